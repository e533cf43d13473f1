//! The owner side of a request's transaction: the connection it holds, what its handles
//! share, and the commit with the record.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError};

use sqlx::postgres::PgConnection;
// The `Executor` methods rather than the query builders' `execute(conn)`: their boxed futures
// keep these `async fn`s provably `Send` (the builders' generic futures hit a rustc limitation
// on higher-ranked lifetimes there).
use sqlx::Executor as _;
use tokio::sync::{Mutex, OwnedMutexGuard};

use super::{is_conflict, SqlxTransaction, TxConnection};
use crate::error::{sqlx_code, Error};
use crate::response::SavedResponse;
use crate::store::pg_failover::{sqlx_unavailable, Observed};
use crate::store::pg_sql::COMPLETE_RECORD;
use crate::store::{to_unix_millis, NewRecord, Reservation, Scope};

/// The connection of one transaction, while it may still be open.
///
/// Dropping a slot that still holds its connection takes the connection out of the pool and
/// closes it instead of returning it: `Drop` cannot await a `ROLLBACK`, and a pooled connection
/// with an open transaction would hand it to the next user of the pool. Closing the socket is
/// what makes PostgreSQL roll back. Every path the layer drives to its end sends `ROLLBACK` or
/// `COMMIT` and keeps the connection.
pub(super) struct Slot {
    pub(super) connection: Option<TxConnection>,
}

impl Slot {
    pub(super) fn new(connection: TxConnection) -> Self {
        Slot {
            connection: Some(connection),
        }
    }

    pub(super) fn raw(&mut self) -> Result<&mut PgConnection, Error> {
        self.connection
            .as_mut()
            .map(TxConnection::raw_mut)
            .ok_or(Error::TransactionFinished)
    }

    /// Ends the transaction with `ROLLBACK` and gives the connection back to the pool; if that
    /// fails, the connection is discarded (closing it rolls back).
    pub(super) async fn roll_back_and_release(&mut self) {
        let rolled_back = match self.raw() {
            // The connection stays in the slot while this awaits: if this future is dropped,
            // the slot's `Drop` discards it.
            Ok(conn) => conn.execute("ROLLBACK").await,
            Err(_) => return,
        };
        match rolled_back {
            Ok(_) => self.release(),
            Err(error) => {
                tracing::warn!(%error, "ROLLBACK failed; closing the connection");
                self.discard();
            }
        }
    }

    /// Sends `COMMIT` and gives the connection back; if the server refuses it (it rolled back:
    /// a serialization failure at commit makes the layer run the request again) or the
    /// connection broke, the connection is not reused.
    pub(super) async fn commit_and_release(&mut self) -> Result<(), Error> {
        let committed = self.raw()?.execute("COMMIT").await;
        match committed {
            // Committed: no transaction is left open on the connection.
            Ok(_) => {
                self.release();
                Ok(())
            }
            // Refused by the server (it rolled back: a serialization failure at commit makes the
            // layer run the request again), or the connection broke: do not reuse it.
            Err(error) => {
                self.discard();
                if sqlx_unavailable(&error) {
                    // `COMMIT` was sent: it may have committed. The same key replays if it
                    // did and runs afresh if not.
                    Err(Error::CommitOutcomeUnknown(error.to_string()))
                } else {
                    Err(error.into())
                }
            }
        }
    }

    /// Gives the connection back to the pool: only once no transaction is open on it.
    fn release(&mut self) {
        drop(self.connection.take());
    }

    fn discard(&mut self) {
        if let Some(connection) = self.connection.take() {
            // Out of the pool for good (the pool may open a replacement); dropping the
            // connection closes its socket.
            drop(connection.into_pooled().detach());
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.connection.is_some() {
            tracing::debug!("idempotency transaction dropped while open; closing its connection");
            self.discard();
        }
    }
}

/// The first serialization failure, deadlock or failover error that a statement run through
/// a handle got (the database's message), shared by the transaction and the connection it
/// lends.
pub(super) type ConflictCell = Arc<std::sync::Mutex<Option<Observed>>>;

/// Keeps `error` if it is the transaction's first serialization failure, deadlock or
/// failover error.
pub(super) fn observe(conflict: &ConflictCell, error: &sqlx::Error) {
    Observed::keep_first(
        conflict,
        is_conflict(error),
        sqlx_unavailable(error),
        || match error.as_database_error() {
            Some(db_error) => db_error.message().to_owned(),
            None => error.to_string(),
        },
    );
}

pub(super) struct TxShared {
    pub(super) token: u64,
    /// Set as soon as the layer starts to commit or roll back: handles refuse work from then on.
    finished: AtomicBool,
    pub(super) connection: Arc<Mutex<Slot>>,
    /// PostgreSQL has rolled the transaction back once a handler's statement conflicted,
    /// whatever the handler answers: commit and rollback report it, so that the request runs
    /// again.
    conflict: ConflictCell,
}

impl TxShared {
    pub(super) fn new(token: u64, slot: Slot) -> Self {
        let conflict = match &slot.connection {
            Some(connection) => connection.conflict_cell(),
            None => ConflictCell::default(),
        };
        TxShared {
            token,
            finished: AtomicBool::new(false),
            connection: Arc::new(Mutex::new(slot)),
            conflict,
        }
    }

    /// The conflict a handle's statement got, if any, as the error to report.
    pub(super) fn conflict(&self) -> Option<Error> {
        self.conflict
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .map(Observed::into_error)
    }

    pub(super) fn is_finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    /// Marks the transaction finished and takes its connection from the handles.
    pub(super) fn take_connection(&self) -> Result<OwnedMutexGuard<Slot>, Error> {
        self.finished.store(true, Ordering::Release);
        // The handler has returned its response; a connection still borrowed now belongs to
        // a task that outlived its request, still using the transaction: do not commit under it.
        let slot = self.connection.clone().try_lock_owned().map_err(|_| {
            Error::TransactionAborted("a handler still holds the transaction's connection")
        })?;
        if slot.connection.is_none() {
            return Err(Error::TransactionAborted(
                "the transaction's connection is gone",
            ));
        }
        Ok(slot)
    }

    /// The owner went away without committing: refuse further work and close the connection
    /// (which rolls back).
    pub(super) fn abandon(&self) {
        self.finished.store(true, Ordering::Release);
        // Discard at once if nobody borrows the connection; otherwise the slot's own `Drop`
        // does it when the last borrower lets go.
        if let Ok(mut slot) = self.connection.try_lock() {
            slot.discard();
        }
    }
}

/// The open transaction of one request: the owner side, which the layer holds and ends.
///
/// [`commit`](Reservation::commit) and [`rollback`](Reservation::rollback) consume
/// it; dropping it without either rolls back (by closing its connection; see the module docs).
/// The handler gets a [`SqlxTransaction`] on it, never the transaction itself.
pub struct SqlxReservation {
    tx: Arc<TxShared>,
    scope: Scope,
    /// The `ctid` of the reserved row.
    row_id: String,
}

impl SqlxReservation {
    pub(super) fn new(token: u64, slot: Slot, scope: Scope, row_id: String) -> Self {
        SqlxReservation {
            tx: Arc::new(TxShared::new(token, slot)),
            scope,
            row_id,
        }
    }
}

impl fmt::Debug for SqlxReservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlxReservation")
            .field("reservation", &self.tx.token)
            .finish_non_exhaustive()
    }
}

impl Drop for SqlxReservation {
    fn drop(&mut self) {
        self.tx.abandon();
    }
}

impl Reservation for SqlxReservation {
    type Handle = SqlxTransaction;

    fn handle(&self) -> SqlxTransaction {
        SqlxTransaction::new(self.tx.clone())
    }

    async fn commit(self, record: NewRecord) -> Result<(), Error> {
        let mut slot = self.tx.take_connection()?;
        // The transaction is already rolled back on the server: report why, to run it again.
        if let Some(conflict) = self.tx.conflict() {
            slot.roll_back_and_release().await;
            return Err(conflict);
        }
        let response = &record.response;
        let trailers = response
            .trailers
            .as_ref()
            .map(|t| SavedResponse::encode_headers(t));
        let saved = match slot.raw() {
            Ok(conn) => {
                let complete = sqlx::query(COMPLETE_RECORD)
                    .bind(&*self.scope.tenant)
                    .bind(&*self.scope.operation)
                    .bind(self.scope.key.as_str())
                    .bind(&record.fingerprint.digest()[..])
                    .bind(i32::from(record.fingerprint.version()))
                    .bind(i32::from(response.status.as_u16()))
                    .bind(SavedResponse::encode_headers(&response.headers))
                    .bind(&response.body[..])
                    .bind(trailers)
                    .bind(to_unix_millis(record.created_at))
                    .bind(to_unix_millis(record.expires_at))
                    .bind(self.row_id.as_str());
                conn.execute(complete).await
            }
            Err(error) => return Err(error),
        };
        if let Err(error) = saved {
            // The transaction is aborted (or the connection broke): nothing may commit.
            slot.roll_back_and_release().await;
            return Err(match sqlx_code(&error).as_deref() {
                Some("22012") => Error::TransactionAborted(
                    "the transaction ended before commit (it is not the one the layer began)",
                ),
                _ => error.into(),
            });
        }
        // The record is this transaction's own: commit it with the handler's rows.
        slot.commit_and_release().await
    }

    /// Rolls back. Reports a serialization failure or deadlock that a handler's statement
    /// got ([`Error::StatementConflict`]): the handler's answer came from a transaction the
    /// database had rolled back, and the layer runs the request again.
    async fn rollback(self) -> Result<(), Error> {
        match self.tx.take_connection() {
            // A server that went away or cannot take writes: not a connection to reuse.
            Ok(mut slot) if self.tx.conflict().is_some_and(|e| e.is_unavailable()) => {
                slot.discard()
            }
            Ok(mut slot) => slot.roll_back_and_release().await,
            // Nothing to roll back here: a borrower still holds it (the slot's `Drop` closes
            // it later), or it is already gone.
            Err(error) => tracing::warn!(%error, "rollback deferred to the connection's release"),
        }
        match self.tx.conflict() {
            Some(conflict) => Err(conflict),
            None => Ok(()),
        }
    }
}
