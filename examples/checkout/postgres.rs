//! The checkout on PostgreSQL (`--database-url URL`, the tokio-postgres store): the orders,
//! the keys, the steps and the outbox in one database, which several instances of the
//! program may share. A local step's closure gets the step's `PostgresHandle` and
//! returns a future; the transaction lends its connection one borrow at a time.

use serde_json::Value;
use tower_idempotency::body::BoxError;
use tower_idempotency::outbox::{Enqueue, Outbox};

type PostgresOutbox = Outbox<PostgresStore>;
use tower_idempotency::steps::{StepError, StepStore, Steps};
use tower_idempotency::store::tokio_postgres::{PostgresHandle, PostgresStore};
use tower_idempotency::Tenant;

use super::{CheckoutStore, NewOrder};

/// The orders, next to the store's tables (the same columns as on SQLite).
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS checkout_orders (
    id           BIGSERIAL PRIMARY KEY,
    tenant_id    TEXT   NOT NULL,
    sku          TEXT   NOT NULL,
    quantity     BIGINT NOT NULL,
    amount_cents BIGINT NOT NULL,
    status       TEXT   NOT NULL CHECK (status IN ('pending', 'paid', 'declined')),
    charge_id    TEXT
);";

/// Connects to the database at `url`.
pub(crate) async fn connect(url: &str) -> Result<PostgresStore, BoxError> {
    PostgresStore::connect(url)
        .await
        .map_err(|error| format!("cannot open the store: {error}").into())
}

impl CheckoutStore for PostgresStore {
    async fn install(&self) -> Result<(), BoxError> {
        self.client().await?.batch_execute(SCHEMA).await?;
        self.install_steps().await?;
        PostgresOutbox::install(self).await?;
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
            .local("insert_order", move |tx: PostgresHandle| async move {
                let row = tx
                    .client()
                    .await?
                    .query_one(
                        "INSERT INTO checkout_orders \
                         (tenant_id, sku, quantity, amount_cents, status) \
                         VALUES ($1, $2, $3, $4, 'pending') RETURNING id",
                        &[&tenant_id, &order.sku, &order.quantity, &amount_cents],
                    )
                    .await?;
                Ok(row.try_get::<_, i64>(0)?)
            })
            .await
    }

    async fn mark_declined(steps: &Steps<Self>, order_id: i64) -> Result<(), StepError> {
        steps
            .local("mark_declined", move |tx: PostgresHandle| async move {
                tx.client()
                    .await?
                    .execute(
                        "UPDATE checkout_orders SET status = 'declined' WHERE id = $1",
                        &[&order_id],
                    )
                    .await?;
                Ok(())
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
            .local("mark_paid", move |tx: PostgresHandle| async move {
                tx.client()
                    .await?
                    .execute(
                        "UPDATE checkout_orders SET status = 'paid', charge_id = $1 \
                         WHERE id = $2",
                        &[&charge_id, &order_id],
                    )
                    .await?;
                // The borrow above has ended: the enqueue takes the connection next.
                tx.enqueue("order_paid", event).await?;
                Ok(())
            })
            .await
    }

    async fn find_order(
        &self,
        tenant: &Tenant,
        order_id: i64,
    ) -> Result<Option<(String, Option<String>)>, BoxError> {
        let row = self
            .client()
            .await?
            .query_opt(
                "SELECT status, charge_id FROM checkout_orders WHERE id = $1 AND tenant_id = $2",
                &[&order_id, &tenant.as_str()],
            )
            .await?;
        match row {
            Some(row) => Ok(Some((row.try_get(0)?, row.try_get(1)?))),
            None => Ok(None),
        }
    }
}
