//! The SQL of the PostgreSQL outbox and inbox, shared by the tokio-postgres store
//! (`postgres.rs`) and the sqlx store (`sqlx_postgres.rs`): one copy of the tables and of every
//! statement, so that both drivers read and write them the same way. Times are Unix
//! milliseconds.

/// The same columns and meaning as the SQLite outbox (times are Unix milliseconds).
/// `available_at` is when the event is next due; a claim moves it to the end of the lease, so
/// "due" covers both new events and claims whose relay died: one index serves the claim.
pub(crate) const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS outbox_events (
    seq          BIGSERIAL PRIMARY KEY,
    event_id     TEXT    NOT NULL UNIQUE,
    topic        TEXT    NOT NULL,
    payload      TEXT    NOT NULL,
    status       TEXT    NOT NULL DEFAULT 'pending'
                         CONSTRAINT outbox_events_status
                         CHECK (status IN ('pending', 'delivered', 'dead')),
    attempts     INTEGER NOT NULL DEFAULT 0,
    available_at BIGINT  NOT NULL,
    lease_owner  TEXT,
    last_error   TEXT,
    created_at   BIGINT  NOT NULL,
    delivered_at BIGINT
);
CREATE INDEX IF NOT EXISTS outbox_events_due ON outbox_events (status, available_at);
";

/// Serializes the outbox's `install` between instances starting at the same time
/// (concurrent `CREATE TABLE IF NOT EXISTS` of one table can fail on PostgreSQL's catalog
/// index).
pub(crate) const OUTBOX_INSTALL_LOCK: i64 = 0x7469_6465_6d70_0002;

/// The same table as the SQLite inbox (`processed_at` in Unix milliseconds).
pub(crate) const INBOX_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS inbox_events (
    consumer     TEXT   NOT NULL,
    event_id     TEXT   NOT NULL,
    processed_at BIGINT NOT NULL,
    PRIMARY KEY (consumer, event_id)
);
CREATE INDEX IF NOT EXISTS inbox_events_processed_at ON inbox_events (processed_at);
";

/// Serializes the inbox's `install` (see [`OUTBOX_INSTALL_LOCK`]).
pub(crate) const INBOX_INSTALL_LOCK: i64 = 0x7469_6465_6d70_0003;

/// Records an id. While another transaction holds the same `(consumer, event_id)` (it
/// inserted it and has not ended), this blocks on the primary key; when that one commits,
/// the conflict makes this a no-op (0 rows: a duplicate), and when it rolls back, this insert
/// goes through (1 row: the first).
pub(crate) const INSERT_ID: &str = "INSERT INTO inbox_events (consumer, event_id, processed_at) \
     VALUES ($1, $2, $3) ON CONFLICT (consumer, event_id) DO NOTHING";

/// Adds a pending event, due at once: `(event_id, topic, payload, now)`.
pub(crate) const INSERT_EVENT: &str = "INSERT INTO outbox_events (event_id, topic, payload, \
     status, \
     attempts, available_at, created_at) VALUES ($1, $2, $3, 'pending', 0, $4, $4)";

/// Dead-letters the events whose last allowed attempt was abandoned (the lease ran out).
pub(crate) const DEAD_LETTER_ABANDONED: &str = "UPDATE outbox_events SET status = 'dead', \
     lease_owner = NULL, last_error = 'abandoned: the lease of its last attempt ran out' \
     WHERE seq IN (SELECT seq FROM outbox_events \
         WHERE status = 'pending' AND lease_owner IS NOT NULL \
         AND available_at <= $1 AND attempts >= $2 \
         FOR UPDATE SKIP LOCKED) \
     RETURNING seq, event_id, topic, payload, attempts, created_at";

/// Claims due events. SKIP LOCKED: rows another relay is claiming right now are skipped, not
/// waited for; a row claimed and committed meanwhile is re-checked (no longer due) and left.
pub(crate) const CLAIM: &str = "UPDATE outbox_events SET lease_owner = $1, available_at = $2, \
     attempts = attempts + 1 \
     WHERE seq IN (SELECT seq FROM outbox_events \
         WHERE status = 'pending' AND available_at <= $3 \
         ORDER BY available_at, seq LIMIT $4 \
         FOR UPDATE SKIP LOCKED) \
     RETURNING seq, event_id, topic, payload, attempts, created_at";

/// Whether any event is due: an idle relay's poll, a plain read that locks nothing.
pub(crate) const SELECT_DUE: &str = "SELECT EXISTS (SELECT 1 FROM outbox_events \
     WHERE status = 'pending' AND available_at <= $1)";

/// Marks an event delivered, whoever holds the claim now: the sink accepted it, and that stays
/// true.
pub(crate) const SETTLE_DELIVERED: &str = "UPDATE outbox_events SET status = 'delivered', \
     delivered_at = $2, \
     lease_owner = NULL, last_error = NULL \
     WHERE event_id = $1 AND status = 'pending'";

/// Schedules a failed event again, only under the claim `$2`: if it ran out and another relay
/// claimed the event, that relay decides what happens next.
pub(crate) const SETTLE_RETRY: &str = "UPDATE outbox_events SET available_at = $3, lease_owner \
     = NULL, \
     last_error = $4 \
     WHERE event_id = $1 AND lease_owner = $2 AND status = 'pending'";

/// Dead-letters an event, only under the claim `$2`.
pub(crate) const SETTLE_DEAD: &str = "UPDATE outbox_events SET status = 'dead', lease_owner = \
     NULL, \
     last_error = $3 \
     WHERE event_id = $1 AND lease_owner = $2 AND status = 'pending'";

/// `(pending, dead)` counts, for the backlog gauges.
pub(crate) const BACKLOG: &str = "SELECT (SELECT count(*) FROM outbox_events WHERE status = \
     'pending'), \
     (SELECT count(*) FROM outbox_events WHERE status = 'dead')";

/// `(status, leased, count)` rows: an event is in flight while its lease runs (`$1`: now).
pub(crate) const COUNT_BY_STATE: &str = "SELECT status, lease_owner IS NOT NULL AND \
     available_at > $1, count(*) \
     FROM outbox_events GROUP BY 1, 2";

/// Moves the dead event `$1` back to pending, due at `$2`, attempts reset.
pub(crate) const REQUEUE: &str = "UPDATE outbox_events SET status = 'pending', attempts = 0, \
     available_at = $2, lease_owner = NULL \
     WHERE event_id = $1 AND status = 'dead'";

/// [`REQUEUE`] for every dead event.
pub(crate) const REQUEUE_ALL_DEAD: &str = "UPDATE outbox_events SET status = 'pending', \
     attempts = 0, \
     available_at = $1, lease_owner = NULL WHERE status = 'dead'";

/// Deletes up to `$2` events delivered before `$1`; SKIP LOCKED, so several instances may purge at
/// once.
pub(crate) const PURGE_DELIVERED: &str = "DELETE FROM outbox_events WHERE seq IN (SELECT seq \
     FROM outbox_events \
     WHERE status = 'delivered' AND delivered_at <= $1 LIMIT $2 \
     FOR UPDATE SKIP LOCKED)";

/// Whether `$1` has processed the event `$2` (committed).
pub(crate) const INBOX_CONTAINS: &str = "SELECT EXISTS (SELECT 1 FROM inbox_events \
     WHERE consumer = $1 AND event_id = $2)";

/// Deletes up to `$3` ids of consumer `$1` processed before `$2` (SKIP LOCKED).
pub(crate) const PURGE_INBOX: &str = "DELETE FROM inbox_events WHERE (consumer, event_id) IN ( \
     SELECT consumer, event_id FROM inbox_events \
     WHERE consumer = $1 AND processed_at <= $2 LIMIT $3 \
     FOR UPDATE SKIP LOCKED)";

/// One event by id, in [`EVENT_COLUMNS`](super::columns::EVENT_COLUMNS) order.
pub(crate) const SELECT_EVENT: &str = "SELECT event_id, topic, payload, status, attempts, \
     created_at, available_at, delivered_at, last_error, lease_owner \
     FROM outbox_events WHERE event_id = $1";

/// Dead-lettered events, oldest first, at most `$1`, in `EVENT_COLUMNS` order.
pub(crate) const DEAD_LETTERS: &str = "SELECT event_id, topic, payload, status, attempts, \
     created_at, available_at, delivered_at, last_error, lease_owner \
     FROM outbox_events WHERE status = 'dead' ORDER BY seq LIMIT $1";

#[cfg(test)]
mod tests {
    use super::super::columns::EVENT_COLUMNS;
    use super::*;

    #[test]
    fn event_reads_select_the_columns_raw_event_expects() {
        for sql in [SELECT_EVENT, DEAD_LETTERS] {
            assert!(
                sql.contains(&format!("SELECT {EVENT_COLUMNS} FROM")),
                "{sql}"
            );
        }
    }
}
