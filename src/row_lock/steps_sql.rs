//! The statements of step-by-step requests that every SQL server of the crate runs as written
//! (PostgreSQL on both drivers, MySQL and MariaDB), re-exported by each server's SQL module
//! (`pg_sql.rs`, `mysql_sql.rs`) next to its own. Parameters are numbered `$n`, as PostgreSQL
//! takes them; the MySQL driver sends each as a `?` bound to the n-th value. `$1`, `$2`, `$3`
//! are always the key's tenant, operation and idempotency key. Times are Unix milliseconds.

/// Checks that the key is still under the generation `$6` (and running), and moves its lease's
/// end to `$4` (`$5`: now). No row changed: the lease was lost.
pub(crate) const CHECK_LEASE: &str = "UPDATE idempotency_progress SET lease_until = $4, \
     updated_at = $5 WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 \
     AND generation = $6 AND status = 'running'";

/// Marks the key dead: the completer ran out of attempts (`$4`: now).
pub(crate) const MARK_DEAD: &str = "UPDATE idempotency_progress SET status = 'dead', \
     lease_owner = NULL, last_error = 'the completer ran out of attempts', updated_at = $4 \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3";

/// Takes the key (its row locked by the claim's read) for the owner `$4` until `$5`, bumping
/// its generation and counting `$6` completer attempts (`$7`: now).
pub(crate) const TAKE_KEY: &str = "UPDATE idempotency_progress SET generation = generation + 1, \
     status = 'running', lease_owner = $4, lease_until = $5, attempts = attempts + $6, \
     updated_at = $7 WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3";

/// Deletes the intent of the foreign step `$4`.
pub(crate) const FORGET_INTENT: &str = "DELETE FROM idempotency_steps \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 AND seq = $4 \
     AND result IS NULL";

/// Settles the intent of the step `$4` with the result `$5`.
pub(crate) const SETTLE_INTENT: &str = "UPDATE idempotency_steps SET result = $5 \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 AND seq = $4 \
     AND result IS NULL";

/// Deletes the key under the generation `$4` if it has no step saved (a retry starts afresh).
pub(crate) const DELETE_IF_NO_STEPS: &str = "DELETE FROM idempotency_progress \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 AND generation = $4 \
     AND status = 'running' AND NOT EXISTS (SELECT 1 FROM idempotency_steps AS s \
     WHERE s.tenant = $1 AND s.operation = $2 AND s.idempotency_key = $3)";

/// Ends the lease of the generation `$4` now (`$5`), so that a retry resumes the key at once.
pub(crate) const END_LEASE: &str = "UPDATE idempotency_progress SET lease_owner = NULL, \
     lease_until = $5, updated_at = $5 \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 AND generation = $4";

/// Marks the key `$4` (in doubt or dead) with the reason `$5`, its lease ended at `$6`.
pub(crate) const SET_STATUS: &str = "UPDATE idempotency_progress SET status = $4, \
     last_error = $5, lease_owner = NULL, lease_until = $6 \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3";

/// An operator's resolution: the key running again, free to be resumed, its attempts reset
/// (`$4`: now).
pub(crate) const RESUME: &str = "UPDATE idempotency_progress SET status = 'running', \
     attempts = 0, last_error = NULL, lease_owner = NULL, lease_until = $4, updated_at = $4 \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3";

/// Deletes a record of the key that must give way to its final record: expired at `$4`, or a
/// reservation left behind.
pub(crate) const DELETE_STALE_RECORD: &str = "DELETE FROM idempotency_records \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 \
     AND (state = 'in_progress' OR expires_at <= $4)";

/// Saves the key's final record (`$4`..`$11`: fingerprint, its version, status, headers, body,
/// trailers, created and expiry times).
pub(crate) const INSERT_RECORD: &str = "INSERT INTO idempotency_records (tenant, operation, \
     idempotency_key, fingerprint, fingerprint_version, status, headers, body, trailers, \
     created_at, expires_at, state) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, 'completed')";

/// Deletes the key's steps.
pub(crate) const DELETE_STEPS: &str = "DELETE FROM idempotency_steps \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3";

/// Deletes the key's progress.
pub(crate) const DELETE_PROGRESS: &str = "DELETE FROM idempotency_progress \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3";

/// The key's progress, locked for the claim's transaction: `fingerprint_version, fingerprint,
/// status, lease_owner, lease_until, attempts, generation`.
pub(crate) const SELECT_PROGRESS: &str = "SELECT fingerprint_version, fingerprint, status, \
     lease_owner, lease_until, attempts, generation FROM idempotency_progress \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 FOR UPDATE";

/// The key's record, any state, locked (a locking read sees the latest committed row on every
/// server, whatever the isolation level), in the columns `record_row::live_record` reads.
pub(crate) const SELECT_RECORD: &str = "SELECT state, fingerprint_version, fingerprint, status, \
     headers, body, trailers, created_at, expires_at FROM idempotency_records \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 FOR UPDATE";

/// The key's steps in order: `seq, name, kind, result` (a locking read, as above).
pub(crate) const SELECT_STEPS: &str = "SELECT seq, name, kind, result FROM idempotency_steps \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 ORDER BY seq FOR UPDATE";

/// What the listings select from `idempotency_progress AS p` after its scope columns: the
/// fingerprint's version and digest, status, generation, attempts, lease end, last error, the
/// request's method, uri, headers and body, the creation and change times, and the count of
/// steps.
macro_rules! progress_columns {
    () => {
        "p.fingerprint_version, p.fingerprint, p.status, p.generation, p.attempts, \
         p.lease_until, p.last_error, p.method, p.uri, p.headers, p.body, p.created_at, \
         p.updated_at, (SELECT count(*) FROM idempotency_steps AS s WHERE s.tenant = p.tenant \
         AND s.operation = p.operation AND s.idempotency_key = p.idempotency_key) \
         FROM idempotency_progress AS p"
    };
}
pub(crate) use progress_columns;

/// The condition of a listing: status `$1`, at most `$2`, oldest change first; an idle listing
/// also wants the lease ended by `$2` (now) and no change since `$3`, and takes at most `$4`.
/// (Each numbers only the parameters it uses: PostgreSQL cannot type one it never sees.)
macro_rules! progress_filter {
    (all) => {
        " WHERE p.status = $1 ORDER BY p.updated_at LIMIT $2"
    };
    (idle) => {
        " WHERE p.status = $1 AND p.lease_until <= $2 AND p.updated_at <= $3 \
         ORDER BY p.updated_at LIMIT $4"
    };
}
pub(crate) use progress_filter;
