//! The owner side of a request's transaction: the connection it holds ([`Slot`]), and the
//! commit with the record.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use sqlx::{Connection as _, Either, Executor as _};

use super::{CheckedConnection, Conn, SqlxDatabase, SqlxDialect, SqlxHandle};
use crate::error::Error;
use crate::row_lock::tx_state::{ObservedCell, TxShared, TxSlot};
use crate::sqlx::driver::our_sql;
use crate::store::{NewRecord, Reservation, Scope};

/// The connection of one transaction, while it may still be open.
///
/// Dropping a slot that still holds its connection takes the connection out of the pool and
/// closes it instead of returning it: `Drop` cannot await a `ROLLBACK`, and a pooled connection
/// with an open transaction would hand it to the next user of the pool. Closing the socket is
/// what makes the server roll back. Every path the layer drives to its end sends `ROLLBACK` or
/// `COMMIT` (and the dialect's session restore) and keeps the connection.
pub(crate) struct Slot<D: SqlxDialect> {
    pub(crate) connection: Option<CheckedConnection<D>>,
}

impl<D: SqlxDialect> Slot<D> {
    pub(crate) fn new(connection: CheckedConnection<D>) -> Self {
        Slot {
            connection: Some(connection),
        }
    }

    pub(crate) fn raw(&mut self) -> Result<&mut Conn<D>, Error> {
        self.connection
            .as_mut()
            .map(CheckedConnection::raw_mut)
            .ok_or(Error::TransactionFinished)
    }

    /// With unnamed statements (a transaction pooler in front of the server), closes the
    /// statements left cached on the connection: the store's own that go with bind parameters
    /// (rare paths: a conflict's re-check and take-over, a record that is not plain ASCII or
    /// over 16 KiB), and whatever else prepared one. Run inside the transaction, before it
    /// ends, the `Close` reaches the server connection that prepared them: the next
    /// transaction may run on another, where a cached statement would not exist (or another
    /// client's of the same name would). Before a transaction begins, it drops what a use of
    /// the connection outside the store left. Nothing is sent when nothing is cached.
    pub(crate) async fn forget_statements(&mut self) -> Result<(), sqlx::Error> {
        let Some(connection) = self.connection.as_mut() else {
            return Ok(());
        };
        if !connection.unnamed_statements() {
            return Ok(());
        }
        let raw = connection.raw_mut();
        if raw.cached_statements_size() == 0 {
            return Ok(());
        }
        raw.clear_cached_statements().await
    }

    /// Ends the transaction with `ROLLBACK` and gives the connection back to the pool; if that
    /// fails, the connection is discarded (closing it rolls back). A `ROLLBACK` that gets no
    /// answer within the connection's [answer wait](CheckedConnection::answer_wait), where it has
    /// one, is given up the same way: nothing of the transaction commits without `COMMIT`.
    pub(crate) async fn roll_back_and_release(&mut self) {
        let wait = self
            .connection
            .as_ref()
            .and_then(CheckedConnection::answer_wait);
        let ended = match wait {
            Some(wait) => match tokio::time::timeout(wait, self.end(D::ROLLBACK)).await {
                Ok(ended) => ended,
                Err(_) => {
                    self.discard();
                    Err(sqlx::Error::Protocol(format!(
                        "no answer within {} ms",
                        wait.as_millis()
                    )))
                }
            },
            None => self.end(D::ROLLBACK).await,
        };
        if let Err(error) = ended {
            tracing::warn!(%error, "ROLLBACK failed; closing the connection");
        }
    }

    /// Sends `COMMIT` and gives the connection back; if the server refuses it (it rolled back:
    /// a serialization failure at commit makes the layer run the request again) or the
    /// connection broke, the connection is not reused.
    pub(crate) async fn commit_and_release(&mut self) -> Result<(), Error> {
        self.raw()?;
        self.end(D::COMMIT).await.map_err(|error| {
            if D::is_unavailable(&error) {
                // `COMMIT` was sent: it may have committed. The same key replays if it did and
                // runs afresh if not.
                Error::CommitOutcomeUnknown(error.to_string())
            } else {
                error.into()
            }
        })
    }

    /// Sends `complete` (the completed record's statement as text, see
    /// [`SqlxDialect::complete_as_text`]) and `COMMIT` (with what restores the session) in one
    /// round trip, and gives the connection back. The server runs nothing of a simple query
    /// after a statement that failed: if the record's statement fails, `COMMIT` does not run
    /// and the transaction stays open, aborted; it is rolled back as when
    /// [`SqlxDialect::complete`] fails. Once `COMMIT` was sent, an answer lost with the
    /// connection leaves the outcome unknown ([`Error::CommitOutcomeUnknown`]).
    pub(crate) async fn complete_and_commit(&mut self, complete: &str) -> Result<(), Error> {
        let sql = format!("{complete}; {}", D::COMMIT);
        if let Err(error) = self.forget_statements().await {
            // Nothing was committed: `COMMIT` was not sent.
            self.discard();
            return Err(error.into());
        }
        let conn = self.raw()?;
        // The connection stays in the slot while this awaits: if this future is dropped, the
        // slot's `Drop` discards it.
        let mut results = D::Db::executor(conn).fetch_many(our_sql(sql));
        // The statements that ran to their end: the record's, then `COMMIT`, then the
        // session's restore.
        let mut done = 0;
        let mut failed = None;
        while let Some(result) = results.next().await {
            match result {
                Ok(Either::Left(_)) => done += 1,
                Ok(Either::Right(_)) => {}
                Err(error) => {
                    failed = Some(error);
                    break;
                }
            }
        }
        drop(results);
        let Some(error) = failed else {
            if done >= 2 {
                self.release();
                return Ok(());
            }
            self.discard();
            return Err(Error::CommitOutcomeUnknown(
                "no result for COMMIT".to_owned(),
            ));
        };
        let answered = matches!(error, sqlx::Error::Database(_));
        match done {
            // The record's statement failed on the server: nothing after it ran.
            0 if answered => {
                self.roll_back_and_release().await;
                Err(D::complete_failed(error))
            }
            // `COMMIT` was sent with it, and its answer is lost.
            0 => {
                self.discard();
                Err(Error::CommitOutcomeUnknown(error.to_string()))
            }
            // `COMMIT` failed: the server rolled back, or the connection broke.
            1 => {
                self.discard();
                if D::is_unavailable(&error) || !answered {
                    Err(Error::CommitOutcomeUnknown(error.to_string()))
                } else {
                    Err(error.into())
                }
            }
            // `COMMIT` answered; the statement after it reports a conflict: the transaction
            // was rolled back (see `end`).
            _ if D::is_conflict(&error) => {
                self.discard();
                Err(error.into())
            }
            // Committed; restoring the session failed.
            _ => {
                tracing::warn!(%error, "restoring the session failed; closing the connection");
                self.discard();
                Ok(())
            }
        }
    }

    /// Sends `statements` (`COMMIT` or `ROLLBACK`, then what restores the session) and gives
    /// the connection back if all of them ran, else discards it. The error is the first
    /// statement's: once that ran, the transaction has ended as asked, whatever follows; but
    /// for a conflict (a deadlock, a serialization failure) reported on a statement after it.
    ///
    /// That is how a MariaDB Galera node may end a transaction that another node's commit
    /// aborted while its own `COMMIT` was being certified: the `COMMIT` is answered as done,
    /// the transaction is rolled back, and the deadlock (`1213`) comes with the next
    /// statement of the batch, here the session's restore sent with it (a `COMMIT` sent alone
    /// gets the `1213` itself). It is taken as the `COMMIT`'s:
    /// nothing committed (a statement that sets session variables takes no lock, and a
    /// committed transaction has nothing left to abort), and the layer runs the request again.
    async fn end(&mut self, statements: &'static str) -> Result<(), sqlx::Error> {
        if let Err(error) = self.forget_statements().await {
            // Not ended: closing the connection rolls back.
            self.discard();
            return Err(error);
        }
        let (ended, restored) = match self.raw() {
            // The connection stays in the slot while this awaits: if this future is dropped,
            // the slot's `Drop` discards it.
            Ok(conn) => {
                let mut results = D::Db::executor(conn).fetch_many(statements);
                let mut ended = match results.next().await {
                    Some(Ok(_)) => Ok(()),
                    Some(Err(error)) => Err(error),
                    None => Err(sqlx::Error::Protocol(
                        "no result for COMMIT or ROLLBACK".into(),
                    )),
                };
                let mut restored = ended.is_ok();
                while let Some(result) = results.next().await {
                    if let Err(error) = result {
                        restored = false;
                        if ended.is_ok() && D::is_conflict(&error) {
                            // A conflict reported on the statement after `COMMIT`: the
                            // transaction was rolled back, not committed.
                            tracing::debug!(%error, "the transaction was rolled back at its end");
                            ended = Err(error);
                        } else {
                            tracing::warn!(%error, "restoring the session failed; closing the connection");
                        }
                    }
                }
                (ended, restored)
            }
            Err(_) => return Ok(()),
        };
        if restored {
            self.release();
        } else {
            self.discard();
        }
        ended
    }

    /// Gives the connection back to the pool: only once no transaction is open on it.
    fn release(&mut self) {
        drop(self.connection.take());
    }

    pub(crate) fn discard(&mut self) {
        if let Some(connection) = self.connection.take() {
            // Out of the pool for good (the pool may open a replacement); dropping the
            // connection closes its socket.
            drop(connection.into_pooled().detach());
        }
    }
}

impl<D: SqlxDialect> TxSlot for Slot<D> {
    fn is_open(&self) -> bool {
        self.connection.is_some()
    }

    fn discard(&mut self) {
        Slot::discard(self);
    }

    async fn roll_back_and_release(&mut self) {
        Slot::roll_back_and_release(self).await;
    }

    fn observed_cell(&self) -> ObservedCell {
        match &self.connection {
            Some(connection) => connection.observed_cell(),
            None => ObservedCell::default(),
        }
    }
}

impl<D: SqlxDialect> Drop for Slot<D> {
    fn drop(&mut self) {
        if self.connection.is_some() {
            tracing::debug!("idempotency transaction dropped while open; closing its connection");
            self.discard();
        }
    }
}

/// The open transaction of one request: the owner side, which the layer holds and ends.
///
/// [`commit`](Reservation::commit) and [`rollback`](Reservation::rollback) consume
/// it; dropping it without either rolls back (by closing its connection).
/// The handler gets a [`SqlxHandle`] on it, never the transaction itself.
pub struct SqlxReservation<D: SqlxDialect> {
    tx: Arc<TxShared<Slot<D>>>,
    scope: Scope,
    /// The reserved row.
    row: D::RowId,
    /// How long the commit waits for the server's answers, plus the dialect's
    /// [`ANSWER_MARGIN`](SqlxDialect::ANSWER_MARGIN) if it has one: the layer's lock timeout.
    commit_wait: Duration,
}

impl<D: SqlxDialect> SqlxReservation<D> {
    pub(super) fn new(
        token: u64,
        slot: Slot<D>,
        scope: Scope,
        row: D::RowId,
        commit_wait: Duration,
    ) -> Self {
        SqlxReservation {
            tx: Arc::new(TxShared::new(token, slot)),
            scope,
            row,
            commit_wait,
        }
    }
}

impl<D: SqlxDialect> fmt::Debug for SqlxReservation<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlxReservation")
            .field("reservation", &self.tx.token)
            .finish_non_exhaustive()
    }
}

impl<D: SqlxDialect> Drop for SqlxReservation<D> {
    fn drop(&mut self) {
        self.tx.abandon();
    }
}

impl<D: SqlxDialect> Reservation for SqlxReservation<D> {
    type Handle = SqlxHandle<D>;

    fn handle(&self) -> SqlxHandle<D> {
        SqlxHandle::new(self.tx.clone())
    }

    fn commit(self, record: NewRecord) -> impl Future<Output = Result<(), Error>> + Send {
        // Boxed, as the reservation is (see the store's `begin`).
        Box::pin(self.complete_and_commit(record))
    }

    /// Rolls back. Reports a serialization failure or deadlock that a handler's statement
    /// got ([`Error::StatementConflict`]): the handler's answer came from a transaction the
    /// database had rolled back, and the layer runs the request again.
    async fn rollback(self) -> Result<(), Error> {
        Box::pin(self.tx.rollback()).await
    }
}

impl<D: SqlxDialect> SqlxReservation<D> {
    /// [`Reservation::commit`]: the record completed, then `COMMIT`.
    async fn complete_and_commit(self, record: NewRecord) -> Result<(), Error> {
        let mut slot = self.tx.take_connection()?;
        // The transaction is already rolled back on the server: report why, to run it again.
        if let Some(conflict) = self.tx.conflict() {
            slot.roll_back_and_release().await;
            return Err(conflict);
        }
        let unnamed = slot
            .connection
            .as_ref()
            .is_some_and(CheckedConnection::unnamed_statements);
        let committing = async {
            if let Some(complete) = D::complete_as_text(&self.scope, &self.row, &record, unnamed) {
                return slot.complete_and_commit(&complete).await;
            }
            let saved = D::complete(slot.raw()?, &self.scope, &self.row, &record).await;
            if let Err(error) = saved {
                // The transaction is aborted, the row is not this transaction's reservation
                // any more, or the connection broke: nothing may commit.
                slot.roll_back_and_release().await;
                return Err(error);
            }
            // The record is this transaction's own: commit it with the handler's rows.
            slot.commit_and_release().await
        };
        let Some(margin) = D::ANSWER_MARGIN else {
            return committing.await;
        };
        // A server that stops answering holds the commit no longer than a lock wait and the
        // margin: the connection is then closed, and `COMMIT` may have been sent (the same
        // key replays if it committed).
        match tokio::time::timeout(self.commit_wait + margin, committing).await {
            Ok(outcome) => outcome,
            Err(_) => {
                slot.discard();
                Err(Error::CommitOutcomeUnknown(
                    "the database did not answer COMMIT within the lock timeout".to_owned(),
                ))
            }
        }
    }
}
