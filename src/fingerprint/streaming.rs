//! Canonical JSON hashed as it is written, with no copy of the document.
//!
//! [`canonicalize_json`](super::canonicalize_json) builds the canonical form in a `Vec`, members
//! included, then rewrites each object in sorted order when it closes; the fingerprint only needs
//! its SHA-256, so [`hash_canonical_json`] writes the same bytes straight into the hashers. The
//! digest covers the length of the canonical form before the form itself, so the document is read
//! in two passes:
//!
//! 1. **Measure**, in document order: every check of [`canonicalize_json`](super::canonicalize_json),
//!    in the same order and with the same errors, counting the canonical length instead of
//!    writing (a length does not depend on the order of members). This pass holds nothing but
//!    its stack of open arrays and objects. Duplicate keys are not looked for here: when the
//!    measure fails, it runs again with the duplicate check on (see below), so the error is the
//!    one the `Vec` canonicalizer returns.
//! 2. **Write**, in canonical order: an object's members are found by skipping over their values,
//!    their key positions (a `u32` each, on one stack shared by all the open objects) are sorted
//!    by key, then each member is written, its value canonicalized from its place in the input,
//!    straight into the hashers (through a small buffer on the stack). Arrays are written as
//!    they come. An object with the same key twice is found when its keys are sorted: since the
//!    measure found no other fault, [`FingerprintError::DuplicateKey`] is then the error.
//!
//! The heap cost is the key stack: four bytes per member of the objects being written (an object
//! and the objects around it), whatever the size of the values. The time is linear in the input
//! times the nesting depth of *objects*: a value is skipped over once by each object around it,
//! then written once.
//!
//! Input positions are kept as `u32`: a body of 4 GiB or more goes through
//! [`canonicalize_json`](super::canonicalize_json) instead.

use std::cmp::Ordering;

use sha2::{Digest, Sha256};

use super::FingerprintError;

/// Feeds `hashers` the canonical form of the JSON document `input` as one field of a
/// fingerprint: its length (8 bytes, big-endian), then its bytes. Exactly what hashing the output
/// of [`canonicalize_json`](super::canonicalize_json) that way gives, and the same errors.
pub(super) fn hash_canonical_json(
    input: &[u8],
    max_depth: usize,
    hashers: &mut [Sha256],
) -> Result<(), FingerprintError> {
    if u32::try_from(input.len()).is_err() {
        return hash_buffered(input, max_depth, hashers);
    }
    let measured = measure(input, max_depth)?;
    for hasher in hashers.iter_mut() {
        hasher.update(measured.length.to_be_bytes());
    }
    let mut sink = HashSink {
        hashers,
        buffer: [0; HASH_BUFFER],
        filled: 0,
    };
    write_canonical(input, max_depth, measured.root_keys, &mut sink)?;
    sink.flush();
    Ok(())
}

/// What [`hash_canonical_json`] does with [`canonicalize_json`](super::canonicalize_json)'s bytes.
fn hash_buffered(
    input: &[u8],
    max_depth: usize,
    hashers: &mut [Sha256],
) -> Result<(), FingerprintError> {
    let canonical = super::canonicalize_json(input, max_depth)?;
    for hasher in hashers.iter_mut() {
        hasher.update((canonical.len() as u64).to_be_bytes());
        hasher.update(&canonical);
    }
    Ok(())
}

/// What the first pass learns of a valid document.
pub(super) struct Measured {
    /// The length of the canonical form.
    pub(super) length: u64,
    /// When the document is an object, the positions of its keys, in document order (so the
    /// second pass need not find them again).
    pub(super) root_keys: Vec<u32>,
}

/// Validates `input` exactly as [`canonicalize_json`](super::canonicalize_json) does (same checks,
/// same order, same errors) and measures its canonical form. `input` is at most `u32::MAX` bytes
/// long.
pub(super) fn measure(input: &[u8], max_depth: usize) -> Result<Measured, FingerprintError> {
    let text = std::str::from_utf8(input).map_err(|_| FingerprintError::InvalidUtf8)?;
    let mut counter = Counter(0);
    let mut walker = Walker::new(text.as_bytes(), max_depth, Order::Document);
    match walker.run(&mut counter) {
        Ok(()) => Ok(Measured {
            length: counter.0,
            root_keys: walker.keys,
        }),
        // Another fault, or a duplicate key in an object that closes before it?
        Err(error) => {
            let checked = Walker::new(text.as_bytes(), max_depth, Order::DocumentChecked)
                .run(&mut Counter(0));
            Err(checked.err().unwrap_or(error))
        }
    }
}

/// Writes the canonical form of `input` to `out`. `input` has passed [`measure`], which found
/// `root_keys`: the only error left to find is a duplicate key.
pub(super) fn write_canonical(
    input: &[u8],
    max_depth: usize,
    root_keys: Vec<u32>,
    out: &mut impl Sink,
) -> Result<(), FingerprintError> {
    let mut walker = Walker::new(input, max_depth, Order::Canonical);
    walker.keys = root_keys;
    walker.run(out)
}

/// The canonical form through the two passes, as bytes (the length [`measure`] found checked).
#[cfg(test)]
pub(super) fn canonical_bytes(input: &[u8], max_depth: usize) -> Result<Vec<u8>, FingerprintError> {
    let measured = measure(input, max_depth)?;
    let mut out = Vec::new();
    write_canonical(input, max_depth, measured.root_keys, &mut out)?;
    assert_eq!(out.len() as u64, measured.length, "the measured length");
    Ok(out)
}

/// Where canonical bytes go.
pub(super) trait Sink {
    /// Appends `bytes`.
    fn put(&mut self, bytes: &[u8]);

    /// Appends one byte.
    fn byte(&mut self, byte: u8) {
        self.put(&[byte]);
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// Counts the bytes instead of keeping them.
struct Counter(u64);

impl Sink for Counter {
    fn put(&mut self, bytes: &[u8]) {
        self.0 += bytes.len() as u64;
    }
}

const HASH_BUFFER: usize = 4096;

/// Gathers the many small writes into blocks for the hashers.
struct HashSink<'h> {
    hashers: &'h mut [Sha256],
    buffer: [u8; HASH_BUFFER],
    filled: usize,
}

impl HashSink<'_> {
    fn flush(&mut self) {
        let pending = self.buffer.get(..self.filled).unwrap_or_default();
        for hasher in self.hashers.iter_mut() {
            hasher.update(pending);
        }
        self.filled = 0;
    }
}

impl Sink for HashSink<'_> {
    fn put(&mut self, bytes: &[u8]) {
        if let Some(free) = self.buffer.get_mut(self.filled..self.filled + bytes.len()) {
            free.copy_from_slice(bytes);
            self.filled += bytes.len();
            return;
        }
        self.flush();
        match self.buffer.get_mut(..bytes.len()) {
            Some(free) => {
                free.copy_from_slice(bytes);
                self.filled = bytes.len();
            }
            None => {
                for hasher in self.hashers.iter_mut() {
                    hasher.update(bytes);
                }
            }
        }
    }

    fn byte(&mut self, byte: u8) {
        if let Some(free) = self.buffer.get_mut(self.filled) {
            *free = byte;
            self.filled += 1;
        } else {
            self.put(&[byte]);
        }
    }
}

/// The order in which the document is walked.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Order {
    /// As written, without looking for duplicate keys; the keys of the document's own object
    /// (if it is one) are kept on the key stack.
    Document,
    /// As written, each object's keys sorted when it closes to look for duplicates.
    DocumentChecked,
    /// Each object's members sorted by key.
    Canonical,
}

enum Frame {
    Array,
    /// `first` is the object's first entry on the key stack; in canonical order `current` is the
    /// entry of the member being written and `end` the input position just after the object.
    Object {
        first: usize,
        current: usize,
        end: usize,
    },
}

struct Walker<'a> {
    bytes: &'a [u8],
    pos: usize,
    order: Order,
    stack: Vec<Frame>,
    /// Input positions of the keys (their opening `"`) of the open objects, innermost last. In
    /// canonical order, the document's own object's are there from the start (see [`measure`]).
    keys: Vec<u32>,
    max_depth: usize,
}

impl<'a> Walker<'a> {
    fn new(bytes: &'a [u8], max_depth: usize, order: Order) -> Self {
        Walker {
            bytes,
            pos: 0,
            order,
            stack: Vec::new(),
            keys: Vec::new(),
            max_depth,
        }
    }

    /// The structure of `Canonicalizer::run`, with the members of objects taken in the walk's
    /// order.
    fn run(&mut self, out: &mut impl Sink) -> Result<(), FingerprintError> {
        self.skip_whitespace();
        'value: loop {
            if !self.begin_value(out)? {
                continue 'value;
            }
            loop {
                self.skip_whitespace();
                match self.stack.last_mut() {
                    None => break 'value,
                    Some(Frame::Array) => match self.peek() {
                        Some(b',') => {
                            self.pos += 1;
                            out.byte(b',');
                            self.skip_whitespace();
                            continue 'value;
                        }
                        Some(b']') => {
                            self.pos += 1;
                            out.byte(b']');
                            self.stack.pop();
                        }
                        _ => return Err(self.error("expected ',' or ']' after an array element")),
                    },
                    Some(Frame::Object {
                        first,
                        current,
                        end,
                    }) if self.order == Order::Canonical => {
                        *current += 1;
                        let (first, current, end) = (*first, *current, *end);
                        if let Some(&key) = self.keys.get(current) {
                            out.byte(b',');
                            self.pos = key as usize;
                            self.member(out)?;
                            continue 'value;
                        }
                        out.byte(b'}');
                        self.pos = end;
                        self.keys.truncate(first);
                        self.stack.pop();
                    }
                    Some(Frame::Object { first, .. }) => {
                        let first = *first;
                        match self.peek() {
                            Some(b',') => {
                                self.pos += 1;
                                out.byte(b',');
                                self.skip_whitespace();
                                self.member(out)?;
                                continue 'value;
                            }
                            Some(b'}') => {
                                self.pos += 1;
                                out.byte(b'}');
                                if self.order == Order::DocumentChecked {
                                    self.sort_keys(first)?;
                                    self.keys.truncate(first);
                                }
                                self.stack.pop();
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
        Ok(())
    }

    /// Writes a scalar, or opens a container. Returns whether a whole value was written (a scalar
    /// or an empty container), as opposed to a container waiting for its first element.
    fn begin_value(&mut self, out: &mut impl Sink) -> Result<bool, FingerprintError> {
        match self.peek() {
            Some(b'{') => {
                self.check_depth()?;
                self.pos += 1;
                self.skip_whitespace();
                if self.peek() == Some(b'}') {
                    self.pos += 1;
                    out.put(b"{}");
                    return Ok(true);
                }
                out.byte(b'{');
                let first = if self.stack.is_empty() {
                    0
                } else {
                    self.keys.len()
                };
                let end = if self.order == Order::Canonical {
                    let end = if self.stack.is_empty() {
                        // The document's own object: its keys were found by `measure`, and only
                        // whitespace follows it.
                        self.bytes.len() - trailing_whitespace(self.bytes)
                    } else {
                        self.gather_keys()?
                    };
                    self.sort_keys(first)?;
                    self.pos = self.key(first);
                    end
                } else {
                    0
                };
                self.stack.push(Frame::Object {
                    first,
                    current: first,
                    end,
                });
                self.member(out)?;
                Ok(false)
            }
            Some(b'[') => {
                self.check_depth()?;
                self.pos += 1;
                out.byte(b'[');
                self.skip_whitespace();
                if self.peek() == Some(b']') {
                    self.pos += 1;
                    out.byte(b']');
                    return Ok(true);
                }
                self.stack.push(Frame::Array);
                Ok(false)
            }
            Some(b'"') => self.string(out).map(|()| true),
            Some(b'-' | b'0'..=b'9') => self.number(out).map(|()| true),
            Some(b't') => self.literal(out, "true"),
            Some(b'f') => self.literal(out, "false"),
            Some(b'n') => self.literal(out, "null"),
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

    fn literal(
        &mut self,
        out: &mut impl Sink,
        word: &'static str,
    ) -> Result<bool, FingerprintError> {
        let found = self
            .bytes
            .get(self.pos..)
            .is_some_and(|rest| rest.starts_with(word.as_bytes()));
        if !found {
            return Err(self.error("invalid literal, expected true, false or null"));
        }
        self.pos += word.len();
        out.put(word.as_bytes());
        Ok(true)
    }

    /// Writes `"key":` from the current position, leaving it at the start of the value.
    fn member(&mut self, out: &mut impl Sink) -> Result<(), FingerprintError> {
        if self.peek() != Some(b'"') {
            return Err(self.error("expected a string as object key"));
        }
        let kept = match self.order {
            Order::Document => self.stack.len() == 1,
            Order::DocumentChecked => true,
            Order::Canonical => false,
        };
        if kept {
            // Positions fit in a u32: longer inputs never get here (`hash_canonical_json`).
            self.keys.push(self.pos as u32);
        }
        self.string(out)?;
        self.skip_whitespace();
        if self.peek() != Some(b':') {
            return Err(self.error("expected ':' after an object key"));
        }
        self.pos += 1;
        out.byte(b':');
        self.skip_whitespace();
        Ok(())
    }

    /// The input position of the key at `index` on the key stack.
    fn key(&self, index: usize) -> usize {
        self.keys
            .get(index)
            .map_or(self.bytes.len(), |&key| key as usize)
    }

    /// From the first key of an object (already validated), pushes the position of each key on
    /// the key stack, and returns the position just after the object.
    fn gather_keys(&mut self) -> Result<usize, FingerprintError> {
        loop {
            if self.peek() != Some(b'"') {
                return Err(self.error("expected a string as object key"));
            }
            // Positions fit in a u32: longer inputs never get here (`hash_canonical_json`).
            self.keys.push(self.pos as u32);
            self.skip_string()?;
            self.skip_whitespace();
            if self.peek() != Some(b':') {
                return Err(self.error("expected ':' after an object key"));
            }
            self.pos += 1;
            self.skip_whitespace();
            self.skip_value()?;
            self.skip_whitespace();
            match self.peek() {
                Some(b',') => {
                    self.pos += 1;
                    self.skip_whitespace();
                }
                Some(b'}') => return Ok(self.pos + 1),
                _ => return Err(self.error("expected ',' or '}' after an object member")),
            }
        }
    }

    /// Sorts the keys of the innermost object (from `first` on the key stack) in canonical order;
    /// two equal keys are [`FingerprintError::DuplicateKey`].
    fn sort_keys(&mut self, first: usize) -> Result<(), FingerprintError> {
        let Some(keys) = self.keys.get_mut(first..) else {
            return Ok(());
        };
        let bytes = self.bytes;
        keys.sort_unstable_by(|&a, &b| compare_keys(bytes, a as usize, b as usize));
        if keys
            .windows(2)
            .any(|pair| compare_keys(bytes, pair[0] as usize, pair[1] as usize).is_eq())
        {
            return Err(FingerprintError::DuplicateKey);
        }
        Ok(())
    }

    /// Moves past a value that was already validated.
    fn skip_value(&mut self) -> Result<(), FingerprintError> {
        match self.peek() {
            Some(b'"') => self.skip_string(),
            Some(b'{' | b'[') => {
                let mut depth = 0usize;
                loop {
                    match self.peek() {
                        Some(b'"') => self.skip_string()?,
                        Some(b'{' | b'[') => {
                            depth += 1;
                            self.pos += 1;
                        }
                        Some(b'}' | b']') => {
                            self.pos += 1;
                            depth = depth.saturating_sub(1);
                            if depth == 0 {
                                return Ok(());
                            }
                        }
                        Some(_) => self.pos += 1,
                        None => return Err(self.error("unexpected end of input in a value")),
                    }
                }
            }
            _ => {
                while !matches!(
                    self.peek(),
                    None | Some(b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
                ) {
                    self.pos += 1;
                }
                Ok(())
            }
        }
    }

    /// Moves past a string that was already validated.
    fn skip_string(&mut self) -> Result<(), FingerprintError> {
        self.pos += 1;
        loop {
            self.pos = plain_run_end(self.bytes, self.pos);
            match self.peek() {
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(());
                }
                Some(b'\\') => self.pos += 2,
                Some(_) => self.pos += 1,
                None => return Err(self.error("unterminated string")),
            }
        }
    }

    /// Writes the string starting at the current `"` the JCS way: unescaped runs as they are (no
    /// character in them needs an escape), each escape decoded then written as JCS writes it.
    fn string(&mut self, out: &mut impl Sink) -> Result<(), FingerprintError> {
        self.pos += 1;
        out.byte(b'"');
        let mut run_start = self.pos;
        loop {
            self.pos = plain_run_end(self.bytes, self.pos);
            match self.peek() {
                None => return Err(self.error("unterminated string")),
                Some(b'"') => {
                    out.put(self.bytes.get(run_start..self.pos).unwrap_or_default());
                    self.pos += 1;
                    out.byte(b'"');
                    return Ok(());
                }
                Some(b'\\') => {
                    out.put(self.bytes.get(run_start..self.pos).unwrap_or_default());
                    self.pos += 1;
                    let decoded = self.escape()?;
                    write_char(out, decoded);
                    run_start = self.pos;
                }
                Some(0x00..=0x1F) => {
                    return Err(self.error("control character in string must be escaped"))
                }
                Some(_) => self.pos += 1,
            }
        }
    }

    /// Decodes one escape sequence, the current position being just after its `\`.
    fn escape(&mut self) -> Result<char, FingerprintError> {
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
                let unit = self.hex4()?;
                let code_point = match unit {
                    0xD800..=0xDBFF => {
                        if self.bytes.get(self.pos..self.pos + 2) != Some(b"\\u") {
                            return Err(self.error_at(escape_start, "lone surrogate in string"));
                        }
                        self.pos += 2;
                        let low = self.hex4()?;
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
                return char::from_u32(code_point)
                    .ok_or_else(|| self.error_at(escape_start, "invalid unicode escape"));
            }
            _ => return Err(self.error("invalid escape sequence in string")),
        };
        self.pos += 1;
        Ok(decoded)
    }

    fn hex4(&mut self) -> Result<u32, FingerprintError> {
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

    /// Parses a number and writes its one canonical spelling (see `write_number`).
    fn number(&mut self, out: &mut impl Sink) -> Result<(), FingerprintError> {
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

        // The written exponent, or None if it does not even fit in an i128.
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
                exponent = exponent
                    .and_then(|e| e.checked_mul(10))
                    .and_then(|e| e.checked_add(i128::from(digit - b'0')));
            }
            if exponent_negative {
                exponent = exponent.map(|e| -e);
            }
        }

        let digits = Digits {
            int: self.bytes.get(int_start..int_end).unwrap_or_default(),
            frac: self.bytes.get(frac.0..frac.1).unwrap_or_default(),
        };
        let Some((first, end)) = digits.significant() else {
            // Any zero, whatever its sign, fraction or exponent, is `0`.
            out.byte(b'0');
            return Ok(());
        };
        // The first significant digit sits at integer position (int_len - 1 - first).
        let scientific = exponent
            .and_then(|e| e.checked_add(digits.int.len() as i128 - 1 - first as i128))
            .and_then(|e| i64::try_from(e).ok())
            .ok_or(FingerprintError::NumberOutOfRange)?;
        write_number(out, negative, &digits, first, end, scientific);
        Ok(())
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

    fn error(&self, reason: &'static str) -> FingerprintError {
        self.error_at(self.pos, reason)
    }

    fn error_at(&self, offset: usize, reason: &'static str) -> FingerprintError {
        FingerprintError::InvalidJson { offset, reason }
    }
}

/// The digits of a number as written: its integer part then its fraction, read as one sequence.
struct Digits<'a> {
    int: &'a [u8],
    frac: &'a [u8],
}

impl Digits<'_> {
    /// The range of the significant digits (no leading or trailing zeros), or `None` for zero.
    fn significant(&self) -> Option<(usize, usize)> {
        let nonzero = |d: &u8| *d != b'0';
        let first = self.int.iter().chain(self.frac).position(nonzero)?;
        let last = match self.frac.iter().rposition(nonzero) {
            Some(last) => self.int.len() + last,
            None => self.int.iter().rposition(nonzero)?,
        };
        Some((first, last + 1))
    }

    /// Writes the digits in `start..end` of the sequence.
    fn write(&self, out: &mut impl Sink, start: usize, end: usize) {
        let split = self.int.len();
        if start < split {
            out.put(self.int.get(start..end.min(split)).unwrap_or_default());
        }
        if end > split {
            let from = start.max(split) - split;
            out.put(self.frac.get(from..end - split).unwrap_or_default());
        }
    }
}

/// Writes `(-)d1.d2d3… × 10^scientific` (the digits `first..end` of `digits`) like ECMAScript's
/// `Number.prototype.toString`, keeping every digit: plain decimal when 1e-7 < |x| < 1e21, else
/// `d.ddde±N`.
fn write_number(
    out: &mut impl Sink,
    negative: bool,
    digits: &Digits<'_>,
    first: usize,
    end: usize,
    scientific: i64,
) {
    if negative {
        out.byte(b'-');
    }
    // Position of the decimal point, counted in digits from the first significant one.
    let point = i128::from(scientific) + 1;
    let count = (end - first) as i128;
    if point > -6 && point <= 21 {
        if point <= 0 {
            out.put(b"0.");
            zeros(out, point.unsigned_abs() as usize);
            digits.write(out, first, end);
        } else if point >= count {
            digits.write(out, first, end);
            zeros(out, (point - count) as usize);
        } else {
            let split = first + point as usize;
            digits.write(out, first, split);
            out.byte(b'.');
            digits.write(out, split, end);
        }
    } else {
        digits.write(out, first, first + 1);
        if end - first > 1 {
            out.byte(b'.');
            digits.write(out, first + 1, end);
        }
        out.byte(b'e');
        out.byte(if scientific < 0 { b'-' } else { b'+' });
        let mut buffer = [0u8; 20];
        let mut at = buffer.len();
        let mut magnitude = scientific.unsigned_abs();
        loop {
            at -= 1;
            if let Some(slot) = buffer.get_mut(at) {
                *slot = b'0' + (magnitude % 10) as u8;
            }
            magnitude /= 10;
            if magnitude == 0 || at == 0 {
                break;
            }
        }
        out.put(buffer.get(at..).unwrap_or_default());
    }
}

/// The position of the first `"`, `\\` or control character in `bytes` from `at` on (or the end):
/// where a run of string content that is written as it is ends. Eight bytes at a time.
fn plain_run_end(bytes: &[u8], mut at: usize) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    // Whether a byte of `word` is below `n` (n <= 0x80); no false negatives.
    let any_below = |word: u64, n: u8| word.wrapping_sub(ONES * u64::from(n)) & !word & HIGH != 0;
    while let Some(chunk) = bytes.get(at..at + 8) {
        let word = u64::from_le_bytes(<[u8; 8]>::try_from(chunk).unwrap_or([0; 8]));
        if any_below(word, 0x20)
            || any_below(word ^ (ONES * u64::from(b'"')), 1)
            || any_below(word ^ (ONES * u64::from(b'\\')), 1)
        {
            break;
        }
        at += 8;
    }
    while let Some(&byte) = bytes.get(at) {
        if byte == b'"' || byte == b'\\' || byte < 0x20 {
            break;
        }
        at += 1;
    }
    at
}

/// The number of whitespace bytes at the end of `bytes`.
fn trailing_whitespace(bytes: &[u8]) -> usize {
    bytes
        .iter()
        .rev()
        .take_while(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        .count()
}

/// Writes `count` zeros.
fn zeros(out: &mut impl Sink, mut count: usize) {
    const ZEROS: &[u8; 32] = b"00000000000000000000000000000000";
    while count > 0 {
        let run = count.min(ZEROS.len());
        out.put(ZEROS.get(..run).unwrap_or_default());
        count -= run;
    }
}

/// Writes one decoded character of a string the JCS way: only `"`, `\` and control characters
/// are escaped.
fn write_char(out: &mut impl Sink, decoded: char) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    match decoded {
        '"' => out.put(b"\\\""),
        '\\' => out.put(b"\\\\"),
        '\u{8}' => out.put(b"\\b"),
        '\t' => out.put(b"\\t"),
        '\n' => out.put(b"\\n"),
        '\u{c}' => out.put(b"\\f"),
        '\r' => out.put(b"\\r"),
        '\u{0}'..='\u{1f}' => {
            let byte = decoded as u8;
            out.put(b"\\u00");
            out.byte(HEX[usize::from(byte >> 4)]);
            out.byte(HEX[usize::from(byte & 0x0f)]);
        }
        _ => out.put(decoded.encode_utf8(&mut [0; 4]).as_bytes()),
    }
}

/// Orders two keys of a validated document (given by the position of their opening `"`) by their
/// decoded values as sequences of UTF-16 code units, as JCS does.
///
/// Compares the bytes as written while neither key has an escape: the UTF-8 order of two
/// characters is their UTF-16 order, except that U+E000..U+FFFF (lead bytes `EE`, `EF`) come
/// after the supplementary planes (`F0`..`F4`, surrogate pairs in UTF-16), so those two lead
/// bytes rank last. An escape hands over to the decoding comparison.
fn compare_keys(bytes: &[u8], a: usize, b: usize) -> Ordering {
    fn rank(byte: u8) -> u16 {
        match byte {
            0xEE | 0xEF => u16::from(byte) + 0x100,
            _ => u16::from(byte),
        }
    }
    let (mut i, mut j) = (a + 1, b + 1);
    loop {
        match (bytes.get(i).copied(), bytes.get(j).copied()) {
            (Some(b'\\'), _) | (_, Some(b'\\')) | (None, _) | (_, None) => {
                return Utf16Units::new(bytes, a).cmp(Utf16Units::new(bytes, b));
            }
            (Some(b'"'), Some(b'"')) => return Ordering::Equal,
            (Some(b'"'), Some(_)) => return Ordering::Less,
            (Some(_), Some(b'"')) => return Ordering::Greater,
            (Some(x), Some(y)) if x == y => {
                i += 1;
                j += 1;
            }
            (Some(x), Some(y)) => return rank(x).cmp(&rank(y)),
        }
    }
}

/// The UTF-16 code units of a validated JSON string, escapes decoded.
struct Utf16Units<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// The low surrogate of a character written without escape, still to come.
    pending: Option<u16>,
}

impl<'a> Utf16Units<'a> {
    /// The string whose opening `"` is at `start`.
    fn new(bytes: &'a [u8], start: usize) -> Self {
        Utf16Units {
            bytes,
            pos: start + 1,
            pending: None,
        }
    }

    fn hex4(&self, at: usize) -> u16 {
        let digits = self.bytes.get(at..at + 4).unwrap_or_default();
        digits.iter().fold(0, |unit, &digit| {
            let value = char::from(digit).to_digit(16).unwrap_or_default();
            unit.wrapping_mul(16).wrapping_add(value as u16)
        })
    }
}

impl Iterator for Utf16Units<'_> {
    type Item = u16;

    fn next(&mut self) -> Option<u16> {
        if let Some(unit) = self.pending.take() {
            return Some(unit);
        }
        match self.bytes.get(self.pos).copied()? {
            b'"' => None,
            b'\\' => {
                let escaped = self.bytes.get(self.pos + 1).copied()?;
                self.pos += 2;
                let unit = match escaped {
                    b'b' => 0x08,
                    b'f' => 0x0C,
                    b'n' => 0x0A,
                    b'r' => 0x0D,
                    b't' => 0x09,
                    // A `\u` escape is a UTF-16 unit already (a pair is two escapes).
                    b'u' => {
                        let unit = self.hex4(self.pos);
                        self.pos += 4;
                        unit
                    }
                    other => u16::from(other),
                };
                Some(unit)
            }
            lead => {
                let width = match lead {
                    0x00..=0x7F => 1,
                    0xC0..=0xDF => 2,
                    0xE0..=0xEF => 3,
                    _ => 4,
                };
                let encoded = self.bytes.get(self.pos..self.pos + width)?;
                self.pos += width;
                let decoded = std::str::from_utf8(encoded).ok()?.chars().next()?;
                let mut units = [0; 2];
                let units = decoded.encode_utf16(&mut units);
                self.pending = units.get(1).copied();
                units.first().copied()
            }
        }
    }
}

#[cfg(test)]
mod tests;
