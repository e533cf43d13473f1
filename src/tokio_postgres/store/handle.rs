//! The handler's side of the request's transaction: [`PostgresHandle`] (the handle in the
//! request extensions) and [`CheckedClient`] (its connection, borrowed, behind the guard
//! that refuses transaction control and notes conflicts for the layer), with the [`Command`]
//! and [`Executor`] traits that say what a borrowed connection runs.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Object;
use tokio::sync::OwnedMappedMutexGuard;
use tokio_postgres::row::Row;
use tokio_postgres::types::{BorrowToSql, ToSql, Type};
use tokio_postgres::{GenericClient, SimpleQueryMessage, Statement, ToStatement};

use super::slot::{Slot, TxShared};
use super::statements::{untyped, Preparation, Typed};
use crate::error::Error;
use crate::postgres::guard as sql_guard;
use crate::postgres::reserve as pg_reserve;
use crate::row_lock::tx_state::Observed;

/// The handle a handler uses to write its rows in the request's transaction.
///
/// The layer puts it in the request extensions. Everything run through
/// [`client`](Self::client) belongs to the same PostgreSQL transaction as the idempotency
/// record: it commits when the layer saves the response, and rolls back if the handler fails,
/// panics or the client goes away. (The receiver's inbox, `Inbox::process` with the
/// `outbox` feature, hands its closure the same handle on a transaction of its own.)
///
/// ```no_run
/// # async fn handler(tx: tower_idempotency::store::tokio_postgres::PostgresHandle)
/// #     -> Result<i64, tower_idempotency::Error> {
/// let client = tx.client().await?;
/// let row = client
///     .query_one(
///         "INSERT INTO orders (sku, quantity) VALUES ($1, $2) RETURNING id",
///         &[&"book", &1i32],
///     )
///     .await?;
/// let order_id: i64 = row.try_get(0)?;
/// # Ok(order_id) }
/// ```
///
/// - The layer commits: `COMMIT`, `ROLLBACK`, `BEGIN` and the like are refused
///   ([`Error::TransactionControl`]; see [`CheckedClient`]).
/// - A failed statement aborts the whole PostgreSQL transaction: answer an error status (the
///   layer then rolls back) rather than carrying on. Use a `SAVEPOINT` to recover from an
///   expected failure inside the transaction.
/// - A serialization failure (`40001`) or deadlock (`40P01`) of one of the handler's
///   statements is noticed by the layer, whatever the handler answers: it runs the request
///   again in a fresh transaction, up to
///   [`with_conflict_retries`](crate::IdempotencyLayer::with_conflict_retries) times, then
///   answers `503` with `Retry-After`.
/// - A statement that finds the database gone or read-only (a lost connection, `25006`,
///   `57P01`, `57P02`, `57P03`: a failover) is noticed too: the layer answers `503` with
///   `Retry-After` whatever the handler answers, and the connection is not reused.
/// - Statements run with the layer's `lock_timeout` (`SET LOCAL`): a lock wait past it fails
///   with SQLSTATE `55P03`, for which [`Error::is_busy`] is true.
/// - A statement whose answer has not come within the lock timeout and 500 ms is taken for a
///   server (or network) that stopped answering without closing the connection: it fails with
///   [`Error::Unavailable`], the statements after it are refused at once, and the layer
///   answers `503` with `Retry-After` whatever the handler answers, closing the connection.
///   (A statement that runs longer than that on a live server is given up the same way.)
/// - Drop the [`CheckedClient`] before the handler returns; after the request ends the
///   handle refuses work ([`Error::TransactionFinished`]).
#[derive(Clone)]
pub struct PostgresHandle {
    pub(super) tx: Arc<TxShared>,
}

impl fmt::Debug for PostgresHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresHandle")
            .field("reservation", &self.tx.token)
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl PostgresHandle {
    /// Borrows the transaction's connection. Waits while another borrow of the same
    /// transaction is alive (one connection runs one statement at a time).
    pub async fn client(&self) -> Result<CheckedClient, Error> {
        let mut answer_wait = None;
        let mut preparation = Preparation::default();
        let connection = self
            .tx
            .borrow(|slot| {
                answer_wait = slot.answer_wait;
                preparation = slot.preparation;
                slot.object.as_mut()
            })
            .await?;
        Ok(CheckedClient {
            connection,
            tx: self.tx.clone(),
            answer_wait,
            preparation,
        })
    }

    /// Whether the transaction has been committed or rolled back (or is being).
    pub fn is_finished(&self) -> bool {
        self.tx.is_finished()
    }
}

/// The transaction's connection, borrowed from a [`PostgresHandle`]: runs statements
/// inside the request's transaction, with the methods of a [`tokio_postgres::Client`].
///
/// It does not hand out the client itself, so that every statement goes through two checks:
///
/// - **No transaction control.** `BEGIN`, `START TRANSACTION`, `COMMIT`, `END`, `ROLLBACK`,
///   `ABORT`, `PREPARE TRANSACTION` and `COMMIT`/`ROLLBACK PREPARED` are refused with
///   [`Error::TransactionControl`] before they reach the server, and nothing of the call runs.
///   `SAVEPOINT`, `RELEASE` and `ROLLBACK TO` are allowed: they stay inside the transaction.
///   Every statement is sent with the extended protocol, which runs one command per string;
///   [`batch_execute`](Self::batch_execute) and [`simple_query`](Self::simple_query) cut
///   their input into statements and send them one by one. (A `CREATE FUNCTION` or `CREATE
///   PROCEDURE` with a `BEGIN ATOMIC` body stays whole.)
/// - **Conflicts are seen by the layer.** A serialization failure or a deadlock that a
///   statement gets is returned to the handler as usual, and also kept: the layer then runs
///   the request again (see [`PostgresHandle`]).
///
/// COPY is not offered: a COPY in progress would hold the connection past the borrow.
pub struct CheckedClient {
    connection: OwnedMappedMutexGuard<Slot, Object>,
    tx: Arc<TxShared>,
    /// How long a statement's answer may take before the server is taken for gone (see
    /// `Slot::answer_wait`).
    answer_wait: Option<Duration>,
    /// Whether statements may be cached on the connection (see
    /// [`PostgresOptions::with_unnamed_statements`](super::PostgresOptions::with_unnamed_statements)).
    preparation: Preparation,
}

impl fmt::Debug for CheckedClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CheckedClient")
            .field("reservation", &self.tx.token)
            .finish_non_exhaustive()
    }
}

/// What a [`CheckedClient`] runs: SQL text (`&str`, `String`), checked before it is sent,
/// or a [`Statement`] prepared through a `CheckedClient` (checked when prepared).
pub trait Command: ToStatement + sealed::Command {
    /// The SQL text to check, if this is text.
    #[doc(hidden)]
    fn sql_text(&self) -> Option<&str>;
}

impl Command for str {
    fn sql_text(&self) -> Option<&str> {
        Some(self)
    }
}

impl Command for String {
    fn sql_text(&self) -> Option<&str> {
        Some(self)
    }
}

impl Command for Statement {
    fn sql_text(&self) -> Option<&str> {
        None
    }
}

/// Where a statement of `Outbox::enqueue_in` or
/// `Inbox::record` (with the `outbox` feature) runs: a [`CheckedClient`] (inside
/// the request's transaction), or a client or transaction of your own (any
/// [`tokio_postgres::GenericClient`]: a [`tokio_postgres::Client`], a pooled connection, a
/// [`tokio_postgres::Transaction`]).
#[cfg_attr(not(feature = "outbox"), allow(dead_code, unreachable_pub))]
pub trait Executor: Sync + sealed::Executor {
    /// Runs `statement` with `params`; returns how many rows it changed.
    fn execute_statement(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> impl Future<Output = Result<u64, Error>> + Send;

    /// Runs `statement` with `params` of the given types; returns how many rows it changed.
    #[doc(hidden)]
    fn execute_typed_statement(
        &self,
        statement: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> impl Future<Output = Result<u64, Error>> + Send;
}

impl<C: GenericClient + Sync> Executor for C {
    async fn execute_statement(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, Error> {
        Ok(GenericClient::execute(self, statement, params).await?)
    }

    /// Unnamed, in one message: one round trip (a statement sent as text would be prepared in
    /// a round trip of its own first), and nothing left on the server connection, which a
    /// transaction pooler may hand to another client once the message is answered.
    async fn execute_typed_statement(
        &self,
        statement: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<u64, Error> {
        Ok(GenericClient::execute_typed(self, statement, params).await?)
    }
}

impl Executor for CheckedClient {
    /// Prepared once per pooled connection: a statement sent as text costs a round trip of
    /// its own (parse and describe) before it runs. (With unnamed statements, prepared and
    /// closed inside the transaction.)
    async fn execute_statement(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, Error> {
        let statement = self.prepare_cached(statement).await?;
        self.execute(&statement, params).await
    }

    /// Prepared once per pooled connection, or unnamed (see
    /// [`PostgresOptions::with_unnamed_statements`](super::PostgresOptions::with_unnamed_statements)).
    async fn execute_typed_statement(
        &self,
        statement: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<u64, Error> {
        match self.preparation {
            Preparation::Cached => {
                let prepared = self.prepare_cached(statement).await?;
                self.execute(&prepared, &untyped(params)).await
            }
            Preparation::Unnamed => self.execute_typed(statement, params).await,
        }
    }
}

mod sealed {
    use tokio_postgres::{GenericClient, Statement};

    /// Keeps [`Command`](super::Command) to the types this crate knows how to check.
    #[allow(unreachable_pub)]
    pub trait Command {}

    impl Command for str {}
    impl Command for String {}
    impl Command for Statement {}

    /// Keeps [`Executor`](super::Executor) to the types this crate knows how to run on.
    #[allow(unreachable_pub)]
    #[cfg_attr(not(feature = "outbox"), allow(dead_code))]
    pub trait Executor {}

    impl Executor for super::CheckedClient {}
    impl<C: GenericClient> Executor for C {}
}

impl CheckedClient {
    fn client(&self) -> &tokio_postgres::Client {
        &self.connection
    }

    /// Refuses transaction control in `command`'s text.
    fn check<T: Command + ?Sized>(command: &T) -> Result<(), Error> {
        match command.sql_text() {
            Some(sql) => sql_guard::check_command_remembered(sql),
            None => Ok(()),
        }
    }

    /// Converts a database error, keeping a conflict for the layer to see.
    fn observe<T>(&self, result: Result<T, tokio_postgres::Error>) -> Result<T, Error> {
        result.map_err(|error| {
            self.tx.observe(&error);
            Error::TokioPostgres(error)
        })
    }

    /// Runs `statement` (a request to the server), given up when its answer has not come
    /// within the lock timeout and a margin: the server stopped answering. That is kept for
    /// the layer (which answers `503` with `Retry-After` and closes the connection), and the
    /// statements that follow are refused at once: they would wait behind this one.
    async fn answered<T>(
        &self,
        statement: impl Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, Error> {
        let Some(wait) = self.answer_wait else {
            return self.observe(statement.await);
        };
        if Observed::is_stalled(&self.tx.observed) {
            return Err(Error::Unavailable(
                "an earlier statement of the transaction got no answer from the database"
                    .to_owned(),
            ));
        }
        match tokio::time::timeout(wait, statement).await {
            Ok(result) => self.observe(result),
            Err(_) => {
                let message = format!(
                    "the database did not answer a statement within the lock timeout and {} ms",
                    pg_reserve::ANSWER_MARGIN.as_millis()
                );
                Observed::keep_stalled(&self.tx.observed, message.clone());
                Err(Error::Unavailable(message))
            }
        }
    }

    /// Prepares `query` ([`tokio_postgres::Client::prepare`]).
    pub async fn prepare(&self, query: &str) -> Result<Statement, Error> {
        sql_guard::check_command_remembered(query)?;
        self.answered(self.client().prepare(query)).await
    }

    /// Prepares `query` with the given parameter types
    /// ([`tokio_postgres::Client::prepare_typed`]).
    pub async fn prepare_typed(
        &self,
        query: &str,
        parameter_types: &[Type],
    ) -> Result<Statement, Error> {
        sql_guard::check_command_remembered(query)?;
        self.answered(self.client().prepare_typed(query, parameter_types))
            .await
    }

    /// Prepares `query` once per connection and reuses the statement afterwards.
    ///
    /// With [unnamed statements](super::PostgresOptions::with_unnamed_statements) (behind a
    /// transaction pooler), it prepares `query` afresh instead, as
    /// [`prepare`](Self::prepare) does: a statement cached on the connection would be gone
    /// on the server connection of the next transaction. Drop the statement before the
    /// handler returns: it is closed on the server then, inside the transaction.
    pub async fn prepare_cached(&self, query: &str) -> Result<Statement, Error> {
        sql_guard::check_command_remembered(query)?;
        match self.preparation {
            Preparation::Cached => self.answered(self.connection.prepare_cached(query)).await,
            Preparation::Unnamed => self.answered(self.client().prepare(query)).await,
        }
    }

    /// Runs a statement and returns its rows ([`tokio_postgres::Client::query`]).
    pub async fn query<T>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, Error>
    where
        T: ?Sized + Command,
    {
        Self::check(statement)?;
        self.answered(self.client().query(statement, params)).await
    }

    /// Runs a statement that returns exactly one row ([`tokio_postgres::Client::query_one`]).
    pub async fn query_one<T>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, Error>
    where
        T: ?Sized + Command,
    {
        Self::check(statement)?;
        self.answered(self.client().query_one(statement, params))
            .await
    }

    /// Runs a statement that returns at most one row
    /// ([`tokio_postgres::Client::query_opt`]).
    pub async fn query_opt<T>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, Error>
    where
        T: ?Sized + Command,
    {
        Self::check(statement)?;
        self.answered(self.client().query_opt(statement, params))
            .await
    }

    /// Runs `query` with parameters of the given types, without preparing it first
    /// ([`tokio_postgres::Client::query_typed`]).
    pub async fn query_typed(
        &self,
        query: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, Error> {
        sql_guard::check_command_remembered(query)?;
        self.answered(self.client().query_typed(query, params))
            .await
    }

    /// Runs `query` with parameters of the given types, without preparing it first; returns
    /// how many rows it changed ([`tokio_postgres::Client::execute_typed`]).
    pub async fn execute_typed(
        &self,
        query: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<u64, Error> {
        sql_guard::check_command_remembered(query)?;
        self.answered(self.client().execute_typed(query, params))
            .await
    }

    /// Runs a statement; returns how many rows it changed
    /// ([`tokio_postgres::Client::execute`]).
    pub async fn execute<T>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, Error>
    where
        T: ?Sized + Command,
    {
        Self::check(statement)?;
        self.answered(self.client().execute(statement, params))
            .await
    }

    /// [`execute`](Self::execute) with the parameters as an iterator
    /// ([`tokio_postgres::Client::execute_raw`]).
    pub async fn execute_raw<T, P, I>(&self, statement: &T, params: I) -> Result<u64, Error>
    where
        T: ?Sized + Command,
        P: BorrowToSql,
        I: IntoIterator<Item = P>,
        I::IntoIter: ExactSizeIterator,
    {
        Self::check(statement)?;
        self.answered(self.client().execute_raw(statement, params))
            .await
    }

    /// Runs the statements of `query` (separated by `;`, no parameters) one after the other.
    ///
    /// All of them are checked before the first runs: one refused statement and none runs.
    pub async fn batch_execute(&self, query: &str) -> Result<(), Error> {
        let statements = sql_guard::split(query);
        for statement in &statements {
            sql_guard::check_command(statement)?;
        }
        for statement in statements {
            // The extended protocol: a piece that still held two commands would be refused
            // by the server, so nothing this did not check can run.
            self.answered(self.client().execute(statement, &[])).await?;
        }
        Ok(())
    }

    /// Runs the statements of `query` with the simple query protocol (rows as text)
    /// ([`tokio_postgres::Client::simple_query`]), one after the other; checked like
    /// [`batch_execute`](Self::batch_execute).
    pub async fn simple_query(&self, query: &str) -> Result<Vec<SimpleQueryMessage>, Error> {
        let statements = sql_guard::split(query);
        for statement in &statements {
            sql_guard::check_command(statement)?;
        }
        let mut messages = Vec::new();
        for statement in statements {
            // Parsed first with the extended protocol, which takes one command only: the
            // simple protocol then runs text the server has read as exactly that command.
            drop(self.answered(self.client().prepare(statement)).await?);
            messages.extend(self.answered(self.client().simple_query(statement)).await?);
        }
        Ok(messages)
    }

    /// Runs one of the store's statements (the outbox's, the steps'...) in the transaction,
    /// prepared once per connection or unnamed, as the store's options say; its rows.
    pub(crate) async fn query_shared(
        &self,
        sql: &str,
        params: &[Typed<'_>],
    ) -> Result<Vec<Row>, Error> {
        match self.preparation {
            Preparation::Cached => {
                let prepared = self.prepare_cached(sql).await?;
                self.query(&prepared, &untyped(params)).await
            }
            Preparation::Unnamed => self.query_typed(sql, params).await,
        }
    }

    /// Whether the connection is closed (the server went away).
    pub fn is_closed(&self) -> bool {
        self.client().is_closed()
    }
}
