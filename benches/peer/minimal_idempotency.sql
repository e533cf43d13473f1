-- The table the minimal handler (the article's, without the crate) keeps its answers in: one row
-- per (tenant, key), with the payload it came with and the status and body it got. Used by
-- `peer --minimal` and by case M of `cargo bench --bench orders -- --cases wal`.
CREATE TABLE IF NOT EXISTS idempotency (
    tenant  TEXT    NOT NULL,
    key     TEXT    NOT NULL,
    payload BLOB    NOT NULL,
    status  INTEGER NOT NULL,
    body    BLOB    NOT NULL,
    PRIMARY KEY (tenant, key)
);
