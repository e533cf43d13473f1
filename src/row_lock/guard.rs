//! What the handles of every SQL server refuse is checked the same way: a command's first
//! words, then every statement the dialect's lexer ([`scanner`]) cuts out of it. Each dialect
//! names its refused statements: PostgreSQL's in `src/postgres/guard.rs`, MySQL's in
//! `src/mysql/guard.rs`.

use crate::error::Error;

pub(crate) mod scanner;

pub(crate) use scanner::{split_in, Dialect};

/// A dialect's `check_command`: for `dialect`, whose refused statements `refused` names: the first
/// command, then every statement [`split_in`] finds.
pub(crate) fn check_with(
    dialect: Dialect,
    refused: impl Fn(&str) -> Option<&'static str>,
    command: &str,
) -> Result<(), Error> {
    let refusal =
        refused(command).or_else(|| split_in(dialect, command).into_iter().find_map(&refused));
    match refusal {
        Some(statement) => Err(Error::TransactionControl(statement)),
        None => Ok(()),
    }
}
