//! The `orders` table of the test apps on SQLite: its schema, and the insert each app's
//! handler makes through the request's idempotency transaction.

// Not every test that includes this file uses all of it.
#![allow(dead_code)]

use std::future::Future;

use tower_idempotency::store::sqlite::SqliteTransaction;

pub const ORDERS_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS orders (
    id INTEGER PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    sku TEXT NOT NULL,
    quantity INTEGER NOT NULL
)";

/// Inserts the order row through `tx`, in the request's transaction; returns its id.
pub fn insert_order<'tx>(
    tx: &'tx SqliteTransaction,
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
