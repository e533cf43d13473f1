//! The canonical bytes of a JSON document ([`canonicalize_json`]): a strict RFC 8259 parser that
//! writes the canonical form into a `Vec` (members sorted in UTF-16 order, whitespace dropped,
//! strings and numbers written one way; see [the module docs](super#deviations-from-jcs)).
//!
//! The fingerprints hash the same bytes without building them (`streaming`); this `Vec` version
//! is the public function and the reference the streaming one is tested against.

use std::cmp::Ordering;

use super::FingerprintError;

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
/// A [`Fingerprinter`] does not build this `Vec`: it hashes the same bytes as they are produced,
/// and fails with the same errors.
///
/// [`DEFAULT_MAX_JSON_DEPTH`]: super::DEFAULT_MAX_JSON_DEPTH
/// [`Fingerprinter`]: super::Fingerprinter
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

#[cfg(test)]
mod tests;
