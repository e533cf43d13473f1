//! How the cost grows with the work (`--scale`, the slow measurements of issue 35), on SQLite
//! (the first SQLite mode asked for: FULL by default) and, with `--database-url`, PostgreSQL:
//!
//! - **records**: new keys and replays through the layer with the records table already
//!   holding 0, 1 million and 10 million records (`--scale-rows`): throughput at c64, p50/p99
//!   at c1, and the database's size per million records. The table is filled with set-based
//!   SQL (a recursive CTE on SQLite, `generate_series` on PostgreSQL) in the store's own
//!   column formats, so the store reads the rows as valid records: UUID-like keys
//!   ([`uuid_key`]) over eight tenants (`shop-a` .. `shop-h`), the route's operation, the
//!   fingerprint of the replayed request, a `201` with `location` and `content-type`, a saved
//!   body of about 300 bytes, created over the last day and live for two. Replays pick a
//!   random `shop-a` record of the whole table; new keys are UUID-like too, so they land all
//!   over the primary key's B-tree as real clients' keys do. The "0" point holds 8,000 rows
//!   (1,000 per tenant), so that the replays have something to replay. SQLite's sizes are
//!   filled before their servers start (`journal_mode=OFF`, a large cache, synced to disk
//!   after) and measured side by side, their rounds interleaved; PostgreSQL's one after the
//!   other in one schema, filled up to each size in turn (`VACUUM ANALYZE` after each fill:
//!   a long-lived table is vacuumed), so that three pools of 32 never coexist.
//! - **purge**: `--scale-purge-rows` (1 million) expired records purged with the admin's
//!   `Admin::purge_expired` (batches of [`PURGE_BATCH`] through `IdempotencyStore::
//!   purge_expired`, each its own transaction: what `continuously_purge_expired` does at each
//!   tick) while 16 connections send new keys; the same load without a purge is measured
//!   before and after it (pooled). Reports the purge's rate.
//! - **body**: 1 KiB, 64 KiB and 1 MiB JSON bodies (an order with line items) through the
//!   layer and through H (which fingerprints the same way and saves the record), SQLite only:
//!   the server's CPU per request at c1 (`cpu.rs`), and the heap per in-flight request at c16:
//!   the peak of the server's live heap bytes (`alloc.rs`: kept at every allocation and free,
//!   the load generator's threads left out) over the idle level before the load (the 16
//!   connections open), divided by 16. SQLite's own `malloc` is not counted.
//! - **concurrency**: new keys at c1, 16, 64, 256 and 1024 (rounds interleaved): throughput,
//!   p50/p99, errors.
//!
//! Every part prints its table and how long it took, writes `scale.csv` (one line per
//! figure) and adds its goals to the run's goal list (`goals.csv`).

use std::fmt::Write as _;
use std::path::{Path as FsPath, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::http::header::CONTENT_TYPE;
use tower_idempotency::admin::Admin;
use tower_idempotency::fingerprint::Fingerprinter;
use tower_idempotency::store::sqlite::rusqlite::Connection;
use tower_idempotency::store::tokio_postgres::tokio_postgres::{self, NoTls};

use crate::cases::{median, percentile_ms};
use crate::cli::{Mode, Options};
use crate::cpu::CpuSample;
use crate::load::{connect_all, run_load, Conn, Limit, LoadStats, Workload};
use crate::report::{self, Goal};
use crate::servers::{create_database, Server};
use crate::BoxError;

/// The parts of `--scale`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    Records,
    Purge,
    Body,
    Concurrency,
}

impl Part {
    const ALL: [Part; 4] = [Part::Records, Part::Purge, Part::Body, Part::Concurrency];

    fn name(self) -> &'static str {
        match self {
            Part::Records => "records",
            Part::Purge => "purge",
            Part::Body => "body",
            Part::Concurrency => "concurrency",
        }
    }
}

/// What `--scale`, `--scale-rows`, `--scale-parts` and `--scale-purge-rows` asked for.
#[derive(Clone, Debug)]
pub(crate) struct ScaleOptions {
    rows: Vec<u64>,
    parts: Vec<Part>,
    purge_rows: u64,
}

impl Default for ScaleOptions {
    fn default() -> Self {
        ScaleOptions {
            rows: vec![0, 1_000_000, 10_000_000],
            parts: Part::ALL.to_vec(),
            purge_rows: 1_000_000,
        }
    }
}

/// The most rows a key number may reach: [`uuid_key`]'s arithmetic stays within 64 bits below.
const MAX_ROWS: u64 = 100_000_000;

impl ScaleOptions {
    pub(crate) fn parse(&mut self, flag: &str, value: &str) -> Result<(), String> {
        let numbers = |value: &str| {
            value
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| s.replace('_', "").parse::<u64>().ok())
                .collect::<Option<Vec<u64>>>()
                .filter(|n| !n.is_empty() && n.iter().all(|&n| n <= MAX_ROWS))
                .ok_or(format!(
                    "{flag} takes record counts from 0 to {MAX_ROWS}, such as 0,1000000"
                ))
        };
        match flag {
            "--scale-rows" => {
                let mut rows = numbers(value)?;
                rows.sort_unstable();
                rows.dedup();
                self.rows = rows;
            }
            "--scale-purge-rows" => match numbers(value)?[..] {
                [n] if n > 0 => self.purge_rows = n,
                _ => return Err(format!("{flag} takes one positive record count")),
            },
            _ => {
                let mut parts = Vec::new();
                for name in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                    let part = Part::ALL
                        .into_iter()
                        .find(|part| part.name().eq_ignore_ascii_case(name))
                        .ok_or(format!(
                            "unknown scale part `{name}` (records, purge, body, concurrency)"
                        ))?;
                    if !parts.contains(&part) {
                        parts.push(part);
                    }
                }
                if parts.is_empty() {
                    return Err(format!("{flag} needs at least one part"));
                }
                self.parts = parts;
            }
        }
        Ok(())
    }

    /// How long the parts take at least: the measured rounds and warm-ups, plus the fills and
    /// the purge at the rates this machine showed (about 70,000 rows/s filled on SQLite
    /// and on PostgreSQL, a purge about 16,000 rows/s, on a 2-core machine).
    pub(crate) fn estimate(&self, options: &Options) -> Duration {
        let stores = stores(options).len() as u32;
        let per_run = options.duration * options.rounds as u32 + options.warmup;
        let filled: u64 = self.rows.iter().map(|&n| n.max(REPLAY_FLOOR)).sum();
        let fill_secs = |rows: u64| rows as f64 / 70_000.0 * 2.0;
        let mut total = Duration::ZERO;
        for part in &self.parts {
            total += match part {
                Part::Records => {
                    per_run * (RECORD_RUNS.len() * self.rows.len()) as u32 * stores
                        + Duration::from_secs_f64(fill_secs(filled))
                }
                Part::Purge => {
                    options.duration * options.rounds as u32 * 2 * stores
                        + Duration::from_secs_f64(
                            fill_secs(self.purge_rows) + self.purge_rows as f64 / 16_000.0 * 2.0,
                        )
                }
                Part::Body => (per_run * 2 + (options.duration + options.warmup) * 2) * 3,
                Part::Concurrency => per_run * LEVELS.len() as u32 * stores,
            };
        }
        total
    }
}

/// What the scale measurements give the run: their goals and the CSV file written.
pub(crate) struct Measured {
    pub(crate) goals: Vec<Goal>,
    pub(crate) csv: PathBuf,
}

/// One figure of `scale.csv`.
struct Line {
    part: &'static str,
    store: String,
    variant: String,
    x: u64,
    metric: &'static str,
    value: f64,
    unit: &'static str,
}

/// The figures and goals measured so far.
#[derive(Default)]
struct Out {
    lines: Vec<Line>,
    goals: Vec<Goal>,
}

impl Out {
    #[allow(clippy::too_many_arguments)]
    fn line(
        &mut self,
        part: Part,
        store: &str,
        variant: &str,
        x: u64,
        metric: &'static str,
        value: f64,
        unit: &'static str,
    ) {
        self.lines.push(Line {
            part: part.name(),
            store: store.to_owned(),
            variant: variant.to_owned(),
            x,
            metric,
            value,
            unit,
        });
    }

    fn goal(&mut self, what: String, value: f64, goal: f64, at_least: bool, detail: String) {
        self.goals
            .push(Goal::new(what, value, goal, at_least, detail));
    }
}

/// Where a part stores its rows.
#[derive(Clone)]
enum Store {
    Sqlite(Mode),
    Postgres(String),
}

impl Store {
    fn name(&self) -> String {
        match self {
            Store::Sqlite(mode) => format!("SQLite {}", mode.name()),
            Store::Postgres(_) => "PostgreSQL".to_owned(),
        }
    }
}

/// SQLite in the first SQLite mode asked for (FULL by default), and PostgreSQL with a URL.
fn stores(options: &Options) -> Vec<Store> {
    let mut stores = Vec::new();
    if let Some(&mode) = options.modes.iter().find(|&&m| m != Mode::Postgres) {
        stores.push(Store::Sqlite(mode));
    }
    if let (true, Some(url)) = (
        options.modes.contains(&Mode::Postgres),
        &options.database_url,
    ) {
        stores.push(Store::Postgres(url.clone()));
    }
    stores
}

pub(crate) async fn run(options: &Options, scale: &ScaleOptions) -> Result<Measured, BoxError> {
    let started = Instant::now();
    let stores = stores(options);
    let mut out = Out::default();
    println!();
    println!(
        "How cost grows (--scale): parts {}, stores {}, {} rounds x {:.1} s (+{:.1} s warm-up), \
         load generator threads {}",
        scale
            .parts
            .iter()
            .map(|p| p.name())
            .collect::<Vec<_>>()
            .join(", "),
        stores
            .iter()
            .map(Store::name)
            .collect::<Vec<_>>()
            .join(", "),
        options.rounds,
        options.duration.as_secs_f64(),
        options.warmup.as_secs_f64(),
        options.client_threads,
    );
    let mut timings = Vec::new();
    for &part in &scale.parts {
        let part_started = Instant::now();
        match part {
            Part::Records => {
                for store in &stores {
                    records(store, scale, options, &mut out).await?;
                }
            }
            Part::Purge => {
                for store in &stores {
                    purge(store, scale, options, &mut out).await?;
                }
            }
            Part::Body => match stores.first() {
                Some(Store::Sqlite(mode)) => body(*mode, options, &mut out).await?,
                _ => eprintln!("scale: the body part runs on SQLite only; skipped"),
            },
            Part::Concurrency => {
                for store in &stores {
                    concurrency(store, options, &mut out).await?;
                }
            }
        }
        let secs = part_started.elapsed().as_secs_f64();
        out.line(part, "-", "wall time", 0, "seconds", secs, "s");
        timings.push(format!("{} {:.0} s", part.name(), secs));
    }
    println!();
    println!(
        "scale parts took: {} (total {:.0} s)",
        timings.join(", "),
        started.elapsed().as_secs_f64()
    );
    report::print_goals_titled("Goals: how cost grows (this run)", &out.goals);
    std::fs::create_dir_all(&options.out)?;
    let csv = options.out.join("scale.csv");
    let mut text = String::from("part,store,variant,x,metric,value,unit\n");
    for line in &out.lines {
        let _ = writeln!(
            text,
            "{},\"{}\",\"{}\",{},{},{:.3},{}",
            line.part, line.store, line.variant, line.x, line.metric, line.value, line.unit
        );
    }
    std::fs::write(&csv, text)?;
    Ok(Measured {
        goals: out.goals,
        csv,
    })
}

// ---------------------------------------------------------------------------------------------
// Keys, bodies and the rows written with set-based SQL
// ---------------------------------------------------------------------------------------------

/// The tenants rows are spread over (`shop-a` .. `shop-h`, row `n` to `n % 8`); the load
/// generator is `shop-a`.
const TENANTS: u64 = 8;

/// Rows in the table at the "0" point: 1,000 `shop-a` records for the replays.
const REPLAY_FLOOR: u64 = 8_000;

/// The route's operation (the layer's `with_operation` on both stores).
const OPERATION: &str = "create_order";

const DAY_MS: i64 = 86_400_000;

/// A UUID-like key (version 4 layout) for number `n`, unique per `n` (its last group is a
/// bijection of `n` modulo 2^48) and spread over the key space. [`SQLITE_KEY`] and [`PG_KEY`]
/// compute the same text in SQL.
fn uuid_key(n: u64) -> String {
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        (n * 2_654_435_761) % (1 << 32),
        (n * 40_503) % (1 << 16),
        (n * 48_271) % (1 << 12),
        (n * 69_621) % (1 << 12),
        (n * 1_103_515_245 + 12_345) % (1 << 48),
    )
}

/// The key of the `m`-th `shop-a` row.
fn shop_a_key(m: u64) -> String {
    uuid_key(m * TENANTS)
}

const SQLITE_KEY: &str = "printf('%08x-%04x-4%03x-8%03x-%012x', (n * 2654435761) % 4294967296, \
     (n * 40503) % 65536, (n * 48271) % 4096, (n * 69621) % 4096, \
     (n * 1103515245 + 12345) % 281474976710656)";

const PG_KEY: &str = "lpad(to_hex((n * 2654435761) % 4294967296), 8, '0') || '-' || \
     lpad(to_hex((n * 40503) % 65536), 4, '0') || '-4' || \
     lpad(to_hex((n * 48271) % 4096), 3, '0') || '-8' || \
     lpad(to_hex((n * 69621) % 4096), 3, '0') || '-' || \
     lpad(to_hex((n * 1103515245 + 12345) % 281474976710656), 12, '0')";

/// The saved response body of row `n` (text), about 300 bytes, as an order API answers.
const BODY_TEXT: &str = "'{\"order_id\":' || n || ',\"status\":\"created\",\"sku\":\"sku-' || \
     (n % 5000) || '\",\"quantity\":' || (1 + n % 5) || ',\"unit_price_cents\":' || \
     (100 + n % 9900) || ',\"currency\":\"EUR\",\"customer_id\":\"cus_' || \
     ((n * 40503) % 1000000) || '\",\"shipping\":{\"method\":\"standard\",\"country\":\"DE\",\
     \"postcode\":\"' || (10000 + n % 89999) || '\"},\"items\":[{\"sku\":\"sku-' || (n % 5000) \
     || '\",\"quantity\":' || (1 + n % 5) || '}],\"created_at\":\"2026-01-01T00:00:00Z\"}'";

/// The saved headers of row `n`, encoded as the store encodes them.
const HEADERS_TEXT: &str =
    "'[[\"location\",\"/orders/' || n || '\"],[\"content-type\",\"application/json\"]]'";

/// Live records (created over the last day, expiring a day from then plus one) or expired ones
/// (expired a day ago or more).
#[derive(Clone, Copy)]
enum Expiry {
    Live,
    Expired,
}

impl Expiry {
    /// `(created_at, expires_at)` of row `n` in SQL, `now` in Unix milliseconds.
    fn columns(self, now: i64) -> (String, String) {
        let created = match self {
            Expiry::Live => format!("({now} - (n * 7919) % {DAY_MS})"),
            Expiry::Expired => format!("({now} - {} - (n * 7919) % {DAY_MS})", 2 * DAY_MS),
        };
        let expires = match self {
            Expiry::Live => format!("{created} + {}", 2 * DAY_MS),
            Expiry::Expired => format!("{created} + {DAY_MS}"),
        };
        (created, expires)
    }
}

/// The fingerprint of `POST /orders` with `body`, as the layer (and H) compute it:
/// `(version, digest in hex)`.
fn fingerprint_hex(body: &[u8]) -> Result<(u16, String), BoxError> {
    let (parts, ()) = http::Request::post("/orders")
        .header(CONTENT_TYPE, "application/json")
        .body(())?
        .into_parts();
    let fingerprint = Fingerprinter::json().fingerprint(&parts, body)?;
    let mut hex = String::with_capacity(64);
    for byte in fingerprint.digest() {
        let _ = write!(hex, "{byte:02x}");
    }
    Ok((fingerprint.version(), hex))
}

/// The request body the records part replays (and sends with new keys).
fn order_body() -> Bytes {
    crate::load::order_body("book-scale")
}

fn now_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as i64)
}

/// Rows per transaction of a fill.
const FILL_CHUNK: u64 = 1_000_000;

/// Fills rows `from .. to` into the SQLite database at `path` (no other connection open):
/// `journal_mode=OFF` and a 1 GiB cache while it runs, then WAL again and the file synced.
fn fill_sqlite(path: &FsPath, from: u64, to: u64, expiry: Expiry) -> Result<(), BoxError> {
    let (version, digest) = fingerprint_hex(&order_body())?;
    let (created, expires) = expiry.columns(now_millis());
    let conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(5))?;
    // The store that created the tables closes its connections on its own threads after it
    // is dropped: until then the journal mode cannot change.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let journal = conn.query_row("PRAGMA journal_mode = OFF", [], |row| {
            row.get::<_, String>(0)
        });
        match journal {
            Ok(journal) if journal.eq_ignore_ascii_case("off") => break,
            _ if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Ok(journal) => {
                return Err(format!("filling: SQLite kept journal_mode={journal}").into())
            }
            Err(error) => return Err(error.into()),
        }
    }
    conn.execute_batch("PRAGMA synchronous = OFF; PRAGMA cache_size = -1048576;")?;
    let insert = format!(
        "WITH RECURSIVE s(n) AS (SELECT ?1 UNION ALL SELECT n + 1 FROM s WHERE n + 1 < ?2) \
         INSERT INTO idempotency_records (tenant, operation, idempotency_key, fingerprint, \
         fingerprint_version, status, headers, body, trailers, created_at, expires_at) \
         SELECT 'shop-' || char(97 + n % {TENANTS}), '{OPERATION}', {SQLITE_KEY}, \
         X'{digest}', {version}, 201, {HEADERS_TEXT}, CAST({BODY_TEXT} AS BLOB), NULL, \
         {created}, {expires} FROM s"
    );
    let mut start = from;
    while start < to {
        let end = (start + FILL_CHUNK).min(to);
        conn.execute_batch("BEGIN")?;
        conn.execute(&insert, (start as i64, end as i64))?;
        conn.execute_batch("COMMIT")?;
        start = end;
    }
    let journal: String = conn.query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))?;
    if !journal.eq_ignore_ascii_case("wal") {
        return Err(format!("after filling: SQLite refused WAL (journal_mode={journal})").into());
    }
    drop(conn);
    std::fs::File::open(path)?.sync_all()?;
    Ok(())
}

/// A connection to the PostgreSQL schema of `server`.
async fn pg_connect(url: &str, server: &Server) -> Result<tokio_postgres::Client, BoxError> {
    let database = server.postgres().ok_or("not a PostgreSQL server")?;
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(connection);
    client
        .batch_execute(&format!("SET search_path TO {}", database.schema()))
        .await?;
    Ok(client)
}

/// Fills rows `from .. to` into the records table of `server`'s schema, then `VACUUM
/// ANALYZE`s it.
async fn fill_postgres(
    url: &str,
    server: &Server,
    from: u64,
    to: u64,
    expiry: Expiry,
) -> Result<(), BoxError> {
    let (version, digest) = fingerprint_hex(&order_body())?;
    let (created, expires) = expiry.columns(now_millis());
    let client = pg_connect(url, server).await?;
    let mut start = from;
    while start < to {
        let end = (start + FILL_CHUNK).min(to);
        client
            .batch_execute(&format!(
                "INSERT INTO idempotency_records (tenant, operation, idempotency_key, \
                 fingerprint, fingerprint_version, status, headers, body, trailers, created_at, \
                 expires_at, state) \
                 SELECT 'shop-' || chr(97 + (n % {TENANTS})::int), '{OPERATION}', {PG_KEY}, \
                 '\\x{digest}'::bytea, {version}, 201, {HEADERS_TEXT}, \
                 convert_to({BODY_TEXT}, 'UTF8'), NULL, {created}, {expires}, 'completed' \
                 FROM generate_series({start}::bigint, {}::bigint) AS s(n)",
                end - 1
            ))
            .await?;
        start = end;
    }
    client
        .batch_execute("VACUUM ANALYZE idempotency_records")
        .await?;
    Ok(())
}

/// The size of the SQLite database at `path` (the file and its WAL), in bytes.
fn sqlite_bytes(path: &FsPath) -> u64 {
    let wal = path.with_extension("db-wal");
    [path.to_path_buf(), wal]
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum()
}

/// The size of the records table of `server`'s schema with its indexes and TOAST, in bytes.
async fn pg_bytes(url: &str, server: &Server) -> Result<u64, BoxError> {
    let client = pg_connect(url, server).await?;
    let size: i64 = client
        .query_one("SELECT pg_total_relation_size('idempotency_records')", &[])
        .await?
        .try_get(0)?;
    Ok(u64::try_from(size)?)
}

// ---------------------------------------------------------------------------------------------
// Measuring
// ---------------------------------------------------------------------------------------------

/// One load on one server, measured in rounds.
struct Run {
    server: Arc<Server>,
    workload: Arc<Workload>,
    conns: Vec<Conn>,
    pooled: LoadStats,
    rounds: Vec<f64>,
}

/// What a [`Run`] measured.
#[derive(Clone, Copy, Default)]
struct Figures {
    per_second: f64,
    p50_ms: f64,
    p99_ms: f64,
    requests: u64,
    errors: u64,
}

impl Run {
    /// Connects `concurrency` connections and warms up.
    async fn prepare(
        server: Arc<Server>,
        workload: Workload,
        concurrency: usize,
        options: &Options,
    ) -> Result<Self, BoxError> {
        let workload = Arc::new(workload);
        let conns = connect_all(server.addr, concurrency).await?;
        let (conns, _) = run_load(conns, &workload, Limit::For(options.warmup)).await;
        Ok(Run {
            server,
            workload,
            conns,
            pooled: LoadStats::default(),
            rounds: Vec::new(),
        })
    }

    async fn round(&mut self, duration: Duration) {
        let stats = self.load(duration).await;
        self.record(stats);
    }

    /// A round's load, not yet recorded.
    async fn load(&mut self, duration: Duration) -> LoadStats {
        let conns = std::mem::take(&mut self.conns);
        let (conns, stats) = run_load(conns, &self.workload, Limit::For(duration)).await;
        self.conns = conns;
        stats
    }

    fn record(&mut self, stats: LoadStats) {
        self.rounds.push(stats.requests_per_second());
        self.pooled.merge(stats);
    }

    /// Closes the connections; the figures.
    fn finish(mut self, label: &str) -> (Figures, Arc<Server>) {
        drop(std::mem::take(&mut self.conns));
        if let Some(error) = &self.pooled.first_error {
            eprintln!(
                "  !! {label}: {} unexpected answers, first: {error}",
                self.pooled.errors
            );
        }
        self.pooled.latencies.sort_unstable();
        let figures = Figures {
            per_second: median(&self.rounds),
            p50_ms: percentile_ms(&self.pooled.latencies, 50.0),
            p99_ms: percentile_ms(&self.pooled.latencies, 99.0),
            requests: self.pooled.ok + self.pooled.errors,
            errors: self.pooled.errors,
        };
        (figures, self.server)
    }
}

/// Runs the rounds of `runs`, interleaved (each run's round 1, then each run's round 2, ...).
async fn interleave(runs: &mut [Run], options: &Options, label: &str) {
    for round in 0..options.rounds {
        let mut done = Vec::new();
        for run in runs.iter_mut() {
            run.round(options.duration).await;
            done.push(format!(
                "{:.0}",
                run.rounds.last().copied().unwrap_or_default()
            ));
        }
        eprintln!("  {label} round {}: {} req/s", round + 1, done.join(" / "));
    }
}

/// A range of key numbers for the new keys of one run, never used before in this process
/// (beyond any filled row: PostgreSQL's sizes share one table).
fn new_key_base() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    // 190 ranges of 10 million below 2^31 (see `uuid_key`), more than a run uses.
    200_000_000 + NEXT.fetch_add(1, Ordering::Relaxed) % 190 * 10_000_000
}

// ---------------------------------------------------------------------------------------------
// Records already stored
// ---------------------------------------------------------------------------------------------

/// The loads of the records part: (name, replays?, concurrency).
const RECORD_RUNS: [(&str, bool, usize); 4] = [
    ("new keys c64", false, 64),
    ("replays c64", true, 64),
    ("new keys c1", false, 1),
    ("replays c1", true, 1),
];

/// A records table of one size, served.
struct Sized {
    rows: u64,
    server: Arc<Server>,
    fill_secs: f64,
    bytes: u64,
    /// The empty table's size (the schema and the priming), to count the rows' bytes alone.
    empty_bytes: u64,
    figures: Vec<Figures>,
}

async fn records(
    store: &Store,
    scale: &ScaleOptions,
    options: &Options,
    out: &mut Out,
) -> Result<(), BoxError> {
    let name = store.name();
    let mut sized = Vec::new();
    match store {
        Store::Sqlite(mode) => {
            // Every size its own database, filled before its server starts; measured side by
            // side.
            for &rows in &scale.rows {
                let filled = rows.max(REPLAY_FLOOR);
                eprintln!("scale records {name}: filling {filled} records ...");
                let dir = tempfile::tempdir()?;
                let path = dir.path().join("orders.db");
                drop(create_database(&path, *mode).await?);
                let empty_bytes = sqlite_bytes(&path);
                let started = Instant::now();
                let fill_path = path.clone();
                tokio::task::spawn_blocking(move || {
                    fill_sqlite(&fill_path, 0, filled, Expiry::Live)
                })
                .await??;
                let fill_secs = started.elapsed().as_secs_f64();
                let bytes = sqlite_bytes(&path);
                eprintln!("  filled in {fill_secs:.1} s, {:.1} MiB", mib(bytes));
                let server = Arc::new(Server::start_in(dir, *mode).await?);
                sized.push(Sized {
                    rows,
                    server,
                    fill_secs,
                    bytes,
                    empty_bytes,
                    figures: Vec::new(),
                });
            }
            measure_sizes(&mut sized, options, &name).await?;
            let servers: Vec<Arc<Server>> = sized.iter().map(|s| s.server.clone()).collect();
            let plain: Vec<SizedFigures> = sized.into_iter().map(SizedFigures::from).collect();
            for server in servers {
                shut_down(server).await?;
            }
            print_records(&name, &plain, out);
        }
        Store::Postgres(url) => {
            // One schema, filled up to each size in turn, measured after each fill.
            let schema = format!("bench_scale_{}", std::process::id());
            let server = Arc::new(Server::start_postgres(url, &schema).await?);
            let empty_bytes = pg_bytes(url, &server).await?;
            let mut filled = 0;
            for &rows in &scale.rows {
                let target = rows.max(REPLAY_FLOOR);
                eprintln!("scale records {name}: filling up to {target} records ...");
                let started = Instant::now();
                fill_postgres(url, &server, filled, target, Expiry::Live).await?;
                let fill_secs = started.elapsed().as_secs_f64();
                filled = target;
                let bytes = pg_bytes(url, &server).await?;
                eprintln!("  filled in {fill_secs:.1} s, {:.1} MiB", mib(bytes));
                let mut one = vec![Sized {
                    rows,
                    server: server.clone(),
                    fill_secs,
                    bytes,
                    empty_bytes,
                    figures: Vec::new(),
                }];
                measure_sizes(&mut one, options, &name).await?;
                sized.extend(one);
            }
            // The sizes hold clones of the one server: let them go before shutting it down.
            let plain: Vec<SizedFigures> = sized.into_iter().map(SizedFigures::from).collect();
            shut_down(server).await?;
            print_records(&name, &plain, out);
        }
    }
    Ok(())
}

/// A size's figures, its server let go.
struct SizedFigures {
    rows: u64,
    fill_secs: f64,
    bytes: u64,
    empty_bytes: u64,
    figures: Vec<Figures>,
}

impl From<Sized> for SizedFigures {
    fn from(size: Sized) -> Self {
        SizedFigures {
            rows: size.rows,
            fill_secs: size.fill_secs,
            bytes: size.bytes,
            empty_bytes: size.empty_bytes,
            figures: size.figures,
        }
    }
}

/// The loads of [`RECORD_RUNS`] on every size, each load's rounds interleaved across sizes.
async fn measure_sizes(sized: &mut [Sized], options: &Options, name: &str) -> Result<(), BoxError> {
    for &(load, replays, concurrency) in &RECORD_RUNS {
        let mut runs = Vec::with_capacity(sized.len());
        for size in sized.iter() {
            let workload = if replays {
                Workload::ReplayKeyed {
                    body: order_body(),
                    count: size.rows.max(REPLAY_FLOOR) / TENANTS,
                    key: shop_a_key,
                }
            } else {
                Workload::CreateKeyed {
                    path: "/orders",
                    body: order_body(),
                    next: AtomicU64::new(new_key_base()),
                    key: uuid_key,
                }
            };
            runs.push(Run::prepare(size.server.clone(), workload, concurrency, options).await?);
        }
        let sizes: Vec<String> = sized.iter().map(|s| rows_label(s.rows)).collect();
        interleave(
            &mut runs,
            options,
            &format!("records {name} {load} ({})", sizes.join(" / ")),
        )
        .await;
        for (run, size) in runs.into_iter().zip(sized.iter_mut()) {
            let (figures, _) = run.finish(&format!("records {name} {load} {}", size.rows));
            size.figures.push(figures);
        }
    }
    Ok(())
}

fn print_records(name: &str, sized: &[SizedFigures], out: &mut Out) {
    println!();
    println!(
        "Records already stored, {name}: new keys and replays through the layer \
         (req/s: median of the rounds; p50/p99 ms over all rounds)"
    );
    println!(
        "{:>10} {:>7} {:>9} {:>9} {:>11} {:>11} {:>15} {:>15} {:>7}",
        "records",
        "fill s",
        "db MiB",
        "MiB/1M",
        "new c64/s",
        "replay c64/s",
        "new c1 p50/p99",
        "replay c1 p50/p99",
        "errors"
    );
    let part = Part::Records;
    for size in sized {
        let per_million = (size.rows > 0)
            .then(|| size.bytes.saturating_sub(size.empty_bytes) as f64 / size.rows as f64 * 1e6);
        let f = &size.figures;
        let get = |i: usize| f.get(i).copied().unwrap_or_default();
        let errors: u64 = f.iter().map(|f| f.errors).sum();
        println!(
            "{:>10} {:>7.1} {:>9.1} {:>9} {:>11.0} {:>11.0} {:>15} {:>15} {:>7}",
            size.rows,
            size.fill_secs,
            mib(size.bytes),
            per_million.map_or_else(|| "-".to_owned(), |b| format!("{:.1}", mib(b as u64))),
            get(0).per_second,
            get(1).per_second,
            format!("{:.2}/{:.2}", get(2).p50_ms, get(2).p99_ms),
            format!("{:.2}/{:.2}", get(3).p50_ms, get(3).p99_ms),
            errors
        );
        out.line(
            part,
            name,
            "fill",
            size.rows,
            "seconds",
            size.fill_secs,
            "s",
        );
        out.line(
            part,
            name,
            "database",
            size.rows,
            "size",
            size.bytes as f64,
            "bytes",
        );
        if let Some(bytes) = per_million {
            out.line(
                part,
                name,
                "database",
                size.rows,
                "size_per_million_records",
                bytes,
                "bytes",
            );
        }
        for (&(load, _, _), figures) in RECORD_RUNS.iter().zip(f) {
            out.line(
                part,
                name,
                load,
                size.rows,
                "requests_per_s",
                figures.per_second,
                "req/s",
            );
            out.line(part, name, load, size.rows, "p50", figures.p50_ms, "ms");
            out.line(part, name, load, size.rows, "p99", figures.p99_ms, "ms");
            out.line(
                part,
                name,
                load,
                size.rows,
                "requests",
                figures.requests as f64,
                "count",
            );
            out.line(
                part,
                name,
                load,
                size.rows,
                "errors",
                figures.errors as f64,
                "count",
            );
        }
    }
    if sized.iter().any(|s| s.rows > 0) {
        println!("  (the 0 point holds {REPLAY_FLOOR} records, 1,000 per tenant, to replay)");
    }
    let Some(empty) = sized.first() else {
        return;
    };
    for size in sized.iter().skip(1) {
        let at = rows_label(size.rows);
        let base = rows_label(empty.rows);
        for (i, &(load, _, concurrency)) in RECORD_RUNS.iter().enumerate() {
            let (Some(big), Some(small)) = (size.figures.get(i), empty.figures.get(i)) else {
                continue;
            };
            if concurrency > 1 {
                out.goal(
                    format!("{name} {load}, {at} / {base} records: req/s"),
                    big.per_second / small.per_second,
                    0.8,
                    true,
                    format!("{:.0} vs {:.0} req/s", big.per_second, small.per_second),
                );
            } else {
                out.goal(
                    format!("{name} {load}, {at} / {base} records: p99"),
                    big.p99_ms / small.p99_ms,
                    1.5,
                    false,
                    format!("{:.2} vs {:.2} ms", big.p99_ms, small.p99_ms),
                );
            }
        }
    }
}

fn rows_label(rows: u64) -> String {
    match rows {
        0 => "0".to_owned(),
        n if n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        n if n % 1_000 == 0 => format!("{}k", n / 1_000),
        n => n.to_string(),
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

async fn shut_down(server: Arc<Server>) -> Result<(), BoxError> {
    match Arc::try_unwrap(server) {
        Ok(server) => server.shut_down().await,
        Err(_) => Err("a scale server is still shared at its shutdown".into()),
    }
}

// ---------------------------------------------------------------------------------------------
// Purging while serving
// ---------------------------------------------------------------------------------------------

/// Records per purge transaction (the batch of `continuously_purge_expired`'s example).
const PURGE_BATCH: usize = 200;

/// The load's windows: short, so that the purge's end is seen within one.
const WINDOW: Duration = Duration::from_millis(250);

/// The longest a purge may take before the part gives up waiting.
const PURGE_LIMIT: Duration = Duration::from_secs(30 * 60);

async fn purge(
    store: &Store,
    scale: &ScaleOptions,
    options: &Options,
    out: &mut Out,
) -> Result<(), BoxError> {
    let name = store.name();
    let rows = scale.purge_rows;
    eprintln!("scale purge {name}: filling {rows} expired records ...");
    let started = Instant::now();
    let server = match store {
        Store::Sqlite(mode) => {
            let dir = tempfile::tempdir()?;
            let path = dir.path().join("orders.db");
            drop(create_database(&path, *mode).await?);
            let fill_path = path.clone();
            tokio::task::spawn_blocking(move || fill_sqlite(&fill_path, 0, rows, Expiry::Expired))
                .await??;
            Server::start_in(dir, *mode).await?
        }
        Store::Postgres(url) => {
            let schema = format!("bench_purge_{}", std::process::id());
            let server = Server::start_postgres(url, &schema).await?;
            fill_postgres(url, &server, 0, rows, Expiry::Expired).await?;
            server
        }
    };
    eprintln!("  filled in {:.1} s", started.elapsed().as_secs_f64());
    let server = Arc::new(server);
    let workload = Workload::CreateKeyed {
        path: "/orders",
        body: order_body(),
        next: AtomicU64::new(new_key_base()),
        key: uuid_key,
    };
    let mut run = Run::prepare(server.clone(), workload, 16, options).await?;
    let quiet = options.duration * options.rounds as u32;

    let mut without = LoadStats::default();
    let before = windows(&mut run, quiet, || false).await;
    let before_rate = before.requests_per_second();
    without.merge(before);
    let mut without_elapsed = quiet;

    eprintln!("  purging {rows} expired records in batches of {PURGE_BATCH} under c16 ...");
    let done = Arc::new(AtomicBool::new(false));
    let purge_started = Instant::now();
    let task = {
        let done = done.clone();
        let sqlite = server.sqlite_store().cloned();
        let postgres = server.postgres().map(|db| db.state.store.clone());
        tokio::spawn(async move {
            let purged = match (sqlite, postgres) {
                (Some(store), _) => Admin::new(store).purge_expired(PURGE_BATCH).await,
                (None, Some(store)) => Admin::new(store).purge_expired(PURGE_BATCH).await,
                (None, None) => Ok(0),
            };
            let elapsed = purge_started.elapsed();
            done.store(true, Ordering::SeqCst);
            (purged, elapsed)
        })
    };
    let during = windows(&mut run, PURGE_LIMIT, || done.load(Ordering::SeqCst)).await;
    let finished = done.load(Ordering::SeqCst);
    let (purged, purge_elapsed) = if finished {
        let (purged, elapsed) = task.await?;
        (
            purged.map_err(|e| format!("the purge failed: {e}"))?,
            elapsed,
        )
    } else {
        task.abort();
        (0, purge_started.elapsed())
    };

    let after = windows(&mut run, quiet, || false).await;
    let after_rate = after.requests_per_second();
    without.merge(after);
    without_elapsed += quiet;
    without.elapsed = without_elapsed;
    drop(run.finish(&format!("purge {name}")));
    shut_down(server).await?;

    let mut without_latencies = std::mem::take(&mut without.latencies);
    without_latencies.sort_unstable();
    let mut during_latencies = during.latencies.clone();
    during_latencies.sort_unstable();
    let (base_rate, base_p99) = (
        without.requests_per_second(),
        percentile_ms(&without_latencies, 99.0),
    );
    let (rate, p99) = (
        during.requests_per_second(),
        percentile_ms(&during_latencies, 99.0),
    );
    let purge_rate = purged as f64 / purge_elapsed.as_secs_f64().max(1e-9);
    println!();
    println!(
        "Purging while serving, {name}: {rows} expired records, Admin::purge_expired in \
         batches of {PURGE_BATCH}, new keys at c16"
    );
    println!(
        "  {:<40} {:>9} {:>8} {:>8} {:>9} {:>7}",
        "load", "req/s", "p50 ms", "p99 ms", "requests", "errors"
    );
    let print = |label: &str, stats: &LoadStats, sorted: &[u32], rate: f64| {
        println!(
            "  {label:<40} {rate:>9.0} {:>8.2} {:>8.2} {:>9} {:>7}",
            percentile_ms(sorted, 50.0),
            percentile_ms(sorted, 99.0),
            stats.ok + stats.errors,
            stats.errors
        );
    };
    print(
        &format!("without a purge (before {before_rate:.0}, after {after_rate:.0})"),
        &without,
        &without_latencies,
        base_rate,
    );
    print("while purging", &during, &during_latencies, rate);
    println!(
        "  purge: {purged} of {rows} records in {:.1} s, {purge_rate:.0} records/s{}",
        purge_elapsed.as_secs_f64(),
        if finished {
            ""
        } else {
            " (NOT finished: gave up waiting)"
        }
    );
    let part = Part::Purge;
    for (variant, stats, sorted, rate) in [
        ("without a purge", &without, &without_latencies, base_rate),
        ("while purging", &during, &during_latencies, rate),
    ] {
        out.line(part, &name, variant, 16, "requests_per_s", rate, "req/s");
        out.line(
            part,
            &name,
            variant,
            16,
            "p50",
            percentile_ms(sorted, 50.0),
            "ms",
        );
        out.line(
            part,
            &name,
            variant,
            16,
            "p99",
            percentile_ms(sorted, 99.0),
            "ms",
        );
        out.line(
            part,
            &name,
            variant,
            16,
            "errors",
            stats.errors as f64,
            "count",
        );
    }
    out.line(
        part,
        &name,
        "purge",
        rows,
        "purged",
        purged as f64,
        "records",
    );
    out.line(
        part,
        &name,
        "purge",
        rows,
        "seconds",
        purge_elapsed.as_secs_f64(),
        "s",
    );
    out.line(part, &name, "purge", rows, "rate", purge_rate, "records/s");
    out.goal(
        format!("{name} c16 new keys while purging / without: req/s"),
        rate / base_rate,
        0.8,
        true,
        format!("{rate:.0} vs {base_rate:.0} req/s"),
    );
    out.goal(
        format!("{name} c16 new keys while purging / without: p99"),
        p99 / base_p99,
        2.0,
        false,
        format!("{p99:.2} vs {base_p99:.2} ms"),
    );
    out.goal(
        format!(
            "{name} purge of {} expired records finished",
            rows_label(rows)
        ),
        purged as f64 / rows as f64,
        1.0,
        true,
        format!(
            "{purged} in {:.1} s, {purge_rate:.0} records/s",
            purge_elapsed.as_secs_f64()
        ),
    );
    Ok(())
}

/// Runs `run`'s load in [`WINDOW`]s until `limit` has passed or `stop` says so; the pooled
/// stats, `elapsed` their total.
async fn windows(run: &mut Run, limit: Duration, stop: impl Fn() -> bool) -> LoadStats {
    let started = Instant::now();
    let mut pooled = LoadStats::default();
    while started.elapsed() < limit && !stop() {
        let conns = std::mem::take(&mut run.conns);
        let (conns, stats) = run_load(conns, &run.workload, Limit::For(WINDOW)).await;
        run.conns = conns;
        pooled.merge(stats);
    }
    pooled.elapsed = started.elapsed();
    pooled
}

// ---------------------------------------------------------------------------------------------
// Body size
// ---------------------------------------------------------------------------------------------

const BODY_SIZES: [usize; 3] = [1024, 64 * 1024, 1024 * 1024];

/// The in-flight requests of the memory measurement.
const MEMORY_CONCURRENCY: usize = 16;

/// An order of exactly `size` bytes of JSON: line items (objects of a few members each, so
/// that canonicalization sorts keys) and a note to pad.
fn json_body(size: usize) -> Bytes {
    let mut body = String::with_capacity(size);
    body.push_str(r#"{"sku":"book-body","quantity":1,"items":["#);
    let tail = r#"],"note":""}"#;
    let mut i = 0;
    loop {
        let item = format!(
            r#"{}{{"sku":"sku-{i:05}","quantity":{},"price_cents":{},"gift":false}}"#,
            if i == 0 { "" } else { "," },
            1 + i % 5,
            100 + i * 7 % 9900
        );
        if body.len() + item.len() + tail.len() > size {
            break;
        }
        body.push_str(&item);
        i += 1;
    }
    body.push_str(r#"],"note":""#);
    while body.len() + 2 < size {
        body.push('x');
    }
    body.push_str(r#""}"#);
    Bytes::from(body)
}

async fn body(mode: Mode, options: &Options, out: &mut Out) -> Result<(), BoxError> {
    let name = format!("SQLite {}", mode.name());
    let server = Arc::new(Server::start(mode).await?);
    let routes = [("layer", "/orders"), ("H", "/hand/orders")];
    println!();
    println!(
        "Body size, {name}: JSON orders through the layer and through H (the same fingerprint \
         and record): server CPU per request at c1 (summed over the rounds); heap per in-flight request at c{MEMORY_CONCURRENCY} (peak of the server's live \
         heap over the idle level, / {MEMORY_CONCURRENCY})"
    );
    println!(
        "  {:>8} {:<6} {:>9} {:>10} {:>9} {:>14} {:>9} {:>7}",
        "body", "route", "c1 req/s", "srv us/req", "x H", "heap/in-flight", "x body", "errors"
    );
    for size in BODY_SIZES {
        let body = json_body(size);
        debug_assert_eq!(body.len(), size);
        eprintln!("scale body {name}: {} KiB ...", size / 1024);
        // CPU at c1, the two routes' rounds interleaved.
        let mut runs = Vec::new();
        for (_, path) in routes {
            let workload = Workload::CreateKeyed {
                path,
                body: body.clone(),
                next: AtomicU64::new(new_key_base()),
                key: uuid_key,
            };
            runs.push(Run::prepare(server.clone(), workload, 1, options).await?);
        }
        let mut cpu = [Duration::ZERO; 2];
        for round in 0..options.rounds {
            for (i, run) in runs.iter_mut().enumerate() {
                let before = CpuSample::now(&[]);
                run.round(options.duration).await;
                if let (Some(before), Some(after)) = (before, CpuSample::now(&[])) {
                    cpu[i] += before.until(&after).server;
                }
            }
            eprintln!(
                "  body {} KiB round {}: layer {:.0}, H {:.0} req/s",
                size / 1024,
                round + 1,
                runs[0].rounds.last().copied().unwrap_or_default(),
                runs[1].rounds.last().copied().unwrap_or_default()
            );
        }
        let mut measured = Vec::new();
        for (i, run) in runs.into_iter().enumerate() {
            let (figures, _) = run.finish(&format!("body {} KiB {}", size / 1024, routes[i].0));
            let per_request = cpu[i].as_secs_f64() * 1e6 / figures.requests.max(1) as f64;
            measured.push((figures, per_request));
        }
        // Heap per in-flight request at c16, one route after the other.
        let mut heap = Vec::new();
        for (_, path) in routes {
            let workload = Workload::CreateKeyed {
                path,
                body: body.clone(),
                next: AtomicU64::new(new_key_base()),
                key: uuid_key,
            };
            let mut run =
                Run::prepare(server.clone(), workload, MEMORY_CONCURRENCY, options).await?;
            let idle = crate::alloc::reset_peak();
            let stats = run.load(options.duration).await;
            // Before the round's latencies are merged on this thread.
            let extra = (crate::alloc::peak_bytes() - idle) as f64;
            run.record(stats);
            let (figures, _) = run.finish(&format!("body {} KiB heap", size / 1024));
            heap.push((extra / MEMORY_CONCURRENCY as f64, figures.errors));
        }
        let part = Part::Body;
        let x = size as u64;
        for (i, (route, _)) in routes.iter().enumerate() {
            let (figures, cpu_us) = measured[i];
            let (per_flight, heap_errors) = heap[i];
            println!(
                "  {:>6}Ki {:<6} {:>9.0} {:>10.0} {:>9.2} {:>14.0} {:>9.2} {:>7}",
                size / 1024,
                route,
                figures.per_second,
                cpu_us,
                cpu_us / measured[1].1,
                per_flight,
                per_flight / size as f64,
                figures.errors + heap_errors
            );
            out.line(
                part,
                &name,
                route,
                x,
                "requests_per_s_c1",
                figures.per_second,
                "req/s",
            );
            out.line(
                part,
                &name,
                route,
                x,
                "server_cpu_per_request",
                cpu_us,
                "us",
            );
            out.line(
                part,
                &name,
                route,
                x,
                "heap_per_in_flight_request",
                per_flight,
                "bytes",
            );
            out.line(
                part,
                &name,
                route,
                x,
                "errors",
                (figures.errors + heap_errors) as f64,
                "count",
            );
        }
        let (layer_cpu, hand_cpu) = (measured[0].1, measured[1].1);
        out.goal(
            format!(
                "{name} {} KiB body: server CPU per request, layer / H",
                size / 1024
            ),
            layer_cpu / hand_cpu,
            1.2,
            false,
            format!("{layer_cpu:.0} vs {hand_cpu:.0} us"),
        );
        let (layer_heap, hand_heap) = (heap[0].0, heap[1].0);
        out.goal(
            format!(
                "{name} {} KiB body: heap per in-flight request, layer over H, in bodies",
                size / 1024
            ),
            (layer_heap - hand_heap) / size as f64,
            1.2,
            false,
            format!("{layer_heap:.0} vs {hand_heap:.0} bytes"),
        );
    }
    shut_down(server).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Concurrency
// ---------------------------------------------------------------------------------------------

const LEVELS: [usize; 5] = [1, 16, 64, 256, 1024];

async fn concurrency(store: &Store, options: &Options, out: &mut Out) -> Result<(), BoxError> {
    let name = store.name();
    let server = Arc::new(match store {
        Store::Sqlite(mode) => Server::start(*mode).await?,
        Store::Postgres(url) => {
            let schema = format!("bench_conc_{}", std::process::id());
            Server::start_postgres(url, &schema).await?
        }
    });
    eprintln!(
        "scale concurrency {name}: connecting {} connections ...",
        LEVELS.iter().sum::<usize>()
    );
    let mut runs = Vec::new();
    for &level in &LEVELS {
        let workload = Workload::CreateKeyed {
            path: "/orders",
            body: order_body(),
            next: AtomicU64::new(new_key_base()),
            key: uuid_key,
        };
        runs.push(Run::prepare(server.clone(), workload, level, options).await?);
    }
    let levels: Vec<String> = LEVELS.iter().map(|c| format!("c{c}")).collect();
    interleave(
        &mut runs,
        options,
        &format!("concurrency {name} ({})", levels.join(" / ")),
    )
    .await;
    let mut figures = Vec::new();
    for (run, &level) in runs.into_iter().zip(&LEVELS) {
        figures.push(run.finish(&format!("concurrency {name} c{level}")).0);
    }
    shut_down(server).await?;
    println!();
    println!("Concurrency, {name}: new keys through the layer, rounds interleaved across levels");
    println!(
        "  {:>5} {:>9} {:>8} {:>8} {:>9} {:>7}",
        "c", "req/s", "p50 ms", "p99 ms", "requests", "errors"
    );
    let part = Part::Concurrency;
    for (f, &level) in figures.iter().zip(&LEVELS) {
        println!(
            "  {level:>5} {:>9.0} {:>8.2} {:>8.2} {:>9} {:>7}",
            f.per_second, f.p50_ms, f.p99_ms, f.requests, f.errors
        );
        let c = level as u64;
        out.line(
            part,
            &name,
            "new keys",
            c,
            "requests_per_s",
            f.per_second,
            "req/s",
        );
        out.line(part, &name, "new keys", c, "p50", f.p50_ms, "ms");
        out.line(part, &name, "new keys", c, "p99", f.p99_ms, "ms");
        out.line(
            part,
            &name,
            "new keys",
            c,
            "requests",
            f.requests as f64,
            "count",
        );
        out.line(
            part,
            &name,
            "new keys",
            c,
            "errors",
            f.errors as f64,
            "count",
        );
    }
    let at = |level: usize| LEVELS.iter().position(|&c| c == level).map(|i| figures[i]);
    if let (Some(top), Some(c64)) = (at(1024), at(64)) {
        out.goal(
            format!("{name} new keys c1024 / c64: req/s"),
            top.per_second / c64.per_second,
            0.8,
            true,
            format!(
                "{:.0} vs {:.0} req/s, p99 {:.1} vs {:.1} ms",
                top.per_second, c64.per_second, top.p99_ms, c64.p99_ms
            ),
        );
    }
    let errors: u64 = figures.iter().map(|f| f.errors).sum();
    out.goal(
        format!("{name} new keys c1..c1024: errors"),
        errors as f64,
        0.0,
        false,
        format!(
            "{} requests",
            figures.iter().map(|f| f.requests).sum::<u64>()
        ),
    );
    Ok(())
}
