//! [`SqlDriver`] on sqlx's MySQL driver: [`SqlxMySqlStore`] and its [`SqlxMySqlHandle`] handle.
//! The shared statements number their parameters `$n`; [`positional`] sends each as a `?`
//! bound to the n-th value, in the order they appear.

use sqlx::mysql::MySqlRow;
// The `Executor` methods keep these futures provably `Send` (see the store's `reservation.rs`).
use sqlx::{Executor as _, Row as _};

use crate::error::Error;
use crate::mysql::admin_sql;
#[cfg(feature = "outbox")]
use crate::mysql::outbox_sql::{CLAIM, DEAD_LETTER_ABANDONED, SELECT_ABANDONED, SELECT_CLAIMABLE};
#[cfg(feature = "outbox")]
use crate::row::Columns;
use crate::row_lock::driver::SqlHandle;
use crate::row_lock::driver::{columns_by_try_get, SqlDriver, SqlParam};
use crate::sqlx::driver::{our_sql, sqlx_bind};
use crate::store::sqlx_mysql::SqlxMySqlHandle;
use crate::store::sqlx_mysql::SqlxMySqlStore;

// The admin calls (`row_lock/admin.rs`) on this store.
crate::row_lock::admin::sql_admin!(crate::store::sqlx_mysql::SqlxMySqlStore, admin_sql);

/// `sql` with each `$n` replaced by `?`, and the values to bind in that order: `params[n - 1]`
/// for each `$n` (one may appear several times, or not at all).
pub(crate) fn positional<'p>(
    sql: &str,
    params: &[SqlParam<'p>],
) -> Result<(String, Vec<SqlParam<'p>>), Error> {
    let mut text = String::with_capacity(sql.len());
    let mut bound = Vec::with_capacity(params.len());
    let mut rest = sql;
    while let Some(at) = rest.find('$') {
        text.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let digits = after.bytes().take_while(u8::is_ascii_digit).count();
        let param = after[..digits]
            .parse::<usize>()
            .ok()
            .and_then(|n| params.get(n.checked_sub(1)?))
            .ok_or_else(|| {
                Error::Corrupt(format!("no parameter ${} for {sql:?}", &after[..digits]))
            })?;
        text.push('?');
        bound.push(*param);
        rest = &after[digits..];
    }
    text.push_str(rest);
    Ok((text, bound))
}

columns_by_try_get!(MySqlRow, i64);
crate::store::columns::record_row::record_columns_by_try_get!(MySqlRow);

impl SqlDriver for SqlxMySqlStore {
    type Row = MySqlRow;

    async fn fetch_rows(&self, sql: &str, params: &[SqlParam<'_>]) -> Result<Vec<MySqlRow>, Error> {
        let (sql, params) = positional(sql, params)?;
        Ok(self
            .pool()
            .fetch_all(sqlx_bind(sqlx::query(our_sql(sql)), &params))
            .await?)
    }

    async fn execute_counted(&self, sql: &str, params: &[SqlParam<'_>]) -> Result<u64, Error> {
        let (sql, params) = positional(sql, params)?;
        let done = self
            .pool()
            .execute(sqlx_bind(sqlx::query(our_sql(sql)), &params))
            .await?;
        Ok(done.rows_affected())
    }

    #[cfg(feature = "outbox")]
    async fn fetch_in_transaction(
        &self,
        statements: &[(&str, &[SqlParam<'_>])],
    ) -> Result<Vec<Vec<MySqlRow>>, Error> {
        let mut tx = self.pool().begin().await?;
        let mut results = Vec::with_capacity(statements.len());
        for (sql, params) in statements {
            let (sql, params) = positional(sql, params)?;
            results.push(
                (&mut *tx)
                    .fetch_all(sqlx_bind(sqlx::query(our_sql(sql)), &params))
                    .await?,
            );
        }
        tx.commit().await?;
        Ok(results)
    }

    async fn install_tables(&self, lock: i64, schema: &str) -> Result<(), Error> {
        self.install_schema(&format!("tower_idempotency_{lock:x}"), schema)
            .await
    }
}

/// The claim on MySQL, whose updates return no rows: in one transaction, the abandoned events
/// (`dead_letter`'s parameters) and then the due ones (`claim`'s) are each selected with a
/// locking read that skips rows other relays hold, and updated by `seq`. Returns the rows of
/// both, as PostgreSQL's `RETURNING` gives them.
#[cfg(feature = "outbox")]
pub(crate) async fn claim(
    store: &SqlxMySqlStore,
    dead_letter: &[SqlParam<'_>],
    claim: &[SqlParam<'_>],
) -> Result<[Vec<MySqlRow>; 2], Error> {
    let mut tx = store.pool().begin().await?;
    let mut results = Vec::with_capacity(2);
    for (select, update, params) in [
        (SELECT_ABANDONED, DEAD_LETTER_ABANDONED, dead_letter),
        (SELECT_CLAIMABLE, CLAIM, claim),
    ] {
        let (sql, bound) = positional(select, params)?;
        let rows = (&mut *tx)
            .fetch_all(sqlx_bind(sqlx::query(our_sql(sql)), &bound))
            .await?;
        if !rows.is_empty() {
            let seqs = rows
                .iter()
                .map(|row| Ok(row.required_big_int(0, "seq")?.to_string()))
                .collect::<Result<Vec<_>, Error>>()?;
            // Only integers read back from the table are formatted into the statement.
            let (sql, bound) = positional(&format!("{update}({})", seqs.join(", ")), params)?;
            (&mut *tx)
                .execute(sqlx_bind(sqlx::query(our_sql(sql)), &bound))
                .await?;
        }
        results.push(rows);
    }
    tx.commit().await?;
    <[Vec<MySqlRow>; 2]>::try_from(results)
        .map_err(|_| Error::Corrupt("a claim returned no rows".into()))
}

impl SqlHandle for SqlxMySqlHandle {
    type Row = MySqlRow;

    async fn fetch_in(
        &self,
        sql: &'static str,
        params: &[SqlParam<'_>],
    ) -> Result<Vec<MySqlRow>, Error> {
        let (sql, params) = positional(sql, params)?;
        let mut conn = self.acquire().await?;
        Ok((&mut *conn)
            .fetch_all(sqlx_bind(sqlx::query(our_sql(sql)), &params))
            .await?)
    }

    async fn execute_in(&self, sql: &'static str, params: &[SqlParam<'_>]) -> Result<u64, Error> {
        let (sql, params) = positional(sql, params)?;
        let mut conn = self.acquire().await?;
        let done = (&mut *conn)
            .execute(sqlx_bind(sqlx::query(our_sql(sql)), &params))
            .await?;
        Ok(done.rows_affected())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbered_parameters_become_positional_in_order() {
        let params = [SqlParam::Text("a"), SqlParam::BigInt(2)];
        let (sql, bound) = positional("x = $2 AND y = $1 OR z = $2", &params).unwrap();
        assert_eq!(sql, "x = ? AND y = ? OR z = ?");
        let bound: Vec<String> = bound.iter().map(|p| format!("{p:?}")).collect();
        assert_eq!(bound, ["BigInt(2)", "Text(\"a\")", "BigInt(2)"]);
        assert!(positional("x = $3", &params).is_err());
        assert!(positional("x = $0", &params).is_err());
        assert_eq!(positional("no parameters", &[]).unwrap().0, "no parameters");
    }
}

#[cfg(feature = "outbox")]
use crate::mysql::outbox_sql as mysql_outbox_sql;

// The outbox's and the inbox's calls on an executor of the application's (`sqlx/outbox.rs`).
#[cfg(feature = "outbox")]
crate::sqlx::outbox::outbox_database!(sqlx::MySql, mysql_outbox_sql, positional);

// The outbox and the inbox (`row_lock/outbox.rs`) on this store.
#[cfg(feature = "outbox")]
crate::row_lock::outbox::sql_outbox_and_inbox!(
    crate::store::sqlx_mysql::SqlxMySqlStore,
    crate::store::sqlx_mysql::SqlxMySqlHandle,
    mysql_outbox_sql,
    claim
);

use crate::mysql::steps_sql as mysql_steps_sql;

// Step-by-step requests (`row_lock/steps.rs`) on this store.
crate::row_lock::steps::sql_steps!(
    crate::store::sqlx_mysql::SqlxMySqlStore,
    crate::store::sqlx_mysql::SqlxMySqlHandle,
    mysql_steps_sql
);
