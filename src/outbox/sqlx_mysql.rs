//! The outbox and the inbox on the MySQL and MariaDB store: the names ([`SqlxMySqlOutbox`],
//! [`SqlxMySqlInbox`]) and the calls that take a sqlx executor of the caller's ([`enqueue`],
//! [`SqlxMySqlInbox::record`]). Everything else is written once for every SQL store:
//! [`Outbox`] and [`Inbox`] over [`OutboxBackend`] and [`InboxBackend`], with MySQL's
//! statements (`mysql_sql.rs`). MySQL 8.0 or MariaDB 10.6 or later (`FOR UPDATE SKIP
//! LOCKED`): relays in several instances share the work, each claim taking due events with a
//! lease, and the inbox's insert waits on an id that another open transaction holds.
//!
//! The tables are created by `install` (under `GET_LOCK`), or by your own migrations from the
//! crate's files in `migrations/mysql/`.
//!
//! ```no_run
//! # async fn run(pool: sqlx::MySqlPool) -> Result<(), tower_idempotency::Error> {
//! use serde_json::json;
//! use tower_idempotency::outbox::sqlx_mysql::SqlxMySqlOutbox;
//! use tower_idempotency::outbox::{sink_fn, Enqueue, OutboxEvent, Relay};
//! use tower_idempotency::store::sqlx_mysql::{SqlxMySqlStore, SqlxTransaction};
//!
//! let store = SqlxMySqlStore::new(pool);
//! store.migrate().await?;
//! // Creates `outbox_events` (idempotent): once at start-up, before serving.
//! let outbox = SqlxMySqlOutbox::install(&store).await?;
//!
//! // In a handler, through the request's transaction handle:
//! async fn create_order(tx: SqlxTransaction) -> Result<(), tower_idempotency::Error> {
//!     let event_id = tx.enqueue("order_created", json!({ "order_id": 1 })).await?;
//!     # let _ = event_id;
//!     Ok(())
//! }
//!
//! // At start-up, in every instance if you like: deliver events, forever.
//! let relay = Relay::new(
//!     outbox,
//!     sink_fn(|event: OutboxEvent| async move {
//!         println!("{} {} {}", event.id(), event.topic(), event.payload());
//!         Ok::<(), std::io::Error>(())
//!     }),
//! );
//! tokio::spawn(relay.run());
//! # Ok(()) }
//! ```

use sqlx::mysql::MySql;
// The `Executor` methods rather than the query builders' `execute(conn)`: their boxed futures
// keep these futures provably `Send`.
use sqlx::Executor;

use super::inbox::receipt;
use super::mysql_sql::{check_inbox_ids, INSERT_EVENT, INSERT_ID};
use super::pg::{record_params, NewEvent};
#[cfg(doc)]
use super::{Enqueue, InboxBackend, OutboxBackend};
use super::{EventId, Inbox, Outbox, Receipt};
use crate::error::Error;
use crate::pg_driver::{positional, sqlx_bind};
use crate::store::sqlx_mysql::SqlxMySqlStore;
#[cfg(doc)]
use crate::store::sqlx_mysql::SqlxTransaction;

/// The outbox of a [`SqlxMySqlStore`] (see [`Outbox`]).
pub type SqlxMySqlOutbox = Outbox<SqlxMySqlStore>;

/// The processed event ids of one consumer in a MySQL or MariaDB database (see [`Inbox`]):
/// table `inbox_events`, next to the store's. [`Inbox::process`] hands its closure the same
/// [`SqlxTransaction`] a request's handler gets (take its [`acquire`](SqlxTransaction::acquire)d
/// connection, do not `COMMIT`), on a transaction of the inbox's own, and the closure returns a
/// future. Consumer names and event ids are at most 255 bytes.
pub type SqlxMySqlInbox = Inbox<SqlxMySqlStore>;

/// Adds an event to the outbox through `executor`: the connection a [`SqlxTransaction`] lends
/// (`&mut *conn`: the event then belongs to the request's transaction), or a transaction or
/// pool of your own. Returns its id.
///
/// ```no_run
/// # async fn handler(tx: tower_idempotency::store::sqlx_mysql::SqlxTransaction)
/// #     -> Result<(), tower_idempotency::Error> {
/// use serde_json::json;
/// use tower_idempotency::outbox::sqlx_mysql::enqueue;
///
/// let mut conn = tx.acquire().await?;
/// let done = sqlx::query("INSERT INTO orders (sku) VALUES ('book')")
///     .execute(&mut *conn)
///     .await?;
/// enqueue(&mut *conn, "order_created", &json!({ "order_id": done.last_insert_id() })).await?;
/// # Ok(()) }
/// ```
pub async fn enqueue<'c, E>(
    executor: E,
    topic: &str,
    payload: &serde_json::Value,
) -> Result<EventId, Error>
where
    E: Executor<'c, Database = MySql>,
{
    let event = NewEvent::new(payload);
    let (sql, params) = positional(INSERT_EVENT, &event.params(topic))?;
    executor
        .execute(sqlx_bind(sqlx::query(&sql), &params))
        .await?;
    Ok(event.id)
}

impl SqlxMySqlInbox {
    /// Records `event_id` through `executor`, which must be inside the transaction that applies
    /// the event (a `sqlx::Transaction` of your own, or the connection a [`SqlxTransaction`]
    /// lends): [`Receipt::First`] if it was new (apply the event in the same transaction),
    /// [`Receipt::Duplicate`] if it was there already (do nothing).
    ///
    /// While another open transaction holds the same id, this waits for it to end (within
    /// `innodb_lock_wait_timeout`).
    pub async fn record<'c, E>(&self, executor: E, event_id: &str) -> Result<Receipt, Error>
    where
        E: Executor<'c, Database = MySql>,
    {
        check_inbox_ids(self.consumer(), event_id)?;
        let (sql, params) = positional(INSERT_ID, &record_params(self.consumer(), event_id))?;
        let inserted = executor
            .execute(sqlx_bind(sqlx::query(&sql), &params))
            .await?;
        Ok(receipt(inserted.rows_affected()))
    }
}
