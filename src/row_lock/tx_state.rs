//! What the owner of a request's transaction and the handler's handles share, written once
//! for the SQL stores with row locks (tokio-postgres, sqlx on PostgreSQL, sqlx on MySQL and
//! MariaDB): whether the transaction is finished, the slot holding its connection, and the
//! first error of a handle's statement that ended the transaction whatever the handler
//! answers ([`Observed`]); and what is done with them the same way on every driver: a
//! handle's borrow of the connection, a request's rollback, the roll-back after an error.
//! Each driver has its own slot ([`TxSlot`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as StdMutex, PoisonError};

use tokio::sync::{Mutex, OwnedMappedMutexGuard, OwnedMutexGuard};

use crate::error::Error;

/// What a statement run through a transaction's handle got that ends the transaction
/// whatever the handler answers: the store reports it at commit or rollback
/// ([`into_error`](Self::into_error)).
#[derive(Clone, Debug)]
pub(crate) enum Observed {
    /// A serialization failure or deadlock: the layer runs the request again.
    Conflict(String),
    /// The server went away or cannot take writes (a PostgreSQL failover): the layer answers
    /// `503`; the connection is not reused.
    Unavailable(String),
    /// A lock wait past the lock timeout (PostgreSQL `55P03`; MySQL and MariaDB `1205`, a row
    /// lock or a metadata lock another session holds). A handler that failed after it is
    /// answered `503` with `Retry-After` (reported at rollback only), as for a wait on the
    /// store's own statements. MySQL rolled back only the statement and the transaction goes
    /// on, so a handler that recovered from it commits as usual; PostgreSQL aborted the
    /// transaction, whose commit then fails.
    LockTimeout(String),
    /// A statement got no answer within the lock timeout and a margin (a server or network
    /// that stopped answering without closing the connection): as
    /// [`Unavailable`](Self::Unavailable), and the handles refuse further statements at once
    /// (on the same connection they would wait behind the unanswered one).
    Stalled(String),
}

/// The first [`Observed`] error of a transaction, shared by the transaction and the
/// connection its handles lend.
pub(crate) type ObservedCell = Arc<StdMutex<Option<Observed>>>;

impl Observed {
    /// Keeps what a handle's statement got in `first`, unless `first` already holds something
    /// (the first error is the cause; later ones follow from it): a serialization failure or
    /// deadlock (`conflict`), a failover error (`unavailable`), or nothing at all.
    pub(crate) fn keep_first(
        first: &StdMutex<Option<Observed>>,
        conflict: bool,
        unavailable: bool,
        message: impl FnOnce() -> String,
    ) {
        let observed = match (conflict, unavailable) {
            (true, _) => Observed::Conflict(message()),
            (false, true) => Observed::Unavailable(message()),
            (false, false) => return,
        };
        let mut first = first.lock().unwrap_or_else(PoisonError::into_inner);
        // A lock timeout did not end the transaction: what ends it later is the cause.
        if matches!(*first, None | Some(Observed::LockTimeout(_))) {
            *first = Some(observed);
        }
    }

    /// Keeps a lock wait timeout a handle's statement got in `first`, unless `first` already
    /// holds something.
    pub(crate) fn keep_lock_timeout(first: &StdMutex<Option<Observed>>, message: String) {
        let mut first = first.lock().unwrap_or_else(PoisonError::into_inner);
        first.get_or_insert(Observed::LockTimeout(message));
    }

    /// Whether the database ended (or lost) the transaction: nothing of it can commit.
    pub(crate) fn ended_the_transaction(&self) -> bool {
        !matches!(self, Observed::LockTimeout(_))
    }

    /// Keeps in `first` that a handle's statement got no answer in time
    /// ([`Stalled`](Self::Stalled)), unless `first` already holds something.
    pub(crate) fn keep_stalled(first: &StdMutex<Option<Observed>>, message: String) {
        let mut first = first.lock().unwrap_or_else(PoisonError::into_inner);
        // A lock timeout did not end the transaction: the stall is what ends it.
        if matches!(*first, None | Some(Observed::LockTimeout(_))) {
            *first = Some(Observed::Stalled(message));
        }
    }

    /// Whether a handle's statement got no answer in time: `first` holds
    /// [`Stalled`](Self::Stalled).
    pub(crate) fn is_stalled(first: &StdMutex<Option<Observed>>) -> bool {
        matches!(
            *first.lock().unwrap_or_else(PoisonError::into_inner),
            Some(Observed::Stalled(_))
        )
    }

    /// The error a commit or rollback reports for it.
    pub(crate) fn into_error(self) -> Error {
        match self {
            Observed::Conflict(message) => Error::StatementConflict(message),
            Observed::Unavailable(message) | Observed::Stalled(message) => {
                Error::Unavailable(message)
            }
            Observed::LockTimeout(message) => Error::LockTimeout(message),
        }
    }
}

/// The connection of one transaction, while it may still be open: a driver's slot.
pub(crate) trait TxSlot: Send {
    /// Whether the slot still holds its connection.
    fn is_open(&self) -> bool;

    /// Takes the connection out of the pool for good and closes it (which rolls back).
    fn discard(&mut self);

    /// Ends the transaction with `ROLLBACK` and gives the connection back (or discards it).
    fn roll_back_and_release(&mut self) -> impl std::future::Future<Output = ()> + Send;

    /// Ends the transaction after `error`: a connection to a server that went away or cannot
    /// take writes is closed rather than returned to the pool, so that the pool connects
    /// afresh (to the new primary, on PostgreSQL with `target_session_attrs=read-write`);
    /// otherwise as [`roll_back_and_release`](Self::roll_back_and_release).
    fn roll_back_after(&mut self, error: &Error) -> impl std::future::Future<Output = ()> + Send {
        async move {
            if error.is_unavailable() {
                self.discard();
            } else {
                self.roll_back_and_release().await;
            }
        }
    }

    /// Where the handles' statements keep their [`Observed`] error: a new cell unless the
    /// connection already has one.
    fn observed_cell(&self) -> ObservedCell {
        ObservedCell::default()
    }
}

/// One transaction, shared by its owner (a request's reservation or the inbox's own
/// transaction) and the handler's handles.
pub(crate) struct TxShared<S> {
    /// The transaction's number in this process (for `Debug` and the inbox's commit check).
    pub(crate) token: u64,
    /// Set as soon as the layer starts to commit or roll back: handles refuse work from then on.
    pub(crate) finished: AtomicBool,
    pub(crate) connection: Arc<Mutex<S>>,
    /// The first serialization failure, deadlock or failover error that a statement run
    /// through a handle got (the database's message). The database has rolled the transaction
    /// back by then (or the server is gone), whatever the handler answers: commit and rollback
    /// report it, so that the request runs again or is answered `503`.
    pub(crate) observed: ObservedCell,
}

impl<S: TxSlot> TxShared<S> {
    pub(crate) fn new(token: u64, slot: S) -> Self {
        TxShared {
            token,
            finished: AtomicBool::new(false),
            observed: slot.observed_cell(),
            connection: Arc::new(Mutex::new(slot)),
        }
    }

    /// What a handle's statement got that ended the transaction, if anything, as the error
    /// to report (at commit: a lock timeout alone lets the transaction commit).
    pub(crate) fn conflict(&self) -> Option<Error> {
        self.observed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .filter(Observed::ended_the_transaction)
            .map(Observed::into_error)
    }

    /// What a handle's statement got that the request's rollback reports: what ended the
    /// transaction, or a lock wait past the lock timeout.
    fn observed_at_rollback(&self) -> Option<Error> {
        self.observed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .map(Observed::into_error)
    }

    /// Whether the layer has begun to commit or roll back (or the owner went away).
    pub(crate) fn is_finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    /// A handle's borrow of the connection, which `connection` picks out of the slot. Waits
    /// while another borrow is alive (one connection runs one statement at a time); refused
    /// with [`Error::TransactionFinished`] once the transaction is finished (before or while
    /// this waited) or its connection is gone.
    pub(crate) async fn borrow<C>(
        &self,
        connection: impl FnOnce(&mut S) -> Option<&mut C>,
    ) -> Result<OwnedMappedMutexGuard<S, C>, Error> {
        if self.is_finished() {
            return Err(Error::TransactionFinished);
        }
        let slot = self.connection.clone().lock_owned().await;
        // The layer may have finished the transaction while this waited.
        if self.is_finished() {
            return Err(Error::TransactionFinished);
        }
        OwnedMutexGuard::try_map(slot, connection).map_err(|_| Error::TransactionFinished)
    }

    /// Marks the transaction finished and takes its connection from the handles.
    pub(crate) fn take_connection(&self) -> Result<OwnedMutexGuard<S>, Error> {
        self.finished.store(true, Ordering::Release);
        // The handler has returned its response; a connection still borrowed now belongs to
        // a task that outlived its request, still using the transaction: do not commit under it.
        let slot = self.connection.clone().try_lock_owned().map_err(|_| {
            Error::TransactionAborted("a handler still holds the transaction's connection")
        })?;
        if !slot.is_open() {
            return Err(Error::TransactionAborted(
                "the transaction's connection is gone",
            ));
        }
        Ok(slot)
    }

    /// A request's rollback: ends the transaction if its connection is free (after the error
    /// a handle's statement got, if any), and reports a serialization failure or deadlock
    /// that a handle's statement got ([`Error::StatementConflict`]): the handler's answer came
    /// from a transaction the database had rolled back, and the layer runs the request again.
    /// So it reports a lost database ([`Error::Unavailable`]) and a lock wait past the lock
    /// timeout ([`Error::LockTimeout`]): the layer answers `503` for both.
    pub(crate) async fn rollback(&self) -> Result<(), Error> {
        match self.take_connection() {
            Ok(mut slot) => match self.conflict() {
                Some(observed) => slot.roll_back_after(&observed).await,
                None => slot.roll_back_and_release().await,
            },
            // Nothing to roll back here: a borrower still holds it (the slot's `Drop` closes
            // it later), or it is already gone.
            Err(error) => tracing::warn!(%error, "rollback deferred to the connection's release"),
        }
        match self.observed_at_rollback() {
            Some(observed) => Err(observed),
            None => Ok(()),
        }
    }

    /// The owner went away without committing: refuse further work and close the connection
    /// (which rolls back).
    pub(crate) fn abandon(&self) {
        self.finished.store(true, Ordering::Release);
        // Discard at once if nobody borrows the connection; otherwise the slot's own `Drop`
        // does it when the last borrower lets go.
        if let Ok(mut slot) = self.connection.try_lock() {
            slot.discard();
        }
    }
}

/// What a store's own transaction (the inbox's or a step's, outside any request) needs from
/// its slot.
#[cfg(feature = "_row-lock-store")]
pub(crate) trait OwnedSlot: TxSlot + Send {
    /// Whether the transaction is still the one marked with `token` when it was opened.
    fn is_own_transaction(
        &mut self,
        token: u64,
    ) -> impl std::future::Future<Output = Result<bool, Error>> + Send;

    /// Ends the transaction with `COMMIT` and gives the connection back.
    fn commit_and_release(&mut self)
        -> impl std::future::Future<Output = Result<(), Error>> + Send;
}

/// A transaction a store opened for itself, committed or rolled back by its owner (the
/// inbox) rather than by the layer, through the same handles as a request's. Dropping it
/// without either rolls back (by closing its connection, as for a request).
#[cfg(feature = "_row-lock-store")]
pub(crate) struct OwnedTransaction<S: TxSlot> {
    pub(crate) tx: Arc<TxShared<S>>,
}

#[cfg(feature = "_row-lock-store")]
impl<S: OwnedSlot> OwnedTransaction<S> {
    /// The transaction on `slot`, marked with `token`, once its `BEGIN` has run (`begun`); if
    /// that failed, the slot is rolled back and the error returned.
    pub(crate) async fn opened(
        token: u64,
        mut slot: S,
        begun: Result<(), Error>,
    ) -> Result<Self, Error> {
        if let Err(error) = begun {
            slot.roll_back_and_release().await;
            return Err(error);
        }
        Ok(OwnedTransaction {
            tx: Arc::new(TxShared::new(token, slot)),
        })
    }

    /// Commits, after checking that the transaction is still the one the store opened and
    /// still able to commit: a `COMMIT` or `ROLLBACK` run through a handle would otherwise
    /// let this `COMMIT` succeed with nothing in it, and so would a failed statement (`COMMIT`
    /// of an aborted transaction answers `ROLLBACK` without an error).
    pub(crate) async fn commit(self) -> Result<(), Error> {
        let mut slot = self.tx.take_connection()?;
        if let Some(conflict) = self.tx.conflict() {
            slot.roll_back_after(&conflict).await;
            return Err(conflict);
        }
        let checked = match slot.is_own_transaction(self.tx.token).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(Error::TransactionAborted(
                "the transaction ended before commit (COMMIT or ROLLBACK through its handle?)",
            )),
            Err(error) => Err(error),
        };
        if let Err(error) = checked {
            slot.roll_back_and_release().await;
            return Err(error);
        }
        slot.commit_and_release().await
    }

    /// Rolls back and gives the connection back to the pool (or closes it if a handle still
    /// borrows it). Returns what a handle's statement got that ended the transaction (a
    /// serialization failure, a deadlock, a lost server), if anything: the cause of whatever
    /// error the work reported after it (a closure that turned the `40001` into an error of
    /// its own, or the next statement refused in the aborted transaction).
    pub(crate) async fn rollback(self) -> Option<Error> {
        let ended = self.tx.conflict();
        match self.tx.take_connection() {
            Ok(mut slot) => match &ended {
                Some(cause) => slot.roll_back_after(cause).await,
                None => slot.roll_back_and_release().await,
            },
            Err(error) => tracing::warn!(%error, "rollback deferred to the connection's release"),
        }
        ended
    }
}

#[cfg(feature = "_row-lock-store")]
impl<S: TxSlot> Drop for OwnedTransaction<S> {
    fn drop(&mut self) {
        self.tx.abandon();
    }
}
