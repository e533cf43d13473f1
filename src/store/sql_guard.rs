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
//! The lexer knows two dialects ([`Dialect`]); MySQL's list of refused statements, longer
//! because of its implicit commits, is in [`mysql`].

use crate::error::Error;

#[cfg(feature = "sqlx-mysql")]
pub(crate) mod mysql;

/// Whose lexical rules the SQL follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dialect {
    /// PostgreSQL: nested `/* */` comments, `E'...'` strings, dollar quotes.
    Postgres,
    /// MySQL and MariaDB: `#` comments, `-- ` only before a blank, executable `/*! */`
    /// comments (their text runs), backslash escapes in `'` and `"` strings, backquoted
    /// identifiers, no dollar quotes.
    #[cfg_attr(not(feature = "sqlx-mysql"), allow(dead_code))]
    MySql,
}

/// The transaction-control statement that `command` starts with, if any: what the handle
/// refuses. `command` holds one command, possibly after empty statements and comments.
///
/// `SAVEPOINT`, `RELEASE` and `ROLLBACK TO` are allowed: on PostgreSQL they work inside the
/// transaction the layer opened and can neither end it nor roll back anything of the layer's
/// (the layer sets no savepoint), and they are how a handler recovers from an expected error.
#[cfg_attr(
    not(any(feature = "postgres", feature = "sqlx-postgres")),
    allow(dead_code)
)]
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
#[cfg_attr(
    not(any(feature = "postgres", feature = "sqlx-postgres")),
    allow(dead_code)
)]
pub(crate) fn check_command(command: &str) -> Result<(), Error> {
    let refusal = refused(command).or_else(|| split(command).into_iter().find_map(refused));
    match refusal {
        Some(statement) => Err(Error::TransactionControl(statement)),
        None => Ok(()),
    }
}

/// [`check_command`], remembering the texts it accepted: a handler sends the same few
/// statements on every request, and looking a text up costs a fraction of reading it again.
/// Only accepted texts are kept (a refusal is checked every time), at most
/// [`REMEMBERED`] of them, each at most [`REMEMBERED_LEN`] bytes long; past that, texts are
/// checked every time. Process-wide: whether a text is accepted depends on nothing else.
#[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
pub(crate) fn check_command_remembered(command: &str) -> Result<(), Error> {
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

/// How many accepted texts [`check_command_remembered`] keeps.
#[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
const REMEMBERED: usize = 1024;

/// The longest text [`check_command_remembered`] keeps.
#[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
const REMEMBERED_LEN: usize = 4096;

/// Cuts `sql` into its statements (without the `;`), leaving out empty ones (only whitespace
/// and comments), the way `psql` does: semicolons inside strings, quoted identifiers,
/// comments, dollar quotes, parentheses and the `BEGIN ATOMIC ... END` body of a `CREATE
/// FUNCTION` or `CREATE PROCEDURE` do not end a statement.
#[cfg_attr(
    not(any(feature = "postgres", feature = "sqlx-postgres")),
    allow(dead_code)
)]
pub(crate) fn split(sql: &str) -> Vec<&str> {
    split_in(Dialect::Postgres, sql)
}

/// [`split`] by the rules of `dialect` (the routine-body heuristic is PostgreSQL's only).
pub(crate) fn split_in(dialect: Dialect, sql: &str) -> Vec<&str> {
    let bytes = sql.as_bytes();
    let mut statements = Vec::new();
    let mut start = 0;
    let mut at = 0;
    let mut parens: usize = 0;
    let mut routine = RoutineBody::default();
    let mut empty = true;
    while at < bytes.len() {
        match token(dialect, bytes, at) {
            Token::Blank(end) => at = end,
            Token::Semicolon if parens == 0 && routine.depth == 0 => {
                if !empty {
                    statements.push(&sql[start..at]);
                }
                at += 1;
                start = at;
                empty = true;
                parens = 0;
                routine = RoutineBody::default();
            }
            other => {
                empty = false;
                match other {
                    Token::Word(end) => {
                        if dialect == Dialect::Postgres {
                            routine.word(&sql[at..end], parens);
                        }
                        at = end;
                    }
                    Token::Open => {
                        parens += 1;
                        at += 1;
                    }
                    Token::Close => {
                        parens = parens.saturating_sub(1);
                        at += 1;
                    }
                    Token::Other(end) => at = end,
                    Token::Semicolon => at += 1,
                    Token::Blank(end) => at = end,
                }
            }
        }
    }
    if !empty {
        statements.push(&sql[start..]);
    }
    statements
}

/// psql's heuristic for SQL-standard routine bodies: in a statement that starts with `CREATE
/// [OR REPLACE] FUNCTION` or `PROCEDURE`, `BEGIN` opens a block, `CASE` inside one opens
/// another, and `END` closes one; semicolons inside do not end the statement.
#[derive(Default)]
struct RoutineBody {
    /// The first words of the statement, as far as they match the heading.
    words: usize,
    heading: Heading,
    depth: usize,
}

#[derive(Default, PartialEq)]
enum Heading {
    #[default]
    Unknown,
    Create,
    CreateOr,
    CreateOrReplace,
    Routine,
    Other,
}

impl RoutineBody {
    fn word(&mut self, word: &str, parens: usize) {
        let is = |keyword: &str| word.eq_ignore_ascii_case(keyword);
        self.words += 1;
        self.heading = match (&self.heading, self.words) {
            (Heading::Unknown, 1) if is("CREATE") => Heading::Create,
            (Heading::Create, 2) if is("OR") => Heading::CreateOr,
            (Heading::CreateOr, 3) if is("REPLACE") => Heading::CreateOrReplace,
            (Heading::Create, 2) | (Heading::CreateOrReplace, 4)
                if is("FUNCTION") || is("PROCEDURE") =>
            {
                Heading::Routine
            }
            (Heading::Routine, _) => Heading::Routine,
            _ => Heading::Other,
        };
        if self.heading != Heading::Routine || parens != 0 {
            return;
        }
        // CASE also ends with END: counted only inside a body, where that END must not close it.
        if is("BEGIN") || (is("CASE") && self.depth > 0) {
            self.depth += 1;
        } else if is("END") {
            self.depth = self.depth.saturating_sub(1);
        }
    }
}

/// The words (identifiers and keywords) a command starts with, after comments, whitespace
/// and empty statements; ends at the first token that is not a word.
pub(crate) struct Words<'a> {
    dialect: Dialect,
    sql: &'a str,
    at: usize,
    started: bool,
}

impl<'a> Words<'a> {
    pub(crate) fn new(dialect: Dialect, sql: &'a str) -> Self {
        Words {
            dialect,
            sql,
            at: 0,
            started: false,
        }
    }
}

impl<'a> Iterator for Words<'a> {
    type Item = &'a str;

    fn next(&mut self) -> Option<&'a str> {
        let bytes = self.sql.as_bytes();
        while self.at < bytes.len() {
            match token(self.dialect, bytes, self.at) {
                Token::Blank(end) => self.at = end,
                // Leading semicolons are empty statements, which the server drops.
                Token::Semicolon if !self.started => self.at += 1,
                Token::Word(end) => {
                    let word = &self.sql[self.at..end];
                    self.at = end;
                    self.started = true;
                    return Some(word);
                }
                _ => {
                    self.at = bytes.len();
                    return None;
                }
            }
        }
        None
    }
}

/// One lexical token, by where it ends.
pub(crate) enum Token {
    /// Whitespace or a comment.
    Blank(usize),
    /// An unquoted identifier or keyword (letters, digits, `_`, `$`, non-ASCII).
    Word(usize),
    Semicolon,
    Open,
    Close,
    /// Anything else: a string, a quoted identifier, a number, a parameter, an operator.
    Other(usize),
}

fn is_space(byte: u8) -> bool {
    matches!(byte, b' ' | b'\t' | b'\n' | b'\r' | b'\x0b' | b'\x0c')
}

fn is_ident_start(byte: u8) -> bool {
    byte.is_ascii_alphabetic() || byte == b'_' || byte >= 0x80
}

/// What may follow the first character of an identifier (PostgreSQL allows `$` in them).
fn is_ident_cont(byte: u8) -> bool {
    is_ident_start(byte) || byte.is_ascii_digit() || byte == b'$'
}

/// What a dollar-quote tag is made of (no `$`).
fn is_tag_cont(byte: u8) -> bool {
    is_ident_start(byte) || byte.is_ascii_digit()
}

/// The token that starts at `at` (not past the end).
pub(crate) fn token(dialect: Dialect, bytes: &[u8], at: usize) -> Token {
    let next = |offset: usize| bytes.get(at + offset).copied();
    if dialect == Dialect::MySql {
        if let Some(token) = mysql_token(bytes, at) {
            return token;
        }
    }
    match bytes[at] {
        byte if is_space(byte) => {
            let end = bytes[at..]
                .iter()
                .position(|&b| !is_space(b))
                .map_or(bytes.len(), |n| at + n);
            Token::Blank(end)
        }
        b'-' if next(1) == Some(b'-') => {
            let end = bytes[at..]
                .iter()
                .position(|&b| b == b'\n' || b == b'\r')
                .map_or(bytes.len(), |n| at + n);
            Token::Blank(end)
        }
        b'/' if next(1) == Some(b'*') => Token::Blank(block_comment_end(bytes, at)),
        b';' => Token::Semicolon,
        b'(' => Token::Open,
        b')' => Token::Close,
        b'\'' => Token::Other(quoted_end(bytes, at + 1, b'\'', false)),
        b'"' => Token::Other(quoted_end(bytes, at + 1, b'"', false)),
        // `E'...'`: a string with backslash escapes (`E` not inside a word: words are
        // lexed whole below).
        b'E' | b'e' if next(1) == Some(b'\'') => {
            Token::Other(quoted_end(bytes, at + 2, b'\'', true))
        }
        byte if is_ident_start(byte) => {
            let end = bytes[at..]
                .iter()
                .position(|&b| !is_ident_cont(b))
                .map_or(bytes.len(), |n| at + n);
            Token::Word(end)
        }
        b'$' => Token::Other(dollar_end(bytes, at)),
        byte if byte.is_ascii_digit() => {
            // A number: digits, `.`, `_`, an exponent, or the letters of a hex or octal
            // literal. Never a `$`, which starts a new token after a number.
            let end = bytes[at..]
                .iter()
                .position(|&b| !(b.is_ascii_alphanumeric() || b == b'.' || b == b'_'))
                .map_or(bytes.len(), |n| at + n);
            Token::Other(end)
        }
        _ => Token::Other(at + 1),
    }
}

/// The tokens MySQL lexes otherwise than PostgreSQL (`None`: lexed alike).
fn mysql_token(bytes: &[u8], at: usize) -> Option<Token> {
    let next = |offset: usize| bytes.get(at + offset).copied();
    let to_line_end = || {
        bytes[at..]
            .iter()
            .position(|&b| b == b'\n' || b == b'\r')
            .map_or(bytes.len(), |n| at + n)
    };
    Some(match bytes[at] {
        b'#' => Token::Blank(to_line_end()),
        // `--` starts a comment only before a blank or a control character (`1--1` is `1 - -1`).
        b'-' if next(1) == Some(b'-') => match next(2) {
            None => Token::Blank(bytes.len()),
            Some(byte) if byte <= b' ' => Token::Blank(to_line_end()),
            Some(_) => Token::Other(at + 1),
        },
        // An executable comment (`/*! ... */`, MariaDB's `/*M! ... */`): its text runs, so only
        // the opener (and its version number) and the closer are blank.
        b'/' if next(1) == Some(b'*')
            && (next(2) == Some(b'!') || (next(2) == Some(b'M') && next(3) == Some(b'!'))) =>
        {
            let opener = if next(2) == Some(b'!') {
                at + 3
            } else {
                at + 4
            };
            let end = bytes[opener..]
                .iter()
                .position(|b| !b.is_ascii_digit())
                .map_or(bytes.len(), |n| opener + n);
            Token::Blank(end)
        }
        b'*' if next(1) == Some(b'/') => Token::Blank(at + 2),
        // Comments do not nest.
        b'/' if next(1) == Some(b'*') => {
            let end = bytes[at + 2..]
                .windows(2)
                .position(|w| w == b"*/")
                .map_or(bytes.len(), |n| at + 2 + n + 2);
            Token::Blank(end)
        }
        b'\'' => Token::Other(quoted_end(bytes, at + 1, b'\'', true)),
        b'"' => Token::Other(quoted_end(bytes, at + 1, b'"', true)),
        b'`' => Token::Other(quoted_end(bytes, at + 1, b'`', false)),
        // No `E'...'` strings (`e` is a word there) and no dollar quotes.
        b'E' | b'e' if next(1) == Some(b'\'') => Token::Word(at + 1),
        b'$' => Token::Other(at + 1),
        _ => return None,
    })
}

/// The end of the (nested) `/* */` comment that starts at `at`; the end of the input if it
/// is not closed.
fn block_comment_end(bytes: &[u8], at: usize) -> usize {
    let mut depth = 0usize;
    let mut i = at;
    while i < bytes.len() {
        if bytes[i] == b'/' && bytes.get(i + 1) == Some(&b'*') {
            depth += 1;
            i += 2;
        } else if bytes[i] == b'*' && bytes.get(i + 1) == Some(&b'/') {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    bytes.len()
}

/// The end of a quoted string or identifier whose content starts at `from`: a doubled quote
/// is part of it, and so is a backslash-escaped character when `backslash` is set.
fn quoted_end(bytes: &[u8], from: usize, quote: u8, backslash: bool) -> usize {
    let mut i = from;
    while i < bytes.len() {
        let byte = bytes[i];
        if backslash && byte == b'\\' {
            i += 2;
        } else if byte == quote {
            if bytes.get(i + 1) == Some(&quote) {
                i += 2;
            } else {
                return i + 1;
            }
        } else {
            i += 1;
        }
    }
    bytes.len()
}

/// The end of what starts with the `$` at `at`: a parameter (`$1`), a dollar-quoted string
/// (`$$...$$`, `$tag$...$tag$`), or a lone `$`.
fn dollar_end(bytes: &[u8], at: usize) -> usize {
    let after = at + 1;
    if bytes.get(after).is_some_and(u8::is_ascii_digit) {
        return bytes[after..]
            .iter()
            .position(|b| !b.is_ascii_digit())
            .map_or(bytes.len(), |n| after + n);
    }
    let tag_end = if bytes.get(after).copied().is_some_and(is_ident_start) {
        bytes[after..]
            .iter()
            .position(|&b| !is_tag_cont(b))
            .map_or(bytes.len(), |n| after + n)
    } else {
        after
    };
    if bytes.get(tag_end) != Some(&b'$') {
        return after;
    }
    let delimiter = &bytes[at..=tag_end];
    let body = tag_end + 1;
    bytes[body..]
        .windows(delimiter.len())
        .position(|window| window == delimiter)
        .map_or(bytes.len(), |n| body + n + delimiter.len())
}

#[cfg(test)]
mod tests {
    use super::{check_command, refused, split};
    use crate::error::Error;

    #[test]
    #[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
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
