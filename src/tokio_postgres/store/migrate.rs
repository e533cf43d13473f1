//! Installing tables: [`install_schema`] creates them in one transaction under an advisory
//! lock (the store's `idempotency_records` when it connects, the outbox's and the inbox's
//! tables when they are installed), and upgrades a table of an older layout.

use super::{PostgresStore, MIGRATION_LOCK, SCHEMA};
use crate::error::Error;
use crate::postgres::store_sql::{Upgrade, ADD_STATE, HAS_COLUMN};

/// Creates tables (`schema`: `CREATE ... IF NOT EXISTS` statements) in one transaction under a
/// transaction-level advisory lock (`lock`, the same in every instance), so that instances
/// starting at the same time do not race on PostgreSQL's catalog; then makes the `upgrades`
/// whose column is missing, in the same transaction.
pub(crate) async fn install_schema(
    store: &PostgresStore,
    lock: i64,
    schema: &str,
    upgrades: &[Upgrade],
) -> Result<(), Error> {
    let mut client = store.client().await?;
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&lock])
        .await?;
    tx.batch_execute(schema).await?;
    for upgrade in upgrades {
        let has_column: bool = tx
            .query_one(HAS_COLUMN, &[&upgrade.table, &upgrade.column])
            .await?
            .try_get(0)?;
        if !has_column {
            tracing::info!(
                "migrating {}: adding the column {}",
                upgrade.table,
                upgrade.column
            );
            tx.batch_execute(upgrade.statement).await?;
        }
    }
    tx.commit().await?;
    Ok(())
}

impl PostgresStore {
    /// Creates `idempotency_records` if it is missing, and brings a table of the SQLite
    /// layout (no `state`) to this store's, under an advisory lock (instances that run it at
    /// the same time take turns). Connecting does it unless
    /// [`with_create_schema(false)`](super::PostgresOptions::with_create_schema); call it yourself to
    /// migrate when you choose (a deploy step, say). Running it again changes nothing.
    pub async fn migrate(&self) -> Result<(), Error> {
        install_schema(self, MIGRATION_LOCK, SCHEMA, &[ADD_STATE]).await
    }
}
