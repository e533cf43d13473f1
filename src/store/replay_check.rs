//! Where a request of a store with row locks (PostgreSQL on either driver, MySQL and MariaDB)
//! learns that its key already has a completed record: in a plain read before the transaction,
//! or from the reservation itself. [`ReplayChecks`] makes the choice for each request, written
//! once for every such store, and [`first_attempt`] runs it.
//!
//! The read costs a new key one query more than a hand-written transaction makes; skipping it
//! costs a replay a transaction (the reservation's `INSERT`, the read of the record it ran
//! into, a `ROLLBACK`) on a connection of the request transactions. Which is dearer depends on
//! how many first attempts are retries, which the store learns from their outcomes: every
//! first attempt tells, whichever way it went, whether its key had a record.

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime};

use super::{begin_and_run_in_place, lookup_then, IdempotencyStore, RunOutcome, Scope};
use crate::error::Error;

/// Where a request learns that its key already has a completed record (a retry to replay).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReplayCheck {
    /// [`ReadPool`](Self::ReadPool) while retries are frequent among recent first attempts
    /// (one in eight or more), or when a reservation would have to wait for a connection
    /// (every one of the request transactions' pool is taken); else
    /// [`Reservation`](Self::Reservation). So a service whose requests are mostly new keys
    /// pays no read more than a hand-written transaction; a burst of retries is answered from
    /// the read pool again within a few requests; and a replay never waits for a connection
    /// that writers hold. When a reservation fails (the primary is down, say), the read is
    /// made after all, so a record on the read pool (a standby) still replays.
    #[default]
    Adaptive,
    /// Always before the transaction, with a plain read on the read pool: replays never take
    /// a connection of the request transactions, and under load the checks of concurrent
    /// requests share statements (the tokio-postgres store). A new key pays for one read more
    /// than a hand-written transaction would.
    ReadPool,
    /// Always in the transaction, by the reservation itself, as a hand-written handler does
    /// it (an `INSERT ... ON CONFLICT DO NOTHING` of the key, then a read of the record it
    /// ran into): a new key costs no read more than that, but a replay takes a connection of
    /// the request transactions for the reservation, the read and a `ROLLBACK`, and waits for
    /// one when writers hold them all.
    Reservation,
}

/// How much one outcome moves the estimate: an exponential moving average over about the
/// last 16 first attempts.
const SHIFT: u32 = 4;
/// The estimate's scale: `ONE` is "every first attempt was a retry".
const ONE: u32 = 1 << 16;
/// From this share of retries on (one in eight), read before the transaction. The read saves
/// a retry two round trips on a write connection and costs a new key one, so it pays from one
/// in three; from one in eight, retries stay off the write connections unless they are rare.
const READ_FROM: u32 = ONE / 8;

/// A store's [`ReplayCheck`] and, under [`ReplayCheck::Adaptive`], its estimate of the share
/// of first attempts that were retries (shared by the store's clones).
#[derive(Debug)]
pub(crate) struct ReplayChecks {
    check: ReplayCheck,
    /// The share of recent first attempts whose key had a record, in `1 / ONE`.
    found: AtomicU32,
}

impl ReplayChecks {
    pub(crate) fn new(check: ReplayCheck) -> Self {
        ReplayChecks {
            check,
            found: AtomicU32::new(0),
        }
    }

    /// The configured choice.
    pub(crate) fn check(&self) -> ReplayCheck {
        self.check
    }

    /// Whether the next first attempt reads before its transaction; `write_idle` tells
    /// whether a connection of the request transactions is idle now.
    pub(crate) fn read_first(&self, write_idle: impl FnOnce() -> bool) -> bool {
        match self.check {
            ReplayCheck::ReadPool => true,
            ReplayCheck::Reservation => false,
            ReplayCheck::Adaptive => {
                self.found.load(Ordering::Relaxed) >= READ_FROM || !write_idle()
            }
        }
    }

    /// Learns from a first attempt's outcome whether its key had a record. Concurrent
    /// updates may lose one another's step: the estimate only needs to follow the trend.
    pub(crate) fn observe<T>(&self, outcome: &Result<RunOutcome<T>, Error>) {
        if self.check != ReplayCheck::Adaptive {
            return;
        }
        let had_record = match outcome {
            Ok(RunOutcome::Found { .. } | RunOutcome::Existing { .. }) => true,
            Ok(RunOutcome::Ran { .. }) => false,
            Err(_) => return,
        };
        let found = self.found.load(Ordering::Relaxed);
        let target = if had_record { ONE } else { 0 };
        // found + (target - found) / 2^SHIFT, rounded towards the target so that it reaches it.
        let next = if target > found {
            found + (target - found).div_ceil(1 << SHIFT)
        } else {
            found - (found - target).div_ceil(1 << SHIFT)
        };
        self.found.store(next, Ordering::Relaxed);
    }
}

/// A request's first attempt under `checks`: [`IdempotencyStore::lookup`], then
/// [`begin`](IdempotencyStore::begin) and `work` in place when it finds no live record, or the
/// begin alone, which finds a completed record itself; then the outcome teaches `checks`.
/// `write_idle` tells whether a reservation would find a connection without waiting.
///
/// A begin that ran alone and failed (the primary is down, or every transaction connection
/// stayed taken past the lock timeout) is followed by the lookup after all: a record it finds
/// (on a standby that serves the read pool, say) is replayed rather than the error answered.
pub(crate) async fn first_attempt<St, W, F>(
    store: &St,
    checks: &ReplayChecks,
    write_idle: impl FnOnce() -> bool,
    scope: &Scope,
    lock_timeout: Duration,
    now: SystemTime,
    work: W,
) -> Result<RunOutcome<F::Output>, Error>
where
    St: IdempotencyStore,
    W: FnOnce(St::Reservation) -> F,
    F: Future,
{
    let begin = move || begin_and_run_in_place(store, scope, lock_timeout, now, work);
    let outcome = if checks.read_first(write_idle) {
        lookup_then(store, scope, now, begin).await
    } else {
        match begin().await {
            Err(error) => match store.lookup(scope, now).await {
                Ok(Some(record)) => Ok(RunOutcome::Found { record }),
                Ok(None) | Err(_) => Err(error),
            },
            outcome => outcome,
        }
    };
    checks.observe(&outcome);
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ran() -> Result<RunOutcome<()>, Error> {
        Ok(RunOutcome::Ran {
            output: (),
            waited: Duration::ZERO,
        })
    }

    fn replayed() -> Result<RunOutcome<()>, Error> {
        Ok(RunOutcome::Existing {
            record: crate::store::test_records::stored_record(),
            waited: Duration::ZERO,
        })
    }

    #[test]
    fn adaptive_skips_the_read_while_retries_are_rare() {
        let checks = ReplayChecks::new(ReplayCheck::Adaptive);
        assert!(
            !checks.read_first(|| true),
            "a fresh store has seen no retry"
        );
        for _ in 0..100 {
            checks.observe(&ran());
        }
        assert!(!checks.read_first(|| true));
        // One retry in twenty stays below one in eight.
        for _ in 0..20 {
            checks.observe(&replayed());
            for _ in 0..19 {
                checks.observe(&ran());
            }
        }
        assert!(!checks.read_first(|| true));
    }

    #[test]
    fn adaptive_reads_first_within_a_few_retries_and_stops_after_new_keys() {
        let checks = ReplayChecks::new(ReplayCheck::Adaptive);
        for _ in 0..3 {
            checks.observe(&replayed());
        }
        assert!(checks.read_first(|| true), "three retries in a row");
        for _ in 0..1000 {
            checks.observe(&replayed());
        }
        assert!(checks.read_first(|| true));
        let mut new_keys = 0;
        while checks.read_first(|| true) {
            checks.observe(&ran());
            new_keys += 1;
        }
        assert!((20..=40).contains(&new_keys), "{new_keys} new keys");
        for _ in 0..1000 {
            checks.observe(&ran());
        }
        assert_eq!(checks.found.load(Ordering::Relaxed), 0, "reaches zero");
    }

    #[test]
    fn adaptive_reads_first_when_no_write_connection_is_idle() {
        let checks = ReplayChecks::new(ReplayCheck::Adaptive);
        assert!(checks.read_first(|| false));
    }

    #[test]
    fn errors_teach_nothing() {
        let checks = ReplayChecks::new(ReplayCheck::Adaptive);
        for _ in 0..10 {
            checks.observe(&replayed());
        }
        let before = checks.found.load(Ordering::Relaxed);
        checks.observe::<()>(&Err(Error::Busy));
        assert_eq!(checks.found.load(Ordering::Relaxed), before);
    }

    #[test]
    fn fixed_choices_ignore_outcomes_and_idleness() {
        let read_pool = ReplayChecks::new(ReplayCheck::ReadPool);
        let reservation = ReplayChecks::new(ReplayCheck::Reservation);
        for _ in 0..100 {
            read_pool.observe(&ran());
            reservation.observe(&replayed());
        }
        assert!(read_pool.read_first(|| true));
        assert!(!reservation.read_first(|| false));
    }
}
