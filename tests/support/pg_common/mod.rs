//! Shared setup for the PostgreSQL tests: a fresh schema per test in the database named by
//! `TEST_DATABASE_URL`, and the order app of the example on a [`PostgresStore`] served on
//! 127.0.0.1:0.
//!
//! Every test that uses it is registered as needing PostgreSQL (`test! { name, postgres }`, see
//! `tests/support/harness.rs`), so that `cargo test` without `TEST_DATABASE_URL` reports those
//! tests as ignored. The client side (requests, replies) is the one of `tests/support/common`.

use std::future::Future;

use http::header::HeaderName;
use http::{HeaderValue, StatusCode};
use tower_idempotency::store::tokio_postgres::tokio_postgres::types::{FromSql, ToSql};
use tower_idempotency::store::tokio_postgres::tokio_postgres::{self, NoTls};
use tower_idempotency::store::tokio_postgres::{PostgresHandle, PostgresOptions, PostgresStore};
use tower_idempotency::Tenant;

use crate::common::server_backed::{run_on_a_thread_of_its_own, FreshName, OrderServer};
use crate::common::{hook_for, AppBuilder, HookFor, InsertOrder, OrderCallOf, Outcome};

pub mod hot_row;
pub mod inventory;
pub mod sqlx_app;

/// The business table of the PostgreSQL order app (the same as the example's).
pub const ORDERS_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS orders (
    id        BIGSERIAL PRIMARY KEY,
    tenant_id TEXT   NOT NULL,
    sku       TEXT   NOT NULL,
    quantity  BIGINT NOT NULL
)";

/// Schemas of this suite are named `tidem_<unix seconds>_<pid>_<n>`.
const SCHEMA_PREFIX: &str = "tidem_";

/// A schema of its own in the test database, dropped (with its connections) when dropped.
pub struct TestDb {
    url: String,
    pub schema: String,
}

impl TestDb {
    /// A fresh schema with the `orders` table, or `None` (after saying so) when
    /// `TEST_DATABASE_URL` is not set.
    pub async fn create() -> Option<TestDb> {
        let FreshName {
            url,
            name: schema,
            now,
            first,
        } = FreshName::new("TEST_DATABASE_URL", "PostgreSQL", SCHEMA_PREFIX)?;
        let admin = connect(&url.parse().expect("TEST_DATABASE_URL is a valid URL")).await;
        if first {
            sweep_stale_schemas(&admin, now).await;
        }
        admin
            .batch_execute(&format!("CREATE SCHEMA {schema}"))
            .await
            .expect("create the test schema");
        let db = TestDb { url, schema };
        db.client()
            .await
            .batch_execute(ORDERS_SCHEMA)
            .await
            .expect("create orders");
        Some(db)
    }

    /// The connection settings of this schema: `search_path` points at it, and
    /// `application_name` marks the connections so that the cleanup can close them.
    pub fn config(&self) -> tokio_postgres::Config {
        let mut config: tokio_postgres::Config = self.url.parse().expect("valid URL");
        config.options(format!("-c search_path={}", self.schema));
        config.application_name(&self.schema);
        config
    }

    /// The same as a URL, for the example's `--database-url`.
    pub fn url(&self) -> String {
        let separator = if self.url.contains('?') { '&' } else { '?' };
        format!(
            "{}{separator}options=-c%20search_path%3D{schema}&application_name={schema}",
            self.url,
            schema = self.schema
        )
    }

    /// A store on this schema with the default options.
    pub async fn store(&self) -> PostgresStore {
        self.store_with(|options| options).await
    }

    pub async fn store_with(
        &self,
        customise: impl FnOnce(PostgresOptions) -> PostgresOptions,
    ) -> PostgresStore {
        customise(PostgresStore::builder(self.config()))
            .build()
            .await
            .expect("open the PostgreSQL store")
    }

    /// A plain connection on this schema (its own, not a pooled one).
    pub async fn client(&self) -> tokio_postgres::Client {
        connect(&self.config()).await
    }

    pub async fn execute(&self, sql: &str) {
        self.client()
            .await
            .batch_execute(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// The first column of the one row that `sql` returns.
    pub async fn value<T: for<'a> FromSql<'a>>(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> T {
        self.client()
            .await
            .query_one(sql, params)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .get(0)
    }

    async fn count(&self, sql: &str) -> i64 {
        self.value(sql, &[]).await
    }

    pub async fn order_count(&self) -> i64 {
        self.count("SELECT count(*) FROM orders").await
    }

    /// Completed records (a reservation is never visible outside its transaction).
    pub async fn record_count(&self) -> i64 {
        self.count("SELECT count(*) FROM idempotency_records WHERE state = 'completed'")
            .await
    }

    /// `(orders, completed records)`.
    pub async fn counts(&self) -> (i64, i64) {
        (self.order_count().await, self.record_count().await)
    }

    /// Whether a record exists for `(tenant, operation, key)`, in any state, expired or not.
    pub async fn record_exists(&self, tenant: &str, operation: &str, key: &str) -> bool {
        let sql = "SELECT count(*) FROM idempotency_records \
                   WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3";
        self.value::<i64>(sql, &[&tenant, &operation, &key]).await > 0
    }

    /// The orders as `(id, tenant_id, sku, quantity)`, by id.
    pub async fn orders(&self) -> Vec<(i64, String, String, i64)> {
        self.client()
            .await
            .query(
                "SELECT id, tenant_id, sku, quantity FROM orders ORDER BY id",
                &[],
            )
            .await
            .expect("orders")
            .iter()
            .map(|row| (row.get(0), row.get(1), row.get(2), row.get(3)))
            .collect()
    }

    /// Records in any state.
    pub async fn row_count(&self) -> i64 {
        self.count("SELECT count(*) FROM idempotency_records").await
    }

    /// The `order_id` in each completed record's saved body, sorted.
    pub async fn recorded_order_ids(&self) -> Vec<i64> {
        self.client()
            .await
            .query(
                "SELECT (convert_from(body, 'UTF8')::json ->> 'order_id')::bigint \
                 FROM idempotency_records WHERE state = 'completed' ORDER BY 1",
                &[],
            )
            .await
            .expect("records")
            .iter()
            .map(|row| row.get(0))
            .collect()
    }
}

impl Drop for TestDb {
    /// Closes the schema's connections and drops it. `Drop` cannot await, so this runs on a
    /// thread of its own with its own runtime; a failure only leaves a schema behind (swept
    /// by a later run).
    fn drop(&mut self) {
        let (url, schema) = (self.url.clone(), self.schema.clone());
        run_on_a_thread_of_its_own(move || async move {
            let Ok(config) = url.parse::<tokio_postgres::Config>() else {
                return;
            };
            let Ok((client, connection)) = config.connect(NoTls).await else {
                return;
            };
            tokio::spawn(connection);
            let _ = client
                .execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                         WHERE application_name = $1 AND pid <> pg_backend_pid()",
                    &[&schema],
                )
                .await;
            let _ = client
                .batch_execute(&format!(
                    "SET lock_timeout = '5s'; DROP SCHEMA IF EXISTS {schema} CASCADE"
                ))
                .await;
        });
    }
}

/// Drops the schemas that earlier runs left behind (killed before their cleanup), once an
/// hour has passed since they were made.
async fn sweep_stale_schemas(admin: &tokio_postgres::Client, now: u64) {
    let Ok(rows) = admin
        .query(
            "SELECT nspname FROM pg_namespace WHERE starts_with(nspname, $1)",
            &[&SCHEMA_PREFIX],
        )
        .await
    else {
        return;
    };
    for row in rows {
        let name: String = row.get(0);
        if FreshName::is_stale(&name, SCHEMA_PREFIX, now) {
            let _ = admin
                .batch_execute(&format!("DROP SCHEMA IF EXISTS {name} CASCADE"))
                .await;
        }
    }
}

pub async fn connect(config: &tokio_postgres::Config) -> tokio_postgres::Client {
    let (client, connection) = config.connect(NoTls).await.expect("connect to PostgreSQL");
    tokio::spawn(connection);
    client
}

/// What the order handler knows when it calls the hook: its order row is already inserted,
/// inside the open idempotency transaction.
pub type OrderCall = OrderCallOf<PostgresHandle>;

/// What the hook asks the handler to do next.
#[derive(Debug, Default)]
pub struct HookOutcome {
    /// Answer this status with `{"error":"injected_failure"}` instead of the 201.
    pub fail_with: Option<StatusCode>,
}

impl Outcome for HookOutcome {
    fn failing(fail_with: Option<StatusCode>) -> Self {
        HookOutcome { fail_with }
    }

    fn fail_with(&self) -> Option<StatusCode> {
        self.fail_with
    }

    fn into_headers(self) -> Vec<(HeaderName, HeaderValue)> {
        Vec::new()
    }
}

pub type Hook = HookFor<OrderCall, HookOutcome>;

/// Wraps an async closure as a [`Hook`].
pub fn hook<Fut: Future<Output = HookOutcome> + Send + 'static>(
    f: impl Fn(OrderCall) -> Fut + Send + Sync + 'static,
) -> Hook {
    hook_for(f)
}

type CustomiseStore = Box<dyn FnOnce(PostgresOptions) -> PostgresOptions + Send>;

/// What only the PostgreSQL app takes: the store's options.
pub struct PgApp {
    store: CustomiseStore,
}

impl Default for PgApp {
    fn default() -> Self {
        PgApp {
            store: Box::new(|options| options),
        }
    }
}

/// Builds a [`PgServer`].
pub type ServerBuilder = AppBuilder<PostgresStore, Hook, PgApp>;

impl ServerBuilder {
    /// Customises the store's options (pool sizes, isolation), starting from the tests' smaller
    /// pools (8 transaction connections, 4 read connections).
    pub fn store<F>(mut self, f: F) -> Self
    where
        F: FnOnce(PostgresOptions) -> PostgresOptions + Send + 'static,
    {
        self.extra.store = Box::new(f);
        self
    }

    /// Serves the app on a store of its own (its own pools) over `db`'s schema; several
    /// servers on one schema are several app instances sharing one database.
    pub async fn spawn(mut self, db: &TestDb) -> PgServer {
        // Smaller pools than the defaults: tests run two at a time, some with two servers,
        // and the server allows 100 connections in all.
        let customise_store = std::mem::replace(&mut self.extra.store, Box::new(|options| options));
        let store = db
            .store_with(|options| {
                customise_store(options.with_max_connections(8).with_max_read_connections(4))
            })
            .await;
        self.serve_on(store).await
    }
}

/// A running order app on 127.0.0.1 and its store.
pub type PgServer = OrderServer<PostgresStore, PostgresHandle, HookOutcome>;

impl PgServer {
    pub fn builder() -> ServerBuilder {
        AppBuilder::new(PgApp::default())
    }

    /// The default app on `db`.
    pub async fn spawn(db: &TestDb) -> PgServer {
        Self::builder().spawn(db).await
    }
}

impl InsertOrder for PostgresHandle {
    async fn insert_order(
        &self,
        tenant: &Tenant,
        sku: &str,
        quantity: i64,
    ) -> Result<i64, tower_idempotency::Error> {
        let client = self.client().await?;
        let row = client
            .query_one(
                "INSERT INTO orders (tenant_id, sku, quantity) VALUES ($1, $2, $3) RETURNING id",
                &[&tenant.as_str(), &sku, &quantity],
            )
            .await?;
        Ok(row.try_get(0)?)
    }
}

/// A TCP proxy on loopback to the test database's server that forwards both ways until
/// [`freeze`](Self::freeze): from then on it forwards nothing and closes nothing, as a server
/// (or a network) that stopped answering without a reset.
pub struct FreezingProxy {
    pub addr: std::net::SocketAddr,
    frozen: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl FreezingProxy {
    /// A proxy to the server of `db`'s configuration (its first host and port).
    pub async fn to(db: &TestDb) -> FreezingProxy {
        let config = db.config();
        let host = match config.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(host)) => host.clone(),
            _ => "127.0.0.1".to_owned(),
        };
        let port = config.get_ports().first().copied().unwrap_or(5432);
        let upstream = tokio::net::lookup_host((host.as_str(), port))
            .await
            .expect("resolve the database's host")
            .next()
            .expect("an address of the database's host");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let addr = listener.local_addr().expect("the proxy's address");
        let frozen = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let relay_frozen = frozen.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                    continue;
                };
                let (from_client, to_client) = client.into_split();
                let (from_server, to_server) = server.into_split();
                tokio::spawn(Self::relay(from_client, to_server, relay_frozen.clone()));
                tokio::spawn(Self::relay(from_server, to_client, relay_frozen.clone()));
            }
        });
        FreezingProxy { addr, frozen }
    }

    /// From now on nothing is forwarded on any connection, old or new.
    pub fn freeze(&self) {
        self.frozen.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// `db`'s configuration, through this proxy.
    pub fn config(&self, db: &TestDb) -> tokio_postgres::Config {
        // A new configuration: `host` and `port` add to a configuration's list of hosts.
        let to_db = db.config();
        let mut config = tokio_postgres::Config::new();
        config
            .host("127.0.0.1")
            .port(self.addr.port())
            .options(to_db.get_options().unwrap_or_default())
            .application_name(to_db.get_application_name().unwrap_or_default());
        if let Some(user) = to_db.get_user() {
            config.user(user);
        }
        if let Some(dbname) = to_db.get_dbname() {
            config.dbname(dbname);
        }
        if let Some(password) = to_db.get_password() {
            config.password(password);
        }
        config
    }

    async fn relay(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        frozen: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buffer = vec![0; 16 * 1024];
        loop {
            let read = match from.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(read) => read,
            };
            if frozen.load(std::sync::atomic::Ordering::SeqCst) {
                // Holds both sockets open, forwarding nothing, until the test ends.
                std::future::pending::<()>().await;
            }
            if to.write_all(&buffer[..read]).await.is_err() {
                return;
            }
        }
    }
}
