//! What the sqlx databases share of the driver seam ([`crate::row_lock::driver`]): binding
//! the shared statements' parameters, and the store's own transactions.

use std::future::Future;

use crate::error::Error;
use crate::row_lock::driver::SqlParam;
use crate::row_lock::driver::{finish, Finish, Own, SqlDriver, SqlHandle, SqlTransactions};

/// SQL the store wrote, as sqlx takes a string that is not a `&'static str` (its `SqlSafeStr`,
/// a check against SQL built from input): the store's own statements, with nothing formatted
/// into them but what the store chooses (statement texts, table and statement names, isolation
/// levels, timeouts) and values it wrote itself: integers, and on PostgreSQL the quoted
/// constants of `postgres/store/literal.rs`, whose module docs say why their quoting is safe.
/// Never a handler's SQL (the handler passed it to sqlx itself) nor a request's input.
pub(crate) fn our_sql<T>(sql: T) -> sqlx::AssertSqlSafe<T>
where
    sqlx::AssertSqlSafe<T>: sqlx::SqlSafeStr,
{
    sqlx::AssertSqlSafe(sql)
}

/// `query` with `params` bound in order, on either sqlx database.
pub(crate) fn sqlx_bind<'q, 'p, DB>(
    query: sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments>,
    params: &[SqlParam<'p>],
) -> sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments>
where
    DB: sqlx::Database,
    &'p str: sqlx::Encode<'p, DB> + sqlx::Type<DB>,
    Option<&'p str>: sqlx::Encode<'p, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'p, DB> + sqlx::Type<DB>,
    i32: sqlx::Encode<'p, DB> + sqlx::Type<DB>,
    &'p [u8]: sqlx::Encode<'p, DB> + sqlx::Type<DB>,
{
    params.iter().fold(query, |query, param| match *param {
        SqlParam::Text(value) => query.bind(value),
        SqlParam::OptionalText(value) => query.bind(value),
        SqlParam::BigInt(value) => query.bind(value),
        SqlParam::Int(value) => query.bind(value),
        SqlParam::Bytes(value) => query.bind(value),
    })
}

/// The store's own transactions on either sqlx database (`sqlx::store::owned`).
impl<D> SqlTransactions for crate::sqlx::store::SqlxStore<D>
where
    D: crate::sqlx::store::OwnedDialect,
    Self: SqlDriver,
    crate::sqlx::store::SqlxHandle<D>: SqlHandle<Row = <Self as SqlDriver>::Row>,
{
    type Handle = crate::sqlx::store::SqlxHandle<D>;

    fn conflict_retries(&self) -> u32 {
        self.shared.conflict_retries
    }

    async fn in_own_transaction<T, B, Fut>(&self, own: Own, body: B) -> Result<T, Error>
    where
        T: Send,
        B: FnOnce(Self::Handle) -> Fut + Send,
        Fut: Future<Output = Result<(T, Finish), Error>> + Send,
    {
        let transaction = self.begin_owned(own).await?;
        let outcome = body(transaction.handle()).await;
        finish(transaction, outcome, |t| t.commit(), |t| t.rollback()).await
    }
}
