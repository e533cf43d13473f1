//! `IdempotencyKey::parse` on arbitrary header bytes, checked against a small reference parser
//! written from the contract (a raw token or an RFC 8941 sf-string, 1 to `max_len` visible
//! ASCII characters once unquoted), plus the round trips a client relies on.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tower_idempotency::key::{IdempotencyKey, KeyError, DEFAULT_MAX_KEY_LEN};

fn visible(byte: u8) -> bool {
    (0x21..=0x7E).contains(&byte)
}

/// The contract, written as plainly as possible.
fn reference(value: &[u8], max_len: usize) -> Result<Vec<u8>, KeyError> {
    let start = value
        .iter()
        .position(|b| *b != b' ' && *b != b'\t')
        .unwrap_or(value.len());
    let end = value
        .iter()
        .rposition(|b| *b != b' ' && *b != b'\t')
        .map_or(start, |i| i + 1);
    let value = &value[start..end];
    let key = if value.is_empty() {
        return Err(KeyError::Empty);
    } else if value[0] == b'"' {
        // sf-string: `"` then chars (0x20..=0x7E but `"` and `\`) or `\"` `\\`, then `"`.
        if value.len() < 2 || value[value.len() - 1] != b'"' {
            return Err(KeyError::Malformed);
        }
        let inner = &value[1..value.len() - 1];
        let mut key = Vec::new();
        let mut i = 0;
        while i < inner.len() {
            match inner[i] {
                b'\\' => match inner.get(i + 1) {
                    Some(&c @ (b'"' | b'\\')) => {
                        key.push(c);
                        i += 2;
                    }
                    _ => return Err(KeyError::Malformed),
                },
                b'"' => return Err(KeyError::Malformed),
                c @ 0x20..=0x7E => {
                    key.push(c);
                    i += 1;
                }
                _ => return Err(KeyError::Malformed),
            }
        }
        key
    } else {
        if !value.iter().all(|b| visible(*b)) {
            return Err(KeyError::Malformed);
        }
        value.to_vec()
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if !key.iter().all(|b| visible(*b)) {
        return Err(KeyError::Malformed);
    }
    if key.len() > max_len {
        return Err(KeyError::TooLong { max: max_len });
    }
    Ok(key)
}

fn quote(key: &str) -> String {
    format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""))
}

fuzz_target!(|data: &[u8]| {
    // The first byte picks a maximum length (small ones reach the length check often).
    let (max_len, value) = match data.split_first() {
        Some((&first, rest)) if first < 64 => (usize::from(first), rest),
        _ => (DEFAULT_MAX_KEY_LEN, data),
    };
    let parsed = IdempotencyKey::parse(value, max_len);
    let expected = reference(value, max_len);
    assert_eq!(
        parsed.as_ref().map(|k| k.as_str().as_bytes().to_vec()),
        expected.as_ref().map(Clone::clone),
        "parser and reference disagree on {value:?} (max {max_len})"
    );
    let Ok(key) = parsed else {
        return;
    };
    let text = key.as_str();
    assert!(!text.is_empty() && text.len() <= max_len);
    assert!(text.bytes().all(visible));

    // The quoted spelling is the same key; so is the raw one (when it is not itself quoted).
    assert_eq!(
        IdempotencyKey::parse(quote(text).as_bytes(), max_len),
        Ok(key.clone())
    );
    if !text.starts_with('"') {
        assert_eq!(
            IdempotencyKey::parse(text.as_bytes(), max_len),
            Ok(key.clone())
        );
    }
    // Optional whitespace around the value never matters.
    let mut padded = b" \t".to_vec();
    padded.extend_from_slice(value);
    padded.extend_from_slice(b"\t ");
    assert_eq!(IdempotencyKey::parse(&padded, max_len), Ok(key.clone()));

    // Logs get a fixed-size tag, and `Debug` never shows the key.
    let tag = key.redacted();
    assert!(tag.len() == 14 && tag.starts_with("k:"));
    let debug = format!("{key:?}");
    // (Keys of 24 characters or more: a shorter one may be a substring of the tag by chance.)
    assert!(text.len() < 24 || !debug.contains(text));
});
