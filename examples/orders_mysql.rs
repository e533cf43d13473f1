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

use axum::response::Response;
use axum::routing::post;
use axum::{Extension, Json};
use serde_json::Value;
use sqlx::mysql::MySqlPoolOptions;
use tower_idempotency::extract::Tx;
use tower_idempotency::store::sqlx_mysql::{SqlxMySqlStore, SqlxTransaction};
use tower_idempotency::Tenant;

use sqlx_app::{created, idempotency, sku_and_quantity, ApiError, Args, BoxError};

/// The command line, the layer's configuration, authentication, error answers and serving,
/// shared with the other sqlx example.
#[path = "common/sqlx_app.rs"]
mod sqlx_app;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = Args::parse("mysql")?;

    // The application's pool: its own queries and the idempotency transactions share it.
    let pool = MySqlPoolOptions::new()
        .max_connections(16)
        .connect(&args.url)
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

    let orders = post(create_order).layer(idempotency(store));
    sqlx_app::serve(&args.addr, orders, "MySQL store").await
}

/// `POST /orders`: runs once per `(tenant, key)`; the layer replays its `201` to retries.
async fn create_order(
    Extension(tenant): Extension<Tenant>,
    Tx(tx): Tx<SqlxTransaction>,
    Json(order): Json<Value>,
) -> Result<Response, ApiError> {
    let (sku, quantity) = sku_and_quantity(&order)?;
    let mut conn = tx.acquire().await?;
    let inserted = sqlx::query("INSERT INTO orders (tenant_id, sku, quantity) VALUES (?, ?, ?)")
        .bind(tenant.as_str())
        .bind(sku)
        .bind(quantity)
        .execute(&mut *conn)
        .await?;
    Ok(created(inserted.last_insert_id()))
}
