//! Heap cost of fingerprinting a 64 KiB JSON body, measured with a counting global allocator:
//! the peak and the total of the bytes allocated while fingerprinting (the body and the request
//! head are allocated before), for three shapes of body, each at most 1.2 times the body's size.
//!
//! The JSON fingerprint hashes the canonical form as it is produced, so the extra memory is
//! bounded by what sorting object members needs (a position per member of the objects being
//! written), not by a copy of the body. Run with `--nocapture` to see the figures. One `#[test]`
//! only: the allocator counts every allocation of the process, and a second test running at the
//! same time would be counted too.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use support::json_bodies::{self, array_of_objects, flat_object, large_string};
use tower_idempotency::fingerprint::Fingerprinter;

#[global_allocator]
static ALLOC: Counting = Counting;

/// Bytes live on the heap now, counted from the last [`Counting::reset`] (a block allocated
/// before and freed after makes it wrap below zero: read only as a peak over the start).
static LIVE: AtomicUsize = AtomicUsize::new(0);
/// The most [`LIVE`] has been since the last reset.
static PEAK: AtomicUsize = AtomicUsize::new(0);
/// Bytes and blocks allocated since the last reset (a reallocation counts as a new block).
static TOTAL_BYTES: AtomicUsize = AtomicUsize::new(0);
static TOTAL_BLOCKS: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, counting.
struct Counting;

impl Counting {
    fn allocated(size: usize) {
        let live = LIVE.fetch_add(size, Ordering::Relaxed).wrapping_add(size);
        if (live as isize) > 0 {
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        TOTAL_BYTES.fetch_add(size, Ordering::Relaxed);
        TOTAL_BLOCKS.fetch_add(1, Ordering::Relaxed);
    }

    fn freed(size: usize) {
        LIVE.fetch_sub(size, Ordering::Relaxed);
    }

    /// Starts counting from here.
    fn reset() {
        for counter in [&LIVE, &PEAK, &TOTAL_BYTES, &TOTAL_BLOCKS] {
            counter.store(0, Ordering::Relaxed);
        }
    }
}

// SAFETY: every call is passed on to the system allocator unchanged; the counters only observe.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let block = System.alloc(layout);
        if !block.is_null() {
            Self::allocated(layout.size());
        }
        block
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let block = System.alloc_zeroed(layout);
        if !block.is_null() {
            Self::allocated(layout.size());
        }
        block
    }

    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        System.dealloc(block, layout);
        Self::freed(layout.size());
    }

    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let moved = System.realloc(block, layout, new_size);
        if !moved.is_null() {
            Self::freed(layout.size());
            Self::allocated(new_size);
        }
        moved
    }
}

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
        Counting::reset();
        let fingerprint = fingerprinter.fingerprint(&parts, body);
        let (peak, total_bytes, total_blocks) = (
            PEAK.load(Ordering::Relaxed),
            TOTAL_BYTES.load(Ordering::Relaxed),
            TOTAL_BLOCKS.load(Ordering::Relaxed),
        );
        assert!(fingerprint.is_ok(), "{shape}: {fingerprint:?}");
        drop(fingerprint);
        let limit = body.len() * 12 / 10;
        eprintln!(
            "{shape}: body {} bytes, peak extra {peak} bytes ({:.2}x), total allocated \
             {total_bytes} bytes ({:.2}x) in {total_blocks} blocks",
            body.len(),
            peak as f64 / body.len() as f64,
            total_bytes as f64 / body.len() as f64,
        );
        if peak > limit || total_bytes > limit {
            failures.push(*shape);
        }
    }
    assert!(failures.is_empty(), "over 1.2x the body size: {failures:?}");
}
