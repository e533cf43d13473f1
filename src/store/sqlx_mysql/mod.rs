//! The MySQL and MariaDB store on sqlx: built from the application's own [`sqlx::MySqlPool`].
//!
//! The same table layout, contract and guarantees as the PostgreSQL stores, on InnoDB:
//!
//! - **Reserving a key** is an `INSERT` of an `in_progress` row on the primary key
//!   `(tenant, operation, idempotency_key)`, inside the request's transaction. A duplicate
//!   (from this instance or another) blocks on that uncommitted row until the first
//!   transaction ends: after a commit its insert fails with a duplicate key and it replays the
//!   completed record, after a rollback its insert goes through and it runs the handler.
//!   Requests with different keys never wait for each other.
//! - **The handler's rows** go through [`SqlxTransaction`]: [`SqlxTransaction::acquire`] lends
//!   the transaction's connection, on which ordinary sqlx code runs
//!   (`sqlx::query(..).execute(&mut *conn)`, `query_as`, the `query!` macros). The layer then
//!   turns the reservation into the completed record and commits, before the response leaves.
//! - **Waits are bounded**: taking a connection from the pool and every lock wait
//!   (`innodb_lock_wait_timeout`, set for the request and restored after it) share the
//!   layer's lock timeout, rounded up to whole seconds; past it the request gets `503` with
//!   `Retry-After`. Deadlocks (`1213`) while reserving are retried a bounded number of times
//!   ([`SqlxMySqlOptions::deadlock_retries`]); one that a handler's statement gets is reported
//!   to the layer, which runs the request again.
//! - **The layer commits**: the connection the handle lends refuses transaction control and
//!   the statements that make MySQL commit on its own (DDL, `LOCK TABLES`, `SET autocommit`).
//! - **Replays** are a plain consistent read of completed records on a separate pool of read
//!   connections: no locks, and no waiting for the connections that writers hold.
//! - **Rollback on drop**: a transaction dropped while still open takes its connection out of
//!   the pool and closes it; the server rolls back a transaction whose connection is gone.
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use tower_idempotency::store::sqlx_mysql::sqlx::mysql::MySqlPoolOptions;
//! use tower_idempotency::store::sqlx_mysql::SqlxMySqlStore;
//!
//! let pool = MySqlPoolOptions::new()
//!     .max_connections(16)
//!     .connect("mysql://app@127.0.0.1/shop")
//!     .await?;
//! let store = SqlxMySqlStore::new(pool);
//! // Creates `idempotency_records` if it is missing (skip it when your own migrations run the
//! // crate's migration file).
//! store.migrate().await?;
//! # Ok(()) }
//! ```

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use sqlx::mysql::{MySqlConnection, MySqlPool, MySqlPoolOptions, MySqlRow};
// The `Executor` methods on a connection rather than the query builders' `execute(conn)`:
// their boxed futures keep the store's futures provably `Send`.
use sqlx::{Executor as _, Row};
use tokio::time::Instant;

use super::reserve::{self, ReserveStatements, Reserved};
use super::{to_unix_millis, Begin, IdempotencyStore, SavedColumns, Scope, StoredRecord};
use crate::error::{mysql_number, sqlx_code, Error, MYSQL_DEADLOCK};

mod handle;
mod reservation;
mod sql;

pub use handle::{SqlxConnection, SqlxTransaction, TxConnection};
use reservation::Slot;
pub use reservation::SqlxReservation;
/// The sqlx version of the pools and of the handle's connection: depend on it through this
/// re-export (or keep yours on the same 0.8 release).
pub use sqlx;

pub use super::reserve::Isolation;

/// MySQL's `ER_DUP_ENTRY`: the key has a committed row.
const DUPLICATE_KEY: u16 = 1062;

/// The longest tenant, operation or key the table holds, in bytes.
pub const MAX_SCOPE_BYTES: usize = 255;

/// Options for a [`SqlxMySqlStore`]; see [`SqlxMySqlStore::builder`].
#[derive(Clone, Debug)]
pub struct SqlxMySqlOptions {
    pool: MySqlPool,
    reads: Option<MySqlPool>,
    max_read_connections: u32,
    read_wait: Duration,
    isolation: Isolation,
    deadlock_retries: u32,
}

impl SqlxMySqlOptions {
    /// The pool of the replay fast path. Default: a pool of its own, made (lazily) from the
    /// write pool's connect options, with [`max_read_connections`](Self::max_read_connections)
    /// connections. Give one to read from a replica: a record not yet replicated is then only
    /// found by the (authoritative) write path.
    pub fn read_pool(mut self, pool: MySqlPool) -> Self {
        self.reads = Some(pool);
        self
    }

    /// The most connections of the read pool this store makes (not one given with
    /// [`read_pool`](Self::read_pool)). Default: 8.
    pub fn max_read_connections(mut self, connections: u32) -> Self {
        self.max_read_connections = connections.max(1);
        self
    }

    /// How long the replay fast path waits for a read before it gives up and lets the request
    /// take the (authoritative) write path. Default: 1 s.
    pub fn read_wait(mut self, wait: Duration) -> Self {
        self.read_wait = wait;
        self
    }

    /// The isolation level of request transactions. Default: [`Isolation::ReadCommitted`]
    /// (InnoDB's own default is `REPEATABLE READ`, whose gap locks make deadlocks between
    /// handlers likelier).
    pub fn isolation(mut self, isolation: Isolation) -> Self {
        self.isolation = isolation;
        self
    }

    /// How many times reserving a key is retried after a deadlock (`1213`: InnoDB rolled the
    /// transaction back, as happens when several requests waited on a key whose holder rolled
    /// back), within the lock timeout, before the request gets `503`. Default: 3.
    pub fn deadlock_retries(mut self, retries: u32) -> Self {
        self.deadlock_retries = retries;
        self
    }

    /// The store. Opens no connection: the read pool this makes connects on first use.
    pub fn build(self) -> SqlxMySqlStore {
        let reads = match self.reads {
            Some(reads) => reads,
            None => MySqlPoolOptions::new()
                .max_connections(self.max_read_connections)
                .acquire_timeout(self.read_wait.max(Duration::from_millis(1)))
                // A broken connection only fails a lookup, which the write path then redoes.
                .test_before_acquire(false)
                .connect_lazy_with((*self.pool.connect_options()).clone()),
        };
        SqlxMySqlStore {
            shared: Arc::new(Shared {
                transactions: self.pool,
                reads,
                read_wait: self.read_wait,
                isolation: self.isolation,
                deadlock_retries: self.deadlock_retries,
                reservations: AtomicU64::new(1),
            }),
        }
    }
}

struct Shared {
    transactions: MySqlPool,
    reads: MySqlPool,
    read_wait: Duration,
    isolation: Isolation,
    deadlock_retries: u32,
    reservations: AtomicU64,
}

/// A MySQL- or MariaDB-backed [`IdempotencyStore`] on sqlx. Cheap to clone; clones share the
/// pools.
#[derive(Clone)]
pub struct SqlxMySqlStore {
    shared: Arc<Shared>,
}

impl fmt::Debug for SqlxMySqlStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlxMySqlStore")
            .field("connections", &self.shared.transactions.size())
            .field("read_connections", &self.shared.reads.size())
            .field("isolation", &self.shared.isolation)
            .finish_non_exhaustive()
    }
}

impl SqlxMySqlStore {
    /// A store on `pool` with the default options. Opens no connection and creates nothing:
    /// run [`migrate`](Self::migrate), or the crate's migration with your own.
    ///
    /// Request transactions take their connections from `pool`, the one the rest of the
    /// application uses: size it for both.
    pub fn new(pool: MySqlPool) -> Self {
        Self::builder(pool).build()
    }

    /// Options for a store on `pool`.
    pub fn builder(pool: MySqlPool) -> SqlxMySqlOptions {
        SqlxMySqlOptions {
            pool,
            reads: None,
            max_read_connections: 8,
            read_wait: Duration::from_secs(1),
            isolation: Isolation::default(),
            deadlock_retries: 3,
        }
    }

    /// The pool of request transactions (the application's).
    pub fn pool(&self) -> &MySqlPool {
        &self.shared.transactions
    }

    /// The pool of the replay fast path.
    pub fn read_pool(&self) -> &MySqlPool {
        &self.shared.reads
    }

    /// Creates `idempotency_records` if it is missing (the crate's migration file, run under
    /// `GET_LOCK` so that instances starting together do not race). Safe to run at every start,
    /// and before or after `sqlx migrate run` of the same file.
    pub async fn migrate(&self) -> Result<(), Error> {
        let mut conn = self.shared.transactions.acquire().await?;
        let locked: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 30)")
            .bind(sql::MIGRATION_LOCK)
            .fetch_one(&mut *conn)
            .await?;
        if locked != Some(1) {
            return Err(Error::Busy);
        }
        let created = sqlx::raw_sql(sql::SCHEMA).execute(&mut *conn).await;
        let released = sqlx::query("DO RELEASE_LOCK(?)")
            .bind(sql::MIGRATION_LOCK)
            .execute(&mut *conn)
            .await;
        created?;
        released?;
        Ok(())
    }

    /// One attempt at opening the transaction and reserving the scope.
    async fn try_begin(
        &self,
        scope: &Scope,
        deadline: Instant,
        now: i64,
    ) -> Result<Begin<SqlxReservation>, Error> {
        let connection = tokio::time::timeout_at(deadline, self.shared.transactions.acquire())
            .await
            .map_err(|_| Error::Busy)?
            .map_err(pool_error)?;
        // From here on, dropping this future (the client went away) discards the connection,
        // which rolls back whatever the server has done for it.
        let mut slot = Slot::new(TxConnection::new(connection));
        let token = self.shared.reservations.fetch_add(1, Ordering::Relaxed);
        match reserve(&mut slot, scope, deadline, now, self.shared.isolation).await {
            Ok(Reserved::Row(())) => Ok(Begin::Reserved(SqlxReservation::new(
                token,
                slot,
                scope.clone(),
            ))),
            Ok(Reserved::Existing(record)) => {
                slot.roll_back_and_release().await;
                Ok(Begin::Existing(record))
            }
            Err(error) => {
                slot.roll_back_and_release().await;
                Err(error)
            }
        }
    }
}

/// The reservation's statements on a sqlx MySQL connection.
struct Statements<'a> {
    conn: &'a mut MySqlConnection,
    scope: &'a Scope,
    now: i64,
}

impl ReserveStatements for Statements<'_> {
    type Row = ();

    async fn insert(&mut self) -> Result<Option<()>, Error> {
        let s = self.scope;
        let insert = sqlx::query(sql::INSERT_RESERVATION)
            .bind(&*s.tenant)
            .bind(&*s.operation)
            .bind(s.key.as_str())
            .bind(self.now)
            .bind(self.now);
        match (&mut *self.conn).execute(insert).await {
            Ok(_) => Ok(Some(())),
            Err(error) if mysql_number(&error) == Some(DUPLICATE_KEY) => Ok(None),
            Err(error) => Err(error.into()),
        }
    }

    async fn select(&mut self) -> Result<Option<Option<StoredRecord>>, Error> {
        let s = self.scope;
        let select = sqlx::query(sql::SELECT_RECORD)
            .bind(&*s.tenant)
            .bind(&*s.operation)
            .bind(s.key.as_str());
        let Some(row) = (&mut *self.conn).fetch_optional(select).await? else {
            return Ok(None);
        };
        let state: &str = row.try_get(0)?;
        let expires_at: i64 = row.try_get(8)?;
        if state == "completed" && expires_at > self.now {
            decode_record(&row).map(|record| Some(Some(record)))
        } else {
            Ok(Some(None))
        }
    }

    async fn take_over(&mut self) -> Result<Option<()>, Error> {
        let s = self.scope;
        let take_over = sqlx::query(sql::TAKE_OVER)
            .bind(self.now)
            .bind(self.now)
            .bind(&*s.tenant)
            .bind(&*s.operation)
            .bind(s.key.as_str())
            .bind(self.now);
        let done = (&mut *self.conn).execute(take_over).await?;
        Ok((done.rows_affected() == 1).then_some(()))
    }
}

/// Checks that the scope fits the table's columns: a longer value would be refused by a
/// strict server and cut short by a lenient one (two keys would then share a record).
fn check_scope(scope: &Scope) -> Result<(), Error> {
    let fits = [&*scope.tenant, &*scope.operation, scope.key.as_str()]
        .iter()
        .all(|part| part.len() <= MAX_SCOPE_BYTES);
    if fits {
        Ok(())
    } else {
        Err(Error::Sqlx(sqlx::Error::InvalidArgument(format!(
            "a tenant, operation or idempotency key longer than {MAX_SCOPE_BYTES} bytes \
             does not fit the MySQL table"
        ))))
    }
}

/// Opens the transaction on `slot`'s connection and reserves `scope` (see
/// [`reserve::reserve`]). The transaction is left open either way.
async fn reserve(
    slot: &mut Slot,
    scope: &Scope,
    deadline: Instant,
    now: i64,
    isolation: Isolation,
) -> Result<Reserved<()>, Error> {
    let conn = slot.raw()?;
    // `innodb_lock_wait_timeout` counts whole seconds, at least one: round up.
    let remaining = deadline.saturating_duration_since(Instant::now());
    let lock_wait_secs = remaining.as_millis().div_ceil(1000).max(1);
    let lock_wait_secs = u64::try_from(lock_wait_secs).unwrap_or(u64::MAX);
    let begin = sql::begin_request(isolation, lock_wait_secs);
    (&mut *conn).execute(begin.as_str()).await?;
    reserve::reserve(&mut Statements { conn, scope, now }, None).await
}

/// A deadlock (`1213`), or any other serialization failure (`40001`).
fn is_conflict(error: &sqlx::Error) -> bool {
    mysql_number(error) == Some(MYSQL_DEADLOCK) || sqlx_code(error).as_deref() == Some("40001")
}

/// A pool that had no connection in time is busy, as the layer's own timeout would be.
fn pool_error(error: sqlx::Error) -> Error {
    match error {
        sqlx::Error::PoolTimedOut => Error::Busy,
        sqlx::Error::PoolClosed => Error::Closed,
        other => Error::Sqlx(other),
    }
}

fn decode_record(row: &MySqlRow) -> Result<StoredRecord, Error> {
    let corrupt = |what: &str| Error::Corrupt(what.to_owned());
    let version: i32 = row
        .try_get::<Option<i32>, _>(1)?
        .ok_or_else(|| corrupt("fingerprint version missing"))?;
    let digest: &[u8] = row
        .try_get::<Option<&[u8]>, _>(2)?
        .ok_or_else(|| corrupt("fingerprint missing"))?;
    let status: i32 = row
        .try_get::<Option<i32>, _>(3)?
        .ok_or_else(|| corrupt("status"))?;
    let headers: &str = row
        .try_get::<Option<&str>, _>(4)?
        .ok_or_else(|| corrupt("headers missing"))?;
    let columns = SavedColumns::decode(i64::from(version), digest, i64::from(status), headers)?;
    let body: &[u8] = row
        .try_get::<Option<&[u8]>, _>(5)?
        .ok_or_else(|| corrupt("body missing"))?;
    columns.into_record(
        Bytes::copy_from_slice(body),
        row.try_get(6)?,
        row.try_get(7)?,
        row.try_get(8)?,
    )
}

impl IdempotencyStore for SqlxMySqlStore {
    type Reservation = SqlxReservation;

    async fn lookup(&self, scope: &Scope, now: SystemTime) -> Result<Option<StoredRecord>, Error> {
        check_scope(scope)?;
        // A consistent read in autocommit on the read pool: it takes no row locks and never
        // waits for the transaction that holds this scope (an uncommitted reservation is
        // simply invisible).
        let read = async {
            let row = sqlx::query(sql::SELECT_LIVE_RECORD)
                .bind(&*scope.tenant)
                .bind(&*scope.operation)
                .bind(scope.key.as_str())
                .bind(to_unix_millis(now))
                .fetch_optional(&self.shared.reads)
                .await
                .map_err(pool_error)?;
            row.as_ref().map(decode_record).transpose()
        };
        tokio::time::timeout(self.shared.read_wait, read)
            .await
            .map_err(|_| Error::Busy)?
    }

    async fn begin(
        &self,
        scope: &Scope,
        lock_timeout: Duration,
        now: SystemTime,
    ) -> Result<Begin<SqlxReservation>, Error> {
        check_scope(scope)?;
        let deadline = Instant::now() + lock_timeout;
        let now = to_unix_millis(now);
        reserve::retry_conflicts(self.shared.deadlock_retries, deadline, || {
            self.try_begin(scope, deadline, now)
        })
        .await
    }

    async fn purge_expired(&self, now: SystemTime, batch: usize) -> Result<u64, Error> {
        let batch = u64::try_from(batch).unwrap_or(u64::MAX);
        let done = sqlx::query(sql::PURGE_EXPIRED)
            .bind(to_unix_millis(now))
            .bind(batch)
            .execute(&self.shared.transactions)
            .await
            .map_err(pool_error)?;
        Ok(done.rows_affected())
    }
}
