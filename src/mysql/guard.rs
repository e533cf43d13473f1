//! What the MySQL and MariaDB handle refuses: transaction control, and the statements that
//! make the server commit the open transaction on its own (an *implicit commit*: DDL, `LOCK
//! TABLES`, `SET autocommit`...), which would commit the handler's rows and the reservation
//! before the layer saves the response.
//!
//! As on PostgreSQL, the handle sends every piece with the binary (prepared-statement)
//! protocol, for which the server refuses a string of more than one statement: a string that
//! holds one statement is checked by its first words ([`check_command`]).
//!
//! Where a string or a quoted name ends depends on the session's `sql_mode`
//! (`NO_BACKSLASH_ESCAPES`, `ANSI_QUOTES`), which a handler can change. So a text is checked
//! under every reading ([`MySqlQuoting`]) and refused if any of them finds a refused
//! statement: `SET @x = 'C:\', autocommit = 1` sets `autocommit` when backslashes do not
//! escape, and is refused whatever the session's mode. The price: a string literal with a
//! backslash before a quote and a refused statement after it (`'it\'s; COMMIT'`) is refused
//! too; bind such values as parameters.

use crate::error::Error;
use crate::row_lock::guard::scanner::{MySqlQuoting, Token, Tokens, Words};
use crate::row_lock::guard::{check_with, split_in, Dialect};

/// The statement the handle refuses that `command` starts with, if any.
///
/// Allowed: `SAVEPOINT`, `RELEASE SAVEPOINT`, `ROLLBACK TO [SAVEPOINT]`, `CREATE TEMPORARY
/// TABLE` and `DROP TEMPORARY TABLE` (none of them ends the transaction), and everything
/// else not listed below. `CALL` is allowed although a procedure may commit: the handle cannot
/// see inside it.
#[cfg(test)]
pub(crate) fn refused(command: &str) -> Option<&'static str> {
    MySqlQuoting::ALL
        .into_iter()
        .find_map(|quoting| refused_in(quoting, command))
}

/// [`refused`] under one reading of the quotes.
fn refused_in(quoting: MySqlQuoting, command: &str) -> Option<&'static str> {
    let mut words = Words::new(Dialect::MySql(quoting), command);
    let first = words.next()?;
    let is = |word: &str, keyword: &str| word.eq_ignore_ascii_case(keyword);
    let second = words.next();
    let second_is = |keyword: &str| second.is_some_and(|word| is(word, keyword));
    let refusal = match first.to_ascii_uppercase().as_str() {
        "BEGIN" => "BEGIN",
        "START" if second_is("TRANSACTION") => "START TRANSACTION",
        "COMMIT" => "COMMIT",
        "ROLLBACK" => {
            // `ROLLBACK [WORK] TO [SAVEPOINT] name` is allowed.
            let next = if second_is("WORK") {
                words.next()
            } else {
                second
            };
            match next {
                Some(word) if is(word, "TO") => return None,
                _ => "ROLLBACK",
            }
        }
        "XA" => "XA",
        "LOCK" => "LOCK TABLES",
        "UNLOCK" => "UNLOCK TABLES",
        // `PREPARE s FROM '...'` and `EXECUTE IMMEDIATE '...'` run text the handle cannot see.
        "PREPARE" => "PREPARE",
        "EXECUTE" => "EXECUTE",
        "SET" => return refused_set(quoting, command),
        "CREATE" => {
            // `CREATE [OR REPLACE] TEMPORARY TABLE` commits nothing.
            let temporary = second_is("TEMPORARY")
                || (second_is("OR")
                    && words.next().is_some_and(|w| is(w, "REPLACE"))
                    && words.next().is_some_and(|w| is(w, "TEMPORARY")));
            if temporary {
                return None;
            }
            "CREATE (an implicit commit)"
        }
        "DROP" if second_is("TEMPORARY") => return None,
        "DROP" => "DROP (an implicit commit)",
        "ALTER" => "ALTER (an implicit commit)",
        "RENAME" => "RENAME (an implicit commit)",
        "TRUNCATE" => "TRUNCATE (an implicit commit)",
        "GRANT" => "GRANT (an implicit commit)",
        "REVOKE" => "REVOKE (an implicit commit)",
        "ANALYZE" => "ANALYZE (an implicit commit)",
        "CHECK" => "CHECK TABLE (an implicit commit)",
        "OPTIMIZE" => "OPTIMIZE (an implicit commit)",
        "REPAIR" => "REPAIR (an implicit commit)",
        "FLUSH" => "FLUSH (an implicit commit)",
        "RESET" => "RESET (an implicit commit)",
        "CACHE" => "CACHE INDEX (an implicit commit)",
        "LOAD" if second_is("INDEX") => "LOAD INDEX (an implicit commit)",
        "INSTALL" => "INSTALL (an implicit commit)",
        "UNINSTALL" => "UNINSTALL (an implicit commit)",
        "START" | "STOP" | "CHANGE" => "replication control (an implicit commit)",
        _ => return None,
    };
    Some(refusal)
}

/// A `SET` is refused when it sets `autocommit` (turning it on commits) or a password, and
/// MariaDB's `SET STATEMENT ... FOR statement` when its statement is.
fn refused_set(quoting: MySqlQuoting, command: &str) -> Option<&'static str> {
    let bytes = command.as_bytes();
    let mut words = 0usize;
    let mut tokens = Tokens::new(Dialect::MySql(quoting), command);
    while let Some((at, token)) = tokens.next() {
        let Token::Word(end) = token else {
            continue;
        };
        let word = &command[at..end];
        words += 1;
        // `@name` is a user variable (`@@name` is the system variable).
        let user_variable = at >= 1 && bytes[at - 1] == b'@' && (at < 2 || bytes[at - 2] != b'@');
        if user_variable {
            continue;
        }
        if word.eq_ignore_ascii_case("autocommit") {
            return Some("SET autocommit");
        }
        if words == 2 && word.eq_ignore_ascii_case("PASSWORD") {
            return Some("SET PASSWORD (an implicit commit)");
        }
        if tokens.depth() == 0 && words > 2 && word.eq_ignore_ascii_case("FOR") {
            return refused_in(quoting, &command[end..]);
        }
    }
    None
}

/// Checks a string the server will run as one statement (the binary protocol); the other
/// statements [`split`] finds are checked too, for a clear error.
/// Every reading of the quotes must pass.
pub(crate) fn check_command(command: &str) -> Result<(), Error> {
    MySqlQuoting::ALL.into_iter().try_for_each(|quoting| {
        check_with(
            Dialect::MySql(quoting),
            |piece| refused_in(quoting, piece),
            command,
        )
    })
}

/// Cuts `sql` into its statements by MySQL's lexical rules under the default `sql_mode` (see
/// [`postgres::guard::split`](crate::postgres::guard::split)); each piece is then checked under every reading ([`check_command`]).
pub(crate) fn split(sql: &str) -> Vec<&str> {
    split_in(Dialect::MySql(MySqlQuoting::Backslash), sql)
}

#[cfg(test)]
mod tests {
    use super::{check_command, refused, split};

    #[test]
    fn transaction_control_and_implicit_commits_are_refused() {
        for sql in [
            "COMMIT",
            "commit work",
            "BEGIN",
            "BEGIN NOT ATOMIC SELECT 1; END",
            "START TRANSACTION READ ONLY",
            "ROLLBACK",
            "ROLLBACK WORK",
            "ROLLBACK AND CHAIN",
            "XA START 'x'",
            "LOCK TABLES orders WRITE",
            "UNLOCK TABLES",
            "SET autocommit = 1",
            "SET @@autocommit = 1",
            "SET SESSION autocommit=1",
            "set @@session.AUTOCOMMIT = 1",
            "SET @a = 1, autocommit = 1",
            "SET PASSWORD = PASSWORD('x')",
            "SET STATEMENT max_statement_time = 1 FOR COMMIT",
            "CREATE TABLE t (a INT)",
            "CREATE INDEX i ON orders (sku)",
            "ALTER TABLE orders ADD COLUMN x INT",
            "DROP TABLE orders",
            "RENAME TABLE a TO b",
            "TRUNCATE orders",
            "GRANT SELECT ON *.* TO x",
            "ANALYZE TABLE orders",
            "OPTIMIZE TABLE orders",
            "FLUSH TABLES",
            "LOAD INDEX INTO CACHE orders",
            "PREPARE s FROM 'COMMIT'",
            "EXECUTE IMMEDIATE 'COMMIT'",
        ] {
            assert!(refused(sql).is_some(), "{sql:?}");
            assert!(check_command(sql).is_err(), "{sql:?}");
        }
    }

    #[test]
    fn mysql_comments_hide_nothing_that_runs() {
        for sql in [
            "# a comment\nCOMMIT",
            "-- a comment\nCOMMIT",
            "--\tx\nCOMMIT",
            "/* a comment */ COMMIT",
            "/*!COMMIT*/",
            "/*!50000 COMMIT */",
            "/*M!100000 COMMIT */",
            "SELECT 1; /*!COMMIT*/",
            // A backslash escapes: the string ends at the second quote, COMMIT is a statement.
            "SELECT 'a\\\\'; COMMIT",
        ] {
            assert!(check_command(sql).is_err(), "{sql:?}");
        }
    }

    #[test]
    fn savepoints_temporary_tables_and_ordinary_statements_pass() {
        for sql in [
            "SAVEPOINT s",
            "RELEASE SAVEPOINT s",
            "ROLLBACK TO s",
            "ROLLBACK WORK TO SAVEPOINT s",
            "CREATE TEMPORARY TABLE t (a INT)",
            "CREATE OR REPLACE TEMPORARY TABLE t (a INT)",
            "DROP TEMPORARY TABLE t",
            "INSERT INTO orders (sku) VALUES ('COMMIT')",
            "INSERT INTO orders (sku) VALUES ('it\\'s')",
            "INSERT INTO orders (sku) VALUES (\"it\\\"s\")",
            "INSERT INTO orders (sku) VALUES (\"it\\\"s; COMMIT\")",
            "INSERT INTO orders (sku) VALUES ('C:\\\\temp')",
            "SELECT `commit` FROM t",
            "SELECT 1 # ; COMMIT",
            "SELECT 1 /* ; COMMIT */",
            "SELECT 1--1",
            "SET @a = 1",
            "SET @autocommit = 1, @password = 2",
            "SET SESSION innodb_lock_wait_timeout = 2",
            "SET STATEMENT max_statement_time = 1 FOR SELECT 1",
            "LOAD DATA INFILE 'x' INTO TABLE t",
            "CALL place_order(1)",
            "SELECT * FROM t FOR UPDATE",
        ] {
            assert_eq!(refused(sql), None, "{sql:?}");
            assert!(check_command(sql).is_ok(), "{sql:?}");
        }
    }

    #[test]
    fn no_sql_mode_hides_a_statement() {
        for sql in [
            // `NO_BACKSLASH_ESCAPES`: the string is `'C:\'`, and `autocommit` is set.
            "SET @x = 'C:\\', autocommit = 1",
            // `ANSI_QUOTES`: `@"x\"` is a name, and `autocommit` is set.
            "SET @\"x\\\" = 1, autocommit = 1",
            "SELECT 'a\\'; COMMIT; -- '",
            "SELECT \"a\\\"; COMMIT; -- \"",
        ] {
            assert!(check_command(sql).is_err(), "{sql:?}");
        }
    }

    #[test]
    fn split_follows_mysql_quoting() {
        assert_eq!(split("SELECT 1; COMMIT"), ["SELECT 1", " COMMIT"]);
        assert_eq!(
            split("SELECT 'a\\'; b'; SELECT 2"),
            ["SELECT 'a\\'; b'", " SELECT 2"]
        );
        assert_eq!(split("SELECT `a;b`"), ["SELECT `a;b`"]);
        assert_eq!(
            split("SELECT 1 # ;\n; SELECT 2"),
            ["SELECT 1 # ;\n", " SELECT 2"]
        );
        // No dollar quotes: `$$` quotes nothing.
        assert_eq!(split("SELECT $$; COMMIT"), ["SELECT $$", " COMMIT"]);
        // Comments do not nest.
        assert_eq!(
            split("SELECT /* /* */ 1; COMMIT"),
            ["SELECT /* /* */ 1", " COMMIT"]
        );
    }
}
