-- tower-idempotency: the table of idempotency records (MySQL 8.0.16 or later, MariaDB 10.3 or
-- later; InnoDB).
--
-- Run it with `sqlx migrate run --source <directory holding it>` (copy it into your own MySQL
-- migrations) or embed it with `sqlx::migrate!`. The store's `migrate()` runs the same text;
-- it is `IF NOT EXISTS`, so either order works.
--
-- The same columns as the PostgreSQL table. The scope columns are byte strings, compared byte
-- for byte (no collation folds case or ignores trailing spaces); 255 bytes each, which holds
-- 255-character keys. A reservation is an `in_progress` row whose response columns are still
-- empty; other transactions never see one (it is committed only as `completed`).
CREATE TABLE IF NOT EXISTS idempotency_records (
    tenant              VARBINARY(255) NOT NULL,
    operation           VARBINARY(255) NOT NULL,
    idempotency_key     VARBINARY(255) NOT NULL,
    fingerprint         VARBINARY(64),
    fingerprint_version INTEGER,
    status              INTEGER,
    headers             MEDIUMTEXT,
    body                LONGBLOB,
    trailers            MEDIUMTEXT,
    created_at          BIGINT NOT NULL,
    expires_at          BIGINT NOT NULL,
    state               VARCHAR(16) NOT NULL DEFAULT 'completed',
    PRIMARY KEY (tenant, operation, idempotency_key),
    KEY idempotency_records_expires_at (expires_at),
    CONSTRAINT idempotency_records_state CHECK (state IN ('in_progress', 'completed')),
    CONSTRAINT idempotency_records_completed CHECK (state = 'in_progress' OR (
        fingerprint IS NOT NULL AND fingerprint_version IS NOT NULL AND status IS NOT NULL
        AND headers IS NOT NULL AND body IS NOT NULL))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
