//! The `orders` table the SQLite order examples share, and what makes an order valid (the
//! rules of `order_rules.rs`): the same rules and error codes over HTTP and gRPC. Included with
//! `#[path = "common/order_table.rs"] mod order_table;`.

// Not every example uses every item.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use tower_idempotency::body::BoxError;
use tower_idempotency::store::continuously_purge_expired;
use tower_idempotency::store::sqlite::rusqlite::{self, Connection, OptionalExtension};
use tower_idempotency::store::sqlite::SqliteStore;

pub use order_rules::{tenant_of, NewOrder};

/// What makes an order valid, without a database (the sqlx examples share it too).
#[path = "order_rules.rs"]
mod order_rules;

/// The business table. It lives in the same database file as `idempotency_records`, which is
/// what lets an order and its saved response commit in one transaction.
pub const ORDERS_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS orders (
    id        INTEGER PRIMARY KEY,
    tenant_id TEXT    NOT NULL,
    sku       TEXT    NOT NULL,
    quantity  INTEGER NOT NULL
);";

/// Opens the store and creates the `orders` table next to the idempotency records.
pub async fn open_store(db: &Path) -> Result<SqliteStore, BoxError> {
    let store = SqliteStore::open(db)
        .await
        .map_err(|error| format!("cannot open {}: {error}", db.display()))?;
    store.write(|tx| tx.execute_batch(ORDERS_SCHEMA)).await?;
    Ok(store)
}

/// The first line an HTTP order example prints: its address, which scripts and tests read,
/// and an order to try.
pub fn banner(local: SocketAddr, db: &Path) -> String {
    format!(
        "listening on http://{local} (database {}); try: curl -i http://{local}/orders \
         -H 'Authorization: Bearer shop-a-token' -H 'Idempotency-Key: key-1' \
         -H 'Content-Type: application/json' -d '{{\"sku\":\"book\",\"quantity\":1}}'",
        db.display()
    )
}

/// Purges expired idempotency records every minute, 1000 at a time, in a task of its own.
pub fn spawn_purge(store: &SqliteStore) {
    tokio::spawn(continuously_purge_expired(
        store.clone(),
        Duration::from_secs(60),
        1000,
    ));
}

/// Inserts the order for `tenant` on `conn` (in the examples, the request's idempotency
/// transaction) and returns its id.
pub fn insert(conn: &Connection, tenant: &str, order: &NewOrder) -> rusqlite::Result<i64> {
    conn.prepare_cached("INSERT INTO orders (tenant_id, sku, quantity) VALUES (?1, ?2, ?3)")?
        .execute((tenant, &order.sku, order.quantity))?;
    Ok(conn.last_insert_rowid())
}

/// `(sku, quantity)` of the order `id`, if `tenant` placed it: another tenant's order is
/// answered exactly like a missing one, so ids reveal nothing across tenants.
pub async fn find(
    store: &SqliteStore,
    tenant: &str,
    id: i64,
) -> Result<Option<(String, i64)>, tower_idempotency::Error> {
    let tenant = tenant.to_owned();
    store
        .read(move |conn| {
            conn.query_row(
                "SELECT sku, quantity FROM orders WHERE id = ?1 AND tenant_id = ?2",
                (id, tenant),
                |row| Ok((row.get(0)?, row.get(1)?)),
            )
            .optional()
        })
        .await
}
