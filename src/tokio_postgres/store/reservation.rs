//! Reserving a key and ending the request's transaction: `try_begin` takes a connection and
//! [`reserve`] sends the `BEGIN` and the reservation's `INSERT` in one flight (then, for a
//! duplicate, replays or takes over its record); [`PostgresReservation`] is the layer's side of
//! the open transaction, whose `commit` sends the completed record and `COMMIT` in one flight,
//! checked by the reservation row's `xmin`.

use std::fmt;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;

use deadpool_postgres::ClientWrapper;

use super::slot::{Slot, TxShared};
use super::statements::{untyped, Preparation, Typed};
use super::store::pool_error;
use super::{
    Isolation, PostgresHandle, PostgresStore, COMPLETE_RECORD, INSERT_RESERVATION, SELECT_RECORD,
    TAKE_OVER,
};
use crate::error::Error;
use crate::postgres::failover::postgres_unavailable;
use crate::postgres::reserve::{self as pg_reserve, ReserveStatements, Reserved};
use crate::response::SavedResponse;
use crate::row_lock::replay_check::Acquired;
use crate::row_lock::reserve;
use crate::row_lock::tx_state::TxSlot as _;
use crate::store::columns::record_row::live_record;
use crate::store::{to_unix_millis, Begin, NewRecord, Reservation, Scope, StoredRecord};

impl PostgresStore {
    /// One attempt at opening the transaction and reserving the scope.
    pub(super) async fn try_begin(
        &self,
        scope: &Scope,
        deadline: Instant,
        lock_timeout: Duration,
        now: i64,
    ) -> Result<Begin<PostgresReservation>, Error> {
        // The wait ends in this block: its future takes no room beside the reservation's.
        let object = {
            let acquire = std::pin::pin!(async {
                tokio::time::timeout_at(deadline, self.shared.transactions.get())
                    .await
                    .map_err(|_| Error::Busy)?
                    .map_err(pool_error)
            });
            let read = || self.read(scope, now);
            match self.shared.replay_checks.acquire(acquire, read).await? {
                Acquired::Connection(object) => object,
                Acquired::Found(record) => return Ok(Begin::Existing(record)),
            }
        };
        // From here on, dropping this future (the client went away) discards the connection,
        // which rolls back whatever the server has done for it.
        let mut slot = Slot {
            object: Some(object),
            answer_wait: Some(lock_timeout + pg_reserve::ANSWER_MARGIN),
            preparation: self.shared.preparation,
        };
        let token = self.shared.reservations.fetch_add(1, Ordering::Relaxed);
        let isolation = self.shared.isolation;
        // The server ends its lock waits by the deadline; one that has not answered soon
        // after has stopped answering (the connection is then closed).
        let reserving = reserve(&slot, scope, deadline, self.key_row_wait, now, isolation);
        let due = pg_reserve::answers_due(deadline, self.key_row_wait);
        match pg_reserve::answered_by(due, reserving).await {
            Ok(Reserved::Row(row_id)) => Ok(Begin::Reserved(PostgresReservation {
                tx: Arc::new(TxShared::new(token, slot)),
                scope: scope.clone(),
                row_id,
                commit_wait: lock_timeout,
            })),
            Ok(Reserved::Existing(record)) => {
                slot.roll_back_and_release().await;
                Ok(Begin::Existing(record))
            }
            Err(error) => {
                slot.roll_back_after(&error).await;
                if error.is_unavailable() {
                    // The other idle connections most likely lead to the same server.
                    self.forget_idle_connections();
                }
                Err(error)
            }
        }
    }
}

/// The reservation's statements on a tokio-postgres connection. Each is prepared (from the
/// connection's cache) inside the transaction, where `lock_timeout` bounds the wait: parsing a
/// statement that writes the table takes the table's lock, which another session may hold (a
/// `LOCK TABLE`). The re-check and the take-over are prepared only when a conflict needs them:
/// a new key runs the insert alone. (Unnamed statements are parsed in the transaction too.)
struct Statements<'a> {
    client: &'a ClientWrapper,
    preparation: Preparation,
    scope: &'a Scope,
    now: i64,
}

impl ReserveStatements for Statements<'_> {
    type Row = String;

    async fn insert(&mut self) -> Result<Option<String>, Error> {
        let s = self.scope;
        let (tenant, operation, key) = (&*s.tenant, &*s.operation, s.key.as_str());
        let params: [Typed<'_>; 4] = [
            (&tenant, Type::TEXT),
            (&operation, Type::TEXT),
            (&key, Type::TEXT),
            (&self.now, Type::INT8),
        ];
        // Ready at once when the connection has it (no round trip of its own), or unnamed: the
        // insert is then sent in the same flight as whatever was polled before it.
        let row = self
            .preparation
            .query_opt(self.client, INSERT_RESERVATION, &params)
            .await?;
        Ok(row.map(|row| row.try_get(0)).transpose()?)
    }

    async fn select(&mut self) -> Result<Option<Option<StoredRecord>>, Error> {
        let s = self.scope;
        let (tenant, operation, key) = (&*s.tenant, &*s.operation, s.key.as_str());
        let params: [Typed<'_>; 3] = [
            (&tenant, Type::TEXT),
            (&operation, Type::TEXT),
            (&key, Type::TEXT),
        ];
        let row = self
            .preparation
            .query_opt(self.client, SELECT_RECORD, &params)
            .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        live_record(&row, self.now).map(Some)
    }

    async fn take_over(&mut self) -> Result<Option<String>, Error> {
        let s = self.scope;
        let (tenant, operation, key) = (&*s.tenant, &*s.operation, s.key.as_str());
        let params: [Typed<'_>; 4] = [
            (&tenant, Type::TEXT),
            (&operation, Type::TEXT),
            (&key, Type::TEXT),
            (&self.now, Type::INT8),
        ];
        let row = self
            .preparation
            .query_opt(self.client, TAKE_OVER, &params)
            .await?;
        Ok(row.map(|row| row.try_get(0)).transpose()?)
    }
}

/// Opens the transaction on `slot`'s connection and reserves `scope` (see
/// [`pg_reserve::reserve`]), waiting on the key's row up to `key_row_wait` if set
/// ([`Error::InFlight`] past it). The transaction is left open either way.
async fn reserve(
    slot: &Slot,
    scope: &Scope,
    deadline: Instant,
    key_row_wait: Option<Duration>,
    now: i64,
    isolation: Isolation,
) -> Result<Reserved<String>, Error> {
    let client = slot.client()?;
    let mut statements = Statements {
        client,
        preparation: slot.preparation,
        scope,
        now,
    };
    // The begin and the first reservation go in one flight (tokio-postgres pipelines requests
    // polled together, in order): one round trip for both. On a connection that has not
    // prepared the insert yet, its preparation follows the begin (and the insert follows it),
    // bounded by the `lock_timeout` the begin set. Should the begin fail (its `SET LOCAL`, or
    // under an in-flight policy the wait for the table's lock), the transaction is aborted
    // and the insert fails with it; the begin's error is the one reported, never as in flight.
    let begin = isolation.begin_request(deadline, key_row_wait);
    let (begun, first) =
        futures_util::future::join(client.batch_execute(&begin), statements.insert()).await;
    begun?;
    let reserved = match first {
        Ok(first) => pg_reserve::reserve(&mut statements, Some(first)).await,
        Err(error) => Err(error),
    }
    .map_err(|error| reserve::in_flight_past_bound(key_row_wait, error))?;
    if key_row_wait.is_some() && matches!(reserved, Reserved::Row(_)) {
        // The handler's own lock waits keep the lock timeout.
        let restore = pg_reserve::restore_lock_timeout(deadline);
        client.batch_execute(&restore).await?;
    }
    Ok(reserved)
}

/// A serialization failure (`40001`) or a deadlock (`40P01`).
pub(super) fn is_conflict_code(error: &tokio_postgres::Error) -> bool {
    matches!(
        error.code(),
        Some(code) if *code == SqlState::T_R_SERIALIZATION_FAILURE
            || *code == SqlState::T_R_DEADLOCK_DETECTED
    )
}

/// The open transaction of one request (the owner side, held by the layer).
///
/// Dropping it without committing rolls back (by closing its connection; see the module docs).
pub struct PostgresReservation {
    pub(super) tx: Arc<TxShared>,
    scope: Scope,
    /// The `ctid` of the reserved row.
    row_id: String,
    /// How long the commit waits for the server's answers before it takes the server for gone
    /// (plus [`pg_reserve::ANSWER_MARGIN`]): the layer's lock timeout.
    commit_wait: Duration,
}

impl fmt::Debug for PostgresReservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresReservation")
            .field("reservation", &self.tx.token)
            .finish_non_exhaustive()
    }
}

impl Drop for PostgresReservation {
    fn drop(&mut self) {
        self.tx.abandon();
    }
}

impl Reservation for PostgresReservation {
    type Handle = PostgresHandle;

    fn handle(&self) -> PostgresHandle {
        PostgresHandle {
            tx: self.tx.clone(),
        }
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

impl PostgresReservation {
    /// [`Reservation::commit`]: the record completed and `COMMIT`, in one flight.
    async fn complete_and_commit(self, record: NewRecord) -> Result<(), Error> {
        let mut slot = self.tx.take_connection()?;
        // The transaction is already rolled back on the server (or the server is gone): report
        // why, to run it again or answer 503.
        if let Some(conflict) = self.tx.conflict() {
            slot.roll_back_after(&conflict).await;
            return Err(conflict);
        }
        let client = match slot.client() {
            Ok(client) => client,
            Err(error) => return Err(error),
        };
        // A server that stops answering holds the commit no longer than a lock wait (and the
        // margin): the connection is then closed.
        let answer_by = Instant::now() + self.commit_wait;
        // Prepared (from the connection's cache) before the flight; an unnamed statement is
        // parsed in it.
        let prepared = match slot.preparation {
            Preparation::Cached => {
                let prepared = pg_reserve::answered_by(answer_by, async {
                    Ok(client.prepare_cached(COMPLETE_RECORD).await?)
                });
                match prepared.await {
                    Ok(statement) => Some(statement),
                    Err(error) => {
                        slot.roll_back_after(&error).await;
                        return Err(error);
                    }
                }
            }
            Preparation::Unnamed => None,
        };
        let response = &record.response;
        let trailers = response
            .trailers
            .as_ref()
            .map(|t| SavedResponse::encode_headers(t));
        let (tenant, operation, key) = (
            &*self.scope.tenant,
            &*self.scope.operation,
            self.scope.key.as_str(),
        );
        let (digest, version) = (
            &record.fingerprint.digest()[..],
            i32::from(record.fingerprint.version()),
        );
        let (status, headers, body) = (
            i32::from(response.status.as_u16()),
            SavedResponse::encode_headers(&response.headers),
            &response.body[..],
        );
        let (created_at, expires_at) = (
            to_unix_millis(record.created_at),
            to_unix_millis(record.expires_at),
        );
        let params: [Typed<'_>; 12] = [
            (&tenant, Type::TEXT),
            (&operation, Type::TEXT),
            (&key, Type::TEXT),
            (&digest, Type::BYTEA),
            (&version, Type::INT4),
            (&status, Type::INT4),
            (&headers, Type::TEXT),
            (&body, Type::BYTEA),
            (&trailers, Type::TEXT),
            (&created_at, Type::INT8),
            (&expires_at, Type::INT8),
            (&self.row_id, Type::TEXT),
        ];
        // The record and `COMMIT` in one flight (tokio-postgres sends requests polled together
        // in order): when the record fails, the transaction is aborted and PostgreSQL answers
        // the `COMMIT` with a `ROLLBACK`. The statement answers one row (`1`) or fails: its
        // row count says so without decoding the row.
        let save = async {
            match &prepared {
                Some(statement) => client.execute(statement, &untyped(&params)).await,
                None => client.execute_typed(COMPLETE_RECORD, &params).await,
            }
        };
        let flight = futures_util::future::join(save, client.batch_execute("COMMIT"));
        let Ok((saved, committed)) =
            tokio::time::timeout_at(answer_by + pg_reserve::ANSWER_MARGIN, flight).await
        else {
            // `COMMIT` was sent: it may have committed. The same key replays if it did.
            slot.discard();
            return Err(Error::CommitOutcomeUnknown(
                "the database did not answer COMMIT within the lock timeout".to_owned(),
            ));
        };
        // Committed, rolled back, or the connection is gone: no transaction is left open on it.
        slot.release();
        match (saved, committed) {
            (Ok(1), Ok(())) => Ok(()),
            // Never: an aggregate without `GROUP BY` answers one row. Reported as `query_one`
            // reported it, as a failure, but without claiming that nothing was committed.
            (Ok(rows), Ok(())) => Err(Error::CommitOutcomeUnknown(format!(
                "the record's completion answered {rows} rows instead of one"
            ))),
            (Err(error), _) if error.code() == Some(&SqlState::DIVISION_BY_ZERO) => {
                Err(Error::TransactionAborted(
                    "the transaction ended before commit (it is not the one the layer began)",
                ))
            }
            // The connection was lost with `COMMIT` sent (or on its way): it may have committed.
            // Not a final failure: the same key replays if it did, and runs afresh if not.
            (_, Err(error)) if postgres_unavailable(&error) => {
                Err(Error::CommitOutcomeUnknown(error.to_string()))
            }
            (Err(error), _) | (Ok(_), Err(error)) => Err(error.into()),
        }
    }
}
