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

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::Poll;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use crate::error::Error;
use crate::store::retry_share::RetryShare;
use crate::store::{
    begin_and_run_in_place, fast_path_lookup, IdempotencyStore, RunOutcome, Scope, StoredRecord,
};

/// Where a request learns that its key already has a completed record (a retry to replay),
/// and so which requests pay for the check: replays (in waits for the connections that
/// writers hold) or new keys (in one read more than a hand-written transaction makes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReplayCheck {
    /// [`FavorReplays`](Self::FavorReplays) while retries are frequent among recent first
    /// attempts (one in eight or more); else [`FavorNewKeys`](Self::FavorNewKeys), except that
    /// a reservation that waits for a connection (every one of the request transactions' pool
    /// is taken) longer than twice what they have lately waited (at least 1 ms, at most
    /// 100 ms) reads meanwhile, and replays a record it finds without waiting further. So a
    /// service whose requests are mostly new keys pays no read more than a hand-written
    /// transaction, even while its requests queue for connections; a burst of retries is
    /// answered from the read pool again within a few requests; and a replay waits for
    /// connections that writers hold no longer than that. When a reservation fails (the
    /// primary is down, say), the read is made after all, so a record on the read pool (a
    /// standby) still replays.
    #[default]
    Adaptive,
    /// Replays never wait for writers: every request first reads its key's record with a
    /// plain read on the read pool, before any transaction, so replays never take a
    /// connection of the request transactions, and under load the checks of concurrent
    /// requests share statements (the tokio-postgres store). A new key pays for one read more
    /// than a hand-written transaction would.
    FavorReplays,
    /// New keys pay nothing extra: the check is made in the transaction, by the reservation
    /// itself, as a hand-written handler does it (an `INSERT ... ON CONFLICT DO NOTHING` of
    /// the key, then a read of the record it ran into). A new key costs no read more than
    /// that, but a replay takes a connection of the request transactions for the
    /// reservation, the read and a `ROLLBACK`, and waits for one when writers hold them all.
    FavorNewKeys,
}

/// The least and the most a reservation waits for a connection before it reads meanwhile
/// ([`ReplayChecks::acquire`]).
const PATIENCE: (Duration, Duration) = (Duration::from_millis(1), Duration::from_millis(100));

/// How long past the lock timeout (from the start of a request's first attempt) the lookup
/// that follows a failed begin may last ([`first_attempt`]): a begin that gave up on a server
/// that stopped answering (by the lock timeout and 500 ms) leaves it no time, so that the
/// request is answered within the lock timeout and 1 s.
pub(crate) const FALLBACK_READ_MARGIN: Duration = Duration::from_millis(500);

/// How a reservation's wait for a connection ended ([`ReplayChecks::acquire`]).
pub(crate) enum Acquired<C> {
    /// The connection.
    Connection(C),
    /// The key's live completed record, read while the wait went on.
    Found(StoredRecord),
}

/// A store's [`ReplayCheck`] and, under [`ReplayCheck::Adaptive`], its estimate of the share
/// of first attempts that were retries (shared by the store's clones).
#[derive(Debug)]
pub(crate) struct ReplayChecks {
    check: ReplayCheck,
    /// How often recent first attempts were retries.
    retries: RetryShare,
    /// How long reservations have lately waited for a connection, in microseconds (a moving
    /// average over about the last 8).
    waited_us: AtomicU32,
}

impl ReplayChecks {
    pub(crate) fn new(check: ReplayCheck) -> Self {
        ReplayChecks {
            check,
            retries: RetryShare::default(),
            waited_us: AtomicU32::new(0),
        }
    }

    /// The configured choice.
    pub(crate) fn check(&self) -> ReplayCheck {
        self.check
    }

    /// Whether the next first attempt reads before its transaction.
    pub(crate) fn read_first(&self) -> bool {
        match self.check {
            ReplayCheck::FavorReplays => true,
            ReplayCheck::FavorNewKeys => false,
            ReplayCheck::Adaptive => self.retries.frequent(),
        }
    }

    /// A reservation's connection, from `acquire`. Under [`ReplayCheck::Adaptive`], once the
    /// wait has lasted twice what waits have lately lasted (within [`PATIENCE`]), `read` (the
    /// key's live completed record, as [`IdempotencyStore::lookup`] reads it) runs while the
    /// wait goes on: a record it finds ends the wait. A read that finds nothing, or fails,
    /// leaves the wait to end as it would have.
    ///
    /// An `acquire` that is ready at once sets no timer. `acquire` is pinned by the caller and
    /// the read is made (and boxed) only when it runs, so that the request's future carries
    /// neither twice nor the read at all on the common path, where nothing waits that long.
    pub(crate) async fn acquire<C, R>(
        &self,
        mut acquire: Pin<&mut impl Future<Output = Result<C, Error>>>,
        read: impl FnOnce() -> R,
    ) -> Result<Acquired<C>, Error>
    where
        R: Future<Output = Result<Option<StoredRecord>, Error>>,
    {
        if self.check != ReplayCheck::Adaptive {
            return acquire.await.map(Acquired::Connection);
        }
        if let Poll::Ready(connection) = poll_fn(|cx| Poll::Ready(acquire.as_mut().poll(cx))).await
        {
            self.learn_wait(Duration::ZERO);
            return connection.map(Acquired::Connection);
        }
        let started = Instant::now();
        let patience = self.patience();
        if let Ok(connection) = tokio::time::timeout_at(started + patience, &mut acquire).await {
            self.learn_wait(started.elapsed());
            return connection.map(Acquired::Connection);
        }
        let mut read = Box::pin(read());
        let mut reading = true;
        poll_fn(|cx| {
            if reading {
                match read.as_mut().poll(cx) {
                    Poll::Ready(Ok(Some(record))) => {
                        return Poll::Ready(Ok(Acquired::Found(record)))
                    }
                    Poll::Ready(Ok(None)) => reading = false,
                    Poll::Ready(Err(error)) => {
                        tracing::debug!(%error, "replay check while waiting for a connection failed");
                        reading = false;
                    }
                    Poll::Pending => {}
                }
            }
            match acquire.as_mut().poll(cx) {
                Poll::Ready(connection) => {
                    self.learn_wait(started.elapsed());
                    Poll::Ready(connection.map(Acquired::Connection))
                }
                Poll::Pending => Poll::Pending,
            }
        })
        .await
    }

    /// How long a reservation waits for a connection before it reads meanwhile.
    fn patience(&self) -> Duration {
        let lately = Duration::from_micros(u64::from(self.waited_us.load(Ordering::Relaxed)));
        (lately * 2).clamp(PATIENCE.0, PATIENCE.1)
    }

    /// Learns how long a wait for a connection lasted (concurrent updates may lose one
    /// another's step, as in [`observe`](Self::observe)).
    fn learn_wait(&self, waited: Duration) {
        let sample = u32::try_from(waited.as_micros()).unwrap_or(u32::MAX);
        let lately = self.waited_us.load(Ordering::Relaxed);
        let next = if sample > lately {
            lately + (sample - lately).div_ceil(8)
        } else {
            lately - (lately - sample).div_ceil(8)
        };
        self.waited_us.store(next, Ordering::Relaxed);
    }

    /// Learns from a first attempt's outcome whether its key had a record.
    pub(crate) fn observe<T>(&self, outcome: &Result<RunOutcome<T>, Error>) {
        if self.check == ReplayCheck::Adaptive {
            self.retries.observe(outcome);
        }
    }
}

/// A request's first attempt under `checks`: [`IdempotencyStore::lookup`], then
/// [`begin`](IdempotencyStore::begin) and `work` in place when it finds no live record, or the
/// begin alone, which finds a completed record itself (or reads while it waits for a
/// connection: [`ReplayChecks::acquire`]); then the outcome teaches `checks`.
///
/// A begin that ran alone and failed (the primary is down, or every transaction connection
/// stayed taken past the lock timeout) is followed by the lookup after all: a record it finds
/// (on a standby that serves the read pool, say) is replayed rather than the error answered.
///
/// The lock timeout bounds the whole attempt, measured from its start, whatever the store's
/// `read_wait`: a lookup before the begin leaves the begin only what is left of the lock
/// timeout, and the lookup after a failed begin is given up (or not made) by the lock timeout
/// and [`FALLBACK_READ_MARGIN`]. So a server that stops answering is answered `503` within the
/// lock timeout and 1 s: the begin gives up on it by the lock timeout and 500 ms, and the
/// lookup after it adds nothing past the lock timeout and [`FALLBACK_READ_MARGIN`].
pub(crate) async fn first_attempt<St, W, F>(
    store: &St,
    checks: &ReplayChecks,
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
    let started = Instant::now();
    // The work (the handler and the commit) boxed once the key is reserved: this future then
    // holds a pointer for it, not room for it through the lookup and the reservation (and a
    // replay never makes it).
    let work = move |reservation| Box::pin(work(reservation));
    let begin = move || {
        // What the lookup before it left of the lock timeout (all of it when none was made).
        let left = lock_timeout.saturating_sub(started.elapsed());
        begin_and_run_in_place(store, scope, left, now, work)
    };
    // One `begin().await` for both ways: its future (the store's and the handler's) takes its
    // room in this one once, not once for each.
    let read_first = checks.read_first();
    let found = if read_first {
        fast_path_lookup(store, scope, now).await
    } else {
        None
    };
    let outcome = if let Some(record) = found {
        Ok(RunOutcome::Found { record })
    } else {
        match begin().await {
            Err(error) if !read_first => {
                let read_by = started + lock_timeout + FALLBACK_READ_MARGIN;
                if Instant::now() >= read_by {
                    // The begin used the whole lock timeout and more (a server that stopped
                    // answering, most likely the read pool's too): no time is left to read.
                    Err(error)
                } else {
                    match tokio::time::timeout_at(read_by, store.lookup(scope, now)).await {
                        Ok(Ok(Some(record))) => Ok(RunOutcome::Found { record }),
                        Ok(Ok(None) | Err(_)) | Err(_) => Err(error),
                    }
                }
            }
            outcome => outcome,
        }
    };
    checks.observe(&outcome);
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::pin::pin;

    fn ran() -> Result<RunOutcome<()>, Error> {
        Ok(RunOutcome::Ran {
            output: (),
            waited: Duration::ZERO,
        })
    }

    fn replayed() -> Result<RunOutcome<()>, Error> {
        Ok(RunOutcome::Existing {
            record: crate::row_lock::test_records::stored_record(),
            waited: Duration::ZERO,
        })
    }

    #[test]
    fn adaptive_skips_the_read_while_retries_are_rare() {
        let checks = ReplayChecks::new(ReplayCheck::Adaptive);
        assert!(!checks.read_first(), "a fresh store has seen no retry");
        for _ in 0..100 {
            checks.observe(&ran());
        }
        assert!(!checks.read_first());
        // One retry in twenty stays below one in eight.
        for _ in 0..20 {
            checks.observe(&replayed());
            for _ in 0..19 {
                checks.observe(&ran());
            }
        }
        assert!(!checks.read_first());
    }

    #[test]
    fn adaptive_reads_first_within_a_few_retries_and_stops_after_new_keys() {
        let checks = ReplayChecks::new(ReplayCheck::Adaptive);
        for _ in 0..3 {
            checks.observe(&replayed());
        }
        assert!(checks.read_first(), "three retries in a row");
        for _ in 0..1000 {
            checks.observe(&replayed());
        }
        assert!(checks.read_first());
        let mut new_keys = 0;
        while checks.read_first() {
            checks.observe(&ran());
            new_keys += 1;
        }
        assert!((20..=40).contains(&new_keys), "{new_keys} new keys");
        for _ in 0..1000 {
            checks.observe(&ran());
        }
        assert_eq!(checks.retries.get(), 0, "reaches zero");
    }

    fn record() -> StoredRecord {
        crate::row_lock::test_records::stored_record()
    }

    /// A connection that comes after `wait`.
    async fn connection_after(wait: Duration) -> Result<(), Error> {
        tokio::time::sleep(wait).await;
        Ok(())
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_ready_at_once_reads_nothing() {
        let checks = ReplayChecks::new(ReplayCheck::Adaptive);
        let acquired = checks
            .acquire(pin!(async { Ok(7) }), || async {
                panic!("no read for a ready connection")
            })
            .await;
        assert!(matches!(acquired, Ok(Acquired::Connection(7))));
    }

    #[tokio::test(start_paused = true)]
    async fn a_long_wait_for_a_connection_replays_what_the_read_finds() {
        let checks = ReplayChecks::new(ReplayCheck::Adaptive);
        let started = Instant::now();
        let acquired = checks
            .acquire(
                pin!(std::future::pending::<Result<(), Error>>()),
                || async { Ok(Some(record())) },
            )
            .await;
        assert!(matches!(acquired, Ok(Acquired::Found(_))));
        assert_eq!(started.elapsed(), PATIENCE.0, "after the least patience");
    }

    #[tokio::test(start_paused = true)]
    async fn a_read_that_finds_nothing_or_fails_leaves_the_wait_to_end() {
        let checks = ReplayChecks::new(ReplayCheck::Adaptive);
        for read in [Ok(None), Err(Error::Busy)] {
            let acquire = pin!(connection_after(Duration::from_millis(50)));
            let acquired = checks.acquire(acquire, || async { read }).await;
            assert!(matches!(acquired, Ok(Acquired::Connection(()))));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn patience_follows_recent_waits_within_its_bounds() {
        let checks = ReplayChecks::new(ReplayCheck::Adaptive);
        assert_eq!(checks.patience(), PATIENCE.0);
        for _ in 0..100 {
            checks.learn_wait(Duration::from_millis(12));
        }
        assert_eq!(checks.patience(), Duration::from_millis(24));
        // A wait shorter than the patience ends without a read.
        let acquire = pin!(connection_after(Duration::from_millis(20)));
        let acquired = checks
            .acquire(acquire, || async { panic!("no read within the patience") })
            .await;
        assert!(matches!(acquired, Ok(Acquired::Connection(()))));
        for _ in 0..100 {
            checks.learn_wait(Duration::from_secs(3));
        }
        assert_eq!(checks.patience(), PATIENCE.1);
        for _ in 0..100 {
            checks.learn_wait(Duration::ZERO);
        }
        assert_eq!(checks.patience(), PATIENCE.0);
    }

    #[tokio::test(start_paused = true)]
    async fn fixed_choices_wait_for_the_connection_without_a_read() {
        for check in [ReplayCheck::FavorReplays, ReplayCheck::FavorNewKeys] {
            let checks = ReplayChecks::new(check);
            let acquire = pin!(connection_after(Duration::from_secs(1)));
            let acquired = checks
                .acquire(acquire, || async { panic!("no read under {check:?}") })
                .await;
            assert!(matches!(acquired, Ok(Acquired::Connection(()))));
        }
    }

    #[test]
    fn errors_teach_nothing() {
        let checks = ReplayChecks::new(ReplayCheck::Adaptive);
        for _ in 0..10 {
            checks.observe(&replayed());
        }
        let before = checks.retries.get();
        checks.observe::<()>(&Err(Error::Busy));
        assert_eq!(checks.retries.get(), before);
    }

    #[test]
    fn fixed_choices_ignore_outcomes() {
        let read_pool = ReplayChecks::new(ReplayCheck::FavorReplays);
        let reservation = ReplayChecks::new(ReplayCheck::FavorNewKeys);
        for _ in 0..100 {
            read_pool.observe(&ran());
            reservation.observe(&replayed());
        }
        assert!(read_pool.read_first());
        assert!(!reservation.read_first());
    }
}
