//! The same order service on PostgreSQL (`--database-url postgres://...`): orders and
//! idempotency records live in one database, so several instances of this program can serve
//! the same shop and a duplicate sent to two of them still creates one order. Each order's
//! `order_created` event commits with it in `outbox_events`; with `--webhook URL` a relay
//! delivers them, and relays in several instances never deliver one event at the same time.

use std::time::Duration;

use tower_idempotency::body::BoxError;
type PostgresOutbox =
    tower_idempotency::outbox::Outbox<tower_idempotency::store::tokio_postgres::PostgresStore>;
use tower_idempotency::store::continuously_purge_expired;
use tower_idempotency::store::tokio_postgres::{PostgresHandle, PostgresStore};
use tower_idempotency::Tenant;

use crate::app::order_table::NewOrder;
use crate::app::{app, DbResult, OrderDatabase, OrderHandle};
use crate::{server, webhook};

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
        webhook::spawn_relay(outbox, url)?;
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
    server::serve(listener, app(store, ietf), webhook, ietf).await
}

/// The orders live in the store's database.
impl OrderDatabase for PostgresStore {
    type Handle = PostgresHandle;

    async fn find(&self, tenant: &Tenant, id: i64) -> DbResult<Option<(String, i64)>> {
        let client = self.client().await?;
        let row = client
            .query_opt(
                "SELECT sku, quantity FROM orders WHERE id = $1 AND tenant_id = $2",
                &[&id, &tenant.as_str()],
            )
            .await?;
        match row {
            Some(row) => Ok(Some((row.try_get(0)?, row.try_get(1)?))),
            None => Ok(None),
        }
    }
}

/// The transaction lends its connection, one borrow at a time: dropped here, before the
/// handler enqueues the event.
impl OrderHandle for PostgresHandle {
    async fn insert_order(&self, tenant: &Tenant, order: &NewOrder) -> DbResult<i64> {
        let client = self.client().await?;
        let insert = client
            .prepare_cached(
                "INSERT INTO orders (tenant_id, sku, quantity) VALUES ($1, $2, $3) RETURNING id",
            )
            .await?;
        let row = client
            .query_one(&insert, &[&tenant.as_str(), &order.sku, &order.quantity])
            .await?;
        Ok(row.try_get(0)?)
    }
}
