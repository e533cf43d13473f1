//! How a PostgreSQL store reserves a key, written once for both drivers (tokio-postgres in
//! `postgres`, sqlx in `sqlx_postgres`): the isolation level and the `BEGIN` that opens a
//! request's transaction, and the decision between reserving, replaying and taking over. Each
//! driver runs the three statements of [`pg_sql`](super::pg_sql) through
//! [`ReserveStatements`].

use std::future::Future;

use tokio::time::Instant;

use super::StoredRecord;
use crate::error::Error;

/// The isolation level of the request transactions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Isolation {
    /// `READ COMMITTED`, PostgreSQL's default: what the reservation needs, and never a
    /// serialization failure from the layer's own statements.
    #[default]
    ReadCommitted,
    /// `REPEATABLE READ`.
    RepeatableRead,
    /// `SERIALIZABLE`: the handler's reads and writes behave as if requests ran one at a time.
    /// Conflicts surface as serialization failures (`40001`): while reserving the key they are
    /// retried, later they answer `503` and the client retries.
    Serializable,
}

impl Isolation {
    /// `BEGIN` at this level, for transactions that set nothing else (the inbox's own).
    pub(crate) fn begin_statement(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "BEGIN ISOLATION LEVEL READ COMMITTED",
            Isolation::RepeatableRead => "BEGIN ISOLATION LEVEL REPEATABLE READ",
            Isolation::Serializable => "BEGIN ISOLATION LEVEL SERIALIZABLE",
        }
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

/// What [`reserve`] found.
pub(crate) enum Reserved {
    /// The scope is reserved by this transaction, in the row at this `ctid`.
    Row(String),
    /// A duplicate committed first: its live record.
    Existing(StoredRecord),
}

/// The reservation's statements on one driver's connection, inside the open transaction, for
/// one scope at one `now`.
pub(crate) trait ReserveStatements {
    /// `INSERT_RESERVATION`: the new row's `ctid`, or `None` when the key has a row (blocks on
    /// the primary key while another transaction holds it).
    fn insert(&mut self) -> impl Future<Output = Result<Option<String>, Error>> + Send;

    /// `SELECT_RECORD`: `None` when the key has no row, `Some(None)` when its row is not a live
    /// completed record (expired, or a stray reservation), else the record.
    fn select(
        &mut self,
    ) -> impl Future<Output = Result<Option<Option<StoredRecord>>, Error>> + Send;

    /// `TAKE_OVER`: the row's `ctid` once taken over, or `None` if it changed meanwhile.
    fn take_over(&mut self) -> impl Future<Output = Result<Option<String>, Error>> + Send;
}

/// Reserves the scope, or finds the record a duplicate committed first. `first` is the answer
/// of an insert the driver already sent (tokio-postgres sends it with the `BEGIN`).
pub(crate) async fn reserve<S: ReserveStatements>(
    statements: &mut S,
    mut first: Option<Option<String>>,
) -> Result<Reserved, Error> {
    // Each turn ends in a decision unless another transaction changed the row in between
    // (purged it, or took it over and committed): then look again, a few times at most.
    for _ in 0..4 {
        let inserted = match first.take() {
            Some(inserted) => inserted,
            None => statements.insert().await?,
        };
        if let Some(row) = inserted {
            return Ok(Reserved::Row(row));
        }
        let Some(found) = statements.select().await? else {
            continue; // purged since the insert saw it
        };
        if let Some(record) = found {
            return Ok(Reserved::Existing(record));
        }
        // Expired, or a stray reservation that was committed: take it over. Blocks if another
        // request is taking it over too; when that one commits, its fresh record no longer
        // matches and the next turn replays it.
        if let Some(row) = statements.take_over().await? {
            return Ok(Reserved::Row(row));
        }
    }
    Err(Error::Busy)
}

/// Runs `attempt` (open a transaction and reserve) again after a serialization failure or a
/// deadlock, at most `retries` times, after a short pause that grows with each retry so that
/// the other transaction can end; never past `deadline` ([`Error::Busy`] then).
pub(crate) async fn retry_conflicts<T, F, Fut>(
    retries: u32,
    deadline: Instant,
    mut attempt: F,
) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    let mut retried = 0;
    loop {
        match attempt().await {
            Err(error) if error.is_serialization_conflict() && retried < retries => {
                retried += 1;
                tracing::debug!(%error, retries = retried, "reserving the key conflicted; retrying");
                let pause = std::time::Duration::from_millis(2u64 << retried.min(6));
                if Instant::now() + pause >= deadline {
                    return Err(Error::Busy);
                }
                tokio::time::sleep(pause).await;
            }
            outcome => return outcome,
        }
    }
}
