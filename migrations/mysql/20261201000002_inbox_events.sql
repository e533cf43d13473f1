-- tower-idempotency: the receiver's inbox of processed event ids (MySQL 8.0 or later, MariaDB
-- 10.6 or later; InnoDB). The inbox's `install` runs the same text; it is `IF NOT EXISTS`, so
-- either order works.
--
-- The same table as the PostgreSQL and SQLite inboxes (`processed_at` in Unix milliseconds).
-- The consumer and the event id are byte strings, compared byte for byte, 255 bytes each.
CREATE TABLE IF NOT EXISTS inbox_events (
    consumer     VARBINARY(255) NOT NULL,
    event_id     VARBINARY(255) NOT NULL,
    processed_at BIGINT         NOT NULL,
    PRIMARY KEY (consumer, event_id),
    KEY inbox_events_processed_at (processed_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
