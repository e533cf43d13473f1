//! The pieces the walks are made of: scanning runs of bytes eight at a time, comparing keys, and
//! writing numbers and string characters the canonical way.

use std::cmp::Ordering;

use super::Sink;

/// The digits of a number as written: its integer part then its fraction, read as one sequence.
pub(super) struct Digits<'a> {
    pub(super) int: &'a [u8],
    pub(super) frac: &'a [u8],
}

impl Digits<'_> {
    /// The range of the significant digits (no leading or trailing zeros), or `None` for zero.
    pub(super) fn significant(&self) -> Option<(usize, usize)> {
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
pub(super) fn write_number(
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
pub(super) fn plain_run_end(bytes: &[u8], mut at: usize) -> usize {
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

/// The position of the first `"`, `{`, `}`, `[` or `]` in `bytes` from `at` on (or the end): what
/// skipping over an array or object looks for. Eight bytes at a time.
pub(super) fn structural_end(bytes: &[u8], mut at: usize) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let any_zero = |word: u64| word.wrapping_sub(ONES) & !word & HIGH != 0;
    while let Some(chunk) = bytes.get(at..at + 8) {
        let word = u64::from_le_bytes(<[u8; 8]>::try_from(chunk).unwrap_or([b'"'; 8]));
        // `[` and `{`, `]` and `}` differ only in the bit 0x20.
        let folded = word | (ONES * 0x20);
        if any_zero(word ^ (ONES * u64::from(b'"')))
            || any_zero(folded ^ (ONES * u64::from(b'{')))
            || any_zero(folded ^ (ONES * u64::from(b'}')))
        {
            break;
        }
        at += 8;
    }
    while let Some(&byte) = bytes.get(at) {
        if matches!(byte, b'"' | b'{' | b'}' | b'[' | b']') {
            break;
        }
        at += 1;
    }
    at
}

/// The number of whitespace bytes at the end of `bytes`.
pub(super) fn trailing_whitespace(bytes: &[u8]) -> usize {
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
pub(super) fn write_char(out: &mut impl Sink, decoded: char) {
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
            // A nibble indexes the 16 digits.
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
pub(super) fn compare_keys(bytes: &[u8], a: usize, b: usize) -> Ordering {
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
