//! How MySQL and MariaDB errors reported through sqlx are classified ([`ErrorKind`]), by their
//! error numbers (their SQLSTATE is often only the general `HY000`).

use crate::error::ErrorKind;

/// MySQL's `ER_LOCK_WAIT_TIMEOUT`: a lock wait past `innodb_lock_wait_timeout` (only the
/// statement is rolled back).
pub(crate) const MYSQL_LOCK_WAIT_TIMEOUT: u16 = 1205;
/// MySQL's `ER_LOCK_DEADLOCK`: InnoDB rolled the whole transaction back.
pub(crate) const MYSQL_DEADLOCK: u16 = 1213;
/// MySQL's `ER_CON_COUNT_ERROR`.
const MYSQL_TOO_MANY_CONNECTIONS: u16 = 1040;
/// MySQL's `ER_SERVER_SHUTDOWN`: the server is shutting down.
const MYSQL_SERVER_SHUTDOWN: u16 = 1053;
/// MariaDB's `ER_CONNECTION_KILLED`: another session ran `KILL` on this connection.
const MYSQL_CONNECTION_KILLED: u16 = 1927;

/// The error number of a MySQL or MariaDB error reported through sqlx.
pub(crate) fn mysql_number(error: &sqlx::Error) -> Option<u16> {
    error
        .as_database_error()
        .and_then(|e| e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
        .map(sqlx::mysql::MySqlDatabaseError::number)
}

/// A lock wait timeout (`1205`), a deadlock (`1213`) or too many connections (`1040`); `None`
/// for any other error, MySQL's or not.
pub(crate) fn kind(error: &sqlx::Error) -> Option<ErrorKind> {
    match mysql_number(error)? {
        MYSQL_LOCK_WAIT_TIMEOUT => Some(ErrorKind::LockTimeout),
        MYSQL_DEADLOCK => Some(ErrorKind::Conflict),
        MYSQL_TOO_MANY_CONNECTIONS => Some(ErrorKind::Busy),
        _ => None,
    }
}

/// Whether the server is shutting down (`1053`) or killed the connection (`1927`).
pub(crate) fn unavailable(error: &sqlx::Error) -> bool {
    matches!(
        mysql_number(error),
        Some(MYSQL_SERVER_SHUTDOWN | MYSQL_CONNECTION_KILLED)
    )
}
