//! The bound on the replay fast path's read, kept by one watchdog thread instead of a runtime
//! timer per read.
//!
//! A tokio timer armed while the runtime's other worker sleeps in the I/O driver with a later
//! deadline wakes that worker (an `eventfd` write, a wake-up, a new `epoll_wait`) only so that
//! it sleeps again with the earlier deadline. At low concurrency that happened on every replay
//! check, which almost always answers in well under a millisecond. Here a read registers with
//! a process-wide watchdog instead (a lock and a push), and the watchdog, which looks at the
//! reads in flight every [`TICK`], ends those past their bound: a read is given up between
//! `wait` and `wait + TICK` after it started, on any runtime (the watchdog only calls
//! wakers). While no read has been in flight for a while the watchdog sleeps until the next
//! one arrives.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_util::task::AtomicWaker;
use pin_project_lite::pin_project;

use crate::error::Error;

/// How often the watchdog looks at the reads in flight: how far past its bound a read may run.
pub(crate) const TICK: Duration = Duration::from_millis(20);
/// How many empty looks in a row before the watchdog sleeps until the next read (about 1 s):
/// under a steady load it keeps looking rather than being woken for every read.
const IDLE_TICKS: u32 = 50;

/// One bounded read, shared by its future and the watchdog.
struct Entry {
    deadline: Instant,
    /// The read gave up (set by the watchdog).
    expired: AtomicBool,
    /// The read ended, or its future was dropped: the watchdog forgets it.
    done: AtomicBool,
    waker: AtomicWaker,
}

#[derive(Default)]
struct Watchdog {
    reads: Mutex<Reads>,
    /// Wakes the watchdog when a read arrives while it sleeps.
    arrived: Condvar,
}

#[derive(Default)]
struct Reads {
    in_flight: Vec<Arc<Entry>>,
    /// The watchdog is waiting for `arrived`.
    sleeping: bool,
}

impl Watchdog {
    /// The process's watchdog, its thread started by the first read. `None` if the thread
    /// could not be started (the reads then go unbounded by it, and say so in the log once).
    fn get() -> Option<&'static Watchdog> {
        static WATCHDOG: OnceLock<Option<&'static Watchdog>> = OnceLock::new();
        *WATCHDOG.get_or_init(|| {
            let watchdog: &'static Watchdog = Box::leak(Box::default());
            let started = std::thread::Builder::new()
                .name("idempotency-read-bound".into())
                .spawn(move || watchdog.run());
            match started {
                Ok(_) => Some(watchdog),
                Err(error) => {
                    tracing::error!(%error, "could not start the replay check's watchdog; replay checks are not bounded");
                    None
                }
            }
        })
    }

    fn register(&self, entry: Arc<Entry>) {
        let Ok(mut reads) = self.reads.lock() else {
            return;
        };
        reads.in_flight.push(entry);
        if reads.sleeping {
            reads.sleeping = false;
            self.arrived.notify_one();
        }
    }

    fn run(&self) {
        let mut idle = 0u32;
        loop {
            std::thread::sleep(TICK);
            let Ok(mut reads) = self.reads.lock() else {
                return;
            };
            let now = Instant::now();
            reads.in_flight.retain(|entry| {
                if entry.done.load(Ordering::Acquire) {
                    return false;
                }
                if entry.deadline <= now {
                    entry.expired.store(true, Ordering::Release);
                    entry.waker.wake();
                    return false;
                }
                true
            });
            if !reads.in_flight.is_empty() {
                idle = 0;
                continue;
            }
            idle += 1;
            if idle < IDLE_TICKS {
                continue;
            }
            idle = 0;
            reads.sleeping = true;
            while reads.sleeping {
                reads = match self.arrived.wait(reads) {
                    Ok(reads) => reads,
                    Err(_) => return,
                };
            }
        }
    }
}

pin_project! {
    /// `read`, given up with [`Error::Busy`] once `wait` has passed (see the module docs).
    pub(crate) struct Bounded<F> {
        #[pin]
        read: F,
        entry: Option<Arc<Entry>>,
    }

    impl<F> PinnedDrop for Bounded<F> {
        fn drop(this: Pin<&mut Self>) {
            if let Some(entry) = this.project().entry.take() {
                entry.done.store(true, Ordering::Release);
            }
        }
    }
}

/// Bounds `read` by `wait` (give or take [`TICK`]) without a runtime timer.
pub(crate) fn bounded<T, F>(wait: Duration, read: F) -> Bounded<F>
where
    F: Future<Output = Result<T, Error>>,
{
    let entry = Watchdog::get().and_then(|watchdog| {
        // A bound too far away to represent is no bound.
        let deadline = Instant::now().checked_add(wait)?;
        let entry = Arc::new(Entry {
            deadline,
            expired: AtomicBool::new(false),
            done: AtomicBool::new(false),
            waker: AtomicWaker::new(),
        });
        watchdog.register(entry.clone());
        Some(entry)
    });
    Bounded { read, entry }
}

impl<T, F> Future for Bounded<F>
where
    F: Future<Output = Result<T, Error>>,
{
    type Output = Result<T, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Some(entry) = this.entry.as_ref() {
            entry.waker.register(cx.waker());
            if entry.expired.load(Ordering::Acquire) {
                entry.done.store(true, Ordering::Release);
                *this.entry = None;
                return Poll::Ready(Err(Error::Busy));
            }
        }
        let output = std::task::ready!(this.read.poll(cx));
        if let Some(entry) = this.entry.take() {
            entry.done.store(true, Ordering::Release);
        }
        Poll::Ready(output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_read_that_answers_is_not_touched() {
        let answer = bounded(Duration::from_secs(5), async { Ok::<_, Error>(7) }).await;
        assert_eq!(answer.ok(), Some(7));
    }

    #[tokio::test]
    async fn a_read_that_never_answers_is_given_up_after_its_wait() {
        let started = Instant::now();
        let read = bounded(
            Duration::from_millis(50),
            std::future::pending::<Result<(), Error>>(),
        );
        assert!(matches!(read.await, Err(Error::Busy)));
        assert!(started.elapsed() >= Duration::from_millis(50));
    }

    #[tokio::test]
    async fn a_bound_past_the_clock_s_range_is_no_bound() {
        let answer = bounded(Duration::MAX, async { Ok::<_, Error>(()) }).await;
        assert!(answer.is_ok());
    }

    #[test]
    fn many_reads_on_several_runtimes_each_get_their_answer_or_their_bound() {
        let handles: Vec<_> = (0..4)
            .map(|i| {
                std::thread::spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_time()
                        .build()
                        .expect("runtime");
                    runtime.block_on(async move {
                        let stuck = bounded(
                            Duration::from_millis(30 + i * 10),
                            std::future::pending::<Result<(), Error>>(),
                        );
                        let quick = bounded(Duration::from_secs(5), async {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                            Ok::<_, Error>(i)
                        });
                        let (stuck, quick) = tokio::join!(stuck, quick);
                        assert!(matches!(stuck, Err(Error::Busy)));
                        assert_eq!(quick.ok(), Some(i));
                    });
                })
            })
            .collect();
        for handle in handles {
            handle.join().expect("thread");
        }
    }
}
