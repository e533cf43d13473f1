//! Property tests of the JSON canonicalization and of the Idempotency-Key parser.
//!
//! JSON values are generated as a small model (numbers as exact decimal digits, so big integers
//! and long decimals are represented exactly, which `serde_json::Value` cannot do), then written
//! out in randomly varied but equivalent spellings: whitespace, member order, `\u` escapes, and
//! numbers such as `1.50`, `15e-1` and `0.15E1`.

use support::json_bodies;
use support::splitmix;

use proptest::collection::vec;
use proptest::prelude::*;
use tower_idempotency::fingerprint::{canonicalize_json, FingerprintError, DEFAULT_MAX_JSON_DEPTH};
use tower_idempotency::key::{IdempotencyKey, KeyError, DEFAULT_MAX_KEY_LEN};

/// A JSON value, with numbers kept exactly.
#[derive(Clone, Debug)]
enum Json {
    Null,
    Bool(bool),
    /// `±digits × 10^exponent`; `digits` has no leading or trailing zeros and is empty for zero.
    Number {
        negative: bool,
        digits: String,
        exponent: i64,
    },
    String(String),
    Array(Vec<Json>),
    /// Keys are distinct.
    Object(Vec<(String, Json)>),
}

impl Json {
    fn number(negative: bool, digits: &str, exponent: i64) -> Json {
        let significant = digits.trim_start_matches('0');
        let trimmed = significant.trim_end_matches('0');
        let exponent = exponent + (significant.len() - trimmed.len()) as i64;
        Json::Number {
            negative: negative && !trimmed.is_empty(),
            digits: trimmed.to_owned(),
            exponent: if trimmed.is_empty() { 0 } else { exponent },
        }
    }
}

fn arb_char() -> impl Strategy<Value = char> {
    prop_oneof![
        6 => prop::char::range(' ', '~'),
        1 => prop::char::range('\u{0}', '\u{1f}'),
        2 => prop::sample::select(vec![
            '"', '\\', '/', '\u{7f}', 'é', 'ö', '€', '\u{80}', '\u{2028}', '\u{e000}',
            '\u{fb33}', '\u{ffff}', '😀', '\u{10000}', '\u{10ffff}',
        ]),
        1 => any::<char>(),
    ]
}

fn arb_string() -> impl Strategy<Value = String> {
    vec(arb_char(), 0..8).prop_map(|chars| chars.into_iter().collect())
}

fn arb_number() -> impl Strategy<Value = Json> {
    prop_oneof![
        1 => Just(Json::number(false, "0", 0)),
        // Small integers, the common case.
        3 => (any::<bool>(), 1u32..1000).prop_map(|(n, v)| Json::number(n, &v.to_string(), 0)),
        // Big integers, beyond what a double holds exactly.
        2 => (any::<bool>(), "[1-9][0-9]{15,40}").prop_map(|(n, d)| Json::number(n, &d, 0)),
        // Decimals, tiny to huge.
        4 => (any::<bool>(), "[1-9][0-9]{0,30}", -40i64..=10)
            .prop_map(|(n, d, e)| Json::number(n, &d, e)),
    ]
}

fn distinct_keys(members: Vec<(String, Json)>) -> Vec<(String, Json)> {
    let mut seen = std::collections::HashSet::new();
    members
        .into_iter()
        .filter(|(key, _)| seen.insert(key.clone()))
        .collect()
}

fn arb_json() -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::Bool),
        arb_number(),
        arb_string().prop_map(Json::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..6).prop_map(Json::Array),
            vec((arb_string(), inner), 0..6).prop_map(|m| Json::Object(distinct_keys(m))),
        ]
    })
}

/// Deterministic choices for one spelling (splitmix64).
struct Choices(u64);

impl Choices {
    fn next(&mut self) -> u64 {
        splitmix::next_u64(&mut self.0)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }

    fn pick<'a>(&mut self, options: &[&'a str]) -> &'a str {
        options[self.below(options.len())]
    }
}

/// Writes `value` in a randomly chosen spelling.
fn render(value: &Json, choices: &mut Choices) -> String {
    let mut out = String::new();
    whitespace(&mut out, choices);
    write_json(value, choices, &mut out);
    whitespace(&mut out, choices);
    out
}

fn whitespace(out: &mut String, choices: &mut Choices) {
    if choices.one_in(2) {
        out.push_str(choices.pick(&[" ", "\n", "\t", "\r\n  ", "  "]));
    }
}

/// How [`write_json`] spells a document out: the white space between tokens, the order of an
/// object's members, and how numbers and strings are written.
trait Spelling {
    fn space(&mut self, out: &mut String);
    /// The indices of `members` in the order they are written.
    fn member_order(&mut self, members: &[(String, Json)]) -> Vec<usize>;
    fn number(&mut self, negative: bool, digits: &str, exponent: i64, out: &mut String);
    fn string(&mut self, s: &str, out: &mut String);
}

/// A random but equivalent spelling.
impl Spelling for Choices {
    fn space(&mut self, out: &mut String) {
        whitespace(out, self);
    }

    fn member_order(&mut self, members: &[(String, Json)]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..members.len()).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, self.below(i + 1));
        }
        order
    }

    fn number(&mut self, negative: bool, digits: &str, exponent: i64, out: &mut String) {
        render_number(negative, digits, exponent, self, out);
    }

    fn string(&mut self, s: &str, out: &mut String) {
        render_string(s, self, out);
    }
}

/// Writes `value` token by token, spelled as `spelling` says.
fn write_json(value: &Json, spelling: &mut impl Spelling, out: &mut String) {
    match value {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Number {
            negative,
            digits,
            exponent,
        } => spelling.number(*negative, digits, *exponent, out),
        Json::String(s) => spelling.string(s, out),
        Json::Array(items) => {
            out.push('[');
            spelling.space(out);
            for (index, item) in items.iter().enumerate() {
                if index > 0 {
                    out.push(',');
                    spelling.space(out);
                }
                write_json(item, spelling, out);
                spelling.space(out);
            }
            out.push(']');
        }
        Json::Object(members) => {
            let order = spelling.member_order(members);
            out.push('{');
            spelling.space(out);
            for (position, &index) in order.iter().enumerate() {
                if position > 0 {
                    out.push(',');
                    spelling.space(out);
                }
                let (key, value) = &members[index];
                spelling.string(key, out);
                spelling.space(out);
                out.push(':');
                spelling.space(out);
                write_json(value, spelling, out);
                spelling.space(out);
            }
            out.push('}');
        }
    }
}

fn render_string(s: &str, choices: &mut Choices, out: &mut String) {
    fn unicode_escape(unit: u16, choices: &mut Choices, out: &mut String) {
        let hex = format!("{unit:04x}");
        out.push_str("\\u");
        out.push_str(&if choices.one_in(2) {
            hex
        } else {
            hex.to_uppercase()
        });
    }
    out.push('"');
    for c in s.chars() {
        let short = match c {
            '"' => Some("\\\""),
            '\\' => Some("\\\\"),
            '/' => Some("\\/"),
            '\u{8}' => Some("\\b"),
            '\u{c}' => Some("\\f"),
            '\n' => Some("\\n"),
            '\r' => Some("\\r"),
            '\t' => Some("\\t"),
            _ => None,
        };
        let must_escape = matches!(c, '"' | '\\' | '\u{0}'..='\u{1f}');
        if !must_escape && choices.one_in(2) {
            out.push(c);
        } else if short.is_some() && choices.one_in(2) {
            out.push_str(short.unwrap_or_default());
        } else {
            let mut units = [0u16; 2];
            for &unit in c.encode_utf16(&mut units).iter() {
                unicode_escape(unit, choices, out);
            }
        }
    }
    out.push('"');
}

/// Writes `±digits × 10^exponent` as `mantissa × 10^written_exponent` with a random split.
fn render_number(
    negative: bool,
    digits: &str,
    exponent: i64,
    choices: &mut Choices,
    out: &mut String,
) {
    if digits.is_empty() {
        out.push_str(choices.pick(&["0", "-0", "0.0", "-0.000", "0e5", "0E-3", "-0.0e+0"]));
        return;
    }
    if negative {
        out.push('-');
    }
    // mantissa = digits × 10^-shift
    let shift = choices.below(digits.len() + 6) as i64 - 3;
    let written_exponent = exponent + shift;
    let mut mantissa = String::new();
    if shift <= 0 {
        mantissa.push_str(digits);
        mantissa.extend(std::iter::repeat_n('0', (-shift) as usize));
        if choices.one_in(4) {
            mantissa.push_str(choices.pick(&[".0", ".00"]));
        }
    } else {
        let shift = shift as usize;
        if shift >= digits.len() {
            mantissa.push_str("0.");
            mantissa.extend(std::iter::repeat_n('0', shift - digits.len()));
            mantissa.push_str(digits);
        } else {
            let (int_part, frac_part) = digits.split_at(digits.len() - shift);
            mantissa.push_str(int_part);
            mantissa.push('.');
            mantissa.push_str(frac_part);
        }
        if choices.one_in(4) {
            mantissa.push_str(choices.pick(&["0", "00"]));
        }
    }
    out.push_str(&mantissa);
    if written_exponent != 0 || choices.one_in(3) {
        out.push_str(choices.pick(&["e", "E"]));
        if written_exponent < 0 {
            out.push('-');
        } else if choices.one_in(2) {
            out.push('+');
        }
        if choices.one_in(4) {
            out.push_str(choices.pick(&["0", "00"]));
        }
        out.push_str(&written_exponent.unsigned_abs().to_string());
    }
}

/// The canonical spelling, written independently of the library: no white space, members
/// sorted by their UTF-16 code units, ECMAScript's numbers and the shortest string escapes.
struct Canonical;

impl Spelling for Canonical {
    fn space(&mut self, _out: &mut String) {}

    fn member_order(&mut self, members: &[(String, Json)]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..members.len()).collect();
        order.sort_by_key(|&index| members[index].0.encode_utf16().collect::<Vec<u16>>());
        order
    }

    fn number(&mut self, negative: bool, digits: &str, exponent: i64, out: &mut String) {
        if digits.is_empty() {
            out.push('0');
            return;
        }
        if negative {
            out.push('-');
        }
        // ECMAScript's Number::toString: value = digits × 10^(point - k).
        let k = digits.len() as i64;
        let point = exponent + k;
        if k <= point && point <= 21 {
            out.push_str(digits);
            out.push_str(&"0".repeat((point - k) as usize));
        } else if 0 < point && point <= 21 {
            out.push_str(&digits[..point as usize]);
            out.push('.');
            out.push_str(&digits[point as usize..]);
        } else if -6 < point && point <= 0 {
            out.push_str("0.");
            out.push_str(&"0".repeat((-point) as usize));
            out.push_str(digits);
        } else {
            out.push_str(&digits[..1]);
            if k > 1 {
                out.push('.');
                out.push_str(&digits[1..]);
            }
            out.push_str(&format!("e{:+}", point - 1));
        }
    }

    fn string(&mut self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{0}'..='\u{1f}' => out.push_str(&format!("\\u{:04x}", c as u32)),
                _ => out.push(c),
            }
        }
        out.push('"');
    }
}

/// The expected canonical form.
fn expected_canonical(value: &Json, out: &mut String) {
    write_json(value, &mut Canonical, out);
}

fn count_nodes(value: &Json) -> usize {
    1 + match value {
        Json::Array(items) => items.iter().map(count_nodes).sum(),
        Json::Object(members) => members.iter().map(|(_, v)| count_nodes(v)).sum(),
        _ => 0,
    }
}

/// Changes the value of node number `target` (pre-order), so that the document means something
/// else. Returns the remaining count when the target is not in this subtree.
fn mutate(value: &mut Json, target: usize, choices: &mut Choices) -> Option<usize> {
    if target == 0 {
        mutate_node(value, choices);
        return None;
    }
    let mut remaining = target - 1;
    let children: Vec<&mut Json> = match value {
        Json::Array(items) => items.iter_mut().collect(),
        Json::Object(members) => members.iter_mut().map(|(_, v)| v).collect(),
        _ => Vec::new(),
    };
    for child in children {
        remaining = mutate(child, remaining, choices)?;
    }
    Some(remaining)
}

fn unused_key(members: &[(String, Json)], base: &str) -> String {
    let mut key = base.to_owned();
    while members.iter().any(|(k, _)| *k == key) {
        key.push('~');
    }
    key
}

fn mutate_node(value: &mut Json, choices: &mut Choices) {
    match value {
        Json::Null => *value = Json::Bool(false),
        Json::Bool(b) => *b = !*b,
        Json::Number {
            negative,
            digits,
            exponent,
        } => {
            if digits.is_empty() {
                *value = Json::number(choices.one_in(2), "1", choices.below(5) as i64 - 2);
                return;
            }
            match choices.below(3) {
                0 => *negative = !*negative,
                1 => *exponent += 1,
                // One more significant digit, far down: e.g. 9007199254740992 -> ...9921 × 10^-1.
                _ => {
                    digits.push('1');
                    *exponent -= 1;
                }
            }
        }
        Json::String(s) => s.push(['x', '\u{0}', 'é', '😀'][choices.below(4)]),
        Json::Array(items) => items.push(Json::Null),
        Json::Object(members) => {
            if !members.is_empty() && choices.one_in(2) {
                let index = choices.below(members.len());
                let renamed = unused_key(members, &members[index].0);
                members[index].0 = renamed;
            } else {
                let key = unused_key(members, "");
                members.push((key, Json::Null));
            }
        }
    }
}

/// What a request's fingerprint must be, built from [`canonicalize_json`]'s bytes as the
/// fingerprint's digest is documented: SHA-256 over length-prefixed fields (domain, `json`, the
/// version, method, path, the canonical query where there is one, the canonical body).
fn expected_json_digest(path: &str, query: Option<(&str, &str)>, canonical: &[u8]) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    let mut field = |bytes: &[u8]| {
        hasher.update((bytes.len() as u64).to_be_bytes());
        hasher.update(bytes);
    };
    field(b"tower-idempotency/request-fingerprint");
    field(b"json");
    field(&[0, if query.is_some() { 2 } else { 1 }]);
    field(b"POST");
    field(path.as_bytes());
    if let Some((name, value)) = query {
        let mut pairs = Vec::new();
        for part in [name, value] {
            pairs.extend_from_slice(&(part.len() as u64).to_be_bytes());
            pairs.extend_from_slice(part.as_bytes());
        }
        field(&pairs);
    }
    field(canonical);
    hasher.finalize().into()
}

/// Checks that the JSON fingerprint of `body` (hashed as it is canonicalized) is the digest of
/// [`canonicalize_json`]'s bytes, or fails with the same error, with and without a query.
fn check_fingerprint_against_reference(body: &[u8], max_depth: usize) -> Result<(), TestCaseError> {
    use tower_idempotency::fingerprint::{Fingerprint, Fingerprinter};
    let fingerprinter = Fingerprinter::json().with_max_depth(max_depth);
    let reference = canonicalize_json(body, max_depth);
    for (uri, query) in [
        ("/orders", None),
        ("/orders?dry_run=true", Some(("dry_run", "true"))),
    ] {
        let (parts, ()) = http::Request::post(uri)
            .body(())
            .expect("a valid request")
            .into_parts();
        let fingerprint = fingerprinter.fingerprint(&parts, body);
        match &reference {
            Err(error) => prop_assert_eq!(fingerprint.err(), Some(error.clone())),
            Ok(canonical) => {
                let fingerprint = fingerprint.expect("the reference accepts the body");
                let expected = expected_json_digest("/orders", query, canonical);
                prop_assert_eq!(fingerprint.digest(), &expected);
                // The digest version 1 gives the request, kept to compare with old records.
                let version_1 = expected_json_digest("/orders", None, canonical);
                prop_assert!(Fingerprint::new(1, version_1).matches(&fingerprint));
            }
        }
    }
    Ok(())
}

/// Bytes that, put somewhere in a JSON document, make it invalid or change its meaning.
const CORRUPTIONS: &[&[u8]] = &[
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b"\"",
    b"\\",
    b" ",
    b"0",
    b"1",
    b"-",
    b".",
    b"e",
    b"E",
    b"+",
    b"u",
    b"x",
    b"\\u",
    b"\\ud83d",
    b"\x01",
    b"\n",
    b"\xff",
    b"\xc3",
    b"\xc3\xa9",
    b"null",
    b"tru",
    b"1e999999999999999999999999999999999999999",
    b"{\"k\":1,\"k\":2}",
];

fn corrupt(document: &str, choices: &mut Choices) -> Vec<u8> {
    let mut bytes = document.as_bytes().to_vec();
    for _ in 0..=choices.below(3) {
        let at = choices.below(bytes.len() + 1);
        match choices.below(3) {
            0 if at < bytes.len() => {
                bytes.remove(at);
            }
            1 if at < bytes.len() => {
                let with = CORRUPTIONS[choices.below(CORRUPTIONS.len())];
                bytes.splice(at..at + 1, with.iter().copied());
            }
            _ => {
                let with = CORRUPTIONS[choices.below(CORRUPTIONS.len())];
                bytes.splice(at..at, with.iter().copied());
            }
        }
    }
    bytes
}

fn canon(input: &str) -> Vec<u8> {
    match canonicalize_json(input.as_bytes(), DEFAULT_MAX_JSON_DEPTH) {
        Ok(canonical) => canonical,
        Err(error) => panic!("{input:?} should canonicalize: {error}"),
    }
}

proptest! {
    fn canonical_form_is_the_expected_one_for_any_spelling(value in arb_json(), seed in any::<u64>()) {
        let mut expected = String::new();
        expected_canonical(&value, &mut expected);
        let spelling = render(&value, &mut Choices(seed));
        prop_assert_eq!(String::from_utf8(canon(&spelling)).ok(), Some(expected), "input: {}", spelling);
    }

    fn all_spellings_give_the_same_canonical_bytes(value in arb_json(), seeds in any::<(u64, u64)>()) {
        let a = render(&value, &mut Choices(seeds.0));
        let b = render(&value, &mut Choices(seeds.1));
        prop_assert_eq!(canon(&a), canon(&b), "a: {}\nb: {}", a, b);
    }

    fn canonicalization_is_idempotent(value in arb_json(), seed in any::<u64>()) {
        let once = canon(&render(&value, &mut Choices(seed)));
        let text = String::from_utf8(once.clone()).expect("canonical JSON is UTF-8");
        prop_assert_eq!(canon(&text), once);
    }

    fn canonical_output_is_json_that_serde_json_parses(value in arb_json(), seed in any::<u64>()) {
        let canonical = canon(&render(&value, &mut Choices(seed)));
        let parsed = serde_json::from_slice::<serde_json::Value>(&canonical);
        prop_assert!(parsed.is_ok(), "{:?}: {:?}", String::from_utf8_lossy(&canonical), parsed);
    }

    fn any_changed_value_changes_the_canonical_bytes(
        value in arb_json(),
        seeds in any::<(u64, u64, u64)>(),
    ) {
        let mut choices = Choices(seeds.2);
        let mut changed = value.clone();
        let target = choices.below(count_nodes(&value));
        prop_assert!(mutate(&mut changed, target, &mut choices).is_none());

        let (mut before, mut after) = (String::new(), String::new());
        expected_canonical(&value, &mut before);
        expected_canonical(&changed, &mut after);
        prop_assert_ne!(&before, &after, "the mutation must change the value");

        let original = canon(&render(&value, &mut Choices(seeds.0)));
        let mutated = canon(&render(&changed, &mut Choices(seeds.1)));
        prop_assert_ne!(original, mutated);
    }

    fn duplicate_keys_in_any_spelling_are_rejected(
        key in arb_string(),
        values in any::<(u8, u8)>(),
        seeds in any::<(u64, u64)>(),
    ) {
        let mut a = String::new();
        let mut b = String::new();
        render_string(&key, &mut Choices(seeds.0), &mut a);
        render_string(&key, &mut Choices(seeds.1), &mut b);
        let document = format!("{{{a}:{}, {b}:{}}}", values.0, values.1);
        prop_assert_eq!(
            canonicalize_json(document.as_bytes(), DEFAULT_MAX_JSON_DEPTH),
            Err(FingerprintError::DuplicateKey)
        );
    }

    fn json_fingerprint_is_the_digest_of_canonicalize_json(
        value in arb_json(),
        seed in any::<u64>(),
    ) {
        let spelling = render(&value, &mut Choices(seed));
        check_fingerprint_against_reference(spelling.as_bytes(), DEFAULT_MAX_JSON_DEPTH)?;
        // A document with many members, in a large object and in an array of objects.
        let wide = format!(
            "{{\"z\":{spelling},\"list\":[{spelling},{{\"b\":{spelling},\"a\":1}}],\"a\":{spelling}}}"
        );
        check_fingerprint_against_reference(wide.as_bytes(), DEFAULT_MAX_JSON_DEPTH)?;
    }

    fn json_fingerprint_fails_as_canonicalize_json_does(
        value in arb_json(),
        seeds in any::<(u64, u64)>(),
        max_depth in prop_oneof![3 => Just(DEFAULT_MAX_JSON_DEPTH), 1 => 0usize..5],
    ) {
        let spelling = render(&value, &mut Choices(seeds.0));
        let corrupted = corrupt(&spelling, &mut Choices(seeds.1));
        check_fingerprint_against_reference(&corrupted, max_depth)?;
    }

    fn duplicate_keys_fail_the_fingerprint_as_canonicalize_json_does(
        values in (arb_json(), arb_json()),
        key in arb_string(),
        seeds in any::<(u64, u64, u64)>(),
    ) {
        let mut a = String::new();
        let mut b = String::new();
        render_string(&key, &mut Choices(seeds.0), &mut a);
        render_string(&key, &mut Choices(seeds.1), &mut b);
        let mut choices = Choices(seeds.2);
        let first = render(&values.0, &mut choices);
        let second = render(&values.1, &mut choices);
        let document = format!("[{first}, {{{a}:{first}, \"x\":[], {b}:{second}}}, {second}]");
        check_fingerprint_against_reference(document.as_bytes(), DEFAULT_MAX_JSON_DEPTH)?;
        let corrupted = corrupt(&document, &mut choices);
        check_fingerprint_against_reference(&corrupted, DEFAULT_MAX_JSON_DEPTH)?;
    }

    /// A value starting with `"` is a quoted string, so raw tokens start with anything else.
    fn visible_ascii_token_parses_to_itself(token in "[!#-~][!-~]{0,127}") {
        let key = IdempotencyKey::parse(token.as_bytes(), DEFAULT_MAX_KEY_LEN);
        prop_assert_eq!(key.as_ref().map(IdempotencyKey::as_str), Ok(token.as_str()));
    }

    fn quoted_token_parses_to_the_same_key(
        token in "[!-~]{1,128}",
        padding in ("[ \t]{0,2}", "[ \t]{0,2}"),
    ) {
        let escaped = token.replace('\\', "\\\\").replace('"', "\\\"");
        let quoted = format!("{}\"{escaped}\"{}", padding.0, padding.1);
        let key = IdempotencyKey::parse(quoted.as_bytes(), DEFAULT_MAX_KEY_LEN);
        prop_assert_eq!(key.as_ref().map(IdempotencyKey::as_str), Ok(token.as_str()));
        // The same key as the raw spelling, where there is one (`"` starts a quoted string).
        if !token.starts_with('"') {
            prop_assert_eq!(key, IdempotencyKey::parse(token.as_bytes(), DEFAULT_MAX_KEY_LEN));
        }
    }

    fn longer_tokens_are_too_long(token in "[!#-~][!-~]{128,300}") {
        prop_assert_eq!(
            IdempotencyKey::parse(token.as_bytes(), DEFAULT_MAX_KEY_LEN),
            Err(KeyError::TooLong { max: DEFAULT_MAX_KEY_LEN })
        );
    }
}

// The properties above, each a test.
test! { canonical_form_is_the_expected_one_for_any_spelling, sync }
test! { all_spellings_give_the_same_canonical_bytes, sync }
test! { canonicalization_is_idempotent, sync }
test! { canonical_output_is_json_that_serde_json_parses, sync }
test! { any_changed_value_changes_the_canonical_bytes, sync }
test! { duplicate_keys_in_any_spelling_are_rejected, sync }
test! { json_fingerprint_is_the_digest_of_canonicalize_json, sync }
test! { json_fingerprint_fails_as_canonicalize_json_does, sync }
test! { duplicate_keys_fail_the_fingerprint_as_canonicalize_json_does, sync }
test! { visible_ascii_token_parses_to_itself, sync }
test! { quoted_token_parses_to_the_same_key, sync }
test! { longer_tokens_are_too_long, sync }

/// 64 KiB JSON bodies of three shapes: a few fields one of which is a large array of objects, a
/// large string, a flat object with a few thousand keys in no particular order; and a fourth,
/// hostile one: objects nested as deep as the default limit allows.
fn bodies_of_64_kib() -> Vec<(&'static str, Vec<u8>)> {
    const TARGET: usize = json_bodies::TARGET;
    // Not a realistic shape: the worst nesting the default depth allows, each object around a
    // large array of numbers.
    let levels = 120;
    let mut numbers = String::new();
    while numbers.len() < TARGET - levels * 12 {
        numbers.push_str(&format!("{},", numbers.len() % 1000));
    }
    let nested = format!(
        "{}[{numbers}0]{}",
        r#"{"b":0,"a":"#.repeat(levels),
        "}".repeat(levels)
    );
    vec![
        ("array of objects", json_bodies::array_of_objects()),
        ("large string", json_bodies::large_string()),
        ("flat object", json_bodies::flat_object()),
        ("nested objects (hostile)", nested.into_bytes()),
    ]
}

test! { fingerprint_cost_of_64_kib_json_bodies, sync, ignore = "a timing, not a check: run it by name in release mode" }
/// The CPU cost of fingerprinting a 64 KiB JSON body: run in release mode,
/// `cargo test --release --test contract -- --ignored --nocapture canonical_props::fingerprint_cost`.
/// `FINGERPRINT_RUNS` sets the number of runs per timing (1000), e.g. a few under an instruction
/// counter such as `valgrind --tool=callgrind --toggle-collect='*Fingerprinter*fingerprint*'`;
/// `FINGERPRINT_SHAPE` keeps the shapes whose name contains it (`array`, `string`, `flat`, `nested`).
fn fingerprint_cost_of_64_kib_json_bodies() {
    use tower_idempotency::fingerprint::Fingerprinter;
    let runs: u32 = std::env::var("FINGERPRINT_RUNS")
        .ok()
        .and_then(|runs| runs.parse().ok())
        .unwrap_or(1000);
    let parts = json_bodies::order_head();
    let fingerprinter = Fingerprinter::auto();
    let only = std::env::var("FINGERPRINT_SHAPE").unwrap_or_default();
    for (shape, body) in bodies_of_64_kib() {
        if !shape.contains(only.as_str()) {
            continue;
        }
        let mut best = std::time::Duration::MAX;
        for _ in 0..5 {
            let start = std::time::Instant::now();
            for _ in 0..runs {
                let fingerprint = fingerprinter.fingerprint(&parts, std::hint::black_box(&body));
                assert!(fingerprint.is_ok(), "{shape}: {fingerprint:?}");
            }
            best = best.min(start.elapsed());
        }
        eprintln!(
            "{shape}: {} bytes, {:.1} µs per fingerprint (best of 5 x {runs} runs)",
            body.len(),
            best.as_secs_f64() * 1e6 / f64::from(runs.max(1))
        );
    }
}
