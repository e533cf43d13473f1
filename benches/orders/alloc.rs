//! Bytes allocated per request: the global allocator is `stats_alloc`'s counting wrapper of the
//! system allocator, and the `alloc` measurement reads its counters before and after a window
//! of requests (the whole process: client, server and SQLite).
//!
//! The wrapper counts every allocation of the run (two atomic additions each, the same for
//! every case); only the `alloc` measurement reads the counts. Bytes are those of new blocks
//! plus what reallocations grow blocks by; blocks are allocations plus reallocations.
//!
//! Around it, [`Counting`] keeps the server's live heap bytes and their peak, for the heap
//! measurement of `scale.rs` (one more atomic addition per allocation, reallocation and free,
//! and a comparison with the peak): every thread's allocations but the load generator's,
//! whose threads mark themselves (`load.rs`). A block allocated on one side and freed on the
//! other is counted on one side only: that happens where a run hands connections and load
//! results back, outside a measured round, which is read as the peak over its own start.
//!
//! Its own counter, not `stats_alloc`'s: in those, a reallocation adds its growth to
//! `bytes_allocated` (or its shrinkage to `bytes_deallocated`) and the signed change to
//! `bytes_reallocated` as well, so live bytes computed from them (allocated - deallocated +
//! reallocated) count every reallocation's change twice and grow with every request that grows
//! a buffer by reallocation; and they are read one after the other while other threads
//! allocate. A peak sampled from them grew with the number of requests, not with the requests
//! in flight.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};

use crate::cli::{Mode, Options};
use crate::extras::Extra;
use crate::load::{connect_all, run_load, Limit, Workload};
use crate::servers::Server;
use crate::BoxError;

/// `stats_alloc`'s counters, read by the `alloc` measurement.
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

#[global_allocator]
static COUNTING: Counting = Counting;

/// The server's bytes live on the heap now (allocated less freed): the Rust allocations of
/// every thread but the load generator's (SQLite allocates with its own `malloc`, not
/// counted). Relative: only its changes mean something.
static LIVE: AtomicI64 = AtomicI64::new(0);
/// The most [`LIVE`] has been since [`reset_peak`].
static PEAK: AtomicI64 = AtomicI64::new(0);

thread_local! {
    /// Whether this thread is one of the load generator's (`load.rs`): the live bytes are the
    /// server's, not the client's. A `Cell` without a destructor: readable in the allocator.
    static CLIENT_THREAD: Cell<bool> = const { Cell::new(false) };
}

/// Marks the calling thread as the load generator's: its allocations and frees are left out
/// of [`LIVE`].
pub(crate) fn mark_client_thread() {
    CLIENT_THREAD.with(|client| client.set(true));
}

fn on_client_thread() -> bool {
    CLIENT_THREAD.try_with(Cell::get).unwrap_or(false)
}

/// [`GLOBAL`] with the live bytes and their peak kept too.
struct Counting;

impl Counting {
    fn grew(delta: i64) {
        if on_client_thread() {
            return;
        }
        let live = LIVE.fetch_add(delta, Ordering::Relaxed) + delta;
        // The read is shared by every thread; the write happens only on a new peak.
        if live > PEAK.load(Ordering::Relaxed) {
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
    }
}

// SAFETY: every call goes to `stats_alloc`'s wrapper of the system allocator unchanged; the
// counters beside it do not touch the memory.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let block = GLOBAL.alloc(layout);
        if !block.is_null() {
            Self::grew(layout.size() as i64);
        }
        block
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let block = GLOBAL.alloc_zeroed(layout);
        if !block.is_null() {
            Self::grew(layout.size() as i64);
        }
        block
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        GLOBAL.dealloc(ptr, layout);
        if !on_client_thread() {
            LIVE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let block = GLOBAL.realloc(ptr, layout, new_size);
        if !block.is_null() {
            let change = new_size as i64 - layout.size() as i64;
            if change > 0 {
                Self::grew(change);
            } else if !on_client_thread() {
                LIVE.fetch_add(change, Ordering::Relaxed);
            }
        }
        block
    }
}

/// Starts a new peak from the server's bytes live now ([`LIVE`]); returns them.
pub(crate) fn reset_peak() -> i64 {
    let live = LIVE.load(Ordering::Relaxed);
    PEAK.store(live, Ordering::Relaxed);
    live
}

/// The most bytes live at once since [`reset_peak`], counted at every allocation (no
/// sampling: a peak however short is seen).
pub(crate) fn peak_bytes() -> i64 {
    PEAK.load(Ordering::Relaxed)
}

/// Bytes allocated per request (the whole process: client, server, SQLite) for a 64 KiB JSON
/// body, sent one at a time, through the layer and through baseline H.
pub(crate) async fn run_alloc(options: &Options) -> Result<Vec<Extra>, BoxError> {
    const BODY_SIZE: usize = 64 * 1024;
    let requests: u64 = if options.quick { 100 } else { 300 };
    let body = {
        let head = r#"{"sku":"book","quantity":1,"note":""#;
        let tail = r#""}"#;
        let mut body = String::with_capacity(BODY_SIZE);
        body.push_str(head);
        while body.len() < BODY_SIZE - tail.len() {
            body.push_str("lorem ipsum ");
        }
        body.truncate(BODY_SIZE - tail.len());
        body.push_str(tail);
        Bytes::from(body)
    };
    debug_assert_eq!(body.len(), BODY_SIZE);

    let server = Server::start(Mode::Full).await?;
    println!();
    println!(
        "Bytes allocated per request, {} KiB JSON body, c=1, {requests} requests \
         (whole process: client, server and SQLite)",
        BODY_SIZE / 1024
    );
    println!(
        "  {:<42} {:>12} {:>12} {:>10}",
        "route", "bytes/req", "allocs/req", "x body"
    );
    let mut measured = Vec::new();
    for (variant, path) in [
        ("H: no layer (hand-written)", "/hand/orders"),
        ("A: layer, JSON fingerprint (as the example)", "/orders"),
        ("A: layer, raw-bytes fingerprint", "/raw/orders"),
    ] {
        let workload = Arc::new(Workload::Create {
            path,
            prefix: format!("m{}-", measured.len()),
            body: body.clone(),
            next: AtomicU64::new(0),
        });
        let conns = connect_all(server.addr, 1).await?;
        let (conns, warmup) = run_load(conns, &workload, Limit::Requests(50)).await;
        let window = Region::new(GLOBAL);
        let (conns, stats) = run_load(conns, &workload, Limit::Requests(requests)).await;
        let count = window.change();
        drop(conns);
        if let Some(error) = warmup.first_error.or(stats.first_error) {
            eprintln!("  !! alloc {variant}: {error}");
        }
        let per_request = count.bytes_allocated as f64 / requests as f64;
        let blocks = (count.allocations + count.reallocations) as f64 / requests as f64;
        println!(
            "  {variant:<42} {per_request:>12.0} {blocks:>12.1} {:>10.2}",
            per_request / BODY_SIZE as f64
        );
        measured.push((variant, per_request, blocks));
    }
    server.shut_down().await?;

    let mut extras = Vec::new();
    for (variant, bytes, blocks) in &measured {
        extras.push(Extra {
            measure: "alloc_per_request_64k_body",
            variant: (*variant).to_owned(),
            metric: "bytes",
            value: *bytes,
            unit: "bytes",
        });
        extras.push(Extra {
            measure: "alloc_per_request_64k_body",
            variant: (*variant).to_owned(),
            metric: "allocations",
            value: *blocks,
            unit: "count",
        });
    }
    if let [(_, baseline, baseline_blocks), rest @ ..] = &measured[..] {
        for ((variant, bytes, blocks), label) in rest
            .iter()
            .zip(["layer (JSON) minus H", "layer (raw) minus H"])
        {
            let extra = bytes - baseline;
            println!(
                "  {label:<42} {extra:>12.0} {:>12.1} {:>10.2}",
                blocks - baseline_blocks,
                extra / BODY_SIZE as f64
            );
            extras.push(Extra {
                measure: "alloc_per_request_64k_body",
                variant: format!("{variant} minus H"),
                metric: "bytes_over_body",
                value: extra / BODY_SIZE as f64,
                unit: "ratio",
            });
        }
    }
    Ok(extras)
}
