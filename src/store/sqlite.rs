//! The SQLite store: one writer connection on a dedicated thread, WAL readers for the
//! replay fast path.
//!
//! SQLite allows one writer at a time, so the store queues writers in-process instead of
//! letting them collide on `SQLITE_BUSY`. The writer connection lives on its own thread and
//! every statement on it runs there: rusqlite is blocking and must never run on the async
//! executor's threads. Reads of completed records (the fast path) run on reader connections
//! under `spawn_blocking`; in WAL mode they never wait for the writer.
//!
//! # The handler runs on the writer thread
//!
//! Requests queue on the writer thread itself, and while one holds the transaction, the
//! layer's work for it (calling the handler, capturing its response, committing) is polled on
//! that thread too, with the server's tokio runtime entered
//! ([`IdempotencyStore::begin_and_run`]). A [`SqliteTransaction::run`] from the handler then
//! runs its statement at once, and the writer never waits for the request's task to be
//! scheduled between statements: that wait, twice per request, was most of the time a
//! request held the writer. What it means for a handler:
//!
//! - Timers, I/O, `tokio::spawn` and `spawn_blocking` work as usual (the runtime serves them).
//!   A statement run from another task goes through the writer's queue and joins the same
//!   transaction.
//! - Its CPU time is spent on the writer thread. The writer was reserved for the request
//!   anyway, so no other request's statements are delayed by it; replays never wait for it.
//! - Task-local values set by outer layers (`tokio::task_local!`) are not visible, and
//!   `tokio::task::block_in_place` is not available (not a runtime worker thread).
//! - If the client goes away, the work is dropped on the writer thread a moment later (when it
//!   next wakes), and the transaction rolls back.
//!
//! # Group commit
//!
//! With `synchronous=FULL` every commit waits for an fsync, which would cap durable throughput
//! at one request per fsync. So requests that queue for the writer share one SQLite
//! transaction: each request runs inside its own `SAVEPOINT` (a failure rolls back only its
//! own rows), and the group commits with one fsync when the queue drains, the group is full,
//! or it has been open for the group delay. A request's response is released only after the
//! group's `COMMIT` has returned, so no client ever sees a `201` that is not on disk; a
//! duplicate that finds a record of the open group waits for the same commit. A lone request
//! commits at once, exactly as without grouping.
//!
//! Some failures end the whole shared transaction, not just a savepoint: a trigger's
//! `RAISE(ROLLBACK)`, `INSERT OR ROLLBACK` / `ON CONFLICT ROLLBACK`, a deferred foreign key
//! that only fails at `COMMIT`, a full disk or an I/O error. The request whose failure it was
//! gets its own error; every other member of the group gets [`Error::GroupRolledBack`], and
//! the layer runs it again at once, alone in a transaction of its own (so nothing another
//! request does can undo it twice). Its client sees only the answer of that second run.
//! (Where the failure surfaces at `COMMIT`, the culprit is found the same way: every member
//! runs again alone, and only the culprit fails again.)
//!
//! # Transaction control is the store's
//!
//! The writer connection's authorizer refuses `BEGIN`, `COMMIT`, `ROLLBACK`, `END` and any
//! statement on the request's savepoint to everything but the store itself: a handler (or a
//! [`SqliteStore::write`] closure) that tries gets [`Error::TransactionControl`], and its rows
//! stay in the request's transaction. Savepoints of a handler's own (other names) are allowed.
//! Calls that need the writer to themselves ([`SqliteStore::write`], `purge_expired`, and
//! the outbox and inbox calls built on them) fail at once with [`Error::InsideRequest`] when
//! made from a handler inside its own request: use the request's [`SqliteTransaction::run`].
//!
//! # Several processes on one file
//!
//! Processes sharing the file take turns for SQLite's write lock: a writer waiting for it
//! tries again every millisecond (up to the lock timeout, then `503`), and a writer that has
//! seen another process write leaves the lock free for a moment after each commit, so that a
//! busy process cannot starve a quiet one. The store also refuses to write (a `500`) once
//! the path no longer names the file it opened (deleted or replaced): SQLite would go on
//! committing to a file that no restart reads.
//!
//! ```no_run
//! # async fn run() -> Result<(), tower_idempotency::Error> {
//! use tower_idempotency::store::sqlite::{SqliteStore, Synchronous};
//!
//! // Durable by default: WAL + synchronous=FULL.
//! let store = SqliteStore::open("orders.db").await?;
//!
//! // Faster commits that may lose the last transactions on power loss (not on a crash):
//! let fast = SqliteStore::builder("cache.db")
//!     .synchronous(Synchronous::Normal)
//!     .open()
//!     .await?;
//! # Ok(()) }
//! ```

use std::cell::RefCell;
use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::StatusCode;
/// The rusqlite version the store's closures use: depend on it through this re-export.
pub use rusqlite;
use rusqlite::{params, Connection, OpenFlags, OptionalExtension};
use tokio::sync::oneshot;

use tracing::Instrument;

use super::{
    begin_then_run, from_unix_millis, lookup_then, to_unix_millis, Began, Begin, IdempotencyStore,
    NewRecord, Scope, StoreTransaction, StoredRecord,
};
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::response::SavedResponse;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS idempotency_records (
    tenant              TEXT    NOT NULL,
    operation           TEXT    NOT NULL,
    idempotency_key     TEXT    NOT NULL,
    fingerprint         BLOB    NOT NULL,
    fingerprint_version INTEGER NOT NULL,
    status              INTEGER NOT NULL,
    headers             TEXT    NOT NULL,
    body                BLOB    NOT NULL,
    trailers            TEXT,
    created_at          INTEGER NOT NULL,
    expires_at          INTEGER NOT NULL,
    PRIMARY KEY (tenant, operation, idempotency_key)
);
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at
    ON idempotency_records (expires_at);
";

/// How long standalone writes (`write`, purges) wait for another process's write lock.
const STANDALONE_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// The shortest wait for another process's lock a request's begin gets, however little of its
/// lock timeout is left.
const MIN_BUSY_WAIT: Duration = Duration::from_millis(1);

/// How often the writer tries again while another process holds SQLite's write lock.
/// SQLite's own busy handler backs off to 100 ms between tries, while a process with a steady
/// queue frees the lock only for moments between its groups: a waiter that slow starves.
const BUSY_POLL: Duration = Duration::from_millis(1);

/// While another process writes to the same file, how long the writer leaves the lock free
/// after a commit before it takes it again (longer than [`BUSY_POLL`], so the other's next
/// try finds it free): the two take turns instead of one starving the other.
const GIVE_WAY: Duration = Duration::from_millis(2);

/// How long after the last sign of another writing process the writer keeps giving way.
const OTHER_WRITER_WINDOW: Duration = Duration::from_secs(1);

const SELECT_RECORD: &str = "SELECT fingerprint_version, fingerprint, status, headers, body, \
     trailers, created_at, expires_at FROM idempotency_records \
     WHERE tenant = ?1 AND operation = ?2 AND idempotency_key = ?3";

/// How hard SQLite works to make a commit durable (`PRAGMA synchronous`, in WAL mode).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Synchronous {
    /// `FULL`: every commit is on disk before it returns, so a client that received a `201`
    /// gets it back after a power cut. The default.
    #[default]
    Full,
    /// `NORMAL`: commits survive a crash of the process but the last ones may be lost on
    /// power loss or an OS crash. Several times faster.
    Normal,
}

impl Synchronous {
    fn pragma(self) -> &'static str {
        match self {
            Synchronous::Full => "FULL",
            Synchronous::Normal => "NORMAL",
        }
    }
}

/// Options for opening a [`SqliteStore`]; see [`SqliteStore::builder`].
#[derive(Clone, Debug)]
pub struct SqliteOptions {
    path: PathBuf,
    synchronous: Synchronous,
    max_idle_readers: usize,
    group: GroupLimits,
}

/// When an open group of requests is committed.
#[derive(Clone, Copy, Debug)]
struct GroupLimits {
    max_requests: usize,
    max_delay: Duration,
}

impl SqliteOptions {
    /// The durability of commits. Default: [`Synchronous::Full`].
    pub fn synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// How many idle reader connections to keep for the replay fast path. Default: 8.
    pub fn max_idle_readers(mut self, readers: usize) -> Self {
        self.max_idle_readers = readers;
        self
    }

    /// Group commit: at most `max_requests` requests share one commit, and a group is never
    /// held open longer than `max_delay` waiting for more. A group also commits as soon as no
    /// request is waiting for the writer. Default: 64 requests, 5 ms. `max_requests = 1` turns
    /// grouping off (one commit per request).
    pub fn group_commit(mut self, max_requests: usize, max_delay: Duration) -> Self {
        self.group = GroupLimits {
            max_requests: max_requests.max(1),
            max_delay,
        };
        self
    }

    /// Opens (creating if needed) the database, switches it to WAL, creates the schema and
    /// starts the writer thread.
    pub async fn open(self) -> Result<SqliteStore, Error> {
        let options = self;
        tokio::task::spawn_blocking(move || SqliteStore::open_blocking(options))
            .await
            .map_err(|_| Error::Panicked)?
    }
}

/// Work for the writer thread.
enum Job {
    /// A step of the transaction that owns the writer (a handler's statement, the request's
    /// end), or of one that has ended (it then only reports so): runs at once, in order.
    Step(Step),
    /// Work that needs the writer to itself (a request's begin, a standalone write): runs in
    /// arrival order, each once no request's transaction owns the writer.
    Exclusive(Exclusive),
    /// Polls the work of the request with this generation again (see [`DrivenWaker`]).
    Wake(u64),
}

type Step = Box<dyn FnOnce(&mut Writer) + Send>;

/// A job that needs the writer to itself.
struct Exclusive {
    /// Counts it in [`Writer::queued`] until it starts (or is dropped).
    ticket: QueueTicket,
    step: Step,
    /// A request's begin: skipped, and dropped early, once the request stops waiting.
    request: Option<Arc<TxShared>>,
}

impl Exclusive {
    fn is_abandoned(&self) -> bool {
        self.request
            .as_ref()
            .is_some_and(|tx| tx.finished.load(Ordering::Acquire))
    }
}

/// The name of the savepoint that isolates one request inside a group.
const REQUEST_SAVEPOINT: &str = "tower_idempotency_request";

/// The store's own transaction-control statements.
///
/// Only the store may run transaction control on the writer: the connection's authorizer
/// refuses it to every other statement (see [`Writer::control`]). The cached ones carry a
/// comment unique to the store, so that a handler's `prepare_cached` of the same words cannot
/// fetch one of these (authorized) statements from the connection's statement cache.
struct ControlSql {
    begin: String,
    savepoint: String,
    release: String,
    commit: String,
    rollback_request: String,
}

impl ControlSql {
    fn new() -> Self {
        use std::hash::{BuildHasher, Hasher};
        // Random per process and store (the standard library seeds it from the OS).
        let nonce = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        let tag = format!("/* tower-idempotency {nonce:016x} */");
        ControlSql {
            begin: format!("BEGIN IMMEDIATE {tag}"),
            savepoint: format!("SAVEPOINT {REQUEST_SAVEPOINT} {tag}"),
            release: format!("RELEASE {REQUEST_SAVEPOINT} {tag}"),
            commit: format!("COMMIT {tag}"),
            rollback_request: format!(
                "ROLLBACK TO {REQUEST_SAVEPOINT}; RELEASE {REQUEST_SAVEPOINT}"
            ),
        }
    }
}

/// What the writer connection's authorizer reads and writes.
#[derive(Default)]
struct ControlGuard {
    /// Set while the store runs its own transaction control.
    allowed: AtomicBool,
    /// The statement last refused, as an index into [`REFUSED`].
    refused: AtomicU8,
}

/// The statements the authorizer refuses, by name.
const REFUSED: [&str; 6] = [
    "BEGIN",
    "COMMIT",
    "ROLLBACK",
    "SAVEPOINT of the request's savepoint",
    "RELEASE of the request's savepoint",
    "ROLLBACK TO the request's savepoint",
];

impl ControlGuard {
    /// `error` from a statement of a handler (or a `write` closure): the authorizer's refusal
    /// becomes [`Error::TransactionControl`], naming the statement.
    fn error(&self, error: rusqlite::Error) -> Error {
        if error.sqlite_error_code() != Some(rusqlite::ErrorCode::AuthorizationForStatementDenied) {
            return Error::from(error);
        }
        let refused = REFUSED
            .get(usize::from(self.refused.load(Ordering::Relaxed)))
            .copied()
            .unwrap_or("transaction control");
        Error::TransactionControl(refused)
    }
}

/// Lets the store's own transaction control through the authorizer while it lives.
struct ControlAllowed<'a>(&'a ControlGuard);

impl<'a> ControlAllowed<'a> {
    fn new(guard: &'a ControlGuard) -> Self {
        guard.allowed.store(true, Ordering::Relaxed);
        ControlAllowed(guard)
    }
}

impl Drop for ControlAllowed<'_> {
    fn drop(&mut self) {
        self.0.allowed.store(false, Ordering::Relaxed);
    }
}

/// Installs the writer connection's authorizer: transaction control (`BEGIN`, `COMMIT`,
/// `ROLLBACK`, `END`) and any statement on the request's savepoint are refused unless the
/// store itself runs them. A handler's own savepoints (other names) are allowed: they nest
/// inside the request's and end with it.
fn refuse_foreign_transaction_control(
    conn: &mut Connection,
    guard: Arc<ControlGuard>,
) -> rusqlite::Result<()> {
    use rusqlite::hooks::{AuthAction, AuthContext, Authorization, TransactionOperation};
    conn.authorizer(Some(move |context: AuthContext<'_>| {
        let refused = match context.action {
            AuthAction::Transaction { operation } => Some(match operation {
                TransactionOperation::Begin => 0,
                TransactionOperation::Rollback => 2,
                // `COMMIT` and `END`, which SQLite reports as an operation of their own.
                _ => 1,
            }),
            AuthAction::Savepoint {
                operation,
                savepoint_name,
            } if savepoint_name.eq_ignore_ascii_case(REQUEST_SAVEPOINT) => Some(match operation {
                TransactionOperation::Release => 4,
                TransactionOperation::Rollback => 5,
                _ => 3,
            }),
            _ => None,
        };
        match refused {
            Some(statement) if !guard.allowed.load(Ordering::Relaxed) => {
                guard.refused.store(statement, Ordering::Relaxed);
                Authorization::Deny
            }
            _ => Authorization::Allow,
        }
    }))
}

/// Told when the group a request belongs to has committed, or why it did not.
type CommitWaiter = Box<dyn FnOnce(Result<(), Error>) + Send>;

/// A request waiting for its group's commit.
struct Member {
    scope: Scope,
    /// It saved its record in the group (rather than found one of the group's records).
    saved: bool,
    notify: CommitWaiter,
}

/// The SQLite transaction shared by a group of requests.
struct Group {
    /// Requests whose records (or whose duplicates' records) are in the group.
    members: Vec<Member>,
    opened: Instant,
    /// Opened for a request that runs again after another member rolled its group back:
    /// it commits alone, so nothing another request does can undo it a second time.
    solo: bool,
}

/// How long a request is remembered as one to run alone (see [`Writer::rerun_alone`]):
/// the layer runs it again at once, so this only bounds what a client that went away
/// leaves behind.
const RERUN_ALONE_FOR: Duration = Duration::from_secs(60);

/// What lives on the writer thread.
struct Writer {
    conn: Connection,
    /// The generation of the request whose savepoint is open, if any.
    active: Option<u64>,
    /// The open group transaction, if any.
    group: Option<Group>,
    limits: GroupLimits,
    /// How many exclusive jobs (requests' begins, mostly) wait for the writer.
    queued: Arc<AtomicUsize>,
    /// When the active request's savepoint opened.
    request_started: Option<Instant>,
    /// A moving average of how long requests hold the writer: a group only waits for the
    /// next request if that fits in the group delay.
    typical_hold: Duration,
    /// The database file the connection opened.
    file: DatabaseFile,
    /// The state of the connection's busy handler.
    busy: Arc<Mutex<BusyWait>>,
    /// Whether another process writes to the file too.
    other_writers: OtherWriters,
    /// Which store this is (see [`Shared::id`]).
    store_id: u64,
    /// Requests' work started by the last job, for the thread to poll.
    started: Vec<Driven>,
    /// What the authorizer reads: whether the store runs its own transaction control.
    control: Arc<ControlGuard>,
    sql: ControlSql,
    /// Requests whose group another member rolled back: each runs again alone.
    rerun_alone: std::collections::HashMap<Scope, Instant>,
}

/// The writer connection's busy handler: `busy_timeout`'s semantics (one statement waits at
/// most `budget`), but trying every [`BUSY_POLL`], and noting that it had to wait.
struct BusyWait {
    budget: Duration,
    /// When the current wait began.
    started: Option<Instant>,
    /// Whether a statement waited for another process's lock since the writer last looked.
    waited: bool,
}

impl BusyWait {
    /// Called by SQLite while a lock is held elsewhere; `attempt` counts from 0 per wait.
    fn on_busy(state: &Mutex<BusyWait>, attempt: i32) -> bool {
        let Ok(mut state) = state.lock() else {
            return false;
        };
        let now = Instant::now();
        if attempt == 0 {
            state.started = Some(now);
        }
        state.waited = true;
        let waited = state
            .started
            .map_or(Duration::ZERO, |started| now - started);
        if waited >= state.budget {
            return false;
        }
        let nap = BUSY_POLL.min(state.budget - waited);
        drop(state);
        std::thread::sleep(nap);
        true
    }
}

/// Signs that another process writes to the same database file.
#[derive(Default)]
struct OtherWriters {
    /// `PRAGMA data_version` when last read: it changes when another connection commits.
    data_version: Option<i64>,
    /// When another process was last seen writing (its commit, or its lock in the way).
    seen: Option<Instant>,
    /// When this writer last committed.
    committed: Option<Instant>,
}

impl Writer {
    /// Runs the store's own transaction control: the authorizer refuses it to everyone else.
    fn control<T>(&self, f: impl FnOnce(&Connection) -> T) -> T {
        let _allowed = ControlAllowed::new(&self.control);
        f(&self.conn)
    }

    /// Opens the group transaction if needed and the request's savepoint in it.
    fn begin_request(
        &mut self,
        generation: u64,
        scope: &Scope,
        busy_wait: Duration,
    ) -> Result<(), Error> {
        if self.active.is_some() {
            self.rollback_request();
        }
        let alone = self.rerun_alone.remove(scope).is_some();
        if self.group.as_ref().is_some_and(|group| alone || group.solo) {
            self.flush();
        }
        if self.group.is_none() || self.conn.is_autocommit() {
            self.abort_group("the group transaction ended unexpectedly");
            self.file.check()?;
            self.give_way();
            self.set_busy_wait(busy_wait);
            let begun = self.control(|conn| {
                conn.prepare_cached(&self.sql.begin)
                    .and_then(|mut begin| begin.execute([]))
            });
            self.note_other_writers();
            if let Err(error) = begun {
                return Err(if is_busy(&error) {
                    Error::Busy
                } else {
                    error.into()
                });
            }
            self.group = Some(Group {
                members: Vec::new(),
                opened: Instant::now(),
                solo: alone,
            });
        }
        // Cached: prepared once per connection rather than once per request.
        self.control(|conn| {
            conn.prepare_cached(&self.sql.savepoint)
                .and_then(|mut savepoint| savepoint.execute([]))
        })?;
        self.active = Some(generation);
        self.request_started = Some(Instant::now());
        Ok(())
    }

    /// Opens the request's savepoint and checks for a live record: `Some` (with the savepoint
    /// rolled back already) if there is one. Refuses once `deadline` has passed.
    fn start_request(
        &mut self,
        generation: u64,
        deadline: Instant,
        scope: &Scope,
        now_millis: i64,
    ) -> Result<Option<StoredRecord>, Error> {
        // Other processes may hold SQLite's own write lock: wait for it as long as the lock
        // timeout allows, no longer.
        let busy_wait = deadline
            .checked_duration_since(Instant::now())
            .filter(|left| !left.is_zero())
            .ok_or(Error::Busy)?;
        self.begin_request(generation, scope, busy_wait.max(MIN_BUSY_WAIT))?;
        match check_existing(&self.conn, scope, now_millis) {
            Ok(None) => Ok(None),
            Ok(Some(record)) => {
                self.rollback_request();
                Ok(Some(record))
            }
            Err(error) => {
                self.rollback_request();
                Err(error)
            }
        }
    }

    /// How long each following statement may wait for another process's lock.
    fn set_busy_wait(&self, wait: Duration) {
        if let Ok(mut busy) = self.busy.lock() {
            busy.budget = wait;
        }
    }

    /// Before taking SQLite's write lock: while another process writes too, leaves the lock
    /// free for [`GIVE_WAY`] after this writer's last commit, so that the other one gets its
    /// turn (a writer with a steady queue would otherwise take the lock again at once).
    fn give_way(&self) {
        let others = &self.other_writers;
        if others
            .seen
            .is_none_or(|seen| seen.elapsed() >= OTHER_WRITER_WINDOW)
        {
            return;
        }
        if let Some(since) = others.committed.map(|committed| committed.elapsed()) {
            if since < GIVE_WAY {
                std::thread::sleep(GIVE_WAY - since);
            }
        }
    }

    /// After `BEGIN IMMEDIATE`: notes whether another process held the lock, or committed
    /// since this writer last looked.
    fn note_other_writers(&mut self) {
        let waited = self
            .busy
            .lock()
            .map(|mut busy| std::mem::take(&mut busy.waited))
            .unwrap_or(false);
        let version = self
            .conn
            .prepare_cached("PRAGMA data_version")
            .and_then(|mut pragma| pragma.query_row([], |row| row.get::<_, i64>(0)))
            .ok();
        let others = &mut self.other_writers;
        let committed_elsewhere = others.data_version.is_some() && others.data_version != version;
        if waited || committed_elsewhere {
            others.seen = Some(Instant::now());
        }
        others.data_version = version;
    }

    /// Folds the ending request's hold time into the moving average.
    fn end_request(&mut self) {
        self.active = None;
        if let Some(started) = self.request_started.take() {
            self.typical_hold = (self.typical_hold * 7 + started.elapsed()) / 8;
        }
    }

    /// Undoes the active request's rows, and only them.
    fn rollback_request(&mut self) {
        let was_active = self.active.is_some();
        self.end_request();
        if was_active && !self.conn.is_autocommit() {
            let undone = self.control(|conn| conn.execute_batch(&self.sql.rollback_request));
            if let Err(error) = undone {
                tracing::error!(%error, "rolling back a request's savepoint failed");
                self.abort_group("rolling back a request's savepoint failed");
            }
        }
    }

    /// Keeps the active request's rows in the group (to commit with it).
    fn release_request(&mut self) -> Result<(), Error> {
        self.control(|conn| {
            conn.prepare_cached(&self.sql.release)
                .and_then(|mut release| release.execute([]))
        })?;
        self.end_request();
        Ok(())
    }

    /// Tells `member` when the open group commits (at once if there is none).
    fn on_commit(&mut self, member: Member) {
        match &mut self.group {
            Some(group) => group.members.push(member),
            None => (member.notify)(Ok(())),
        }
    }

    /// Remembers that the request of `scope` runs again alone (its group was rolled back
    /// through no fault of its own).
    fn rerun_alone(&mut self, scope: Scope) {
        if self.rerun_alone.len() >= 1024 {
            self.rerun_alone
                .retain(|_, since| since.elapsed() < RERUN_ALONE_FOR);
        }
        self.rerun_alone.insert(scope, Instant::now());
    }

    /// Tells a group's members how it ended.
    ///
    /// When it failed, a member whose failure it was (the group's only saved record, or a
    /// request that ran alone) gets the error; every other member gets
    /// [`Error::GroupRolledBack`] and is remembered to run again alone: the layer then runs it
    /// again at once, and the client never sees the difference.
    fn tell_members(&mut self, group: Group, outcome: Result<(), Error>) {
        let error = match outcome {
            Ok(()) => {
                for member in group.members {
                    (member.notify)(Ok(()));
                }
                return;
            }
            Err(error) => error,
        };
        let saved = group.members.iter().filter(|member| member.saved).count();
        let its_own = group.solo || saved <= 1;
        let reason = error.to_string();
        let mut error = Some(error);
        for member in group.members {
            if its_own && member.saved {
                let error = error
                    .take()
                    .unwrap_or_else(|| Error::CommitFailed(reason.clone()));
                (member.notify)(Err(error));
            } else {
                self.rerun_alone(member.scope);
                (member.notify)(Err(Error::GroupRolledBack(reason.clone())));
            }
        }
    }

    /// Runs a job's step; a panic ends the step, not the thread.
    fn run(&mut self, step: Step) {
        // A panicking step drops its reply channel, which its caller reports as
        // `Error::Panicked`; the thread and the connection go on serving.
        let _ = std::panic::catch_unwind(AssertUnwindSafe(|| step(self)));
        self.after_job();
    }

    /// Commits the open group and tells its requests. Only between requests.
    fn flush(&mut self) {
        debug_assert!(self.active.is_none());
        let Some(group) = self.group.take() else {
            return;
        };
        let requests = group.members.len();
        let outcome = if self.conn.is_autocommit() {
            Err(Error::TransactionAborted(
                "the group transaction ended unexpectedly",
            ))
        } else if let Err(error) = self.file.check() {
            tracing::error!(%error, requests, "group not committed");
            self.roll_back_all();
            Err(error)
        } else {
            let committed = self.control(|conn| {
                conn.prepare_cached(&self.sql.commit)
                    .and_then(|mut commit| commit.execute([]))
            });
            committed.map(drop).map_err(|error| {
                // A deferred foreign key (or constraint trigger) a member left violated
                // fails here, with the transaction still open; a full disk or an I/O error
                // may have ended it already.
                tracing::warn!(%error, requests, "group commit failed");
                self.roll_back_all();
                Error::from(error)
            })
        };
        if outcome.is_ok() {
            self.other_writers.committed = Some(Instant::now());
        }
        self.tell_members(group, outcome);
    }

    /// Rolls back whatever transaction is open on the connection.
    fn roll_back_all(&mut self) {
        if !self.conn.is_autocommit() {
            if let Err(error) = self.control(|conn| conn.execute_batch("ROLLBACK")) {
                tracing::error!(%error, "rollback failed");
            }
        }
    }

    /// Throws the open group away: the active request (if any) ended it, so every member
    /// waiting for its commit runs again alone.
    fn abort_group(&mut self, reason: &'static str) {
        self.end_request();
        self.roll_back_all();
        if let Some(group) = self.group.take() {
            if !group.members.is_empty() {
                tracing::info!(
                    reason,
                    requests = group.members.len(),
                    "group rolled back; its requests run again"
                );
            }
            for member in group.members {
                self.rerun_alone(member.scope);
                (member.notify)(Err(Error::GroupRolledBack(reason.to_owned())));
            }
        }
    }

    /// Commits the group if it is due; run after every job.
    fn after_job(&mut self) {
        if self.group.is_some() && self.conn.is_autocommit() {
            // A statement ended the transaction (or SQLite rolled it back on a full disk):
            // the group's work is gone, and its requests must not report success.
            self.abort_group("the group transaction ended unexpectedly");
            return;
        }
        if self.active.is_none() && self.group.as_ref().is_some_and(|g| self.is_due(g)) {
            self.flush();
        }
    }

    /// Whether the group should commit now rather than wait for the next queued request.
    fn is_due(&self, group: &Group) -> bool {
        // The members already in the group wait for the next request's handler too: only
        // worth it while that is expected to fit in the group delay.
        group.solo
            || self.queued.load(Ordering::Acquire) == 0
            || group.members.len() >= self.limits.max_requests
            || group.opened.elapsed() + self.typical_hold >= self.limits.max_delay
    }

    /// How long the thread may wait for the next job before the open group must commit.
    fn flush_deadline(&self) -> Option<Duration> {
        match (&self.group, self.active) {
            (Some(group), None) => {
                Some(self.limits.max_delay.saturating_sub(group.opened.elapsed()))
            }
            _ => None,
        }
    }

    /// Ends whatever is open before a standalone statement or transaction.
    fn settle(&mut self) {
        self.rollback_request();
        self.flush();
    }
}

/// The file the store opened, to notice when its path stops naming it.
///
/// SQLite keeps writing to a database file that was deleted (or renamed over) while open, and
/// its commits succeed: every answer from then on would promise what no restart will ever read
/// again. So the writer refuses to begin or commit while the path names another file, or none.
struct DatabaseFile {
    /// The absolute path (so a later change of the working directory does not matter).
    path: PathBuf,
    /// `None` where the file cannot be identified (`:memory:`, URIs, non-Unix systems): not
    /// checked.
    identity: Option<(u64, u64)>,
}

impl DatabaseFile {
    fn opened(path: &Path) -> Self {
        let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        let identity = Self::identity_of(&path);
        DatabaseFile { path, identity }
    }

    /// Device and inode.
    #[cfg(unix)]
    fn identity_of(path: &Path) -> Option<(u64, u64)> {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(path)
            .ok()
            .map(|metadata| (metadata.dev(), metadata.ino()))
    }

    #[cfg(not(unix))]
    fn identity_of(_path: &Path) -> Option<(u64, u64)> {
        None
    }

    fn check(&self) -> Result<(), Error> {
        match self.identity {
            Some(opened) if Self::identity_of(&self.path) != Some(opened) => {
                Err(Error::Io(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!(
                        "the database file {} was deleted or replaced while open: \
                         refusing to write to it",
                        self.path.display()
                    ),
                )))
            }
            _ => Ok(()),
        }
    }
}

struct Shared {
    /// Tells this store's writer thread from another store's.
    id: u64,
    path: PathBuf,
    jobs: mpsc::Sender<Job>,
    readers: Mutex<Vec<Connection>>,
    max_idle_readers: usize,
    generations: AtomicU64,
    /// How many exclusive jobs wait for the writer (read by the writer thread to decide
    /// whether a group should wait for more).
    queued: Arc<AtomicUsize>,
}

/// A SQLite-backed [`IdempotencyStore`]. Cheap to clone.
#[derive(Clone)]
pub struct SqliteStore {
    shared: Arc<Shared>,
}

impl fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.shared.path)
            .finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// Opens the database at `path` with the default options (WAL, `synchronous=FULL`).
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, Error> {
        Self::builder(path).open().await
    }

    /// Options for opening the database at `path`.
    pub fn builder(path: impl AsRef<Path>) -> SqliteOptions {
        SqliteOptions {
            path: path.as_ref().to_path_buf(),
            synchronous: Synchronous::default(),
            max_idle_readers: 8,
            group: GroupLimits {
                max_requests: 64,
                max_delay: Duration::from_millis(5),
            },
        }
    }

    fn open_blocking(options: SqliteOptions) -> Result<Self, Error> {
        let mut conn = Connection::open(&options.path)?;
        conn.busy_timeout(Duration::from_secs(5))?;
        let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            tracing::warn!(%mode, "SQLite did not switch to WAL; replays may wait for writers");
        }
        conn.pragma_update(None, "synchronous", options.synchronous.pragma())?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.execute_batch(SCHEMA)?;

        let file = DatabaseFile::opened(&options.path);
        // From now on the writer connection waits for other processes' locks through this
        // handler (`set_busy_wait` sets how long).
        let busy = Arc::new(Mutex::new(BusyWait {
            budget: STANDALONE_BUSY_TIMEOUT,
            started: None,
            waited: false,
        }));
        let handler_state = busy.clone();
        conn.busy_handler(Some(move |attempt| {
            BusyWait::on_busy(&handler_state, attempt)
        }))?;
        let control = Arc::new(ControlGuard::default());
        refuse_foreign_transaction_control(&mut conn, control.clone())?;

        let (jobs, receiver) = mpsc::channel::<Job>();
        let store_id = NEXT_STORE_ID.fetch_add(1, Ordering::Relaxed);
        let queued = Arc::new(AtomicUsize::new(0));
        let writer = Writer {
            conn,
            active: None,
            group: None,
            limits: options.group,
            queued: queued.clone(),
            request_started: None,
            typical_hold: Duration::ZERO,
            file,
            busy,
            other_writers: OtherWriters::default(),
            store_id,
            started: Vec::new(),
            control,
            sql: ControlSql::new(),
            rerun_alone: std::collections::HashMap::new(),
        };
        std::thread::Builder::new()
            .name("tower-idempotency-sqlite-writer".into())
            .spawn(move || writer_thread(writer, &receiver))?;

        Ok(SqliteStore {
            shared: Arc::new(Shared {
                id: store_id,
                path: options.path,
                jobs,
                readers: Mutex::new(Vec::new()),
                max_idle_readers: options.max_idle_readers,
                generations: AtomicU64::new(1),
                queued,
            }),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// How many requests are waiting for the writer right now (a gauge for metrics).
    pub fn writers_waiting(&self) -> usize {
        self.shared.queued.load(Ordering::Acquire)
    }

    /// Runs `f` on a read-only connection, off the async executor. Use it for reads of your
    /// own tables (in WAL mode they do not wait for the writer).
    pub async fn read<T, F>(&self, f: F) -> Result<T, Error>
    where
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || shared.with_reader(|conn| f(conn).map_err(Error::from)))
            .await
            .map_err(|_| Error::Panicked)?
    }

    /// Runs `f` in its own write transaction (`BEGIN IMMEDIATE` ... `COMMIT`) on the writer
    /// connection, queued behind the requests that hold it. Use it for migrations and writes
    /// that are not part of an idempotent request. `f` returning an error rolls back.
    ///
    /// Called from a handler inside its own request, it fails at once with
    /// [`Error::InsideRequest`]: it would wait for the request to end. Use the request's
    /// [`SqliteTransaction::run`] there.
    pub async fn write<T, F>(&self, f: F) -> Result<T, Error>
    where
        F: FnOnce(&rusqlite::Transaction<'_>) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        self.shared
            .call_exclusive("SqliteStore::write", move |writer| {
                writer.settle();
                writer.file.check()?;
                writer.set_busy_wait(STANDALONE_BUSY_TIMEOUT);
                let allowed = &*writer.control;
                let tx = {
                    let _allowed = ControlAllowed::new(allowed);
                    rusqlite::Transaction::new_unchecked(
                        &writer.conn,
                        rusqlite::TransactionBehavior::Immediate,
                    )?
                };
                // `f` runs as a handler's statements do: its transaction control is refused.
                let value = std::panic::catch_unwind(AssertUnwindSafe(|| f(&tx)));
                let _allowed = ControlAllowed::new(allowed);
                match value {
                    Ok(Ok(value)) => {
                        tx.commit()?;
                        Ok(value)
                    }
                    Ok(Err(error)) => {
                        drop(tx);
                        Err(allowed.error(error))
                    }
                    Err(panic) => {
                        drop(tx);
                        std::panic::resume_unwind(panic)
                    }
                }
            })
            .await
    }
}

impl SqliteStore {
    /// [`IdempotencyStore::begin_and_run`] (with `look_up_first`,
    /// [`IdempotencyStore::lookup_then_begin_and_run`]) on the writer thread where there is a
    /// tokio runtime to serve the work, in place otherwise.
    fn run_on_writer<W, F>(
        &self,
        scope: &Scope,
        lock_timeout: Duration,
        now: SystemTime,
        work: W,
        look_up_first: bool,
    ) -> impl Future<Output = Result<Began<F::Output>, Error>> + Send + 'static
    where
        W: FnOnce(SqliteReservation) -> F + Send + 'static,
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let runtime = tokio::runtime::Handle::try_current().ok();
        let store = self.clone();
        let scope = scope.clone();
        async move {
            match (runtime, look_up_first) {
                (Some(runtime), _) => {
                    store
                        .begin_on_writer(scope, lock_timeout, now, work, runtime, look_up_first)
                        .await
                }
                (None, false) => begin_then_run(&store, &scope, lock_timeout, now, work).await,
                (None, true) => {
                    lookup_then(&store, &scope, now, || {
                        begin_then_run(&store, &scope, lock_timeout, now, work)
                    })
                    .await
                }
            }
        }
    }

    /// [`IdempotencyStore::begin_and_run`] with the work polled on the writer thread; with
    /// `look_up_first`, [`IdempotencyStore::lookup_then_begin_and_run`]: the fast-path read
    /// runs on a reader thread, which queues the begin itself when it finds no record, so that
    /// the request is woken once, by the answer, rather than once more between the two.
    async fn begin_on_writer<W, F>(
        self,
        scope: Scope,
        lock_timeout: Duration,
        now: SystemTime,
        work: W,
        runtime: tokio::runtime::Handle,
        look_up_first: bool,
    ) -> Result<Began<F::Output>, Error>
    where
        W: FnOnce(SqliteReservation) -> F + Send + 'static,
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let queued_at = Instant::now();
        let deadline = queued_at + lock_timeout;
        let generation = self.shared.generations.fetch_add(1, Ordering::Relaxed);
        let tx = Arc::new(TxShared {
            generation,
            store: self.shared.clone(),
            finished: AtomicBool::new(false),
        });
        // Moved into the begin: whatever happens to it (skipped, failed, dropped with the
        // queue), its drop queues the rollback of whatever it began.
        let reservation = SqliteReservation {
            tx: tx.clone(),
            open: true,
            scope: scope.clone(),
        };
        // If this future is dropped before the work is done, the begin is skipped and the
        // handles refuse work; the work itself ends when it sees `answer` go.
        let cancel = CancelOnDrop(tx.clone());
        let span = tracing::Span::current();
        let store = Arc::downgrade(&self.shared);
        let now_millis = to_unix_millis(now);
        let (reply, mut answer) = oneshot::channel::<Result<Began<F::Output>, Error>>();
        // Whether the begin started before the request gave up on its lock timeout: decided
        // once, by whichever side gets there first, with no wake-up of the request for it.
        let begin_state = Arc::new(AtomicU8::new(BEGIN_WAITING));
        let begin_started = begin_state.clone();
        let lookup_scope = look_up_first.then(|| scope.clone());
        // The begin, or (given the record the fast path found) the answer with that record.
        let start = move |found: Option<StoredRecord>| -> Option<Step> {
            if let Some(record) = found {
                // Nothing began: no rollback to queue for the writer.
                let mut reservation = reservation;
                reservation.close();
                let _ = reply.send(Ok(Began::Found { record }));
                return None;
            }
            Some(Box::new(move |writer: &mut Writer| {
                let started = begin_started.compare_exchange(
                    BEGIN_WAITING,
                    BEGIN_STARTED,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
                if started.is_err() || tx.finished.load(Ordering::Acquire) {
                    return;
                }
                let waited = queued_at.elapsed();
                match writer.start_request(generation, deadline, &scope, now_millis) {
                    Ok(Some(record)) => writer.on_commit(Member {
                        scope,
                        saved: false,
                        notify: Box::new(move |outcome| {
                            let _ =
                                reply.send(outcome.map(|()| Began::Existing { record, waited }));
                        }),
                    }),
                    Ok(None) => {
                        let work = DrivenWork {
                            work: work(reservation).instrument(span),
                            reply: Some(reply),
                            waited,
                        };
                        writer.started.push(Driven {
                            generation,
                            future: Box::pin(work),
                            runtime,
                            waker: Arc::new(DrivenWaker {
                                generation,
                                store,
                                queued: AtomicBool::new(false),
                            }),
                        });
                    }
                    Err(error) => {
                        let _ = reply.send(Err(error));
                    }
                }
            }))
        };
        match lookup_scope {
            None => {
                if let Some(begin) = start(None) {
                    self.shared
                        .send_exclusive(begin, Some(cancel.0.clone()), NESTED_REQUEST)?;
                }
            }
            Some(lookup_scope) => {
                // The check `send_exclusive` makes needs this thread (the reader's is not it).
                if inside_request(self.shared.id) {
                    return Err(Error::InsideRequest(NESTED_REQUEST));
                }
                let shared = self.shared.clone();
                let request = cancel.0.clone();
                // Not awaited: the answer comes through `answer`, from here or the begin.
                drop(tokio::task::spawn_blocking(move || {
                    let found = match shared.with_reader(|conn| read_record(conn, &lookup_scope)) {
                        Ok(record) => record.filter(|record| record.expires_at > now),
                        // The begin reads again, authoritatively.
                        Err(error) => {
                            tracing::warn!(%error, "idempotency fast-path lookup failed");
                            None
                        }
                    };
                    if let Some(begin) = start(found) {
                        // If the store is gone, dropping the begin drops its reply: the
                        // request hears of it.
                        let _ = shared.send_exclusive(begin, Some(request), NESTED_REQUEST);
                    }
                }));
            }
        }
        // The lock timeout bounds the wait for the begin, not the work after it.
        let answered = match tokio::time::timeout(lock_timeout, &mut answer).await {
            Ok(answered) => answered,
            Err(_elapsed) => {
                let gave_up = begin_state.compare_exchange(
                    BEGIN_WAITING,
                    BEGIN_GAVE_UP,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
                if gave_up.is_ok() {
                    return Err(Error::Busy);
                }
                // The begin started in time: wait for the work.
                answer.await
            }
        };
        answered.map_err(|_| Error::Panicked)?
    }
}

/// A request's begin has not started on the writer yet.
const BEGIN_WAITING: u8 = 0;
/// It started (in time).
const BEGIN_STARTED: u8 = 1;
/// The request gave up waiting for it (its lock timeout passed): it will not start.
const BEGIN_GAVE_UP: u8 = 2;

/// Marks a request's transaction finished when the request stops waiting for it.
struct CancelOnDrop(Arc<TxShared>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.finished.store(true, Ordering::Release);
    }
}

/// A place in the writer's queue, given up when dropped.
struct QueueTicket(Arc<AtomicUsize>);

impl Drop for QueueTicket {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Numbers the stores of the process.
static NEXT_STORE_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// On a writer thread, its store's writer. Jobs borrow it, and so do the statements of a
    /// request whose work the thread polls: they run at once, without a round trip.
    static WRITER: RefCell<Option<Writer>> = const { RefCell::new(None) };
}

/// What a begin queued from inside a request's work is called in [`Error::InsideRequest`].
const NESTED_REQUEST: &str = "an idempotent request nested in another on the same store";

/// Whether this is the writer thread of store `id`, polling the work of a request that holds
/// the writer (a handler's code, under the layer).
fn inside_request(id: u64) -> bool {
    WRITER.with(|cell| {
        cell.try_borrow().is_ok_and(|writer| {
            writer
                .as_ref()
                .is_some_and(|writer| writer.store_id == id && writer.active.is_some())
        })
    })
}

/// Runs `f` with this thread's writer; `None` on any other thread (or while it is borrowed).
fn with_writer<T>(f: impl FnOnce(&mut Writer) -> T) -> Option<T> {
    WRITER.with(|cell| {
        let mut writer = cell.try_borrow_mut().ok()?;
        writer.as_mut().map(f)
    })
}

/// Runs `f` at once, as a job, if this is the writer thread of store `id` (and its writer is
/// free); gives `f` back otherwise, to be sent to the writer thread.
fn run_if_on_writer<T, F>(id: u64, f: F) -> Result<T, F>
where
    F: FnOnce(&mut Writer) -> T,
{
    WRITER.with(|cell| {
        let Ok(mut writer) = cell.try_borrow_mut() else {
            return Err(f);
        };
        match writer.as_mut() {
            Some(writer) if writer.store_id == id => {
                let output = f(writer);
                writer.after_job();
                Ok(output)
            }
            _ => Err(f),
        }
    })
}

/// The writer thread: runs jobs in order, exclusive ones one at a time, polls the work of the
/// request that owns the writer, and commits groups when they are due.
fn writer_thread(writer: Writer, receiver: &mpsc::Receiver<Job>) {
    WRITER.with(|cell| *cell.borrow_mut() = Some(writer));
    // Exclusive jobs that arrived while a request's transaction owned the writer.
    let mut waiting: VecDeque<Exclusive> = VecDeque::new();
    // Requests' work being polled here (the owner's, and ones awaiting their group's commit).
    let mut driven: Vec<Driven> = Vec::new();
    loop {
        // Work started by the last job: poll it at once (outside the writer's borrow, since
        // its statements borrow the writer).
        let started = with_writer(|writer| std::mem::take(&mut writer.started)).unwrap_or_default();
        for mut work in started {
            if !work.poll() {
                driven.push(work);
            }
        }
        // The next request starts as soon as the last one ended: no hand-off in between.
        if with_writer(|writer| writer.active.is_none()).unwrap_or(true) {
            if let Some(Exclusive { ticket, step, .. }) = waiting.pop_front() {
                drop(ticket);
                with_writer(|writer| writer.run(step));
                continue;
            }
        }
        // A request in progress, or the next member of an open group, sends its job within
        // microseconds: waiting for it briefly (yielding the CPU) is cheaper than parking the
        // thread and being woken. An idle writer parks at once: nothing is on its way, and
        // spinning would only burn a core between requests.
        let busy = with_writer(|writer| writer.active.is_some() || writer.group.is_some())
            .unwrap_or(false);
        let spin = if busy {
            with_writer(|writer| writer.flush_deadline())
                .flatten()
                .map_or(JOB_SPIN, |due| due.min(JOB_SPIN))
        } else {
            Duration::ZERO
        };
        let job = match spin_for_job(receiver, spin) {
            Some(job) => Some(job),
            None => match with_writer(|writer| writer.flush_deadline()).flatten() {
                None => receiver.recv().ok(),
                Some(wait) => match receiver.recv_timeout(wait) {
                    Ok(job) => Some(job),
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        with_writer(Writer::flush);
                        continue;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => None,
                },
            },
        };
        // Ends when every sender (the store and all transactions) is gone.
        let Some(job) = job else { break };
        match job {
            Job::Step(step) => {
                with_writer(|writer| writer.run(step));
            }
            Job::Exclusive(job) => {
                let owned = with_writer(|writer| writer.active.is_some()).unwrap_or(false);
                if owned || !waiting.is_empty() {
                    // Requests that gave up (their lock timeout passed) while a long
                    // transaction held the writer leave now, with what they hold.
                    waiting.retain(|queued| !queued.is_abandoned());
                    waiting.push_back(job);
                } else {
                    drop(job.ticket);
                    with_writer(|writer| writer.run(job.step));
                }
            }
            Job::Wake(generation) => {
                if let Some(at) = driven.iter().position(|work| work.generation == generation) {
                    if driven[at].poll() {
                        driven.swap_remove(at);
                    }
                }
            }
        }
    }
    // Cancelled work rolls back through jobs nobody reads any more: end what is open here.
    drop(driven);
    drop(waiting);
    with_writer(Writer::settle);
}

/// A request's work, polled on the writer thread.
struct Driven {
    generation: u64,
    future: Pin<Box<dyn Future<Output = ()> + Send>>,
    /// The tokio runtime the request came from: its timers, I/O and `spawn` serve the work.
    runtime: tokio::runtime::Handle,
    waker: Arc<DrivenWaker>,
}

impl Driven {
    /// Polls the work once; `true` when it is done (finished, cancelled or panicked).
    fn poll(&mut self) -> bool {
        self.waker.queued.store(false, Ordering::Release);
        let _runtime = self.runtime.enter();
        let waker = Waker::from(self.waker.clone());
        let mut cx = Context::from_waker(&waker);
        let future = self.future.as_mut();
        // A panic drops the work (rolling its transaction back) and its reply, which the
        // request reports as `Error::Panicked`.
        !matches!(
            std::panic::catch_unwind(AssertUnwindSafe(|| future.poll(&mut cx))),
            Ok(Poll::Pending)
        )
    }
}

/// Wakes driven work: queues a [`Job::Wake`] for it (once until it is polled).
struct DrivenWaker {
    generation: u64,
    store: Weak<Shared>,
    queued: AtomicBool,
}

impl Wake for DrivenWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if self.queued.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(store) = self.store.upgrade() {
            let _ = store.jobs.send(Job::Wake(self.generation));
        }
    }
}

pin_project_lite::pin_project! {
    /// A request's work and where its outcome goes; ends early, dropping the work (and with
    /// it the transaction, which rolls back), once the request stops waiting for it.
    struct DrivenWork<F: Future> {
        #[pin]
        work: F,
        reply: Option<oneshot::Sender<Result<Began<F::Output>, Error>>>,
        waited: Duration,
    }
}

impl<F: Future> Future for DrivenWork<F> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.project();
        let Some(reply) = this.reply.as_mut() else {
            return Poll::Ready(());
        };
        if reply.poll_closed(cx).is_ready() {
            return Poll::Ready(());
        }
        let output = std::task::ready!(this.work.poll(cx));
        if let Some(reply) = this.reply.take() {
            let _ = reply.send(Ok(Began::Ran {
                output,
                waited: *this.waited,
            }));
        }
        Poll::Ready(())
    }
}

/// How long the writer thread polls for its next job before it parks.
const JOB_SPIN: Duration = Duration::from_micros(50);

/// The next job if one arrives within `spin` (at most [`JOB_SPIN`]; less when the open group
/// is due sooner).
fn spin_for_job(receiver: &mpsc::Receiver<Job>, spin: Duration) -> Option<Job> {
    let started = Instant::now();
    loop {
        match receiver.try_recv() {
            Ok(job) => return Some(job),
            Err(mpsc::TryRecvError::Disconnected) => return None,
            Err(mpsc::TryRecvError::Empty) if started.elapsed() >= spin => return None,
            Err(mpsc::TryRecvError::Empty) => std::thread::yield_now(),
        }
    }
}

impl Shared {
    /// Sends `f` to the writer thread as a step of the transaction that owns the writer, and
    /// waits for its answer. Only the owner of the open transaction sends steps, so steps of
    /// different transactions never interleave.
    async fn call<T, F>(&self, f: F) -> Result<T, Error>
    where
        F: FnOnce(&mut Writer) -> Result<T, Error> + Send + 'static,
        T: Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        self.jobs
            .send(Job::Step(Box::new(move |writer| {
                let _ = reply.send(f(writer));
            })))
            .map_err(|_| Error::Closed)?;
        answer.await.map_err(|_| Error::Panicked)?
    }

    /// Queues `step` to run once the writer is free of other transactions. The job counts in
    /// `queued` from now until it starts, so that a group does not commit early while the
    /// next request is about to join it.
    ///
    /// Refused at once ([`Error::InsideRequest`], naming `what`) when called from the work of
    /// a request that holds this store's writer: the job would wait for that request to end,
    /// and the request for the job.
    fn send_exclusive(
        &self,
        step: Step,
        request: Option<Arc<TxShared>>,
        what: &'static str,
    ) -> Result<(), Error> {
        if inside_request(self.id) {
            return Err(Error::InsideRequest(what));
        }
        self.queued.fetch_add(1, Ordering::AcqRel);
        let ticket = QueueTicket(self.queued.clone());
        self.jobs
            .send(Job::Exclusive(Exclusive {
                ticket,
                step,
                request,
            }))
            .map_err(|_| Error::Closed)
    }

    /// Runs `f` with the writer to itself, and waits for its answer. `what` names the call
    /// in the error a call from inside a request gets (see [`Shared::send_exclusive`]).
    async fn call_exclusive<T, F>(&self, what: &'static str, f: F) -> Result<T, Error>
    where
        F: FnOnce(&mut Writer) -> Result<T, Error> + Send + 'static,
        T: Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        self.send_exclusive(
            Box::new(move |writer| {
                let _ = reply.send(f(writer));
            }),
            None,
            what,
        )?;
        answer.await.map_err(|_| Error::Panicked)?
    }

    fn with_reader<T>(&self, f: impl FnOnce(&Connection) -> Result<T, Error>) -> Result<T, Error> {
        let idle = self.readers.lock().ok().and_then(|mut pool| pool.pop());
        let conn = match idle {
            Some(conn) => conn,
            None => {
                let conn = Connection::open_with_flags(
                    &self.path,
                    OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
                )?;
                conn.busy_timeout(Duration::from_secs(5))?;
                conn
            }
        };
        let result = f(&conn);
        if let Ok(mut pool) = self.readers.lock() {
            if pool.len() < self.max_idle_readers {
                pool.push(conn);
            }
        }
        result
    }
}

fn read_record(conn: &Connection, scope: &Scope) -> Result<Option<StoredRecord>, Error> {
    let mut statement = conn.prepare_cached(SELECT_RECORD)?;
    let row = statement
        .query_row(
            params![&*scope.tenant, &*scope.operation, scope.key.as_str()],
            |row| {
                Ok((
                    row.get::<_, i64>(0)?,
                    row.get::<_, Vec<u8>>(1)?,
                    row.get::<_, i64>(2)?,
                    row.get::<_, String>(3)?,
                    row.get::<_, Vec<u8>>(4)?,
                    row.get::<_, Option<String>>(5)?,
                    row.get::<_, i64>(6)?,
                    row.get::<_, i64>(7)?,
                ))
            },
        )
        .optional()?;
    let Some((version, digest, status, headers, body, trailers, created_at, expires_at)) = row
    else {
        return Ok(None);
    };
    let version =
        u16::try_from(version).map_err(|_| Error::Corrupt("fingerprint version".into()))?;
    let digest: [u8; 32] = digest
        .try_into()
        .map_err(|_| Error::Corrupt("fingerprint length".into()))?;
    let status = u16::try_from(status)
        .ok()
        .and_then(|s| StatusCode::from_u16(s).ok())
        .ok_or_else(|| Error::Corrupt("status".into()))?;
    let headers = SavedResponse::decode_headers(&headers).map_err(Error::Corrupt)?;
    let trailers = trailers
        .map(|t| SavedResponse::decode_headers(&t))
        .transpose()
        .map_err(Error::Corrupt)?;
    Ok(Some(StoredRecord {
        fingerprint: Fingerprint::new(version, digest),
        response: SavedResponse {
            status,
            headers,
            body: Bytes::from(body),
            trailers,
        },
        created_at: from_unix_millis(created_at),
        expires_at: from_unix_millis(expires_at),
    }))
}

/// Saves the idempotency record (in the request's savepoint).
fn insert_record(conn: &Connection, scope: &Scope, record: &NewRecord) -> Result<(), Error> {
    let response = &record.response;
    conn.prepare_cached(
        "INSERT INTO idempotency_records (tenant, operation, idempotency_key, fingerprint, \
         fingerprint_version, status, headers, body, trailers, created_at, expires_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
    )?
    .execute(params![
        &*scope.tenant,
        &*scope.operation,
        scope.key.as_str(),
        &record.fingerprint.digest()[..],
        record.fingerprint.version(),
        response.status.as_u16(),
        SavedResponse::encode_headers(&response.headers),
        &response.body[..],
        response
            .trailers
            .as_ref()
            .map(|t| SavedResponse::encode_headers(t)),
        to_unix_millis(record.created_at),
        to_unix_millis(record.expires_at),
    ])?;
    Ok(())
}

/// The live record of `scope`, read on the writer inside the request's savepoint; an expired
/// one is deleted (in the savepoint) so that the key can be used again.
fn check_existing(
    conn: &Connection,
    scope: &Scope,
    now_millis: i64,
) -> Result<Option<StoredRecord>, Error> {
    match read_record(conn, scope)? {
        Some(record) if to_unix_millis(record.expires_at) > now_millis => Ok(Some(record)),
        Some(_) => {
            conn.prepare_cached(
                "DELETE FROM idempotency_records WHERE tenant = ?1 \
                 AND operation = ?2 AND idempotency_key = ?3",
            )?
            .execute(params![
                &*scope.tenant,
                &*scope.operation,
                scope.key.as_str()
            ])?;
            Ok(None)
        }
        None => Ok(None),
    }
}

fn is_busy(error: &rusqlite::Error) -> bool {
    matches!(
        error.sqlite_error_code(),
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
    )
}

impl IdempotencyStore for SqliteStore {
    type Transaction = SqliteReservation;

    async fn lookup(&self, scope: &Scope, now: SystemTime) -> Result<Option<StoredRecord>, Error> {
        let shared = self.shared.clone();
        let scope = scope.clone();
        let record = tokio::task::spawn_blocking(move || {
            shared.with_reader(|conn| read_record(conn, &scope))
        })
        .await
        .map_err(|_| Error::Panicked)??;
        Ok(record.filter(|r| r.expires_at > now))
    }

    async fn begin(
        &self,
        scope: &Scope,
        lock_timeout: Duration,
        now: SystemTime,
    ) -> Result<Begin<SqliteReservation>, Error> {
        let deadline = Instant::now() + lock_timeout;
        let generation = self.shared.generations.fetch_add(1, Ordering::Relaxed);
        // Built before the begin is queued, so that dropping this future at any await point
        // (or the begin failing in any way) queues the rollback of whatever it began.
        let mut reservation = SqliteReservation {
            tx: Arc::new(TxShared {
                generation,
                store: self.shared.clone(),
                finished: AtomicBool::new(false),
            }),
            open: true,
            scope: scope.clone(),
        };
        let tx = reservation.tx.clone();
        let scope = scope.clone();
        let now_millis = to_unix_millis(now);
        let (reply, answer) = oneshot::channel::<Result<Option<StoredRecord>, Error>>();
        let begin: Step = Box::new(move |writer| {
            // Its caller gave up (timed out, or went away) while it waited: skip it.
            if tx.finished.load(Ordering::Acquire) {
                return;
            }
            match writer.start_request(generation, deadline, &scope, now_millis) {
                // The record may belong to the open group: answer only once that group is
                // durable.
                Ok(Some(record)) => writer.on_commit(Member {
                    scope,
                    saved: false,
                    notify: Box::new(move |outcome| {
                        let _ = reply.send(outcome.map(|()| Some(record)));
                    }),
                }),
                Ok(None) => {
                    let _ = reply.send(Ok(None));
                }
                Err(error) => {
                    let _ = reply.send(Err(error));
                }
            }
        });
        self.shared
            .send_exclusive(begin, Some(reservation.tx.clone()), NESTED_REQUEST)?;
        let answer = tokio::time::timeout(lock_timeout, answer)
            .await
            .map_err(|_| Error::Busy)?
            .map_err(|_| Error::Panicked)?;
        match answer {
            Ok(None) => Ok(Begin::Reserved(reservation)),
            Ok(Some(record)) => {
                // Rolled back on the writer already.
                reservation.close();
                Ok(Begin::Existing(record))
            }
            Err(error) => Err(error),
        }
    }

    /// Runs `work` on the writer thread, right after the begin: the handler's statements and
    /// the commit run there at once, and the writer never waits for the request's task to be
    /// scheduled between them. Its timers, I/O and spawned tasks are served by the calling
    /// tokio runtime; without one, `work` runs in place.
    fn begin_and_run<W, F>(
        &self,
        scope: &Scope,
        lock_timeout: Duration,
        now: SystemTime,
        work: W,
    ) -> impl Future<Output = Result<Began<F::Output>, Error>> + Send
    where
        W: FnOnce(SqliteReservation) -> F + Send + 'static,
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.run_on_writer(scope, lock_timeout, now, work, false)
    }

    /// The fast-path read runs on a reader thread (as [`lookup`](Self::lookup)), which queues
    /// the begin itself when it finds no record: the request is woken once, by its answer.
    fn lookup_then_begin_and_run<W, F>(
        &self,
        scope: &Scope,
        lock_timeout: Duration,
        now: SystemTime,
        work: W,
    ) -> impl Future<Output = Result<Began<F::Output>, Error>> + Send
    where
        W: FnOnce(SqliteReservation) -> F + Send + 'static,
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.run_on_writer(scope, lock_timeout, now, work, true)
    }

    async fn purge_expired(&self, now: SystemTime, batch: usize) -> Result<u64, Error> {
        let now = to_unix_millis(now);
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        self.shared
            .call_exclusive("IdempotencyStore::purge_expired", move |writer| {
                writer.settle();
                writer.set_busy_wait(STANDALONE_BUSY_TIMEOUT);
                let deleted = writer.conn.execute(
                    "DELETE FROM idempotency_records WHERE rowid IN (SELECT rowid FROM \
                     idempotency_records WHERE expires_at <= ?1 LIMIT ?2)",
                    params![now, batch],
                )?;
                Ok(deleted as u64)
            })
            .await
    }
}

struct TxShared {
    generation: u64,
    store: Arc<Shared>,
    finished: AtomicBool,
}

/// The open write transaction of one request (the owner side, held by the layer).
///
/// Dropping it without committing rolls back; the next request starts after that.
pub struct SqliteReservation {
    tx: Arc<TxShared>,
    /// Whether the request has yet to end (commit, roll back) on the writer.
    open: bool,
    scope: Scope,
}

impl fmt::Debug for SqliteReservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteReservation")
            .field("generation", &self.tx.generation)
            .finish_non_exhaustive()
    }
}

impl SqliteReservation {
    /// Marks the request ended; from now on the handler's clones of the handle refuse work.
    fn close(&mut self) {
        self.open = false;
        // Release: a begin still waiting on the writer sees it and is skipped.
        self.tx.finished.store(true, Ordering::Release);
    }

    /// Ends the request on the writer thread with `end`, which answers through `reply`.
    ///
    /// Whatever `end` does (even panicking), the request's savepoint is closed afterwards: the
    /// writer never waits for an owner that has gone.
    async fn end<T, F>(mut self, end: F) -> Result<T, Error>
    where
        F: FnOnce(&mut Writer, oneshot::Sender<Result<T, Error>>) + Send + 'static,
        T: Send + 'static,
    {
        let generation = self.tx.generation;
        self.close();
        let (reply, answer) = oneshot::channel();
        let step: Step = Box::new(move |writer| {
            if writer.active != Some(generation) {
                let _ = reply.send(Err(Error::TransactionAborted(
                    "the transaction was ended before commit",
                )));
                return;
            }
            let ended = std::panic::catch_unwind(AssertUnwindSafe(|| end(writer, reply)));
            if writer.active == Some(generation) {
                writer.rollback_request();
            }
            if let Err(panic) = ended {
                std::panic::resume_unwind(panic);
            }
        });
        // Polled on the writer thread (the request's work), it ends at once.
        if let Err(step) = run_if_on_writer(self.tx.store.id, step) {
            self.tx
                .store
                .jobs
                .send(Job::Step(step))
                .map_err(|_| Error::Closed)?;
        }
        answer.await.map_err(|_| Error::Panicked)?
    }
}

impl Drop for SqliteReservation {
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        // Before the rollback is queued: a begin that has not started yet is skipped, and one
        // that has is followed by this rollback.
        self.close();
        let generation = self.tx.generation;
        let _ = self
            .tx
            .store
            .jobs
            .send(Job::Step(Box::new(move |writer: &mut Writer| {
                if writer.active == Some(generation) {
                    writer.rollback_request();
                    tracing::debug!("idempotency transaction rolled back");
                }
            })));
    }
}

impl StoreTransaction for SqliteReservation {
    type Handle = SqliteTransaction;

    fn handle(&self) -> SqliteTransaction {
        SqliteTransaction {
            tx: self.tx.clone(),
        }
    }

    async fn commit(self, record: NewRecord) -> Result<(), Error> {
        let scope = self.scope.clone();
        // Answered once the group holding the record has committed: one wake-up, not two.
        self.end(move |writer, reply| {
            match insert_record(&writer.conn, &scope, &record)
                .and_then(|()| writer.release_request())
            {
                Ok(()) => writer.on_commit(Member {
                    scope,
                    saved: true,
                    notify: Box::new(move |outcome| {
                        let _ = reply.send(outcome);
                    }),
                }),
                // `end` rolls the savepoint back next.
                Err(error) => {
                    let _ = reply.send(Err(error));
                }
            }
        })
        .await
    }

    async fn rollback(self) -> Result<(), Error> {
        self.end(|writer, reply| {
            writer.rollback_request();
            let _ = reply.send(Ok(()));
        })
        .await
    }
}

/// The handle a handler uses to write its rows in the request's transaction.
///
/// The layer puts it in the request extensions. Everything run through it belongs to the same
/// SQLite transaction as the idempotency record: it commits when the layer saves the response,
/// and rolls back if the handler fails, panics or the client goes away.
///
/// ```no_run
/// # async fn handler(tx: tower_idempotency::store::sqlite::SqliteTransaction)
/// #     -> Result<i64, tower_idempotency::Error> {
/// let order_id = tx
///     .run(|conn| {
///         conn.execute("INSERT INTO orders (sku, quantity) VALUES (?1, ?2)", ("book", 1))?;
///         Ok(conn.last_insert_rowid())
///     })
///     .await?;
/// # Ok(order_id) }
/// ```
#[derive(Clone)]
pub struct SqliteTransaction {
    tx: Arc<TxShared>,
}

impl fmt::Debug for SqliteTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteTransaction")
            .field("generation", &self.tx.generation)
            .field("finished", &self.tx.finished.load(Ordering::Acquire))
            .finish()
    }
}

impl SqliteTransaction {
    /// Runs `f` on the transaction's connection, on the writer thread: at once when called
    /// from the handler under the layer (its work is polled there, see the
    /// [module docs](self#the-handler-runs-on-the-writer-thread)), through the writer's queue
    /// from any other task. A panic in `f` is returned as [`Error::Panicked`].
    ///
    /// Transaction control in `f` (`COMMIT`, `ROLLBACK`, `BEGIN`, `END`, the request's
    /// savepoint) is refused with [`Error::TransactionControl`]: the layer commits. If the
    /// transaction ends inside `f` anyway (a trigger's `RAISE(ROLLBACK)`, `ON CONFLICT
    /// ROLLBACK`, or SQLite rolling it back on a full disk), this returns
    /// [`Error::TransactionAborted`] and the request fails; the other requests of its commit
    /// group run again (see [group commit](self#group-commit)).
    pub async fn run<T, F>(&self, f: F) -> Result<T, Error>
    where
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        if self.tx.finished.load(Ordering::Acquire) {
            return Err(Error::TransactionFinished);
        }
        let generation = self.tx.generation;
        let statement = move |writer: &mut Writer| {
            if writer.active != Some(generation) {
                return Err(Error::TransactionFinished);
            }
            // A panicking statement is an error for the caller, not a panic through it.
            let result = std::panic::catch_unwind(AssertUnwindSafe(|| f(&writer.conn)))
                .map_err(|_| Error::Panicked)?;
            if writer.conn.is_autocommit() {
                // `after_job` rolls the rest of the group back, and its members run again.
                // The statement's own error says why (a full disk is a 503); the request's end
                // finds its transaction gone either way.
                return Err(match result {
                    Err(error) => writer.control.error(error),
                    Ok(_) => Error::TransactionAborted(
                        "a handler's statement ended the transaction (RAISE(ROLLBACK), \
                         ON CONFLICT ROLLBACK, or a disk error)",
                    ),
                });
            }
            result.map_err(|error| writer.control.error(error))
        };
        // From the request's work, polled on the writer thread: run the statement now.
        match run_if_on_writer(self.tx.store.id, statement) {
            Ok(result) => result,
            Err(statement) => self.tx.store.call(statement).await,
        }
    }

    /// Whether the transaction has been committed or rolled back.
    pub fn is_finished(&self) -> bool {
        self.tx.finished.load(Ordering::Acquire)
    }
}
