//! The store's own transactions, outside any request: the receiver's inbox (feature `outbox`)
//! opens one, records an event id and applies the event through the same
//! [`PostgresHandle`] handle a request's handler gets, then commits or rolls back itself
//! ([`OwnedTransaction`], the same for both PostgreSQL drivers). Each call of a step-by-step
//! request runs in one too (a local step's closure gets its handle).

use std::sync::atomic::Ordering;

use tokio_postgres::types::Type;

use super::slot::Slot;
use super::statements::Typed;
use super::{PostgresHandle, PostgresStore};
use crate::error::Error;
use crate::postgres::store_sql::IS_OWN_TRANSACTION;
use crate::row_lock::driver::Own;
use crate::row_lock::tx_state::{OwnedSlot, OwnedTransaction};

impl PostgresStore {
    /// Opens a transaction of the store's own, outside any request (the inbox's), on a pooled
    /// connection, at the isolation level `own` says. It is used through the same handle as a
    /// request's transaction and rolls back the same way if dropped.
    pub(crate) async fn begin_owned(&self, own: Own) -> Result<OwnedTransaction<Slot>, Error> {
        let slot = Slot {
            object: Some(self.client().await?),
            answer_wait: None,
            preparation: self.shared.preparation,
        };
        let token = self.shared.reservations.fetch_add(1, Ordering::Relaxed);
        // One round trip.
        let begun = match slot.client() {
            Ok(client) => client
                .batch_execute(&own.isolation(self.shared.isolation).begin_owned(token))
                .await
                .map_err(Error::from),
            Err(error) => Err(error),
        };
        OwnedTransaction::opened(token, slot, begun).await
    }

    /// [`PostgresOptions::with_serialization_retries`](super::PostgresOptions::with_serialization_retries).
    pub(crate) fn serialization_retries(&self) -> u32 {
        self.shared.serialization_retries
    }
}

impl OwnedTransaction<Slot> {
    /// A handle on this transaction: the same type a request's handler gets.
    pub(crate) fn handle(&self) -> PostgresHandle {
        PostgresHandle {
            tx: self.tx.clone(),
        }
    }
}

impl OwnedSlot for Slot {
    async fn is_own_transaction(&mut self, token: u64) -> Result<bool, Error> {
        let client = self.client()?;
        let token = token.to_string();
        let params: [Typed<'_>; 1] = [(&token, Type::TEXT)];
        let row = self
            .preparation
            .query_one(client, IS_OWN_TRANSACTION, &params)
            .await?;
        Ok(row.try_get(0)?)
    }

    async fn commit_and_release(&mut self) -> Result<(), Error> {
        Slot::commit_and_release(self).await
    }
}
