//! The benchmark of issues 4 and 13: what the idempotency layer costs, measured against
//! hand-written baselines in the same process run, over real HTTP on loopback, on SQLite and
//! (with `--database-url`) PostgreSQL.
//!
//! ```text
//! cargo bench --bench orders                  # SQLite, the full run (about 5 minutes on 2 cores)
//! cargo bench --bench orders -- --database-url postgres://postgres@127.0.0.1/test
//! cargo bench --bench orders -- --quick       # smoke run, under a minute (SQLite)
//! cargo bench --bench orders -- --help
//! ```
//!
//! A program with `harness = false`: `cargo bench` runs it with the flags after `--` (and
//! `--bench`, which cargo adds); with no flags it is the full run that the README's figures
//! come from, and it says how long that takes before it starts. `cargo test` does not build it;
//! run by `cargo test --benches` or `--all-targets` (without cargo's `--bench`), it measures
//! nothing and exits successfully.
//!
//! Where things live: `cli.rs` the options, `servers.rs` the apps under test on SQLite and the
//! server each case gets, `postgres.rs` the same on PostgreSQL, `sqlx_sqlite.rs` on SQLite through
//! sqlx, `hand.rs` the hand-written baselines' transactions, `load.rs` the load generator,
//! `cases.rs` the table's measurements, `extras.rs` the hold and disk measurements, `alloc.rs` the
//! allocation count, `cpu.rs` the CPU accounting, `report.rs` the printed tables, the goals and the
//! CSV files, `chart.rs` the chart, `serve.rs` a server left running for a profiler (`--serve`),
//! `galera.rs` the MySQL store on one server and on a Galera cluster (`--galera`), `table.rs` the
//! docs' tables read back from a run's CSV files (`--table`), `wal.rs` the WAL frames a new key
//! writes (`--cases wal`), `instr.rs` the instructions per request under callgrind (`--cases
//! instr`), `scale.rs` the slow measurements of how cost grows (`--scale`: records already stored,
//! purging while serving, body size, concurrency), `topology.rs` PostgreSQL behind PgBouncer and at
//! SERIALIZABLE beside the direct connection (`--topology`).
//!
//! Every SQLite case gets a fresh database (WAL) in a temp dir (`TMPDIR` picks where: keep it
//! on a real disk, or `synchronous=FULL` measures no fsync at all) and its own server on
//! `127.0.0.1:0`; the PostgreSQL cases of one concurrency share a server and a fresh schema
//! (dropped after them), each case ordering its own SKU. A load generator in this program
//! opens `N` keep-alive HTTP/1.1 connections, each with one request in flight (`N` = the
//! concurrency).
//!
//! | case | what runs |
//! |---|---|
//! | A | `POST /orders` under the layer: the handler of `examples/orders.rs` (or `orders/postgres.rs`): the order and its `order_created` outbox event in the request's transaction; a new key each time |
//! | B | the same route, replays of keys created beforehand (over as many connections as the case has, at most 16: on PostgreSQL the setup leaves the store's pools as wide as it was, and case A shares that store) |
//! | C | the same route, 90% new keys and 10% retries of the connection's recent keys (SQLite) |
//! | H | baseline: the same work written by hand, no layer (`hand.rs`). SQLite: rusqlite inline under a `tokio::sync::Mutex<Connection>`, cached statements: `BEGIN IMMEDIATE`, look up the key, insert the order, the event and the record, `COMMIT`. PostgreSQL: tokio-postgres and deadpool (pool 32): `BEGIN`, reserve the key `ON CONFLICT DO NOTHING` (on a conflict `SELECT` and compare), insert the order `RETURNING id`, the event, `UPDATE` the record, `COMMIT`. Both fingerprint the request as the layer does (`Fingerprinter::json()`) and save status, headers and body in `idempotency_records` |
//! | D | the old baseline: H's transaction under `spawn_blocking` behind an async mutex (SQLite) |
//! | R | baseline: a plain `GET /orders/{id}` on the same server (SQLite: `SqliteStore::read`; PostgreSQL: a pooled connection, a cached statement) |
//! | SA | case A on the sqlx store (`SqlxPostgresStore` on a `PgPool` of 32, `outbox::sqlx_postgres::enqueue`), PostgreSQL only |
//! | SH | baseline: H's PostgreSQL transaction written with sqlx on a `PgPool` of 32 (the same statements, `query` with binds, which sqlx prepares once per connection), PostgreSQL only |
//! | QA | case A on the sqlx SQLite store (`SqlxSqliteStore` on a `SqlitePool` of 8, as in `examples/orders_sqlx_sqlite.rs`), with that example's handler and the event enqueued on the handle (`Enqueue`, into the store's own outbox table), on a fresh file of its own: WAL and the mode's `synchronous`, as A's. SQLite only |
//! | QH | baseline: H's SQLite transaction written with sqlx on the same kind of file and pool (`BEGIN IMMEDIATE` through `Pool::begin_with`, the order inserted `RETURNING id` as QA does, the event with H's statement into the sqlx SQLite store's outbox table), SQLite only |
//! | E | ceiling: H's SQL in a tight rusqlite loop on one thread, no HTTP (SQLite) |
//!
//! All tables are created by the crate (`SqliteStore`/`PostgresStore`, `SqliteOutbox::install`,
//! `PostgresOutbox::install`; for QA and QH the sqlx SQLite store and its outbox's `install`), so
//! the layer and the baselines write identical rows.
//!
//! At each concurrency the cases' rounds are interleaved (A, B, ..., then A, B, ... again;
//! both SQLite modes together, as one goal compares FULL with NORMAL), so that a slow spell of
//! a shared machine falls on every case alike. Throughput is the median of the rounds;
//! latencies (p50, p99) pool every request of every round.
//!
//! **CPU per request** is the server's alone (`srv us`): the load generator runs on a tokio
//! runtime of its own whose threads are named `bench-client`, and the server's CPU time is the
//! process's (all threads, exited ones included: the SQLite writer, the blocking pool, the
//! server's executor) minus the client threads', read from `/proc/self/task/*/stat` (Linux,
//! 10 ms ticks, summed over the rounds). `cli us` is the load generator's; with PostgreSQL,
//! `db us` is the CPU of the backends serving the benchmark's connections (found by their
//! `application_name` in `pg_stat_activity`, read from `/proc/<pid>/stat`: the database must
//! run on this machine). `--client-threads` sets the load generator's threads (default 1).
//!
//! After each case a check counts the case's orders, on a new connection and through the
//! store's readers: each fresh `201` the clients received must have exactly one committed
//! order. A goals block then lists every ratio of the performance goals, with met/NOT met. Two
//! extra measurements follow: replay latency while a handler holds the write transaction for

use std::error::Error;
use std::process::ExitCode;
use std::time::Instant;

use cli::{Case, Command, Mode, Options, USAGE};

mod alloc;
mod cases;
mod chart;
mod cli;
mod cpu;
mod extras;
mod galera;
mod hand;
mod instr;
mod load;
mod postgres;
mod report;
mod scale;
mod serve;
mod servers;
mod sqlx_sqlite;
mod table;
mod topology;
mod wal;

type BoxError = Box<dyn Error + Send + Sync>;

#[tokio::main]
async fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    // `cargo bench` adds `--bench`; without it this is `cargo test --benches` (or
    // `--all-targets`), whose flags are the test harness's: a benchmark is not a test.
    let Some(bench) = args.iter().position(|arg| arg == "--bench") else {
        println!("bench: measures nothing under `cargo test`; run `cargo bench --bench orders`");
        return ExitCode::SUCCESS;
    };
    args.remove(bench);
    let options = match Command::parse(args.into_iter()) {
        Ok(Command::Help) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Ok(Command::Run(options)) => options,
        Ok(Command::Serve { mode, database_url }) => {
            return match serve::run(mode, database_url.as_deref()).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    eprintln!("bench: {error}");
                    ExitCode::FAILURE
                }
            };
        }
        Ok(Command::Galera(options)) => {
            return match galera::run(&options).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    eprintln!("bench: {error}");
                    ExitCode::FAILURE
                }
            };
        }
        Ok(Command::Table(dir)) => {
            return match table::print(&dir) {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    eprintln!("bench: {error}");
                    ExitCode::FAILURE
                }
            };
        }
        Err(message) => {
            eprintln!("bench: {message}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&options).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("bench: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run(options: &Options) -> Result<(), BoxError> {
    let started = Instant::now();
    eprintln!(
        "bench: this run takes {} at least{}",
        cli::describe_duration(options.estimate()),
        if options.quick {
            " (--quick: a smoke run)"
        } else {
            ""
        }
    );
    load::start_client(options.client_threads)?;
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "tower-idempotency benchmark: {cores} cores, {} rounds x {:.1} s (+{:.1} s warm-up) per case, \
         concurrency {:?}, temp databases in {}",
        options.rounds,
        options.duration.as_secs_f64(),
        options.warmup.as_secs_f64(),
        options.concurrency,
        std::env::temp_dir().display()
    );
    if cfg!(debug_assertions) {
        eprintln!("bench: this is a debug build; run with --release for meaningful figures");
    }
    let mut extras = Vec::new();
    extras.extend(extras::disk_probe("before", options).await?);

    let http: Vec<Case> = options
        .cases
        .iter()
        .copied()
        .filter(|&case| case != Case::E)
        .collect();
    // Both SQLite modes interleave (a goal compares FULL with NORMAL); PostgreSQL on its own.
    let sqlite: Vec<(Mode, Case)> = options
        .modes
        .iter()
        .filter(|&&mode| mode != Mode::Postgres)
        .flat_map(|&mode| mode.cases(&http).into_iter().map(move |case| (mode, case)))
        .collect();
    let postgres: Vec<(Mode, Case)> = if options.modes.contains(&Mode::Postgres) {
        Mode::Postgres
            .cases(&http)
            .into_iter()
            .map(|case| (Mode::Postgres, case))
            .collect()
    } else {
        Vec::new()
    };
    let mut rows = Vec::new();
    for &concurrency in &options.concurrency {
        for pairs in [&sqlite, &postgres] {
            if !pairs.is_empty() {
                rows.extend(cases::run_interleaved(pairs, concurrency, options).await?);
            }
        }
    }
    if options.cases.contains(&Case::E) {
        for &mode in options.modes.iter().filter(|&&mode| mode != Mode::Postgres) {
            eprintln!("running E {} ...", mode.name());
            rows.push(cases::run_ceiling(mode, options).await?);
        }
    }
    rows.sort_by_key(|x| (x.mode, x.case, x.concurrency));
    let mut goals = report::goals(&rows);

    if !rows.is_empty() {
        report::print_table(&rows, options);
        report::print_ratios(&rows);
    }
    if options.wal {
        eprintln!("running wal ...");
        let (counts, goal) = wal::run_wal(options).await?;
        extras.extend(counts);
        goals.extend(goal);
    }
    if options.instr {
        eprintln!("running instr ...");
        let (counts, goal) = instr::run_instr(options).await?;
        extras.extend(counts);
        goals.extend(goal);
    }
    report::print_goals(&goals);
    if options.hold {
        eprintln!("running hold ...");
        extras.extend(extras::run_hold(options).await?);
    }
    if options.alloc {
        eprintln!("running alloc ...");
        extras.extend(alloc::run_alloc(options).await?);
    }

    let mut written = Vec::new();
    if let Some(scale) = &options.scale {
        eprintln!("running scale ...");
        let measured = scale::run(options, scale).await?;
        goals.extend(measured.goals);
        written.push(measured.csv);
    }
    if options.topology {
        eprintln!("running topology ...");
        written.push(topology::run(options).await?);
    }

    extras.extend(extras::disk_probe("after", options).await?);

    std::fs::create_dir_all(&options.out)?;
    if !rows.is_empty() {
        let csv = options.out.join("results.csv");
        report::write_results_csv(&csv, &rows)?;
        let svg = options.out.join("throughput.svg");
        chart::write_throughput_svg(&svg, &rows, options)?;
        written.extend([csv, svg]);
    }
    if !goals.is_empty() {
        let csv = options.out.join("goals.csv");
        report::write_goals_csv(&csv, &goals)?;
        written.push(csv);
    }
    if options.hold || options.alloc || options.wal || options.instr || !rows.is_empty() {
        let csv = options.out.join("extras.csv");
        report::write_extras_csv(&csv, &extras)?;
        written.push(csv);
    }
    println!();
    let written: Vec<String> = written.iter().map(|p| p.display().to_string()).collect();
    println!(
        "wrote {} in {:.0} s",
        written.join(", "),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
