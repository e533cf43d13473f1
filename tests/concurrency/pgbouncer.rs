//! The PostgreSQL stores behind PgBouncer in transaction pooling mode, on both drivers: each
//! test starts a PgBouncer of its own (`support::pgbouncer`: `pool_mode = transaction`, two
//! server connections per role, so that every client connection's transactions are spread
//! over both) in front of the server of `TEST_DATABASE_URL`, and the stores connect through
//! it with unnamed statements (`with_unnamed_statements(true)`). Reported as ignored where
//! PgBouncer or `TEST_DATABASE_URL` is missing.
//!
//! - What needs the setting: without it, a statement prepared on one server connection is
//!   missing on the next (`prepared statement "..." does not exist`), and the request is a
//!   `500`; with it, the same sequence is answered.
//! - The contract through the pooler (replays, conflicts, tenants, failures, expiry, purge)
//!   and many keys at once.
//! - Two app instances racing duplicates through the pooler.
//! - Steps, the outbox's relay, the inbox and the admin verbs through the pooler.
//! - An app instance (a child process) killed with SIGKILL under load, and a restart of
//!   PgBouncer under load: one order per key, nothing lost, never a `500`.

use support::common;
use support::common::ChargeProvider;
use support::pg_common;
use support::pgbouncer::{Bounced, ChildApp};

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::extract::State;
use axum::routing::post as route_post;
use axum::{Json, Router};
use common::process::client;
use common::server_backed::OrderServer;
use common::{
    hook_for, post, AppBuilder, HookFor, InsertOrder, OrderCallOf, Post, Reply, SHOP_A, SHOP_B,
};
use http::{HeaderName, HeaderValue, StatusCode};
use pg_common::HookOutcome;
use serde_json::{json, Value};
use tower_idempotency::admin::{Admin, AdminBackend, RecordFilter};
use tower_idempotency::outbox::{
    sink_fn, Enqueue, Inbox, InboxBackend, Outbox, OutboxBackend, OutboxEvent, Processed, Relay,
};
use tower_idempotency::steps::{CallAgain, ProgressStatus, StepError, StepStore, Steps};
use tower_idempotency::store::sqlx_postgres::{SqlxPostgresHandle, SqlxPostgresStore};
use tower_idempotency::store::tokio_postgres::tokio_postgres::{self, NoTls};
use tower_idempotency::store::tokio_postgres::{PostgresHandle, PostgresStore};
use tower_idempotency::store::{IdempotencyStore, ReplayCheck};
use tower_idempotency::{IdempotencyLayer, Tenant};

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;
/// Server connections per role in front of each test's database.
const POOL_SIZE: usize = 2;
/// How long one request may take before a client gives it up (a killed instance, a restarted
/// PgBouncer): reached only by requests cut off.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

type Hook<D> = HookFor<OrderCallOf<<D as Driver>::Handle>, HookOutcome>;
type App<D> = AppBuilder<<D as Driver>::Store, Hook<D>, ()>;
type Server<D> = OrderServer<<D as Driver>::Store, <D as Driver>::Handle, HookOutcome>;

/// A driver's store through the pooler, and what the tests do with it that is written per
/// driver (the handler's SQL).
trait Driver: Sized + Send + Sync + 'static {
    type Store: IdempotencyStore
        + StepStore
        + OutboxBackend
        + InboxBackend
        + AdminBackend
        + Clone
        + Send
        + Sync
        + 'static;
    type Handle: Enqueue + Send + Sync + 'static;

    /// The driver's name, for messages and the child app's environment.
    const NAME: &'static str;

    /// Whether the driver forgets a statement it had prepared once the server says it does not
    /// exist (`26000`), so that the next use prepares it again: sqlx does (0.9.1), tokio-postgres
    /// does not.
    const FORGETS_A_MISSING_STATEMENT: bool;

    /// A store through `db`'s PgBouncer with `max` transaction connections (and the store's
    /// defaults but the replay check `check`); with unnamed statements if `unnamed`.
    fn store(
        db: &Bounced,
        max: u32,
        check: ReplayCheck,
        unnamed: bool,
    ) -> impl Future<Output = Self::Store> + Send;

    /// A store through the pooler at `url` (the child app's, which has no [`Bounced`]).
    fn store_at(url: &str) -> impl Future<Output = Self::Store> + Send;

    /// The order app on `store`.
    fn serve(app: App<Self>, store: Self::Store) -> impl Future<Output = Server<Self>>;

    /// The steps route's local step: an order of `sku` (tenant `steps`); its id.
    fn insert_in_step(
        steps: &Steps<Self::Store>,
        sku: String,
    ) -> impl Future<Output = Result<i64, StepError>> + Send;

    /// Processes `event_id` with `inbox`: one row in `effects` in the inbox's transaction.
    fn process(
        inbox: &Inbox<Self::Store>,
        event_id: &str,
    ) -> impl Future<Output = Result<Processed<i64>, tower_idempotency::Error>> + Send;

    /// A reservation of `store` taken directly, and the order app's handler statement in it:
    /// the error of either, if any (a statement the connection prepared on another server
    /// connection fails here).
    fn handler_statement_on(store: &Self::Store) -> impl Future<Output = Option<String>> + Send;
}

struct TokioPostgres;

impl Driver for TokioPostgres {
    type Store = PostgresStore;
    type Handle = PostgresHandle;

    const NAME: &'static str = "tokio_postgres";
    const FORGETS_A_MISSING_STATEMENT: bool = false;

    async fn store(db: &Bounced, max: u32, check: ReplayCheck, unnamed: bool) -> PostgresStore {
        db.store_with(|options| {
            options
                .with_unnamed_statements(unnamed)
                .with_max_connections(max as usize)
                .with_replay_check(check)
        })
        .await
    }

    async fn store_at(url: &str) -> PostgresStore {
        PostgresStore::builder(url.parse().expect("a valid URL"))
            .with_unnamed_statements(true)
            .with_max_connections(8)
            .with_max_read_connections(4)
            .build()
            .await
            .expect("open the store through PgBouncer")
    }

    async fn serve(app: App<Self>, store: PostgresStore) -> Server<Self> {
        app.serve_on(store).await
    }

    async fn insert_in_step(steps: &Steps<PostgresStore>, sku: String) -> Result<i64, StepError> {
        steps
            .local("insert_order", move |tx: PostgresHandle| async move {
                let row = tx
                    .client()
                    .await?
                    .query_one(
                        "INSERT INTO orders (tenant_id, sku, quantity) VALUES ('steps', $1, 1) \
                         RETURNING id",
                        &[&sku],
                    )
                    .await?;
                Ok(row.try_get::<_, i64>(0)?)
            })
            .await
    }

    async fn process(
        inbox: &Inbox<PostgresStore>,
        event_id: &str,
    ) -> Result<Processed<i64>, tower_idempotency::Error> {
        let id = event_id.to_owned();
        inbox
            .process(event_id, move |tx| async move {
                let client = tx.client().await?;
                client.execute(INSERT_EFFECT, &[&id]).await?;
                let row = client
                    .query_one("SELECT count(*) FROM effects WHERE event_id = $1", &[&id])
                    .await?;
                Ok(row.try_get(0)?)
            })
            .await
    }

    async fn handler_statement_on(store: &PostgresStore) -> Option<String> {
        use tower_idempotency::store::{Begin, Reservation};
        let scope = common::scope("shop-a", "create_order", "direct");
        let begun = store
            .begin(&scope, Duration::from_secs(5), SystemTime::now())
            .await;
        let reservation = match begun {
            Ok(Begin::Reserved(reservation)) => reservation,
            Ok(_) => return Some("the key had a record".to_owned()),
            Err(error) => return Some(error.to_string()),
        };
        let tenant = Tenant::new("direct");
        let inserted = reservation.handle().insert_order(&tenant, "x", 1).await;
        let _ = reservation.rollback().await;
        inserted.err().map(|error| error.to_string())
    }
}

struct Sqlx;

impl Driver for Sqlx {
    type Store = SqlxPostgresStore;
    type Handle = SqlxPostgresHandle;

    const NAME: &'static str = "sqlx";
    const FORGETS_A_MISSING_STATEMENT: bool = true;

    async fn store(db: &Bounced, max: u32, check: ReplayCheck, unnamed: bool) -> SqlxPostgresStore {
        let store = SqlxPostgresStore::builder(db.sqlx_pool(max).await)
            .with_max_read_connections(4)
            .with_replay_check(check)
            .with_unnamed_statements(unnamed)
            .build();
        store
            .migrate()
            .await
            .expect("create the table through PgBouncer");
        store
    }

    async fn store_at(url: &str) -> SqlxPostgresStore {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(8)
            .connect(url)
            .await
            .expect("connect the pool through PgBouncer");
        let store = SqlxPostgresStore::builder(pool)
            .with_max_read_connections(4)
            .with_unnamed_statements(true)
            .build();
        store
            .migrate()
            .await
            .expect("create the table through PgBouncer");
        store
    }

    async fn serve(app: App<Self>, store: SqlxPostgresStore) -> Server<Self> {
        app.serve_on(store).await
    }

    async fn insert_in_step(
        steps: &Steps<SqlxPostgresStore>,
        sku: String,
    ) -> Result<i64, StepError> {
        steps
            .local("insert_order", move |tx: SqlxPostgresHandle| async move {
                let mut conn = tx.acquire().await?;
                let id = sqlx::query_scalar::<_, i64>(
                    "INSERT INTO orders (tenant_id, sku, quantity) VALUES ('steps', $1, 1) \
                     RETURNING id",
                )
                .bind(sku)
                .fetch_one(&mut *conn)
                .await?;
                Ok(id)
            })
            .await
    }

    async fn process(
        inbox: &Inbox<SqlxPostgresStore>,
        event_id: &str,
    ) -> Result<Processed<i64>, tower_idempotency::Error> {
        let id = event_id.to_owned();
        inbox
            .process(event_id, move |tx| async move {
                let mut conn = tx.acquire().await?;
                sqlx::query(INSERT_EFFECT)
                    .bind(&id)
                    .execute(&mut *conn)
                    .await?;
                let count = sqlx::query_scalar("SELECT count(*) FROM effects WHERE event_id = $1")
                    .bind(&id)
                    .fetch_one(&mut *conn)
                    .await?;
                Ok(count)
            })
            .await
    }

    async fn handler_statement_on(store: &SqlxPostgresStore) -> Option<String> {
        use tower_idempotency::store::{Begin, Reservation};
        let scope = common::scope("shop-a", "create_order", "direct");
        let begun = store
            .begin(&scope, Duration::from_secs(5), SystemTime::now())
            .await;
        let reservation = match begun {
            Ok(Begin::Reserved(reservation)) => reservation,
            Ok(_) => return Some("the key had a record".to_owned()),
            Err(error) => return Some(error.to_string()),
        };
        let tenant = Tenant::new("direct");
        let inserted = reservation.handle().insert_order(&tenant, "x", 1).await;
        let _ = reservation.rollback().await;
        inserted.err().map(|error| error.to_string())
    }
}

/// The receiver's effect: one row per application of an event.
const INSERT_EFFECT: &str = "INSERT INTO effects (event_id, note) VALUES ($1, 'applied')";

/// The order app of the tests, its layers customised by `layer`.
fn app<D: Driver>(
    layer: impl Fn(IdempotencyLayer<D::Store>) -> IdempotencyLayer<D::Store> + Send + 'static,
) -> App<D> {
    AppBuilder::new(()).layer(layer)
}

/// Sends `body` under `key` as `token`'s tenant through a client of its own; `None` when no
/// answer came (the server went away under it).
async fn try_post(addr: SocketAddr, token: &str, key: &str, body: &str) -> Option<Reply> {
    Post::order(key, body)
        .token(Some(token))
        .try_send(&client(), addr, REQUEST_TIMEOUT)
        .await
}

/// Sends `body` under `key` as shop-a, again while the answer is `503` (the store was busy:
/// every connection PgBouncer has for the role taken for longer than the lock timeout, under a
/// burst), as a client that honours `Retry-After` does; the first other answer.
async fn post_while_busy(addr: SocketAddr, key: &str, body: &str) -> Reply {
    for _ in 0..50 {
        let reply = post(addr, Some(SHOP_A), Some(key), body, &[]).await;
        if reply.status != StatusCode::SERVICE_UNAVAILABLE {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{key}: busy for 50 attempts");
}

// ----- what needs the setting -----

test! { startup_options_are_refused_and_the_roles_search_path_selects_the_schema, pgbouncer }
/// PgBouncer refuses the startup `options` the other suites select their schema with: the
/// role's own `search_path` selects it here, on every server connection PgBouncer lends.
async fn startup_options_are_refused_and_the_roles_search_path_selects_the_schema() {
    let Some(db) = Bounced::create(POOL_SIZE).await else {
        return;
    };
    let mut with_options = db.config();
    with_options.options(format!("-c search_path={}", db.name));
    let refused = with_options
        .connect(NoTls)
        .await
        .map(drop)
        .expect_err("PgBouncer refuses the options startup parameter");
    let message = refused
        .as_db_error()
        .map(|error| error.message().to_owned())
        .unwrap_or_else(|| refused.to_string());
    assert_eq!(
        message, "unsupported startup parameter: options",
        "{refused:?}"
    );

    let (client, connection) = db.config().connect(NoTls).await.expect("connect");
    tokio::spawn(connection);
    for _ in 0..4 {
        // Each transaction on whichever server connection PgBouncer lends.
        let rows = client.simple_query("SHOW search_path").await.expect("show");
        let shown = rows.iter().find_map(|message| match message {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
            _ => None,
        });
        assert_eq!(shown.as_deref(), Some(db.name.as_str()));
    }
}

/// The server connection the role's last transaction ran on: the one that went idle last
/// (which PgBouncer, reusing server connections last in first out, lends next).
async fn last_server_connection(db: &Bounced) -> i32 {
    db.value(
        "SELECT pid FROM pg_stat_activity WHERE usename = current_user AND state = 'idle' \
         ORDER BY state_change DESC LIMIT 1",
        &[],
    )
    .await
}

/// A client through the pooler holding a transaction open on the server connection `pid` (of
/// the two PgBouncer has for the role), so that the store's next transaction runs on the
/// other. Usually the first client gets it (the last used, lent first); if not, it holds the
/// other while a second client takes `pid`, and lets it go.
async fn hold_server_connection(db: &Bounced, pid: i32) -> tokio_postgres::Client {
    let hold = || async {
        let (holder, connection) = db.config().connect(NoTls).await.expect("connect");
        tokio::spawn(connection);
        holder
            .batch_execute("BEGIN")
            .await
            .expect("hold a server connection");
        let held: i32 = holder
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .expect("its backend")
            .get(0);
        (holder, held)
    };
    let (first, held) = hold().await;
    if held == pid {
        return first;
    }
    let (second, held) = hold().await;
    assert_eq!(held, pid, "PgBouncer lent the other server connection");
    drop(first);
    second
}

/// Without unnamed statements, a statement the store's connection prepared in one
/// transaction is gone in the next, which PgBouncer runs on another server connection: the
/// handler's statement fails, the error saying `prepared statement "..." does not exist`, and
/// so does the next request's (a `500`), unless the driver forgot the statement at that error
/// (sqlx): then it prepares it again and the request is answered. With unnamed statements, the
/// same sequence is answered throughout.
async fn a_statement_prepared_on_one_server_connection_is_missing_on_the_next<D: Driver>() {
    for unnamed in [false, true] {
        let Some(db) = Bounced::create(POOL_SIZE).await else {
            return;
        };
        // One connection, reused for every request; no read before the reservation.
        let store = D::store(&db, 1, ReplayCheck::FavorNewKeys, unnamed).await;
        let server = D::serve(app::<D>(|layer| layer), store.clone()).await;
        let first = post(server.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
        assert_eq!(first.status, StatusCode::CREATED, "{}: {first:?}", D::NAME);

        // The server connection the first request ran on is now another client's.
        let holder = hold_server_connection(&db, last_server_connection(&db).await).await;
        let failed = D::handler_statement_on(&store).await;
        let second = post(server.addr, Some(SHOP_A), Some("k2"), BOOK, &[]).await;
        if unnamed || D::FORGETS_A_MISSING_STATEMENT {
            assert_eq!(
                second.status,
                StatusCode::CREATED,
                "{}: {second:?}",
                D::NAME
            );
        } else {
            assert_eq!(
                second.status,
                StatusCode::INTERNAL_SERVER_ERROR,
                "{}: without unnamed statements: {second:?}",
                D::NAME
            );
        }
        if unnamed {
            assert_eq!(failed, None, "{}", D::NAME);
        } else {
            let failed = failed.expect("the handler's statement fails");
            assert!(
                failed.contains("prepared statement") && failed.contains("does not exist"),
                "{}: {failed}",
                D::NAME
            );
        }
        drop(holder);
        server.shutdown().await;
    }
}

// ----- the contract and many keys -----

async fn the_contract_holds_through_the_pooler<D: Driver>() {
    let Some(db) = Bounced::create(POOL_SIZE).await else {
        return;
    };
    let failing = hook_for(|call: OrderCallOf<D::Handle>| async move {
        HookOutcome {
            fail_with: (call.sku == "broken").then_some(StatusCode::UNPROCESSABLE_ENTITY),
        }
    });
    let store = D::store(&db, 8, ReplayCheck::default(), true).await;
    let server = D::serve(app::<D>(|layer| layer).hook(failing), store.clone()).await;
    let addr = server.addr;

    // A new key, then its replays.
    let first = post(addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(!first.replayed());
    for _ in 0..3 {
        let again = post(addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
        assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
        assert!(again.replayed(), "{again:?}");
        assert_eq!(again.body, first.body);
    }
    assert_eq!(server.app.handler_calls(), 1);
    // Another payload under the same key.
    let other = r#"{"sku":"pen","quantity":2}"#;
    let conflict = post(addr, Some(SHOP_A), Some("key-1"), other, &[]).await;
    assert_eq!(conflict.status, StatusCode::CONFLICT, "{conflict:?}");
    // Another tenant, the same key: its own order.
    let shop_b = post(addr, Some(SHOP_B), Some("key-1"), BOOK, &[]).await;
    assert_eq!(shop_b.status, StatusCode::CREATED, "{shop_b:?}");
    assert_ne!(shop_b.order_id(), first.order_id());
    // No key.
    let keyless = post(addr, Some(SHOP_A), None, BOOK, &[]).await;
    assert_eq!(keyless.status, StatusCode::BAD_REQUEST, "{keyless:?}");
    // A handler's failure is not saved, its rows roll back, and the key runs again.
    let broken = r#"{"sku":"broken","quantity":1}"#;
    let refused = post(addr, Some(SHOP_A), Some("key-2"), broken, &[]).await;
    assert_eq!(
        refused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{refused:?}"
    );
    let corrected = post(addr, Some(SHOP_A), Some("key-2"), BOOK, &[]).await;
    assert_eq!(corrected.status, StatusCode::CREATED, "{corrected:?}");
    assert!(!corrected.replayed());
    assert_eq!(db.orders().await.len(), 3, "the failed order rolled back");

    // Many keys at once, each sent twice, through two server connections.
    let keys: Vec<String> = (0..200).map(|n| format!("many-{n}")).collect();
    let answers = Arc::new(Mutex::new(BTreeMap::<String, Vec<Reply>>::new()));
    let next = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..16)
        .map(|_| {
            let (keys, answers, next) = (keys.clone(), answers.clone(), next.clone());
            tokio::spawn(async move {
                loop {
                    let n = next.fetch_add(1, Ordering::SeqCst);
                    let Some(key) = keys.get(n / 2) else {
                        return;
                    };
                    let reply = post_while_busy(addr, key, BOOK).await;
                    answers
                        .lock()
                        .unwrap()
                        .entry(key.clone())
                        .or_default()
                        .push(reply);
                }
            })
        })
        .collect();
    for client in clients {
        client.await.expect("a client");
    }
    let answers = std::mem::take(&mut *answers.lock().unwrap());
    for (key, replies) in &answers {
        assert_eq!(replies.len(), 2, "{key}");
        for reply in replies {
            assert_eq!(
                reply.status,
                StatusCode::CREATED,
                "{}: {key}: {reply:?}",
                D::NAME
            );
            assert_eq!(reply.body, replies[0].body, "{key}: one order");
        }
    }
    assert_eq!(db.orders().await.len(), 3 + keys.len());
    assert_eq!(server.app.handler_calls(), 4 + keys.len());

    // A saved header that is not ASCII: the record goes with bind parameters.
    let note = HeaderName::from_static("x-note");
    let noted: App<D> = AppBuilder::new(())
        .layer(move |layer| layer.with_replayed_header(note.clone()))
        .response_header(
            HeaderName::from_static("x-note"),
            HeaderValue::from_bytes(b"caf\xe9").expect("obs-text"),
        )
        .hook(hook_for(|_call: OrderCallOf<D::Handle>| async {
            HookOutcome::default()
        }));
    let noted = D::serve(noted, store.clone()).await;
    let saved = post(noted.addr, Some(SHOP_A), Some("noted"), BOOK, &[]).await;
    assert_eq!(saved.status, StatusCode::CREATED, "{saved:?}");
    let replayed = post(noted.addr, Some(SHOP_A), Some("noted"), BOOK, &[]).await;
    assert!(replayed.replayed(), "{replayed:?}");
    assert_eq!(
        replayed.headers.get("x-note").map(HeaderValue::as_bytes),
        Some(&b"caf\xe9"[..])
    );
    noted.shutdown().await;

    // An expired record is taken over; the purge deletes expired ones.
    const RETENTION: Duration = Duration::from_millis(200);
    let expiring = D::serve(
        app::<D>(|layer| layer.with_retention(RETENTION)),
        store.clone(),
    )
    .await;
    let once = post(expiring.addr, Some(SHOP_A), Some("brief"), BOOK, &[]).await;
    assert_eq!(once.status, StatusCode::CREATED, "{once:?}");
    tokio::time::sleep(RETENTION + Duration::from_millis(50)).await;
    let again = post(expiring.addr, Some(SHOP_A), Some("brief"), BOOK, &[]).await;
    assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
    assert!(!again.replayed(), "expired: runs afresh");
    assert_ne!(again.order_id(), once.order_id());
    let other = post(expiring.addr, Some(SHOP_A), Some("brief-2"), BOOK, &[]).await;
    assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
    tokio::time::sleep(RETENTION + Duration::from_millis(50)).await;
    let records = db.row_count().await;
    let purged = store
        .purge_expired(SystemTime::now(), 1)
        .await
        .expect("purge through PgBouncer");
    let purged = purged
        + store
            .purge_expired(SystemTime::now(), 10)
            .await
            .expect("purge through PgBouncer");
    assert_eq!(purged, 2, "the two expired records");
    assert_eq!(db.row_count().await, records - 2);
    expiring.shutdown().await;
    server.shutdown().await;
}

// ----- two instances -----

async fn two_app_instances_race_duplicates_through_the_pooler<D: Driver>() {
    let Some(db) = Bounced::create(POOL_SIZE).await else {
        return;
    };
    let one = D::serve(
        app::<D>(|layer| layer),
        D::store(&db, 8, ReplayCheck::default(), true).await,
    )
    .await;
    let two = D::serve(
        app::<D>(|layer| layer),
        D::store(&db, 8, ReplayCheck::FavorReplays, true).await,
    )
    .await;
    const KEYS: usize = 60;
    let mut sends = Vec::new();
    for n in 0..KEYS {
        for addr in [one.addr, two.addr, one.addr, two.addr] {
            let key = format!("race-{n}");
            sends.push(tokio::spawn(async move {
                let reply = post_while_busy(addr, &key, BOOK).await;
                (key, reply)
            }));
        }
    }
    let mut bodies: BTreeMap<String, Vec<Reply>> = BTreeMap::new();
    for send in sends {
        let (key, reply) = send.await.expect("a send");
        bodies.entry(key).or_default().push(reply);
    }
    for (key, replies) in &bodies {
        for reply in replies {
            assert_eq!(
                reply.status,
                StatusCode::CREATED,
                "{}: {key}: {reply:?}",
                D::NAME
            );
            assert_eq!(reply.body, replies[0].body, "{key}: one order for all four");
        }
    }
    assert_eq!(db.orders().await.len(), KEYS, "one order per key");
    assert_eq!(db.recorded_orders().await.len(), KEYS);
    assert_eq!(
        one.app.handler_calls() + two.app.handler_calls(),
        KEYS,
        "the handler ran once per key"
    );
    one.shutdown().await;
    two.shutdown().await;
}

// ----- steps, the outbox, the inbox, the admin -----

async fn checkout<D: Driver>(
    State(provider): State<ChargeProvider>,
    steps: Steps<D::Store>,
    Json(body): Json<Value>,
) -> Result<(StatusCode, Json<Value>), StepError> {
    let sku = body["sku"].as_str().unwrap_or("book").to_owned();
    let order_id = D::insert_in_step(&steps, sku).await?;
    let charge = steps
        .foreign("charge", CallAgain, |key| async move {
            Ok::<_, tower_idempotency::steps::Foreign>(provider.charge(key))
        })
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({"order_id": order_id, "charge_id": charge})),
    ))
}

async fn steps_outbox_inbox_and_admin_through_the_pooler<D: Driver>() {
    let Some(db) = Bounced::create(POOL_SIZE).await else {
        return;
    };
    db.execute("CREATE TABLE effects (event_id TEXT NOT NULL, note TEXT NOT NULL)")
        .await;
    let store = D::store(&db, 8, ReplayCheck::default(), true).await;
    let outbox = Outbox::install(&store).await.expect("install the outbox");
    store.install_steps().await.expect("install the steps");

    // Orders that enqueue an event in their transaction.
    let enqueuing = hook_for(|call: OrderCallOf<D::Handle>| async move {
        let payload = json!({ "order_id": call.order_id });
        call.tx
            .enqueue("order_created", payload)
            .await
            .expect("enqueue through PgBouncer");
        HookOutcome::default()
    });
    let server = D::serve(app::<D>(|layer| layer).hook(enqueuing), store.clone()).await;
    let mut order_ids = Vec::new();
    for n in 0..20 {
        let reply = post(
            server.addr,
            Some(SHOP_A),
            Some(&format!("ev-{n}")),
            BOOK,
            &[],
        )
        .await;
        assert_eq!(reply.status, StatusCode::CREATED, "{}: {reply:?}", D::NAME);
        order_ids.push(reply.order_id());
    }

    // The relay delivers each once.
    let delivered = Arc::new(Mutex::new(Vec::<(String, i64)>::new()));
    let sink = {
        let delivered = delivered.clone();
        sink_fn(move |event: OutboxEvent| {
            let delivered = delivered.clone();
            async move {
                let payload: Value = serde_json::from_str(event.payload()).unwrap_or_default();
                let order_id = payload["order_id"].as_i64().unwrap_or(-1);
                delivered
                    .lock()
                    .unwrap()
                    .push((event.id().as_str().to_owned(), order_id));
                Ok::<(), std::io::Error>(())
            }
        })
    };
    let mut relay = Relay::new(outbox.clone(), sink).with_batch_size(7);
    for _ in 0..20 {
        let round = relay
            .run_once()
            .await
            .expect("a relay round through PgBouncer");
        if round.claimed == 0 {
            break;
        }
    }
    let delivered = std::mem::take(&mut *delivered.lock().unwrap());
    let mut delivered_orders: Vec<i64> = delivered.iter().map(|(_, id)| *id).collect();
    delivered_orders.sort_unstable();
    let mut expected = order_ids.clone();
    expected.sort_unstable();
    assert_eq!(delivered_orders, expected, "each event delivered once");
    let counts = outbox.counts().await.expect("outbox counts");
    assert_eq!((counts.delivered, counts.pending, counts.dead), (20, 0, 0));

    // The receiver applies each once.
    let inbox = Inbox::install(&store, "billing")
        .await
        .expect("install the inbox");
    for (event_id, _) in &delivered {
        let first = D::process(&inbox, event_id).await.expect("process");
        assert!(matches!(first, Processed::First(1)), "{first:?}");
        let again = D::process(&inbox, event_id).await.expect("process again");
        assert!(matches!(again, Processed::Duplicate), "{again:?}");
    }

    // The admin verbs.
    let admin = Admin::new(store.clone());
    let counts = admin
        .counts(&RecordFilter::default())
        .await
        .expect("counts through PgBouncer");
    assert_eq!(counts.live, 20);
    let record = admin
        .inspect("shop-a", "create_order", "ev-3", true)
        .await
        .expect("inspect through PgBouncer")
        .expect("the record");
    assert_eq!(record.status, 201);
    assert!(admin
        .delete("shop-a", "create_order", "ev-3")
        .await
        .expect("delete"));
    let again = post(server.addr, Some(SHOP_A), Some("ev-3"), BOOK, &[]).await;
    assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
    assert!(!again.replayed(), "deleted: runs again");
    assert_eq!(admin.purge_expired(100).await.expect("purge"), 0);
    server.shutdown().await;

    // Steps: a local step and a foreign call per key; duplicates in flight wait and replay.
    let provider = ChargeProvider::default();
    let layer = IdempotencyLayer::new(store.clone())
        .with_operation("checkout")
        .with_lock_timeout(Duration::from_secs(5))
        .with_step_lease(Duration::from_secs(10));
    let router = Router::new()
        .route("/checkouts", route_post(checkout::<D>).layer(layer))
        .layer(axum::Extension(Tenant::new("shop-a")))
        .with_state(provider.clone());
    let serving = common::Serving::start(router).await;
    let mut sends = Vec::new();
    for n in 0..12 {
        for _ in 0..2 {
            let addr = serving.addr;
            sends.push(tokio::spawn(async move {
                let key = format!("steps-{n}");
                let reply = Post::order(&key, r#"{"sku":"book"}"#)
                    .path("/checkouts")
                    .send(addr)
                    .await;
                (key, reply)
            }));
        }
    }
    let mut answers: BTreeMap<String, Vec<Reply>> = BTreeMap::new();
    for send in sends {
        let (key, reply) = send.await.expect("a send");
        answers.entry(key).or_default().push(reply);
    }
    for (key, replies) in &answers {
        for reply in replies {
            assert_eq!(
                reply.status,
                StatusCode::CREATED,
                "{}: {key}: {reply:?}",
                D::NAME
            );
            assert_eq!(reply.body, replies[0].body, "{key}");
        }
    }
    assert_eq!(provider.calls(), 12, "one call per key");
    let steps_orders: i64 = db
        .value("SELECT count(*) FROM orders WHERE tenant_id = 'steps'", &[])
        .await;
    assert_eq!(steps_orders, 12);
    for status in [
        ProgressStatus::Running,
        ProgressStatus::InDoubt,
        ProgressStatus::Dead,
    ] {
        let keys = admin
            .keys_in_progress(status, 100)
            .await
            .expect("keys in progress through PgBouncer");
        assert!(keys.is_empty(), "{status:?}: {keys:?}");
    }
    serving.stop().await;
}

// ----- a killed instance, a restarted pooler -----

/// How the load of [`load_until_answered`] went.
#[derive(Debug, Default)]
struct Load {
    /// Each key's `201` bodies.
    created: BTreeMap<String, Vec<bytes::Bytes>>,
    /// Statuses other than `201` and `503`, with the key.
    unexpected: Vec<(String, Reply)>,
    /// Sends cut off or answered `503` (sent again).
    retried: usize,
}

/// Sends every key of `keys` until it is answered `201`, from `clients` clients at once, each
/// send to one of `instances()` (the live app instances, chosen by the key and the attempt);
/// `event` runs once `after` keys are answered, under the load.
async fn load_until_answered<F, Fut>(
    keys: Vec<String>,
    clients: usize,
    instances: Arc<Mutex<Vec<SocketAddr>>>,
    after: usize,
    event: F,
) -> Load
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = ()>,
{
    let load = Arc::new(Mutex::new(Load::default()));
    let next = Arc::new(AtomicUsize::new(0));
    let answered = Arc::new(AtomicUsize::new(0));
    let total = keys.len();
    let keys = Arc::new(keys);
    let workers: Vec<_> = (0..clients)
        .map(|_| {
            let (keys, load, next, answered, instances) = (
                keys.clone(),
                load.clone(),
                next.clone(),
                answered.clone(),
                instances.clone(),
            );
            tokio::spawn(async move {
                loop {
                    let n = next.fetch_add(1, Ordering::SeqCst);
                    let Some(key) = keys.get(n) else {
                        return;
                    };
                    let body = body_of(n);
                    for attempt in 0usize.. {
                        let addr = {
                            let live = instances.lock().unwrap();
                            live[(n + attempt) % live.len()]
                        };
                        let reply = try_post(addr, SHOP_A, key, &body).await;
                        let created = {
                            let mut load = load.lock().unwrap();
                            match reply {
                                Some(reply) if reply.status == StatusCode::CREATED => {
                                    let created = load.created.entry(key.clone()).or_default();
                                    created.push(reply.body);
                                    true
                                }
                                Some(reply) if reply.status == StatusCode::SERVICE_UNAVAILABLE => {
                                    load.retried += 1;
                                    false
                                }
                                Some(reply) => {
                                    load.unexpected.push((key.clone(), reply));
                                    load.retried += 1;
                                    false
                                }
                                None => {
                                    load.retried += 1;
                                    false
                                }
                            }
                        };
                        if created {
                            answered.fetch_add(1, Ordering::SeqCst);
                            break;
                        }
                        if attempt >= 200 {
                            let last = load
                                .lock()
                                .unwrap()
                                .unexpected
                                .last()
                                .map(|last| format!("{last:?}"));
                            panic!(
                                "{key}: never answered 201; the last unexpected answer: {last:?}"
                            );
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            })
        })
        .collect();
    while answered.load(Ordering::SeqCst) < after.min(total) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    event().await;
    for worker in workers {
        worker.await.expect("a client");
    }
    let mut load = std::mem::take(&mut *load.lock().unwrap());
    // Every key once more, from the first live instance: a replay of its one order.
    for (n, key) in keys.iter().enumerate() {
        let addr = instances.lock().unwrap()[0];
        let replay = post(addr, Some(SHOP_A), Some(key), &body_of(n), &[]).await;
        if replay.status == StatusCode::CREATED && replay.replayed() {
            load.created
                .entry(key.clone())
                .or_default()
                .push(replay.body);
        } else {
            load.unexpected.push((key.clone(), replay));
        }
    }
    load
}

/// The order the `n`-th key of a load sends.
fn body_of(n: usize) -> String {
    json!({ "sku": format!("sku-{n}"), "quantity": n % 9 + 1 }).to_string()
}

/// Checks the end state after a load: no `500` (nor any status but `201` and `503`), every
/// key answered with one order, the same one on every `201`, exactly one order and one
/// record per key.
async fn assert_one_order_per_key(db: &Bounced, keys: usize, load: &Load, what: &str) {
    assert!(
        load.unexpected.is_empty(),
        "{what}: unexpected answers: {:?}",
        load.unexpected
    );
    assert_eq!(load.created.len(), keys, "{what}: every key answered");
    for (key, bodies) in &load.created {
        assert!(
            bodies.iter().all(|body| body == &bodies[0]),
            "{what}: {key}: {bodies:?}"
        );
    }
    let orders = db.orders().await;
    assert_eq!(orders.len(), keys, "{what}: one order per key, none lost");
    let recorded = db.recorded_orders().await;
    assert_eq!(recorded.len(), keys, "{what}: one record per key");
    let order_ids: Vec<i64> = orders.iter().map(|order| order.0).collect();
    for (_, key, order_id) in &recorded {
        assert!(
            order_ids.contains(order_id),
            "{what}: {key}: its order exists"
        );
        let answered: Value =
            serde_json::from_slice(&load.created[key][0]).expect("a 201's JSON body");
        assert_eq!(
            answered["order_id"], *order_id,
            "{what}: {key}: the answered order"
        );
    }
}

/// The environment variable that makes [`app_instance`] serve: `<driver> <url>`.
const APP_INSTANCE: &str = "TIDEM_PGBOUNCER_APP_INSTANCE";

test! { app_instance, multi_thread = 2, ignore = "an app instance the SIGKILL test runs as a child process (serves only then)" }
/// An app instance for [`an_app_instance_killed_with_sigkill_loses_and_duplicates_nothing`]:
/// this binary run again as a child process, with only this test, serves the order app
/// through the PgBouncer at the URL of [`APP_INSTANCE`] until it is killed.
async fn app_instance() {
    let Ok(instance) = std::env::var(APP_INSTANCE) else {
        println!("skipped: an app instance of the SIGKILL test, which sets {APP_INSTANCE}");
        return;
    };
    let (driver, url) = instance.split_once(' ').expect("<driver> <url>");
    let addr = match driver {
        "tokio_postgres" => serve_instance::<TokioPostgres>(url).await,
        _ => serve_instance::<Sqlx>(url).await,
    };
    println!("listening on http://{addr}");
    std::future::pending::<()>().await;
}

async fn serve_instance<D: Driver>(url: &str) -> SocketAddr {
    let server = D::serve(app::<D>(|layer| layer), D::store_at(url).await).await;
    let addr = server.addr;
    // Served until the process is killed.
    std::mem::forget(server);
    addr
}

async fn an_app_instance_killed_with_sigkill_loses_and_duplicates_nothing<D: Driver>() {
    let Some(db) = Bounced::create(POOL_SIZE).await else {
        return;
    };
    // The table, created once before the instances start.
    drop(D::store(&db, 1, ReplayCheck::default(), true).await);
    let env = [(APP_INSTANCE, format!("{} {}", D::NAME, db.url()))];
    let doomed = ChildApp::start("pgbouncer::app_instance", &env).await;
    let survivor = ChildApp::start("pgbouncer::app_instance", &env).await;
    let instances = Arc::new(Mutex::new(vec![doomed.addr, survivor.addr]));
    const KEYS: usize = 300;
    let keys: Vec<String> = (0..KEYS).map(|n| format!("kill-{n}")).collect();
    let live = instances.clone();
    let load = load_until_answered(keys, 16, instances, KEYS / 3, || async move {
        let gone = doomed.addr;
        doomed.kill().await;
        live.lock().unwrap().retain(|addr| *addr != gone);
    })
    .await;
    println!(
        "{}: SIGKILL under load: {} keys answered, {} sends retried",
        D::NAME,
        load.created.len(),
        load.retried
    );
    assert_one_order_per_key(&db, KEYS, &load, "SIGKILL of an instance").await;
    survivor.kill().await;
}

async fn a_restart_of_pgbouncer_under_load_loses_and_duplicates_nothing<D: Driver>() {
    let Some(mut db) = Bounced::create(POOL_SIZE).await else {
        return;
    };
    let one = D::serve(
        app::<D>(|layer| layer),
        D::store(&db, 8, ReplayCheck::default(), true).await,
    )
    .await;
    let two = D::serve(
        app::<D>(|layer| layer),
        D::store(&db, 8, ReplayCheck::FavorReplays, true).await,
    )
    .await;
    let instances = Arc::new(Mutex::new(vec![one.addr, two.addr]));
    const KEYS: usize = 300;
    let keys: Vec<String> = (0..KEYS).map(|n| format!("restart-{n}")).collect();
    let bouncer = &mut db.bouncer;
    let load = load_until_answered(keys, 16, instances, KEYS / 3, || bouncer.restart()).await;
    println!(
        "{}: PgBouncer restarted under load: {} keys answered, {} sends retried",
        D::NAME,
        load.created.len(),
        load.retried
    );
    assert_one_order_per_key(&db, KEYS, &load, "restart of PgBouncer").await;
    one.shutdown().await;
    two.shutdown().await;
}

/// The tests above, on one driver.
macro_rules! pgbouncer_tests {
    ($driver:ident) => {
        use super::*;

        test! { a_statement_prepared_on_one_server_connection_is_missing_on_the_next, multi_thread = 2, pgbouncer }
        async fn a_statement_prepared_on_one_server_connection_is_missing_on_the_next() {
            super::a_statement_prepared_on_one_server_connection_is_missing_on_the_next::<$driver>()
                .await;
        }

        test! { the_contract_holds_through_the_pooler, multi_thread = 2, pgbouncer }
        async fn the_contract_holds_through_the_pooler() {
            super::the_contract_holds_through_the_pooler::<$driver>().await;
        }

        test! { two_app_instances_race_duplicates_through_the_pooler, multi_thread = 2, pgbouncer }
        async fn two_app_instances_race_duplicates_through_the_pooler() {
            super::two_app_instances_race_duplicates_through_the_pooler::<$driver>().await;
        }

        test! { steps_outbox_inbox_and_admin_through_the_pooler, multi_thread = 2, pgbouncer }
        async fn steps_outbox_inbox_and_admin_through_the_pooler() {
            super::steps_outbox_inbox_and_admin_through_the_pooler::<$driver>().await;
        }

        test! { an_app_instance_killed_with_sigkill_loses_and_duplicates_nothing, multi_thread = 2, pgbouncer }
        async fn an_app_instance_killed_with_sigkill_loses_and_duplicates_nothing() {
            super::an_app_instance_killed_with_sigkill_loses_and_duplicates_nothing::<$driver>()
                .await;
        }

        test! { a_restart_of_pgbouncer_under_load_loses_and_duplicates_nothing, multi_thread = 2, pgbouncer }
        async fn a_restart_of_pgbouncer_under_load_loses_and_duplicates_nothing() {
            super::a_restart_of_pgbouncer_under_load_loses_and_duplicates_nothing::<$driver>()
                .await;
        }
    };
}

mod tokio_postgres_store {
    //! The tokio-postgres store (`PostgresStore`, deadpool) behind PgBouncer.
    pgbouncer_tests!(TokioPostgres);
}

mod sqlx_store {
    //! The sqlx store (`SqlxPostgresStore`, the app's `PgPool`) behind PgBouncer.
    pgbouncer_tests!(Sqlx);
}
