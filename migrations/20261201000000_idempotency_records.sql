-- tower-idempotency: the table of idempotency records (PostgreSQL 13 or later).
--
-- Run it with `sqlx migrate run` (copy it into your own migrations directory) or embed it
-- with `sqlx::migrate!`. The stores create the same table themselves unless told not to
-- (`create_schema(false)`); every statement here is `IF NOT EXISTS`, so either order works.
--
-- A reservation is an `in_progress` row whose response columns are still empty; other
-- transactions never see one (it is committed only as `completed`).

CREATE TABLE IF NOT EXISTS idempotency_records (
    tenant              TEXT    NOT NULL,
    operation           TEXT    NOT NULL,
    idempotency_key     TEXT    NOT NULL,
    fingerprint         BYTEA,
    fingerprint_version INTEGER,
    status              INTEGER,
    headers             TEXT,
    body                BYTEA,
    trailers            TEXT,
    created_at          BIGINT  NOT NULL,
    expires_at          BIGINT  NOT NULL,
    state               TEXT    NOT NULL DEFAULT 'completed',
    PRIMARY KEY (tenant, operation, idempotency_key),
    CONSTRAINT idempotency_records_state CHECK (state IN ('in_progress', 'completed')),
    CONSTRAINT idempotency_records_completed CHECK (state = 'in_progress' OR (
        fingerprint IS NOT NULL AND fingerprint_version IS NOT NULL AND status IS NOT NULL
        AND headers IS NOT NULL AND body IS NOT NULL))
);
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at
    ON idempotency_records (expires_at);
