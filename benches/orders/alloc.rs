//! Bytes allocated per request: the global allocator is `stats_alloc`'s counting wrapper of the
//! system allocator, and the `alloc` measurement reads its counters before and after a window
//! of requests (the whole process: client, server and SQLite).
//!
//! The wrapper counts every allocation of the run (two atomic additions each, the same for
//! every case); only the `alloc` measurement reads the counts. Bytes are those of new blocks
//! plus what reallocations grow blocks by; blocks are allocations plus reallocations.

use std::alloc::System;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use axum::body::Bytes;
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};

use crate::cli::{Mode, Options};
use crate::extras::Extra;
use crate::load::{connect_all, run_load, Limit, Workload};
use crate::servers::Server;
use crate::BoxError;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Bytes live on the heap now (allocated less freed, reallocations included): the whole
/// process's Rust allocations (SQLite allocates with its own `malloc`, not counted).
pub(crate) fn live_bytes() -> i64 {
    let stats = GLOBAL.stats();
    stats.bytes_allocated as i64 - stats.bytes_deallocated as i64 + stats.bytes_reallocated as i64
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
