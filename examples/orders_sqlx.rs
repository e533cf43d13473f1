//! The order route on the sqlx store: the application's own `PgPool`, and a handler of
//! ordinary sqlx code whose order row commits together with the saved response.
//!
//! ```text
//! cargo run --example orders_sqlx --features sqlx-postgres,axum -- \
//!     --database-url postgres://postgres@127.0.0.1/shop [--addr 127.0.0.1:3000]
//! curl -i -X POST http://127.0.0.1:3000/orders -H 'authorization: Bearer shop-a-token' \
//!     -H 'idempotency-key: order-1' -H 'content-type: application/json' \
//!     -d '{"sku":"book","quantity":1}'
//! ```
//!
//! The handler uses the function forms (`query_as`, `bind`) rather than the `query!` macros,
//! so that building it needs neither a live database nor a checked-in `.sqlx` directory; the
//! macros take the same `&mut *conn` executor (the tests' sqlx order app writes its order with
//! `query_scalar!`, built offline from the crate's `.sqlx/`: docs/sqlx.md, "Query macros").

use axum::response::Response;
use axum::routing::post;
use axum::{Extension, Json};
use serde_json::Value;
use sqlx::postgres::PgPoolOptions;
use tower_idempotency::extract::Tx;
use tower_idempotency::store::sqlx_postgres::{SqlxPostgresStore, SqlxTransaction};
use tower_idempotency::Tenant;

use sqlx_app::{created, idempotency, sku_and_quantity, ApiError, Args, BoxError};

/// The command line, the layer's configuration, authentication, error answers and serving,
/// shared with the other sqlx example.
#[path = "common/sqlx_app.rs"]
mod sqlx_app;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = Args::parse("postgres")?;

    // The application's pool: its own queries and the idempotency transactions share it.
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect(&args.url)
        .await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS orders (
            id        BIGSERIAL PRIMARY KEY,
            tenant_id TEXT   NOT NULL,
            sku       TEXT   NOT NULL,
            quantity  BIGINT NOT NULL
        )",
    )
    .execute(&pool)
    .await?;
    let store = SqlxPostgresStore::new(pool);
    // Creates `idempotency_records` if it is missing (or run the crate's migration file with
    // your own migrations instead).
    store.migrate().await?;

    let orders = post(create_order).layer(idempotency(store));
    sqlx_app::serve(&args.addr, orders, "sqlx store").await
}

/// `POST /orders`: runs once per `(tenant, key)`; the layer replays its `201` to retries.
async fn create_order(
    Extension(tenant): Extension<Tenant>,
    Tx(tx): Tx<SqlxTransaction>,
    Json(order): Json<Value>,
) -> Result<Response, ApiError> {
    let (sku, quantity) = sku_and_quantity(&order)?;
    let mut conn = tx.acquire().await?;
    let (order_id,): (i64,) = sqlx::query_as(
        "INSERT INTO orders (tenant_id, sku, quantity) VALUES ($1, $2, $3) RETURNING id",
    )
    .bind(tenant.as_str())
    .bind(sku)
    .bind(quantity)
    .fetch_one(&mut *conn)
    .await?;
    Ok(created(order_id))
}
