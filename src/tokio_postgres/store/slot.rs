//! The connection of one open transaction ([`Slot`]: rolled back by closing it if dropped
//! open) and what the layer's side and the handler's handles share about the transaction
//! ([`TxShared`]: whether it is finished, its connection, the first conflict a handle's
//! statement got).

use std::time::Duration;

use deadpool_postgres::{ClientWrapper, Object};

use super::reservation::is_conflict_code;
use super::statements::Preparation;
use crate::error::Error;
use crate::postgres::failover::postgres_unavailable;
use crate::row_lock::tx_state::{Observed, TxSlot};

/// The connection of one transaction, while it may still be open.
///
/// Dropping a slot that still holds its connection discards the connection instead of
/// returning it to the pool: `Drop` cannot await a `ROLLBACK`, and a pooled connection with an
/// open transaction would hand it to the next request. Closing the socket is what makes
/// PostgreSQL roll back (it aborts the transaction of a backend whose client is gone, as soon
/// as the backend reads from the socket: at once when idle, after the running statement
/// otherwise). The cost, a new connection, is paid only when a future is dropped mid-request;
/// every path the layer drives to its end sends `ROLLBACK` or `COMMIT` and keeps the
/// connection.
pub(crate) struct Slot {
    pub(super) object: Option<Object>,
    /// How long after sending a statement its answer is due, for a request's transaction (the
    /// lock timeout and [`ANSWER_MARGIN`](crate::postgres::reserve::ANSWER_MARGIN): the server
    /// ends every lock wait by the lock timeout itself). An answer missing past it means a
    /// server that stopped answering: the handles' statements and the `ROLLBACK` give up on
    /// it, and the connection is closed. `None`: no bound (the inbox's own transactions).
    pub(super) answer_wait: Option<Duration>,
    /// How the store's statements on this connection reach the server, and whether a
    /// handle's `prepare_cached` may cache (see `statements`).
    pub(super) preparation: Preparation,
}

impl Slot {
    pub(super) fn client(&self) -> Result<&ClientWrapper, Error> {
        self.object.as_deref().ok_or(Error::TransactionFinished)
    }

    /// Ends the transaction with `ROLLBACK` and gives the connection back to the pool; if that
    /// fails, the connection is discarded (closing it rolls back).
    ///
    /// A `ROLLBACK` that gets no answer within [`answer_wait`](Self::answer_wait) is given up:
    /// the connection is discarded (nothing of the transaction can commit without a `COMMIT`).
    pub(super) async fn roll_back_and_release(&mut self) {
        let rolled_back = match &self.object {
            // The connection stays in the slot while this awaits: if this future is dropped,
            // the slot's `Drop` discards it.
            Some(object) => {
                let rollback = object.batch_execute("ROLLBACK");
                match self.answer_wait {
                    Some(wait) => match tokio::time::timeout(wait, rollback).await {
                        Ok(rolled_back) => rolled_back.map_err(|error| error.to_string()),
                        Err(_) => Err(format!("no answer within {} ms", wait.as_millis())),
                    },
                    None => rollback.await.map_err(|error| error.to_string()),
                }
            }
            None => return,
        };
        match rolled_back {
            Ok(()) => self.release(),
            Err(error) => {
                tracing::warn!(%error, "ROLLBACK failed; closing the connection");
                self.discard();
            }
        }
    }

    /// Ends the transaction with `COMMIT` and gives the connection back to the pool (for the
    /// inbox's own transactions: a request's commit sends `COMMIT` with its record).
    pub(super) async fn commit_and_release(&mut self) -> Result<(), Error> {
        let committed = match &self.object {
            // As in `roll_back_and_release`, a drop while this awaits discards the connection.
            Some(object) => object.batch_execute("COMMIT").await,
            None => return Err(Error::TransactionFinished),
        };
        // Committed, or failed and therefore rolled back by the server: either way no
        // transaction is left open on the connection.
        self.release();
        committed.map_err(Error::from)
    }

    /// Gives the connection back to the pool: only once no transaction is open on it.
    pub(super) fn release(&mut self) {
        drop(self.object.take());
    }

    pub(super) fn discard(&mut self) {
        if let Some(object) = self.object.take() {
            // Out of the pool for good; dropping the client closes its connection.
            drop(Object::take(object));
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.object.is_some() {
            tracing::debug!("idempotency transaction dropped while open; closing its connection");
            self.discard();
        }
    }
}

/// One transaction, shared by its owner ([`PostgresReservation`](super::PostgresReservation)
/// or the inbox's own transaction) and its [`PostgresHandle`](super::PostgresHandle)
/// handles.
pub(super) type TxShared = crate::row_lock::tx_state::TxShared<Slot>;

impl TxSlot for Slot {
    fn is_open(&self) -> bool {
        self.object.is_some()
    }

    fn discard(&mut self) {
        Slot::discard(self);
    }

    async fn roll_back_and_release(&mut self) {
        Slot::roll_back_and_release(self).await;
    }
}

impl TxShared {
    /// Keeps `error` if it is the transaction's first serialization failure, deadlock or
    /// failover error.
    pub(super) fn observe(&self, error: &tokio_postgres::Error) {
        // A lock wait past the lock timeout (`55P03`): answered `503` if the handler then fails.
        if error.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) {
            let message = match error.as_db_error() {
                Some(db_error) => db_error.to_string(),
                None => error.to_string(),
            };
            Observed::keep_lock_timeout(&self.observed, message);
            return;
        }
        Observed::keep_first(
            &self.observed,
            is_conflict_code(error),
            postgres_unavailable(error),
            || match error.as_db_error() {
                Some(db_error) => db_error.to_string(),
                None => error.to_string(),
            },
        );
    }
}
