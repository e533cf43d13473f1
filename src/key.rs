//! Parsing and validation of the `Idempotency-Key` request header.
//!
//! A key is sent either as a raw token (`Idempotency-Key: 8e03978e-40d5-43e8`) or, as the IETF
//! draft specifies, as an [RFC 8941] sf-string (`Idempotency-Key: "8e03978e-40d5-43e8"`). Both
//! spellings name the same key. After unquoting, a key is 1 to `max_len` bytes of visible ASCII
//! (`0x21..=0x7E`).
//!
//! A key is a capability: whoever holds it can replay the saved response. So `Debug` does not print
//! it (and there is no `Display`); it prints [`IdempotencyKey::redacted`], a short
//! non-reversible tag that is safe for logs.
//!
//! ```
//! use tower_idempotency::key::{IdempotencyKey, KeyError, DEFAULT_MAX_KEY_LEN};
//!
//! let raw = IdempotencyKey::parse(b"order-42", DEFAULT_MAX_KEY_LEN).unwrap();
//! let quoted = IdempotencyKey::parse(b"\"order-42\"", DEFAULT_MAX_KEY_LEN).unwrap();
//! assert_eq!(raw, quoted);
//! assert_eq!(raw.as_str(), "order-42");
//! assert!(!format!("{raw:?}").contains("order-42"));
//!
//! assert_eq!(IdempotencyKey::parse(b"", DEFAULT_MAX_KEY_LEN), Err(KeyError::Empty));
//! assert_eq!(IdempotencyKey::parse(b"a b", DEFAULT_MAX_KEY_LEN), Err(KeyError::Malformed));
//! ```
//!
//! [RFC 8941]: https://www.rfc-editor.org/rfc/rfc8941#name-strings

use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};

/// The default maximum length of a key, in bytes after unquoting.
pub const DEFAULT_MAX_KEY_LEN: usize = 128;

pub use crate::key_source::KeyExtractor;

/// A validated idempotency key.
///
/// `Debug` never prints the key itself (it is a capability to replay a response):
/// they print its [redacted](IdempotencyKey::redacted) tag. Use [`as_str`](IdempotencyKey::as_str)
/// to get the key.
///
/// Shared, not copied, by its clones: a request's scope is cloned a few times on its way
/// through the layer and the store.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(Arc<str>);

/// Why an `Idempotency-Key` header value was rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The header value, or the quoted string in it, is empty.
    #[error("the Idempotency-Key header is empty")]
    Empty,
    /// The key is longer than the configured maximum.
    #[error("the Idempotency-Key is longer than {max} bytes")]
    TooLong {
        /// The maximum length, in bytes.
        max: usize,
    },
    /// The value is neither a token of visible ASCII characters nor a well-formed quoted string of
    /// them.
    #[error(
        "the Idempotency-Key is malformed: expected visible ASCII characters, \
         optionally as a quoted string"
    )]
    Malformed,
}

impl IdempotencyKey {
    /// Parses one header value: a raw token, or an RFC 8941 sf-string (`"abc"` is the key `abc`).
    ///
    /// Leading and trailing spaces and tabs are ignored. Inside a quoted string only `\"` and `\\`
    /// escapes are allowed. The key, after unquoting, must be 1 to `max_len` bytes, each visible
    /// ASCII (`0x21..=0x7E`).
    pub fn parse(value: &[u8], max_len: usize) -> Result<Self, KeyError> {
        let value = trim_ows(value);
        let unquoted;
        let key: &[u8] = match value.split_first() {
            None => return Err(KeyError::Empty),
            Some((b'"', quoted)) => {
                unquoted = unquote_sf_string(quoted)?;
                &unquoted
            }
            // A raw token is the key as it is: no copy before the key's own.
            Some(_) => value,
        };
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        // A quoted string may hold spaces; a key may not (nor may a raw token hold anything
        // but visible ASCII).
        if !key.iter().all(|&b| is_visible_ascii(b)) {
            return Err(KeyError::Malformed);
        }
        if key.len() > max_len {
            return Err(KeyError::TooLong { max: max_len });
        }
        // Every byte was checked to be ASCII above, so this cannot fail.
        std::str::from_utf8(key)
            .map(|key| IdempotencyKey(Arc::from(key)))
            .map_err(|_| KeyError::Malformed)
    }

    /// A key already unquoted, taken exactly as it is: as [`as_str`](Self::as_str) gives it
    /// and the stores keep and list it (`"x"` is the key of three characters `"x"`, which a
    /// client sends as `"\"x\""`). 1 or more bytes of visible ASCII, of any length; use it
    /// to name a stored key (the admin), never to read a header.
    pub fn from_unquoted(key: &str) -> Result<Self, KeyError> {
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if !key.bytes().all(is_visible_ascii) {
            return Err(KeyError::Malformed);
        }
        Ok(IdempotencyKey(Arc::from(key)))
    }

    /// The key, as the client sent it (unquoted).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A short, stable, non-reversible tag for logs: `k:` and the first 12 hex characters of the
    /// SHA-256 of the key, e.g. `k:3fa2c91b0d4e`.
    pub fn redacted(&self) -> String {
        self.redacted_lazily().to_string()
    }

    /// The [redacted](IdempotencyKey::redacted) tag, hashed only when it is printed: for log
    /// fields that are usually filtered out.
    pub(crate) fn redacted_lazily(&self) -> Redacted<'_> {
        Redacted(self)
    }
}

/// Prints the [redacted](IdempotencyKey::redacted) tag of a key, never the key.
pub(crate) struct Redacted<'a>(&'a IdempotencyKey);

impl fmt::Display for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let digest = Sha256::digest(self.0 .0.as_bytes());
        let mut tag = [0u8; 14];
        tag[..2].copy_from_slice(b"k:");
        for (i, byte) in digest.iter().take(6).enumerate() {
            tag[2 + 2 * i] = HEX[usize::from(byte >> 4)];
            tag[3 + 2 * i] = HEX[usize::from(byte & 0x0f)];
        }
        // Only ASCII went in.
        f.write_str(std::str::from_utf8(&tag).map_err(|_| fmt::Error)?)
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "IdempotencyKey({}, len {})",
            self.redacted_lazily(),
            self.0.len()
        )
    }
}

/// Whether `byte` is a visible ASCII character (no space, no control).
fn is_visible_ascii(byte: u8) -> bool {
    (0x21..=0x7E).contains(&byte)
}

fn trim_ows(mut value: &[u8]) -> &[u8] {
    while let Some((b' ' | b'\t', rest)) = value.split_first() {
        value = rest;
    }
    while let Some((b' ' | b'\t', rest)) = value.split_last() {
        value = rest;
    }
    value
}

/// Decodes the body of an sf-string, `quoted` being everything after the opening `"`.
fn unquote_sf_string(quoted: &[u8]) -> Result<Vec<u8>, KeyError> {
    let mut key = Vec::with_capacity(quoted.len());
    let mut bytes = quoted.iter();
    while let Some(&byte) = bytes.next() {
        match byte {
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => key.push(escaped),
                _ => return Err(KeyError::Malformed),
            },
            // The closing quote must end the value.
            b'"' if bytes.as_slice().is_empty() => return Ok(key),
            b'"' => return Err(KeyError::Malformed),
            0x20..=0x7E => key.push(byte),
            _ => return Err(KeyError::Malformed),
        }
    }
    // No closing quote.
    Err(KeyError::Malformed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(value: &str) -> Result<IdempotencyKey, KeyError> {
        IdempotencyKey::parse(value.as_bytes(), DEFAULT_MAX_KEY_LEN)
    }

    fn key(value: &str) -> String {
        match parse(value) {
            Ok(key) => key.as_str().to_owned(),
            Err(error) => panic!("{value:?} should parse, got {error:?}"),
        }
    }

    #[test]
    fn raw_token() {
        assert_eq!(key("abc"), "abc");
        assert_eq!(
            key("8e03978e-40d5-43e8-bc93-6894a57f9324"),
            "8e03978e-40d5-43e8-bc93-6894a57f9324"
        );
        // Every visible ASCII character is allowed in a raw token, quotes and backslashes too.
        let all_visible: String = (0x21u8..=0x7E).map(char::from).collect();
        assert_eq!(key(&all_visible), all_visible);
        assert_eq!(key("a\"b"), "a\"b");
        assert_eq!(key("a\\b"), "a\\b");
    }

    #[test]
    fn surrounding_spaces_and_tabs_are_trimmed() {
        assert_eq!(key("  abc\t "), "abc");
        assert_eq!(key("\t\"abc\"  "), "abc");
    }

    #[test]
    fn quoted_is_the_same_key_as_raw() {
        assert_eq!(parse("\"abc\""), parse("abc"));
        assert_eq!(key("\"abc\""), "abc");
    }

    #[test]
    fn quoted_escapes() {
        assert_eq!(key(r#""a\"b""#), "a\"b");
        assert_eq!(key(r#""a\\b""#), "a\\b");
        assert_eq!(key(r#""\\\"""#), "\\\"");
        // Other escapes do not exist in sf-strings.
        assert_eq!(parse(r#""a\nb""#), Err(KeyError::Malformed));
        assert_eq!(parse(r#""a\u0041""#), Err(KeyError::Malformed));
        // A trailing backslash escapes the closing quote, leaving the string unterminated.
        assert_eq!(parse(r#""abc\""#), Err(KeyError::Malformed));
    }

    #[test]
    fn quoted_must_be_closed_and_end_the_value() {
        assert_eq!(parse("\"abc"), Err(KeyError::Malformed));
        assert_eq!(parse("\""), Err(KeyError::Malformed));
        assert_eq!(parse("\"abc\"def"), Err(KeyError::Malformed));
        assert_eq!(parse("\"abc\"\""), Err(KeyError::Malformed));
        assert_eq!(parse("\"a\"b\""), Err(KeyError::Malformed));
    }

    #[test]
    fn empty() {
        assert_eq!(parse(""), Err(KeyError::Empty));
        assert_eq!(parse(" \t "), Err(KeyError::Empty));
        assert_eq!(parse("\"\""), Err(KeyError::Empty));
    }

    #[test]
    fn spaces_inside_are_malformed() {
        assert_eq!(parse("a b"), Err(KeyError::Malformed));
        assert_eq!(parse("a\tb"), Err(KeyError::Malformed));
        // Allowed by the sf-string grammar, but not in a key.
        assert_eq!(parse("\"a b\""), Err(KeyError::Malformed));
        assert_eq!(parse("\" \""), Err(KeyError::Malformed));
    }

    #[test]
    fn control_non_ascii_and_nul_are_malformed() {
        for bad in [
            &b"a\x00b"[..],
            b"\x00",
            b"a\x01",
            b"a\x7fb",
            b"a\nb",
            b"a\rb",
            b"caf\xc3\xa9",
            b"\xff",
            b"\"a\x00b\"",
            b"\"a\tb\"",
            b"\"caf\xc3\xa9\"",
            b"\"a\x7f\"",
        ] {
            assert_eq!(
                IdempotencyKey::parse(bad, DEFAULT_MAX_KEY_LEN),
                Err(KeyError::Malformed),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn default_max_length() {
        let longest = "k".repeat(DEFAULT_MAX_KEY_LEN);
        assert_eq!(key(&longest), longest);
        assert_eq!(key(&format!("\"{longest}\"")), longest);

        let too_long = "k".repeat(DEFAULT_MAX_KEY_LEN + 1);
        assert_eq!(parse(&too_long), Err(KeyError::TooLong { max: 128 }));
        assert_eq!(
            parse(&format!("\"{too_long}\"")),
            Err(KeyError::TooLong { max: 128 })
        );
    }

    #[test]
    fn length_is_counted_after_unquoting_and_unescaping() {
        // 128 escaped characters: 258 bytes on the wire, 128 in the key.
        let escaped = format!("\"{}\"", "\\\\".repeat(DEFAULT_MAX_KEY_LEN));
        assert_eq!(key(&escaped), "\\".repeat(DEFAULT_MAX_KEY_LEN));
    }

    #[test]
    fn custom_max_length() {
        assert_eq!(
            IdempotencyKey::parse(b"abcd", 4).map(|k| k.as_str().to_owned()),
            Ok("abcd".to_owned())
        );
        assert_eq!(
            IdempotencyKey::parse(b"abcde", 4),
            Err(KeyError::TooLong { max: 4 })
        );
        assert_eq!(
            IdempotencyKey::parse(b"\"abcde\"", 4),
            Err(KeyError::TooLong { max: 4 })
        );
        let long = "x".repeat(1000);
        assert!(IdempotencyKey::parse(long.as_bytes(), 1000).is_ok());
    }

    #[test]
    fn debug_does_not_leak_the_key() {
        let key = parse("super-secret-key-123456").expect("valid key");
        let debug = format!("{key:?}");
        assert!(!debug.contains("secret"), "{debug}");
        assert_eq!(debug, format!("IdempotencyKey({}, len 23)", key.redacted()));
    }

    #[test]
    fn redacted_tag() {
        // SHA-256("abc") = ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad
        assert_eq!(key_of("abc").redacted(), "k:ba7816bf8f01");
        assert_eq!(key_of("\"abc\"").redacted(), "k:ba7816bf8f01");
        assert_ne!(key_of("abd").redacted(), key_of("abc").redacted());
    }

    fn key_of(value: &str) -> IdempotencyKey {
        parse(value).expect("valid key")
    }
}
