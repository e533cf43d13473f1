//! One fixture over every store, so that a suite is written once and run against each: a
//! [`Database`] is a fresh database of one kind (a SQLite file in a temp dir, a PostgreSQL
//! schema of its own, a MySQL/MariaDB database of its own) that serves the order app of the
//! tests on 127.0.0.1:0, reads its business rows and records, and injects the failures every
//! store can have. A [`Backend`] is a database whose store also has the outbox, the inbox and
//! the admin verbs (every store): it opens a store of the test's own on it, enqueues events,
//! reads them and the receiver's effects, and names the database to the admin tool.
//!
//! A suite writes each test as `async fn name<B: Database>(db: B)` (or `B: Backend` for the
//! outbox, inbox and admin suites) and instantiates it in a module per backend with
//! `backend_tests!(Sqlite; a, b)`, `backend_tests!(Postgres; a, b)`,
//! `backend_tests!(SqlxPostgres; a, b)` (the PostgreSQL store on sqlx, on a schema of its own
//! too), `backend_tests!(MySql; a, b)` and `backend_tests!(SqlxSqlite; a, b)` (the SQLite store
//! on sqlx, on a file of its own too); every instance on a server is registered as needing
//! it, and reported as ignored without it (`TEST_DATABASE_URL`, `TEST_MYSQL_URL`). Tests
//! that only make sense on one backend sit next to them in the same module.
//!
//! The apps themselves are the ones of `tests/support/common` (SQLite, and the sqlx stores of
//! MySQL and SQLite with their handle's insert from `tests/support/mysql_common` and
//! `tests/support/sqlx_sqlite_common`) and `tests/support/pg_common` (PostgreSQL, and
//! `pg_common::sqlx_app` on sqlx); this module only adapts them to one interface. Another
//! backend is a struct implementing [`Database`] (and [`Backend`] once its store has the
//! outbox) and an arm of [`backend_tests!`](crate::backend_tests!) that registers its tests as
//! needing its server.

// Here rather than in each suite's root: the outbox, inbox and admin suites need no MySQL.
pub use crate::mysql_common;
use crate::sqlx_sqlite_common;

mod handle_sql;

// Only the suites with tests of the handles use it.
#[allow(unused_imports)]
pub use handle_sql::{checking, HandleConflict, HandleSession, HandleSql, Problems, TxHandle};

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use serde_json::Value;
use tokio::sync::OnceCell;
use tower_idempotency::admin::AdminBackend;
use tower_idempotency::outbox::{
    Enqueue, EventId, EventInfo, Inbox, InboxBackend, Outbox, OutboxBackend, Processed,
};
use tower_idempotency::store::sqlite::{SqliteHandle, SqliteStore};
use tower_idempotency::store::sqlx_mysql::{SqlxMySqlHandle, SqlxMySqlStore};
use tower_idempotency::store::sqlx_postgres::{SqlxPostgresHandle, SqlxPostgresStore};
use tower_idempotency::store::sqlx_sqlite::{SqlxSqliteHandle, SqlxSqliteStore};
use tower_idempotency::store::tokio_postgres::{PostgresHandle, PostgresOptions, PostgresStore};
use tower_idempotency::store::IdempotencyStore;
use tower_idempotency::IdempotencyLayer;

use crate::common::server_backed::OrderServer;
use crate::common::{
    hook_for, post, AppBuilder, AppOf, HookFor, HookOutcome, OrderCallOf, Outcome, Reply,
    SqliteApp, TestServer, PATIENCE, SHOP_A,
};
use crate::pg_common::sqlx_app::SqlxPgApp;
use crate::pg_common::{PgApp, TestDb};

/// What a backend's order handler tells the test's hook, its order row inserted inside the
/// open idempotency transaction `tx`.
#[derive(Clone, Debug)]
pub struct Call {
    pub tenant: String,
    pub key: Option<String>,
    pub sku: String,
    pub order_id: i64,
    pub tx: Tx,
}

type EnqueueFn = dyn Fn(String, Value) -> BoxFuture<'static, Result<EventId, tower_idempotency::Error>>
    + Send
    + Sync;

/// The request's transaction, whichever the backend, for what the generic suites do in it:
/// enqueue an outbox event (on a [`Backend`]), or reach the backend's own handle (the tests of
/// [`HandleSql`]).
#[derive(Clone)]
pub struct Tx {
    enqueue: Arc<EnqueueFn>,
    handle: Arc<dyn Any + Send + Sync>,
}

impl Tx {
    fn of<T: Enqueue + Send + Sync + 'static>(tx: T) -> Tx {
        let tx = Arc::new(tx);
        let handle = tx.clone();
        Tx {
            enqueue: Arc::new(move |topic, payload| {
                let tx = tx.clone();
                Box::pin(async move { tx.enqueue(&topic, payload).await })
            }),
            handle,
        }
    }

    /// Enqueues an event in the request's transaction.
    pub async fn enqueue(
        &self,
        topic: &str,
        payload: Value,
    ) -> Result<EventId, tower_idempotency::Error> {
        (self.enqueue)(topic.to_owned(), payload).await
    }

    /// The backend's own transaction handle, if it is a `T`.
    pub fn handle<T: Send + Sync + 'static>(&self) -> Option<Arc<T>> {
        self.handle.clone().downcast().ok()
    }
}

impl fmt::Debug for Tx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Tx")
    }
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

/// The hook of a backend's app that runs `hook`, its transaction handle made a [`Tx`] by
/// `tx`.
fn adapt_with<T: Send + 'static, O: Outcome>(
    hook: Hook,
    tx: fn(T) -> Tx,
) -> HookFor<OrderCallOf<T>, O> {
    hook_for(move |call: OrderCallOf<T>| {
        let outcome = hook(Call {
            tenant: call.tenant,
            key: call.key,
            sku: call.sku,
            order_id: call.order_id,
            tx: tx(call.tx),
        });
        async move { O::failing(outcome.await) }
    })
}

/// The hook of the app of a store with the outbox.
fn adapt<T: Enqueue + Send + Sync + 'static, O: Outcome>(hook: Hook) -> HookFor<OrderCallOf<T>, O> {
    adapt_with(hook, Tx::of)
}

/// A [`Hook`] that runs `f` with its own clone of `shared` (a gate, a barrier...) on every call.
pub fn hook_sharing<S, F, Fut>(shared: &S, f: F) -> Hook
where
    S: Clone + Send + Sync + 'static,
    F: Fn(S, Call) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = FailWith> + Send + 'static,
{
    let shared = shared.clone();
    hook(move |call| f(shared.clone(), call))
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

/// The receiver's effect in the inbox suites: one row per application of an event.
pub const EFFECTS: &str = "CREATE TABLE effects (event_id TEXT NOT NULL, note TEXT NOT NULL)";

/// What an inbox suite's closure does.
#[derive(Clone, Copy, Debug)]
pub enum Apply {
    /// Nothing (`Ok(0)`).
    Nothing,
    /// Inserts the event's [`EFFECTS`] row; returns the event's rows as the transaction sees
    /// them.
    Effect,
    /// Inserts the row, then fails.
    EffectThenFail,
    /// Runs a statement on a table that does not exist.
    BrokenStatement,
}

/// The SQL of [`Apply::Effect`]'s insert, and what [`Apply::EffectThenFail`] fails with.
const INSERT_EFFECT: &str = "INSERT INTO effects (event_id, note) VALUES ($1, 'applied')";
/// The [`EFFECTS`] rows of an event.
const COUNT_EFFECTS: &str = "SELECT count(*) FROM effects WHERE event_id = $1";
pub const FAILURE: &str = "the receiver failed";

/// What [`Backend::process`] returns.
pub type Processing = Result<Processed<i64>, tower_idempotency::Error>;

/// The event `id` of `outbox`, which must exist.
pub async fn event_of<S: OutboxBackend>(outbox: &Outbox<S>, id: &EventId) -> EventInfo {
    outbox
        .event(id.as_str())
        .await
        .expect("read")
        .expect("event")
}

/// A fresh database of one kind, with the `orders` table once an app served on it: what every
/// backend has.
pub trait Database: Sized + Send + Sync + 'static {
    type Store: IdempotencyStore + Clone + Send + Sync + 'static;
    /// A fresh database; `None` (after saying so) where this backend is not available.
    fn create() -> impl Future<Output = Option<Self>>;

    /// Whether writers of different keys run at the same time (SQLite has one writer).
    const PARALLEL_WRITERS: bool;

    /// Serves the order app on this database (every server on one database is another app
    /// instance sharing it).
    fn serve(&self, setup: Setup<'_, Self>) -> impl Future<Output = Server<Self>>;

    /// Runs SQL on the database, outside any request.
    fn execute(&self, sql: &str) -> impl Future<Output = ()>;

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

    /// `(orders, completed records)`.
    fn counts(&self) -> impl Future<Output = (i64, i64)> {
        async { (self.order_count().await, self.record_count().await) }
    }

    /// A server with the default app.
    fn spawn(&self) -> impl Future<Output = Server<Self>> {
        self.server().spawn()
    }

    /// A server to customise.
    fn server(&self) -> Setup<'_, Self> {
        AppBuilder::new(self)
    }

    /// A server with the default app, its layers customised by `f`.
    fn with_layer<F>(&self, f: F) -> impl Future<Output = Server<Self>>
    where
        F: Fn(IdempotencyLayer<Self::Store>) -> IdempotencyLayer<Self::Store> + Send + 'static,
    {
        self.server().layer(f).spawn()
    }
}

/// A [`Database`] whose store has the outbox, the inbox and the admin verbs, and a store of the
/// test's own on it (opened on first use) for those suites.
pub trait Backend: Database<Store: OutboxBackend + InboxBackend + AdminBackend> {
    /// What the error of an enqueue without the outbox table says.
    const NO_OUTBOX_TABLE: &'static str;

    /// Where the test's own store is kept once opened.
    fn store_cell(&self) -> &OnceCell<Self::Store>;

    /// The test's own store on this database (opened on first use).
    fn store(&self) -> impl Future<Output = &Self::Store> {
        self.store_cell().get_or_init(|| self.another_store())
    }

    /// Another store on the same database (another app instance, with a pool of its own).
    fn another_store(&self) -> impl Future<Output = Self::Store>;

    /// Rows in `outbox_events`.
    fn event_count(&self) -> impl Future<Output = i64>;
    /// Committed [`EFFECTS`] rows of `event_id`.
    fn effects(&self, event_id: &str) -> impl Future<Output = i64>;

    /// Enqueues an event outside any request (in a transaction of its own).
    fn enqueue_now(&self, topic: &str, payload: Value) -> impl Future<Output = EventId>;

    /// Enqueues `order_created` events `{"order_id": n}` for each `n` of `orders`, in order.
    fn enqueue_orders(&self, orders: std::ops::Range<usize>) -> impl Future<Output = Vec<EventId>> {
        async move {
            let mut ids = Vec::new();
            for n in orders {
                let payload = serde_json::json!({ "order_id": n });
                ids.push(self.enqueue_now("order_created", payload).await);
            }
            ids
        }
    }

    /// How the admin tool names this database: `--db PATH` or `--database-url URL` (the
    /// database exists by then).
    fn tool_args(&self) -> impl Future<Output = Vec<String>>;

    /// Processes `event_id` with `inbox`, applying it as `apply` says (the closure is the
    /// backend's: a `rusqlite` one on SQLite, a future on PostgreSQL).
    fn process(
        inbox: &Inbox<Self::Store>,
        event_id: &str,
        apply: Apply,
    ) -> impl Future<Output = Processing>;

    /// Applies `event_id` through a request's transaction handle: one [`EFFECTS`] row.
    fn apply_in(
        tx: &<Self::Store as InboxBackend>::Handle,
        event_id: &str,
    ) -> impl Future<Output = ()>;
}

/// How to serve the app: the layer of each route, the hook, headers on every 201 (the
/// builder of `tests/support/common`, on this database).
pub type Setup<'db, B> = AppBuilder<<B as Database>::Store, Hook, &'db B>;

impl<B: Database> AppBuilder<B::Store, Hook, &B> {
    pub async fn spawn(self) -> Server<B> {
        self.extra.serve(self).await
    }
}

/// A backend's own running server, stopped when dropped.
trait Running: Send {
    /// Stops it gracefully (bounded).
    fn stop(self: Box<Self>) -> BoxFuture<'static, ()>;
}

impl Running for TestServer {
    fn stop(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin((*self).shutdown())
    }
}

impl<S: Send + 'static, T: Send + 'static, O: Send + 'static> Running for OrderServer<S, T, O> {
    fn stop(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin((*self).shutdown())
    }
}

/// A backend's own running server on the store `S`: where it listens, its store and its
/// app's state.
trait Serves<S>: Running {
    fn addr(&self) -> SocketAddr;
    fn store(&self) -> &S;
    fn app(&self) -> Arc<dyn AppState>;
}

impl Serves<SqliteStore> for TestServer {
    fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn store(&self) -> &SqliteStore {
        &self.store
    }

    fn app(&self) -> Arc<dyn AppState> {
        self.app.clone()
    }
}

impl<S, T, O> Serves<S> for OrderServer<S, T, O>
where
    S: Send + 'static,
    T: Send + 'static,
    O: Outcome,
{
    fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn store(&self) -> &S {
        &self.store
    }

    fn app(&self) -> Arc<dyn AppState> {
        self.app.clone()
    }
}

/// A running order app on 127.0.0.1 and its store.
pub struct Server<B: Database> {
    pub addr: SocketAddr,
    pub store: B::Store,
    pub app: Arc<dyn AppState>,
    running: Box<dyn Running>,
}

impl<B: Database> Server<B> {
    fn new(running: impl Serves<B::Store> + 'static) -> Self {
        Server {
            addr: running.addr(),
            store: running.store().clone(),
            app: running.app(),
            running: Box::new(running),
        }
    }

    /// Stops serving (gracefully, bounded) and lets go of the store.
    pub async fn shutdown(self) {
        self.running.stop().await;
    }
}

/// Sends `body` under `key` as shop-a: a `201` that ran the handler, not a replay.
pub async fn runs_afresh(addr: SocketAddr, key: &str, body: &str) -> Reply {
    let reply = post(addr, Some(SHOP_A), Some(key), body, &[]).await;
    assert_eq!(reply.status, StatusCode::CREATED, "{key}: {reply:?}");
    assert!(!reply.replayed(), "{key}: runs afresh: {reply:?}");
    reply
}

/// Sends `body` under `key` as shop-a again: a replay of `original`, the same status and body.
pub async fn replays(addr: SocketAddr, key: &str, body: &str, original: &Reply) -> Reply {
    replays_as(addr, SHOP_A, key, body, original).await
}

/// [`replays`] as the tenant whose token is `tenant`.
pub async fn replays_as(
    addr: SocketAddr,
    tenant: &str,
    key: &str,
    body: &str,
    original: &Reply,
) -> Reply {
    let reply = post(addr, Some(tenant), Some(key), body, &[]).await;
    assert!(reply.replayed(), "{key}: a replay: {reply:?}");
    assert_eq!(reply.status, original.status, "{key}");
    assert_eq!(reply.body, original.body, "{key}: the same body");
    reply
}

/// Runs a generic test on a fresh database of `B`, when there is one.
pub async fn run<B: Database, Fut: Future<Output = ()>>(test: impl FnOnce(B) -> Fut) {
    if let Some(db) = B::create().await {
        test(db).await;
    }
}

/// The failure triggers of [`Database`] on a SQLite file, whichever driver its store uses:
/// both stores save a record with an `INSERT` (SQLite's reservation is the write lock, not a
/// row), which the trigger fails.
macro_rules! sqlite_failure_triggers {
    () => {
        async fn fail_saving_the_record_of(&self, key: &'static str) {
            self.execute(&format!(
                "CREATE TRIGGER fail_record BEFORE INSERT ON idempotency_records \
                 WHEN NEW.idempotency_key = '{key}' \
                 BEGIN SELECT RAISE(ABORT, 'injected record failure'); END;"
            ))
            .await;
        }

        async fn fail_inserting_orders_of(&self, sku: &'static str) {
            self.execute(&format!(
                "CREATE TRIGGER fail_order BEFORE INSERT ON orders WHEN NEW.sku = '{sku}' \
                 BEGIN SELECT RAISE(ABORT, 'injected order failure'); END;"
            ))
            .await;
        }

        async fn stop_failing(&self) {
            self.execute("DROP TRIGGER IF EXISTS fail_record; DROP TRIGGER IF EXISTS fail_order;")
                .await;
        }
    };
}

// ----- SQLite: a file in a temp dir -----

/// A SQLite file in a temp dir of its own. The app opens its own store on it; the test reads
/// the file through a connection of its own, as another process would.
pub struct Sqlite {
    path: PathBuf,
    store: OnceCell<SqliteStore>,
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

    fn count(&self, sql: &str, params: impl rusqlite::Params) -> i64 {
        self.read(|conn| conn.query_row(sql, params, |row| row.get(0)))
    }
}

impl Database for Sqlite {
    type Store = SqliteStore;

    const PARALLEL_WRITERS: bool = false;

    async fn create() -> Option<Self> {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("orders.db");
        Some(Sqlite {
            path,
            store: OnceCell::new(),
            _dir: dir,
        })
    }

    async fn serve(&self, setup: Setup<'_, Self>) -> Server<Self> {
        let running = setup
            .convert(adapt, SqliteApp::on(&self.path))
            .spawn()
            .await;
        Server::new(running)
    }

    async fn execute(&self, sql: &str) {
        self.read(|conn| conn.execute_batch(sql));
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
        self.count("SELECT COUNT(*) FROM orders", [])
    }

    async fn record_count(&self) -> i64 {
        self.count("SELECT COUNT(*) FROM idempotency_records", [])
    }

    async fn record_exists(&self, tenant: &str, operation: &str, key: &str) -> bool {
        let sql = "SELECT COUNT(*) FROM idempotency_records \
                   WHERE tenant = ?1 AND operation = ?2 AND idempotency_key = ?3";
        self.count(sql, (tenant, operation, key)) > 0
    }

    sqlite_failure_triggers!();
}

impl Backend for Sqlite {
    const NO_OUTBOX_TABLE: &'static str = "no such table: outbox_events";

    fn store_cell(&self) -> &OnceCell<SqliteStore> {
        &self.store
    }

    async fn another_store(&self) -> SqliteStore {
        SqliteStore::open(&self.path).await.expect("open")
    }

    async fn event_count(&self) -> i64 {
        self.count("SELECT count(*) FROM outbox_events", [])
    }

    async fn effects(&self, event_id: &str) -> i64 {
        self.count(
            "SELECT count(*) FROM effects WHERE event_id = ?1",
            [event_id],
        )
    }

    async fn enqueue_now(&self, topic: &str, payload: Value) -> EventId {
        let topic = topic.to_owned();
        self.store()
            .await
            .write(move |tx| tower_idempotency::outbox::Outbox::<tower_idempotency::store::sqlite::SqliteStore>::enqueue_in(tx, &topic, &payload))
            .await
            .expect("enqueue")
    }

    async fn tool_args(&self) -> Vec<String> {
        self.store().await;
        vec!["--db".into(), self.path.display().to_string()]
    }

    async fn process(inbox: &Inbox<SqliteStore>, event_id: &str, apply: Apply) -> Processing {
        let id = event_id.to_owned();
        inbox
            .process(event_id, move |tx| {
                let insert = INSERT_EFFECT.replace('$', "?");
                match apply {
                    Apply::Nothing => return Ok(0),
                    Apply::BrokenStatement => {
                        tx.execute("INSERT INTO no_such_table VALUES (1)", [])?;
                        return Ok(0);
                    }
                    Apply::Effect | Apply::EffectThenFail => tx.execute(&insert, [&id])?,
                };
                if let Apply::EffectThenFail = apply {
                    // Any `rusqlite` error that carries the message will do.
                    return Err(rusqlite::Error::InvalidParameterName(FAILURE.into()));
                }
                tx.query_row(
                    "SELECT count(*) FROM effects WHERE event_id = ?1",
                    [&id],
                    |row| row.get(0),
                )
            })
            .await
    }

    async fn apply_in(tx: &SqliteHandle, event_id: &str) {
        let id = event_id.to_owned();
        let insert = INSERT_EFFECT.replace('$', "?");
        tx.run(move |conn| conn.execute(&insert, [id]))
            .await
            .expect("apply");
    }
}

// ----- PostgreSQL, either driver: a schema of its own -----

/// The failure triggers of a database on a server, in its SQL dialect.
trait FailureTriggers {
    /// A trigger `name` that fails every row of `event` (`INSERT ON orders`) matching `when`.
    fn failing_trigger(&self, name: &str, event: &str, when: &str) -> impl Future<Output = ()>;
    /// Drops the triggers of [`Database::fail_saving_the_record_of`] and
    /// [`Database::fail_inserting_orders_of`].
    fn drop_failing_triggers(&self) -> impl Future<Output = ()>;
}

impl FailureTriggers for TestDb {
    async fn failing_trigger(&self, name: &str, event: &str, when: &str) {
        self.execute(&format!(
            "CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN RAISE EXCEPTION 'injected failure: {name}'; END $$; \
             CREATE TRIGGER {name} BEFORE {event} FOR EACH ROW WHEN ({when}) \
             EXECUTE FUNCTION {name}();"
        ))
        .await;
    }

    async fn drop_failing_triggers(&self) {
        self.execute(
            "DROP TRIGGER IF EXISTS fail_record ON idempotency_records; \
             DROP TRIGGER IF EXISTS fail_order ON orders;",
        )
        .await;
    }
}

impl FailureTriggers for mysql_common::TestDb {
    async fn failing_trigger(&self, name: &str, event: &str, when: &str) {
        self.execute(&format!(
            "CREATE TRIGGER {name} BEFORE {event} FOR EACH ROW BEGIN IF {when} THEN \
             SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'injected failure: {name}'; \
             END IF; END"
        ))
        .await;
    }

    async fn drop_failing_triggers(&self) {
        self.execute("DROP TRIGGER IF EXISTS fail_record; DROP TRIGGER IF EXISTS fail_order")
            .await;
    }
}

/// The [`Database`] methods of a backend on a server (a struct with `db`, a `TestDb` of
/// `tests/support/pg_common` or `tests/support/mysql_common`) that read and change the database itself,
/// whichever driver its store uses: the test reads through a connection of its own, as another
/// process would.
macro_rules! server_database_reads {
    () => {
        async fn execute(&self, sql: &str) {
            self.db.execute(sql).await;
        }

        async fn orders(&self) -> Vec<Order> {
            self.db.orders().await
        }

        async fn order_count(&self) -> i64 {
            self.db.order_count().await
        }

        async fn record_count(&self) -> i64 {
            self.db.record_count().await
        }

        async fn record_exists(&self, tenant: &str, operation: &str, key: &str) -> bool {
            self.db.record_exists(tenant, operation, key).await
        }

        async fn fail_saving_the_record_of(&self, key: &'static str) {
            // The layer reserves the row first and completes it on commit: fail the completion.
            let when = format!("NEW.idempotency_key = '{key}' AND NEW.state = 'completed'");
            self.db
                .failing_trigger("fail_record", "UPDATE ON idempotency_records", &when)
                .await;
        }

        async fn fail_inserting_orders_of(&self, sku: &'static str) {
            let when = format!("NEW.sku = '{sku}'");
            self.db
                .failing_trigger("fail_order", "INSERT ON orders", &when)
                .await;
        }

        async fn stop_failing(&self) {
            self.db.drop_failing_triggers().await;
        }
    };
}

/// The [`Backend`] methods of a PostgreSQL backend that read the outbox's and the receiver's
/// tables, whichever driver its store uses.
macro_rules! pg_outbox_reads {
    () => {
        async fn event_count(&self) -> i64 {
            self.db
                .value("SELECT count(*) FROM outbox_events", &[])
                .await
        }

        async fn effects(&self, event_id: &str) -> i64 {
            let sql = "SELECT count(*) FROM effects WHERE event_id = $1";
            self.db.value(sql, &[&event_id]).await
        }

        async fn tool_args(&self) -> Vec<String> {
            vec!["--database-url".into(), self.db.url()]
        }
    };
}

// ----- PostgreSQL on tokio-postgres -----

/// A schema of its own in the database of `TEST_DATABASE_URL`, dropped at the end.
pub struct Postgres {
    store: OnceCell<PostgresStore>,
    pub db: TestDb,
}

impl Database for Postgres {
    type Store = PostgresStore;

    const PARALLEL_WRITERS: bool = true;

    async fn create() -> Option<Self> {
        let db = TestDb::create().await?;
        Some(Postgres {
            store: OnceCell::new(),
            db,
        })
    }

    async fn serve(&self, setup: Setup<'_, Self>) -> Server<Self> {
        setup.spawn_with(|options| options).await
    }

    server_database_reads!();
}

impl Backend for Postgres {
    const NO_OUTBOX_TABLE: &'static str = "outbox_events";

    fn store_cell(&self) -> &OnceCell<PostgresStore> {
        &self.store
    }

    async fn another_store(&self) -> PostgresStore {
        self.db
            .store_with(|o| o.with_max_connections(4).with_max_read_connections(2))
            .await
    }

    pg_outbox_reads!();

    /// Autocommit, on a pooled connection.
    async fn enqueue_now(&self, topic: &str, payload: Value) -> EventId {
        let client = self.store().await.client().await.expect("client");
        tower_idempotency::outbox::Outbox::<tower_idempotency::store::tokio_postgres::PostgresStore>::enqueue_in(&**client, topic, &payload)
            .await
            .expect("enqueue")
    }

    async fn process(inbox: &Inbox<PostgresStore>, event_id: &str, apply: Apply) -> Processing {
        let id = event_id.to_owned();
        inbox
            .process(event_id, move |tx| async move {
                let client = tx.client().await?;
                match apply {
                    Apply::Nothing => return Ok(0),
                    Apply::BrokenStatement => {
                        client
                            .execute("INSERT INTO no_such_table VALUES (1)", &[])
                            .await?;
                        return Ok(0);
                    }
                    Apply::Effect | Apply::EffectThenFail => {
                        client.execute(INSERT_EFFECT, &[&id]).await?
                    }
                };
                if let Apply::EffectThenFail = apply {
                    return Err(tower_idempotency::Error::Corrupt(FAILURE.into()));
                }
                let row = client
                    .query_one("SELECT count(*) FROM effects WHERE event_id = $1", &[&id])
                    .await?;
                Ok(row.try_get(0)?)
            })
            .await
    }

    async fn apply_in(tx: &PostgresHandle, event_id: &str) {
        let client = tx.client().await.expect("client");
        client
            .execute(INSERT_EFFECT, &[&event_id])
            .await
            .expect("apply");
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
            .spawn(&db.db)
            .await;
        Server::new(running)
    }
}

/// The [`Backend`] calls of a store on sqlx (`$store`, whose handle is `$handle`) that run the
/// test's SQL through sqlx, whichever database: an event enqueued on the store's pool
/// (autocommit), and the receiver's effect applied in the inbox's transaction or a request's.
/// `$param` is how the database writes the first bind parameter (`$1`; MySQL's `?`).
macro_rules! sqlx_backend_calls {
    ($store:ty, $handle:ty, $param:literal) => {
        /// Autocommit, on the store's pool.
        async fn enqueue_now(&self, topic: &str, payload: Value) -> EventId {
            let pool = self.store().await.pool();
            Outbox::<$store>::enqueue_in(pool, topic, &payload)
                .await
                .expect("enqueue")
        }

        async fn process(inbox: &Inbox<$store>, event_id: &str, apply: Apply) -> Processing {
            let id = event_id.to_owned();
            inbox
                .process(event_id, move |tx| async move {
                    let mut conn = tx.acquire().await?;
                    match apply {
                        Apply::Nothing => return Ok(0),
                        Apply::BrokenStatement => {
                            sqlx::query("INSERT INTO no_such_table VALUES (1)")
                                .execute(&mut *conn)
                                .await?;
                            return Ok(0);
                        }
                        Apply::Effect | Apply::EffectThenFail => {
                            let insert = INSERT_EFFECT.replace("$1", $param);
                            sqlx::query(sqlx::AssertSqlSafe(insert))
                                .bind(&id)
                                .execute(&mut *conn)
                                .await?
                        }
                    };
                    if let Apply::EffectThenFail = apply {
                        return Err(tower_idempotency::Error::Corrupt(FAILURE.into()));
                    }
                    let count = COUNT_EFFECTS.replace("$1", $param);
                    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(count))
                        .bind(&id)
                        .fetch_one(&mut *conn)
                        .await?)
                })
                .await
        }

        async fn apply_in(tx: &$handle, event_id: &str) {
            let mut conn = tx.acquire().await.expect("connection");
            let insert = INSERT_EFFECT.replace("$1", $param);
            let applied = sqlx::query(sqlx::AssertSqlSafe(insert))
                .bind(event_id)
                .execute(&mut *conn);
            applied.await.expect("apply");
        }
    };
}

// ----- PostgreSQL on sqlx -----

/// A schema of its own, as [`Postgres`], served by the app on the sqlx store
/// (`pg_common::sqlx_app`).
pub struct SqlxPostgres {
    store: OnceCell<SqlxPostgresStore>,
    pub db: TestDb,
}

impl Database for SqlxPostgres {
    type Store = SqlxPostgresStore;

    const PARALLEL_WRITERS: bool = true;

    async fn create() -> Option<Self> {
        let db = TestDb::create().await?;
        Some(SqlxPostgres {
            store: OnceCell::new(),
            db,
        })
    }

    async fn serve(&self, setup: Setup<'_, Self>) -> Server<Self> {
        let running = setup.convert(adapt, SqlxPgApp).spawn(&self.db).await;
        Server::new(running)
    }

    server_database_reads!();
}

impl Backend for SqlxPostgres {
    const NO_OUTBOX_TABLE: &'static str = "outbox_events";

    fn store_cell(&self) -> &OnceCell<SqlxPostgresStore> {
        &self.store
    }

    async fn another_store(&self) -> SqlxPostgresStore {
        self.db.sqlx_store(4, 2).await
    }

    pg_outbox_reads!();

    sqlx_backend_calls!(SqlxPostgresStore, SqlxPostgresHandle, "$1");
}

// ----- MySQL or MariaDB on sqlx: a database of its own -----

/// A database of its own on the server of `TEST_MYSQL_URL`, dropped at the end, served by the
/// order app of `tests/support/common` on the sqlx MySQL store (its handle's inserts are
/// `tests/support/mysql_common`'s).
pub struct MySql {
    store: OnceCell<SqlxMySqlStore>,
    pub db: mysql_common::TestDb,
}

impl Database for MySql {
    type Store = SqlxMySqlStore;

    const PARALLEL_WRITERS: bool = true;

    async fn create() -> Option<Self> {
        let db = mysql_common::TestDb::create().await?;
        Some(MySql {
            store: OnceCell::new(),
            db,
        })
    }

    async fn serve(&self, setup: Setup<'_, Self>) -> Server<Self> {
        let running = setup
            .convert(adapt::<SqlxMySqlHandle, HookOutcome>, ())
            // A pool of 8 connections, as the PostgreSQL apps.
            .serve_on(self.db.store(8).await)
            .await;
        Server::new(running)
    }

    server_database_reads!();
}

impl Backend for MySql {
    const NO_OUTBOX_TABLE: &'static str = "outbox_events";

    fn store_cell(&self) -> &OnceCell<SqlxMySqlStore> {
        &self.store
    }

    async fn another_store(&self) -> SqlxMySqlStore {
        self.db.store(4).await
    }

    async fn event_count(&self) -> i64 {
        self.db.count("SELECT count(*) FROM outbox_events").await
    }

    async fn effects(&self, event_id: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE event_id = ?")
            .bind(event_id)
            .fetch_one(&mut self.db.connection().await)
            .await
            .expect("count the effects")
    }

    /// The admin tool has no MySQL store: the suites that run it leave MySQL out.
    async fn tool_args(&self) -> Vec<String> {
        vec!["--database-url".into(), self.db.url()]
    }

    sqlx_backend_calls!(SqlxMySqlStore, SqlxMySqlHandle, "?");
}

// ----- SQLite on sqlx: a file in a temp dir -----

/// A SQLite file in a temp dir of its own (`tests/support/sqlx_sqlite_common`), served by the
/// order app of `tests/support/common` on the sqlx SQLite store (its handle's insert is
/// `sqlx_sqlite_common`'s). Every server opens a store of its own on the file; the test reads
/// it through a connection of its own, as another process would. No server: its tests run in a
/// plain `cargo test`.
pub struct SqlxSqlite {
    store: OnceCell<SqlxSqliteStore>,
    pub db: sqlx_sqlite_common::TestDb,
}

impl Database for SqlxSqlite {
    type Store = SqlxSqliteStore;

    const PARALLEL_WRITERS: bool = false;

    async fn create() -> Option<Self> {
        let db = sqlx_sqlite_common::TestDb::with_orders().await?;
        Some(SqlxSqlite {
            store: OnceCell::new(),
            db,
        })
    }

    async fn serve(&self, setup: Setup<'_, Self>) -> Server<Self> {
        let running = setup
            .convert(adapt::<SqlxSqliteHandle, HookOutcome>, ())
            // A pool of 8 connections, as the other stores' apps: requests beyond the one
            // writer wait for the write lock rather than for a connection.
            .serve_on(self.db.store(8).await)
            .await;
        Server::new(running)
    }

    async fn execute(&self, sql: &str) {
        self.db.execute(sql).await;
    }

    async fn orders(&self) -> Vec<Order> {
        self.db.orders().await
    }

    async fn order_count(&self) -> i64 {
        self.db.order_count().await
    }

    async fn record_count(&self) -> i64 {
        self.db.record_count().await
    }

    async fn record_exists(&self, tenant: &str, operation: &str, key: &str) -> bool {
        self.db.record_exists(tenant, operation, key).await
    }

    sqlite_failure_triggers!();
}

impl Backend for SqlxSqlite {
    const NO_OUTBOX_TABLE: &'static str = "no such table: outbox_events";

    fn store_cell(&self) -> &OnceCell<SqlxSqliteStore> {
        &self.store
    }

    async fn another_store(&self) -> SqlxSqliteStore {
        self.db.store(4).await
    }

    async fn event_count(&self) -> i64 {
        self.db.count("SELECT count(*) FROM outbox_events").await
    }

    async fn effects(&self, event_id: &str) -> i64 {
        sqlx::query_scalar(COUNT_EFFECTS)
            .bind(event_id)
            .fetch_one(&mut self.db.connection().await)
            .await
            .expect("count the effects")
    }

    /// The tool opens the file with the SQLite store (`--db`): its tables have the same
    /// columns.
    async fn tool_args(&self) -> Vec<String> {
        vec!["--db".into(), self.db.path().display().to_string()]
    }

    sqlx_backend_calls!(SqlxSqliteStore, SqlxSqliteHandle, "$1");
}

/// Instantiates generic tests (`async fn name<B: Database>(db: B)` in the suite's root module)
/// as tests (`test!`) on a fresh database each, inside the suite's module of that backend
/// (which also holds the suite's tests for that backend only):
/// `backend_tests!(Sqlite; a, b(multi_thread = 2), c = a)`, where `b(multi_thread = 2)` runs `b`
/// on a multi-thread runtime of 2 workers and `c = a` runs `a` under the name `c`
/// (`c(multi_thread = 2) = a` with one). Every PostgreSQL instance is registered as needing
/// PostgreSQL (reported as ignored without `TEST_DATABASE_URL`), every MySQL one as needing
/// MySQL (`TEST_MYSQL_URL`); the SQLite ones (`Sqlite`, `SqlxSqlite`) need nothing.
#[macro_export]
macro_rules! backend_tests {
    (Sqlite; $($tests:tt)*) => {
        $crate::backend_tests!(@each Sqlite []; $($tests)*);
    };
    (Postgres; $($tests:tt)*) => {
        $crate::backend_tests!(@each Postgres [postgres]; $($tests)*);
    };
    (SqlxPostgres; $($tests:tt)*) => {
        $crate::backend_tests!(@each SqlxPostgres [postgres]; $($tests)*);
    };
    (MySql; $($tests:tt)*) => {
        $crate::backend_tests!(@each MySql [mysql]; $($tests)*);
    };
    (SqlxSqlite; $($tests:tt)*) => {
        $crate::backend_tests!(@each SqlxSqlite []; $($tests)*);
    };
    (@each $backend:ident [$($needs:ident)?];
        $name:ident $(($($options:tt)*))? = $test:ident $(, $($rest:tt)*)?) => {
        $crate::test! { $name $(, $($options)*)? $(, $needs)? }
        async fn $name() {
            $crate::backend::run(|db: $crate::backend::$backend| super::$test(db)).await;
        }
        $crate::backend_tests!(@each $backend [$($needs)?]; $($($rest)*)?);
    };
    (@each $backend:ident [$($needs:ident)?];
        $name:ident $(($($options:tt)*))? $(, $($rest:tt)*)?) => {
        $crate::test! { $name $(, $($options)*)? $(, $needs)? }
        async fn $name() {
            $crate::backend::run(|db: $crate::backend::$backend| super::$name(db)).await;
        }
        $crate::backend_tests!(@each $backend [$($needs)?]; $($($rest)*)?);
    };
    (@each $backend:ident [$($needs:ident)?];) => {};
}
