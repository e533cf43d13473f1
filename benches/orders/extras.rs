//! The extra measurements beside the table: replay latency while a handler holds the write
//! transaction (`hold`), and the disk's `fsync` latency before and after the cases. The
//! allocation count is in `alloc.rs`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cases::{percentile_ms, replay_workload};
use crate::cli::{Mode, Options};
use crate::load::{connect_all, run_load, Limit, Workload};
use crate::servers::{Server, HOLD};
use crate::BoxError;

/// One line of the extra measurements (`extras.csv`).
pub(crate) struct Extra {
    pub(crate) measure: &'static str,
    pub(crate) variant: String,
    pub(crate) metric: &'static str,
    pub(crate) value: f64,
    pub(crate) unit: &'static str,
}

/// Replay latency while a handler holds the write transaction 100 ms at a time, in a loop.
pub(crate) async fn run_hold(options: &Options) -> Result<Vec<Extra>, BoxError> {
    const REPLAY_CONCURRENCY: usize = 16;
    let duration = (options.duration * options.rounds as u32).max(Duration::from_millis(800));
    let server = Server::start(Mode::Full).await?;
    let (replays, _) = replay_workload(server.addr, REPLAY_CONCURRENCY, "h-", "book").await?;
    let replays = Arc::new(replays);
    let mut conns = connect_all(server.addr, REPLAY_CONCURRENCY).await?;
    (conns, _) = run_load(conns, &replays, Limit::For(options.warmup)).await;

    println!();
    println!(
        "Replays while a handler holds the write transaction for {} ms, in a loop \
         (FULL, replay load c={REPLAY_CONCURRENCY}, {:.1} s each; target: p99 < 5 ms)",
        HOLD.as_millis(),
        duration.as_secs_f64()
    );
    println!(
        "  {:<34} {:>10} {:>9} {:>9} {:>9} {:>7} {:>7}",
        "writer", "replays/s", "p50 ms", "p99 ms", "max ms", "holds", "errors"
    );
    let mut extras = Vec::new();
    for (variant, path) in [
        ("idle (no holder)", None),
        ("holder awaits inside the tx", Some("/slow/async")),
        ("holder blocks the writer thread", Some("/slow/blocking")),
    ] {
        let holder = async {
            match path {
                Some(path) => {
                    let conns = connect_all(server.addr, 1).await?;
                    let slow = Arc::new(Workload::create(path, "slow-", "book"));
                    let (_, stats) = run_load(conns, &slow, Limit::For(duration)).await;
                    Ok::<_, BoxError>(Some(stats))
                }
                None => Ok(None),
            }
        };
        let (replayed, held) =
            tokio::join!(run_load(conns, &replays, Limit::For(duration)), holder);
        let (back, mut stats) = replayed;
        conns = back;
        let held = held?;
        stats.latencies.sort_unstable();
        let p50 = percentile_ms(&stats.latencies, 50.0);
        let p99 = percentile_ms(&stats.latencies, 99.0);
        let max = percentile_ms(&stats.latencies, 100.0);
        let holds = held.as_ref().map_or(0, |h| h.ok);
        let errors = stats.errors + held.as_ref().map_or(0, |h| h.errors);
        println!(
            "  {variant:<34} {:>10.0} {p50:>9.2} {p99:>9.2} {max:>9.2} {holds:>7} {errors:>7}",
            stats.requests_per_second()
        );
        for error in [&stats.first_error, &held.and_then(|h| h.first_error)]
            .into_iter()
            .flatten()
        {
            eprintln!("  !! hold {variant}: {error}");
        }
        for (metric, value, unit) in [
            ("replays_per_s", stats.requests_per_second(), "1/s"),
            ("p50", p50, "ms"),
            ("p99", p99, "ms"),
            ("max", max, "ms"),
            ("holds", holds as f64, "count"),
            ("errors", errors as f64, "count"),
        ] {
            extras.push(Extra {
                measure: "replay_while_writer_held",
                variant: variant.to_owned(),
                metric,
                value,
                unit,
            });
        }
    }
    drop(conns);
    server.shut_down().await?;
    Ok(extras)
}

/// Measures and prints the disk's sync latency (`when`: before or after the cases).
pub(crate) async fn disk_probe(
    when: &'static str,
    options: &Options,
) -> Result<Vec<Extra>, BoxError> {
    let samples = if options.quick { 50 } else { 200 };
    let (p50, p99, taken) = tokio::task::spawn_blocking(move || probe_fsync(samples)).await??;
    println!(
        "disk {when}: fsync of a 4 KiB overwrite in the temp dir: p50 {p50:.3} ms, p99 {p99:.3} ms \
         ({taken} samples; every FULL figure depends on it)"
    );
    Ok([("p50", p50), ("p99", p99)]
        .into_iter()
        .map(|(metric, value)| Extra {
            measure: "disk_fsync_4k_overwrite",
            variant: when.into(),
            metric,
            value,
            unit: "ms",
        })
        .collect())
}

/// How long the temp dir's disk takes to make a small overwrite durable (`fsync`, as SQLite
/// syncs): every `synchronous=FULL` figure depends on it, and on a shared machine it varies.
/// Stops after `samples` syncs or 3 s.
fn probe_fsync(samples: usize) -> Result<(f64, f64, usize), BoxError> {
    use std::io::{Seek, SeekFrom, Write};
    let dir = tempfile::tempdir()?;
    let mut file = std::fs::File::create(dir.path().join("fsync-probe"))?;
    let block = [0x5a_u8; 4096];
    file.write_all(&block)?;
    file.sync_all()?;
    let mut micros = Vec::with_capacity(samples);
    let deadline = Instant::now() + Duration::from_secs(3);
    while micros.len() < samples && Instant::now() < deadline {
        file.seek(SeekFrom::Start(0))?;
        file.write_all(&block)?;
        let began = Instant::now();
        file.sync_all()?;
        micros.push(u32::try_from(began.elapsed().as_micros()).unwrap_or(u32::MAX));
    }
    micros.sort_unstable();
    Ok((
        percentile_ms(&micros, 50.0),
        percentile_ms(&micros, 99.0),
        micros.len(),
    ))
}
