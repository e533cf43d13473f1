//! The SQLite store: one writer connection on a dedicated thread, WAL readers for the
//! replay fast path.
//!
//! SQLite allows one writer at a time, so the store queues writers in-process behind an async
//! lock instead of letting them collide on `SQLITE_BUSY`. The writer connection lives on its
//! own thread and every statement on it runs there: rusqlite is blocking and must never run on
//! the async executor's threads. Reads of completed records (the fast path) run on reader
//! connections under `spawn_blocking`; in WAL mode they never wait for the writer.
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

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::StatusCode;
/// The rusqlite version the store's closures use: depend on it through this re-export.
pub use rusqlite;
use rusqlite::{params, Connection, OpenFlags, OptionalExtension};
use tokio::sync::{oneshot, OwnedMutexGuard};

use super::{
    from_unix_millis, to_unix_millis, Begin, IdempotencyStore, NewRecord, Scope, StoreTransaction,
    StoredRecord,
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

    /// Opens (creating if needed) the database, switches it to WAL, creates the schema and
    /// starts the writer thread.
    pub async fn open(self) -> Result<SqliteStore, Error> {
        let options = self;
        tokio::task::spawn_blocking(move || SqliteStore::open_blocking(options))
            .await
            .map_err(|_| Error::Panicked)?
    }
}

type Job = Box<dyn FnOnce(&mut Writer) + Send>;

/// What lives on the writer thread.
struct Writer {
    conn: Connection,
    /// The generation of the transaction that is open, if any.
    active: Option<u64>,
}

impl Writer {
    fn rollback_if_open(&mut self) {
        if !self.conn.is_autocommit() {
            if let Err(error) = self.conn.execute_batch("ROLLBACK") {
                tracing::error!(%error, "rollback failed");
            }
        }
        self.active = None;
    }
}

struct Shared {
    path: PathBuf,
    jobs: mpsc::Sender<Job>,
    /// Held by whoever may send statements to the writer: one transaction at a time.
    writer_lock: Arc<tokio::sync::Mutex<()>>,
    readers: Mutex<Vec<Connection>>,
    max_idle_readers: usize,
    generations: AtomicU64,
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
        }
    }

    fn open_blocking(options: SqliteOptions) -> Result<Self, Error> {
        let conn = Connection::open(&options.path)?;
        conn.busy_timeout(Duration::from_secs(5))?;
        let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            tracing::warn!(%mode, "SQLite did not switch to WAL; replays may wait for writers");
        }
        conn.pragma_update(None, "synchronous", options.synchronous.pragma())?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.execute_batch(SCHEMA)?;

        let (jobs, receiver) = mpsc::channel::<Job>();
        let mut writer = Writer { conn, active: None };
        std::thread::Builder::new()
            .name("tower-idempotency-sqlite-writer".into())
            .spawn(move || {
                // Ends when every sender (the store and all transactions) is gone.
                for job in receiver {
                    // A panicking job drops its reply channel, which its caller reports as
                    // `Error::Panicked`; the thread and the connection go on serving.
                    let _ = std::panic::catch_unwind(AssertUnwindSafe(|| job(&mut writer)));
                }
                writer.rollback_if_open();
            })?;

        Ok(SqliteStore {
            shared: Arc::new(Shared {
                path: options.path,
                jobs,
                writer_lock: Arc::new(tokio::sync::Mutex::new(())),
                readers: Mutex::new(Vec::new()),
                max_idle_readers: options.max_idle_readers,
                generations: AtomicU64::new(1),
            }),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.shared.path
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
    pub async fn write<T, F>(&self, f: F) -> Result<T, Error>
    where
        F: FnOnce(&rusqlite::Transaction<'_>) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let _guard = self.shared.writer_lock.clone().lock_owned().await;
        self.shared
            .call(move |writer| {
                writer.rollback_if_open();
                let tx = writer
                    .conn
                    .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
                let value = f(&tx)?;
                tx.commit()?;
                Ok(value)
            })
            .await
    }
}

impl Shared {
    /// Sends `f` to the writer thread and waits for its answer. The caller must hold the
    /// writer lock (or own the open transaction) so that jobs of different transactions
    /// never interleave.
    async fn call<T, F>(&self, f: F) -> Result<T, Error>
    where
        F: FnOnce(&mut Writer) -> Result<T, Error> + Send + 'static,
        T: Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let job: Job = Box::new(move |writer| {
            let _ = reply.send(f(writer));
        });
        self.jobs.send(job).map_err(|_| Error::Closed)?;
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
        let guard =
            tokio::time::timeout(lock_timeout, self.shared.writer_lock.clone().lock_owned())
                .await
                .map_err(|_| Error::Busy)?;
        let generation = self.shared.generations.fetch_add(1, Ordering::Relaxed);
        // Built before BEGIN runs, so that dropping this future at any await point rolls back.
        let reservation = SqliteReservation {
            tx: Arc::new(TxShared {
                generation,
                store: self.shared.clone(),
                finished: AtomicBool::new(false),
            }),
            guard: Some(guard),
            scope: scope.clone(),
        };
        // Other processes may hold SQLite's own write lock: wait for it as long as the lock
        // timeout allows, no longer.
        let busy_wait = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        let scope = scope.clone();
        let now_millis = to_unix_millis(now);
        let existing = self
            .shared
            .call(move |writer| {
                writer.rollback_if_open();
                writer.conn.busy_timeout(busy_wait)?;
                if let Err(error) = writer.conn.execute_batch("BEGIN IMMEDIATE") {
                    return Err(if is_busy(&error) {
                        Error::Busy
                    } else {
                        error.into()
                    });
                }
                writer.active = Some(generation);
                let checked = (|| {
                    match read_record(&writer.conn, &scope)? {
                        Some(record) if to_unix_millis(record.expires_at) > now_millis => {
                            return Ok(Some(record));
                        }
                        Some(_) => {
                            writer.conn.execute(
                                "DELETE FROM idempotency_records WHERE tenant = ?1 \
                                 AND operation = ?2 AND idempotency_key = ?3",
                                params![&*scope.tenant, &*scope.operation, scope.key.as_str()],
                            )?;
                        }
                        None => {}
                    }
                    Ok(None)
                })();
                match checked {
                    Ok(Some(record)) => {
                        writer.rollback_if_open();
                        Ok(Some(record))
                    }
                    Ok(None) => Ok(None),
                    Err(error) => {
                        writer.rollback_if_open();
                        Err(error)
                    }
                }
            })
            .await?;
        match existing {
            Some(record) => {
                reservation.tx.finished.store(true, Ordering::Release);
                Ok(Begin::Existing(record))
            }
            None => Ok(Begin::Reserved(reservation)),
        }
    }

    async fn purge_expired(&self, now: SystemTime, batch: usize) -> Result<u64, Error> {
        let _guard = self.shared.writer_lock.clone().lock_owned().await;
        let now = to_unix_millis(now);
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        self.shared
            .call(move |writer| {
                writer.rollback_if_open();
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
/// Dropping it without committing rolls back and only then releases the writer lock.
pub struct SqliteReservation {
    tx: Arc<TxShared>,
    guard: Option<OwnedMutexGuard<()>>,
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
    /// Ends the transaction with `finish` on the writer thread, then releases the lock.
    async fn finish<F>(mut self, finish: F) -> Result<(), Error>
    where
        F: FnOnce(&mut Writer) -> Result<(), Error> + Send + 'static,
    {
        let generation = self.tx.generation;
        // From here on the handler's clones of the handle refuse work.
        self.tx.finished.store(true, Ordering::Release);
        let result = self
            .tx
            .store
            .call(move |writer| {
                if writer.active != Some(generation) {
                    return Err(Error::TransactionAborted(
                        "the transaction was ended before commit",
                    ));
                }
                finish(writer)
            })
            .await;
        // The job ran (or the thread is gone): nothing of this transaction is left open.
        self.guard.take();
        result
    }
}

impl Drop for SqliteReservation {
    fn drop(&mut self) {
        if self.guard.is_none() {
            return;
        }
        self.tx.finished.store(true, Ordering::Release);
        let generation = self.tx.generation;
        // Queued before the guard is released, so the next transaction's BEGIN runs after it.
        let _ = self
            .tx
            .store
            .jobs
            .send(Box::new(move |writer: &mut Writer| {
                if writer.active == Some(generation) {
                    writer.rollback_if_open();
                    tracing::debug!("idempotency transaction rolled back");
                }
            }));
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
        self.finish(move |writer| {
            let saved = (|| {
                if writer.conn.is_autocommit() {
                    return Err(Error::TransactionAborted(
                        "SQLite ended the transaction before commit",
                    ));
                }
                let response = &record.response;
                writer
                    .conn
                    .prepare_cached(
                        "INSERT INTO idempotency_records (tenant, operation, idempotency_key, \
                         fingerprint, fingerprint_version, status, headers, body, trailers, \
                         created_at, expires_at) \
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
                writer.conn.execute_batch("COMMIT")?;
                Ok(())
            })();
            if saved.is_err() {
                writer.rollback_if_open();
            }
            writer.active = None;
            saved
        })
        .await
    }

    async fn rollback(self) -> Result<(), Error> {
        self.finish(|writer| {
            writer.rollback_if_open();
            Ok(())
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
    /// Runs `f` on the transaction's connection, on the writer thread.
    ///
    /// Do not run `COMMIT`, `ROLLBACK` or `BEGIN` in `f`: the layer commits. If the
    /// transaction ends inside `f` anyway (by such a statement, or because SQLite rolled it back
    /// on a full disk), this returns [`Error::TransactionAborted`] and the request fails.
    pub async fn run<T, F>(&self, f: F) -> Result<T, Error>
    where
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        if self.tx.finished.load(Ordering::Acquire) {
            return Err(Error::TransactionFinished);
        }
        let generation = self.tx.generation;
        self.tx
            .store
            .call(move |writer| {
                if writer.active != Some(generation) {
                    return Err(Error::TransactionFinished);
                }
                let result = f(&writer.conn);
                if writer.conn.is_autocommit() {
                    writer.active = None;
                    return Err(Error::TransactionAborted(
                        "the transaction ended inside a handler's statement",
                    ));
                }
                result.map_err(Error::from)
            })
            .await
    }

    /// Whether the transaction has been committed or rolled back.
    pub fn is_finished(&self) -> bool {
        self.tx.finished.load(Ordering::Acquire)
    }
}
