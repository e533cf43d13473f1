-- tower-idempotency: the table of idempotency records on SQLite (the sqlx SQLite store).
--
-- Run it with `sqlx migrate run` (copy it into your own migrations directory) or embed it
-- with `sqlx::migrate!`. `SqlxSqliteStore::migrate` runs the same text (and turns on WAL);
-- every statement here is `IF NOT EXISTS`, so either order works.
--
-- The same layout as the PostgreSQL and MySQL tables. The store writes only `completed`
-- rows: its reservation is the database's write lock, held by the request's transaction.

CREATE TABLE IF NOT EXISTS idempotency_records (
    tenant              TEXT    NOT NULL,
    operation           TEXT    NOT NULL,
    idempotency_key     TEXT    NOT NULL,
    fingerprint         BLOB,
    fingerprint_version INTEGER,
    status              INTEGER,
    headers             TEXT,
    body                BLOB,
    trailers            TEXT,
    created_at          INTEGER NOT NULL,
    expires_at          INTEGER NOT NULL,
    state               TEXT    NOT NULL DEFAULT 'completed',
    PRIMARY KEY (tenant, operation, idempotency_key),
    CONSTRAINT idempotency_records_state CHECK (state IN ('in_progress', 'completed')),
    CONSTRAINT idempotency_records_completed CHECK (state = 'in_progress' OR (
        fingerprint IS NOT NULL AND fingerprint_version IS NOT NULL AND status IS NOT NULL
        AND headers IS NOT NULL AND body IS NOT NULL))
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at
    ON idempotency_records (expires_at);
