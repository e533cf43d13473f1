//! The order API of `orders.rs` on SQLite through sqlx: the application's own `SqlitePool`,
//! and a handler of ordinary sqlx code whose order row commits together with the saved
//! response.
//!
//! ```text
//! cargo run --example orders_sqlx_sqlite --features sqlx-sqlite,axum -- \
//!     --database-url sqlite://shop.db [--addr 127.0.0.1:3000]
//! curl -i -X POST http://127.0.0.1:3000/orders -H 'authorization: Bearer shop-a-token' \
//!     -H 'idempotency-key: order-1' -H 'content-type: application/json' \
//!     -d '{"sku":"book","quantity":1}'
//! curl -i http://127.0.0.1:3000/orders/1 -H 'authorization: Bearer shop-a-token'
//! ```

use std::str::FromStr;

use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use sqlx::Row;
use tower_idempotency::store::sqlx_sqlite::{SqlxSqliteHandle, SqlxSqliteStore};
use tower_idempotency::Tenant;

use sqlx_app::{Args, BoxError, NewOrder, OrderSql};

/// The order API (`POST /orders`, `GET /orders/{id}`, rules, error codes), the command line
/// and serving, shared with the other sqlx examples: this file brings the SQL.
#[path = "common/sqlx_app.rs"]
mod sqlx_app;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = Args::parse("sqlite")?;

    // The application's pool: its own queries and the idempotency transactions share it.
    // The file is created if it is missing.
    let options = SqliteConnectOptions::from_str(&args.url)?.create_if_missing(true);
    let pool = SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await?;
    let store = SqlxSqliteStore::new(pool.clone());
    // Turns on WAL for the file and creates `idempotency_records` if it is missing.
    store.migrate().await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS orders (
            id        INTEGER PRIMARY KEY AUTOINCREMENT,
            tenant_id TEXT    NOT NULL,
            sku       TEXT    NOT NULL,
            quantity  INTEGER NOT NULL
        )",
    )
    .execute(&pool)
    .await?;

    let app = sqlx_app::app(Orders(pool), store);
    sqlx_app::serve(&args.addr, app, "sqlx SQLite store").await
}

/// The orders table, on the application's pool.
#[derive(Clone)]
struct Orders(SqlitePool);

impl OrderSql for Orders {
    type Store = SqlxSqliteStore;
    type Handle = SqlxSqliteHandle;

    /// Ordinary sqlx code on the connection the transaction lends.
    async fn insert(
        tx: &SqlxSqliteHandle,
        tenant: &Tenant,
        order: &NewOrder,
    ) -> Result<i64, BoxError> {
        let mut conn = tx.acquire().await?;
        let (id,): (i64,) = sqlx::query_as(
            "INSERT INTO orders (tenant_id, sku, quantity) VALUES (?1, ?2, ?3) RETURNING id",
        )
        .bind(tenant.as_str())
        .bind(&order.sku)
        .bind(order.quantity)
        .fetch_one(&mut *conn)
        .await?;
        Ok(id)
    }

    async fn find(&self, tenant: &Tenant, id: i64) -> Result<Option<(String, i64)>, BoxError> {
        let row = sqlx::query("SELECT sku, quantity FROM orders WHERE id = ?1 AND tenant_id = ?2")
            .bind(id)
            .bind(tenant.as_str())
            .fetch_optional(&self.0)
            .await?;
        match row {
            Some(row) => Ok(Some((row.try_get(0)?, row.try_get(1)?))),
            None => Ok(None),
        }
    }
}
