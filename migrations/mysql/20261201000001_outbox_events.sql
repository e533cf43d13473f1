-- tower-idempotency: the transactional outbox's table (MySQL 8.0 or later, MariaDB 10.6 or
-- later; InnoDB). The outbox's `install` runs the same text; it is `IF NOT EXISTS`, so either
-- order works.
--
-- The same columns and meaning as the PostgreSQL and SQLite outboxes (times are Unix
-- milliseconds). `available_at` is when the event is next due; a claim moves it to the end of
-- the lease, so "due" covers both new events and claims whose relay died: one index serves the
-- claim.
CREATE TABLE IF NOT EXISTS outbox_events (
    seq          BIGINT        NOT NULL AUTO_INCREMENT PRIMARY KEY,
    event_id     VARCHAR(64)   NOT NULL,
    topic        TEXT          NOT NULL,
    payload      LONGTEXT      NOT NULL,
    status       VARCHAR(16)   NOT NULL DEFAULT 'pending',
    attempts     INTEGER       NOT NULL DEFAULT 0,
    available_at BIGINT        NOT NULL,
    lease_owner  VARCHAR(255),
    last_error   TEXT,
    created_at   BIGINT        NOT NULL,
    delivered_at BIGINT,
    UNIQUE KEY outbox_events_event_id (event_id),
    KEY outbox_events_due (status, available_at),
    CONSTRAINT outbox_events_status CHECK (status IN ('pending', 'delivered', 'dead'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
