//! How tokio-postgres errors are classified ([`ErrorKind`]) and displayed.

use tokio_postgres::error::SqlState;

use crate::error::{DriverError, ErrorKind};
use crate::postgres::failover::postgres_unavailable;

/// A failover ([`postgres_unavailable`]) is [`ErrorKind::Unavailable`]; a serialization
/// failure or a deadlock (the transaction was rolled back: a retry may well succeed) is a
/// [`ErrorKind::Conflict`]; a lock wait past `lock_timeout` is [`ErrorKind::LockTimeout`]; too
/// many connections is [`ErrorKind::Busy`].
pub(crate) fn kind(error: &tokio_postgres::Error) -> ErrorKind {
    if postgres_unavailable(error) {
        return ErrorKind::Unavailable;
    }
    match error.code() {
        Some(code)
            if *code == SqlState::T_R_SERIALIZATION_FAILURE
                || *code == SqlState::T_R_DEADLOCK_DETECTED =>
        {
            ErrorKind::Conflict
        }
        Some(code) if *code == SqlState::LOCK_NOT_AVAILABLE => ErrorKind::LockTimeout,
        Some(code) if *code == SqlState::TOO_MANY_CONNECTIONS => ErrorKind::Busy,
        _ => ErrorKind::Other,
    }
}

/// tokio-postgres displays only the kind ("db error"); the server's message is its source.
/// Logs print an error's `Display`, so it carries both.
pub(crate) fn detail(error: &tokio_postgres::Error) -> String {
    match std::error::Error::source(error) {
        Some(cause) => format!("{error}: {cause}"),
        None => error.to_string(),
    }
}

impl DriverError for tokio_postgres::Error {
    fn classify(&self) -> ErrorKind {
        kind(self)
    }

    fn detail(&self) -> String {
        detail(self)
    }
}
