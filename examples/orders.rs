//! An order service whose `POST /orders` is safe to retry.
//!
//! The client sends an `Idempotency-Key` with each new order. The handler inserts the order
//! through the transaction handle the layer gives it, so the order row and the saved `201`
//! commit together: a retry with the same key gets the same `201` back (marked
//! `Idempotent-Replayed: true`) and never creates a second order.
//!
//! ```text
//! cargo run --example orders                 # serves on 127.0.0.1:3000, database ./orders.db
//! cargo run --example orders -- --demo       # runs the retry lab against itself and exits
//! cargo run --example orders -- --database-url postgres://postgres@127.0.0.1/shop
//! cargo run --example orders -- --webhook http://127.0.0.1:3001/events   # with the relay
//! cargo run --example orders -- --help
//! ```
//!
//! Each new order also enqueues an `order_created` event in the same transaction (the
//! transactional outbox): the order, its saved `201` and its event commit together. With
//! `--webhook URL` a relay runs beside the server and POSTs each event there, with the event id
//! as `Idempotency-Key`, until the receiver accepts it (`examples/inventory.rs` is one).
//!
//! ```text
//! curl -i http://127.0.0.1:3000/orders \
//!     -H 'Authorization: Bearer shop-a-token' \
//!     -H 'Idempotency-Key: key-1' \
//!     -H 'Content-Type: application/json' \
//!     -d '{"sku":"book","quantity":1}'
//! curl -i http://127.0.0.1:3000/orders/1 -H 'Authorization: Bearer shop-a-token'
//! ```
//!
//! Logs go to stderr; set `RUST_LOG` (default `warn`) to see more.

use std::error::Error;
use std::future::IntoFuture;
use std::io::IsTerminal;
use std::path::{Path as FsPath, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, LOCATION};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, Barrier};
use tower_idempotency::body::RequestBody;
use tower_idempotency::extract::Tx;
use tower_idempotency::fingerprint::Fingerprinter;
use tower_idempotency::outbox::sqlite::SqliteOutbox;
use tower_idempotency::outbox::{Enqueue, HttpSink, Relay};
use tower_idempotency::response::IDEMPOTENT_REPLAYED;
use tower_idempotency::store::continuously_purge_expired;
use tower_idempotency::store::sqlite::rusqlite::OptionalExtension;
use tower_idempotency::store::sqlite::{SqliteStore, SqliteTransaction};
use tower_idempotency::{IdempotencyLayer, Tenant, IDEMPOTENCY_KEY};

type BoxError = Box<dyn Error + Send + Sync>;

/// The PostgreSQL variant of the app (`--database-url`).
#[cfg(feature = "postgres")]
#[path = "orders/postgres.rs"]
mod postgres;

const USAGE: &str = "\
usage: orders [--addr ADDR] [--db PATH | --database-url URL] [--webhook URL]
       orders --demo

  --addr ADDR   address to listen on (default 127.0.0.1:3000)
  --db PATH     SQLite database for orders and idempotency records (default ./orders.db)
  --database-url URL
                PostgreSQL instead (postgres://user@host:5432/db): several instances may
                share it
  --webhook URL deliver the outbox's events (`order_created`) to this URL: a relay POSTs
                each one with its event id as `Idempotency-Key` until it is accepted
  --demo        serve on an ephemeral loopback port with a fresh database, run the retry
                lab against it over HTTP, print its six lines and exit
  -h, --help    show this help";

/// The business table. It lives in the same database file as `idempotency_records`, which is
/// what lets an order and its saved response commit in one transaction.
const ORDERS_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS orders (
    id        INTEGER PRIMARY KEY,
    tenant_id TEXT    NOT NULL,
    sku       TEXT    NOT NULL,
    quantity  INTEGER NOT NULL
);";

#[tokio::main]
async fn main() -> ExitCode {
    // Logs on stderr, so that stdout carries only what the program is asked to print.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();

    let command = match Command::parse(std::env::args().skip(1)) {
        Ok(command) => command,
        Err(message) => {
            eprintln!("orders: {message}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let outcome = match command {
        Command::Help => {
            println!("{USAGE}");
            Ok(())
        }
        #[cfg(feature = "postgres")]
        Command::Serve {
            addr,
            database_url: Some(url),
            webhook,
            ..
        } => postgres::serve(&addr, &url, webhook.as_deref()).await,
        #[cfg(not(feature = "postgres"))]
        Command::Serve {
            database_url: Some(_),
            ..
        } => Err("--database-url needs the `postgres` feature".into()),
        Command::Serve {
            addr, db, webhook, ..
        } => serve(&addr, &db, webhook.as_deref()).await,
        Command::Demo => demo().await,
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("orders: {error}");
            ExitCode::FAILURE
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------------------------

enum Command {
    Help,
    Serve {
        addr: String,
        db: PathBuf,
        database_url: Option<String>,
        webhook: Option<String>,
    },
    Demo,
}

impl Command {
    /// Hand-parsed: three flags do not justify an argument-parsing dependency.
    fn parse(mut args: impl Iterator<Item = String>) -> Result<Self, String> {
        let mut addr = None;
        let mut db = None;
        let mut database_url = None;
        let mut webhook = None;
        let mut demo = false;
        while let Some(arg) = args.next() {
            // Accept both `--addr VALUE` and `--addr=VALUE`.
            let (flag, inline) = match arg.split_once('=') {
                Some((flag, value)) if flag.starts_with("--") => (flag, Some(value.to_owned())),
                _ => (arg.as_str(), None),
            };
            let mut value = || {
                inline
                    .clone()
                    .or_else(|| args.next())
                    .ok_or_else(|| format!("{flag} needs a value"))
            };
            match flag {
                "-h" | "--help" => return Ok(Command::Help),
                "--addr" => addr = Some(value()?),
                "--db" => db = Some(PathBuf::from(value()?)),
                "--database-url" => database_url = Some(value()?),
                "--webhook" => webhook = Some(value()?),
                "--demo" if inline.is_none() => demo = true,
                _ => return Err(format!("unknown argument `{arg}`")),
            }
        }
        if db.is_some() && database_url.is_some() {
            return Err("--db and --database-url are two different stores: pick one".into());
        }
        match (
            demo,
            addr.is_some() || db.is_some() || database_url.is_some() || webhook.is_some(),
        ) {
            (true, true) => {
                Err("--demo picks its own address and database, and has no webhook".into())
            }
            (true, false) => Ok(Command::Demo),
            (false, _) => Ok(Command::Serve {
                addr: addr.unwrap_or_else(|| "127.0.0.1:3000".into()),
                db: db.unwrap_or_else(|| "orders.db".into()),
                database_url,
                webhook,
            }),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The app
// ---------------------------------------------------------------------------------------------

/// Opens the store and creates the `orders` and `outbox_events` tables next to the
/// idempotency records.
async fn open_store(db: &FsPath) -> Result<SqliteStore, BoxError> {
    let store = SqliteStore::open(db)
        .await
        .map_err(|error| format!("cannot open {}: {error}", db.display()))?;
    store.write(|tx| tx.execute_batch(ORDERS_SCHEMA)).await?;
    SqliteOutbox::install(&store).await?;
    Ok(store)
}

fn app(store: SqliteStore) -> Router {
    let idempotency = IdempotencyLayer::new(store.clone())
        // Name the operation so that records survive a change of route.
        .with_operation("create_order")
        // The route only takes JSON: compare payloads as JSON values even when a client
        // forgets the Content-Type, so `{"sku":"book", "quantity":1}` sent with different
        // spacing or key order is still the same request.
        .with_fingerprinter(Fingerprinter::json());

    Router::new()
        // Only the POST is wrapped: GET is idempotent by itself.
        .route("/orders", post(create_order).layer(idempotency))
        .route("/orders/{id}", get(get_order))
        // Added last, so it is the outermost layer: it must run before the idempotency layer,
        // which scopes every record by the tenant it finds here.
        .layer(middleware::from_fn(authenticate))
        .with_state(store)
}

/// Demo authentication: a fixed token per tenant. A real app verifies a session or a signed
/// token here; what matters is that the tenant comes from the server, never from a header the
/// client picks freely.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let tenant = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .and_then(|token| match token {
            "shop-a-token" => Some(Tenant::new("shop-a")),
            "shop-b-token" => Some(Tenant::new("shop-b")),
            _ => None,
        });
    match tenant {
        Some(tenant) => {
            request.extensions_mut().insert(tenant);
            next.run(request).await
        }
        None => ApiError::Unauthenticated.into_response(),
    }
}

/// `POST /orders`: runs once per `(tenant, key)`; the layer replays its `201` to retries.
///
/// Every error answer here is a 4xx or 5xx, which the layer does not save: it rolls the
/// transaction back, so the client may retry the same key (with a corrected payload).
async fn create_order(
    Extension(tenant): Extension<Tenant>,
    Tx(tx): Tx<SqliteTransaction>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let order = NewOrder::parse(&body)?;
    let tenant_id = tenant.as_str().to_owned();
    let (sku, quantity) = (order.sku.clone(), order.quantity);
    // Same connection, same transaction as the idempotency record the layer saves after us.
    let order_id = tx
        .run(move |conn| {
            conn.execute(
                "INSERT INTO orders (tenant_id, sku, quantity) VALUES (?1, ?2, ?3)",
                (tenant_id, order.sku, order.quantity),
            )?;
            Ok(conn.last_insert_rowid())
        })
        .await
        .map_err(|error| {
            tracing::error!(%error, "inserting the order failed");
            ApiError::Internal
        })?;
    // Reserving stock is another service's job. Calling it from here could not be undone by a
    // rollback; the event commits with the order instead (or not at all), and the relay
    // delivers it once the order is durable.
    let event = json!({
        "order_id": order_id,
        "tenant": tenant.as_str(),
        "sku": sku,
        "quantity": quantity,
    });
    tx.enqueue("order_created", event).await.map_err(|error| {
        tracing::error!(%error, "enqueueing order_created failed");
        ApiError::Internal
    })?;

    // `Location` and `Content-Type` are saved with the body and replayed to retries.
    let response = (
        StatusCode::CREATED,
        [(LOCATION, format!("/orders/{order_id}"))],
        Json(json!({ "order_id": order_id })),
    );
    Ok(response.into_response())
}

/// `GET /orders/{id}`: the caller's own order. Another tenant's order is answered exactly like
/// a missing one, so ids reveal nothing across tenants.
async fn get_order(
    State(store): State<SqliteStore>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let order_id: i64 = id.parse().map_err(|_| ApiError::NotFound)?;
    let tenant_id = tenant.as_str().to_owned();
    let order = store
        .read(move |conn| {
            conn.query_row(
                "SELECT sku, quantity FROM orders WHERE id = ?1 AND tenant_id = ?2",
                (order_id, tenant_id),
                |row| Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?)),
            )
            .optional()
        })
        .await
        .map_err(|error| {
            tracing::error!(%error, "reading the order failed");
            ApiError::Internal
        })?;
    let (sku, quantity) = order.ok_or(ApiError::NotFound)?;
    Ok(Json(
        json!({ "order_id": order_id, "sku": sku, "quantity": quantity }),
    ))
}

/// A validated order request.
struct NewOrder {
    sku: String,
    quantity: i64,
}

impl NewOrder {
    /// Parsed by hand from a JSON value (rather than with a typed `Json<T>` extractor) so that
    /// every invalid field gets one of the two documented error codes. A body that is not JSON
    /// at all does not get here: the layer's JSON fingerprinter answers it `400 invalid_json`.
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let value: Value = serde_json::from_slice(body).map_err(|_| ApiError::InvalidKeyOrSku)?;
        let sku = value
            .get("sku")
            .and_then(Value::as_str)
            // Counted in characters, not bytes: "書" is one character.
            .filter(|sku| (1..=100).contains(&sku.chars().count()))
            .ok_or(ApiError::InvalidKeyOrSku)?;
        // `as_i64` is `None` for `1.5`, `1.0`, `"1"` and `true`: only JSON integers pass.
        let quantity = value
            .get("quantity")
            .and_then(Value::as_i64)
            .filter(|quantity| (1..=100).contains(quantity))
            .ok_or(ApiError::InvalidQuantity)?;
        Ok(NewOrder {
            sku: sku.to_owned(),
            quantity,
        })
    }
}

/// The app's own error answers, as `{"error":"<code>"}`. (The layer answers its own: a
/// missing key, `409` for a reused key, `413` for a large body, and so on.)
#[derive(Debug)]
enum ApiError {
    Unauthenticated,
    InvalidKeyOrSku,
    InvalidQuantity,
    NotFound,
    Internal,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = match self {
            ApiError::Unauthenticated => (StatusCode::UNAUTHORIZED, "unauthenticated"),
            ApiError::InvalidKeyOrSku => (StatusCode::BAD_REQUEST, "invalid_key_or_sku"),
            ApiError::InvalidQuantity => (StatusCode::BAD_REQUEST, "invalid_quantity"),
            ApiError::NotFound => (StatusCode::NOT_FOUND, "not_found"),
            ApiError::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal_error"),
        };
        (status, Json(json!({ "error": code }))).into_response()
    }
}

// ---------------------------------------------------------------------------------------------
// Serving
// ---------------------------------------------------------------------------------------------

async fn serve(addr: &str, db: &FsPath, webhook: Option<&str>) -> Result<(), BoxError> {
    let store = open_store(db).await?;
    if let Some(url) = webhook {
        let relay = Relay::new(SqliteOutbox::existing(&store), webhook_sink(url)?);
        // Like the purge below: the library never spawns its background work.
        tokio::spawn(relay.run());
    }
    // The library never spawns background work; expired records are purged by this task.
    tokio::spawn(continuously_purge_expired(
        store.clone(),
        Duration::from_secs(60),
        1000,
    ));

    let listener = TcpListener::bind(addr)
        .await
        .map_err(|error| format!("cannot listen on {addr}: {error}"))?;
    let local = listener.local_addr()?;
    println!(
        "listening on http://{local} (database {}); try: curl -i http://{local}/orders \
         -H 'Authorization: Bearer shop-a-token' -H 'Idempotency-Key: key-1' \
         -H 'Content-Type: application/json' -d '{{\"sku\":\"book\",\"quantity\":1}}'",
        db.display()
    );
    // After the first line, which scripts and tests read for the address.
    if let Some(url) = webhook {
        println!("relaying outbox events to {url}");
    }

    axum::serve(listener, app(store))
        .with_graceful_shutdown(ctrl_c())
        .await?;
    Ok(())
}

/// The relay's sink for `--webhook URL`: POSTs each event there, its id as `Idempotency-Key`.
type WebhookSink = HttpSink<Client<HttpConnector, RequestBody>, RequestBody>;

fn webhook_sink(url: &str) -> Result<WebhookSink, BoxError> {
    let uri: axum::http::Uri = url
        .parse()
        .map_err(|error| format!("--webhook {url}: {error}"))?;
    let client = Client::builder(TokioExecutor::new()).build_http::<RequestBody>();
    Ok(HttpSink::new(client, uri))
}

/// Resolves on Ctrl-C. If the handler cannot be installed, never resolves (rather than
/// shutting the server down at once).
async fn ctrl_c() {
    match tokio::signal::ctrl_c().await {
        Ok(()) => eprintln!("shutting down: finishing requests in flight"),
        Err(error) => {
            tracing::error!(%error, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The demo: the article's lab, over real HTTP against the app above
// ---------------------------------------------------------------------------------------------

/// Fails the demo with a message when a condition does not hold.
macro_rules! ensure {
    ($condition:expr, $($message:tt)+) => {
        if !$condition {
            return Err(format!($($message)+).into());
        }
    };
}

async fn demo() -> Result<(), BoxError> {
    let dir = tempfile::tempdir()?;
    let store = open_store(&dir.path().join("orders.db")).await?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let client = DemoClient::new(format!("http://{}", listener.local_addr()?));

    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(
        axum::serve(listener, app(store.clone()))
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .into_future(),
    );

    // A bug that makes a request hang must fail the demo, not hang it.
    let lab = tokio::time::timeout(Duration::from_secs(30), run_lab(&client, &store))
        .await
        .unwrap_or_else(|_| Err("the lab did not finish within 30 s".into()));

    // Close the client's idle connections so the graceful shutdown does not wait for them.
    drop(client);
    let _ = stop.send(());
    server.await??;
    lab.map_err(|error| format!("demo failed: {error}").into())
}

async fn run_lab(client: &DemoClient, store: &SqliteStore) -> Result<(), BoxError> {
    const SHOP_A: &str = "shop-a-token";
    const SHOP_B: &str = "shop-b-token";

    // 1. The first response is lost on the way; the client retries with the same key.
    let first = client.create_order(SHOP_A, "key-1", "book", 1).await?;
    let retry = client.create_order(SHOP_A, "key-1", "book", 1).await?;
    ensure!(
        first.status == StatusCode::CREATED && !first.replayed,
        "first request: expected a fresh 201, got {first:?}"
    );
    ensure!(
        retry.replayed
            && retry.status == first.status
            && retry.body == first.body
            && retry.location == first.location,
        "retry: expected a replay of {first:?}, got {retry:?}"
    );
    let orders = expect_orders(store, 1).await?;
    println!("retry: {} orders={orders}", retry.summary());

    // 2. Same key, different payload: refused, nothing changes.
    let conflict = client.create_order(SHOP_A, "key-1", "book", 2).await?;
    ensure!(
        conflict.status == StatusCode::CONFLICT
            && conflict.body == r#"{"error":"key_reused_with_different_payload"}"#,
        "changed payload: expected 409 key_reused_with_different_payload, got {conflict:?}"
    );
    let orders = expect_orders(store, 1).await?;
    println!("changed payload: {} orders={orders}", conflict.summary());

    // 3. Another tenant may use the same key: it is a different scope.
    let other = client.create_order(SHOP_B, "key-1", "book", 1).await?;
    ensure!(
        other.status == StatusCode::CREATED && !other.replayed && other.body != first.body,
        "other tenant: expected a new 201 order, got {other:?}"
    );
    let orders = expect_orders(store, 2).await?;
    println!("other tenant: {} orders={orders}", other.summary());

    // 4. Two copies of one request in flight at once: exactly one runs the handler, the other
    //    gets its response.
    let barrier = Arc::new(Barrier::new(2));
    let spawn_copy = || {
        let (client, barrier) = (client.clone(), barrier.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            client.create_order(SHOP_A, "key-2", "book", 1).await
        })
    };
    let (a, b) = (spawn_copy(), spawn_copy());
    let (a, b) = (a.await??, b.await??);
    ensure!(
        a.status == StatusCode::CREATED && a.body == b.body && a.location == b.location,
        "concurrent retry: expected the same 201 twice, got {a:?} and {b:?}"
    );
    ensure!(
        a.replayed != b.replayed,
        "concurrent retry: expected exactly one replay, got {a:?} and {b:?}"
    );
    let orders = expect_orders(store, 3).await?;
    println!("concurrent retry: {} orders={orders}", a.summary());

    // 5. Saving the response fails after the handler inserted its order: both roll back.
    store
        .write(|tx| {
            tx.execute_batch(
                "CREATE TRIGGER fail_replay BEFORE INSERT ON idempotency_records \
                 WHEN NEW.idempotency_key = 'key-3' \
                 BEGIN SELECT RAISE(ABORT, 'injected replay failure'); END;",
            )
        })
        .await?;
    let failed = client.create_order(SHOP_A, "key-3", "book", 1).await?;
    ensure!(
        failed.status == StatusCode::INTERNAL_SERVER_ERROR
            && failed.body == r#"{"error":"internal_error"}"#,
        "injected failure: expected 500 internal_error, got {failed:?}"
    );
    let records = store
        .read(|conn| {
            conn.query_row(
                "SELECT count(*) FROM idempotency_records WHERE idempotency_key = 'key-3'",
                [],
                |row| row.get::<_, i64>(0),
            )
        })
        .await?;
    ensure!(
        records == 0,
        "injected failure: expected no saved record for key-3, found {records}"
    );
    let orders = expect_orders(store, 3).await?;
    println!("injected failure: rolled back, orders={orders}");

    // 6. Nothing was kept for key-3, so once the fault is gone the same key runs afresh.
    store
        .write(|tx| tx.execute_batch("DROP TRIGGER fail_replay"))
        .await?;
    let recovered = client.create_order(SHOP_A, "key-3", "book", 1).await?;
    ensure!(
        recovered.status == StatusCode::CREATED && !recovered.replayed,
        "retry after rollback: expected a fresh 201, got {recovered:?}"
    );
    let orders = expect_orders(store, 4).await?;
    println!(
        "retry after rollback: {} orders={orders}",
        recovered.summary()
    );
    Ok(())
}

/// Counts the orders (through the store, as any reader would) and checks the count.
async fn expect_orders(store: &SqliteStore, expected: i64) -> Result<i64, BoxError> {
    let orders = store
        .read(|conn| conn.query_row("SELECT count(*) FROM orders", [], |row| row.get(0)))
        .await?;
    ensure!(
        orders == expected,
        "expected {expected} orders in the database, found {orders}"
    );
    Ok(orders)
}

/// A plain HTTP client: the demo goes through the network stack like any real client.
#[derive(Clone)]
struct DemoClient {
    http: Client<HttpConnector, Full<Bytes>>,
    base: String,
}

/// What the demo looks at in a response.
#[derive(Debug)]
struct Reply {
    status: StatusCode,
    body: String,
    replayed: bool,
    location: Option<HeaderValue>,
}

impl Reply {
    /// `201 {"order_id":1}`, as the lab prints it.
    fn summary(&self) -> String {
        format!("{} {}", self.status.as_u16(), self.body)
    }
}

impl DemoClient {
    fn new(base: String) -> Self {
        DemoClient {
            http: Client::builder(TokioExecutor::new()).build_http(),
            base,
        }
    }

    async fn create_order(
        &self,
        token: &str,
        key: &str,
        sku: &str,
        quantity: i64,
    ) -> Result<Reply, BoxError> {
        let body = json!({ "sku": sku, "quantity": quantity }).to_string();
        let request = axum::http::Request::post(format!("{}/orders", self.base))
            .header(AUTHORIZATION, format!("Bearer {token}"))
            .header(IDEMPOTENCY_KEY, key)
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))?;
        let response = self.http.request(request).await?;
        let status = response.status();
        let replayed = response
            .headers()
            .get(IDEMPOTENT_REPLAYED)
            .is_some_and(|value| value == "true");
        let location = response.headers().get(LOCATION).cloned();
        let body = response.into_body().collect().await?.to_bytes();
        Ok(Reply {
            status,
            body: String::from_utf8(body.to_vec())?,
            replayed,
            location,
        })
    }
}
