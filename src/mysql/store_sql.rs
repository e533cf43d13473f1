//! The SQL of the MySQL and MariaDB store: the schema and every statement, on the same table
//! layout as the PostgreSQL stores.

use crate::row_lock::reserve::Isolation;

/// The migration shipped in `migrations/mysql/` (for `sqlx migrate run` or `sqlx::migrate!`):
/// one copy for the store and for applications that run migrations themselves.
pub(crate) const SCHEMA: &str =
    include_str!("../../migrations/mysql/20261201000000_idempotency_records.sql");

/// Serializes schema creation between instances starting at the same time (`GET_LOCK`).
pub(crate) const MIGRATION_LOCK: &str = "tower_idempotency_migrate";

/// Reads a record, for the re-check inside the transaction (any state). A locking read: it
/// sees the latest committed row whatever the isolation level (the duplicate-key check of the
/// insert before it already holds the shared lock).
pub(crate) const SELECT_RECORD: &str =
    "SELECT state, fingerprint_version, fingerprint, status, headers, \
     body, trailers, created_at, expires_at FROM idempotency_records \
     WHERE tenant = ? AND operation = ? AND idempotency_key = ? LOCK IN SHARE MODE";

/// Reads a live completed record, for the fast path: a consistent (non-locking) read, which
/// never waits for a transaction holding the key.
pub(crate) const SELECT_LIVE_RECORD: &str =
    "SELECT state, fingerprint_version, fingerprint, status, \
     headers, body, trailers, created_at, expires_at FROM idempotency_records \
     WHERE tenant = ? AND operation = ? AND idempotency_key = ? \
     AND state = 'completed' AND expires_at > ?";

/// Reserves a scope: blocks on the primary key while another transaction holds it, and fails
/// with a duplicate key (1062) once a committed row has it. Binds: the scope, then `now` twice.
pub(crate) const INSERT_RESERVATION: &str = "INSERT INTO idempotency_records \
     (tenant, operation, idempotency_key, state, created_at, expires_at) \
     VALUES (?, ?, ?, 'in_progress', ?, ?)";

/// Takes the locks the reservation needs on the table (its metadata lock, and the global
/// read lock's intention), and no row lock: it matches no row.
pub(crate) const LOCK_TABLE_FOR_RESERVATION: &str =
    "UPDATE idempotency_records SET state = state WHERE FALSE";

/// Takes over an expired record (or a stray reservation) as this transaction's reservation.
/// Binds: `now` twice, the scope, `now`.
pub(crate) const TAKE_OVER: &str = "UPDATE idempotency_records SET state = 'in_progress', \
     fingerprint = NULL, fingerprint_version = NULL, status = NULL, headers = NULL, body = NULL, \
     trailers = NULL, created_at = ?, expires_at = ? \
     WHERE tenant = ? AND operation = ? AND idempotency_key = ? \
     AND (state = 'in_progress' OR expires_at <= ?)";

/// Turns this transaction's reservation into the completed record; `commit` sends `COMMIT`
/// only if it changed exactly one row. Binds: the response columns and times, then the scope.
pub(crate) const COMPLETE_RECORD: &str = "UPDATE idempotency_records SET \
     state = 'completed', fingerprint = ?, fingerprint_version = ?, status = ?, headers = ?, \
     body = ?, trailers = ?, created_at = ?, expires_at = ? \
     WHERE tenant = ? AND operation = ? AND idempotency_key = ? AND state = 'in_progress'";

/// Deletes a batch of expired records. Binds: `now`, the batch size.
pub(crate) const PURGE_EXPIRED: &str =
    "DELETE FROM idempotency_records WHERE expires_at <= ? LIMIT ?";

/// What `COMMIT` and `ROLLBACK` are followed by: the session's own `autocommit` and lock wait
/// timeouts again (saved by [`begin_request`]), so that the connection goes back to the
/// application's pool as it came.
macro_rules! restore_session {
    () => {
        "SET autocommit = @tower_idempotency_autocommit, \
         innodb_lock_wait_timeout = @tower_idempotency_lock_wait, \
         lock_wait_timeout = @tower_idempotency_mdl_wait"
    };
}

/// `COMMIT`, then the session restored (one round trip).
pub(crate) const COMMIT: &str = concat!("COMMIT; ", restore_session!());

/// `ROLLBACK`, then the session restored (one round trip).
pub(crate) const ROLLBACK: &str = concat!("ROLLBACK; ", restore_session!());

/// Opens a request's transaction at `isolation`, its row lock waits bounded by
/// `lock_wait_secs` (`innodb_lock_wait_timeout` counts whole seconds) and its waits for
/// metadata locks (`LOCK TABLES`, `FLUSH TABLES WITH READ LOCK`, DDL of another session) by
/// `mdl_wait_secs` (`lock_wait_timeout`, whole seconds too, a year by default). `autocommit` is off until the end, so
/// that should the server end the transaction under the handler (a deadlock rolls it back),
/// what the handler runs next still waits for the layer's `COMMIT` or `ROLLBACK` instead of
/// committing on its own. Only an integer is formatted into it.
pub(crate) fn begin_request(
    isolation: Isolation,
    lock_wait_secs: u64,
    mdl_wait_secs: u64,
) -> String {
    let level = match isolation {
        Isolation::ReadCommitted => "READ COMMITTED",
        Isolation::RepeatableRead => "REPEATABLE READ",
        Isolation::Serializable => "SERIALIZABLE",
    };
    format!(
        "SET @tower_idempotency_autocommit = @@autocommit, \
         @tower_idempotency_lock_wait = @@innodb_lock_wait_timeout, \
         @tower_idempotency_mdl_wait = @@lock_wait_timeout, \
         autocommit = 0, innodb_lock_wait_timeout = {lock_wait_secs}, \
         lock_wait_timeout = {mdl_wait_secs}; \
         SET TRANSACTION ISOLATION LEVEL {level}; START TRANSACTION"
    )
}

/// The lock waits of the open transaction bounded by `lock_wait_secs` again (after a
/// reservation whose wait on the key's row had a bound of its own). Only an integer is
/// formatted into it.
pub(crate) fn set_lock_wait(lock_wait_secs: u64) -> String {
    format!("SET innodb_lock_wait_timeout = {lock_wait_secs}")
}
