#![doc = include_str!("../docs/admin.md")]

use std::fmt;
use std::future::Future;
use std::time::SystemTime;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};

use crate::error::Error;
use crate::fingerprint::Fingerprint;
#[cfg(feature = "outbox")]
use crate::outbox::{Outbox, OutboxBackend};
use crate::row::Columns;
use crate::store::{from_unix_millis, IdempotencyStore, SavedColumns};

// The backends' `AdminBackend`s live in their folders: `src/sqlite/admin.rs`, and
// `src/row_lock/admin.rs` over each SQL server's `admin_sql.rs`.

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

pub(crate) mod sealed {
    /// Only this crate's stores are [`AdminBackend`](super::AdminBackend)s.
    #[allow(unreachable_pub)]
    pub trait Sealed {}
}

/// The queries on idempotency records that [`Admin`] needs from a store, beyond
/// [`IdempotencyStore`] (whose `purge_expired_step` it uses). Each backend implements them with its
/// own SQL; [`Admin`] is written once over them.
///
/// Sealed: implemented by this crate's stores only (what they return, [`RecordInfo`] and
/// [`RecordCounts`], is built from the crate's own tables).
pub trait AdminBackend: IdempotencyStore + sealed::Sealed {
    /// The record of `(tenant, operation, key)`, expired or not; the body only if `with_body`.
    fn inspect_record(
        &self,
        tenant: &str,
        operation: &str,
        key: &str,
        with_body: bool,
    ) -> impl Future<Output = Result<Option<RecordInfo>, Error>> + Send;

    /// Deletes the record of `(tenant, operation, key)`; whether one existed.
    fn delete_record(
        &self,
        tenant: &str,
        operation: &str,
        key: &str,
    ) -> impl Future<Output = Result<bool, Error>> + Send;

    /// Counts the records `filter` selects, by state.
    fn count_records(
        &self,
        filter: &RecordFilter,
    ) -> impl Future<Output = Result<RecordCounts, Error>> + Send;
}

impl<S: AdminBackend> Admin<S> {
    /// The record of `(tenant, operation, key)`, expired or not; the body only if `with_body`
    /// (it is not even read otherwise: it may be large or personal).
    pub async fn inspect(
        &self,
        tenant: &str,
        operation: &str,
        key: &str,
        with_body: bool,
    ) -> Result<Option<RecordInfo>, Error> {
        self.store
            .inspect_record(tenant, operation, key, with_body)
            .await
    }

    /// Deletes the record of `(tenant, operation, key)`: the next request with that key runs
    /// the handler again (the business rows it created stay). Returns whether one existed.
    ///
    /// A request holding that scope right now finishes first (SQLite: the delete waits for
    /// the writer; PostgreSQL: for the record's row lock). The first request for a key is not
    /// seen on PostgreSQL while it runs (its reservation is not committed): nothing is
    /// deleted, and its record appears when it commits.
    pub async fn delete(&self, tenant: &str, operation: &str, key: &str) -> Result<bool, Error> {
        self.store.delete_record(tenant, operation, key).await
    }

    /// Counts records by state.
    pub async fn counts(&self, filter: &RecordFilter) -> Result<RecordCounts, Error> {
        self.store.count_records(filter).await
    }

    /// Deletes every expired record, in batches of `batch` (each its own short transaction);
    /// returns how many. After each batch but the last it pauses four times as long as the
    /// batch took, so that a purge takes at most a fifth of the store's time from the requests
    /// it serves meanwhile: a million records take minutes on a busy SQLite file, not seconds.
    /// On SQLite a batch's deletes hold the one writer while they run: keep batches small (a
    /// few hundred) on a store that serves requests.
    pub async fn purge_expired(&self, batch: usize) -> Result<u64, Error> {
        crate::store::purge_expired_paced(&self.store, SystemTime::now(), batch).await
    }
}

#[cfg(feature = "outbox")]
impl<S: OutboxBackend> Admin<S> {
    /// The outbox of this database, without creating its table: its counts, events, dead
    /// letters and requeues ([`Outbox::counts`], [`Outbox::event`], [`Outbox::dead_letters`],
    /// [`Outbox::requeue`], [`Outbox::requeue_all_dead`]). Those fail if the database has no
    /// outbox.
    pub fn outbox(&self) -> Outbox<S> {
        Outbox::existing(&self.store)
    }
}

impl<S: crate::steps::StepStore> Admin<S> {
    /// Step-by-step keys in progress with `status`, oldest change first, at most `limit`:
    /// [`InDoubt`](crate::steps::ProgressStatus::InDoubt) keys wait for [`resolve_steps`](Self::resolve_steps),
    /// [`Dead`](crate::steps::ProgressStatus::Dead) ones are the completer's dead letters.
    /// A row that cannot be read is skipped (logged at error level and counted).
    pub async fn keys_in_progress(
        &self,
        status: crate::steps::ProgressStatus,
        limit: usize,
    ) -> Result<Vec<crate::steps::Progress>, Error> {
        let query = crate::steps::ProgressQuery::new(status, limit);
        Ok(self.store.progress(&query).await?.keys)
    }

    /// Settles a key in doubt (or a dead letter) of `(tenant, operation, key)` (the key as
    /// [`keys_in_progress`](Self::keys_in_progress) lists it): the foreign step at `seq` (its
    /// position, as listed and logged; `None` for a dead letter) is called again or taken as
    /// done with the given result, and the key is free to be resumed by the next retry or the
    /// completer, under a new generation (an earlier owner can commit nothing more).
    ///
    /// Refused, changing nothing, for a key that is running
    /// ([`Settled::Running`](crate::steps::Settled::Running): its owner may be in the middle
    /// of a call) and for a `seq` that is not a step's intent
    /// ([`Settled::NoIntent`](crate::steps::Settled::NoIntent)).
    pub async fn resolve_steps(
        &self,
        tenant: &str,
        operation: &str,
        key: &str,
        seq: Option<u32>,
        resolution: &crate::steps::Resolution,
    ) -> Result<crate::steps::Settled, Error> {
        let key = crate::key::IdempotencyKey::from_unquoted(key)
            .map_err(|e| Error::Corrupt(format!("idempotency key: {e}")))?;
        let scope = crate::store::Scope::new(tenant, operation, key);
        self.store
            .resolve(&scope, seq, resolution, SystemTime::now())
            .await
    }

    /// Deletes up to `batch` step-by-step keys left running past their expiry (see
    /// [`StepStore::purge_progress`](crate::steps::StepStore::purge_progress)); returns how
    /// many. Keys in doubt or dead are never purged.
    pub async fn purge_progress(&self, batch: usize) -> Result<u64, Error> {
        self.store.purge_progress(SystemTime::now(), batch).await
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

impl RecordCounts {
    /// The counts as a backend's `count(*)` columns give them.
    pub(crate) fn from_columns(live: i64, expired: i64) -> Self {
        RecordCounts {
            live: u64::try_from(live).unwrap_or(0),
            expired: u64::try_from(expired).unwrap_or(0),
        }
    }
}

/// The columns [`Admin::inspect`] reads, without the body unless asked.
pub(crate) struct RawRecord {
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
    /// A record's columns, in the order `inspect` selects them: `fingerprint_version,
    /// fingerprint, status, headers, length(body), body (or NULL), created_at, expires_at`.
    pub(crate) fn read<R: Columns + ?Sized>(row: &R) -> Result<RawRecord, R::Error> {
        Ok(RawRecord {
            version: row.required_int(0, "fingerprint version")?,
            digest: row.required_bytes(1, "fingerprint")?,
            status: row.required_int(2, "status")?,
            headers: row.required_text(3, "headers")?,
            body_len: row.required_int(4, "body")?,
            body: row.bytes(5)?,
            created_at: row.required_big_int(6, "created_at")?,
            expires_at: row.required_big_int(7, "expires_at")?,
        })
    }

    /// The record as shown, checking what was read.
    pub(crate) fn into_info(
        self,
        tenant: &str,
        operation: &str,
        key: &str,
    ) -> Result<RecordInfo, Error> {
        let SavedColumns {
            fingerprint,
            status,
            headers,
        } = SavedColumns::decode(self.version, &self.digest, self.status, &self.headers)?;
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
            fingerprint,
            body_len: usize::try_from(self.body_len).unwrap_or(0),
            body: self.body.map(Bytes::from),
        })
    }
}
