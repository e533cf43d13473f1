//! The order API of `orders.rs` on the sqlx PostgreSQL store: the application's own `PgPool`,
//! and a handler of ordinary sqlx code whose order row commits together with the saved
//! response.
//!
//! ```text
//! cargo run --example orders_sqlx --features sqlx-postgres,axum -- \
//!     --database-url postgres://postgres@127.0.0.1/shop [--addr 127.0.0.1:3000]
//! curl -i -X POST http://127.0.0.1:3000/orders -H 'authorization: Bearer shop-a-token' \
//!     -H 'idempotency-key: order-1' -H 'content-type: application/json' \
//!     -d '{"sku":"book","quantity":1}'
//! curl -i http://127.0.0.1:3000/orders/1 -H 'authorization: Bearer shop-a-token'
//! ```
//!
//! The handler uses the function forms (`query_as`, `bind`) rather than the `query!` macros,
//! so that building it needs neither a live database nor a checked-in `.sqlx` directory; the
//! macros take the same `&mut *conn` executor (in CI, the tests' sqlx order app writes its order
//! with `query_scalar!`, built offline from `tests/support/.sqlx/`: see
//! `tests/support/pg_common/sqlx_app.rs`).

use sqlx::postgres::{PgPool, PgPoolOptions};
use tower_idempotency::store::sqlx_postgres::{SqlxPostgresHandle, SqlxPostgresStore};
use tower_idempotency::Tenant;

use sqlx_app::{Args, BoxError, NewOrder, OrderSql};

/// The order API (`POST /orders`, `GET /orders/{id}`, rules, error codes), the command line
/// and serving, shared with the other sqlx example: this file brings the SQL.
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
    let store = SqlxPostgresStore::new(pool.clone());
    // Creates `idempotency_records` if it is missing (or run the crate's migration file with
    // your own migrations instead).
    store.migrate().await?;

    let app = sqlx_app::app(Orders(pool), store);
    sqlx_app::serve(&args.addr, app, "sqlx store").await
}

/// The orders table, on the application's pool.
#[derive(Clone)]
struct Orders(PgPool);

impl OrderSql for Orders {
    type Store = SqlxPostgresStore;
    type Handle = SqlxPostgresHandle;

    /// Ordinary sqlx code on the connection the transaction lends.
    async fn insert(
        tx: &SqlxPostgresHandle,
        tenant: &Tenant,
        order: &NewOrder,
    ) -> Result<i64, BoxError> {
        let mut conn = tx.acquire().await?;
        let (order_id,): (i64,) = sqlx::query_as(
            "INSERT INTO orders (tenant_id, sku, quantity) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(tenant.as_str())
        .bind(&order.sku)
        .bind(order.quantity)
        .fetch_one(&mut *conn)
        .await?;
        Ok(order_id)
    }

    async fn find(&self, tenant: &Tenant, id: i64) -> Result<Option<(String, i64)>, BoxError> {
        let found =
            sqlx::query_as("SELECT sku, quantity FROM orders WHERE id = $1 AND tenant_id = $2")
                .bind(id)
                .bind(tenant.as_str())
                .fetch_optional(&self.0)
                .await?;
        Ok(found)
    }
}
