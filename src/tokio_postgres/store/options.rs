//! The options of a [`PostgresStore`] ([`PostgresOptions`], [`Isolation`]) and connecting:
//! building the two pools (request transactions, replays) or taking pools of the caller's,
//! then installing the schema.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, Pool, QueueMode};
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{NoTls, Socket};

use super::statements::Preparation;
use super::store::Shared;
use super::PostgresStore;
use crate::error::Error;
use crate::row_lock::replay_check::ReplayChecks;

use crate::store::{Isolation, ReplayCheck};

/// Options for opening a [`PostgresStore`]; see [`PostgresStore::builder`] and
/// [`PostgresStore::builder_from_pool`].
#[derive(Clone, Debug)]
pub struct PostgresOptions {
    connections: Connections,
    read_pool: Option<Pool>,
    read_config: Option<Box<tokio_postgres::Config>>,
    max_connections: usize,
    max_read_connections: usize,
    read_wait: Duration,
    replay_check: ReplayCheck,
    isolation: Isolation,
    serialization_retries: u32,
    create_schema: bool,
    preparation: Preparation,
}

impl PostgresOptions {
    /// The most connections held by request transactions (and [`PostgresStore::client`]) at
    /// once. A request that finds them all busy waits for one within the layer's lock timeout.
    /// Default: 16. (A pool of your own, [`PostgresStore::builder_from_pool`], keeps its own size.)
    pub fn with_max_connections(mut self, connections: usize) -> Self {
        self.max_connections = connections.max(1);
        self
    }

    /// The most connections used by the replay fast path at once. They are a separate pool, so
    /// that replays never wait for connections that writers hold. Default: 8. (A pool of your
    /// own, [`with_read_pool`](Self::with_read_pool), keeps its own size.)
    pub fn with_max_read_connections(mut self, connections: usize) -> Self {
        self.max_read_connections = connections.max(1);
        self
    }

    /// A pool of your own for the replay fast path, instead of one the store builds.
    ///
    /// Default: none. Without it, a store on settings builds its read pool
    /// ([`with_max_read_connections`](Self::with_max_read_connections)), and a store on a pool of your
    /// own ([`PostgresStore::builder_from_pool`]) reads from that same pool: replays may then wait for
    /// connections that writers hold, up to [`with_read_wait`](Self::with_read_wait), before taking the
    /// write path.
    pub fn with_read_pool(mut self, pool: Pool) -> Self {
        self.read_pool = Some(pool);
        self
    }

    /// Replays read from the server of these settings, a hot standby for example, instead of
    /// the primary: the store builds its read pool on them
    /// ([`with_max_read_connections`](Self::with_max_read_connections)). (A [`with_read_pool`](Self::with_read_pool)
    /// of your own takes precedence.)
    ///
    /// A standby can never make a key look absent that the primary has committed: the read
    /// is only the fast path. On a miss (the standby has not replayed the commit yet) or an
    /// error (the standby is down), the request takes the write path on the primary, which
    /// reserves the key with an `INSERT` and finds the committed record there. What a replay
    /// from the standby shows is a record the primary committed; a record deleted since
    /// (by the admin tool: the purge only deletes expired ones, which the read skips) may
    /// still replay from a lagging standby. See
    /// [Running past one server](crate::store::tokio_postgres#running-past-one-server).
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::store::tokio_postgres::PostgresStore;
    ///
    /// let primary = "postgres://app@db1,db2/shop?target_session_attrs=read-write".parse()?;
    /// let standby = "postgres://app@db2/shop".parse()?;
    /// let store = PostgresStore::builder(primary).with_read_from(standby).build().await?;
    /// # let _ = store;
    /// # Ok(()) }
    /// ```
    pub fn with_read_from(mut self, config: tokio_postgres::Config) -> Self {
        self.read_config = Some(Box::new(config));
        self
    }

    /// How long the replay fast path may take (the wait for a read connection included)
    /// before it gives up and lets the request take the (authoritative) write path. The bound
    /// is kept by a watchdog that looks every 20 ms, so a stuck check ends up to 20 ms late.
    /// Default: 1 s.
    pub fn with_read_wait(mut self, wait: Duration) -> Self {
        self.read_wait = wait;
        self
    }

    /// Where a request learns that its key has a completed record to replay: with a read on
    /// the read pool before its transaction, or in the transaction, by the reservation.
    /// Default: [`ReplayCheck::Adaptive`], which reads first only while retries are frequent
    /// among recent requests, or meanwhile when a reservation waits unusually long for a
    /// connection; see [`ReplayCheck`].
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::store::tokio_postgres::PostgresStore;
    /// use tower_idempotency::store::ReplayCheck;
    ///
    /// // Replays must never take a connection of the request transactions.
    /// let store = PostgresStore::builder("postgres://app@127.0.0.1/shop".parse()?)
    ///     .with_replay_check(ReplayCheck::FavorReplays)
    ///     .build()
    ///     .await?;
    /// # let _ = store;
    /// # Ok(()) }
    /// ```
    pub fn with_replay_check(mut self, check: ReplayCheck) -> Self {
        self.replay_check = check;
        self
    }

    /// The isolation level of request transactions. Default: [`Isolation::ReadCommitted`].
    pub fn with_isolation(mut self, isolation: Isolation) -> Self {
        self.isolation = isolation;
        self
    }

    /// How many times reserving a key is retried after a serialization failure (`40001`) or a
    /// deadlock (`40P01`), within the lock timeout, before the request gets `503`. Default: 3.
    pub fn with_serialization_retries(mut self, retries: u32) -> Self {
        self.serialization_retries = retries;
        self
    }

    /// Whether connecting creates `idempotency_records` if it is missing (or migrates a table
    /// of the SQLite layout). Default: `true`. A tool that must not change the database (an
    /// admin tool) turns it off: connecting then only checks that a connection can be made,
    /// and calls fail if the table is missing.
    pub fn with_create_schema(mut self, create: bool) -> Self {
        self.create_schema = create;
        self
    }

    /// Whether the store sends each of its statements unnamed, parsed, bound and run in one
    /// message, instead of preparing it once per connection and running it by name. Turn it on
    /// behind a connection pool that may hand each transaction to another server connection:
    /// PgBouncer with `pool_mode = transaction` (before 1.21, or with `max_prepared_statements`
    /// unset), Supavisor, RDS Proxy. There, a statement prepared on one server connection does
    /// not exist on the next, and requests fail with `500` and
    /// `prepared statement "s21" does not exist`. Default: `false` (on a direct connection a
    /// statement prepared once is not parsed and planned again on every run).
    ///
    /// It covers the store's statements, and a handler's statements through its
    /// [`CheckedClient`](super::CheckedClient) inside the request's transaction:
    /// [`prepare_cached`](super::CheckedClient::prepare_cached) then prepares afresh (the
    /// statement is closed when dropped, before the transaction ends). Your own statements
    /// outside a request are yours to send the same way: see
    /// [Behind a transaction pooler](crate::store::tokio_postgres#behind-a-transaction-pooler).
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::store::tokio_postgres::PostgresStore;
    ///
    /// // PgBouncer, pool_mode = transaction, on port 6432.
    /// let store = PostgresStore::builder("postgres://app@127.0.0.1:6432/shop".parse()?)
    ///     .with_unnamed_statements(true)
    ///     .build()
    ///     .await?;
    /// # let _ = store;
    /// # Ok(()) }
    /// ```
    pub fn with_unnamed_statements(mut self, unnamed: bool) -> Self {
        self.preparation = if unnamed {
            Preparation::Unnamed
        } else {
            Preparation::Cached
        };
        self
    }

    /// Connects without TLS, creates (or migrates) the schema and returns the store. (With
    /// pools of your own, the connections are theirs: they connect as their manager does.)
    pub async fn build(self) -> Result<PostgresStore, Error> {
        self.build_with_tls(NoTls).await
    }

    /// Like [`build`](Self::build), with a TLS connector (`postgres-native-tls`,
    /// `tokio-postgres-rustls`...).
    pub async fn build_with_tls<T>(self, tls: T) -> Result<PostgresStore, Error>
    where
        T: MakeTlsConnect<Socket> + Clone + Sync + Send + 'static,
        T::Stream: Sync + Send,
        T::TlsConnect: Sync + Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        // Last in, first out: the connection used last is the one taken next, so that a pool
        // that grew in a burst does not rotate every request over all its backends once the
        // load is light again (each idle one a cold process and cold caches).
        let pool = |config: &tokio_postgres::Config, size: usize| {
            Pool::builder(Manager::new(config.clone(), tls.clone()))
                .max_size(size)
                .queue_mode(QueueMode::Lifo)
                .build()
                .map_err(|error| Error::Io(std::io::Error::other(error)))
        };
        let read_pool = match (self.read_pool, &self.read_config) {
            (Some(reads), _) => Some(reads),
            (None, Some(config)) => Some(pool(config, self.max_read_connections)?),
            (None, None) => None,
        };
        let (transactions, reads) = match (self.connections, read_pool) {
            (Connections::Config(config), read_pool) => {
                let reads = match read_pool {
                    Some(reads) => reads,
                    None => pool(&config, self.max_read_connections)?,
                };
                (pool(&config, self.max_connections)?, reads)
            }
            (Connections::Pool(transactions), Some(reads)) => (transactions, reads),
            (Connections::Pool(transactions), None) => (transactions.clone(), transactions),
        };
        let store = PostgresStore {
            shared: Arc::new(Shared {
                transactions,
                reads,
                lookups: Arc::default(),
                read_wait: self.read_wait,
                replay_checks: ReplayChecks::new(self.replay_check),
                isolation: self.isolation,
                serialization_retries: self.serialization_retries,
                preparation: self.preparation,
                reservations: AtomicU64::new(1),
            }),
            key_row_wait: None,
        };
        if self.create_schema {
            store.migrate().await?;
        } else {
            // Fail here, not on the first call, if the settings cannot connect.
            drop(store.client().await?);
        }
        Ok(store)
    }
}

/// Where the connections of request transactions come from.
#[derive(Clone, Debug)]
enum Connections {
    /// Settings: the store builds its pools.
    Config(Box<tokio_postgres::Config>),
    /// A pool of the caller's ([`PostgresStore::builder_from_pool`]).
    Pool(Pool),
}

impl PostgresStore {
    /// Connects to `url` (`postgres://user@host:5432/db`, or a key-value string) with the
    /// default options and creates (or migrates) the schema.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Self::builder(url.parse()?).build().await
    }

    /// Options for connecting with `config`.
    pub fn builder(config: tokio_postgres::Config) -> PostgresOptions {
        Self::options(Connections::Config(Box::new(config)))
    }

    /// Options for a store on a pool of your own (built with the [`deadpool_postgres`] this
    /// crate re-exports): request transactions, [`client`](Self::client) and, unless you give
    /// a [`with_read_pool`](PostgresOptions::with_read_pool), the replay fast path take their connections
    /// from it. Finish with [`build`](PostgresOptions::build), which creates (or migrates)
    /// the schema, or with [`with_create_schema(false)`](PostgresOptions::with_create_schema) only checks
    /// that the pool gives a connection.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::store::tokio_postgres::deadpool_postgres::{Manager, Pool};
    /// use tower_idempotency::store::tokio_postgres::tokio_postgres::{Config, NoTls};
    /// use tower_idempotency::store::tokio_postgres::PostgresStore;
    ///
    /// let config: Config = "postgres://app@127.0.0.1/shop".parse()?;
    /// let pool = Pool::builder(Manager::new(config, NoTls)).max_size(32).build()?;
    /// // The app's own queries and the store share the pool.
    /// let store = PostgresStore::builder_from_pool(pool.clone()).build().await?;
    /// # let _ = (store, pool);
    /// # Ok(()) }
    /// ```
    pub fn builder_from_pool(pool: Pool) -> PostgresOptions {
        Self::options(Connections::Pool(pool))
    }

    fn options(connections: Connections) -> PostgresOptions {
        PostgresOptions {
            connections,
            read_pool: None,
            read_config: None,
            max_connections: 16,
            max_read_connections: 8,
            read_wait: Duration::from_secs(1),
            replay_check: ReplayCheck::default(),
            isolation: Isolation::default(),
            serialization_retries: 3,
            create_schema: true,
            preparation: Preparation::Cached,
        }
    }
}
