//! The PostgreSQL store on sqlx: built from the application's own [`sqlx::PgPool`].
//!
//! The same table, statements and guarantees as the tokio-postgres store (`postgres`
//! feature); only the driver differs, so that a service already on sqlx keeps one database
//! library and one pool:
//!
//! - **Reserving a key** is an `INSERT ... ON CONFLICT DO NOTHING` of an `in_progress` row,
//!   inside the request's transaction. A duplicate (from this instance or another) blocks on
//!   that index entry until the first transaction ends: after a commit it reads the completed
//!   record and replays it, after a rollback its own insert goes through and it runs the
//!   handler. Requests with different keys never wait for each other.
//! - **The handler's rows** go through [`SqlxTransaction`]: [`SqlxTransaction::acquire`] lends
//!   the transaction's connection, on which ordinary sqlx code runs
//!   (`sqlx::query(..).execute(&mut *conn)`, `query_as`, the `query!` macros). The layer then
//!   turns the reservation into the completed record and commits, before the response leaves.
//! - **Waits are bounded**: taking a connection from the pool and every lock wait (`SET LOCAL
//!   lock_timeout`) share the layer's lock timeout; past it the request gets `503` with
//!   `Retry-After`. Serialization failures and deadlocks while reserving are retried a bounded
//!   number of times ([`SqlxPostgresOptions::serialization_retries`]); one that a handler's
//!   statement gets is reported to the layer, which runs the request again.
//! - **The layer commits**: the connection the handle lends refuses transaction control
//!   (`COMMIT`, `ROLLBACK`, `BEGIN`...), so a handler cannot commit its rows without the record.
//! - **Replays** are a plain `SELECT` of completed records on a separate pool of read
//!   connections (made from the same connect options, or one you give): no locks, and no
//!   waiting for the connections that writers hold.
//! - **Rollback on drop**: `Drop` cannot await a `ROLLBACK`, so a transaction dropped while still
//!   open (the client went away, the request future was dropped) takes its connection out of
//!   the pool ([`detach`](sqlx::pool::PoolConnection::detach)) and closes it; PostgreSQL rolls
//!   back a transaction whose connection is gone. The explicit paths (`commit`, `rollback`,
//!   failures) send `ROLLBACK` or `COMMIT` and give the connection back.
//! - **The commit check**: the completed record's `UPDATE` fails unless the reservation row was
//!   written by this very transaction (`xmin`); only then is `COMMIT` sent. (sqlx does not
//!   pipeline, so the two go one after the other: one round trip more than the tokio-postgres
//!   store, the same outcome.)
//!
//! Needs PostgreSQL 13 or later (`pg_current_xact_id`).
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use tower_idempotency::store::sqlx_postgres::sqlx::postgres::PgPoolOptions;
//! use tower_idempotency::store::sqlx_postgres::{Isolation, SqlxPostgresStore};
//!
//! let pool = PgPoolOptions::new()
//!     .max_connections(16)
//!     .connect("postgres://app@127.0.0.1/shop")
//!     .await?;
//! let store = SqlxPostgresStore::new(pool);
//! // Creates `idempotency_records` if it is missing (skip it when your own migrations run the
//! // crate's migration file).
//! store.migrate().await?;
//!
//! // SERIALIZABLE request transactions, replays from a replica:
//! # let (pool, replica) = (store.pool().clone(), store.pool().clone());
//! let store = SqlxPostgresStore::builder(pool)
//!     .isolation(Isolation::Serializable)
//!     .read_pool(replica)
//!     .build();
//! # Ok(()) }
//! ```
//!
//! The schema is also shipped as a sqlx migration (`migrations/` in this crate) for `sqlx
//! migrate run` or `sqlx::migrate!`. Tables are unqualified: they live in the first schema of
//! the connection's `search_path`.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions, PgRow};
// The `Executor` methods on a connection rather than the query builders' `execute(conn)`:
// their boxed futures keep the store's futures provably `Send` (the builders' generic futures
// hit a rustc limitation on higher-ranked lifetimes there).
use sqlx::{Executor as _, Row};
use tokio::time::Instant;

use super::pg_reserve::{self, ReserveStatements, Reserved};
use super::pg_sql::{
    INSERT_RESERVATION, PURGE_EXPIRED, SELECT_LIVE_RECORD, SELECT_RECORD, TAKE_OVER,
};
use super::{to_unix_millis, Begin, IdempotencyStore, SavedColumns, Scope, StoredRecord};
use crate::error::{sqlx_code, Error};

mod handle;
mod migrate;
#[cfg(feature = "outbox")]
mod owned;
mod reservation;

pub use handle::{SqlxConnection, SqlxTransaction, TxConnection};
use reservation::Slot;
pub use reservation::SqlxReservation;
/// The sqlx version of the pools and of the handle's connection: depend on it through this
/// re-export (or keep yours on the same 0.8 release).
pub use sqlx;

pub use super::pg_reserve::Isolation;

/// Options for a [`SqlxPostgresStore`]; see [`SqlxPostgresStore::builder`].
#[derive(Clone, Debug)]
pub struct SqlxPostgresOptions {
    pool: PgPool,
    reads: Option<PgPool>,
    max_read_connections: u32,
    read_wait: Duration,
    isolation: Isolation,
    serialization_retries: u32,
}

impl SqlxPostgresOptions {
    /// The pool of the replay fast path. Default: a pool of its own, made (lazily) from the
    /// write pool's connect options, with [`max_read_connections`](Self::max_read_connections)
    /// connections. Give one to read from a replica: a record not yet replicated is then only
    /// found by the (authoritative) write path.
    pub fn read_pool(mut self, pool: PgPool) -> Self {
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

    /// The isolation level of request transactions. Default: [`Isolation::ReadCommitted`].
    pub fn isolation(mut self, isolation: Isolation) -> Self {
        self.isolation = isolation;
        self
    }

    /// How many times reserving a key is retried after a serialization failure (`40001`) or a
    /// deadlock (`40P01`), within the lock timeout, before the request gets `503`. Default: 3.
    pub fn serialization_retries(mut self, retries: u32) -> Self {
        self.serialization_retries = retries;
        self
    }

    /// The store. Opens no connection: the read pool this makes connects on first use.
    pub fn build(self) -> SqlxPostgresStore {
        let reads = match self.reads {
            Some(reads) => reads,
            None => PgPoolOptions::new()
                .max_connections(self.max_read_connections)
                .acquire_timeout(self.read_wait.max(Duration::from_millis(1)))
                // A broken connection only fails a lookup, which the write path then redoes.
                .test_before_acquire(false)
                .connect_lazy_with((*self.pool.connect_options()).clone()),
        };
        SqlxPostgresStore {
            shared: Arc::new(Shared {
                transactions: self.pool,
                reads,
                read_wait: self.read_wait,
                isolation: self.isolation,
                serialization_retries: self.serialization_retries,
                reservations: AtomicU64::new(1),
            }),
        }
    }
}

struct Shared {
    transactions: PgPool,
    reads: PgPool,
    read_wait: Duration,
    isolation: Isolation,
    serialization_retries: u32,
    reservations: AtomicU64,
}

/// A PostgreSQL-backed [`IdempotencyStore`] on sqlx. Cheap to clone; clones share the pools.
#[derive(Clone)]
pub struct SqlxPostgresStore {
    shared: Arc<Shared>,
}

impl fmt::Debug for SqlxPostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlxPostgresStore")
            .field("connections", &self.shared.transactions.size())
            .field("read_connections", &self.shared.reads.size())
            .field("isolation", &self.shared.isolation)
            .finish_non_exhaustive()
    }
}

impl SqlxPostgresStore {
    /// A store on `pool` with the default options. Opens no connection and creates nothing:
    /// run [`migrate`](Self::migrate), or the crate's migration with your own.
    ///
    /// Request transactions take their connections from `pool`, the one the rest of the
    /// application uses: size it for both.
    pub fn new(pool: PgPool) -> Self {
        Self::builder(pool).build()
    }

    /// Options for a store on `pool`.
    pub fn builder(pool: PgPool) -> SqlxPostgresOptions {
        SqlxPostgresOptions {
            pool,
            reads: None,
            max_read_connections: 8,
            read_wait: Duration::from_secs(1),
            isolation: Isolation::default(),
            serialization_retries: 3,
        }
    }

    /// The pool of request transactions (the application's).
    pub fn pool(&self) -> &PgPool {
        &self.shared.transactions
    }

    /// The pool of the replay fast path.
    pub fn read_pool(&self) -> &PgPool {
        &self.shared.reads
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
            Ok(Reserved::Row(row_id)) => Ok(Begin::Reserved(SqlxReservation::new(
                token,
                slot,
                scope.clone(),
                row_id,
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

/// The reservation's statements on a sqlx connection.
struct Statements<'a> {
    conn: &'a mut PgConnection,
    scope: &'a Scope,
    now: i64,
}

impl ReserveStatements for Statements<'_> {
    type Row = String;

    async fn insert(&mut self) -> Result<Option<String>, Error> {
        let s = self.scope;
        let insert = sqlx::query(INSERT_RESERVATION)
            .bind(&*s.tenant)
            .bind(&*s.operation)
            .bind(s.key.as_str())
            .bind(self.now);
        let row = (&mut *self.conn).fetch_optional(insert).await?;
        Ok(row.map(|row| row.try_get(0)).transpose()?)
    }

    async fn select(&mut self) -> Result<Option<Option<StoredRecord>>, Error> {
        let s = self.scope;
        let select = sqlx::query(SELECT_RECORD)
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

    async fn take_over(&mut self) -> Result<Option<String>, Error> {
        let s = self.scope;
        let take_over = sqlx::query(TAKE_OVER)
            .bind(&*s.tenant)
            .bind(&*s.operation)
            .bind(s.key.as_str())
            .bind(self.now);
        let row = (&mut *self.conn).fetch_optional(take_over).await?;
        Ok(row.map(|row| row.try_get(0)).transpose()?)
    }
}

/// Opens the transaction on `slot`'s connection and reserves `scope` (see
/// [`pg_reserve::reserve`]). The transaction is left open either way.
async fn reserve(
    slot: &mut Slot,
    scope: &Scope,
    deadline: Instant,
    now: i64,
    isolation: Isolation,
) -> Result<Reserved<String>, Error> {
    let conn = slot.raw()?;
    let begin = isolation.begin_request(deadline);
    (&mut *conn).execute(begin.as_str()).await?;
    pg_reserve::reserve(&mut Statements { conn, scope, now }, None).await
}

/// A serialization failure (`40001`) or a deadlock (`40P01`).
fn is_conflict(error: &sqlx::Error) -> bool {
    matches!(sqlx_code(error).as_deref(), Some("40001" | "40P01"))
}

/// A pool that had no connection in time is busy, as the layer's own timeout would be.
fn pool_error(error: sqlx::Error) -> Error {
    match error {
        sqlx::Error::PoolTimedOut => Error::Busy,
        sqlx::Error::PoolClosed => Error::Closed,
        other => Error::Sqlx(other),
    }
}

fn decode_record(row: &PgRow) -> Result<StoredRecord, Error> {
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

impl IdempotencyStore for SqlxPostgresStore {
    type Reservation = SqlxReservation;

    async fn lookup(&self, scope: &Scope, now: SystemTime) -> Result<Option<StoredRecord>, Error> {
        // A plain snapshot read in autocommit on the read pool: it takes no row locks and
        // never waits for the transaction that holds this scope (an uncommitted reservation is
        // simply invisible).
        let read = async {
            let row = sqlx::query(SELECT_LIVE_RECORD)
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
        let deadline = Instant::now() + lock_timeout;
        let now = to_unix_millis(now);
        pg_reserve::retry_conflicts(self.shared.serialization_retries, deadline, || {
            self.try_begin(scope, deadline, now)
        })
        .await
    }

    async fn purge_expired(&self, now: SystemTime, batch: usize) -> Result<u64, Error> {
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        let done = sqlx::query(PURGE_EXPIRED)
            .bind(to_unix_millis(now))
            .bind(batch)
            .execute(&self.shared.transactions)
            .await
            .map_err(pool_error)?;
        Ok(done.rows_affected())
    }
}
