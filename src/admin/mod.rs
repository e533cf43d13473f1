//! Operations on a store, as library calls: inspect or delete one record, count records by
//! state, purge expired ones, and (feature `outbox`) count, list and requeue dead-lettered
//! events. `cargo run --example admin -- --help` is a command-line tool over these calls.
//!
//! [`Admin`] has the same calls for each backend: `Admin<SqliteStore>` (feature `sqlite`) and
//! `Admin<PostgresStore>` (feature `postgres`).
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
//! On PostgreSQL, open the store without letting it create or migrate tables (an admin tool
//! should change nothing it was not asked to), then make the same calls:
//!
//! ```no_run
//! # async fn run() -> Result<(), tower_idempotency::Error> {
//! use tower_idempotency::admin::{Admin, RecordFilter};
//! use tower_idempotency::store::postgres::PostgresStore;
//!
//! let store = PostgresStore::builder("postgres://app@127.0.0.1/shop".parse()?)
//!     .create_schema(false)
//!     .max_connections(2)
//!     .connect()
//!     .await?;
//! let admin = Admin::new(store);
//! let counts = admin
//!     .counts(&RecordFilter::default().tenant("shop-a"))
//!     .await?;
//! let deleted = admin.delete("shop-a", "create_order", "k1").await?;
//! # let _ = (counts, deleted); Ok(()) }
//! ```
//!
//! Records are never shown with their body unless asked (`with_body`): saved responses may hold
//! personal data.

use std::fmt;
use std::time::SystemTime;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};

use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::response::SavedResponse;
use crate::store::{from_unix_millis, IdempotencyStore};

#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

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

impl<S: IdempotencyStore> Admin<S> {
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

impl RawRecord {
    /// The record as shown, checking what was read.
    fn into_info(self, tenant: &str, operation: &str, key: &str) -> Result<RecordInfo, Error> {
        let version = u16::try_from(self.version)
            .map_err(|_| Error::Corrupt("fingerprint version".into()))?;
        let digest: [u8; 32] = self
            .digest
            .try_into()
            .map_err(|_| Error::Corrupt("fingerprint length".into()))?;
        let status = u16::try_from(self.status)
            .ok()
            .and_then(|s| StatusCode::from_u16(s).ok())
            .ok_or_else(|| Error::Corrupt("status".into()))?;
        let headers = SavedResponse::decode_headers(&self.headers).map_err(Error::Corrupt)?;
        let expires_at = from_unix_millis(self.expires_at);
        Ok(RecordInfo {
            tenant: tenant.to_owned(),
            operation: operation.to_owned(),
            key: key.to_owned(),
            state: if expires_at > SystemTime::now() {
                RecordState::Live
            } else {
                RecordState::Expired
            },
            status,
            headers,
            created_at: from_unix_millis(self.created_at),
            expires_at,
            fingerprint: Fingerprint::new(version, digest),
            body_len: usize::try_from(self.body_len).unwrap_or(0),
            body: self.body.map(Bytes::from),
        })
    }
}
