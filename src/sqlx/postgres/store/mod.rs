#![doc = include_str!("../../../docs/sqlx_postgres.md")]

// Connections, the commit check and round trips (taking connections is written once for every
// database, in `src/sqlx/store/mod.rs`; the commit check is this file's and `literal`'s):
//
// - **Connections without the pool's checks**: the store takes an idle connection with
//   `Pool::try_acquire`, which skips the pool's `test_before_acquire` ping and any `before_acquire`
//   hook (they run only when it has to wait for a connection). A connection found gone by the
//   transaction's first round trip is discarded and the transaction opened once more on a checked
//   one.
// - **The commit check**: the completed record's `UPDATE` fails unless the reservation row was
//   written by this very transaction (`xmin`); only then does `COMMIT` run. (sqlx does not
//   pipeline: the two go as one simple query with the values written in as literals, which runs
//   nothing after a failed statement; with a body over 16 KiB or non-ASCII text values they go with
//   bind parameters, one after the other, instead.)
// - **Round trips**: two for a new key besides the handler's statements (`BEGIN` with the
//   reservation; the completed record with `COMMIT`), three while the replay check comes first,
//   with no ping: idle connections are taken without the pool's checks, and one found gone at the
//   first statement is replaced once.
// - **Unnamed statements** (`with_unnamed_statements`, behind a transaction pooler, where the
//   next transaction may run on another server connection): the same two flights, with the
//   statements themselves written out (`literal::with_values`) instead of an `EXECUTE` of the
//   ones prepared per connection; bind parameters unnamed, autocommit reads in a transaction of
//   their own, and what is left cached on the connection closed before the transaction ends
//   (`Slot::forget_statements`).

use std::fmt::Write as _;
use std::time::Duration;

use futures_util::future::BoxFuture;
use sqlx::postgres::{PgConnection, PgQueryResult, Postgres};
// The `Executor` methods on a connection rather than the query builders' `execute(conn)`:
// their boxed futures keep the store's futures provably `Send` (the builders' generic futures
// hit a rustc limitation on higher-ranked lifetimes there).
use futures_util::StreamExt as _;
use sqlx::{Either, Executor as _, Row};
use tokio::time::Instant;

use crate::error::Error;
use crate::postgres::guard as sql_guard;
use crate::postgres::store_sql::{
    COMPLETE_RECORD, INSERT_RESERVATION, INSERT_RESERVATION_RESTORING, PREPARED_NAMES,
    PURGE_EXPIRED, SELECT_LIVE_RECORD, SELECT_RECORD, TAKE_OVER,
};
use crate::response::SavedResponse;
use crate::row_lock::reserve;
use crate::sqlx::driver::our_sql;
use crate::sqlx::error::sqlx_code;
use crate::sqlx::store::{
    Opened, ReserveStep, RowsAffected, SqlxDatabase, SqlxDialect, SqlxOptions, SqlxStore,
};
use crate::store::{to_unix_millis, NewRecord, Scope};

mod literal;
mod migrate;
mod owned;

/// The sqlx version of the pools and of the handle's connection: depend on it through this
/// re-export (or keep yours on the same 0.9 release).
pub use sqlx;

use crate::store::Isolation;

/// A PostgreSQL-backed [`IdempotencyStore`](crate::store::IdempotencyStore) on sqlx. Cheap to clone;
/// clones share the pools.
pub type SqlxPostgresStore = SqlxStore<PgDialect>;

/// Options for a [`SqlxPostgresStore`]; see `SqlxPostgresStore::builder`.
pub type SqlxPostgresOptions = SqlxOptions<PgDialect>;

/// The handle a handler uses to write its rows in the request's PostgreSQL transaction.
///
/// ```no_run
/// # async fn handler(tx: tower_idempotency::store::sqlx_postgres::SqlxPostgresHandle)
/// #     -> Result<i64, Box<dyn std::error::Error>> {
/// let mut conn = tx.acquire().await?;
/// let (order_id,): (i64,) =
///     sqlx::query_as("INSERT INTO orders (sku, quantity) VALUES ($1, $2) RETURNING id")
///         .bind("book")
///         .bind(1i64)
///         .fetch_one(&mut *conn)
///         .await?;
/// # Ok(order_id) }
/// ```
///
/// - A failed statement aborts the whole PostgreSQL transaction: answer an error status (the
///   layer then rolls back) rather than carrying on. Use a `SAVEPOINT` to recover from an
///   expected failure inside the transaction.
/// - The conflicts the layer runs the request again after are serialization failures
///   (`40001`) and deadlocks (`40P01`).
/// - Statements run with the layer's `lock_timeout` (`SET LOCAL`): a lock wait past it fails
///   with SQLSTATE `55P03`.
#[doc = crate::sqlx::store::handle_docs!("SqlxPostgresHandle", "SqlxPostgresConnection")]
pub type SqlxPostgresHandle = crate::sqlx::store::SqlxHandle<PgDialect>;

/// A pooled connection inside the request's transaction: `&mut SqlxPostgresConnection` is a
/// [`sqlx::Executor`] for PostgreSQL, on which sqlx code runs as on a `&mut PgConnection`.
///
/// `BEGIN`, `START TRANSACTION`, `COMMIT`, `END`, `ROLLBACK`, `ABORT`, `PREPARE TRANSACTION`
/// and `COMMIT`/`ROLLBACK PREPARED` are refused; `SAVEPOINT`, `RELEASE` and `ROLLBACK TO` are
/// allowed: they stay inside the transaction. Every statement goes with the extended protocol,
/// which runs one command per string (SQL without bind parameters is cut into statements).
#[doc = crate::sqlx::store::connection_docs!("SqlxPostgresHandle")]
pub type SqlxPostgresConnection = crate::sqlx::store::CheckedConnection<PgDialect>;

mod dialect {
    /// PostgreSQL as the sqlx store's database: the SQL of `src/postgres/store_sql.rs` (shared with the
    /// tokio-postgres store), SQLSTATE conflicts, and the PostgreSQL statement guard.
    #[derive(Clone, Copy, Debug)]
    pub struct PgDialect;
}
pub(crate) use dialect::PgDialect;

impl SqlxOptions<PgDialect> {
    /// How many times reserving a key is retried after a serialization failure (`40001`) or a
    /// deadlock (`40P01`), within the lock timeout, before the request gets `503`. Default: 3.
    pub fn with_serialization_retries(mut self, retries: u32) -> Self {
        self.conflict_retries = retries;
        self
    }

    /// Whether the store keeps no statement prepared on a connection past one message or one
    /// transaction: its one-flight statements go as text with their values written in (not as
    /// an `EXECUTE` of a statement prepared once per connection), its statements with bind
    /// parameters go unnamed (sqlx's `persistent(false)`), inside a transaction (one of their
    /// own where they would run in autocommit), and a statement left cached on the connection
    /// is closed before the transaction ends. A handler's statements through the
    /// [`SqlxPostgresHandle`]'s connection go unnamed too. Turn it on behind a connection pool
    /// that may hand each transaction to another server connection: PgBouncer with
    /// `pool_mode = transaction` (before 1.21, or with `max_prepared_statements` unset),
    /// Supavisor, RDS Proxy. There, a statement prepared on one server connection does not
    /// exist on the next, and requests fail with `500` and
    /// `prepared statement "sqlx_s_3" does not exist` (or `"tower_idempotency_reserve"`).
    /// Default: `false` (on a direct connection a statement prepared once is not parsed and
    /// planned again on every run). See
    /// [Behind a transaction pooler](crate::store::sqlx_postgres#behind-a-transaction-pooler).
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    /// use tower_idempotency::store::sqlx_postgres::SqlxPostgresStore;
    ///
    /// // PgBouncer, pool_mode = transaction, on port 6432.
    /// let options: PgConnectOptions = "postgres://app@127.0.0.1:6432/shop".parse()?;
    /// let pool = PgPoolOptions::new().connect_with(options).await?;
    /// let store = SqlxPostgresStore::builder(pool)
    ///     .with_unnamed_statements(true)
    ///     .build();
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub fn with_unnamed_statements(mut self, unnamed: bool) -> Self {
        self.unnamed_statements = unnamed;
        self
    }
}

impl RowsAffected for PgQueryResult {
    fn rows_affected(&self) -> u64 {
        PgQueryResult::rows_affected(self)
    }
}

impl crate::sqlx::store::sealed::Sealed for PgDialect {}

impl SqlxDialect for PgDialect {
    type Db = Postgres;
    /// The `ctid` of the reserved row.
    type RowId = String;

    const STORE_NAME: &'static str = "SqlxPostgresStore";
    const SELECT_RECORD: &'static str = SELECT_RECORD;
    const SELECT_LIVE_RECORD: &'static str = SELECT_LIVE_RECORD;
    const PURGE_EXPIRED: &'static str = PURGE_EXPIRED;
    const COMMIT: &'static str = "COMMIT";
    const ROLLBACK: &'static str = "ROLLBACK";
    const REFUSED_AFTER_CONFLICT: Option<&'static str> = None;
    /// PostgreSQL ends every lock wait by the deadline itself (`lock_timeout`).
    const ANSWER_MARGIN: Option<Duration> = Some(crate::postgres::reserve::ANSWER_MARGIN);

    /// PostgreSQL text cannot hold NUL: a tenant, operation or key with one is refused (the
    /// server would refuse it as a parameter too).
    fn purge_progress(
        store: &crate::sqlx::store::SqlxStore<Self>,
        now: std::time::SystemTime,
        batch: usize,
    ) -> futures_util::future::BoxFuture<'_, Result<u64, crate::error::Error>> {
        Box::pin(crate::steps::StepStore::purge_progress(store, now, batch))
    }

    fn check_scope(scope: &Scope) -> Result<(), Error> {
        let parts = [&*scope.tenant, &*scope.operation, scope.key.as_str()];
        if parts.iter().any(|part| part.contains('\0')) {
            return Err(literal::nul_refused());
        }
        Ok(())
    }

    /// `SET LOCAL lock_timeout`: a reservation past `key_row_wait` fails with `55P03`.
    fn begin_request(
        isolation: Isolation,
        deadline: Instant,
        key_row_wait: Option<Duration>,
    ) -> String {
        isolation.begin_request(deadline, key_row_wait)
    }

    fn restore_lock_wait(deadline: Instant) -> String {
        crate::postgres::reserve::restore_lock_timeout(deadline)
    }

    /// One round trip: `BEGIN`, `SET LOCAL lock_timeout` and the reservation's `INSERT` (an
    /// `EXECUTE` of it, prepared once per connection) in one simple query; the key's values
    /// are written into its text as literals when they are plain ASCII (else the `BEGIN` goes
    /// alone and the `INSERT` follows with bind parameters). If a statement fails, those after
    /// it do not run and the transaction stays open, aborted, for the caller's `ROLLBACK`.
    ///
    /// Only a lock wait of the `INSERT` past `key_row_wait` is [`Error::InFlight`]: a wait of
    /// the `BEGIN`'s statements (under an in-flight policy, for the table's lock) or of the
    /// statements' preparation ends by the deadline and is reported as it is (`503`).
    fn open_request<'a>(
        conn: &'a mut PgConnection,
        isolation: Isolation,
        (deadline, key_row_wait): (Instant, Option<Duration>),
        (scope, now): (&'a Scope, i64),
        unnamed: bool,
    ) -> BoxFuture<'a, Result<Opened<String>, Error>> {
        // Under an in-flight policy, the insert that reserved the key bounds the lock waits by
        // the deadline again.
        let restore = key_row_wait.map(|_| deadline);
        let begin = move || isolation.begin_request(deadline, key_row_wait);
        let begin_statements = Isolation::begin_request_statements(key_row_wait);
        let flight = move || {
            let begin = begin();
            let flight = if unnamed {
                inline_flight(&begin, scope, now, restore)
            } else {
                one_flight(&begin, scope, now, restore)
            };
            flight.ok_or(begin)
        };
        let failed = move |flight: Failed| match flight {
            Failed::Begin(error) => Error::from(error),
            Failed::Insert(error) => reserve::in_flight_past_bound(key_row_wait, error.into()),
        };
        Box::pin(async move {
            let sql = match flight() {
                Ok(sql) => sql,
                Err(begin) => {
                    conn.execute(our_sql(begin)).await?;
                    return Ok(Opened {
                        inserted: None,
                        lock_wait_restored: false,
                    });
                }
            };
            let row = match run_flight(conn, &sql, begin_statements).await {
                // The connection has not prepared the store's statements (a new connection):
                // the transaction is open, aborted. (An inline flight prepares nothing.)
                Err(Failed::Insert(error))
                    if !unnamed && sqlx_code(&error).as_deref() == Some(NO_SUCH_STATEMENT) =>
                {
                    prepare_statements(conn, &begin()).await?;
                    let sql = flight().map_err(|_| sqlx::Error::Protocol("no flight".into()))?;
                    run_flight(conn, &sql, begin_statements)
                        .await
                        .map_err(failed)?
                }
                row => row.map_err(failed)?,
            };
            Ok(Opened {
                inserted: Some(row),
                lock_wait_restored: restore.is_some(),
            })
        })
    }

    /// An I/O error, a crashed connection task, or the server ending the session
    /// (`57P01`, `57P02`, class `08`).
    fn is_connection_lost(error: &sqlx::Error) -> bool {
        match error {
            sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed => true,
            other => sqlx_code(other)
                .is_some_and(|code| matches!(&*code, "57P01" | "57P02") || code.starts_with("08")),
        }
    }

    /// Both statements return the row's address.
    fn reserve<'a>(
        conn: &'a mut PgConnection,
        step: ReserveStep,
        scope: &'a Scope,
        now: i64,
    ) -> BoxFuture<'a, Result<Option<String>, Error>> {
        let sql = match step {
            ReserveStep::Insert => INSERT_RESERVATION,
            ReserveStep::TakeOver => TAKE_OVER,
        };
        let query = Postgres::bind_scope(sqlx::query(sql), scope).bind(now);
        let row = conn.fetch_optional(query);
        Box::pin(async move { Ok(row.await?.map(|row| row.try_get(0)).transpose()?) })
    }

    /// The `UPDATE` fails unless the reservation row was written by this very transaction
    /// (`xmin`).
    fn complete<'a>(
        conn: &'a mut PgConnection,
        scope: &'a Scope,
        row: &'a String,
        record: &'a NewRecord,
    ) -> BoxFuture<'a, Result<(), Error>> {
        let complete = Postgres::bind_scope(sqlx::query(COMPLETE_RECORD), scope);
        let complete = Postgres::bind_record(complete, record).bind(row.as_str());
        let saved = conn.execute(complete);
        Box::pin(async move { saved.await.map(drop).map_err(complete_failed) })
    }

    /// An `EXECUTE` of the statement, prepared once per connection (or, `unnamed`, the
    /// statement itself), with plain ASCII text values and a body of at most 16 KiB.
    fn complete_as_text(
        scope: &Scope,
        row: &String,
        record: &NewRecord,
        unnamed: bool,
    ) -> Option<String> {
        if unnamed {
            inline_complete(scope, row, record)
        } else {
            complete_as_text(scope, row, record)
        }
    }

    fn complete_failed(error: sqlx::Error) -> Error {
        complete_failed(error)
    }

    /// A serialization failure (`40001`) or a deadlock (`40P01`).
    fn is_conflict(error: &sqlx::Error) -> bool {
        matches!(sqlx_code(error).as_deref(), Some("40001" | "40P01"))
    }

    fn is_unavailable(error: &sqlx::Error) -> bool {
        crate::sqlx::error::sqlx_unavailable(error)
    }

    /// `55P03`: a lock wait past `lock_timeout` (the layer's lock timeout). PostgreSQL aborts
    /// the whole transaction with it; a handler that then fails is answered `503`.
    fn is_lock_timeout(error: &sqlx::Error) -> bool {
        sqlx_code(error).as_deref() == Some("55P03")
    }

    fn check_command(sql: &str) -> Result<(), Error> {
        sql_guard::check_command_remembered(sql)
    }

    fn split(sql: &str) -> Vec<&str> {
        sql_guard::split(sql)
    }
}

/// `invalid_sql_statement_name`: `EXECUTE` of a statement the connection has not prepared.
const NO_SUCH_STATEMENT: &str = "26000";

/// `begin` (the `BEGIN` and `SET LOCAL lock_timeout` of `Isolation::begin_request`) followed by
/// the reservation, as one simple query: `EXECUTE` of the prepared [`INSERT_RESERVATION`] with
/// the scope's values as literals and `now` as an integer (or, with `restore`, a deadline under
/// an in-flight policy, of [`INSERT_RESERVATION_RESTORING`] with the milliseconds left until
/// it). `None` unless every value is plain ASCII ([`literal::is_plain`]; see `literal` for
/// why the quoting is safe): then the `INSERT` goes with bind parameters.
fn one_flight(begin: &str, scope: &Scope, now: i64, restore: Option<Instant>) -> Option<String> {
    let parts = [&*scope.tenant, &*scope.operation, scope.key.as_str()];
    let name = PREPARED_NAMES[usize::from(restore.is_some())];
    let values = parts.iter().map(|part| part.len()).sum::<usize>();
    let mut sql = String::with_capacity(begin.len() + name.len() + values + 80);
    sql.push_str(begin);
    sql.push_str("; EXECUTE ");
    sql.push_str(name);
    sql.push('(');
    for part in parts {
        literal::push_plain(&mut sql, part)?;
        sql.push_str(", ");
    }
    // Writing into a `String` cannot fail.
    let _ = write!(sql, "{now}");
    if let Some(deadline) = restore {
        let left = deadline
            .saturating_duration_since(Instant::now())
            .as_millis()
            .max(1);
        let _ = write!(sql, ", {left}");
    }
    sql.push(')');
    Some(sql)
}

/// [`one_flight`] for a connection that keeps no statement (behind a transaction pooler, where
/// the next transaction may run on another server connection, which has not prepared it): the
/// reservation's statement itself with its values written in, not an `EXECUTE`. The server
/// parses and plans it every time. `None` unless every value is plain ASCII.
fn inline_flight(begin: &str, scope: &Scope, now: i64, restore: Option<Instant>) -> Option<String> {
    let mut values = Vec::with_capacity(5);
    for part in [&*scope.tenant, &*scope.operation, scope.key.as_str()] {
        values.push(literal::plain(part)?);
    }
    values.push(now.to_string());
    let statement = match restore {
        Some(deadline) => {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .as_millis()
                .max(1);
            values.push(left.to_string());
            INSERT_RESERVATION_RESTORING
        }
        None => INSERT_RESERVATION,
    };
    let insert = literal::with_values(statement, &values)?;
    Some(format!("{begin}; {insert}"))
}

/// A statement of a flight ([`one_flight`]) that failed: one of the `BEGIN`'s, or the
/// reservation's `INSERT`.
enum Failed {
    Begin(sqlx::Error),
    Insert(sqlx::Error),
}

/// Sends `sql` (see [`one_flight`], whose `BEGIN` has `begin_statements` statements): the
/// reserved row's address, or `None` if the key has a row.
async fn run_flight(
    conn: &mut PgConnection,
    sql: &str,
    begin_statements: usize,
) -> Result<Option<String>, Failed> {
    let mut results = conn.fetch_many(our_sql(sql));
    let mut row = None;
    // The statements that ran to their end: an error before the `BEGIN`'s all did is theirs.
    let mut done = 0;
    while let Some(result) = results.next().await {
        match result {
            Ok(Either::Left(_)) => done += 1,
            Ok(Either::Right(inserted)) => {
                let address = inserted.try_get::<String, _>(0).map_err(Failed::Insert)?;
                row.get_or_insert(address);
            }
            Err(error) if done < begin_statements => return Err(Failed::Begin(error)),
            Err(error) => return Err(Failed::Insert(error)),
        }
    }
    Ok(row)
}

/// Ends the aborted transaction on `conn` and prepares the store's statements that the
/// connection does not have ([`PREPARED_NAMES`]): once per connection. They are prepared in a
/// transaction opened with `begin` (then rolled back: prepared statements outlive it), whose
/// `lock_timeout` bounds the wait: preparing a statement that writes the table takes the
/// table's lock, which another session may hold (a `LOCK TABLE`).
async fn prepare_statements(conn: &mut PgConnection, begin: &str) -> Result<(), sqlx::Error> {
    let names = PREPARED_NAMES.map(|name| format!("'{name}'")).join(", ");
    let check = format!(
        "ROLLBACK; {begin}; SELECT name FROM pg_prepared_statements WHERE name IN ({names})"
    );
    let mut present = Vec::new();
    {
        let mut results = conn.fetch_many(our_sql(check));
        while let Some(result) = results.next().await {
            if let Either::Right(row) = result? {
                present.push(row.try_get::<String, _>(0)?);
            }
        }
    }
    let statements = [
        INSERT_RESERVATION,
        INSERT_RESERVATION_RESTORING,
        COMPLETE_RECORD,
    ];
    let mut prepare: Vec<String> = PREPARED_NAMES
        .iter()
        .zip(statements)
        .filter(|(name, _)| !present.iter().any(|have| have == *name))
        .map(|(name, statement)| format!("PREPARE {name} AS {statement}"))
        .collect();
    prepare.push("ROLLBACK".to_owned());
    conn.execute(our_sql(prepare.join("; "))).await?;
    Ok(())
}

/// The completed record's `error`: the division by zero of [`COMPLETE_RECORD`] says that the
/// row is not this transaction's reservation.
fn complete_failed(error: sqlx::Error) -> Error {
    if sqlx_code(&error).as_deref() == Some("22012") {
        Error::TransactionAborted(
            "the transaction ended before commit (it is not the one the layer began)",
        )
    } else {
        error.into()
    }
}

/// The most body bytes the completed record's statement carries as text (as hex, twice as
/// many characters); a larger body goes as a bind parameter.
const MAX_TEXT_BODY: usize = 16 * 1024;

/// [`complete_as_text`] for a connection that keeps no statement (see [`inline_flight`]):
/// [`COMPLETE_RECORD`] itself with its values written in. `None` under the same conditions.
fn inline_complete(scope: &Scope, row: &str, record: &NewRecord) -> Option<String> {
    let response = &record.response;
    if response.body.len() > MAX_TEXT_BODY {
        return None;
    }
    let headers = SavedResponse::encode_headers(&response.headers);
    let trailers = match &response.trailers {
        Some(trailers) => literal::plain(&SavedResponse::encode_headers(trailers))?,
        None => "NULL".to_owned(),
    };
    let values = [
        literal::plain(&scope.tenant)?,
        literal::plain(&scope.operation)?,
        literal::plain(scope.key.as_str())?,
        literal::bytes_constant(&record.fingerprint.digest()[..]),
        record.fingerprint.version().to_string(),
        response.status.as_u16().to_string(),
        literal::plain(&headers)?,
        literal::bytes_constant(&response.body),
        trailers,
        to_unix_millis(record.created_at).to_string(),
        to_unix_millis(record.expires_at).to_string(),
        literal::plain(row)?,
    ];
    literal::with_values(COMPLETE_RECORD, &values)
}

/// `EXECUTE` of the prepared [`COMPLETE_RECORD`] (prepared with the reservation's, see
/// [`prepare_statements`]) with its values as literals (see `literal`): the text values quoted,
/// the bytes as hex `bytea` constants, the numbers as integers. `None` unless every text value
/// (the scope, the headers, the trailers, the row's address) is plain ASCII and the body is at
/// most [`MAX_TEXT_BODY`] bytes. (A handler that runs `DEALLOCATE` makes the commit fail:
/// nothing is committed.)
fn complete_as_text(scope: &Scope, row: &str, record: &NewRecord) -> Option<String> {
    let response = &record.response;
    if response.body.len() > MAX_TEXT_BODY {
        return None;
    }
    let headers = SavedResponse::encode_headers(&response.headers);
    let trailers = (response.trailers.as_ref()).map(|t| SavedResponse::encode_headers(t));
    let digest = &record.fingerprint.digest()[..];
    let scope_texts = [&*scope.tenant, &*scope.operation, scope.key.as_str()];
    // One buffer: the text values (quoting adds a few bytes each), the bytes as hex, the rest.
    let texts = scope_texts.iter().map(|text| text.len()).sum::<usize>()
        + headers.len()
        + trailers.as_ref().map_or(0, String::len)
        + row.len();
    let mut sql = String::with_capacity(texts + 2 * (digest.len() + response.body.len()) + 200);
    sql.push_str("EXECUTE ");
    sql.push_str(PREPARED_NAMES[2]);
    sql.push('(');
    for text in scope_texts {
        literal::push_plain(&mut sql, text)?;
        sql.push_str(", ");
    }
    literal::push_bytes(&mut sql, digest);
    // Writing into a `String` cannot fail.
    let _ = write!(
        sql,
        ", {}, {}, ",
        record.fingerprint.version(),
        response.status.as_u16()
    );
    literal::push_plain(&mut sql, &headers)?;
    sql.push_str(", ");
    literal::push_bytes(&mut sql, &response.body);
    sql.push_str(", ");
    match &trailers {
        Some(trailers) => literal::push_plain(&mut sql, trailers)?,
        None => sql.push_str("NULL"),
    }
    let _ = write!(
        sql,
        ", {}, {}, ",
        to_unix_millis(record.created_at),
        to_unix_millis(record.expires_at)
    );
    literal::push_plain(&mut sql, row)?;
    sql.push(')');
    Some(sql)
}
