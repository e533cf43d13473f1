use sha2::{Digest, Sha256};

use super::scan::{compare_keys, plain_run_end, structural_end};
use super::*;
use crate::fingerprint::DEFAULT_MAX_JSON_DEPTH;

/// The canonical bytes (their measured length checked by `canonical_bytes` itself).
fn streamed(input: &str) -> Result<String, FingerprintError> {
    canonical_bytes(input.as_bytes(), DEFAULT_MAX_JSON_DEPTH)
        .map(|bytes| String::from_utf8(bytes).expect("canonical JSON is UTF-8"))
}

/// SHA-256 of the length-prefixed canonical bytes, into `count` hashers, as hashed through the
/// hash buffer and as hashed from the canonical bytes.
fn digests(input: &[u8], count: usize) -> (Vec<[u8; 32]>, Vec<[u8; 32]>) {
    let mut streaming = vec![Sha256::new(); count];
    hash_canonical_json(input, DEFAULT_MAX_JSON_DEPTH, &mut streaming).expect("valid JSON");
    let canonical = canonical_bytes(input, DEFAULT_MAX_JSON_DEPTH).expect("valid JSON");
    let mut reference = Sha256::new();
    reference.update((canonical.len() as u64).to_be_bytes());
    reference.update(&canonical);
    let reference: [u8; 32] = reference.finalize().into();
    let streaming = streaming.into_iter().map(|h| h.finalize().into()).collect();
    (streaming, vec![reference; count])
}

#[test]
fn hashes_what_the_reference_hashes_into_each_hasher() {
    let mut large = String::from("[");
    for index in 0..2000 {
        large.push_str(&format!(
            r#"{{"z":"{}","a":[{index},{{"y":1.50,"x":"\u00e9\n"}}],"m":null}},"#,
            "x".repeat(index % 50)
        ));
    }
    large.push_str(r#""end"]"#);
    for input in [
        "1",
        r#"{"b":1,"a":2}"#,
        r#"  {"b" : [1, {"d":4,"c":3}] , "a" : "s\"t"}  "#,
        large.as_str(),
    ] {
        for count in [1, 2] {
            let (streaming, reference) = digests(input.as_bytes(), count);
            assert_eq!(streaming, reference, "{count} hasher(s)");
        }
    }
}

#[test]
fn sorts_objects_at_every_level_wherever_they_are() {
    assert_eq!(
        streamed(r#"{"z":{"y":[{"b":1,"a":[{"d":0,"c":0}]}],"x":null},"a":{}}"#),
        Ok(r#"{"a":{},"z":{"x":null,"y":[{"a":[{"c":0,"d":0}],"b":1}]}}"#.into())
    );
    assert_eq!(
        streamed(" [ { \"b\" : { } , \"a\" : [ ] } , { } , [ { \"d\" : 1 , \"c\" : 2 } ] ] "),
        Ok(r#"[{"a":[],"b":{}},{},[{"c":2,"d":1}]]"#.into())
    );
    // Values that look like structure inside strings are skipped over as strings.
    assert_eq!(
        streamed(r#"{"b":"}],{\"x\":[","a":{"k":"\\","j":"\""}}"#),
        Ok(r#"{"a":{"j":"\"","k":"\\"},"b":"}],{\"x\":["}"#.into())
    );
}

#[test]
fn keys_compare_as_utf16_escaped_or_not() {
    // In UTF-16 order: "" < "a" < "ab" < "b" < "é" < U+D7FF < U+10000 (a surrogate pair) <
    // U+E000 < U+FFFF.
    let keys = [
        "",
        "a",
        "ab",
        "b",
        "é",
        "\u{d7ff}",
        "\u{10000}",
        "😀",
        "\u{e000}",
        "\u{ffff}",
    ];
    let spellings = |key: &str| {
        let escaped: String = key
            .encode_utf16()
            .map(|unit| format!("\\u{unit:04x}"))
            .collect();
        [format!("\"{key}\""), format!("\"{escaped}\"")]
    };
    for (i, a) in keys.iter().enumerate() {
        for (j, b) in keys.iter().enumerate() {
            for a_spelled in spellings(a) {
                for b_spelled in spellings(b) {
                    let text = format!("{a_spelled} {b_spelled}");
                    let order = compare_keys(text.as_bytes(), 0, a_spelled.len() + 1);
                    assert_eq!(order, i.cmp(&j), "{text}");
                }
            }
        }
    }
    assert_eq!(
        streamed(r#"{"\ufffF":1,"\ud83d\ude00":2,"\u00e9":3,"é1":4,"a":5}"#),
        Ok("{\"a\":5,\"é\":3,\"é1\":4,\"😀\":2,\"\u{ffff}\":1}".into())
    );
}

#[test]
fn duplicate_keys_are_found_in_any_object_and_spelling() {
    for input in [
        r#"{"a":1,"\u0061":2}"#,
        r#"{"b":{"x":1,"y":2},"a":[{"k":1,"\u006b":2}]}"#,
        r#"[1,{"c":{"d":{"e":1,"e":1}}}]"#,
        r#"{"é":1,"\u00e9":2}"#,
        r#"{"😀":1,"\ud83d\ude00":2}"#,
    ] {
        assert_eq!(
            streamed(input),
            Err(FingerprintError::DuplicateKey),
            "{input}"
        );
    }
    // The first fault in document order wins.
    let later_syntax_error = r#"{"a":1,"a":2} x"#;
    assert_eq!(
        streamed(later_syntax_error),
        Err(FingerprintError::DuplicateKey)
    );
    let earlier_syntax_error = r#"[{"a":1,"a":2 x}]"#;
    assert!(matches!(
        streamed(earlier_syntax_error),
        Err(FingerprintError::InvalidJson { offset: 14, .. })
    ));
    let open_object = r#"{"a":1,"a":2"#;
    assert!(matches!(
        streamed(open_object),
        Err(FingerprintError::InvalidJson { .. })
    ));
    let deeper_later = r#"[{"a":1,"a":2},[[[1]]]]"#;
    assert_eq!(
        canonical_bytes(deeper_later.as_bytes(), 3),
        Err(FingerprintError::DuplicateKey)
    );
}

#[test]
fn numbers_are_spelled_like_the_reference() {
    for input in [
        "0",
        "-0",
        "0.000",
        "0e99999999999999999999999999999999999999999",
        "1",
        "-1",
        "10",
        "1.5",
        "0.1",
        "0.0000001",
        "0.000001",
        "1e-7",
        "123e-9",
        "1e21",
        "1e20",
        "123456789012345678901234567890",
        "1.000e+3",
        "12.3400e5",
        "-98.76e-30",
        "100000000000000000000",
        "1000000000000000000000",
        "0.00001230",
        "5E-324",
        "1e9223372036854775807",
        "1e-9223372036854775808",
        "1e9223372036854775808",
        "10e9223372036854775806",
        "0.1e-9223372036854775807",
    ] {
        let _ = streamed(input);
        let _ = streamed(&format!("[{input}, {{\"n\":{input}}}]"));
    }
    assert_eq!(
        streamed("1e9223372036854775808"),
        Err(FingerprintError::NumberOutOfRange)
    );
    assert_eq!(streamed("12.50e1"), Ok("125".into()));
}

#[test]
fn strings_are_written_like_the_reference() {
    let mut long = String::from("\"");
    for index in 0..300 {
        long.extend("abcdefé€😀".chars().take(index % 9 + 1));
        long.push_str(["", "\\n", "\\\"", "\\u0000", "\\/", "\\ud83d\\ude00"][index % 6]);
    }
    long.push('"');
    for input in [
        r#""""#,
        r#""\b\f\n\r\t\"\\\u0000\u001F\u0008\u007f\/""#,
        r#""\u2028\u00e9""#,
        r#""12345678\"12345678""#,
        long.as_str(),
        "\"a\u{1}\"",
        "\"unterminated",
        "\"12345678901234567890",
        r#""\x""#,
        r#""\ud83d""#,
        r#""\ud83d\u0041""#,
    ] {
        let _ = streamed(input);
    }
}

#[test]
fn plain_runs_end_at_quotes_backslashes_and_control_characters() {
    for special in [b'"', b'\\', 0x00, 0x1f, b'\n'] {
        for at in 0..20 {
            let mut bytes = vec![b'x'; 24];
            bytes[at] = special;
            assert_eq!(plain_run_end(&bytes, 0), at);
            assert_eq!(plain_run_end(&bytes, at), at);
        }
    }
    let text = "é€😀\u{7f} ~".repeat(5);
    assert_eq!(plain_run_end(text.as_bytes(), 0), text.len());
    assert_eq!(plain_run_end(b"", 0), 0);
}

#[test]
fn deep_nesting_is_iterative_and_bounded() {
    let depth = 100_000;
    let arrays = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
    assert_eq!(
        canonical_bytes(arrays.as_bytes(), usize::MAX).map(|out| out.len()),
        Ok(2 * depth)
    );
    assert_eq!(
        canonical_bytes(arrays.as_bytes(), DEFAULT_MAX_JSON_DEPTH),
        Err(FingerprintError::TooDeep {
            max: DEFAULT_MAX_JSON_DEPTH
        })
    );
    // Each object is skipped over by the objects around it: fewer levels in a debug build.
    let depth = 2_000;
    let objects = format!(
        "{}1{}",
        "{\"b\":0, \"a\" : ".repeat(depth),
        "}".repeat(depth)
    );
    let expected = format!("{}1{}", "{\"a\":".repeat(depth), ",\"b\":0}".repeat(depth));
    assert_eq!(
        canonical_bytes(objects.as_bytes(), usize::MAX),
        Ok(expected.into_bytes())
    );
}

#[test]
fn structural_runs_end_at_quotes_and_brackets() {
    for special in [b'"', b'{', b'}', b'[', b']'] {
        for at in 0..20 {
            let mut bytes = b"1, -2.5e+3 ,null,true:\\ \xc3\xa9 ;".to_vec();
            bytes[at] = special;
            assert_eq!(structural_end(&bytes, 0), at);
        }
    }
    // Bytes one bit away from `[`, `{`, `]` and `}`.
    let near = b"\x5a\x5c\x7a\x7c\x5e\x7e\x3b\x3d\x1b\x1d\xdb\xfb\xdd\xfd\x22\x02";
    assert_eq!(structural_end(near, 0), near.len() - 2);
    assert_eq!(structural_end(b"", 0), 0);
}
