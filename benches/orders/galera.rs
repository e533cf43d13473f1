//! `--galera`: the MySQL store on a three-node MariaDB Galera cluster beside the same store on
//! one MariaDB server reached directly, new keys and replays.
//!
//! Both run the tests' order app (`support::common`: `POST /orders` inserts the order in the
//! request's transaction, no outbox event) on a `SqlxMySqlStore` with a pool of
//! [`POOL_SIZE`]: on the server of `TEST_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`,
//! a fresh database), and on the first node of a cluster the run starts
//! (`support::galera`, the tests' cluster: three `mariadbd` on this machine, with
//! `innodb_flush_log_at_trx_commit = 2`). Cases: `A` (a new key per request) and `B` (replays
//! of 1000 keys created beforehand), at each `--concurrency`, the rounds interleaved between the
//! two setups. Prints a table; writes nothing.

use std::sync::Arc;
use std::time::Duration;

use support::common::server_backed::OrderServer;
use support::common::{AppBuilder, HookFor, OrderCallOf};
use support::galera::GaleraDb;
use support::mysql_common::TestDb;
use support::pg_common::HookOutcome;
use tower_idempotency::store::sqlx_mysql::sqlx::MySqlPool;
use tower_idempotency::store::sqlx_mysql::{SqlxMySqlHandle, SqlxMySqlStore};

use crate::cases::{median, percentile_ms};
use crate::cli::Options;
use crate::load::{self, order_body, Limit, LoadStats, Workload};
use crate::BoxError;

/// Connections of each store's pool.
const POOL_SIZE: u32 = 32;

/// Keys case B replays.
const REPLAY_KEYS: u64 = 1000;

type Hook = HookFor<OrderCallOf<SqlxMySqlHandle>, HookOutcome>;
type Server = OrderServer<SqlxMySqlStore, SqlxMySqlHandle, HookOutcome>;

/// One setup under measurement.
struct Setup {
    name: &'static str,
    server: Server,
}

async fn serve(pool: MySqlPool) -> Result<Server, BoxError> {
    let store = SqlxMySqlStore::builder(pool)
        .with_max_read_connections(8)
        .build();
    store.migrate().await?;
    Ok(AppBuilder::<SqlxMySqlStore, Hook, ()>::new(())
        .serve_on(store)
        .await)
}

pub(crate) async fn run(options: &Options) -> Result<(), BoxError> {
    if std::env::var("TEST_MYSQL_URL").is_err() {
        std::env::set_var("TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test");
    }
    if !support::galera::Galera::available() {
        return Err(support::galera::MISSING.into());
    }
    load::start_client(options.client_threads)?;
    let direct = TestDb::create()
        .await
        .ok_or("--galera needs a MariaDB server: TEST_MYSQL_URL")?;
    eprintln!("bench: starting a three-node Galera cluster ...");
    let cluster = GaleraDb::create().await;
    let setups = [
        Setup {
            name: "MariaDB, one server",
            server: serve(direct.pool(POOL_SIZE).await).await?,
        },
        Setup {
            name: "Galera, 3 nodes (app on one)",
            server: serve(cluster.pool(0, POOL_SIZE).await).await?,
        },
    ];
    // Commits flush the redo log on the direct server as it is set; the nodes write it at
    // commit and flush it once a second (the cluster's copies are its durability).
    let flush: i64 = direct
        .count("SELECT CAST(@@innodb_flush_log_at_trx_commit AS SIGNED)")
        .await;
    println!(
        "MySQL store: one MariaDB server (innodb_flush_log_at_trx_commit = {flush}) and a \
         three-node Galera cluster on this machine (= 2 on each node), {} rounds x {:.1} s per \
         case, the rounds interleaved",
        options.rounds,
        options.duration.as_secs_f64()
    );
    println!(
        "{:<30} {:<20} {:>4} {:>9} {:>8} {:>8} {:>7}",
        "setup", "case", "c", "req/s", "p50 ms", "p99 ms", "errors"
    );
    for &concurrency in &options.concurrency {
        for (case, describe) in [("A", "new keys"), ("B", "replays")] {
            let mut workloads = Vec::new();
            for (n, setup) in setups.iter().enumerate() {
                let prefix = format!("{case}-c{concurrency}-{n}-");
                let workload = match case {
                    "A" => Workload::create("/orders", &prefix, "galera-bench"),
                    _ => {
                        // The keys to replay, created through the layer.
                        let conns = load::connect_all(setup.server.addr, 16).await?;
                        let create = Arc::new(Workload::create("/orders", &prefix, "galera-bench"));
                        let (_, made) =
                            load::run_load(conns, &create, Limit::Requests(REPLAY_KEYS)).await;
                        if made.fresh != REPLAY_KEYS {
                            return Err(format!(
                                "{}: created {} of {REPLAY_KEYS} keys to replay ({:?})",
                                setup.name, made.fresh, made.first_error
                            )
                            .into());
                        }
                        Workload::Replay {
                            prefix,
                            count: REPLAY_KEYS,
                            body: order_body("galera-bench"),
                        }
                    }
                };
                workloads.push(Arc::new(workload));
            }
            let mut measured: Vec<(Vec<f64>, LoadStats)> = setups
                .iter()
                .map(|_| (Vec::new(), LoadStats::default()))
                .collect();
            for round in 0..=options.rounds {
                for (n, setup) in setups.iter().enumerate() {
                    let conns = load::connect_all(setup.server.addr, concurrency).await?;
                    // Round 0 warms up.
                    let length = if round == 0 {
                        options.warmup
                    } else {
                        options.duration
                    };
                    let (_, stats) = load::run_load(conns, &workloads[n], Limit::For(length)).await;
                    if round > 0 {
                        measured[n].0.push(stats.requests_per_second());
                        measured[n].1.merge(stats);
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            for (setup, (rounds, mut stats)) in setups.iter().zip(measured) {
                stats.latencies.sort_unstable();
                println!(
                    "{:<30} {:<20} {:>4} {:>9.0} {:>8.2} {:>8.2} {:>7}",
                    setup.name,
                    format!("{case} {describe}"),
                    concurrency,
                    median(&rounds),
                    percentile_ms(&stats.latencies, 50.0),
                    percentile_ms(&stats.latencies, 99.0),
                    stats.errors
                );
                if let Some(error) = &stats.first_error {
                    eprintln!("bench: {}: first error: {error}", setup.name);
                }
            }
        }
    }
    for setup in setups {
        setup.server.shutdown().await;
    }
    Ok(())
}
