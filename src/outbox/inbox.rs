//! The receiver's side: an inbox of processed event ids, written in the receiver's own
//! transaction, so a redelivered event is acknowledged without being applied twice.
//!
//! The relay delivers at least once: after a crash, a timeout or a lost acknowledgement the
//! same event (same [`EventId`](super::EventId)) arrives again. The receiver records the id in
//! the **same transaction** as the effect (reserving stock, say): either both commit or
//! neither does, so an id in the inbox always means "already applied", and an id missing
//! always means "not applied".
//!
//! ```no_run
//! # async fn run() -> Result<(), tower_idempotency::Error> {
//! use tower_idempotency::outbox::inbox::{Processed, SqliteInbox};
//! use tower_idempotency::store::sqlite::SqliteStore;
//!
//! let store = SqliteStore::open("inventory.db").await?;
//! let inbox = SqliteInbox::install(&store, "inventory").await?;
//!
//! // For each delivery (the event id comes from the `Idempotency-Key` header):
//! let event_id = "0190c1c2-8d5e-7a1b-9c3d-4e5f60718293";
//! match inbox
//!     .process(event_id, |tx| {
//!         tx.execute("UPDATE stock SET reserved = reserved + 1 WHERE sku = 'book'", [])?;
//!         Ok(())
//!     })
//!     .await?
//! {
//!     Processed::First(()) => println!("reserved"),
//!     Processed::Duplicate => println!("already reserved: acknowledged, nothing done"),
//! }
//! # Ok(()) }
//! ```
//!
//! A receiver that is itself behind [`IdempotencyLayer`](crate::IdempotencyLayer) records the
//! id in the request's transaction instead, with [`SqliteInbox::process_in`].

use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use rusqlite::{params, Connection};

/// Shared by both backends' inboxes; re-exported here, where they were first defined.
pub use super::{Processed, Receipt};
use crate::error::Error;
use crate::metrics::outbox as record;
use crate::store::sqlite::{SqliteStore, SqliteTransaction};
use crate::store::to_unix_millis;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS inbox_events (
    consumer     TEXT    NOT NULL,
    event_id     TEXT    NOT NULL,
    processed_at INTEGER NOT NULL,
    PRIMARY KEY (consumer, event_id)
);
CREATE INDEX IF NOT EXISTS inbox_events_processed_at ON inbox_events (processed_at);
";

/// The processed event ids of one consumer, in a SQLite database (table `inbox_events`).
/// Cheap to clone.
#[derive(Clone)]
pub struct SqliteInbox {
    store: SqliteStore,
    consumer: Arc<str>,
}

impl fmt::Debug for SqliteInbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteInbox")
            .field("consumer", &self.consumer)
            .field("path", &self.store.path())
            .finish()
    }
}

impl SqliteInbox {
    /// Creates `inbox_events` if needed and returns the inbox of `consumer` (a name for the
    /// receiving component: several consumers may share one database, each with its own ids).
    pub async fn install(
        store: &SqliteStore,
        consumer: impl Into<Arc<str>>,
    ) -> Result<Self, Error> {
        store.write(|tx| tx.execute_batch(SCHEMA)).await?;
        Ok(SqliteInbox {
            store: store.clone(),
            consumer: consumer.into(),
        })
    }

    /// The consumer's name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// Records `event_id` on `conn`, which must be inside the transaction that applies the
    /// event: [`Receipt::First`] if it was new (apply the event in the same transaction),
    /// [`Receipt::Duplicate`] if it was there already (do nothing).
    pub fn record(&self, conn: &Connection, event_id: &str) -> rusqlite::Result<Receipt> {
        record_id(conn, &self.consumer, event_id)
    }

    /// Applies an event once: in one write transaction, records `event_id` and runs `f`, or
    /// does nothing if the id was recorded before. An error from `f` rolls back both, so the
    /// redelivery runs `f` again.
    pub async fn process<T, F>(&self, event_id: &str, f: F) -> Result<Processed<T>, Error>
    where
        F: FnOnce(&rusqlite::Transaction<'_>) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let consumer = self.consumer.clone();
        let event_id = event_id.to_owned();
        let processed = self
            .store
            .write(move |tx| match record_id(tx, &consumer, &event_id)? {
                Receipt::First => f(tx).map(Processed::First),
                Receipt::Duplicate => Ok(Processed::Duplicate),
            })
            .await?;
        record::inbox(&self.consumer, matches!(processed, Processed::First(_)));
        Ok(processed)
    }

    /// [`process`](Self::process) inside an idempotent request's transaction: the id, the
    /// effect and the saved response commit together.
    pub async fn process_in<T, F>(
        &self,
        tx: &SqliteTransaction,
        event_id: &str,
        f: F,
    ) -> Result<Processed<T>, Error>
    where
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let consumer = self.consumer.clone();
        let event_id = event_id.to_owned();
        let processed = tx
            .run(move |conn| match record_id(conn, &consumer, &event_id)? {
                Receipt::First => f(conn).map(Processed::First),
                Receipt::Duplicate => Ok(Processed::Duplicate),
            })
            .await?;
        record::inbox(&self.consumer, matches!(processed, Processed::First(_)));
        Ok(processed)
    }

    /// Whether `event_id` was processed (committed).
    pub async fn contains(&self, event_id: &str) -> Result<bool, Error> {
        let consumer = self.consumer.clone();
        let event_id = event_id.to_owned();
        self.store
            .read(move |conn| {
                conn.query_row(
                    "SELECT EXISTS (SELECT 1 FROM inbox_events \
                     WHERE consumer = ?1 AND event_id = ?2)",
                    params![&*consumer, event_id],
                    |row| row.get(0),
                )
            })
            .await
    }

    /// Deletes up to `batch` ids of this consumer processed before `before`; returns how many.
    /// Keep ids longer than the sender may redeliver (its relay's whole retry schedule): an id
    /// purged too early lets a late redelivery apply again.
    pub async fn purge_processed_before(
        &self,
        before: SystemTime,
        batch: usize,
    ) -> Result<u64, Error> {
        let consumer = self.consumer.clone();
        let before = to_unix_millis(before);
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        let deleted = self
            .store
            .write(move |tx| {
                tx.execute(
                    "DELETE FROM inbox_events WHERE rowid IN (SELECT rowid FROM inbox_events \
                     WHERE consumer = ?1 AND processed_at <= ?2 LIMIT ?3)",
                    params![&*consumer, before, batch],
                )
            })
            .await?;
        Ok(deleted as u64)
    }
}

fn record_id(conn: &Connection, consumer: &str, event_id: &str) -> rusqlite::Result<Receipt> {
    let inserted = conn
        .prepare_cached(
            "INSERT INTO inbox_events (consumer, event_id, processed_at) VALUES (?1, ?2, ?3) \
             ON CONFLICT (consumer, event_id) DO NOTHING",
        )?
        .execute(params![
            consumer,
            event_id,
            to_unix_millis(SystemTime::now())
        ])?;
    Ok(if inserted == 1 {
        Receipt::First
    } else {
        Receipt::Duplicate
    })
}
