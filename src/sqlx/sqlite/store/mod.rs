#![doc = include_str!("../guide.md")]

use std::time::{Duration, SystemTime};

use futures_util::future::BoxFuture;
use sqlx::sqlite::{Sqlite, SqliteConnection, SqliteQueryResult};
// The `Executor` methods on a connection rather than the query builders' `execute(conn)`:
// their boxed futures keep the store's futures provably `Send`.
use sqlx::{Executor as _, Row as _};
use tokio::time::Instant;

use crate::error::Error;
use crate::sqlx::driver::our_sql;
use crate::sqlx::store::{
    ReserveStep, RowsAffected, SqlxDatabase, SqlxDialect, SqlxOptions, SqlxStore,
};
use crate::store::{NewRecord, Scope};

mod owned;
pub(crate) mod sql;

/// The sqlx version of the pools and of the handle's connection: depend on it through this
/// re-export (or keep yours on the same 0.9 release).
pub use sqlx;

/// A SQLite-backed [`IdempotencyStore`](crate::store::IdempotencyStore) on sqlx. Cheap to
/// clone; clones share the pools.
pub type SqlxSqliteStore = SqlxStore<SqliteDialect>;

/// Options for a [`SqlxSqliteStore`]; see `SqlxSqliteStore::builder`.
pub type SqlxSqliteOptions = SqlxOptions<SqliteDialect>;

/// The handle a handler uses to write its rows in the request's SQLite transaction.
///
/// ```no_run
/// # async fn handler(tx: tower_idempotency::store::sqlx_sqlite::SqlxSqliteHandle)
/// #     -> Result<i64, Box<dyn std::error::Error>> {
/// let mut conn = tx.acquire().await?;
/// let (order_id,): (i64,) =
///     sqlx::query_as("INSERT INTO orders (sku, quantity) VALUES (?1, ?2) RETURNING id")
///         .bind("book")
///         .bind(1i64)
///         .fetch_one(&mut *conn)
///         .await?;
/// # Ok(order_id) }
/// ```
///
/// - The transaction holds the database's write lock from its start (`BEGIN IMMEDIATE`):
///   requests write one at a time, and a handler's statements never wait for another writer.
/// - Refused: `BEGIN`, `COMMIT`, `END` and `ROLLBACK` (see [`SqlxSqliteConnection`]).
///   `SAVEPOINT`, `RELEASE` and `ROLLBACK TO` are allowed.
#[doc = crate::sqlx::store::handle_docs!("SqlxSqliteHandle", "SqlxSqliteConnection")]
pub type SqlxSqliteHandle = crate::sqlx::store::SqlxHandle<SqliteDialect>;

/// A pooled connection inside the request's transaction: `&mut SqlxSqliteConnection` is a
/// [`sqlx::Executor`] for SQLite, on which sqlx code runs as on a `&mut SqliteConnection`.
///
/// `BEGIN`, `COMMIT`, `END` and `ROLLBACK` (but `ROLLBACK TO`) are refused anywhere in a
/// string: sqlx runs every statement of one, and the check cuts it into statements by
/// SQLite's own lexical rules.
#[doc = crate::sqlx::store::connection_docs!("SqlxSqliteHandle")]
pub type SqlxSqliteConnection = crate::sqlx::store::CheckedConnection<SqliteDialect>;

mod dialect {
    /// SQLite as the sqlx store's database: the reservation is the database's write lock
    /// (`BEGIN IMMEDIATE`), the record is saved when the response is, and the SQLite
    /// statement guard.
    #[derive(Clone, Copy, Debug)]
    pub struct SqliteDialect;
}
pub(crate) use dialect::SqliteDialect;

impl SqlxSqliteStore {
    /// Turns on write-ahead logging for the file and creates `idempotency_records` if it is
    /// missing. Safe to run at every start, from several processes at once.
    ///
    /// Durable by default: with WAL on, a commit is on disk when it returns as long as the
    /// pool keeps SQLite's default `synchronous = FULL` (sqlx's default too). A pool set to
    /// `NORMAL` may lose the last commits on a power cut (not on a crash of the process); a
    /// warning is logged then.
    pub async fn migrate(&self) -> Result<(), Error> {
        let mut conn = self.pool().acquire().await?;
        conn.execute(sql::WAL).await?;
        conn.execute(sql::SCHEMA).await?;
        let synchronous: i64 = conn.fetch_one(sql::SYNCHRONOUS).await?.try_get(0)?;
        if synchronous < 2 {
            tracing::warn!(
                synchronous,
                "the pool's connections commit with synchronous below FULL: a power cut may \
                 lose committed records and the rows saved with them"
            );
        }
        Ok(())
    }
}

impl RowsAffected for SqliteQueryResult {
    fn rows_affected(&self) -> u64 {
        SqliteQueryResult::rows_affected(self)
    }
}

impl crate::sqlx::store::sealed::Sealed for SqliteDialect {}

/// How long until `deadline`, in milliseconds, for SQLite's busy timeout.
fn millis_until(deadline: Instant) -> u64 {
    let left = deadline.saturating_duration_since(Instant::now());
    u64::try_from(left.as_millis()).unwrap_or(u64::MAX)
}

impl SqlxDialect for SqliteDialect {
    type Db = Sqlite;
    /// The record is saved by its key.
    type RowId = ();

    const STORE_NAME: &'static str = "SqlxSqliteStore";
    const SELECT_RECORD: &'static str = sql::SELECT_RECORD;
    const SELECT_LIVE_RECORD: &'static str = sql::SELECT_LIVE_RECORD;
    const PURGE_EXPIRED: &'static str = sql::PURGE_EXPIRED;
    const COMMIT: &'static str = sql::COMMIT;
    const ROLLBACK: &'static str = sql::ROLLBACK;
    const REFUSED_AFTER_CONFLICT: Option<&'static str> = None;

    fn purge_progress(
        store: &SqlxStore<Self>,
        now: SystemTime,
        batch: usize,
    ) -> BoxFuture<'_, Result<u64, Error>> {
        Box::pin(crate::steps::StepStore::purge_progress(store, now, batch))
    }

    /// Any length fits.
    fn check_scope(_scope: &Scope) -> Result<(), Error> {
        Ok(())
    }

    /// `BEGIN IMMEDIATE`, its wait for the write lock bounded by `deadline`. SQLite is
    /// serializable at every isolation level. The in-flight policy's bound does not apply: the
    /// lock another request holds is the database's, not its key's, so a duplicate waits as
    /// any other request does (see [`InFlight`](crate::InFlight)).
    fn begin_request(
        _isolation: crate::store::Isolation,
        deadline: Instant,
        _key_row_wait: Option<Duration>,
    ) -> String {
        sql::begin(millis_until(deadline))
    }

    /// Nothing: the busy timeout set before `BEGIN IMMEDIATE` is the deadline's already (the
    /// in-flight policy's bound is not applied), and inside the transaction, which holds the
    /// write lock, no statement waits for another writer.
    fn restore_lock_wait(_deadline: Instant) -> String {
        String::from(sql::NOTHING)
    }

    /// `BEGIN IMMEDIATE` as [`begin_request`](Self::begin_request) writes it, sent as raw SQL:
    /// its text changes with every request (the milliseconds left), and sqlx would keep each
    /// text as a prepared statement in the connection's cache, pushing out the handler's.
    fn open_request<'a>(
        conn: &'a mut SqliteConnection,
        isolation: crate::store::Isolation,
        (deadline, key_row_wait): (Instant, Option<Duration>),
        _reservation: (&'a Scope, i64),
        _unnamed: bool,
    ) -> BoxFuture<'a, Result<crate::sqlx::store::Opened<()>, Error>> {
        let begin = Self::begin_request(isolation, deadline, key_row_wait);
        Box::pin(async move {
            conn.execute(sqlx::raw_sql(our_sql(begin))).await?;
            Ok(crate::sqlx::store::Opened {
                inserted: None,
                lock_wait_restored: false,
            })
        })
    }

    /// Under the write lock no other transaction writes: the key is this request's unless it
    /// has a live record. An expired record is replaced when the new one is saved.
    fn reserve<'a>(
        conn: &'a mut SqliteConnection,
        step: ReserveStep,
        scope: &'a Scope,
        now: i64,
    ) -> BoxFuture<'a, Result<Option<()>, Error>> {
        Box::pin(async move {
            if step == ReserveStep::TakeOver {
                return Ok(Some(()));
            }
            let query = Sqlite::bind_scope(sqlx::query(sql::HAS_LIVE_RECORD), scope).bind(now);
            let live = conn.fetch_optional(query).await?;
            Ok(live.is_none().then_some(()))
        })
    }

    /// Checks that the transaction is still the one the store began (see
    /// [`sql::CHECK_OPEN`]), then saves the record.
    fn complete<'a>(
        conn: &'a mut SqliteConnection,
        scope: &'a Scope,
        _row: &'a (),
        record: &'a NewRecord,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            if let Err(error) = conn.execute(sql::CHECK_OPEN).await {
                tracing::debug!(%error, "the request's transaction was rolled back under it");
                return Err(Error::TransactionAborted(
                    "the transaction ended before commit (SQLite rolled it back)",
                ));
            }
            let save = Sqlite::bind_record(sqlx::query(sql::SAVE_RECORD), record);
            conn.execute(Sqlite::bind_scope(save, scope)).await?;
            Ok(())
        })
    }

    /// SQLite has no serialization failures: writers take the lock one at a time.
    fn is_conflict(_error: &sqlx::Error) -> bool {
        false
    }

    fn is_unavailable(error: &sqlx::Error) -> bool {
        crate::sqlx::error::sqlx_unavailable(error)
    }

    fn check_command(sql: &str) -> Result<(), Error> {
        crate::sqlx::sqlite::guard::check_command(sql)
    }

    fn split(sql: &str) -> Vec<&str> {
        crate::sqlx::sqlite::guard::split(sql)
    }
}
