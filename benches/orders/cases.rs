//! The measurements of the table: a case's rounds at one concurrency, interleaved with the
//! other cases' rounds, the order check after each case, and the ceiling E (no HTTP).

use std::net::SocketAddr;
use std::path::Path as FsPath;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::json;
use tower_idempotency::store::sqlite::rusqlite::{self, Connection, OptionalExtension};

use crate::cli::{Case, Mode, Options};
use crate::cpu::{CpuSample, CpuUsed};
use crate::load::{connect_all, order_body, run_load, Conn, Limit, LoadStats, Workload};
use crate::servers::{create_database, open_connection, prime_wal, Server, INSERT_ORDER};
use crate::BoxError;

/// One row of the table.
#[derive(Clone, Debug)]
pub(crate) struct Row {
    pub(crate) case: Case,
    pub(crate) mode: Mode,
    pub(crate) concurrency: usize,
    /// Requests per second of each round.
    pub(crate) rounds: Vec<f64>,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) requests: u64,
    pub(crate) errors: u64,
    /// The server's CPU time per request over the measured rounds, in microseconds: every
    /// thread of this process but the load generator's (executor, SQLite writer, blocking
    /// pool). `None` where it cannot be read (`/proc`).
    pub(crate) cpu_us: Option<f64>,
    /// The load generator's CPU time per request, in microseconds.
    pub(crate) client_cpu_us: Option<f64>,
    /// The PostgreSQL backends' CPU time per request, in microseconds (PostgreSQL only).
    pub(crate) db_cpu_us: Option<f64>,
    /// What the order count check found wrong, if anything.
    pub(crate) integrity: Option<String>,
}

impl Row {
    pub(crate) fn median(&self) -> f64 {
        median(&self.rounds)
    }
}

/// The median of `values` (0 for none).
pub(crate) fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The nearest-rank percentile of latencies in microseconds, in milliseconds.
pub(crate) fn percentile_ms(sorted_micros: &[u32], percentile: f64) -> f64 {
    if sorted_micros.is_empty() {
        return 0.0;
    }
    let rank = (percentile / 100.0 * sorted_micros.len() as f64).ceil() as usize;
    f64::from(sorted_micros[rank.clamp(1, sorted_micros.len()) - 1]) / 1000.0
}

/// The keys case B replays, created (over HTTP, through the layer) before it starts.
const REPLAY_KEYS: u64 = 1000;

/// The most connections [`replay_workload`] creates its keys over.
const SETUP_CONNECTIONS: usize = 16;

/// Creates [`REPLAY_KEYS`] orders under keys `prefix`0.. over `connections` connections and
/// returns the workload that replays them, with how many orders it created.
///
/// Give it the concurrency of the case: the setup leaves the store's pools as large as the
/// connections it used, and a PostgreSQL pool hands out its idle connections in turn, so a
/// setup wider than the case would make case A (which shares the store) rotate over more
/// backends than H's pool has, at c=1 over 16 instead of one.
pub(crate) async fn replay_workload(
    addr: SocketAddr,
    connections: usize,
    prefix: &str,
    sku: &str,
) -> Result<(Workload, i64), BoxError> {
    let setup = connect_all(addr, connections.clamp(1, SETUP_CONNECTIONS)).await?;
    let create = Arc::new(Workload::create("/orders", prefix, sku));
    let (setup, stats) = run_load(setup, &create, Limit::Requests(REPLAY_KEYS)).await;
    drop(setup);
    if stats.errors > 0 {
        return Err(format!(
            "creating the keys to replay failed: {}",
            stats.first_error.unwrap_or_default()
        )
        .into());
    }
    let replays = Workload::Replay {
        prefix: prefix.into(),
        count: REPLAY_KEYS,
        body: order_body(sku),
    };
    Ok((replays, stats.fresh as i64))
}
/// The orders case R reads, inserted before it starts.
pub(crate) const READ_ORDERS: u64 = 1000;

/// A case being measured at one concurrency, its rounds interleaved with other cases'.
struct CaseRun {
    case: Case,
    mode: Mode,
    concurrency: usize,
    server: Arc<Server>,
    workload: Arc<Workload>,
    sku: String,
    conns: Vec<Conn>,
    /// Orders that must be committed: the setup's plus one per fresh 201.
    expected_orders: i64,
    pooled: LoadStats,
    rounds: Vec<f64>,
    cpu: Option<CpuUsed>,
    problems: Vec<String>,
}

impl CaseRun {
    /// Sets the case up on `server` (creates the keys to replay, the orders to read), connects
    /// and warms up.
    async fn prepare(
        case: Case,
        mode: Mode,
        concurrency: usize,
        server: Arc<Server>,
        options: &Options,
    ) -> Result<Self, BoxError> {
        let sku = format!("book-{}", case.name());
        let prefix = format!("{}-{concurrency}-", case.name().to_ascii_lowercase());
        let mut expected_orders = 0i64;
        let workload = Arc::new(match case {
            Case::A => Workload::create("/orders", &prefix, &sku),
            Case::B => {
                let (replays, created) =
                    replay_workload(server.addr, concurrency, &prefix, &sku).await?;
                expected_orders += created;
                replays
            }
            Case::C => Workload::Mixed {
                prefix,
                retry_percent: 10,
                next: AtomicU64::new(0),
                body: order_body(&sku),
            },
            Case::D => Workload::create("/baseline/orders", &prefix, &sku),
            Case::H => Workload::create("/hand/orders", &prefix, &sku),
            Case::ReservationA => Workload::create("/reservation/orders", &prefix, &sku),
            // The sqlx SQLite server has the same paths as the PostgreSQL one.
            Case::SqlxA | Case::SqlxSqliteA => Workload::create("/sqlx/orders", &prefix, &sku),
            Case::SqlxH | Case::SqlxSqliteH => Workload::create("/sqlx/hand/orders", &prefix, &sku),
            Case::R => {
                let sku: &'static str = "book-R";
                let first = server.insert_orders(sku, READ_ORDERS).await?;
                expected_orders += READ_ORDERS as i64;
                Workload::Read {
                    first,
                    count: READ_ORDERS,
                }
            }
            Case::E => return Err("case E does not run over HTTP".into()),
        });
        let mut problems = Vec::new();
        if let Some(problem) = server.check_orders(&sku, expected_orders).await? {
            problems.push(format!("after the setup: {problem}"));
        }
        let conns = connect_all(server.addr, concurrency).await?;
        let (conns, warmup) = run_load(conns, &workload, Limit::For(options.warmup)).await;
        expected_orders += warmup.fresh as i64;
        Ok(CaseRun {
            case,
            mode,
            concurrency,
            server,
            workload,
            sku,
            conns,
            expected_orders,
            pooled: LoadStats::default(),
            rounds: Vec::with_capacity(options.rounds),
            cpu: Some(CpuUsed::default()),
            problems,
        })
    }

    fn label(&self) -> String {
        format!(
            "{} {} c={}",
            self.case.name(),
            self.mode.name(),
            self.concurrency
        )
    }

    /// One measured round.
    async fn round(&mut self, options: &Options) {
        let backends = self.server.backends().await;
        let before = CpuSample::now(&backends);
        let conns = std::mem::take(&mut self.conns);
        let (conns, stats) = run_load(conns, &self.workload, Limit::For(options.duration)).await;
        let after = CpuSample::now(&backends);
        self.conns = conns;
        match (before, after, &mut self.cpu) {
            (Some(before), Some(after), Some(cpu)) => cpu.add(before.until(&after)),
            _ => self.cpu = None,
        }
        self.rounds.push(stats.requests_per_second());
        self.expected_orders += stats.fresh as i64;
        self.pooled.merge(stats);
    }

    /// Closes the connections, checks the orders and makes the row; returns the server.
    async fn finish(mut self) -> Result<(Row, Arc<Server>), BoxError> {
        let label = self.label();
        drop(std::mem::take(&mut self.conns));
        // Every fresh 201 must have its order committed by the time the client has it (the
        // commit comes before the response), and nothing else may have created one.
        if let Some(problem) = self
            .server
            .check_orders(&self.sku, self.expected_orders)
            .await?
        {
            self.problems.push(format!("after the load: {problem}"));
        }
        if let Some(error) = &self.pooled.first_error {
            eprintln!(
                "  !! {label}: {} unexpected answers, first: {error}",
                self.pooled.errors
            );
        }
        if !self.problems.is_empty() {
            eprintln!("  !! {label}: {}", self.problems.join("; "));
        }
        let mut pooled = self.pooled;
        pooled.latencies.sort_unstable();
        let requests = pooled.ok + pooled.errors;
        let per_request =
            |used: Duration| (requests > 0).then(|| used.as_secs_f64() * 1e6 / requests as f64);
        let row = Row {
            case: self.case,
            mode: self.mode,
            concurrency: self.concurrency,
            rounds: self.rounds,
            p50_ms: percentile_ms(&pooled.latencies, 50.0),
            p99_ms: percentile_ms(&pooled.latencies, 99.0),
            requests,
            errors: pooled.errors,
            cpu_us: self.cpu.and_then(|cpu| per_request(cpu.server)),
            client_cpu_us: self.cpu.and_then(|cpu| per_request(cpu.client)),
            db_cpu_us: self
                .cpu
                .filter(|_| self.mode == Mode::Postgres)
                .and_then(|cpu| per_request(cpu.database)),
            integrity: (!self.problems.is_empty()).then(|| self.problems.join("; ")),
        };
        Ok((row, self.server))
    }
}

/// Measures the `(mode, case)` pairs at one concurrency, their rounds interleaved (A, B, ...,
/// then A, B, ... again) so that a slow spell of a shared machine falls on every case alike.
/// SQLite cases get a server and a fresh database each; PostgreSQL cases share one server and
/// one fresh schema (each case orders its own SKU).
pub(crate) async fn run_interleaved(
    pairs: &[(Mode, Case)],
    concurrency: usize,
    options: &Options,
) -> Result<Vec<Row>, BoxError> {
    let mut shared: Option<Arc<Server>> = None;
    let mut runs = Vec::with_capacity(pairs.len());
    // The read baseline's orders first, so that their ids are dense where cases share tables.
    let mut ordered = pairs.to_vec();
    ordered.sort_by_key(|&(_, case)| case != Case::R);
    for &(mode, case) in &ordered {
        eprintln!(
            "preparing {} {} c={concurrency} ...",
            case.name(),
            mode.name()
        );
        let server = match (mode, &shared, &options.database_url) {
            (Mode::Postgres, Some(server), _) => server.clone(),
            (Mode::Postgres, None, Some(url)) => {
                let schema = format!("bench_{}_c{concurrency}", std::process::id());
                let server = Arc::new(Server::start_postgres(url, &schema).await?);
                shared = Some(server.clone());
                server
            }
            (Mode::Postgres, None, None) => return Err("PostgreSQL needs --database-url".into()),
            _ if case.is_sqlx_sqlite() => Arc::new(Server::start_sqlx_sqlite(mode).await?),
            _ => Arc::new(Server::start(mode).await?),
        };
        runs.push(CaseRun::prepare(case, mode, concurrency, server, options).await?);
    }
    // Back in the order asked for.
    runs.sort_by_key(|run| (run.mode, run.case));
    // The store's writer gives way to another writer of its file for a second after it last
    // saw one commit (the baseline connections primed the WAL): let that pass.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    for round in 0..options.rounds {
        for run in &mut runs {
            run.round(options).await;
            eprintln!(
                "  {} round {}: {:.0} req/s",
                run.label(),
                round + 1,
                run.rounds.last().copied().unwrap_or_default()
            );
        }
    }
    let mut rows = Vec::with_capacity(runs.len());
    let mut servers = Vec::new();
    for run in runs {
        let (row, server) = run.finish().await?;
        rows.push(row);
        servers.push(server);
    }
    drop(shared);
    for server in servers {
        if let Ok(server) = Arc::try_unwrap(server) {
            server.shut_down().await?;
        }
    }
    Ok(rows)
}

/// Case E: check the record, insert the order, its event and the record, commit; on one
/// thread.
pub(crate) async fn run_ceiling(mode: Mode, options: &Options) -> Result<Row, BoxError> {
    // The store creates the records table; then it is closed and a bare connection takes over.
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("orders.db");
    drop(create_database(&path, mode).await?);
    let options = options.clone();
    let row = tokio::task::spawn_blocking(move || ceiling_loop(&path, mode, &options)).await??;
    drop(dir);
    Ok(row)
}

fn ceiling_loop(path: &FsPath, mode: Mode, options: &Options) -> Result<Row, BoxError> {
    let mut conn = open_connection(path, mode)?;
    prime_wal(&conn, mode)?;
    let mut n: u64 = 0;
    let mut one = |conn: &mut Connection| -> Result<(), BoxError> {
        let key = format!("e-{n}");
        n += 1;
        let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as i64;
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        let existing: Option<Vec<u8>> = tx
            .prepare_cached(
                "SELECT fingerprint FROM idempotency_records \
                 WHERE tenant = ?1 AND operation = ?2 AND idempotency_key = ?3",
            )?
            .query_row(("shop-a", "create_order", &key), |row| row.get(0))
            .optional()?;
        if existing.is_some() {
            return Err("a fresh key already has a record".into());
        }
        tx.prepare_cached(INSERT_ORDER)?
            .execute(("shop-a", "book", 1))?;
        let order_id = tx.last_insert_rowid();
        let event =
            json!({ "order_id": order_id, "tenant": "shop-a", "sku": "book", "quantity": 1 });
        tower_idempotency::outbox::Outbox::<tower_idempotency::store::sqlite::SqliteStore>::enqueue_in(&tx, "order_created", &event)?;
        tx.prepare_cached(
            "INSERT INTO idempotency_records (tenant, operation, idempotency_key, fingerprint, \
             fingerprint_version, status, headers, body, trailers, created_at, expires_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, NULL, ?9, ?10)",
        )?
        .execute(rusqlite::params![
            "shop-a",
            "create_order",
            key,
            &[0x5a_u8; 32][..],
            1,
            201,
            format!(r#"[["location","/orders/{order_id}"],["content-type","application/json"]]"#),
            format!(r#"{{"order_id":{order_id}}}"#).as_bytes(),
            now,
            now + 86_400_000,
        ])?;
        tx.commit()?;
        Ok(())
    };

    let warmup_end = Instant::now() + options.warmup;
    while Instant::now() < warmup_end {
        one(&mut conn)?;
    }
    let mut rounds = Vec::with_capacity(options.rounds);
    let mut latencies = Vec::new();
    for _ in 0..options.rounds {
        let start = Instant::now();
        let end = start + options.duration;
        let mut count = 0u64;
        while Instant::now() < end {
            let began = Instant::now();
            one(&mut conn)?;
            latencies.push(u32::try_from(began.elapsed().as_micros()).unwrap_or(u32::MAX));
            count += 1;
        }
        rounds.push(count as f64 / start.elapsed().as_secs_f64());
    }
    latencies.sort_unstable();
    Ok(Row {
        case: Case::E,
        mode,
        concurrency: 1,
        rounds,
        p50_ms: percentile_ms(&latencies, 50.0),
        p99_ms: percentile_ms(&latencies, 99.0),
        requests: latencies.len() as u64,
        errors: 0,
        cpu_us: None,
        client_cpu_us: None,
        db_cpu_us: None,
        integrity: None,
    })
}
