//! [`SqlDriver`] on sqlx's SQLite driver: [`SqlxSqliteStore`] and its [`SqlxSqliteHandle`]
//! handle, and the engine's steps, outbox, inbox and admin calls on them. SQLite takes the
//! shared statements' `$n` parameters as written; [`sqlite_text`] drops their row locks and
//! renames `GREATEST`. A transaction of the store's takes the write lock at its start (`BEGIN
//! IMMEDIATE`): one that began as a reader could not become a writer once another had
//! committed, and no other writer runs until it ends, which is what the row locks the other
//! servers take would give.

use sqlx::query::Query;
use sqlx::sqlite::{Sqlite, SqliteArguments, SqliteRow};
// The `Executor` methods keep these futures provably `Send` (see the store's `reservation.rs`).
use sqlx::{Executor as _, Row as _};

use crate::error::Error;
use crate::row_lock::driver::SqlHandle;
use crate::row_lock::driver::{columns_by_try_get, SqlDriver, SqlParam};
use crate::sqlx::driver::{our_sql, sqlx_bind};
use crate::store::sqlx_sqlite::{SqlxSqliteHandle, SqlxSqliteStore};

#[cfg(feature = "outbox")]
use super::outbox_sql;
use super::{admin_sql, steps_sql};

/// `sql` (one of the store's statements, as [`sqlite_text`] gives it) with `params` bound in
/// order.
fn bound<'q>(sql: &str, params: &[SqlParam<'_>]) -> Query<'q, Sqlite, SqliteArguments> {
    sqlx_bind(sqlx::query(our_sql(sqlite_text(sql))), params)
}

/// A statement written for every server as SQLite takes it: without row locks (`FOR UPDATE`,
/// `SKIP LOCKED`: the transactions that run them hold the database's write lock), and
/// `GREATEST` spelled `MAX` (SQLite's `MAX` of several arguments is the same scalar function).
pub(crate) fn sqlite_text(sql: &str) -> String {
    sql.replace(" FOR UPDATE SKIP LOCKED", "")
        .replace(" FOR UPDATE", "")
        .replace("GREATEST(", "MAX(")
}

/// The statement and its parameters as SQLite takes them (for the sqlx outbox's calls through
/// an executor of the application's).
#[cfg(feature = "outbox")]
fn prepared<'p>(sql: &str, params: &[SqlParam<'p>]) -> Result<(String, Vec<SqlParam<'p>>), Error> {
    Ok((sqlite_text(sql), params.to_vec()))
}

columns_by_try_get!(SqliteRow, i64);
crate::store::columns::record_row::record_columns_by_try_get!(SqliteRow);

/// Opens a transaction that holds the write lock from its start.
const BEGIN_IMMEDIATE: &str = "BEGIN IMMEDIATE";

impl SqlDriver for SqlxSqliteStore {
    type Row = SqliteRow;

    async fn fetch_rows(
        &self,
        sql: &str,
        params: &[SqlParam<'_>],
    ) -> Result<Vec<SqliteRow>, Error> {
        Ok(self.pool().fetch_all(bound(sql, params)).await?)
    }

    async fn execute_counted(&self, sql: &str, params: &[SqlParam<'_>]) -> Result<u64, Error> {
        let done = self.pool().execute(bound(sql, params)).await?;
        Ok(done.rows_affected())
    }

    #[cfg(feature = "outbox")]
    async fn fetch_in_transaction(
        &self,
        statements: &[(&str, &[SqlParam<'_>])],
    ) -> Result<Vec<Vec<SqliteRow>>, Error> {
        let mut tx = self.pool().begin_with(BEGIN_IMMEDIATE).await?;
        let mut results = Vec::with_capacity(statements.len());
        for (sql, params) in statements {
            results.push((&mut *tx).fetch_all(bound(sql, params)).await?);
        }
        tx.commit().await?;
        Ok(results)
    }

    /// SQLite runs `CREATE ... IF NOT EXISTS` statements atomically under its write lock: no
    /// lock of the store's own is needed.
    async fn install_tables(&self, _lock: i64, schema: &str) -> Result<(), Error> {
        let mut tx = self.pool().begin_with(BEGIN_IMMEDIATE).await?;
        (&mut *tx).execute(sqlx::raw_sql(our_sql(schema))).await?;
        tx.commit().await?;
        Ok(())
    }
}

impl SqlHandle for SqlxSqliteHandle {
    type Row = SqliteRow;

    async fn fetch_in(
        &self,
        sql: &'static str,
        params: &[SqlParam<'_>],
    ) -> Result<Vec<SqliteRow>, Error> {
        let mut conn = self.acquire().await?;
        Ok((&mut *conn).fetch_all(bound(sql, params)).await?)
    }

    async fn execute_in(&self, sql: &'static str, params: &[SqlParam<'_>]) -> Result<u64, Error> {
        let mut conn = self.acquire().await?;
        let done = (&mut *conn).execute(bound(sql, params)).await?;
        Ok(done.rows_affected())
    }
}

/// The claim: the abandoned events dead-lettered, then the due ones claimed, in one
/// transaction that holds the write lock (each `UPDATE ... RETURNING` gives its rows).
#[cfg(feature = "outbox")]
async fn claim(
    store: &SqlxSqliteStore,
    dead_letter: &[SqlParam<'_>],
    claim: &[SqlParam<'_>],
) -> Result<[Vec<SqliteRow>; 2], Error> {
    let statements = [
        (outbox_sql::DEAD_LETTER_ABANDONED, dead_letter),
        (outbox_sql::CLAIM, claim),
    ];
    let results = store.fetch_in_transaction(&statements).await?;
    <[Vec<SqliteRow>; 2]>::try_from(results)
        .map_err(|_| Error::Corrupt("a claim returned no rows".into()))
}

// The outbox's and the inbox's calls on an executor of the application's (`sqlx/outbox.rs`).
#[cfg(feature = "outbox")]
crate::sqlx::outbox::outbox_database!(Sqlite, outbox_sql, prepared);

// The admin calls (`row_lock/admin.rs`) on this store.
crate::row_lock::admin::sql_admin!(SqlxSqliteStore, admin_sql);

// The outbox and the inbox (`row_lock/outbox.rs`) on this store.
#[cfg(feature = "outbox")]
crate::row_lock::outbox::sql_outbox_and_inbox!(
    SqlxSqliteStore,
    SqlxSqliteHandle,
    outbox_sql,
    claim
);

// Step-by-step requests (`row_lock/steps.rs`) on this store.
crate::row_lock::steps::sql_steps!(SqlxSqliteStore, SqlxSqliteHandle, steps_sql);

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shared statement with a row lock or `GREATEST` runs on SQLite without them, and
    /// nothing else of it changes.
    #[test]
    fn shared_statements_lose_their_row_locks_and_greatest() {
        for shared in [
            steps_sql::SELECT_PROGRESS,
            steps_sql::SELECT_RECORD,
            steps_sql::SELECT_STEPS,
            steps_sql::SELECT_STEP_AT,
            steps_sql::ANY_STEP,
            steps_sql::SELECT_STATUS,
            steps_sql::TAKE_KEY,
        ] {
            let text = sqlite_text(shared);
            assert!(!text.contains("FOR UPDATE"), "{text}");
            assert!(!text.contains("GREATEST"), "{text}");
            assert_ne!(text, shared, "{shared} had nothing to rewrite");
        }
        assert_eq!(
            sqlite_text("SELECT seq FROM t WHERE a = $1 ORDER BY seq FOR UPDATE SKIP LOCKED"),
            "SELECT seq FROM t WHERE a = $1 ORDER BY seq"
        );
        assert_eq!(
            sqlite_text(steps_sql::INSERT_STEP),
            steps_sql::INSERT_STEP,
            "a statement without row locks is sent as written"
        );
    }
}
