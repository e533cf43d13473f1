//! The store itself: [`PostgresStore`], its shared state (the two pools and the settings),
//! and its [`IdempotencyStore`] calls: the replay check on the read pool, `begin` (retrying a
//! reservation that conflicted) and the purge of expired records.

use std::fmt;
use std::future::Future;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use deadpool_postgres::{Object, Pool, PoolError};
use tokio_postgres::types::Type;

use super::lookups::Lookups;
use super::statements::{Preparation, Typed};
use super::{Isolation, PostgresReservation, PURGE_EXPIRED};
use crate::error::Error;
use crate::in_flight::InFlight;
use crate::row_lock::replay_check::{first_attempt, ReplayChecks};
use crate::row_lock::reserve;
use crate::store::{to_unix_millis, Begin, IdempotencyStore, RunOutcome, Scope, StoredRecord};

/// What clones of a store share.
pub(super) struct Shared {
    /// Request transactions and [`PostgresStore::client`].
    pub(super) transactions: Pool,
    /// The replay fast path.
    pub(super) reads: Pool,
    /// The replay checks in flight and queued.
    pub(super) lookups: Arc<Lookups>,
    pub(super) read_wait: Duration,
    /// Where first attempts check for a record (and what they have found lately).
    pub(super) replay_checks: ReplayChecks,
    pub(super) isolation: Isolation,
    pub(super) serialization_retries: u32,
    /// How the store's statements reach the server (prepared and cached, or unnamed).
    pub(super) preparation: Preparation,
    /// The next transaction's token (its name in logs and `Debug`).
    pub(super) reservations: AtomicU64,
}

/// A PostgreSQL-backed [`IdempotencyStore`]. Cheap to clone; clones share the pools.
#[derive(Clone)]
pub struct PostgresStore {
    pub(super) shared: Arc<Shared>,
    /// The in-flight policy's bound on the wait for a key's row
    /// ([`IdempotencyStore::bound_duplicate_wait`]); `None`: the lock timeout.
    pub(super) key_row_wait: Option<Duration>,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("transactions", &self.shared.transactions.status())
            .field("reads", &self.shared.reads.status())
            .field("replay_check", &self.shared.replay_checks.check())
            .field("isolation", &self.shared.isolation)
            .field("preparation", &self.shared.preparation)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// A pooled connection in autocommit mode, for work outside a request: creating your
    /// tables, reads of your own rows. Open your own transaction with
    /// `client.transaction().await`. It comes from the same pool as request transactions.
    pub async fn client(&self) -> Result<Object, Error> {
        self.shared.transactions.get().await.map_err(pool_error)
    }

    /// The pool of request transactions (the one [`client`](Self::client) takes from).
    pub fn pool(&self) -> &Pool {
        &self.shared.transactions
    }

    /// How the store's statements reach the server (see `statements`).
    pub(crate) fn preparation(&self) -> Preparation {
        self.shared.preparation
    }
}

impl PostgresStore {
    /// Closes the idle connections of both pools, after one of them met a server that went
    /// away or became read-only (a failover): the others most likely lead to the same server,
    /// and the pools then connect afresh (to the new primary, with several hosts and
    /// `target_session_attrs=read-write`) instead of failing one request per connection.
    pub(super) fn forget_idle_connections(&self) {
        self.shared.transactions.retain(|_, _| false);
        self.shared.reads.retain(|_, _| false);
    }
}

impl PostgresStore {
    /// The live completed record of `scope` at `now` (in milliseconds) on the read pool: a
    /// plain snapshot read in autocommit, which takes no row locks and never waits for the
    /// transaction that holds this scope (an uncommitted reservation is simply invisible).
    /// Batched with the checks of other requests under load (`lookups`); given up after
    /// `read_wait`.
    pub(super) async fn read(
        &self,
        scope: &Scope,
        now: i64,
    ) -> Result<Option<StoredRecord>, Error> {
        let shared = &self.shared;
        let read = shared
            .lookups
            .check(&shared.reads, shared.preparation, scope, now);
        reserve::within(self.shared.read_wait, read).await
    }
}

pub(super) fn pool_error(error: PoolError) -> Error {
    match error {
        PoolError::Timeout(_) => Error::Busy,
        PoolError::Backend(error) => Error::TokioPostgres(error),
        PoolError::Closed => Error::Closed,
        other => Error::Io(std::io::Error::other(other.to_string())),
    }
}

impl IdempotencyStore for PostgresStore {
    type Reservation = PostgresReservation;

    async fn lookup(&self, scope: &Scope, now: SystemTime) -> Result<Option<StoredRecord>, Error> {
        // Boxed, as the reservation and the commit are: see `begin`.
        Box::pin(self.read(scope, to_unix_millis(now))).await
    }

    /// The replay check on the read pool first, or `begin_and_run` alone (the reservation
    /// finds a completed record itself), as the store's `ReplayCheck` decides.
    async fn lookup_then_begin_and_run<W, F>(
        &self,
        scope: &Scope,
        lock_timeout: Duration,
        now: SystemTime,
        work: W,
    ) -> Result<RunOutcome<F::Output>, Error>
    where
        W: FnOnce(PostgresReservation) -> F + Send + 'static,
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let checks = &self.shared.replay_checks;
        first_attempt(self, checks, scope, lock_timeout, now, work).await
    }

    async fn begin(
        &self,
        scope: &Scope,
        lock_timeout: Duration,
        now: SystemTime,
    ) -> Result<Begin<PostgresReservation>, Error> {
        // tokio-postgres's futures are large (a statement's preparation, its query and their
        // time bounds: about 5 KB for the reservation, 4 for the read, 3 for the commit).
        // Boxed, each takes its room only while it runs; inline, every request's future would
        // hold room for the largest of them for its whole life (about 8 KB), and copy it on
        // each move.
        Box::pin(reserve::begin_with_retries(
            self.shared.serialization_retries,
            lock_timeout,
            now,
            |deadline, now| self.try_begin(scope, deadline, lock_timeout, now),
        ))
        .await
    }

    /// Bounds the reservation's wait on the key's row (`lock_timeout` while it runs, SQLSTATE
    /// `55P03` past it), under [`InFlight::Reject`] by 1 ms.
    fn bound_duplicate_wait(mut self, policy: InFlight) -> Self {
        self.key_row_wait = reserve::key_row_wait(policy);
        self
    }

    async fn purge_expired(&self, now: SystemTime, batch: usize) -> Result<u64, Error> {
        let client = self.client().await?;
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        let now_millis = to_unix_millis(now);
        let params: [Typed<'_>; 2] = [(&now_millis, Type::INT8), (&batch, Type::INT8)];
        let deleted = self
            .shared
            .preparation
            .execute(&client, PURGE_EXPIRED, &params)
            .await?;
        drop(client);
        let batch = usize::try_from(batch).unwrap_or(usize::MAX);
        let progress = crate::steps::StepStore::purge_progress(self, now, batch).await?;
        Ok(deleted + progress)
    }
}
