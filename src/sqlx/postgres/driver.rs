//! [`SqlDriver`] on sqlx: [`SqlxPostgresStore`] and its [`SqlxPostgresHandle`] handle. sqlx
//! prepares and caches each statement on its connection, unless the store keeps no statement
//! prepared (`with_unnamed_statements`, behind a transaction pooler): then each goes unnamed,
//! those that run in autocommit in a transaction of their own (sqlx prepares a statement with
//! bind parameters in a round trip of its own, and a pooler may hand the next to another
//! server connection, which has no such statement).

use sqlx::postgres::{PgArguments, PgRow, Postgres};
use sqlx::query::Query;
// The `Executor` methods keep these futures provably `Send` (see the store's `reservation.rs`).
use sqlx::{Executor as _, Row as _, SqlSafeStr};

use crate::error::Error;
use crate::postgres::admin_sql;
use crate::row_lock::driver::SqlHandle;
use crate::row_lock::driver::{columns_by_try_get, SqlDriver, SqlParam};
use crate::sqlx::driver::{our_sql, sqlx_bind};
use crate::store::sqlx_postgres::SqlxPostgresHandle;
use crate::store::sqlx_postgres::SqlxPostgresStore;

// The admin calls (`row_lock/admin.rs`) on this store.
crate::row_lock::admin::sql_admin!(crate::store::sqlx_postgres::SqlxPostgresStore, admin_sql);

/// `sql` with `params` bound in order.
pub(crate) fn bound<'q>(
    sql: impl SqlSafeStr,
    params: &[SqlParam<'_>],
) -> Query<'q, Postgres, PgArguments> {
    sqlx_bind(sqlx::query(sql), params)
}

columns_by_try_get!(PgRow, i32);
crate::store::columns::record_row::record_columns_by_try_get!(PgRow);

impl SqlDriver for SqlxPostgresStore {
    type Row = PgRow;

    async fn fetch_rows(&self, sql: &str, params: &[SqlParam<'_>]) -> Result<Vec<PgRow>, Error> {
        if !self.shared.unnamed_statements {
            return Ok(self.pool().fetch_all(bound(our_sql(sql), params)).await?);
        }
        let mut tx = self.pool().begin().await?;
        let rows = (&mut *tx)
            .fetch_all(bound(our_sql(sql), params).persistent(false))
            .await?;
        tx.commit().await?;
        Ok(rows)
    }

    async fn execute_counted(&self, sql: &str, params: &[SqlParam<'_>]) -> Result<u64, Error> {
        if !self.shared.unnamed_statements {
            let done = self.pool().execute(bound(our_sql(sql), params)).await?;
            return Ok(done.rows_affected());
        }
        let mut tx = self.pool().begin().await?;
        let done = (&mut *tx)
            .execute(bound(our_sql(sql), params).persistent(false))
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }

    #[cfg(feature = "outbox")]
    async fn fetch_in_transaction(
        &self,
        statements: &[(&str, &[SqlParam<'_>])],
    ) -> Result<Vec<Vec<PgRow>>, Error> {
        let mut tx = self.pool().begin().await?;
        let persistent = !self.shared.unnamed_statements;
        let mut results = Vec::with_capacity(statements.len());
        for (sql, params) in statements {
            let statement = bound(our_sql(*sql), params).persistent(persistent);
            results.push((&mut *tx).fetch_all(statement).await?);
        }
        tx.commit().await?;
        Ok(results)
    }

    async fn install_tables(&self, lock: i64, schema: &str) -> Result<(), Error> {
        self.install_schema(lock, schema, &[]).await
    }
}

impl SqlHandle for SqlxPostgresHandle {
    type Row = PgRow;

    async fn fetch_in(
        &self,
        sql: &'static str,
        params: &[SqlParam<'_>],
    ) -> Result<Vec<PgRow>, Error> {
        let mut conn = self.acquire().await?;
        Ok((&mut *conn).fetch_all(bound(sql, params)).await?)
    }

    async fn execute_in(&self, sql: &'static str, params: &[SqlParam<'_>]) -> Result<u64, Error> {
        let mut conn = self.acquire().await?;
        let done = (&mut *conn).execute(bound(sql, params)).await?;
        Ok(done.rows_affected())
    }
}

/// The statement and its parameters as PostgreSQL takes them: as written (for
/// `src/sqlx/outbox.rs`, which sends MySQL's through `positional`).
#[cfg(feature = "outbox")]
fn numbered<'p>(sql: &str, params: &[SqlParam<'p>]) -> Result<(String, Vec<SqlParam<'p>>), Error> {
    Ok((sql.to_owned(), params.to_vec()))
}

#[cfg(feature = "outbox")]
use crate::postgres::outbox_sql as pg_outbox_sql;

// The outbox's and the inbox's calls on an executor of the application's (`sqlx/outbox.rs`).
#[cfg(feature = "outbox")]
crate::sqlx::outbox::outbox_database!(Postgres, pg_outbox_sql, numbered);

// The outbox and the inbox (`row_lock/outbox.rs`) on this store.
#[cfg(feature = "outbox")]
crate::row_lock::outbox::sql_outbox_and_inbox!(
    crate::store::sqlx_postgres::SqlxPostgresStore,
    crate::store::sqlx_postgres::SqlxPostgresHandle,
    pg_outbox_sql,
    crate::row_lock::outbox::claim_returning
);

use crate::postgres::steps_sql as pg_steps_sql;

// Step-by-step requests (`row_lock/steps.rs`) on this store.
crate::row_lock::steps::sql_steps!(
    crate::store::sqlx_postgres::SqlxPostgresStore,
    crate::store::sqlx_postgres::SqlxPostgresHandle,
    pg_steps_sql
);
