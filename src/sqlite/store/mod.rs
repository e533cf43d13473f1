#![doc = include_str!("../../docs/sqlite.md")]

// The store's parts, one concern a file:
// - `options`: `SqliteOptions`, durability (`Synchronous`) and the group limits.
// - `writer`: the writer thread, its job queue and the `Writer` that lives on it.
// - `group`: group commit on the `Writer`: requests' savepoints, commits, isolation.
// - `executor`: `begin_and_run` on the writer thread, polling the requests' work there.
// - `in_place`: `begin_and_run` on the request's own task, with the idle writer.
// - `reader`: the reader connections of the fast path.
// - `purge`: the purge of expired records, a walk along the records' primary key.
// - `records`: the schema, the record SQL and row decoding.
// - `authorizer`: the writer's authorizer, refusing transaction control to handlers.
// - `file`: the database file: its identity, other processes' locks, giving way to them.
// - `reservation`: `SqliteReservation`, the layer's side of a request's transaction.
// - `handle`: `SqliteHandle`, the handler's side.
// This file holds the store itself: opening it, its own calls and the trait impl.
//
// How a request runs (the layer's side is in `src/service/`):
//
// The layer calls `IdempotencyStore::lookup_then_begin_and_run` for a request's first attempt and
// `IdempotencyStore::begin_and_run` when it runs the request again (after a serialization conflict
// or `Error::GroupRolledBack`). Called on a tokio runtime:
//
// 1. **Fast path** (first attempt only). A reader connection reads the record, in place or under
//    `spawn_blocking` (`reader`). A live one is the answer (`RunOutcome::Found`): nothing is queued
//    for the writer. Otherwise (no record, an expired one, or a failed read, which is only logged)
//    the reader queues the request's begin for the writer itself, so that the request is woken
//    once, by its answer.
// 2. **Begin.** The begin waits in the writer's queue, at most the lock timeout (`Error::Busy` past
//    it). On the writer it opens the group transaction if none is open (`BEGIN IMMEDIATE`), or
//    else the request's savepoint in the open one (the request that opens the transaction needs
//    none: until it ends, the transaction holds its work alone), and reads the record again: a live one (a duplicate committed
//    first, perhaps in the open group) is the answer once that group is durable
//    (`RunOutcome::Existing`); an expired one is deleted.
// 3. **Work.** Otherwise the layer's work for the request (calling the handler, capturing its
//    response, committing) is polled on the writer thread, and the handler's `SqliteHandle::run`
//    runs its statements there at once.
// 4. **Commit.** `Reservation::commit` inserts the record and releases the savepoint, keeping the
//    request's rows in the group; the request gets its answer (`RunOutcome::Ran`) once the group's
//    `COMMIT` has returned. A rollback, an error or a dropped `SqliteReservation` undoes the
//    savepoint alone (the transaction, for the request that opened it).
//
// **In place.** When the writer is idle (nothing open, nobody queued) and SQLite's write lock is
// free without a busy wait, steps 2 to 4 run on the request's own task instead, with the writer
// that the writer thread left idle (`SqliteOptions::with_write_in_place`, on by default): the
// begin, the handler's statements and the commit run inline, as in a hand-written handler, without
// the two hand-overs to the writer thread and back (on a multi-thread runtime only). The
// statements and the commit block the worker; each runs under `block_in_place`, so that the
// worker's other tasks go on meanwhile, unless its call site has been fast lately (under
// `SqliteOptions::with_inline_limit`), when it runs inline and skips that hand-over: a site that
// has been fast and turns slow blocks its worker once (see `in_place`). Requests that arrive
// meanwhile queue for the writer thread (step 2), which takes the writer back when the request
// ends; if any queued, the request's rows stay in an open group that they join, and it is
// answered when that group commits.
//
// Without a tokio runtime the same steps run one after the other in the caller's task
// (`IdempotencyStore::lookup`, `IdempotencyStore::begin`, then the work awaited in place).
mod authorizer;
mod executor;
mod file;
mod group;
mod handle;
mod in_place;
mod options;
mod purge;
mod reader;
mod records;
mod reservation;
mod steps;
mod writer;

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// The rusqlite version the store's closures use: depend on it through this re-export.
pub use rusqlite;
use rusqlite::Connection;
use tokio::sync::oneshot;

pub use handle::SqliteHandle;
pub use options::{SqliteOptions, Synchronous};
pub(crate) use reservation::SqliteReservation;

use crate::error::Error;
use crate::store::retry_share::RetryShare;
use crate::store::{
    to_unix_millis, Begin, IdempotencyStore, PurgeStep, RunOutcome, Scope, StoredRecord,
};
use authorizer::{refuse_foreign_transaction_control, ControlAllowed, ControlGuard, ControlSql};
use file::{is_busy, BusyWait, DatabaseFile, OtherWriters, STANDALONE_BUSY_TIMEOUT};
use group::Member;
use in_place::CallSites;
use records::SCHEMA;
use writer::{writer_thread, IdleWriter, Job, Step, Writer, NESTED_REQUEST};

/// How long a reader connection waits for a lock before it reports busy (off the executor).
const READER_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// What the store's clones, its requests' transactions and the writer's wakers share.
struct Shared {
    /// Tells this store's writer thread from another store's.
    id: u64,
    path: PathBuf,
    jobs: mpsc::Sender<Job>,
    readers: Mutex<Vec<Connection>>,
    max_idle_readers: usize,
    /// [`SqliteOptions::with_read_in_place`].
    read_in_place: bool,
    /// [`SqliteOptions::with_write_in_place`].
    write_in_place: bool,
    /// Which blocking calls of requests run in place may run inline
    /// ([`SqliteOptions::with_inline_limit`]).
    sites: CallSites,
    /// Where the writer thread leaves the writer while idle (see `in_place`).
    idle: Arc<Mutex<IdleWriter>>,
    generations: AtomicU64,
    /// How many exclusive jobs wait for the writer (read by the writer thread to decide
    /// whether a group should wait for more).
    queued: Arc<AtomicUsize>,
    /// How often recent first attempts were retries: while rare, a request that finds the
    /// writer idle skips the read before its transaction (see `in_place`).
    retries: RetryShare,
    /// Where the purge's walk along the records' key is (see `purge`).
    purge: Mutex<purge::PurgeWalk>,
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
        Self::builder(path).build().await
    }

    /// Options for opening the database at `path`.
    pub fn builder(path: impl AsRef<Path>) -> SqliteOptions {
        SqliteOptions::new(path.as_ref())
    }

    fn open_blocking(options: SqliteOptions) -> Result<Self, Error> {
        let mut conn = Connection::open(&options.path)?;
        conn.busy_timeout(STANDALONE_BUSY_TIMEOUT)?;
        // Another process setting up the same new file at the same moment can make SQLite
        // answer busy without waiting (switching to WAL, recovering the WAL): try again until
        // the busy timeout has passed.
        let deadline = Instant::now() + STANDALONE_BUSY_TIMEOUT;
        loop {
            match set_up_file(&conn, options.synchronous) {
                Err(error) if is_busy(&error) && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                set_up => break set_up?,
            }
        }

        let file = DatabaseFile::opened(&options.path);
        // From now on the writer connection waits for other processes' locks through this
        // handler (`set_busy_wait` sets how long).
        let busy = Arc::new(Mutex::new(BusyWait::new(STANDALONE_BUSY_TIMEOUT)));
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
            savepoint: false,
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
        };
        let idle = Arc::new(Mutex::new(IdleWriter::default()));
        let thread_idle = idle.clone();
        std::thread::Builder::new()
            .name("tower-idempotency-sqlite-writer".into())
            .spawn(move || writer_thread(writer, &receiver, &thread_idle))?;

        // One reader from the start: a replay is read even if the first requests, all new
        // keys, never needed one, and the file is deleted or becomes unreadable later. Without
        // it (it could not be opened), readers are opened when needed, as always.
        let readers = match options.max_idle_readers {
            0 => Vec::new(),
            _ => match reader::open_warm_reader(&options.path, STANDALONE_BUSY_TIMEOUT) {
                Ok(conn) => vec![conn],
                Err(error) => {
                    tracing::debug!(%error, "no reader connection opened with the store");
                    Vec::new()
                }
            },
        };
        Ok(SqliteStore {
            shared: Arc::new(Shared {
                id: store_id,
                path: options.path,
                jobs,
                readers: Mutex::new(readers),
                max_idle_readers: options.max_idle_readers,
                read_in_place: options.read_in_place,
                write_in_place: options.write_in_place,
                sites: CallSites::new(options.inline_limit),
                idle,
                generations: AtomicU64::new(1),
                queued,
                retries: RetryShare::default(),
                purge: Mutex::default(),
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
    /// that are not part of an idempotent request. `f` returning an error rolls back, and so
    /// does a database file deleted or replaced before the commit (an [`Error::Io`]), as for a
    /// request.
    ///
    /// Called from a handler inside its own request, it fails at once with
    /// [`Error::InsideRequest`]: it would wait for the request to end. Use the request's
    /// [`SqliteHandle::run`] there.
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
                        // Again before `COMMIT`, as a request's commit does: `f` may have run
                        // for long enough for the file to be deleted under it.
                        if let Err(error) = writer.file.check() {
                            drop(tx);
                            return Err(error);
                        }
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

/// Switches the database to WAL, sets the connection's pragmas and creates the schema.
fn set_up_file(conn: &Connection, synchronous: Synchronous) -> rusqlite::Result<()> {
    let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        tracing::warn!(%mode, "SQLite did not switch to WAL; replays may wait for writers");
    }
    conn.pragma_update(None, "synchronous", synchronous.pragma())?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    conn.execute_batch(SCHEMA)
}

/// Numbers the stores of the process.
static NEXT_STORE_ID: AtomicU64 = AtomicU64::new(1);

impl IdempotencyStore for SqliteStore {
    type Reservation = SqliteReservation;

    /// In place when that cannot wait (see [`SqliteOptions::with_read_in_place`]), else under
    /// `spawn_blocking` (or in place, without a tokio runtime).
    async fn lookup(&self, scope: &Scope, now: SystemTime) -> Result<Option<StoredRecord>, Error> {
        if let Some(found) = self.shared.try_read_live_record_in_place(scope, now) {
            return found;
        }
        if tokio::runtime::Handle::try_current().is_err() {
            return self.shared.read_live_record(scope, now);
        }
        let shared = self.shared.clone();
        let scope = scope.clone();
        tokio::task::spawn_blocking(move || shared.read_live_record(&scope, now))
            .await
            .map_err(|_| Error::Panicked)?
    }

    async fn begin(
        &self,
        scope: &Scope,
        lock_timeout: Duration,
        now: SystemTime,
    ) -> Result<Begin<SqliteReservation>, Error> {
        self.begin_with(scope, lock_timeout, now, false).await
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
    ) -> impl Future<Output = Result<RunOutcome<F::Output>, Error>> + Send
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
    ) -> impl Future<Output = Result<RunOutcome<F::Output>, Error>> + Send
    where
        W: FnOnce(SqliteReservation) -> F + Send + 'static,
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.run_on_writer(scope, lock_timeout, now, work, true)
    }

    /// Goes on with the walk along the records' key where the last call left it (see
    /// `purge_expired_step`): it may delete fewer than `batch` before the end of the table.
    async fn purge_expired(&self, now: SystemTime, batch: usize) -> Result<u64, Error> {
        let records = self.purge_step(now, batch, false).await?.deleted;
        let progress = crate::steps::StepStore::purge_progress(self, now, batch).await?;
        Ok(records + progress)
    }

    /// Walks the records in key order, from where the last call stopped: looks at 16 records
    /// per record of `batch` at most (1,024 at least), on a reader connection, and deletes the
    /// expired ones among them, up to `batch`, in one transaction on the writer. Done when the
    /// walk reaches the end of the table (then it starts again from the start). A purge that
    /// finds a pass begun with an earlier `now` in progress starts its own.
    async fn purge_expired_step(&self, now: SystemTime, batch: usize) -> Result<PurgeStep, Error> {
        let mut step = self.purge_step(now, batch, true).await?;
        // Once the walk is done, the keys left running past their expiry, a batch per call.
        if step.done {
            let progress = crate::steps::StepStore::purge_progress(self, now, batch).await?;
            step.deleted += progress;
            step.done = progress < batch as u64;
        }
        Ok(step)
    }
}

impl SqliteStore {
    /// [`IdempotencyStore::begin`]; `alone`: the request runs in a group of its own (see
    /// `group`), as a request another member's failure rolled back runs again.
    pub(super) async fn begin_with(
        &self,
        scope: &Scope,
        lock_timeout: Duration,
        now: SystemTime,
        alone: bool,
    ) -> Result<Begin<SqliteReservation>, Error> {
        let deadline = Instant::now() + lock_timeout;
        // Built before the begin is queued, so that dropping this future at any await point
        // (or the begin failing in any way) queues the rollback of whatever it began.
        let mut reservation = SqliteReservation::new(&self.shared, scope);
        let generation = reservation.tx.generation;
        let tx = reservation.tx.clone();
        let scope = scope.clone();
        let now_millis = to_unix_millis(now);
        let (reply, answer) = oneshot::channel::<Result<Option<StoredRecord>, Error>>();
        let begin: Step = Box::new(move |writer| {
            // Its caller gave up (timed out, or went away) while it waited: skip it.
            if tx.finished.load(Ordering::Acquire) {
                return;
            }
            match writer.reserve_scope(generation, deadline, &scope, now_millis, alone) {
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
}
