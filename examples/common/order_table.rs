//! The `orders` table the SQLite order examples share, and what makes an order valid: the
//! same rules and error codes over HTTP and gRPC. Included with
//! `#[path = "common/order_table.rs"] mod order_table;`.

// Not every example uses every item.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use tower_idempotency::body::BoxError;
use tower_idempotency::store::continuously_purge_expired;
use tower_idempotency::store::sqlite::rusqlite::{self, Connection, OptionalExtension};
use tower_idempotency::store::sqlite::SqliteStore;
use tower_idempotency::Tenant;

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

/// A validated order request.
#[derive(Clone, Debug)]
pub struct NewOrder {
    pub sku: String,
    pub quantity: i64,
}

/// The code of an invalid sku (the name predates the rules: a bad key is the layer's answer).
pub const INVALID_SKU: &str = "invalid_key_or_sku";
/// The code of an invalid quantity.
pub const INVALID_QUANTITY: &str = "invalid_quantity";

impl NewOrder {
    /// An sku of 1 to 100 characters (not bytes: "書" is one), and 1 to 100 of it.
    pub fn new(sku: String, quantity: i64) -> Result<Self, &'static str> {
        if !(1..=100).contains(&sku.chars().count()) {
            return Err(INVALID_SKU);
        }
        if !(1..=100).contains(&quantity) {
            return Err(INVALID_QUANTITY);
        }
        Ok(NewOrder { sku, quantity })
    }

    /// From a JSON body, by hand (rather than with a typed `Json<T>` extractor) so that every
    /// invalid field gets one of the two documented error codes. A body that is not JSON at
    /// all does not get here: the layer's JSON fingerprinter answers it `400 invalid_json`.
    pub fn from_json(body: &[u8]) -> Result<Self, &'static str> {
        let value: Value = serde_json::from_slice(body).map_err(|_| INVALID_SKU)?;
        let sku = value
            .get("sku")
            .and_then(Value::as_str)
            .ok_or(INVALID_SKU)?;
        // `as_i64` is `None` for `1.5`, `1.0`, `"1"` and `true`: only JSON integers pass (0 is
        // out of range, so a missing quantity is `invalid_quantity`).
        let quantity = value.get("quantity").and_then(Value::as_i64).unwrap_or(0);
        NewOrder::new(sku.to_owned(), quantity)
    }
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

/// Demo authentication: a fixed bearer token per tenant. A real app verifies a session or a
/// signed token; what matters is that the tenant comes from the server, never from a header
/// the client picks freely.
pub fn tenant_of(authorization: Option<&str>) -> Option<Tenant> {
    match authorization?.strip_prefix("Bearer ")? {
        "shop-a-token" => Some(Tenant::new("shop-a")),
        "shop-b-token" => Some(Tenant::new("shop-b")),
        _ => None,
    }
}
