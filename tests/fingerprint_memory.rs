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

#[path = "support/json_bodies/mod.rs"]
mod json_bodies;

use json_bodies::{array_of_objects, flat_object, large_string};

#[test]
fn fingerprinting_a_64_kib_json_body_allocates_at_most_1_2_times_its_size() {
    let parts = json_bodies::order_head();
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
