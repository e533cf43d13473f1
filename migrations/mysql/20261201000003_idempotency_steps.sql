-- tower-idempotency: the tables of step-by-step requests (MySQL 8.0.16 or later, MariaDB 10.3
-- or later; InnoDB). The stores' `install_steps()` runs the same text; it is `IF NOT EXISTS`,
-- so either order works.
--
-- The same columns and meaning as the PostgreSQL and SQLite tables (times are Unix
-- milliseconds). The scope columns are byte strings, compared byte for byte, 255 bytes each,
-- as in `idempotency_records`.
CREATE TABLE IF NOT EXISTS idempotency_progress (
    tenant              VARBINARY(255) NOT NULL,
    operation           VARBINARY(255) NOT NULL,
    idempotency_key     VARBINARY(255) NOT NULL,
    fingerprint         VARBINARY(64)  NOT NULL,
    fingerprint_version INTEGER        NOT NULL,
    status              VARCHAR(16)    NOT NULL,
    generation          BIGINT         NOT NULL,
    lease_owner         VARCHAR(255),
    lease_until         BIGINT         NOT NULL,
    attempts            INTEGER        NOT NULL DEFAULT 0,
    last_error          TEXT,
    method              TEXT           NOT NULL,
    uri                 MEDIUMTEXT     NOT NULL,
    headers             MEDIUMTEXT     NOT NULL,
    body                LONGBLOB       NOT NULL,
    created_at          BIGINT         NOT NULL,
    updated_at          BIGINT         NOT NULL,
    run_id              VARCHAR(64)    NOT NULL,
    expires_at          BIGINT         NOT NULL,
    PRIMARY KEY (tenant, operation, idempotency_key),
    KEY idempotency_progress_idle (status, updated_at),
    KEY idempotency_progress_expiry (status, expires_at),
    CONSTRAINT idempotency_progress_status CHECK (status IN ('running', 'in_doubt', 'dead'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
CREATE TABLE IF NOT EXISTS idempotency_steps (
    tenant          VARBINARY(255) NOT NULL,
    operation       VARBINARY(255) NOT NULL,
    idempotency_key VARBINARY(255) NOT NULL,
    seq             INTEGER        NOT NULL,
    name            TEXT           NOT NULL,
    kind            VARCHAR(16)    NOT NULL,
    result          LONGTEXT,
    created_at      BIGINT         NOT NULL,
    updated_at      BIGINT         NOT NULL,
    PRIMARY KEY (tenant, operation, idempotency_key, seq),
    CONSTRAINT idempotency_steps_kind CHECK (kind IN ('local', 'foreign'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
