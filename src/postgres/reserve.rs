//! How a PostgreSQL store opens a request's transaction, written once for both drivers
//! (tokio-postgres in `postgres`, sqlx in `sqlx_postgres`): the `BEGIN` at the isolation level,
//! with its lock waits bounded. The reservation itself (the decision between reserving,
//! replaying and taking over) is driver-neutral: [`reserve`](crate::row_lock::reserve); each driver runs
//! the three statements of [`store_sql`](super::store_sql) through [`ReserveStatements`](crate::row_lock::reserve::ReserveStatements).

use std::time::Duration;

use tokio::time::Instant;

pub use crate::row_lock::replay_check::ReplayCheck;
pub use crate::row_lock::reserve::Isolation;
// What the tokio-postgres store reaches through this module.
#[cfg(feature = "postgres")]
pub(crate) use crate::row_lock::reserve::{reserve, ReserveStatements, Reserved};

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
    pub(crate) fn begin_owned(self, token: u64) -> String {
        format!(
            "{}; SET LOCAL {} = '{token}'",
            self.begin_statement(),
            super::store_sql::OWN_TRANSACTION_SETTING
        )
    }

    /// Opens a request's transaction at this level, with its lock waits bounded by `deadline`,
    /// or, while reserving the key, by `key_row_wait` (see
    /// [`key_row_wait`](crate::row_lock::reserve::key_row_wait); then [`restore_lock_timeout`] follows the
    /// reservation). `SET LOCAL lock_timeout`, never 0, which would mean "wait forever": 1 ms
    /// is the shortest wait. Only an integer is formatted into it.
    pub(crate) fn begin_request(self, deadline: Instant, key_row_wait: Option<Duration>) -> String {
        let wait =
            key_row_wait.unwrap_or_else(|| deadline.saturating_duration_since(Instant::now()));
        format!(
            "{}; SET LOCAL lock_timeout = {}",
            self.begin_statement(),
            lock_timeout_ms(wait)
        )
    }
}

/// What follows a reservation made under a `key_row_wait`: the transaction's lock waits bounded
/// by `deadline` again, for the handler's own statements.
pub(crate) fn restore_lock_timeout(deadline: Instant) -> String {
    let wait = deadline.saturating_duration_since(Instant::now());
    format!("SET LOCAL lock_timeout = {}", lock_timeout_ms(wait))
}

/// `wait` in milliseconds for `lock_timeout`: at least 1 (0 disables the timeout).
fn lock_timeout_ms(wait: Duration) -> u128 {
    wait.as_millis().max(1)
}
