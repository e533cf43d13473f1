//! The order API of `orders.rs` on MySQL or MariaDB: the application's own `MySqlPool`, and a
//! handler of ordinary sqlx code whose order row commits together with the saved response.
//!
//! ```text
//! cargo run --example orders_mysql --features sqlx-mysql,axum -- \
//!     --database-url mysql://root@127.0.0.1:3306/shop [--addr 127.0.0.1:3000]
//! curl -i -X POST http://127.0.0.1:3000/orders -H 'authorization: Bearer shop-a-token' \
//!     -H 'idempotency-key: order-1' -H 'content-type: application/json' \
//!     -d '{"sku":"book","quantity":1}'
//! curl -i http://127.0.0.1:3000/orders/1 -H 'authorization: Bearer shop-a-token'
//! ```

use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use sqlx::Row;
use tower_idempotency::store::sqlx_mysql::{SqlxMySqlHandle, SqlxMySqlStore};
use tower_idempotency::Tenant;

use sqlx_app::{Args, BoxError, NewOrder, OrderSql};

/// The order API (`POST /orders`, `GET /orders/{id}`, rules, error codes), the command line
/// and serving, shared with the other sqlx example: this file brings the SQL.
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
    let store = SqlxMySqlStore::new(pool.clone());
    // Creates `idempotency_records` if it is missing (or run the crate's migration file,
    // `migrations/mysql/`, with your own migrations instead).
    store.migrate().await?;

    let app = sqlx_app::app(Orders(pool), store);
    sqlx_app::serve(&args.addr, app, "MySQL store").await
}

/// The orders table, on the application's pool.
#[derive(Clone)]
struct Orders(MySqlPool);

impl OrderSql for Orders {
    type Store = SqlxMySqlStore;
    type Handle = SqlxMySqlHandle;

    /// Ordinary sqlx code on the connection the transaction lends.
    async fn insert(
        tx: &SqlxMySqlHandle,
        tenant: &Tenant,
        order: &NewOrder,
    ) -> Result<i64, BoxError> {
        let mut conn = tx.acquire().await?;
        let inserted =
            sqlx::query("INSERT INTO orders (tenant_id, sku, quantity) VALUES (?, ?, ?)")
                .bind(tenant.as_str())
                .bind(&order.sku)
                .bind(order.quantity)
                .execute(&mut *conn)
                .await?;
        Ok(i64::try_from(inserted.last_insert_id())?)
    }

    async fn find(&self, tenant: &Tenant, id: i64) -> Result<Option<(String, i64)>, BoxError> {
        let row = sqlx::query("SELECT sku, quantity FROM orders WHERE id = ? AND tenant_id = ?")
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
