//! Heap cost of fingerprinting a 64 KiB JSON body, measured with `dhat`'s testing mode: the peak
//! and the total of the bytes allocated while fingerprinting (the body and the request head are
//! allocated before), for three shapes of body, each at most 1.2 times the body's size.
//!
//! The JSON fingerprint hashes the canonical form as it is produced, so the extra memory is
//! bounded by what sorting object members needs (a position per member of the objects being
//! written), not by a copy of the body. Run with `--nocapture` to see the figures. One `#[test]`
//! only: `dhat` counts every allocation of the process, and a second test running at the same
//! time would be counted too.

use tower_idempotency::fingerprint::Fingerprinter;

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

const TARGET: usize = 64 * 1024;

/// `{"order":…,"customer":{…},"items":[{…},…]}`: a few fields, one a large array of objects.
fn array_of_objects() -> Vec<u8> {
    let mut body =
        String::from(r#"{"order":"ord-2041","customer":{"id":77,"name":"Ann"},"items":["#);
    let mut index = 0;
    while body.len() < TARGET - 120 {
        if index > 0 {
            body.push(',');
        }
        body.push_str(&format!(
            r#"{{"sku":"SKU-{index:05}","quantity":{},"price":{}.{:02},"note":"gift \u00e9"}}"#,
            index % 7 + 1,
            index % 300,
            index % 100
        ));
        index += 1;
    }
    body.push_str(r#"],"currency":"EUR"}"#);
    body.into_bytes()
}

/// `{"id":1,"blob":"…"}` with a 64 KiB string (a few escapes in it).
fn large_string() -> Vec<u8> {
    let mut blob = String::new();
    let mut line = 0;
    while blob.len() < TARGET - 64 {
        blob.push_str(&format!(
            "line {line}: the quick brown fox \\\"jumps\\\"\\n"
        ));
        line += 1;
    }
    format!(r#"{{"id":1,"blob":"{blob}","kind":"note"}}"#).into_bytes()
}

/// `{"field_00000":"value 0",…}`: a flat object with a few thousand keys, shuffled.
fn flat_object() -> Vec<u8> {
    let mut members = Vec::new();
    let mut size = 2;
    let mut index = 0;
    while size < TARGET - 40 {
        let member = format!(r#""field_{index:05}":"value {index}""#);
        size += member.len() + 1;
        members.push(member);
        index += 1;
    }
    let count = members.len();
    let shuffled: Vec<&str> = (0..count)
        .map(|i| members[i * 7919 % count].as_str())
        .collect();
    format!("{{{}}}", shuffled.join(",")).into_bytes()
}

#[test]
fn fingerprinting_a_64_kib_json_body_allocates_at_most_1_2_times_its_size() {
    let (parts, ()) = http::Request::post("/orders?dry_run=true")
        .header("content-type", "application/json")
        .body(())
        .expect("a valid request")
        .into_parts();
    let fingerprinter = Fingerprinter::auto();
    let shapes = [
        ("array of objects", array_of_objects()),
        ("large string", large_string()),
        ("flat object", flat_object()),
    ];
    let mut failures = Vec::new();
    for (shape, body) in &shapes {
        assert!(
            serde_json::from_slice::<serde_json::Value>(body).is_ok(),
            "{shape}: the body is JSON"
        );
        let profiler = dhat::Profiler::builder().testing().build();
        let fingerprint = fingerprinter.fingerprint(&parts, body);
        let stats = dhat::HeapStats::get();
        drop(profiler);
        assert!(fingerprint.is_ok(), "{shape}: {fingerprint:?}");
        let limit = body.len() * 12 / 10;
        eprintln!(
            "{shape}: body {} bytes, peak extra {} bytes ({:.2}x), total allocated {} bytes \
             ({:.2}x) in {} blocks",
            body.len(),
            stats.max_bytes,
            stats.max_bytes as f64 / body.len() as f64,
            stats.total_bytes,
            stats.total_bytes as f64 / body.len() as f64,
            stats.total_blocks,
        );
        if stats.max_bytes > limit || stats.total_bytes > limit as u64 {
            failures.push(*shape);
        }
    }
    assert!(failures.is_empty(), "over 1.2x the body size: {failures:?}");
}
