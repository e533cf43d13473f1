//! What a database implements to hold step-by-step requests: [`StepStore`], and the rows it
//! reads and writes. [`Steps`](super::Steps), the layer and the [`Completer`](super::Completer)
//! are written once over it.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;

use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::store::{Scope, StoredRecord};

/// The request a key was first sent with, kept while the key is in progress so that the
/// [`Completer`](super::Completer) can run it again without the client. Deleted with the key's
/// progress when it finishes.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SavedRequest {
    /// `POST`, `PATCH`...
    pub method: String,
    /// The path and query.
    pub uri: String,
    /// The headers the handler may read (see [`SavedRequest::KEPT_HEADERS`]), encoded as the
    /// store keeps a response's headers.
    pub headers: String,
    /// The body as received.
    pub body: Bytes,
}

impl SavedRequest {
    /// A request as read back.
    pub fn new(method: String, uri: String, headers: String, body: Bytes) -> Self {
        SavedRequest {
            method,
            uri,
            headers,
            body,
        }
    }

    /// The request headers kept for the completer: what describes the body. Credentials are
    /// never kept (the tenant is part of the key's scope).
    pub const KEPT_HEADERS: [http::HeaderName; 2] =
        [http::header::CONTENT_TYPE, http::header::ACCEPT];
}

/// What [`acquire`](sealed::StepProtocol::acquire) is asked to do.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Claim {
    /// The key.
    pub scope: Scope,
    /// The fingerprint of the request that claims it.
    pub fingerprint: Fingerprint,
    /// The request, to keep for the completer; `None` when the completer claims (it only
    /// resumes keys that exist).
    pub request: Option<SavedRequest>,
    /// Who claims (unique per claim).
    pub owner: Arc<str>,
    /// Until when the claim holds, if it is granted.
    pub lease_until: SystemTime,
    /// Now.
    pub now: SystemTime,
    /// The completer's bound on its attempts: a claim by the completer counts one, and a key
    /// past it becomes a dead letter ([`Acquired::Dead`]). `None` for a client's request.
    pub max_attempts: Option<u32>,
    /// Until when the key's progress is kept if it is left running and nobody resumes it:
    /// [`StepStore::purge_progress`] deletes it after that (never a key in doubt or dead).
    /// Set by each claim that takes the key; the layer gives its records' time to live.
    pub expires_at: SystemTime,
    /// How long the claim may wait for a lock (the layer's lock timeout); past it the claim
    /// fails with an error [`Error::is_busy`] is true of.
    pub wait: Duration,
}

impl Claim {
    /// A client's claim of `scope` without its request, and no bound on attempts: set
    /// [`request`](Self::request) (a new key is only taken with it) and, for the completer,
    /// [`max_attempts`](Self::max_attempts). Its progress expires a day after `now` and its
    /// lock waits are bounded to 5 seconds unless [`expires_at`](Self::expires_at) and
    /// [`wait`](Self::wait) are set.
    pub fn new(
        scope: Scope,
        fingerprint: Fingerprint,
        owner: Arc<str>,
        lease_until: SystemTime,
        now: SystemTime,
    ) -> Self {
        Claim {
            scope,
            fingerprint,
            request: None,
            owner,
            lease_until,
            now,
            max_attempts: None,
            expires_at: now + DEFAULT_PROGRESS_TTL,
            wait: DEFAULT_WAIT,
        }
    }
}

/// [`Claim::new`]'s expiry of a key's progress.
const DEFAULT_PROGRESS_TTL: Duration = Duration::from_secs(24 * 60 * 60);
/// [`Claim::new`]'s and [`Lease::new`]'s bound on lock waits.
const DEFAULT_WAIT: Duration = Duration::from_secs(5);

/// How long an operator's call ([`StepStore::resolve`], [`StepStore::purge_progress`]) waits
/// for a lock.
#[cfg(feature = "_sql-store")]
pub(crate) const ADMIN_WAIT: Duration = DEFAULT_WAIT;

/// A new run id: 32 random hexadecimal digits, never reused (UUID v4). One life of a key
/// (from its first claim until it finishes, or its progress is deleted) has one.
#[cfg(feature = "_sql-store")]
pub(crate) fn new_run_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// The outcome of [`acquire`](sealed::StepProtocol::acquire).
#[derive(Debug)]
#[non_exhaustive]
pub enum Acquired {
    /// The key is this claim's, under `generation`: new (no steps) or resumed (the steps
    /// done or begun before, in order).
    Owned {
        /// The lease's generation: every commit of this claim checks it.
        generation: i64,
        /// The key's run id: created with the key's progress, kept across resumes and
        /// take-overs, new for every life of the key (after it finished and its record was
        /// deleted or expired, or its progress was purged). Part of every step key.
        run: String,
        /// The steps saved before, ordered by their position.
        steps: Vec<SavedStep>,
    },
    /// The key has finished: its record (replay it, or answer `409` on another payload).
    Completed(StoredRecord),
    /// The key is in progress with another payload.
    Mismatch,
    /// Another claim holds the key until `until` (a request still running).
    Held {
        /// When that lease ends.
        until: SystemTime,
    },
    /// A step's outcome is unknown and its policy leaves it to an operator.
    InDoubt,
    /// The completer gave up on the key (dead letter).
    Dead,
    /// There is nothing to resume (the completer's claim of a key that finished meanwhile).
    Gone,
}

/// A step as saved.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SavedStep {
    /// Its position among the key's steps, from 0.
    pub seq: u32,
    /// The name the handler gave it.
    pub name: String,
    /// Local or foreign.
    pub kind: StepKind,
    /// Its result as JSON (see `steps::Outcome`); `None` for a foreign step's intent.
    pub result: Option<String>,
}

impl SavedStep {
    /// A step as read back.
    pub fn new(seq: u32, name: String, kind: StepKind, result: Option<String>) -> Self {
        SavedStep {
            seq,
            name,
            kind,
            result,
        }
    }
}

/// Whether a step ran in a transaction of its own or called another service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepKind {
    /// Ran a closure in a transaction of its own.
    Local,
    /// Called another service.
    Foreign,
}

impl StepKind {
    /// As stored.
    pub fn as_str(self) -> &'static str {
        match self {
            StepKind::Local => "local",
            StepKind::Foreign => "foreign",
        }
    }

    /// From its stored form.
    pub fn parse(text: &str) -> Result<Self, Error> {
        match text {
            "local" => Ok(StepKind::Local),
            "foreign" => Ok(StepKind::Foreign),
            other => Err(Error::Corrupt(format!("step kind {other:?}"))),
        }
    }
}

/// The state of a key in progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressStatus {
    /// Running, or waiting for a retry or the completer.
    Running,
    /// A step's outcome is unknown and its policy leaves it to an operator
    /// ([`StepStore::resolve`]).
    InDoubt,
    /// The completer gave up after its bounded attempts (a dead letter).
    Dead,
}

impl ProgressStatus {
    /// As stored.
    pub fn as_str(self) -> &'static str {
        match self {
            ProgressStatus::Running => "running",
            ProgressStatus::InDoubt => "in_doubt",
            ProgressStatus::Dead => "dead",
        }
    }

    /// From its stored form.
    pub fn parse(text: &str) -> Result<Self, Error> {
        match text {
            "running" => Ok(ProgressStatus::Running),
            "in_doubt" => Ok(ProgressStatus::InDoubt),
            "dead" => Ok(ProgressStatus::Dead),
            other => Err(Error::Corrupt(format!("progress status {other:?}"))),
        }
    }
}

/// A claim granted by [`acquire`](sealed::StepProtocol::acquire): every commit under it checks that
/// the key is still in the same life (its run id) under this generation and running (and extends
/// the lease), and is refused with [`Error::LeaseLost`] once another claim took the key over, or it
/// was marked in doubt or dead, or an operator resolved it (each of which gives the key a new
/// generation), or its life ended (a new life starts again at generation 1, under another run id).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Lease {
    /// The key.
    pub scope: Scope,
    /// The key's run id when the claim was granted.
    pub run: String,
    /// The generation the claim was granted.
    pub generation: i64,
    /// The new end of the lease, set by each commit.
    pub until: SystemTime,
    /// Now.
    pub now: SystemTime,
    /// How long a commit may wait for a lock (the layer's lock timeout); past it the commit
    /// fails with an error [`Error::is_busy`] is true of, and nothing is written.
    pub wait: Duration,
}

impl Lease {
    /// The lease of `generation` of the life `run` on `scope`, to be moved to `until` by the
    /// next commit, its lock waits bounded to 5 seconds (set [`wait`](Self::wait) for another
    /// bound).
    pub fn new(
        scope: Scope,
        run: impl Into<String>,
        generation: i64,
        until: SystemTime,
        now: SystemTime,
    ) -> Self {
        Lease {
            scope,
            run: run.into(),
            generation,
            until,
            now,
            wait: DEFAULT_WAIT,
        }
    }
}

/// A step to write under a [`Lease`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct StepRow {
    /// Its position.
    pub seq: u32,
    /// Its name.
    pub name: String,
    /// Local or foreign.
    pub kind: StepKind,
    /// Its result as JSON; `None` writes a foreign step's intent.
    pub result: Option<String>,
}

impl StepRow {
    /// A step to write: its intent (`result` `None`) or its result.
    pub fn new(seq: u32, name: String, kind: StepKind, result: Option<String>) -> Self {
        StepRow {
            seq,
            name,
            kind,
            result,
        }
    }
}

/// Checks `step`, about to be written at its position, against the step the key saved there
/// (`name`, `kind` as stored, `done`: with its result): only the intent of the same step may
/// be written again or settled with its result. Anything else is [`Error::StepsChanged`].
#[cfg(feature = "_sql-store")]
pub(crate) fn check_saved_step(
    step: &StepRow,
    name: &str,
    kind: &str,
    done: bool,
) -> Result<(), Error> {
    if name == step.name && kind == step.kind.as_str() && !done {
        return Ok(());
    }
    Err(Error::StepsChanged {
        position: step.seq,
        saved: format!("{kind} {name}{}", if done { " (done)" } else { "" }),
    })
}

/// A key in progress, as listed for the completer and for operators.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Progress {
    /// The key.
    pub scope: Scope,
    /// The fingerprint of its request.
    pub fingerprint: Fingerprint,
    /// Running, in doubt or dead.
    pub status: ProgressStatus,
    /// How many claims it has had.
    pub generation: i64,
    /// The completer's attempts.
    pub attempts: u32,
    /// When the current lease ends (or ended).
    pub lease_until: SystemTime,
    /// Why it is in doubt or dead, if it is.
    pub last_error: Option<String>,
    /// The request it was first sent with.
    pub request: SavedRequest,
    /// When the key was first claimed.
    pub created_at: SystemTime,
    /// When the key last changed.
    pub updated_at: SystemTime,
    /// How many steps it has saved.
    pub steps: u32,
    /// Its run id (new for every life of the key, kept across its resumes and take-overs):
    /// with the scope and a step's name, it gives the step's key
    /// ([`step_key`](super::step_key)).
    pub run: String,
}

impl Progress {
    /// A key in progress as read back, with the other fields at their zero values: the store
    /// sets them from its row.
    #[cfg(feature = "_sql-store")]
    pub(crate) fn new(
        scope: Scope,
        fingerprint: Fingerprint,
        status: ProgressStatus,
        request: SavedRequest,
    ) -> Self {
        Progress {
            scope,
            fingerprint,
            status,
            generation: 0,
            attempts: 0,
            lease_until: SystemTime::UNIX_EPOCH,
            last_error: None,
            request,
            created_at: SystemTime::UNIX_EPOCH,
            updated_at: SystemTime::UNIX_EPOCH,
            steps: 0,
            run: String::new(),
        }
    }
}

/// Which keys in progress [`StepStore::progress`] lists: those with
/// [`status`](Self::status), oldest change first, at most [`limit`](Self::limit), after
/// [`after`](Self::after) (the page before's [`ProgressPage::next`]).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ProgressQuery {
    /// The status.
    pub status: ProgressStatus,
    /// Only this operation's keys, when given.
    pub operation: Option<String>,
    /// Only running keys whose lease has passed (at [`now`](Self::now)) and that have not
    /// changed since then (what the completer resumes), when given.
    pub idle_since: Option<SystemTime>,
    /// Now.
    pub now: SystemTime,
    /// At most this many rows (listed or skipped).
    pub limit: usize,
    /// Where the page before ended.
    pub after: Option<ProgressCursor>,
}

impl ProgressQuery {
    /// The first `limit` keys with `status`, of every operation.
    pub fn new(status: ProgressStatus, limit: usize) -> Self {
        ProgressQuery {
            status,
            operation: None,
            idle_since: None,
            now: SystemTime::now(),
            limit,
            after: None,
        }
    }

    /// Only `operation`'s keys.
    pub fn operation(mut self, operation: impl Into<String>) -> Self {
        self.operation = Some(operation.into());
        self
    }

    /// The page after `cursor`.
    pub fn after(mut self, cursor: Option<ProgressCursor>) -> Self {
        self.after = cursor;
        self
    }
}

/// Where a page of [`StepStore::progress`] ended: the last row's change time and scope, as
/// stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProgressCursor {
    pub(crate) updated_at: i64,
    pub(crate) tenant: String,
    pub(crate) operation: String,
    pub(crate) key: String,
}

/// A page of keys in progress ([`StepStore::progress`]).
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct ProgressPage {
    /// The keys, oldest change first.
    pub keys: Vec<Progress>,
    /// Rows that could not be read (each logged at error level and counted by the metric
    /// `idempotency_steps_unreadable_total`): skipped, never a failed listing.
    pub skipped: usize,
    /// Where this page ended, if it was full: the next page starts there. `None` when there
    /// are no more rows.
    pub next: Option<ProgressCursor>,
}

#[cfg(feature = "_sql-store")]
impl ProgressPage {
    /// Adds a listed row at `cursor`: its key, or, when it could not be read, a skip (logged
    /// and counted). The page's end moves past it either way.
    pub(crate) fn add(&mut self, cursor: ProgressCursor, read: Result<Progress, Error>) {
        match read {
            Ok(progress) => self.keys.push(progress),
            Err(error) => {
                crate::metrics::unreadable_progress(
                    &cursor.tenant,
                    &cursor.operation,
                    &cursor.key,
                    &error,
                );
                self.skipped += 1;
            }
        }
        self.next = Some(cursor);
    }

    /// The page of `seen` rows asked for `limit`: only a full page says where the next starts.
    pub(crate) fn ended(mut self, seen: usize, limit: usize) -> Self {
        if seen < limit {
            self.next = None;
        }
        self
    }
}

/// What [`StepStore::resolve`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settled {
    /// The key was in doubt or dead: settled, and free to be resumed under a new generation
    /// (an earlier owner still running can commit nothing more).
    Resolved,
    /// The key is not in progress.
    NotFound,
    /// The key is running: its owner may be in the middle of a call. Nothing was changed; only
    /// a key in doubt or dead can be resolved.
    Running,
    /// The step named is not a foreign step's intent (it has its result, or there is none at
    /// that position). Nothing was changed.
    NoIntent,
}

/// How an operator resolves a key in doubt ([`StepStore::resolve`]).
#[derive(Clone, Debug)]
pub enum Resolution {
    /// The call did not happen (or may be made again): the step is called again on the next
    /// attempt.
    CallAgain,
    /// The call happened, with this result (the step's JSON, as the handler's type
    /// serializes it): the next attempt goes on from there.
    Done(serde_json::Value),
}

pub(crate) mod sealed {
    use std::future::Future;

    use super::{Acquired, Claim, Lease, ProgressStatus, StepOutcome, StepRow};
    use crate::error::Error;
    use crate::store::{IdempotencyStore, NewRecord};

    /// Only this crate's stores are [`StepProtocol`]s, hence [`StepStore`](super::StepStore)s.
    #[allow(unreachable_pub)]
    pub trait Sealed {}

    /// The protocol [`Steps`](crate::steps::Steps), the layer's steps mode and the
    /// [`Completer`](crate::steps::Completer) run on a [`StepStore`](super::StepStore): claim a
    /// key under a lease, save its steps, release or finish it, with the rows they exchange.
    /// A trait no other crate can name (but this repository's tests, through
    /// `steps::__private`), so that [`StepStore`](super::StepStore)'s public methods take and
    /// return only types a user can name.
    ///
    /// Every method that writes under a `Lease` runs in a transaction of its own that first
    /// checks the lease's generation (and moves the lease's end to `Lease::until`); when
    /// another claim has taken the key over, nothing is written and the method fails with
    /// [`Error::LeaseLost`].
    #[allow(unreachable_pub)]
    pub trait StepProtocol: IdempotencyStore + Sealed {
        /// What a local step's closure gets: on SQLite a `&rusqlite::Transaction` (the closure runs
        /// on the writer thread and returns a `rusqlite::Result`), on the SQL servers the same
        /// transaction handle a request's handler gets (the closure returns a future).
        type Work<'a>;

        /// What `StepOutcome::into_resolved` turns a local step's closure's return into.
        type Resolved<T: Send + 'static>;

        /// In one transaction: takes the key for `claim` if it is free (new, released, or its
        /// lease has passed), bumping its generation; or says why not. A new key is only taken if
        /// it has no live record (`Acquired::Completed` otherwise) and the claim carries its
        /// request.
        fn acquire(&self, claim: &Claim) -> impl Future<Output = Result<Acquired, Error>> + Send;

        /// Writes a foreign step's intent (`StepRow::result` `None`) or result under `lease`.
        /// An intent written again over a saved one leaves it as it is (the lease is still
        /// checked and extended: [`Steps`](crate::steps::Steps) does so before it calls again); a
        /// saved result is never overwritten.
        fn save_step(
            &self,
            lease: &Lease,
            step: &StepRow,
        ) -> impl Future<Output = Result<(), Error>> + Send;

        /// Deletes the intent of the foreign step at `seq` under `lease` (the call is known not
        /// to have happened).
        fn forget_intent(
            &self,
            lease: &Lease,
            seq: u32,
        ) -> impl Future<Output = Result<(), Error>> + Send;

        /// In one transaction under `lease`: runs `work`, then saves `step` with the JSON of what
        /// it returned (`encode`), and commits both. An error from `work` or `encode` rolls back.
        fn run_local<F, R>(
            &self,
            lease: &Lease,
            step: &StepRow,
            work: F,
            encode: fn(&R::Value) -> Result<String, Error>,
        ) -> impl Future<Output = Result<R::Value, Error>> + Send
        where
            F: for<'a> FnOnce(Self::Work<'a>) -> R + Send + 'static,
            R: StepOutcome<Self>;

        /// Lets the key go under `lease`: it is deleted if it has no step saved (a retry starts
        /// afresh, with any payload), else its lease ends now (a retry resumes it).
        fn release(&self, lease: &Lease) -> impl Future<Output = Result<(), Error>> + Send;

        /// Marks the key in doubt or dead under `lease`, with the reason.
        fn set_status(
            &self,
            lease: &Lease,
            status: ProgressStatus,
            reason: &str,
        ) -> impl Future<Output = Result<(), Error>> + Send;

        /// In one transaction under `lease`: saves the key's final `record` (replayed from then on
        /// like any other) and deletes its progress and steps.
        fn finish(
            &self,
            lease: &Lease,
            record: &NewRecord,
        ) -> impl Future<Output = Result<(), Error>> + Send;
    }
}

/// What a database implements to run step-by-step requests (tables `idempotency_progress`
/// and `idempotency_steps`, beside `idempotency_records`). Implemented by every store of the
/// crate; [`Steps`](super::Steps), the layer's steps mode and the
/// [`Completer`](super::Completer) are written once over it.
///
/// Sealed: name it as a bound (`Steps<St: StepStore>`), but it cannot be implemented outside
/// this crate. Its rows and their guarantees (leases, generations, one transaction per
/// commit) are the crate's own and change with it.
///
/// Its methods are what an application or an operator does with the steps' tables; the
/// protocol the layer runs on them is the crate's own.
pub trait StepStore: sealed::StepProtocol {
    /// Creates the two tables if needed. Idempotent, and safe for instances starting at the
    /// same time.
    fn install_steps(&self) -> impl Future<Output = Result<(), Error>> + Send;

    /// A page of keys in progress, as `query` says, ordered by their last change (then by
    /// scope). A row that cannot be read is skipped and reported, never a failed listing.
    fn progress(
        &self,
        query: &ProgressQuery,
    ) -> impl Future<Output = Result<ProgressPage, Error>> + Send;

    /// An operator's decision on a key in doubt (or dead), in one transaction: refused
    /// ([`Settled::Running`]) unless the key is in doubt or dead; else settles the foreign
    /// step at `seq` as `resolution` says (refused with [`Settled::NoIntent`] unless it is an
    /// intent) and makes the key running again under a new generation, free to be resumed,
    /// with its completer attempts reset.
    fn resolve(
        &self,
        scope: &Scope,
        seq: Option<u32>,
        resolution: &Resolution,
        now: SystemTime,
    ) -> impl Future<Output = Result<Settled, Error>> + Send;

    /// Ends up to `batch` keys left running whose progress expired at `now` (their claims'
    /// `expires_at`, the layer's retention) and whose lease has ended; returns how many. A key
    /// without a foreign step is deleted with its steps and saved request (its next request
    /// starts a new life, with a new run id). A key with a foreign step's intent or result (money
    /// may have been taken for an order that was never answered) is marked dead instead, for an
    /// operator: it is never forgotten. Keys in doubt or dead are never purged. Does nothing (0) if
    /// the steps' tables were never installed.
    fn purge_progress(
        &self,
        now: SystemTime,
        batch: usize,
    ) -> impl Future<Output = Result<u64, Error>> + Send;
}

/// What a local step's closure may return on store `S`: on SQLite a `rusqlite::Result<T>`,
/// on the SQL servers a future of `Result<T, Error>`.
pub trait StepOutcome<S: sealed::StepProtocol> {
    /// The value the closure produced (`T`).
    type Value: Send + 'static;

    /// The outcome as the store consumes it.
    fn into_resolved(self) -> S::Resolved<Self::Value>;
}

/// A store of the application's own cannot implement [`StepStore`]: here a complete
/// [`IdempotencyStore`] with every item of [`StepStore`] and of its protocol (written with the
/// rows and the protocol of `__private`, which the crate's tests see) fails only for the
/// sealed supertrait. (On stable
/// rustdoc does not check the error code: the impl must be complete for the test to mean
/// anything.)
///
/// ```compile_fail,E0277
/// use std::future::Future;
/// use std::time::{Duration, SystemTime};
/// use tower_idempotency::steps::__private::{
///     Acquired, Claim, Lease, StepOutcome, StepProtocol, StepRow,
/// };
/// use tower_idempotency::steps::{
///     ProgressPage, ProgressQuery, ProgressStatus, Resolution, Settled, StepStore,
/// };
/// use tower_idempotency::store::sqlite::SqliteStore;
/// use tower_idempotency::store::{Begin, IdempotencyStore, NewRecord, Scope, StoredRecord};
/// use tower_idempotency::Error;
///
/// #[derive(Clone)]
/// struct MyStore(SqliteStore);
///
/// impl IdempotencyStore for MyStore {
///     type Reservation = <SqliteStore as IdempotencyStore>::Reservation;
///
///     fn lookup(&self, scope: &Scope, now: SystemTime)
///         -> impl Future<Output = Result<Option<StoredRecord>, Error>> + Send {
///         self.0.lookup(scope, now)
///     }
///
///     fn begin(&self, scope: &Scope, lock_timeout: Duration, now: SystemTime)
///         -> impl Future<Output = Result<Begin<Self::Reservation>, Error>> + Send {
///         self.0.begin(scope, lock_timeout, now)
///     }
///
///     fn purge_expired(&self, now: SystemTime, batch: usize)
///         -> impl Future<Output = Result<u64, Error>> + Send {
///         self.0.purge_expired(now, batch)
///     }
/// }
///
/// impl StepProtocol for MyStore {
///     type Work<'a> = ();
///     type Resolved<T: Send + 'static> = T;
///
///     async fn acquire(&self, _: &Claim) -> Result<Acquired, Error> { unimplemented!() }
///     async fn save_step(&self, _: &Lease, _: &StepRow) -> Result<(), Error> { unimplemented!() }
///     async fn forget_intent(&self, _: &Lease, _: u32) -> Result<(), Error> { unimplemented!() }
///     async fn run_local<F, R>(
///         &self,
///         _: &Lease,
///         _: &StepRow,
///         _: F,
///         _: fn(&R::Value) -> Result<String, Error>,
///     ) -> Result<R::Value, Error>
///     where
///         F: for<'a> FnOnce(Self::Work<'a>) -> R + Send + 'static,
///         R: StepOutcome<Self>,
///     {
///         unimplemented!()
///     }
///     async fn release(&self, _: &Lease) -> Result<(), Error> { unimplemented!() }
///     async fn set_status(&self, _: &Lease, _: ProgressStatus, _: &str) -> Result<(), Error> {
///         unimplemented!()
///     }
///     async fn finish(&self, _: &Lease, _: &NewRecord) -> Result<(), Error> { unimplemented!() }
/// }
///
/// impl StepStore for MyStore {
///     async fn install_steps(&self) -> Result<(), Error> { unimplemented!() }
///     async fn progress(&self, _: &ProgressQuery) -> Result<ProgressPage, Error> {
///         unimplemented!()
///     }
///     async fn resolve(&self, _: &Scope, _: Option<u32>, _: &Resolution, _: SystemTime)
///         -> Result<Settled, Error> {
///         unimplemented!()
///     }
///     async fn purge_progress(&self, _: SystemTime, _: usize) -> Result<u64, Error> {
///         unimplemented!()
///     }
/// }
/// ```
#[cfg(all(doctest, feature = "sqlite", feature = "_internal-tests"))]
struct StepStoreIsSealed;
