-- tower-idempotency: the transactional outbox on SQLite (the sqlx SQLite store).
--
-- Run it with `sqlx migrate run` (copy it into your own migrations directory) or embed it
-- with `sqlx::migrate!`. `Outbox::install` runs the same text; every statement is
-- `IF NOT EXISTS`, so either order works.
--
-- The columns and their meaning are those of the PostgreSQL and MySQL tables. Times are Unix
-- milliseconds. `available_at` is when the event is next due; a claim moves it to the end of
-- the lease, so "due" covers both new events and claims whose relay died: one index serves
-- the claim. `seq` is the rowid, without `AUTOINCREMENT` (which writes a sequence table's row
-- at every insert): a new event's is above every event still in the table.

CREATE TABLE IF NOT EXISTS outbox_events (
    seq          INTEGER PRIMARY KEY,
    event_id     TEXT    NOT NULL UNIQUE,
    topic        TEXT    NOT NULL,
    payload      TEXT    NOT NULL,
    status       TEXT    NOT NULL DEFAULT 'pending'
                         CONSTRAINT outbox_events_status
                         CHECK (status IN ('pending', 'delivered', 'dead')),
    attempts     INTEGER NOT NULL DEFAULT 0,
    available_at INTEGER NOT NULL,
    lease_owner  TEXT,
    last_error   TEXT,
    created_at   INTEGER NOT NULL,
    delivered_at INTEGER
);
CREATE INDEX IF NOT EXISTS outbox_events_due ON outbox_events (status, available_at);
