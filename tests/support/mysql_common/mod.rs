//! Shared setup for the MySQL and MariaDB tests: a fresh database per test on the server named
//! by `TEST_MYSQL_URL`, with the `orders` table of the example, and the counts the tests check.
//!
//! Every test that uses it is registered as needing MySQL (`test! { name, mysql }`, see
//! `tests/support/harness.rs`), so that `cargo test` without `TEST_MYSQL_URL` reports those
//! tests as ignored.

use std::str::FromStr;

use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::{AssertSqlSafe, Connection as _, Executor as _, MySqlConnection, Row as _};
use tower_idempotency::store::sqlx_mysql::{SqlxMySqlHandle, SqlxMySqlStore};
use tower_idempotency::Tenant;

use crate::common::server_backed::{run_on_a_thread_of_its_own, FreshName};
use crate::common::InsertOrder;

/// The business table of the MySQL order app (the same as the example's).
pub const ORDERS_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS orders (
    id        BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    tenant_id VARCHAR(255) NOT NULL,
    sku       VARCHAR(255) NOT NULL,
    quantity  BIGINT       NOT NULL
) ENGINE = InnoDB";

/// Databases of these suites are named `timy_<unix seconds>_<pid>_<n>`.
const DATABASE_PREFIX: &str = "timy_";

/// A database of its own on the test server, dropped (after its connections are closed) when
/// dropped.
pub struct TestDb {
    url: String,
    pub name: String,
}

impl TestDb {
    /// A fresh database with the `orders` table, or `None` (after saying so) when
    /// `TEST_MYSQL_URL` is not set.
    pub async fn create() -> Option<TestDb> {
        let FreshName {
            url,
            name,
            now,
            first,
        } = FreshName::new("TEST_MYSQL_URL", "MySQL", DATABASE_PREFIX)?;
        let mut admin = MySqlConnection::connect_with(&server_options(&url))
            .await
            .expect("connect to the MySQL server");
        if first {
            sweep_stale_databases(&mut admin, now).await;
        }
        admin
            .execute(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .expect("create the test database");
        let db = TestDb { url, name };
        db.execute(ORDERS_SCHEMA).await;
        Some(db)
    }

    /// The connect options of this database.
    pub fn options(&self) -> MySqlConnectOptions {
        server_options(&self.url).database(&self.name)
    }

    /// The same as a URL, for the example's `--database-url`.
    pub fn url(&self) -> String {
        let base = self.url.split('?').next().unwrap_or(&self.url);
        let server = match base.rfind('/') {
            Some(slash) if slash > "mysql://".len() => &base[..slash],
            _ => base,
        };
        format!("{server}/{}", self.name)
    }

    /// A pool of `max` connections on this database.
    pub async fn pool(&self, max: u32) -> MySqlPool {
        MySqlPoolOptions::new()
            .max_connections(max)
            .connect_with(self.options())
            .await
            .expect("connect the sqlx pool")
    }

    /// A store on a pool of `max` connections, with the table created.
    pub async fn store(&self, max: u32) -> SqlxMySqlStore {
        let store = SqlxMySqlStore::builder(self.pool(max).await)
            .with_max_read_connections(2)
            .build();
        store.migrate().await.expect("create the table");
        store
    }

    /// A plain connection on this database (its own, not a pooled one).
    pub async fn connection(&self) -> MySqlConnection {
        MySqlConnection::connect_with(&self.options())
            .await
            .expect("connect to the test database")
    }

    pub async fn execute(&self, sql: &str) {
        self.connection()
            .await
            .execute(AssertSqlSafe(sql))
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// The first column of the one row that `sql` returns, as an integer.
    pub async fn count(&self, sql: &str) -> i64 {
        let row = self
            .connection()
            .await
            .fetch_one(AssertSqlSafe(sql))
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        row.try_get::<i64, _>(0).expect("an integer")
    }

    pub async fn order_count(&self) -> i64 {
        self.count("SELECT count(*) FROM orders").await
    }

    /// Completed records (a reservation is never visible outside its transaction).
    pub async fn record_count(&self) -> i64 {
        self.count("SELECT count(*) FROM idempotency_records WHERE state = 'completed'")
            .await
    }

    /// Records in any state.
    pub async fn row_count(&self) -> i64 {
        self.count("SELECT count(*) FROM idempotency_records").await
    }

    /// `(orders, completed records)`.
    pub async fn counts(&self) -> (i64, i64) {
        (self.order_count().await, self.record_count().await)
    }

    /// Whether a record exists for `(tenant, operation, key)`, in any state, expired or not.
    pub async fn record_exists(&self, tenant: &str, operation: &str, key: &str) -> bool {
        let found: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idempotency_records \
             WHERE tenant = ? AND operation = ? AND idempotency_key = ?",
        )
        .bind(tenant)
        .bind(operation)
        .bind(key)
        .fetch_one(&mut self.connection().await)
        .await
        .expect("count records");
        found > 0
    }

    /// The orders as `(id, tenant_id, sku, quantity)`, by id.
    pub async fn orders(&self) -> Vec<(i64, String, String, i64)> {
        sqlx::query_as("SELECT id, tenant_id, sku, quantity FROM orders ORDER BY id")
            .fetch_all(&mut self.connection().await)
            .await
            .expect("orders")
    }

    /// The skus of the orders, by id.
    pub async fn order_skus(&self) -> Vec<String> {
        sqlx::query_scalar("SELECT sku FROM orders ORDER BY id")
            .fetch_all(&mut self.connection().await)
            .await
            .expect("orders")
    }

    /// The `order_id` in each completed record's saved body.
    pub async fn recorded_order_ids(&self) -> Vec<i64> {
        let bodies: Vec<Vec<u8>> =
            sqlx::query_scalar("SELECT body FROM idempotency_records WHERE state = 'completed'")
                .fetch_all(&mut self.connection().await)
                .await
                .expect("record bodies");
        let mut ids: Vec<i64> = bodies
            .iter()
            .map(|body| {
                let json: serde_json::Value = serde_json::from_slice(body).expect("JSON body");
                json["order_id"].as_i64().expect("an order_id")
            })
            .collect();
        ids.sort_unstable();
        ids
    }

    /// The ids of the orders, sorted.
    pub async fn order_ids(&self) -> Vec<i64> {
        sqlx::query_scalar("SELECT id FROM orders ORDER BY id")
            .fetch_all(&mut self.connection().await)
            .await
            .expect("order ids")
    }
}

fn server_options(url: &str) -> MySqlConnectOptions {
    MySqlConnectOptions::from_str(url).expect("TEST_MYSQL_URL is a valid URL")
}

impl Drop for TestDb {
    /// Closes the database's connections and drops it. `Drop` cannot await, so this runs on a
    /// thread of its own with its own runtime; a failure only leaves a database behind (swept
    /// by a later run).
    fn drop(&mut self) {
        let (url, name) = (self.url.clone(), self.name.clone());
        run_on_a_thread_of_its_own(move || async move {
            let Ok(mut admin) = MySqlConnection::connect_with(&server_options(&url)).await else {
                return;
            };
            let ids: Vec<u64> = sqlx::query_scalar(
                "SELECT id FROM information_schema.PROCESSLIST \
                     WHERE db = ? AND id <> CONNECTION_ID()",
            )
            .bind(&name)
            .fetch_all(&mut admin)
            .await
            .unwrap_or_default();
            for id in ids {
                let _ = admin.execute(AssertSqlSafe(format!("KILL {id}"))).await;
            }
            let _ = admin
                .execute(AssertSqlSafe(format!(
                    "SET SESSION lock_wait_timeout = 5; DROP DATABASE IF EXISTS {name}"
                )))
                .await;
        });
    }
}

/// Drops the databases that earlier runs left behind (killed before their cleanup), once an
/// hour has passed since they were made.
async fn sweep_stale_databases(admin: &mut MySqlConnection, now: u64) {
    let Ok(names) = sqlx::query_scalar::<_, String>(
        "SELECT schema_name FROM information_schema.SCHEMATA WHERE schema_name LIKE 'timy\\_%'",
    )
    .fetch_all(&mut *admin)
    .await
    else {
        return;
    };
    for name in names {
        if FreshName::is_stale(&name, DATABASE_PREFIX, now) {
            let _ = admin
                .execute(AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name}")))
                .await;
        }
    }
}

impl InsertOrder for SqlxMySqlHandle {
    async fn insert_order(
        &self,
        tenant: &Tenant,
        sku: &str,
        quantity: i64,
    ) -> Result<i64, tower_idempotency::Error> {
        let mut conn = self.acquire().await?;
        let inserted =
            sqlx::query("INSERT INTO orders (tenant_id, sku, quantity) VALUES (?, ?, ?)")
                .bind(tenant.as_str())
                .bind(sku)
                .bind(quantity)
                .execute(&mut *conn)
                .await?;
        i64::try_from(inserted.last_insert_id())
            .map_err(|_| tower_idempotency::Error::Corrupt("an order id past i64".into()))
    }
}
