//! [`SqlDriver`] on tokio-postgres: [`PostgresStore`] and its [`PostgresHandle`] handle.

use bytes::BytesMut;
use tokio_postgres::row::Row;
use tokio_postgres::types::{IsNull, ToSql, Type};

use crate::error::Error;
use crate::postgres::admin_sql;
use crate::row_lock::driver::{columns_by_try_get, SqlDriver, SqlParam};
use crate::row_lock::driver::{finish, Finish, Own, SqlHandle, SqlTransactions};
use crate::store::tokio_postgres::statements::{typed, Preparation};
use crate::store::tokio_postgres::PostgresStore;
use crate::store::tokio_postgres::{migrate::install_schema, Executor as _, PostgresHandle};

// The admin calls (`row_lock/admin.rs`) on this store.
crate::row_lock::admin::sql_admin!(crate::store::tokio_postgres::PostgresStore, admin_sql);

type BoxedError = Box<dyn std::error::Error + Sync + Send>;

/// Each parameter is sent as the value it holds (its type checked against the statement's).
impl ToSql for SqlParam<'_> {
    fn to_sql(&self, ty: &Type, out: &mut BytesMut) -> Result<IsNull, BoxedError> {
        match self {
            SqlParam::Text(value) => value.to_sql(ty, out),
            SqlParam::OptionalText(value) => value.to_sql(ty, out),
            SqlParam::BigInt(value) => value.to_sql(ty, out),
            SqlParam::Int(value) => value.to_sql(ty, out),
            SqlParam::Bytes(value) => value.to_sql(ty, out),
        }
    }

    fn accepts(_: &Type) -> bool {
        // Checked per value in `to_sql_checked`, which is what the driver calls.
        true
    }

    fn to_sql_checked(&self, ty: &Type, out: &mut BytesMut) -> Result<IsNull, BoxedError> {
        match self {
            SqlParam::Text(value) => value.to_sql_checked(ty, out),
            SqlParam::OptionalText(value) => value.to_sql_checked(ty, out),
            SqlParam::BigInt(value) => value.to_sql_checked(ty, out),
            SqlParam::Int(value) => value.to_sql_checked(ty, out),
            SqlParam::Bytes(value) => value.to_sql_checked(ty, out),
        }
    }
}

/// The parameters as tokio-postgres takes them.
pub(crate) fn as_sql<'a>(params: &'a [SqlParam<'_>]) -> Vec<&'a (dyn ToSql + Sync)> {
    params.iter().map(|param| param as _).collect()
}

columns_by_try_get!(Row, i32);
crate::store::columns::record_row::record_columns_by_try_get!(tokio_postgres::Row);

impl SqlDriver for PostgresStore {
    type Row = Row;

    /// Prepared (and closed) on the connection, or unnamed in one message: outside a
    /// transaction, a transaction pooler may run a statement prepared in one round trip on
    /// another server connection than the one that prepared it.
    async fn fetch_rows(&self, sql: &str, params: &[SqlParam<'_>]) -> Result<Vec<Row>, Error> {
        let client = self.client().await?;
        Ok(match self.preparation() {
            Preparation::Cached => client.query(sql, &as_sql(params)).await?,
            Preparation::Unnamed => client.query_typed(sql, &typed(params)).await?,
        })
    }

    async fn execute_counted(&self, sql: &str, params: &[SqlParam<'_>]) -> Result<u64, Error> {
        let client = self.client().await?;
        Ok(match self.preparation() {
            Preparation::Cached => client.execute(sql, &as_sql(params)).await?,
            Preparation::Unnamed => client.execute_typed(sql, &typed(params)).await?,
        })
    }

    #[cfg(feature = "outbox")]
    async fn fetch_in_transaction(
        &self,
        statements: &[(&str, &[SqlParam<'_>])],
    ) -> Result<Vec<Vec<Row>>, Error> {
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        let mut results = Vec::with_capacity(statements.len());
        for (sql, params) in statements {
            results.push(match self.preparation() {
                Preparation::Cached => tx.query(*sql, &as_sql(params)).await?,
                Preparation::Unnamed => tx.query_typed(sql, &typed(params)).await?,
            });
        }
        tx.commit().await?;
        Ok(results)
    }

    async fn install_tables(&self, lock: i64, schema: &str) -> Result<(), Error> {
        install_schema(self, lock, schema, &[]).await
    }
}

impl SqlTransactions for PostgresStore {
    type Handle = PostgresHandle;

    fn conflict_retries(&self) -> u32 {
        self.serialization_retries()
    }

    async fn in_own_transaction<T, B, Fut>(&self, own: Own, body: B) -> Result<T, Error>
    where
        T: Send,
        B: FnOnce(PostgresHandle) -> Fut + Send,
        Fut: std::future::Future<Output = Result<(T, Finish), Error>> + Send,
    {
        let transaction = self.begin_owned(own).await?;
        let outcome = body(transaction.handle()).await;
        finish(transaction, outcome, |t| t.commit(), |t| t.rollback()).await
    }
}

impl SqlHandle for PostgresHandle {
    type Row = Row;

    async fn fetch_in(
        &self,
        sql: &'static str,
        params: &[SqlParam<'_>],
    ) -> Result<Vec<Row>, Error> {
        let client = self.client().await?;
        client.query_shared(sql, &typed(params)).await
    }

    async fn execute_in(&self, sql: &'static str, params: &[SqlParam<'_>]) -> Result<u64, Error> {
        let client = self.client().await?;
        client.execute_typed_statement(sql, &typed(params)).await
    }
}

use crate::postgres::steps_sql as pg_steps_sql;

// Step-by-step requests (`row_lock/steps.rs`) on this store.
crate::row_lock::steps::sql_steps!(
    crate::store::tokio_postgres::PostgresStore,
    crate::store::tokio_postgres::PostgresHandle,
    pg_steps_sql
);
