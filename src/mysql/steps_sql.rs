//! The SQL of step-by-step requests on MySQL and MariaDB (the sqlx MySQL store), with the
//! parameters of `postgres/steps_sql.rs` in the same `$n` numbering (the MySQL driver sends each as a
//! `?`). The statements that PostgreSQL runs as written too are in
//! `row_lock/steps_sql.rs`.

use crate::error::Error;
pub(crate) use crate::row_lock::steps_sql::*;
use crate::store::Scope;

/// The migration shipped in `migrations/mysql/`.
pub(crate) const SCHEMA: &str =
    include_str!("../../migrations/mysql/20261201000003_idempotency_steps.sql");

/// Serializes `install_steps` between instances starting at the same time (the `GET_LOCK`
/// name is formed from it).
pub(crate) const STEPS_INSTALL_LOCK: i64 = 0x7469_6465_6d70_0004;

/// Bounds the row lock waits of a transaction of the steps (and of a local step's work in it)
/// to `$1` seconds (see [`wait_param`]): past it a statement fails with `1205`, which the
/// layer answers `503` + `Retry-After`. The store's own transaction restores the session's
/// value when it ends.
pub(crate) const BOUND_LOCK_WAIT: &str = "SET innodb_lock_wait_timeout = $1";

/// The lock timeout's value: whole seconds, rounded up, at least 1 (InnoDB's unit).
pub(crate) fn wait_param(wait: std::time::Duration) -> i64 {
    let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    i64::try_from(seconds)
        .unwrap_or(i64::MAX)
        .clamp(1, 1_073_741_824)
}

/// Whether the steps' tables exist (a row if they do), in the connection's database.
pub(crate) const STEPS_INSTALLED: &str = "SELECT 1 FROM information_schema.tables \
     WHERE table_schema = DATABASE() AND table_name = 'idempotency_progress'";

/// Adds a new key's progress (as PostgreSQL's `INSERT_PROGRESS`), or, if the key has one, changes
/// nothing (0 rows). `IGNORE` rather than `ON DUPLICATE KEY UPDATE`, whose count the driver's
/// found-rows mode makes 1 either way; the values it could cut short fit their columns (the
/// scope is checked first, the others are `TEXT` or wider, and the owner is generated).
pub(crate) const INSERT_PROGRESS: &str = "INSERT IGNORE INTO idempotency_progress (tenant, \
     operation, idempotency_key, fingerprint, fingerprint_version, status, generation, \
     lease_owner, lease_until, attempts, method, uri, headers, body, created_at, updated_at, \
     run_id, expires_at) \
     VALUES ($1, $2, $3, $4, $5, 'running', 1, $6, $7, 0, $8, $9, $10, $11, $12, $12, $13, $14)";

/// The scope columns as text (they are byte strings).
macro_rules! scope_as_text {
    () => {
        "SELECT CONVERT(p.tenant USING utf8mb4), CONVERT(p.operation USING utf8mb4), \
         CONVERT(p.idempotency_key USING utf8mb4), "
    };
}

/// A page of keys in progress (see `progress_filter!`).
pub(crate) const LIST_PROGRESS: &str =
    concat!(scope_as_text!(), progress_columns!(), progress_filter!(""));

/// Checks that the scope fits the tables' columns, as the store's reservation does.
pub(crate) fn check_scope(scope: &Scope) -> Result<(), Error> {
    use crate::sqlx::store::SqlxDialect as _;
    crate::store::sqlx_mysql::MySqlDialect::check_scope(scope)
}

/// Up to `$2` keys whose progress expired by `$1` (see `expired_progress!`), their scope as
/// text.
pub(crate) const EXPIRED_PROGRESS: &str = concat!(
    "SELECT CONVERT(tenant USING utf8mb4), CONVERT(operation USING utf8mb4), \
     CONVERT(idempotency_key USING utf8mb4)",
    expired_progress!()
);
