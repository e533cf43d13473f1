//! The SQL lexer under every dialect's checks: statements cut at top-level semicolons
//! ([`split_in`]), the tokens with their nesting ([`Tokens`]), the first words of a command
//! ([`Words`]) and single tokens ([`token`]), by PostgreSQL's or MySQL's lexical rules, or
//! those of a dialect that lexes its own differences ([`Dialect`]).

/// Whose lexical rules the SQL follows.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Dialect {
    /// PostgreSQL: nested `/* */` comments, `E'...'` strings, dollar quotes.
    #[cfg_attr(not(feature = "_postgres-dialect"), allow(dead_code))]
    Postgres,
    /// MySQL and MariaDB: `#` comments, `-- ` only before a blank, executable `/*! */`
    /// comments (their text runs), backquoted identifiers, no dollar quotes; `'` and `"`
    /// quote as the session's `sql_mode` says ([`MySqlQuoting`]).
    #[cfg_attr(not(feature = "sqlx-mysql"), allow(dead_code))]
    MySql(MySqlQuoting),
    /// A dialect whose store's folder lexes the tokens it reads otherwise than PostgreSQL
    /// (`None`: lexed alike), with the helpers of this module (SQLite's, in
    /// `src/sqlx/sqlite/guard.rs`).
    #[cfg_attr(not(feature = "sqlx-sqlite"), allow(dead_code))]
    Own(fn(&[u8], usize) -> Option<Token>),
}

/// How MySQL reads `'` and `"`, which the session's `sql_mode` decides: a handler's statement
/// is checked under every reading, so that no mode can hide a statement from the check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(feature = "sqlx-mysql"), allow(dead_code))]
pub(crate) enum MySqlQuoting {
    /// The default: `'` and `"` strings, a backslash escapes the next character.
    Backslash,
    /// `ANSI_QUOTES`: `"` quotes an identifier, where a backslash is an ordinary character;
    /// `'` strings as by default.
    AnsiQuotes,
    /// `NO_BACKSLASH_ESCAPES` (with or without `ANSI_QUOTES`): a backslash is an ordinary
    /// character everywhere.
    NoBackslash,
}

#[cfg_attr(not(feature = "sqlx-mysql"), allow(dead_code))]
impl MySqlQuoting {
    /// Every reading a session's `sql_mode` can give.
    pub(crate) const ALL: [MySqlQuoting; 3] = [
        MySqlQuoting::Backslash,
        MySqlQuoting::AnsiQuotes,
        MySqlQuoting::NoBackslash,
    ];
}

/// Cuts `sql` into its statements by the rules of `dialect` (see [`postgres::guard::split`](crate::postgres::guard::split); the
/// routine-body heuristic is PostgreSQL's only).
pub(crate) fn split_in(dialect: Dialect, sql: &str) -> Vec<&str> {
    let mut statements = Vec::new();
    let mut start = 0;
    let mut routine = RoutineBody::default();
    let mut empty = true;
    let mut tokens = Tokens::new(dialect, sql);
    while let Some((at, token)) = tokens.next() {
        match token {
            Token::Blank(_) => {}
            Token::Semicolon if tokens.depth() == 0 && routine.depth == 0 => {
                if !empty {
                    statements.push(&sql[start..at]);
                }
                start = at + 1;
                empty = true;
                routine = RoutineBody::default();
            }
            Token::Word(end) => {
                empty = false;
                if matches!(dialect, Dialect::Postgres) {
                    routine.word(&sql[at..end], tokens.depth());
                }
            }
            _ => empty = false,
        }
    }
    if !empty {
        statements.push(&sql[start..]);
    }
    statements
}

/// The tokens of `sql` with where each starts, keeping count of the open parentheses.
pub(crate) struct Tokens<'a> {
    dialect: Dialect,
    bytes: &'a [u8],
    at: usize,
    depth: usize,
}

impl<'a> Tokens<'a> {
    pub(crate) fn new(dialect: Dialect, sql: &'a str) -> Self {
        Tokens {
            dialect,
            bytes: sql.as_bytes(),
            at: 0,
            depth: 0,
        }
    }

    /// How many parentheses are open after the last token returned (a stray `)` closes none).
    pub(crate) fn depth(&self) -> usize {
        self.depth
    }
}

impl Iterator for Tokens<'_> {
    type Item = (usize, Token);

    fn next(&mut self) -> Option<(usize, Token)> {
        let at = self.at;
        if at >= self.bytes.len() {
            return None;
        }
        let token = token(self.dialect, self.bytes, at);
        self.at = match token {
            Token::Blank(end) | Token::Word(end) | Token::Other(end) => end,
            Token::Open => {
                self.depth += 1;
                at + 1
            }
            Token::Close => {
                self.depth = self.depth.saturating_sub(1);
                at + 1
            }
            Token::Semicolon => at + 1,
        };
        Some((at, token))
    }
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

pub(crate) fn is_space(byte: u8) -> bool {
    matches!(byte, b' ' | b'\t' | b'\n' | b'\r' | b'\x0b' | b'\x0c')
}

pub(crate) fn is_ident_start(byte: u8) -> bool {
    byte.is_ascii_alphabetic() || byte == b'_' || byte >= 0x80
}

/// What may follow the first character of an identifier (PostgreSQL allows `$` in them).
pub(crate) fn is_ident_cont(byte: u8) -> bool {
    is_ident_start(byte) || byte.is_ascii_digit() || byte == b'$'
}

/// What a dollar-quote tag is made of (no `$`).
fn is_tag_cont(byte: u8) -> bool {
    is_ident_start(byte) || byte.is_ascii_digit()
}

/// The end of the run of bytes from `from` on that are all `in_run`: the first byte past
/// `from` that is not, or the end of the input.
pub(crate) fn end_of_run(bytes: &[u8], from: usize, in_run: impl Fn(u8) -> bool) -> usize {
    bytes[from..]
        .iter()
        .position(|&b| !in_run(b))
        .map_or(bytes.len(), |n| from + n)
}

/// The token that starts at `at` (not past the end).
pub(crate) fn token(dialect: Dialect, bytes: &[u8], at: usize) -> Token {
    let next = |offset: usize| bytes.get(at + offset).copied();
    if let Dialect::MySql(quoting) = dialect {
        if let Some(token) = mysql_token(bytes, at, quoting) {
            return token;
        }
    }
    if let Dialect::Own(own_token) = dialect {
        if let Some(token) = own_token(bytes, at) {
            return token;
        }
    }
    match bytes[at] {
        byte if is_space(byte) => {
            let end = end_of_run(bytes, at, is_space);
            Token::Blank(end)
        }
        b'-' if next(1) == Some(b'-') => {
            let end = end_of_run(bytes, at, |b| b != b'\n' && b != b'\r');
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
            let end = end_of_run(bytes, at, is_ident_cont);
            Token::Word(end)
        }
        b'$' => Token::Other(dollar_end(bytes, at)),
        byte if byte.is_ascii_digit() => {
            // A number: digits, `.`, `_`, an exponent, or the letters of a hex or octal
            // literal. Never a `$`, which starts a new token after a number.
            let end = end_of_run(bytes, at, |b| {
                b.is_ascii_alphanumeric() || b == b'.' || b == b'_'
            });
            Token::Other(end)
        }
        _ => Token::Other(at + 1),
    }
}

/// The tokens MySQL lexes otherwise than PostgreSQL (`None`: lexed alike).
fn mysql_token(bytes: &[u8], at: usize, quoting: MySqlQuoting) -> Option<Token> {
    let next = |offset: usize| bytes.get(at + offset).copied();
    let to_line_end = || end_of_run(bytes, at, |b| b != b'\n' && b != b'\r');
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
            let end = end_of_run(bytes, opener, |b: u8| b.is_ascii_digit());
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
        b'\'' => Token::Other(quoted_end(
            bytes,
            at + 1,
            b'\'',
            quoting != MySqlQuoting::NoBackslash,
        )),
        b'"' => Token::Other(quoted_end(
            bytes,
            at + 1,
            b'"',
            quoting == MySqlQuoting::Backslash,
        )),
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
pub(crate) fn quoted_end(bytes: &[u8], from: usize, quote: u8, backslash: bool) -> usize {
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
        return end_of_run(bytes, after, |b: u8| b.is_ascii_digit());
    }
    let tag_end = if bytes.get(after).copied().is_some_and(is_ident_start) {
        end_of_run(bytes, after, is_tag_cont)
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
