//! The SQL of the SQLite outbox and inbox, with the parameters of `postgres/outbox_sql.rs` in
//! the same `$n` numbering, so that the logic of `row_lock/outbox.rs` binds one list on every
//! server. A claim runs in a transaction that holds the database's write lock: no other relay
//! claims at the same time, so nothing is skipped or waited for row by row. Times are Unix
//! milliseconds.

pub(crate) use crate::row_lock::outbox_sql::*;

/// The migration shipped in this folder's `migrations/`.
pub(crate) const SCHEMA: &str = include_str!("migrations/20261201000001_outbox_events.sql");

/// Not used: SQLite runs `CREATE ... IF NOT EXISTS` under its write lock.
pub(crate) const OUTBOX_INSTALL_LOCK: i64 = 0;

/// The inbox's table: the migration shipped in this folder's `migrations/`.
pub(crate) const INBOX_SCHEMA: &str = include_str!("migrations/20261201000002_inbox_events.sql");

/// Not used (see [`OUTBOX_INSTALL_LOCK`]).
pub(crate) const INBOX_INSTALL_LOCK: i64 = 0;

/// Records an id: 1 row if it is new, 0 if the consumer has it (a duplicate). A transaction
/// that holds the same id uncommitted holds the write lock too: this waits for it to end.
pub(crate) const INSERT_ID: &str = "INSERT INTO inbox_events (consumer, event_id, processed_at) \
     VALUES ($1, $2, $3) ON CONFLICT (consumer, event_id) DO NOTHING";

/// Dead-letters the events whose last allowed attempt was abandoned (the lease ran out).
pub(crate) const DEAD_LETTER_ABANDONED: &str = "UPDATE outbox_events SET status = 'dead', \
     lease_owner = NULL, last_error = 'abandoned: the lease of its last attempt ran out' \
     WHERE status = 'pending' AND lease_owner IS NOT NULL \
     AND available_at <= $1 AND attempts >= $2 \
     RETURNING seq, event_id, topic, payload, attempts, created_at";

/// Claims due events, oldest first, for `$1` until `$2` (`$3`: now, `$4`: the batch).
pub(crate) const CLAIM: &str = "UPDATE outbox_events SET lease_owner = $1, available_at = $2, \
     attempts = attempts + 1 \
     WHERE seq IN (SELECT seq FROM outbox_events \
         WHERE status = 'pending' AND available_at <= $3 \
         ORDER BY available_at, seq LIMIT $4) \
     RETURNING seq, event_id, topic, payload, attempts, created_at";

/// `(status, leased, count)` rows: an event is in flight while its lease runs (`$1`: now).
pub(crate) const COUNT_BY_STATE: &str = "SELECT status, lease_owner IS NOT NULL AND \
     available_at > $1, count(*) \
     FROM outbox_events GROUP BY 1, 2";

/// Deletes up to `$2` events delivered before `$1`, oldest first.
pub(crate) const PURGE_DELIVERED: &str = "DELETE FROM outbox_events WHERE seq IN (SELECT seq \
     FROM outbox_events WHERE status = 'delivered' AND delivered_at <= $1 ORDER BY seq \
     LIMIT $2)";

/// Deletes up to `$3` ids of consumer `$1` processed before `$2`, oldest first.
pub(crate) const PURGE_INBOX: &str = "DELETE FROM inbox_events WHERE (consumer, event_id) IN ( \
     SELECT consumer, event_id FROM inbox_events \
     WHERE consumer = $1 AND processed_at <= $2 ORDER BY processed_at LIMIT $3)";

/// Any consumer name and event id fit `inbox_events` (`TEXT`).
pub(crate) fn check_inbox_ids(_consumer: &str, _event_id: &str) -> Result<(), crate::Error> {
    Ok(())
}
