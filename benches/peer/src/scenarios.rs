//! The same reliability scenarios against the `orders` example (tower-idempotency) and the
//! peer (axum-idempotent + a hand-written transaction), with counts of the orders each one
//! creates. Each server runs as a process of its own on a fresh durable SQLite file; the
//! orders are counted in that file.
//!
//! ```text
//! scenarios --orders PATH/TO/orders --peer PATH/TO/peer [--redis-server PATH/TO/redis-server]
//!           [--work DIR] [--kills N]
//! ```
//!
//! With `--redis-server` (Redis 7.4 or later: ruts' store needs `HEXPIRE`), the peer also runs
//! on a Redis of its own, started here on a free port, and one more scenario stops that Redis.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tokio::sync::Barrier;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const ORDER: &str = r#"{"sku":"book","quantity":1}"#;
const OTHER_ORDER: &str = r#"{"sku":"pen","quantity":5}"#;
const TIMEOUT: Duration = Duration::from_secs(5);

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("scenarios: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}

struct Args {
    orders: PathBuf,
    peer: PathBuf,
    redis_server: Option<PathBuf>,
    work: PathBuf,
    kills: usize,
}

fn parse_args() -> Result<Args, BoxError> {
    let (mut orders, mut peer, mut redis_server) = (None, None, None);
    let mut work = std::env::temp_dir().join("idempotency-peer-scenarios");
    let mut kills = 5;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--orders" => orders = Some(PathBuf::from(value)),
            "--peer" => peer = Some(PathBuf::from(value)),
            "--redis-server" => redis_server = Some(PathBuf::from(value)),
            "--work" => work = PathBuf::from(value),
            "--kills" => kills = value.parse()?,
            other => return Err(format!("unknown flag {other}").into()),
        }
    }
    Ok(Args {
        orders: orders.ok_or("--orders PATH is required")?,
        peer: peer.ok_or("--peer PATH is required")?,
        redis_server,
        work,
        kills,
    })
}

async fn run() -> Result<(), BoxError> {
    let args = parse_args()?;
    let _ = std::fs::remove_dir_all(&args.work);
    std::fs::create_dir_all(&args.work)?;
    let mut redis = None;
    let mut targets = vec![
        Target::orders(&args.orders, &args.work),
        Target::peer(&args.peer, &args.work, "moka", "peer-moka"),
    ];
    if let Some(redis_server) = &args.redis_server {
        let server = Redis::start(redis_server, &args.work).await?;
        targets.push(Target::peer(
            &args.peer,
            &args.work,
            &format!("redis://{}", server.addr),
            "peer-redis",
        ));
        redis = Some(server);
    }

    let mut table: Vec<(String, Vec<String>)> = Vec::new();
    for target in &targets {
        println!("== {}", target.name);
        let mut column = Vec::new();
        column.push(one_key_at_once(target).await?);
        column.push(sigkill(target, args.kills).await?);
        column.push(changed_body(target).await?);
        column.push(lost_cookie(target).await?);
        if target.name == "peer-redis" {
            if let Some(redis) = redis.as_mut() {
                column.push(redis_away(target, redis).await?);
            }
        }
        table.push((target.name.clone(), column));
    }
    println!();
    println!("summary (orders created; what was answered)");
    for (name, column) in &table {
        for line in column {
            println!("{name:<11} {line}");
        }
    }
    if let Some(mut redis) = redis {
        redis.stop().await;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The scenarios
// ---------------------------------------------------------------------------------------------

/// 32 requests with one key, sent at the same moment; five rounds, a key each.
async fn one_key_at_once(target: &Target) -> Result<String, BoxError> {
    let mut server = target.start("one-key").await?;
    let cookie = server.login().await?;
    let mut statuses = Statuses::default();
    let mut per_round = Vec::new();
    for round in 0..5 {
        let before = server.orders()?;
        let barrier = Arc::new(Barrier::new(32));
        let mut tasks = Vec::new();
        for _ in 0..32 {
            let (barrier, addr, cookie) = (barrier.clone(), server.addr.clone(), cookie.clone());
            tasks.push(tokio::spawn(async move {
                // Connected before the barrier, so that the 32 requests leave together.
                let stream = TcpStream::connect(&addr).await;
                barrier.wait().await;
                let key = format!("same-key-{round}");
                post_order_on(stream?, &addr, &key, ORDER, cookie.as_deref()).await
            }));
        }
        for task in tasks {
            statuses.add(task.await?);
        }
        per_round.push((server.orders()? - before).to_string());
    }
    server.kill().await;
    let line = format!(
        "32 at once with one key, 5 rounds: orders per round {}; answers {statuses}",
        per_round.join("/")
    );
    println!("{line}");
    Ok(line)
}

/// New keys from 16 clients; the server is SIGKILLed mid-load and started again on the same
/// file; every unanswered key is retried until answered. Then (a client that did not see its
/// answer in time, or a second tab) every answered key is sent once more.
async fn sigkill(target: &Target, kills: usize) -> Result<String, BoxError> {
    let mut server = target.start("sigkill").await?;
    let cookie = server.login().await?;
    let before = server.orders()?;
    let mut answered: Vec<String> = Vec::new();
    let mut unanswered: Vec<String> = Vec::new();
    for round in 0..kills {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicUsize::new(0));
        let mut workers = Vec::new();
        for worker in 0..16 {
            let (addr, cookie, stop, sent) = (
                server.addr.clone(),
                cookie.clone(),
                stop.clone(),
                sent.clone(),
            );
            workers.push(tokio::spawn(async move {
                let mut keys = Vec::new();
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    let key = format!("kill-{round}-{worker}-{n}");
                    n += 1;
                    sent.fetch_add(1, Ordering::Relaxed);
                    let status = post_order(&addr, &key, ORDER, cookie.as_deref()).await;
                    let ok = matches!(status, Ok(ref r) if r.status == 201);
                    keys.push((key, ok));
                    if !ok {
                        // The server is gone: this worker's last key is unanswered.
                        break;
                    }
                }
                keys
            }));
        }
        // Kill once the load is well under way.
        while sent.load(Ordering::Relaxed) < 200 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        server.kill().await;
        stop.store(true, Ordering::Relaxed);
        for worker in workers {
            for (key, ok) in worker.await? {
                if ok {
                    answered.push(key);
                } else {
                    unanswered.push(key);
                }
            }
        }
        server.restart().await?;
    }
    // Every unanswered key, retried until it is answered (same session cookie).
    let mut retry_statuses = Statuses::default();
    for key in &unanswered {
        for _ in 0..5 {
            let response = post_order(&server.addr, key, ORDER, cookie.as_deref()).await;
            let done = matches!(response, Ok(ref r) if r.status == 201);
            retry_statuses.add(response);
            if done {
                break;
            }
        }
    }
    let keys = answered.len() + unanswered.len();
    let after_retry = server.orders()? - before;
    // Every answered key once more.
    let mut replay_statuses = Statuses::default();
    for key in &answered {
        replay_statuses.add(post_order(&server.addr, key, ORDER, cookie.as_deref()).await);
    }
    let after_replay = server.orders()? - before;
    server.kill().await;
    let line = format!(
        "SIGKILL x{kills} under c16: {keys} keys, {} unanswered; after retrying those: {after_retry} \
         orders ({} extra; retries answered {retry_statuses}); after sending the {} answered keys \
         again: {} more orders ({replay_statuses})",
        unanswered.len(),
        after_retry - keys as i64,
        answered.len(),
        after_replay - after_retry,
    );
    println!("{line}");
    Ok(line)
}

/// A used key sent again with another body.
async fn changed_body(target: &Target) -> Result<String, BoxError> {
    let mut server = target.start("changed-body").await?;
    let cookie = server.login().await?;
    let before = server.orders()?;
    let first = post_order(&server.addr, "changed-1", ORDER, cookie.as_deref()).await?;
    let second = post_order(&server.addr, "changed-1", OTHER_ORDER, cookie.as_deref()).await?;
    let created = server.orders()? - before;
    server.kill().await;
    let line = format!(
        "changed body under a used key: {created} orders; first {}, then {} {}",
        first.status,
        second.status,
        second.summary()
    );
    println!("{line}");
    Ok(line)
}

/// The same key from a client without the cookie, and after a new login.
async fn lost_cookie(target: &Target) -> Result<String, BoxError> {
    let mut server = target.start("lost-cookie").await?;
    let cookie = server.login().await?;
    let before = server.orders()?;
    let first = post_order(&server.addr, "cookie-1", ORDER, cookie.as_deref()).await?;
    let without = post_order(&server.addr, "cookie-1", ORDER, None).await?;
    let after_without = server.orders()? - before;
    let new_cookie = server.login().await?;
    let relogged = post_order(&server.addr, "cookie-1", ORDER, new_cookie.as_deref()).await?;
    let created = server.orders()? - before;
    server.kill().await;
    let line = format!(
        "same key without the cookie, then after a new login: {after_without} then {created} \
         orders; first {}, without cookie {} {}, new login {} {}",
        first.status,
        without.status,
        without.summary(),
        relogged.status,
        relogged.summary()
    );
    println!("{line}");
    Ok(line)
}

/// Redis goes away (SIGKILL, no persistence, as a cache is usually run) while the peer serves;
/// keys answered before are retried, new keys are sent and retried; then Redis comes back
/// (empty) and every key is sent again.
async fn redis_away(target: &Target, redis: &mut Redis) -> Result<String, BoxError> {
    let mut server = target.start("redis-away").await?;
    let cookie = server.login().await?;
    let before = server.orders()?;
    let mut keys = Vec::new();
    for n in 0..5 {
        let key = format!("redis-before-{n}");
        post_order(&server.addr, &key, ORDER, cookie.as_deref()).await?;
        keys.push(key);
    }
    redis.kill().await;
    let mut down = Statuses::default();
    for n in 0..5 {
        keys.push(format!("redis-during-{n}"));
    }
    for key in keys.iter().chain(keys.iter()) {
        down.add(post_order(&server.addr, key, ORDER, cookie.as_deref()).await);
    }
    let while_down = server.orders()? - before;
    redis.start_again().await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut up = Statuses::default();
    for key in &keys {
        up.add(post_order(&server.addr, key, ORDER, cookie.as_deref()).await);
    }
    let created = server.orders()? - before;
    server.kill().await;
    let line = format!(
        "Redis killed: 10 keys (5 answered before), each sent twice while down -> {while_down} \
         orders ({down}); Redis back (empty), each key once more -> {created} orders ({up})"
    );
    println!("{line}");
    Ok(line)
}

// ---------------------------------------------------------------------------------------------
// Servers
// ---------------------------------------------------------------------------------------------

struct Target {
    name: String,
    program: PathBuf,
    /// Flags after `--addr ADDR --db PATH`.
    extra: Vec<String>,
    work: PathBuf,
    /// The peer needs a session cookie; the `orders` example has no sessions.
    login: bool,
}

impl Target {
    fn orders(program: &Path, work: &Path) -> Target {
        Target {
            name: "orders".into(),
            program: program.into(),
            extra: Vec::new(),
            work: work.into(),
            login: false,
        }
    }

    fn peer(program: &Path, work: &Path, store: &str, name: &str) -> Target {
        Target {
            name: name.into(),
            program: program.into(),
            extra: vec!["--store".into(), store.into()],
            work: work.into(),
            login: true,
        }
    }

    async fn start(&self, scenario: &str) -> Result<Server, BoxError> {
        let port = free_port()?;
        let mut server = Server {
            program: self.program.clone(),
            extra: self.extra.clone(),
            addr: format!("127.0.0.1:{port}"),
            db: self.work.join(format!("{}-{scenario}.db", self.name)),
            login: self.login,
            child: None,
        };
        server.restart().await?;
        Ok(server)
    }
}

struct Server {
    program: PathBuf,
    extra: Vec<String>,
    addr: String,
    db: PathBuf,
    login: bool,
    child: Option<Child>,
}

impl Server {
    /// Starts the server on its address and file; waits for its `listening on` line.
    async fn restart(&mut self) -> Result<(), BoxError> {
        let mut child = Command::new(&self.program)
            .arg("--addr")
            .arg(&self.addr)
            .arg("--db")
            .arg(&self.db)
            .args(&self.extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .map_err(|_| format!("{} did not start", self.program.display()))??;
        if !first.is_some_and(|line| line.starts_with("listening on")) {
            return Err(format!("{} did not start", self.program.display()).into());
        }
        // Keep reading its stdout so that it never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL: no shutdown of any kind.
    async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    /// The session cookie (`session=...`), for the peer.
    async fn login(&self) -> Result<Option<String>, BoxError> {
        if !self.login {
            return Ok(None);
        }
        let response = request(&self.addr, "POST", "/login", &[], "").await?;
        let cookie = response
            .headers
            .iter()
            .find(|(name, _)| name == "set-cookie")
            .and_then(|(_, value)| value.split(';').next())
            .ok_or("login answered no cookie")?;
        Ok(Some(cookie.to_owned()))
    }

    /// The orders in the server's file.
    fn orders(&self) -> Result<i64, BoxError> {
        let conn = rusqlite::Connection::open(&self.db)?;
        conn.busy_timeout(Duration::from_secs(10))?;
        Ok(conn.query_row("SELECT count(*) FROM orders", [], |row| row.get(0))?)
    }
}

/// A Redis of the scenarios' own, without persistence, on a free port.
struct Redis {
    program: PathBuf,
    dir: PathBuf,
    addr: String,
    child: Option<Child>,
}

impl Redis {
    async fn start(program: &Path, work: &Path) -> Result<Redis, BoxError> {
        let mut redis = Redis {
            program: program.into(),
            dir: work.into(),
            addr: format!("127.0.0.1:{}", free_port()?),
            child: None,
        };
        redis.start_again().await?;
        Ok(redis)
    }

    async fn start_again(&mut self) -> Result<(), BoxError> {
        let port = self.addr.rsplit(':').next().unwrap_or_default().to_owned();
        let child = Command::new(&self.program)
            .args([
                "--port",
                &port,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        self.child = Some(child);
        for _ in 0..100 {
            if TcpStream::connect(&self.addr).await.is_ok() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err("redis-server did not start".into())
    }

    async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    async fn stop(&mut self) {
        self.kill().await;
    }
}

fn free_port() -> Result<u16, BoxError> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

// ---------------------------------------------------------------------------------------------
// HTTP/1.1, one request per connection
// ---------------------------------------------------------------------------------------------

struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Reply {
    fn replayed(&self) -> bool {
        self.headers
            .iter()
            .any(|(name, value)| name.ends_with("replayed") && value == "true")
    }

    /// The body, and whether it was a replay.
    fn summary(&self) -> String {
        let replayed = if self.replayed() { " (replayed)" } else { "" };
        format!("{}{replayed}", self.body.trim())
    }
}

async fn post_order(
    addr: &str,
    key: &str,
    body: &str,
    cookie: Option<&str>,
) -> Result<Reply, BoxError> {
    let stream = tokio::time::timeout(TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| -> BoxError { "timeout".into() })??;
    post_order_on(stream, addr, key, body, cookie).await
}

async fn post_order_on(
    stream: TcpStream,
    addr: &str,
    key: &str,
    body: &str,
    cookie: Option<&str>,
) -> Result<Reply, BoxError> {
    let mut headers = vec![
        ("Idempotency-Key", key.to_owned()),
        ("Content-Type", "application/json".to_owned()),
    ];
    if let Some(cookie) = cookie {
        headers.push(("Cookie", cookie.to_owned()));
    }
    exchange(stream, addr, "POST", "/orders", &headers, body).await
}

async fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, String)],
    body: &str,
) -> Result<Reply, BoxError> {
    let stream = tokio::time::timeout(TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| -> BoxError { "timeout".into() })??;
    exchange(stream, addr, method, path, headers, body).await
}

/// One request on `stream`, `Connection: close`; the answer within [`TIMEOUT`].
async fn exchange(
    mut stream: TcpStream,
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, String)],
    body: &str,
) -> Result<Reply, BoxError> {
    let exchange = async {
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
             Authorization: Bearer shop-a-token\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        head.push_str(body);
        stream.write_all(head.as_bytes()).await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        parse_reply(&raw)
    };
    tokio::time::timeout(TIMEOUT, exchange)
        .await
        .map_err(|_| -> BoxError { "timeout".into() })?
}

fn parse_reply(raw: &[u8]) -> Result<Reply, BoxError> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n").ok_or("connection closed")?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|line| line.split(' ').nth(1))
        .and_then(|code| code.parse().ok())
        .ok_or("no status line")?;
    let headers = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_owned()))
        .collect();
    Ok(Reply {
        status,
        headers,
        body: body.to_owned(),
    })
}

/// Counts of the answers: `201 x1, 409 x31`, `timeout x3`.
#[derive(Default)]
struct Statuses(BTreeMap<String, usize>);

impl Statuses {
    fn add(&mut self, reply: Result<Reply, BoxError>) {
        let name = match reply {
            Ok(reply) if reply.replayed() => format!("{} replayed", reply.status),
            Ok(reply) => reply.status.to_string(),
            Err(error) if error.to_string() == "timeout" => "timeout".into(),
            Err(_) => "connection error".into(),
        };
        *self.0.entry(name).or_default() += 1;
    }
}

impl std::fmt::Display for Statuses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self.0.iter().map(|(k, n)| format!("{k} x{n}")).collect();
        write!(f, "{}", parts.join(", "))
    }
}
