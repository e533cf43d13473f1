//! Shared setup for the tests of the sqlx SQLite store: a fresh database file per test in a temp
//! dir, the stores the tests' order app serves on it, and what the tests read from it (orders,
//! records), through sqlx's SQLite driver.
//!
//! Unlike [`pg_common`](crate::pg_common) and [`mysql_common`](crate::mysql_common), it needs
//! no server: its tests run in a plain `cargo test`. For a program under test the file is left
//! to that program to create (as `examples/orders_sqlx_sqlite.rs` does, with its `orders` table
//! and the records' table), so several processes can open it and the test reads what they
//! wrote; for the order app of `tests/support/common` ([`TestDb::with_orders`], served by
//! `backend::SqlxSqlite`) the test creates it.

use std::path::{Path, PathBuf};

use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use sqlx::{AssertSqlSafe, Connection as _, Executor as _, Row as _, SqliteConnection};
use tower_idempotency::store::sqlx_sqlite::{SqlxSqliteHandle, SqlxSqliteStore};
use tower_idempotency::Tenant;

use crate::common::InsertOrder;
use crate::sqlite_orders::ORDERS_SCHEMA;

/// A database file of its own, `orders.db` in a temp dir deleted (with the file, its WAL and
/// its shared-memory index) when dropped.
pub struct TestDb {
    dir: tempfile::TempDir,
}

impl TestDb {
    /// A temp dir for a fresh database file; the file does not exist yet.
    ///
    /// An `Option`, as the server-backed databases' `create`, though never `None`: a file needs
    /// no server.
    pub async fn create() -> Option<TestDb> {
        let dir = tempfile::tempdir().expect("temp dir");
        Some(TestDb { dir })
    }

    /// The database file.
    pub fn path(&self) -> PathBuf {
        self.dir.path().join("orders.db")
    }

    /// The same as a URL, for the example's `--database-url`: `sqlite:///tmp/.../orders.db`.
    pub fn url(&self) -> String {
        format!("sqlite://{}", self.path().display())
    }

    /// A plain connection on the file (its own, not a pooled one), which never creates it: a
    /// test reads what the program under test wrote.
    pub async fn connection(&self) -> SqliteConnection {
        connect(&self.path()).await
    }

    /// A fresh database file with the records' table (and WAL on) and the `orders` table of the
    /// tests' order app, made by a store of the test's own, closed before this returns.
    pub async fn with_orders() -> Option<TestDb> {
        let db = TestDb::create().await?;
        db.store(1).await.pool().close().await;
        Some(db)
    }

    /// A pool of at most `max` connections on the file, which it creates if it is missing.
    pub async fn pool(&self, max: u32) -> SqlitePool {
        let options = SqliteConnectOptions::new()
            .filename(self.path())
            .create_if_missing(true);
        SqlitePoolOptions::new()
            .max_connections(max)
            .connect_with(options)
            .await
            .unwrap_or_else(|e| panic!("open {}: {e}", self.path().display()))
    }

    /// A store on a pool of `max` connections (and a read pool of 2), migrated, with the
    /// `orders` table of the tests' order app: an app instance of its own on the file.
    pub async fn store(&self, max: u32) -> SqlxSqliteStore {
        let store = SqlxSqliteStore::builder(self.pool(max).await)
            .with_max_read_connections(2)
            .build();
        store.migrate().await.expect("create the records' table");
        store
            .pool()
            .execute(ORDERS_SCHEMA)
            .await
            .expect("create the orders table");
        store
    }

    /// Runs `sql` (one statement or several) on a connection of its own.
    pub async fn execute(&self, sql: &str) {
        self.connection()
            .await
            .execute(sqlx::raw_sql(AssertSqlSafe(sql)))
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

    /// Completed records (the store writes no other: its reservation is the write lock).
    pub async fn record_count(&self) -> i64 {
        self.count("SELECT count(*) FROM idempotency_records WHERE state = 'completed'")
            .await
    }

    /// Records in any state.
    pub async fn row_count(&self) -> i64 {
        self.count("SELECT count(*) FROM idempotency_records").await
    }

    /// Whether a record exists for `(tenant, operation, key)`, expired or not.
    pub async fn record_exists(&self, tenant: &str, operation: &str, key: &str) -> bool {
        let found: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM idempotency_records \
             WHERE tenant = ?1 AND operation = ?2 AND idempotency_key = ?3",
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

    /// The `order_id` in each completed record's saved body, sorted.
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
}

/// Opens `path` without creating it, leaving its journal mode as the file has it (WAL, which
/// the store turned on): a connection that asked for another mode would need the file to
/// itself.
async fn connect(path: &Path) -> SqliteConnection {
    let options = SqliteConnectOptions::new().filename(path);
    SqliteConnection::connect_with(&options)
        .await
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

impl InsertOrder for SqlxSqliteHandle {
    async fn insert_order(
        &self,
        tenant: &Tenant,
        sku: &str,
        quantity: i64,
    ) -> Result<i64, tower_idempotency::Error> {
        let mut conn = self.acquire().await?;
        let id = sqlx::query_scalar(
            "INSERT INTO orders (tenant_id, sku, quantity) VALUES (?1, ?2, ?3) RETURNING id",
        )
        .bind(tenant.as_str())
        .bind(sku)
        .bind(quantity)
        .fetch_one(&mut *conn)
        .await?;
        Ok(id)
    }
}
