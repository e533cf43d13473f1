//! [`SqliteReservation`]: the layer's side of a request's write transaction.
//!
//! The begin (`SqliteStore::begin`, or `executor` for `begin_and_run`) creates it before it
//! queues anything, so that whatever happens next, dropping it queues the rollback of what
//! the begin started on the writer. [`Reservation::commit`] saves the record
//! (`records`) and joins the request's group commit (`group`); `rollback` and `Drop` undo
//! the request's savepoint. [`TxShared`] is what it shares with the handler's handles
//! (`handle`) and with the begin: the request's generation, the store, and whether the
//! request has ended.

use std::any::TypeId;
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use super::group::Member;
use super::handle::SqliteHandle;
use super::records::insert_record;
use super::writer::{run_if_on_writer, Job, Step, Writer};
use super::Shared;
use crate::error::Error;
use crate::store::{NewRecord, Reservation, Scope};

/// What a request's reservation, its handles and its queued begin share.
pub(super) struct TxShared {
    /// Tells this request's steps on the writer from another's (see `Writer::active`).
    pub(super) generation: u64,
    pub(super) store: Arc<Shared>,
    /// Set once the request has ended, or stopped waiting for its begin.
    pub(super) finished: AtomicBool,
    /// The writer, when the request runs in place (see `in_place`): held here from its begin
    /// to its end, then given back to the store. `None` when it runs on the writer thread.
    pub(super) in_place: Option<Mutex<Option<Box<Writer>>>>,
}

/// The open write transaction of one request (the owner side, held by the layer).
///
/// Dropping it without committing rolls back; the next request starts after that.
pub struct SqliteReservation {
    pub(super) tx: Arc<TxShared>,
    /// Whether the request has yet to end (commit, roll back) on the writer.
    open: bool,
    scope: Scope,
}

impl fmt::Debug for SqliteReservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteReservation")
            .field("generation", &self.tx.generation)
            .finish_non_exhaustive()
    }
}

impl SqliteReservation {
    /// A new request's reservation of `scope` (not yet begun), numbered by `store`.
    pub(super) fn new(store: &Arc<Shared>, scope: &Scope) -> Self {
        let generation = store.generations.fetch_add(1, Ordering::Relaxed);
        Self::with_writer(store, scope, generation, None)
    }

    /// The reservation of a request that runs in place, holding `writer`, on which its
    /// savepoint (numbered `generation`) is open.
    pub(super) fn in_place(
        store: &Arc<Shared>,
        scope: &Scope,
        generation: u64,
        writer: Box<Writer>,
    ) -> Self {
        Self::with_writer(store, scope, generation, Some(writer))
    }

    fn with_writer(
        store: &Arc<Shared>,
        scope: &Scope,
        generation: u64,
        writer: Option<Box<Writer>>,
    ) -> Self {
        SqliteReservation {
            tx: Arc::new(TxShared {
                generation,
                store: store.clone(),
                finished: AtomicBool::new(false),
                in_place: writer.map(|writer| Mutex::new(Some(writer))),
            }),
            open: true,
            scope: scope.clone(),
        }
    }

    /// Marks the request ended; from now on the handler's clones of the handle refuse work.
    pub(super) fn close(&mut self) {
        self.open = false;
        // Release: a begin still waiting on the writer sees it and is skipped.
        self.tx.finished.store(true, Ordering::Release);
    }

    /// Ends the request on the writer thread with `end`, which answers through `reply`.
    ///
    /// Whatever `end` does (even panicking), the request's savepoint is closed afterwards: the
    /// writer never waits for an owner that has gone.
    async fn end<T, F>(mut self, end: F) -> Result<T, Error>
    where
        F: FnOnce(&mut Writer, oneshot::Sender<Result<T, Error>>) + Send + 'static,
        T: Send + 'static,
    {
        let generation = self.tx.generation;
        self.close();
        let (reply, answer) = oneshot::channel();
        let step: Step = Box::new(move |writer| {
            if writer.active != Some(generation) {
                let _ = reply.send(Err(Error::TransactionAborted(
                    "the transaction was ended before commit",
                )));
                return;
            }
            let ended = std::panic::catch_unwind(AssertUnwindSafe(|| end(writer, reply)));
            if writer.active == Some(generation) {
                writer.rollback_request();
            }
            if let Err(panic) = ended {
                std::panic::resume_unwind(panic);
            }
        });
        if self.tx.in_place.is_some() {
            // The request holds the writer: end here, and give the writer back.
            let store = self.tx.store.clone();
            // The site is `end`'s type: the commit's and the rollback's are sites of their own.
            self.tx
                .with_lent(TypeId::of::<F>(), move |lent| {
                    let Some(mut writer) = lent.take() else {
                        return Err(Error::TransactionFinished);
                    };
                    // A panicking end drops its reply, which reads as `Error::Panicked`.
                    let _ = std::panic::catch_unwind(AssertUnwindSafe(|| step(&mut writer)));
                    writer.after_job();
                    store.return_writer(writer);
                    Ok(())
                })
                .await?;
        // Polled on the writer thread (the request's work), it ends at once.
        } else if let Err(step) = run_if_on_writer(self.tx.store.id, step) {
            self.tx
                .store
                .jobs
                .send(Job::Step(step))
                .map_err(|_| Error::Closed)?;
        }
        answer.await.map_err(|_| Error::Panicked)?
    }
}

impl Drop for SqliteReservation {
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        // Before the rollback is queued: a begin that has not started yet is skipped, and one
        // that has is followed by this rollback.
        self.close();
        let generation = self.tx.generation;
        if self.tx.in_place.is_some() {
            self.tx.roll_back_lent();
            return;
        }
        let _ = self
            .tx
            .store
            .jobs
            .send(Job::Step(Box::new(move |writer: &mut Writer| {
                if writer.active == Some(generation) {
                    writer.rollback_request();
                    tracing::debug!("idempotency transaction rolled back");
                }
            })));
    }
}

impl Reservation for SqliteReservation {
    type Handle = SqliteHandle;

    fn handle(&self) -> SqliteHandle {
        SqliteHandle {
            tx: self.tx.clone(),
        }
    }

    async fn commit(self, record: NewRecord) -> Result<(), Error> {
        let scope = self.scope.clone();
        // Answered once the group holding the record has committed: one wake-up, not two.
        self.end(move |writer, reply| {
            match insert_record(&writer.conn, &scope, &record)
                .and_then(|()| writer.release_request())
            {
                Ok(()) => writer.on_commit(Member {
                    scope,
                    saved: true,
                    notify: Box::new(move |outcome| {
                        let _ = reply.send(outcome);
                    }),
                }),
                // `end` rolls the savepoint back next.
                Err(error) => {
                    let _ = reply.send(Err(error));
                }
            }
        })
        .await
    }

    async fn rollback(self) -> Result<(), Error> {
        self.end(|writer, reply| {
            writer.rollback_request();
            let _ = reply.send(Ok(()));
        })
        .await
    }
}
