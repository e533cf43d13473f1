//! The store's own transactions, outside any request: the receiver's inbox (feature `outbox`)
//! opens one, records an event id and applies the event through the same [`SqlxTransaction`]
//! handle a request's handler gets, then commits or rolls back itself ([`OwnedTransaction`],
//! the same for both PostgreSQL drivers).

// The `Executor` methods keep these futures provably `Send` (see `store::sqlx::reservation`).
use sqlx::Executor as _;
use sqlx::Row as _;

use super::{PgDialect, SqlxPostgresStore, SqlxTransaction, TxConnection};
use crate::error::Error;
use crate::store::pg_sql::IS_OWN_TRANSACTION;
use crate::store::sqlx::{pool_error, Slot};
use crate::store::tx_state::{OwnedSlot, OwnedTransaction};

impl SqlxPostgresStore {
    /// Opens a transaction of the store's own, outside any request (the inbox's), on a pooled
    /// connection, with the store's isolation level. It is used through the same handle as a
    /// request's transaction and rolls back the same way if dropped.
    pub(crate) async fn begin_owned(&self) -> Result<OwnedTransaction<Slot<PgDialect>>, Error> {
        let connection = self.pool().acquire().await.map_err(pool_error)?;
        let mut slot = Slot::new(TxConnection::new(connection));
        let token = self.next_token();
        let begin = self.shared.isolation.begin_owned(token);
        let begun = match slot.raw() {
            Ok(conn) => conn
                .execute(begin.as_str())
                .await
                .map(drop)
                .map_err(Error::from),
            Err(error) => Err(error),
        };
        OwnedTransaction::opened(token, slot, begun).await
    }

    /// [`SqlxPostgresOptions::serialization_retries`](super::SqlxPostgresOptions::serialization_retries).
    pub(crate) fn serialization_retries(&self) -> u32 {
        self.shared.conflict_retries
    }
}

impl OwnedTransaction<Slot<PgDialect>> {
    /// A handle on this transaction: the same type a request's handler gets.
    pub(crate) fn handle(&self) -> SqlxTransaction {
        SqlxTransaction::new(self.tx.clone())
    }
}

impl OwnedSlot for Slot<PgDialect> {
    async fn is_own_transaction(&mut self, token: u64) -> Result<bool, Error> {
        let token = token.to_string();
        let check = sqlx::query(IS_OWN_TRANSACTION).bind(token.as_str());
        Ok(self.raw()?.fetch_one(check).await?.try_get(0)?)
    }

    async fn commit_and_release(&mut self) -> Result<(), Error> {
        Slot::commit_and_release(self).await
    }
}
