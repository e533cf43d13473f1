//! The outbox and the inbox on the PostgreSQL store (the SQL only: [`Outbox`] and [`Inbox`]
//! are written once over [`OutboxBackend`] and [`InboxBackend`]). `outbox_events` lives in the
//! same database (and schema) as the handler's rows and the idempotency records, so an event
//! commits in their transaction; `inbox_events` holds the receiver's processed event ids.
//!
//! Events are enqueued through the request's [`PostgresTransaction`] (the same connection and
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
//! use tower_idempotency::outbox::postgres::PostgresOutbox;
//! use tower_idempotency::outbox::{sink_fn, Enqueue, OutboxEvent, Relay};
//! use tower_idempotency::store::postgres::{PostgresStore, PostgresTransaction};
//!
//! let store = PostgresStore::connect("postgres://app@127.0.0.1/shop").await?;
//! // Creates `outbox_events` (idempotent): once at start-up, before serving.
//! let outbox = PostgresOutbox::install(&store).await?;
//!
//! // In a handler, through the request's transaction handle:
//! async fn create_order(tx: PostgresTransaction) -> Result<(), tower_idempotency::Error> {
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
//! On the receiving side, [`PostgresInbox`] records each processed event id in
//! `inbox_events`, in the same transaction as the event's effect, so a redelivery is
//! acknowledged without being applied twice.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime};

use tokio_postgres::row::Row;

use super::columns::{
    attempts_from_column, claimed_oldest_first, count_from_column, event_status, RawEvent,
};
use super::inbox::receipt;
use super::pg_sql::{
    BACKLOG, CLAIM, COUNT_BY_STATE, DEAD_LETTERS, DEAD_LETTER_ABANDONED, INBOX_CONTAINS,
    INBOX_INSTALL_LOCK, INBOX_SCHEMA, INSERT_EVENT, INSERT_ID, OUTBOX_INSTALL_LOCK,
    PURGE_DELIVERED, PURGE_INBOX, REQUEUE, REQUEUE_ALL_DEAD, SCHEMA, SELECT_DUE, SELECT_EVENT,
    SETTLE_DEAD, SETTLE_DELIVERED, SETTLE_RETRY,
};
use super::{
    Backlog, ClaimRequest, Claimed, Enqueue, EventId, EventInfo, Inbox, InboxBackend, InboxOutcome,
    Outbox, OutboxBackend, OutboxCounts, OutboxEvent, OutboxStore, Processed, Receipt, Settlement,
};
use crate::error::Error;
use crate::store::postgres::migrate::install_schema;
use crate::store::postgres::{Executor, PostgresStore, PostgresTransaction, TransactionClient};
use crate::store::{from_unix_millis, to_unix_millis};

/// The outbox of a [`PostgresStore`] (see [`Outbox`]).
pub type PostgresOutbox = Outbox<PostgresStore>;

/// The processed event ids of one consumer in a PostgreSQL database (see [`Inbox`]): table
/// `inbox_events`, in the same schema as the store's tables. [`Inbox::process`] hands its
/// closure the same [`PostgresTransaction`] a request's handler gets (take its
/// [`client`](PostgresTransaction::client), do not `COMMIT`), on a transaction of the inbox's
/// own, and the closure returns a future.
pub type PostgresInbox = Inbox<PostgresStore>;

/// Adds an event to the outbox through `client`: a
/// [`TransactionClient`] of the request's
/// transaction (the event then belongs to that transaction), or a client or transaction of
/// your own. Returns its id.
///
/// Use it to write an order and its event with one borrow of the transaction's connection;
/// [`Enqueue::enqueue`] on the handle does the same in a call of its own.
///
/// ```no_run
/// # async fn handler(tx: tower_idempotency::store::postgres::PostgresTransaction)
/// #     -> Result<(), tower_idempotency::Error> {
/// use serde_json::json;
/// use tower_idempotency::outbox::postgres::enqueue;
///
/// let client = tx.client().await?;
/// let row = client
///     .query_one("INSERT INTO orders (sku) VALUES ('book') RETURNING id", &[])
///     .await?;
/// let order_id: i64 = row.try_get(0)?;
/// enqueue(&client, "order_created", &json!({ "order_id": order_id })).await?;
/// # Ok(()) }
/// ```
pub async fn enqueue<C>(
    client: &C,
    topic: &str,
    payload: &serde_json::Value,
) -> Result<EventId, Error>
where
    C: Executor + ?Sized,
{
    let id = EventId::generate();
    let now = to_unix_millis(SystemTime::now());
    let payload = payload.to_string();
    client
        .execute_statement(INSERT_EVENT, &[&id.as_str(), &topic, &payload, &now])
        .await?;
    Ok(id)
}

impl Enqueue for PostgresTransaction {
    /// ```no_run
    /// # async fn handler(tx: tower_idempotency::store::postgres::PostgresTransaction)
    /// #     -> Result<(), tower_idempotency::Error> {
    /// use serde_json::json;
    /// use tower_idempotency::outbox::Enqueue;
    ///
    /// let event_id = tx.enqueue("order_created", json!({ "order_id": 7 })).await?;
    /// # let _ = event_id; Ok(()) }
    /// ```
    async fn enqueue(&self, topic: &str, payload: serde_json::Value) -> Result<EventId, Error> {
        let client = self.client().await?;
        let id = EventId::generate();
        let now = to_unix_millis(SystemTime::now());
        let payload = payload.to_string();
        let statement = client.prepare_cached(INSERT_EVENT).await?;
        client
            .execute(&statement, &[&id.as_str(), &topic, &payload, &now])
            .await?;
        Ok(id)
    }
}

impl OutboxStore for PostgresStore {
    async fn claim(&self, request: ClaimRequest) -> Result<Claimed, Error> {
        let now = to_unix_millis(request.now);
        let lease_until = to_unix_millis(request.now + request.lease.max(Duration::from_millis(1)));
        let batch = i64::try_from(request.batch).unwrap_or(i64::MAX);
        let token = request.token.as_str().to_owned();
        let max_attempts = i32::try_from(request.max_attempts).unwrap_or(i32::MAX);
        let mut client = self.client().await?;
        // An idle relay polls often: a plain read first, so that polling opens no write
        // transaction and locks nothing.
        let due: bool = client.query_one(SELECT_DUE, &[&now]).await?.try_get(0)?;
        if !due {
            return Ok(Claimed::default());
        }
        let tx = client.transaction().await?;
        // First, the events whose last allowed attempt was abandoned: retrying them would
        // exceed the attempts (and an event that crashes its relay would be retried forever).
        let abandoned = tx
            .query(DEAD_LETTER_ABANDONED, &[&now, &max_attempts])
            .await?
            .iter()
            .map(claimed_row)
            .collect::<Result<Vec<_>, Error>>()?;
        let claimed = tx
            .query(CLAIM, &[&token, &lease_until, &now, &batch])
            .await?
            .iter()
            .map(claimed_row)
            .collect::<Result<Vec<_>, Error>>()?;
        tx.commit().await?;
        Ok(claimed_oldest_first(claimed, abandoned))
    }

    async fn settle(&self, settlements: Vec<Settlement>) -> Result<(), Error> {
        if settlements.is_empty() {
            return Ok(());
        }
        let now = to_unix_millis(SystemTime::now());
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        for settlement in &settlements {
            match settlement {
                // Recorded whoever holds the claim now: the sink accepted the event, and that
                // stays true.
                Settlement::Delivered { id } => {
                    tx.execute(SETTLE_DELIVERED, &[&id.as_str(), &now]).await?
                }
                // Only under our own claim: if it ran out and another relay claimed the event,
                // that relay decides what happens next.
                Settlement::Retry {
                    id,
                    token,
                    at,
                    error,
                } => {
                    tx.execute(
                        SETTLE_RETRY,
                        &[&id.as_str(), &token.as_str(), &to_unix_millis(*at), error],
                    )
                    .await?
                }
                Settlement::Dead { id, token, error } => {
                    tx.execute(SETTLE_DEAD, &[&id.as_str(), &token.as_str(), error])
                        .await?
                }
            };
        }
        tx.commit().await?;
        Ok(())
    }

    async fn backlog(&self) -> Result<Backlog, Error> {
        let client = self.client().await?;
        let row = client.query_one(BACKLOG, &[]).await?;
        Ok(Backlog {
            pending: count_from_column(row.try_get(0)?),
            dead: count_from_column(row.try_get(1)?),
        })
    }
}

/// A row returned by a claim: `(seq, event)`.
fn claimed_row(row: &Row) -> Result<(i64, OutboxEvent), Error> {
    Ok((
        row.try_get(0)?,
        OutboxEvent::new(
            EventId::from(row.try_get::<_, String>(1)?),
            row.try_get::<_, String>(2)?,
            row.try_get::<_, String>(3)?,
            attempts_from_column(row.try_get::<_, i32>(4)?.into()),
            from_unix_millis(row.try_get(5)?),
        ),
    ))
}

/// An `outbox_events` row, in `EVENT_COLUMNS` order.
fn raw_event(row: &Row) -> Result<RawEvent, Error> {
    Ok(RawEvent {
        id: row.try_get(0)?,
        topic: row.try_get(1)?,
        payload: row.try_get(2)?,
        status: row.try_get(3)?,
        attempts: row.try_get::<_, i32>(4)?.into(),
        created_at: row.try_get(5)?,
        available_at: row.try_get(6)?,
        delivered_at: row.try_get(7)?,
        last_error: row.try_get(8)?,
        leased: row.try_get::<_, Option<String>>(9)?.is_some(),
    })
}

/// Statements run in autocommit on pooled connections of the store.
impl OutboxBackend for PostgresStore {
    async fn install_outbox(&self) -> Result<(), Error> {
        install_schema(self, OUTBOX_INSTALL_LOCK, SCHEMA, &[]).await
    }

    async fn event(&self, id: &str) -> Result<Option<EventInfo>, Error> {
        let now = to_unix_millis(SystemTime::now());
        let client = self.client().await?;
        let row = client.query_opt(SELECT_EVENT, &[&id]).await?;
        row.map(|row| raw_event(&row)?.into_info(now)).transpose()
    }

    async fn outbox_counts(&self) -> Result<OutboxCounts, Error> {
        let now = to_unix_millis(SystemTime::now());
        let client = self.client().await?;
        let rows = client.query(COUNT_BY_STATE, &[&now]).await?;
        let mut counts = OutboxCounts::default();
        for row in rows {
            let status: String = row.try_get(0)?;
            let status = event_status(&status, row.try_get(1)?)?;
            counts.add(status, count_from_column(row.try_get(2)?));
        }
        Ok(counts)
    }

    async fn dead_letters(&self, limit: usize) -> Result<Vec<EventInfo>, Error> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let now = to_unix_millis(SystemTime::now());
        let client = self.client().await?;
        let rows = client.query(DEAD_LETTERS, &[&limit]).await?;
        rows.iter()
            .map(|row| raw_event(row)?.into_info(now))
            .collect()
    }

    async fn requeue(&self, id: &str) -> Result<bool, Error> {
        let now = to_unix_millis(SystemTime::now());
        let client = self.client().await?;
        let changed = client.execute(REQUEUE, &[&id, &now]).await?;
        Ok(changed > 0)
    }

    async fn requeue_all_dead(&self) -> Result<u64, Error> {
        let now = to_unix_millis(SystemTime::now());
        let client = self.client().await?;
        Ok(client.execute(REQUEUE_ALL_DEAD, &[&now]).await?)
    }

    /// Several instances may purge at once (SKIP LOCKED).
    async fn purge_delivered(&self, before: SystemTime, batch: usize) -> Result<u64, Error> {
        let before = to_unix_millis(before);
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        let client = self.client().await?;
        Ok(client.execute(PURGE_DELIVERED, &[&before, &batch]).await?)
    }
}

impl PostgresInbox {
    /// Records `event_id` through `client`, which must be inside the transaction that applies
    /// the event (a [`tokio_postgres::Transaction`] of your own, `&*transaction` for one opened
    /// on a pooled connection, or a [`TransactionClient`]): [`Receipt::First`] if
    /// it was new (apply the event in the same transaction), [`Receipt::Duplicate`] if it was
    /// there already (do nothing).
    ///
    /// While another open transaction holds the same id, this waits for it to end.
    pub async fn record<C>(&self, client: &C, event_id: &str) -> Result<Receipt, Error>
    where
        C: Executor + ?Sized,
    {
        let now = to_unix_millis(SystemTime::now());
        let inserted = client
            .execute_statement(INSERT_ID, &[&self.consumer(), &event_id, &now])
            .await?;
        Ok(receipt(inserted))
    }
}

/// A PostgreSQL [`Inbox::process`] closure returns a future of `Result<T, Error>`, as an
/// `async move` block or an `async fn(PostgresTransaction) -> Result<T, Error>` does.
impl<T, Fut> InboxOutcome<PostgresStore> for Fut
where
    T: Send + 'static,
    Fut: Future<Output = Result<T, Error>> + Send + 'static,
{
    type Value = T;

    fn into_resolved(self) -> Pin<Box<dyn Future<Output = Result<T, Error>> + Send>> {
        Box::pin(self)
    }
}

impl InboxBackend for PostgresStore {
    type Transaction = PostgresTransaction;
    type Work<'a> = PostgresTransaction;
    type Resolved<T: Send + 'static> = Pin<Box<dyn Future<Output = Result<T, Error>> + Send>>;

    async fn install_inbox(&self) -> Result<(), Error> {
        install_schema(self, INBOX_INSTALL_LOCK, INBOX_SCHEMA, &[]).await
    }

    async fn record_in(
        &self,
        tx: &PostgresTransaction,
        consumer: &str,
        event_id: &str,
    ) -> Result<Receipt, Error> {
        let client = tx.client().await?;
        record_cached(&client, consumer, event_id).await
    }

    /// On a transaction of the store's own, with its isolation level. A panic in `work` or
    /// this future being dropped rolls back. Under `REPEATABLE READ` or `SERIALIZABLE`, a
    /// wait on the id's primary key that ends in a serialization failure is retried
    /// ([`PostgresOptions::serialization_retries`] times) before `work` is called.
    ///
    /// [`PostgresOptions::serialization_retries`]: crate::store::postgres::PostgresOptions::serialization_retries
    async fn process_once<F, R>(
        &self,
        consumer: &str,
        event_id: &str,
        work: F,
    ) -> Result<Processed<R::Value>, Error>
    where
        F: for<'a> FnOnce(PostgresTransaction) -> R + Send + 'static,
        R: InboxOutcome<Self>,
    {
        let mut retries = 0;
        let transaction = loop {
            let transaction = self.begin_owned().await?;
            let recorded = async {
                let client = transaction.handle().client().await?;
                record_cached(&client, consumer, event_id).await
            }
            .await;
            match recorded {
                Ok(Receipt::First) => break transaction,
                Ok(Receipt::Duplicate) => {
                    transaction.rollback().await;
                    return Ok(Processed::Duplicate);
                }
                Err(error)
                    if error.is_serialization_conflict()
                        && retries < self.serialization_retries() =>
                {
                    transaction.rollback().await;
                    retries += 1;
                    tracing::debug!(%error, retries, "recording an inbox id conflicted; retrying");
                    // A short pause, growing with each retry, lets the other transaction end.
                    tokio::time::sleep(Duration::from_millis(2u64 << retries.min(6))).await;
                }
                Err(error) => {
                    transaction.rollback().await;
                    return Err(error);
                }
            }
        };
        match work(transaction.handle()).into_resolved().await {
            Ok(value) => {
                transaction.commit().await?;
                Ok(Processed::First(value))
            }
            Err(error) => {
                transaction.rollback().await;
                Err(error)
            }
        }
    }

    async fn inbox_contains(&self, consumer: &str, event_id: &str) -> Result<bool, Error> {
        let client = self.client().await?;
        Ok(client
            .query_one(INBOX_CONTAINS, &[&consumer, &event_id])
            .await?
            .try_get(0)?)
    }

    /// Several instances may purge at once (SKIP LOCKED).
    async fn purge_inbox(
        &self,
        consumer: &str,
        before: SystemTime,
        batch: usize,
    ) -> Result<u64, Error> {
        let before = to_unix_millis(before);
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        let client = self.client().await?;
        Ok(client
            .execute(PURGE_INBOX, &[&consumer, &before, &batch])
            .await?)
    }
}

/// [`PostgresInbox::record`] on a transaction's connection, with its statement cached.
async fn record_cached(
    client: &TransactionClient,
    consumer: &str,
    event_id: &str,
) -> Result<Receipt, Error> {
    let insert = client.prepare_cached(INSERT_ID).await?;
    let now = to_unix_millis(SystemTime::now());
    let inserted = client
        .execute(&insert, &[&consumer, &event_id, &now])
        .await?;
    Ok(receipt(inserted))
}
