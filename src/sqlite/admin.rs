//! [`AdminBackend`] on a SQLite file: the SQL of the admin calls.

use std::time::SystemTime;

use rusqlite::{params, OptionalExtension};

use crate::admin::{AdminBackend, RawRecord, RecordCounts, RecordFilter, RecordInfo};
use crate::error::Error;
use crate::store::sqlite::SqliteStore;
use crate::store::to_unix_millis;

impl crate::admin::sealed::Sealed for SqliteStore {}

/// Reads on a reader (WAL: they never wait); a delete waits for the writer, behind the
/// requests that hold it.
impl AdminBackend for SqliteStore {
    async fn inspect_record(
        &self,
        tenant: &str,
        operation: &str,
        key: &str,
        with_body: bool,
    ) -> Result<Option<RecordInfo>, Error> {
        let scope = (tenant.to_owned(), operation.to_owned(), key.to_owned());
        let raw = self
            .read(move |conn| {
                let body_column = if with_body { "body" } else { "NULL" };
                conn.query_row(
                    &format!(
                        "SELECT fingerprint_version, fingerprint, status, headers, length(body), \
                         {body_column}, created_at, expires_at FROM idempotency_records \
                         WHERE tenant = ?1 AND operation = ?2 AND idempotency_key = ?3"
                    ),
                    params![scope.0, scope.1, scope.2],
                    |row| RawRecord::read(row),
                )
                .optional()
            })
            .await?;
        raw.map(|raw| raw.into_info(tenant, operation, key))
            .transpose()
    }

    async fn delete_record(&self, tenant: &str, operation: &str, key: &str) -> Result<bool, Error> {
        let scope = (tenant.to_owned(), operation.to_owned(), key.to_owned());
        let deleted = self
            .write(move |tx| {
                tx.execute(
                    "DELETE FROM idempotency_records \
                     WHERE tenant = ?1 AND operation = ?2 AND idempotency_key = ?3",
                    params![scope.0, scope.1, scope.2],
                )
            })
            .await?;
        Ok(deleted > 0)
    }

    async fn count_records(&self, filter: &RecordFilter) -> Result<RecordCounts, Error> {
        let filter = filter.clone();
        let now = to_unix_millis(SystemTime::now());
        let (live, expired) = self
            .read(move |conn| {
                conn.query_row(
                    "SELECT count(*) FILTER (WHERE expires_at > ?1), \
                     count(*) FILTER (WHERE expires_at <= ?1) \
                     FROM idempotency_records \
                     WHERE (?2 IS NULL OR tenant = ?2) AND (?3 IS NULL OR operation = ?3)",
                    params![now, filter.tenant, filter.operation],
                    |row| Ok((row.get::<_, i64>(0)?, row.get::<_, i64>(1)?)),
                )
            })
            .await?;
        Ok(RecordCounts::from_columns(live, expired))
    }
}
