//! The handler's side: the handle in the request extensions, and the connection it lends,
//! which runs ordinary sqlx code inside the request's transaction and refuses transaction
//! control.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use futures_util::future::{self, BoxFuture};
use futures_util::stream::{self, BoxStream};
use futures_util::StreamExt;
use sqlx::error::BoxDynError;
use sqlx::mysql::{
    MySql, MySqlArguments, MySqlConnection, MySqlQueryResult, MySqlRow, MySqlStatement,
    MySqlTypeInfo,
};
use sqlx::pool::PoolConnection;
use sqlx::{Describe, Either, Execute, Executor};
use tokio::sync::{OwnedMappedMutexGuard, OwnedMutexGuard};

use super::reservation::{observe, ConflictCell, Slot, TxShared};
use crate::error::Error;
use crate::store::sql_guard::mysql as sql_guard;

/// The handle a handler uses to write its rows in the request's transaction.
///
/// The layer puts it in the request extensions (take it with
/// [`Tx<SqlxTransaction>`](crate::extract::Tx) in axum). Everything run on the connection it
/// lends belongs to the same InnoDB transaction as the idempotency record: it commits when
/// the layer saves the response, and rolls back if the handler fails, panics or the client
/// goes away.
///
/// ```no_run
/// # async fn handler(tx: tower_idempotency::store::sqlx_mysql::SqlxTransaction)
/// #     -> Result<u64, Box<dyn std::error::Error>> {
/// let mut conn = tx.acquire().await?;
/// let done = sqlx::query("INSERT INTO orders (sku, quantity) VALUES (?, ?)")
///     .bind("book")
///     .bind(1i64)
///     .execute(&mut *conn)
///     .await?;
/// # Ok(done.last_insert_id()) }
/// ```
///
/// - The layer commits: `COMMIT`, `ROLLBACK`, `BEGIN`, and the statements after which MySQL
///   commits on its own (DDL, `LOCK TABLES`, `SET autocommit`...) are refused before they
///   reach the server (see [`TxConnection`]).
/// - A failed statement is rolled back on its own and the transaction goes on (InnoDB's way),
///   except a deadlock (`1213`), after which InnoDB has rolled the whole transaction back: the
///   connection then refuses further statements, and the layer runs the request again in a
///   fresh transaction, up to
///   [`with_conflict_retries`](crate::IdempotencyLayer::with_conflict_retries) times, then
///   answers `503` with `Retry-After`.
/// - Lock waits are bounded by the layer's lock timeout (`innodb_lock_wait_timeout`, whole
///   seconds): past it a statement fails with `1205`.
/// - Drop the [`SqlxConnection`] before the handler returns; after the request ends the
///   handle refuses work ([`Error::TransactionFinished`]).
#[derive(Clone)]
pub struct SqlxTransaction {
    tx: Arc<TxShared>,
}

impl fmt::Debug for SqlxTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlxTransaction")
            .field("reservation", &self.tx.token)
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl SqlxTransaction {
    pub(super) fn new(tx: Arc<TxShared>) -> Self {
        SqlxTransaction { tx }
    }

    /// Borrows the transaction's connection. Waits while another borrow of the same
    /// transaction is alive (one connection runs one statement at a time).
    ///
    /// Run statements on it with `&mut *conn` as the executor.
    pub async fn acquire(&self) -> Result<SqlxConnection, Error> {
        if self.is_finished() {
            return Err(Error::TransactionFinished);
        }
        let slot = self.tx.connection.clone().lock_owned().await;
        // The layer may have finished the transaction while this waited.
        if self.is_finished() {
            return Err(Error::TransactionFinished);
        }
        let connection = OwnedMutexGuard::try_map(slot, |slot| slot.connection.as_mut())
            .map_err(|_| Error::TransactionFinished)?;
        Ok(SqlxConnection { connection })
    }

    /// Whether the transaction has been committed or rolled back (or is being).
    pub fn is_finished(&self) -> bool {
        self.tx.is_finished()
    }
}

/// The transaction's connection, borrowed from a [`SqlxTransaction`]: dereferences to a
/// [`TxConnection`], whose `&mut` is a [`sqlx::Executor`] (`.execute(&mut *conn)`).
pub struct SqlxConnection {
    connection: OwnedMappedMutexGuard<Slot, TxConnection>,
}

impl fmt::Debug for SqlxConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlxConnection").finish_non_exhaustive()
    }
}

impl Deref for SqlxConnection {
    type Target = TxConnection;

    fn deref(&self) -> &TxConnection {
        &self.connection
    }
}

impl DerefMut for SqlxConnection {
    fn deref_mut(&mut self) -> &mut TxConnection {
        &mut self.connection
    }
}

/// A pooled connection inside the request's transaction. `&mut TxConnection` is a
/// [`sqlx::Executor`] for MySQL: `query`, `query_as`, `query_scalar`, `raw_sql` and the
/// `query!` macros run on it as on a `&mut MySqlConnection`, with three checks:
///
/// - **No transaction control.** `BEGIN`, `START TRANSACTION`, `COMMIT`, `ROLLBACK`, `XA`,
///   `LOCK`/`UNLOCK TABLES`, `SET autocommit`, SQL-level `PREPARE`/`EXECUTE`, and the
///   statements that commit implicitly (`CREATE`, `ALTER`, `DROP`, `RENAME`, `TRUNCATE`,
///   `GRANT`, table maintenance...) are refused before they reach the server, and nothing of
///   the call runs (the error's message names the statement). `SAVEPOINT`, `RELEASE
///   SAVEPOINT`, `ROLLBACK TO`, `CREATE TEMPORARY TABLE` and `DROP TEMPORARY TABLE` are
///   allowed. Every statement goes with the binary protocol, which runs one statement per
///   string: SQL without bind parameters (`raw_sql`, a `&str`), which sqlx would send as text
///   with several statements allowed, is cut into statements, all are checked, and each is
///   sent on its own. (Its rows come back once the last statement has run.) A stored
///   procedure (`CALL`) runs unchecked: one that commits commits the request's transaction.
/// - **Deadlocks are seen by the layer.** A deadlock that a statement gets is returned to the
///   handler as usual, and also kept: the layer then runs the request again (see
///   [`SqlxTransaction`]).
/// - **Nothing runs after a deadlock.** InnoDB has rolled the transaction back by then; what
///   followed would run in another transaction, so it is refused.
///
/// It does not hand out the `MySqlConnection` itself, so that nothing bypasses the checks.
pub struct TxConnection {
    raw: PoolConnection<MySql>,
    conflict: ConflictCell,
}

impl fmt::Debug for TxConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TxConnection").finish_non_exhaustive()
    }
}

impl TxConnection {
    pub(super) fn new(raw: PoolConnection<MySql>) -> Self {
        TxConnection {
            raw,
            conflict: ConflictCell::default(),
        }
    }

    /// The connection, for the store's own statements (unchecked).
    pub(super) fn raw_mut(&mut self) -> &mut MySqlConnection {
        &mut self.raw
    }

    pub(super) fn conflict_cell(&self) -> ConflictCell {
        Arc::clone(&self.conflict)
    }

    pub(super) fn into_pooled(self) -> PoolConnection<MySql> {
        self.raw
    }
}

/// Refuses transaction control anywhere in `sql`, and everything once a deadlock has rolled
/// the transaction back.
fn check(sql: &str, conflict: &ConflictCell) -> Result<(), sqlx::Error> {
    let conflicted = conflict
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .is_some();
    if conflicted {
        return Err(sqlx::Error::InvalidArgument(
            "refused: a deadlock rolled the request's transaction back; the layer runs the \
             request again"
                .into(),
        ));
    }
    sql_guard::check_command(sql).map_err(refusal)
}

/// The error a refused statement gets: sqlx's own type, so that a handler's `?` carries it.
fn refusal(error: Error) -> sqlx::Error {
    sqlx::Error::InvalidArgument(error.to_string())
}

/// One statement of a string sent without parameters, sent with the binary protocol (empty
/// arguments, not prepared for reuse): the server refuses it if it still holds two statements.
struct Piece<'q>(&'q str);

impl<'q> Execute<'q, MySql> for Piece<'q> {
    fn sql(&self) -> &'q str {
        self.0
    }

    fn statement(&self) -> Option<&MySqlStatement<'q>> {
        None
    }

    fn take_arguments(&mut self) -> Result<Option<MySqlArguments>, BoxDynError> {
        Ok(Some(MySqlArguments::default()))
    }

    fn persistent(&self) -> bool {
        false
    }
}

/// A query whose arguments were already taken (to see which protocol it needs).
struct Checked<E> {
    query: E,
    arguments: Option<MySqlArguments>,
}

impl<'q, E: Execute<'q, MySql>> Execute<'q, MySql> for Checked<E> {
    fn sql(&self) -> &'q str {
        self.query.sql()
    }

    fn statement(&self) -> Option<&MySqlStatement<'q>> {
        self.query.statement()
    }

    fn take_arguments(&mut self) -> Result<Option<MySqlArguments>, BoxDynError> {
        Ok(self.arguments.take())
    }

    fn persistent(&self) -> bool {
        self.query.persistent()
    }
}

type Step = Either<MySqlQueryResult, MySqlRow>;

/// Runs the statements of `sql` one by one (each checked already), stopping at the first
/// error; returns every result in order.
async fn run_pieces(
    raw: &mut MySqlConnection,
    sql: &str,
    conflict: &ConflictCell,
) -> Vec<Result<Step, sqlx::Error>> {
    let mut results = Vec::new();
    for piece in sql_guard::split(sql) {
        let mut steps = (&mut *raw).fetch_many(Piece(piece));
        while let Some(step) = steps.next().await {
            match step {
                Ok(step) => results.push(Ok(step)),
                Err(error) => {
                    observe(conflict, &error);
                    results.push(Err(error));
                    return results;
                }
            }
        }
    }
    results
}

impl<'c> Executor<'c> for &'c mut TxConnection {
    type Database = MySql;

    fn fetch_many<'e, 'q: 'e, E>(self, mut query: E) -> BoxStream<'e, Result<Step, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, MySql>,
    {
        let sql = query.sql();
        if let Err(refused) = check(sql, &self.conflict) {
            return stream::once(future::ready(Err(refused))).boxed();
        }
        let conflict = Arc::clone(&self.conflict);
        let raw: &'c mut MySqlConnection = &mut self.raw;
        match query.take_arguments() {
            Err(error) => stream::once(future::ready(Err(sqlx::Error::Encode(error)))).boxed(),
            Ok(Some(arguments)) => raw
                .fetch_many(Checked {
                    query,
                    arguments: Some(arguments),
                })
                .inspect(move |step| {
                    if let Err(error) = step {
                        observe(&conflict, error);
                    }
                })
                .boxed(),
            Ok(None) => stream::once(async move { run_pieces(raw, sql, &conflict).await })
                .flat_map(stream::iter)
                .boxed(),
        }
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        mut query: E,
    ) -> BoxFuture<'e, Result<Option<MySqlRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, MySql>,
    {
        let sql = query.sql();
        let checked = check(sql, &self.conflict);
        let conflict = Arc::clone(&self.conflict);
        let raw: &'c mut MySqlConnection = &mut self.raw;
        Box::pin(async move {
            checked?;
            match query.take_arguments().map_err(sqlx::Error::Encode)? {
                Some(arguments) => {
                    let row = raw
                        .fetch_optional(Checked {
                            query,
                            arguments: Some(arguments),
                        })
                        .await;
                    if let Err(error) = &row {
                        observe(&conflict, error);
                    }
                    row
                }
                None => {
                    let mut first = None;
                    for step in run_pieces(raw, sql, &conflict).await {
                        if let Either::Right(row) = step? {
                            first.get_or_insert(row);
                        }
                    }
                    Ok(first)
                }
            }
        })
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [MySqlTypeInfo],
    ) -> BoxFuture<'e, Result<MySqlStatement<'q>, sqlx::Error>>
    where
        'c: 'e,
    {
        let checked = check(sql, &self.conflict);
        let conflict = Arc::clone(&self.conflict);
        let raw: &'c mut MySqlConnection = &mut self.raw;
        Box::pin(async move {
            checked?;
            let statement = raw.prepare_with(sql, parameters).await;
            if let Err(error) = &statement {
                observe(&conflict, error);
            }
            statement
        })
    }

    fn describe<'e, 'q: 'e>(
        self,
        sql: &'q str,
    ) -> BoxFuture<'e, Result<Describe<MySql>, sqlx::Error>>
    where
        'c: 'e,
    {
        let checked = check(sql, &self.conflict);
        let raw: &'c mut MySqlConnection = &mut self.raw;
        Box::pin(async move {
            checked?;
            raw.describe(sql).await
        })
    }
}
