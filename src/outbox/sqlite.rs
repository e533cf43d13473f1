//! The outbox on the SQLite store: `outbox_events` lives in the same database file as the
//! handler's rows and the idempotency records, so an event commits in their transaction.
//!
//! Everything goes through the store's public API: events are enqueued with
//! [`SqliteTransaction::run`], relays claim and settle with [`SqliteStore::write`] (one
//! `BEGIN IMMEDIATE` transaction each, queued behind requests on the single writer), and counts
//! and listings read with [`SqliteStore::read`]. Relays in other processes on the same file are
//! serialized by SQLite's own write lock, so a claim is atomic across processes too.
//!
//! ```no_run
//! # async fn run() -> Result<(), tower_idempotency::Error> {
//! use serde_json::json;
//! use tower_idempotency::outbox::sqlite::{enqueue, SqliteOutbox};
//! use tower_idempotency::store::sqlite::{SqliteStore, SqliteTransaction};
//!
//! let store = SqliteStore::open("orders.db").await?;
//! SqliteOutbox::install(&store).await?;
//!
//! // In a handler: the order row and its event in one hop to the writer thread.
//! async fn create_order(tx: SqliteTransaction) -> Result<i64, tower_idempotency::Error> {
//!     tx.run(|conn| {
//!         conn.execute("INSERT INTO orders (sku) VALUES ('book')", [])?;
//!         let order_id = conn.last_insert_rowid();
//!         enqueue(conn, "order_created", &json!({ "order_id": order_id }))?;
//!         Ok(order_id)
//!     })
//!     .await
//! }
//! # Ok(()) }
//! ```

use std::fmt;
use std::time::{Duration, SystemTime};

use rusqlite::{params, Connection, OptionalExtension, Row};

use super::{
    Backlog, ClaimRequest, Claimed, Enqueue, EventId, EventInfo, EventStatus, OutboxCounts,
    OutboxEvent, OutboxStore, Settlement,
};
use crate::error::Error;
use crate::store::sqlite::{SqliteStore, SqliteTransaction};
use crate::store::{from_unix_millis, to_unix_millis};

/// `available_at` is when the event is next due. A claim moves it to the end of the lease, so
/// "due" covers both new events and claims whose relay died: one index serves the claim.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS outbox_events (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id     TEXT    NOT NULL UNIQUE,
    topic        TEXT    NOT NULL,
    payload      TEXT    NOT NULL,
    status       TEXT    NOT NULL DEFAULT 'pending'
                         CHECK (status IN ('pending', 'delivered', 'dead')),
    attempts     INTEGER NOT NULL DEFAULT 0,
    available_at INTEGER NOT NULL,
    lease_owner  TEXT,
    last_error   TEXT,
    created_at   INTEGER NOT NULL,
    delivered_at INTEGER
);
CREATE INDEX IF NOT EXISTS outbox_events_due ON outbox_events (status, available_at);
";

const EVENT_COLUMNS: &str = "event_id, topic, payload, status, attempts, created_at, \
     available_at, delivered_at, last_error, lease_owner";

/// The outbox of a [`SqliteStore`]: the relay's [`OutboxStore`] and the operations on
/// `outbox_events` (counts, dead letters, requeue, purge). Cheap to clone.
#[derive(Clone)]
pub struct SqliteOutbox {
    store: SqliteStore,
}

impl fmt::Debug for SqliteOutbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteOutbox")
            .field("path", &self.store.path())
            .finish()
    }
}

impl SqliteOutbox {
    /// Creates `outbox_events` if needed and returns the outbox. Idempotent: call it at
    /// start-up, before serving requests that enqueue.
    pub async fn install(store: &SqliteStore) -> Result<Self, Error> {
        store.write(|tx| tx.execute_batch(SCHEMA)).await?;
        Ok(SqliteOutbox {
            store: store.clone(),
        })
    }

    /// The outbox of a database whose `outbox_events` table already exists (an admin tool
    /// should not create tables); calls on it fail if the table is missing.
    pub fn existing(store: &SqliteStore) -> Self {
        SqliteOutbox {
            store: store.clone(),
        }
    }

    /// The store.
    pub fn store(&self) -> &SqliteStore {
        &self.store
    }

    /// One event, by id.
    pub async fn event(&self, id: &str) -> Result<Option<EventInfo>, Error> {
        let id = id.to_owned();
        let now = to_unix_millis(SystemTime::now());
        let raw = self
            .store
            .read(move |conn| {
                conn.query_row(
                    &format!("SELECT {EVENT_COLUMNS} FROM outbox_events WHERE event_id = ?1"),
                    [id],
                    RawEvent::from_row,
                )
                .optional()
            })
            .await?;
        raw.map(|raw| raw.into_info(now)).transpose()
    }

    /// How many events are in each state.
    pub async fn counts(&self) -> Result<OutboxCounts, Error> {
        let now = to_unix_millis(SystemTime::now());
        let rows = self
            .store
            .read(move |conn| {
                let mut statement = conn.prepare(
                    "SELECT status, lease_owner IS NOT NULL AND available_at > ?1, count(*) \
                     FROM outbox_events GROUP BY 1, 2",
                )?;
                let rows = statement
                    .query_map([now], |row| {
                        Ok((
                            row.get::<_, String>(0)?,
                            row.get::<_, bool>(1)?,
                            row.get::<_, i64>(2)?,
                        ))
                    })?
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                Ok(rows)
            })
            .await?;
        let mut counts = OutboxCounts::default();
        for (status, leased, count) in rows {
            let count = u64::try_from(count).unwrap_or(0);
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
        let raws = self
            .store
            .read(move |conn| {
                let mut statement = conn.prepare(&format!(
                    "SELECT {EVENT_COLUMNS} FROM outbox_events WHERE status = 'dead' \
                     ORDER BY seq LIMIT ?1"
                ))?;
                let rows = statement
                    .query_map([limit], RawEvent::from_row)?
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                Ok(rows)
            })
            .await?;
        raws.into_iter().map(|raw| raw.into_info(now)).collect()
    }

    /// Moves a dead-lettered event back to pending, due now, with its attempts reset (its last
    /// error is kept until the next attempt). Returns `false` if no dead event has this id.
    pub async fn requeue(&self, id: &str) -> Result<bool, Error> {
        let id = id.to_owned();
        let now = to_unix_millis(SystemTime::now());
        let changed = self
            .store
            .write(move |tx| {
                tx.execute(
                    "UPDATE outbox_events SET status = 'pending', attempts = 0, \
                     available_at = ?2, lease_owner = NULL \
                     WHERE event_id = ?1 AND status = 'dead'",
                    params![id, now],
                )
            })
            .await?;
        Ok(changed > 0)
    }

    /// Requeues every dead-lettered event (see [`requeue`](Self::requeue)); returns how many.
    pub async fn requeue_dead(&self) -> Result<u64, Error> {
        let now = to_unix_millis(SystemTime::now());
        let changed = self
            .store
            .write(move |tx| {
                tx.execute(
                    "UPDATE outbox_events SET status = 'pending', attempts = 0, \
                     available_at = ?1, lease_owner = NULL WHERE status = 'dead'",
                    [now],
                )
            })
            .await?;
        Ok(changed as u64)
    }

    /// Deletes up to `batch` events delivered before `before`; returns how many. Delivered
    /// events are kept until then only for inspection: nothing reads them again.
    pub async fn purge_delivered(&self, before: SystemTime, batch: usize) -> Result<u64, Error> {
        let before = to_unix_millis(before);
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        let deleted = self
            .store
            .write(move |tx| {
                tx.execute(
                    "DELETE FROM outbox_events WHERE seq IN (SELECT seq FROM outbox_events \
                     WHERE status = 'delivered' AND delivered_at <= ?1 LIMIT ?2)",
                    params![before, batch],
                )
            })
            .await?;
        Ok(deleted as u64)
    }
}

/// Adds an event to the outbox on `conn`: inside [`SqliteTransaction::run`], it belongs to the
/// request's transaction. Returns its id.
///
/// Use it to write an order and its event in one closure; [`Enqueue::enqueue`] on the handle
/// does the same in a call of its own.
pub fn enqueue(
    conn: &Connection,
    topic: &str,
    payload: &serde_json::Value,
) -> rusqlite::Result<EventId> {
    let id = EventId::generate();
    let now = to_unix_millis(SystemTime::now());
    conn.prepare_cached(
        "INSERT INTO outbox_events (event_id, topic, payload, status, attempts, available_at, \
         created_at) VALUES (?1, ?2, ?3, 'pending', 0, ?4, ?4)",
    )?
    .execute(params![id.as_str(), topic, payload.to_string(), now])?;
    Ok(id)
}

impl Enqueue for SqliteTransaction {
    /// ```no_run
    /// # async fn handler(tx: tower_idempotency::store::sqlite::SqliteTransaction)
    /// #     -> Result<(), tower_idempotency::Error> {
    /// use serde_json::json;
    /// use tower_idempotency::outbox::Enqueue;
    ///
    /// let event_id = tx.enqueue("order_created", json!({ "order_id": 7 })).await?;
    /// # let _ = event_id; Ok(()) }
    /// ```
    async fn enqueue(&self, topic: &str, payload: serde_json::Value) -> Result<EventId, Error> {
        let topic = topic.to_owned();
        self.run(move |conn| enqueue(conn, &topic, &payload)).await
    }
}

impl OutboxStore for SqliteOutbox {
    async fn claim(&self, request: ClaimRequest) -> Result<Claimed, Error> {
        let now = to_unix_millis(request.now);
        let lease_until = to_unix_millis(request.now + request.lease.max(Duration::from_millis(1)));
        let batch = i64::try_from(request.batch).unwrap_or(i64::MAX);
        let token = request.token.as_str().to_owned();
        let max_attempts = i64::from(request.max_attempts);
        // An idle relay polls often: look on a reader first (WAL: no lock), so that polling
        // never takes the write lock away from requests, in this process or another.
        let due = self
            .store
            .read(move |conn| {
                conn.query_row(
                    "SELECT EXISTS (SELECT 1 FROM outbox_events \
                     WHERE status = 'pending' AND available_at <= ?1)",
                    [now],
                    |row| row.get::<_, bool>(0),
                )
            })
            .await?;
        if !due {
            return Ok(Claimed::default());
        }
        let (abandoned, mut claimed) = self
            .store
            .write(move |tx| {
                // First, the events whose last allowed attempt was abandoned: retrying them
                // would exceed the attempts (and an event that crashes its relay would be
                // retried forever).
                let abandoned = tx
                    .prepare_cached(
                        "UPDATE outbox_events SET status = 'dead', lease_owner = NULL, \
                         last_error = 'abandoned: the lease of its last attempt ran out' \
                         WHERE status = 'pending' AND lease_owner IS NOT NULL \
                         AND available_at <= ?1 AND attempts >= ?2 \
                         RETURNING seq, event_id, topic, payload, attempts, created_at",
                    )?
                    .query_map(params![now, max_attempts], claimed_row)?
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                let claimed = tx
                    .prepare_cached(
                        "UPDATE outbox_events SET lease_owner = ?1, available_at = ?2, \
                         attempts = attempts + 1 \
                         WHERE seq IN (SELECT seq FROM outbox_events \
                             WHERE status = 'pending' AND available_at <= ?3 \
                             ORDER BY available_at, seq LIMIT ?4) \
                         RETURNING seq, event_id, topic, payload, attempts, created_at",
                    )?
                    .query_map(params![token, lease_until, now, batch], claimed_row)?
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                Ok((abandoned, claimed))
            })
            .await?;
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
        self.store
            .write(move |tx| {
                for settlement in &settlements {
                    match settlement {
                        // Recorded whoever holds the claim now: the sink accepted the event,
                        // and that stays true.
                        Settlement::Delivered { id } => tx
                            .prepare_cached(
                                "UPDATE outbox_events SET status = 'delivered', \
                                 delivered_at = ?2, lease_owner = NULL, last_error = NULL \
                                 WHERE event_id = ?1 AND status = 'pending'",
                            )?
                            .execute(params![id.as_str(), now])?,
                        // Only under our own claim: if it ran out and another relay claimed
                        // the event, that relay decides what happens next.
                        Settlement::Retry {
                            id,
                            token,
                            at,
                            error,
                        } => tx
                            .prepare_cached(
                                "UPDATE outbox_events SET available_at = ?3, \
                                 lease_owner = NULL, last_error = ?4 \
                                 WHERE event_id = ?1 AND lease_owner = ?2 \
                                 AND status = 'pending'",
                            )?
                            .execute(params![
                                id.as_str(),
                                token.as_str(),
                                to_unix_millis(*at),
                                error
                            ])?,
                        Settlement::Dead { id, token, error } => tx
                            .prepare_cached(
                                "UPDATE outbox_events SET status = 'dead', \
                                 lease_owner = NULL, last_error = ?3 \
                                 WHERE event_id = ?1 AND lease_owner = ?2 \
                                 AND status = 'pending'",
                            )?
                            .execute(params![id.as_str(), token.as_str(), error])?,
                    };
                }
                Ok(())
            })
            .await
    }

    async fn backlog(&self) -> Result<Backlog, Error> {
        let (pending, dead) = self
            .store
            .read(|conn| {
                conn.query_row(
                    "SELECT (SELECT count(*) FROM outbox_events WHERE status = 'pending'), \
                     (SELECT count(*) FROM outbox_events WHERE status = 'dead')",
                    [],
                    |row| Ok((row.get::<_, i64>(0)?, row.get::<_, i64>(1)?)),
                )
            })
            .await?;
        Ok(Backlog {
            pending: u64::try_from(pending).unwrap_or(0),
            dead: u64::try_from(dead).unwrap_or(0),
        })
    }
}

/// A row returned by a claim: `(seq, event)`.
fn claimed_row(row: &Row<'_>) -> rusqlite::Result<(i64, OutboxEvent)> {
    let attempts: i64 = row.get(4)?;
    Ok((
        row.get(0)?,
        OutboxEvent::new(
            EventId::from(row.get::<_, String>(1)?),
            row.get::<_, String>(2)?,
            row.get::<_, String>(3)?,
            u32::try_from(attempts).unwrap_or(u32::MAX),
            from_unix_millis(row.get(5)?),
        ),
    ))
}

/// An `outbox_events` row as read (in [`EVENT_COLUMNS`] order).
struct RawEvent {
    id: String,
    topic: String,
    payload: String,
    status: String,
    attempts: i64,
    created_at: i64,
    available_at: i64,
    delivered_at: Option<i64>,
    last_error: Option<String>,
    leased: bool,
}

impl RawEvent {
    fn from_row(row: &Row<'_>) -> rusqlite::Result<Self> {
        Ok(RawEvent {
            id: row.get(0)?,
            topic: row.get(1)?,
            payload: row.get(2)?,
            status: row.get(3)?,
            attempts: row.get(4)?,
            created_at: row.get(5)?,
            available_at: row.get(6)?,
            delivered_at: row.get(7)?,
            last_error: row.get(8)?,
            leased: row.get::<_, Option<String>>(9)?.is_some(),
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
            attempts: u32::try_from(self.attempts).unwrap_or(u32::MAX),
            created_at: from_unix_millis(self.created_at),
            available_at: from_unix_millis(self.available_at),
            delivered_at: self.delivered_at.map(from_unix_millis),
            last_error: self.last_error,
        })
    }
}
