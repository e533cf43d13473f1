//! The store's own transactions on PostgreSQL (the inbox's; see `sqlx::store::owned`): marked
//! with a `SET LOCAL` token, checked before `COMMIT`.

use futures_util::future::BoxFuture;
// The `Executor` methods keep these futures provably `Send` (see `sqlx::store::reservation`).
use sqlx::postgres::PgConnection;
use sqlx::Executor as _;
use sqlx::Row as _;

use super::PgDialect;
use crate::error::Error;
use crate::postgres::store_sql::IS_OWN_TRANSACTION;
use crate::row_lock::reserve::Isolation;
use crate::sqlx::store::OwnedDialect;

impl OwnedDialect for PgDialect {
    fn begin_owned(isolation: Isolation, token: u64) -> String {
        isolation.begin_owned(token)
    }

    fn is_own_transaction(
        conn: &mut PgConnection,
        token: u64,
    ) -> BoxFuture<'_, Result<bool, Error>> {
        Box::pin(async move {
            let token = token.to_string();
            let check = sqlx::query(IS_OWN_TRANSACTION).bind(token.as_str());
            Ok(conn.fetch_one(check).await?.try_get(0)?)
        })
    }
}
