//! `canonicalize_json` on arbitrary bytes.
//!
//! - It never panics, and never takes more than linear-ish time (libFuzzer's timeout).
//! - It accepts what serde_json accepts (but duplicate keys, deeper nesting), and what it accepts
//!   serde_json reads as the same value (numbers compared as doubles, as serde_json reads them).
//! - Its output is a fixed point, and every other spelling of the same value (whitespace, string
//!   escapes, number spellings) canonicalizes to the same bytes.
//! - Changing any character of a string or any digit of a number changes the canonical bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use tower_idempotency::fingerprint::{canonicalize_json, FingerprintError};

/// Below serde_json's own recursion limit (128), so both parsers can read every accepted input.
const MAX_DEPTH: usize = 64;

fuzz_target!(|data: &[u8]| {
    let canonical = canonicalize_json(data, MAX_DEPTH);
    let serde = serde_json::from_slice::<Value>(data);
    let out = match (canonical, &serde) {
        (Ok(out), _) => out,
        // Refused by design where serde_json reads on: duplicate keys (it keeps the last),
        // nesting deeper than MAX_DEPTH, and exponents beyond 64 bits (`1e-99999999999999999999`
        // is 0.0 to serde_json; the canonical form keeps numbers exact, so it cannot be
        // written, and the request is a 400 `number_out_of_range`).
        (
            Err(
                FingerprintError::DuplicateKey
                | FingerprintError::TooDeep { .. }
                | FingerprintError::NumberOutOfRange,
            ),
            Ok(_),
        ) => return,
        (Err(error), Ok(_)) => panic!("serde_json reads {data:?}, the canonicalizer says {error}"),
        (Err(_), Err(_)) => return,
    };

    assert_eq!(
        canonicalize_json(&out, MAX_DEPTH).as_deref(),
        Ok(&out[..]),
        "not a fixed point: {:?}",
        String::from_utf8_lossy(&out)
    );
    // Numbers beyond a double's range are exact here and an error for serde_json.
    let out_of_range = |error: &serde_json::Error| error.to_string().contains("out of range");
    match (&serde, serde_json::from_slice::<Value>(&out)) {
        (Ok(input), Ok(output)) => assert!(
            same_value(input, &output),
            "{input} became {output} ({:?})",
            String::from_utf8_lossy(&out)
        ),
        (Err(error), _) if out_of_range(error) => {}
        (_, Err(error)) if out_of_range(&error) => {}
        (Err(error), _) => panic!("the canonicalizer accepts {data:?}, serde_json says {error}"),
        (Ok(_), Err(error)) => panic!("canonical output unreadable: {error}"),
    }

    // Another spelling of the same value, driven by the input bytes.
    let respelled = respell(&out, data);
    assert_eq!(
        canonicalize_json(&respelled, MAX_DEPTH).as_deref(),
        Ok(&out[..]),
        "{:?} is a spelling of {:?}",
        String::from_utf8_lossy(&respelled),
        String::from_utf8_lossy(&out)
    );

    // A different value: one character of a string, or one digit of a number, changed.
    if let Some(mutated) = mutate(&out, data) {
        if let Ok(other) = canonicalize_json(&mutated, MAX_DEPTH) {
            assert_ne!(
                other,
                out,
                "{:?} and {:?} are different values",
                String::from_utf8_lossy(&mutated),
                String::from_utf8_lossy(&out)
            );
        }
    }
});

fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Null, Value::Null) => true,
        (Value::Bool(x), Value::Bool(y)) => x == y,
        (Value::String(x), Value::String(y)) => x == y,
        (Value::Number(x), Value::Number(y)) => {
            let (Some(x), Some(y)) = (x.as_f64(), y.as_f64()) else {
                return false;
            };
            // serde_json's default float parsing is not always correctly rounded: allow the last
            // bits, and treat everything around the subnormals as equal.
            x == y
                || (x - y).abs() <= 1e-12 * x.abs().max(y.abs())
                || (x.abs() < 1e-300 && y.abs() < 1e-300)
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same_value(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_value(v, w)))
        }
        _ => false,
    }
}

/// Pseudo-random choices taken from the fuzz input, so that a crash reproduces.
struct Choices<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Choices<'_> {
    fn next(&mut self) -> u8 {
        if self.bytes.is_empty() {
            return 0;
        }
        let byte = self.bytes[self.at % self.bytes.len()];
        self.at += 1;
        byte.wrapping_add((self.at / self.bytes.len()) as u8)
    }
}

/// Rewrites canonical JSON as another spelling of the same value: whitespace around
/// structural characters, escapes for string characters, other spellings of numbers.
fn respell(canonical: &[u8], seed: &[u8]) -> Vec<u8> {
    const WHITESPACE: [&[u8]; 5] = [b"", b" ", b"\n", b"\t\r\n ", b"  "];
    let mut choices = Choices { bytes: seed, at: 0 };
    let text = std::str::from_utf8(canonical).expect("canonical JSON is UTF-8");
    let mut out = Vec::with_capacity(canonical.len() * 2);
    out.extend_from_slice(WHITESPACE[usize::from(choices.next()) % WHITESPACE.len()]);
    let mut chars = text.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        match c {
            '"' => {
                out.push(b'"');
                // The string, up to its closing quote: canonical strings escape only `"`, `\`
                // and control characters.
                while let Some((_, c)) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => {
                            let (_, escaped) = chars.next().expect("complete escape");
                            out.push(b'\\');
                            out.push(escaped as u8);
                            if escaped == 'u' {
                                for _ in 0..4 {
                                    out.push(chars.next().expect("four hex digits").1 as u8);
                                }
                            }
                        }
                        c => match choices.next() % 4 {
                            0 => {
                                let mut units = [0u16; 2];
                                for unit in c.encode_utf16(&mut units) {
                                    out.extend_from_slice(format!("\\u{unit:04X}").as_bytes());
                                }
                            }
                            1 if c == '/' => out.extend_from_slice(b"\\/"),
                            _ => {
                                let mut buffer = [0u8; 4];
                                out.extend_from_slice(c.encode_utf8(&mut buffer).as_bytes());
                            }
                        },
                    }
                }
                out.push(b'"');
            }
            '-' | '0'..='9' => {
                let mut end = at + c.len_utf8();
                while let Some(&(next, c)) = chars.peek() {
                    if !matches!(c, '0'..='9' | '.' | 'e' | '+' | '-') {
                        break;
                    }
                    end = next + c.len_utf8();
                    chars.next();
                }
                respell_number(&text[at..end], choices.next(), &mut out);
            }
            '{' | '}' | '[' | ']' | ':' | ',' => {
                out.push(c as u8);
                out.extend_from_slice(WHITESPACE[usize::from(choices.next()) % WHITESPACE.len()]);
            }
            c => {
                let mut buffer = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buffer).as_bytes());
            }
        }
    }
    out
}

/// Another spelling of a canonical number: `1.5` as `1.50` or `15e-1`, `2` as `2.0` or
/// `2E+0`, `1e+30` as `1.0E30`.
fn respell_number(number: &str, choice: u8, out: &mut Vec<u8>) {
    let (mantissa, exponent) = match number.split_once('e') {
        Some((m, e)) => (m, Some(e)),
        None => (number, None),
    };
    let exponent: i64 = exponent.map_or(0, |e| e.parse().expect("canonical exponent"));
    match choice % 4 {
        0 => out.extend_from_slice(number.as_bytes()),
        1 => {
            // Trailing zeros in the fraction.
            out.extend_from_slice(mantissa.as_bytes());
            if !mantissa.contains('.') {
                out.push(b'.');
            }
            out.extend_from_slice(b"000");
            out.extend_from_slice(format!("E{exponent:+}").as_bytes());
        }
        2 => {
            // No decimal point: shift it into the exponent.
            let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
            let int = int.trim_start_matches('-');
            if number.starts_with('-') {
                out.push(b'-');
            }
            let digits = format!("{int}{frac}");
            let digits = digits.trim_start_matches('0');
            let digits = if digits.is_empty() { "0" } else { digits };
            out.extend_from_slice(digits.as_bytes());
            out.extend_from_slice(format!("e{}", exponent - frac.len() as i64).as_bytes());
        }
        _ => {
            // Leading zeros in the fraction, compensated in the exponent.
            out.extend_from_slice(number.as_bytes());
            if !number.contains(['.', 'e']) {
                out.extend_from_slice(b".0e-0");
            }
        }
    }
}

/// Canonical JSON with one string character or one number digit changed, if it has one.
fn mutate(canonical: &[u8], seed: &[u8]) -> Option<Vec<u8>> {
    // Positions that can change without changing the syntax: alphanumerics inside strings (not
    // parts of escapes) and digits of numbers.
    let mut candidates = Vec::new();
    let mut in_string = false;
    let mut i = 0;
    while i < canonical.len() {
        let byte = canonical[i];
        if in_string {
            match byte {
                b'"' => in_string = false,
                b'\\' => {
                    i += if canonical.get(i + 1) == Some(&b'u') {
                        6
                    } else {
                        2
                    };
                    continue;
                }
                b if b.is_ascii_alphanumeric() => candidates.push(i),
                _ => {}
            }
        } else {
            match byte {
                b'"' => in_string = true,
                b if b.is_ascii_digit() => candidates.push(i),
                _ => {}
            }
        }
        i += 1;
    }
    if candidates.is_empty() {
        return None;
    }
    let pick = seed.iter().fold(0usize, |acc, b| {
        acc.wrapping_mul(31).wrapping_add(usize::from(*b))
    });
    let at = candidates[pick % candidates.len()];
    let mut mutated = canonical.to_vec();
    mutated[at] = match mutated[at] {
        b'9' => b'1',
        b'0'..=b'8' => mutated[at] + 1,
        b'z' | b'Z' => b'a',
        b'a'..=b'y' | b'A'..=b'Y' => mutated[at] + 1,
        _ => return None,
    };
    Some(mutated)
}
