//! How a PostgreSQL store opens a request's transaction, written once for both drivers
//! (tokio-postgres in `postgres`, sqlx in `sqlx_postgres`): the `BEGIN` at the isolation level,
//! with its lock waits bounded. The reservation itself (the decision between reserving,
//! replaying and taking over) is driver-neutral: [`reserve`](super::reserve); each driver runs
//! the three statements of [`pg_sql`](super::pg_sql) through [`ReserveStatements`](super::reserve::ReserveStatements).

use tokio::time::Instant;

pub use super::reserve::Isolation;
// What the tokio-postgres store reaches through this module.
#[cfg(feature = "postgres")]
pub(crate) use super::reserve::{reserve, ReserveStatements, Reserved};

impl Isolation {
    /// `BEGIN` at this level, for transactions that set nothing else (the inbox's own).
    pub(crate) fn begin_statement(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "BEGIN ISOLATION LEVEL READ COMMITTED",
            Isolation::RepeatableRead => "BEGIN ISOLATION LEVEL REPEATABLE READ",
            Isolation::Serializable => "BEGIN ISOLATION LEVEL SERIALIZABLE",
        }
    }

    /// `BEGIN` at this level of a transaction a store opens for itself (the inbox's), marked
    /// with `token` (see `pg_sql::OWN_TRANSACTION_SETTING`). Only an integer is formatted into
    /// it.
    #[cfg(feature = "outbox")]
    pub(crate) fn begin_owned(self, token: u64) -> String {
        format!(
            "{}; SET LOCAL {} = '{token}'",
            self.begin_statement(),
            super::pg_sql::OWN_TRANSACTION_SETTING
        )
    }

    /// Opens a request's transaction at this level, with its lock waits bounded by `deadline`
    /// (`SET LOCAL lock_timeout`, never 0, which would mean "wait forever"). Only an integer is
    /// formatted into it.
    pub(crate) fn begin_request(self, deadline: Instant) -> String {
        let lock_ms = deadline
            .saturating_duration_since(Instant::now())
            .as_millis()
            .max(1);
        format!(
            "{}; SET LOCAL lock_timeout = {lock_ms}",
            self.begin_statement()
        )
    }
}
