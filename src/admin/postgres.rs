//! [`AdminBackend`] on a PostgreSQL database: the SQL of the admin calls.
//!
//! Statements run in autocommit on pooled connections of the store. A request's reservation
//! is never visible to them (it is committed only as a completed record); a reservation that
//! a handler committed itself (a stray `in_progress` row, written already expired) is not a
//! record: [`Admin::inspect`](super::Admin::inspect) does not show it, [`Admin::counts`](super::Admin::counts) counts it as expired and
//! [`Admin::purge_expired`](super::Admin::purge_expired) removes it.

use std::time::SystemTime;

use tokio_postgres::row::Row;

use super::pg_sql::{inspect_record, COUNT_RECORDS, DELETE_RECORD};
use super::{AdminBackend, RawRecord, RecordCounts, RecordFilter, RecordInfo};
use crate::error::Error;
use crate::store::postgres::PostgresStore;
use crate::store::to_unix_millis;

impl AdminBackend for PostgresStore {
    async fn inspect_record(
        &self,
        tenant: &str,
        operation: &str,
        key: &str,
        with_body: bool,
    ) -> Result<Option<RecordInfo>, Error> {
        let client = self.client().await?;
        let row = client
            .query_opt(&inspect_record(with_body), &[&tenant, &operation, &key])
            .await?;
        row.map(|row| raw_record(&row)?.into_info(tenant, operation, key))
            .transpose()
    }

    async fn delete_record(&self, tenant: &str, operation: &str, key: &str) -> Result<bool, Error> {
        let client = self.client().await?;
        let deleted = client
            .execute(DELETE_RECORD, &[&tenant, &operation, &key])
            .await?;
        Ok(deleted > 0)
    }

    async fn count_records(&self, filter: &RecordFilter) -> Result<RecordCounts, Error> {
        let now = to_unix_millis(SystemTime::now());
        let client = self.client().await?;
        let row = client
            .query_one(
                COUNT_RECORDS,
                &[
                    &now,
                    &filter.tenant.as_deref(),
                    &filter.operation.as_deref(),
                ],
            )
            .await?;
        Ok(RecordCounts::from_columns(row.try_get(0)?, row.try_get(1)?))
    }
}

/// A completed record's columns, in the order `inspect` selects them.
fn raw_record(row: &Row) -> Result<RawRecord, Error> {
    let missing = |what: &str| Error::Corrupt(format!("{what} missing"));
    Ok(RawRecord {
        version: row
            .try_get::<_, Option<i32>>(0)?
            .ok_or_else(|| missing("fingerprint version"))?
            .into(),
        digest: row
            .try_get::<_, Option<Vec<u8>>>(1)?
            .ok_or_else(|| missing("fingerprint"))?,
        status: row
            .try_get::<_, Option<i32>>(2)?
            .ok_or_else(|| missing("status"))?
            .into(),
        headers: row
            .try_get::<_, Option<String>>(3)?
            .ok_or_else(|| missing("headers"))?,
        body_len: row
            .try_get::<_, Option<i32>>(4)?
            .ok_or_else(|| missing("body"))?
            .into(),
        body: row.try_get(5)?,
        created_at: row.try_get(6)?,
        expires_at: row.try_get(7)?,
    })
}
