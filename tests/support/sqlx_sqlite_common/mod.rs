//! Shared setup for the tests of the sqlx SQLite store: a fresh database file per test in a temp
//! dir, and what the tests read from it (orders, records), through sqlx's SQLite driver.
//!
//! Unlike [`pg_common`](crate::pg_common) and [`mysql_common`](crate::mysql_common), it needs
//! no server: its tests run in a plain `cargo test`. The file is left for the program under
//! test to create (as `examples/orders_sqlx_sqlite.rs` does, with its `orders` table and the
//! records' table), so several processes can open it and the test reads what they wrote.

use std::path::{Path, PathBuf};

use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{AssertSqlSafe, Connection as _, Executor as _, Row as _, SqliteConnection};

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
