//! What the generic store needs from a [`sqlx::Database`] ([`SqlxDatabase`]): its connection
//! as an executor, reading a record row, and the statements whose binds are the same on every
//! database. Implemented once, for every database whose types support it (PostgreSQL, MySQL),
//! so that the store's generic code carries no sqlx trait bounds.

use futures_util::future::BoxFuture;
use sqlx::database::HasStatementCache;
use sqlx::query::Query;
use sqlx::{Database, Encode, Executor, IntoArguments, Pool, Type};

use super::pool_error;
use crate::error::Error;
use crate::response::SavedResponse;
use crate::store::columns::record_row::{live_record, RecordColumns};
use crate::store::{to_unix_millis, NewRecord, Scope, StoredRecord};

/// A statement of the store, its binds still to come.
pub(crate) type Statement<'q, DB> = Query<'q, DB, <DB as Database>::Arguments>;

/// A sqlx database the store runs on (one that caches statements on its connections, which the
/// store can do without: `persistent(false)`).
pub trait SqlxDatabase: Database + HasStatementCache {
    /// `conn` as an executor, for the store's own statements (unchecked).
    fn executor<'c>(conn: &'c mut Self::Connection) -> impl Executor<'c, Database = Self> + 'c;

    /// `pool` as an executor: each statement on a connection of its own, in autocommit.
    fn pool_executor<'p>(pool: &'p Pool<Self>) -> impl Executor<'p, Database = Self> + 'p;

    /// Binds the scope: tenant, operation, key.
    fn bind_scope<'q>(query: Statement<'q, Self>, scope: &'q Scope) -> Statement<'q, Self>;

    /// Binds the completed record's columns: fingerprint, fingerprint version, status,
    /// headers, body, trailers, created and expiry times.
    fn bind_record<'q>(query: Statement<'q, Self>, record: &'q NewRecord) -> Statement<'q, Self>;

    /// Runs `sql`, whose binds are the scope and then, if `bind_now`, `now`, and reads its
    /// row (the columns of the record statements): `None` when there is none, `Some(None)`
    /// when it is not a completed record live at `now` (expired, or a reservation), else the
    /// record. Prepared once per connection if `persistent`, else unnamed.
    fn fetch_record<'e>(
        executor: impl Executor<'e, Database = Self> + 'e,
        sql: &'static str,
        scope: &'e Scope,
        now: i64,
        bind_now: bool,
        persistent: bool,
    ) -> BoxFuture<'e, Result<Option<Option<StoredRecord>>, Error>>;

    /// Runs the purge `sql` (binds: `now`, the batch size); the rows it deleted. With
    /// `unnamed` (a transaction pooler in front of the server), unnamed and in a transaction
    /// of its own, so that its preparation and its run reach the same server connection.
    fn purge<'e>(
        pool: &'e Pool<Self>,
        sql: &'static str,
        now_and_batch: (i64, usize),
        unnamed: bool,
    ) -> BoxFuture<'e, Result<u64, Error>>;
}

impl<DB> SqlxDatabase for DB
where
    DB: Database + HasStatementCache,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> &'q [u8]: Encode<'q, DB> + Type<DB>,
    i32: for<'q> Encode<'q, DB> + Type<DB>,
    i64: for<'q> Encode<'q, DB> + Type<DB>,
    String: for<'q> Encode<'q, DB> + Type<DB>,
    Option<String>: for<'q> Encode<'q, DB>,
    DB::QueryResult: RowsAffected,
    DB::Row: RecordColumns,
{
    fn executor<'c>(conn: &'c mut DB::Connection) -> impl Executor<'c, Database = DB> + 'c {
        conn
    }

    fn pool_executor<'p>(pool: &'p Pool<DB>) -> impl Executor<'p, Database = DB> + 'p {
        pool
    }

    fn bind_scope<'q>(query: Statement<'q, DB>, scope: &'q Scope) -> Statement<'q, DB> {
        query
            .bind(&*scope.tenant)
            .bind(&*scope.operation)
            .bind(scope.key.as_str())
    }

    fn bind_record<'q>(query: Statement<'q, DB>, record: &'q NewRecord) -> Statement<'q, DB> {
        let response = &record.response;
        let trailers = response
            .trailers
            .as_ref()
            .map(|t| SavedResponse::encode_headers(t));
        query
            .bind(&record.fingerprint.digest()[..])
            .bind(i32::from(record.fingerprint.version()))
            .bind(i32::from(response.status.as_u16()))
            .bind(SavedResponse::encode_headers(&response.headers))
            .bind(&response.body[..])
            .bind(trailers)
            .bind(to_unix_millis(record.created_at))
            .bind(to_unix_millis(record.expires_at))
    }

    fn fetch_record<'e>(
        executor: impl Executor<'e, Database = DB> + 'e,
        sql: &'static str,
        scope: &'e Scope,
        now: i64,
        bind_now: bool,
        persistent: bool,
    ) -> BoxFuture<'e, Result<Option<Option<StoredRecord>>, Error>> {
        let query = Self::bind_scope(sqlx::query(sql), scope);
        let query = if bind_now { query.bind(now) } else { query }.persistent(persistent);
        let row = executor.fetch_optional(query);
        Box::pin(async move {
            let Some(row) = row.await.map_err(pool_error)? else {
                return Ok(None);
            };
            live_record(&row, now).map(Some)
        })
    }

    fn purge<'e>(
        pool: &'e Pool<DB>,
        sql: &'static str,
        (now, batch): (i64, usize),
        unnamed: bool,
    ) -> BoxFuture<'e, Result<u64, Error>> {
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        let purge = sqlx::query::<DB>(sql).bind(now).bind(batch);
        if !unnamed {
            let done = pool.execute(purge);
            return Box::pin(async move { Ok(done.await.map_err(pool_error)?.rows_affected()) });
        }
        Box::pin(async move {
            let mut tx = pool.begin().await.map_err(pool_error)?;
            let done = (&mut *tx).execute(purge.persistent(false)).await?;
            tx.commit().await?;
            Ok(done.rows_affected())
        })
    }
}

/// The rows a statement changed (each database's query result has its own method).
pub trait RowsAffected {
    /// The rows the statement changed.
    fn rows_affected(&self) -> u64;
}
