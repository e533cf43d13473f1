//! The PostgreSQL store: several app instances, one truth.
//!
//! Every instance of a service talks to the same database, and the primary key of
//! `idempotency_records` decides which request runs the handler:
//!
//! - **Reserving a key** is an `INSERT ... ON CONFLICT DO NOTHING` of an `in_progress` row,
//!   inside the request's transaction. A duplicate (from this instance or another) blocks on
//!   that index entry until the first transaction ends: after a commit it reads the completed
//!   record and replays it, after a rollback its own insert goes through and it runs the
//!   handler. Requests with different keys never wait for each other.
//! - **The handler's rows** go through [`PostgresTransaction`], the same connection and the same
//!   transaction; the layer then turns the reservation into the completed record and commits,
//!   before the response leaves.
//! - **Waits are bounded**: taking a pooled connection and every lock wait (`SET LOCAL
//!   lock_timeout`) share the layer's lock timeout; past it the request gets `503` with
//!   `Retry-After`. Serialization failures and deadlocks while reserving are retried a bounded
//!   number of times ([`PostgresOptions::serialization_retries`]); one that a handler's
//!   statement gets is reported to the layer, which runs the request again.
//! - **The layer commits**: the handle refuses transaction control (`COMMIT`, `ROLLBACK`,
//!   `BEGIN`...), so a handler cannot commit its rows without the record.
//! - **Replays** are a plain `SELECT` of completed records on a separate pool of read
//!   connections: no locks, and no waiting for the connections that writers hold.
//! - **Rollback on drop**: `Drop` cannot await a `ROLLBACK`, so a transaction dropped while still
//!   open (the client went away, the request future was dropped) takes its connection out of
//!   the pool and closes it; PostgreSQL rolls back a transaction whose connection is gone. The
//!   explicit paths (`commit`, `rollback`, failures) send `ROLLBACK` and keep the connection.
//! - **Round trips** for a new key: the replay check on the read pool; `BEGIN` with the
//!   reservation in one flight; the handler's statements; the completed record with `COMMIT` in
//!   one flight.
//!
//! Needs PostgreSQL 13 or later (`pg_current_xact_id`).
//!
//! ```no_run
//! # async fn run() -> Result<(), tower_idempotency::Error> {
//! use tower_idempotency::store::postgres::{Isolation, PostgresStore};
//!
//! // Creates (or migrates) `idempotency_records` in the connection's schema.
//! let store = PostgresStore::connect("postgres://app@127.0.0.1/shop").await?;
//!
//! // Bigger pools, and SERIALIZABLE transactions for handlers that need them:
//! let config = "postgres://app@127.0.0.1/shop".parse()?;
//! let store = PostgresStore::builder(config)
//!     .max_connections(32)
//!     .isolation(Isolation::Serializable)
//!     .connect()
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! Tables are unqualified: they live in the first schema of the connection's `search_path`
//! (set it with `options=-c search_path=...` in the URL to use another schema).

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
/// The deadpool-postgres version of the store's pools: depend on it through this re-export.
pub use deadpool_postgres;
use deadpool_postgres::{ClientWrapper, Manager, Object, Pool, PoolError};
use http::StatusCode;
use tokio::sync::{Mutex, OwnedMappedMutexGuard, OwnedMutexGuard};
use tokio::time::Instant;
/// The tokio-postgres version of the transaction handle: depend on it through this re-export.
pub use tokio_postgres;
use tokio_postgres::error::SqlState;
use tokio_postgres::row::Row;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::types::{BorrowToSql, ToSql, Type};
use tokio_postgres::{GenericClient, NoTls, SimpleQueryMessage, Socket, Statement, ToStatement};

use super::pg_sql::{
    COMPLETE_RECORD, INSERT_RESERVATION, MIGRATE_ADD_STATE, MIGRATION_LOCK, PURGE_EXPIRED, SCHEMA,
    SELECT_LIVE_RECORD, SELECT_RECORD, TAKE_OVER,
};
use super::sql_guard;
use super::{
    from_unix_millis, to_unix_millis, Begin, IdempotencyStore, NewRecord, Scope, StoreTransaction,
    StoredRecord,
};
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::response::SavedResponse;

#[cfg(feature = "outbox")]
mod owned;

/// The `SET LOCAL` name that marks a transaction opened by `begin_owned`; its `commit` checks it
/// to detect a transaction that the owner's code ended (`COMMIT`/`ROLLBACK`) behind its back.
/// (A request's transaction is recognized by its reservation row instead; see
/// [`COMPLETE_RECORD`].)
#[cfg(feature = "outbox")]
const RESERVATION_SETTING: &str = "tower_idempotency.reservation";

/// The isolation level of the request transactions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Isolation {
    /// `READ COMMITTED`, PostgreSQL's default: what the reservation needs, and never a
    /// serialization failure from the layer's own statements.
    #[default]
    ReadCommitted,
    /// `REPEATABLE READ`.
    RepeatableRead,
    /// `SERIALIZABLE`: the handler's reads and writes behave as if requests ran one at a time.
    /// Conflicts surface as serialization failures (`40001`): while reserving the key they are
    /// retried, later they answer `503` and the client retries.
    Serializable,
}

impl Isolation {
    fn begin_statement(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "BEGIN ISOLATION LEVEL READ COMMITTED",
            Isolation::RepeatableRead => "BEGIN ISOLATION LEVEL REPEATABLE READ",
            Isolation::Serializable => "BEGIN ISOLATION LEVEL SERIALIZABLE",
        }
    }
}

/// Options for opening a [`PostgresStore`]; see [`PostgresStore::builder`].
#[derive(Clone, Debug)]
pub struct PostgresOptions {
    config: tokio_postgres::Config,
    max_connections: usize,
    max_read_connections: usize,
    read_wait: Duration,
    isolation: Isolation,
    serialization_retries: u32,
    create_schema: bool,
}

impl PostgresOptions {
    /// The most connections held by request transactions (and [`PostgresStore::client`]) at
    /// once. A request that finds them all busy waits for one within the layer's lock timeout.
    /// Default: 16.
    pub fn max_connections(mut self, connections: usize) -> Self {
        self.max_connections = connections.max(1);
        self
    }

    /// The most connections used by the replay fast path at once. They are a separate pool, so
    /// that replays never wait for connections that writers hold. Default: 8.
    pub fn max_read_connections(mut self, connections: usize) -> Self {
        self.max_read_connections = connections.max(1);
        self
    }

    /// How long the replay fast path waits for a read connection before it gives up and lets
    /// the request take the (authoritative) write path. Default: 1 s.
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

    /// Whether connecting creates `idempotency_records` if it is missing (or migrates a table
    /// of the SQLite layout). Default: `true`. A tool that must not change the database (an
    /// admin tool) turns it off: connecting then only checks that a connection can be made,
    /// and calls fail if the table is missing.
    pub fn create_schema(mut self, create: bool) -> Self {
        self.create_schema = create;
        self
    }

    /// Connects without TLS, creates (or migrates) the schema and returns the store.
    pub async fn connect(self) -> Result<PostgresStore, Error> {
        self.connect_with_tls(NoTls).await
    }

    /// Like [`connect`](Self::connect), with a TLS connector (`postgres-native-tls`,
    /// `tokio-postgres-rustls`...).
    pub async fn connect_with_tls<T>(self, tls: T) -> Result<PostgresStore, Error>
    where
        T: MakeTlsConnect<Socket> + Clone + Sync + Send + 'static,
        T::Stream: Sync + Send,
        T::TlsConnect: Sync + Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        let pool = |size: usize| {
            Pool::builder(Manager::new(self.config.clone(), tls.clone()))
                .max_size(size)
                .build()
                .map_err(|error| Error::Io(std::io::Error::other(error)))
        };
        let store = PostgresStore {
            shared: Arc::new(Shared {
                transactions: pool(self.max_connections)?,
                reads: pool(self.max_read_connections)?,
                read_wait: self.read_wait,
                isolation: self.isolation,
                serialization_retries: self.serialization_retries,
                reservations: AtomicU64::new(1),
            }),
        };
        if self.create_schema {
            store.migrate().await?;
        } else {
            // Fail here, not on the first call, if the settings cannot connect.
            drop(store.client().await?);
        }
        Ok(store)
    }
}

struct Shared {
    transactions: Pool,
    reads: Pool,
    read_wait: Duration,
    isolation: Isolation,
    serialization_retries: u32,
    reservations: AtomicU64,
}

/// A PostgreSQL-backed [`IdempotencyStore`]. Cheap to clone; clones share the pools.
#[derive(Clone)]
pub struct PostgresStore {
    shared: Arc<Shared>,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("transactions", &self.shared.transactions.status())
            .field("reads", &self.shared.reads.status())
            .field("isolation", &self.shared.isolation)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// Connects to `url` (`postgres://user@host:5432/db`, or a key-value string) with the
    /// default options and creates (or migrates) the schema.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Self::builder(url.parse()?).connect().await
    }

    /// Options for connecting with `config`.
    pub fn builder(config: tokio_postgres::Config) -> PostgresOptions {
        PostgresOptions {
            config,
            max_connections: 16,
            max_read_connections: 8,
            read_wait: Duration::from_secs(1),
            isolation: Isolation::default(),
            serialization_retries: 3,
            create_schema: true,
        }
    }

    /// A pooled connection in autocommit mode, for work outside a request: creating your
    /// tables, reads of your own rows. Open your own transaction with
    /// `client.transaction().await`. It comes from the same pool as request transactions.
    pub async fn client(&self) -> Result<Object, Error> {
        self.shared.transactions.get().await.map_err(pool_error)
    }

    /// The pool of request transactions (the one [`client`](Self::client) takes from).
    pub fn pool(&self) -> &Pool {
        &self.shared.transactions
    }

    async fn migrate(&self) -> Result<(), Error> {
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
            .await?;
        tx.batch_execute(SCHEMA).await?;
        // `current_schemas(false)[1]` is where the unqualified CREATE TABLE above put it.
        let has_state: bool = tx
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM information_schema.columns \
                 WHERE table_schema = (current_schemas(false))[1] \
                 AND table_name = 'idempotency_records' AND column_name = 'state')",
                &[],
            )
            .await?
            .try_get(0)?;
        if !has_state {
            tracing::info!("migrating idempotency_records: adding the reservation state");
            tx.batch_execute(MIGRATE_ADD_STATE).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// One attempt at opening the transaction and reserving the scope.
    async fn try_begin(
        &self,
        scope: &Scope,
        deadline: Instant,
        now: i64,
    ) -> Result<Begin<PostgresReservation>, Error> {
        let object = tokio::time::timeout_at(deadline, self.shared.transactions.get())
            .await
            .map_err(|_| Error::Busy)?
            .map_err(pool_error)?;
        // From here on, dropping this future (the client went away) discards the connection,
        // which rolls back whatever the server has done for it.
        let mut slot = Slot {
            object: Some(object),
        };
        let token = self.shared.reservations.fetch_add(1, Ordering::Relaxed);
        match reserve(&slot, scope, deadline, now, self.shared.isolation).await {
            Ok(Reserved::Row(row_id)) => Ok(Begin::Reserved(PostgresReservation {
                tx: Arc::new(TxShared::new(token, slot)),
                scope: scope.clone(),
                row_id,
            })),
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

/// What [`reserve`] found.
enum Reserved {
    /// The scope is reserved by this transaction, in the row at this `ctid`.
    Row(String),
    /// A duplicate committed first: its live record.
    Existing(StoredRecord),
}

/// Opens the transaction on `slot`'s connection and reserves `scope`. The transaction is
/// left open either way.
async fn reserve(
    slot: &Slot,
    scope: &Scope,
    deadline: Instant,
    now: i64,
    isolation: Isolation,
) -> Result<Reserved, Error> {
    let client = slot.client()?;
    // `lock_timeout` 0 would mean "wait forever": never less than 1 ms.
    let lock_ms = deadline
        .saturating_duration_since(Instant::now())
        .as_millis()
        .max(1);
    let params = [&*scope.tenant, &*scope.operation, scope.key.as_str()];
    // Prepared once per connection, before the transaction.
    let insert = client.prepare_cached(INSERT_RESERVATION).await?;
    let select = client.prepare_cached(SELECT_RECORD).await?;
    let take_over = client.prepare_cached(TAKE_OVER).await?;
    // The begin and the first reservation go in one flight (tokio-postgres pipelines requests
    // polled together, in order): one round trip for both. Only an integer is formatted into
    // the begin. Should the begin's `SET LOCAL` fail, the transaction is aborted and the
    // insert fails with it.
    let begin = format!(
        "{}; SET LOCAL lock_timeout = {lock_ms}",
        isolation.begin_statement()
    );
    let (begun, first) = futures_util::future::join(
        client.batch_execute(&begin),
        client.query_opt(&insert, &[&params[0], &params[1], &params[2], &now]),
    )
    .await;
    begun?;
    let mut first = Some(first?);
    // Each turn ends in a decision unless another transaction changed the row in between
    // (purged it, or took it over and committed): then look again, a few times at most.
    for _ in 0..4 {
        // Blocks on the primary key while another transaction holds this scope.
        let inserted = match first.take() {
            Some(inserted) => inserted,
            None => {
                client
                    .query_opt(&insert, &[&params[0], &params[1], &params[2], &now])
                    .await?
            }
        };
        if let Some(row) = inserted {
            return Ok(Reserved::Row(row.try_get(0)?));
        }
        let Some(row) = client
            .query_opt(&select, &[&params[0], &params[1], &params[2]])
            .await?
        else {
            continue; // purged since the insert saw it
        };
        let state: &str = row.try_get(0)?;
        let expires_at: i64 = row.try_get(8)?;
        if state == "completed" && expires_at > now {
            return decode_record(&row).map(Reserved::Existing);
        }
        // Expired, or a stray reservation that was committed: take it over. Blocks if another
        // request is taking it over too; when that one commits, its fresh record no longer
        // matches and the next turn replays it.
        let taken = client
            .query_opt(&take_over, &[&params[0], &params[1], &params[2], &now])
            .await?;
        if let Some(row) = taken {
            return Ok(Reserved::Row(row.try_get(0)?));
        }
    }
    Err(Error::Busy)
}

/// Whether an error is a conflict that a fresh transaction may not hit again.
fn is_transient_conflict(error: &Error) -> bool {
    match error {
        Error::Postgres(error) => is_conflict_code(error),
        _ => false,
    }
}

/// A serialization failure (`40001`) or a deadlock (`40P01`).
fn is_conflict_code(error: &tokio_postgres::Error) -> bool {
    matches!(
        error.code(),
        Some(code) if *code == SqlState::T_R_SERIALIZATION_FAILURE
            || *code == SqlState::T_R_DEADLOCK_DETECTED
    )
}

fn pool_error(error: PoolError) -> Error {
    match error {
        PoolError::Timeout(_) => Error::Busy,
        PoolError::Backend(error) => Error::Postgres(error),
        PoolError::Closed => Error::Closed,
        other => Error::Io(std::io::Error::other(other.to_string())),
    }
}

fn decode_record(row: &Row) -> Result<StoredRecord, Error> {
    let corrupt = |what: &str| Error::Corrupt(what.to_owned());
    let version: i32 = row
        .try_get::<_, Option<i32>>(1)?
        .ok_or_else(|| corrupt("fingerprint version missing"))?;
    let version = u16::try_from(version).map_err(|_| corrupt("fingerprint version"))?;
    let digest: [u8; 32] = row
        .try_get::<_, Option<&[u8]>>(2)?
        .ok_or_else(|| corrupt("fingerprint missing"))?
        .try_into()
        .map_err(|_| corrupt("fingerprint length"))?;
    let status = row
        .try_get::<_, Option<i32>>(3)?
        .and_then(|s| u16::try_from(s).ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .ok_or_else(|| corrupt("status"))?;
    let headers = row
        .try_get::<_, Option<&str>>(4)?
        .ok_or_else(|| corrupt("headers missing"))?;
    let headers = SavedResponse::decode_headers(headers).map_err(Error::Corrupt)?;
    let body = row
        .try_get::<_, Option<&[u8]>>(5)?
        .ok_or_else(|| corrupt("body missing"))?;
    let trailers = row
        .try_get::<_, Option<&str>>(6)?
        .map(SavedResponse::decode_headers)
        .transpose()
        .map_err(Error::Corrupt)?;
    Ok(StoredRecord {
        fingerprint: Fingerprint::new(version, digest),
        response: SavedResponse {
            status,
            headers,
            body: Bytes::copy_from_slice(body),
            trailers,
        },
        created_at: from_unix_millis(row.try_get(7)?),
        expires_at: from_unix_millis(row.try_get(8)?),
    })
}

impl IdempotencyStore for PostgresStore {
    type Transaction = PostgresReservation;

    async fn lookup(&self, scope: &Scope, now: SystemTime) -> Result<Option<StoredRecord>, Error> {
        // A plain snapshot read in autocommit: it takes no row locks and never waits for the
        // transaction that holds this scope (an uncommitted reservation is simply invisible).
        let read = async {
            let client = self.shared.reads.get().await.map_err(pool_error)?;
            let select = client.prepare_cached(SELECT_LIVE_RECORD).await?;
            let row = client
                .query_opt(
                    &select,
                    &[
                        &&*scope.tenant,
                        &&*scope.operation,
                        &scope.key.as_str(),
                        &to_unix_millis(now),
                    ],
                )
                .await?;
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
    ) -> Result<Begin<PostgresReservation>, Error> {
        let deadline = Instant::now() + lock_timeout;
        let now = to_unix_millis(now);
        let mut retries = 0;
        loop {
            match self.try_begin(scope, deadline, now).await {
                Err(error)
                    if is_transient_conflict(&error)
                        && retries < self.shared.serialization_retries =>
                {
                    retries += 1;
                    tracing::debug!(%error, retries, "reserving the key conflicted; retrying");
                    // A short pause, growing with each retry, lets the other transaction end.
                    let pause = Duration::from_millis(2u64 << retries.min(6));
                    if Instant::now() + pause >= deadline {
                        return Err(Error::Busy);
                    }
                    tokio::time::sleep(pause).await;
                }
                outcome => return outcome,
            }
        }
    }

    async fn purge_expired(&self, now: SystemTime, batch: usize) -> Result<u64, Error> {
        let client = self.client().await?;
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        let purge = client.prepare_cached(PURGE_EXPIRED).await?;
        let deleted = client
            .execute(&purge, &[&to_unix_millis(now), &batch])
            .await?;
        Ok(deleted)
    }
}

/// The connection of one transaction, while it may still be open.
///
/// Dropping a slot that still holds its connection discards the connection instead of
/// returning it to the pool: `Drop` cannot await a `ROLLBACK`, and a pooled connection with an
/// open transaction would hand it to the next request. Closing the socket is what makes
/// PostgreSQL roll back (it aborts the transaction of a backend whose client is gone, as soon
/// as the backend reads from the socket: at once when idle, after the running statement
/// otherwise). The cost, a new connection, is paid only when a future is dropped mid-request;
/// every path the layer drives to its end sends `ROLLBACK` or `COMMIT` and keeps the
/// connection.
struct Slot {
    object: Option<Object>,
}

impl Slot {
    fn client(&self) -> Result<&ClientWrapper, Error> {
        self.object.as_deref().ok_or(Error::TransactionFinished)
    }

    /// Ends the transaction with `ROLLBACK` and gives the connection back to the pool; if that
    /// fails, the connection is discarded (closing it rolls back).
    async fn roll_back_and_release(&mut self) {
        let rolled_back = match &self.object {
            // The connection stays in the slot while this awaits: if this future is dropped,
            // the slot's `Drop` discards it.
            Some(object) => object.batch_execute("ROLLBACK").await,
            None => return,
        };
        match rolled_back {
            Ok(()) => self.release(),
            Err(error) => {
                tracing::warn!(%error, "ROLLBACK failed; closing the connection");
                self.discard();
            }
        }
    }

    /// Ends the transaction with `COMMIT` and gives the connection back to the pool (for the
    /// inbox's own transactions: a request's commit sends `COMMIT` with its record).
    #[cfg(feature = "outbox")]
    async fn commit_and_release(&mut self) -> Result<(), Error> {
        let committed = match &self.object {
            // As in `roll_back_and_release`, a drop while this awaits discards the connection.
            Some(object) => object.batch_execute("COMMIT").await,
            None => return Err(Error::TransactionFinished),
        };
        // Committed, or failed and therefore rolled back by the server: either way no
        // transaction is left open on the connection.
        self.release();
        committed.map_err(Error::from)
    }

    /// Gives the connection back to the pool: only once no transaction is open on it.
    fn release(&mut self) {
        drop(self.object.take());
    }

    fn discard(&mut self) {
        if let Some(object) = self.object.take() {
            // Out of the pool for good; dropping the client closes its connection.
            drop(Object::take(object));
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.object.is_some() {
            tracing::debug!("idempotency transaction dropped while open; closing its connection");
            self.discard();
        }
    }
}

struct TxShared {
    token: u64,
    /// Set as soon as the layer starts to commit or roll back: handles refuse work from then on.
    finished: AtomicBool,
    connection: Arc<Mutex<Slot>>,
    /// The first serialization failure or deadlock that a statement run through a handle got
    /// (the database's message). PostgreSQL has rolled the transaction back by then, whatever
    /// the handler answers: commit and rollback report it, so that the request runs again.
    conflict: std::sync::Mutex<Option<String>>,
}

/// The open transaction of one request (the owner side, held by the layer).
///
/// Dropping it without committing rolls back (by closing its connection; see the module docs).
pub struct PostgresReservation {
    tx: Arc<TxShared>,
    scope: Scope,
    /// The `ctid` of the reserved row.
    row_id: String,
}

impl fmt::Debug for PostgresReservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresReservation")
            .field("reservation", &self.tx.token)
            .finish_non_exhaustive()
    }
}

impl TxShared {
    fn new(token: u64, slot: Slot) -> Self {
        TxShared {
            token,
            finished: AtomicBool::new(false),
            connection: Arc::new(Mutex::new(slot)),
            conflict: std::sync::Mutex::new(None),
        }
    }

    /// Keeps `error` if it is the transaction's first serialization failure or deadlock.
    fn observe(&self, error: &tokio_postgres::Error) {
        if !is_conflict_code(error) {
            return;
        }
        let message = match error.as_db_error() {
            Some(db_error) => db_error.to_string(),
            None => error.to_string(),
        };
        let mut conflict = self.conflict.lock().unwrap_or_else(PoisonError::into_inner);
        conflict.get_or_insert(message);
    }

    /// The conflict a handle's statement got, if any, as the error to report.
    fn conflict(&self) -> Option<Error> {
        self.conflict
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .map(Error::StatementConflict)
    }

    /// Marks the transaction finished and takes its connection from the handles.
    fn take_connection(&self) -> Result<OwnedMutexGuard<Slot>, Error> {
        self.finished.store(true, Ordering::Release);
        // The handler has returned its response; a connection still borrowed now belongs to
        // a task that outlived its request, still using the transaction: do not commit under it.
        let slot = self.connection.clone().try_lock_owned().map_err(|_| {
            Error::TransactionAborted("a handler still holds the transaction's connection")
        })?;
        if slot.object.is_none() {
            return Err(Error::TransactionAborted(
                "the transaction's connection is gone",
            ));
        }
        Ok(slot)
    }

    /// The owner went away without committing: refuse further work and close the connection
    /// (which rolls back).
    fn abandon(&self) {
        self.finished.store(true, Ordering::Release);
        // Discard at once if nobody borrows the connection; otherwise the slot's own `Drop`
        // does it when the last borrower lets go.
        if let Ok(mut slot) = self.connection.try_lock() {
            slot.discard();
        }
    }
}

impl Drop for PostgresReservation {
    fn drop(&mut self) {
        self.tx.abandon();
    }
}

impl StoreTransaction for PostgresReservation {
    type Handle = PostgresTransaction;

    fn handle(&self) -> PostgresTransaction {
        PostgresTransaction {
            tx: self.tx.clone(),
        }
    }

    async fn commit(self, record: NewRecord) -> Result<(), Error> {
        let mut slot = self.tx.take_connection()?;
        // The transaction is already rolled back on the server: report why, to run it again.
        if let Some(conflict) = self.tx.conflict() {
            slot.roll_back_and_release().await;
            return Err(conflict);
        }
        let client = match slot.client() {
            Ok(client) => client,
            Err(error) => return Err(error),
        };
        let complete = match client.prepare_cached(COMPLETE_RECORD).await {
            Ok(statement) => statement,
            Err(error) => {
                slot.roll_back_and_release().await;
                return Err(error.into());
            }
        };
        let response = &record.response;
        let trailers = response
            .trailers
            .as_ref()
            .map(|t| SavedResponse::encode_headers(t));
        let params: [&(dyn ToSql + Sync); 12] = [
            &&*self.scope.tenant,
            &&*self.scope.operation,
            &self.scope.key.as_str(),
            &&record.fingerprint.digest()[..],
            &i32::from(record.fingerprint.version()),
            &i32::from(response.status.as_u16()),
            &SavedResponse::encode_headers(&response.headers),
            &&response.body[..],
            &trailers,
            &to_unix_millis(record.created_at),
            &to_unix_millis(record.expires_at),
            &self.row_id,
        ];
        // The record and `COMMIT` in one flight (tokio-postgres sends requests polled together
        // in order): when the record fails, the transaction is aborted and PostgreSQL answers
        // the `COMMIT` with a `ROLLBACK`.
        let (saved, committed) = futures_util::future::join(
            client.query_one(&complete, &params),
            client.batch_execute("COMMIT"),
        )
        .await;
        // Committed, rolled back, or the connection is gone: no transaction is left open on it.
        slot.release();
        match (saved, committed) {
            (Ok(_), Ok(())) => Ok(()),
            (Err(error), _) if error.code() == Some(&SqlState::DIVISION_BY_ZERO) => {
                Err(Error::TransactionAborted(
                    "the transaction ended before commit (it is not the one the layer began)",
                ))
            }
            (Err(error), _) | (Ok(_), Err(error)) => Err(error.into()),
        }
    }

    /// Rolls back. Reports a serialization failure or deadlock that a handler's statement
    /// got ([`Error::StatementConflict`]): the handler's answer came from a transaction the
    /// database had rolled back, and the layer runs the request again.
    async fn rollback(self) -> Result<(), Error> {
        match self.tx.take_connection() {
            Ok(mut slot) => slot.roll_back_and_release().await,
            // Nothing to roll back here: a borrower still holds it (the slot's `Drop` closes
            // it later), or it is already gone.
            Err(error) => tracing::warn!(%error, "rollback deferred to the connection's release"),
        }
        match self.tx.conflict() {
            Some(conflict) => Err(conflict),
            None => Ok(()),
        }
    }
}

/// The handle a handler uses to write its rows in the request's transaction.
///
/// The layer puts it in the request extensions. Everything run through
/// [`client`](Self::client) belongs to the same PostgreSQL transaction as the idempotency
/// record: it commits when the layer saves the response, and rolls back if the handler fails,
/// panics or the client goes away. (The receiver's inbox, `PostgresInbox::process` with the
/// `outbox` feature, hands its closure the same handle on a transaction of its own.)
///
/// ```no_run
/// # async fn handler(tx: tower_idempotency::store::postgres::PostgresTransaction)
/// #     -> Result<i64, tower_idempotency::Error> {
/// let client = tx.client().await?;
/// let row = client
///     .query_one(
///         "INSERT INTO orders (sku, quantity) VALUES ($1, $2) RETURNING id",
///         &[&"book", &1i32],
///     )
///     .await?;
/// let order_id: i64 = row.try_get(0)?;
/// # Ok(order_id) }
/// ```
///
/// - The layer commits: `COMMIT`, `ROLLBACK`, `BEGIN` and the like are refused
///   ([`Error::TransactionControl`]; see [`TransactionClient`]).
/// - A failed statement aborts the whole PostgreSQL transaction: answer an error status (the
///   layer then rolls back) rather than carrying on. Use a `SAVEPOINT` to recover from an
///   expected failure inside the transaction.
/// - A serialization failure (`40001`) or deadlock (`40P01`) of one of the handler's
///   statements is noticed by the layer, whatever the handler answers: it runs the request
///   again in a fresh transaction, up to
///   [`with_conflict_retries`](crate::IdempotencyLayer::with_conflict_retries) times, then
///   answers `503` with `Retry-After`.
/// - Statements run with the layer's `lock_timeout` (`SET LOCAL`): a lock wait past it fails
///   with SQLSTATE `55P03`, for which [`Error::is_busy`] is true.
/// - Drop the [`TransactionClient`] before the handler returns; after the request ends the
///   handle refuses work ([`Error::TransactionFinished`]).
#[derive(Clone)]
pub struct PostgresTransaction {
    tx: Arc<TxShared>,
}

impl fmt::Debug for PostgresTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresTransaction")
            .field("reservation", &self.tx.token)
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl PostgresTransaction {
    /// Borrows the transaction's connection. Waits while another borrow of the same
    /// transaction is alive (one connection runs one statement at a time).
    pub async fn client(&self) -> Result<TransactionClient, Error> {
        if self.is_finished() {
            return Err(Error::TransactionFinished);
        }
        let slot = self.tx.connection.clone().lock_owned().await;
        // The layer may have finished the transaction while this waited.
        if self.is_finished() {
            return Err(Error::TransactionFinished);
        }
        let connection = OwnedMutexGuard::try_map(slot, |slot| slot.object.as_mut())
            .map_err(|_| Error::TransactionFinished)?;
        Ok(TransactionClient {
            connection,
            tx: self.tx.clone(),
        })
    }

    /// Whether the transaction has been committed or rolled back (or is being).
    pub fn is_finished(&self) -> bool {
        self.tx.finished.load(Ordering::Acquire)
    }
}

/// The transaction's connection, borrowed from a [`PostgresTransaction`]: runs statements
/// inside the request's transaction, with the methods of a [`tokio_postgres::Client`].
///
/// It does not hand out the client itself, so that every statement goes through two checks:
///
/// - **No transaction control.** `BEGIN`, `START TRANSACTION`, `COMMIT`, `END`, `ROLLBACK`,
///   `ABORT`, `PREPARE TRANSACTION` and `COMMIT`/`ROLLBACK PREPARED` are refused with
///   [`Error::TransactionControl`] before they reach the server, and nothing of the call runs.
///   `SAVEPOINT`, `RELEASE` and `ROLLBACK TO` are allowed: they stay inside the transaction.
///   Every statement is sent with the extended protocol, which runs one command per string;
///   [`batch_execute`](Self::batch_execute) and [`simple_query`](Self::simple_query) cut
///   their input into statements and send them one by one. (A `CREATE FUNCTION` or `CREATE
///   PROCEDURE` with a `BEGIN ATOMIC` body stays whole.)
/// - **Conflicts are seen by the layer.** A serialization failure or a deadlock that a
///   statement gets is returned to the handler as usual, and also kept: the layer then runs
///   the request again (see [`PostgresTransaction`]).
///
/// COPY is not offered: a COPY in progress would hold the connection past the borrow.
pub struct TransactionClient {
    connection: OwnedMappedMutexGuard<Slot, Object>,
    tx: Arc<TxShared>,
}

impl fmt::Debug for TransactionClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransactionClient")
            .field("reservation", &self.tx.token)
            .finish_non_exhaustive()
    }
}

/// What a [`TransactionClient`] runs: SQL text (`&str`, `String`), checked before it is sent,
/// or a [`Statement`] prepared through a `TransactionClient` (checked when prepared).
pub trait Command: ToStatement + sealed::Command {
    /// The SQL text to check, if this is text.
    #[doc(hidden)]
    fn sql_text(&self) -> Option<&str>;
}

impl Command for str {
    fn sql_text(&self) -> Option<&str> {
        Some(self)
    }
}

impl Command for String {
    fn sql_text(&self) -> Option<&str> {
        Some(self)
    }
}

impl Command for Statement {
    fn sql_text(&self) -> Option<&str> {
        None
    }
}

/// Where a statement of [`enqueue`](crate::outbox::postgres::enqueue) or
/// `PostgresInbox::record` (with the `outbox` feature) runs: a [`TransactionClient`] (inside
/// the request's transaction), or a client or transaction of your own (any
/// [`tokio_postgres::GenericClient`]: a [`tokio_postgres::Client`], a pooled connection, a
/// [`tokio_postgres::Transaction`]).
pub trait Executor: Sync + sealed::Executor {
    /// Runs `statement` with `params`; returns how many rows it changed.
    fn execute_statement(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> impl Future<Output = Result<u64, Error>> + Send;
}

impl<C: GenericClient + Sync> Executor for C {
    async fn execute_statement(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, Error> {
        Ok(GenericClient::execute(self, statement, params).await?)
    }
}

impl Executor for TransactionClient {
    /// Prepared once per pooled connection: a statement sent as text costs a round trip of
    /// its own (parse and describe) before it runs.
    async fn execute_statement(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, Error> {
        let statement = self.prepare_cached(statement).await?;
        self.execute(&statement, params).await
    }
}

mod sealed {
    use tokio_postgres::{GenericClient, Statement};

    /// Keeps [`Command`](super::Command) to the types this crate knows how to check.
    #[allow(unreachable_pub)]
    pub trait Command {}

    impl Command for str {}
    impl Command for String {}
    impl Command for Statement {}

    /// Keeps [`Executor`](super::Executor) to the types this crate knows how to run on.
    #[allow(unreachable_pub)]
    pub trait Executor {}

    impl Executor for super::TransactionClient {}
    impl<C: GenericClient> Executor for C {}
}

impl TransactionClient {
    fn client(&self) -> &tokio_postgres::Client {
        &self.connection
    }

    /// Refuses transaction control in `command`'s text.
    fn check<T: Command + ?Sized>(command: &T) -> Result<(), Error> {
        match command.sql_text() {
            Some(sql) => sql_guard::check_command(sql),
            None => Ok(()),
        }
    }

    /// Converts a database error, keeping a conflict for the layer to see.
    fn observe<T>(&self, result: Result<T, tokio_postgres::Error>) -> Result<T, Error> {
        result.map_err(|error| {
            self.tx.observe(&error);
            Error::Postgres(error)
        })
    }

    /// Prepares `query` ([`tokio_postgres::Client::prepare`]).
    pub async fn prepare(&self, query: &str) -> Result<Statement, Error> {
        sql_guard::check_command(query)?;
        self.observe(self.client().prepare(query).await)
    }

    /// Prepares `query` with the given parameter types
    /// ([`tokio_postgres::Client::prepare_typed`]).
    pub async fn prepare_typed(
        &self,
        query: &str,
        parameter_types: &[Type],
    ) -> Result<Statement, Error> {
        sql_guard::check_command(query)?;
        self.observe(self.client().prepare_typed(query, parameter_types).await)
    }

    /// Prepares `query` once per connection and reuses the statement afterwards.
    pub async fn prepare_cached(&self, query: &str) -> Result<Statement, Error> {
        sql_guard::check_command(query)?;
        self.observe(self.connection.prepare_cached(query).await)
    }

    /// Runs a statement and returns its rows ([`tokio_postgres::Client::query`]).
    pub async fn query<T>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, Error>
    where
        T: ?Sized + Command,
    {
        Self::check(statement)?;
        self.observe(self.client().query(statement, params).await)
    }

    /// Runs a statement that returns exactly one row ([`tokio_postgres::Client::query_one`]).
    pub async fn query_one<T>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, Error>
    where
        T: ?Sized + Command,
    {
        Self::check(statement)?;
        self.observe(self.client().query_one(statement, params).await)
    }

    /// Runs a statement that returns at most one row
    /// ([`tokio_postgres::Client::query_opt`]).
    pub async fn query_opt<T>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, Error>
    where
        T: ?Sized + Command,
    {
        Self::check(statement)?;
        self.observe(self.client().query_opt(statement, params).await)
    }

    /// Runs `query` with parameters of the given types, without preparing it first
    /// ([`tokio_postgres::Client::query_typed`]).
    pub async fn query_typed(
        &self,
        query: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, Error> {
        sql_guard::check_command(query)?;
        self.observe(self.client().query_typed(query, params).await)
    }

    /// Runs a statement; returns how many rows it changed
    /// ([`tokio_postgres::Client::execute`]).
    pub async fn execute<T>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, Error>
    where
        T: ?Sized + Command,
    {
        Self::check(statement)?;
        self.observe(self.client().execute(statement, params).await)
    }

    /// [`execute`](Self::execute) with the parameters as an iterator
    /// ([`tokio_postgres::Client::execute_raw`]).
    pub async fn execute_raw<T, P, I>(&self, statement: &T, params: I) -> Result<u64, Error>
    where
        T: ?Sized + Command,
        P: BorrowToSql,
        I: IntoIterator<Item = P>,
        I::IntoIter: ExactSizeIterator,
    {
        Self::check(statement)?;
        self.observe(self.client().execute_raw(statement, params).await)
    }

    /// Runs the statements of `query` (separated by `;`, no parameters) one after the other.
    ///
    /// All of them are checked before the first runs: one refused statement and none runs.
    pub async fn batch_execute(&self, query: &str) -> Result<(), Error> {
        let statements = sql_guard::split(query);
        for statement in &statements {
            sql_guard::check_command(statement)?;
        }
        for statement in statements {
            // The extended protocol: a piece that still held two commands would be refused
            // by the server, so nothing this did not check can run.
            self.observe(self.client().execute(statement, &[]).await)?;
        }
        Ok(())
    }

    /// Runs the statements of `query` with the simple query protocol (rows as text)
    /// ([`tokio_postgres::Client::simple_query`]), one after the other; checked like
    /// [`batch_execute`](Self::batch_execute).
    pub async fn simple_query(&self, query: &str) -> Result<Vec<SimpleQueryMessage>, Error> {
        let statements = sql_guard::split(query);
        for statement in &statements {
            sql_guard::check_command(statement)?;
        }
        let mut messages = Vec::new();
        for statement in statements {
            // Parsed first with the extended protocol, which takes one command only: the
            // simple protocol then runs text the server has read as exactly that command.
            drop(self.observe(self.client().prepare(statement).await)?);
            messages.extend(self.observe(self.client().simple_query(statement).await)?);
        }
        Ok(messages)
    }

    /// Whether the connection is closed (the server went away).
    pub fn is_closed(&self) -> bool {
        self.client().is_closed()
    }
}

#[cfg(test)]
mod tests;
