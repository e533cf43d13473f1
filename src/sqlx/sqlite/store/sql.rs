//! The SQL of the SQLite store on sqlx: the schema and every statement. The table has the
//! layout of the PostgreSQL and MySQL ones; the store writes only completed records (the
//! reservation is the database's write lock).

/// The migration shipped in this folder's `migrations/` (for `sqlx migrate run` or
/// `sqlx::migrate!`).
pub(crate) const SCHEMA: &str =
    include_str!("../migrations/20261201000000_idempotency_records.sql");

/// Turns on write-ahead logging (a setting of the file, kept by every later connection): a
/// commit is one append, and readers (the replay fast path) never wait for the writer.
pub(crate) const WAL: &str = "PRAGMA journal_mode = WAL";

/// The connection's `synchronous` setting (`2`: `FULL`, SQLite's default).
pub(crate) const SYNCHRONOUS: &str = "PRAGMA synchronous";

/// A record row in the columns the shared reader takes. Binds: the scope.
pub(crate) const SELECT_RECORD: &str =
    "SELECT state, fingerprint_version, fingerprint, status, headers, body, trailers, \
     created_at, expires_at FROM idempotency_records \
     WHERE tenant = ?1 AND operation = ?2 AND idempotency_key = ?3";

/// The live record of a scope, for the fast path (a read in WAL mode never waits for the
/// writer). Binds: the scope, `now`.
pub(crate) const SELECT_LIVE_RECORD: &str =
    "SELECT state, fingerprint_version, fingerprint, status, headers, body, trailers, \
     created_at, expires_at FROM idempotency_records \
     WHERE tenant = ?1 AND operation = ?2 AND idempotency_key = ?3 \
     AND state = 'completed' AND expires_at > ?4";

/// Whether the scope has a live record (a row if it does), read under the write lock: if
/// not, the request holding the lock has the key. Binds: the scope, `now`.
pub(crate) const HAS_LIVE_RECORD: &str = "SELECT 1 FROM idempotency_records \
     WHERE tenant = ?1 AND operation = ?2 AND idempotency_key = ?3 \
     AND state = 'completed' AND expires_at > ?4";

/// Saves the completed record, over an expired one (or a reservation another store's
/// protocol left) of the same scope. Binds: the response
/// columns and times, then the scope.
pub(crate) const SAVE_RECORD: &str = "INSERT OR REPLACE INTO idempotency_records \
     (fingerprint, fingerprint_version, status, headers, body, trailers, created_at, \
     expires_at, tenant, operation, idempotency_key, state) \
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, 'completed')";

/// Deletes a batch of expired records, through the index on `expires_at` (SQLite's own
/// `DELETE ... LIMIT` is a build option the bundled library does not have). Binds: `now`, the
/// batch size.
pub(crate) const PURGE_EXPIRED: &str = "DELETE FROM idempotency_records \
     WHERE (tenant, operation, idempotency_key) IN (SELECT tenant, operation, idempotency_key \
     FROM idempotency_records WHERE expires_at <= ?1 LIMIT ?2)";

/// The savepoint every transaction of the store opens after `BEGIN`: it exists as long as
/// that transaction does. SQLite rolls a transaction back on its own after some errors (a
/// full disk, an I/O error), and the statements after it would each commit alone; releasing
/// the savepoint before saving the record fails then, and nothing is saved.
macro_rules! marked {
    () => {
        "tower_idempotency_transaction"
    };
}

/// Checks that the transaction [`begin`] opened is still open (see [`marked!`]). Releasing a
/// savepoint inside `BEGIN ... COMMIT` commits nothing.
pub(crate) const CHECK_OPEN: &str = concat!("RELEASE ", marked!());

/// `COMMIT`, then sqlx's default busy timeout again (the store sets its own while it takes
/// the write lock: see [`begin`]).
pub(crate) const COMMIT: &str = "COMMIT; PRAGMA busy_timeout = 5000";

/// `ROLLBACK`, then sqlx's default busy timeout again.
pub(crate) const ROLLBACK: &str = "ROLLBACK; PRAGMA busy_timeout = 5000";

/// Takes the database's write lock (`BEGIN IMMEDIATE`), waiting up to `wait_ms` for the
/// request or the application writer that holds it, and marks the transaction (see
/// [`marked!`]). Only an integer is formatted into it.
pub(crate) fn begin(wait_ms: u64) -> String {
    format!(
        concat!(
            "PRAGMA busy_timeout = {}; BEGIN IMMEDIATE; SAVEPOINT ",
            marked!()
        ),
        wait_ms
    )
}

/// A statement that changes nothing (see `SqliteDialect::restore_lock_wait`).
pub(crate) const NOTHING: &str = "SELECT 1";
