//! The store on sqlx, written once for every database it runs on: [`SqlxStore`] over a
//! [`SqlxDialect`] (what differs between databases: the SQL, the duplicate-key and conflict
//! errors, opening and ending a request's transaction, the statements a handler may not run).
//! `sqlx_postgres` and `sqlx_mysql` are the dialects, with the public names of their store.
//!
//! - `options`: the store's options and building it.
//! - `rows`: what the generic code needs from a [`sqlx::Database`].
//! - `reservation`: a transaction's connection (its slot), its commit with the record, and
//!   its rollback.
//! - `handle`: the handler's handle and the connection it lends, which refuses transaction
//!   control.
//!
//! Every path the layer drives to its end sends `ROLLBACK` or `COMMIT` (with the dialect's
//! session restore) and gives the connection back; a transaction dropped while still open
//! takes its connection out of the pool and closes it, which makes the server roll back.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures_util::future::BoxFuture;
use sqlx::pool::PoolConnection;
use sqlx::{Database, Executor as _, Pool};
use tokio::time::Instant;

use crate::error::Error;
use crate::row_lock::replay_check::{first_attempt, Acquired, ReplayChecks};
use crate::row_lock::reserve::{self, Isolation, ReserveStatements, Reserved};
use crate::sqlx::driver::our_sql;
use crate::store::{
    to_unix_millis, Begin, IdempotencyStore, NewRecord, RunOutcome, Scope, StoredRecord,
};

mod handle;
mod options;
mod owned;
mod reservation;
mod rows;

pub(crate) use handle::{connection_docs, handle_docs, CheckedConnection, SqlxHandle};
pub(crate) use options::SqlxOptions;
pub(crate) use owned::OwnedDialect;
pub(crate) use reservation::Slot;
pub(crate) use reservation::SqlxReservation;
pub(crate) use rows::{RowsAffected, SqlxDatabase};

pub(crate) mod sealed {
    /// Only this crate's dialects are [`SqlxDialect`](super::SqlxDialect)s.
    #[allow(unreachable_pub)]
    pub trait Sealed {}
}

/// The connection type of a dialect's database.
pub(crate) type Conn<D> = <<D as SqlxDialect>::Db as Database>::Connection;

/// What differs between the databases of the sqlx store: implemented by
/// [`PgDialect`](crate::store::sqlx_postgres::PgDialect) (feature `sqlx-postgres`),
/// [`MySqlDialect`](crate::store::sqlx_mysql::MySqlDialect) (feature `sqlx-mysql`) and
/// [`SqliteDialect`](crate::store::sqlx_sqlite::SqliteDialect) (feature `sqlx-sqlite`), and
/// sealed: the store's guarantees rest on each dialect's SQL.
pub trait SqlxDialect: sealed::Sealed + Clone + fmt::Debug + Send + Sync + Sized + 'static {
    /// The sqlx database.
    type Db: SqlxDatabase;
    /// What identifies the reserved row for the commit (a row address, or `()` where the
    /// commit finds the row by its key).
    type RowId: Send + Sync + 'static;

    /// The store's name in `Debug`.
    const STORE_NAME: &'static str;
    /// Reads a record inside the transaction (any state). Binds: the scope.
    const SELECT_RECORD: &'static str;
    /// Reads a live completed record, for the replay fast path. Binds: the scope, `now`.
    const SELECT_LIVE_RECORD: &'static str;
    /// Deletes a batch of expired records. Binds: `now`, the batch size.
    const PURGE_EXPIRED: &'static str;
    /// Ends a request's transaction with its rows (one result per statement; the first is
    /// the `COMMIT`).
    const COMMIT: &'static str;
    /// Ends a request's transaction without them (the first statement is the `ROLLBACK`).
    const ROLLBACK: &'static str;
    /// Why a handler's statement is refused once a handle's statement conflicted, if the
    /// database runs nothing more of the transaction then (`None`: statements still run).
    const REFUSED_AFTER_CONFLICT: Option<&'static str>;
    /// How long past a request's deadline the store waits for the server's answers to its own
    /// statements (the reservation, the commit) before it takes the server for gone and closes
    /// the connection (`503`): where the server itself ends every lock wait by the deadline.
    /// `None` (the default): no bound of the store's own.
    const ANSWER_MARGIN: Option<Duration> = None;

    /// Checks that `scope` fits the table.
    fn check_scope(scope: &Scope) -> Result<(), Error>;

    /// The store's [`StepStore::purge_progress`](crate::steps::StepStore::purge_progress),
    /// which `purge_expired` runs after the records.
    #[doc(hidden)]
    fn purge_progress(
        store: &SqlxStore<Self>,
        now: SystemTime,
        batch: usize,
    ) -> futures_util::future::BoxFuture<'_, Result<u64, Error>>;

    /// Opens a request's transaction at `isolation`, its lock waits bounded by `deadline`, or,
    /// while reserving the key, by `key_row_wait`: the [in-flight policy](crate::InFlight)'s
    /// bound on the wait for a key's row another transaction holds (zero under `Reject`: the
    /// shortest wait the database allows). Then
    /// [`restore_lock_wait`](Self::restore_lock_wait) follows the reservation.
    fn begin_request(
        isolation: Isolation,
        deadline: Instant,
        key_row_wait: Option<Duration>,
    ) -> String;

    /// What follows a reservation made under a `key_row_wait`: the lock waits bounded by
    /// `deadline` again, for the handler's own statements.
    fn restore_lock_wait(deadline: Instant) -> String;

    /// Opens a request's transaction as [`begin_request`](Self::begin_request) says (`waits`:
    /// its `deadline` and `key_row_wait`) and, where the dialect sends it in the same round
    /// trip, inserts the reservation of `scope` at `now` too (see [`Opened`]), with no
    /// statement left prepared on the connection if `unnamed` (a transaction pooler in front
    /// of the server). The default only opens the transaction. A failed insert's lock wait
    /// past `key_row_wait` is reported as [`Error::InFlight`] here, by the dialect that knows
    /// which statement failed.
    fn open_request<'a>(
        conn: &'a mut Conn<Self>,
        isolation: Isolation,
        waits: (Instant, Option<Duration>),
        (scope, now): (&'a Scope, i64),
        unnamed: bool,
    ) -> BoxFuture<'a, Result<Opened<Self::RowId>, Error>> {
        let _ = (scope, now, unnamed);
        let begin = Self::begin_request(isolation, waits.0, waits.1);
        Box::pin(async move {
            Self::Db::executor(conn).execute(our_sql(begin)).await?;
            Ok(Opened {
                inserted: None,
                lock_wait_restored: false,
            })
        })
    }

    /// Whether `error` means that the connection is gone (closed, broken, or ended by the
    /// server): then nothing of its transaction can commit, and a fresh connection may
    /// try again.
    fn is_connection_lost(error: &sqlx::Error) -> bool {
        matches!(error, sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed)
    }

    /// Takes, before a reservation whose wait on the key's row is bounded by the in-flight
    /// policy, every lock the reservation's statements need besides the key's row (on the
    /// table: another session's `LOCK TABLES`, a backup's global read lock), waiting up to
    /// the lock timeout: past it [`Error::Busy`], not [`Error::InFlight`]. The reservation's
    /// own lock wait timeout can then only be the key's row, held by a request of the same
    /// key. The default takes nothing (the dialect's lock wait error tells the two apart, or
    /// its reservation waits on nothing else).
    fn lock_table_for_reservation(conn: &mut Conn<Self>) -> BoxFuture<'_, Result<(), Error>> {
        let _ = conn;
        Box::pin(std::future::ready(Ok(())))
    }

    /// Reserves `scope` at `now` by `step`: the reserved row, or `None` (see [`ReserveStep`]).
    fn reserve<'a>(
        conn: &'a mut Conn<Self>,
        step: ReserveStep,
        scope: &'a Scope,
        now: i64,
    ) -> BoxFuture<'a, Result<Option<Self::RowId>, Error>>;

    /// Turns this transaction's reservation into the completed record: an error unless the
    /// row is still the one this transaction reserved (then nothing may commit).
    fn complete<'a>(
        conn: &'a mut Conn<Self>,
        scope: &'a Scope,
        row: &'a Self::RowId,
        record: &'a NewRecord,
    ) -> BoxFuture<'a, Result<(), Error>>;

    /// The completed record's statement of [`complete`](Self::complete) as text, with its
    /// values written into it, for the commit to send it and [`COMMIT`](Self::COMMIT) in one
    /// round trip (one that leaves no statement prepared on the connection if `unnamed`);
    /// `None` where the dialect does not (the default), or not for these values: then the
    /// statement goes with bind parameters, and `COMMIT` after it.
    fn complete_as_text(
        scope: &Scope,
        row: &Self::RowId,
        record: &NewRecord,
        unnamed: bool,
    ) -> Option<String> {
        let _ = (scope, row, record, unnamed);
        None
    }

    /// The error of a failed completed record's statement, sent as text (see
    /// [`complete_as_text`](Self::complete_as_text)).
    fn complete_failed(error: sqlx::Error) -> Error {
        error.into()
    }

    /// A serialization failure or deadlock.
    fn is_conflict(error: &sqlx::Error) -> bool;

    /// A server that went away or cannot take writes (a failover).
    fn is_unavailable(error: &sqlx::Error) -> bool;

    /// A lock wait past the lock timeout that rolled back only its statement, which the
    /// handle reports at rollback (see [`SqlxHandle`]). The default: none.
    fn is_lock_timeout(error: &sqlx::Error) -> bool {
        let _ = error;
        false
    }

    /// Refuses transaction control anywhere in a handler's `sql`.
    fn check_command(sql: &str) -> Result<(), Error>;

    /// Cuts SQL sent without parameters into its statements.
    fn split(sql: &str) -> Vec<&str>;
}

/// What [`SqlxDialect::open_request`] did besides opening the transaction.
#[derive(Debug)]
#[non_exhaustive]
pub struct Opened<R> {
    /// The answer of the reservation's insert if it was sent too (as [`ReserveStep::Insert`]
    /// gives it), `None` if not.
    pub inserted: Option<Option<R>>,
    /// Whether, the insert having reserved the key under a `key_row_wait`, the lock waits are
    /// bounded by the deadline again already (what
    /// [`restore_lock_wait`](SqlxDialect::restore_lock_wait) does).
    pub lock_wait_restored: bool,
}

/// The two statements that reserve a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReserveStep {
    /// Inserts the reservation: `None` when the key has a row.
    Insert,
    /// Takes an expired record (or a stray reservation) over: `None` if it changed meanwhile.
    TakeOver,
}

/// What clones of a store share.
pub(crate) struct Shared<D: SqlxDialect> {
    pub(crate) transactions: Pool<D::Db>,
    pub(crate) reads: Pool<D::Db>,
    pub(crate) read_wait: Duration,
    /// Where first attempts check for a record (and what they have found lately).
    pub(crate) replay_checks: ReplayChecks,
    pub(crate) isolation: Isolation,
    /// How many times reserving a key is retried after a conflict.
    pub(crate) conflict_retries: u32,
    /// Whether no statement stays prepared on a connection past one message or one
    /// transaction (a transaction pooler in front of the server; see `statements_for`).
    pub(crate) unnamed_statements: bool,
    /// The next transaction's token (its name in logs and `Debug`).
    pub(crate) reservations: AtomicU64,
}

/// An [`IdempotencyStore`] on sqlx, on the database of `D`. Cheap to clone; clones share the
/// pools.
#[derive(Clone)]
pub struct SqlxStore<D: SqlxDialect> {
    pub(crate) shared: Arc<Shared<D>>,
    /// The in-flight policy's bound on the wait for a key's row
    /// ([`IdempotencyStore::bound_duplicate_wait`]); `None`: the lock timeout.
    pub(crate) key_row_wait: Option<Duration>,
}

impl<D: SqlxDialect> fmt::Debug for SqlxStore<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(D::STORE_NAME)
            .field("connections", &self.shared.transactions.size())
            .field("read_connections", &self.shared.reads.size())
            .field("replay_check", &self.shared.replay_checks.check())
            .field("isolation", &self.shared.isolation)
            .finish_non_exhaustive()
    }
}

impl<D: SqlxDialect> SqlxStore<D> {
    /// A store on `pool` with the default options. Opens no connection and creates nothing:
    /// run `migrate`, or the crate's migration with your own.
    ///
    /// Request transactions take their connections from `pool`, the one the rest of the
    /// application uses: size it for both.
    pub fn new(pool: Pool<D::Db>) -> Self {
        Self::builder(pool).build()
    }

    /// Options for a store on `pool`.
    pub fn builder(pool: Pool<D::Db>) -> SqlxOptions<D> {
        SqlxOptions::new(pool)
    }

    /// The pool of request transactions (the application's).
    pub fn pool(&self) -> &Pool<D::Db> {
        &self.shared.transactions
    }

    /// The pool of the replay fast path.
    pub fn read_pool(&self) -> &Pool<D::Db> {
        &self.shared.reads
    }

    /// The next transaction's token.
    pub(crate) fn next_token(&self) -> u64 {
        self.shared.reservations.fetch_add(1, Ordering::Relaxed)
    }

    /// A connection of `pool` for a request: an idle one if there is one (taken without the
    /// pool's checks: `test_before_acquire`'s ping and a `before_acquire` hook), else one
    /// waited for by `deadline` (with them). `true` with a connection that was checked.
    async fn connection(
        pool: &Pool<D::Db>,
        deadline: Instant,
    ) -> Result<(PoolConnection<D::Db>, bool), Error> {
        if let Some(idle) = pool.try_acquire() {
            return Ok((idle, false));
        }
        Ok((Self::checked_connection(pool, deadline).await?, true))
    }

    /// A connection of `pool` through its `acquire` (with the pool's checks), by `deadline`.
    async fn checked_connection(
        pool: &Pool<D::Db>,
        deadline: Instant,
    ) -> Result<PoolConnection<D::Db>, Error> {
        tokio::time::timeout_at(deadline, pool.acquire())
            .await
            .map_err(|_| Error::Busy)?
            .map_err(pool_error)
    }

    /// One attempt at opening the transaction and reserving the scope.
    ///
    /// The transaction's first round trip also tells whether an idle connection taken
    /// unchecked still works: if it is gone, nothing of the transaction can commit (the
    /// server rolls back a transaction whose connection is gone), so the connection is
    /// discarded and the transaction opened once more on a connection of `acquire`.
    async fn try_begin(
        &self,
        scope: &Scope,
        deadline: Instant,
        lock_timeout: Duration,
        now: i64,
    ) -> Result<Begin<SqlxReservation<D>>, Error> {
        let pool = &self.shared.transactions;
        // The wait ends in this block: its future takes no room beside the reservation's.
        let (connection, mut checked) = {
            let acquire = std::pin::pin!(Self::connection(pool, deadline));
            let read = || async { Ok(self.lookup_at(scope, now).await?.flatten()) };
            match self.shared.replay_checks.acquire(acquire, read).await? {
                Acquired::Connection(connection) => connection,
                Acquired::Found(record) => return Ok(Begin::Existing(record)),
            }
        };
        // The wait for a connection and the replay check may have used the whole lock
        // timeout (a table another session locked blocks the read too): the transaction's
        // statements would each wait once more, on MySQL a whole second at least.
        if Instant::now() >= deadline {
            return Err(Error::Busy);
        }
        let reserving = async {
            // From here on, dropping this future (the client went away) discards the connection,
            // which rolls back whatever the server has done for it.
            let unnamed = self.shared.unnamed_statements;
            let for_request = |connection| {
                CheckedConnection::for_request(connection, lock_timeout)
                    .with_unnamed_statements(unnamed)
            };
            let mut slot = Slot::new(for_request(connection));
            let waits = (deadline, self.key_row_wait);
            let isolation = self.shared.isolation;
            let opened = loop {
                // Statements a use of the connection outside the store left cached: their
                // server connection may be another client's now.
                let opening = async {
                    slot.forget_statements().await?;
                    D::open_request(slot.raw()?, isolation, waits, (scope, now), unnamed).await
                };
                match opening.await {
                    Ok(opened) => break opened,
                    Err(Error::Sqlx(error)) if !checked && D::is_connection_lost(&error) => {
                        tracing::debug!(%error, "idle connection lost; opening the transaction on another");
                        slot.discard();
                        let connection = Self::checked_connection(pool, deadline).await?;
                        slot = Slot::new(for_request(connection));
                        checked = true;
                    }
                    Err(error) => {
                        slot.roll_back_and_release().await;
                        return Err(error);
                    }
                }
            };
            let token = self.next_token();
            match reserve_in(&mut slot, scope, waits, now, opened, unnamed).await {
                Ok(Reserved::Row(row)) => Ok(Begin::Reserved(SqlxReservation::new(
                    token,
                    slot,
                    scope.clone(),
                    row,
                    lock_timeout,
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
        };
        match D::ANSWER_MARGIN {
            // The server ends its lock waits by the deadline; one that has not answered soon
            // after has stopped answering: dropping the work closes the connection.
            // (Under an in-flight policy whose bound outlasts the deadline, once that is over.)
            Some(margin) => {
                let due = match self.key_row_wait {
                    Some(wait) => deadline.max(Instant::now() + wait),
                    None => deadline,
                };
                tokio::time::timeout_at(due + margin, reserving)
                    .await
                    .unwrap_or_else(|_| Err(no_answer(margin)))
            }
            None => reserving.await,
        }
    }
}

/// What a store reports when the server did not answer within the lock timeout and `margin`.
fn no_answer(margin: Duration) -> Error {
    Error::Unavailable(format!(
        "the database did not answer within the lock timeout and {} ms",
        margin.as_millis()
    ))
}

impl<D: SqlxDialect> SqlxStore<D> {
    /// The fast path's read of `scope`'s live record at `now`, given up after `read_wait`: a
    /// plain consistent read in autocommit on the read pool, which takes no row locks and
    /// never waits for the transaction that holds this scope (an uncommitted reservation is
    /// simply invisible).
    async fn lookup_at(
        &self,
        scope: &Scope,
        now: i64,
    ) -> Result<Option<Option<StoredRecord>>, Error> {
        reserve::within(self.shared.read_wait, self.read(scope, now)).await
    }

    /// The fast path's read of `scope`'s live record at `now`, on the read pool: on an idle
    /// connection taken without the pool's checks if there is one, once more through the
    /// pool's `acquire` if that connection turns out to be gone.
    async fn read(&self, scope: &Scope, now: i64) -> Result<Option<Option<StoredRecord>>, Error> {
        let reads = &self.shared.reads;
        if self.shared.unnamed_statements {
            return Self::read_in_transaction(reads, scope, now).await;
        }
        if let Some(mut idle) = reads.try_acquire() {
            let conn = D::Db::executor(&mut idle);
            let live = D::SELECT_LIVE_RECORD;
            match D::Db::fetch_record(conn, live, scope, now, true, true).await {
                Err(Error::Sqlx(error)) if D::is_connection_lost(&error) => {
                    tracing::debug!(%error, "idle read connection lost; reading on another");
                    drop(idle.detach());
                }
                found => return found,
            }
        }
        let conn = D::Db::pool_executor(reads);
        D::Db::fetch_record(conn, D::SELECT_LIVE_RECORD, scope, now, true, true).await
    }

    /// [`read`](Self::read) with unnamed statements (a transaction pooler in front of the
    /// server): in a transaction of its own, where sqlx's two round trips of a statement with
    /// bind parameters (its preparation, then its run) reach the same server connection. In
    /// autocommit the pooler may hand each to another, which has no such statement.
    async fn read_in_transaction(
        reads: &Pool<D::Db>,
        scope: &Scope,
        now: i64,
    ) -> Result<Option<Option<StoredRecord>>, Error> {
        let mut tx = reads.begin().await.map_err(pool_error)?;
        let conn = D::Db::executor(&mut *tx);
        let found = D::Db::fetch_record(conn, D::SELECT_LIVE_RECORD, scope, now, true, false).await;
        // A read: its end changes nothing (a failed one rolls back as the transaction drops).
        if found.is_ok() {
            tx.commit().await?;
        }
        found
    }
}

/// The reservation's statements on a sqlx connection.
struct Statements<'a, D: SqlxDialect> {
    conn: &'a mut Conn<D>,
    scope: &'a Scope,
    now: i64,
    /// No statement left prepared on the connection (see `SqlxOptions::unnamed_statements`).
    unnamed: bool,
}

impl<D: SqlxDialect> ReserveStatements for Statements<'_, D> {
    type Row = D::RowId;

    async fn insert(&mut self) -> Result<Option<D::RowId>, Error> {
        D::reserve(self.conn, ReserveStep::Insert, self.scope, self.now).await
    }

    async fn select(&mut self) -> Result<Option<Option<StoredRecord>>, Error> {
        let conn = D::Db::executor(self.conn);
        let persistent = !self.unnamed;
        D::Db::fetch_record(
            conn,
            D::SELECT_RECORD,
            self.scope,
            self.now,
            false,
            persistent,
        )
        .await
    }

    async fn take_over(&mut self) -> Result<Option<D::RowId>, Error> {
        D::reserve(self.conn, ReserveStep::TakeOver, self.scope, self.now).await
    }
}

/// Reserves `scope` in the transaction open on `slot`'s connection (see [`reserve::reserve`]);
/// `opened` says what [`SqlxDialect::open_request`] did besides; `waits` are the lock
/// timeout's deadline and the in-flight policy's bound on the wait for the key's row, if any
/// ([`Error::InFlight`] past it). The transaction is left open either way.
async fn reserve_in<D: SqlxDialect>(
    slot: &mut Slot<D>,
    scope: &Scope,
    (deadline, key_row_wait): (Instant, Option<Duration>),
    now: i64,
    opened: Opened<D::RowId>,
    unnamed: bool,
) -> Result<Reserved<D::RowId>, Error> {
    // Restored only if that insert reserved the key (then `reserve` returns its row).
    let restored = opened.lock_wait_restored && matches!(opened.inserted, Some(Some(_)));
    let conn = slot.raw()?;
    if key_row_wait.is_some() && opened.inserted.is_none() {
        D::lock_table_for_reservation(conn).await?;
    }
    let mut statements = Statements::<D> {
        conn,
        scope,
        now,
        unnamed,
    };
    let reserved = reserve::reserve(&mut statements, opened.inserted)
        .await
        .map_err(|error| reserve::in_flight_past_bound(key_row_wait, error))?;
    if key_row_wait.is_some() && !restored && matches!(reserved, Reserved::Row(_)) {
        // The handler's own lock waits keep the lock timeout.
        let restore = D::restore_lock_wait(deadline);
        D::Db::executor(slot.raw()?)
            .execute(our_sql(restore))
            .await?;
    }
    Ok(reserved)
}

/// A pool that had no connection in time is busy, as the layer's own timeout would be.
pub(crate) fn pool_error(error: sqlx::Error) -> Error {
    match error {
        sqlx::Error::PoolTimedOut => Error::Busy,
        sqlx::Error::PoolClosed => Error::Closed,
        other => Error::Sqlx(other),
    }
}

impl<D: SqlxDialect> IdempotencyStore for SqlxStore<D> {
    type Reservation = SqlxReservation<D>;

    async fn lookup(&self, scope: &Scope, now: SystemTime) -> Result<Option<StoredRecord>, Error> {
        D::check_scope(scope)?;
        // Boxed, as the reservation and the commit are: see `begin`.
        let found = Box::pin(self.lookup_at(scope, to_unix_millis(now))).await?;
        Ok(found.flatten())
    }

    /// The replay check on the read pool first, or `begin_and_run` alone (the reservation
    /// finds a completed record itself), as the store's
    /// [`ReplayCheck`](crate::row_lock::replay_check::ReplayCheck) decides.
    async fn lookup_then_begin_and_run<W, F>(
        &self,
        scope: &Scope,
        lock_timeout: Duration,
        now: SystemTime,
        work: W,
    ) -> Result<RunOutcome<F::Output>, Error>
    where
        W: FnOnce(SqlxReservation<D>) -> F + Send + 'static,
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let checks = &self.shared.replay_checks;
        first_attempt(self, checks, scope, lock_timeout, now, work).await
    }

    async fn begin(
        &self,
        scope: &Scope,
        lock_timeout: Duration,
        now: SystemTime,
    ) -> Result<Begin<SqlxReservation<D>>, Error> {
        D::check_scope(scope)?;
        // sqlx's futures are large (a query, the pool's wait, their time bounds). Boxed, each
        // takes its room only while it runs; inline, every request's future would hold room
        // for the largest of them for its whole life, and copy it on each move.
        Box::pin(reserve::begin_with_retries(
            self.shared.conflict_retries,
            lock_timeout,
            now,
            |deadline, now| self.try_begin(scope, deadline, lock_timeout, now),
        ))
        .await
    }

    /// Bounds the reservation's wait on the key's row (see each dialect for how).
    fn bound_duplicate_wait(mut self, policy: crate::InFlight) -> Self {
        self.key_row_wait = reserve::key_row_wait(policy);
        self
    }

    async fn purge_expired(&self, now: SystemTime, batch: usize) -> Result<u64, Error> {
        let millis = to_unix_millis(now);
        let pool = &self.shared.transactions;
        let unnamed = self.shared.unnamed_statements;
        let records = D::Db::purge(pool, D::PURGE_EXPIRED, (millis, batch), unnamed).await?;
        Ok(records + D::purge_progress(self, now, batch).await?)
    }
}
