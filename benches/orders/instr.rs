//! `instr`: instructions per request, counted by callgrind, where a shared machine's clock
//! cannot decide. The same binary sent the same requests executes nearly the same instructions
//! (the `orders` example's counts repeat to a percent or two), however busy the machine;
//! requests per second do not repeat half as well.
//!
//! Two pairs of servers, each a process of its own started under `valgrind --tool=callgrind`
//! (every thread counted): the `orders` example as shipped (durable SQLite) against the
//! minimal handler (`benches/peer --minimal`: axum and rusqlite, `BEGIN IMMEDIATE`, look up
//! `(tenant, key)`, insert the order, an event and a `(tenant, key, payload, status, body)`
//! row, `COMMIT`); with `--database-url`, the example on PostgreSQL against case H on
//! PostgreSQL (this program's `--serve --modes pg`, `/hand/orders`: tokio-postgres by hand,
//! with the layer's fingerprint), as the peer has no PostgreSQL handler. On one keep-alive
//! connection: [`WARM`] new keys, then [`ROUNDS`] rounds of the counters zeroed
//! (`callgrind_control -z`), [`COUNTED`] new keys and a dump (`callgrind_control -d`), whose
//! median is the figure; then replays of one key, the same way. The dumps stay in the directory
//! printed at the end, for `callgrind_annotate --inclusive=yes`; with
//! `CARGO_PROFILE_RELEASE_DEBUG=line-tables-only` in the environment of `cargo bench` the
//! programs carry line tables too, for files and lines in its output.
//!
//! Then the server CPU per new key at one connection, without valgrind: both SQLite servers
//! run natively, [`CPU_ROUNDS`] interleaved rounds of new keys, each server's user and system
//! time read from `/proc/<pid>/stat` around each round; the median of the rounds.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, HOST};
use axum::http::{Method, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tower_idempotency::response::IDEMPOTENT_REPLAYED;
use tower_idempotency::IDEMPOTENCY_KEY;

use crate::cases::median;
use crate::cli::Options;
use crate::extras::Extra;
use crate::report::Goal;
use crate::BoxError;

/// Requests before the counters are zeroed: connections, statement caches, pools and the
/// allocator's arenas settle.
const WARM: u64 = 50;
/// Requests counted in a round.
const COUNTED: u64 = 200;
/// Rounds counted per kind (each zeroed and dumped on its own); their median is the figure:
/// the minimal handler's hand-over to the blocking pool moves its count by a few percent from
/// one round to the next.
const ROUNDS: usize = 3;
/// Interleaved rounds of the CPU measurement.
const CPU_ROUNDS: usize = 5;
/// Goals of issue 52: the example's instructions at most these times the baseline's.
const NEW_KEY_GOAL: f64 = 1.5;
const REPLAY_GOAL: f64 = 1.2;
const CPU_GOAL: f64 = 1.3;
/// How long a server may take to print its address under valgrind.
const START_PATIENCE: Duration = Duration::from_secs(180);

/// A server program and its arguments (`--addr 127.0.0.1:0` comes first).
struct Program {
    name: &'static str,
    describe: &'static str,
    path: PathBuf,
    args: Vec<String>,
    /// The route of `POST` orders.
    route: &'static str,
}

/// Instructions per request of one server.
struct Counted {
    new_key: f64,
    replay: f64,
}

/// Runs the measurements; prints them, returns them as extras and the goals.
pub(crate) async fn run_instr(options: &Options) -> Result<(Vec<Extra>, Vec<Goal>), BoxError> {
    let valgrind = std::process::Command::new("valgrind")
        .arg("--version")
        .output();
    if !valgrind.is_ok_and(|output| output.status.success()) {
        return Err(
            "--cases instr runs the servers under valgrind, which is not installed \
                    (Debian: apt-get install valgrind)"
                .into(),
        );
    }
    let dir = tempfile::Builder::new().prefix("instr-").tempdir()?.keep();
    // Copied at once: the target directory's binaries are shared by name with any other
    // checkout that builds there.
    let copy = |built: PathBuf, name: &str| -> Result<PathBuf, BoxError> {
        let copy = dir.join(name);
        std::fs::copy(&built, &copy)?;
        Ok(copy)
    };
    let orders = copy(support::apps::process::build_example("orders"), "orders")?;
    let peer = copy(build_peer()?, "peer")?;
    let db = |name: &str| dir.join(name).display().to_string();
    let mut pairs = vec![(
        "SQLite (FULL)",
        Program {
            name: "orders",
            describe: "orders example",
            path: orders.clone(),
            args: vec!["--db".into(), db("orders.db")],
            route: "/orders",
        },
        Program {
            name: "minimal",
            describe: "peer --minimal",
            path: peer.clone(),
            args: vec!["--minimal".into(), "--db".into(), db("minimal.db")],
            route: "/orders",
        },
    )];
    let schema = format!("bench_instr_{}", std::process::id());
    if let Some(url) = &options.database_url {
        create_schema(url, &schema).await?;
        pairs.push((
            "PostgreSQL",
            Program {
                name: "orders-pg",
                describe: "orders example --database-url",
                path: orders.clone(),
                args: vec!["--database-url".into(), with_search_path(url, &schema)],
                route: "/orders",
            },
            Program {
                name: "H-pg",
                describe: "case H (--serve --modes pg)",
                path: std::env::current_exe()?,
                args: vec![
                    "--bench".into(),
                    "--serve".into(),
                    "--modes".into(),
                    "pg".into(),
                    "--database-url".into(),
                    url.clone(),
                ],
                route: "/hand/orders",
            },
        ));
    }

    let mut extras = Vec::new();
    let mut goals = Vec::new();
    println!();
    println!(
        "Instructions per request (callgrind, every thread of the server; one connection, \
         {WARM} requests to warm up, then the median of {ROUNDS} rounds of {COUNTED})"
    );
    println!(
        "  {:<14} {:<32} {:>12} {:>12}",
        "database", "server", "new key", "replay"
    );
    let mut outcome: Result<(), BoxError> = Ok(());
    for (database, layer, baseline) in &pairs {
        let mut counted = Vec::new();
        for program in [layer, baseline] {
            match count(program, &dir).await {
                Ok(count) => counted.push(count),
                Err(error) => {
                    outcome = Err(format!("{}: {error}", program.name).into());
                    break;
                }
            }
        }
        let [ours, theirs] = counted.as_slice() else {
            break;
        };
        for (program, count) in [(layer, ours), (baseline, theirs)] {
            println!(
                "  {:<14} {:<32} {:>12.0} {:>12.0}",
                database, program.describe, count.new_key, count.replay
            );
            for (metric, value) in [("new_key", count.new_key), ("replay", count.replay)] {
                extras.push(Extra {
                    measure: "instructions_per_request",
                    variant: format!("{}:{metric}", program.name),
                    metric: "instructions",
                    value,
                    unit: "instructions",
                });
            }
        }
        let (new_ratio, replay_ratio) =
            (ours.new_key / theirs.new_key, ours.replay / theirs.replay);
        println!(
            "  {:<14} {:<32} {:>11.2}x {:>11.2}x",
            database, "ratio", new_ratio, replay_ratio
        );
        goals.push(Goal::at_most(
            format!(
                "instructions per new key, {database}: {} / {}",
                layer.name, baseline.name
            ),
            new_ratio,
            NEW_KEY_GOAL,
            format!("{:.0} vs {:.0}", ours.new_key, theirs.new_key),
        ));
        goals.push(Goal::at_most(
            format!(
                "instructions per replay, {database}: {} / {}",
                layer.name, baseline.name
            ),
            replay_ratio,
            REPLAY_GOAL,
            format!("{:.0} vs {:.0}", ours.replay, theirs.replay),
        ));
    }
    if let Some(url) = &options.database_url {
        if let Err(error) = drop_schema(url, &schema).await {
            eprintln!("bench: dropping schema {schema}: {error}");
        }
    }
    outcome?;
    println!(
        "  callgrind's files: {} (callgrind_annotate --inclusive=yes FILE)",
        dir.display()
    );

    let (layer, baseline) = (&pairs[0].1, &pairs[0].2);
    let rounds = if options.quick { 2 } else { CPU_ROUNDS };
    let requests = if options.quick { 300 } else { 2000 };
    let (ours, theirs) = cpu_per_new_key(layer, baseline, &dir, rounds, requests).await?;
    println!(
        "Server CPU per new key, one connection, SQLite FULL (median of {rounds} interleaved \
         rounds of {requests}): {} {ours:.0} us, {} {theirs:.0} us, {:.2}x",
        layer.name,
        baseline.name,
        ours / theirs
    );
    for (program, value) in [(layer, ours), (baseline, theirs)] {
        extras.push(Extra {
            measure: "cpu_per_new_key_c1",
            variant: program.name.to_owned(),
            metric: "cpu_us",
            value,
            unit: "us",
        });
    }
    goals.push(Goal::at_most(
        format!(
            "server CPU per new key c1, SQLite FULL: {} / {}",
            layer.name, baseline.name
        ),
        ours / theirs,
        CPU_GOAL,
        format!("{ours:.0} vs {theirs:.0} us"),
    ));
    Ok((extras, goals))
}

/// `program` under callgrind: instructions per new key and per replay of one key.
async fn count(program: &Program, dir: &Path) -> Result<Counted, BoxError> {
    let out = dir.join(format!("{}.callgrind", program.name));
    let mut command = Command::new("valgrind");
    command
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(format!(
            "--log-file={}",
            dir.join(format!("{}.valgrind.log", program.name)).display()
        ))
        .arg(&program.path);
    let server = Server::start(command, program, dir).await?;
    let mut conn = Client::connect(server.addr).await?;
    let prefix = format!("instr-{}-{}-", program.name, std::process::id());
    let mut dumps = 0;
    // Each kind: warm up, then `ROUNDS` times zero, count and dump; the median.
    let mut new_keys = 0..;
    for _ in 0..WARM {
        let i = new_keys.next().unwrap_or_default();
        conn.order(program.route, &format!("{prefix}{i}"), false)
            .await?;
    }
    let mut rounds = Vec::new();
    for _ in 0..ROUNDS {
        server.callgrind_control("-z").await?;
        for _ in 0..COUNTED {
            let i = new_keys.next().unwrap_or_default();
            conn.order(program.route, &format!("{prefix}{i}"), false)
                .await?;
        }
        dumps += 1;
        rounds.push(server.dump(&out, dumps).await? as f64 / COUNTED as f64);
    }
    let new_key = median(&rounds);
    // Replays of one key.
    let key = format!("{prefix}0");
    for _ in 0..WARM {
        conn.order(program.route, &key, true).await?;
    }
    rounds.clear();
    for _ in 0..ROUNDS {
        server.callgrind_control("-z").await?;
        for _ in 0..COUNTED {
            conn.order(program.route, &key, true).await?;
        }
        dumps += 1;
        rounds.push(server.dump(&out, dumps).await? as f64 / COUNTED as f64);
    }
    let replay = median(&rounds);
    drop(conn);
    server.stop().await;
    Ok(Counted { new_key, replay })
}

/// Server CPU per new key at one connection, `rounds` interleaved rounds of `requests`; the
/// medians in microseconds, `layer`'s first.
async fn cpu_per_new_key(
    layer: &Program,
    baseline: &Program,
    dir: &Path,
    rounds: usize,
    requests: u64,
) -> Result<(f64, f64), BoxError> {
    let mut servers = Vec::new();
    for program in [layer, baseline] {
        let mut program_args = program.args.clone();
        // A database file of its own, beside the one callgrind's run wrote.
        if let Some(db) = program_args.iter_mut().skip_while(|a| *a != "--db").nth(1) {
            db.push_str(".cpu");
        }
        let program = Program {
            args: program_args,
            path: program.path.clone(),
            ..*program
        };
        let server = Server::start(Command::new(&program.path), &program, dir).await?;
        let mut conn = Client::connect(server.addr).await?;
        for i in 0..WARM {
            conn.order(program.route, &format!("cpu-warm-{i}"), false)
                .await?;
        }
        servers.push((server, conn, program.route, Vec::new()));
    }
    for round in 0..rounds {
        for (server, conn, route, per_request) in &mut servers {
            let before = server.cpu()?;
            for i in 0..requests {
                conn.order(route, &format!("cpu-{round}-{i}"), false)
                    .await?;
            }
            let used = server.cpu()?.saturating_sub(before);
            per_request.push(used.as_secs_f64() * 1e6 / requests as f64);
        }
    }
    let mut medians = Vec::new();
    for (server, conn, _, per_request) in servers {
        drop(conn);
        server.stop().await;
        medians.push(median(&per_request));
    }
    Ok((medians[0], medians[1]))
}

/// A server process, started with `--addr 127.0.0.1:0`, its address read from the first line
/// it prints that holds `http://`.
struct Server {
    child: Child,
    pid: u32,
    addr: SocketAddr,
}

impl Server {
    /// Its standard error goes to `NAME.stderr` in `dir`.
    async fn start(mut command: Command, program: &Program, dir: &Path) -> Result<Self, BoxError> {
        let stderr = std::fs::File::create(dir.join(format!("{}.stderr", program.name)))?;
        // `--serve` picks its own address.
        if !program.args.iter().any(|arg| arg == "--serve") {
            command.args(["--addr", "127.0.0.1:0"]);
        }
        let mut child = command
            .args(&program.args)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .map_err(|error| format!("cannot start {}: {error}", program.name))?;
        let pid = child.id().ok_or("the server exited at once")?;
        let mut lines = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
        let addr = tokio::time::timeout(START_PATIENCE, async {
            while let Some(line) = lines.next_line().await? {
                let addr = line
                    .split_once("http://")
                    .and_then(|(_, rest)| rest.split_whitespace().next())
                    .and_then(|addr| addr.parse::<SocketAddr>().ok());
                if let Some(addr) = addr {
                    return Ok(addr);
                }
            }
            Err::<_, BoxError>("the server exited before it printed its address".into())
        })
        .await
        .map_err(|_| format!("{} did not print its address in time", program.name))??;
        // Keep draining stdout, so that the server never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Server { child, pid, addr })
    }

    async fn callgrind_control(&self, flag: &str) -> Result<(), BoxError> {
        let output = Command::new("callgrind_control")
            .args([flag, &self.pid.to_string()])
            .output()
            .await?;
        if !output.status.success() {
            return Err(format!(
                "callgrind_control {flag} failed: {}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            )
            .into());
        }
        Ok(())
    }

    /// Dumps the counters (dump number `n`) and returns the instructions of every thread
    /// since they were zeroed.
    async fn dump(&self, out: &Path, n: u32) -> Result<u64, BoxError> {
        self.callgrind_control("-d").await?;
        let file = PathBuf::from(format!("{}.{n}", out.display()));
        let text = std::fs::read_to_string(&file)
            .map_err(|error| format!("reading {}: {error}", file.display()))?;
        // `totals:` sums the cost lines of every thread (`Ir` first); `summary:` may not
        // count what ran since the last zeroing.
        let total = |prefix: &str| {
            text.lines()
                .find_map(|line| line.strip_prefix(prefix))
                .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
        };
        total("totals:")
            .or_else(|| total("summary:"))
            .ok_or_else(|| format!("no totals in {}", file.display()).into())
    }

    /// User and system time of the whole process so far.
    fn cpu(&self) -> Result<Duration, BoxError> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid))?;
        crate::cpu::stat_cpu(&stat).ok_or_else(|| "unreadable /proc stat".into())
    }

    /// Ctrl-C (so that `--serve` drops its schema and valgrind writes its last file), then a
    /// kill if it has not exited within a minute.
    async fn stop(mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-INT", &self.pid.to_string()])
            .status();
        if tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// One keep-alive HTTP/1.1 connection.
struct Client {
    sender: SendRequest<Full<Bytes>>,
    addr: SocketAddr,
}

impl Client {
    async fn connect(addr: SocketAddr) -> Result<Self, BoxError> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (sender, connection) = http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(Client { sender, addr })
    }

    /// `POST route` with `key`; `201` expected, a replay marked as one (where the server marks
    /// replays) when `replay`.
    async fn order(&mut self, route: &str, key: &str, replay: bool) -> Result<(), BoxError> {
        let request = hyper::Request::builder()
            .method(Method::POST)
            .uri(route)
            .header(HOST, self.addr.to_string())
            .header(AUTHORIZATION, "Bearer shop-a-token")
            .header(CONTENT_TYPE, "application/json")
            .header(IDEMPOTENCY_KEY, key)
            .body(Full::new(Bytes::from_static(
                br#"{"sku":"book","quantity":1}"#,
            )))?;
        self.sender.ready().await?;
        let response = self.sender.send_request(request).await?;
        let status = response.status();
        let replayed = response.headers().contains_key(IDEMPOTENT_REPLAYED);
        response.into_body().collect().await?;
        if status != StatusCode::CREATED || (replayed && !replay) {
            return Err(
                format!("{route} with key {key} answered {status} (replayed: {replayed})").into(),
            );
        }
        Ok(())
    }
}

/// Builds `benches/peer` (a workspace of its own) in release; the path of its `peer` binary.
fn build_peer() -> Result<PathBuf, BoxError> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/peer/Cargo.toml");
    let output = std::process::Command::new(cargo)
        .args([
            "build",
            "--release",
            "--bin",
            "peer",
            "--message-format=json",
            "--manifest-path",
            manifest,
        ])
        .stderr(Stdio::inherit())
        .output()?;
    if !output.status.success() {
        return Err("building benches/peer failed".into());
    }
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|message| message["reason"] == "compiler-artifact")
        .filter(|message| message["target"]["name"] == "peer")
        .find_map(|message| message["executable"].as_str().map(PathBuf::from))
        .ok_or_else(|| "cargo reported no peer binary".into())
}

/// `url` with the connection option that puts its tables in `schema`.
fn with_search_path(url: &str, schema: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}options=-c%20search_path%3D{schema}")
}

async fn create_schema(url: &str, schema: &str) -> Result<(), BoxError> {
    execute(url, &format!("CREATE SCHEMA {schema}")).await
}

async fn drop_schema(url: &str, schema: &str) -> Result<(), BoxError> {
    execute(url, &format!("DROP SCHEMA IF EXISTS {schema} CASCADE")).await
}

async fn execute(url: &str, sql: &str) -> Result<(), BoxError> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    client.batch_execute(sql).await?;
    Ok(())
}
