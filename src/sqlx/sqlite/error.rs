//! How SQLite errors reported through sqlx are classified ([`ErrorKind`]), by their result
//! codes (sqlx reports the extended code; its low byte is the primary one).

use crate::error::ErrorKind;

/// `SQLITE_BUSY`: another connection holds the lock this one needs, past the busy timeout.
const SQLITE_BUSY: i64 = 5;
/// `SQLITE_LOCKED`: a conflict inside one connection or a shared cache.
const SQLITE_LOCKED: i64 = 6;
/// `SQLITE_FULL`: the disk (or the database's size limit) is full.
const SQLITE_FULL: i64 = 13;

/// The primary result code of a SQLite error reported through sqlx.
pub(crate) fn sqlite_code(error: &sqlx::Error) -> Option<i64> {
    let error = error
        .as_database_error()?
        .try_downcast_ref::<sqlx::sqlite::SqliteError>()?;
    let code = sqlx::error::DatabaseError::code(error)?;
    code.parse::<i64>().ok().map(|code| code & 0xff)
}

/// A lock not taken within the busy timeout (`SQLITE_BUSY`, `SQLITE_LOCKED`) or a full disk
/// is [`ErrorKind::Busy`]: retry later; `None` for any other error, SQLite's or not.
pub(crate) fn kind(error: &sqlx::Error) -> Option<ErrorKind> {
    match sqlite_code(error)? {
        SQLITE_BUSY | SQLITE_LOCKED | SQLITE_FULL => Some(ErrorKind::Busy),
        _ => None,
    }
}
