//! What the two sqlx order examples (`orders_sqlx.rs` on PostgreSQL, `orders_mysql.rs` on MySQL
//! or MariaDB) share around their store and handler: the command line, the layer's
//! configuration, the demo authentication, the error answers and serving. Included with
//! `#[path = "common/sqlx_app.rs"] mod sqlx_app;`.

use std::fmt::Display;

use axum::extract::Request;
use axum::http::header::LOCATION;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::MethodRouter;
use axum::{Json, Router};
use serde_json::{json, Value};
use tower_idempotency::{Fingerprinter, IdempotencyLayer, Tenant};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// `--database-url URL [--addr ADDR]`.
pub struct Args {
    pub url: String,
    /// Default `127.0.0.1:3000`.
    pub addr: String,
}

impl Args {
    /// The process's arguments; `scheme` (`postgres`, `mysql`) names the URL a missing
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

/// The layer of `POST /orders`: a named operation, and payloads compared as JSON values.
pub fn idempotency<S>(store: S) -> IdempotencyLayer<S> {
    IdempotencyLayer::new(store)
        .with_operation("create_order")
        .with_fingerprinter(Fingerprinter::json())
}

/// Serves `orders` (`POST /orders` behind its idempotency layer) as `/orders` on `addr`,
/// behind the demo authentication; the first line names the `store`.
pub async fn serve(addr: &str, orders: MethodRouter, store: &str) -> Result<(), BoxError> {
    let app = Router::new()
        .route("/orders", orders)
        .layer(middleware::from_fn(authenticate));
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("listening on http://{} ({store})", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}

/// Two demo tenants, by bearer token.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let tenant = match request
        .headers()
        .get("authorization")
        .and_then(|value| value.to_str().ok())
    {
        Some("Bearer shop-a-token") => Tenant::new("shop-a"),
        Some("Bearer shop-b-token") => Tenant::new("shop-b"),
        _ => return StatusCode::UNAUTHORIZED.into_response(),
    };
    request.extensions_mut().insert(tenant);
    next.run(request).await
}

/// The `sku` and `quantity` of an order body.
pub fn sku_and_quantity(order: &Value) -> Result<(&str, i64), ApiError> {
    let sku = order["sku"].as_str().ok_or(ApiError::BadRequest)?;
    let quantity = order["quantity"].as_i64().ok_or(ApiError::BadRequest)?;
    Ok((sku, quantity))
}

/// `201` with the new order's id and `Location`, which the layer saves and replays.
pub fn created<T: Into<Value> + Display>(order_id: T) -> Response {
    let location = format!("/orders/{order_id}");
    let body = json!({ "order_id": order_id.into() });
    (StatusCode::CREATED, [(LOCATION, location)], Json(body)).into_response()
}

/// A 4xx or 5xx, which the layer does not save: it rolls the transaction back.
pub enum ApiError {
    BadRequest,
    Internal,
}

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        eprintln!("database error: {error}");
        ApiError::Internal
    }
}

impl From<tower_idempotency::Error> for ApiError {
    fn from(error: tower_idempotency::Error) -> Self {
        eprintln!("transaction error: {error}");
        ApiError::Internal
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = match self {
            ApiError::BadRequest => (StatusCode::BAD_REQUEST, "invalid_order"),
            ApiError::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        (status, Json(json!({ "error": code }))).into_response()
    }
}
