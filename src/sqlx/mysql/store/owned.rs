//! The store's own transactions on MySQL and MariaDB (the inbox's; see `sqlx::store::owned`).

use futures_util::future::BoxFuture;
use sqlx::mysql::MySqlConnection;

use super::{sql, MySqlDialect};
use crate::error::Error;
use crate::row_lock::reserve::Isolation;
use crate::sqlx::store::OwnedDialect;

/// How long a statement of the store's own transaction waits for a row lock or a metadata lock
/// (`innodb_lock_wait_timeout` and `lock_wait_timeout`, whole seconds: InnoDB's default).
const OWN_LOCK_WAIT_SECS: u64 = 50;

impl OwnedDialect for MySqlDialect {
    /// As a request's transaction (`autocommit` off until its end, the session restored after
    /// it), with InnoDB's default lock wait. The token is not needed: see
    /// [`is_own_transaction`](Self::is_own_transaction).
    fn begin_owned(isolation: Isolation, _token: u64) -> String {
        sql::begin_request(isolation, OWN_LOCK_WAIT_SECS, OWN_LOCK_WAIT_SECS)
    }

    /// Always: the handle's connection refuses `COMMIT`, `ROLLBACK` and the statements that
    /// commit on their own, a failed statement leaves an InnoDB transaction open, and a
    /// deadlock (which rolls it back) is seen by the handle and stops the commit before this.
    fn is_own_transaction(
        _conn: &mut MySqlConnection,
        _token: u64,
    ) -> BoxFuture<'_, Result<bool, Error>> {
        Box::pin(async { Ok(true) })
    }
}
