//! The SQL of the PostgreSQL outbox and inbox, shared by the tokio-postgres store
//! (`src/tokio_postgres/`) and the sqlx store (`src/sqlx/postgres/`): one copy of the tables and of every
//! statement, so that both drivers read and write them the same way. Times are Unix
//! milliseconds. The statements that MySQL runs as written too are in `row_lock/outbox_sql.rs`.

pub(crate) use crate::row_lock::outbox_sql::*;

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

/// `(status, leased, count)` rows: an event is in flight while its lease runs (`$1`: now).
pub(crate) const COUNT_BY_STATE: &str = "SELECT status, lease_owner IS NOT NULL AND \
     available_at > $1, count(*) \
     FROM outbox_events GROUP BY 1, 2";

/// Deletes up to `$2` events delivered before `$1`; SKIP LOCKED, so several instances may purge at
/// once.
pub(crate) const PURGE_DELIVERED: &str = "DELETE FROM outbox_events WHERE seq IN (SELECT seq \
     FROM outbox_events \
     WHERE status = 'delivered' AND delivered_at <= $1 LIMIT $2 \
     FOR UPDATE SKIP LOCKED)";

/// Deletes up to `$3` ids of consumer `$1` processed before `$2` (SKIP LOCKED).
pub(crate) const PURGE_INBOX: &str = "DELETE FROM inbox_events WHERE (consumer, event_id) IN ( \
     SELECT consumer, event_id FROM inbox_events \
     WHERE consumer = $1 AND processed_at <= $2 LIMIT $3 \
     FOR UPDATE SKIP LOCKED)";

/// Any consumer name and event id fit `inbox_events` (`TEXT`).
pub(crate) fn check_inbox_ids(_consumer: &str, _event_id: &str) -> Result<(), crate::Error> {
    Ok(())
}
