//! Request fingerprints: a canonical form of the payload, digested with SHA-256.
//!
//! A retry with the same key must carry the same payload; a different payload under a used key is
//! a client bug and gets a conflict. "Same" means the same *value*, not the same bytes: for JSON,
//! members are sorted, whitespace is dropped, and strings and numbers are written one way, with
//! [RFC 8785] (JCS) as the reference. So these two bodies have one fingerprint:
//!
//! ```
//! use tower_idempotency::fingerprint::{canonicalize_json, DEFAULT_MAX_JSON_DEPTH};
//!
//! let a = canonicalize_json(br#"{ "quantity":1,  "sku":"book"}"#, DEFAULT_MAX_JSON_DEPTH)?;
//! let b = canonicalize_json(br#"{"sku":"\u0062ook","quantity":1.0}"#, DEFAULT_MAX_JSON_DEPTH)?;
//! assert_eq!(a, b);
//! assert_eq!(a, br#"{"quantity":1,"sku":"book"}"#);
//! # Ok::<(), tower_idempotency::fingerprint::FingerprintError>(())
//! ```
//!
//! Only the digest is kept, never the body (payloads may hold personal data), together with the
//! version of the canonicalization that produced it.
//!
//! # The query string
//!
//! `POST /orders?dry_run=true` is not the request `POST /orders`: the built-in schemes digest the
//! query too (since [`CANONICALIZATION_VERSION`] 2). It is canonicalized the way
//! `application/x-www-form-urlencoded` is parsed (the [WHATWG URL] parser, which axum's `Query`
//! and `serde_urlencoded` follow), so that two spellings a handler cannot tell apart share a
//! fingerprint:
//!
//! - split on `&`, empty pieces dropped; each piece split on its first `=` into name and value
//!   (`a` is `a=`);
//! - in names and values `+` is a space and `%XX` is the byte `XX` (`%4a`, `%4A` and `J` agree;
//!   `a+b` is `a%20b`, and `%2B` is `+`), while a `%` not followed by two hex digits stays as it
//!   is; the decoded bytes are kept as they are, UTF-8 or not;
//! - **the pairs keep their order**: `?a=1&b=2` and `?b=2&a=1` are different requests. A handler
//!   that reads the pairs as a list, or takes the first (or last) of repeated names, tells them
//!   apart, and a client retrying sends the same URL anyway: sorting would only risk replaying a
//!   response to a request that means something else.
//!
//! No query, `?` and `?&` are all the empty query.
//!
//! Records saved under version 1 (method, path and body, whatever the query) are compared as
//! version 1 compared them: a fresh [`Fingerprint`] of a built-in scheme also carries the digest
//! version 1 gives the request, and [`Fingerprint::matches`] uses it against a version-1
//! fingerprint: a version-1 record still replays to a retry whatever its query, as it always did.
//! Such records last at most the retention after an upgrade. Without a query, a request is
//! digested exactly as version 1 digested it (so nothing is hashed twice for it).
//!
//! ```
//! use tower_idempotency::fingerprint::Fingerprinter;
//!
//! let parts = |uri: &str| http::Request::post(uri).body(()).unwrap().into_parts().0;
//! let raw = Fingerprinter::raw();
//! let order = raw.fingerprint(&parts("/orders"), b"book")?;
//! let dry_run = raw.fingerprint(&parts("/orders?dry_run=true"), b"book")?;
//! assert!(!order.matches(&dry_run));
//!
//! let spelled = raw.fingerprint(&parts("/orders?note=gift+wrap"), b"book")?;
//! let encoded = raw.fingerprint(&parts("/orders?note=gift%20wrap&"), b"book")?;
//! assert!(spelled.matches(&encoded));
//! # Ok::<(), tower_idempotency::fingerprint::FingerprintError>(())
//! ```
//!
//! A [custom](Fingerprinter::custom) scheme digests the method and path with what its function
//! returns, and not the query: its version belongs to the route, so the layer cannot change its
//! digests without breaking the records saved before. Its function gets the request head: return
//! what matters of `parts.uri.query()` with the payload.
//!
//! # Deviations from JCS
//!
//! - Numbers are kept exactly instead of being rounded to IEEE-754 doubles: JCS would give
//!   `9007199254740993` and `9007199254740992` one spelling, and two different values must never
//!   share a fingerprint. Each numeric value has one spelling, chosen like ECMAScript's
//!   `Number.prototype.toString` (plain decimal when 1e-7 < |x| < 1e21, else `d.ddde+N`), with
//!   all significant digits kept: `1.0`, `10e-1` and `1` are all `1`; `1E30` is `1e+30`; `-0` is
//!   `0`.
//! - Duplicate object keys are rejected ([`FingerprintError::DuplicateKey`]): such a payload means
//!   different things to different parsers.
//!
//! # Choosing a scheme per route
//!
//! ```
//! use tower_idempotency::fingerprint::{Fingerprinter, FingerprintError};
//!
//! // The default: canonical JSON for JSON content types, the exact bytes otherwise.
//! let auto = Fingerprinter::auto();
//!
//! // Only the business fields count: a client may change `note` on a retry.
//! let custom = Fingerprinter::custom(1, |_parts, body| {
//!     let value: serde_json::Value = serde_json::from_slice(body)
//!         .map_err(|_| FingerprintError::Custom("body is not JSON".into()))?;
//!     Ok(format!("{}|{}", value["sku"], value["quantity"]).into_bytes())
//! });
//!
//! let (parts, ()) = http::Request::post("/orders").body(()).unwrap().into_parts();
//! let first = custom.fingerprint(&parts, br#"{"sku":"book","quantity":1,"note":"a"}"#)?;
//! let retry = custom.fingerprint(&parts, br#"{"sku":"book","quantity":1,"note":"b"}"#)?;
//! assert!(first.matches(&retry));
//! # let _ = auto;
//! # Ok::<(), FingerprintError>(())
//! ```
//!
//! [RFC 8785]: https://www.rfc-editor.org/rfc/rfc8785
//! [WHATWG URL]: https://url.spec.whatwg.org/#urlencoded-parsing

use std::borrow::Cow;
use std::cmp::Ordering;
use std::fmt;
use std::sync::Arc;

use http::header::CONTENT_TYPE;
use http::HeaderMap;
use sha2::{Digest, Sha256};

/// Version of the built-in canonicalization (JSON and raw schemes).
///
/// Stored with every fingerprint; it changes whenever a change to this module would give an
/// existing payload a different digest. Version 2 added the query string (see
/// [the module docs](self#the-query-string)); version-1 records still compare as they did.
pub const CANONICALIZATION_VERSION: u16 = 2;

/// The built-in canonicalization before the query string counted: method, path and body.
const PATH_ONLY_VERSION: u16 = 1;

/// The default maximum nesting depth of JSON arrays and objects.
pub const DEFAULT_MAX_JSON_DEPTH: usize = 128;

/// Why a request could not be fingerprinted. Each is the client's fault (a 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FingerprintError {
    /// The body is not valid UTF-8.
    #[error("the request body is not valid UTF-8")]
    InvalidUtf8,
    /// The body is not one valid JSON value.
    #[error("invalid JSON at byte {offset}: {reason}")]
    InvalidJson {
        /// Byte offset in the body where the problem was found.
        offset: usize,
        /// What was wrong there.
        reason: &'static str,
    },
    /// Arrays and objects are nested deeper than allowed.
    #[error("JSON arrays and objects are nested deeper than {max} levels")]
    TooDeep {
        /// The maximum depth.
        max: usize,
    },
    /// An object has the same key twice (after unescaping).
    #[error("a JSON object has the same key twice")]
    DuplicateKey,
    /// A number's exponent is too large to be represented.
    #[error("a JSON number's exponent is out of range")]
    NumberOutOfRange,
    /// A route-supplied fingerprint function rejected the request.
    #[error("{0}")]
    Custom(String),
}

impl FingerprintError {
    /// A short, stable code for error bodies: `invalid_utf8`, `invalid_json`, `json_too_deep`,
    /// `duplicate_json_key`, `number_out_of_range` or `invalid_payload`.
    pub fn code(&self) -> &'static str {
        match self {
            FingerprintError::InvalidUtf8 => "invalid_utf8",
            FingerprintError::InvalidJson { .. } => "invalid_json",
            FingerprintError::TooDeep { .. } => "json_too_deep",
            FingerprintError::DuplicateKey => "duplicate_json_key",
            FingerprintError::NumberOutOfRange => "number_out_of_range",
            FingerprintError::Custom(_) => "invalid_payload",
        }
    }
}

/// The canonical bytes of a JSON document.
///
/// `input` must be valid UTF-8 holding exactly one JSON value ([RFC 8259], strictly: no comments,
/// trailing commas, leading zeros, `NaN` or byte order mark), with optional surrounding whitespace.
/// `max_depth` bounds the nesting of arrays and objects (`0` allows only scalars).
///
/// The parser is iterative (an explicit stack, no recursion), so hostile nesting returns
/// [`FingerprintError::TooDeep`] instead of overflowing the stack. Each object is rewritten in
/// sorted order when it closes, so the work is bounded by the input length times the nesting
/// depth of objects: keep `max_depth` modest ([`DEFAULT_MAX_JSON_DEPTH`] is).
///
/// [RFC 8259]: https://www.rfc-editor.org/rfc/rfc8259
pub fn canonicalize_json(input: &[u8], max_depth: usize) -> Result<Vec<u8>, FingerprintError> {
    let text = std::str::from_utf8(input).map_err(|_| FingerprintError::InvalidUtf8)?;
    Canonicalizer {
        text,
        bytes: input,
        pos: 0,
        out: Vec::with_capacity(input.len()),
        stack: Vec::new(),
        max_depth,
        scratch: String::new(),
        digits: Vec::new(),
    }
    .run()
}

/// An array or object being parsed.
enum Frame {
    /// Elements are written to the output as they come, so nothing to remember.
    Array,
    Object(ObjectFrame),
}

/// Members of an object are written to the output unsorted, values only, from `start` on; when
/// the object closes, that region is rewritten with the keys in canonical order.
struct ObjectFrame {
    start: usize,
    members: Vec<Member>,
}

struct Member {
    key: String,
    /// Range of the canonical value in the output.
    value_start: usize,
    value_end: usize,
}

struct Canonicalizer<'a> {
    text: &'a str,
    bytes: &'a [u8],
    pos: usize,
    out: Vec<u8>,
    stack: Vec<Frame>,
    max_depth: usize,
    /// Reused buffers, to avoid an allocation per string value and per number.
    scratch: String,
    digits: Vec<u8>,
}

/// What encloses the value that was just completed.
enum Enclosing {
    Document,
    Array,
    Object,
}

impl Canonicalizer<'_> {
    fn run(mut self) -> Result<Vec<u8>, FingerprintError> {
        self.skip_whitespace();
        'value: loop {
            if !self.begin_value()? {
                // A non-empty container was opened: parse its first element.
                continue 'value;
            }
            // A value is complete: close as many containers as the input closes here.
            loop {
                self.skip_whitespace();
                let enclosing = match self.stack.last() {
                    None => Enclosing::Document,
                    Some(Frame::Array) => Enclosing::Array,
                    Some(Frame::Object(_)) => Enclosing::Object,
                };
                match enclosing {
                    Enclosing::Document => break 'value,
                    Enclosing::Array => match self.peek() {
                        Some(b',') => {
                            self.pos += 1;
                            self.out.push(b',');
                            self.skip_whitespace();
                            continue 'value;
                        }
                        Some(b']') => {
                            self.pos += 1;
                            self.out.push(b']');
                            self.stack.pop();
                        }
                        _ => return Err(self.error("expected ',' or ']' after an array element")),
                    },
                    Enclosing::Object => {
                        let value_end = self.out.len();
                        if let Some(Frame::Object(object)) = self.stack.last_mut() {
                            if let Some(member) = object.members.last_mut() {
                                member.value_end = value_end;
                            }
                        }
                        match self.peek() {
                            Some(b',') => {
                                self.pos += 1;
                                self.skip_whitespace();
                                self.begin_member()?;
                                continue 'value;
                            }
                            Some(b'}') => {
                                self.pos += 1;
                                self.finish_object()?;
                            }
                            _ => {
                                return Err(self.error("expected ',' or '}' after an object member"))
                            }
                        }
                    }
                }
            }
        }
        if self.pos != self.bytes.len() {
            return Err(self.error("unexpected data after the JSON value"));
        }
        Ok(self.out)
    }

    /// Parses a scalar, or opens a container. Returns whether a whole value was written (a scalar
    /// or an empty container), as opposed to a container waiting for its first element.
    fn begin_value(&mut self) -> Result<bool, FingerprintError> {
        match self.peek() {
            Some(b'{') => {
                self.check_depth()?;
                self.pos += 1;
                self.skip_whitespace();
                if self.peek() == Some(b'}') {
                    self.pos += 1;
                    self.out.extend_from_slice(b"{}");
                    return Ok(true);
                }
                self.stack.push(Frame::Object(ObjectFrame {
                    start: self.out.len(),
                    members: Vec::new(),
                }));
                self.begin_member()?;
                Ok(false)
            }
            Some(b'[') => {
                self.check_depth()?;
                self.pos += 1;
                self.out.push(b'[');
                self.skip_whitespace();
                if self.peek() == Some(b']') {
                    self.pos += 1;
                    self.out.push(b']');
                    return Ok(true);
                }
                self.stack.push(Frame::Array);
                Ok(false)
            }
            Some(b'"') => {
                let mut value = std::mem::take(&mut self.scratch);
                value.clear();
                let read = self.read_string(&mut value);
                if read.is_ok() {
                    write_string(&mut self.out, &value);
                }
                self.scratch = value;
                read.map(|()| true)
            }
            Some(b'-' | b'0'..=b'9') => self.number().map(|()| true),
            Some(b't') => self.literal("true"),
            Some(b'f') => self.literal("false"),
            Some(b'n') => self.literal("null"),
            Some(_) => Err(self.error("expected a JSON value")),
            None => Err(self.error("unexpected end of input, expected a JSON value")),
        }
    }

    fn check_depth(&self) -> Result<(), FingerprintError> {
        if self.stack.len() >= self.max_depth {
            return Err(FingerprintError::TooDeep {
                max: self.max_depth,
            });
        }
        Ok(())
    }

    fn literal(&mut self, word: &'static str) -> Result<bool, FingerprintError> {
        let found = self
            .bytes
            .get(self.pos..)
            .is_some_and(|rest| rest.starts_with(word.as_bytes()));
        if !found {
            return Err(self.error("invalid literal, expected true, false or null"));
        }
        self.pos += word.len();
        self.out.extend_from_slice(word.as_bytes());
        Ok(true)
    }

    /// Parses `"key" :` and records a member whose value starts at the current output position.
    fn begin_member(&mut self) -> Result<(), FingerprintError> {
        if self.peek() != Some(b'"') {
            return Err(self.error("expected a string as object key"));
        }
        let mut key = String::new();
        self.read_string(&mut key)?;
        self.skip_whitespace();
        if self.peek() != Some(b':') {
            return Err(self.error("expected ':' after an object key"));
        }
        self.pos += 1;
        self.skip_whitespace();
        let value_start = self.out.len();
        if let Some(Frame::Object(object)) = self.stack.last_mut() {
            object.members.push(Member {
                key,
                value_start,
                value_end: value_start,
            });
        }
        Ok(())
    }

    /// Rewrites the innermost object's region of the output with its members in canonical order.
    fn finish_object(&mut self) -> Result<(), FingerprintError> {
        let Some(Frame::Object(mut object)) = self.stack.pop() else {
            return Err(self.error("'}' does not close an object"));
        };
        let values = self.out.split_off(object.start);
        object
            .members
            .sort_unstable_by(|a, b| compare_utf16(&a.key, &b.key));
        if object.members.windows(2).any(|w| w[0].key == w[1].key) {
            return Err(FingerprintError::DuplicateKey);
        }
        self.out.push(b'{');
        for (index, member) in object.members.iter().enumerate() {
            if index > 0 {
                self.out.push(b',');
            }
            write_string(&mut self.out, &member.key);
            self.out.push(b':');
            let value = values
                .get(member.value_start - object.start..member.value_end - object.start)
                .unwrap_or_default();
            self.out.extend_from_slice(value);
        }
        self.out.push(b'}');
        Ok(())
    }

    /// Decodes the string starting at the current `"` into `dst`.
    fn read_string(&mut self, dst: &mut String) -> Result<(), FingerprintError> {
        self.pos += 1;
        let mut run_start = self.pos;
        loop {
            match self.peek() {
                None => return Err(self.error("unterminated string")),
                Some(b'"') => {
                    dst.push_str(self.text_between(run_start, self.pos)?);
                    self.pos += 1;
                    return Ok(());
                }
                Some(b'\\') => {
                    dst.push_str(self.text_between(run_start, self.pos)?);
                    self.pos += 1;
                    self.read_escape(dst)?;
                    run_start = self.pos;
                }
                Some(0x00..=0x1F) => {
                    return Err(self.error("control character in string must be escaped"))
                }
                // Multi-byte UTF-8 sequences are copied as they are: the input is valid UTF-8.
                Some(_) => self.pos += 1,
            }
        }
    }

    /// Decodes one escape sequence, the current position being just after its `\`.
    fn read_escape(&mut self, dst: &mut String) -> Result<(), FingerprintError> {
        let decoded = match self.peek() {
            Some(b'"') => '"',
            Some(b'\\') => '\\',
            Some(b'/') => '/',
            Some(b'b') => '\u{8}',
            Some(b'f') => '\u{c}',
            Some(b'n') => '\n',
            Some(b'r') => '\r',
            Some(b't') => '\t',
            Some(b'u') => {
                let escape_start = self.pos - 1;
                self.pos += 1;
                let unit = self.read_hex4()?;
                let code_point = match unit {
                    0xD800..=0xDBFF => {
                        if self.bytes.get(self.pos..self.pos + 2) != Some(b"\\u") {
                            return Err(self.error_at(escape_start, "lone surrogate in string"));
                        }
                        self.pos += 2;
                        let low = self.read_hex4()?;
                        if !(0xDC00..=0xDFFF).contains(&low) {
                            return Err(self.error_at(escape_start, "lone surrogate in string"));
                        }
                        0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)
                    }
                    0xDC00..=0xDFFF => {
                        return Err(self.error_at(escape_start, "lone surrogate in string"))
                    }
                    _ => unit,
                };
                let decoded = char::from_u32(code_point)
                    .ok_or_else(|| self.error_at(escape_start, "invalid unicode escape"))?;
                dst.push(decoded);
                return Ok(());
            }
            _ => return Err(self.error("invalid escape sequence in string")),
        };
        self.pos += 1;
        dst.push(decoded);
        Ok(())
    }

    fn read_hex4(&mut self) -> Result<u32, FingerprintError> {
        let mut unit = 0;
        for _ in 0..4 {
            let digit = self
                .peek()
                .and_then(|b| char::from(b).to_digit(16))
                .ok_or_else(|| self.error("expected four hex digits after \\u"))?;
            unit = unit * 16 + digit;
            self.pos += 1;
        }
        Ok(unit)
    }

    /// Parses a number and writes its one canonical spelling.
    fn number(&mut self) -> Result<(), FingerprintError> {
        let negative = self.peek() == Some(b'-');
        if negative {
            self.pos += 1;
        }

        let int_start = self.pos;
        match self.peek() {
            Some(b'0') => {
                self.pos += 1;
                if self.peek().is_some_and(|b| b.is_ascii_digit()) {
                    return Err(self.error("leading zeros are not allowed in numbers"));
                }
            }
            Some(b'1'..=b'9') => self.skip_digits(),
            _ => return Err(self.error("expected a digit")),
        }
        let int_end = self.pos;

        let mut frac = (self.pos, self.pos);
        if self.peek() == Some(b'.') {
            self.pos += 1;
            let start = self.pos;
            self.skip_digits();
            if self.pos == start {
                return Err(self.error("expected a digit after the decimal point"));
            }
            frac = (start, self.pos);
        }

        // The written exponent, or None if it does not even fit in an i128. Leading zeros do not
        // count towards overflow.
        let mut exponent: Option<i128> = Some(0);
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.pos += 1;
            let exponent_negative = match self.peek() {
                Some(b'-') => {
                    self.pos += 1;
                    true
                }
                Some(b'+') => {
                    self.pos += 1;
                    false
                }
                _ => false,
            };
            let start = self.pos;
            self.skip_digits();
            if self.pos == start {
                return Err(self.error("expected a digit in the exponent"));
            }
            for &digit in self.bytes.get(start..self.pos).unwrap_or_default() {
                let digit = i128::from(digit - b'0');
                exponent = exponent
                    .and_then(|e| e.checked_mul(10))
                    .and_then(|e| e.checked_add(digit));
            }
            if exponent_negative {
                exponent = exponent.map(|e| -e);
            }
        }

        // Significant digits: integer and fraction digits, without leading or trailing zeros.
        let int_digits = self.bytes.get(int_start..int_end).unwrap_or_default();
        let frac_digits = self.bytes.get(frac.0..frac.1).unwrap_or_default();
        let all_digits = || int_digits.iter().chain(frac_digits).copied();
        let Some(first) = all_digits().position(|d| d != b'0') else {
            // Any zero, whatever its sign, fraction or exponent, is `0`.
            self.out.push(b'0');
            return Ok(());
        };
        let mut digits = std::mem::take(&mut self.digits);
        digits.clear();
        digits.extend(all_digits().skip(first));
        while digits.last() == Some(&b'0') {
            digits.pop();
        }

        // value = d1.d2d3… × 10^scientific; the first significant digit sits at integer position
        // (int_len - 1 - first), counting 0 for the units.
        let scientific = exponent
            .and_then(|e| e.checked_add(int_digits.len() as i128 - 1 - first as i128))
            .and_then(|e| i64::try_from(e).ok());
        let result = match scientific {
            Some(scientific) => {
                write_number(&mut self.out, negative, &digits, scientific);
                Ok(())
            }
            None => Err(FingerprintError::NumberOutOfRange),
        };
        self.digits = digits;
        result
    }

    fn skip_digits(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_digit()) {
            self.pos += 1;
        }
    }

    fn skip_whitespace(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    /// The input between two positions that are known to sit next to ASCII bytes (hence on
    /// character boundaries).
    fn text_between(&self, start: usize, end: usize) -> Result<&str, FingerprintError> {
        self.text
            .get(start..end)
            .ok_or_else(|| self.error_at(start, "invalid string"))
    }

    fn error(&self, reason: &'static str) -> FingerprintError {
        self.error_at(self.pos, reason)
    }

    fn error_at(&self, offset: usize, reason: &'static str) -> FingerprintError {
        FingerprintError::InvalidJson { offset, reason }
    }
}

/// JCS orders object members by their keys as sequences of UTF-16 code units.
fn compare_utf16(a: &str, b: &str) -> Ordering {
    a.encode_utf16().cmp(b.encode_utf16())
}

/// Writes a string the JCS way: only `"`, `\` and control characters are escaped.
fn write_string(out: &mut Vec<u8>, value: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    for &byte in value.as_bytes() {
        match byte {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0x08 => out.extend_from_slice(b"\\b"),
            b'\t' => out.extend_from_slice(b"\\t"),
            b'\n' => out.extend_from_slice(b"\\n"),
            0x0C => out.extend_from_slice(b"\\f"),
            b'\r' => out.extend_from_slice(b"\\r"),
            0x00..=0x1F => {
                out.extend_from_slice(b"\\u00");
                out.push(HEX[usize::from(byte >> 4)]);
                out.push(HEX[usize::from(byte & 0x0f)]);
            }
            // Bytes of multi-byte characters included: the string is valid UTF-8.
            _ => out.push(byte),
        }
    }
    out.push(b'"');
}

/// Writes `(-)d1.d2d3… × 10^scientific` like ECMAScript's `Number.prototype.toString`, keeping
/// every digit: plain decimal when 1e-7 < |x| < 1e21, else `d.ddde±N`. `digits` are the
/// significant digits (ASCII, no leading or trailing zeros, not empty).
fn write_number(out: &mut Vec<u8>, negative: bool, digits: &[u8], scientific: i64) {
    if negative {
        out.push(b'-');
    }
    // Position of the decimal point, counted in digits from the first significant one.
    let point = i128::from(scientific) + 1;
    let count = digits.len() as i128;
    if point > -6 && point <= 21 {
        if point <= 0 {
            out.extend_from_slice(b"0.");
            out.extend(std::iter::repeat_n(b'0', point.unsigned_abs() as usize));
            out.extend_from_slice(digits);
        } else if point >= count {
            out.extend_from_slice(digits);
            out.extend(std::iter::repeat_n(b'0', (point - count) as usize));
        } else {
            let (int_part, frac_part) = digits.split_at(point as usize);
            out.extend_from_slice(int_part);
            out.push(b'.');
            out.extend_from_slice(frac_part);
        }
    } else {
        let (first, rest) = digits.split_at(1);
        out.extend_from_slice(first);
        if !rest.is_empty() {
            out.push(b'.');
            out.extend_from_slice(rest);
        }
        out.push(b'e');
        out.push(if scientific < 0 { b'-' } else { b'+' });
        out.extend_from_slice(scientific.unsigned_abs().to_string().as_bytes());
    }
}

/// SHA-256 digest of a request's canonical form, with the canonicalization version that produced
/// it.
///
/// Compare a fresh fingerprint with a stored one with [`matches`](Fingerprint::matches) (constant
/// time), not `==`: `==` compares the version and the digest only.
#[derive(Clone, Copy)]
pub struct Fingerprint {
    version: u16,
    digest: [u8; 32],
    /// The digest version 1 gave the same request (no query), to compare with records saved
    /// before version 2. Only on fresh fingerprints of the built-in schemes; never stored.
    path_only: Option<[u8; 32]>,
}

impl PartialEq for Fingerprint {
    fn eq(&self, other: &Self) -> bool {
        self.version == other.version && self.digest == other.digest
    }
}

impl Eq for Fingerprint {}

impl std::hash::Hash for Fingerprint {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.version.hash(state);
        self.digest.hash(state);
    }
}

impl Fingerprint {
    /// A fingerprint from its parts, e.g. as read back from a store.
    pub fn new(version: u16, digest: [u8; 32]) -> Self {
        Fingerprint {
            version,
            digest,
            path_only: None,
        }
    }

    /// The version of the scheme that produced the digest: [`CANONICALIZATION_VERSION`] for the
    /// built-in schemes, the route's own number for [`Fingerprinter::custom`].
    pub fn version(&self) -> u16 {
        self.version
    }

    /// The SHA-256 digest.
    pub fn digest(&self) -> &[u8; 32] {
        &self.digest
    }

    /// Whether both fingerprints are of the same request: the same version and digest, or, when
    /// one of them is a version-1 record (saved before the query counted) and the other a fresh
    /// fingerprint of a built-in scheme, the digest version 1 gives the fresh one's request. The
    /// digests are compared in constant time.
    pub fn matches(&self, other: &Fingerprint) -> bool {
        let (mine, theirs) = if self.version == other.version {
            (&self.digest, &other.digest)
        } else if let (PATH_ONLY_VERSION, Some(path_only)) = (other.version, &self.path_only) {
            (path_only, &other.digest)
        } else if let (PATH_ONLY_VERSION, Some(path_only)) = (self.version, &other.path_only) {
            (&self.digest, path_only)
        } else {
            return false;
        };
        let difference = mine
            .iter()
            .zip(theirs.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        // Keep the optimizer from turning the fold into an early-exit comparison.
        std::hint::black_box(difference) == 0
    }

    /// The digest as 64 lowercase hex characters.
    pub fn to_hex(&self) -> String {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut hex = String::with_capacity(64);
        for byte in self.digest {
            hex.push(char::from(HEX[usize::from(byte >> 4)]));
            hex.push(char::from(HEX[usize::from(byte & 0x0f)]));
        }
        hex
    }
}

/// `Fingerprint(v1:ab12cd34…)`: the version and the first 8 hex characters of the digest.
impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hex = self.to_hex();
        write!(
            f,
            "Fingerprint(v{}:{}…)",
            self.version,
            hex.get(..8).unwrap_or_default()
        )
    }
}

type CustomFn =
    dyn Fn(&http::request::Parts, &[u8]) -> Result<Vec<u8>, FingerprintError> + Send + Sync;

#[derive(Clone)]
enum Scheme {
    Auto,
    Json,
    Raw,
    Custom { version: u16, f: Arc<CustomFn> },
}

/// How a route turns a request into a [`Fingerprint`]. Cheap to clone.
///
/// The digest covers a domain-separated encoding of the scheme, the method, the URI path, the
/// canonical query (built-in schemes; see [the module docs](self#the-query-string)) and the
/// canonical body, each field length-prefixed, so a payload sent to another route, with another
/// query or with another method never matches.
#[derive(Clone)]
pub struct Fingerprinter {
    scheme: Scheme,
    max_depth: usize,
}

/// Starts the hashed encoding, so these digests cannot be confused with digests of anything else.
const DOMAIN: &[u8] = b"tower-idempotency/request-fingerprint";

impl Fingerprinter {
    fn with_scheme(scheme: Scheme) -> Self {
        Fingerprinter {
            scheme,
            max_depth: DEFAULT_MAX_JSON_DEPTH,
        }
    }

    /// The default: canonical JSON when `Content-Type` is `application/json` or
    /// `application/*+json` (case-insensitive, parameters such as `charset` ignored), the exact
    /// body bytes otherwise.
    pub fn auto() -> Self {
        Self::with_scheme(Scheme::Auto)
    }

    /// Always canonical JSON, whatever the `Content-Type`: a body that is not JSON is an error.
    pub fn json() -> Self {
        Self::with_scheme(Scheme::Json)
    }

    /// The exact body bytes.
    pub fn raw() -> Self {
        Self::with_scheme(Scheme::Raw)
    }

    /// A route-supplied function returning the canonical bytes to digest (for example only the
    /// business fields), with the version number the route assigns to its scheme. Change the
    /// version whenever the function changes what it returns for a payload.
    ///
    /// The method and path are digested with the returned bytes; the query is not: return what
    /// matters of `parts.uri.query()` too (see [the module docs](self#the-query-string)).
    ///
    /// An error from the function rejects the request (a 400).
    pub fn custom<F>(version: u16, f: F) -> Self
    where
        F: Fn(&http::request::Parts, &[u8]) -> Result<Vec<u8>, FingerprintError>
            + Send
            + Sync
            + 'static,
    {
        Self::with_scheme(Scheme::Custom {
            version,
            f: Arc::new(f),
        })
    }

    /// Maximum JSON nesting depth (default [`DEFAULT_MAX_JSON_DEPTH`]). Has no effect on raw and
    /// custom schemes.
    ///
    /// ```
    /// use tower_idempotency::fingerprint::Fingerprinter;
    ///
    /// let fingerprinter = Fingerprinter::json().with_max_depth(16);
    /// ```
    pub fn with_max_depth(mut self, max_depth: usize) -> Self {
        self.max_depth = max_depth;
        self
    }

    /// The fingerprint of a buffered request.
    ///
    /// SHA-256 over a domain-separated encoding of: a tag for the scheme (`json`, `raw` or
    /// `custom`), the canonicalization version, the method, the URI path, the canonical query
    /// (built-in schemes, when it is not empty) and the canonical bytes, each field
    /// length-prefixed so fields cannot run into one another. A request of a built-in scheme
    /// without a query is digested exactly as version 1 digested it, version field included.
    pub fn fingerprint(
        &self,
        parts: &http::request::Parts,
        body: &[u8],
    ) -> Result<Fingerprint, FingerprintError> {
        let json = |body: &[u8]| canonicalize_json(body, self.max_depth).map(Cow::Owned);
        let (tag, canonical): (&str, Cow<'_, [u8]>) = match &self.scheme {
            Scheme::Auto if is_json_content_type(&parts.headers) => ("json", json(body)?),
            Scheme::Json => ("json", json(body)?),
            Scheme::Auto | Scheme::Raw => ("raw", Cow::Borrowed(body)),
            Scheme::Custom { version, f } => {
                let canonical = f(parts, body)?;
                let digest = digest("custom", *version, parts, None, &canonical);
                return Ok(Fingerprint::new(*version, digest));
            }
        };
        let path_only = digest(tag, PATH_ONLY_VERSION, parts, None, &canonical);
        let query = canonical_query(parts.uri.query());
        let digest = if query.is_empty() {
            path_only
        } else {
            digest(
                tag,
                CANONICALIZATION_VERSION,
                parts,
                Some(&query),
                &canonical,
            )
        };
        Ok(Fingerprint {
            version: CANONICALIZATION_VERSION,
            digest,
            path_only: Some(path_only),
        })
    }
}

/// SHA-256 over the fields of a fingerprint, in order, each prefixed with its length (8 bytes,
/// big-endian); `query` only where the version has one.
fn digest(
    tag: &str,
    version: u16,
    parts: &http::request::Parts,
    query: Option<&[u8]>,
    canonical: &[u8],
) -> [u8; 32] {
    let mut hasher = Sha256::new();
    let mut field = |bytes: &[u8]| {
        hasher.update((bytes.len() as u64).to_be_bytes());
        hasher.update(bytes);
    };
    field(DOMAIN);
    field(tag.as_bytes());
    field(&version.to_be_bytes());
    field(parts.method.as_str().as_bytes());
    field(parts.uri.path().as_bytes());
    if let Some(query) = query {
        field(query);
    }
    field(canonical);
    hasher.finalize().into()
}

/// The canonical query: its `application/x-www-form-urlencoded` pairs in order, each name and
/// value decoded and length-prefixed (8 bytes, big-endian). Empty when there are no pairs.
fn canonical_query(query: Option<&str>) -> Vec<u8> {
    let mut out = Vec::new();
    for pair in query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
    {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        for part in [name, value] {
            let decoded = form_decode(part);
            out.extend_from_slice(&(decoded.len() as u64).to_be_bytes());
            out.extend_from_slice(&decoded);
        }
    }
    out
}

/// A form-encoded name or value as bytes: `+` is a space, `%XX` the byte `XX`; a `%` without
/// two hex digits after it is kept.
fn form_decode(input: &str) -> Vec<u8> {
    let bytes = input.as_bytes();
    let hex = |at: usize| {
        bytes
            .get(at)
            .and_then(|b| char::from(*b).to_digit(16))
            .and_then(|d| u8::try_from(d).ok())
    };
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while let Some(&byte) = bytes.get(at) {
        match (byte, hex(at + 1), hex(at + 2)) {
            (b'%', Some(high), Some(low)) => {
                out.push(high << 4 | low);
                at += 3;
            }
            (b'+', _, _) => {
                out.push(b' ');
                at += 1;
            }
            (other, _, _) => {
                out.push(other);
                at += 1;
            }
        }
    }
    out
}

impl Default for Fingerprinter {
    /// [`Fingerprinter::auto`].
    fn default() -> Self {
        Self::auto()
    }
}

impl fmt::Debug for Fingerprinter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("Fingerprinter");
        match &self.scheme {
            Scheme::Auto => debug.field("scheme", &"auto"),
            Scheme::Json => debug.field("scheme", &"json"),
            Scheme::Raw => debug.field("scheme", &"raw"),
            Scheme::Custom { version, .. } => {
                debug.field("scheme", &"custom").field("version", version)
            }
        };
        debug.field("max_depth", &self.max_depth).finish()
    }
}

/// `application/json` or `application/*+json`, ignoring parameters and case.
fn is_json_content_type(headers: &HeaderMap) -> bool {
    let Some(value) = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or_default().trim();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    let subtype = subtype.to_ascii_lowercase();
    kind.eq_ignore_ascii_case("application")
        && (subtype == "json" || (subtype.ends_with("+json") && subtype.len() > "+json".len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(input: &str) -> Result<String, FingerprintError> {
        canonicalize_json(input.as_bytes(), DEFAULT_MAX_JSON_DEPTH)
            .map(|bytes| String::from_utf8(bytes).expect("canonical JSON is UTF-8"))
    }

    fn canon_ok(input: &str) -> String {
        match canon(input) {
            Ok(output) => output,
            Err(error) => panic!("{input:?} should canonicalize, got {error}"),
        }
    }

    fn assert_invalid_json(input: &str) {
        assert!(
            matches!(canon(input), Err(FingerprintError::InvalidJson { .. })),
            "{input:?} should be invalid JSON, got {:?}",
            canon(input)
        );
    }

    #[test]
    fn design_example() {
        let a = canon_ok(r#"{ "quantity":1,  "sku":"book"}"#);
        let b = canon_ok(r#"{"sku":"\u0062ook","quantity":1}"#);
        assert_eq!(a, b);
        assert_eq!(a, r#"{"quantity":1,"sku":"book"}"#);
    }

    #[test]
    fn whitespace_is_dropped() {
        assert_eq!(
            canon_ok(" \t\r\n[ 1 , { \"a\" : [ ] , \"b\" : { } } , \"x y\" ]\n"),
            r#"[1,{"a":[],"b":{}},"x y"]"#
        );
    }

    #[test]
    fn scalars_at_top_level() {
        assert_eq!(canon_ok("true"), "true");
        assert_eq!(canon_ok(" false "), "false");
        assert_eq!(canon_ok("null"), "null");
        assert_eq!(canon_ok(r#""x""#), r#""x""#);
        assert_eq!(canon_ok("-7"), "-7");
    }

    #[test]
    fn equivalent_numbers_have_one_spelling() {
        for one in [
            "1", "1.0", "1e0", "10e-1", "0.1e1", "1.000E+0", "100e-2", "1E00",
        ] {
            assert_eq!(canon_ok(one), "1", "{one}");
        }
        for hundred in ["100", "1E2", "1e+2", "100.00", "0.001e5", "10E1"] {
            assert_eq!(canon_ok(hundred), "100", "{hundred}");
        }
        for value in ["1.5", "1.50", "15e-1", "0.15E1", "150e-2"] {
            assert_eq!(canon_ok(value), "1.5", "{value}");
        }
        assert_eq!(canon_ok("-12.250"), "-12.25");
        assert_eq!(canon_ok("0.001"), "0.001");
        assert_eq!(canon_ok("1e-3"), "0.001");
        assert_eq!(canon_ok("123.456e1"), "1234.56");
        assert_eq!(canon_ok("0.0000123"), "0.0000123");
    }

    #[test]
    fn plain_and_scientific_ranges_follow_ecmascript() {
        assert_eq!(canon_ok("1e20"), "100000000000000000000");
        assert_eq!(canon_ok("123456789012345678901"), "123456789012345678901");
        assert_eq!(canon_ok("1e21"), "1e+21");
        assert_eq!(
            canon_ok("1234567890123456789012"),
            "1.234567890123456789012e+21"
        );
        assert_eq!(canon_ok("0.000001"), "0.000001");
        assert_eq!(canon_ok("0.0000012"), "0.0000012");
        assert_eq!(canon_ok("1e-7"), "1e-7");
        assert_eq!(canon_ok("-1.25e-7"), "-1.25e-7");
        assert_eq!(canon_ok("1E30"), "1e+30");
    }

    #[test]
    fn zero_has_one_spelling() {
        for zero in [
            "0",
            "-0",
            "0.0",
            "-0.000",
            "0e5",
            "0E-5",
            "-0e+0",
            "0.00e999999999999999999999",
        ] {
            assert_eq!(canon_ok(zero), "0", "{zero}");
        }
    }

    #[test]
    fn big_numbers_stay_exact_and_distinct() {
        let a = canon_ok("9007199254740993");
        let b = canon_ok("9007199254740992");
        assert_eq!(a, "9007199254740993");
        assert_ne!(a, b);
        assert_eq!(
            canon_ok("[0.1, 0.10000000000000001]"),
            "[0.1,0.10000000000000001]"
        );
        let long = format!("1{}", "0".repeat(400));
        assert_eq!(canon_ok(&long), "1e+400");
        let digits = "1234567890123456789012345678901234567890123456789";
        assert_eq!(canon_ok(&format!("0.{digits}")), format!("0.{digits}"));
    }

    #[test]
    fn huge_exponents() {
        assert_eq!(canon_ok("1e400"), "1e+400");
        assert_eq!(canon_ok("-2.5E-400"), "-2.5e-400");
        assert_eq!(canon_ok("1e400"), canon_ok("10e399"));
        assert_eq!(canon_ok("1e9223372036854775807"), "1e+9223372036854775807");
        assert_eq!(canon_ok("1e-9223372036854775808"), "1e-9223372036854775808");
        // Leading zeros in the exponent do not count.
        assert_eq!(
            canon_ok("1e0000000000000000000000000000000000000000007"),
            "10000000"
        );
        for out_of_range in [
            "1e999999999999999999999",
            "-1e-999999999999999999999",
            "1e9223372036854775808",
            "10e9223372036854775807",
            "1e-9223372036854775809",
            "[1e99999999999999999999999999999999999999999999999999999999999999]",
        ] {
            assert_eq!(
                canon(out_of_range),
                Err(FingerprintError::NumberOutOfRange),
                "{out_of_range}"
            );
        }
        // Adjusted back into range by the position of the first significant digit.
        assert_eq!(
            canon_ok("0.1e9223372036854775808"),
            "1e+9223372036854775807"
        );
    }

    #[test]
    fn strict_number_grammar() {
        for bad in [
            "01",
            "-01",
            "00",
            "1.",
            ".5",
            "-",
            "+1",
            "1e",
            "1e+",
            "1.e5",
            "0x10",
            "NaN",
            "Infinity",
            "-Infinity",
            "1.5.3",
            "- 1",
        ] {
            assert_invalid_json(bad);
        }
    }

    #[test]
    fn strings_escapes_are_decoded_and_written_jcs_style() {
        assert_eq!(canon_ok(r#""\u0062ook""#), r#""book""#);
        assert_eq!(canon_ok(r#""\/""#), r#""/""#);
        assert_eq!(canon_ok(r#""\u00e9""#), "\"é\"");
        assert_eq!(canon_ok(r#""\u00E9""#), "\"é\"");
        assert_eq!(canon_ok(r#""\ud83d\ude00""#), "\"😀\"");
        assert_eq!(canon_ok("\"😀\""), "\"😀\"");
        assert_eq!(
            canon_ok(r#""\b\f\n\r\t\"\\\u0000\u001F\u0008\u007f""#),
            "\"\\b\\f\\n\\r\\t\\\"\\\\\\u0000\\u001f\\b\u{7f}\""
        );
        assert_eq!(canon_ok(r#""\u2028\u2029""#), "\"\u{2028}\u{2029}\"");
    }

    #[test]
    fn invalid_strings() {
        for bad in [
            "\"abc",
            "\"a\u{1}b\"",
            "\"a\nb\"",
            "\"a\tb\"",
            r#""\x""#,
            r#""\u12""#,
            r#""\u12G4""#,
            r#""\'""#,
            "'single'",
        ] {
            assert_invalid_json(bad);
        }
    }

    #[test]
    fn lone_surrogates_are_rejected() {
        for bad in [
            r#""\ud83d""#,
            r#""\ud83dx""#,
            r#""\ude00""#,
            r#""\ude00\ud83d""#,
            r#""\ud83d\u0041""#,
            r#""\ud83d\ud83d""#,
            r#"{"\udfff":1}"#,
        ] {
            assert!(
                matches!(
                    canon(bad),
                    Err(FingerprintError::InvalidJson {
                        reason: "lone surrogate in string",
                        ..
                    })
                ),
                "{bad}: {:?}",
                canon(bad)
            );
        }
    }

    #[test]
    fn invalid_utf8() {
        for bad in [
            &b"\"\xff\""[..],
            b"\"caf\xc3\"",
            b"\xed\xa0\x80",
            b"[1,\xc0\x80]",
        ] {
            assert_eq!(
                canonicalize_json(bad, DEFAULT_MAX_JSON_DEPTH),
                Err(FingerprintError::InvalidUtf8)
            );
        }
    }

    #[test]
    fn strict_grammar() {
        for bad in [
            "",
            "   ",
            "[1,]",
            "{\"a\":1,}",
            "[,1]",
            "{,}",
            "[1 2]",
            "{\"a\" 1}",
            "{\"a\":}",
            "{a:1}",
            "{1:1}",
            "[1]]",
            "[1",
            "{\"a\":1",
            "1 2",
            "// c\n1",
            "/* c */ 1",
            "[1] // c",
            "tru",
            "nul",
            "True",
            "\u{feff}1",
            "[1\u{a0}]",
            "{\"a\":1]",
            "[1}",
        ] {
            assert_invalid_json(bad);
        }
    }

    #[test]
    fn error_offsets_point_at_the_problem() {
        assert_eq!(
            canon("[1,]"),
            Err(FingerprintError::InvalidJson {
                offset: 3,
                reason: "expected a JSON value"
            })
        );
        assert_eq!(
            canon("{} x"),
            Err(FingerprintError::InvalidJson {
                offset: 3,
                reason: "unexpected data after the JSON value"
            })
        );
    }

    #[test]
    fn duplicate_keys_are_rejected() {
        assert_eq!(
            canon(r#"{"a":1,"a":1}"#),
            Err(FingerprintError::DuplicateKey)
        );
        assert_eq!(
            canon(r#"{"a":1,"b":2,"a":3}"#),
            Err(FingerprintError::DuplicateKey)
        );
        assert_eq!(
            canon(r#"{"a":1,"\u0061":2}"#),
            Err(FingerprintError::DuplicateKey)
        );
        assert_eq!(
            canon(r#"[{"x":{"k":1,"k":2}}]"#),
            Err(FingerprintError::DuplicateKey)
        );
        // The same key in different objects is fine.
        assert_eq!(
            canon_ok(r#"{"a":{"a":1},"b":{"a":2}}"#),
            r#"{"a":{"a":1},"b":{"a":2}}"#
        );
    }

    #[test]
    fn keys_are_ordered_by_utf16_code_units() {
        // U+E000 is a single code unit 0xE000; U+1F600 is the pair 0xD83D 0xDE00, which sorts
        // first in UTF-16 although it is the larger code point (and the larger UTF-8 sequence).
        assert!('\u{e000}' < '\u{1f600}');
        assert_eq!(
            canon_ok(r#"{"\ue000":1,"\ud83d\ude00":2}"#),
            "{\"\u{1f600}\":2,\"\u{e000}\":1}"
        );
        assert_eq!(
            canon_ok("{\"\u{1f600}\":2,\"\u{e000}\":1}"),
            "{\"\u{1f600}\":2,\"\u{e000}\":1}"
        );
        // A prefix sorts before its extensions.
        assert_eq!(canon_ok(r#"{"ab":1,"a":2,"":3}"#), r#"{"":3,"a":2,"ab":1}"#);
    }

    #[test]
    fn nested_objects_are_sorted_at_every_level() {
        assert_eq!(
            canon_ok(r#"{"z":{"y":[{"b":1,"a":[{"d":0,"c":0}]}],"x":null},"a":{}}"#),
            r#"{"a":{},"z":{"x":null,"y":[{"a":[{"c":0,"d":0}],"b":1}]}}"#
        );
    }

    /// RFC 8785, section 3.2.3.
    #[test]
    fn rfc8785_sorting_example() {
        let input = r#"{
            "\u20ac": "Euro Sign",
            "\r": "Carriage Return",
            "\ufb33": "Hebrew Letter Dalet With Dagesh",
            "1": "One",
            "\ud83d\ude00": "Emoji: Grinning Face",
            "\u0080": "Control",
            "\u00f6": "Latin Small Letter O With Diaeresis"
        }"#;
        assert_eq!(
            canon_ok(input),
            "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\u{80}\":\"Control\",\
             \"ö\":\"Latin Small Letter O With Diaeresis\",\"€\":\"Euro Sign\",\
             \"😀\":\"Emoji: Grinning Face\",\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}"
        );
    }

    /// RFC 8785, section 3.2.2, except that `333333333.33333329` keeps all its digits instead of
    /// being rounded to the double `333333333.3333333`.
    #[test]
    fn rfc8785_serialization_example() {
        let input = r#"{
            "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
            "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
            "literals": [null, true, false]
        }"#;
        assert_eq!(
            canon_ok(input),
            r#"{"literals":[null,true,false],"numbers":[333333333.33333329,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#
        );
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_stack_overflow() {
        let depth = 100_000;
        let arrays = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        assert_eq!(
            canon(&arrays),
            Err(FingerprintError::TooDeep {
                max: DEFAULT_MAX_JSON_DEPTH
            })
        );
        let objects = format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth));
        assert_eq!(
            canon(&objects),
            Err(FingerprintError::TooDeep {
                max: DEFAULT_MAX_JSON_DEPTH
            })
        );
        // Unclosed, too.
        assert_eq!(
            canon(&"[{\"a\":".repeat(depth)),
            Err(FingerprintError::TooDeep {
                max: DEFAULT_MAX_JSON_DEPTH
            })
        );
    }

    #[test]
    fn deep_nesting_within_the_limit_is_iterative_too() {
        // With no effective limit, 100 000 levels parse and print without recursion.
        let depth = 100_000;
        let arrays = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        assert_eq!(
            canonicalize_json(arrays.as_bytes(), usize::MAX).map(|out| out.len()),
            Ok(2 * depth)
        );
        // Fewer objects: each level rewrites the levels inside it, which is slow in debug builds.
        let depth = 20_000;
        let objects = format!("{}1{}", "{\"a\" : ".repeat(depth), "}".repeat(depth));
        let expected = format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth));
        assert_eq!(
            canonicalize_json(objects.as_bytes(), usize::MAX),
            Ok(expected.into_bytes())
        );
    }

    #[test]
    fn max_depth_counts_arrays_and_objects() {
        let depth = |input: &str, max| canonicalize_json(input.as_bytes(), max);
        assert!(depth("[[1]]", 2).is_ok());
        assert_eq!(depth("[[1]]", 1), Err(FingerprintError::TooDeep { max: 1 }));
        assert!(depth(r#"{"a":[{}]}"#, 3).is_ok());
        assert_eq!(
            depth(r#"{"a":[{}]}"#, 2),
            Err(FingerprintError::TooDeep { max: 2 })
        );
        assert!(depth("1", 0).is_ok());
        assert_eq!(depth("[]", 0), Err(FingerprintError::TooDeep { max: 0 }));
    }

    #[test]
    fn error_codes() {
        assert_eq!(FingerprintError::InvalidUtf8.code(), "invalid_utf8");
        assert_eq!(canon("[").map_err(|e| e.code()), Err("invalid_json"));
        assert_eq!(FingerprintError::TooDeep { max: 1 }.code(), "json_too_deep");
        assert_eq!(FingerprintError::DuplicateKey.code(), "duplicate_json_key");
        assert_eq!(
            FingerprintError::NumberOutOfRange.code(),
            "number_out_of_range"
        );
        assert_eq!(
            FingerprintError::Custom("x".into()).code(),
            "invalid_payload"
        );
    }

    fn parts(method: &str, uri: &str, content_type: Option<&str>) -> http::request::Parts {
        let mut request = http::Request::builder().method(method).uri(uri);
        if let Some(content_type) = content_type {
            request = request.header(CONTENT_TYPE, content_type);
        }
        request.body(()).expect("valid request").into_parts().0
    }

    fn fingerprint(
        fingerprinter: &Fingerprinter,
        parts: &http::request::Parts,
        body: &str,
    ) -> Fingerprint {
        fingerprinter
            .fingerprint(parts, body.as_bytes())
            .expect("fingerprint")
    }

    #[test]
    fn auto_picks_json_by_content_type() {
        let auto = Fingerprinter::auto();
        let a = r#"{ "quantity":1,  "sku":"book"}"#;
        let b = r#"{"sku":"\u0062ook","quantity":1}"#;
        for content_type in [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON;charset=UTF-8",
            "application/merge-patch+json",
            "application/vnd.api+json ; x=y",
        ] {
            let parts = parts("POST", "/orders", Some(content_type));
            assert!(
                fingerprint(&auto, &parts, a).matches(&fingerprint(&auto, &parts, b)),
                "{content_type}"
            );
            assert!(
                auto.fingerprint(&parts, b"not json").is_err(),
                "{content_type}"
            );
        }
        for content_type in [
            None,
            Some("text/plain"),
            Some("application/jsonx"),
            Some("application/+json"),
            Some("text/json"),
            Some("application/x-www-form-urlencoded"),
        ] {
            let parts = parts("POST", "/orders", content_type);
            assert!(
                !fingerprint(&auto, &parts, a).matches(&fingerprint(&auto, &parts, b)),
                "{content_type:?}"
            );
            assert!(
                auto.fingerprint(&parts, b"not json").is_ok(),
                "{content_type:?}"
            );
        }
    }

    #[test]
    fn auto_is_json_or_raw() {
        let json_parts = parts("POST", "/orders", Some("application/json"));
        let text_parts = parts("POST", "/orders", Some("text/plain"));
        let body = r#"{"a":1}"#;
        assert_eq!(
            fingerprint(&Fingerprinter::auto(), &json_parts, body),
            fingerprint(&Fingerprinter::json(), &json_parts, body)
        );
        assert_eq!(
            fingerprint(&Fingerprinter::auto(), &text_parts, body),
            fingerprint(&Fingerprinter::raw(), &text_parts, body)
        );
        assert_eq!(
            fingerprint(&Fingerprinter::default(), &json_parts, body),
            fingerprint(&Fingerprinter::auto(), &json_parts, body)
        );
    }

    #[test]
    fn json_and_raw_ignore_content_type() {
        let text_parts = parts("POST", "/orders", Some("text/plain"));
        let json = Fingerprinter::json();
        assert!(
            fingerprint(&json, &text_parts, r#"{"a":1, "b":2}"#).matches(&fingerprint(
                &json,
                &text_parts,
                r#"{"b":2,"a":1.0}"#
            ))
        );
        assert_eq!(
            json.fingerprint(&text_parts, b"a=1").map_err(|e| e.code()),
            Err("invalid_json")
        );

        let json_parts = parts("POST", "/orders", Some("application/json"));
        let raw = Fingerprinter::raw();
        assert!(
            !fingerprint(&raw, &json_parts, r#"{"a":1}"#).matches(&fingerprint(
                &raw,
                &json_parts,
                r#"{"a": 1}"#
            ))
        );
        assert!(raw.fingerprint(&json_parts, b"\xff not json").is_ok());
    }

    #[test]
    fn fingerprint_covers_method_path_and_query() {
        let fingerprinter = Fingerprinter::json();
        let body = r#"{"sku":"book"}"#;
        let base = fingerprint(&fingerprinter, &parts("POST", "/orders", None), body);
        let other_path = fingerprint(&fingerprinter, &parts("POST", "/refunds", None), body);
        let other_method = fingerprint(&fingerprinter, &parts("PUT", "/orders", None), body);
        let with_query = fingerprint(&fingerprinter, &parts("POST", "/orders?x=1", None), body);
        let other_body = fingerprint(
            &fingerprinter,
            &parts("POST", "/orders", None),
            r#"{"sku":"pen"}"#,
        );
        assert!(!base.matches(&other_path));
        assert!(!base.matches(&other_method));
        assert!(!base.matches(&other_body));
        assert!(!base.matches(&with_query));
        assert!(!with_query.matches(&base));
        assert_eq!(base.version(), CANONICALIZATION_VERSION);
        assert_eq!(with_query.version(), CANONICALIZATION_VERSION);
        assert_eq!(CANONICALIZATION_VERSION, 2);
    }

    /// Whether two URIs get one fingerprint (raw scheme, same method and body).
    fn same_request(a: &str, b: &str) -> bool {
        let raw = Fingerprinter::raw();
        fingerprint(&raw, &parts("POST", a, None), "x").matches(&fingerprint(
            &raw,
            &parts("POST", b, None),
            "x",
        ))
    }

    #[test]
    fn query_is_compared_decoded_with_its_pairs_in_order() {
        // One request, spelled differently.
        for (a, b) in [
            ("/orders", "/orders?"),
            ("/orders", "/orders?&&"),
            ("/orders?a=1&b=2", "/orders?a=1&&b=2&"),
            ("/orders?q=a+b", "/orders?q=a%20b"),
            ("/orders?q=%41%4a", "/orders?q=AJ"),
            ("/orders?q=%4a", "/orders?q=%4A"),
            ("/orders?a", "/orders?a="),
            ("/orders?n%61me=v", "/orders?name=v"),
            // The first `=` ends the name.
            ("/orders?q=a%3Db", "/orders?q=a=b"),
            ("/orders?q=%zz&r=%4", "/orders?q=%25zz&r=%254"),
            ("/orders?q=%C3%A9", "/orders?q=%c3%a9"),
        ] {
            assert!(same_request(a, b), "{a} and {b} are one request");
        }
        // Different requests.
        for (a, b) in [
            ("/orders", "/orders?dry_run=true"),
            ("/orders?a=1&b=2", "/orders?b=2&a=1"),
            ("/orders?a=1&a=2", "/orders?a=2&a=1"),
            ("/orders?q=a%26b", "/orders?q=a&b"),
            ("/orders?q=%2B", "/orders?q=+"),
            ("/orders?a=1", "/orders?a=1&a=1"),
            ("/orders?ab=", "/orders?a=b"),
            ("/orders?a=", "/orders?=a"),
            ("/orders?q=%FF", "/orders?q=%FE"),
        ] {
            assert!(!same_request(a, b), "{a} and {b} are different requests");
        }
    }

    #[test]
    fn form_decode_keeps_bytes() {
        assert_eq!(form_decode("a+b%20c"), b"a b c");
        assert_eq!(form_decode("%"), b"%");
        assert_eq!(form_decode("%4"), b"%4");
        assert_eq!(form_decode("%g1%ff"), b"%g1\xff");
        assert_eq!(canonical_query(None), b"");
        assert_eq!(canonical_query(Some("&")), b"");
        assert_eq!(
            canonical_query(Some("a=1")),
            b"\0\0\0\0\0\0\0\x01a\0\0\0\0\0\0\0\x011"
        );
    }

    /// Version 1's digest of `POST /orders` with the JSON body `{"sku":"book","quantity":1}`,
    /// computed outside this crate from the version-1 format: SHA-256 over the length-prefixed
    /// fields domain, `json`, `[0, 1]`, `POST`, `/orders` and the canonical body.
    const VERSION_1_BOOK: &str = "b1ae1830d4a8191aea3292482d1160e5c0801b6cbfdf65f3e711357f13d85dfe";

    #[test]
    fn version_1_records_still_compare_as_they_did() {
        let book = r#"{"sku":"book","quantity":1}"#;
        let stored = Fingerprint::new(
            1,
            (0..32)
                .map(|i| u8::from_str_radix(&VERSION_1_BOOK[2 * i..2 * i + 2], 16).unwrap())
                .collect::<Vec<_>>()
                .try_into()
                .unwrap(),
        );
        let auto = Fingerprinter::auto();
        let json = Some("application/json");
        // Without a query, version 2 digests the request exactly as version 1 did.
        let plain = fingerprint(&auto, &parts("POST", "/orders", json), book);
        assert_eq!(plain.to_hex(), VERSION_1_BOOK);
        assert_eq!(plain.version(), 2);
        assert!(stored.matches(&plain) && plain.matches(&stored));
        // A version-1 record ignored the query: it still does, in both directions.
        let dry_run = fingerprint(&auto, &parts("POST", "/orders?dry_run=true", json), book);
        assert_ne!(dry_run.to_hex(), VERSION_1_BOOK);
        assert!(stored.matches(&dry_run) && dry_run.matches(&stored));
        // The rest still counts.
        for (method, uri, body) in [
            ("POST", "/orders", r#"{"sku":"pen","quantity":1}"#),
            ("PATCH", "/orders?x=1", book),
            ("POST", "/orders/1?x=1", book),
        ] {
            let other = fingerprint(&auto, &parts(method, uri, json), body);
            assert!(!stored.matches(&other) && !other.matches(&stored), "{uri}");
        }
        // A version-2 record read back from a store (no path-only digest) keeps the query.
        let stored_dry_run = Fingerprint::new(dry_run.version(), *dry_run.digest());
        assert!(stored_dry_run.matches(&dry_run));
        assert!(!stored_dry_run.matches(&plain) && !plain.matches(&stored_dry_run));
        // Only version 1 gets the path-only comparison.
        let stored_v3 = Fingerprint::new(3, *plain.digest());
        assert!(!stored_v3.matches(&plain));
        // `==` compares what is stored: the version and the digest.
        assert_eq!(Fingerprint::new(2, *plain.digest()), plain);
    }

    #[test]
    fn custom_schemes_keep_their_digests() {
        // The route owns a custom scheme's version: its digests (method, path, returned bytes)
        // are the same as before the query counted, with or without a query.
        let custom = Fingerprinter::custom(1, |_, body| Ok(body.to_vec()));
        let plain = fingerprint(&custom, &parts("POST", "/orders", None), "x");
        let with_query = fingerprint(&custom, &parts("POST", "/orders?dry_run=true", None), "x");
        assert!(plain.matches(&with_query));
        assert_eq!(plain.version(), 1);
        // A custom scheme that returns the query tells the requests apart.
        let with_query_bytes = Fingerprinter::custom(2, |parts, body| {
            let mut bytes = parts.uri.query().unwrap_or_default().as_bytes().to_vec();
            bytes.push(0);
            bytes.extend_from_slice(body);
            Ok(bytes)
        });
        let plain = fingerprint(&with_query_bytes, &parts("POST", "/orders", None), "x");
        let with_query = fingerprint(
            &with_query_bytes,
            &parts("POST", "/orders?dry_run=true", None),
            "x",
        );
        assert!(!plain.matches(&with_query));
        // A built-in version-1 record never matches a custom fingerprint of the same bytes.
        let builtin_v1 = Fingerprint::new(
            1,
            *fingerprint(&Fingerprinter::raw(), &parts("POST", "/orders", None), "x").digest(),
        );
        let custom_v1 = fingerprint(&custom, &parts("POST", "/orders", None), "x");
        assert!(!builtin_v1.matches(&custom_v1) && !custom_v1.matches(&builtin_v1));
    }

    #[test]
    fn fields_cannot_run_into_one_another() {
        let raw = Fingerprinter::raw();
        let a = fingerprint(&raw, &parts("POST", "/orders", None), "x");
        let b = fingerprint(&raw, &parts("POST", "/order", None), "sx");
        assert!(!a.matches(&b));
    }

    #[test]
    fn schemes_are_domain_separated() {
        let parts = parts("POST", "/orders", Some("application/json"));
        let body = r#"{"a":1}"#;
        let json = fingerprint(&Fingerprinter::json(), &parts, body);
        let raw = fingerprint(&Fingerprinter::raw(), &parts, body);
        let custom = fingerprint(
            &Fingerprinter::custom(CANONICALIZATION_VERSION, |_, body| Ok(body.to_vec())),
            &parts,
            body,
        );
        // Same canonical bytes, three schemes, three digests.
        assert_ne!(json.digest(), raw.digest());
        assert_ne!(json.digest(), custom.digest());
        assert_ne!(raw.digest(), custom.digest());
    }

    #[test]
    fn custom_fingerprinter() {
        let business_fields = Fingerprinter::custom(7, |parts, body| {
            let value: serde_json::Value = serde_json::from_slice(body)
                .map_err(|_| FingerprintError::Custom("not JSON".into()))?;
            let _ = parts;
            Ok(format!("{}|{}", value["sku"], value["quantity"]).into_bytes())
        });
        let parts = parts("POST", "/orders", Some("application/json"));
        let a = fingerprint(
            &business_fields,
            &parts,
            r#"{"sku":"book","quantity":1,"note":"a"}"#,
        );
        let b = fingerprint(
            &business_fields,
            &parts,
            r#"{"note":"b","sku":"book","quantity":1}"#,
        );
        let c = fingerprint(&business_fields, &parts, r#"{"sku":"book","quantity":2}"#);
        assert_eq!(a.version(), 7);
        assert!(a.matches(&b));
        assert!(!a.matches(&c));
        assert_eq!(
            business_fields.fingerprint(&parts, b"nope"),
            Err(FingerprintError::Custom("not JSON".into()))
        );
        assert!(format!("{business_fields:?}").contains("custom"));
    }

    #[test]
    fn with_max_depth_applies() {
        let parts = parts("POST", "/orders", Some("application/json"));
        let shallow = Fingerprinter::auto().with_max_depth(1);
        assert!(shallow.fingerprint(&parts, b"[1]").is_ok());
        assert_eq!(
            shallow.fingerprint(&parts, b"[[1]]"),
            Err(FingerprintError::TooDeep { max: 1 })
        );
        assert!(Fingerprinter::raw()
            .with_max_depth(1)
            .fingerprint(&parts, b"[[1]]")
            .is_ok());
    }

    #[test]
    fn matches_compares_version_and_digest() {
        let a = Fingerprint::new(1, [7; 32]);
        assert!(a.matches(&Fingerprint::new(1, [7; 32])));
        assert!(!a.matches(&Fingerprint::new(2, [7; 32])));
        assert!(!Fingerprint::new(2, [7; 32]).matches(&a));
        let mut digest = [7; 32];
        digest[31] = 8;
        assert!(!a.matches(&Fingerprint::new(1, digest)));
        digest = [7; 32];
        digest[0] = 0;
        assert!(!a.matches(&Fingerprint::new(1, digest)));
    }

    #[test]
    fn hex_and_debug() {
        let mut digest = [0u8; 32];
        digest[0] = 0xab;
        digest[1] = 0x12;
        digest[2] = 0xcd;
        digest[3] = 0x34;
        digest[31] = 0xff;
        let fingerprint = Fingerprint::new(1, digest);
        let hex = fingerprint.to_hex();
        assert_eq!(hex.len(), 64);
        assert!(hex.starts_with("ab12cd3400"));
        assert!(hex.ends_with("00ff"));
        assert_eq!(format!("{fingerprint:?}"), "Fingerprint(v1:ab12cd34…)");
        assert_eq!(
            format!("{:?}", Fingerprinter::default()),
            "Fingerprinter { scheme: \"auto\", max_depth: 128 }"
        );
    }
}
