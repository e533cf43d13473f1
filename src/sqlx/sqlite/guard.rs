//! What the SQLite handle refuses: the statements that end or open the request's transaction
//! (`BEGIN`, `COMMIT`, `END`, `ROLLBACK` but for `ROLLBACK TO`), which would commit or undo
//! the handler's rows apart from the saved response. SQLite commits nothing on its own
//! inside a transaction: a statement that cannot run in one (`VACUUM`, `DETACH`, a
//! `journal_mode` change) fails there instead.
//!
//! sqlx runs every statement of a string, with or without bind parameters, so every
//! statement SQLite's own lexical rules find in it is checked ([`SQLITE`]).

use crate::error::Error;
use crate::row_lock::guard::scanner::{
    end_of_run, is_ident_cont, is_space, quoted_end, Token, Words,
};
use crate::row_lock::guard::{check_with, split_in, Dialect};

/// SQLite's lexical rules: comments do not nest and `--` ends at a line feed only, `[...]`
/// and backquoted identifiers, no `E'...'` strings and no dollar quotes (`$`, `@`, `:` and
/// `#` start a parameter name, which may end with a parenthesized suffix).
const SQLITE: Dialect = Dialect::Own(sqlite_token);

/// The statement the handle refuses that `command` starts with, if any. Allowed:
/// `SAVEPOINT`, `RELEASE [SAVEPOINT]`, `ROLLBACK [TRANSACTION] TO [SAVEPOINT]` (none of them
/// ends the transaction) and everything else.
fn refused(command: &str) -> Option<&'static str> {
    let mut words = Words::new(SQLITE, command);
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
    check_with(SQLITE, refused, command)
}

/// Cuts SQL into its statements by SQLite's lexical rules.
pub(crate) fn split(sql: &str) -> Vec<&str> {
    split_in(SQLITE, sql)
}

/// The tokens SQLite lexes otherwise than PostgreSQL (`None`: lexed alike), as SQLite's own
/// tokenizer cuts them.
fn sqlite_token(bytes: &[u8], at: usize) -> Option<Token> {
    let next = |offset: usize| bytes.get(at + offset).copied();
    Some(match bytes[at] {
        // To the line feed only: a carriage return does not end it.
        b'-' if next(1) == Some(b'-') => Token::Blank(end_of_run(bytes, at, |b| b != b'\n')),
        // Comments do not nest.
        b'/' if next(1) == Some(b'*') => {
            let end = bytes[at + 2..]
                .windows(2)
                .position(|w| w == b"*/")
                .map_or(bytes.len(), |n| at + 2 + n + 2);
            Token::Blank(end)
        }
        b'`' => Token::Other(quoted_end(bytes, at + 1, b'`', false)),
        // `[name]`: no escape, it ends at the first `]`.
        b'[' => Token::Other(
            bytes[at + 1..]
                .iter()
                .position(|&b| b == b']')
                .map_or(bytes.len(), |n| at + 1 + n + 1),
        ),
        // No `E'...'` strings: `E` is a word.
        b'E' | b'e' if next(1) == Some(b'\'') => Token::Word(at + 1),
        b'$' | b'@' | b':' | b'#' => Token::Other(sqlite_variable_end(bytes, at)),
        _ => return None,
    })
}

/// The end of the parameter name that starts at `at` (`$name`, `@name`, `:name`, `#name`):
/// identifier characters and `::`, and after at least one of them a suffix from `(` to the
/// first `)` with no blank before it (a blank there ends the token, which SQLite refuses).
fn sqlite_variable_end(bytes: &[u8], at: usize) -> usize {
    let mut i = at + 1;
    let mut named = false;
    while i < bytes.len() {
        let byte = bytes[i];
        if is_ident_cont(byte) {
            named = true;
            i += 1;
        } else if byte == b'(' && named {
            i += 1;
            while i < bytes.len() && !is_space(bytes[i]) && bytes[i] != b')' {
                i += 1;
            }
            if bytes.get(i) == Some(&b')') {
                i += 1;
            }
            return i;
        } else if byte == b':' && bytes.get(i + 1) == Some(&b':') {
            i += 2;
        } else {
            return i;
        }
    }
    i
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
