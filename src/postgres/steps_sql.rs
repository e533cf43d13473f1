//! The SQL of step-by-step requests on PostgreSQL, shared by the tokio-postgres store and the
//! sqlx store. The statements that MySQL runs as written too are in `row_lock/steps_sql.rs`.

use crate::error::Error;
pub(crate) use crate::row_lock::steps_sql::*;
use crate::store::Scope;

/// The migration shipped in `migrations/`.
pub(crate) const SCHEMA: &str =
    include_str!("../../migrations/20261201000003_idempotency_steps.sql");

/// Serializes `install_steps` between instances starting at the same time (concurrent
/// `CREATE TABLE IF NOT EXISTS` of one table can fail on PostgreSQL's catalog index).
pub(crate) const STEPS_INSTALL_LOCK: i64 = 0x7469_6465_6d70_0004;

/// Bounds the lock waits of a transaction of the steps (and of a local step's work in it) to
/// `$1` (see [`wait_param`]): past it a statement fails with `55P03`, which the layer answers
/// `503` + `Retry-After`.
pub(crate) const BOUND_LOCK_WAIT: &str =
    "SELECT set_config('lock_timeout', ($1::bigint)::text, true)";

/// The lock timeout's value: milliseconds, at least 1 (0 would mean "wait forever").
pub(crate) fn wait_param(wait: std::time::Duration) -> i64 {
    i64::try_from(wait.as_millis())
        .unwrap_or(i64::MAX)
        .clamp(1, i64::from(i32::MAX))
}

/// Whether the steps' tables exist (a row if they do), on the connection's search path.
pub(crate) const STEPS_INSTALLED: &str =
    "SELECT 1 WHERE to_regclass('idempotency_progress') IS NOT NULL";

/// Adds a new key's progress for the owner `$6` until `$7`, generation 1, if the key has none
/// (else nothing, 0 rows: a concurrent claim added it; the claim reads it again). `$4`, `$5`: the
/// fingerprint and its version; `$8`..`$11`: the request's method, uri, headers and body;
/// `$12`: now; `$13`: the new run id; `$14`: when the progress expires.
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
    progress_filter!("::text")
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
