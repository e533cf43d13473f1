//! The outbox and the inbox on the sqlx PostgreSQL store (the driver's half only: the SQL is
//! the tokio-postgres store's, shared through `pg_sql.rs`, and [`Outbox`] and [`Inbox`] are
//! written once over [`OutboxBackend`] and [`InboxBackend`]). The tables, the claims with
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

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime};

use sqlx::postgres::{PgRow, Postgres};
// The `Executor` methods rather than the query builders' `execute(conn)`: their boxed futures
// keep these futures provably `Send` (see the store's `reservation.rs`).
use sqlx::{Executor, Row as _};

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
use crate::store::sqlx_postgres::{SqlxPostgresStore, SqlxTransaction};
use crate::store::{from_unix_millis, to_unix_millis};

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
    let id = EventId::generate();
    let now = to_unix_millis(SystemTime::now());
    let insert = sqlx::query(INSERT_EVENT)
        .bind(id.as_str())
        .bind(topic)
        .bind(payload.to_string())
        .bind(now);
    executor.execute(insert).await?;
    Ok(id)
}

impl Enqueue for SqlxTransaction {
    /// ```no_run
    /// # async fn handler(tx: tower_idempotency::store::sqlx_postgres::SqlxTransaction)
    /// #     -> Result<(), tower_idempotency::Error> {
    /// use serde_json::json;
    /// use tower_idempotency::outbox::Enqueue;
    ///
    /// let event_id = tx.enqueue("order_created", json!({ "order_id": 7 })).await?;
    /// # let _ = event_id; Ok(()) }
    /// ```
    async fn enqueue(&self, topic: &str, payload: serde_json::Value) -> Result<EventId, Error> {
        let mut conn = self.acquire().await?;
        enqueue(&mut *conn, topic, &payload).await
    }
}

impl OutboxStore for SqlxPostgresStore {
    async fn claim(&self, request: ClaimRequest) -> Result<Claimed, Error> {
        let now = to_unix_millis(request.now);
        let lease_until = to_unix_millis(request.now + request.lease.max(Duration::from_millis(1)));
        let batch = i64::try_from(request.batch).unwrap_or(i64::MAX);
        let max_attempts = i32::try_from(request.max_attempts).unwrap_or(i32::MAX);
        // An idle relay polls often: a plain read first, so that polling opens no write
        // transaction and locks nothing.
        let due: bool = self
            .pool()
            .fetch_one(sqlx::query(SELECT_DUE).bind(now))
            .await?
            .try_get(0)?;
        if !due {
            return Ok(Claimed::default());
        }
        let mut tx = self.pool().begin().await?;
        // First, the events whose last allowed attempt was abandoned: retrying them would
        // exceed the attempts (and an event that crashes its relay would be retried forever).
        let abandoned = (&mut *tx)
            .fetch_all(
                sqlx::query(DEAD_LETTER_ABANDONED)
                    .bind(now)
                    .bind(max_attempts),
            )
            .await?
            .iter()
            .map(claimed_row)
            .collect::<Result<Vec<_>, Error>>()?;
        let claim = sqlx::query(CLAIM)
            .bind(request.token.as_str())
            .bind(lease_until)
            .bind(now)
            .bind(batch);
        let claimed = (&mut *tx)
            .fetch_all(claim)
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
        let mut tx = self.pool().begin().await?;
        for settlement in &settlements {
            let statement = match settlement {
                Settlement::Delivered { id } => {
                    sqlx::query(SETTLE_DELIVERED).bind(id.as_str()).bind(now)
                }
                Settlement::Retry {
                    id,
                    token,
                    at,
                    error,
                } => sqlx::query(SETTLE_RETRY)
                    .bind(id.as_str())
                    .bind(token.as_str())
                    .bind(to_unix_millis(*at))
                    .bind(error.as_str()),
                Settlement::Dead { id, token, error } => sqlx::query(SETTLE_DEAD)
                    .bind(id.as_str())
                    .bind(token.as_str())
                    .bind(error.as_str()),
            };
            (&mut *tx).execute(statement).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn backlog(&self) -> Result<Backlog, Error> {
        let row = self.pool().fetch_one(sqlx::query(BACKLOG)).await?;
        Ok(Backlog {
            pending: count_from_column(row.try_get(0)?),
            dead: count_from_column(row.try_get(1)?),
        })
    }
}

/// A row returned by a claim: `(seq, event)`.
fn claimed_row(row: &PgRow) -> Result<(i64, OutboxEvent), Error> {
    Ok((
        row.try_get(0)?,
        OutboxEvent::new(
            EventId::from(row.try_get::<String, _>(1)?),
            row.try_get::<String, _>(2)?,
            row.try_get::<String, _>(3)?,
            attempts_from_column(row.try_get::<i32, _>(4)?.into()),
            from_unix_millis(row.try_get(5)?),
        ),
    ))
}

/// An `outbox_events` row, in `EVENT_COLUMNS` order.
fn raw_event(row: &PgRow) -> Result<RawEvent, Error> {
    Ok(RawEvent {
        id: row.try_get(0)?,
        topic: row.try_get(1)?,
        payload: row.try_get(2)?,
        status: row.try_get(3)?,
        attempts: row.try_get::<i32, _>(4)?.into(),
        created_at: row.try_get(5)?,
        available_at: row.try_get(6)?,
        delivered_at: row.try_get(7)?,
        last_error: row.try_get(8)?,
        leased: row.try_get::<Option<String>, _>(9)?.is_some(),
    })
}

/// Statements run in autocommit on the store's pool.
impl OutboxBackend for SqlxPostgresStore {
    async fn install_outbox(&self) -> Result<(), Error> {
        self.install_schema(OUTBOX_INSTALL_LOCK, SCHEMA, &[]).await
    }

    async fn event(&self, id: &str) -> Result<Option<EventInfo>, Error> {
        let now = to_unix_millis(SystemTime::now());
        let row = self
            .pool()
            .fetch_optional(sqlx::query(SELECT_EVENT).bind(id))
            .await?;
        row.map(|row| raw_event(&row)?.into_info(now)).transpose()
    }

    async fn outbox_counts(&self) -> Result<OutboxCounts, Error> {
        let now = to_unix_millis(SystemTime::now());
        let rows = self
            .pool()
            .fetch_all(sqlx::query(COUNT_BY_STATE).bind(now))
            .await?;
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
        let rows = self
            .pool()
            .fetch_all(sqlx::query(DEAD_LETTERS).bind(limit))
            .await?;
        rows.iter()
            .map(|row| raw_event(row)?.into_info(now))
            .collect()
    }

    async fn requeue(&self, id: &str) -> Result<bool, Error> {
        let now = to_unix_millis(SystemTime::now());
        let done = self
            .pool()
            .execute(sqlx::query(REQUEUE).bind(id).bind(now))
            .await?;
        Ok(done.rows_affected() > 0)
    }

    async fn requeue_all_dead(&self) -> Result<u64, Error> {
        let now = to_unix_millis(SystemTime::now());
        let done = self
            .pool()
            .execute(sqlx::query(REQUEUE_ALL_DEAD).bind(now))
            .await?;
        Ok(done.rows_affected())
    }

    /// Several instances may purge at once (SKIP LOCKED).
    async fn purge_delivered(&self, before: SystemTime, batch: usize) -> Result<u64, Error> {
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        let purge = sqlx::query(PURGE_DELIVERED)
            .bind(to_unix_millis(before))
            .bind(batch);
        Ok(self.pool().execute(purge).await?.rows_affected())
    }
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
        record(executor, self.consumer(), event_id).await
    }
}

/// Records `event_id` for `consumer` through `executor` (see [`INSERT_ID`]).
async fn record<'c, E>(executor: E, consumer: &str, event_id: &str) -> Result<Receipt, Error>
where
    E: Executor<'c, Database = Postgres>,
{
    let insert = sqlx::query(INSERT_ID)
        .bind(consumer)
        .bind(event_id)
        .bind(to_unix_millis(SystemTime::now()));
    Ok(receipt(executor.execute(insert).await?.rows_affected()))
}

/// A sqlx [`Inbox::process`] closure returns a future of `Result<T, Error>`, as an `async
/// move` block or an `async fn(SqlxTransaction) -> Result<T, Error>` does.
impl<T, Fut> InboxOutcome<SqlxPostgresStore> for Fut
where
    T: Send + 'static,
    Fut: Future<Output = Result<T, Error>> + Send + 'static,
{
    type Value = T;

    fn into_resolved(self) -> Pin<Box<dyn Future<Output = Result<T, Error>> + Send>> {
        Box::pin(self)
    }
}

impl InboxBackend for SqlxPostgresStore {
    type Transaction = SqlxTransaction;
    type Work<'a> = SqlxTransaction;
    type Resolved<T: Send + 'static> = Pin<Box<dyn Future<Output = Result<T, Error>> + Send>>;

    async fn install_inbox(&self) -> Result<(), Error> {
        self.install_schema(INBOX_INSTALL_LOCK, INBOX_SCHEMA, &[])
            .await
    }

    async fn record_in(
        &self,
        tx: &SqlxTransaction,
        consumer: &str,
        event_id: &str,
    ) -> Result<Receipt, Error> {
        let mut conn = tx.acquire().await?;
        record(&mut *conn, consumer, event_id).await
    }

    /// On a transaction of the store's own, with its isolation level. A panic in `work` or
    /// this future being dropped rolls back. Under `REPEATABLE READ` or `SERIALIZABLE`, a
    /// wait on the id's primary key that ends in a serialization failure is retried
    /// ([`SqlxPostgresOptions::serialization_retries`] times) before `work` is called.
    ///
    /// [`SqlxPostgresOptions::serialization_retries`]: crate::store::sqlx_postgres::SqlxPostgresOptions::serialization_retries
    async fn process_once<F, R>(
        &self,
        consumer: &str,
        event_id: &str,
        work: F,
    ) -> Result<Processed<R::Value>, Error>
    where
        F: for<'a> FnOnce(SqlxTransaction) -> R + Send + 'static,
        R: InboxOutcome<Self>,
    {
        let mut retries = 0;
        let transaction = loop {
            let transaction = self.begin_owned().await?;
            let recorded = async {
                let mut conn = transaction.handle().acquire().await?;
                record(&mut *conn, consumer, event_id).await
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
        let contains = sqlx::query(INBOX_CONTAINS).bind(consumer).bind(event_id);
        Ok(self.pool().fetch_one(contains).await?.try_get(0)?)
    }

    /// Several instances may purge at once (SKIP LOCKED).
    async fn purge_inbox(
        &self,
        consumer: &str,
        before: SystemTime,
        batch: usize,
    ) -> Result<u64, Error> {
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        let purge = sqlx::query(PURGE_INBOX)
            .bind(consumer)
            .bind(to_unix_millis(before))
            .bind(batch);
        Ok(self.pool().execute(purge).await?.rows_affected())
    }
}
