//! The calls that take a sqlx executor of the caller's ([`enqueue`], [`Inbox::record`]),
//! written once for every sqlx database: each database only sends a shared statement its way
//! ([`OutboxDatabase`]).

use futures_util::future::BoxFuture;
use sqlx::Executor;

use crate::error::Error;
use crate::outbox::inbox::receipt;
use crate::outbox::{EventId, Inbox, InboxBackend, Outbox, Receipt};
use crate::row_lock::driver::SqlParam;
use crate::row_lock::outbox::{record_params, NewEvent};
use crate::row_lock::outbox_sql::INSERT_EVENT;
use crate::sqlx::store::{SqlxDialect, SqlxStore};

/// A sqlx database with the crate's outbox and inbox (PostgreSQL, MySQL): what [`enqueue`] and
/// [`Inbox::record`] take an executor of. Sealed.
pub trait OutboxDatabase: sqlx::Database + sealed::Statements {}

impl<DB: sqlx::Database + sealed::Statements> OutboxDatabase for DB {}

pub(crate) mod sealed {
    use super::{BoxFuture, Error, Executor, SqlParam};

    /// How a database records an inbox id and runs a shared statement. Sealed: only this
    /// crate implements it, and its types stay the crate's.
    #[allow(unreachable_pub, private_interfaces)]
    pub trait Statements: sqlx::Database {
        /// Its `INSERT_ID`.
        const INSERT_ID: &'static str;

        /// Its `check_inbox_ids`.
        fn check_inbox_ids(consumer: &str, event_id: &str) -> Result<(), Error>;

        /// Runs `sql` with `params` through `executor`; returns how many rows it changed.
        fn execute_shared<'e, 'c: 'e, E>(
            executor: E,
            sql: &'static str,
            params: &'e [SqlParam<'e>],
        ) -> BoxFuture<'e, Result<u64, Error>>
        where
            E: Executor<'c, Database = Self> + 'e;
    }
}

/// [`sealed::Statements`] on a sqlx database, with the statements of its SQL module `$sql`,
/// each prepared by `$prepare` (`$n` parameters as written, as MySQL's `?`, or as SQLite
/// takes them).
macro_rules! outbox_database {
    ($db:ty, $sql:ident, $prepare:path) => {
        #[allow(private_interfaces)]
        impl $crate::sqlx::outbox::sealed::Statements for $db {
            const INSERT_ID: &'static str = $sql::INSERT_ID;

            fn check_inbox_ids(consumer: &str, event_id: &str) -> Result<(), $crate::Error> {
                $sql::check_inbox_ids(consumer, event_id)
            }

            fn execute_shared<'e, 'c: 'e, E>(
                executor: E,
                sql: &'static str,
                params: &'e [$crate::row_lock::driver::SqlParam<'e>],
            ) -> futures_util::future::BoxFuture<'e, Result<u64, $crate::Error>>
            where
                E: sqlx::Executor<'c, Database = Self> + 'e,
            {
                Box::pin(async move {
                    let (sql, params) = $prepare(sql, params)?;
                    let query = sqlx::query($crate::sqlx::driver::our_sql(sql));
                    let done = executor
                        .execute($crate::sqlx::driver::sqlx_bind(query, &params))
                        .await?;
                    Ok(done.rows_affected())
                })
            }
        }
    };
}

/// Each sqlx database invokes it in its folder (its `driver.rs`).
pub(crate) use outbox_database;

/// The outbox of a sqlx store ([`SqlxPostgresStore`](crate::store::sqlx_postgres::SqlxPostgresStore),
/// [`SqlxMySqlStore`](crate::store::sqlx_mysql::SqlxMySqlStore),
/// [`SqlxSqliteStore`](crate::store::sqlx_sqlite::SqlxSqliteStore)).
impl<D: SqlxDialect> Outbox<SqlxStore<D>>
where
    D::Db: OutboxDatabase,
{
    /// Adds an event to the outbox through `executor`: the connection a request's handle
    /// lends (`&mut *conn`: the event then belongs to the request's transaction), or a transaction
    /// or pool of your own. Returns its id.
    ///
    /// Use it to write an order and its event with one borrow of the transaction's connection;
    /// [`Enqueue::enqueue`](crate::outbox::Enqueue::enqueue) on the handle does the same in a call of its
    /// own.
    ///
    /// ```no_run
    /// # async fn handler(tx: tower_idempotency::store::sqlx_postgres::SqlxPostgresHandle)
    /// #     -> Result<(), tower_idempotency::Error> {
    /// use serde_json::json;
    /// use tower_idempotency::outbox::Outbox;
    /// use tower_idempotency::store::sqlx_postgres::SqlxPostgresStore;
    ///
    /// let mut conn = tx.acquire().await?;
    /// let order_id: i64 = sqlx::query_scalar("INSERT INTO orders (sku) VALUES ('book') RETURNING id")
    ///     .fetch_one(&mut *conn)
    ///     .await?;
    /// Outbox::<SqlxPostgresStore>::enqueue_in(&mut *conn, "order_created", &json!({ "order_id": order_id })).await?;
    /// # Ok(()) }
    /// ```
    pub async fn enqueue_in<'c, E>(
        executor: E,
        topic: &str,
        payload: &serde_json::Value,
    ) -> Result<EventId, Error>
    where
        E: Executor<'c, Database = D::Db>,
    {
        let event = NewEvent::new(payload);
        let params = event.params(topic);
        <D::Db as sealed::Statements>::execute_shared(executor, INSERT_EVENT, &params).await?;
        Ok(event.id)
    }
}

/// The inbox of a sqlx store: [`Inbox::process`] hands its closure the same handle a
/// request's handler gets (take its `acquire`d connection, do not `COMMIT`), on a transaction
/// of the inbox's own, and the closure returns a future; [`Inbox::record`] records an id
/// through an executor of yours, waiting (on MySQL within `innodb_lock_wait_timeout`) on an id
/// another open transaction holds. On MySQL, consumer names and event ids are at most 255
/// bytes.
impl<D: SqlxDialect> Inbox<SqlxStore<D>>
where
    D::Db: OutboxDatabase,
    SqlxStore<D>: InboxBackend,
{
    /// Records `event_id` through `executor`, which must be inside the transaction that applies
    /// the event (a `sqlx::Transaction` of your own, or the connection a request's
    /// handle lends): [`Receipt::First`] if it was new (apply the event in the same
    /// transaction), [`Receipt::Duplicate`] if it was there already (do nothing).
    ///
    /// While another open transaction holds the same id, this waits for it to end.
    pub async fn record<'c, E>(&self, executor: E, event_id: &str) -> Result<Receipt, Error>
    where
        E: Executor<'c, Database = D::Db>,
    {
        <D::Db as sealed::Statements>::check_inbox_ids(self.consumer(), event_id)?;
        let params = record_params(self.consumer(), event_id);
        let insert_id = <D::Db as sealed::Statements>::INSERT_ID;
        let inserted =
            <D::Db as sealed::Statements>::execute_shared(executor, insert_id, &params).await?;
        Ok(receipt(inserted))
    }
}
