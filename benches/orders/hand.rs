//! The hand-written baselines: the transaction a careful user writes without the layer, on the
//! same tables (`orders`, `outbox_events`, `idempotency_records`, created by the crate so the
//! schemas are identical) and with the same work per request: fingerprint the request as the
//! layer does, check the key, insert the order and its `order_created` event, save the
//! response (status, headers, body) in the record, commit; on an existing record compare the
//! fingerprint and replay.

use std::sync::LazyLock;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::Request;
use axum::http::header::{CONTENT_TYPE, LOCATION};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tower_idempotency::fingerprint::{Fingerprint, Fingerprinter};
use tower_idempotency::response::IDEMPOTENT_REPLAYED;
use tower_idempotency::store::sqlite::rusqlite::{self, params, Connection, OptionalExtension};
use tower_idempotency::store::sqlx_postgres::sqlx::postgres::PgPool;
use tower_idempotency::store::sqlx_postgres::sqlx::{self, Executor as _, Row as _};
use tower_idempotency::store::sqlx_sqlite::sqlx::sqlite::SqlitePool;
use tower_idempotency::store::tokio_postgres::deadpool_postgres::Pool;
use tower_idempotency::{Tenant, IDEMPOTENCY_KEY};

use crate::servers::{ApiError, NewOrder};
use crate::BoxError;

/// The layer's operation name for the route, so the records are alike.
pub(crate) const OPERATION: &str = "create_order";
/// How long a record lives (the layer's default retention).
const RETENTION_MS: i64 = 24 * 60 * 60 * 1000;
/// The largest body read (the layer's default limit is of the same order).
const BODY_LIMIT: usize = 1024 * 1024;

/// The route's fingerprint, as the layer of the orders example computes it.
static FINGERPRINTER: LazyLock<Fingerprinter> = LazyLock::new(Fingerprinter::json);

/// What the transaction needs from a request.
pub(crate) struct HandRequest {
    tenant: String,
    key: String,
    fingerprint: Fingerprint,
    order: NewOrder,
}

impl HandRequest {
    /// Reads the key, the body and the tenant, and fingerprints the request.
    pub(crate) async fn read(request: Request) -> Result<Self, ApiError> {
        let (parts, body) = request.into_parts();
        let tenant = parts
            .extensions
            .get::<Tenant>()
            .ok_or(ApiError::Unauthenticated)?
            .as_str()
            .to_owned();
        let key = parts
            .headers
            .get(IDEMPOTENCY_KEY)
            .and_then(|value| value.to_str().ok())
            .filter(|key| (1..=255).contains(&key.len()))
            .ok_or(ApiError::InvalidKeyOrSku)?
            .to_owned();
        let body = axum::body::to_bytes(body, BODY_LIMIT)
            .await
            .map_err(|_| ApiError::InvalidKeyOrSku)?;
        let fingerprint = FINGERPRINTER
            .fingerprint(&parts, &body)
            .map_err(|_| ApiError::InvalidKeyOrSku)?;
        let order = NewOrder::parse(&body)?;
        Ok(HandRequest {
            tenant,
            key,
            fingerprint,
            order,
        })
    }

    fn event(&self, order_id: i64) -> String {
        json!({
            "order_id": order_id,
            "tenant": self.tenant,
            "sku": self.order.sku,
            "quantity": self.order.quantity,
        })
        .to_string()
    }
}

/// What the transaction decided.
pub(crate) enum HandOutcome {
    Created {
        order_id: i64,
        headers: String,
        body: String,
    },
    Replay {
        status: i64,
        headers: String,
        body: Vec<u8>,
    },
    Mismatch,
}

impl HandOutcome {
    fn created(order_id: i64) -> Self {
        HandOutcome::Created {
            order_id,
            // Saved as the layer saves them: `[name, value]` pairs.
            headers: json!([
                ["location", format!("/orders/{order_id}")],
                ["content-type", "application/json"]
            ])
            .to_string(),
            body: json!({ "order_id": order_id }).to_string(),
        }
    }

    /// Whether a saved record replays (its fingerprint matches) or conflicts.
    fn existing(request: &HandRequest, version: i64, digest: &[u8], replay: Self) -> Self {
        let saved = u16::try_from(version)
            .ok()
            .zip(<[u8; 32]>::try_from(digest).ok())
            .map(|(version, digest)| Fingerprint::new(version, digest));
        match saved {
            Some(saved) if saved.matches(&request.fingerprint) => replay,
            _ => HandOutcome::Mismatch,
        }
    }
}

impl IntoResponse for HandOutcome {
    fn into_response(self) -> Response {
        match self {
            HandOutcome::Created { order_id, body, .. } => {
                let location = HeaderValue::try_from(format!("/orders/{order_id}"))
                    .expect("a path is a valid header value");
                (
                    StatusCode::CREATED,
                    [
                        (LOCATION, location),
                        (CONTENT_TYPE, HeaderValue::from_static("application/json")),
                    ],
                    body,
                )
                    .into_response()
            }
            HandOutcome::Replay {
                status,
                headers,
                body,
            } => {
                let status = u16::try_from(status)
                    .ok()
                    .and_then(|status| StatusCode::from_u16(status).ok())
                    .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                let mut response = (status, Bytes::from(body)).into_response();
                let saved: Vec<(String, String)> =
                    serde_json::from_str(&headers).unwrap_or_default();
                for (name, value) in saved {
                    if let (Ok(name), Ok(value)) =
                        (HeaderName::try_from(name), HeaderValue::try_from(value))
                    {
                        response.headers_mut().append(name, value);
                    }
                }
                response
                    .headers_mut()
                    .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
                response
            }
            HandOutcome::Mismatch => (
                StatusCode::UNPROCESSABLE_ENTITY,
                axum::Json(json!({ "error": "idempotency_key_reused" })),
            )
                .into_response(),
        }
    }
}

pub(crate) fn now_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as i64)
}

pub(crate) fn event_id() -> String {
    uuid::Uuid::now_v7().to_string()
}

// ---------------------------------------------------------------------------------------------
// SQLite
// ---------------------------------------------------------------------------------------------

const SQLITE_SELECT_RECORD: &str = "SELECT fingerprint_version, fingerprint, status, headers, \
     body FROM idempotency_records \
     WHERE tenant = ?1 AND operation = ?2 AND idempotency_key = ?3 AND expires_at > ?4";
const SQLITE_INSERT_ORDER: &str =
    "INSERT INTO orders (tenant_id, sku, quantity) VALUES (?1, ?2, ?3)";
pub(crate) const SQLITE_INSERT_EVENT: &str =
    "INSERT INTO outbox_events (event_id, topic, payload, status, \
     attempts, available_at, created_at) VALUES (?1, ?2, ?3, 'pending', 0, ?4, ?4)";
const SQLITE_INSERT_RECORD: &str = "INSERT INTO idempotency_records (tenant, operation, \
     idempotency_key, fingerprint, fingerprint_version, status, headers, body, trailers, \
     created_at, expires_at) VALUES (?1, ?2, ?3, ?4, ?5, 201, ?6, ?7, NULL, ?8, ?9)";

/// `BEGIN IMMEDIATE`; look up the key; insert the order, the event and the record; `COMMIT`.
/// Every statement is prepared once per connection (`prepare_cached`).
pub(crate) fn sqlite_transaction(
    conn: &mut Connection,
    request: &HandRequest,
) -> rusqlite::Result<HandOutcome> {
    let now = now_millis();
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let existing = tx
        .prepare_cached(SQLITE_SELECT_RECORD)?
        .query_row(
            params![request.tenant, OPERATION, request.key, now],
            |row| {
                Ok((
                    row.get::<_, i64>(0)?,
                    row.get::<_, Vec<u8>>(1)?,
                    row.get::<_, i64>(2)?,
                    row.get::<_, String>(3)?,
                    row.get::<_, Vec<u8>>(4)?,
                ))
            },
        )
        .optional()?;
    if let Some((version, digest, status, headers, body)) = existing {
        // Nothing written: dropping `tx` rolls back.
        let replay = HandOutcome::Replay {
            status,
            headers,
            body,
        };
        return Ok(HandOutcome::existing(request, version, &digest, replay));
    }
    tx.prepare_cached(SQLITE_INSERT_ORDER)?.execute(params![
        request.tenant,
        request.order.sku,
        request.order.quantity
    ])?;
    let order_id = tx.last_insert_rowid();
    tx.prepare_cached(SQLITE_INSERT_EVENT)?.execute(params![
        event_id(),
        "order_created",
        request.event(order_id),
        now
    ])?;
    let outcome = HandOutcome::created(order_id);
    if let HandOutcome::Created { headers, body, .. } = &outcome {
        tx.prepare_cached(SQLITE_INSERT_RECORD)?.execute(params![
            request.tenant,
            OPERATION,
            request.key,
            &request.fingerprint.digest()[..],
            request.fingerprint.version(),
            headers,
            body.as_bytes(),
            now,
            now + RETENTION_MS,
        ])?;
    }
    tx.commit()?;
    Ok(outcome)
}

/// The order's insert of the sqlx SQLite cases (QA, QH), as `examples/orders_sqlx_sqlite.rs`
/// writes it: the id comes back with the row.
pub(crate) const SQLITE_INSERT_ORDER_RETURNING: &str =
    "INSERT INTO orders (tenant_id, sku, quantity) VALUES (?1, ?2, ?3) RETURNING id";

/// [`sqlite_transaction`] written with sqlx on its `SqlitePool` (the file of the sqlx SQLite
/// store, whose records and outbox tables the statements fit): `BEGIN IMMEDIATE` through
/// `Pool::begin_with`, the same statements but the order's insert, which returns the id as
/// the sqlx example's does (sqlx prepares each statement once per connection), `COMMIT`.
pub(crate) async fn sqlx_sqlite_transaction(
    pool: &SqlitePool,
    request: &HandRequest,
) -> Result<HandOutcome, BoxError> {
    let now = now_millis();
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
    let select = sqlx::query(SQLITE_SELECT_RECORD)
        .bind(&request.tenant)
        .bind(OPERATION)
        .bind(&request.key)
        .bind(now);
    if let Some(row) = (&mut *tx).fetch_optional(select).await? {
        let version: i64 = row.try_get(0)?;
        let digest: Vec<u8> = row.try_get(1)?;
        let replay = HandOutcome::Replay {
            status: row.try_get(2)?,
            headers: row.try_get(3)?,
            body: row.try_get(4)?,
        };
        tx.rollback().await?;
        return Ok(HandOutcome::existing(request, version, &digest, replay));
    }
    let insert_order = sqlx::query(SQLITE_INSERT_ORDER_RETURNING)
        .bind(&request.tenant)
        .bind(&request.order.sku)
        .bind(request.order.quantity);
    let order_id: i64 = (&mut *tx).fetch_one(insert_order).await?.try_get(0)?;
    let insert_event = sqlx::query(SQLITE_INSERT_EVENT)
        .bind(event_id())
        .bind("order_created")
        .bind(request.event(order_id))
        .bind(now);
    (&mut *tx).execute(insert_event).await?;
    let outcome = HandOutcome::created(order_id);
    if let HandOutcome::Created { headers, body, .. } = &outcome {
        let insert_record = sqlx::query(SQLITE_INSERT_RECORD)
            .bind(&request.tenant)
            .bind(OPERATION)
            .bind(&request.key)
            .bind(&request.fingerprint.digest()[..])
            .bind(i64::from(request.fingerprint.version()))
            .bind(headers.as_str())
            .bind(body.as_bytes())
            .bind(now)
            .bind(now + RETENTION_MS);
        (&mut *tx).execute(insert_record).await?;
    }
    tx.commit().await?;
    Ok(outcome)
}

// ---------------------------------------------------------------------------------------------
// PostgreSQL
// ---------------------------------------------------------------------------------------------

const PG_RESERVE: &str = "INSERT INTO idempotency_records \
     (tenant, operation, idempotency_key, state, created_at, expires_at) \
     VALUES ($1, $2, $3, 'in_progress', $4, $4) ON CONFLICT DO NOTHING";
const PG_SELECT_RECORD: &str = "SELECT fingerprint_version, fingerprint, status, headers, body \
     FROM idempotency_records WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3";
const PG_INSERT_ORDER: &str =
    "INSERT INTO orders (tenant_id, sku, quantity) VALUES ($1, $2, $3) RETURNING id";
const PG_INSERT_EVENT: &str = "INSERT INTO outbox_events (event_id, topic, payload, status, \
     attempts, available_at, created_at) VALUES ($1, $2, $3, 'pending', 0, $4, $4)";
const PG_COMPLETE_RECORD: &str = "UPDATE idempotency_records SET state = 'completed', \
     fingerprint = $4, fingerprint_version = $5, status = 201, headers = $6, body = $7, \
     created_at = $8, expires_at = $9 \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3";

/// `BEGIN`; reserve the key (`INSERT ... ON CONFLICT DO NOTHING`: a concurrent duplicate waits
/// on the key until this commits); on a conflict read the record and compare; insert the order
/// (`RETURNING id`) and the event; complete the record; `COMMIT`. Statements are prepared once
/// per pooled connection.
pub(crate) async fn postgres_transaction(
    pool: &Pool,
    request: &HandRequest,
) -> Result<HandOutcome, BoxError> {
    let now = now_millis();
    let mut client = pool.get().await?;
    let tx = client.transaction().await?;
    let reserve = tx.prepare_cached(PG_RESERVE).await?;
    let reserved = tx
        .execute(&reserve, &[&request.tenant, &OPERATION, &request.key, &now])
        .await?;
    if reserved == 0 {
        let select = tx.prepare_cached(PG_SELECT_RECORD).await?;
        let row = tx
            .query_one(&select, &[&request.tenant, &OPERATION, &request.key])
            .await?;
        let version: i32 = row.try_get(0)?;
        let digest: Vec<u8> = row.try_get(1)?;
        let status: i32 = row.try_get(2)?;
        let replay = HandOutcome::Replay {
            status: i64::from(status),
            headers: row.try_get(3)?,
            body: row.try_get(4)?,
        };
        tx.rollback().await?;
        return Ok(HandOutcome::existing(
            request,
            i64::from(version),
            &digest,
            replay,
        ));
    }
    let insert_order = tx.prepare_cached(PG_INSERT_ORDER).await?;
    let order_id: i64 = tx
        .query_one(
            &insert_order,
            &[&request.tenant, &request.order.sku, &request.order.quantity],
        )
        .await?
        .try_get(0)?;
    let insert_event = tx.prepare_cached(PG_INSERT_EVENT).await?;
    tx.execute(
        &insert_event,
        &[
            &event_id(),
            &"order_created",
            &request.event(order_id),
            &now,
        ],
    )
    .await?;
    let outcome = HandOutcome::created(order_id);
    if let HandOutcome::Created { headers, body, .. } = &outcome {
        let complete = tx.prepare_cached(PG_COMPLETE_RECORD).await?;
        tx.execute(
            &complete,
            &[
                &request.tenant,
                &OPERATION,
                &request.key,
                &&request.fingerprint.digest()[..],
                &i32::from(request.fingerprint.version()),
                headers,
                &body.as_bytes(),
                &now,
                &(now + RETENTION_MS),
            ],
        )
        .await?;
    }
    tx.commit().await?;
    Ok(outcome)
}

/// [`postgres_transaction`] written with sqlx on its `PgPool`: the same statements in the same
/// order (sqlx prepares each once per connection), `BEGIN` and `COMMIT` through
/// `sqlx::Transaction`.
pub(crate) async fn sqlx_transaction(
    pool: &PgPool,
    request: &HandRequest,
) -> Result<HandOutcome, BoxError> {
    let now = now_millis();
    let mut tx = pool.begin().await?;
    let reserve = sqlx::query(PG_RESERVE)
        .bind(&request.tenant)
        .bind(OPERATION)
        .bind(&request.key)
        .bind(now);
    if (&mut *tx).execute(reserve).await?.rows_affected() == 0 {
        let select = sqlx::query(PG_SELECT_RECORD)
            .bind(&request.tenant)
            .bind(OPERATION)
            .bind(&request.key);
        let row = (&mut *tx).fetch_one(select).await?;
        let version: i32 = row.try_get(0)?;
        let digest: Vec<u8> = row.try_get(1)?;
        let status: i32 = row.try_get(2)?;
        let replay = HandOutcome::Replay {
            status: i64::from(status),
            headers: row.try_get(3)?,
            body: row.try_get(4)?,
        };
        tx.rollback().await?;
        return Ok(HandOutcome::existing(
            request,
            i64::from(version),
            &digest,
            replay,
        ));
    }
    let insert_order = sqlx::query(PG_INSERT_ORDER)
        .bind(&request.tenant)
        .bind(&request.order.sku)
        .bind(request.order.quantity);
    let order_id: i64 = (&mut *tx).fetch_one(insert_order).await?.try_get(0)?;
    let insert_event = sqlx::query(PG_INSERT_EVENT)
        .bind(event_id())
        .bind("order_created")
        .bind(request.event(order_id))
        .bind(now);
    (&mut *tx).execute(insert_event).await?;
    let outcome = HandOutcome::created(order_id);
    if let HandOutcome::Created { headers, body, .. } = &outcome {
        let complete = sqlx::query(PG_COMPLETE_RECORD)
            .bind(&request.tenant)
            .bind(OPERATION)
            .bind(&request.key)
            .bind(&request.fingerprint.digest()[..])
            .bind(i32::from(request.fingerprint.version()))
            .bind(headers.as_str())
            .bind(body.as_bytes())
            .bind(now)
            .bind(now + RETENTION_MS);
        (&mut *tx).execute(complete).await?;
    }
    tx.commit().await?;
    Ok(outcome)
}
