//! Runs a request's work on the writer thread: the SQLite store's
//! [`IdempotencyStore::begin_and_run`] and [`IdempotencyStore::lookup_then_begin_and_run`].
//!
//! `queue_begin` queues the request's begin (from a reader thread after the fast-path
//! read, see `reader`, when it looks up first); the begin, run by the writer thread (`writer`)
//! with group commit's `reserve_scope` (`group`), either answers with a record it found or
//! starts the work (the layer's handler call and commit, given a [`SqliteReservation`]) as
//! [`Driven`] work. The writer thread polls it with the request's tokio runtime entered, and a
//! [`DrivenWaker`] queues the next poll as a job. [`DrivenWork`] sends the work's output back
//! to the request, and ends the work once the request stops waiting for it.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::oneshot;
use tracing::Instrument;

use super::group::Member;
use super::in_place::InPlace;
use super::reservation::{SqliteReservation, TxShared};
use super::writer::{inside_request, Job, Step, Writer, NESTED_REQUEST};
use super::{Shared, SqliteStore};
use crate::error::Error;
#[cfg(doc)]
use crate::store::IdempotencyStore;
use crate::store::{
    begin_and_run_in_place, lookup_then, run_after_begin, to_unix_millis, RunOutcome, Scope,
    StoredRecord,
};

/// A queued begin's answer to come, its state (see [`BEGIN_WAITING`]), and what cancels it
/// if the request stops waiting.
type QueuedAnswer<T> = (
    oneshot::Receiver<Result<RunOutcome<T>, Error>>,
    Arc<AtomicU8>,
    CancelOnDrop,
);

/// How a begin queued for the writer thread runs.
#[derive(Clone, Copy)]
struct QueuedBegin {
    /// Read the record on a reader thread first.
    look_up_first: bool,
    /// In a group of its own (see `group`).
    alone: bool,
}

impl SqliteStore {
    /// [`IdempotencyStore::begin_and_run`] (with `look_up_first`,
    /// [`IdempotencyStore::lookup_then_begin_and_run`]) on the writer thread where there is a
    /// tokio runtime to serve the work, in place otherwise.
    pub(super) fn run_on_writer<W, F>(
        &self,
        scope: &Scope,
        lock_timeout: Duration,
        now: SystemTime,
        work: W,
        look_up_first: bool,
    ) -> impl Future<Output = Result<RunOutcome<F::Output>, Error>> + Send + 'static
    where
        W: FnOnce(SqliteReservation) -> F + Send + 'static,
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let runtime = tokio::runtime::Handle::try_current().ok();
        let store = self.clone();
        let scope = scope.clone();
        // `begin_and_run` is the layer's rerun of a request another member's failure rolled
        // back: it runs in a group of its own, so that no other request can roll it back again.
        let alone = !look_up_first;
        async move {
            let outcome = match (runtime, look_up_first) {
                (Some(runtime), _) => 'run: {
                    // In place if the writer is idle; else queued, without reading again. Only
                    // on a multi-thread runtime: there a statement in place hands the thread's
                    // other tasks to another thread while it runs (see `in_place`); a
                    // current-thread runtime has no other thread to serve them.
                    let in_place = store.shared.write_in_place
                        && runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread;
                    let (work, look_up_first) = if in_place {
                        match store
                            .try_run_in_place(&scope, now, work, look_up_first, alone)
                            .await
                        {
                            InPlace::Done(outcome) => break 'run outcome,
                            InPlace::Queue { work, looked_up } => {
                                (work, look_up_first && !looked_up)
                            }
                        }
                    } else {
                        (work, look_up_first)
                    };
                    // Queued now; what is awaited holds only the wait, not the work (which
                    // the begin took), so a request in the writer's queue holds no second
                    // copy of it.
                    let queued = store.queue_begin(
                        scope,
                        lock_timeout,
                        now,
                        work,
                        runtime,
                        QueuedBegin {
                            look_up_first,
                            alone,
                        },
                    );
                    answer_of(queued, lock_timeout).await
                }
                // Boxed, as is the work in `try_run_in_place`: the work (the handler's call)
                // runs inside these futures. Unboxed, their largest state would size this
                // future, and with it every request's, also while a request only waits in the
                // writer's queue.
                (None, false) => {
                    Box::pin(run_after_begin(
                        || store.begin_with(&scope, lock_timeout, now, alone),
                        work,
                    ))
                    .await
                }
                (None, true) => {
                    Box::pin(lookup_then(&store, &scope, now, || {
                        begin_and_run_in_place(&store, &scope, lock_timeout, now, work)
                    }))
                    .await
                }
            };
            if look_up_first {
                store.shared.retries.observe(&outcome);
            }
            outcome
        }
    }

    /// [`IdempotencyStore::begin_and_run`] with the work polled on the writer thread; with
    /// `look_up_first`, [`IdempotencyStore::lookup_then_begin_and_run`]: the fast-path read
    /// runs on a reader thread, which queues the begin itself when it finds no record, so that
    /// the request is woken once, by the answer, rather than once more between the two.
    ///
    /// Queues the begin at once; returns where its answer comes, the begin's state, and what
    /// cancels it if the request stops waiting ([`answer_of`] waits for it).
    fn queue_begin<W, F>(
        &self,
        scope: Scope,
        lock_timeout: Duration,
        now: SystemTime,
        work: W,
        runtime: tokio::runtime::Handle,
        QueuedBegin {
            look_up_first,
            alone,
        }: QueuedBegin,
    ) -> Result<QueuedAnswer<F::Output>, Error>
    where
        W: FnOnce(SqliteReservation) -> F + Send + 'static,
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let queued_at = Instant::now();
        let deadline = queued_at + lock_timeout;
        // Moved into the begin: whatever happens to it (skipped, failed, dropped with the
        // queue), its drop queues the rollback of whatever it began.
        let reservation = SqliteReservation::new(&self.shared, &scope);
        let generation = reservation.tx.generation;
        let tx = reservation.tx.clone();
        // If this future is dropped before the work is done, the begin is skipped and the
        // handles refuse work; the work itself ends when it sees `answer` go.
        let cancel = CancelOnDrop(tx.clone());
        let span = tracing::Span::current();
        let store = Arc::downgrade(&self.shared);
        let now_millis = to_unix_millis(now);
        let (reply, answer) = oneshot::channel::<Result<RunOutcome<F::Output>, Error>>();
        // Whether the begin started before the request gave up on its lock timeout: decided
        // once, by whichever side gets there first, with no wake-up of the request for it.
        let begin_state = Arc::new(AtomicU8::new(BEGIN_WAITING));
        let begin_started = begin_state.clone();
        let lookup_scope = look_up_first.then(|| scope.clone());
        // The begin, or (given the record the fast path found) the answer with that record.
        let start = move |found: Option<StoredRecord>| -> Option<Step> {
            if let Some(record) = found {
                // Nothing began: no rollback to queue for the writer.
                let mut reservation = reservation;
                reservation.close();
                let _ = reply.send(Ok(RunOutcome::Found { record }));
                return None;
            }
            Some(Box::new(move |writer: &mut Writer| {
                let started = begin_started.compare_exchange(
                    BEGIN_WAITING,
                    BEGIN_STARTED,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
                if started.is_err() || tx.finished.load(Ordering::Acquire) {
                    return;
                }
                let waited = queued_at.elapsed();
                match writer.reserve_scope(generation, deadline, &scope, now_millis, alone) {
                    Ok(Some(record)) => writer.on_commit(Member {
                        scope,
                        saved: false,
                        notify: Box::new(move |outcome| {
                            let _ = reply
                                .send(outcome.map(|()| RunOutcome::Existing { record, waited }));
                        }),
                    }),
                    Ok(None) => {
                        let work = DrivenWork {
                            work: work(reservation).instrument(span),
                            reply: Some(reply),
                            waited,
                        };
                        writer.started.push(Driven {
                            generation,
                            future: Box::pin(work),
                            runtime,
                            waker: Arc::new(DrivenWaker {
                                generation,
                                store,
                                queued: AtomicBool::new(false),
                            }),
                        });
                    }
                    Err(error) => {
                        let _ = reply.send(Err(error));
                    }
                }
            }))
        };
        match lookup_scope {
            None => {
                if let Some(begin) = start(None) {
                    self.shared
                        .send_exclusive(begin, Some(cancel.0.clone()), NESTED_REQUEST)?;
                }
            }
            Some(lookup_scope) => {
                // The check `send_exclusive` makes needs this thread (the reader's is not it).
                if inside_request(self.shared.id) {
                    return Err(Error::InsideRequest(NESTED_REQUEST));
                }
                // The answer comes through `answer`, from the reader thread or the begin.
                self.shared
                    .look_up_then_queue(lookup_scope, now, cancel.0.clone(), start);
            }
        }
        Ok((answer, begin_state, cancel))
    }
}

/// The answer to a begin [`SqliteStore::queue_begin`] queued: within `lock_timeout` for the
/// begin to start (else [`Error::Busy`]), then for as long as the work runs.
async fn answer_of<T>(
    queued: Result<QueuedAnswer<T>, Error>,
    lock_timeout: Duration,
) -> Result<RunOutcome<T>, Error> {
    let (mut answer, begin_state, _cancel) = queued?;
    // The lock timeout bounds the wait for the begin, not the work after it.
    let answered = match tokio::time::timeout(lock_timeout, &mut answer).await {
        Ok(answered) => answered,
        Err(_elapsed) => {
            let gave_up = begin_state.compare_exchange(
                BEGIN_WAITING,
                BEGIN_GAVE_UP,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
            if gave_up.is_ok() {
                return Err(Error::Busy);
            }
            // The begin started in time: wait for the work.
            answer.await
        }
    };
    answered.map_err(|_| Error::Panicked)?
}

/// A request's begin has not started on the writer yet.
const BEGIN_WAITING: u8 = 0;
/// It started (in time).
const BEGIN_STARTED: u8 = 1;
/// The request gave up waiting for it (its lock timeout passed): it will not start.
const BEGIN_GAVE_UP: u8 = 2;

/// Marks a request's transaction finished when the request stops waiting for it.
struct CancelOnDrop(Arc<TxShared>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.finished.store(true, Ordering::Release);
    }
}

/// A request's work, polled on the writer thread.
pub(super) struct Driven {
    pub(super) generation: u64,
    future: Pin<Box<dyn Future<Output = ()> + Send>>,
    /// The tokio runtime the request came from: its timers, I/O and `spawn` serve the work.
    runtime: tokio::runtime::Handle,
    waker: Arc<DrivenWaker>,
}

impl Driven {
    /// Polls the work once; `true` when it is done (finished, cancelled or panicked).
    pub(super) fn poll(&mut self) -> bool {
        self.waker.queued.store(false, Ordering::Release);
        let _runtime = self.runtime.enter();
        let waker = Waker::from(self.waker.clone());
        let mut cx = Context::from_waker(&waker);
        let future = self.future.as_mut();
        // A panic drops the work (rolling its transaction back) and its reply, which the
        // request reports as `Error::Panicked`.
        !matches!(
            std::panic::catch_unwind(AssertUnwindSafe(|| future.poll(&mut cx))),
            Ok(Poll::Pending)
        )
    }
}

/// Wakes driven work: queues a [`Job::Wake`] for it (once until it is polled).
pub(super) struct DrivenWaker {
    generation: u64,
    store: Weak<Shared>,
    queued: AtomicBool,
}

impl Wake for DrivenWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if self.queued.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(store) = self.store.upgrade() {
            let _ = store.jobs.send(Job::Wake(self.generation));
        }
    }
}

pin_project_lite::pin_project! {
    /// A request's work and where its outcome goes; ends early, dropping the work (and with
    /// it the transaction, which rolls back), once the request stops waiting for it.
    struct DrivenWork<F: Future> {
        #[pin]
        work: F,
        reply: Option<oneshot::Sender<Result<RunOutcome<F::Output>, Error>>>,
        waited: Duration,
    }
}

impl<F: Future> Future for DrivenWork<F> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.project();
        let Some(reply) = this.reply.as_mut() else {
            return Poll::Ready(());
        };
        if reply.poll_closed(cx).is_ready() {
            return Poll::Ready(());
        }
        let output = std::task::ready!(this.work.poll(cx));
        if let Some(reply) = this.reply.take() {
            let _ = reply.send(Ok(RunOutcome::Ran {
                output,
                waited: *this.waited,
            }));
        }
        Poll::Ready(())
    }
}
