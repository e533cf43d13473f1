//! The outbox and the inbox on the sqlx PostgreSQL store: the names ([`SqlxPostgresOutbox`],
//! [`SqlxPostgresInbox`]) and the calls that take a sqlx executor of the caller's
//! ([`enqueue`], [`SqlxPostgresInbox::record`]). Everything else is the tokio-postgres store's
//! code: [`Outbox`] and [`Inbox`] over [`OutboxBackend`] and [`InboxBackend`], which both
//! PostgreSQL stores implement with the same statements and logic (`pg.rs`, with the SQL in
//! `pg_sql.rs`), each driver only running a statement and reading a row. The tables, the claims with
//! `FOR UPDATE SKIP LOCKED` and a lease, and the inbox's blocking on a held id are those of
//! [`postgres`](super::postgres) (feature `postgres`); a database may be served by both stores
//! at once.
//!
//! ```no_run
//! # async fn run(pool: sqlx::PgPool) -> Result<(), tower_idempotency::Error> {
//! use serde_json::json;
//! use tower_idempotency::outbox::sqlx_postgres::SqlxPostgresOutbox;
//! use tower_idempotency::outbox::{sink_fn, Enqueue, OutboxEvent, Relay};
//! use tower_idempotency::store::sqlx_postgres::{SqlxPostgresStore, SqlxTransaction};
//!
//! let store = SqlxPostgresStore::new(pool);
//! store.migrate().await?;
//! // Creates `outbox_events` (idempotent): once at start-up, before serving.
//! let outbox = SqlxPostgresOutbox::install(&store).await?;
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

use sqlx::postgres::Postgres;
// The `Executor` methods rather than the query builders' `execute(conn)`: their boxed futures
// keep these futures provably `Send` (see the store's `reservation.rs`).
use sqlx::Executor;

use super::inbox::receipt;
use super::pg::{record_params, NewEvent};
use super::pg_sql::{INSERT_EVENT, INSERT_ID};
#[cfg(doc)]
use super::{Enqueue, InboxBackend, OutboxBackend};
use super::{EventId, Inbox, Outbox, Receipt};
use crate::error::Error;
use crate::pg_driver::sqlx_query;
use crate::store::sqlx_postgres::SqlxPostgresStore;
#[cfg(doc)]
use crate::store::sqlx_postgres::SqlxTransaction;

/// The outbox of a [`SqlxPostgresStore`] (see [`Outbox`]).
pub type SqlxPostgresOutbox = Outbox<SqlxPostgresStore>;

/// The processed event ids of one consumer in a PostgreSQL database, on sqlx (see [`Inbox`]):
/// table `inbox_events`, in the same schema as the store's tables. [`Inbox::process`] hands
/// its closure the same [`SqlxTransaction`] a request's handler gets (take its
/// [`acquire`](SqlxTransaction::acquire)d connection, do not `COMMIT`), on a transaction of the
/// inbox's own, and the closure returns a future.
pub type SqlxPostgresInbox = Inbox<SqlxPostgresStore>;

/// Adds an event to the outbox through `executor`: the connection a [`SqlxTransaction`] lends
/// (`&mut *conn`: the event then belongs to the request's transaction), or a transaction or
/// pool of your own. Returns its id.
///
/// Use it to write an order and its event with one borrow of the transaction's connection;
/// [`Enqueue::enqueue`] on the handle does the same in a call of its own.
///
/// ```no_run
/// # async fn handler(tx: tower_idempotency::store::sqlx_postgres::SqlxTransaction)
/// #     -> Result<(), tower_idempotency::Error> {
/// use serde_json::json;
/// use tower_idempotency::outbox::sqlx_postgres::enqueue;
///
/// let mut conn = tx.acquire().await?;
/// let order_id: i64 = sqlx::query_scalar("INSERT INTO orders (sku) VALUES ('book') RETURNING id")
///     .fetch_one(&mut *conn)
///     .await?;
/// enqueue(&mut *conn, "order_created", &json!({ "order_id": order_id })).await?;
/// # Ok(()) }
/// ```
pub async fn enqueue<'c, E>(
    executor: E,
    topic: &str,
    payload: &serde_json::Value,
) -> Result<EventId, Error>
where
    E: Executor<'c, Database = Postgres>,
{
    let event = NewEvent::new(payload);
    let params = event.params(topic);
    executor.execute(sqlx_query(INSERT_EVENT, &params)).await?;
    Ok(event.id)
}

impl SqlxPostgresInbox {
    /// Records `event_id` through `executor`, which must be inside the transaction that applies
    /// the event (a `sqlx::Transaction` of your own, or the connection a [`SqlxTransaction`]
    /// lends): [`Receipt::First`] if it was new (apply the event in the same transaction),
    /// [`Receipt::Duplicate`] if it was there already (do nothing).
    ///
    /// While another open transaction holds the same id, this waits for it to end.
    pub async fn record<'c, E>(&self, executor: E, event_id: &str) -> Result<Receipt, Error>
    where
        E: Executor<'c, Database = Postgres>,
    {
        let params = record_params(self.consumer(), event_id);
        let inserted = executor.execute(sqlx_query(INSERT_ID, &params)).await?;
        Ok(receipt(inserted.rows_affected()))
    }
}
