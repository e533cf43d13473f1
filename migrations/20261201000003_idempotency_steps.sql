-- tower-idempotency: the tables of step-by-step requests (PostgreSQL 13 or later).
--
-- Run it with `sqlx migrate run` (copy it into your own migrations directory) or embed it
-- with `sqlx::migrate!`. The stores' `install_steps()` runs the same text; every statement is
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
    fingerprint         BYTEA   NOT NULL,
    fingerprint_version INTEGER NOT NULL,
    status              TEXT    NOT NULL,
    generation          BIGINT  NOT NULL,
    lease_owner         TEXT,
    lease_until         BIGINT  NOT NULL,
    attempts            INTEGER NOT NULL DEFAULT 0,
    last_error          TEXT,
    method              TEXT    NOT NULL,
    uri                 TEXT    NOT NULL,
    headers             TEXT    NOT NULL,
    body                BYTEA   NOT NULL,
    created_at          BIGINT  NOT NULL,
    updated_at          BIGINT  NOT NULL,
    run_id              TEXT    NOT NULL,
    expires_at          BIGINT  NOT NULL,
    PRIMARY KEY (tenant, operation, idempotency_key),
    CONSTRAINT idempotency_progress_status CHECK (status IN ('running', 'in_doubt', 'dead'))
);
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
    created_at      BIGINT  NOT NULL,
    updated_at      BIGINT  NOT NULL,
    PRIMARY KEY (tenant, operation, idempotency_key, seq),
    CONSTRAINT idempotency_steps_kind CHECK (kind IN ('local', 'foreign'))
);
