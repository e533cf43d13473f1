//! Records and scopes for the stores' white-box tests.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::StatusCode;

use crate::fingerprint::Fingerprint;
#[cfg(feature = "_postgres-dialect")]
use crate::key::IdempotencyKey;
use crate::response::SavedResponse;
#[cfg(feature = "_postgres-dialect")]
use crate::store::Scope;
use crate::store::{NewRecord, StoredRecord};

/// `key` of `tenant` on the operation `create_order`.
#[cfg(feature = "_postgres-dialect")]
pub(crate) fn tenant_scope(tenant: &str, key: &str) -> Scope {
    Scope {
        tenant: tenant.into(),
        operation: "create_order".into(),
        key: IdempotencyKey::parse(key.as_bytes(), 128).expect("key"),
    }
}

/// `key` of the tenant `shop`.
#[cfg(feature = "_postgres-dialect")]
pub(crate) fn scope(key: &str) -> Scope {
    tenant_scope("shop", key)
}

/// A `201` with the body `{}`, saved now for an hour.
pub(crate) fn record() -> NewRecord {
    let now = SystemTime::now();
    NewRecord {
        fingerprint: Fingerprint::new(2, [7; 32]),
        response: SavedResponse {
            status: StatusCode::CREATED,
            headers: Vec::new(),
            body: Bytes::from_static(b"{}"),
            trailers: None,
        },
        created_at: now,
        expires_at: now + Duration::from_secs(3600),
    }
}

/// [`record`] as a store reads it back.
pub(crate) fn stored_record() -> StoredRecord {
    let record = record();
    StoredRecord::new(
        record.fingerprint,
        record.response,
        record.created_at,
        record.expires_at,
    )
}
