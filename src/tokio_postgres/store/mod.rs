#![doc = include_str!("../../docs/postgres.md")]

/// The deadpool-postgres version of the store's pools: depend on it through this re-export.
pub use deadpool_postgres;
/// The tokio-postgres version of the transaction handle: depend on it through this re-export.
pub use tokio_postgres;

use crate::store::Isolation;
#[cfg_attr(not(feature = "outbox"), allow(unused_imports))]
pub(crate) use handle::Executor;
pub use handle::{CheckedClient, PostgresHandle};
pub use options::PostgresOptions;
pub(crate) use reservation::PostgresReservation;
pub use store::PostgresStore;

// What runs where: `options` (settings, connecting), `migrate` (installing tables), `store`
// (the store and its calls), `lookups` (the replay checks, batched under load), `reservation` (reserving a key, commit and rollback), `slot`
// (a transaction's connection and shared state), `handle` (the handler's handle and its
// guarded client), `src/postgres/guard.rs` (refusing transaction control), `owned` (the inbox's own
// transactions). The SQL the store runs is in `src/postgres/store_sql.rs`.
mod handle;
mod lookups;
pub(crate) mod migrate;
mod options;
mod reservation;
mod slot;
// `store.rs` holds `PostgresStore` itself; the folder is the driver's store module.
#[allow(clippy::module_inception)]
mod store;

mod owned;

// The SQL the store runs, shared with the sqlx store.
use crate::postgres::store_sql::{
    COMPLETE_RECORD, INSERT_RESERVATION, MIGRATION_LOCK, PURGE_EXPIRED, SCHEMA, SELECT_LIVE_RECORD,
    SELECT_RECORD, TAKE_OVER,
};

#[cfg(test)]
mod tests;
