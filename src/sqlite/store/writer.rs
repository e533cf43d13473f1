//! The writer thread: the one thread that owns the writer connection, and its job queue.
//!
//! Every statement on the writer connection runs here. [`Job`]s arrive through the store's
//! channel: steps of the transaction that owns the writer run at once, [`Exclusive`] jobs (a
//! request's begin, a standalone write) wait until no request's transaction owns it, and wakes
//! poll a request's work again (`executor`). The [`Writer`] lives in a thread-local while the
//! thread runs, so that a handler's statement issued from work polled here runs at once
//! ([`run_if_on_writer`]) rather than through the queue. What a job does with the writer is
//! written elsewhere: group commit in `group`, the store's transaction control in
//! `authorizer`, the checks against other processes in `file`.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rusqlite::Connection;
use tokio::sync::oneshot;

use super::authorizer::{ControlGuard, ControlSql};
use super::executor::Driven;
use super::file::{BusyWait, DatabaseFile, OtherWriters};
use super::group::Group;
use super::in_place::inside_request_in_place;
use super::options::GroupLimits;
use super::reservation::TxShared;
use super::Shared;
use crate::error::Error;

/// Work for the writer thread.
pub(super) enum Job {
    /// A step of the transaction that owns the writer (a handler's statement, the request's
    /// end), or of one that has ended (it then only reports so): runs at once, in order.
    Step(Step),
    /// Work that needs the writer to itself (a request's begin, a standalone write): runs in
    /// arrival order, each once no request's transaction owns the writer.
    Exclusive(Exclusive),
    /// Polls the work of the request with this generation again (see
    /// [`DrivenWaker`](super::executor::DrivenWaker)).
    Wake(u64),
    /// The writer, back from a request that ran in place (see `in_place`) and could not put
    /// it in the [`IdleWriter`] slot (the thread wanted it, a group is open, or the slot was
    /// locked for a moment).
    Return(Box<Writer>),
}

/// Where the writer thread leaves the writer while it has nothing to do, so that a request
/// can run its transaction in place, on its own task (see `in_place`).
#[derive(Default)]
pub(super) struct IdleWriter {
    /// The idle writer, or `None` while the thread or a request holds it.
    pub(super) writer: Option<Box<Writer>>,
    /// The thread waits for it: a request gives it back through the queue
    /// ([`Job::Return`]), which wakes the thread, rather than through the slot.
    pub(super) wanted: bool,
}

/// Something to run on the writer thread, with the writer.
pub(super) type Step = Box<dyn FnOnce(&mut Writer) + Send>;

/// A job that needs the writer to itself.
pub(super) struct Exclusive {
    /// Counts it in [`Writer::queued`] until it starts (or is dropped).
    ticket: QueueTicket,
    step: Step,
    /// A request's begin: skipped, and dropped early, once the request stops waiting.
    request: Option<Arc<TxShared>>,
}

impl Exclusive {
    fn is_abandoned(&self) -> bool {
        self.request
            .as_ref()
            .is_some_and(|tx| tx.finished.load(Ordering::Acquire))
    }
}

/// What lives on the writer thread.
pub(super) struct Writer {
    pub(super) conn: Connection,
    /// The generation of the request whose savepoint is open, if any.
    pub(super) active: Option<u64>,
    /// Whether the active request has a savepoint of its own; not when it opened the group
    /// transaction, which then holds its work alone (see `group`).
    pub(super) savepoint: bool,
    /// The open group transaction, if any.
    pub(super) group: Option<Group>,
    pub(super) limits: GroupLimits,
    /// How many exclusive jobs (requests' begins, mostly) wait for the writer.
    pub(super) queued: Arc<AtomicUsize>,
    /// When the active request's savepoint opened.
    pub(super) request_started: Option<Instant>,
    /// A moving average of how long requests hold the writer: a group only waits for the
    /// next request if that fits in the group delay.
    pub(super) typical_hold: Duration,
    /// The database file the connection opened.
    pub(super) file: DatabaseFile,
    /// The state of the connection's busy handler.
    pub(super) busy: Arc<Mutex<BusyWait>>,
    /// Whether another process writes to the file too.
    pub(super) other_writers: OtherWriters,
    /// Which store this is (see [`Shared::id`]).
    pub(super) store_id: u64,
    /// Requests' work started by the last job, for the thread to poll.
    pub(super) started: Vec<Driven>,
    /// What the authorizer reads: whether the store runs its own transaction control.
    pub(super) control: Arc<ControlGuard>,
    pub(super) sql: ControlSql,
}

impl Writer {
    /// Runs a job's step; a panic ends the step, not the thread.
    pub(super) fn run(&mut self, step: Step) {
        // A panicking step drops its reply channel, which its caller reports as
        // `Error::Panicked`; the thread and the connection go on serving.
        let _ = std::panic::catch_unwind(AssertUnwindSafe(|| step(self)));
        self.after_job();
    }
}

/// A place in the writer's queue, given up when dropped.
struct QueueTicket(Arc<AtomicUsize>);

impl Drop for QueueTicket {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

thread_local! {
    /// On a writer thread, its store's writer. Jobs borrow it, and so do the statements of a
    /// request whose work the thread polls: they run at once, without a round trip.
    static WRITER: RefCell<Option<Writer>> = const { RefCell::new(None) };
}

/// What a begin queued from inside a request's work is called in [`Error::InsideRequest`].
pub(super) const NESTED_REQUEST: &str = "an idempotent request nested in another on the same store";

/// Whether this is the writer thread of store `id`, polling the work of a request that holds
/// the writer (a handler's code, under the layer), or the task of a request of store `id`
/// that holds the writer in place.
pub(super) fn inside_request(id: u64) -> bool {
    inside_request_in_place(id)
        || WRITER.with(|cell| {
            cell.try_borrow().is_ok_and(|writer| {
                writer
                    .as_ref()
                    .is_some_and(|writer| writer.store_id == id && writer.active.is_some())
            })
        })
}

/// Runs `f` with this thread's writer; `None` on any other thread (or while it is borrowed).
fn with_writer<T>(f: impl FnOnce(&mut Writer) -> T) -> Option<T> {
    WRITER.with(|cell| {
        let mut writer = cell.try_borrow_mut().ok()?;
        writer.as_mut().map(f)
    })
}

/// Runs `f` at once, as a job, if this is the writer thread of store `id` (and its writer is
/// free); gives `f` back otherwise, to be sent to the writer thread.
pub(super) fn run_if_on_writer<T, F>(id: u64, f: F) -> Result<T, F>
where
    F: FnOnce(&mut Writer) -> T,
{
    WRITER.with(|cell| {
        let Ok(mut writer) = cell.try_borrow_mut() else {
            return Err(f);
        };
        match writer.as_mut() {
            Some(writer) if writer.store_id == id => {
                let output = f(writer);
                writer.after_job();
                Ok(output)
            }
            _ => Err(f),
        }
    })
}

/// The writer thread: runs jobs in order, exclusive ones one at a time, polls the work of the
/// request that owns the writer, and commits groups when they are due.
pub(super) fn writer_thread(
    writer: Writer,
    receiver: &mpsc::Receiver<Job>,
    idle: &Mutex<IdleWriter>,
) {
    WRITER.with(|cell| *cell.borrow_mut() = Some(writer));
    // Jobs that arrived while a request running in place held the writer.
    let mut backlog: VecDeque<Job> = VecDeque::new();
    // Exclusive jobs that arrived while a request's transaction owned the writer.
    let mut waiting: VecDeque<Exclusive> = VecDeque::new();
    // Requests' work being polled here (the owner's, and ones awaiting their group's commit).
    let mut driven: Vec<Driven> = Vec::new();
    loop {
        // Work started by the last job: poll it at once (outside the writer's borrow, since
        // its statements borrow the writer).
        let started = with_writer(|writer| std::mem::take(&mut writer.started)).unwrap_or_default();
        for mut work in started {
            if !work.poll() {
                driven.push(work);
            }
        }
        // The next request starts as soon as the last one ended: no hand-off in between.
        if with_writer(|writer| writer.active.is_none()).unwrap_or(true) {
            if let Some(Exclusive { ticket, step, .. }) = waiting.pop_front() {
                drop(ticket);
                with_writer(|writer| writer.run(step));
                continue;
            }
        }
        // A request in progress, or the next member of an open group, sends its job within
        // microseconds: waiting for it briefly (yielding the CPU) is cheaper than parking the
        // thread and being woken. An idle writer parks at once: nothing is on its way, and
        // spinning would only burn a core between requests.
        let busy = with_writer(|writer| writer.active.is_some() || writer.group.is_some())
            .unwrap_or(false);
        let spin = if busy {
            with_writer(|writer| writer.flush_deadline())
                .flatten()
                .map_or(JOB_SPIN, |due| due.min(JOB_SPIN))
        } else {
            Duration::ZERO
        };
        let job = match backlog.pop_front() {
            Some(job) => Some(job),
            None => spin_for_job(receiver, spin),
        };
        let job = match job {
            Some(job) => Some(job),
            None => match with_writer(|writer| writer.flush_deadline()).flatten() {
                // Idle: nothing open, nothing waiting. Lend the writer to whichever request
                // comes first (in place) while parked, and take it back for the next job.
                None if !busy && waiting.is_empty() && driven.is_empty() => {
                    lend(idle);
                    match receiver.recv() {
                        // The request that took it gave it back with a group open.
                        Ok(Job::Return(writer)) => {
                            take_back(idle, *writer);
                            continue;
                        }
                        Ok(job) => {
                            reclaim(idle, receiver, &mut backlog);
                            Some(job)
                        }
                        Err(mpsc::RecvError) => None,
                    }
                }
                None => receiver.recv().ok(),
                Some(wait) => match receiver.recv_timeout(wait) {
                    Ok(job) => Some(job),
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        with_writer(Writer::flush);
                        continue;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => None,
                },
            },
        };
        // Ends when every sender (the store and all transactions) is gone.
        let Some(job) = job else { break };
        match job {
            Job::Step(step) => {
                with_writer(|writer| writer.run(step));
            }
            Job::Exclusive(job) => {
                let owned = with_writer(|writer| writer.active.is_some()).unwrap_or(false);
                if owned || !waiting.is_empty() {
                    // Requests that gave up (their lock timeout passed) while a long
                    // transaction held the writer leave now, with what they hold.
                    waiting.retain(|queued| !queued.is_abandoned());
                    waiting.push_back(job);
                } else {
                    drop(job.ticket);
                    with_writer(|writer| writer.run(job.step));
                }
            }
            // Sent only while the writer is lent, which is handled above; kept if it comes.
            Job::Return(writer) => take_back(idle, *writer),
            Job::Wake(generation) => {
                if let Some(at) = driven.iter().position(|work| work.generation == generation) {
                    if driven[at].poll() {
                        driven.swap_remove(at);
                    }
                }
            }
        }
    }
    // Cancelled work rolls back through jobs nobody reads any more: end what is open here.
    drop(driven);
    drop(waiting);
    drop(backlog);
    if let Some(writer) = idle.lock().ok().and_then(|mut slot| slot.writer.take()) {
        take_back(idle, *writer);
    }
    with_writer(Writer::settle);
}

/// Puts the writer back in the thread-local.
fn take_back(idle: &Mutex<IdleWriter>, writer: Writer) {
    if let Ok(mut slot) = idle.lock() {
        slot.wanted = false;
    }
    WRITER.with(|cell| *cell.borrow_mut() = Some(writer));
}

/// Leaves the writer (from the thread-local) in the `idle` slot.
fn lend(idle: &Mutex<IdleWriter>) {
    let Some(writer) = WRITER.with(|cell| cell.borrow_mut().take()) else {
        return;
    };
    match idle.lock() {
        Ok(mut slot) => {
            slot.writer = Some(Box::new(writer));
            slot.wanted = false;
        }
        // Never poisoned (nothing panics under it); keep the writer here if it is.
        Err(_) => WRITER.with(|cell| *cell.borrow_mut() = Some(writer)),
    }
}

/// Takes the writer back from the `idle` slot into the thread-local; if a request running in
/// place holds it, waits for it to come back through the queue, keeping the jobs that arrive
/// meanwhile in `backlog` (in order). The thread may wait here: it is not an async thread.
fn reclaim(idle: &Mutex<IdleWriter>, receiver: &mpsc::Receiver<Job>, backlog: &mut VecDeque<Job>) {
    if WRITER.with(|cell| cell.borrow().is_some()) {
        return;
    }
    let lent = match idle.lock() {
        Ok(mut slot) => match slot.writer.take() {
            Some(writer) => Some(writer),
            None => {
                slot.wanted = true;
                None
            }
        },
        Err(_) => None,
    };
    let writer = match lent {
        Some(writer) => writer,
        None => loop {
            match receiver.recv() {
                Ok(Job::Return(writer)) => break writer,
                Ok(job) => backlog.push_back(job),
                // Every sender is gone, the request's with it: nothing comes back.
                Err(mpsc::RecvError) => return,
            }
        },
    };
    take_back(idle, *writer);
}

/// How long the writer thread polls for its next job before it parks.
const JOB_SPIN: Duration = Duration::from_micros(50);

/// The next job if one arrives within `spin` (at most [`JOB_SPIN`]; less when the open group
/// is due sooner).
fn spin_for_job(receiver: &mpsc::Receiver<Job>, spin: Duration) -> Option<Job> {
    let started = Instant::now();
    loop {
        match receiver.try_recv() {
            Ok(job) => return Some(job),
            Err(mpsc::TryRecvError::Disconnected) => return None,
            Err(mpsc::TryRecvError::Empty) if started.elapsed() >= spin => return None,
            Err(mpsc::TryRecvError::Empty) => std::thread::yield_now(),
        }
    }
}

impl Shared {
    /// Sends `f` to the writer thread as a step of the transaction that owns the writer, and
    /// waits for its answer. Only the owner of the open transaction sends steps, so steps of
    /// different transactions never interleave.
    pub(super) async fn call<T, F>(&self, f: F) -> Result<T, Error>
    where
        F: FnOnce(&mut Writer) -> Result<T, Error> + Send + 'static,
        T: Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        self.jobs
            .send(Job::Step(Box::new(move |writer| {
                let _ = reply.send(f(writer));
            })))
            .map_err(|_| Error::Closed)?;
        answer.await.map_err(|_| Error::Panicked)?
    }

    /// Queues `step` to run once the writer is free of other transactions. The job counts in
    /// `queued` from now until it starts, so that a group does not commit early while the
    /// next request is about to join it.
    ///
    /// Refused at once ([`Error::InsideRequest`], naming `what`) when called from the work of
    /// a request that holds this store's writer: the job would wait for that request to end,
    /// and the request for the job.
    pub(super) fn send_exclusive(
        &self,
        step: Step,
        request: Option<Arc<TxShared>>,
        what: &'static str,
    ) -> Result<(), Error> {
        if inside_request(self.id) {
            return Err(Error::InsideRequest(what));
        }
        self.queued.fetch_add(1, Ordering::AcqRel);
        let ticket = QueueTicket(self.queued.clone());
        self.jobs
            .send(Job::Exclusive(Exclusive {
                ticket,
                step,
                request,
            }))
            .map_err(|_| Error::Closed)
    }

    /// Runs `f` with the writer to itself, and waits for its answer. `what` names the call
    /// in the error a call from inside a request gets (see [`Shared::send_exclusive`]).
    pub(super) async fn call_exclusive<T, F>(&self, what: &'static str, f: F) -> Result<T, Error>
    where
        F: FnOnce(&mut Writer) -> Result<T, Error> + Send + 'static,
        T: Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        self.send_exclusive(
            Box::new(move |writer| {
                let _ = reply.send(f(writer));
            }),
            None,
            what,
        )?;
        answer.await.map_err(|_| Error::Panicked)?
    }
}
