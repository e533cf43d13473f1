//! The `orders` table of the test apps on SQLite: its schema, and the insert each app's
//! handler makes through the request's idempotency transaction.

use std::future::Future;

use tower_idempotency::store::sqlite::{SqliteHandle, SqliteStore};

pub const ORDERS_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS orders (
    id INTEGER PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    sku TEXT NOT NULL,
    quantity INTEGER NOT NULL
)";

/// Creates the `orders` table next to the idempotency records of `store`.
pub async fn create_orders_table(store: &SqliteStore) {
    store
        .write(|tx| tx.execute_batch(ORDERS_SCHEMA))
        .await
        .expect("create orders table");
}

/// A store over `orders.db` in a new temp dir (kept while the returned directory lives),
/// with the `orders` table.
pub async fn orders_store_in_a_temp_dir() -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("orders.db"))
        .await
        .expect("open store");
    create_orders_table(&store).await;
    (dir, store)
}

/// Inserts the order row through `tx`, in the request's transaction; returns its id.
pub fn insert_order<'tx>(
    tx: &'tx SqliteHandle,
    tenant_id: &str,
    sku: &str,
    quantity: i64,
) -> impl Future<Output = Result<i64, tower_idempotency::Error>> + Send + 'tx {
    let row = (tenant_id.to_owned(), sku.to_owned(), quantity);
    tx.run(move |conn| {
        conn.execute(
            "INSERT INTO orders (tenant_id, sku, quantity) VALUES (?1, ?2, ?3)",
            (&row.0, &row.1, row.2),
        )?;
        Ok(conn.last_insert_rowid())
    })
}
