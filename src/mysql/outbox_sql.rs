//! The SQL of the MySQL and MariaDB outbox (the sqlx MySQL store). The statements take the
//! same parameters, in the same `$n` numbering, as those of `postgres/outbox_sql.rs`, so that the logic of
//! `row_lock/outbox.rs` binds one list on every server; the MySQL driver sends each `$n` as a `?` bound to
//! the n-th value. Times are Unix milliseconds. The statements that PostgreSQL runs as written
//! too are in `row_lock/outbox_sql.rs`.

pub(crate) use crate::row_lock::outbox_sql::*;

/// The migration shipped in `migrations/mysql/`.
pub(crate) const SCHEMA: &str =
    include_str!("../../migrations/mysql/20261201000001_outbox_events.sql");

/// Serializes the outbox's `install` between instances starting at the same time (the
/// `GET_LOCK` name is formed from it).
pub(crate) const OUTBOX_INSTALL_LOCK: i64 = 0x7469_6465_6d70_0002;

/// The events whose last allowed attempt was abandoned (the lease ran out), locked for the
/// claim's transaction; SKIP LOCKED: those another relay is claiming are left to it.
pub(crate) const SELECT_ABANDONED: &str = "SELECT seq, event_id, topic, payload, attempts, \
     created_at FROM outbox_events \
     WHERE status = 'pending' AND lease_owner IS NOT NULL \
     AND available_at <= $1 AND attempts >= $2 \
     ORDER BY seq FOR UPDATE SKIP LOCKED";

/// Dead-letters the abandoned events selected (and locked) by [`SELECT_ABANDONED`]; the
/// driver appends their `seq`s as the list `IN (...)`.
pub(crate) const DEAD_LETTER_ABANDONED: &str = "UPDATE outbox_events SET status = 'dead', \
     lease_owner = NULL, last_error = 'abandoned: the lease of its last attempt ran out' \
     WHERE seq IN ";

/// Due events, oldest first, locked for the claim's transaction (SKIP LOCKED: rows another
/// relay is claiming are skipped, not waited for), with the attempt the claim counts.
/// Parameters: those of `CLAIM` (`$3`: now, `$4`: the batch).
pub(crate) const SELECT_CLAIMABLE: &str = "SELECT seq, event_id, topic, payload, attempts + 1, \
     created_at FROM outbox_events \
     WHERE status = 'pending' AND available_at <= $3 \
     ORDER BY available_at, seq LIMIT $4 FOR UPDATE SKIP LOCKED";

/// Claims the events selected by [`SELECT_CLAIMABLE`] for `$1` until `$2`; the driver appends
/// their `seq`s as the list `IN (...)`.
pub(crate) const CLAIM: &str = "UPDATE outbox_events SET lease_owner = $1, available_at = $2, \
     attempts = attempts + 1 WHERE seq IN ";

/// `(status, leased, count)` rows: an event is in flight while its lease runs (`$1`: now).
pub(crate) const COUNT_BY_STATE: &str = "SELECT status, \
     (lease_owner IS NOT NULL AND available_at > $1) AS leased, count(*) \
     FROM outbox_events GROUP BY status, leased";

/// Deletes up to `$2` events delivered before `$1`, oldest first (MySQL has no SKIP LOCKED
/// for a `DELETE`: purges running at once wait for each other's rows).
pub(crate) const PURGE_DELIVERED: &str = "DELETE FROM outbox_events \
     WHERE status = 'delivered' AND delivered_at <= $1 ORDER BY seq LIMIT $2";

/// The inbox's table: the migration shipped in `migrations/mysql/`.
pub(crate) const INBOX_SCHEMA: &str =
    include_str!("../../migrations/mysql/20261201000002_inbox_events.sql");

/// Serializes the inbox's `install` (see [`OUTBOX_INSTALL_LOCK`]).
pub(crate) const INBOX_INSTALL_LOCK: i64 = 0x7469_6465_6d70_0003;

/// The longest consumer name or event id `inbox_events` holds, in bytes.
pub(crate) const INBOX_ID_MAX_BYTES: usize = 255;

/// Refuses a consumer name or an event id longer than [`INBOX_ID_MAX_BYTES`] before it reaches
/// the server ([`INSERT_ID`]'s `IGNORE` would cut it short, and two ids would then be one).
pub(crate) fn check_inbox_ids(consumer: &str, event_id: &str) -> Result<(), crate::Error> {
    if consumer.len() <= INBOX_ID_MAX_BYTES && event_id.len() <= INBOX_ID_MAX_BYTES {
        return Ok(());
    }
    Err(crate::Error::Sqlx(sqlx::Error::InvalidArgument(format!(
        "an inbox consumer or event id longer than {INBOX_ID_MAX_BYTES} bytes does not fit the \
         MySQL table"
    ))))
}

/// Records an id. While another transaction holds the same `(consumer, event_id)` (it
/// inserted it and has not ended), this blocks on the primary key; when that one commits, the
/// duplicate key makes this a no-op (0 rows: a duplicate), and when it rolls back, this insert
/// goes through (1 row: the first). `IGNORE` rather than `ON DUPLICATE KEY UPDATE`, whose
/// count the driver's found-rows mode makes 1 either way.
pub(crate) const INSERT_ID: &str = "INSERT IGNORE INTO inbox_events \
     (consumer, event_id, processed_at) VALUES ($1, $2, $3)";

/// Deletes up to `$3` ids of consumer `$1` processed before `$2`, oldest first.
pub(crate) const PURGE_INBOX: &str = "DELETE FROM inbox_events \
     WHERE consumer = $1 AND processed_at <= $2 ORDER BY processed_at LIMIT $3";
