//! The order API of the sqlx examples (`orders_sqlx.rs` on PostgreSQL, `orders_mysql.rs` on
//! MySQL or MariaDB, `orders_sqlx_sqlite.rs` on SQLite), the same as `orders.rs` serves: `POST /orders` behind the idempotency
//! layer with the order rules and error codes of `order_rules.rs`, `201` with `Location`,
//! `GET /orders/{id}`, the demo authentication; and the command line and serving. Each
//! example supplies only its SQL ([`OrderSql`]). Included with
//! `#[path = "common/sqlx_app.rs"] mod sqlx_app;`.

use std::future::Future;

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::header::{AUTHORIZATION, LOCATION};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde_json::{json, Value};
use tower_idempotency::extract::Tx;
use tower_idempotency::store::IdempotencyStore;
use tower_idempotency::{fingerprint::Fingerprinter, IdempotencyLayer, Tenant};

pub use order_rules::NewOrder;

/// What makes an order valid: the rules and codes of every order example.
#[path = "order_rules.rs"]
mod order_rules;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// `--database-url URL [--addr ADDR]`.
pub struct Args {
    pub url: String,
    /// Default `127.0.0.1:3000`.
    pub addr: String,
}

impl Args {
    /// The process's arguments; `scheme` (`postgres`, `mysql`, `sqlite`) names the URL a missing
    /// `--database-url` asks for.
    pub fn parse(scheme: &str) -> Result<Self, BoxError> {
        let mut args = std::env::args().skip(1);
        let (mut url, mut addr) = (None, String::from("127.0.0.1:3000"));
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--database-url" => url = args.next(),
                "--addr" => addr = args.next().ok_or("--addr needs a value")?,
                other => return Err(format!("unknown argument {other}").into()),
            }
        }
        let url = url.ok_or_else(|| format!("--database-url {scheme}://... is required"))?;
        Ok(Args { url, addr })
    }
}

/// The example's SQL on its database: the orders live next to the idempotency records, so an
/// order and its saved `201` commit in one transaction.
pub trait OrderSql: Clone + Send + Sync + 'static {
    /// The idempotency store on the application's pool.
    type Store: IdempotencyStore + Clone + Send + Sync + 'static;
    /// The request's transaction, which the layer hands the handler (`Tx<...>`).
    type Handle: Clone + Send + Sync + 'static;

    /// Inserts `order` for `tenant` in the request's transaction; returns its id.
    fn insert(
        tx: &Self::Handle,
        tenant: &Tenant,
        order: &NewOrder,
    ) -> impl Future<Output = Result<i64, BoxError>> + Send;

    /// `(sku, quantity)` of the order `id`, if `tenant` placed it.
    fn find(
        &self,
        tenant: &Tenant,
        id: i64,
    ) -> impl Future<Output = Result<Option<(String, i64)>, BoxError>> + Send;
}

/// The order API: `POST /orders` behind the idempotency layer on `store`, `GET /orders/{id}`
/// on `db`, and the demo authentication in front of both.
pub fn app<D: OrderSql>(db: D, store: D::Store) -> Router {
    Router::new()
        // Only the POST is wrapped: GET is idempotent by itself.
        .route("/orders", post(create_order::<D>).layer(idempotency(store)))
        .route("/orders/{id}", get(get_order::<D>))
        // Outermost: the idempotency layer scopes every record by the tenant found here.
        .layer(middleware::from_fn(authenticate))
        .with_state(db)
}

/// The layer of `POST /orders`: a named operation, and payloads compared as JSON values.
pub fn idempotency<S>(store: S) -> IdempotencyLayer<S> {
    IdempotencyLayer::new(store)
        .with_operation("create_order")
        .with_fingerprinter(Fingerprinter::json())
}

/// Serves `app` on `addr`; the first line (which scripts and tests read) names the `store`.
pub async fn serve(addr: &str, app: Router, store: &str) -> Result<(), BoxError> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("listening on http://{} ({store})", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}

/// Demo authentication: a fixed token per tenant ([`order_rules::tenant_of`]).
async fn authenticate(mut request: Request, next: Next) -> Response {
    let authorization = request.headers().get(AUTHORIZATION);
    match order_rules::tenant_of(authorization.and_then(|value| value.to_str().ok())) {
        Some(tenant) => {
            request.extensions_mut().insert(tenant);
            next.run(request).await
        }
        None => ApiError::Unauthenticated.into_response(),
    }
}

/// `POST /orders`: runs once per `(tenant, key)`; the layer replays its `201` to retries.
/// Every error answer is a 4xx or 5xx, which the layer does not save: it rolls back.
async fn create_order<D: OrderSql>(
    Extension(tenant): Extension<Tenant>,
    Tx(tx): Tx<D::Handle>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let order = NewOrder::from_json(&body).map_err(ApiError::Invalid)?;
    let order_id = D::insert(&tx, &tenant, &order)
        .await
        .map_err(|error| internal(error, "inserting the order"))?;
    let location = format!("/orders/{order_id}");
    let body = json!({ "order_id": order_id });
    Ok((StatusCode::CREATED, [(LOCATION, location)], Json(body)).into_response())
}

/// `GET /orders/{id}`: the caller's own order; another tenant's is answered like a missing one.
async fn get_order<D: OrderSql>(
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

/// The app's own error answers, as `{"error":"<code>"}`: those of `orders.rs`.
enum ApiError {
    Unauthenticated,
    /// `400` with the code of the invalid field (`invalid_key_or_sku`, `invalid_quantity`).
    Invalid(&'static str),
    NotFound,
    Internal,
}

/// Logs what failed (the client only learns `internal_error`).
fn internal(error: impl std::fmt::Display, doing: &str) -> ApiError {
    eprintln!("{doing} failed: {error}");
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
