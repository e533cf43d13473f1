//! How sqlx errors are classified ([`ErrorKind`]), on either database: the SQLSTATEs here,
//! PostgreSQL's failover codes in `src/postgres/failover.rs`, MySQL's error numbers in
//! `src/sqlx/mysql/error.rs`. The answer does not depend on which drivers the build has: a
//! MySQL error is never read as a PostgreSQL one.

use crate::error::{DriverError, ErrorKind};

/// A broken connection or a server that ended it is [`ErrorKind::Unavailable`]; a pool that
/// had no free connection in time is [`ErrorKind::Busy`]; then the SQLSTATE: a serialization
/// failure or a deadlock (`40001`, `40P01`; MySQL reports a deadlock as `40001` too) is a
/// [`ErrorKind::Conflict`], a lock wait past `lock_timeout` (`55P03`) a
/// [`ErrorKind::LockTimeout`], too many connections (`53300`) [`ErrorKind::Busy`]; on MySQL
/// and MariaDB the same by error number.
pub(crate) fn kind(error: &sqlx::Error) -> ErrorKind {
    if sqlx_unavailable(error) {
        return ErrorKind::Unavailable;
    }
    if matches!(error, sqlx::Error::PoolTimedOut) {
        return ErrorKind::Busy;
    }
    #[cfg(feature = "sqlx-mysql")]
    if let Some(kind) = super::mysql::error::kind(error) {
        return kind;
    }
    #[cfg(feature = "sqlx-sqlite")]
    if let Some(kind) = super::sqlite::error::kind(error) {
        return kind;
    }
    match sqlx_code(error).as_deref() {
        Some("40001" | "40P01") => ErrorKind::Conflict,
        Some("55P03") => ErrorKind::LockTimeout,
        Some("53300") => ErrorKind::Busy,
        _ => ErrorKind::Other,
    }
}

impl DriverError for sqlx::Error {
    fn classify(&self) -> ErrorKind {
        kind(self)
    }
}

/// The SQLSTATE of a database error reported through sqlx.
pub(crate) fn sqlx_code(error: &sqlx::Error) -> Option<std::borrow::Cow<'_, str>> {
    error.as_database_error().and_then(|e| e.code())
}

/// Whether a sqlx error means that the database went away or cannot serve the transaction,
/// on either database: the connection broke, or the server ended it (on PostgreSQL the codes
/// of [`failover`](crate::postgres::failover), on MySQL the numbers of
/// `src/sqlx/mysql/error.rs`).
pub(crate) fn sqlx_unavailable(error: &sqlx::Error) -> bool {
    if matches!(error, sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed) {
        return true;
    }
    #[cfg(feature = "sqlx-postgres")]
    if crate::postgres::failover::sqlx_unavailable(error) {
        return true;
    }
    #[cfg(feature = "sqlx-mysql")]
    if super::mysql::error::unavailable(error) {
        return true;
    }
    false
}
