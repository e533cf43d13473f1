//! The walks over a document: in document order to measure and validate it, in canonical order
//! to write it (see [the module docs](super)).

use super::scan::{
    compare_keys, plain_run_end, structural_end, trailing_whitespace, write_char, write_number,
    Digits,
};
use super::Sink;
use crate::fingerprint::FingerprintError;

/// The order in which the document is walked.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Order {
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

pub(super) struct Walker<'a> {
    bytes: &'a [u8],
    pos: usize,
    order: Order,
    stack: Vec<Frame>,
    /// Input positions of the keys (their opening `"`) of the open objects, innermost last. In
    /// canonical order, the document's own object's are there from the start (see [`measure`](super::measure)).
    pub(super) keys: Vec<usize>,
    max_depth: usize,
}

impl<'a> Walker<'a> {
    pub(super) fn new(bytes: &'a [u8], max_depth: usize, order: Order) -> Self {
        Walker {
            bytes,
            pos: 0,
            order,
            stack: Vec::new(),
            keys: Vec::new(),
            max_depth,
        }
    }

    /// Parses the one value of the document (and the whitespace around it), writing it to `out`
    /// with the members of objects taken in the walk's order.
    pub(super) fn run(&mut self, out: &mut impl Sink) -> Result<(), FingerprintError> {
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
                            self.pos = key;
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
            self.keys.push(self.pos);
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
        self.keys.get(index).map_or(self.bytes.len(), |&key| key)
    }

    /// From the first key of an object (already validated), pushes the position of each key on
    /// the key stack, and returns the position just after the object.
    fn gather_keys(&mut self) -> Result<usize, FingerprintError> {
        loop {
            if self.peek() != Some(b'"') {
                return Err(self.error("expected a string as object key"));
            }
            self.keys.push(self.pos);
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
        keys.sort_unstable_by(|&a, &b| compare_keys(bytes, a, b));
        let equal = |pair: &[usize]| match *pair {
            [a, b] => compare_keys(bytes, a, b).is_eq(),
            _ => false,
        };
        if keys.windows(2).any(equal) {
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
                    self.pos = structural_end(self.bytes, self.pos);
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
        // The quotes are written with the runs next to them: a string without escapes is
        // written as it is, in one piece.
        let mut run_start = self.pos;
        self.pos += 1;
        loop {
            self.pos = plain_run_end(self.bytes, self.pos);
            match self.peek() {
                None => return Err(self.error("unterminated string")),
                Some(b'"') => {
                    self.pos += 1;
                    out.put(self.bytes.get(run_start..self.pos).unwrap_or_default());
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

        if frac.0 == frac.1 && self.pos == int_end && int_end - int_start <= 21 {
            let int = self.bytes.get(int_start..int_end).unwrap_or_default();
            if int.first() != Some(&b'0') {
                // An integer of at most 21 digits, written plainly and without a leading zero,
                // is its own canonical spelling.
                let start = if negative { int_start - 1 } else { int_start };
                out.put(self.bytes.get(start..int_end).unwrap_or_default());
                return Ok(());
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
