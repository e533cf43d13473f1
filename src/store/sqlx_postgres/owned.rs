//! The store's own transactions, outside any request: the receiver's inbox (feature `outbox`)
//! opens one, records an event id and applies the event through the same [`SqlxTransaction`]
//! handle a request's handler gets, then commits or rolls back itself.

use std::sync::Arc;

// The `Executor` methods keep these futures provably `Send` (see `reservation.rs`).
use sqlx::Executor as _;
use sqlx::Row as _;

use super::{PgDialect, SqlxPostgresStore, SqlxTransaction, TxConnection};
use crate::error::Error;
use crate::store::pg_sql::{IS_OWN_TRANSACTION, OWN_TRANSACTION_SETTING};
use crate::store::sqlx::{pool_error, Slot};
use crate::store::tx_state::TxShared;

impl SqlxPostgresStore {
    /// Opens a transaction of the store's own, outside any request (the inbox's), on a pooled
    /// connection, with the store's isolation level. It is used through the same handle as a
    /// request's transaction and rolls back the same way if dropped.
    pub(crate) async fn begin_owned(&self) -> Result<OwnedTransaction, Error> {
        let connection = self.pool().acquire().await.map_err(pool_error)?;
        let mut slot = Slot::new(TxConnection::new(connection));
        let token = self.next_token();
        // Only an integer is formatted into it.
        let begin = format!(
            "{}; SET LOCAL {OWN_TRANSACTION_SETTING} = '{token}'",
            self.shared.isolation.begin_statement()
        );
        let begun = match slot.raw() {
            Ok(conn) => conn.execute(begin.as_str()).await.map_err(Error::from),
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

    /// [`SqlxPostgresOptions::serialization_retries`](super::SqlxPostgresOptions::serialization_retries).
    pub(crate) fn serialization_retries(&self) -> u32 {
        self.shared.conflict_retries
    }
}

/// A transaction opened by [`SqlxPostgresStore::begin_owned`], committed or rolled back by its
/// owner (the inbox) rather than by the layer. Dropping it without either rolls back (by
/// closing its connection, as for a request).
pub(crate) struct OwnedTransaction {
    tx: Arc<TxShared<Slot<PgDialect>>>,
}

impl OwnedTransaction {
    /// A handle on this transaction: the same type a request's handler gets.
    pub(crate) fn handle(&self) -> SqlxTransaction {
        SqlxTransaction::new(self.tx.clone())
    }

    /// Commits, after checking that the transaction is still the one `begin_owned` opened and
    /// still able to commit (a failed statement aborts it, and `COMMIT` of an aborted
    /// transaction answers `ROLLBACK` without an error).
    pub(crate) async fn commit(self) -> Result<(), Error> {
        let mut slot = self.tx.take_connection()?;
        if let Some(conflict) = self.tx.conflict() {
            slot.roll_back_and_release().await;
            return Err(conflict);
        }
        let checked = async {
            let token = self.tx.token.to_string();
            let check = sqlx::query(IS_OWN_TRANSACTION).bind(token.as_str());
            let same: bool = slot.raw()?.fetch_one(check).await?.try_get(0)?;
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
