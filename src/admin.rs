//! Operations on a store, as library calls: inspect or delete one record, count records by
//! state, purge expired ones, and (feature `outbox`) count, list and requeue dead-lettered
//! events. `cargo run --example admin -- --help` is a command-line tool over these calls.
//!
//! [`Admin`] is one type per backend (`Admin<SqliteStore>` here); the PostgreSQL store gets its
//! own `impl` with the same calls.
//!
//! ```no_run
//! # async fn run() -> Result<(), tower_idempotency::Error> {
//! use tower_idempotency::admin::{Admin, RecordFilter};
//! use tower_idempotency::store::sqlite::SqliteStore;
//!
//! let admin = Admin::new(SqliteStore::open("orders.db").await?);
//! if let Some(record) = admin.inspect("shop-a", "create_order", "k1", false).await? {
//!     println!("{:?} {} expires {:?}", record.state, record.status, record.expires_at);
//! }
//! let counts = admin.counts(&RecordFilter::default()).await?;
//! println!("{} live, {} expired", counts.live, counts.expired);
//! let purged = admin.purge_expired(1000).await?;
//! # let _ = purged; Ok(()) }
//! ```
//!
//! Records are never shown with their body unless asked (`with_body`): saved responses may hold
//! personal data.

use std::fmt;
use std::time::SystemTime;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use rusqlite::{params, OptionalExtension};

use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::response::SavedResponse;
use crate::store::sqlite::SqliteStore;
use crate::store::{from_unix_millis, to_unix_millis, IdempotencyStore};

/// Administrative calls on a store; see the [module docs](self).
#[derive(Clone)]
pub struct Admin<S> {
    store: S,
}

impl<S: fmt::Debug> fmt::Debug for Admin<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Admin").field("store", &self.store).finish()
    }
}

impl<S> Admin<S> {
    /// Administrative calls on `store`.
    pub fn new(store: S) -> Self {
        Admin { store }
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }
}

/// Whether a record still counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordState {
    /// Replayed to retries until `expires_at`.
    Live,
    /// Past `expires_at`: treated as absent, removed by the next purge (or by the next request
    /// with the same key).
    Expired,
}

impl RecordState {
    /// `live` or `expired`.
    pub fn as_str(self) -> &'static str {
        match self {
            RecordState::Live => "live",
            RecordState::Expired => "expired",
        }
    }
}

impl fmt::Display for RecordState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One record, as [`Admin::inspect`] shows it.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RecordInfo {
    /// The tenant.
    pub tenant: String,
    /// The operation.
    pub operation: String,
    /// The idempotency key.
    pub key: String,
    /// Live or expired.
    pub state: RecordState,
    /// The saved response's status.
    pub status: StatusCode,
    /// The saved (replayed) headers.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// When the record was saved.
    pub created_at: SystemTime,
    /// When it stops counting.
    pub expires_at: SystemTime,
    /// The request's fingerprint (a digest of the canonical payload, never the payload).
    pub fingerprint: Fingerprint,
    /// The saved body's length in bytes.
    pub body_len: usize,
    /// The saved body, only if asked for.
    pub body: Option<Bytes>,
}

/// Which records [`Admin::counts`] counts: all by default.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct RecordFilter {
    /// Only this tenant's.
    pub tenant: Option<String>,
    /// Only this operation's.
    pub operation: Option<String>,
}

impl RecordFilter {
    /// Only this tenant's records.
    pub fn tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant = Some(tenant.into());
        self
    }

    /// Only this operation's records.
    pub fn operation(mut self, operation: impl Into<String>) -> Self {
        self.operation = Some(operation.into());
        self
    }
}

/// Records by state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordCounts {
    /// Live records.
    pub live: u64,
    /// Expired records not purged yet.
    pub expired: u64,
}

/// The columns [`Admin::inspect`] reads, without the body unless asked.
struct RawRecord {
    version: i64,
    digest: Vec<u8>,
    status: i64,
    headers: String,
    body_len: i64,
    body: Option<Vec<u8>>,
    created_at: i64,
    expires_at: i64,
}

impl Admin<SqliteStore> {
    /// The record of `(tenant, operation, key)`, expired or not; the body only if `with_body`.
    pub async fn inspect(
        &self,
        tenant: &str,
        operation: &str,
        key: &str,
        with_body: bool,
    ) -> Result<Option<RecordInfo>, Error> {
        let scope = (tenant.to_owned(), operation.to_owned(), key.to_owned());
        let lookup = scope.clone();
        let raw = self
            .store
            .read(move |conn| {
                // The body is not even read unless asked for: it may be large or personal.
                let body_column = if with_body { "body" } else { "NULL" };
                conn.query_row(
                    &format!(
                        "SELECT fingerprint_version, fingerprint, status, headers, length(body), \
                         {body_column}, created_at, expires_at FROM idempotency_records \
                         WHERE tenant = ?1 AND operation = ?2 AND idempotency_key = ?3"
                    ),
                    params![lookup.0, lookup.1, lookup.2],
                    |row| {
                        Ok(RawRecord {
                            version: row.get(0)?,
                            digest: row.get(1)?,
                            status: row.get(2)?,
                            headers: row.get(3)?,
                            body_len: row.get(4)?,
                            body: row.get(5)?,
                            created_at: row.get(6)?,
                            expires_at: row.get(7)?,
                        })
                    },
                )
                .optional()
            })
            .await?;
        let Some(raw) = raw else {
            return Ok(None);
        };
        let version =
            u16::try_from(raw.version).map_err(|_| Error::Corrupt("fingerprint version".into()))?;
        let digest: [u8; 32] = raw
            .digest
            .try_into()
            .map_err(|_| Error::Corrupt("fingerprint length".into()))?;
        let status = u16::try_from(raw.status)
            .ok()
            .and_then(|s| StatusCode::from_u16(s).ok())
            .ok_or_else(|| Error::Corrupt("status".into()))?;
        let headers = SavedResponse::decode_headers(&raw.headers).map_err(Error::Corrupt)?;
        let expires_at = from_unix_millis(raw.expires_at);
        Ok(Some(RecordInfo {
            tenant: scope.0,
            operation: scope.1,
            key: scope.2,
            state: if expires_at > SystemTime::now() {
                RecordState::Live
            } else {
                RecordState::Expired
            },
            status,
            headers,
            created_at: from_unix_millis(raw.created_at),
            expires_at,
            fingerprint: Fingerprint::new(version, digest),
            body_len: usize::try_from(raw.body_len).unwrap_or(0),
            body: raw.body.map(Bytes::from),
        }))
    }

    /// Deletes the record of `(tenant, operation, key)`: the next request with that key runs
    /// the handler again (the business rows it created stay). Returns whether one existed.
    ///
    /// A request holding that scope right now finishes first (the delete waits for the writer).
    pub async fn delete(&self, tenant: &str, operation: &str, key: &str) -> Result<bool, Error> {
        let scope = (tenant.to_owned(), operation.to_owned(), key.to_owned());
        let deleted = self
            .store
            .write(move |tx| {
                tx.execute(
                    "DELETE FROM idempotency_records \
                     WHERE tenant = ?1 AND operation = ?2 AND idempotency_key = ?3",
                    params![scope.0, scope.1, scope.2],
                )
            })
            .await?;
        Ok(deleted > 0)
    }

    /// Counts records by state.
    pub async fn counts(&self, filter: &RecordFilter) -> Result<RecordCounts, Error> {
        let filter = filter.clone();
        let now = to_unix_millis(SystemTime::now());
        let (live, expired) = self
            .store
            .read(move |conn| {
                conn.query_row(
                    "SELECT count(*) FILTER (WHERE expires_at > ?1), \
                     count(*) FILTER (WHERE expires_at <= ?1) \
                     FROM idempotency_records \
                     WHERE (?2 IS NULL OR tenant = ?2) AND (?3 IS NULL OR operation = ?3)",
                    params![now, filter.tenant, filter.operation],
                    |row| Ok((row.get::<_, i64>(0)?, row.get::<_, i64>(1)?)),
                )
            })
            .await?;
        Ok(RecordCounts {
            live: u64::try_from(live).unwrap_or(0),
            expired: u64::try_from(expired).unwrap_or(0),
        })
    }

    /// Deletes every expired record, in batches of `batch` (each its own short transaction, so
    /// requests are not held up); returns how many.
    pub async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
        let batch = batch.max(1);
        let now = SystemTime::now();
        let mut total = 0;
        loop {
            let deleted = self.store.purge_expired(now, batch).await?;
            total += deleted;
            if deleted < batch as u64 {
                return Ok(total);
            }
        }
    }
}

#[cfg(feature = "outbox")]
mod outbox {
    use super::Admin;
    use crate::error::Error;
    use crate::outbox::sqlite::SqliteOutbox;
    use crate::outbox::{EventInfo, OutboxCounts};
    use crate::store::sqlite::SqliteStore;

    impl Admin<SqliteStore> {
        /// Outbox events by state (see [`SqliteOutbox::counts`]). Fails if the database has no
        /// outbox.
        pub async fn outbox_counts(&self) -> Result<OutboxCounts, Error> {
            self.outbox().counts().await
        }

        /// One outbox event, by id.
        pub async fn event(&self, id: &str) -> Result<Option<EventInfo>, Error> {
            self.outbox().event(id).await
        }

        /// Dead-lettered events, oldest first, at most `limit`.
        pub async fn dead_letters(&self, limit: usize) -> Result<Vec<EventInfo>, Error> {
            self.outbox().dead_letters(limit).await
        }

        /// Requeues one dead-lettered event: due at once, attempts reset. Returns `false` if
        /// no dead event has this id.
        pub async fn requeue(&self, id: &str) -> Result<bool, Error> {
            self.outbox().requeue(id).await
        }

        /// Requeues every dead-lettered event; returns how many.
        pub async fn requeue_all_dead(&self) -> Result<u64, Error> {
            self.outbox().requeue_dead().await
        }

        /// The outbox of this database, without creating its table.
        fn outbox(&self) -> SqliteOutbox {
            SqliteOutbox::existing(&self.store)
        }
    }
}
