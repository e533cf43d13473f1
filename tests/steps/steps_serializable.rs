//! The steps mode on PostgreSQL at `SERIALIZABLE` under load (the tokio-postgres store and the
//! sqlx store): a handler whose two local steps each read a hot row and write it back
//! incremented (read-then-write, which SERIALIZABLE aborts with `40001` across concurrent
//! requests), with a foreign step between them to a provider that counts its calls per step
//! key (and would answer a second call with the same key, `CallAgain`). 64 clients, every key
//! sent twice at once, each client retrying a `503` with the same key.
//!
//! A local step's transaction thrown away saves nothing; the layer runs the handler again
//! under the same claim, and the foreign step's saved result comes back without a call. So:
//! one provider call per key, one order per key, each hot row incremented once per key, local
//! steps run more often than that (the retries happened), every answer a `201` or a `503` with
//! `Retry-After`, never a `500`.
//!
//! Needs `TEST_DATABASE_URL`; without it `cargo test` reports these tests as ignored.

use support::pg_common;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use pg_common::hot_row::{
    check_one_order_per_key, send_every_key_twice, Load, HOT_TABLE, WRITE_HOT,
};
use pg_common::TestDb;
use serde_json::{json, Value};
use tower_idempotency::steps::{CallAgain, StepError, StepStore, Steps};
use tower_idempotency::store::Isolation;
use tower_idempotency::{IdempotencyLayer, Tenant};

/// Transaction connections of each store.
const CONNECTIONS: u32 = 24;
/// Conflict retries of the layer (runs of the handler again after a local step's conflict).
const RETRIES: u32 = 5;

/// A PostgreSQL store at `SERIALIZABLE` and its local step: read hot row `row`, write it back
/// incremented, and (for the first) insert the order; returns the order id (or 0).
trait HotSteps: Send + Sync + 'static {
    type Store: StepStore + Clone + Send + Sync + 'static;

    /// The store on `db`'s schema at `SERIALIZABLE`, with the steps' tables.
    fn store(db: &TestDb) -> impl Future<Output = Self::Store> + Send;

    fn increment(
        steps: &Steps<Self::Store>,
        name: &'static str,
        row: i32,
        insert_order: bool,
        runs: Arc<AtomicUsize>,
    ) -> impl Future<Output = Result<i64, StepError>> + Send;
}

const READ: &str = "SELECT n FROM hot WHERE id = $1";
const INSERT_ORDER: &str =
    "INSERT INTO orders (tenant_id, sku, quantity) VALUES ('shop-a', 'book', 1) RETURNING id";

struct TokioPg;

impl HotSteps for TokioPg {
    type Store = tower_idempotency::store::tokio_postgres::PostgresStore;

    async fn store(db: &TestDb) -> Self::Store {
        let store = db
            .store_with(|options| {
                options
                    .with_isolation(Isolation::Serializable)
                    .with_max_connections(CONNECTIONS as usize)
                    .with_max_read_connections(4)
            })
            .await;
        store.install_steps().await.expect("install the steps");
        store
    }

    async fn increment(
        steps: &Steps<Self::Store>,
        name: &'static str,
        row: i32,
        insert_order: bool,
        runs: Arc<AtomicUsize>,
    ) -> Result<i64, StepError> {
        use tower_idempotency::store::tokio_postgres::PostgresHandle;
        steps
            .local(name, move |tx: PostgresHandle| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let client = tx.client().await?;
                let n: i64 = client.query_one(READ, &[&row]).await?.try_get(0)?;
                client.execute(WRITE_HOT, &[&(n + 1), &row]).await?;
                if !insert_order {
                    return Ok(0);
                }
                Ok(client.query_one(INSERT_ORDER, &[]).await?.try_get(0)?)
            })
            .await
    }
}

struct SqlxPg;

impl HotSteps for SqlxPg {
    type Store = tower_idempotency::store::sqlx_postgres::SqlxPostgresStore;

    async fn store(db: &TestDb) -> Self::Store {
        let store = Self::Store::builder(db.sqlx_pool(CONNECTIONS).await)
            .with_max_read_connections(4)
            .with_isolation(Isolation::Serializable)
            .build();
        store.migrate().await.expect("create the table");
        store.install_steps().await.expect("install the steps");
        store
    }

    async fn increment(
        steps: &Steps<Self::Store>,
        name: &'static str,
        row: i32,
        insert_order: bool,
        runs: Arc<AtomicUsize>,
    ) -> Result<i64, StepError> {
        use tower_idempotency::store::sqlx_postgres::{sqlx, SqlxPostgresHandle};
        steps
            .local(name, move |tx: SqlxPostgresHandle| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let mut conn = tx.acquire().await?;
                let n: i64 = sqlx::query_scalar(READ)
                    .bind(row)
                    .fetch_one(&mut *conn)
                    .await?;
                sqlx::query(WRITE_HOT)
                    .bind(n + 1)
                    .bind(row)
                    .execute(&mut *conn)
                    .await?;
                if !insert_order {
                    return Ok(0);
                }
                Ok(sqlx::query_scalar(INSERT_ORDER)
                    .fetch_one(&mut *conn)
                    .await?)
            })
            .await
    }
}

#[derive(Clone, Default)]
struct App {
    /// The provider's calls, by step key.
    calls: Arc<Mutex<HashMap<String, usize>>>,
    /// Runs of the local steps' closures.
    local_runs: Arc<AtomicUsize>,
    /// Runs of the handler.
    handler_runs: Arc<AtomicUsize>,
}

/// The order: a local step on hot row 1 (with the order's row), the provider's charge, a local
/// step on hot row 2. A step's error is the handler's (a `500`, unless the layer answers for
/// it).
async fn checkout<H: HotSteps>(
    State(app): State<App>,
    steps: Steps<H::Store>,
) -> Result<(StatusCode, Json<Value>), StepError> {
    app.handler_runs.fetch_add(1, Ordering::SeqCst);
    let order_id = H::increment(&steps, "reserve", 1, true, app.local_runs.clone()).await?;
    let calls = app.calls.clone();
    let charge: String = steps
        .foreign("charge", CallAgain, |key| async move {
            *calls.lock().unwrap().entry(key.clone()).or_default() += 1;
            Ok(format!("ch_{key}"))
        })
        .await?;
    H::increment(&steps, "mark_paid", 2, false, app.local_runs.clone()).await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({"order_id": order_id, "charge_id": charge})),
    ))
}

async fn local_steps_conflicting_at_serializable_run_again_and_the_call_is_made_once<
    H: HotSteps,
>() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    db.execute(HOT_TABLE).await;
    let store = H::store(&db).await;
    let layer = IdempotencyLayer::new(store)
        .with_operation("checkout")
        .with_lock_timeout(Duration::from_secs(3))
        .with_conflict_retries(RETRIES)
        .with_steps();
    let app = App::default();
    let router = Router::new()
        .route("/orders", post(checkout::<H>).layer(layer))
        .layer(axum::Extension(Tenant::new("shop-a")))
        .with_state(app.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });

    let load = Load::default();
    let answers = send_every_key_twice(addr, "hot", load).await;
    check_one_order_per_key(&db, &answers, load.keys).await;
    for (row, what) in [
        (1, "one increment per order"),
        (2, "one increment after each charge"),
    ] {
        let n: i64 = db.value("SELECT n FROM hot WHERE id = $1", &[&row]).await;
        assert_eq!(n, load.keys as i64, "{what}");
    }
    let calls = app.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), load.keys, "one charge per key");
    let again: Vec<_> = calls.iter().filter(|(_, &n)| n != 1).collect();
    assert!(
        again.is_empty(),
        "step keys called more than once: {again:?}"
    );
    let (local, handler) = (
        app.local_runs.load(Ordering::SeqCst),
        app.handler_runs.load(Ordering::SeqCst),
    );
    assert!(
        local > 2 * load.keys,
        "the local steps conflicted and ran again ({local} runs for {} keys)",
        load.keys
    );
    // Each request sent runs the handler at most once unless the layer runs it again.
    let sent = 2 * load.keys + answers.busy;
    assert!(
        handler > sent,
        "the layer ran handlers again ({handler} runs for {sent} requests)"
    );
    eprintln!(
        "steps at serializable: {} keys x2 at {} clients in {:?}: {local} local step runs, \
         {handler} handler runs, {} answers 503 (at most {} to one client)",
        load.keys, load.clients, answers.took, answers.busy, answers.most_busy
    );
}

macro_rules! steps_serializable_tests {
    ($($name:ident: $store:ty,)*) => {$(
        test! { $name, postgres }
        async fn $name() {
            local_steps_conflicting_at_serializable_run_again_and_the_call_is_made_once::<$store>()
                .await;
        }
    )*};
}

steps_serializable_tests! {
    local_steps_conflicting_at_serializable_run_again_and_the_call_is_made_once_on_tokio_postgres: TokioPg,
    local_steps_conflicting_at_serializable_run_again_and_the_call_is_made_once_on_sqlx: SqlxPg,
}
