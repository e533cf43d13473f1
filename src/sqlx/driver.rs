//! What both sqlx databases share of the driver seam ([`crate::row_lock::driver`]): binding
//! the shared statements' parameters, and the store's own transactions.

use std::future::Future;

use crate::error::Error;
use crate::row_lock::driver::SqlParam;
use crate::row_lock::driver::{finish, Finish, Own, SqlDriver, SqlHandle, SqlTransactions};

/// `query` with `params` bound in order, on either sqlx database.
pub(crate) fn sqlx_bind<'q, DB>(
    query: sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments<'q>>,
    params: &[SqlParam<'q>],
) -> sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments<'q>>
where
    DB: sqlx::Database,
    &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    Option<&'q str>: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    i32: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
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
