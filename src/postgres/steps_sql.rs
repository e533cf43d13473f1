//! The SQL of step-by-step requests on PostgreSQL, shared by the tokio-postgres store and the
//! sqlx store. The statements that MySQL runs as written too are in `shared_sql.rs`.

use crate::error::Error;
pub(crate) use crate::row_lock::steps_sql::*;
use crate::store::Scope;

/// The migration shipped in `migrations/`.
pub(crate) const SCHEMA: &str =
    include_str!("../../migrations/20261201000003_idempotency_steps.sql");

/// Serializes `install_steps` between instances starting at the same time (concurrent
/// `CREATE TABLE IF NOT EXISTS` of one table can fail on PostgreSQL's catalog index).
pub(crate) const STEPS_INSTALL_LOCK: i64 = 0x7469_6465_6d70_0004;

/// Bounds the lock waits of a transaction of the steps (and of a local step's work in it):
/// past it a statement fails with `55P03`, which the layer answers `503` + `Retry-After`.
pub(crate) const BOUND_LOCK_WAIT: &str = "SELECT set_config('lock_timeout', '5000', true)";

/// Adds a new key's progress for the owner `$6` until `$7`, generation 1, if the key has none
/// (else nothing, 0 rows: a concurrent claim added it; the claim reads it again). `$4`, `$5`: the
/// fingerprint and its version; `$8`..`$11`: the request's method, uri, headers and body;
/// `$12`: now.
pub(crate) const INSERT_PROGRESS: &str = "INSERT INTO idempotency_progress (tenant, operation, \
     idempotency_key, fingerprint, fingerprint_version, status, generation, lease_owner, \
     lease_until, attempts, method, uri, headers, body, created_at, updated_at) \
     VALUES ($1, $2, $3, $4, $5, 'running', 1, $6, $7, 0, $8, $9, $10, $11, $12, $12) \
     ON CONFLICT (tenant, operation, idempotency_key) DO NOTHING";

/// Saves the step `$4` (`$5`: name, `$6`: kind, `$7`: result or `NULL` for an intent, `$8`:
/// now); a saved result is never overwritten, an intent is settled.
pub(crate) const UPSERT_STEP: &str = "INSERT INTO idempotency_steps (tenant, operation, \
     idempotency_key, seq, name, kind, result, created_at, updated_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8) \
     ON CONFLICT (tenant, operation, idempotency_key, seq) DO UPDATE SET \
     result = excluded.result, updated_at = excluded.updated_at \
     WHERE idempotency_steps.result IS NULL";

/// Keys in progress with status `$1`, oldest change first, at most `$2` (see
/// `progress_filter!`).
pub(crate) const LIST_PROGRESS: &str = concat!(
    "SELECT p.tenant, p.operation, p.idempotency_key, ",
    progress_columns!(),
    progress_filter!(all)
);

/// [`LIST_PROGRESS`] of the idle running keys only.
pub(crate) const LIST_IDLE_PROGRESS: &str = concat!(
    "SELECT p.tenant, p.operation, p.idempotency_key, ",
    progress_columns!(),
    progress_filter!(idle)
);

/// Any scope fits the tables (`TEXT`).
pub(crate) fn check_scope(_scope: &Scope) -> Result<(), Error> {
    Ok(())
}
