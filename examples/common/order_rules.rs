//! What makes an order valid, and who places it: the same rules and error codes in every order
//! example, on every store (HTTP and gRPC). Needs no database. Included by `order_table.rs`
//! (the SQLite examples) and `sqlx_app.rs` (the sqlx examples).

// Not every example uses every item.
#![allow(dead_code)]

use serde_json::Value;
use tower_idempotency::Tenant;

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
