//! The receiver's inbox on PostgreSQL: the processed event ids of a consumer in
//! `inbox_events`, written in the same transaction as the event's effect.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::error::Error;
use crate::metrics::outbox as record;
use crate::outbox::{Processed, Receipt};
use crate::store::postgres::{Executor, PostgresStore, PostgresTransaction, TransactionClient};
use crate::store::to_unix_millis;

/// The same table as the SQLite inbox (`processed_at` in Unix milliseconds).
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS inbox_events (
    consumer     TEXT   NOT NULL,
    event_id     TEXT   NOT NULL,
    processed_at BIGINT NOT NULL,
    PRIMARY KEY (consumer, event_id)
);
CREATE INDEX IF NOT EXISTS inbox_events_processed_at ON inbox_events (processed_at);
";

/// Serializes `install` between instances starting at the same time (see the outbox's).
const INSTALL_LOCK: i64 = 0x7469_6465_6d70_0003;

/// Records an id. While another transaction holds the same `(consumer, event_id)` (it
/// inserted it and has not ended), this blocks on the primary key; when that one commits,
/// the conflict makes this a no-op (0 rows: a duplicate), and when it rolls back, this insert
/// goes through (1 row: the first).
const INSERT_ID: &str = "INSERT INTO inbox_events (consumer, event_id, processed_at) \
     VALUES ($1, $2, $3) ON CONFLICT (consumer, event_id) DO NOTHING";

/// The processed event ids of one consumer, in a PostgreSQL database (table `inbox_events`,
/// in the same schema as the store's tables). Cheap to clone.
///
/// The PostgreSQL twin of [`SqliteInbox`](crate::outbox::inbox::SqliteInbox): the id and the
/// event's effect commit in one transaction, so an id in the inbox always means "applied"
/// and a missing id always means "not applied". Receivers in several instances may share one
/// inbox: a redelivery that arrives while the first delivery is still being applied (on
/// another instance, say) waits for it on the primary key, then is a duplicate if it
/// committed, or applies the event if it rolled back.
///
/// ```no_run
/// # async fn run() -> Result<(), tower_idempotency::Error> {
/// use tower_idempotency::outbox::postgres::PostgresInbox;
/// use tower_idempotency::outbox::Processed;
/// use tower_idempotency::store::postgres::PostgresStore;
///
/// let store = PostgresStore::connect("postgres://app@127.0.0.1/inventory").await?;
/// // Creates `inbox_events` (idempotent): once at start-up.
/// let inbox = PostgresInbox::install(&store, "inventory").await?;
///
/// // For each delivery (the event id comes from the `Idempotency-Key` header):
/// let event_id = "0190c1c2-8d5e-7a1b-9c3d-4e5f60718293";
/// let processed = inbox
///     .process(event_id, |tx| async move {
///         // The same handle a request's handler gets: one connection, one transaction.
///         let client = tx.client().await?;
///         let row = client
///             .query_one(
///                 "UPDATE stock SET reserved = reserved + 1 WHERE sku = $1 RETURNING reserved",
///                 &[&"book"],
///             )
///             .await?;
///         Ok(row.try_get::<_, i64>(0)?)
///     })
///     .await?;
/// match processed {
///     Processed::First(reserved) => println!("reserved (now {reserved})"),
///     Processed::Duplicate => println!("already reserved: acknowledged, nothing done"),
/// }
/// # Ok(()) }
/// ```
///
/// A receiver that is itself behind [`IdempotencyLayer`](crate::IdempotencyLayer) records the
/// id in the request's transaction instead, with [`process_in`](Self::process_in).
#[derive(Clone)]
pub struct PostgresInbox {
    store: PostgresStore,
    consumer: Arc<str>,
}

impl fmt::Debug for PostgresInbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresInbox")
            .field("consumer", &self.consumer)
            .field("store", &self.store)
            .finish()
    }
}

impl PostgresInbox {
    /// Creates `inbox_events` if needed (in the first schema of the connection's
    /// `search_path`, like the store's own table) and returns the inbox of `consumer` (a name
    /// for the receiving component: several consumers may share one database, each with its
    /// own ids). Idempotent, and safe for instances starting at the same time.
    pub async fn install(
        store: &PostgresStore,
        consumer: impl Into<Arc<str>>,
    ) -> Result<Self, Error> {
        let mut client = store.client().await?;
        let tx = client.transaction().await?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&INSTALL_LOCK])
            .await?;
        tx.batch_execute(SCHEMA).await?;
        tx.commit().await?;
        Ok(PostgresInbox {
            store: store.clone(),
            consumer: consumer.into(),
        })
    }

    /// The consumer's name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The store.
    pub fn store(&self) -> &PostgresStore {
        &self.store
    }

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
            .execute_statement(INSERT_ID, &[&&*self.consumer, &event_id, &now])
            .await?;
        Ok(receipt(inserted))
    }

    /// Applies an event once: in one transaction of its own, records `event_id` and runs `f`
    /// with the transaction's handle, then commits; or, if the id was recorded before, does
    /// nothing and returns [`Processed::Duplicate`] without calling `f`.
    ///
    /// `f` gets the same [`PostgresTransaction`] a request's handler gets (take its
    /// [`client`](PostgresTransaction::client), do not `COMMIT`): a closure returning a future,
    /// or an `async fn(PostgresTransaction) -> Result<T, Error>`. An error from `f`, a panic,
    /// or this future being dropped rolls back both the id and the effect, so the redelivery
    /// runs `f` again.
    ///
    /// Two deliveries of one event at once (two relays, two instances) apply it once: the
    /// second waits on the id's primary key until the first transaction ends. With
    /// `REPEATABLE READ` or `SERIALIZABLE` transactions that wait ends in a serialization
    /// failure, which is retried here ([`PostgresOptions::serialization_retries`] times)
    /// before `f` is called.
    ///
    /// [`PostgresOptions::serialization_retries`]: crate::store::postgres::PostgresOptions::serialization_retries
    pub async fn process<T, F, Fut>(&self, event_id: &str, f: F) -> Result<Processed<T>, Error>
    where
        F: FnOnce(PostgresTransaction) -> Fut,
        Fut: Future<Output = Result<T, Error>>,
    {
        let mut retries = 0;
        let transaction = loop {
            let transaction = self.store.begin_owned().await?;
            let recorded = async {
                let client = transaction.handle().client().await?;
                record_cached(&client, &self.consumer, event_id).await
            }
            .await;
            match recorded {
                Ok(Receipt::First) => break transaction,
                Ok(Receipt::Duplicate) => {
                    transaction.rollback().await;
                    record::inbox(&self.consumer, false);
                    return Ok(Processed::Duplicate);
                }
                Err(error)
                    if error.is_serialization_conflict()
                        && retries < self.store.serialization_retries() =>
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
        match f(transaction.handle()).await {
            Ok(value) => {
                transaction.commit().await?;
                record::inbox(&self.consumer, true);
                Ok(Processed::First(value))
            }
            Err(error) => {
                transaction.rollback().await;
                Err(error)
            }
        }
    }

    /// Records `event_id` in an idempotent request's transaction (the handle the layer put in
    /// the request extensions): [`Receipt::First`] if it is new, and the handler then applies
    /// the event through the same handle, so that the id, the effect and the saved response
    /// commit together (or roll back together: the redelivery then applies it);
    /// [`Receipt::Duplicate`] if it was applied before, and the handler only acknowledges it.
    ///
    /// Unlike [`SqliteInbox::process_in`](crate::outbox::inbox::SqliteInbox::process_in) it
    /// takes no closure: on PostgreSQL the handler simply goes on using the handle.
    ///
    /// While another open transaction holds the same id, this waits for it to end, within the
    /// layer's lock timeout; past it the error [`is_busy`](Error::is_busy) (answer `503`, the
    /// sender retries). Under `REPEATABLE READ` or `SERIALIZABLE` a wait that ends with the
    /// other transaction committing is a serialization failure, also `is_busy`, and is not
    /// retried here (the request's transaction is not this call's to restart): answer `503`,
    /// and the sender's retry finds the id.
    ///
    /// ```no_run
    /// # async fn handler(
    /// #     inbox: tower_idempotency::outbox::postgres::PostgresInbox,
    /// #     tx: tower_idempotency::store::postgres::PostgresTransaction,
    /// #     event_id: &str,
    /// # ) -> Result<&'static str, tower_idempotency::Error> {
    /// use tower_idempotency::outbox::Receipt;
    ///
    /// if inbox.process_in(&tx, event_id).await? == Receipt::Duplicate {
    ///     return Ok("duplicate"); // applied before: acknowledge, change nothing
    /// }
    /// let client = tx.client().await?;
    /// client
    ///     .execute("UPDATE stock SET reserved = reserved + 1 WHERE sku = $1", &[&"book"])
    ///     .await?;
    /// Ok("reserved")
    /// # }
    /// ```
    pub async fn process_in(
        &self,
        tx: &PostgresTransaction,
        event_id: &str,
    ) -> Result<Receipt, Error> {
        let client = tx.client().await?;
        let receipt = record_cached(&client, &self.consumer, event_id).await?;
        record::inbox(&self.consumer, receipt == Receipt::First);
        Ok(receipt)
    }

    /// Whether `event_id` was processed (committed).
    pub async fn contains(&self, event_id: &str) -> Result<bool, Error> {
        let client = self.store.client().await?;
        Ok(client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM inbox_events \
                 WHERE consumer = $1 AND event_id = $2)",
                &[&&*self.consumer, &event_id],
            )
            .await?
            .try_get(0)?)
    }

    /// Deletes up to `batch` ids of this consumer processed before `before`; returns how many.
    /// Keep ids longer than the sender may redeliver (its relay's whole retry schedule): an id
    /// purged too early lets a late redelivery apply again. Several instances may purge at
    /// once (SKIP LOCKED).
    pub async fn purge_processed_before(
        &self,
        before: SystemTime,
        batch: usize,
    ) -> Result<u64, Error> {
        let before = to_unix_millis(before);
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        let client = self.store.client().await?;
        Ok(client
            .execute(
                "DELETE FROM inbox_events WHERE (consumer, event_id) IN ( \
                     SELECT consumer, event_id FROM inbox_events \
                     WHERE consumer = $1 AND processed_at <= $2 LIMIT $3 \
                     FOR UPDATE SKIP LOCKED)",
                &[&&*self.consumer, &before, &batch],
            )
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

fn receipt(inserted: u64) -> Receipt {
    if inserted == 1 {
        Receipt::First
    } else {
        Receipt::Duplicate
    }
}
