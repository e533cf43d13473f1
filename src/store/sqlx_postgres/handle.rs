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
use sqlx::pool::PoolConnection;
use sqlx::postgres::{
    PgArguments, PgConnection, PgQueryResult, PgRow, PgStatement, PgTypeInfo, Postgres,
};
use sqlx::{Describe, Either, Execute, Executor};
use tokio::sync::{OwnedMappedMutexGuard, OwnedMutexGuard};

use super::reservation::{observe, ConflictCell, Slot, TxShared};
use crate::error::Error;
use crate::store::sql_guard;

/// The handle a handler uses to write its rows in the request's transaction.
///
/// The layer puts it in the request extensions (take it with
/// [`Tx<SqlxTransaction>`](crate::extract::Tx) in axum). Everything run on the connection it
/// lends belongs to the same PostgreSQL transaction as the idempotency record: it commits when
/// the layer saves the response, and rolls back if the handler fails, panics or the client
/// goes away.
///
/// ```no_run
/// # async fn handler(tx: tower_idempotency::store::sqlx_postgres::SqlxTransaction)
/// #     -> Result<i64, Box<dyn std::error::Error>> {
/// let mut conn = tx.acquire().await?;
/// let (order_id,): (i64,) =
///     sqlx::query_as("INSERT INTO orders (sku, quantity) VALUES ($1, $2) RETURNING id")
///         .bind("book")
///         .bind(1i64)
///         .fetch_one(&mut *conn)
///         .await?;
/// # Ok(order_id) }
/// ```
///
/// - The layer commits: `COMMIT`, `ROLLBACK`, `BEGIN` and the like are refused before they
///   reach the server (see [`TxConnection`]).
/// - A failed statement aborts the whole PostgreSQL transaction: answer an error status (the
///   layer then rolls back) rather than carrying on. Use a `SAVEPOINT` to recover from an
///   expected failure inside the transaction.
/// - A serialization failure (`40001`) or deadlock (`40P01`) of one of the handler's
///   statements is noticed by the layer, whatever the handler answers: it runs the request
///   again in a fresh transaction, up to
///   [`with_conflict_retries`](crate::IdempotencyLayer::with_conflict_retries) times, then
///   answers `503` with `Retry-After`.
/// - Statements run with the layer's `lock_timeout` (`SET LOCAL`): a lock wait past it fails
///   with SQLSTATE `55P03`.
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
/// [`sqlx::Executor`] for PostgreSQL: `query`, `query_as`, `query_scalar`, `raw_sql` and the
/// `query!` macros run on it as on a `&mut PgConnection`, with two checks:
///
/// - **No transaction control.** `BEGIN`, `START TRANSACTION`, `COMMIT`, `END`, `ROLLBACK`,
///   `ABORT`, `PREPARE TRANSACTION` and `COMMIT`/`ROLLBACK PREPARED` are refused before they
///   reach the server, and nothing of the call runs (the error's message names the
///   statement). `SAVEPOINT`, `RELEASE` and `ROLLBACK TO` are allowed: they stay inside the
///   transaction. Every statement goes with the extended protocol, which runs one command per
///   string: SQL without bind parameters (`raw_sql`, a `&str`), which sqlx would send with the
///   simple protocol, is cut into statements, all are checked, and each is sent on its own.
///   (Its rows come back once the last statement has run.)
/// - **Conflicts are seen by the layer.** A serialization failure or a deadlock that a
///   statement gets is returned to the handler as usual, and also kept: the layer then runs
///   the request again (see [`SqlxTransaction`]).
///
/// It does not hand out the `PgConnection` itself, so that nothing bypasses the checks.
pub struct TxConnection {
    raw: PoolConnection<Postgres>,
    conflict: ConflictCell,
}

impl fmt::Debug for TxConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TxConnection").finish_non_exhaustive()
    }
}

impl TxConnection {
    pub(super) fn new(raw: PoolConnection<Postgres>) -> Self {
        TxConnection {
            raw,
            conflict: ConflictCell::default(),
        }
    }

    /// The connection, for the store's own statements (unchecked).
    pub(super) fn raw_mut(&mut self) -> &mut PgConnection {
        &mut self.raw
    }

    pub(super) fn conflict_cell(&self) -> ConflictCell {
        Arc::clone(&self.conflict)
    }

    pub(super) fn into_pooled(self) -> PoolConnection<Postgres> {
        self.raw
    }
}

/// Refuses transaction control anywhere in `sql`.
fn check(sql: &str) -> Result<(), sqlx::Error> {
    sql_guard::check_command_remembered(sql).map_err(refusal)
}

/// The error a refused statement gets: sqlx's own type, so that a handler's `?` carries it.
fn refusal(error: Error) -> sqlx::Error {
    sqlx::Error::InvalidArgument(error.to_string())
}

/// One statement of a string sent without parameters, sent with the extended protocol (empty
/// arguments, not prepared for reuse): the server refuses it if it still holds two commands.
struct Piece<'q>(&'q str);

impl<'q> Execute<'q, Postgres> for Piece<'q> {
    fn sql(&self) -> &'q str {
        self.0
    }

    fn statement(&self) -> Option<&PgStatement<'q>> {
        None
    }

    fn take_arguments(&mut self) -> Result<Option<PgArguments>, BoxDynError> {
        Ok(Some(PgArguments::default()))
    }

    fn persistent(&self) -> bool {
        false
    }
}

/// A query whose arguments were already taken (to see which protocol it needs).
struct Checked<E> {
    query: E,
    arguments: Option<PgArguments>,
}

impl<'q, E: Execute<'q, Postgres>> Execute<'q, Postgres> for Checked<E> {
    fn sql(&self) -> &'q str {
        self.query.sql()
    }

    fn statement(&self) -> Option<&PgStatement<'q>> {
        self.query.statement()
    }

    fn take_arguments(&mut self) -> Result<Option<PgArguments>, BoxDynError> {
        Ok(self.arguments.take())
    }

    fn persistent(&self) -> bool {
        self.query.persistent()
    }
}

type Step = Either<PgQueryResult, PgRow>;

/// Runs the statements of `sql` one by one (each checked already), stopping at the first
/// error; returns every result in order.
async fn run_pieces(
    raw: &mut PgConnection,
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
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(self, mut query: E) -> BoxStream<'e, Result<Step, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let sql = query.sql();
        if let Err(refused) = check(sql) {
            return stream::once(future::ready(Err(refused))).boxed();
        }
        let conflict = Arc::clone(&self.conflict);
        let raw: &'c mut PgConnection = &mut self.raw;
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
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let sql = query.sql();
        let checked = check(sql);
        let conflict = Arc::clone(&self.conflict);
        let raw: &'c mut PgConnection = &mut self.raw;
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
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement<'q>, sqlx::Error>>
    where
        'c: 'e,
    {
        let checked = check(sql);
        let conflict = Arc::clone(&self.conflict);
        let raw: &'c mut PgConnection = &mut self.raw;
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
    ) -> BoxFuture<'e, Result<Describe<Postgres>, sqlx::Error>>
    where
        'c: 'e,
    {
        let checked = check(sql);
        let raw: &'c mut PgConnection = &mut self.raw;
        Box::pin(async move {
            checked?;
            raw.describe(sql).await
        })
    }
}
