//! The same order service on PostgreSQL (`--database-url postgres://...`): orders and
//! idempotency records live in one database, so several instances of this program can serve
//! the same shop and a duplicate sent to two of them still creates one order. Each order's
//! `order_created` event commits with it in `outbox_events`; with `--webhook URL` a relay
//! delivers them, and relays in several instances never deliver one event at the same time.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::middleware;
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde_json::{json, Value};
use tower_idempotency::extract::Tx;
use tower_idempotency::outbox::postgres::{enqueue, PostgresOutbox};
use tower_idempotency::outbox::Relay;
use tower_idempotency::store::continuously_purge_expired;
use tower_idempotency::store::postgres::{PostgresStore, PostgresTransaction};
use tower_idempotency::Tenant;

use super::{
    authenticate, created, idempotency, order_created, serve_app, webhook_sink, ApiError, BoxError,
    NewOrder,
};

/// The business table, next to `idempotency_records` (which the store creates).
const ORDERS_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS orders (
    id        BIGSERIAL PRIMARY KEY,
    tenant_id TEXT   NOT NULL,
    sku       TEXT   NOT NULL,
    quantity  BIGINT NOT NULL
);";

/// Serves the order API on `addr`, with PostgreSQL at `url` for orders, records and events;
/// with `webhook`, a relay delivers the events there.
pub(crate) async fn serve(
    addr: &str,
    url: &str,
    webhook: Option<&str>,
    ietf: bool,
) -> Result<(), BoxError> {
    let store = PostgresStore::connect(url)
        .await
        .map_err(|error| format!("cannot open the store: {error}"))?;
    store.client().await?.batch_execute(ORDERS_SCHEMA).await?;
    let outbox = PostgresOutbox::install(&store).await?;
    if let Some(url) = webhook {
        // Claims are leased: every instance may run a relay.
        tokio::spawn(Relay::new(outbox, webhook_sink(url)?).run());
    }
    // Every instance may run this: the purge skips rows another instance is deleting.
    tokio::spawn(continuously_purge_expired(
        store.clone(),
        Duration::from_secs(60),
        1000,
    ));

    let (listener, local) = crate::cli::listen(addr).await?;
    // The URL is not printed: it may carry a password.
    println!("listening on http://{local} (database PostgreSQL)");
    serve_app(listener, app(store, ietf), webhook, ietf).await
}

fn app(store: PostgresStore, ietf: bool) -> Router {
    Router::new()
        .route(
            "/orders",
            post(create_order).layer(idempotency(store.clone(), ietf)),
        )
        .route("/orders/{id}", get(get_order))
        .layer(middleware::from_fn(authenticate))
        .with_state(store)
}

/// `POST /orders`: the order row and its `order_created` event go through the request's
/// transaction, so they commit together with the saved `201`, or not at all.
async fn create_order(
    Extension(tenant): Extension<Tenant>,
    Tx(tx): Tx<PostgresTransaction>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let order = NewOrder::from_json(&body).map_err(ApiError::Invalid)?;
    let client = tx.client().await.map_err(internal)?;
    let insert = client
        .prepare_cached(
            "INSERT INTO orders (tenant_id, sku, quantity) VALUES ($1, $2, $3) RETURNING id",
        )
        .await
        .map_err(internal)?;
    let order_id: i64 = client
        .query_one(&insert, &[&tenant.as_str(), &order.sku, &order.quantity])
        .await
        .and_then(|row| Ok(row.try_get(0)?))
        .map_err(internal)?;
    // Reserving stock is another service's job: the event commits with the order, and the
    // relay delivers it once the order is durable.
    let event = order_created(order_id, &tenant, &order);
    enqueue(&client, "order_created", &event)
        .await
        .map_err(internal)?;
    Ok(created(order_id))
}

/// `GET /orders/{id}`: the caller's own order; another tenant's is a 404.
async fn get_order(
    State(store): State<PostgresStore>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let order_id: i64 = id.parse().map_err(|_| ApiError::NotFound)?;
    let client = store.client().await.map_err(internal)?;
    let row = client
        .query_opt(
            "SELECT sku, quantity FROM orders WHERE id = $1 AND tenant_id = $2",
            &[&order_id, &tenant.as_str()],
        )
        .await
        .map_err(internal)?
        .ok_or(ApiError::NotFound)?;
    let sku: String = row.try_get(0).map_err(internal)?;
    let quantity: i64 = row.try_get(1).map_err(internal)?;
    Ok(Json(
        json!({ "order_id": order_id, "sku": sku, "quantity": quantity }),
    ))
}

fn internal(error: impl std::fmt::Display) -> ApiError {
    tracing::error!(%error, "database error");
    ApiError::Internal
}
