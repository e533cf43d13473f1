//! How SQLite's errors are classified ([`ErrorKind`]).

use crate::error::{DriverError, ErrorKind};

/// A busy or locked database, or a full disk, is [`ErrorKind::Busy`]; anything else is
/// [`ErrorKind::Other`].
pub(crate) fn kind(error: &rusqlite::Error) -> ErrorKind {
    match error {
        // A full disk passes once space is freed: the same key then runs afresh.
        rusqlite::Error::SqliteFailure(e, _)
            if matches!(
                e.code,
                rusqlite::ErrorCode::DatabaseBusy
                    | rusqlite::ErrorCode::DatabaseLocked
                    | rusqlite::ErrorCode::DiskFull
            ) =>
        {
            ErrorKind::Busy
        }
        _ => ErrorKind::Other,
    }
}

impl DriverError for rusqlite::Error {
    fn classify(&self) -> ErrorKind {
        kind(self)
    }
}
