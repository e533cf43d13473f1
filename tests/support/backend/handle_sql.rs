//! What a handler runs through its transaction handle, per driver: the SQL of the suite tests
//! written once over several stores (a connection killed under the transaction, on every store
//! on a server; transaction control refused, on the sqlx stores; a statement failing with a
//! conflict, on the sqlx stores on a server: SQLite has no conflicts).

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use http::StatusCode;
use sqlx::{AssertSqlSafe, Executor as _};
use tower_idempotency::store::tokio_postgres::PostgresHandle;
use tower_idempotency::store::{sqlx_mysql, sqlx_postgres, sqlx_sqlite};

use super::{
    BoxFuture, Call, Database, FailWith, MySql, Postgres, SqlxPostgres, SqlxSqlite, TestDb,
};

/// A [`Database`] whose tests reach the handler's transaction handle ([`Call`]'s `tx`).
pub trait TxHandle: Database {
    /// The store's transaction handle, as the handler gets it.
    type Handle: Send + Sync + 'static;
}

/// A [`Database`] on a server whose handle tells its connection's id, which the test kills.
pub trait HandleSession: TxHandle {
    /// The status and error code of a request whose connection was killed under its handler:
    /// the handler answers its own `500` when its next statement fails, unless the layer
    /// knows better.
    const KILLED_CONNECTION: (StatusCode, &'static str);

    /// The server's id of the handle's connection.
    fn connection_id(tx: &Self::Handle) -> BoxFuture<'_, Result<i64, String>>;

    /// Sleeps 10 s in the transaction (the test kills the connection meanwhile), then runs one
    /// more statement.
    fn sleep_then_query(tx: &Self::Handle) -> BoxFuture<'_, Result<(), String>>;

    /// Kills the connection `id` from a connection of the test's own.
    fn kill(&self, id: i64) -> impl Future<Output = ()>;
}

/// A [`Database`] whose handle runs the sqlx driver's own SQL in the request's transaction.
pub trait HandleSql: TxHandle {
    /// Sends transaction control through the handle in every way the driver has, and runs
    /// savepoints (allowed); what went otherwise than expected.
    fn transaction_control(tx: &Self::Handle) -> BoxFuture<'_, Vec<String>>;
}

/// A [`HandleSql`] on a server whose statements can fail with a conflict the layer retries.
pub trait HandleConflict: HandleSql {
    /// A statement that fails with the server's serialization or deadlock class; what went
    /// otherwise than expected.
    fn raise_conflict(tx: &Self::Handle) -> BoxFuture<'_, Vec<String>>;
}

/// What a handler runs on the handle of `B`: what went otherwise than expected.
pub type HandleCheck<B> = for<'a> fn(&'a <B as TxHandle>::Handle) -> BoxFuture<'a, Vec<String>>;

/// What the checks of a hook found, shared with the test.
#[derive(Clone, Default)]
pub struct Problems(Arc<Mutex<Vec<String>>>);

impl Problems {
    /// Everything found so far.
    pub fn found(&self) -> Vec<String> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// A hook body that runs `check` on the request's handle and keeps what it found in
/// `problems`; the handler then goes on (201).
pub fn checking<B: TxHandle>(
    check: HandleCheck<B>,
    problems: &Problems,
) -> impl Fn(Call) -> BoxFuture<'static, FailWith> + Send + Sync + 'static {
    let problems = problems.clone();
    move |call| {
        let problems = problems.clone();
        Box::pin(async move {
            let found = match call.tx.handle::<B::Handle>() {
                Some(tx) => check(&tx).await,
                None => vec!["not the backend's handle".to_owned()],
            };
            problems
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend(found);
            None
        })
    }
}

/// `Some(what)` unless `outcome` is an error whose message says it was refused.
fn refused<T, E: std::fmt::Display>(what: &str, outcome: Result<T, E>) -> Option<String> {
    match outcome {
        Err(error) if error.to_string().contains("refused") => None,
        Err(error) => Some(format!("{what}: {error}")),
        Ok(_) => Some(format!("{what}: not refused")),
    }
}

/// The connection of the handle `$tx`, or (from the enclosing check) its error as the one
/// problem found.
macro_rules! acquire_or_report {
    ($tx:expr) => {
        match $tx.acquire().await {
            Ok(conn) => conn,
            Err(error) => return vec![error.to_string()],
        }
    };
}

/// The transaction control that every sqlx handle refuses, sent through the connection
/// `$conn` every way sqlx has: `query`, and the executor's own `execute` with a string and with
/// `raw_sql` (`raw_sql(..).execute(&mut *conn)` is not `Send` in a handler, with any sqlx
/// connection). What went otherwise, per attempt.
macro_rules! refused_on_sqlx {
    ($conn:ident) => {
        [
            refused("COMMIT", sqlx::query("COMMIT").execute(&mut *$conn).await),
            refused("ROLLBACK", (&mut *$conn).execute("ROLLBACK").await),
            refused(
                HIDDEN_COMMIT,
                (&mut *$conn).execute(sqlx::raw_sql(HIDDEN_COMMIT)).await,
            ),
            refused("begin", sqlx::query("begin").execute(&mut *$conn).await),
        ]
    };
}

/// [`HandleSql::connection_id`] (the statement, and the type of the id it returns) and
/// [`HandleSql::sleep_then_query`] (the sleep, then the statement after it) in the driver's
/// SQL.
macro_rules! session_statements {
    ($connection_id:literal as $id:ty, [$($statement:literal),+]) => {
        fn connection_id(tx: &Self::Handle) -> BoxFuture<'_, Result<i64, String>> {
            Box::pin(async move {
                let mut conn = tx.acquire().await.map_err(|e| e.to_string())?;
                let id: $id = sqlx::query_scalar($connection_id)
                    .fetch_one(&mut *conn)
                    .await
                    .map_err(|e| e.to_string())?;
                i64::try_from(id).map_err(|e| e.to_string())
            })
        }

        fn sleep_then_query(tx: &Self::Handle) -> BoxFuture<'_, Result<(), String>> {
            Box::pin(async move {
                let mut conn = tx.acquire().await.map_err(|e| e.to_string())?;
                for sql in [$($statement),+] {
                    sqlx::query(sql)
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| e.to_string())?;
                }
                Ok(())
            })
        }
    };
}

/// A batch that ends with a `COMMIT`: refused on every driver, none of its statements run.
const HIDDEN_COMMIT: &str =
    "INSERT INTO orders (tenant_id, sku, quantity) VALUES ('x', 'hidden', 1); COMMIT";

/// Terminates the PostgreSQL backend `id` (`pg_terminate_backend`) from a connection of its own.
async fn terminate_backend(db: &TestDb, id: i64) {
    let pid = i32::try_from(id).expect("a backend pid");
    let terminated: bool = db.value("SELECT pg_terminate_backend($1)", &[&pid]).await;
    assert!(terminated, "backend {pid} terminated");
}

impl TxHandle for Postgres {
    type Handle = PostgresHandle;
}

impl HandleSession for Postgres {
    // The database went away under the handler, as in a failover: not a final failure.
    const KILLED_CONNECTION: (StatusCode, &'static str) =
        (StatusCode::SERVICE_UNAVAILABLE, "busy_retry_later");

    fn connection_id(tx: &Self::Handle) -> BoxFuture<'_, Result<i64, String>> {
        Box::pin(async move {
            let client = tx.client().await.map_err(|e| e.to_string())?;
            let row = client
                .query_one("SELECT pg_backend_pid()", &[])
                .await
                .map_err(|e| e.to_string())?;
            let pid: i32 = row.try_get(0).map_err(|e| e.to_string())?;
            Ok(i64::from(pid))
        })
    }

    fn sleep_then_query(tx: &Self::Handle) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            let client = tx.client().await.map_err(|e| e.to_string())?;
            client
                .batch_execute("SELECT pg_sleep(10); SELECT 1")
                .await
                .map_err(|e| e.to_string())
        })
    }

    async fn kill(&self, id: i64) {
        terminate_backend(&self.db, id).await;
    }
}

impl TxHandle for SqlxPostgres {
    type Handle = sqlx_postgres::SqlxPostgresHandle;
}

impl HandleSession for SqlxPostgres {
    // The database went away under the handler, as in a failover: not a final failure.
    const KILLED_CONNECTION: (StatusCode, &'static str) =
        (StatusCode::SERVICE_UNAVAILABLE, "busy_retry_later");

    session_statements!(
        "SELECT pg_backend_pid()" as i32,
        ["SELECT pg_sleep(10)", "SELECT 1"]
    );

    async fn kill(&self, id: i64) {
        terminate_backend(&self.db, id).await;
    }
}

impl HandleSql for SqlxPostgres {
    fn transaction_control(tx: &Self::Handle) -> BoxFuture<'_, Vec<String>> {
        Box::pin(async move {
            let mut conn = acquire_or_report!(tx);
            let mut problems: Vec<String> = refused_on_sqlx!(conn).into_iter().flatten().collect();
            // Savepoints stay inside the transaction: allowed.
            let savepoints = (&mut *conn)
                .execute(sqlx::raw_sql("SAVEPOINT s; RELEASE SAVEPOINT s"))
                .await;
            problems.extend(savepoints.err().map(|e| format!("savepoints: {e}")));
            problems
        })
    }
}

impl HandleConflict for SqlxPostgres {
    fn raise_conflict(tx: &Self::Handle) -> BoxFuture<'_, Vec<String>> {
        Box::pin(async move {
            let mut conn = acquire_or_report!(tx);
            let conflict = sqlx::query(
                "DO $$ BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = '40001'; END $$",
            )
            .execute(&mut *conn)
            .await;
            match conflict {
                Err(_) => Vec::new(),
                Ok(_) => vec!["the injected conflict did not fail".to_owned()],
            }
        })
    }
}

impl TxHandle for MySql {
    type Handle = sqlx_mysql::SqlxMySqlHandle;
}

impl HandleSession for MySql {
    // MariaDB ends a killed `SLEEP` early without an error; the next statement fails on the
    // lost connection, and the layer answers that as unavailable, as on PostgreSQL.
    const KILLED_CONNECTION: (StatusCode, &'static str) =
        (StatusCode::SERVICE_UNAVAILABLE, "busy_retry_later");

    session_statements!("SELECT CONNECTION_ID()" as u64, ["DO SLEEP(10)", "DO 1"]);

    async fn kill(&self, id: i64) {
        self.db.execute(&format!("KILL {id}")).await;
    }
}

impl HandleSql for MySql {
    fn transaction_control(tx: &Self::Handle) -> BoxFuture<'_, Vec<String>> {
        Box::pin(async move {
            let mut conn = acquire_or_report!(tx);
            // And the implicit commits of MySQL, whichever way they are sent.
            let mut problems: Vec<String> = refused_on_sqlx!(conn).into_iter().flatten().collect();
            let implicit_commits = [
                refused(
                    "SET autocommit = 1",
                    sqlx::query("SET autocommit = 1").execute(&mut *conn).await,
                ),
                refused(
                    "CREATE TABLE",
                    (&mut *conn).execute("CREATE TABLE t (a INT)").await,
                ),
                refused("/*!COMMIT*/", (&mut *conn).execute("/*!COMMIT*/").await),
            ];
            problems.extend(implicit_commits.into_iter().flatten());
            // A session's `sql_mode` changes how quotes read: each of these sets `autocommit`
            // (an implicit commit) under the mode set before it, and the guard reads it so.
            for (mode, sql) in [
                ("NO_BACKSLASH_ESCAPES", "SET @x = 'C:\\', autocommit = 1"),
                ("ANSI_QUOTES", "SET @\"x\\\" = 1, autocommit = 1"),
            ] {
                let set_mode = format!("SET SESSION sql_mode = '{mode}'");
                if let Err(error) = (&mut *conn).execute(AssertSqlSafe(set_mode.as_str())).await {
                    problems.push(format!("{set_mode}: {error}"));
                }
                problems.extend(refused(sql, (&mut *conn).execute(sql).await));
                if let Err(error) = (&mut *conn).execute("SET SESSION sql_mode = DEFAULT").await {
                    problems.push(format!("sql_mode back to its default: {error}"));
                }
            }
            // Savepoints and temporary tables stay inside the transaction: allowed.
            let savepoints = (&mut *conn)
                .execute(sqlx::raw_sql(
                    "SAVEPOINT s; CREATE TEMPORARY TABLE scratch (a INT); \
                     INSERT INTO scratch VALUES (1); ROLLBACK TO SAVEPOINT s; \
                     RELEASE SAVEPOINT s",
                ))
                .await;
            problems.extend(savepoints.err().map(|e| format!("savepoints: {e}")));
            problems
        })
    }
}

impl HandleConflict for MySql {
    fn raise_conflict(tx: &Self::Handle) -> BoxFuture<'_, Vec<String>> {
        Box::pin(async move {
            let mut conn = acquire_or_report!(tx);
            let mut problems = Vec::new();
            let conflict = sqlx::query("SIGNAL SQLSTATE '40001' SET MESSAGE_TEXT = 'injected'")
                .execute(&mut *conn)
                .await;
            if conflict.is_ok() {
                problems.push("the injected conflict did not fail".to_owned());
            }
            // Nothing more runs in the transaction that the deadlock ended.
            problems.extend(refused(
                "a statement after the conflict",
                sqlx::query("DO 1").execute(&mut *conn).await,
            ));
            problems
        })
    }
}

impl TxHandle for SqlxSqlite {
    type Handle = sqlx_sqlite::SqlxSqliteHandle;
}

impl HandleSql for SqlxSqlite {
    fn transaction_control(tx: &Self::Handle) -> BoxFuture<'_, Vec<String>> {
        Box::pin(async move {
            let mut conn = acquire_or_report!(tx);
            // And SQLite's own spelling of `COMMIT`.
            let mut problems: Vec<String> = refused_on_sqlx!(conn).into_iter().flatten().collect();
            problems.extend(refused(
                "END TRANSACTION",
                (&mut *conn).execute("END TRANSACTION").await,
            ));
            // Savepoints stay inside the transaction: allowed.
            let savepoints = (&mut *conn)
                .execute(sqlx::raw_sql(
                    "SAVEPOINT s; ROLLBACK TO SAVEPOINT s; RELEASE SAVEPOINT s",
                ))
                .await;
            problems.extend(savepoints.err().map(|e| format!("savepoints: {e}")));
            problems
        })
    }
}
