#![doc = include_str!("../../../docs/sqlx_mysql.md")]

use std::time::Duration;

use futures_util::future::BoxFuture;
use sqlx::mysql::{MySql, MySqlConnection, MySqlQueryResult};
// The `Executor` methods on a connection rather than the query builders' `execute(conn)`:
// their boxed futures keep the store's futures provably `Send`.
use sqlx::{Executor as _, Row as _};
use tokio::time::Instant;

use crate::error::Error;
use crate::mysql::guard as sql_guard;
use crate::mysql::store_sql as sql;
use crate::sqlx::driver::our_sql;
use crate::sqlx::error::sqlx_code;
use crate::sqlx::mysql::error::{mysql_number, MYSQL_DEADLOCK, MYSQL_LOCK_WAIT_TIMEOUT};
use crate::sqlx::store::{
    ReserveStep, RowsAffected, SqlxDatabase, SqlxDialect, SqlxOptions, SqlxStore,
};
use crate::store::{NewRecord, Scope};

mod owned;

/// The sqlx version of the pools and of the handle's connection: depend on it through this
/// re-export (or keep yours on the same 0.9 release).
pub use sqlx;

use crate::store::Isolation;

/// MySQL's `ER_DUP_ENTRY`: the key has a committed row.
const DUPLICATE_KEY: u16 = 1062;

/// The longest tenant, operation or key the table holds, in bytes.
pub(crate) const MAX_SCOPE_BYTES: usize = 255;

/// A MySQL- or MariaDB-backed [`IdempotencyStore`](crate::store::IdempotencyStore) on sqlx. Cheap to
/// clone; clones share the pools.
pub type SqlxMySqlStore = SqlxStore<MySqlDialect>;

/// Options for a [`SqlxMySqlStore`]; see `SqlxMySqlStore::builder`.
pub type SqlxMySqlOptions = SqlxOptions<MySqlDialect>;

/// The handle a handler uses to write its rows in the request's InnoDB transaction.
///
/// ```no_run
/// # async fn handler(tx: tower_idempotency::store::sqlx_mysql::SqlxMySqlHandle)
/// #     -> Result<u64, Box<dyn std::error::Error>> {
/// let mut conn = tx.acquire().await?;
/// let done = sqlx::query("INSERT INTO orders (sku, quantity) VALUES (?, ?)")
///     .bind("book")
///     .bind(1i64)
///     .execute(&mut *conn)
///     .await?;
/// # Ok(done.last_insert_id()) }
/// ```
///
/// - Refused besides `COMMIT`, `ROLLBACK` and `BEGIN`: the statements after which MySQL
///   commits on its own (DDL, `LOCK TABLES`, `SET autocommit`...; see [`SqlxMySqlConnection`]).
/// - A failed statement is rolled back on its own and the transaction goes on (InnoDB's way),
///   except a deadlock (`1213`), after which InnoDB has rolled the whole transaction back: the
///   connection then refuses further statements, and the layer runs the request again.
/// - Lock waits are bounded by the layer's lock timeout (`innodb_lock_wait_timeout` for row
///   locks, `lock_wait_timeout` for metadata locks such as another session's `LOCK TABLES`;
///   whole seconds): past it a statement fails with `1205`. If the handler then fails, the
///   layer answers `503` with `Retry-After` (whatever the handler answered) and rolls back.
#[doc = crate::sqlx::store::handle_docs!("SqlxMySqlHandle", "SqlxMySqlConnection")]
pub type SqlxMySqlHandle = crate::sqlx::store::SqlxHandle<MySqlDialect>;

/// A pooled connection inside the request's transaction: `&mut SqlxMySqlConnection` is a
/// [`sqlx::Executor`] for MySQL, on which sqlx code runs as on a `&mut MySqlConnection`.
///
/// `BEGIN`, `START TRANSACTION`, `COMMIT`, `ROLLBACK`, `XA`, `LOCK`/`UNLOCK TABLES`, `SET
/// autocommit`, SQL-level `PREPARE`/`EXECUTE`, and the statements that commit implicitly
/// (`CREATE`, `ALTER`, `DROP`, `RENAME`, `TRUNCATE`, `GRANT`, table maintenance...) are
/// refused. `SAVEPOINT`, `RELEASE SAVEPOINT`, `ROLLBACK TO`, `CREATE TEMPORARY TABLE` and `DROP
/// TEMPORARY TABLE` are allowed. Every statement goes with the binary protocol, which runs one
/// statement per string (SQL without bind parameters is cut into statements). A stored
/// procedure (`CALL`) runs unchecked: one that commits commits the request's transaction.
/// Nothing runs after a deadlock: InnoDB has rolled the transaction back by then, and what
/// followed would run in another transaction.
#[doc = crate::sqlx::store::connection_docs!("SqlxMySqlHandle")]
pub type SqlxMySqlConnection = crate::sqlx::store::CheckedConnection<MySqlDialect>;

mod dialect {
    /// MySQL and MariaDB as the sqlx store's database: the SQL of this module, duplicate-key
    /// reservations, InnoDB deadlocks, the session's settings saved and restored around a
    /// request, and the MySQL statement guard.
    #[derive(Clone, Copy, Debug)]
    pub struct MySqlDialect;
}
pub(crate) use dialect::MySqlDialect;

impl SqlxOptions<MySqlDialect> {
    /// How many times reserving a key is retried after a deadlock (`1213`: InnoDB rolled the
    /// transaction back, as happens when several requests waited on a key whose holder rolled
    /// back), within the lock timeout, before the request gets `503`. Default: 3.
    pub fn with_deadlock_retries(mut self, retries: u32) -> Self {
        self.conflict_retries = retries;
        self
    }
}

impl SqlxMySqlStore {
    /// Creates `idempotency_records` if it is missing (the crate's migration file, run under
    /// `GET_LOCK` so that instances starting together do not race). Safe to run at every start,
    /// and before or after `sqlx migrate run` of the same file. On a Galera cluster node, a store
    /// whose request transactions run at [`Isolation::Serializable`] is refused here (it would
    /// be serializable on one node only), with an error that says so.
    pub async fn migrate(&self) -> Result<(), Error> {
        self.install_schema(sql::MIGRATION_LOCK, sql::SCHEMA).await
    }

    /// Creates tables (`schema`: `CREATE ... IF NOT EXISTS` statements) under `GET_LOCK(lock)`
    /// (the same name in every instance).
    ///
    /// On a Galera node (`wsrep_on = ON`) it first refuses a store whose request transactions
    /// run at `SERIALIZABLE`: see [`refuse_on_galera`].
    pub(crate) async fn install_schema(&self, lock: &str, schema: &str) -> Result<(), Error> {
        let mut conn = self.pool().acquire().await?;
        refuse_on_galera(&mut conn, self.shared.isolation).await?;
        let lock_row = conn
            .fetch_one(sqlx::query("SELECT GET_LOCK(?, 30)").bind(lock))
            .await?;
        let locked: Option<i64> = lock_row.try_get(0)?;
        if locked != Some(1) {
            return Err(Error::Busy);
        }
        let created = conn.execute(sqlx::raw_sql(our_sql(schema))).await;
        let released = conn
            .execute(sqlx::query("DO RELEASE_LOCK(?)").bind(lock))
            .await;
        created?;
        released?;
        Ok(())
    }
}

/// What a Galera node does not give the store, refused when the store installs its tables
/// (`migrate`, the outbox's and the steps' installs).
///
/// `SERIALIZABLE` makes InnoDB's reads take shared locks, but locks are a node's own: Galera
/// certifies a transaction against the rows that transactions of other nodes *wrote*, never
/// against what it read, so two handlers on two nodes that read and write conflicting rows
/// both commit. Request transactions at `SERIALIZABLE` would not be serializable across the
/// cluster.
pub(crate) const GALERA_SERIALIZABLE: &str =
    "the server is a Galera cluster node (wsrep_on = ON): \
     request transactions at SERIALIZABLE are serializable on one node only (Galera certifies \
     the rows a transaction wrote against those other nodes wrote, never what it read); use \
     READ COMMITTED (the default) or REPEATABLE READ";

/// Refuses `isolation` on a Galera node where it does not hold ([`GALERA_SERIALIZABLE`]).
async fn refuse_on_galera(conn: &mut MySqlConnection, isolation: Isolation) -> Result<(), Error> {
    if isolation != Isolation::Serializable || !is_galera_node(conn).await? {
        return Ok(());
    }
    Err(Error::Sqlx(sqlx::Error::Configuration(
        GALERA_SERIALIZABLE.into(),
    )))
}

/// Whether the server replicates with Galera: `wsrep_on` is `ON` (MySQL has no such
/// variable; a MariaDB server built with Galera support has it `OFF` unless it is a node).
pub(crate) async fn is_galera_node(conn: &mut MySqlConnection) -> Result<bool, Error> {
    let row = conn
        .fetch_optional(sqlx::query("SHOW VARIABLES LIKE 'wsrep_on'"))
        .await?;
    let Some(row) = row else {
        return Ok(false);
    };
    let value: String = row.try_get(1)?;
    Ok(value.eq_ignore_ascii_case("ON"))
}

impl RowsAffected for MySqlQueryResult {
    fn rows_affected(&self) -> u64 {
        MySqlQueryResult::rows_affected(self)
    }
}

impl crate::sqlx::store::sealed::Sealed for MySqlDialect {}

impl SqlxDialect for MySqlDialect {
    type Db = MySql;
    /// The commit finds the reserved row by its key.
    type RowId = ();

    const STORE_NAME: &'static str = "SqlxMySqlStore";
    const SELECT_RECORD: &'static str = sql::SELECT_RECORD;
    const SELECT_LIVE_RECORD: &'static str = sql::SELECT_LIVE_RECORD;
    const PURGE_EXPIRED: &'static str = sql::PURGE_EXPIRED;
    const COMMIT: &'static str = sql::COMMIT;
    const ROLLBACK: &'static str = sql::ROLLBACK;
    const REFUSED_AFTER_CONFLICT: Option<&'static str> = Some(
        "refused: a deadlock rolled the request's transaction back; the layer runs the \
         request again",
    );

    /// Checks that the scope fits the table's columns: a longer value would be refused by a
    /// strict server and cut short by a lenient one (two keys would then share a record).
    fn purge_progress(
        store: &crate::sqlx::store::SqlxStore<Self>,
        now: std::time::SystemTime,
        batch: usize,
    ) -> futures_util::future::BoxFuture<'_, Result<u64, crate::error::Error>> {
        Box::pin(crate::steps::StepStore::purge_progress(store, now, batch))
    }

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

    /// `innodb_lock_wait_timeout` counts whole seconds: the lock timeout is rounded up, to one
    /// second at least. A `key_row_wait` is rounded up too, and may be 0 (under
    /// [`InFlight::Reject`](crate::InFlight::Reject)): MariaDB then does not wait at all,
    /// MySQL (whose minimum is 1) waits one second. Past it the reservation fails with `1205`.
    /// Waits for metadata locks (`lock_wait_timeout`) are bounded by the lock timeout alone,
    /// rounded up the same way: past it a statement fails with `1205` too.
    fn begin_request(
        isolation: Isolation,
        deadline: Instant,
        key_row_wait: Option<Duration>,
    ) -> String {
        let lock_wait_secs = match key_row_wait {
            Some(bound) => whole_seconds(bound),
            None => lock_wait_secs(deadline),
        };
        sql::begin_request(isolation, lock_wait_secs, self::lock_wait_secs(deadline))
    }

    fn restore_lock_wait(deadline: Instant) -> String {
        sql::set_lock_wait(lock_wait_secs(deadline))
    }

    /// An `UPDATE` that matches no row: it waits for the table's metadata lock and the global
    /// read lock as the reservation's `INSERT` would (up to `lock_wait_timeout`, the lock
    /// timeout), and takes no row lock. Both are then held to the end of the transaction, so
    /// the `INSERT`'s `1205` (after the in-flight policy's `innodb_lock_wait_timeout`) can
    /// only be the key's row: this one's is [`Error::Busy`].
    fn lock_table_for_reservation(conn: &mut MySqlConnection) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async move {
            match conn.execute(sql::LOCK_TABLE_FOR_RESERVATION).await {
                Ok(_) => Ok(()),
                Err(error) if mysql_number(&error) == Some(MYSQL_LOCK_WAIT_TIMEOUT) => {
                    tracing::debug!(%error, "the records table is locked by another session");
                    Err(Error::Busy)
                }
                Err(error) => Err(error.into()),
            }
        })
    }

    /// The insert fails with a duplicate key once a committed row has the key; the take-over
    /// changes no row if the row changed meanwhile.
    fn reserve<'a>(
        conn: &'a mut MySqlConnection,
        step: ReserveStep,
        scope: &'a Scope,
        now: i64,
    ) -> BoxFuture<'a, Result<Option<()>, Error>> {
        let query = match step {
            ReserveStep::Insert => MySql::bind_scope(sqlx::query(sql::INSERT_RESERVATION), scope)
                .bind(now)
                .bind(now),
            ReserveStep::TakeOver => {
                let query = sqlx::query(sql::TAKE_OVER).bind(now).bind(now);
                MySql::bind_scope(query, scope).bind(now)
            }
        };
        let done = conn.execute(query);
        Box::pin(async move {
            match done.await {
                Ok(done) => {
                    Ok((step == ReserveStep::Insert || done.rows_affected() == 1).then_some(()))
                }
                Err(error)
                    if step == ReserveStep::Insert
                        && mysql_number(&error) == Some(DUPLICATE_KEY) =>
                {
                    Ok(None)
                }
                Err(error) => Err(error.into()),
            }
        })
    }

    /// The `UPDATE` must change exactly the reservation row: if it is gone or completed, the
    /// server ended the transaction under the handler (a deadlock rolled it back).
    fn complete<'a>(
        conn: &'a mut MySqlConnection,
        scope: &'a Scope,
        _row: &'a (),
        record: &'a NewRecord,
    ) -> BoxFuture<'a, Result<(), Error>> {
        let complete = MySql::bind_record(sqlx::query(sql::COMPLETE_RECORD), record);
        let saved = conn.execute(MySql::bind_scope(complete, scope));
        Box::pin(async move {
            if saved.await?.rows_affected() == 1 {
                Ok(())
            } else {
                Err(Error::TransactionAborted(
                    "the transaction ended before commit (it is not the one the layer began)",
                ))
            }
        })
    }

    /// A deadlock (`1213`), or any other serialization failure (`40001`).
    fn is_conflict(error: &sqlx::Error) -> bool {
        mysql_number(error) == Some(MYSQL_DEADLOCK) || sqlx_code(error).as_deref() == Some("40001")
    }

    fn is_unavailable(error: &sqlx::Error) -> bool {
        crate::sqlx::error::sqlx_unavailable(error)
    }

    /// `1205`: a row lock wait past `innodb_lock_wait_timeout`, or a metadata lock wait past
    /// `lock_wait_timeout` (both the layer's lock timeout); InnoDB rolls back the statement.
    fn is_lock_timeout(error: &sqlx::Error) -> bool {
        mysql_number(error) == Some(MYSQL_LOCK_WAIT_TIMEOUT)
    }

    fn check_command(sql: &str) -> Result<(), Error> {
        sql_guard::check_command(sql)
    }

    fn split(sql: &str) -> Vec<&str> {
        sql_guard::split(sql)
    }
}

/// The lock timeout left until `deadline`, for `innodb_lock_wait_timeout`: whole seconds
/// rounded up, at least one.
fn lock_wait_secs(deadline: Instant) -> u64 {
    whole_seconds(deadline.saturating_duration_since(Instant::now())).max(1)
}

/// `wait` in whole seconds, rounded up.
fn whole_seconds(wait: Duration) -> u64 {
    let secs = wait.as_millis().div_ceil(1000);
    u64::try_from(secs).unwrap_or(u64::MAX)
}
