//! How a SQL store with row locks reserves a key, written once for every such driver
//! (tokio-postgres, sqlx on PostgreSQL, sqlx on MySQL and MariaDB): the decision between
//! reserving, replaying and taking over an expired record, the bounded retry of a
//! reservation that hit a serialization failure or a deadlock ([`begin_with_retries`]), and the
//! bound on the replay fast path's read ([`within`]), and the bound the in-flight policy puts
//! on the wait for a key's row another transaction holds ([`key_row_wait`],
//! [`in_flight_past_bound`]). Each driver runs its own three statements through
//! [`ReserveStatements`].

use std::future::Future;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use crate::error::Error;
use crate::in_flight::InFlight;
use crate::store::{to_unix_millis, StoredRecord};

/// The isolation level of the request transactions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Isolation {
    /// `READ COMMITTED` (PostgreSQL's default): what the reservation needs, and never a
    /// serialization failure from the layer's own statements.
    #[default]
    ReadCommitted,
    /// `REPEATABLE READ` (InnoDB's default).
    RepeatableRead,
    /// `SERIALIZABLE`: the handler's reads and writes behave as if requests ran one at a time.
    /// Conflicts surface as serialization failures or deadlocks: while reserving the key they
    /// are retried, later they answer `503` and the client retries.
    Serializable,
}

/// What [`reserve`] found.
pub(crate) enum Reserved<R> {
    /// The scope is reserved by this transaction, in this row (the driver's row address, or
    /// `()` where it needs none).
    Row(R),
    /// A duplicate committed first: its live record.
    Existing(StoredRecord),
}

/// The reservation's statements on one driver's connection, inside the open transaction, for
/// one scope at one `now`.
pub(crate) trait ReserveStatements {
    /// What identifies the reserved row for the commit.
    type Row;

    /// Inserts the reservation: the new row, or `None` when the key has a row (blocks on the
    /// primary key while another transaction holds it).
    fn insert(&mut self) -> impl Future<Output = Result<Option<Self::Row>, Error>> + Send;

    /// Reads the key's row: `None` when the key has no row, `Some(None)` when its row is not a
    /// live completed record (expired, or a stray reservation), else the record.
    fn select(
        &mut self,
    ) -> impl Future<Output = Result<Option<Option<StoredRecord>>, Error>> + Send;

    /// Takes an expired record (or a stray reservation) over: the row once taken over, or
    /// `None` if it changed meanwhile.
    fn take_over(&mut self) -> impl Future<Output = Result<Option<Self::Row>, Error>> + Send;
}

/// Reserves the scope, or finds the record a duplicate committed first. `first` is the answer
/// of an insert the driver already sent (tokio-postgres sends it with the `BEGIN`).
pub(crate) async fn reserve<S: ReserveStatements>(
    statements: &mut S,
    mut first: Option<Option<S::Row>>,
) -> Result<Reserved<S::Row>, Error> {
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

/// How long the reservation waits on the key's row while another transaction holds it (a
/// duplicate running on another instance), under the layer's in-flight `policy`: `None` under
/// [`InFlight::Wait`] (up to the lock timeout, as every other wait), zero under
/// [`InFlight::Reject`] (each driver turns it into the shortest wait its database allows), the
/// bound under [`InFlight::WaitUpTo`].
pub(crate) fn key_row_wait(policy: InFlight) -> Option<Duration> {
    match policy {
        InFlight::Wait => None,
        InFlight::Reject => Some(Duration::ZERO),
        InFlight::WaitUpTo(bound) => Some(bound),
    }
}

/// A reservation's `error`, as [`Error::InFlight`] when it is the end of a wait on the key's
/// row bounded by [`key_row_wait`] (a lock wait that timed out: the reservation's statements
/// wait on nothing else).
pub(crate) fn in_flight_past_bound(key_row_wait: Option<Duration>, error: Error) -> Error {
    if key_row_wait.is_some() && error.is_lock_wait_timeout() {
        Error::InFlight
    } else {
        error
    }
}

/// A store's `begin`: `attempt` (open a transaction and reserve, by the deadline `lock_timeout`
/// from now, at `now` in milliseconds), retried after a serialization failure or a deadlock
/// as [`retry_conflicts`] does.
pub(crate) async fn begin_with_retries<T, F, Fut>(
    retries: u32,
    lock_timeout: Duration,
    now: SystemTime,
    mut attempt: F,
) -> Result<T, Error>
where
    F: FnMut(Instant, i64) -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    let deadline = Instant::now() + lock_timeout;
    let now = to_unix_millis(now);
    retry_conflicts(retries, deadline, || attempt(deadline, now)).await
}

/// The replay fast path's read, given up after `wait` ([`Error::Busy`]: the request then takes
/// the authoritative write path). The bound is kept by a watchdog, not a runtime timer per
/// read (see [`read_bound`](super::read_bound)): it ends a stuck read up to
/// [`TICK`](super::read_bound::TICK) late.
pub(crate) async fn within<T>(
    wait: Duration,
    read: impl Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    super::read_bound::bounded(wait, read).await
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
