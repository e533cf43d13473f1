//! The store's own transactions, outside any request: the receiver's inbox (feature `outbox`)
//! opens one, records an event id and applies the event through the same [`SqlxHandle`]
//! handle a request's handler gets, then commits or rolls back itself ([`OwnedTransaction`],
//! the same for every store). Each call of a step-by-step request runs in one too (a local
//! step's closure gets its handle). What differs per database is [`OwnedDialect`]'s.

use futures_util::future::BoxFuture;
// The `Executor` methods keep these futures provably `Send` (see `reservation.rs`).
use sqlx::Executor as _;

use super::CheckedConnection;
use super::{pool_error, Conn, Slot, SqlxDatabase, SqlxDialect, SqlxHandle, SqlxStore};
use crate::error::Error;
use crate::row_lock::driver::Own;
use crate::row_lock::reserve::Isolation;
use crate::row_lock::tx_state::{OwnedSlot, OwnedTransaction};
use crate::sqlx::driver::our_sql;

/// How a database opens and checks a transaction of the store's own.
pub(crate) trait OwnedDialect: SqlxDialect {
    /// `BEGIN` at `isolation` of a transaction marked with `token` (only integers are
    /// formatted into it).
    fn begin_owned(isolation: Isolation, token: u64) -> String;

    /// Whether the transaction on `conn` is still the one marked with `token` when it was
    /// opened, before its `COMMIT`.
    fn is_own_transaction(conn: &mut Conn<Self>, token: u64) -> BoxFuture<'_, Result<bool, Error>>;
}

impl<D: SqlxDialect> SqlxStore<D> {
    /// Opens a transaction of the store's own, outside any request (the inbox's), on a pooled
    /// connection, at the isolation level `own` says. It is used through the same handle as a
    /// request's transaction and rolls back the same way if dropped.
    pub(crate) async fn begin_owned(&self, own: Own) -> Result<OwnedTransaction<Slot<D>>, Error>
    where
        D: OwnedDialect,
    {
        let connection = self.pool().acquire().await.map_err(pool_error)?;
        let unnamed = self.shared.unnamed_statements;
        let mut slot =
            Slot::new(CheckedConnection::new(connection).with_unnamed_statements(unnamed));
        let token = self.next_token();
        let begin = D::begin_owned(own.isolation(self.shared.isolation), token);
        let begun = match slot.forget_statements().await {
            Ok(()) => match slot.raw() {
                Ok(conn) => D::Db::executor(conn)
                    .execute(our_sql(begin))
                    .await
                    .map(drop)
                    .map_err(Error::from),
                Err(error) => Err(error),
            },
            Err(error) => Err(error.into()),
        };
        OwnedTransaction::opened(token, slot, begun).await
    }
}

impl<D: SqlxDialect> OwnedTransaction<Slot<D>> {
    /// A handle on this transaction: the same type a request's handler gets.
    pub(crate) fn handle(&self) -> SqlxHandle<D> {
        SqlxHandle::new(self.tx.clone())
    }
}

impl<D: OwnedDialect> OwnedSlot for Slot<D> {
    async fn is_own_transaction(&mut self, token: u64) -> Result<bool, Error> {
        D::is_own_transaction(self.raw()?, token).await
    }

    async fn commit_and_release(&mut self) -> Result<(), Error> {
        Slot::commit_and_release(self).await
    }
}
