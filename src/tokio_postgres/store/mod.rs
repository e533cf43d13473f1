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

// What runs where: `options` (settings, connecting), `migrate` (installing tables), `store` (the
// store and its calls), `lookups` (the replay checks, batched under load), `reservation` (reserving
// a key, commit and rollback), `slot` (a transaction's connection and shared state), `handle` (the
// handler's handle and its guarded client), `src/postgres/guard.rs` (refusing transaction control),
// `owned` (the inbox's own transactions), `statements` (prepared and cached, or unnamed behind a
// transaction pooler). The SQL the store runs is in `src/postgres/store_sql.rs`.
//
// A request for a new key, from the replay check (`store`, `lookups`) to the commit
// (`reservation`):
//
// 1. **The replay check**: a plain `SELECT` of a live completed record, in autocommit, on a
//    separate pool of read connections: no locks, and no waiting for the connections that writers
//    hold (past `PostgresOptions::with_read_wait` the request takes the write path). A reservation
//    that is not committed is invisible to it. It is skipped while retries are rare among recent
//    requests: the reservation then finds a completed record itself, and one that waits for a
//    transaction connection twice as long as they have lately waited reads meanwhile
//    (`ReplayCheck::Adaptive`, the default).
// 2. **The reservation**: a connection from the pool of request transactions, then `BEGIN` (at the
//    `Isolation` level, with `SET LOCAL lock_timeout`) and an `INSERT ... ON CONFLICT DO NOTHING`
//    of an `in_progress` row, sent together in one flight. A duplicate (from this instance or
//    another) blocks on that index entry until the first transaction ends: after a commit it reads
//    the completed record, rolls back and replays it; after a rollback its own insert goes through
//    and it runs the handler. An expired record (or a stray reservation) is taken over with an
//    `UPDATE`. Requests with different keys never wait for each other. Serialization failures and
//    deadlocks while reserving are retried a bounded number of times
//    (`PostgresOptions::with_serialization_retries`).
// 3. **The handler's statements** go through `PostgresHandle`, on the same connection in the same
//    transaction. The handle refuses transaction control (`COMMIT`, `ROLLBACK`, `BEGIN`...), so a
//    handler cannot commit its rows without the record; a serialization failure or deadlock that
//    one of its statements gets is reported to the layer, which runs the request again.
// 4. **The commit**, before the response leaves: the `UPDATE` that turns the reservation row into
//    the completed record and `COMMIT`, sent together in one flight. The `UPDATE` finds the row by
//    the `ctid` the reservation returned, and completes it only if the row's `xmin` is the current
//    transaction (the one `begin` opened, not one that a `COMMIT` or `ROLLBACK` behind the layer's
//    back left in its place); otherwise it fails, the transaction is aborted, PostgreSQL answers
//    the `COMMIT` with a `ROLLBACK`, and the commit reports `Error::TransactionAborted`.
mod handle;
mod lookups;
pub(crate) mod migrate;
mod options;
mod reservation;
mod slot;
pub(crate) mod statements;
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
