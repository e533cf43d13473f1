//! The options of a [`SqlxStore`] and building it: the application's pool for request
//! transactions, and a read pool for replays (the caller's, or one made from the same connect
//! options).

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolOptions;
use sqlx::Pool;

use super::{Shared, SqlxDialect, SqlxStore};
use crate::row_lock::replay_check::{ReplayCheck, ReplayChecks};
use crate::row_lock::reserve::Isolation;

/// Options for a [`SqlxStore`]; see [`SqlxStore::builder`].
#[derive(Clone, Debug)]
pub struct SqlxOptions<D: SqlxDialect> {
    pool: Pool<D::Db>,
    reads: Option<Pool<D::Db>>,
    max_read_connections: u32,
    read_wait: Duration,
    replay_check: ReplayCheck,
    isolation: Isolation,
    pub(crate) conflict_retries: u32,
    /// Whether the store keeps no statement prepared on a connection past one message or one
    /// transaction (set by a dialect's option: PostgreSQL's `with_unnamed_statements`).
    pub(crate) unnamed_statements: bool,
}

impl<D: SqlxDialect> SqlxOptions<D> {
    pub(super) fn new(pool: Pool<D::Db>) -> Self {
        SqlxOptions {
            pool,
            reads: None,
            max_read_connections: 8,
            read_wait: Duration::from_secs(1),
            replay_check: ReplayCheck::default(),
            isolation: Isolation::default(),
            conflict_retries: 3,
            unnamed_statements: false,
        }
    }

    /// The pool of the replay fast path. Default: a pool of its own, made (lazily) from the
    /// write pool's connect options, with [`with_max_read_connections`](Self::with_max_read_connections)
    /// connections. Give one to read from a replica: a record not yet replicated is then only
    /// found by the (authoritative) write path.
    pub fn with_read_pool(mut self, pool: Pool<D::Db>) -> Self {
        self.reads = Some(pool);
        self
    }

    /// The most connections of the read pool this store makes (not one given with
    /// [`with_read_pool`](Self::with_read_pool)). Default: 8.
    pub fn with_max_read_connections(mut self, connections: u32) -> Self {
        self.max_read_connections = connections.max(1);
        self
    }

    /// How long the replay fast path waits for a read before it gives up and lets the request
    /// take the (authoritative) write path. The bound is kept by a watchdog that looks every
    /// 20 ms, so a stuck read ends up to 20 ms late. Default: 1 s.
    pub fn with_read_wait(mut self, wait: Duration) -> Self {
        self.read_wait = wait;
        self
    }

    /// Where a request learns that its key has a completed record to replay: with a read on
    /// the read pool before its transaction, or in the transaction, by the reservation.
    /// Default: [`ReplayCheck::Adaptive`], which reads first only while retries are frequent
    /// among recent requests, or meanwhile when a reservation waits unusually long for a
    /// connection; see [`ReplayCheck`].
    /// [`ReplayCheck::FavorReplays`] keeps every replay off the pool of request transactions.
    pub fn with_replay_check(mut self, check: ReplayCheck) -> Self {
        self.replay_check = check;
        self
    }

    /// The isolation level of request transactions. Default: [`Isolation::ReadCommitted`]
    /// (on MySQL and MariaDB too: InnoDB's own default is `REPEATABLE READ`, whose gap locks
    /// make deadlocks between handlers likelier).
    pub fn with_isolation(mut self, isolation: Isolation) -> Self {
        self.isolation = isolation;
        self
    }

    /// The store. Opens no connection: the read pool this makes connects on first use.
    pub fn build(self) -> SqlxStore<D> {
        let reads = match self.reads {
            Some(reads) => reads,
            None => PoolOptions::<D::Db>::new()
                .max_connections(self.max_read_connections)
                .acquire_timeout(self.read_wait.max(Duration::from_millis(1)))
                // A broken connection only fails a lookup, which the write path then redoes.
                .test_before_acquire(false)
                .connect_lazy_with((*self.pool.connect_options()).clone()),
        };
        SqlxStore {
            shared: Arc::new(Shared {
                transactions: self.pool,
                reads,
                read_wait: self.read_wait,
                replay_checks: ReplayChecks::new(self.replay_check),
                isolation: self.isolation,
                conflict_retries: self.conflict_retries,
                unnamed_statements: self.unnamed_statements,
                reservations: AtomicU64::new(1),
            }),
            key_row_wait: None,
        }
    }
}
