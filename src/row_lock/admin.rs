//! [`AdminBackend`] on the SQL servers, for every driver (tokio-postgres' `PostgresStore`,
//! sqlx' `SqlxPostgresStore`, `SqlxMySqlStore` and `SqlxSqliteStore`, through [`SqlDriver`]):
//! the statements of `postgres/admin_sql.rs` on PostgreSQL, of `mysql/admin_sql.rs` on MySQL
//! and MariaDB, of `sqlx/sqlite/admin_sql.rs` on SQLite.
//!
//! Statements run in autocommit on pooled connections of the store. A request's reservation
//! is never visible to them (it is committed only as a completed record); a reservation that
//! a handler committed itself (a stray `in_progress` row, written already expired) is not a
//! record: [`Admin::inspect`](crate::admin::Admin::inspect) does not show it,
//! [`Admin::counts`](crate::admin::Admin::counts) counts it as expired and
//! [`Admin::purge_expired`](crate::admin::Admin::purge_expired) removes it.

/// [`AdminBackend`] on a store, with the statements of the server's SQL module `$sql` (written
/// once; expanded in each store's folder, as concrete impls, so that the driver trait stays
/// private).
macro_rules! sql_admin {
    ($store:ty, $sql:ident) => {
        const _: () = {
            use $crate::row_lock::admin::engine::*;

            impl $crate::admin::sealed::Sealed for $store {}

            impl AdminBackend for $store {
                async fn inspect_record(
                    &self,
                    tenant: &str,
                    operation: &str,
                    key: &str,
                    with_body: bool,
                ) -> Result<Option<RecordInfo>, Error> {
                    let scope = [tenant.into(), operation.into(), key.into()];
                    let rows = self
                        .fetch_rows(&$sql::inspect_record(with_body), &scope)
                        .await?;
                    rows.first()
                        .map(|row| RawRecord::read(row)?.into_info(tenant, operation, key))
                        .transpose()
                }

                async fn delete_record(
                    &self,
                    tenant: &str,
                    operation: &str,
                    key: &str,
                ) -> Result<bool, Error> {
                    let scope = [tenant.into(), operation.into(), key.into()];
                    Ok(self.execute_counted($sql::DELETE_RECORD, &scope).await? > 0)
                }

                async fn count_records(
                    &self,
                    filter: &RecordFilter,
                ) -> Result<RecordCounts, Error> {
                    let params = [
                        to_unix_millis(SystemTime::now()).into(),
                        SqlParam::OptionalText(filter.tenant.as_deref()),
                        SqlParam::OptionalText(filter.operation.as_deref()),
                    ];
                    let rows = self.fetch_rows($sql::COUNT_RECORDS, &params).await?;
                    let row = rows
                        .first()
                        .ok_or_else(|| Error::Corrupt("record counts: no row".into()))?;
                    Ok(RecordCounts::from_columns(
                        row.required_big_int(0, "live count")?,
                        row.required_big_int(1, "expired count")?,
                    ))
                }
            }
        };
    };
}

/// Each store invokes it in its folder (its `driver.rs`).
pub(crate) use sql_admin;

/// What [`sql_admin!`]'s expansion names: it imports them all, wherever it is invoked.
pub(crate) mod engine {
    pub(crate) use std::time::SystemTime;

    pub(crate) use crate::admin::{
        AdminBackend, RawRecord, RecordCounts, RecordFilter, RecordInfo,
    };
    pub(crate) use crate::error::Error;
    pub(crate) use crate::row::Columns;
    pub(crate) use crate::row_lock::driver::{SqlDriver, SqlParam};
    pub(crate) use crate::store::to_unix_millis;
}
