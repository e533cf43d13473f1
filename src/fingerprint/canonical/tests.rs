use super::*;
use crate::fingerprint::{FingerprintError, DEFAULT_MAX_JSON_DEPTH};

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
