//! The statements of step-by-step requests that every SQL server of the crate runs as written
//! (PostgreSQL on both drivers, MySQL and MariaDB; SQLite through its driver's `sqlite_text`), re-exported by each server's SQL module
//! (`postgres/steps_sql.rs`, `mysql/steps_sql.rs`) next to its own. Parameters are numbered `$n`, as PostgreSQL
//! takes them; the MySQL driver sends each as a `?` bound to the n-th value. `$1`, `$2`, `$3`
//! are always the key's tenant, operation and idempotency key. Times are Unix milliseconds.

/// Checks that the key is still in the life `$7` under the generation `$6` (and running), and
/// moves its lease's end to `$4` (`$5`: now). No row changed: the lease was lost.
pub(crate) const CHECK_LEASE: &str = "UPDATE idempotency_progress SET lease_until = $4, \
     updated_at = $5 WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 \
     AND generation = $6 AND run_id = $7 AND status = 'running'";

/// Marks the key dead: the completer ran out of attempts (`$4`: now). A new generation: the
/// key is out of every owner's hands.
pub(crate) const MARK_DEAD: &str = "UPDATE idempotency_progress SET status = 'dead', \
     lease_owner = NULL, generation = generation + 1, \
     last_error = 'the completer ran out of attempts', updated_at = $4 \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3";

/// Takes the key (its row locked by the claim's read) for the owner `$4` until `$5`, bumping
/// its generation and counting `$6` completer attempts (`$7`: now), its progress kept at least
/// until `$8`.
pub(crate) const TAKE_KEY: &str = "UPDATE idempotency_progress SET generation = generation + 1, \
     status = 'running', lease_owner = $4, lease_until = $5, attempts = attempts + $6, \
     updated_at = $7, expires_at = GREATEST(expires_at, $8) \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3";

/// Deletes the key's steps: those of an earlier life, when a claim (holding the key's new
/// progress row) starts a new one.
pub(crate) const DELETE_STEPS_OF_KEY: &str = DELETE_STEPS;

/// The step saved at `$4`, if any, locked: `name, kind, result`.
pub(crate) const SELECT_STEP_AT: &str = "SELECT name, kind, result FROM idempotency_steps \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 AND seq = $4 FOR UPDATE";

/// Saves a new step at `$4` (`$5`: name, `$6`: kind, `$7`: result or `NULL` for an intent,
/// `$8`: now).
pub(crate) const INSERT_STEP: &str = "INSERT INTO idempotency_steps (tenant, operation, \
     idempotency_key, seq, name, kind, result, created_at, updated_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8)";

/// Settles the intent at `$4` with its result `$5` (`$6`: now).
pub(crate) const SETTLE_STEP: &str = "UPDATE idempotency_steps SET result = $5, updated_at = $6 \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 AND seq = $4 \
     AND result IS NULL";

/// Deletes the intent of the foreign step `$4`.
pub(crate) const FORGET_INTENT: &str = "DELETE FROM idempotency_steps \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 AND seq = $4 \
     AND result IS NULL AND kind = 'foreign'";

/// Settles the intent of the foreign step `$4` with the result `$5` (an operator's word).
pub(crate) const SETTLE_INTENT: &str = "UPDATE idempotency_steps SET result = $5 \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 AND seq = $4 \
     AND result IS NULL AND kind = 'foreign'";

/// Whether the key has a step saved: a locking read, which sees the latest committed rows on
/// every server and at every isolation level (a step committed while the release waited for
/// the key's row is seen).
pub(crate) const ANY_STEP: &str = "SELECT seq FROM idempotency_steps \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 LIMIT 1 FOR UPDATE";

/// Deletes the key's progress under the generation `$4` of the life `$5` (a release of a key
/// with no step: a retry starts afresh), once [`END_LEASE`] locked its row and [`ANY_STEP`]
/// found none.
pub(crate) const DELETE_RELEASED: &str = "DELETE FROM idempotency_progress \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 AND generation = $4 \
     AND run_id = $5 AND status = 'running'";

/// Ends the lease of the generation `$4` of the life `$6` now (`$5`), so that a retry resumes
/// the key at once. Locks the key's row: the release's first statement.
pub(crate) const END_LEASE: &str = "UPDATE idempotency_progress SET lease_owner = NULL, \
     lease_until = $5, updated_at = $5 \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 AND generation = $4 \
     AND run_id = $6 AND status = 'running'";

/// Marks the key `$4` (in doubt or dead) with the reason `$5`, its lease ended at `$6`, under
/// a new generation (out of its owner's hands).
pub(crate) const SET_STATUS: &str = "UPDATE idempotency_progress SET status = $4, \
     last_error = $5, lease_owner = NULL, lease_until = $6, generation = generation + 1 \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3";

/// The key's status, locked, for an operator's resolution.
pub(crate) const SELECT_STATUS: &str = "SELECT status FROM idempotency_progress \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 FOR UPDATE";

/// An operator's resolution: the key running again under a new generation, free to be
/// resumed, its attempts reset (`$4`: now).
pub(crate) const RESUME: &str = "UPDATE idempotency_progress SET status = 'running', \
     attempts = 0, last_error = NULL, lease_owner = NULL, lease_until = $4, updated_at = $4, \
     generation = generation + 1 \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3";

/// The keys, after their scope columns (which each server's module selects as text), of up
/// to `$2` keys left running whose progress expired and whose lease ended by `$1`.
macro_rules! expired_progress {
    () => {
        " FROM idempotency_progress WHERE status = 'running' AND expires_at <= $1 \
         AND lease_until <= $1 LIMIT $2"
    };
}
pub(crate) use expired_progress;

/// Deletes the key's progress if it is still expired at `$4` (see `expired_progress!`) and
/// has no foreign step.
pub(crate) const DELETE_EXPIRED_PROGRESS: &str = "DELETE FROM idempotency_progress \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 AND status = 'running' \
     AND expires_at <= $4 AND lease_until <= $4 AND NOT EXISTS (SELECT 1 \
     FROM idempotency_steps AS s WHERE s.tenant = $1 AND s.operation = $2 \
     AND s.idempotency_key = $3 AND s.kind = 'foreign')";

/// Marks the key dead if it is still expired at `$4` (see `expired_progress!`): one with a
/// foreign step, which a purge never forgets. A new generation, as every change of owner.
pub(crate) const MARK_EXPIRED_DEAD: &str = "UPDATE idempotency_progress SET status = 'dead', \
     lease_owner = NULL, generation = generation + 1, updated_at = $4, \
     last_error = 'expired with a foreign step: money may have been taken; settle it' \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 AND status = 'running' \
     AND expires_at <= $4 AND lease_until <= $4";

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
/// status, lease_owner, lease_until, attempts, generation, run_id`.
pub(crate) const SELECT_PROGRESS: &str = "SELECT fingerprint_version, fingerprint, status, \
     lease_owner, lease_until, attempts, generation, run_id FROM idempotency_progress \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 FOR UPDATE";

/// The key's record, any state, locked (a locking read sees the latest committed row on every
/// server, whatever the isolation level), in the columns `record_row::live_record` reads.
pub(crate) const SELECT_RECORD: &str = "SELECT state, fingerprint_version, fingerprint, status, \
     headers, body, trailers, created_at, expires_at FROM idempotency_records \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 FOR UPDATE";

/// The key's steps in order: `seq, name, kind, result` (a locking read, as above).
pub(crate) const SELECT_STEPS: &str = "SELECT seq, name, kind, result FROM idempotency_steps \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 ORDER BY seq FOR UPDATE";

/// What the listing selects from `idempotency_progress AS p` after its scope columns: the
/// fingerprint's version and digest, status, generation, attempts, lease end, last error, the
/// request's method, uri, headers and body, the creation and change times, the count of
/// steps and the run id.
macro_rules! progress_columns {
    () => {
        "p.fingerprint_version, p.fingerprint, p.status, p.generation, p.attempts, \
         p.lease_until, p.last_error, p.method, p.uri, p.headers, p.body, p.created_at, \
         p.updated_at, (SELECT count(*) FROM idempotency_steps AS s WHERE s.tenant = p.tenant \
         AND s.operation = p.operation AND s.idempotency_key = p.idempotency_key), p.run_id \
         FROM idempotency_progress AS p"
    };
}
pub(crate) use progress_columns;

/// The condition of the listing: status `$1`; the operation `$2` unless it is `NULL`; when
/// `$3` is not 0, only keys whose lease ended by `$4` (now) and unchanged since `$5`; after
/// the cursor `($6, $7, $8, $9)` (change time and scope), in that order; at most `$10`. `$2`
/// and the cursor's scope are written by each server's module (`$t` is its text cast).
macro_rules! progress_filter {
    ($t:literal) => {
        concat!(
            " WHERE p.status = $1 AND ($2",
            $t,
            " IS NULL OR p.operation = $2) \
             AND ($3 = 0 OR (p.lease_until <= $4 AND p.updated_at <= $5)) \
             AND (p.updated_at, p.tenant, p.operation, p.idempotency_key) > ($6, $7",
            $t,
            ", $8",
            $t,
            ", $9",
            $t,
            ") ORDER BY p.updated_at, p.tenant, p.operation, p.idempotency_key LIMIT $10"
        )
    };
}
pub(crate) use progress_filter;
