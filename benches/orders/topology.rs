//! `--topology`: the layer on PostgreSQL where production runs it, beside the direct
//! connection: the tokio-postgres store reached directly (READ COMMITTED, the default), behind
//! PgBouncer in transaction pooling mode (`with_unnamed_statements(true)`), and at
//! `SERIALIZABLE`. Case A (new keys) and case B (replays of keys created beforehand), with the
//! handler of `postgres.rs` (the order and its outbox event), at each `--concurrency`.
//!
//! Each topology gets a role and a schema of its own (the role's `search_path` is its schema:
//! PgBouncer refuses the startup `options` the other cases select their schema with), the
//! store's pools of `POOL_SIZE`, and its own server; the topologies run one after the other
//! (together their pools would pass PostgreSQL's default `max_connections`). PgBouncer is
//! started the way the tests start it (`support::pgbouncer`: a configuration in a temporary
//! directory, a free port on 127.0.0.1, `pool_mode = transaction`), with `BOUNCER_POOL`
//! server connections; without the program its rows are skipped, with a message. A `503`
//! (a serialization failure past the layer's retries, a wait in PgBouncer's queue) counts as
//! an error of the row, as any answer but the case's `201`. After case A a check counts its
//! orders: one per fresh `201`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::middleware;
use axum::routing::post;
use axum::Router;
use support::pgbouncer::{create_role_with_schema, PgBouncer};
use tower_idempotency::fingerprint::Fingerprinter;
use tower_idempotency::store::tokio_postgres::tokio_postgres::{self, NoTls};
use tower_idempotency::store::tokio_postgres::PostgresStore;
use tower_idempotency::store::Isolation;
use tower_idempotency::IdempotencyLayer;

use crate::cases::{median, percentile_ms, replay_workload};
use crate::cli::{Case, Options};
use crate::hand::OPERATION;
use crate::load::{connect_all, run_load, Limit, LoadStats, Workload};
use crate::postgres::{create_order, APPLICATION_NAME, POOL_SIZE};
use crate::servers::authenticate;
use crate::BoxError;

/// PgBouncer's server connections (`default_pool_size`): fewer than the store's pool, as a
/// pooler in front of several app instances has.
const BOUNCER_POOL: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Topology {
    Direct,
    PgBouncer,
    Serializable,
}

impl Topology {
    const ALL: [Topology; 3] = [
        Topology::Direct,
        Topology::PgBouncer,
        Topology::Serializable,
    ];

    fn name(self) -> &'static str {
        match self {
            Topology::Direct => "direct",
            Topology::PgBouncer => "pgbouncer",
            Topology::Serializable => "serializable",
        }
    }

    fn describe(self) -> String {
        match self {
            Topology::Direct => "direct connection, READ COMMITTED".into(),
            Topology::PgBouncer => format!(
                "PgBouncer, pool_mode = transaction, default_pool_size = {BOUNCER_POOL}, \
                 unnamed statements"
            ),
            Topology::Serializable => "direct connection, SERIALIZABLE".into(),
        }
    }
}

/// One topology's case at one concurrency.
struct TopologyRow {
    topology: Topology,
    case: Case,
    concurrency: usize,
    rounds: Vec<f64>,
    p50_ms: f64,
    p99_ms: f64,
    requests: u64,
    errors: u64,
    first_error: Option<String>,
}

/// How long `--topology` takes at least: three topologies, two cases, each concurrency.
pub(crate) fn estimate(options: &Options) -> Duration {
    let per_case = options.duration * options.rounds as u32 + options.warmup;
    per_case * (Topology::ALL.len() * 2 * options.concurrency.len()) as u32
}

/// Runs every topology, prints the table and writes `topology.csv` in `--out`; returns its
/// path.
pub(crate) async fn run(options: &Options) -> Result<PathBuf, BoxError> {
    let url = options
        .database_url
        .as_deref()
        .ok_or("--topology needs --database-url")?;
    let mut rows = Vec::new();
    for topology in Topology::ALL {
        if topology == Topology::PgBouncer && PgBouncer::binary().is_none() {
            eprintln!(
                "topology: skipping pgbouncer (no pgbouncer on PATH, in /usr/sbin, or PGBOUNCER)"
            );
            continue;
        }
        eprintln!("running topology {} ...", topology.name());
        rows.extend(run_topology(url, topology, options).await?);
    }
    print(&rows, options);
    std::fs::create_dir_all(&options.out)?;
    let csv = options.out.join("topology.csv");
    write_csv(&csv, &rows)?;
    Ok(csv)
}

/// A role of its own whose sessions find its schema, and the schema.
struct Role {
    name: String,
    password: String,
    admin: tokio_postgres::Client,
}

impl Role {
    async fn create(url: &str, topology: Topology) -> Result<Role, BoxError> {
        let (admin, connection) = tokio_postgres::connect(url, NoTls).await?;
        tokio::spawn(connection);
        let name = format!("tidem_bench_{}_{}", topology.name(), std::process::id());
        let server: tokio_postgres::Config = url.parse()?;
        admin
            .batch_execute(&format!(
                "DROP SCHEMA IF EXISTS {name} CASCADE; DROP ROLE IF EXISTS {name}"
            ))
            .await?;
        let password = create_role_with_schema(&admin, &server, &name).await?;
        Ok(Role {
            name,
            password,
            admin,
        })
    }

    /// The connection settings of `url`, as this role.
    fn config(&self, url: &str) -> Result<tokio_postgres::Config, BoxError> {
        let mut config: tokio_postgres::Config = url.parse()?;
        config.user(&self.name).application_name(APPLICATION_NAME);
        Ok(config)
    }

    async fn count_orders(&self, sku: &str) -> Result<i64, BoxError> {
        let sql = format!("SELECT count(*) FROM {}.orders WHERE sku = $1", self.name);
        Ok(self.admin.query_one(&sql, &[&sku]).await?.try_get(0)?)
    }

    async fn drop(self) -> Result<(), BoxError> {
        let name = &self.name;
        self.admin
            .batch_execute(&format!(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{name}'; \
                 DROP SCHEMA IF EXISTS {name} CASCADE; DROP ROLE IF EXISTS {name}"
            ))
            .await?;
        Ok(())
    }
}

/// The first host and port of `config` (the server PgBouncer connects to).
fn upstream(config: &tokio_postgres::Config) -> (String, u16) {
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(host)) => host.clone(),
        _ => "127.0.0.1".to_owned(),
    };
    (host, config.get_ports().first().copied().unwrap_or(5432))
}

async fn run_topology(
    url: &str,
    topology: Topology,
    options: &Options,
) -> Result<Vec<TopologyRow>, BoxError> {
    let role = Role::create(url, topology).await?;
    let direct = role.config(url)?;
    let mut bouncer = None;
    let builder = match topology {
        Topology::Direct => PostgresStore::builder(direct),
        Topology::Serializable => {
            PostgresStore::builder(direct).with_isolation(Isolation::Serializable)
        }
        Topology::PgBouncer => {
            let (host, port) = upstream(&direct);
            let started =
                PgBouncer::start((&host, port), BOUNCER_POOL, &[(&role.name, &role.password)])
                    .await;
            // A configuration of its own: `host` and `port` would add to the URL's.
            let mut through = tokio_postgres::Config::new();
            through
                .host("127.0.0.1")
                .port(started.port)
                .user(&role.name)
                .dbname(direct.get_dbname().unwrap_or("postgres"))
                .application_name(APPLICATION_NAME);
            if !role.password.is_empty() {
                through.password(&role.password);
            }
            bouncer = Some(started);
            PostgresStore::builder(through).with_unnamed_statements(true)
        }
    };
    let store = builder.with_max_connections(POOL_SIZE).build().await?;
    let schema = "CREATE TABLE IF NOT EXISTS orders (id BIGSERIAL PRIMARY KEY, \
                  tenant_id TEXT NOT NULL, sku TEXT NOT NULL, quantity BIGINT NOT NULL)";
    store.client().await?.batch_execute(schema).await?;
    tower_idempotency::outbox::Outbox::<PostgresStore>::install(&store).await?;
    let layer = IdempotencyLayer::new(store.clone())
        .with_operation(OPERATION)
        .with_fingerprinter(Fingerprinter::json());
    let app = Router::new()
        .route("/orders", post(create_order).layer(layer))
        .layer(middleware::from_fn(authenticate));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let mut rows = Vec::new();
    for &concurrency in &options.concurrency {
        let sku = format!("topology-{}-{concurrency}", topology.name());
        let prefix = format!("{}-c{concurrency}-", topology.name());
        let create = Arc::new(Workload::create("/orders", &format!("{prefix}a-"), &sku));
        let (created, fresh) = measure(addr, concurrency, &create, options).await?;
        rows.push(created.into_row(topology, Case::A, concurrency));
        let orders = role.count_orders(&sku).await?;
        if orders != fresh {
            return Err(format!(
                "topology {}: {orders} orders for {fresh} fresh 201s at c{concurrency}",
                topology.name()
            )
            .into());
        }
        let (replays, _) = replay_workload(addr, concurrency, &format!("{prefix}b-"), &sku).await?;
        let (replayed, _) = measure(addr, concurrency, &Arc::new(replays), options).await?;
        rows.push(replayed.into_row(topology, Case::B, concurrency));
    }
    server.abort();
    drop(store);
    if let Some(mut bouncer) = bouncer {
        bouncer.stop().await;
    }
    // Closed pools end their connections in the background: give them a moment.
    tokio::time::sleep(Duration::from_millis(100)).await;
    role.drop().await?;
    Ok(rows)
}

/// What one case's rounds measured.
struct Measured {
    rounds: Vec<f64>,
    pooled: LoadStats,
}

impl Measured {
    fn into_row(mut self, topology: Topology, case: Case, concurrency: usize) -> TopologyRow {
        self.pooled.latencies.sort_unstable();
        TopologyRow {
            topology,
            case,
            concurrency,
            p50_ms: percentile_ms(&self.pooled.latencies, 50.0),
            p99_ms: percentile_ms(&self.pooled.latencies, 99.0),
            requests: self.pooled.ok + self.pooled.errors,
            errors: self.pooled.errors,
            first_error: self.pooled.first_error.take(),
            rounds: self.rounds,
        }
    }
}

/// A warm-up, then `--rounds` rounds of `--duration` of `workload` over `concurrency`
/// connections; the fresh `201`s of all of them (warm-up included).
async fn measure(
    addr: SocketAddr,
    concurrency: usize,
    workload: &Arc<Workload>,
    options: &Options,
) -> Result<(Measured, i64), BoxError> {
    let conns = connect_all(addr, concurrency).await?;
    let (mut conns, warm) = run_load(conns, workload, Limit::For(options.warmup)).await;
    let mut fresh = warm.fresh as i64;
    let mut measured = Measured {
        rounds: Vec::new(),
        pooled: LoadStats::default(),
    };
    for _ in 0..options.rounds {
        let (back, stats) = run_load(conns, workload, Limit::For(options.duration)).await;
        conns = back;
        fresh += stats.fresh as i64;
        measured.rounds.push(stats.requests_per_second());
        measured.pooled.merge(stats);
    }
    Ok((measured, fresh))
}

fn print(rows: &[TopologyRow], options: &Options) {
    println!();
    println!(
        "topology: the tokio-postgres store, requests/s the median of {} rounds of {:.1} s, \
         latency p50/p99 over all rounds; x direct: the ratio to the direct connection's",
        options.rounds,
        options.duration.as_secs_f64()
    );
    for topology in Topology::ALL {
        if rows.iter().any(|row| row.topology == topology) {
            println!("  {}: {}", topology.name(), topology.describe());
        }
    }
    println!(
        "{:<13} {:<4} {:>4} {:>9} {:>8} {:>8} {:>8} {:>9}",
        "topology", "case", "c", "req/s", "p50 ms", "p99 ms", "errors", "x direct"
    );
    for row in rows {
        let direct = rows.iter().find(|other| {
            other.topology == Topology::Direct
                && other.case == row.case
                && other.concurrency == row.concurrency
        });
        let ratio = direct.map_or(String::from("-"), |direct| {
            format!("{:.2}", median(&row.rounds) / median(&direct.rounds))
        });
        println!(
            "{:<13} {:<4} {:>4} {:>9.0} {:>8.2} {:>8.2} {:>8} {:>9}",
            row.topology.name(),
            row.case.name(),
            row.concurrency,
            median(&row.rounds),
            row.p50_ms,
            row.p99_ms,
            row.errors,
            ratio
        );
        if let Some(error) = &row.first_error {
            println!("    first error: {error}");
        }
    }
}

fn write_csv(path: &std::path::Path, rows: &[TopologyRow]) -> std::io::Result<()> {
    let mut csv =
        String::from("topology,case,concurrency,requests_per_s,p50_ms,p99_ms,requests,errors\n");
    for row in rows {
        csv.push_str(&format!(
            "{},{},{},{:.1},{:.3},{:.3},{},{}\n",
            row.topology.name(),
            row.case.name(),
            row.concurrency,
            median(&row.rounds),
            row.p50_ms,
            row.p99_ms,
            row.requests,
            row.errors
        ));
    }
    std::fs::write(path, csv)
}
