//! The order app: `POST /orders` behind the idempotency layer, `GET /orders/{id}`, the demo
//! authentication in front of both, and the SQLite side. Served by `examples/orders.rs` (on
//! PostgreSQL too, with `orders/postgres.rs`), by `examples/client.rs` behind its lossy proxy,
//! and by the tests (`tests/client/`, which change its layer's settings). Declared with
//! `#[path = "orders/app.rs"] mod app;`.

use std::future::Future;
use std::path::Path as FsPath;

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::header::{AUTHORIZATION, LOCATION};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde_json::{json, Value};
use tower_idempotency::body::BoxError;
use tower_idempotency::extract::Tx;
use tower_idempotency::fingerprint::Fingerprinter;
type SqliteOutbox =
    tower_idempotency::outbox::Outbox<tower_idempotency::store::sqlite::SqliteStore>;
use tower_idempotency::outbox::Enqueue;
use tower_idempotency::store::sqlite::{SqliteHandle, SqliteStore};
use tower_idempotency::store::IdempotencyStore;
use tower_idempotency::{IdempotencyLayer, Tenant};

use order_table::NewOrder;

/// The `orders` table and the rules of a valid order, shared with the other order examples.
#[path = "../common/order_table.rs"]
pub mod order_table;

/// What the handlers need from the database the orders live in: it is the idempotency store
/// too, so that an order and its saved `201` commit in one transaction. SQLite below,
/// PostgreSQL in `orders/postgres.rs`.
pub trait OrderDatabase: IdempotencyStore {
    /// The request's transaction, which the layer hands the handler (`Tx<...>`).
    type Handle: OrderHandle;

    /// `(sku, quantity)` of the order `id`, if `tenant` placed it.
    fn find(
        &self,
        tenant: &Tenant,
        id: i64,
    ) -> impl Future<Output = DbResult<Option<(String, i64)>>> + Send;
}

/// The request's transaction: the order and its event go through it.
pub trait OrderHandle: Enqueue + Clone + Send + Sync + 'static {
    /// Inserts `order` for `tenant`; returns its id.
    fn insert_order(
        &self,
        tenant: &Tenant,
        order: &NewOrder,
    ) -> impl Future<Output = DbResult<i64>> + Send;
}

/// A query's value, or why it failed (logged by the handler, `500` to the client).
pub type DbResult<T> = Result<T, BoxError>;

/// The order API on `db`: `POST /orders` behind the idempotency layer, `GET /orders/{id}`,
/// and the demo authentication in front of both.
pub fn app<D: OrderDatabase>(db: D, ietf: bool) -> Router {
    app_with(db.clone(), idempotency(db, ietf))
}

/// The same API with `layer` on `POST /orders`: [`idempotency`] with settings of the caller's
/// (the tests shorten its lock timeout, for one).
pub fn app_with<D: OrderDatabase>(db: D, layer: IdempotencyLayer<D>) -> Router {
    Router::new()
        // Only the POST is wrapped: GET is idempotent by itself.
        .route("/orders", post(create_order::<D>).layer(layer))
        .route("/orders/{id}", get(get_order::<D>))
        // Added last, so it is the outermost layer: it must run before the idempotency layer,
        // which scopes every record by the tenant it finds here.
        .layer(middleware::from_fn(authenticate))
        .with_state(db)
}

/// The idempotency layer of `POST /orders` (on either database); with `ietf`, its own
/// answers as the IETF draft shows them (`--ietf`).
pub fn idempotency<S>(store: S, ietf: bool) -> IdempotencyLayer<S> {
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
async fn create_order<D: OrderDatabase>(
    Extension(tenant): Extension<Tenant>,
    Tx(tx): Tx<D::Handle>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let order = NewOrder::from_json(&body).map_err(ApiError::Invalid)?;
    // Same transaction as the idempotency record the layer saves after us.
    let order_id = tx
        .insert_order(&tenant, &order)
        .await
        .map_err(|error| internal(error, "inserting the order"))?;
    // Reserving stock is another service's job. Calling it from here could not be undone by a
    // rollback; the event commits with the order instead (or not at all), and the relay
    // delivers it once the order is durable.
    let event = order_created(order_id, &tenant, &order);
    tx.enqueue("order_created", event)
        .await
        .map_err(|error| internal(error, "enqueueing order_created"))?;
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
async fn get_order<D: OrderDatabase>(
    State(db): State<D>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let order_id: i64 = id.parse().map_err(|_| ApiError::NotFound)?;
    let order = db
        .find(&tenant, order_id)
        .await
        .map_err(|error| internal(error, "reading the order"))?;
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

/// Logs what failed (the client only learns `internal_error`).
fn internal(error: impl std::fmt::Display, doing: &str) -> ApiError {
    tracing::error!(%error, "{doing} failed");
    ApiError::Internal
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
// On SQLite (the default)
// ---------------------------------------------------------------------------------------------

/// Opens the store and creates the `orders` and `outbox_events` tables next to the
/// idempotency records.
pub async fn open_store(db: &FsPath) -> Result<SqliteStore, BoxError> {
    let store = order_table::open_store(db).await?;
    SqliteOutbox::install(&store).await?;
    Ok(store)
}

/// The orders live in the store's own database file.
impl OrderDatabase for SqliteStore {
    type Handle = SqliteHandle;

    async fn find(&self, tenant: &Tenant, id: i64) -> DbResult<Option<(String, i64)>> {
        Ok(order_table::find(self, tenant.as_str(), id).await?)
    }
}

impl OrderHandle for SqliteHandle {
    async fn insert_order(&self, tenant: &Tenant, order: &NewOrder) -> DbResult<i64> {
        let (tenant_id, order) = (tenant.as_str().to_owned(), order.clone());
        // On the transaction's own connection (the store's writer).
        Ok(self
            .run(move |conn| order_table::insert(conn, &tenant_id, &order))
            .await?)
    }
}
