//! [`SqliteHandle`]: the handler's side of a request's write transaction.
//!
//! The layer puts one in the request extensions ([`Reservation::handle`] of the
//! request's `SqliteReservation`). Its statements run where the request holds the writer:
//! inline when it runs in place (`in_place`); on the writer thread otherwise, at once when the
//! handler's work is polled there (`executor`, through `writer`'s `run_if_on_writer`),
//! through the writer's queue from any other task. They share the
//! reservation's [`TxShared`] (`reservation`), which tells whether the request still holds
//! the writer; the authorizer's refusals (`authorizer`) become [`Error::TransactionControl`].

use std::any::TypeId;
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use rusqlite::Connection;

use super::reservation::TxShared;
use super::writer::{run_if_on_writer, Writer};
use crate::error::Error;
#[cfg(doc)]
use crate::store::Reservation;

/// The handle a handler uses to write its rows in the request's transaction.
///
/// The layer puts it in the request extensions. Everything run through it belongs to the same
/// SQLite transaction as the idempotency record: it commits when the layer saves the response,
/// and rolls back if the handler fails, panics or the client goes away.
///
/// ```no_run
/// # async fn handler(tx: tower_idempotency::store::sqlite::SqliteHandle)
/// #     -> Result<i64, tower_idempotency::Error> {
/// let order_id = tx
///     .run(|conn| {
///         conn.execute("INSERT INTO orders (sku, quantity) VALUES (?1, ?2)", ("book", 1))?;
///         Ok(conn.last_insert_rowid())
///     })
///     .await?;
/// # Ok(order_id) }
/// ```
#[derive(Clone)]
pub struct SqliteHandle {
    pub(super) tx: Arc<TxShared>,
}

impl fmt::Debug for SqliteHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteHandle")
            .field("generation", &self.tx.generation)
            .field("finished", &self.tx.finished.load(Ordering::Acquire))
            .finish()
    }
}

impl SqliteHandle {
    /// Runs `f` on the transaction's connection: on the calling thread when the request
    /// runs in place ([`SqliteOptions::with_write_in_place`](super::SqliteOptions::with_write_in_place);
    /// on the blocking pool if another task of the request is running a statement at that
    /// moment); otherwise on the writer thread, at once when called from the handler under the
    /// layer (its work is polled there, see the
    /// [module docs](super#the-handler-runs-on-the-writer-thread-or-in-place)), through the
    /// writer's queue from any other task. A panic in `f` is returned as [`Error::Panicked`].
    ///
    /// Transaction control in `f` (`COMMIT`, `ROLLBACK`, `BEGIN`, `END`, the request's
    /// savepoint) is refused with [`Error::TransactionControl`]: the layer commits. If the
    /// transaction ends inside `f` anyway (a trigger's `RAISE(ROLLBACK)`, `ON CONFLICT
    /// ROLLBACK`, or SQLite rolling it back on a full disk), this returns
    /// [`Error::TransactionAborted`] and the request fails; the other requests of its commit
    /// group run again (see [group commit](super#group-commit)).
    pub async fn run<T, F>(&self, f: F) -> Result<T, Error>
    where
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        if self.tx.finished.load(Ordering::Acquire) {
            return Err(Error::TransactionFinished);
        }
        let generation = self.tx.generation;
        let statement = move |writer: &mut Writer| {
            if writer.active != Some(generation) {
                return Err(Error::TransactionFinished);
            }
            // A panicking statement is an error for the caller, not a panic through it.
            let result = std::panic::catch_unwind(AssertUnwindSafe(|| f(&writer.conn)))
                .map_err(|_| Error::Panicked)?;
            if writer.conn.is_autocommit() {
                // `after_job` rolls the rest of the group back, and its members run again.
                // The statement's own error says why (a full disk is a 503); the request's end
                // finds its transaction gone either way.
                return Err(match result {
                    Err(error) => writer.control.error(error),
                    Ok(_) => Error::TransactionAborted(
                        "a handler's statement ended the transaction (RAISE(ROLLBACK), \
                         ON CONFLICT ROLLBACK, or a disk error)",
                    ),
                });
            }
            result.map_err(|error| writer.control.error(error))
        };
        // The request holds the writer in place: run the statement here.
        if self.tx.in_place.is_some() {
            // The site is the closure's type: what the handler's code at one place runs.
            return self
                .tx
                .with_lent(TypeId::of::<F>(), move |lent| {
                    let writer = lent.as_mut().ok_or(Error::TransactionFinished)?;
                    let result = statement(writer);
                    writer.after_job();
                    result
                })
                .await;
        }
        // From the request's work, polled on the writer thread: run the statement now.
        match run_if_on_writer(self.tx.store.id, statement) {
            Ok(result) => result,
            Err(statement) => self.tx.store.call(statement).await,
        }
    }

    /// Whether the transaction has been committed or rolled back.
    pub fn is_finished(&self) -> bool {
        self.tx.finished.load(Ordering::Acquire)
    }
}
