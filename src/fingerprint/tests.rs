use super::*;

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
fn a_kept_start_is_the_same_as_one_hashed_afresh() {
    for tag in super::BUILT_IN_TAGS.into_iter().chain(["custom"]) {
        for version in [1, 2, 7] {
            let mut fresh = Sha256::new();
            super::field(&mut fresh, super::DOMAIN);
            super::field(&mut fresh, tag.as_bytes());
            super::field(&mut fresh, &u16::to_be_bytes(version));
            let kept = super::started(tag, version);
            assert_eq!(kept.finalize(), fresh.finalize(), "{tag} v{version}");
        }
    }
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
