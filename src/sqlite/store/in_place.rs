//! Running a request's transaction in place: on the request's own task, with the writer the
//! writer thread left idle ([`SqliteOptions::with_write_in_place`](super::SqliteOptions::with_write_in_place)).
//!
//! When the writer thread has nothing to do (no transaction open, no group, nothing queued)
//! it leaves the writer in an [`IdleWriter`] slot before it parks (`writer`). A request's
//! first or next attempt (`executor`) takes it from there without waiting
//! ([`Shared::take_idle_writer`]: a `try_lock`, and only while no one is queued), begins
//! with no busy wait, and runs the layer's work on its own task: the handler's statements
//! ([`SqliteHandle::run`](super::SqliteHandle::run)) and the commit run on its own thread,
//! as a hand-written handler's would, with no hand-over to the writer thread and back. Its end
//! (commit, rollback, drop) gives the writer back ([`Shared::return_writer`]): into the slot
//! if nothing waits for it, else through the queue, with the group still open if requests
//! queued meanwhile, so that they share its commit. Anything that would wait (the writer
//! busy, a request queued, another process's lock or a recent write by one) sends the
//! request to the writer thread as before.
//!
//! While it holds the writer, the request's task is marked ([`inside_request_in_place`]), so
//! that a nested request or a standalone write from its handler fails at once with
//! [`Error::InsideRequest`] rather than waiting for its own end.
//!
//! On a multi-thread runtime, each of those blocking calls either runs inline, blocking the
//! worker thread for its duration, or under `tokio::task::block_in_place`, which first hands
//! the worker's queued tasks (the one in its LIFO slot too: the server's accept loop, say) to
//! another thread, at the cost of a thread hand-over each time. Which one is learned per call
//! site ([`CallSites`]): the closure type a handler passes to `SqliteHandle::run`, the commit,
//! the rollback. A site runs inline once it has run before and its recent duration is under
//! [`SqliteOptions::with_inline_limit`](super::SqliteOptions::with_inline_limit); a site never
//! seen, or seen slow lately, runs under `block_in_place`. One slow run sends its site back
//! to `block_in_place` at once ([`next_estimate`]), so a site that has been fast and turns
//! slow blocks its worker once, for that one run.

use std::any::TypeId;
use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
#[cfg(feature = "_internal-tests")]
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, TryLockError};
use std::time::{Duration, Instant, SystemTime};

use super::reservation::{SqliteReservation, TxShared};
#[cfg(doc)]
use super::writer::IdleWriter;
use super::writer::{inside_request, Job, Writer, NESTED_REQUEST};
use super::{Shared, SqliteStore};
use crate::error::Error;
use crate::store::{to_unix_millis, RunOutcome, Scope};

tokio::task_local! {
    /// The request whose transaction the current task runs in place.
    static IN_PLACE: Arc<TxShared>;
}

/// Whether the current task runs, in place, a request of store `id` that has not ended.
pub(super) fn inside_request_in_place(id: u64) -> bool {
    IN_PLACE
        .try_with(|tx| tx.store.id == id && !tx.finished.load(Ordering::Acquire))
        .unwrap_or(false)
}

/// What an attempt to run a request in place came to.
// Returned once per request and matched at once: boxing the outcome would allocate for each.
#[allow(clippy::large_enum_variant)]
pub(super) enum InPlace<W, T> {
    /// It ran, or was answered, in place.
    Done(Result<RunOutcome<T>, Error>),
    /// It has to queue for the writer thread; `looked_up`: the fast-path read ran (in place)
    /// and found no live record.
    Queue { work: W, looked_up: bool },
}

impl Shared {
    /// The writer, if the writer thread left it idle and no request waits for it. Never
    /// waits for the slot's lock.
    fn take_idle_writer(&self) -> Option<Box<Writer>> {
        if !self.write_in_place || self.queued.load(Ordering::Acquire) != 0 {
            return None;
        }
        let mut slot = self.idle.try_lock().ok()?;
        if slot.wanted {
            return None;
        }
        slot.writer.take()
    }

    /// Gives back the writer a request held in place: to the slot if the writer is idle and
    /// the thread does not want it, else to the writer thread through the queue (which wakes
    /// it: an open group is the thread's to commit).
    pub(super) fn return_writer(&self, writer: Box<Writer>) {
        let writer = if writer.active.is_none() && writer.group.is_none() {
            match self.idle.try_lock() {
                Ok(mut slot) if !slot.wanted && slot.writer.is_none() => {
                    slot.writer = Some(writer);
                    return;
                }
                _ => writer,
            }
        } else {
            writer
        };
        // Fails only once the thread has ended (it never does while a request holds the
        // store): the writer is then closed here.
        let _ = self.jobs.send(Job::Return(writer));
    }
}

/// How long the blocking calls of requests run in place took lately, per call site, and
/// whether a site's next run may block its worker (see the module docs).
pub(super) struct CallSites {
    /// [`SqliteOptions::with_inline_limit`](super::SqliteOptions::with_inline_limit): a site
    /// whose estimate is under it runs inline.
    limit: Duration,
    /// Each site's estimate ([`next_estimate`]). Locked only to read or update one entry,
    /// never across a call. Sites are closure types of the program: the map stays small.
    estimates: Mutex<HashMap<TypeId, Duration>>,
    /// How many calls ran inline, and how many under `block_in_place`: what the tests observe
    /// (see [`SqliteStore::__blocking_calls`]).
    #[cfg(feature = "_internal-tests")]
    inline: AtomicU64,
    /// See `inline`.
    #[cfg(feature = "_internal-tests")]
    handed_off: AtomicU64,
}

impl CallSites {
    /// No site seen yet; sites under `limit` will run inline.
    pub(super) fn new(limit: Duration) -> Self {
        CallSites {
            limit,
            estimates: Mutex::new(HashMap::new()),
            #[cfg(feature = "_internal-tests")]
            inline: AtomicU64::new(0),
            #[cfg(feature = "_internal-tests")]
            handed_off: AtomicU64::new(0),
        }
    }

    /// Whether `site`'s next call may run inline.
    fn runs_inline(&self, site: TypeId) -> bool {
        if self.limit.is_zero() {
            return false;
        }
        // Never poisoned (nothing panics under it); a poisoned map hands every call off.
        let estimate = match self.estimates.lock() {
            Ok(estimates) => estimates.get(&site).copied(),
            Err(_) => None,
        };
        runs_inline(estimate, self.limit)
    }

    /// Counts in `site`'s estimate a call that took `took`.
    fn record(&self, site: TypeId, took: Duration) {
        if self.limit.is_zero() {
            return;
        }
        if let Ok(mut estimates) = self.estimates.lock() {
            let estimate = estimates.entry(site).or_insert(took);
            *estimate = next_estimate(*estimate, took);
        }
    }

    /// Counts a call that ran inline (`true`) or was handed off, for the tests.
    #[cfg_attr(not(feature = "_internal-tests"), allow(unused_variables))]
    fn count(&self, inline: bool) {
        #[cfg(feature = "_internal-tests")]
        {
            let counter = if inline {
                &self.inline
            } else {
                &self.handed_off
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// How many calls ran inline, and how many under `block_in_place`.
    #[cfg(feature = "_internal-tests")]
    pub(super) fn counts(&self) -> (u64, u64) {
        (
            self.inline.load(Ordering::Relaxed),
            self.handed_off.load(Ordering::Relaxed),
        )
    }
}

/// Whether a site whose estimate is `estimate` (`None`: never seen) runs inline under
/// `limit`: only a site seen before and faster than the limit lately. A zero limit runs
/// nothing inline.
fn runs_inline(estimate: Option<Duration>, limit: Duration) -> bool {
    estimate.is_some_and(|estimate| estimate < limit)
}

/// How much of a site's estimate each new call replaces: after a slow call, the estimate
/// falls by an eighth of the way to the fast calls' time with each of them (a call of 10 ms
/// at a site whose calls take 0.1 ms, against a 1 ms limit: 18 calls under `block_in_place`
/// before the site runs inline again; after one of 1 s, 53).
const DECAY: u32 = 8;

/// A site's estimate after a call that took `took`, from `estimate`: the larger of the call
/// and a moving average. One slow call sends the site back to `block_in_place` at once;
/// it runs inline again only after a run of fast calls has brought the average down.
fn next_estimate(estimate: Duration, took: Duration) -> Duration {
    let average = estimate - estimate / DECAY + took / DECAY;
    average.max(took)
}

/// Times `f`.
fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let started = Instant::now();
    let output = f();
    (output, started.elapsed())
}

impl Shared {
    /// Runs `f`, which blocks (SQLite's statements, a commit's fsync), on the calling thread.
    ///
    /// On a worker of a multi-thread runtime: inline if `site`'s calls have been fast lately
    /// (see the module docs), else under `block_in_place`, which hands the worker's queued
    /// tasks to another thread meanwhile (the task in its LIFO slot included, which no other
    /// worker may steal: the server's accept loop, say, whose new connections would otherwise
    /// wait for the whole statement, however long the handler makes it). Either way the call
    /// is timed, for `site`'s estimate. Elsewhere (a blocking thread, no runtime) at once.
    fn blocking<T>(&self, site: TypeId, f: impl FnOnce() -> T) -> T {
        match tokio::runtime::Handle::try_current() {
            Ok(runtime)
                if runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread =>
            {
                let inline = self.sites.runs_inline(site);
                self.sites.count(inline);
                let (output, took) = if inline {
                    timed(f)
                } else {
                    tokio::task::block_in_place(|| timed(f))
                };
                self.sites.record(site, took);
                output
            }
            _ => f(),
        }
    }
}

impl TxShared {
    /// Runs `f` with the slot of the writer this request holds in place: at once, unless
    /// another task of the request is using it (a handler's spawned task), then on the
    /// blocking pool. [`Error::TransactionFinished`] if the request does not run in place.
    /// `site` names the call for the store's [`CallSites`], which decide whether it may
    /// block the worker it runs on.
    pub(super) async fn with_lent<T, F>(self: &Arc<Self>, site: TypeId, f: F) -> Result<T, Error>
    where
        F: FnOnce(&mut Option<Box<Writer>>) -> Result<T, Error> + Send + 'static,
        T: Send + 'static,
    {
        let Some(lent) = self.in_place.as_ref() else {
            return Err(Error::TransactionFinished);
        };
        match lent.try_lock() {
            Ok(mut writer) => return self.store.blocking(site, || f(&mut writer)),
            Err(TryLockError::Poisoned(poisoned)) => {
                return self.store.blocking(site, || f(&mut poisoned.into_inner()))
            }
            Err(TryLockError::WouldBlock) => {}
        }
        let tx = self.clone();
        tokio::task::spawn_blocking(move || {
            let Some(lent) = tx.in_place.as_ref() else {
                return Err(Error::TransactionFinished);
            };
            let mut writer = lent.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            // Off the runtime's workers anyway; timed all the same, for the site's estimate.
            let (output, took) = timed(|| f(&mut writer));
            tx.store.sites.record(site, took);
            output
        })
        .await
        .map_err(|_| Error::Panicked)?
    }

    /// Rolls back the request's savepoint and gives the writer back (a reservation dropped
    /// without its end). Waits for no lock on the calling thread: if another task of the
    /// request is using the writer, it is done on the blocking pool (or a thread of its own,
    /// outside a runtime) once that task is done.
    pub(super) fn roll_back_lent(self: &Arc<Self>) {
        let Some(lent) = self.in_place.as_ref() else {
            return;
        };
        let generation = self.generation;
        let roll_back = move |store: &Shared, lent: &mut Option<Box<Writer>>| {
            if let Some(mut writer) = lent.take() {
                if writer.active == Some(generation) {
                    writer.rollback_request();
                    tracing::debug!("idempotency transaction rolled back");
                }
                writer.after_job();
                store.return_writer(writer);
            }
        };
        match lent.try_lock() {
            Ok(mut writer) => return roll_back(&self.store, &mut writer),
            Err(TryLockError::Poisoned(poisoned)) => {
                return roll_back(&self.store, &mut poisoned.into_inner())
            }
            Err(TryLockError::WouldBlock) => {}
        }
        let tx = self.clone();
        let later = move || {
            if let Some(lent) = tx.in_place.as_ref() {
                let mut writer = lent.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                roll_back(&tx.store, &mut writer);
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn_blocking(later)),
            Err(_) => drop(std::thread::spawn(later)),
        }
    }
}

impl SqliteStore {
    /// Runs the request in place if the writer is idle (see the module docs), reading its
    /// record first (in place too) with `look_up_first`. Gives `work` back when it has to
    /// queue instead.
    pub(super) async fn try_run_in_place<W, F>(
        &self,
        scope: &Scope,
        now: SystemTime,
        work: W,
        look_up_first: bool,
        alone: bool,
    ) -> InPlace<W, F::Output>
    where
        W: FnOnce(SqliteReservation) -> F + Send + 'static,
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let shared = &self.shared;
        if inside_request(shared.id) {
            return InPlace::Done(Err(Error::InsideRequest(NESTED_REQUEST)));
        }
        let mut looked_up = false;
        // While retries are rare, a request that finds the writer idle skips the read: the
        // reservation finds a completed record itself (and answers it without a commit).
        let mut writer = None;
        if look_up_first && !shared.retries.frequent() {
            writer = shared.take_idle_writer();
        }
        if look_up_first && writer.is_none() {
            match shared.try_read_live_record_in_place(scope, now) {
                Some(Ok(Some(record))) => return InPlace::Done(Ok(RunOutcome::Found { record })),
                Some(Ok(None)) => looked_up = true,
                Some(Err(error)) => {
                    // The begin reads again, authoritatively.
                    tracing::warn!(%error, "idempotency fast-path lookup failed");
                    looked_up = true;
                }
                // No idle reader: read on the blocking pool, as before (a replay never needs
                // the writer).
                None => return InPlace::Queue { work, looked_up },
            }
        }
        let Some(mut writer) = writer.or_else(|| shared.take_idle_writer()) else {
            return InPlace::Queue { work, looked_up };
        };
        let generation = shared.generations.fetch_add(1, Ordering::Relaxed);
        let reserved = std::panic::catch_unwind(AssertUnwindSafe(|| {
            writer.reserve_scope_in_place(generation, scope, to_unix_millis(now), alone)
        }))
        .unwrap_or(Err(Error::Panicked));
        match reserved {
            Ok(None) => {}
            // Another process holds SQLite's write lock: the writer thread waits for it.
            Err(Error::Busy) => {
                shared.return_writer(writer);
                return InPlace::Queue { work, looked_up };
            }
            Err(error) => {
                writer.after_job();
                shared.return_writer(writer);
                if look_up_first && !looked_up {
                    // The read was skipped: a record it finds (the file cannot take writes,
                    // say) is replayed rather than the error answered.
                    match shared.try_read_live_record_in_place(scope, now) {
                        Some(Ok(Some(record))) => {
                            return InPlace::Done(Ok(RunOutcome::Found { record }))
                        }
                        Some(_) => {}
                        // No idle reader: the queued begin reads first, on a reader thread.
                        None => return InPlace::Queue { work, looked_up },
                    }
                }
                return InPlace::Done(Err(error));
            }
            // The group was opened here, for this request alone: the record is committed.
            Ok(Some(record)) => {
                writer.after_job();
                shared.return_writer(writer);
                return InPlace::Done(Ok(RunOutcome::Existing {
                    record,
                    waited: Duration::ZERO,
                }));
            }
        }
        let reservation = SqliteReservation::in_place(shared, scope, generation, writer);
        let tx = reservation.tx.clone();
        // Boxed: allocated only by a request that runs its work here, rather than sizing
        // every request's future (see `run_on_writer`). A replay found above allocates none.
        let output = Box::pin(IN_PLACE.scope(tx, work(reservation))).await;
        InPlace::Done(Ok(RunOutcome::Ran {
            output,
            waited: Duration::ZERO,
        }))
    }
}

impl SqliteStore {
    /// How many blocking calls of requests run in place ran inline, and how many under
    /// `block_in_place` (see the module docs), since the store opened. Not part of the API:
    /// only with the undocumented `_internal-tests` feature, for this repository's tests,
    /// which observe the choice without timing anything.
    #[cfg(feature = "_internal-tests")]
    #[doc(hidden)]
    pub fn __blocking_calls(&self) -> (u64, u64) {
        self.shared.sites.counts()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: Duration = Duration::from_micros(100);
    const FAST: Duration = Duration::from_micros(10);
    const SLOW: Duration = Duration::from_millis(3);

    #[test]
    fn a_site_never_seen_is_handed_off() {
        assert!(!runs_inline(None, LIMIT));
    }

    #[test]
    fn a_site_seen_fast_runs_inline_and_one_at_or_over_the_limit_does_not() {
        assert!(runs_inline(Some(FAST), LIMIT));
        assert!(!runs_inline(Some(LIMIT), LIMIT));
        assert!(!runs_inline(Some(SLOW), LIMIT));
    }

    #[test]
    fn a_zero_limit_runs_nothing_inline() {
        assert!(!runs_inline(Some(Duration::ZERO), Duration::ZERO));
        assert!(!runs_inline(Some(FAST), Duration::ZERO));
    }

    #[test]
    fn one_slow_call_hands_a_fast_site_off_at_once() {
        let mut estimate = FAST;
        for _ in 0..1000 {
            estimate = next_estimate(estimate, FAST);
        }
        assert!(runs_inline(Some(estimate), LIMIT));
        estimate = next_estimate(estimate, SLOW);
        assert!(estimate >= SLOW, "{estimate:?}");
        assert!(!runs_inline(Some(estimate), LIMIT));
    }

    #[test]
    fn a_slow_site_runs_inline_again_after_a_while_of_fast_calls() {
        let mut estimate = next_estimate(FAST, SLOW);
        let mut fast_calls = 0;
        while !runs_inline(Some(estimate), LIMIT) {
            estimate = next_estimate(estimate, FAST);
            fast_calls += 1;
            assert!(fast_calls < 1000, "never decays: {estimate:?}");
        }
        // Not at the first fast call: the site has to stay fast for a while (an eighth of
        // the way down each call: about 26 calls from 3 ms to 100 µs).
        assert!((20..40).contains(&fast_calls), "{fast_calls}");
        // And a slow call on the way down starts it over.
        let again = next_estimate(next_estimate(estimate, SLOW), FAST);
        assert!(!runs_inline(Some(again), LIMIT));
    }

    #[test]
    fn call_sites_learn_per_site_and_only_under_a_limit() {
        struct Fast;
        struct Slow;
        let sites = CallSites::new(LIMIT);
        let (fast, slow) = (TypeId::of::<Fast>(), TypeId::of::<Slow>());
        assert!(!sites.runs_inline(fast));
        sites.record(fast, FAST);
        sites.record(slow, SLOW);
        assert!(sites.runs_inline(fast));
        assert!(!sites.runs_inline(slow));
        sites.record(fast, SLOW);
        assert!(!sites.runs_inline(fast));

        let never = CallSites::new(Duration::ZERO);
        never.record(fast, FAST);
        assert!(!never.runs_inline(fast));
    }
}
