//! The outbox and the inbox on the tokio-postgres store: the calls that take a tokio-postgres
//! client of the caller's (`Outbox::enqueue_in`, `Inbox::record`). [`Outbox`] and [`Inbox`] are written once over
//! [`OutboxBackend`] and [`InboxBackend`], which both PostgreSQL stores implement with the same
//! statements and logic (`row_lock/outbox.rs`, with the SQL in `postgres/outbox_sql.rs`). `outbox_events` lives in the
//! same database (and schema) as the handler's rows and the idempotency records, so an event
//! commits in their transaction; `inbox_events` holds the receiver's processed event ids.
//!
//! Events are enqueued through the request's [`PostgresHandle`] (the same connection and
//! the same transaction as the order), so an event commits or rolls back with the order and the
//! saved response. Relays, in one process or in several app instances, claim due events with
//! `UPDATE ... WHERE seq IN (SELECT ... FOR UPDATE SKIP LOCKED LIMIT n)` on pooled connections
//! of the store: concurrent relays never wait for each other and never claim the same event,
//! and the claim's lease (`available_at` moved to the end of the lease, `lease_owner` set)
//! keeps an event away from other relays while it is delivered.
//!
//! ```no_run
//! # async fn run() -> Result<(), tower_idempotency::Error> {
//! use serde_json::json;
//! use tower_idempotency::outbox::{sink_fn, Enqueue, Outbox, OutboxEvent, Relay};
//! use tower_idempotency::store::tokio_postgres::{PostgresHandle, PostgresStore};
//!
//! let store = PostgresStore::connect("postgres://app@127.0.0.1/shop").await?;
//! // Creates `outbox_events` (idempotent): once at start-up, before serving.
//! let outbox = Outbox::install(&store).await?;
//!
//! // In a handler, through the request's transaction handle:
//! async fn create_order(tx: PostgresHandle) -> Result<(), tower_idempotency::Error> {
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
//!
//! On the receiving side, `Inbox<PostgresStore>` records each processed event id in
//! `inbox_events`, in the same transaction as the event's effect, so a redelivery is
//! acknowledged without being applied twice.

use crate::error::Error;
use crate::outbox::inbox::receipt;
#[cfg(doc)]
use crate::outbox::{Enqueue, InboxBackend, OutboxBackend};
use crate::outbox::{EventId, Inbox, Outbox, Receipt};
use crate::postgres::outbox_sql::{INSERT_EVENT, INSERT_ID};
use crate::row_lock::outbox::{record_params, NewEvent};
use crate::store::tokio_postgres::statements::typed;
#[cfg(doc)]
use crate::store::tokio_postgres::{CheckedClient, PostgresHandle};
use crate::store::tokio_postgres::{Executor, PostgresStore};

/// The outbox of a [`PostgresStore`].
impl Outbox<PostgresStore> {
    /// Adds an event to the outbox through `client`: a
    /// [`CheckedClient`] of the request's
    /// transaction (the event then belongs to that transaction), or a client or transaction of
    /// your own. Returns its id.
    ///
    /// Use it to write an order and its event with one borrow of the transaction's connection;
    /// [`Enqueue::enqueue`] on the handle does the same in a call of its own.
    ///
    /// ```no_run
    /// # async fn handler(tx: tower_idempotency::store::tokio_postgres::PostgresHandle)
    /// #     -> Result<(), tower_idempotency::Error> {
    /// use serde_json::json;
    /// use tower_idempotency::outbox::Outbox;
    /// use tower_idempotency::store::tokio_postgres::PostgresStore;
    ///
    /// let client = tx.client().await?;
    /// let row = client
    ///     .query_one("INSERT INTO orders (sku) VALUES ('book') RETURNING id", &[])
    ///     .await?;
    /// let order_id: i64 = row.try_get(0)?;
    /// Outbox::<PostgresStore>::enqueue_in(&client, "order_created", &json!({ "order_id": order_id })).await?;
    /// # Ok(()) }
    /// ```
    pub async fn enqueue_in<C>(
        client: &C,
        topic: &str,
        payload: &serde_json::Value,
    ) -> Result<EventId, Error>
    where
        C: Executor + ?Sized,
    {
        let event = NewEvent::new(payload);
        client
            .execute_typed_statement(INSERT_EVENT, &typed(&event.params(topic)))
            .await?;
        Ok(event.id)
    }
}

/// The processed event ids of one consumer in a PostgreSQL database: table
/// `inbox_events`, in the same schema as the store's tables. [`Inbox::process`] hands its
/// closure the same [`PostgresHandle`] a request's handler gets (take its
/// [`client`](PostgresHandle::client), do not `COMMIT`), on a transaction of the inbox's
/// own, and the closure returns a future.
impl Inbox<PostgresStore> {
    /// Records `event_id` through `client`, which must be inside the transaction that applies
    /// the event (a [`tokio_postgres::Transaction`] of your own, `&*transaction` for one opened
    /// on a pooled connection, or a [`CheckedClient`]): [`Receipt::First`] if
    /// it was new (apply the event in the same transaction), [`Receipt::Duplicate`] if it was
    /// there already (do nothing).
    ///
    /// While another open transaction holds the same id, this waits for it to end.
    pub async fn record<C>(&self, client: &C, event_id: &str) -> Result<Receipt, Error>
    where
        C: Executor + ?Sized,
    {
        let params = record_params(self.consumer(), event_id);
        let inserted = client
            .execute_typed_statement(INSERT_ID, &typed(&params))
            .await?;
        Ok(receipt(inserted))
    }
}

use crate::postgres::outbox_sql as pg_outbox_sql;

// The outbox and the inbox (`row_lock/outbox.rs`) on this store.
crate::row_lock::outbox::sql_outbox_and_inbox!(
    crate::store::tokio_postgres::PostgresStore,
    crate::store::tokio_postgres::PostgresHandle,
    pg_outbox_sql,
    crate::row_lock::outbox::claim_returning
);
