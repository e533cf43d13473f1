//! The outbox on the PostgreSQL store: `outbox_events` lives in the same database (and
//! schema) as the handler's rows and the idempotency records, so an event commits in their
//! transaction.
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

use std::fmt;
use std::time::{Duration, SystemTime};

use tokio_postgres::row::Row;

use super::{
    Backlog, ClaimRequest, Claimed, Enqueue, EventId, EventInfo, EventStatus, OutboxCounts,
    OutboxEvent, OutboxStore, Settlement,
};
use crate::error::Error;
use crate::store::postgres::{Executor, PostgresStore, PostgresTransaction};
use crate::store::{from_unix_millis, to_unix_millis};

mod inbox;

pub use inbox::PostgresInbox;

/// The same columns and meaning as the SQLite outbox (times are Unix milliseconds).
/// `available_at` is when the event is next due; a claim moves it to the end of the lease, so
/// "due" covers both new events and claims whose relay died: one index serves the claim.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS outbox_events (
    seq          BIGSERIAL PRIMARY KEY,
    event_id     TEXT    NOT NULL UNIQUE,
    topic        TEXT    NOT NULL,
    payload      TEXT    NOT NULL,
    status       TEXT    NOT NULL DEFAULT 'pending'
                         CONSTRAINT outbox_events_status
                         CHECK (status IN ('pending', 'delivered', 'dead')),
    attempts     INTEGER NOT NULL DEFAULT 0,
    available_at BIGINT  NOT NULL,
    lease_owner  TEXT,
    last_error   TEXT,
    created_at   BIGINT  NOT NULL,
    delivered_at BIGINT
);
CREATE INDEX IF NOT EXISTS outbox_events_due ON outbox_events (status, available_at);
";

/// Serializes `install` between instances starting at the same time (concurrent
/// `CREATE TABLE IF NOT EXISTS` of one table can fail on PostgreSQL's catalog index).
const INSTALL_LOCK: i64 = 0x7469_6465_6d70_0002;

const EVENT_COLUMNS: &str = "event_id, topic, payload, status, attempts, created_at, \
     available_at, delivered_at, last_error, lease_owner";

const INSERT_EVENT: &str = "INSERT INTO outbox_events (event_id, topic, payload, status, \
     attempts, available_at, created_at) VALUES ($1, $2, $3, 'pending', 0, $4, $4)";

/// Dead-letters the events whose last allowed attempt was abandoned (the lease ran out).
const DEAD_LETTER_ABANDONED: &str = "UPDATE outbox_events SET status = 'dead', \
     lease_owner = NULL, last_error = 'abandoned: the lease of its last attempt ran out' \
     WHERE seq IN (SELECT seq FROM outbox_events \
         WHERE status = 'pending' AND lease_owner IS NOT NULL \
         AND available_at <= $1 AND attempts >= $2 \
         FOR UPDATE SKIP LOCKED) \
     RETURNING seq, event_id, topic, payload, attempts, created_at";

/// Claims due events. SKIP LOCKED: rows another relay is claiming right now are skipped, not
/// waited for; a row claimed and committed meanwhile is re-checked (no longer due) and left.
const CLAIM: &str = "UPDATE outbox_events SET lease_owner = $1, available_at = $2, \
     attempts = attempts + 1 \
     WHERE seq IN (SELECT seq FROM outbox_events \
         WHERE status = 'pending' AND available_at <= $3 \
         ORDER BY available_at, seq LIMIT $4 \
         FOR UPDATE SKIP LOCKED) \
     RETURNING seq, event_id, topic, payload, attempts, created_at";

/// The outbox of a [`PostgresStore`]: the relay's [`OutboxStore`] and the operations on
/// `outbox_events` (counts, dead letters, requeue, purge). Cheap to clone.
#[derive(Clone)]
pub struct PostgresOutbox {
    store: PostgresStore,
}

impl fmt::Debug for PostgresOutbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresOutbox")
            .field("store", &self.store)
            .finish()
    }
}

impl PostgresOutbox {
    /// Creates `outbox_events` if needed (in the first schema of the connection's
    /// `search_path`, like the store's own table) and returns the outbox. Idempotent: call it
    /// at start-up, before serving requests that enqueue.
    pub async fn install(store: &PostgresStore) -> Result<Self, Error> {
        let mut client = store.client().await?;
        let tx = client.transaction().await?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&INSTALL_LOCK])
            .await?;
        tx.batch_execute(SCHEMA).await?;
        tx.commit().await?;
        Ok(PostgresOutbox {
            store: store.clone(),
        })
    }

    /// The outbox of a database whose `outbox_events` table already exists (an admin tool
    /// should not create tables); calls on it fail if the table is missing.
    pub fn existing(store: &PostgresStore) -> Self {
        PostgresOutbox {
            store: store.clone(),
        }
    }

    /// The store.
    pub fn store(&self) -> &PostgresStore {
        &self.store
    }

    /// One event, by id.
    pub async fn event(&self, id: &str) -> Result<Option<EventInfo>, Error> {
        let now = to_unix_millis(SystemTime::now());
        let client = self.store.client().await?;
        let row = client
            .query_opt(
                &format!("SELECT {EVENT_COLUMNS} FROM outbox_events WHERE event_id = $1"),
                &[&id],
            )
            .await?;
        row.map(|row| RawEvent::from_row(&row)?.into_info(now))
            .transpose()
    }

    /// How many events are in each state.
    pub async fn counts(&self) -> Result<OutboxCounts, Error> {
        let now = to_unix_millis(SystemTime::now());
        let client = self.store.client().await?;
        let rows = client
            .query(
                "SELECT status, lease_owner IS NOT NULL AND available_at > $1, count(*) \
                 FROM outbox_events GROUP BY 1, 2",
                &[&now],
            )
            .await?;
        let mut counts = OutboxCounts::default();
        for row in rows {
            let status: String = row.try_get(0)?;
            let leased: bool = row.try_get(1)?;
            let count = u64::try_from(row.try_get::<_, i64>(2)?).unwrap_or(0);
            match (status.as_str(), leased) {
                ("pending", false) => counts.pending += count,
                ("pending", true) => counts.in_flight += count,
                ("delivered", _) => counts.delivered += count,
                ("dead", _) => counts.dead += count,
                (other, _) => return Err(Error::Corrupt(format!("outbox status {other:?}"))),
            }
        }
        Ok(counts)
    }

    /// Dead-lettered events, oldest first, at most `limit`.
    pub async fn dead_letters(&self, limit: usize) -> Result<Vec<EventInfo>, Error> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let now = to_unix_millis(SystemTime::now());
        let client = self.store.client().await?;
        let rows = client
            .query(
                &format!(
                    "SELECT {EVENT_COLUMNS} FROM outbox_events WHERE status = 'dead' \
                     ORDER BY seq LIMIT $1"
                ),
                &[&limit],
            )
            .await?;
        rows.iter()
            .map(|row| RawEvent::from_row(row)?.into_info(now))
            .collect()
    }

    /// Moves a dead-lettered event back to pending, due now, with its attempts reset (its last
    /// error is kept until the next attempt). Returns `false` if no dead event has this id.
    pub async fn requeue(&self, id: &str) -> Result<bool, Error> {
        let now = to_unix_millis(SystemTime::now());
        let client = self.store.client().await?;
        let changed = client
            .execute(
                "UPDATE outbox_events SET status = 'pending', attempts = 0, \
                 available_at = $2, lease_owner = NULL \
                 WHERE event_id = $1 AND status = 'dead'",
                &[&id, &now],
            )
            .await?;
        Ok(changed > 0)
    }

    /// Requeues every dead-lettered event (see [`requeue`](Self::requeue)); returns how many.
    pub async fn requeue_dead(&self) -> Result<u64, Error> {
        let now = to_unix_millis(SystemTime::now());
        let client = self.store.client().await?;
        Ok(client
            .execute(
                "UPDATE outbox_events SET status = 'pending', attempts = 0, \
                 available_at = $1, lease_owner = NULL WHERE status = 'dead'",
                &[&now],
            )
            .await?)
    }

    /// Deletes up to `batch` events delivered before `before`; returns how many. Delivered
    /// events are kept until then only for inspection: nothing reads them again. Several
    /// instances may purge at once (SKIP LOCKED).
    pub async fn purge_delivered(&self, before: SystemTime, batch: usize) -> Result<u64, Error> {
        let before = to_unix_millis(before);
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        let client = self.store.client().await?;
        Ok(client
            .execute(
                "DELETE FROM outbox_events WHERE seq IN (SELECT seq FROM outbox_events \
                 WHERE status = 'delivered' AND delivered_at <= $1 LIMIT $2 \
                 FOR UPDATE SKIP LOCKED)",
                &[&before, &batch],
            )
            .await?)
    }
}

/// Adds an event to the outbox through `client`: a
/// [`TransactionClient`](crate::store::postgres::TransactionClient) of the request's
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

impl OutboxStore for PostgresOutbox {
    async fn claim(&self, request: ClaimRequest) -> Result<Claimed, Error> {
        let now = to_unix_millis(request.now);
        let lease_until = to_unix_millis(request.now + request.lease.max(Duration::from_millis(1)));
        let batch = i64::try_from(request.batch).unwrap_or(i64::MAX);
        let token = request.token.as_str().to_owned();
        let max_attempts = i32::try_from(request.max_attempts).unwrap_or(i32::MAX);
        let mut client = self.store.client().await?;
        // An idle relay polls often: a plain read first, so that polling opens no write
        // transaction and locks nothing.
        let due: bool = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM outbox_events \
                 WHERE status = 'pending' AND available_at <= $1)",
                &[&now],
            )
            .await?
            .try_get(0)?;
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
        let mut claimed = tx
            .query(CLAIM, &[&token, &lease_until, &now, &batch])
            .await?
            .iter()
            .map(claimed_row)
            .collect::<Result<Vec<_>, Error>>()?;
        tx.commit().await?;
        // RETURNING gives no order: deliver oldest first.
        claimed.sort_by_key(|(seq, _)| *seq);
        Ok(Claimed {
            events: claimed.into_iter().map(|(_, event)| event).collect(),
            abandoned: abandoned.into_iter().map(|(_, event)| event).collect(),
        })
    }

    async fn settle(&self, settlements: Vec<Settlement>) -> Result<(), Error> {
        if settlements.is_empty() {
            return Ok(());
        }
        let now = to_unix_millis(SystemTime::now());
        let mut client = self.store.client().await?;
        let tx = client.transaction().await?;
        for settlement in &settlements {
            match settlement {
                // Recorded whoever holds the claim now: the sink accepted the event, and that
                // stays true.
                Settlement::Delivered { id } => {
                    tx.execute(
                        "UPDATE outbox_events SET status = 'delivered', delivered_at = $2, \
                         lease_owner = NULL, last_error = NULL \
                         WHERE event_id = $1 AND status = 'pending'",
                        &[&id.as_str(), &now],
                    )
                    .await?
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
                        "UPDATE outbox_events SET available_at = $3, lease_owner = NULL, \
                         last_error = $4 \
                         WHERE event_id = $1 AND lease_owner = $2 AND status = 'pending'",
                        &[&id.as_str(), &token.as_str(), &to_unix_millis(*at), error],
                    )
                    .await?
                }
                Settlement::Dead { id, token, error } => {
                    tx.execute(
                        "UPDATE outbox_events SET status = 'dead', lease_owner = NULL, \
                         last_error = $3 \
                         WHERE event_id = $1 AND lease_owner = $2 AND status = 'pending'",
                        &[&id.as_str(), &token.as_str(), error],
                    )
                    .await?
                }
            };
        }
        tx.commit().await?;
        Ok(())
    }

    async fn backlog(&self) -> Result<Backlog, Error> {
        let client = self.store.client().await?;
        let row = client
            .query_one(
                "SELECT (SELECT count(*) FROM outbox_events WHERE status = 'pending'), \
                 (SELECT count(*) FROM outbox_events WHERE status = 'dead')",
                &[],
            )
            .await?;
        Ok(Backlog {
            pending: u64::try_from(row.try_get::<_, i64>(0)?).unwrap_or(0),
            dead: u64::try_from(row.try_get::<_, i64>(1)?).unwrap_or(0),
        })
    }
}

/// A row returned by a claim: `(seq, event)`.
fn claimed_row(row: &Row) -> Result<(i64, OutboxEvent), Error> {
    let attempts: i32 = row.try_get(4)?;
    Ok((
        row.try_get(0)?,
        OutboxEvent::new(
            EventId::from(row.try_get::<_, String>(1)?),
            row.try_get::<_, String>(2)?,
            row.try_get::<_, String>(3)?,
            u32::try_from(attempts).unwrap_or(0),
            from_unix_millis(row.try_get(5)?),
        ),
    ))
}

/// An `outbox_events` row as read (in [`EVENT_COLUMNS`] order).
struct RawEvent {
    id: String,
    topic: String,
    payload: String,
    status: String,
    attempts: i32,
    created_at: i64,
    available_at: i64,
    delivered_at: Option<i64>,
    last_error: Option<String>,
    leased: bool,
}

impl RawEvent {
    fn from_row(row: &Row) -> Result<Self, Error> {
        Ok(RawEvent {
            id: row.try_get(0)?,
            topic: row.try_get(1)?,
            payload: row.try_get(2)?,
            status: row.try_get(3)?,
            attempts: row.try_get(4)?,
            created_at: row.try_get(5)?,
            available_at: row.try_get(6)?,
            delivered_at: row.try_get(7)?,
            last_error: row.try_get(8)?,
            leased: row.try_get::<_, Option<String>>(9)?.is_some(),
        })
    }

    fn into_info(self, now: i64) -> Result<EventInfo, Error> {
        let status = match self.status.as_str() {
            "pending" if self.leased && self.available_at > now => EventStatus::InFlight,
            "pending" => EventStatus::Pending,
            "delivered" => EventStatus::Delivered,
            "dead" => EventStatus::Dead,
            other => return Err(Error::Corrupt(format!("outbox status {other:?}"))),
        };
        Ok(EventInfo {
            id: EventId::from(self.id),
            topic: self.topic,
            payload: self.payload,
            status,
            attempts: u32::try_from(self.attempts).unwrap_or(0),
            created_at: from_unix_millis(self.created_at),
            available_at: from_unix_millis(self.available_at),
            delivered_at: self.delivered_at.map(from_unix_millis),
            last_error: self.last_error,
        })
    }
}
