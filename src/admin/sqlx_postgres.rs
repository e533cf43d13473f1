//! [`AdminBackend`] on the sqlx PostgreSQL store: the SQL of the tokio-postgres store's admin
//! calls (shared through `pg_sql.rs`), run in autocommit on the store's pool, with the same
//! meaning (a reservation is never a record; see the `postgres` backend).

use std::time::SystemTime;

use sqlx::postgres::PgRow;
// The `Executor` methods keep these futures provably `Send` (see the store's `reservation.rs`).
use sqlx::{Executor as _, Row as _};

use super::pg_sql::{inspect_record, COUNT_RECORDS, DELETE_RECORD};
use super::{AdminBackend, RawRecord, RecordCounts, RecordFilter, RecordInfo};
use crate::error::Error;
use crate::store::sqlx_postgres::SqlxPostgresStore;
use crate::store::to_unix_millis;

impl AdminBackend for SqlxPostgresStore {
    async fn inspect_record(
        &self,
        tenant: &str,
        operation: &str,
        key: &str,
        with_body: bool,
    ) -> Result<Option<RecordInfo>, Error> {
        let sql = inspect_record(with_body);
        let inspect = sqlx::query(&sql).bind(tenant).bind(operation).bind(key);
        let row = self.pool().fetch_optional(inspect).await?;
        row.map(|row| raw_record(&row)?.into_info(tenant, operation, key))
            .transpose()
    }

    async fn delete_record(&self, tenant: &str, operation: &str, key: &str) -> Result<bool, Error> {
        let delete = sqlx::query(DELETE_RECORD)
            .bind(tenant)
            .bind(operation)
            .bind(key);
        Ok(self.pool().execute(delete).await?.rows_affected() > 0)
    }

    async fn count_records(&self, filter: &RecordFilter) -> Result<RecordCounts, Error> {
        let count = sqlx::query(COUNT_RECORDS)
            .bind(to_unix_millis(SystemTime::now()))
            .bind(filter.tenant.as_deref())
            .bind(filter.operation.as_deref());
        let row = self.pool().fetch_one(count).await?;
        Ok(RecordCounts::from_columns(row.try_get(0)?, row.try_get(1)?))
    }
}

/// A completed record's columns, in the order `inspect` selects them.
fn raw_record(row: &PgRow) -> Result<RawRecord, Error> {
    let missing = |what: &str| Error::Corrupt(format!("{what} missing"));
    Ok(RawRecord {
        version: row
            .try_get::<Option<i32>, _>(0)?
            .ok_or_else(|| missing("fingerprint version"))?
            .into(),
        digest: row
            .try_get::<Option<Vec<u8>>, _>(1)?
            .ok_or_else(|| missing("fingerprint"))?,
        status: row
            .try_get::<Option<i32>, _>(2)?
            .ok_or_else(|| missing("status"))?
            .into(),
        headers: row
            .try_get::<Option<String>, _>(3)?
            .ok_or_else(|| missing("headers"))?,
        body_len: row
            .try_get::<Option<i32>, _>(4)?
            .ok_or_else(|| missing("body"))?
            .into(),
        body: row.try_get(5)?,
        created_at: row.try_get(6)?,
        expires_at: row.try_get(7)?,
    })
}
