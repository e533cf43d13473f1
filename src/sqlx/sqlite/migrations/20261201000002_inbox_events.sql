-- tower-idempotency: the receiver's inbox on SQLite (the sqlx SQLite store): the ids of the
-- events each consumer has processed. Times are Unix milliseconds.
--
-- Run it with `sqlx migrate run` (copy it into your own migrations directory) or embed it
-- with `sqlx::migrate!`. `Inbox::install` runs the same text; every statement is
-- `IF NOT EXISTS`, so either order works.

CREATE TABLE IF NOT EXISTS inbox_events (
    consumer     TEXT    NOT NULL,
    event_id     TEXT    NOT NULL,
    processed_at INTEGER NOT NULL,
    PRIMARY KEY (consumer, event_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS inbox_events_processed_at ON inbox_events (processed_at);
