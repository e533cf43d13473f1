//! Throughput of the order route behind `IdempotencyLayer`, SQLite store vs PostgreSQL store,
//! in the same run: new keys (the handler of `examples/orders.rs` runs: the order and its
//! `order_created` outbox event, committed with the record) and replays (a completed key: the
//! fast path), at concurrency 1, 16 and 64.
//!
//! ```text
//! cargo run --release --example bench_stores -- --database-url postgres://postgres@127.0.0.1:5432/test
//! ```
//!
//! Requests go straight into the axum router (`tower::ServiceExt::oneshot`), not over
//! sockets, so the figures are the layer and the store rather than the HTTP stack. Both
//! stores are durable: SQLite in WAL with `synchronous=FULL`, PostgreSQL with its server's
//! `synchronous_commit`. The PostgreSQL tables go in a schema of their own, dropped at the end.
//! Each cell is the median of `--rounds` runs (default 3) of `--seconds` each (default 1), the
//! rounds of the two stores interleaved, so that a stall of a busy machine (a slow fsync)
//! does not decide a figure on its own.

use std::error::Error;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use serde_json::{json, Value};
use tower::ServiceExt;
use tower_idempotency::extract::Tx;
type PostgresOutbox =
    tower_idempotency::outbox::Outbox<tower_idempotency::store::tokio_postgres::PostgresStore>;
type SqliteOutbox =
    tower_idempotency::outbox::Outbox<tower_idempotency::store::sqlite::SqliteStore>;
use tower_idempotency::outbox::Enqueue;
use tower_idempotency::store::sqlite::{SqliteHandle, SqliteStore};
use tower_idempotency::store::tokio_postgres::tokio_postgres::{self, NoTls};
use tower_idempotency::store::tokio_postgres::{PostgresHandle, PostgresStore};
use tower_idempotency::store::IdempotencyStore;
use tower_idempotency::{IdempotencyLayer, Tenant};

type BoxError = Box<dyn Error + Send + Sync>;

const CONCURRENCY: [usize; 3] = [1, 16, 64];
const BODY: &str = r#"{"sku":"book","quantity":1}"#;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut url = std::env::var("TEST_DATABASE_URL").ok();
    let mut seconds = 1.0_f64;
    let mut rounds = 3_usize;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--database-url" => url = args.next(),
            "--seconds" => seconds = args.next().ok_or("--seconds N")?.parse()?,
            "--rounds" => rounds = args.next().ok_or("--rounds N")?.parse::<usize>()?.max(1),
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let url = url.ok_or("pass --database-url postgres://... (or set TEST_DATABASE_URL)")?;
    let cell = Duration::from_secs_f64(seconds);

    let dir = tempfile::tempdir()?;
    let sqlite = SqliteStore::open(dir.path().join("bench.db")).await?;
    sqlite
        .write(|tx| {
            tx.execute_batch(
                "CREATE TABLE orders (id INTEGER PRIMARY KEY, tenant_id TEXT NOT NULL, \
                 sku TEXT NOT NULL, quantity INTEGER NOT NULL)",
            )
        })
        .await?;
    SqliteOutbox::install(&sqlite).await?;
    let sqlite_app = app::<SqliteHandle>(sqlite);

    let schema = format!("bench_{}", std::process::id());
    let admin = connect(&url).await?;
    admin
        .batch_execute(&format!("CREATE SCHEMA {schema}"))
        .await?;
    let mut config: tokio_postgres::Config = url.parse()?;
    config.options(format!("-c search_path={schema}"));
    // More transaction connections than the default 16 (the server allows 100 in all).
    let postgres = PostgresStore::builder(config)
        .with_max_connections(32)
        .build()
        .await?;
    postgres
        .client()
        .await?
        .batch_execute(
            "CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, tenant_id TEXT NOT NULL, \
         sku TEXT NOT NULL, quantity BIGINT NOT NULL)",
        )
        .await?;
    PostgresOutbox::install(&postgres).await?;
    let postgres_app = app::<PostgresHandle>(postgres);

    println!(
        "requests/s, median of {rounds} rounds of {seconds} s, {} cores",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!("| workload | concurrency | SQLite | PostgreSQL |");
    println!("|---|---:|---:|---:|");
    let outcome = async {
        for (workload, replay) in [("new keys", false), ("replays", true)] {
            for concurrency in CONCURRENCY {
                let (mut sqlite, mut postgres) = (Vec::new(), Vec::new());
                for _ in 0..rounds {
                    sqlite.push(measure(&sqlite_app, "sqlite", replay, concurrency, cell).await?);
                    postgres.push(measure(&postgres_app, "pg", replay, concurrency, cell).await?);
                }
                let (sqlite, postgres) = (median(sqlite), median(postgres));
                println!("| {workload} | {concurrency} | {sqlite:.0} | {postgres:.0} |");
            }
        }
        Ok::<(), BoxError>(())
    }
    .await;
    admin
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await?;
    outcome
}

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

async fn connect(url: &str) -> Result<tokio_postgres::Client, BoxError> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(connection);
    Ok(client)
}

/// `POST /orders` on `store`, whose request transactions are `T`s. A long lock timeout: a
/// benchmark measures waits, it does not turn them into `503`s (a busy machine can stall a
/// commit for seconds).
fn app<T: InsertOrder>(store: impl IdempotencyStore) -> Router {
    let layer = IdempotencyLayer::new(store)
        .with_operation("create_order")
        .with_lock_timeout(Duration::from_secs(60));
    Router::new().route("/orders", post(create_order::<T>).layer(layer))
}

/// Runs `concurrency` workers against `app` for `duration`; returns completed requests per
/// second. Replays first save one key per worker, then repeat those keys.
async fn measure(
    app: &Router,
    store: &str,
    replay: bool,
    concurrency: usize,
    duration: Duration,
) -> Result<f64, BoxError> {
    static RUN: AtomicU64 = AtomicU64::new(0);
    let run = RUN.fetch_add(1, Ordering::Relaxed);
    if replay {
        for worker in 0..concurrency {
            let key = format!("{store}-{run}-replay-{worker}");
            call(app, &key).await?;
        }
    }
    let done = Arc::new(AtomicUsize::new(0));
    let sequence = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + duration;
    let workers: Vec<_> = (0..concurrency)
        .map(|worker| {
            let (app, done, sequence) = (app.clone(), done.clone(), sequence.clone());
            let store = store.to_owned();
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    let key = if replay {
                        format!("{store}-{run}-replay-{worker}")
                    } else {
                        let n = sequence.fetch_add(1, Ordering::Relaxed);
                        format!("{store}-{run}-new-{n}")
                    };
                    call(&app, &key).await?;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<(), BoxError>(())
            })
        })
        .collect();
    for worker in workers {
        worker.await??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

async fn call(app: &Router, key: &str) -> Result<(), BoxError> {
    let mut request = Request::post("/orders")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(BODY))?;
    request.extensions_mut().insert(Tenant::new("bench"));
    let response = app.clone().oneshot(request).await?;
    if response.status() != StatusCode::CREATED {
        return Err(format!("{key}: {}", response.status()).into());
    }
    Ok(())
}

/// `POST /orders` on either store: the order, then its `order_created` event, in the request's
/// transaction (as `examples/orders.rs` and `examples/orders/postgres.rs`).
async fn create_order<T: InsertOrder>(
    Extension(tenant): Extension<Tenant>,
    Tx(tx): Tx<T>,
    body: Bytes,
) -> Response {
    let Some((sku, quantity)) = parse_order(&body) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let created = async {
        let order_id = tx.insert_order(&tenant, &sku, quantity).await?;
        tx.enqueue("order_created", event(order_id, &tenant, &sku, quantity))
            .await?;
        Ok::<i64, tower_idempotency::Error>(order_id)
    };
    created_response(created.await.ok())
}

/// The order row, in the request's transaction on either store.
trait InsertOrder: Enqueue + Clone + Send + Sync + 'static {
    /// Inserts the order; returns its id.
    fn insert_order(
        &self,
        tenant: &Tenant,
        sku: &str,
        quantity: i64,
    ) -> impl Future<Output = DbResult<i64>> + Send;
}

impl InsertOrder for SqliteHandle {
    async fn insert_order(&self, tenant: &Tenant, sku: &str, quantity: i64) -> DbResult<i64> {
        let (tenant_id, sku) = (tenant.as_str().to_owned(), sku.to_owned());
        self.run(move |conn| {
            conn.execute(
                "INSERT INTO orders (tenant_id, sku, quantity) VALUES (?1, ?2, ?3)",
                (tenant_id, sku, quantity),
            )?;
            Ok(conn.last_insert_rowid())
        })
        .await
    }
}

impl InsertOrder for PostgresHandle {
    async fn insert_order(&self, tenant: &Tenant, sku: &str, quantity: i64) -> DbResult<i64> {
        // Dropped before the event is enqueued: the handle lends one borrow at a time.
        let client = self.client().await?;
        let statement =
            "INSERT INTO orders (tenant_id, sku, quantity) VALUES ($1, $2, $3) RETURNING id";
        let insert = client.prepare_cached(statement).await?;
        let row = client
            .query_one(&insert, &[&tenant.as_str(), &sku, &quantity])
            .await?;
        Ok(row.try_get(0)?)
    }
}

type DbResult<T> = Result<T, tower_idempotency::Error>;

/// The order's SKU and quantity, if the body is an order.
fn parse_order(body: &[u8]) -> Option<(String, i64)> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let sku = value.get("sku")?.as_str()?.to_owned();
    let quantity = value.get("quantity")?.as_i64()?;
    Some((sku, quantity))
}

/// The `order_created` event, as the orders example writes it.
fn event(order_id: i64, tenant: &Tenant, sku: &str, quantity: i64) -> Value {
    json!({
        "order_id": order_id,
        "tenant": tenant.as_str(),
        "sku": sku,
        "quantity": quantity,
    })
}

fn created_response(order_id: Option<i64>) -> Response {
    match order_id {
        Some(id) => (StatusCode::CREATED, format!("{{\"order_id\":{id}}}")).into_response(),
        None => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}
