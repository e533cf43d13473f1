//! The order API of `examples/orders.rs` on plain hyper 1: no axum, no router crate.
//!
//! The same contract and routes: `POST /orders` (safe to retry with an `Idempotency-Key`) and
//! `GET /orders/{id}`, the same demo authentication, the same table. The point is the wrapping:
//! `IdempotencyLayer` is a tower layer over `http::Request<B>`, so it wraps a
//! `tower::service_fn` handler as well as an axum route. The handler finds the transaction
//! handle with `request.extensions().get::<SqliteHandle>()` and inserts the order through
//! it, so the order row and the saved `201` commit together.
//!
//! ```text
//! cargo run --example hyper_orders                  # serves on 127.0.0.1:3000, database ./orders.db
//! cargo run --example hyper_orders -- --addr 127.0.0.1:3001 --db /tmp/orders.db
//! ```
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
//! It serves the very API of the axum example, so the two may share a database file: a retry
//! sent to either one replays the first answer.
//!
//! Logs go to stderr; set `RUST_LOG` (default `warn`) to see more.

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use bytes::Bytes;
use http::header::{AUTHORIZATION, LOCATION};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde_json::json;
use tower::{Layer, ServiceExt};
use tower_idempotency::body::{BoxError, RequestBody};
use tower_idempotency::fingerprint::Fingerprinter;
use tower_idempotency::store::sqlite::{SqliteHandle, SqliteStore};
use tower_idempotency::{IdempotencyLayer, Tenant};

use cli::{ctrl_c, Flag, Flags};
use json::{full_json, full_json_error, internal_error, json_error, method_not_allowed};
use order_table::{open_store, NewOrder};

/// Logging, flags and exit codes, as every example has them.
#[path = "common/cli.rs"]
mod cli;
/// JSON answers: the handler's and the router's.
#[path = "hyper/json.rs"]
mod json;
/// The `orders` table and the rules of a valid order, shared with the other order examples.
#[path = "common/order_table.rs"]
mod order_table;
/// HTTP/1.1 connections, served until a shutdown signal.
#[path = "hyper/server.rs"]
mod server;

/// Every answer's body: the handler's own, or the layer's (a replay or an error it wrote).
type Body = UnsyncBoxBody<Bytes, Infallible>;

const USAGE: &str = "\
usage: hyper_orders [--addr ADDR] [--db PATH]

  --addr ADDR   address to listen on (default 127.0.0.1:3000)
  --db PATH     SQLite database for orders and idempotency records (default ./orders.db)
  -h, --help    show this help";

#[tokio::main]
async fn main() -> ExitCode {
    let flags = [Flag::Value("--addr"), Flag::Value("--db")];
    let parse = |mut flags: Flags| -> Result<_, String> {
        let addr = flags.value("--addr");
        let db = flags.value("--db").map(PathBuf::from);
        Ok((
            addr.unwrap_or_else(|| "127.0.0.1:3000".into()),
            db.unwrap_or_else(|| "orders.db".into()),
        ))
    };
    let run = |(addr, db): (String, PathBuf)| async move { serve(&addr, &db).await };
    cli::main("hyper_orders", USAGE, &flags, parse, run).await
}

// ---------------------------------------------------------------------------------------------
// The app
// ---------------------------------------------------------------------------------------------

/// The layer around `POST /orders`: the same configuration as the axum example's.
fn idempotency_layer(store: SqliteStore) -> IdempotencyLayer<SqliteStore> {
    IdempotencyLayer::new(store)
        // Name the operation so that records survive a change of route.
        .with_operation("create_order")
        // The route only takes JSON: compare payloads as JSON values even when a client
        // forgets the Content-Type.
        .with_fingerprinter(Fingerprinter::json())
}

/// What every connection shares: the store (for reads) and the configured layer.
#[derive(Clone, Debug)]
struct App {
    store: SqliteStore,
    idempotency: IdempotencyLayer<SqliteStore>,
}

impl App {
    fn new(store: SqliteStore) -> Self {
        App {
            idempotency: idempotency_layer(store.clone()),
            store,
        }
    }
}

/// The router: authentication first (it puts the [`Tenant`] in the extensions, and the layer
/// scopes every record by it), then a match on method and path.
async fn route(app: App, mut request: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let Some(tenant) = authenticate(request.headers()) else {
        return Ok(json_error(StatusCode::UNAUTHORIZED, "unauthenticated"));
    };
    request.extensions_mut().insert(tenant.clone());

    let path = request.uri().path().to_owned();
    let response = match (request.method(), path.as_str()) {
        (&Method::POST, "/orders") => {
            // Wrapping per request is cheap (the layer's store and configuration are `Arc`s)
            // and keeps the handler a plain function, with no boxed service to name.
            let service = app.idempotency.layer(tower::service_fn(create_order));
            match service.oneshot(request).await {
                Ok(response) => response.map(BodyExt::boxed_unsync),
                Err(never) => match never {},
            }
        }
        (_, "/orders") => method_not_allowed("POST"),
        (&Method::GET, path) => match path.strip_prefix("/orders/") {
            Some(id) if !id.contains('/') => get_order(&app.store, &tenant, id).await,
            _ => json_error(StatusCode::NOT_FOUND, "not_found"),
        },
        (_, path) if path.starts_with("/orders/") => method_not_allowed("GET"),
        _ => json_error(StatusCode::NOT_FOUND, "not_found"),
    };
    Ok(response)
}

/// Demo authentication: a fixed token per tenant ([`order_table::tenant_of`]). A real app
/// verifies a session or a signed token here; what matters is that the tenant comes from the
/// server, never from a header the client picks freely.
fn authenticate(headers: &http::HeaderMap) -> Option<Tenant> {
    order_table::tenant_of(headers.get(AUTHORIZATION)?.to_str().ok())
}

/// `POST /orders`, behind the idempotency layer: runs once per `(tenant, key)`; the layer
/// replays its `201` to retries.
///
/// Every error answer here is a 4xx or 5xx, which the layer does not save: it rolls the
/// transaction back, so the client may retry the same key (with a corrected payload).
async fn create_order(request: Request<RequestBody>) -> Result<Response<Full<Bytes>>, Infallible> {
    let tenant = request.extensions().get::<Tenant>().cloned();
    // The handle the layer put in the extensions. Without it (the layer missing) the order is
    // refused rather than written outside the idempotency transaction.
    let tx = request.extensions().get::<SqliteHandle>().cloned();
    let (Some(tenant), Some(tx)) = (tenant, tx) else {
        tracing::error!("POST /orders reached without a tenant or an idempotency transaction");
        return Ok(internal_error());
    };
    // The layer already buffered the body (it fingerprinted it): this cannot fail or wait.
    let Ok(body) = request.into_body().collect().await.map(|b| b.to_bytes()) else {
        return Ok(internal_error());
    };
    let order = match NewOrder::from_json(&body) {
        Ok(order) => order,
        Err(code) => return Ok(full_json_error(StatusCode::BAD_REQUEST, code)),
    };
    let tenant_id = tenant.as_str().to_owned();
    // Same connection, same transaction as the idempotency record the layer saves after us.
    let inserted = tx
        .run(move |conn| order_table::insert(conn, &tenant_id, &order))
        .await;
    let order_id = match inserted {
        Ok(order_id) => order_id,
        Err(error) => {
            tracing::error!(%error, "inserting the order failed");
            return Ok(internal_error());
        }
    };

    // `Location` and `Content-Type` are saved with the body and replayed to retries.
    let mut response = full_json(StatusCode::CREATED, &json!({ "order_id": order_id }));
    if let Ok(location) = HeaderValue::from_str(&format!("/orders/{order_id}")) {
        response.headers_mut().insert(LOCATION, location);
    }
    Ok(response)
}

/// `GET /orders/{id}`: the caller's own order. Another tenant's order is answered exactly like
/// a missing one, so ids reveal nothing across tenants.
async fn get_order(store: &SqliteStore, tenant: &Tenant, id: &str) -> Response<Body> {
    let Ok(order_id) = id.parse::<i64>() else {
        return json_error(StatusCode::NOT_FOUND, "not_found");
    };
    let order = order_table::find(store, tenant.as_str(), order_id).await;
    match order {
        Ok(Some((sku, quantity))) => full_json(
            StatusCode::OK,
            &json!({ "order_id": order_id, "sku": sku, "quantity": quantity }),
        )
        .map(BodyExt::boxed_unsync),
        Ok(None) => json_error(StatusCode::NOT_FOUND, "not_found"),
        Err(error) => {
            tracing::error!(%error, "reading the order failed");
            json_error(StatusCode::INTERNAL_SERVER_ERROR, "internal_error")
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Serving
// ---------------------------------------------------------------------------------------------

async fn serve(addr: &str, db: &Path) -> Result<(), BoxError> {
    let store = open_store(db).await?;
    // The library never spawns background work; expired records are purged by this task.
    order_table::spawn_purge(&store);
    let (listener, local) = cli::listen(addr).await?;
    println!("{}", order_table::banner(local, db));
    let app = App::new(store);
    let service = move |request| route(app.clone(), request);
    server::serve_http1(listener, service, ctrl_c()).await;
    Ok(())
}
