//! [`SqlDriver`] on sqlx's SQLite driver: [`SqlxSqliteStore`] and its [`SqlxSqliteHandle`]
//! handle. SQLite takes the shared statements' `$n` parameters as written. A transaction of
//! the store's takes the write lock at its start (`BEGIN IMMEDIATE`): one that began as a
//! reader could not become a writer once another had committed.

use sqlx::query::Query;
use sqlx::sqlite::{Sqlite, SqliteArguments, SqliteRow};
// The `Executor` methods keep these futures provably `Send` (see the store's `reservation.rs`).
use sqlx::{Executor as _, Row as _, SqlSafeStr};

use crate::error::Error;
use crate::row_lock::driver::SqlHandle;
use crate::row_lock::driver::{columns_by_try_get, SqlDriver, SqlParam};
use crate::sqlx::driver::{our_sql, sqlx_bind};
use crate::store::sqlx_sqlite::{SqlxSqliteHandle, SqlxSqliteStore};

/// `sql` with `params` bound in order.
fn bound<'q>(sql: impl SqlSafeStr, params: &[SqlParam<'_>]) -> Query<'q, Sqlite, SqliteArguments> {
    sqlx_bind(sqlx::query(sql), params)
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
        Ok(self.pool().fetch_all(bound(our_sql(sql), params)).await?)
    }

    async fn execute_counted(&self, sql: &str, params: &[SqlParam<'_>]) -> Result<u64, Error> {
        let done = self.pool().execute(bound(our_sql(sql), params)).await?;
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
            results.push((&mut *tx).fetch_all(bound(our_sql(*sql), params)).await?);
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
