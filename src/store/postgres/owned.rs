//! The store's own transactions, outside any request: the receiver's inbox (feature `outbox`)
//! opens one, records an event id and applies the event through the same
//! [`PostgresTransaction`] handle a request's handler gets, then commits or rolls back itself.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::slot::{Slot, TxShared};
use super::{PostgresStore, PostgresTransaction};
use crate::error::Error;
use crate::store::pg_sql::{IS_OWN_TRANSACTION, OWN_TRANSACTION_SETTING};

impl PostgresStore {
    /// Opens a transaction of the store's own, outside any request (the inbox's), on a pooled
    /// connection, with the store's isolation level. It is used through the same handle as a
    /// request's transaction and rolls back the same way if dropped.
    pub(crate) async fn begin_owned(&self) -> Result<OwnedTransaction, Error> {
        let mut slot = Slot {
            object: Some(self.client().await?),
        };
        let token = self.shared.reservations.fetch_add(1, Ordering::Relaxed);
        // One round trip. Only an integer is formatted into it.
        let begun = match slot.client() {
            Ok(client) => client
                .batch_execute(&format!(
                    "{}; SET LOCAL {OWN_TRANSACTION_SETTING} = '{token}'",
                    self.shared.isolation.begin_statement()
                ))
                .await
                .map_err(Error::from),
            Err(error) => Err(error),
        };
        if let Err(error) = begun {
            slot.roll_back_and_release().await;
            return Err(error);
        }
        Ok(OwnedTransaction {
            tx: Arc::new(TxShared::new(token, slot)),
        })
    }

    /// [`PostgresOptions::serialization_retries`].
    pub(crate) fn serialization_retries(&self) -> u32 {
        self.shared.serialization_retries
    }
}

/// A transaction opened by [`PostgresStore::begin_owned`], committed or rolled back by its
/// owner (the inbox) rather than by the layer. Dropping it without either rolls back (by
/// closing its connection, as for a request).
pub(crate) struct OwnedTransaction {
    tx: Arc<TxShared>,
}

impl OwnedTransaction {
    /// A handle on this transaction: the same type a request's handler gets.
    pub(crate) fn handle(&self) -> PostgresTransaction {
        PostgresTransaction {
            tx: self.tx.clone(),
        }
    }

    /// Commits, after checking that the transaction is still the one `begin_owned` opened and
    /// still able to commit: a `COMMIT` or `ROLLBACK` run through a handle would otherwise
    /// let this `COMMIT` succeed with nothing in it, and so would a failed statement (`COMMIT`
    /// of an aborted transaction answers `ROLLBACK` without an error).
    pub(crate) async fn commit(self) -> Result<(), Error> {
        let mut slot = self.tx.take_connection()?;
        if let Some(conflict) = self.tx.conflict() {
            slot.roll_back_after(&conflict).await;
            return Err(conflict);
        }
        let checked = async {
            let client = slot.client()?;
            let check = client.prepare_cached(IS_OWN_TRANSACTION).await?;
            let same: bool = client
                .query_one(&check, &[&self.tx.token.to_string()])
                .await?
                .try_get(0)?;
            if same {
                Ok(())
            } else {
                Err(Error::TransactionAborted(
                    "the transaction ended before commit (COMMIT or ROLLBACK through its handle?)",
                ))
            }
        }
        .await;
        if let Err(error) = checked {
            slot.roll_back_and_release().await;
            return Err(error);
        }
        slot.commit_and_release().await
    }

    /// Rolls back and gives the connection back to the pool (or closes it if a handle still
    /// borrows it).
    pub(crate) async fn rollback(self) {
        match self.tx.take_connection() {
            Ok(mut slot) => slot.roll_back_and_release().await,
            Err(error) => tracing::warn!(%error, "rollback deferred to the connection's release"),
        }
    }
}

impl Drop for OwnedTransaction {
    fn drop(&mut self) {
        self.tx.abandon();
    }
}
