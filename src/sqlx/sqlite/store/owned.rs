//! The store's own transactions on SQLite (the inbox's, the steps'; see `sqlx::store::owned`):
//! as a request's, with the write lock taken at `BEGIN` and the savepoint that marks the
//! transaction checked before `COMMIT`.

use futures_util::future::BoxFuture;
use sqlx::sqlite::SqliteConnection;
use sqlx::Executor as _;

use super::{sql, SqliteDialect};
use crate::error::Error;
use crate::row_lock::reserve::Isolation;
use crate::sqlx::store::OwnedDialect;

/// How long a transaction of the store's own waits for the write lock: sqlx's default busy
/// timeout.
const OWN_BUSY_WAIT_MS: u64 = 5000;

impl OwnedDialect for SqliteDialect {
    /// The token is not needed: the savepoint marks the transaction.
    fn begin_owned(_isolation: Isolation, _token: u64) -> String {
        sql::begin(OWN_BUSY_WAIT_MS)
    }

    /// Whether the savepoint `BEGIN` opened still exists: SQLite rolled nothing back.
    fn is_own_transaction(
        conn: &mut SqliteConnection,
        _token: u64,
    ) -> BoxFuture<'_, Result<bool, Error>> {
        Box::pin(async move { Ok(conn.execute(sql::CHECK_OPEN).await.is_ok()) })
    }
}
