//! Refuses transaction control in the SQL a handler runs through its transaction handle.
//!
//! The layer owns the request's transaction: a `COMMIT` (or `ROLLBACK`, `BEGIN`...) run by the
//! handler would commit its rows with no record, so that a retry runs them again. The handle
//! refuses such statements before they reach the server.
//!
//! The check does not rest on this lexer being exactly the server's. The handle sends every
//! piece of SQL with the extended protocol, for which the server itself refuses a string of
//! more than one command; a string that holds one command is checked by its first words
//! ([`check_command`]), which only needs comments, whitespace and empty statements skipped
//! right. Multi-statement strings (`batch_execute`) are cut here ([`split`]) and each piece is
//! checked and sent on its own: a cut missed here makes the server refuse the piece, a cut made
//! wrongly makes the piece a syntax error; neither runs a hidden statement.
//!
//! The lexer, one for both dialects ([`Dialect`]), is in
//! [`scanner`](crate::row_lock::guard::scanner); this file holds PostgreSQL's refused
//! statements, and MySQL's list, longer because of its implicit commits, is in
//! [`mysql::guard`](crate::mysql::guard). Both check a command the same way ([`check_with`]).

use crate::error::Error;
use crate::row_lock::guard::scanner::Words;
use crate::row_lock::guard::{check_with, split_in, Dialect};

/// The transaction-control statement that `command` starts with, if any: what the handle
/// refuses. `command` holds one command, possibly after empty statements and comments.
///
/// `SAVEPOINT`, `RELEASE` and `ROLLBACK TO` are allowed: on PostgreSQL they work inside the
/// transaction the layer opened and can neither end it nor roll back anything of the layer's
/// (the layer sets no savepoint), and they are how a handler recovers from an expected error.
pub(crate) fn refused(command: &str) -> Option<&'static str> {
    let mut words = Words::new(Dialect::Postgres, command);
    let first = words.next()?;
    let is = |word: &str, keyword: &str| word.eq_ignore_ascii_case(keyword);
    if is(first, "BEGIN") {
        Some("BEGIN")
    } else if is(first, "START") {
        Some("START TRANSACTION")
    } else if is(first, "COMMIT") {
        Some("COMMIT")
    } else if is(first, "END") {
        Some("END")
    } else if is(first, "ABORT") {
        Some("ABORT")
    } else if is(first, "ROLLBACK") {
        // `ROLLBACK [WORK | TRANSACTION] TO [SAVEPOINT] name` is allowed; anything else
        // (`ROLLBACK`, `ROLLBACK AND CHAIN`, `ROLLBACK PREPARED`) is refused.
        let mut next = words.next();
        if next.is_some_and(|word| is(word, "WORK") || is(word, "TRANSACTION")) {
            next = words.next();
        }
        match next {
            Some(word) if is(word, "TO") => None,
            _ => Some("ROLLBACK"),
        }
    } else if is(first, "PREPARE") {
        // `PREPARE name AS ...` (an SQL prepared statement) is fine.
        match words.next() {
            Some(word) if is(word, "TRANSACTION") => Some("PREPARE TRANSACTION"),
            _ => None,
        }
    } else {
        None
    }
}

/// Checks a string the server will run as one command (the extended protocol).
///
/// The first command is what the server may run, and is checked on its own (from its first
/// words, not from how this module cuts the rest); the other statements that [`split`] finds
/// are checked too, so that `SELECT 1; COMMIT` is refused with a clear error rather than by
/// the server for holding two commands.
pub(crate) fn check_command(command: &str) -> Result<(), Error> {
    check_with(Dialect::Postgres, refused, command)
}

/// [`check_command`], remembering the texts it accepted: a handler sends the same few
/// statements on every request, and looking a text up costs a fraction of reading it again.
/// Only accepted texts are kept (a refusal is checked every time), at most
/// [`REMEMBERED`] of them, each at most [`REMEMBERED_LEN`] bytes long; past that, texts are
/// checked every time. Process-wide: whether a text is accepted depends on nothing else.
///
/// In front of that set, each thread keeps the first [`RECENT`] texts it saw accepted:
/// comparing a text with a handful of others (their lengths first) costs a fraction of hashing
/// it for the shared set behind its lock.
pub(crate) fn check_command_remembered(command: &str) -> Result<(), Error> {
    use std::cell::RefCell;

    thread_local! {
        static RECENTLY_ACCEPTED: RefCell<Vec<Box<str>>> = const { RefCell::new(Vec::new()) };
    }
    let known =
        RECENTLY_ACCEPTED.with_borrow(|accepted| accepted.iter().any(|text| **text == *command));
    if known {
        return Ok(());
    }
    check_command_shared(command)?;
    if command.len() <= REMEMBERED_LEN {
        RECENTLY_ACCEPTED.with_borrow_mut(|accepted| {
            if accepted.len() < RECENT {
                accepted.push(command.into());
            }
        });
    }
    Ok(())
}

/// The process-wide part of [`check_command_remembered`].
fn check_command_shared(command: &str) -> Result<(), Error> {
    use std::collections::HashSet;
    use std::sync::{LazyLock, RwLock};

    static ACCEPTED: LazyLock<RwLock<HashSet<Box<str>>>> =
        LazyLock::new(|| RwLock::new(HashSet::new()));
    if ACCEPTED
        .read()
        .is_ok_and(|accepted| accepted.contains(command))
    {
        return Ok(());
    }
    check_command(command)?;
    if command.len() <= REMEMBERED_LEN {
        if let Ok(mut accepted) = ACCEPTED.write() {
            if accepted.len() < REMEMBERED {
                accepted.insert(command.into());
            }
        }
    }
    Ok(())
}

/// How many accepted texts each thread keeps in front of the shared set
/// ([`check_command_remembered`]).
const RECENT: usize = 16;

/// How many accepted texts [`check_command_remembered`] keeps.
const REMEMBERED: usize = 1024;

/// The longest text [`check_command_remembered`] keeps.
const REMEMBERED_LEN: usize = 4096;

/// Cuts `sql` into its statements (without the `;`), leaving out empty ones (only whitespace
/// and comments), the way `psql` does: semicolons inside strings, quoted identifiers,
/// comments, dollar quotes, parentheses and the `BEGIN ATOMIC ... END` body of a `CREATE
/// FUNCTION` or `CREATE PROCEDURE` do not end a statement.
pub(crate) fn split(sql: &str) -> Vec<&str> {
    split_in(Dialect::Postgres, sql)
}

#[cfg(test)]
mod tests {
    use super::{check_command, refused, split};
    use crate::error::Error;

    /// More texts than a thread keeps in front of the shared set, twice over: each answer is
    /// the plain check's.
    #[test]
    fn remembered_texts_answer_as_the_check_does() {
        use super::{check_command_remembered, RECENT};

        let accepted: Vec<String> = (0..RECENT + 4)
            .map(|i| format!("INSERT INTO t VALUES ({i})"))
            .collect();
        for _ in 0..2 {
            for text in &accepted {
                assert!(check_command_remembered(text).is_ok(), "{text}");
            }
            for refused in ["COMMIT", "commit", "SELECT 1; ROLLBACK", "BEGIN"] {
                assert!(
                    matches!(
                        check_command_remembered(refused),
                        Err(Error::TransactionControl(_))
                    ),
                    "{refused}"
                );
            }
            assert!(check_command_remembered("ROLLBACK TO SAVEPOINT a").is_ok());
        }
    }

    #[test]
    fn remembered_checks_answer_as_the_check_does() {
        use super::check_command_remembered;

        for _ in 0..2 {
            assert!(check_command_remembered("INSERT INTO t VALUES (1)").is_ok());
            assert!(check_command_remembered("SELECT 1; COMMIT").is_err());
            assert!(check_command_remembered("commit").is_err());
            assert!(check_command_remembered("ROLLBACK TO SAVEPOINT a").is_ok());
            assert!(check_command_remembered("ROLLBACK").is_err());
        }
        let long = format!("SELECT 1 {}", " ".repeat(5000));
        assert!(check_command_remembered(&long).is_ok());
        assert!(check_command_remembered(&format!("COMMIT {long}")).is_err());
    }

    #[test]
    fn transaction_control_is_refused_in_any_case_and_spelling() {
        for (sql, statement) in [
            ("COMMIT", "COMMIT"),
            ("commit", "COMMIT"),
            ("Commit Work", "COMMIT"),
            ("COMMIT AND CHAIN", "COMMIT"),
            ("COMMIT PREPARED 'x'", "COMMIT"),
            ("END", "END"),
            ("end transaction;", "END"),
            ("BEGIN", "BEGIN"),
            ("begin isolation level serializable", "BEGIN"),
            ("START TRANSACTION", "START TRANSACTION"),
            ("ROLLBACK", "ROLLBACK"),
            ("ROLLBACK WORK", "ROLLBACK"),
            ("ROLLBACK AND CHAIN", "ROLLBACK"),
            ("ROLLBACK PREPARED 'x'", "ROLLBACK"),
            ("ABORT", "ABORT"),
            ("PREPARE TRANSACTION 'x'", "PREPARE TRANSACTION"),
            ("prepare transaction 'x'", "PREPARE TRANSACTION"),
        ] {
            assert_eq!(refused(sql), Some(statement), "{sql}");
        }
    }

    #[test]
    fn comments_whitespace_and_empty_statements_before_the_command_are_skipped() {
        for sql in [
            "  \n\tCOMMIT",
            "-- the layer commits, not me\nCOMMIT",
            "-- a comment\r\nCOMMIT",
            "/* a comment */COMMIT",
            "/* outer /* nested */ still a comment */ COMMIT",
            ";COMMIT",
            " ; ;  -- x\n ; COMMIT",
            "\x0bCOMMIT",
            "\x0cCOMMIT",
            "ROLLBACK/* x */",
            "ROLLBACK -- TO x",
            "ROLLBACK /* TO */ ; ",
        ] {
            assert!(refused(sql).is_some(), "{sql:?}");
        }
    }

    #[test]
    fn savepoints_and_ordinary_statements_pass() {
        for sql in [
            "SAVEPOINT before_insert",
            "RELEASE SAVEPOINT before_insert",
            "RELEASE before_insert",
            "ROLLBACK TO SAVEPOINT before_insert",
            "rollback to before_insert",
            "ROLLBACK WORK TO SAVEPOINT s",
            "ROLLBACK TRANSACTION /* c */ TO s",
            "PREPARE find_order (bigint) AS SELECT * FROM orders WHERE id = $1",
            "INSERT INTO orders (sku) VALUES ('COMMIT') RETURNING id",
            "SELECT $$COMMIT$$",
            "SELECT 1 -- COMMIT",
            "/* COMMIT */ SELECT 1",
            "/* /* COMMIT */ */ SELECT 1",
            "\"commit\"",
            "commit$1",
            "beginning",
            "SET LOCAL lock_timeout = 100",
            "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE",
            "DO $$ BEGIN PERFORM 1; END $$",
            "",
            " ; -- nothing",
        ] {
            assert_eq!(refused(sql), None, "{sql:?}");
        }
    }

    #[test]
    fn the_refusal_names_the_statement_and_what_to_do() {
        let error = check_command("COMMIT").expect_err("refused");
        assert!(matches!(error, Error::TransactionControl("COMMIT")));
        let message = error.to_string();
        assert!(message.contains("COMMIT"), "{message}");
        assert!(message.contains("the layer commits"), "{message}");
        assert!(check_command("SELECT 1").is_ok());
        assert!(matches!(
            check_command("SELECT 1; COMMIT; BEGIN"),
            Err(Error::TransactionControl("COMMIT"))
        ));
        assert!(check_command("SELECT 'x; COMMIT'").is_ok());
    }

    #[test]
    fn split_cuts_at_top_level_semicolons() {
        assert_eq!(
            split("SELECT 1; COMMIT; BEGIN"),
            ["SELECT 1", " COMMIT", " BEGIN"]
        );
        assert_eq!(split("SELECT 1;"), ["SELECT 1"]);
        assert_eq!(
            split(";; -- only a comment\n; /* and */ ;"),
            [] as [&str; 0]
        );
        assert_eq!(split("SELECT 1;\n-- trailing"), ["SELECT 1"]);
    }

    #[test]
    fn split_keeps_semicolons_inside_strings_identifiers_and_comments() {
        for sql in [
            "SELECT 'a; COMMIT'",
            "SELECT 'it''s; COMMIT'",
            "SELECT E'it\\'s; COMMIT'",
            "SELECT e'\\\\'",
            "SELECT \"odd;name\"",
            "SELECT \"say \"\"hi\"\"; COMMIT\"",
            "SELECT 1 -- ; COMMIT",
            "SELECT 1 /* ; COMMIT */",
            "SELECT 1 /* /* ; */ COMMIT; */",
            "SELECT $$; COMMIT; $$",
            "SELECT $body$ $$; COMMIT; $$ $body$",
            "SELECT $a$ $ab$; $a$",
            "SELECT U&'d\\0061t\\+000061; x'",
            "SELECT (1; 2)",
        ] {
            assert_eq!(split(sql), [sql], "{sql:?}");
        }
    }

    #[test]
    fn split_lexes_dollars_in_words_and_parameters_as_postgresql_does() {
        // `x$$` is an identifier: no dollar quote starts there.
        assert_eq!(
            split("SELECT 1 AS x$$; COMMIT; SELECT $$a$$"),
            ["SELECT 1 AS x$$", " COMMIT", " SELECT $$a$$"]
        );
        // `$1` is a parameter, and a dollar quote may start right after one.
        assert_eq!(split("SELECT $1; COMMIT"), ["SELECT $1", " COMMIT"]);
        assert_eq!(split("SELECT $1$$;$$"), ["SELECT $1$$;$$"]);
        // A lone `$` quotes nothing.
        assert_eq!(split("SELECT $x; COMMIT"), ["SELECT $x", " COMMIT"]);
        // A word ending in `e` before a quote is a word, then a plain string.
        assert_eq!(
            split("SELECT name'\\'; COMMIT; --'"),
            ["SELECT name'\\'", " COMMIT"]
        );
    }

    #[test]
    fn split_keeps_a_sql_standard_routine_body_whole() {
        let create = "CREATE OR REPLACE FUNCTION add_one(i int) RETURNS int LANGUAGE sql \
                      BEGIN ATOMIC SELECT CASE WHEN i > 0 THEN i + 1 ELSE 1 END; END";
        assert_eq!(split(&format!("{create}; COMMIT")), [create, " COMMIT"]);
        let procedure = "CREATE PROCEDURE p() LANGUAGE sql BEGIN ATOMIC SELECT 1; SELECT 2; END";
        assert_eq!(split(procedure), [procedure]);
        // Outside a routine's heading, BEGIN opens nothing.
        assert_eq!(
            split("SELECT begin FROM t; COMMIT"),
            ["SELECT begin FROM t", " COMMIT"]
        );
    }

    #[test]
    fn unterminated_quotes_and_comments_run_to_the_end() {
        for sql in [
            "SELECT 'x; COMMIT",
            "SELECT $$x; COMMIT",
            "SELECT /* x; COMMIT",
        ] {
            assert_eq!(split(sql), [sql], "{sql:?}");
        }
    }
}
