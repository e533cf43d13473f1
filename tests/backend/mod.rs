//! One fixture over both stores, so that a suite is written once and run against SQLite and
//! PostgreSQL: [`Backend`] is a fresh database of one kind (a SQLite file in a temp dir, or a
//! PostgreSQL schema of its own) that serves the order app of the tests on 127.0.0.1:0, reads
//! its business rows and records, and injects the failures both stores can have.
//!
//! A suite writes each test as `async fn name<B: Backend>(db: B)` and instantiates it per
//! backend with `backend_tests!` inside its `sqlite` and `postgres` modules (the PostgreSQL
//! instances carry the attribute that reports them as ignored without `TEST_DATABASE_URL`).
//! Tests that only make sense on one backend sit next to them in the same module.
//!
//! The apps themselves are the ones of `tests/common` (SQLite) and `tests/pg_common`
//! (PostgreSQL); this module only adapts them to one interface.

// Every suite uses a different part of it.
#![allow(dead_code)]

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use tower_idempotency::store::postgres::{PostgresOptions, PostgresStore};
use tower_idempotency::store::sqlite::SqliteStore;
use tower_idempotency::store::IdempotencyStore;

use crate::common::{
    hook_for, AppBuilder, AppOf, HookFor, OrderCallOf, Outcome, SqliteApp, TestServer, PATIENCE,
};
use crate::pg_common::{PgApp, PgServer, TestDb};

/// What a backend's order handler tells the test's hook, its order row inserted inside the
/// open idempotency transaction.
#[derive(Clone, Debug)]
pub struct Call {
    pub key: Option<String>,
    pub sku: String,
}

/// What the hook answers: `Some(status)` makes the handler answer that status with
/// `{"error":"injected_failure"}` instead of its 201.
pub type FailWith = Option<StatusCode>;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
pub type Hook = HookFor<Call, FailWith>;

/// Wraps an async closure as a [`Hook`].
pub fn hook<Fut: Future<Output = FailWith> + Send + 'static>(
    f: impl Fn(Call) -> Fut + Send + Sync + 'static,
) -> Hook {
    hook_for(f)
}

/// The hook of a backend's app that runs `hook`.
fn adapt<T: Send + 'static, O: Outcome>(hook: Hook) -> HookFor<OrderCallOf<T>, O> {
    hook_for(move |call: OrderCallOf<T>| {
        let outcome = hook(Call {
            key: call.key,
            sku: call.sku,
        });
        async move { O::failing(outcome.await) }
    })
}

/// Runs `behaviour` on the first call only; later calls get the default outcome (succeed).
/// Works for the hooks of this module and for the backends' own (`pg_common::hook`).
pub fn first_call_only<C, O, F, Fut>(
    behaviour: F,
) -> impl Fn(C) -> BoxFuture<'static, O> + Send + Sync + 'static
where
    C: Send + 'static,
    O: Default + Send + 'static,
    F: Fn(C) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = O> + Send + 'static,
{
    let first = Arc::new(AtomicBool::new(true));
    let behaviour = Arc::new(behaviour);
    move |call| {
        let first = first.swap(false, Ordering::SeqCst);
        let behaviour = behaviour.clone();
        Box::pin(async move {
            if first {
                behaviour(call).await
            } else {
                O::default()
            }
        })
    }
}

/// The state of a running app that the tests read: how often the order handler ran, and how
/// many requests reached the app.
pub trait AppState: Send + Sync + 'static {
    fn handler_calls(&self) -> usize;
    /// Waits until at least `n` requests reached the app; `false` if that took too long.
    fn wait_for_arrivals(&self, n: usize, timeout: Duration) -> BoxFuture<'_, bool>;
}

impl<T: Send + 'static, O: Outcome> AppState for AppOf<T, O> {
    fn handler_calls(&self) -> usize {
        AppOf::handler_calls(self)
    }

    fn wait_for_arrivals(&self, n: usize, timeout: Duration) -> BoxFuture<'_, bool> {
        Box::pin(AppOf::wait_for_arrivals(self, n, timeout))
    }
}

/// `(id, tenant_id, sku, quantity)` of an order.
pub type Order = (i64, String, String, i64);

/// A fresh database of one kind, with the `orders` table, and the order app served on it.
pub trait Backend: Sized + Send + Sync + 'static {
    type Store: IdempotencyStore + Clone + Send + Sync + 'static;
    /// The backend's own running server, stopped when dropped.
    type Running: Send;

    /// A fresh database; `None` (after saying so) where this backend is not available.
    fn create() -> impl Future<Output = Option<Self>>;

    /// Whether writers of different keys run at the same time (SQLite has one writer).
    const PARALLEL_WRITERS: bool;

    /// Serves the order app on this database (every server on one database is another app
    /// instance sharing it).
    fn serve(&self, setup: Setup<'_, Self>) -> impl Future<Output = Server<Self>>;

    /// The address, store and app of a running server.
    fn parts(running: &Self::Running) -> (SocketAddr, Self::Store, Arc<dyn AppState>);

    /// Stops a server gracefully (bounded).
    fn stop(running: Self::Running) -> impl Future<Output = ()>;

    /// The orders, by id.
    fn orders(&self) -> impl Future<Output = Vec<Order>>;
    fn order_count(&self) -> impl Future<Output = i64>;
    /// Completed records (a reservation is never visible outside its transaction).
    fn record_count(&self) -> impl Future<Output = i64>;
    /// Whether a record exists for `(tenant, operation, key)`, expired or not.
    fn record_exists(&self, tenant: &str, operation: &str, key: &str)
        -> impl Future<Output = bool>;

    /// From now on, saving the record of `key` fails (a trigger), after the handler's insert.
    fn fail_saving_the_record_of(&self, key: &'static str) -> impl Future<Output = ()>;
    /// From now on, inserting an order of `sku` fails (a trigger): the handler's own error.
    fn fail_inserting_orders_of(&self, sku: &'static str) -> impl Future<Output = ()>;
    /// Removes the triggers of the two above.
    fn stop_failing(&self) -> impl Future<Output = ()>;

    /// A server with the default app.
    fn spawn(&self) -> impl Future<Output = Server<Self>> {
        self.server().spawn()
    }

    /// A server to customise.
    fn server(&self) -> Setup<'_, Self> {
        AppBuilder::new(self)
    }
}

/// How to serve the app: the layer of each route, the hook, headers on every 201 (the
/// builder of `tests/common`, on this database).
pub type Setup<'db, B> = AppBuilder<<B as Backend>::Store, Hook, &'db B>;

impl<B: Backend> AppBuilder<B::Store, Hook, &B> {
    pub async fn spawn(self) -> Server<B> {
        self.extra.serve(self).await
    }
}

/// A running order app on 127.0.0.1 and its store.
pub struct Server<B: Backend> {
    pub addr: SocketAddr,
    pub store: B::Store,
    pub app: Arc<dyn AppState>,
    running: B::Running,
}

impl<B: Backend> Server<B> {
    fn new(running: B::Running) -> Self {
        let (addr, store, app) = B::parts(&running);
        Server {
            addr,
            store,
            app,
            running,
        }
    }

    /// Stops serving (gracefully, bounded) and lets go of the store.
    pub async fn shutdown(self) {
        B::stop(self.running).await;
    }
}

/// Runs a generic test on a fresh database of `B`, when there is one.
pub async fn run<B: Backend, Fut: Future<Output = ()>>(test: impl FnOnce(B) -> Fut) {
    if let Some(db) = B::create().await {
        test(db).await;
    }
}

// ----- SQLite: a file in a temp dir -----

/// A SQLite file in a temp dir of its own. The app opens its own store on it; the test reads
/// the file through a connection of its own, as another process would.
pub struct Sqlite {
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Sqlite {
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    fn read<T>(&self, query: impl FnOnce(&rusqlite::Connection) -> rusqlite::Result<T>) -> T {
        let conn = rusqlite::Connection::open(&self.path).expect("open the database");
        conn.busy_timeout(PATIENCE).expect("busy timeout");
        query(&conn).expect("query the database")
    }

    fn count(&self, sql: &str) -> i64 {
        self.read(|conn| conn.query_row(sql, [], |row| row.get(0)))
    }

    fn execute(&self, sql: &str) {
        self.read(|conn| conn.execute_batch(sql));
    }
}

impl Backend for Sqlite {
    type Store = SqliteStore;
    type Running = TestServer;

    const PARALLEL_WRITERS: bool = false;

    async fn create() -> Option<Self> {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("orders.db");
        Some(Sqlite { path, _dir: dir })
    }

    async fn serve(&self, setup: Setup<'_, Self>) -> Server<Self> {
        let running = setup
            .convert(adapt, SqliteApp::on(&self.path))
            .spawn()
            .await;
        Server::new(running)
    }

    fn parts(running: &TestServer) -> (SocketAddr, SqliteStore, Arc<dyn AppState>) {
        (running.addr, running.store.clone(), running.app.clone())
    }

    async fn stop(running: TestServer) {
        running.shutdown().await;
    }

    async fn orders(&self) -> Vec<Order> {
        self.read(|conn| {
            let mut statement =
                conn.prepare("SELECT id, tenant_id, sku, quantity FROM orders ORDER BY id")?;
            let rows = statement.query_map([], |row| {
                Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?))
            })?;
            rows.collect()
        })
    }

    async fn order_count(&self) -> i64 {
        self.count("SELECT COUNT(*) FROM orders")
    }

    async fn record_count(&self) -> i64 {
        self.count("SELECT COUNT(*) FROM idempotency_records")
    }

    async fn record_exists(&self, tenant: &str, operation: &str, key: &str) -> bool {
        let found: i64 = self.read(|conn| {
            conn.query_row(
                "SELECT COUNT(*) FROM idempotency_records \
                 WHERE tenant = ?1 AND operation = ?2 AND idempotency_key = ?3",
                (tenant, operation, key),
                |row| row.get(0),
            )
        });
        found > 0
    }

    async fn fail_saving_the_record_of(&self, key: &'static str) {
        self.execute(&format!(
            "CREATE TRIGGER fail_record BEFORE INSERT ON idempotency_records \
             WHEN NEW.idempotency_key = '{key}' \
             BEGIN SELECT RAISE(ABORT, 'injected record failure'); END;"
        ));
    }

    async fn fail_inserting_orders_of(&self, sku: &'static str) {
        self.execute(&format!(
            "CREATE TRIGGER fail_order BEFORE INSERT ON orders WHEN NEW.sku = '{sku}' \
             BEGIN SELECT RAISE(ABORT, 'injected order failure'); END;"
        ));
    }

    async fn stop_failing(&self) {
        self.execute("DROP TRIGGER IF EXISTS fail_record; DROP TRIGGER IF EXISTS fail_order;");
    }
}

// ----- PostgreSQL: a schema of its own -----

/// A schema of its own in the database of `TEST_DATABASE_URL`.
pub struct Postgres(pub TestDb);

impl Postgres {
    /// A trigger `name` that fails every row of `event` (`INSERT ON orders`) matching `when`.
    async fn failing_trigger(&self, name: &str, event: &str, when: &str) {
        self.0
            .execute(&format!(
                "CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$ \
                 BEGIN RAISE EXCEPTION 'injected failure: {name}'; END $$; \
                 CREATE TRIGGER {name} BEFORE {event} FOR EACH ROW WHEN ({when}) \
                 EXECUTE FUNCTION {name}();"
            ))
            .await;
    }
}

impl Backend for Postgres {
    type Store = PostgresStore;
    type Running = PgServer;

    const PARALLEL_WRITERS: bool = true;

    async fn create() -> Option<Self> {
        TestDb::create().await.map(Postgres)
    }

    async fn serve(&self, setup: Setup<'_, Self>) -> Server<Self> {
        setup.spawn_with(|options| options).await
    }

    fn parts(running: &PgServer) -> (SocketAddr, PostgresStore, Arc<dyn AppState>) {
        (running.addr, running.store.clone(), running.app.clone())
    }

    async fn stop(running: PgServer) {
        running.shutdown().await;
    }

    async fn orders(&self) -> Vec<Order> {
        self.0.orders().await
    }

    async fn order_count(&self) -> i64 {
        self.0.order_count().await
    }

    async fn record_count(&self) -> i64 {
        self.0.record_count().await
    }

    async fn record_exists(&self, tenant: &str, operation: &str, key: &str) -> bool {
        self.0.record_exists(tenant, operation, key).await
    }

    async fn fail_saving_the_record_of(&self, key: &'static str) {
        // The layer reserves the row first and completes it on commit: fail the completion.
        let when = format!("NEW.idempotency_key = '{key}' AND NEW.state = 'completed'");
        self.failing_trigger("fail_record", "UPDATE ON idempotency_records", &when)
            .await;
    }

    async fn fail_inserting_orders_of(&self, sku: &'static str) {
        let when = format!("NEW.sku = '{sku}'");
        self.failing_trigger("fail_order", "INSERT ON orders", &when)
            .await;
    }

    async fn stop_failing(&self) {
        self.0
            .execute(
                "DROP TRIGGER IF EXISTS fail_record ON idempotency_records; \
                 DROP TRIGGER IF EXISTS fail_order ON orders;",
            )
            .await;
    }
}

impl Setup<'_, Postgres> {
    /// Serves on a store with these options (pool sizes, isolation), starting from the tests'
    /// smaller pools.
    pub async fn spawn_with<F>(self, options: F) -> Server<Postgres>
    where
        F: FnOnce(PostgresOptions) -> PostgresOptions + Send + 'static,
    {
        let db = self.extra;
        let running = self
            .convert(adapt, PgApp::default())
            .store(options)
            .spawn(&db.0)
            .await;
        Server::new(running)
    }
}

/// Instantiates generic tests (`async fn name<B: Backend>(db: B)` in the parent module) as
/// `#[tokio::test]`s on one backend, each after the given attributes:
/// `backend_tests!(Sqlite []; a, b(flavor = "multi_thread", worker_threads = 2),)`.
macro_rules! backend_tests {
    ($backend:ident [$($attr:tt)*]; $name:ident $(($($flavor:tt)*))?, $($rest:tt)*) => {
        $($attr)*
        #[tokio::test$(($($flavor)*))?]
        async fn $name() {
            $crate::backend::run(super::$name::<$crate::backend::$backend>).await;
        }
        backend_tests!($backend [$($attr)*]; $($rest)*);
    };
    ($backend:ident [$($attr:tt)*];) => {};
}
