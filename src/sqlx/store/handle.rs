//! The handler's side: the handle in the request extensions, and the connection it lends,
//! which runs ordinary sqlx code inside the request's transaction and refuses transaction
//! control.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::{self, BoxFuture};
use futures_util::stream::{self, BoxStream};
use futures_util::StreamExt;
use sqlx::error::BoxDynError;
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, Database, Describe, Either, Execute, Executor, SqlSafeStr, SqlStr};
use tokio::sync::OwnedMappedMutexGuard;

use super::{Conn, Slot, SqlxDatabase, SqlxDialect};
use crate::error::Error;
use crate::row_lock::tx_state::{Observed, ObservedCell, TxShared};

/// The docs of the handle, shared by each database's alias (`SqlxPostgresHandle`,
/// `SqlxMySqlHandle`, `SqlxSqliteHandle`; an alias's page does not show the aliased type's
/// docs), given its name and its connection's.
macro_rules! handle_docs {
    ($handle:literal, $connection:literal) => {
        concat!(
        "\n\nThe layer puts it in the request extensions (take it with \
        `Tx<", $handle, ">` in axum, feature `axum`). Everything run on the connection \
        it lends (`tx.acquire().await?`, then `&mut *conn` as the executor) belongs to the same \
        transaction as the idempotency record: it commits when the layer saves the response, \
        and rolls back if the handler fails, panics or the client goes away.\n\n\
        - The layer commits: transaction control is refused before it reaches the server (see \
          [`", $connection, "`]).\n\
        - A serialization failure or deadlock of one of the handler's statements is noticed by \
          the layer, whatever the handler answers: it runs the request again in a fresh \
          transaction, up to \
          [`with_conflict_retries`](crate::IdempotencyLayer::with_conflict_retries) times, then \
          answers `503` with `Retry-After`.\n\
        - Drop the borrowed connection before the handler returns; after the request ends the \
          handle refuses work ([`Error::TransactionFinished`](crate::Error::TransactionFinished)).\n"
        )
    };
}
pub(crate) use handle_docs;

/// The docs of the handle's connection, shared by each database's alias of it
/// (`SqlxPostgresConnection`, `SqlxMySqlConnection`, `SqlxSqliteConnection`),
/// given the name of the database's handle.
macro_rules! connection_docs {
    ($handle:literal) => {
        concat!(
        "\n\n`query`, `query_as`, `query_scalar`, `raw_sql` and the `query!` macros run on it \
        as on the database's own connection, with two checks:\n\n\
        - **No transaction control.** The statements that would end the transaction (or, on \
          MySQL, commit it implicitly) are refused before they reach the server, and nothing of \
          the call runs (the error's message names the statement).\n\
        - **Conflicts are seen by the layer.** A serialization failure or a deadlock that a \
          statement gets is returned to the handler as usual, and also kept: the layer then \
          runs the request again (see [`", $handle, "`]).\n\n\
        It does not hand out the database's connection itself, so that nothing bypasses the \
        checks.\n"
        )
    };
}
pub(crate) use connection_docs;

/// The handle a handler uses to write its rows in the request's transaction.
///
/// The layer puts it in the request extensions (take it with
/// `Tx<SqlxHandle>` in axum, feature `axum`). Everything run on the connection it
/// lends belongs to the same transaction as the idempotency record: it commits when the layer
/// saves the response, and rolls back if the handler fails, panics or the client goes away.
///
/// - The layer commits: transaction control is refused before it reaches the server (see
///   [`CheckedConnection`]).
/// - A serialization failure or deadlock of one of the handler's statements is noticed by the
///   layer, whatever the handler answers: it runs the request again in a fresh transaction, up
///   to [`with_conflict_retries`](crate::IdempotencyLayer::with_conflict_retries) times, then
///   answers `503` with `Retry-After`.
/// - Where the dialect reports them (MySQL and MariaDB `1205`, PostgreSQL `55P03`), a lock wait past the lock
///   timeout is noticed too: if the handler then fails (any answer the layer does not save,
///   an error, a panic), the layer rolls back and answers `503` with `Retry-After`, as for a
///   wait on its own statements. On MySQL a handler that recovered from it commits as usual:
///   the server rolled back only that statement.
/// - On PostgreSQL, a statement whose answer has not come within the lock timeout and 500 ms
///   is taken for a server (or network) that stopped answering without closing the
///   connection: it fails (an I/O error, `TimedOut`), the statements after it are refused at
///   once, and the layer answers `503` with `Retry-After` whatever the handler answers,
///   closing the connection. (A statement that runs longer than that on a live server is
///   given up the same way.)
/// - Drop the [`SqlxConnection`] before the handler returns; after the request ends the
///   handle refuses work ([`Error::TransactionFinished`]).
#[derive(Clone)]
pub struct SqlxHandle<D: SqlxDialect> {
    tx: Arc<TxShared<Slot<D>>>,
}

impl<D: SqlxDialect> fmt::Debug for SqlxHandle<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlxHandle")
            .field("reservation", &self.tx.token)
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl<D: SqlxDialect> SqlxHandle<D> {
    pub(crate) fn new(tx: Arc<TxShared<Slot<D>>>) -> Self {
        SqlxHandle { tx }
    }

    /// Borrows the transaction's connection. Waits while another borrow of the same
    /// transaction is alive (one connection runs one statement at a time).
    ///
    /// Run statements on it with `&mut *conn` as the executor: the borrow dereferences to the
    /// database's connection alias (`SqlxPostgresConnection`...), whose `&mut` is a [`sqlx::Executor`]. Drop it to let
    /// the next borrow (or the layer's commit) go on; it does not borrow the handle.
    pub async fn acquire(
        &self,
    ) -> Result<impl DerefMut<Target = CheckedConnection<D>> + fmt::Debug + Send + use<D>, Error>
    {
        let connection = self.tx.borrow(|slot| slot.connection.as_mut()).await?;
        Ok(SqlxConnection { connection })
    }

    /// Whether the transaction has been committed or rolled back (or is being).
    pub fn is_finished(&self) -> bool {
        self.tx.is_finished()
    }
}

/// The transaction's connection, borrowed from a [`SqlxHandle`]: dereferences to a
/// [`CheckedConnection`], whose `&mut` is a [`sqlx::Executor`] (`.execute(&mut *conn)`).
/// Public as `impl DerefMut<Target = CheckedConnection>` only ([`SqlxHandle::acquire`]), so
/// that no signature names a type a user cannot.
pub(crate) struct SqlxConnection<D: SqlxDialect> {
    connection: OwnedMappedMutexGuard<Slot<D>, CheckedConnection<D>>,
}

impl<D: SqlxDialect> fmt::Debug for SqlxConnection<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlxConnection").finish_non_exhaustive()
    }
}

impl<D: SqlxDialect> Deref for SqlxConnection<D> {
    type Target = CheckedConnection<D>;

    fn deref(&self) -> &CheckedConnection<D> {
        &self.connection
    }
}

impl<D: SqlxDialect> DerefMut for SqlxConnection<D> {
    fn deref_mut(&mut self) -> &mut CheckedConnection<D> {
        &mut self.connection
    }
}

/// A pooled connection inside the request's transaction. `&mut CheckedConnection` is a
/// [`sqlx::Executor`] for the store's database: `query`, `query_as`, `query_scalar`,
/// `raw_sql` and the `query!` macros run on it as on the database's own connection, with two
/// checks:
///
/// - **No transaction control.** The statements that would end the transaction (or, on
///   MySQL, commit it implicitly) are refused before they reach the server, and nothing of
///   the call runs (the error's message names the statement). Every statement goes with the
///   prepared-statement protocol, which runs one statement per string: SQL without bind
///   parameters (`raw_sql`, a `&str`), which sqlx would send as text, is cut into
///   statements, all are checked, and each is sent on its own. (Its rows come back once the
///   last statement has run.)
/// - **Conflicts are seen by the layer.** A serialization failure or a deadlock that a
///   statement gets is returned to the handler as usual, and also kept: the layer then runs
///   the request again (see [`SqlxHandle`]). Where the database has then rolled the
///   whole transaction back and would run what follows in another one (MySQL), further
///   statements are refused.
///
/// It does not hand out the database's connection itself, so that nothing bypasses the checks.
pub struct CheckedConnection<D: SqlxDialect> {
    raw: PoolConnection<D::Db>,
    conflict: ObservedCell,
    /// How long after sending a statement its answer is due, where the dialect bounds it (the
    /// lock timeout and [`SqlxDialect::ANSWER_MARGIN`]: the server ends every lock wait by
    /// the lock timeout itself). An answer missing past it means a server that stopped
    /// answering: the statement fails, the ones after it are refused, the layer answers `503`
    /// and the connection is closed. `None`: no bound.
    answer_wait: Option<Duration>,
    /// Whether no statement may stay prepared on the connection past its transaction (a
    /// transaction pooler in front of the server): the handler's statements go unnamed
    /// (sqlx's `persistent(false)`), and the slot closes any statement left cached on the
    /// connection before the transaction ends.
    unnamed: bool,
}

impl<D: SqlxDialect> fmt::Debug for CheckedConnection<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CheckedConnection").finish_non_exhaustive()
    }
}

impl<D: SqlxDialect> CheckedConnection<D> {
    pub(crate) fn new(raw: PoolConnection<D::Db>) -> Self {
        CheckedConnection {
            raw,
            conflict: ObservedCell::default(),
            answer_wait: None,
            unnamed: false,
        }
    }

    /// With unnamed statements (see the field), if `unnamed`.
    pub(crate) fn with_unnamed_statements(mut self, unnamed: bool) -> Self {
        self.unnamed = unnamed;
        self
    }

    /// Whether no statement may stay prepared on the connection past its transaction.
    pub(crate) fn unnamed_statements(&self) -> bool {
        self.unnamed
    }

    /// The connection of a request's transaction whose lock waits end by `lock_timeout`: its
    /// statements' answers are due within it and the dialect's
    /// [`ANSWER_MARGIN`](SqlxDialect::ANSWER_MARGIN), if it has one.
    pub(crate) fn for_request(raw: PoolConnection<D::Db>, lock_timeout: Duration) -> Self {
        CheckedConnection {
            answer_wait: D::ANSWER_MARGIN.map(|margin| lock_timeout + margin),
            ..Self::new(raw)
        }
    }

    /// How long a statement's answer may take (see the field).
    pub(crate) fn answer_wait(&self) -> Option<Duration> {
        self.answer_wait
    }

    /// The connection, for the store's own statements (unchecked).
    pub(crate) fn raw_mut(&mut self) -> &mut Conn<D> {
        &mut self.raw
    }

    pub(super) fn observed_cell(&self) -> ObservedCell {
        Arc::clone(&self.conflict)
    }

    pub(super) fn into_pooled(self) -> PoolConnection<D::Db> {
        self.raw
    }
}

/// Keeps `error` if it is the transaction's first serialization failure, deadlock or
/// failover error, or (where the dialect reports them) its first lock wait timeout.
fn observe<D: SqlxDialect>(conflict: &ObservedCell, error: &sqlx::Error) {
    let message = || match error.as_database_error() {
        Some(db_error) => db_error.message().to_owned(),
        None => error.to_string(),
    };
    if D::is_lock_timeout(error) {
        Observed::keep_lock_timeout(conflict, message());
        return;
    }
    Observed::keep_first(
        conflict,
        D::is_conflict(error),
        D::is_unavailable(error),
        message,
    );
}

/// The error of a statement that got no answer within `wait`, kept for the layer (which then
/// answers `503`, see [`CheckedConnection`]).
fn no_answer(conflict: &ObservedCell, wait: Duration) -> sqlx::Error {
    let message = format!(
        "the database did not answer a statement within {} ms (the lock timeout and a margin)",
        wait.as_millis()
    );
    Observed::keep_stalled(conflict, message.clone());
    sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, message))
}

/// `future`, given up after `wait` if set ([`no_answer`]).
async fn answered<T>(
    future: impl std::future::Future<Output = Result<T, sqlx::Error>>,
    wait: Option<Duration>,
    conflict: &ObservedCell,
) -> Result<T, sqlx::Error> {
    match wait {
        Some(wait) => tokio::time::timeout(wait, future)
            .await
            .unwrap_or_else(|_| Err(no_answer(conflict, wait))),
        None => future.await,
    }
}

/// `steps`, each given up after `wait` (from the moment it is asked for) if set: the stream
/// ends after the error ([`no_answer`]).
fn answered_steps<'e, T: Send + 'e>(
    steps: BoxStream<'e, Result<T, sqlx::Error>>,
    wait: Option<Duration>,
    conflict: ObservedCell,
) -> BoxStream<'e, Result<T, sqlx::Error>> {
    let Some(wait) = wait else {
        return steps;
    };
    stream::unfold(Some(steps), move |steps| {
        let conflict = Arc::clone(&conflict);
        async move {
            let mut steps = steps?;
            match tokio::time::timeout(wait, steps.next()).await {
                Ok(Some(step)) => Some((step, Some(steps))),
                Ok(None) => None,
                Err(_) => Some((Err(no_answer(&conflict, wait)), None)),
            }
        }
    })
    .boxed()
}

/// Refuses transaction control anywhere in `sql`, and, where the dialect says so, everything
/// once a conflict has rolled the transaction back; and everything once a statement got no
/// answer in time (it would wait behind that one).
fn check<D: SqlxDialect>(sql: &str, conflict: &ObservedCell) -> Result<(), sqlx::Error> {
    if Observed::is_stalled(conflict) {
        return Err(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "an earlier statement of the transaction got no answer from the database",
        )));
    }
    if let Some(refused) = D::REFUSED_AFTER_CONFLICT {
        // A lock timeout rolled back only its statement: the transaction goes on.
        let conflicted = conflict
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .is_some_and(Observed::ended_the_transaction);
        if conflicted {
            return Err(sqlx::Error::InvalidArgument(refused.into()));
        }
    }
    D::check_command(sql).map_err(refusal)
}

/// The error a refused statement gets: sqlx's own type, so that a handler's `?` carries it.
fn refusal(error: Error) -> sqlx::Error {
    sqlx::Error::InvalidArgument(error.to_string())
}

/// One statement of a string sent without parameters, sent with the prepared-statement
/// protocol (empty arguments, not prepared for reuse): the server refuses it if it still holds
/// two statements. A piece of the handler's own SQL, which sqlx took from the handler as safe
/// (its `SqlSafeStr`): cut from it, not written by the store.
struct Piece<'a>(&'a str);

impl<DB: Database> Execute<'_, DB> for Piece<'_> {
    fn sql(self) -> SqlStr {
        AssertSqlSafe(self.0).into_sql_str()
    }

    fn statement(&self) -> Option<&DB::Statement> {
        None
    }

    fn take_arguments(&mut self) -> Result<Option<DB::Arguments>, BoxDynError> {
        Ok(Some(DB::Arguments::default()))
    }

    fn persistent(&self) -> bool {
        false
    }
}

/// A query taken apart (its SQL, to check it; its arguments, to see which protocol it needs),
/// prepared for reuse (`persistent`) only if it asks to be and the connection keeps statements.
struct Checked<DB: Database> {
    sql: SqlStr,
    /// The statement the query was made from (`Statement::query`), if it was.
    statement: Option<DB::Statement>,
    arguments: Option<DB::Arguments>,
    persistent: bool,
}

impl<DB: Database> Execute<'_, DB> for Checked<DB> {
    fn sql(self) -> SqlStr {
        self.sql
    }

    fn statement(&self) -> Option<&DB::Statement> {
        self.statement.as_ref()
    }

    fn take_arguments(&mut self) -> Result<Option<DB::Arguments>, BoxDynError> {
        Ok(self.arguments.take())
    }

    fn persistent(&self) -> bool {
        self.persistent
    }
}

/// `query` taken apart: its SQL, the statement it was made from, its arguments (or the error
/// of encoding them), and whether it asks to be prepared for reuse.
type Parts<DB> = (
    SqlStr,
    Option<<DB as Database>::Statement>,
    Result<Option<<DB as Database>::Arguments>, BoxDynError>,
    bool,
);

fn take_apart<'q, DB: Database>(mut query: impl Execute<'q, DB>) -> Parts<DB> {
    let persistent = query.persistent();
    let statement = query.statement().cloned();
    let arguments = query.take_arguments();
    (query.sql(), statement, arguments, persistent)
}

type Step<DB> = Either<<DB as Database>::QueryResult, <DB as Database>::Row>;

/// Runs the statements of `sql` one by one (each checked already), stopping at the first
/// error; returns every result in order.
async fn run_pieces<D: SqlxDialect>(
    raw: &mut Conn<D>,
    sql: &str,
    conflict: &ObservedCell,
) -> Vec<Result<Step<D::Db>, sqlx::Error>> {
    let mut results = Vec::new();
    for piece in D::split(sql) {
        let mut steps = D::Db::executor(&mut *raw).fetch_many(Piece(piece));
        while let Some(step) = steps.next().await {
            match step {
                Ok(step) => results.push(Ok(step)),
                Err(error) => {
                    observe::<D>(conflict, &error);
                    results.push(Err(error));
                    return results;
                }
            }
        }
    }
    results
}

impl<'c, D: SqlxDialect> Executor<'c> for &'c mut CheckedConnection<D> {
    type Database = D::Db;

    fn fetch_many<'e, 'q: 'e, E>(self, query: E) -> BoxStream<'e, Result<Step<D::Db>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, D::Db>,
    {
        let (sql, statement, arguments, persistent) = take_apart(query);
        if let Err(refused) = check::<D>(sql.as_str(), &self.conflict) {
            return stream::once(future::ready(Err(refused))).boxed();
        }
        let conflict = Arc::clone(&self.conflict);
        let (wait, stalled) = (self.answer_wait, Arc::clone(&self.conflict));
        let persistent = persistent && !self.unnamed;
        let raw: &'c mut Conn<D> = &mut self.raw;
        let steps = match arguments {
            Err(error) => stream::once(future::ready(Err(sqlx::Error::Encode(error)))).boxed(),
            Ok(Some(arguments)) => D::Db::executor(raw)
                .fetch_many(Checked {
                    sql,
                    statement,
                    arguments: Some(arguments),
                    persistent,
                })
                .inspect(move |step| {
                    if let Err(error) = step {
                        observe::<D>(&conflict, error);
                    }
                })
                .boxed(),
            // The pieces' results come at once when the last has run: one wait for them all.
            Ok(None) => {
                stream::once(async move { run_pieces::<D>(raw, sql.as_str(), &conflict).await })
                    .flat_map(stream::iter)
                    .boxed()
            }
        };
        answered_steps(steps, wait, stalled)
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<<D::Db as Database>::Row>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, D::Db>,
    {
        let (sql, statement, arguments, persistent) = take_apart(query);
        let checked = check::<D>(sql.as_str(), &self.conflict);
        let conflict = Arc::clone(&self.conflict);
        let wait = self.answer_wait;
        let persistent = persistent && !self.unnamed;
        let raw: &'c mut Conn<D> = &mut self.raw;
        let fetch = async move {
            checked?;
            match arguments.map_err(sqlx::Error::Encode)? {
                Some(arguments) => {
                    let row = D::Db::executor(raw)
                        .fetch_optional(Checked {
                            sql,
                            statement,
                            arguments: Some(arguments),
                            persistent,
                        })
                        .await;
                    if let Err(error) = &row {
                        observe::<D>(&conflict, error);
                    }
                    row
                }
                None => {
                    let mut first = None;
                    for step in run_pieces::<D>(raw, sql.as_str(), &conflict).await {
                        if let Either::Right(row) = step? {
                            first.get_or_insert(row);
                        }
                    }
                    Ok(first)
                }
            }
        };
        let conflict = Arc::clone(&self.conflict);
        Box::pin(async move { answered(fetch, wait, &conflict).await })
    }

    fn prepare_with<'e>(
        self,
        sql: SqlStr,
        parameters: &'e [<D::Db as Database>::TypeInfo],
    ) -> BoxFuture<'e, Result<<D::Db as Database>::Statement, sqlx::Error>>
    where
        'c: 'e,
    {
        let checked = check::<D>(sql.as_str(), &self.conflict);
        let conflict = Arc::clone(&self.conflict);
        let wait = self.answer_wait;
        let raw: &'c mut Conn<D> = &mut self.raw;
        Box::pin(async move {
            checked?;
            let statement = answered(
                D::Db::executor(raw).prepare_with(sql, parameters),
                wait,
                &conflict,
            )
            .await;
            if let Err(error) = &statement {
                observe::<D>(&conflict, error);
            }
            statement
        })
    }

    fn describe<'e>(self, sql: SqlStr) -> BoxFuture<'e, Result<Describe<D::Db>, sqlx::Error>>
    where
        'c: 'e,
    {
        let checked = check::<D>(sql.as_str(), &self.conflict);
        let conflict = Arc::clone(&self.conflict);
        let wait = self.answer_wait;
        let raw: &'c mut Conn<D> = &mut self.raw;
        Box::pin(async move {
            checked?;
            answered(D::Db::executor(raw).describe(sql), wait, &conflict).await
        })
    }
}
