//! The outbox and the inbox on the MySQL and MariaDB store: the names ([`SqlxMySqlOutbox`],
//! [`SqlxMySqlInbox`]) and the calls that take a sqlx executor of the caller's ([`enqueue`],
//! [`SqlxMySqlInbox::record`]). Everything else is written once for every SQL store:
//! [`Outbox`] and [`Inbox`] over [`OutboxBackend`] and [`InboxBackend`], with MySQL's
//! statements (`mysql/outbox_sql.rs`). MySQL 8.0 or MariaDB 10.6 or later (`FOR UPDATE SKIP
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

#[cfg(doc)]
use crate::outbox::{Enqueue, InboxBackend, OutboxBackend};
use crate::outbox::{Inbox, Outbox};
use crate::store::sqlx_mysql::SqlxMySqlStore;
#[cfg(doc)]
use crate::store::sqlx_mysql::SqlxTransaction;

pub use crate::sqlx::outbox::enqueue;

/// The outbox of a [`SqlxMySqlStore`] (see [`Outbox`]).
pub type SqlxMySqlOutbox = Outbox<SqlxMySqlStore>;

/// The processed event ids of one consumer in a MySQL or MariaDB database (see [`Inbox`]):
/// table `inbox_events`, next to the store's. [`Inbox::process`] hands its closure the same
/// [`SqlxTransaction`] a request's handler gets (take its `acquire`d
/// connection, do not `COMMIT`), on a transaction of the inbox's own, and the closure returns a
/// future; [`Inbox::record`] records an id through an executor of yours (waiting within
/// `innodb_lock_wait_timeout` on an id another open transaction holds). Consumer names and
/// event ids are at most 255 bytes.
pub type SqlxMySqlInbox = Inbox<SqlxMySqlStore>;
