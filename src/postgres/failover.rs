//! What a PostgreSQL failover looks like to the stores (both drivers): the errors that mean
//! the server went away, is shutting down or starting, or can no longer take writes, so that
//! the layer answers `503` with `Retry-After` whatever the handler made of it (a handle's
//! statement that got one is kept as [`Observed::Unavailable`](crate::row_lock::tx_state::Observed)).

/// SQLSTATEs of a server that cannot serve the transaction: `25006` (read-only: a standby, or
/// an old primary fenced with `default_transaction_read_only`), `57P01` (admin shutdown: a
/// fast shutdown or `pg_terminate_backend`), `57P02` (crash shutdown: another backend
/// crashed), `57P03` (cannot connect now: starting up, or promoting).
const UNAVAILABLE_CODES: [&str; 4] = ["25006", "57P01", "57P02", "57P03"];

/// Whether `code` (a SQLSTATE) says that the server cannot serve the transaction: one of
/// [`UNAVAILABLE_CODES`] or class `08` (connection exception).
pub(crate) fn is_unavailable_code(code: &str) -> bool {
    UNAVAILABLE_CODES.contains(&code) || code.starts_with("08")
}

/// A tokio-postgres error of a failover: the connection is closed or broke (an I/O error,
/// connect refused, no host accepting writes), or the server answered an unavailable code.
#[cfg(feature = "tokio-postgres")]
pub(crate) fn postgres_unavailable(error: &tokio_postgres::Error) -> bool {
    if error.is_closed() {
        return true;
    }
    match error.code() {
        Some(code) => is_unavailable_code(code.code()),
        // Connecting and reading report the socket's error as the cause; so does a
        // `target_session_attrs=read-write` connect that found no host taking writes.
        None => std::error::Error::source(error).is_some_and(|cause| cause.is::<std::io::Error>()),
    }
}

/// The same through sqlx: a PostgreSQL server's unavailable code (a broken connection, on
/// either database, is [`crate::sqlx::error::sqlx_unavailable`]'s).
#[cfg(feature = "sqlx-postgres")]
pub(crate) fn sqlx_unavailable(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|e| e.try_downcast_ref::<sqlx::postgres::PgDatabaseError>())
        .is_some_and(|e| is_unavailable_code(e.code()))
}

#[cfg(test)]
mod tests {
    use super::is_unavailable_code;

    #[test]
    fn failover_codes_are_unavailable_and_others_are_not() {
        for code in [
            "25006", "57P01", "57P02", "57P03", "08000", "08003", "08006", "08001",
        ] {
            assert!(is_unavailable_code(code), "{code}");
        }
        // A conflict, a lock timeout, a constraint, a syntax error, too many connections.
        for code in [
            "40001", "40P01", "55P03", "23505", "42601", "53300", "57014",
        ] {
            assert!(!is_unavailable_code(code), "{code}");
        }
    }
}
