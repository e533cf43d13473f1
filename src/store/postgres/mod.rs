//! The PostgreSQL store: several app instances, one truth.
//!
//! Every instance of a service talks to the same database, and the primary key of
//! `idempotency_records` decides which request runs the handler. A request for a new key goes
//! through four steps, each one round trip apart from the handler's own statements:
//!
//! 1. **The replay check**: a plain `SELECT` of a live completed record, in autocommit, on a
//!    separate pool of read connections: no locks, and no waiting for the connections that
//!    writers hold (past [`PostgresOptions::read_wait`] the request takes the write path). A
//!    reservation that is not committed is invisible to it.
//! 2. **The reservation**: a connection from the pool of request transactions, then `BEGIN`
//!    (at the [`Isolation`] level, with `SET LOCAL lock_timeout`) and an `INSERT ... ON
//!    CONFLICT DO NOTHING` of an `in_progress` row, sent together in one flight. A duplicate
//!    (from this instance or another) blocks on that index entry until the first transaction
//!    ends: after a commit it reads the completed record, rolls back and replays it; after a
//!    rollback its own insert goes through and it runs the handler. An expired record (or a
//!    stray reservation) is taken over with an `UPDATE`. Requests with different keys never
//!    wait for each other. Serialization failures and deadlocks while reserving are retried a
//!    bounded number of times ([`PostgresOptions::serialization_retries`]).
//! 3. **The handler's statements** go through [`PostgresTransaction`], on the same connection
//!    in the same transaction. The handle refuses transaction control (`COMMIT`, `ROLLBACK`,
//!    `BEGIN`...), so a handler cannot commit its rows without the record; a serialization
//!    failure or deadlock that one of its statements gets is reported to the layer, which runs
//!    the request again.
//! 4. **The commit**, before the response leaves: the `UPDATE` that turns the reservation row
//!    into the completed record and `COMMIT`, sent together in one flight. The `UPDATE` finds
//!    the row by the `ctid` the reservation returned, and completes it only if the row's
//!    `xmin` is the current transaction (the one `begin` opened, not one that a `COMMIT` or
//!    `ROLLBACK` behind the layer's back left in its place); otherwise it fails, the
//!    transaction is aborted, PostgreSQL answers the `COMMIT` with a `ROLLBACK`, and the commit
//!    reports [`Error::TransactionAborted`](crate::Error::TransactionAborted).
//!
//! - **Waits are bounded**: taking a pooled connection and every lock wait (`SET LOCAL
//!   lock_timeout`) share the layer's lock timeout; past it the request gets `503` with
//!   `Retry-After`.
//! - **Rollback on drop**: `Drop` cannot await a `ROLLBACK`, so a transaction dropped while still
//!   open (the client went away, the request future was dropped) takes its connection out of
//!   the pool and closes it; PostgreSQL rolls back a transaction whose connection is gone. The
//!   explicit paths (`commit`, `rollback`, failures) send `ROLLBACK` and keep the connection.
//!
//! Needs PostgreSQL 13 or later (`pg_current_xact_id`).
//!
//! # Connecting
//!
//! [`PostgresStore::connect`] takes a URL; [`PostgresStore::builder`] takes a
//! [`tokio_postgres::Config`] and [options](PostgresOptions), and builds the store's two pools.
//! To share a pool your app already has, [`PostgresStore::from_pool`] takes a
//! [`deadpool_postgres::Pool`] (of the version this module re-exports): request transactions
//! and replays take their connections from it, unless replays get a pool of their own
//! ([`PostgresOptions::read_pool`]). Either way, `connect` creates `idempotency_records` (or
//! migrates a table of the SQLite layout) under an advisory lock, so that instances starting
//! together do not collide; with [`create_schema(false)`](PostgresOptions::create_schema) it
//! changes nothing in the database and only checks that it gets a connection, and
//! [`PostgresStore::migrate`] does the same installation when you choose.
//!
//! ```no_run
//! # async fn run(pool: tower_idempotency::store::postgres::deadpool_postgres::Pool)
//! #     -> Result<(), tower_idempotency::Error> {
//! use tower_idempotency::store::postgres::{Isolation, PostgresStore};
//!
//! // Creates (or migrates) `idempotency_records` in the connection's schema.
//! let store = PostgresStore::connect("postgres://app@127.0.0.1/shop").await?;
//!
//! // Bigger pools, and SERIALIZABLE transactions for handlers that need them:
//! let config = "postgres://app@127.0.0.1/shop".parse()?;
//! let store = PostgresStore::builder(config)
//!     .max_connections(32)
//!     .isolation(Isolation::Serializable)
//!     .connect()
//!     .await?;
//!
//! // The app's own pool, migrated as a step of its own:
//! let store = PostgresStore::from_pool(pool)
//!     .create_schema(false)
//!     .connect()
//!     .await?;
//! store.migrate().await?;
//! # Ok(()) }
//! ```
//!
//! Tables are unqualified: they live in the first schema of the connection's `search_path`
//! (set it with `options=-c search_path=...` in the URL to use another schema).

/// The deadpool-postgres version of the store's pools: depend on it through this re-export.
pub use deadpool_postgres;
/// The tokio-postgres version of the transaction handle: depend on it through this re-export.
pub use tokio_postgres;

pub use handle::{Command, Executor, PostgresTransaction, TransactionClient};
pub use options::{Isolation, PostgresOptions};
pub use reservation::PostgresReservation;
pub use store::PostgresStore;

// What runs where: `options` (settings, connecting), `migrate` (installing tables), `store`
// (the store and its calls), `reservation` (reserving a key, commit and rollback), `slot`
// (a transaction's connection and shared state), `handle` (the handler's handle and its
// guarded client), `sql_guard` (refusing transaction control), `owned` (the inbox's own
// transactions). The SQL the store runs is below.
mod handle;
pub(crate) mod migrate;
mod options;
mod reservation;
mod slot;
mod store;

#[cfg(feature = "outbox")]
mod owned;
mod sql_guard;

/// The same columns as the SQLite store, plus `state`: a reservation is an `in_progress` row
/// whose response columns are still empty. Other transactions never see one (it is committed
/// only as `completed`). Should one ever be committed as it is (the handle refuses a handler's
/// transaction control, so only something outside the layer could), it is written already
/// expired, so the next request for its key takes it over.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS idempotency_records (
    tenant              TEXT    NOT NULL,
    operation           TEXT    NOT NULL,
    idempotency_key     TEXT    NOT NULL,
    fingerprint         BYTEA,
    fingerprint_version INTEGER,
    status              INTEGER,
    headers             TEXT,
    body                BYTEA,
    trailers            TEXT,
    created_at          BIGINT  NOT NULL,
    expires_at          BIGINT  NOT NULL,
    state               TEXT    NOT NULL DEFAULT 'completed',
    PRIMARY KEY (tenant, operation, idempotency_key),
    CONSTRAINT idempotency_records_state CHECK (state IN ('in_progress', 'completed')),
    CONSTRAINT idempotency_records_completed CHECK (state = 'in_progress' OR (
        fingerprint IS NOT NULL AND fingerprint_version IS NOT NULL AND status IS NOT NULL
        AND headers IS NOT NULL AND body IS NOT NULL))
);
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at
    ON idempotency_records (expires_at);
";

/// Brings a table created with the SQLite layout (no `state`, response columns `NOT NULL`) to
/// the layout above. Run only when `state` is missing, so that a normal start never takes the
/// `ACCESS EXCLUSIVE` lock of an `ALTER TABLE`.
const MIGRATE_ADD_STATE: &str = "
ALTER TABLE idempotency_records
    ADD COLUMN state TEXT NOT NULL DEFAULT 'completed',
    ALTER COLUMN fingerprint DROP NOT NULL,
    ALTER COLUMN fingerprint_version DROP NOT NULL,
    ALTER COLUMN status DROP NOT NULL,
    ALTER COLUMN headers DROP NOT NULL,
    ALTER COLUMN body DROP NOT NULL,
    ADD CONSTRAINT idempotency_records_state CHECK (state IN ('in_progress', 'completed')),
    ADD CONSTRAINT idempotency_records_completed CHECK (state = 'in_progress' OR (
        fingerprint IS NOT NULL AND fingerprint_version IS NOT NULL AND status IS NOT NULL
        AND headers IS NOT NULL AND body IS NOT NULL));
";

/// Serializes schema creation between instances starting at the same time: concurrent
/// `CREATE TABLE IF NOT EXISTS` of one table can fail on PostgreSQL's catalog index.
/// An arbitrary constant, the same in every instance.
const MIGRATION_LOCK: i64 = 0x7469_6465_6d70_0001;

/// The `SET LOCAL` name that marks a transaction opened by `begin_owned`; its `commit` checks it
/// to detect a transaction that the owner's code ended (`COMMIT`/`ROLLBACK`) behind its back.
/// (A request's transaction is recognized by its reservation row instead; see
/// [`COMPLETE_RECORD`].)
#[cfg(feature = "outbox")]
const RESERVATION_SETTING: &str = "tower_idempotency.reservation";

/// Reads a record, for the re-check inside the transaction (any state).
const SELECT_RECORD: &str = "SELECT state, fingerprint_version, fingerprint, status, headers, \
     body, trailers, created_at, expires_at FROM idempotency_records \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3";

/// Reads a live completed record, for the fast path (the same columns as [`SELECT_RECORD`]).
const SELECT_LIVE_RECORD: &str = "SELECT state, fingerprint_version, fingerprint, status, \
     headers, body, trailers, created_at, expires_at FROM idempotency_records \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 \
     AND state = 'completed' AND expires_at > $4";

/// Reserves a scope: blocks on the primary key while another transaction holds it. Returns
/// the row's physical address, which `commit` updates it by (see [`COMPLETE_RECORD`]).
const INSERT_RESERVATION: &str = "INSERT INTO idempotency_records \
     (tenant, operation, idempotency_key, state, created_at, expires_at) \
     VALUES ($1, $2, $3, 'in_progress', $4, $4) \
     ON CONFLICT (tenant, operation, idempotency_key) DO NOTHING RETURNING ctid::text";

/// Takes over an expired record (or a stray reservation) as this transaction's reservation.
const TAKE_OVER: &str = "UPDATE idempotency_records SET state = 'in_progress', \
     fingerprint = NULL, fingerprint_version = NULL, status = NULL, headers = NULL, body = NULL, \
     trailers = NULL, created_at = $4, expires_at = $4 \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 \
     AND (state = 'in_progress' OR expires_at <= $4) RETURNING ctid::text";

/// Turns this transaction's reservation into the completed record, and fails (division by
/// zero, which aborts the transaction) unless exactly that row was completed. `commit` sends it
/// and `COMMIT` in one flight: PostgreSQL answers the `COMMIT` of an aborted transaction with a
/// `ROLLBACK`, so a record that is not this transaction's own is never committed.
///
/// The last condition checks that the transaction is still the one `begin` opened: the
/// reservation row was written by it (`xmin`). After a `COMMIT` or `ROLLBACK` behind the layer's
/// back, the statement would run in a transaction of its own, whose id differs (or the row is
/// gone).
///
/// The row is found by the `ctid` its reservation returned rather than through the primary
/// key: under `SERIALIZABLE`, reading the key's index page would take a page-level predicate
/// lock, and concurrent requests for *different* keys on that page would then fail each other
/// with serialization errors. (The reservation's `ON CONFLICT` probe takes none.)
const COMPLETE_RECORD: &str = "WITH completed AS (UPDATE idempotency_records SET \
     state = 'completed', fingerprint = $4, fingerprint_version = $5, status = $6, headers = $7, \
     body = $8, trailers = $9, created_at = $10, expires_at = $11 \
     WHERE ctid = $12::text::tid \
     AND tenant = $1 AND operation = $2 AND idempotency_key = $3 AND state = 'in_progress' \
     AND xmin = pg_current_xact_id()::xid RETURNING 1) \
     SELECT 1 / count(*)::int FROM completed";

/// Deletes a batch of expired records. SKIP LOCKED: never wait for (or fight over) a record
/// that a request is taking over, and let several instances purge at once.
const PURGE_EXPIRED: &str = "DELETE FROM idempotency_records AS r USING ( \
         SELECT tenant, operation, idempotency_key FROM idempotency_records \
         WHERE expires_at <= $1 LIMIT $2 FOR UPDATE SKIP LOCKED) AS expired \
     WHERE r.tenant = expired.tenant AND r.operation = expired.operation \
     AND r.idempotency_key = expired.idempotency_key";

#[cfg(test)]
mod tests;
