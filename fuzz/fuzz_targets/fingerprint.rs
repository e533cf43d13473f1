//! `Fingerprinter::fingerprint` on arbitrary requests: a content type, a path and a body.
//!
//! - It never panics, whatever the headers and body.
//! - `auto` is `json` for JSON content types and `raw` for everything else.
//! - A JSON body and its canonical form have one fingerprint; the raw scheme, another path or
//!   another method never share it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tower_idempotency::fingerprint::{canonicalize_json, Fingerprinter, DEFAULT_MAX_JSON_DEPTH};

const CONTENT_TYPES: [&[u8]; 8] = [
    b"application/json",
    b"Application/JSON; charset=utf-8",
    b"application/merge-patch+json",
    b"application/+json",
    b"text/plain",
    b"application/jsonx",
    b"",
    b"\xff\xfe",
];

fn parts(method: &str, path: &str, content_type: Option<&[u8]>) -> http::request::Parts {
    let mut request = http::Request::builder().method(method).uri(path);
    if let Some(content_type) = content_type {
        if let Ok(value) = http::HeaderValue::from_bytes(content_type) {
            request = request.header(http::header::CONTENT_TYPE, value);
        }
    }
    request.body(()).expect("a valid request").into_parts().0
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let content_type = CONTENT_TYPES[usize::from(selector) % CONTENT_TYPES.len()];
    let is_json = usize::from(selector) % CONTENT_TYPES.len() < 3;
    let request = parts("POST", "/orders", Some(content_type));

    let auto = Fingerprinter::auto().fingerprint(&request, body);
    let json = Fingerprinter::json().fingerprint(&request, body);
    let raw = Fingerprinter::raw()
        .fingerprint(&request, body)
        .expect("raw bytes always have a fingerprint");
    if is_json {
        assert_eq!(auto, json, "auto is json for {content_type:?}");
    } else {
        assert_eq!(auto, Ok(raw), "auto is raw for {content_type:?}");
    }

    let Ok(json) = json else {
        return;
    };
    assert!(!json.matches(&raw), "the scheme is part of the digest");
    let canonical = canonicalize_json(body, DEFAULT_MAX_JSON_DEPTH).expect("json() accepted it");
    let again = Fingerprinter::json()
        .fingerprint(&request, &canonical)
        .expect("canonical JSON is JSON");
    assert!(json.matches(&again), "a body and its canonical form match");

    let elsewhere = Fingerprinter::json()
        .fingerprint(&parts("POST", "/orders/other", None), body)
        .expect("the same body");
    let patched = Fingerprinter::json()
        .fingerprint(&parts("PATCH", "/orders", None), body)
        .expect("the same body");
    assert!(!json.matches(&elsewhere), "the path is part of the digest");
    assert!(!json.matches(&patched), "the method is part of the digest");
});
