//! The SQL of step-by-step requests on SQLite, with the parameters of `postgres/steps_sql.rs`
//! in the same `$n` numbering. The statements every server runs (`row_lock/steps_sql.rs`) go
//! through the driver's [`sqlite_text`](super::driver::sqlite_text): SQLite has no row locks
//! to take (each transaction of the steps holds the database's write lock) and spells
//! `GREATEST` as `MAX`.

use crate::error::Error;
pub(crate) use crate::row_lock::steps_sql::*;
use crate::store::Scope;

/// The migration shipped in this folder's `migrations/`.
pub(crate) const SCHEMA: &str = include_str!("migrations/20261201000003_idempotency_steps.sql");

/// Not used: SQLite runs `CREATE ... IF NOT EXISTS` under its write lock.
pub(crate) const STEPS_INSTALL_LOCK: i64 = 0;

/// A statement that bounds nothing: each transaction of the steps took the write lock at its
/// start (waiting up to the busy timeout), and its statements wait for no other lock.
pub(crate) const BOUND_LOCK_WAIT: &str = "SELECT $1";

/// The bound's value (unused by [`BOUND_LOCK_WAIT`]): milliseconds.
pub(crate) fn wait_param(wait: std::time::Duration) -> i64 {
    i64::try_from(wait.as_millis()).unwrap_or(i64::MAX)
}

/// Whether the steps' tables exist (a row if they do).
pub(crate) const STEPS_INSTALLED: &str =
    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'idempotency_progress'";

/// Adds a new key's progress, or, if the key has one, changes nothing (0 rows); as
/// PostgreSQL's.
pub(crate) const INSERT_PROGRESS: &str = "INSERT INTO idempotency_progress (tenant, operation, \
     idempotency_key, fingerprint, fingerprint_version, status, generation, lease_owner, \
     lease_until, attempts, method, uri, headers, body, created_at, updated_at, run_id, \
     expires_at) \
     VALUES ($1, $2, $3, $4, $5, 'running', 1, $6, $7, 0, $8, $9, $10, $11, $12, $12, $13, $14) \
     ON CONFLICT (tenant, operation, idempotency_key) DO NOTHING";

/// A page of keys in progress (see `progress_filter!`).
pub(crate) const LIST_PROGRESS: &str = concat!(
    "SELECT p.tenant, p.operation, p.idempotency_key, ",
    progress_columns!(),
    progress_filter!("")
);

/// Any scope fits the tables (`TEXT`).
pub(crate) fn check_scope(_scope: &Scope) -> Result<(), Error> {
    Ok(())
}

/// Up to `$2` keys whose progress expired by `$1` (see `expired_progress!`).
pub(crate) const EXPIRED_PROGRESS: &str = concat!(
    "SELECT tenant, operation, idempotency_key",
    expired_progress!()
);
