//! Running a request's transaction in place: on the request's own task, with the writer the
//! writer thread left idle ([`SqliteOptions::with_write_in_place`](super::SqliteOptions::with_write_in_place)).
//!
//! When the writer thread has nothing to do (no transaction open, no group, nothing queued)
//! it leaves the writer in an [`IdleWriter`] slot before it parks (`writer`). A request's
//! first or next attempt (`executor`) takes it from there without waiting
//! ([`Shared::take_idle_writer`]: a `try_lock`, and only while no one is queued), begins
//! with no busy wait, and runs the layer's work on its own task: the handler's statements
//! ([`SqliteHandle::run`](super::SqliteHandle::run)) and the commit run inline,
//! as a hand-written handler's would, with no hand-over to another thread and back. Its end
//! (commit, rollback, drop) gives the writer back ([`Shared::return_writer`]): into the slot
//! if nothing waits for it, else through the queue, with the group still open if requests
//! queued meanwhile, so that they share its commit. Anything that would wait (the writer
//! busy, a request queued, another process's lock or a recent write by one) sends the
//! request to the writer thread as before.
//!
//! While it holds the writer, the request's task is marked ([`inside_request_in_place`]), so
//! that a nested request or a standalone write from its handler fails at once with
//! [`Error::InsideRequest`] rather than waiting for its own end.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::{Arc, TryLockError};
use std::time::{Duration, SystemTime};

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

/// Runs `f`, which blocks (SQLite's statements, a commit's fsync), on the calling thread
/// without holding up the runtime's other tasks: on a worker of a multi-thread runtime under
/// `block_in_place`, which hands the worker's queued tasks to another thread meanwhile (the
/// task in its LIFO slot included, which no other worker may steal: the server's accept loop,
/// say, whose new connections would otherwise wait for the whole statement, however long the
/// handler makes it). Elsewhere (a blocking thread, no runtime) at once.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) if runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

impl TxShared {
    /// Runs `f` with the slot of the writer this request holds in place: at once, unless
    /// another task of the request is using it (a handler's spawned task), then on the
    /// blocking pool. [`Error::TransactionFinished`] if the request does not run in place.
    pub(super) async fn with_lent<T, F>(self: &Arc<Self>, f: F) -> Result<T, Error>
    where
        F: FnOnce(&mut Option<Box<Writer>>) -> Result<T, Error> + Send + 'static,
        T: Send + 'static,
    {
        let Some(lent) = self.in_place.as_ref() else {
            return Err(Error::TransactionFinished);
        };
        match lent.try_lock() {
            Ok(mut writer) => return blocking(|| f(&mut writer)),
            Err(TryLockError::Poisoned(poisoned)) => {
                return blocking(|| f(&mut poisoned.into_inner()))
            }
            Err(TryLockError::WouldBlock) => {}
        }
        let tx = self.clone();
        tokio::task::spawn_blocking(move || {
            let Some(lent) = tx.in_place.as_ref() else {
                return Err(Error::TransactionFinished);
            };
            let mut writer = lent.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            f(&mut writer)
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
        let output = IN_PLACE.scope(tx, work(reservation)).await;
        InPlace::Done(Ok(RunOutcome::Ran {
            output,
            waited: Duration::ZERO,
        }))
    }
}
