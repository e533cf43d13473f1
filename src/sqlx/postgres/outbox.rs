//! The outbox and the inbox on the sqlx PostgreSQL store: the names ([`SqlxPostgresOutbox`],
//! [`SqlxPostgresInbox`]) and the calls that take a sqlx executor of the caller's
//! ([`enqueue`], [`SqlxPostgresInbox::record`]). Everything else is the tokio-postgres store's
//! code: [`Outbox`] and [`Inbox`] over [`OutboxBackend`] and [`InboxBackend`], which both
//! PostgreSQL stores implement with the same statements and logic (`row_lock/outbox.rs`, with the SQL in
//! `postgres/outbox_sql.rs`), each driver only running a statement and reading a row. The tables, the claims with
//! `FOR UPDATE SKIP LOCKED` and a lease, and the inbox's blocking on a held id are those of
//! [`postgres`](crate::outbox::postgres) (feature `postgres`); a database may be served by both stores
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

#[cfg(doc)]
use crate::outbox::{Enqueue, InboxBackend, OutboxBackend};
use crate::outbox::{Inbox, Outbox};
use crate::store::sqlx_postgres::SqlxPostgresStore;
#[cfg(doc)]
use crate::store::sqlx_postgres::SqlxTransaction;

pub use crate::sqlx::outbox::enqueue;

/// The outbox of a [`SqlxPostgresStore`] (see [`Outbox`]).
pub type SqlxPostgresOutbox = Outbox<SqlxPostgresStore>;

/// The processed event ids of one consumer in a PostgreSQL database, on sqlx (see [`Inbox`]):
/// table `inbox_events`, in the same schema as the store's tables. [`Inbox::process`] hands
/// its closure the same [`SqlxTransaction`] a request's handler gets (take its
/// `acquire`d connection, do not `COMMIT`), on a transaction of the
/// inbox's own, and the closure returns a future. [`Inbox::record`] records an id through an
/// executor of yours.
pub type SqlxPostgresInbox = Inbox<SqlxPostgresStore>;
