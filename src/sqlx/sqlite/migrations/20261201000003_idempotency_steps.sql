-- tower-idempotency: the tables of step-by-step requests on SQLite (the sqlx SQLite store).
--
-- Run it with `sqlx migrate run` (copy it into your own migrations directory) or embed it
-- with `sqlx::migrate!`. `install_steps()` runs the same text; every statement is
-- `IF NOT EXISTS`, so either order works.
--
-- A key in progress has a row in `idempotency_progress` (its lease, generation, run id, expiry
-- and the request it was sent with) and one row per step saved in `idempotency_steps`
-- (`result` NULL: a foreign step's intent). Both are deleted when the key finishes and its
-- final response is saved in `idempotency_records`. Times are Unix milliseconds.

CREATE TABLE IF NOT EXISTS idempotency_progress (
    tenant              TEXT    NOT NULL,
    operation           TEXT    NOT NULL,
    idempotency_key     TEXT    NOT NULL,
    fingerprint         BLOB    NOT NULL,
    fingerprint_version INTEGER NOT NULL,
    status              TEXT    NOT NULL,
    generation          INTEGER NOT NULL,
    lease_owner         TEXT,
    lease_until         INTEGER NOT NULL,
    attempts            INTEGER NOT NULL DEFAULT 0,
    last_error          TEXT,
    method              TEXT    NOT NULL,
    uri                 TEXT    NOT NULL,
    headers             TEXT    NOT NULL,
    body                BLOB    NOT NULL,
    created_at          INTEGER NOT NULL,
    updated_at          INTEGER NOT NULL,
    run_id              TEXT    NOT NULL,
    expires_at          INTEGER NOT NULL,
    PRIMARY KEY (tenant, operation, idempotency_key),
    CONSTRAINT idempotency_progress_status CHECK (status IN ('running', 'in_doubt', 'dead'))
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idempotency_progress_idle
    ON idempotency_progress (status, updated_at);
CREATE INDEX IF NOT EXISTS idempotency_progress_expiry
    ON idempotency_progress (status, expires_at);
CREATE TABLE IF NOT EXISTS idempotency_steps (
    tenant          TEXT    NOT NULL,
    operation       TEXT    NOT NULL,
    idempotency_key TEXT    NOT NULL,
    seq             INTEGER NOT NULL,
    name            TEXT    NOT NULL,
    kind            TEXT    NOT NULL,
    result          TEXT,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL,
    PRIMARY KEY (tenant, operation, idempotency_key, seq),
    CONSTRAINT idempotency_steps_kind CHECK (kind IN ('local', 'foreign'))
) WITHOUT ROWID;
