//! What the outbox, inbox, steps and admin queries need from a driver: the one seam between the
//! tokio-postgres store, the sqlx PostgreSQL store and the sqlx MySQL store. The SQL and the logic
//! over it are written once (`row_lock/outbox.rs`, `row_lock/admin.rs`, `row_lock/steps.rs`, with
//! the statements in each dialect's folder, `postgres/` and `mysql/`); a driver only runs a
//! statement with [`SqlParam`]s and reads a row's columns ([`Columns`]). The statements number
//! their parameters `$n` on every server; the MySQL driver sends each as a `?` bound to the n-th
//! value.

use std::future::Future;

use crate::error::Error;
use crate::row::Columns;
use crate::row_lock::reserve::Isolation;
use crate::store::record_row::RecordColumns;

/// Implements [`Columns`] for a driver's row type with its `try_get`, which every driver
/// spells the same way; `$int` is the Rust type of an `INTEGER` column (`i32` on PostgreSQL,
/// `i64` on MySQL, whose expressions widen to `BIGINT`).
macro_rules! columns_by_try_get {
    ($row:ty, $int:ty) => {
        impl $crate::row::Columns for $row {
            type Error = Error;

            fn big_int(&self, index: usize) -> Result<Option<i64>, Error> {
                Ok(self.try_get(index)?)
            }

            fn int(&self, index: usize) -> Result<Option<i64>, Error> {
                let value: Option<$int> = self.try_get(index)?;
                Ok(value.map(i64::from))
            }

            fn text(&self, index: usize) -> Result<Option<String>, Error> {
                Ok(self.try_get(index)?)
            }

            fn boolean(&self, index: usize) -> Result<Option<bool>, Error> {
                Ok(self.try_get(index)?)
            }

            fn bytes(&self, index: usize) -> Result<Option<Vec<u8>>, Error> {
                Ok(self.try_get(index)?)
            }

            fn null(_index: usize, what: &str) -> Error {
                $crate::row::missing(what)
            }
        }
    };
}

pub(crate) use columns_by_try_get;

// The drivers, each in its store's folder: `src/tokio_postgres/driver.rs`,
// `src/sqlx/postgres/driver.rs`, `src/sqlx/mysql/driver.rs` and `src/sqlx/sqlite/driver.rs`
// (with what the sqlx databases share in `src/sqlx/driver.rs`). Each implements the traits
// here and invokes the engine's macros (`row_lock/{admin, outbox, steps}.rs`) for its store.

/// A statement parameter: the few types the shared statements bind.
#[derive(Clone, Copy, Debug)]
pub(crate) enum SqlParam<'a> {
    /// `TEXT`.
    Text(&'a str),
    /// `TEXT` or `NULL`.
    OptionalText(Option<&'a str>),
    /// `BIGINT` (times in Unix milliseconds, counts, limits).
    BigInt(i64),
    /// `INTEGER` (attempts, fingerprint versions, status codes, step positions).
    Int(i32),
    /// `BYTEA` (`VARBINARY` or `LONGBLOB` on MySQL: fingerprints, bodies).
    Bytes(&'a [u8]),
}

impl<'a> From<&'a str> for SqlParam<'a> {
    fn from(text: &'a str) -> Self {
        SqlParam::Text(text)
    }
}

impl From<i64> for SqlParam<'_> {
    fn from(value: i64) -> Self {
        SqlParam::BigInt(value)
    }
}

/// How a store runs the shared statements. Statements run in autocommit on a
/// pooled connection of the store, except where a method says otherwise.
pub(crate) trait SqlDriver: Clone + Send + Sync + 'static {
    /// A row the driver returns.
    type Row: Columns<Error = Error> + Send;

    /// Runs `sql` and returns its rows.
    fn fetch_rows(
        &self,
        sql: &str,
        params: &[SqlParam<'_>],
    ) -> impl Future<Output = Result<Vec<Self::Row>, Error>> + Send;

    /// Runs `sql` and returns how many rows it changed.
    fn execute_counted(
        &self,
        sql: &str,
        params: &[SqlParam<'_>],
    ) -> impl Future<Output = Result<u64, Error>> + Send;

    /// Runs `statements` in order in one transaction, commits, and returns each one's rows.
    #[cfg(feature = "outbox")]
    fn fetch_in_transaction(
        &self,
        statements: &[(&str, &[SqlParam<'_>])],
    ) -> impl Future<Output = Result<Vec<Vec<Self::Row>>, Error>> + Send;

    /// Creates tables (`CREATE ... IF NOT EXISTS` statements) under the advisory lock `lock`
    /// (on MySQL, `GET_LOCK` of a name formed from it).
    fn install_tables(
        &self,
        lock: i64,
        schema: &str,
    ) -> impl Future<Output = Result<(), Error>> + Send;
}

/// A request's transaction handle, and what the inbox and the steps do with the store's own
/// transactions (the same handle type).
pub(crate) trait SqlTransactions: SqlDriver {
    /// The handle a request's handler gets.
    type Handle: SqlHandle<Row = Self::Row>;

    /// How often a serialization failure while recording an inbox id is retried.
    #[cfg_attr(not(feature = "outbox"), allow(dead_code))]
    fn conflict_retries(&self) -> u32;

    /// Opens a transaction of the store's own (at the isolation level `own` says), runs `body`
    /// with its handle, and commits if `body` returns `Ok((value, Finish::Commit))`; rolls back
    /// on `Finish::Rollback`, on an error, on a panic or if this future is dropped.
    fn in_own_transaction<T, B, Fut>(
        &self,
        own: Own,
        body: B,
    ) -> impl Future<Output = Result<T, Error>> + Send
    where
        T: Send,
        B: FnOnce(Self::Handle) -> Fut + Send,
        Fut: Future<Output = Result<(T, Finish), Error>> + Send;
}

/// What a transaction of the store's own ([`SqlTransactions::in_own_transaction`]) runs, which
/// decides its isolation level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Own {
    /// The application's statements too (a local step's closure, an inbox event's work): the
    /// store's isolation level.
    Work,
    /// The store's statements only (a step's claim, intent or result, a release, a status, the
    /// final record, an operator's call): `READ COMMITTED`, the level their row locks are
    /// written for, whatever the store's. At `SERIALIZABLE` they would abort one another
    /// (`40001`) for predicate locks on the index pages that keys share.
    Bookkeeping,
}

impl Own {
    /// The isolation level of such a transaction on a store at `isolation`.
    pub(crate) fn isolation(self, isolation: Isolation) -> Isolation {
        match self {
            Own::Work => isolation,
            Own::Bookkeeping => Isolation::ReadCommitted,
        }
    }
}

/// How [`SqlTransactions::in_own_transaction`] ends a transaction whose body succeeded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Finish {
    /// Commit it.
    Commit,
    /// Roll it back: nothing it did is wanted.
    Rollback,
}

/// Runs a statement inside a transaction through its handle.
pub(crate) trait SqlHandle: Send + Sync + 'static {
    /// A row the driver returns.
    type Row: Columns<Error = Error> + RecordColumns + Send;

    /// Runs `sql` (prepared and cached on the connection) in the handle's transaction and
    /// returns its rows.
    fn fetch_in(
        &self,
        sql: &'static str,
        params: &[SqlParam<'_>],
    ) -> impl Future<Output = Result<Vec<Self::Row>, Error>> + Send;

    /// Runs `sql` (prepared and cached on the connection) in the handle's transaction and
    /// returns how many rows it changed.
    fn execute_in(
        &self,
        sql: &'static str,
        params: &[SqlParam<'_>],
    ) -> impl Future<Output = Result<u64, Error>> + Send;
}

/// Ends `transaction` as `outcome` says (see [`SqlTransactions::in_own_transaction`]), with the
/// driver's `commit` and `rollback` (which returns what ended the transaction under the work,
/// if anything). A failed body's error gives way to that cause unless it is a busy error
/// itself: a serialization failure the body turned into an error of its own (a local step's
/// closure) is still reported as one, and the layer runs the request again.
pub(crate) async fn finish<T, O, C, CommitFut, R, RollbackFut>(
    transaction: O,
    outcome: Result<(T, Finish), Error>,
    commit: C,
    rollback: R,
) -> Result<T, Error>
where
    C: FnOnce(O) -> CommitFut,
    CommitFut: Future<Output = Result<(), Error>>,
    R: FnOnce(O) -> RollbackFut,
    RollbackFut: Future<Output = Option<Error>>,
{
    match outcome {
        Ok((value, Finish::Commit)) => {
            commit(transaction).await?;
            Ok(value)
        }
        Ok((value, Finish::Rollback)) => {
            rollback(transaction).await;
            Ok(value)
        }
        Err(error) => match rollback(transaction).await {
            Some(cause) if !error.is_busy() => Err(cause),
            _ => Err(error),
        },
    }
}
