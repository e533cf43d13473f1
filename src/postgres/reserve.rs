//! How a PostgreSQL store opens a request's transaction, written once for both drivers
//! (tokio-postgres in `tokio_postgres`, sqlx in `sqlx_postgres`): the `BEGIN` at the isolation level,
//! with its lock waits bounded. The reservation itself (the decision between reserving,
//! replaying and taking over) is driver-neutral: [`reserve`](crate::row_lock::reserve); each driver runs
//! the three statements of [`store_sql`](super::store_sql) through [`ReserveStatements`](crate::row_lock::reserve::ReserveStatements).

use std::time::Duration;

use tokio::time::Instant;

use crate::row_lock::reserve::Isolation;
// What the tokio-postgres store reaches through this module.
#[cfg(feature = "tokio-postgres")]
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
    /// with `token` (see `store_sql::OWN_TRANSACTION_SETTING`). Only an integer is formatted into
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
    /// is the shortest wait. Only integers are formatted into it.
    ///
    /// Under a `key_row_wait`, the table's lock (`ROW EXCLUSIVE`, the one the reservation's
    /// insert takes) is taken first, its wait bounded by `deadline`: only the wait on the key's
    /// row is then bounded by `key_row_wait`. Another session's lock on the whole table (a
    /// `LOCK TABLE`, a migration) is no request of the same key in flight: past the deadline
    /// it fails this statement (SQLSTATE `55P03`), which the stores answer `503`, not `409`.
    pub(crate) fn begin_request(self, deadline: Instant, key_row_wait: Option<Duration>) -> String {
        let left = deadline.saturating_duration_since(Instant::now());
        match key_row_wait {
            None => format!(
                "{}; SET LOCAL lock_timeout = {}",
                self.begin_statement(),
                lock_timeout_ms(left)
            ),
            Some(key_row_wait) => format!(
                "{}; SET LOCAL lock_timeout = {}; {TAKE_TABLE_LOCK}; SET LOCAL lock_timeout = {}",
                self.begin_statement(),
                lock_timeout_ms(left),
                lock_timeout_ms(key_row_wait)
            ),
        }
    }

    /// How many statements [`begin_request`](Self::begin_request) sends: each answers a
    /// command result before the reservation's insert runs.
    #[cfg(feature = "sqlx-postgres")]
    pub(crate) fn begin_request_statements(key_row_wait: Option<Duration>) -> usize {
        match key_row_wait {
            None => 2,
            Some(_) => 4,
        }
    }
}

/// The table lock the reservation's insert takes, taken first under an in-flight policy (see
/// [`Isolation::begin_request`]). The table is unqualified, as in every statement of the stores.
const TAKE_TABLE_LOCK: &str = "LOCK TABLE idempotency_records IN ROW EXCLUSIVE MODE";

/// What follows a reservation made under a `key_row_wait`: the transaction's lock waits bounded
/// by `deadline` again, for the handler's own statements.
pub(crate) fn restore_lock_timeout(deadline: Instant) -> String {
    let wait = deadline.saturating_duration_since(Instant::now());
    format!("SET LOCAL lock_timeout = {}", lock_timeout_ms(wait))
}

/// How long past a request's deadline (its lock timeout) a PostgreSQL store waits for the
/// server's answers to the layer's own statements (the reservation, the commit) before it takes
/// the server for gone: the server ends every lock wait by the deadline itself
/// (`lock_timeout`), so an answer still missing this much later means a server (or a network)
/// that stopped answering without closing the connection. The connection is then closed and
/// the request answered `503` with `Retry-After`.
pub(crate) const ANSWER_MARGIN: Duration = Duration::from_millis(500);

/// When the server's answers to a reservation are due: at `deadline`, or, under an in-flight
/// policy whose `key_row_wait` outlasts it, once that wait is over.
#[cfg(feature = "tokio-postgres")]
pub(crate) fn answers_due(deadline: Instant, key_row_wait: Option<Duration>) -> Instant {
    match key_row_wait {
        Some(wait) => deadline.max(Instant::now() + wait),
        None => deadline,
    }
}

/// `work` (statements of the layer's own on one connection), given up at `deadline` plus
/// [`ANSWER_MARGIN`]: [`Error::Unavailable`](crate::Error::Unavailable) then. The caller
/// closes the connection, whose state is unknown.
#[cfg(feature = "tokio-postgres")]
pub(crate) async fn answered_by<T>(
    deadline: Instant,
    work: impl std::future::Future<Output = Result<T, crate::Error>>,
) -> Result<T, crate::Error> {
    match tokio::time::timeout_at(deadline + ANSWER_MARGIN, work).await {
        Ok(outcome) => outcome,
        Err(_) => Err(crate::Error::Unavailable(format!(
            "the database did not answer within the lock timeout and {} ms",
            ANSWER_MARGIN.as_millis()
        ))),
    }
}

/// `wait` in milliseconds for `lock_timeout`: at least 1 (0 disables the timeout).
fn lock_timeout_ms(wait: Duration) -> u128 {
    wait.as_millis().max(1)
}
