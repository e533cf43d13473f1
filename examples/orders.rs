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
//! `--webhook URL` a relay runs beside the server and POSTs each event there as
//! `{"id": event id, "topic": "order_created", "payload": {...}}` (the id also as
//! `Idempotency-Key`), until the receiver accepts it (`examples/inventory.rs` is one).
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

use std::future::IntoFuture;
use std::path::{Path as FsPath, PathBuf};
use std::process::ExitCode;

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::header::{AUTHORIZATION, LOCATION};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tower_idempotency::body::{BoxError, RequestBody};
use tower_idempotency::extract::Tx;
use tower_idempotency::fingerprint::Fingerprinter;
use tower_idempotency::outbox::sqlite::SqliteOutbox;
use tower_idempotency::outbox::{Enqueue, HttpSink, Relay};
use tower_idempotency::store::sqlite::{SqliteStore, SqliteTransaction};
use tower_idempotency::{IdempotencyLayer, Tenant};

use cli::{ctrl_c, Flag, Flags};
use order_table::NewOrder;

/// Logging, flags and exit codes, as every example has them.
#[path = "common/cli.rs"]
mod cli;
/// The `--demo`: the retry lab, and its HTTP client.
#[path = "common/lab.rs"]
mod lab;
#[path = "common/lab_http.rs"]
mod lab_http;
/// `GET /metrics` in the Prometheus text format.
#[path = "orders/metrics.rs"]
mod metrics;
/// `GET /openapi.json`, the API's OpenAPI document.
#[path = "orders/openapi.rs"]
mod openapi;
/// The `orders` table and the rules of a valid order, shared with the other order examples.
#[path = "common/order_table.rs"]
mod order_table;
/// The PostgreSQL variant of the app (`--database-url`).
#[cfg(feature = "postgres")]
#[path = "orders/postgres.rs"]
mod postgres;

const USAGE: &str = "\
usage: orders [--addr ADDR] [--db PATH | --database-url URL] [--webhook URL] [--ietf]
       orders --demo

  --addr ADDR   address to listen on (default 127.0.0.1:3000)
  --db PATH     SQLite database for orders and idempotency records (default ./orders.db)
  --database-url URL
                PostgreSQL instead (postgres://user@host:5432/db): several instances may
                share it
  --webhook URL deliver the outbox's events (`order_created`) to this URL: a relay POSTs
                each one with its event id as `Idempotency-Key` until it is accepted
  --ietf        answer the IETF draft's way: problem+json bodies, 422 for a reused key,
                409 with Retry-After at once for a duplicate still running
  --demo        serve on an ephemeral loopback port with a fresh database, run the retry
                lab against it over HTTP, print its six lines and exit
  -h, --help    show this help";

#[tokio::main]
async fn main() -> ExitCode {
    let flags = [
        Flag::Value("--addr"),
        Flag::Value("--db"),
        Flag::Value("--database-url"),
        Flag::Value("--webhook"),
        Flag::Switch("--ietf"),
        Flag::Switch("--demo"),
    ];
    cli::main("orders", USAGE, &flags, Command::parse, Command::run).await
}

// ---------------------------------------------------------------------------------------------
// The app
// ---------------------------------------------------------------------------------------------

/// Opens the store and creates the `orders` and `outbox_events` tables next to the
/// idempotency records.
async fn open_store(db: &FsPath) -> Result<SqliteStore, BoxError> {
    let store = order_table::open_store(db).await?;
    SqliteOutbox::install(&store).await?;
    Ok(store)
}

fn app(store: SqliteStore, ietf: bool) -> Router {
    Router::new()
        // Only the POST is wrapped: GET is idempotent by itself.
        .route(
            "/orders",
            post(create_order).layer(idempotency(store.clone(), ietf)),
        )
        .route("/orders/{id}", get(get_order))
        // Added last, so it is the outermost layer: it must run before the idempotency layer,
        // which scopes every record by the tenant it finds here.
        .layer(middleware::from_fn(authenticate))
        .with_state(store)
}

/// The idempotency layer of `POST /orders` (on either database); with `ietf`, its own
/// answers as the IETF draft shows them (`--ietf`).
fn idempotency<S>(store: S, ietf: bool) -> IdempotencyLayer<S> {
    let layer = IdempotencyLayer::new(store);
    let layer = if ietf { layer.with_ietf_draft() } else { layer };
    layer
        // Name the operation so that records survive a change of route.
        .with_operation("create_order")
        // The route only takes JSON: compare payloads as JSON values even when a client
        // forgets the Content-Type, so `{"sku":"book", "quantity":1}` sent with different
        // spacing or key order is still the same request.
        .with_fingerprinter(Fingerprinter::json())
}

/// Demo authentication: a fixed token per tenant ([`order_table::tenant_of`]). A real app
/// verifies a session or a signed token here; what matters is that the tenant comes from the
/// server, never from a header the client picks freely.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let authorization = request.headers().get(AUTHORIZATION);
    match order_table::tenant_of(authorization.and_then(|value| value.to_str().ok())) {
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
    let order = NewOrder::from_json(&body).map_err(ApiError::Invalid)?;
    // Same connection, same transaction as the idempotency record the layer saves after us.
    let (tenant_id, row) = (tenant.as_str().to_owned(), order.clone());
    let order_id = tx
        .run(move |conn| order_table::insert(conn, &tenant_id, &row))
        .await
        .map_err(|error| {
            tracing::error!(%error, "inserting the order failed");
            ApiError::Internal
        })?;
    // Reserving stock is another service's job. Calling it from here could not be undone by a
    // rollback; the event commits with the order instead (or not at all), and the relay
    // delivers it once the order is durable.
    let event = order_created(order_id, &tenant, &order);
    tx.enqueue("order_created", event).await.map_err(|error| {
        tracing::error!(%error, "enqueueing order_created failed");
        ApiError::Internal
    })?;
    Ok(created(order_id))
}

/// The `order_created` event of a new order: what the inventory needs to reserve its stock.
fn order_created(order_id: i64, tenant: &Tenant, order: &NewOrder) -> Value {
    json!({
        "order_id": order_id,
        "tenant": tenant.as_str(),
        "sku": order.sku,
        "quantity": order.quantity,
    })
}

/// `201` with the new order's id and `Location`: both are saved with the body (and its
/// `Content-Type`) and replayed to retries.
fn created(order_id: i64) -> Response {
    let response = (
        StatusCode::CREATED,
        [(LOCATION, format!("/orders/{order_id}"))],
        Json(json!({ "order_id": order_id })),
    );
    response.into_response()
}

/// `GET /orders/{id}`: the caller's own order. Another tenant's order is answered exactly like
/// a missing one, so ids reveal nothing across tenants.
async fn get_order(
    State(store): State<SqliteStore>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let order_id: i64 = id.parse().map_err(|_| ApiError::NotFound)?;
    let order = order_table::find(&store, tenant.as_str(), order_id)
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

/// The app's own error answers, as `{"error":"<code>"}`. (The layer answers its own: a
/// missing key, `409` for a reused key, `413` for a large body, and so on.)
#[derive(Debug)]
enum ApiError {
    Unauthenticated,
    /// `400` with the code of the invalid field (`invalid_key_or_sku`, `invalid_quantity`).
    Invalid(&'static str),
    NotFound,
    Internal,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = match self {
            ApiError::Unauthenticated => (StatusCode::UNAUTHORIZED, "unauthenticated"),
            ApiError::Invalid(code) => (StatusCode::BAD_REQUEST, code),
            ApiError::NotFound => (StatusCode::NOT_FOUND, "not_found"),
            ApiError::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal_error"),
        };
        (status, Json(json!({ "error": code }))).into_response()
    }
}

// ---------------------------------------------------------------------------------------------
// Serving
// ---------------------------------------------------------------------------------------------

async fn serve(addr: &str, db: &FsPath, webhook: Option<&str>, ietf: bool) -> Result<(), BoxError> {
    let store = open_store(db).await?;
    if let Some(url) = webhook {
        let relay = Relay::new(SqliteOutbox::existing(&store), webhook_sink(url)?);
        // Like the purge below: the library never spawns its background work.
        tokio::spawn(relay.run());
    }
    // The library never spawns background work; expired records are purged by this task.
    order_table::spawn_purge(&store);
    let (listener, local) = cli::listen(addr).await?;
    println!("{}", order_table::banner(local, db));
    serve_app(listener, app(store, ietf), webhook, ietf).await
}

/// Serves `app`, `GET /metrics` and `GET /openapi.json` on `listener` until Ctrl-C. Says where
/// the relay delivers (`--webhook`) after the first line, which scripts and tests read for the
/// address.
async fn serve_app(
    listener: TcpListener,
    app: Router,
    webhook: Option<&str>,
    ietf: bool,
) -> Result<(), BoxError> {
    let app = app
        .merge(metrics::routes(metrics::install()?))
        // Documented from a layer configured as the route's (its store plays no part).
        .merge(openapi::routes(&idempotency((), ietf))?);
    if let Some(url) = webhook {
        println!("relaying outbox events to {url}");
    }
    axum::serve(listener, app)
        .with_graceful_shutdown(ctrl_c())
        .await?;
    Ok(())
}

/// The relay's sink for `--webhook URL`: POSTs each event there, its id in the body (the
/// envelope) and as `Idempotency-Key`.
type WebhookSink = HttpSink<Client<HttpConnector, RequestBody>, RequestBody>;

fn webhook_sink(url: &str) -> Result<WebhookSink, BoxError> {
    let uri: axum::http::Uri = url
        .parse()
        .map_err(|error| format!("--webhook {url}: {error}"))?;
    let client = Client::builder(TokioExecutor::new()).build_http::<RequestBody>();
    Ok(HttpSink::new(client, uri).with_event_envelope())
}

/// The demo: the article's retry lab, over real HTTP against the app above.
async fn demo() -> Result<(), BoxError> {
    let dir = tempfile::tempdir()?;
    let store = open_store(&dir.path().join("orders.db")).await?;
    let (listener, addr) = cli::listen("127.0.0.1:0").await?;
    let client = lab_http::HttpShop::new(addr);
    let router = app(store.clone(), false);
    let serve = move |shutdown: lab::Shutdown| {
        axum::serve(listener, router)
            .with_graceful_shutdown(shutdown)
            .into_future()
    };
    lab::demo(store, serve, async { Ok(client) }).await
}

// ---------------------------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------------------------

enum Command {
    Serve {
        addr: String,
        db: PathBuf,
        database_url: Option<String>,
        webhook: Option<String>,
        ietf: bool,
    },
    Demo,
}

impl Command {
    fn parse(mut flags: Flags) -> Result<Self, String> {
        let addr = flags.value("--addr");
        let db = flags.value("--db").map(PathBuf::from);
        let database_url = flags.value("--database-url");
        let webhook = flags.value("--webhook");
        let ietf = flags.switch("--ietf");
        if db.is_some() && database_url.is_some() {
            return Err("--db and --database-url are two different stores: pick one".into());
        }
        match (
            flags.switch("--demo"),
            addr.is_some() || db.is_some() || database_url.is_some() || webhook.is_some() || ietf,
        ) {
            (true, true) => {
                Err("--demo picks its own address and database, and has no options".into())
            }
            (true, false) => Ok(Command::Demo),
            (false, _) => Ok(Command::Serve {
                addr: addr.unwrap_or_else(|| "127.0.0.1:3000".into()),
                db: db.unwrap_or_else(|| "orders.db".into()),
                database_url,
                webhook,
                ietf,
            }),
        }
    }

    async fn run(self) -> Result<(), BoxError> {
        match self {
            #[cfg(feature = "postgres")]
            Command::Serve {
                addr,
                database_url: Some(url),
                webhook,
                ietf,
                ..
            } => postgres::serve(&addr, &url, webhook.as_deref(), ietf).await,
            #[cfg(not(feature = "postgres"))]
            Command::Serve {
                database_url: Some(_),
                ..
            } => Err("--database-url needs the `postgres` feature".into()),
            Command::Serve {
                addr,
                db,
                webhook,
                ietf,
                ..
            } => serve(&addr, &db, webhook.as_deref(), ietf).await,
            Command::Demo => demo().await,
        }
    }
}
