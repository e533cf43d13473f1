//! The store: the one seam between the request flow and a database.
//!
//! A backend implements four verbs: [`IdempotencyStore::lookup`] (read-only fast path),
//! [`IdempotencyStore::begin`] (open the write transaction and re-check),
//! [`Reservation::commit`] (save the record and commit together with the handler's rows)
//! and [`IdempotencyStore::purge_expired`]. The flow calls them through two provided methods
//! a backend may override to save trips between threads or round trips:
//! [`IdempotencyStore::lookup_then_begin_and_run`] for a request's first attempt and
//! [`IdempotencyStore::begin_and_run`] when it runs again. Everything backend-specific
//! (connections, SQL dialect, locking) stays behind them; the handle the handler uses for its
//! own rows is the backend's [`Reservation::Handle`].

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::response::SavedResponse;

#[cfg(feature = "_sql-store")]
pub(crate) mod columns;
#[cfg(feature = "_sql-store")]
pub(crate) mod retry_share;

// Each store lives in its backend's folder (`src/sqlite/`, `src/tokio_postgres/`, `src/sqlx/`);
// its one public path is here.
#[cfg(feature = "sqlite")]
pub use crate::sqlite::store as sqlite;
#[cfg(feature = "sqlx-mysql")]
pub use crate::sqlx::mysql::store as sqlx_mysql;
#[cfg(feature = "sqlx-postgres")]
pub use crate::sqlx::postgres::store as sqlx_postgres;
#[cfg(feature = "sqlx-sqlite")]
pub use crate::sqlx::sqlite::store as sqlx_sqlite;
#[cfg(feature = "tokio-postgres")]
pub use crate::tokio_postgres::store as tokio_postgres;

/// The settings of the stores on the shared SQL engine (PostgreSQL on either driver, MySQL,
/// SQLite on sqlx: any of their features turns on `_row-lock-store`), one type for all of
/// them.
#[cfg(feature = "_row-lock-store")]
pub use crate::row_lock::{replay_check::ReplayCheck, reserve::Isolation};

#[cfg(feature = "_row-lock-store")]
pub(crate) use columns::record_row;
#[cfg(feature = "_sql-store")]
pub(crate) use columns::SavedColumns;

/// The unique scope of a record: `(tenant, operation, key)`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Scope {
    /// The tenant, from the server's authentication.
    pub tenant: Arc<str>,
    /// The operation name given to the layer (`create_order`).
    pub operation: Arc<str>,
    /// The client's idempotency key.
    pub key: IdempotencyKey,
}

/// A saved record, as read back from the store.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct StoredRecord {
    /// The fingerprint of the request that created it.
    pub fingerprint: Fingerprint,
    /// The response to replay.
    pub response: SavedResponse,
    /// When it was saved.
    pub created_at: SystemTime,
    /// When it stops counting (an expired record is treated as absent).
    pub expires_at: SystemTime,
}

/// What [`Reservation::commit`] saves.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct NewRecord {
    /// The fingerprint of the request.
    pub fingerprint: Fingerprint,
    /// The response to replay.
    pub response: SavedResponse,
    /// Now.
    pub created_at: SystemTime,
    /// `created_at` plus the retention.
    pub expires_at: SystemTime,
}

impl Scope {
    /// The scope of `key` for `operation` of `tenant`.
    pub fn new(
        tenant: impl Into<Arc<str>>,
        operation: impl Into<Arc<str>>,
        key: IdempotencyKey,
    ) -> Self {
        Scope {
            tenant: tenant.into(),
            operation: operation.into(),
            key,
        }
    }
}

impl StoredRecord {
    /// A record as a store read it back (a store of your own builds one from its row).
    pub fn new(
        fingerprint: Fingerprint,
        response: SavedResponse,
        created_at: SystemTime,
        expires_at: SystemTime,
    ) -> Self {
        StoredRecord {
            fingerprint,
            response,
            created_at,
            expires_at,
        }
    }
}

impl NewRecord {
    /// The record to save for a request (what the layer gives
    /// [`Reservation::commit`]; also for tests of a store of your own).
    pub fn new(
        fingerprint: Fingerprint,
        response: SavedResponse,
        created_at: SystemTime,
        expires_at: SystemTime,
    ) -> Self {
        NewRecord {
            fingerprint,
            response,
            created_at,
            expires_at,
        }
    }
}

/// The outcome of [`IdempotencyStore::begin`].
#[derive(Debug)]
pub enum Begin<T> {
    /// No live record exists: the write transaction is open and the scope is reserved until
    /// it commits or rolls back.
    Reserved(T),
    /// A live record was found inside the write transaction (a duplicate committed first).
    /// The transaction has already been closed.
    Existing(StoredRecord),
}

/// The outcome of [`IdempotencyStore::begin_and_run`] and
/// [`IdempotencyStore::lookup_then_begin_and_run`].
#[derive(Debug)]
pub enum RunOutcome<T> {
    /// The read-only lookup found a live record
    /// ([`lookup_then_begin_and_run`](IdempotencyStore::lookup_then_begin_and_run) only): no
    /// transaction was opened and the work did not run.
    Found {
        /// The record.
        record: StoredRecord,
    },
    /// A live record was found (see [`Begin::Existing`]); the work did not run.
    Existing {
        /// The record.
        record: StoredRecord,
        /// How long the request waited for the write lock.
        waited: Duration,
    },
    /// The scope was reserved and the work ran with the transaction.
    Ran {
        /// What the work returned.
        output: T,
        /// How long the request waited for the write lock.
        waited: Duration,
    },
}

/// A storage backend for idempotency records.
///
/// Implementations must guarantee that between [`begin`](Self::begin) returning
/// [`Begin::Reserved`] and the transaction's commit or rollback, no other `begin` for the same
/// scope returns `Reserved`, and that [`Reservation::commit`] makes the handler's writes and
/// the record durable together or not at all.
pub trait IdempotencyStore: Clone + Send + Sync + 'static {
    /// The reserved scope with its open write transaction, returned by [`begin`](Self::begin):
    /// what the layer commits or rolls back. (The handler gets its
    /// [`handle`](Reservation::handle), the store's `*Handle` type.)
    type Reservation: Reservation;

    /// Reads a live (unexpired) record without taking the write lock: the replay fast path.
    fn lookup(
        &self,
        scope: &Scope,
        now: SystemTime,
    ) -> impl Future<Output = Result<Option<StoredRecord>, Error>> + Send;

    /// Opens the write transaction for `scope`, waiting at most `lock_timeout` for the write
    /// lock ([`Error::Busy`] past it), and re-checks for a live record inside it. An expired
    /// record found here is deleted in the same transaction.
    fn begin(
        &self,
        scope: &Scope,
        lock_timeout: Duration,
        now: SystemTime,
    ) -> impl Future<Output = Result<Begin<Self::Reservation>, Error>> + Send;

    /// [`begin`](Self::begin), then, if the scope was reserved, `work` with the transaction:
    /// everything the request does while it holds the transaction (run the handler, commit or
    /// roll back). `work` must end the transaction.
    ///
    /// The default awaits `work` in place. A store may run it where its transaction lives
    /// instead: the SQLite store polls it on its writer thread, so that the handler's
    /// statements and the commit need no round trip between threads. Dropping the returned
    /// future cancels `work` (dropping it rolls the transaction back).
    fn begin_and_run<W, F>(
        &self,
        scope: &Scope,
        lock_timeout: Duration,
        now: SystemTime,
        work: W,
    ) -> impl Future<Output = Result<RunOutcome<F::Output>, Error>> + Send
    where
        W: FnOnce(Self::Reservation) -> F + Send + 'static,
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        begin_and_run_in_place(self, scope, lock_timeout, now, work)
    }

    /// [`lookup`](Self::lookup), then, when it finds no live record,
    /// [`begin_and_run`](Self::begin_and_run): a request's first attempt. A record the lookup
    /// finds is [`RunOutcome::Found`]; a failing lookup is only logged (the begin reads again).
    ///
    /// The default does the two one after the other. A store may do them in one trip: the
    /// SQLite store queues the begin from the reader thread that found nothing, so that the
    /// request is woken once.
    fn lookup_then_begin_and_run<W, F>(
        &self,
        scope: &Scope,
        lock_timeout: Duration,
        now: SystemTime,
        work: W,
    ) -> impl Future<Output = Result<RunOutcome<F::Output>, Error>> + Send
    where
        W: FnOnce(Self::Reservation) -> F + Send + 'static,
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        lookup_then(self, scope, now, move || {
            self.begin_and_run(scope, lock_timeout, now, work)
        })
    }

    /// This store with its wait for a duplicate in flight bounded by the layer's in-flight
    /// `policy`: a store whose reservation waits on the key's row (held by a duplicate running
    /// on another instance) bounds that wait by the policy's bound and reports its end as [`Error::InFlight`]; every
    /// other wait keeps the lock timeout. The layer calls it for each request under
    /// [`InFlight::Reject`](crate::InFlight::Reject) and
    /// [`InFlight::WaitUpTo`](crate::InFlight::WaitUpTo), never under the default
    /// [`InFlight::Wait`](crate::InFlight::Wait).
    ///
    /// The default returns the store unchanged (the duplicate then waits up to the lock
    /// timeout). The PostgreSQL and MySQL stores override it; the SQLite store keeps the
    /// default: its reservation is the file's single write lock, not a row lock.
    fn bound_duplicate_wait(self, policy: crate::InFlight) -> Self {
        let _ = policy;
        self
    }

    /// Deletes up to `batch` records that expired at `now` or before; returns how many it
    /// deleted. The crate's stores delete as many step-by-step keys left running past their
    /// expiry too, with their steps and saved requests (see
    /// [`StepStore::purge_progress`](crate::steps::StepStore::purge_progress)), and count them.
    ///
    /// Fewer than `batch` need not mean that none is left: a store may look at a bounded part
    /// of its records per call (the SQLite store does). To delete every expired record, call
    /// [`purge_expired_step`](Self::purge_expired_step) until it is done, as
    /// [`continuously_purge_expired`] does.
    fn purge_expired(
        &self,
        now: SystemTime,
        batch: usize,
    ) -> impl Future<Output = Result<u64, Error>> + Send;

    /// One call of a purge of every record expired at `now`: deletes up to `batch` of them, as
    /// [`purge_expired`](Self::purge_expired) does, and says whether the purge is
    /// [`done`](PurgeStep::done). Call it with the same `now` until it is.
    ///
    /// The default calls `purge_expired` and is done when that deleted fewer than `batch`. A
    /// store whose calls look at a bounded part of its records overrides it: the SQLite store
    /// is done when its walk along the records' key has reached the end of the table.
    fn purge_expired_step(
        &self,
        now: SystemTime,
        batch: usize,
    ) -> impl Future<Output = Result<PurgeStep, Error>> + Send {
        async move {
            let deleted = self.purge_expired(now, batch).await?;
            Ok(PurgeStep {
                deleted,
                done: deleted < batch as u64,
            })
        }
    }
}

/// What one call of [`IdempotencyStore::purge_expired_step`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PurgeStep {
    /// How many expired records it deleted.
    pub deleted: u64,
    /// Whether the purge is over: every record that had expired at its `now` when it began is
    /// deleted. `false`: call again.
    pub done: bool,
}

/// [`IdempotencyStore::begin_and_run`] in place: `begin`, then `work` awaited by the caller.
pub(crate) async fn begin_and_run_in_place<St, W, F>(
    store: &St,
    scope: &Scope,
    lock_timeout: Duration,
    now: SystemTime,
    work: W,
) -> Result<RunOutcome<F::Output>, Error>
where
    St: IdempotencyStore,
    W: FnOnce(St::Reservation) -> F,
    F: Future,
{
    run_after_begin(|| store.begin(scope, lock_timeout, now), work).await
}

/// `begin`, then `work` awaited by the caller: [`begin_and_run_in_place`] with the begin given.
///
/// `begin` makes the begin's future here rather than being that future: a future given as an
/// argument is kept for the whole run, beside the work's, where one made here shares its
/// space with the work's (they are never alive together).
pub(crate) async fn run_after_begin<R, B, W, F>(
    begin: impl FnOnce() -> B,
    work: W,
) -> Result<RunOutcome<F::Output>, Error>
where
    B: Future<Output = Result<Begin<R>, Error>>,
    W: FnOnce(R) -> F,
    F: Future,
{
    let started = std::time::Instant::now();
    match begin().await? {
        Begin::Existing(record) => Ok(RunOutcome::Existing {
            record,
            waited: started.elapsed(),
        }),
        Begin::Reserved(transaction) => {
            let waited = started.elapsed();
            let output = work(transaction).await;
            Ok(RunOutcome::Ran { output, waited })
        }
    }
}

/// [`IdempotencyStore::lookup`], then `begin` when it finds no live record: what
/// [`IdempotencyStore::lookup_then_begin_and_run`] does one step after the other.
pub(crate) async fn lookup_then<St, T, B, Fut>(
    store: &St,
    scope: &Scope,
    now: SystemTime,
    begin: B,
) -> Result<RunOutcome<T>, Error>
where
    St: IdempotencyStore,
    B: FnOnce() -> Fut,
    Fut: Future<Output = Result<RunOutcome<T>, Error>>,
{
    if let Some(record) = fast_path_lookup(store, scope, now).await {
        return Ok(RunOutcome::Found { record });
    }
    begin().await
}

/// The fast path's read: the live record [`IdempotencyStore::lookup`] finds, if any. A
/// failing read is only logged: the begin that follows reads again, authoritatively.
pub(crate) async fn fast_path_lookup<St: IdempotencyStore>(
    store: &St,
    scope: &Scope,
    now: SystemTime,
) -> Option<StoredRecord> {
    match store.lookup(scope, now).await {
        Ok(found) => found,
        Err(error) => {
            tracing::warn!(%error, "idempotency fast-path lookup failed");
            None
        }
    }
}

/// A reserved scope and the open write transaction that holds it: the layer's side, which
/// saves the record and commits ([`commit`](Self::commit)) or rolls back; the handler writes
/// through its [`handle`](Self::handle). Dropping it without calling `commit` rolls it back: the rollback is the transaction's `Drop`, so a panic, an error or a dropped request
/// future can never leave it open or half-committed.
pub trait Reservation: Send + 'static {
    /// The handle put in the request extensions; the handler writes its rows through it, in
    /// this same transaction. Once the transaction has ended, the handle refuses work.
    type Handle: Clone + Send + Sync + 'static;

    /// A new handle on this transaction.
    fn handle(&self) -> Self::Handle;

    /// Saves `record` for the reserved scope and commits it together with everything the
    /// handler wrote. Returns only once the commit is durable (per the store's durability
    /// setting).
    fn commit(self, record: NewRecord) -> impl Future<Output = Result<(), Error>> + Send;

    /// Rolls back everything written in the transaction and waits until that is done.
    ///
    /// A store whose handle saw one of the handler's statements fail with a serialization
    /// conflict (the database rolled the transaction back under the handler) returns that
    /// error, for which [`Error::is_serialization_conflict`] is true, after rolling back: the
    /// layer then runs the request again, as after a commit that conflicted.
    fn rollback(self) -> impl Future<Output = Result<(), Error>> + Send;
}

/// Purges expired records every `period`, in batches of `batch`, forever.
///
/// The library never spawns background tasks: spawn this future yourself. After each batch
/// but a purge's last it pauses four times as long as the batch took, so that a purge takes at
/// most a fifth of the store's time from the requests it serves meanwhile. On SQLite a batch's
/// deletes hold the one writer while they run, so requests that arrive meanwhile wait for
/// them: keep batches small (a few hundred) on a busy store.
///
/// ```no_run
/// # #[cfg(feature = "sqlite")]
/// # async fn run() -> Result<(), tower_idempotency::Error> {
/// use std::time::Duration;
/// use tower_idempotency::store::{continuously_purge_expired, sqlite::SqliteStore};
///
/// let store = SqliteStore::open("orders.db").await?;
/// tokio::spawn(continuously_purge_expired(store.clone(), Duration::from_secs(60), 200));
/// # Ok(()) }
/// ```
pub async fn continuously_purge_expired<S: IdempotencyStore>(
    store: S,
    period: Duration,
    batch: usize,
) {
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        match purge_expired_paced(&store, SystemTime::now(), batch).await {
            Ok(deleted) => tracing::debug!(deleted, "purged expired idempotency records"),
            Err(error) => tracing::warn!(%error, "purging expired idempotency records failed"),
        }
    }
}

/// After each batch but its last, a purge pauses this many times as long as the batch took.
const PURGE_PAUSE_FACTOR: u32 = 4;

/// Deletes every record that expired at `now` or before, in batches of `batch`
/// ([`IdempotencyStore::purge_expired_step`] until it is done), pausing after each batch but
/// the last ([`PURGE_PAUSE_FACTOR`]); returns how many. Stops at the first error (what it
/// deleted until then stays deleted).
pub(crate) async fn purge_expired_paced<S: IdempotencyStore>(
    store: &S,
    now: SystemTime,
    batch: usize,
) -> Result<u64, Error> {
    let batch = batch.max(1);
    let mut total = 0;
    loop {
        let started = std::time::Instant::now();
        let step = store.purge_expired_step(now, batch).await?;
        total += step.deleted;
        if step.done {
            return Ok(total);
        }
        tracing::debug!(deleted = step.deleted, "purged a batch of expired records");
        tokio::time::sleep(started.elapsed() * PURGE_PAUSE_FACTOR).await;
    }
}

#[cfg(feature = "_sql-store")]
pub(crate) fn to_unix_millis(time: SystemTime) -> i64 {
    match time.duration_since(std::time::UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
        Err(_) => 0,
    }
}

/// The inverse of [`to_unix_millis`].
#[cfg(feature = "_sql-store")]
pub(crate) fn from_unix_millis(millis: i64) -> SystemTime {
    std::time::UNIX_EPOCH + Duration::from_millis(u64::try_from(millis).unwrap_or(0))
}
