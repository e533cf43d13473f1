//! The order route on MySQL or MariaDB: the application's own `MySqlPool`, and a handler of
//! ordinary sqlx code whose order row commits together with the saved response.
//!
//! ```text
//! cargo run --example orders_mysql --features sqlx-mysql,axum -- \
//!     --database-url mysql://root@127.0.0.1:3306/shop [--addr 127.0.0.1:3000]
//! curl -i -X POST http://127.0.0.1:3000/orders -H 'authorization: Bearer shop-a-token' \
//!     -H 'idempotency-key: order-1' -H 'content-type: application/json' \
//!     -d '{"sku":"book","quantity":1}'
//! ```

use axum::extract::Request;
use axum::http::header::LOCATION;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use serde_json::{json, Value};
use sqlx::mysql::MySqlPoolOptions;
use tower_idempotency::extract::Tx;
use tower_idempotency::store::sqlx_mysql::{SqlxMySqlStore, SqlxTransaction};
use tower_idempotency::{Fingerprinter, IdempotencyLayer, Tenant};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let (mut url, mut addr) = (None, String::from("127.0.0.1:3000"));
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--database-url" => url = args.next(),
            "--addr" => addr = args.next().ok_or("--addr needs a value")?,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let url = url.ok_or("--database-url mysql://... is required")?;

    // The application's pool: its own queries and the idempotency transactions share it.
    let pool = MySqlPoolOptions::new()
        .max_connections(16)
        .connect(&url)
        .await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS orders (
            id        BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
            tenant_id VARCHAR(255) NOT NULL,
            sku       VARCHAR(255) NOT NULL,
            quantity  BIGINT       NOT NULL
        ) ENGINE = InnoDB",
    )
    .execute(&pool)
    .await?;
    let store = SqlxMySqlStore::new(pool);
    // Creates `idempotency_records` if it is missing (or run the crate's migration file,
    // `migrations/mysql/`, with your own migrations instead).
    store.migrate().await?;

    let idempotency = IdempotencyLayer::new(store)
        .with_operation("create_order")
        .with_fingerprinter(Fingerprinter::json());
    let app = Router::new()
        .route("/orders", post(create_order).layer(idempotency))
        .layer(middleware::from_fn(authenticate));
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!(
        "listening on http://{} (MySQL store)",
        listener.local_addr()?
    );
    axum::serve(listener, app).await?;
    Ok(())
}

/// `POST /orders`: runs once per `(tenant, key)`; the layer replays its `201` to retries.
async fn create_order(
    Extension(tenant): Extension<Tenant>,
    Tx(tx): Tx<SqlxTransaction>,
    Json(order): Json<Value>,
) -> Result<Response, ApiError> {
    let sku = order["sku"].as_str().ok_or(ApiError::BadRequest)?;
    let quantity = order["quantity"].as_i64().ok_or(ApiError::BadRequest)?;
    let mut conn = tx.acquire().await?;
    let inserted = sqlx::query("INSERT INTO orders (tenant_id, sku, quantity) VALUES (?, ?, ?)")
        .bind(tenant.as_str())
        .bind(sku)
        .bind(quantity)
        .execute(&mut *conn)
        .await?;
    let order_id = inserted.last_insert_id();
    Ok((
        StatusCode::CREATED,
        [(LOCATION, format!("/orders/{order_id}"))],
        Json(json!({ "order_id": order_id })),
    )
        .into_response())
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

/// A 4xx or 5xx, which the layer does not save: it rolls the transaction back.
enum ApiError {
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
