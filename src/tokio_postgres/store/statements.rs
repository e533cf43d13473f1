//! How the store sends its own statements ([`Preparation`]): prepared once per connection and
//! run by name (deadpool's statement cache, the default), or each as an unnamed statement
//! parsed, bound and run in one message (`query_typed`), for a connection pool in front of the
//! server that hands every transaction to another server connection (PgBouncer in transaction
//! mode, Supavisor, RDS Proxy): a statement named on one server connection does not exist on
//! the next (`prepared statement "s21" does not exist`), and one prepared outside a
//! transaction (`Parse`, then `Bind` once its answer is back) may be run on another.

use deadpool_postgres::ClientWrapper;
use tokio_postgres::row::Row;
use tokio_postgres::types::{ToSql, Type};

use crate::row_lock::driver::SqlParam;

/// A parameter and its type, as an unnamed statement takes them (the server is told the types
/// instead of inferring them: nothing is prepared to ask it).
pub(crate) type Typed<'a> = (&'a (dyn ToSql + Sync), Type);

/// How the store's statements reach the server; see the module docs and
/// [`PostgresOptions::with_unnamed_statements`](super::PostgresOptions::with_unnamed_statements).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Preparation {
    /// Prepared once per connection, then run by name: one message and no parsing or planning
    /// of the statement on later runs.
    #[default]
    Cached,
    /// Parsed, bound and run in one message every time, by the unnamed statement (which lives
    /// until the next one): nothing outlives the message on the server connection.
    Unnamed,
}

impl Preparation {
    /// Runs `sql` with `params` on `client`; its rows.
    pub(crate) async fn query(
        self,
        client: &ClientWrapper,
        sql: &str,
        params: &[Typed<'_>],
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        match self {
            Preparation::Cached => {
                let statement = client.prepare_cached(sql).await?;
                client.query(&statement, &untyped(params)).await
            }
            Preparation::Unnamed => client.query_typed(sql, params).await,
        }
    }

    /// Runs `sql` with `params` on `client`; its row, if it returned one (an error if more).
    pub(crate) async fn query_opt(
        self,
        client: &ClientWrapper,
        sql: &str,
        params: &[Typed<'_>],
    ) -> Result<Option<Row>, tokio_postgres::Error> {
        match self {
            Preparation::Cached => {
                let statement = client.prepare_cached(sql).await?;
                client.query_opt(&statement, &untyped(params)).await
            }
            Preparation::Unnamed => client.query_typed_opt(sql, params).await,
        }
    }

    /// Runs `sql` with `params` on `client`; its one row (an error if none or more).
    pub(crate) async fn query_one(
        self,
        client: &ClientWrapper,
        sql: &str,
        params: &[Typed<'_>],
    ) -> Result<Row, tokio_postgres::Error> {
        match self {
            Preparation::Cached => {
                let statement = client.prepare_cached(sql).await?;
                client.query_one(&statement, &untyped(params)).await
            }
            Preparation::Unnamed => client.query_typed_one(sql, params).await,
        }
    }

    /// Runs `sql` with `params` on `client`; how many rows it changed.
    pub(crate) async fn execute(
        self,
        client: &ClientWrapper,
        sql: &str,
        params: &[Typed<'_>],
    ) -> Result<u64, tokio_postgres::Error> {
        match self {
            Preparation::Cached => {
                let statement = client.prepare_cached(sql).await?;
                client.execute(&statement, &untyped(params)).await
            }
            Preparation::Unnamed => client.execute_typed(sql, params).await,
        }
    }
}

/// The values of `params`, as a prepared statement takes them (its types are the statement's).
pub(crate) fn untyped<'a>(params: &[Typed<'a>]) -> Vec<&'a (dyn ToSql + Sync)> {
    params.iter().map(|(value, _)| *value).collect()
}

/// The shared statements' parameters with their types: `TEXT`, `BIGINT`, `INTEGER`, `BYTEA`.
pub(crate) fn typed<'a>(params: &'a [SqlParam<'_>]) -> Vec<Typed<'a>> {
    params
        .iter()
        .map(|param| {
            let ty = match param {
                SqlParam::Text(_) | SqlParam::OptionalText(_) => Type::TEXT,
                SqlParam::BigInt(_) => Type::INT8,
                SqlParam::Int(_) => Type::INT4,
                SqlParam::Bytes(_) => Type::BYTEA,
            };
            (param as &(dyn ToSql + Sync), ty)
        })
        .collect()
}
