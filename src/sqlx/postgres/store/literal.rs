//! SQL literals, for the statements the store sends as text with their values written into
//! them, so that they share a round trip with another statement (sqlx does not pipeline): the
//! reservation with the `BEGIN` (`one_flight`), the completed record with the `COMMIT`
//! (`complete_as_text`), each an `EXECUTE` of a statement prepared once per connection with
//! its arguments as literals, or, with unnamed statements (behind a transaction pooler), the
//! statement itself with its parameters replaced by the literals ([`with_values`]).
//!
//! Why the quoting is safe: [`push_escaped`] writes `E'`, the value with every `\` doubled and
//! every `'` doubled, then `'`. In an escape string constant the lexer ends the constant only at a
//! `'` that is neither doubled nor escaped by a `\`; every `\` of the output stands in a pair (read
//! as one `\`), and every `'` of the value in a pair (read as one `'`), so the constant ends
//! exactly at the closing quote and reads back as the value. Escape sequences (`\n`, `\x41`,
//! `\u0041`, octal) need a lone `\`, which never occurs. PostgreSQL text cannot hold NUL: a value
//! with one is refused. The value's other characters go as they are, as UTF-8, which is what sqlx
//! connections speak (they send `client_encoding = UTF8` at startup, and sqlx decodes text as
//! UTF-8). The store goes further and writes only ASCII values into SQL ([`is_plain`]): their bytes
//! read as the same characters in every client encoding PostgreSQL has, so a connection set to
//! another encoding cannot change where the constant ends (in SJIS, for example, a lead byte could
//! swallow a following `\`).

use crate::error::Error;

/// Appends `value` to `sql` as an escape string constant (`E'...'`, see [`push_escaped`]), if
/// the store writes it into SQL text at all ([`is_plain`]); `None` if not.
pub(crate) fn push_plain(sql: &mut String, value: &str) -> Option<()> {
    is_plain(value).then(|| push_escaped(sql, value))
}

/// `E'`, `value` with every `\` and `'` doubled, `'` (see the module docs): the runs between
/// them are copied whole. Both are ASCII, so every slice starts and ends on a character.
fn push_escaped(sql: &mut String, value: &str) {
    sql.reserve(value.len() + 3);
    sql.push_str("E'");
    let mut rest = value;
    while let Some(at) = rest.bytes().position(|byte| byte == b'\\' || byte == b'\'') {
        // Up to and with the character, then the character again.
        let (head, tail) = rest.split_at(at + 1);
        sql.push_str(head);
        sql.push_str(&head[at..]);
        rest = tail;
    }
    sql.push_str(rest);
    sql.push('\'');
}

/// Appends `bytes` to `sql` as a `bytea` constant: `E'\\x<hex>'` (the escape string of `\x` and
/// hex digits, which `bytea` reads in its hex format whatever `standard_conforming_strings`
/// says): one token for the server's parser, where `decode(..)` is a function call to parse
/// and run.
pub(crate) fn push_bytes(sql: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    sql.reserve(bytes.len() * 2 + 6);
    sql.push_str("E'\\\\x");
    // Written through a small buffer of ASCII digits, a chunk at a time.
    let mut digits = [0u8; 128];
    for chunk in bytes.chunks(digits.len() / 2) {
        for (pair, byte) in digits.chunks_exact_mut(2).zip(chunk) {
            pair[0] = HEX[usize::from(byte >> 4)];
            pair[1] = HEX[usize::from(byte & 0x0f)];
        }
        if let Ok(hex) = std::str::from_utf8(&digits[..chunk.len() * 2]) {
            sql.push_str(hex);
        }
    }
    sql.push('\'');
}

/// `sql` with each parameter `$n` replaced by `values[n - 1]` (a literal of this module, or an
/// integer) in parentheses: a statement whose values the server parses with it, to send as a
/// simple query that leaves nothing prepared on the connection (behind a transaction pooler).
/// `sql` is one of the store's statements; a `$` inside one of its quoted constants or
/// identifiers stays as it is. `None` if a parameter has no value.
pub(crate) fn with_values(sql: &str, values: &[String]) -> Option<String> {
    let mut out = String::with_capacity(sql.len() + values.iter().map(String::len).sum::<usize>());
    let mut quote = None;
    let mut chars = sql.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        match (quote, c) {
            (Some(open), _) if c == open => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"') => quote = Some(c),
            (None, '$') if chars.peek().is_some_and(|(_, next)| next.is_ascii_digit()) => {
                let mut end = at + 1;
                while let Some((digit_at, digit)) = chars.peek().copied() {
                    if !digit.is_ascii_digit() {
                        break;
                    }
                    end = digit_at + 1;
                    chars.next();
                }
                let n: usize = sql[at + 1..end].parse().ok()?;
                out.push('(');
                out.push_str(values.get(n.checked_sub(1)?)?);
                out.push(')');
                continue;
            }
            (None, _) => {}
        }
        out.push(c);
    }
    Some(out)
}

/// `value` as a constant of this module if the store writes it into SQL text ([`push_plain`]).
pub(crate) fn plain(value: &str) -> Option<String> {
    let mut constant = String::new();
    push_plain(&mut constant, value)?;
    Some(constant)
}

/// `bytes` as a constant of this module ([`push_bytes`]).
pub(crate) fn bytes_constant(bytes: &[u8]) -> String {
    let mut constant = String::new();
    push_bytes(&mut constant, bytes);
    constant
}

/// `value` as an escape string constant (see [`push_escaped`]), or an error if it holds a NUL
/// character: any other value, ASCII or not, for the tests of the quoting itself.
#[cfg(test)]
fn quote(value: &str) -> Result<String, Error> {
    if value.contains('\0') {
        return Err(nul_refused());
    }
    let mut quoted = String::new();
    push_escaped(&mut quoted, value);
    Ok(quoted)
}

/// `bytes` as a `bytea` constant (see [`push_bytes`]).
#[cfg(test)]
fn bytes(bytes: &[u8]) -> String {
    let mut constant = String::new();
    push_bytes(&mut constant, bytes);
    constant
}

/// Whether the store writes `value` into SQL text: ASCII without NUL (else the value goes as a
/// bind parameter).
pub(crate) fn is_plain(value: &str) -> bool {
    value.is_ascii() && !value.as_bytes().contains(&0)
}

/// The error of a tenant, operation or key with a NUL character.
pub(crate) fn nul_refused() -> Error {
    Error::Sqlx(sqlx::Error::InvalidArgument(
        "a tenant, operation or idempotency key with a NUL character cannot be stored in \
         PostgreSQL text"
            .into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::{bytes, is_plain, quote, with_values};

    #[test]
    fn quotes_and_backslashes_are_doubled() {
        assert_eq!(quote("").unwrap(), "E''");
        assert_eq!(quote("abc").unwrap(), "E'abc'");
        assert_eq!(quote("it's").unwrap(), "E'it''s'");
        assert_eq!(quote("a\\b").unwrap(), "E'a\\\\b'");
        assert_eq!(quote("\\'").unwrap(), "E'\\\\'''");
        assert_eq!(
            quote("'; DROP TABLE x; --").unwrap(),
            "E'''; DROP TABLE x; --'"
        );
        assert_eq!(quote("é\n").unwrap(), "E'é\n'");
    }

    #[test]
    fn bytes_are_hex() {
        assert_eq!(bytes(b""), "E'\\\\x'");
        assert_eq!(bytes(&[0, 0x7f, 0xff, b'\\', b'\'']), "E'\\\\x007fff5c27'");
        // Longer than the digit buffer: every chunk in order.
        let long: Vec<u8> = (0..=255).cycle().take(300).collect();
        let hex: String = long.iter().map(|byte| format!("{byte:02x}")).collect();
        assert_eq!(bytes(&long), format!("E'\\\\x{hex}'"));
    }

    #[test]
    fn nul_is_refused() {
        let refused = quote("a\0b").unwrap_err();
        assert!(refused.to_string().contains("NUL"), "{refused}");
        assert!(!is_plain("a\0b"));
    }

    #[test]
    fn values_replace_the_parameters_and_nothing_else() {
        let values = ["E'a'".to_owned(), "2".to_owned()];
        assert_eq!(
            with_values("SELECT $1, $2::bigint, '$1', \"$2\", $1", &values).as_deref(),
            Some("SELECT (E'a'), (2)::bigint, '$1', \"$2\", (E'a')")
        );
        // Two digits, and a parameter with no value.
        let many: Vec<String> = (1..=12).map(|n| n.to_string()).collect();
        assert_eq!(with_values("$12 $1", &many).as_deref(), Some("(12) (1)"));
        assert_eq!(with_values("$3", &values), None);
        assert_eq!(with_values("$0", &values), None);
    }

    #[test]
    fn only_ascii_is_plain() {
        assert!(is_plain("order-1 'x' \\ \u{7f}"));
        assert!(!is_plain("café"));
    }
}
