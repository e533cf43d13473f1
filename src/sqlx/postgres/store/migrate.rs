//! Installing tables: [`install_schema`](SqlxPostgresStore::install_schema) creates them in one
//! transaction under an advisory lock (`idempotency_records` when the application calls
//! [`migrate`](SqlxPostgresStore::migrate), the outbox's and the inbox's tables when they are
//! installed), and upgrades a table of an older layout.

// The `Executor` methods keep these futures provably `Send` (see `reservation.rs`).
use sqlx::{Executor as _, Row as _};

use super::SqlxPostgresStore;
use crate::error::Error;
use crate::postgres::store_sql::{Upgrade, ADD_STATE, HAS_COLUMN, MIGRATION_LOCK, SCHEMA};
use crate::sqlx::driver::our_sql;
use crate::sqlx::store::pool_error;

impl SqlxPostgresStore {
    /// Creates `idempotency_records` if it is missing (the crate's migration file, run under
    /// an advisory lock so that instances starting together do not race), and brings a table
    /// of the SQLite layout (no `state` column) to the current one. Safe to run at every start,
    /// and before or after `sqlx migrate run` of the same file.
    pub async fn migrate(&self) -> Result<(), Error> {
        self.install_schema(MIGRATION_LOCK, SCHEMA, &[ADD_STATE])
            .await
    }

    /// Creates tables (`schema`: `CREATE ... IF NOT EXISTS` statements) in one transaction
    /// under a transaction-level advisory lock (`lock`, the same in every instance), then makes
    /// the `upgrades` whose column is missing, in the same transaction.
    pub(crate) async fn install_schema(
        &self,
        lock: i64,
        schema: &str,
        upgrades: &[Upgrade],
    ) -> Result<(), Error> {
        // Prepared once per connection, unless the store keeps no statement prepared (behind a
        // transaction pooler, the next transaction may run on another server connection).
        let persistent = !self.shared.unnamed_statements;
        let mut tx = self.pool().begin().await.map_err(pool_error)?;
        let lock = sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(lock);
        (&mut *tx).execute(lock.persistent(persistent)).await?;
        (&mut *tx).execute(sqlx::raw_sql(our_sql(schema))).await?;
        for upgrade in upgrades {
            let check = sqlx::query(HAS_COLUMN)
                .bind(upgrade.table)
                .bind(upgrade.column)
                .persistent(persistent);
            let has_column: bool = (&mut *tx).fetch_one(check).await?.try_get(0)?;
            if !has_column {
                tracing::info!(
                    "migrating {}: adding the column {}",
                    upgrade.table,
                    upgrade.column
                );
                (&mut *tx).execute(sqlx::raw_sql(upgrade.statement)).await?;
            }
        }
        tx.commit().await?;
        Ok(())
    }
}
