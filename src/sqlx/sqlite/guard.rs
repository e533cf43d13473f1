//! What the SQLite handle refuses: the statements that end or open the request's transaction
//! (`BEGIN`, `COMMIT`, `END`, `ROLLBACK` but for `ROLLBACK TO`), which would commit or undo
//! the handler's rows apart from the saved response. SQLite commits nothing on its own
//! inside a transaction: a statement that cannot run in one (`VACUUM`, `DETACH`, a
//! `journal_mode` change) fails there instead.
//!
//! sqlx runs every statement of a string, with or without bind parameters, so every
//! statement SQLite's own lexical rules find in it is checked ([`Dialect::Sqlite`]).

use crate::error::Error;
use crate::row_lock::guard::scanner::Words;
use crate::row_lock::guard::{check_with, split_in, Dialect};

/// The statement the handle refuses that `command` starts with, if any. Allowed:
/// `SAVEPOINT`, `RELEASE [SAVEPOINT]`, `ROLLBACK [TRANSACTION] TO [SAVEPOINT]` (none of them
/// ends the transaction) and everything else.
fn refused(command: &str) -> Option<&'static str> {
    let mut words = Words::new(Dialect::Sqlite, command);
    let first = words.next()?;
    let refusal = match first.to_ascii_uppercase().as_str() {
        "BEGIN" => "BEGIN",
        "COMMIT" => "COMMIT",
        "END" => "END",
        "ROLLBACK" => {
            let mut next = words.next();
            if next.is_some_and(|word| word.eq_ignore_ascii_case("TRANSACTION")) {
                next = words.next();
            }
            if next.is_some_and(|word| word.eq_ignore_ascii_case("TO")) {
                return None;
            }
            "ROLLBACK"
        }
        _ => return None,
    };
    Some(refusal)
}

/// Checks every statement of `command` (see [`refused`]).
pub(crate) fn check_command(command: &str) -> Result<(), Error> {
    check_with(Dialect::Sqlite, refused, command)
}

/// Cuts SQL into its statements by SQLite's lexical rules.
pub(crate) fn split(sql: &str) -> Vec<&str> {
    split_in(Dialect::Sqlite, sql)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused_anywhere(sql: &str) -> bool {
        check_command(sql).is_err()
    }

    #[test]
    fn transaction_control_is_refused() {
        for sql in [
            "COMMIT",
            "commit transaction",
            "END",
            "end transaction",
            "BEGIN",
            "BEGIN IMMEDIATE",
            "ROLLBACK",
            "ROLLBACK TRANSACTION",
            "INSERT INTO t VALUES (1); COMMIT",
            "  /* c */ -- c\n COMMIT",
            ";;COMMIT",
        ] {
            assert!(refused_anywhere(sql), "{sql:?} passed");
        }
    }

    #[test]
    fn savepoints_and_ordinary_statements_pass() {
        for sql in [
            "SAVEPOINT a",
            "RELEASE a",
            "RELEASE SAVEPOINT a",
            "ROLLBACK TO a",
            "ROLLBACK TRANSACTION TO SAVEPOINT a",
            "INSERT INTO orders (sku) VALUES ($1) RETURNING id",
            "SELECT 'COMMIT'",
            "SELECT [COMMIT; END]",
            "SELECT \"a;COMMIT\"",
            "SELECT `a;COMMIT`",
            "UPDATE t SET x = 1 -- ; COMMIT",
            "UPDATE t SET x = 1 /* ; COMMIT */",
            "CREATE TABLE t (x)",
        ] {
            assert!(!refused_anywhere(sql), "{sql:?} refused");
        }
    }

    /// Where SQLite's rules differ from PostgreSQL's, a lexer of the other dialect would hide
    /// a statement SQLite runs.
    #[test]
    fn sqlite_lexing_hides_nothing_that_runs() {
        for sql in [
            // Comments do not nest: the first `*/` ends it.
            "SELECT 1 /* /* */ ; COMMIT; /* */",
            // `--` ends at a line feed only; a carriage return does not start code.
            "SELECT 1; -- \r'\nCOMMIT; SELECT '",
            // No `E'...'` strings: the backslash is not an escape.
            "SELECT E'\\'; COMMIT; --'",
            // No dollar quotes: `$a$` is a parameter name.
            "SELECT $a$; COMMIT; SELECT $a$",
            // A parameter's parenthesized suffix holds a quote.
            "SELECT $a(') ; COMMIT; SELECT '",
            "SELECT :a(') ; COMMIT; SELECT '",
        ] {
            assert!(refused_anywhere(sql), "{sql:?} passed");
        }
    }

    #[test]
    fn split_follows_sqlite_quoting() {
        assert_eq!(
            split("SELECT [a;b]; SELECT 'c;d' -- e;f\n; SELECT 1"),
            ["SELECT [a;b]", " SELECT 'c;d' -- e;f\n", " SELECT 1"]
        );
    }
}
