//! The checkout on SQLite (`--db FILE`): the orders, the keys, the steps and the outbox in
//! one file. A local step's closure gets the step's `rusqlite::Transaction` and runs on the
//! store's writer thread.

use std::path::Path;

use serde_json::Value;
use tower_idempotency::body::BoxError;
use tower_idempotency::outbox::Outbox;

type SqliteOutbox = Outbox<SqliteStore>;
use tower_idempotency::steps::{StepError, StepStore, Steps};
use tower_idempotency::store::sqlite::rusqlite::{self, OptionalExtension};
use tower_idempotency::store::sqlite::SqliteStore;
use tower_idempotency::Tenant;

use super::{CheckoutStore, NewOrder};

/// The orders, next to the store's tables: step 1 and step 3 write them in the steps'
/// transactions.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS checkout_orders (
    id           INTEGER PRIMARY KEY,
    tenant_id    TEXT    NOT NULL,
    sku          TEXT    NOT NULL,
    quantity     INTEGER NOT NULL,
    amount_cents INTEGER NOT NULL,
    status       TEXT    NOT NULL CHECK (status IN ('pending', 'paid', 'declined')),
    charge_id    TEXT
);";

/// Opens (or creates) the store's file.
pub(crate) async fn open(path: &Path) -> Result<SqliteStore, BoxError> {
    SqliteStore::open(path)
        .await
        .map_err(|error| format!("cannot open {}: {error}", path.display()).into())
}

impl CheckoutStore for SqliteStore {
    async fn install(&self) -> Result<(), BoxError> {
        self.write(|tx| tx.execute_batch(SCHEMA)).await?;
        self.install_steps().await?;
        SqliteOutbox::install(self).await?;
        Ok(())
    }

    async fn insert_order(
        steps: &Steps<Self>,
        tenant: &Tenant,
        order: NewOrder,
        amount_cents: i64,
    ) -> Result<i64, StepError> {
        let tenant_id = tenant.as_str().to_owned();
        steps
            .local("insert_order", move |tx| {
                tx.execute(
                    "INSERT INTO checkout_orders \
                     (tenant_id, sku, quantity, amount_cents, status) \
                     VALUES (?1, ?2, ?3, ?4, 'pending')",
                    rusqlite::params![tenant_id, order.sku, order.quantity, amount_cents],
                )?;
                Ok(tx.last_insert_rowid())
            })
            .await
    }

    async fn mark_declined(steps: &Steps<Self>, order_id: i64) -> Result<(), StepError> {
        steps
            .local("mark_declined", move |tx| {
                tx.execute(
                    "UPDATE checkout_orders SET status = 'declined' WHERE id = ?1",
                    [order_id],
                )
                .map(drop)
            })
            .await
    }

    async fn mark_paid(
        steps: &Steps<Self>,
        order_id: i64,
        charge_id: String,
        event: Value,
    ) -> Result<(), StepError> {
        steps
            .local("mark_paid", move |tx| {
                tx.execute(
                    "UPDATE checkout_orders SET status = 'paid', charge_id = ?1 WHERE id = ?2",
                    rusqlite::params![charge_id, order_id],
                )?;
                SqliteOutbox::enqueue_in(tx, "order_paid", &event).map(drop)
            })
            .await
    }

    async fn find_order(
        &self,
        tenant: &Tenant,
        order_id: i64,
    ) -> Result<Option<(String, Option<String>)>, BoxError> {
        let tenant_id = tenant.as_str().to_owned();
        let found = self
            .read(move |conn| {
                conn.query_row(
                    "SELECT status, charge_id FROM checkout_orders \
                     WHERE id = ?1 AND tenant_id = ?2",
                    rusqlite::params![order_id, tenant_id],
                    |row| Ok((row.get(0)?, row.get(1)?)),
                )
                .optional()
            })
            .await?;
        Ok(found)
    }
}
