//! The load generator: `N` keep-alive HTTP/1.1 connections, each with one request in flight,
//! on a tokio runtime of its own (threads named [`cpu::CLIENT_THREAD`], so that their CPU time
//! is told apart from the server's).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, HOST};
use axum::http::{HeaderValue, Method, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tower_idempotency::response::IDEMPOTENT_REPLAYED;
use tower_idempotency::IDEMPOTENCY_KEY;

use crate::cpu;
use crate::BoxError;

/// The order a case's requests send: each case orders its own SKU, so that the order check
/// counts a case's orders alone where cases share a database (PostgreSQL).
pub(crate) fn order_body(sku: &str) -> Bytes {
    Bytes::from(format!(r#"{{"sku":"{sku}","quantity":1}}"#))
}

/// The load generator's runtime: threads of its own, named so that their CPU time can be told
/// apart from the server's (see `cpu`).
static CLIENT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();

pub(crate) fn start_client(threads: usize) -> Result<(), BoxError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(cpu::CLIENT_THREAD)
        .on_thread_start(crate::alloc::mark_client_thread)
        .enable_all()
        .build()?;
    CLIENT
        .set(runtime)
        .map_err(|_| "the client runtime is already running")?;
    Ok(())
}

/// Runs `future` on the load generator's runtime (this runtime when there is none).
async fn on_client<T: Send + 'static>(
    future: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    let task = match CLIENT.get() {
        Some(runtime) => runtime.spawn(future),
        None => tokio::spawn(future),
    };
    task.await.expect("a load generator task panicked")
}

/// One keep-alive HTTP/1.1 connection with its own request in flight.
pub(crate) struct Conn {
    addr: SocketAddr,
    sender: SendRequest<Full<Bytes>>,
    rng: u64,
    /// Keys this connection created recently (case C retries them).
    recent: VecDeque<String>,
}

async fn connect(addr: SocketAddr, seed: u64) -> Result<Conn, BoxError> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, connection) = http1::handshake(TokioIo::new(stream)).await?;
    // Ends when the sender is dropped.
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(Conn {
        addr,
        sender,
        // splitmix64 needs a non-zero odd start to mix well.
        rng: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
        recent: VecDeque::new(),
    })
}

/// Opens `n` connections from the load generator's runtime.
pub(crate) async fn connect_all(addr: SocketAddr, n: usize) -> Result<Vec<Conn>, BoxError> {
    on_client(async move {
        let mut conns = Vec::with_capacity(n);
        for i in 0..n {
            conns.push(connect(addr, i as u64 + 1).await?);
        }
        Ok(conns)
    })
    .await
}

impl Conn {
    /// splitmix64: a tiny, good-enough generator; no dependency for it.
    fn next_random(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// What a connection sends, request after request.
pub(crate) enum Workload {
    /// `POST path` with a new key each time (`{prefix}{n}`, n counting from 0), sending `body`.
    Create {
        path: &'static str,
        prefix: String,
        body: Bytes,
        next: AtomicU64,
    },
    /// `POST /orders` replaying one of the keys `{prefix}0` .. `{prefix}{count-1}` (created
    /// with `body`).
    Replay {
        prefix: String,
        count: u64,
        body: Bytes,
    },
    /// `POST /orders`: new keys, and `retry_percent` % retries of the connection's recent keys.
    Mixed {
        prefix: String,
        retry_percent: u64,
        next: AtomicU64,
        body: Bytes,
    },
    /// `GET /orders/{id}` for ids `first` .. `first + count - 1`.
    Read { first: u64, count: u64 },
    /// `POST path` with a new key `key(n)` each time, n counting from `next`'s start
    /// (`scale.rs`: UUID-like keys spread over the key space, as real clients send).
    CreateKeyed {
        path: &'static str,
        body: Bytes,
        next: AtomicU64,
        key: fn(u64) -> String,
    },
    /// `POST /orders` replaying `key(n)` for a random n below `count` (records written
    /// beforehand with `body`'s fingerprint, `scale.rs`).
    ReplayKeyed {
        body: Bytes,
        count: u64,
        key: fn(u64) -> String,
    },
}

/// What a response must look like to count as a success.
struct Expect {
    status: StatusCode,
    replayed: bool,
}

impl Workload {
    pub(crate) fn create(path: &'static str, prefix: &str, sku: &str) -> Self {
        Workload::Create {
            path,
            prefix: prefix.to_owned(),
            body: order_body(sku),
            next: AtomicU64::new(0),
        }
    }

    fn plan(&self, conn: &mut Conn) -> (http::Request<Full<Bytes>>, Expect) {
        match self {
            Workload::Create {
                path,
                prefix,
                body,
                next,
            } => {
                let key = format!("{prefix}{}", next.fetch_add(1, Ordering::Relaxed));
                (
                    post_request(conn, path, &key, Full::new(body.clone())),
                    created_fresh(),
                )
            }
            Workload::Replay {
                prefix,
                count,
                body,
            } => {
                let key = format!("{prefix}{}", conn.next_random() % count);
                let body = Full::new(body.clone());
                (post_request(conn, "/orders", &key, body), replayed())
            }
            Workload::Mixed {
                prefix,
                retry_percent,
                next,
                body,
            } => {
                let order = || Full::new(body.clone());
                let retry = conn.next_random() % 100 < *retry_percent && !conn.recent.is_empty();
                if retry {
                    let pick = conn.next_random() as usize % conn.recent.len();
                    let key = conn.recent[pick].clone();
                    (post_request(conn, "/orders", &key, order()), replayed())
                } else {
                    let key = format!("{prefix}{}", next.fetch_add(1, Ordering::Relaxed));
                    if conn.recent.len() == 16 {
                        conn.recent.pop_front();
                    }
                    conn.recent.push_back(key.clone());
                    (
                        post_request(conn, "/orders", &key, order()),
                        created_fresh(),
                    )
                }
            }
            Workload::CreateKeyed {
                path,
                body,
                next,
                key,
            } => {
                let key = key(next.fetch_add(1, Ordering::Relaxed));
                (
                    post_request(conn, path, &key, Full::new(body.clone())),
                    created_fresh(),
                )
            }
            Workload::ReplayKeyed { body, count, key } => {
                let key = key(conn.next_random() % count);
                let body = Full::new(body.clone());
                (post_request(conn, "/orders", &key, body), replayed())
            }
            Workload::Read { first, count } => {
                let id = first + conn.next_random() % count;
                let request = http::Request::get(format!("/orders/{id}"))
                    .header(HOST, host(conn.addr))
                    .header(
                        AUTHORIZATION,
                        HeaderValue::from_static("Bearer shop-a-token"),
                    )
                    .body(Full::new(Bytes::new()))
                    .expect("a valid request");
                let expect = Expect {
                    status: StatusCode::OK,
                    replayed: false,
                };
                (request, expect)
            }
        }
    }
}

fn created_fresh() -> Expect {
    Expect {
        status: StatusCode::CREATED,
        replayed: false,
    }
}

fn replayed() -> Expect {
    Expect {
        status: StatusCode::CREATED,
        replayed: true,
    }
}

fn host(addr: SocketAddr) -> HeaderValue {
    HeaderValue::try_from(addr.to_string()).expect("an address is a valid header value")
}

fn post_request(
    conn: &Conn,
    path: &str,
    key: &str,
    body: Full<Bytes>,
) -> http::Request<Full<Bytes>> {
    http::Request::builder()
        .method(Method::POST)
        .uri(path)
        .header(HOST, host(conn.addr))
        .header(
            AUTHORIZATION,
            HeaderValue::from_static("Bearer shop-a-token"),
        )
        .header(IDEMPOTENCY_KEY, key)
        .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
        .body(body)
        .expect("a valid request")
}

/// When a load run stops.
#[derive(Clone, Copy)]
pub(crate) enum Limit {
    For(Duration),
    Requests(u64),
}

/// What one load run measured.
#[derive(Default)]
pub(crate) struct LoadStats {
    /// Latency of every completed request, in microseconds.
    pub(crate) latencies: Vec<u32>,
    pub(crate) ok: u64,
    pub(crate) errors: u64,
    /// Successful `201`s that were not replays: each created an order.
    pub(crate) fresh: u64,
    pub(crate) first_error: Option<String>,
    pub(crate) elapsed: Duration,
}

impl LoadStats {
    pub(crate) fn merge(&mut self, other: LoadStats) {
        self.latencies.extend(other.latencies);
        self.ok += other.ok;
        self.errors += other.errors;
        self.fresh += other.fresh;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }

    pub(crate) fn requests_per_second(&self) -> f64 {
        (self.ok + self.errors) as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Runs `workload` on every connection until the limit, on the load generator's runtime;
/// returns the connections for reuse.
pub(crate) async fn run_load(
    conns: Vec<Conn>,
    workload: &Arc<Workload>,
    limit: Limit,
) -> (Vec<Conn>, LoadStats) {
    let workload = workload.clone();
    on_client(async move { run_load_here(conns, &workload, limit).await }).await
}

async fn run_load_here(
    conns: Vec<Conn>,
    workload: &Arc<Workload>,
    limit: Limit,
) -> (Vec<Conn>, LoadStats) {
    let start = Instant::now();
    let (deadline, budget) = match limit {
        Limit::For(duration) => (Some(start + duration), None),
        Limit::Requests(n) => (None, Some(Arc::new(AtomicI64::new(n as i64)))),
    };
    let tasks: Vec<_> = conns
        .into_iter()
        .map(|conn| {
            let workload = workload.clone();
            let budget = budget.clone();
            tokio::spawn(drive(conn, workload, deadline, budget))
        })
        .collect();
    let mut conns = Vec::with_capacity(tasks.len());
    let mut stats = LoadStats::default();
    for task in tasks {
        match task.await {
            Ok((conn, conn_stats)) => {
                conns.push(conn);
                stats.merge(conn_stats);
            }
            Err(error) => {
                stats.errors += 1;
                stats
                    .first_error
                    .get_or_insert(format!("load task failed: {error}"));
            }
        }
    }
    stats.elapsed = start.elapsed();
    (conns, stats)
}

async fn drive(
    mut conn: Conn,
    workload: Arc<Workload>,
    deadline: Option<Instant>,
    budget: Option<Arc<AtomicI64>>,
) -> (Conn, LoadStats) {
    let mut stats = LoadStats::default();
    loop {
        if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
            break;
        }
        if budget
            .as_ref()
            .is_some_and(|budget| budget.fetch_sub(1, Ordering::Relaxed) <= 0)
        {
            break;
        }
        let (request, expect) = workload.plan(&mut conn);
        let sent = Instant::now();
        let outcome = async {
            conn.sender.ready().await?;
            let response = conn.sender.send_request(request).await?;
            let status = response.status();
            let was_replayed = response
                .headers()
                .get(IDEMPOTENT_REPLAYED)
                .is_some_and(|value| value == "true");
            let body = response.into_body().collect().await?.to_bytes();
            Ok::<_, BoxError>((status, was_replayed, body))
        }
        .await;
        let micros = u32::try_from(sent.elapsed().as_micros()).unwrap_or(u32::MAX);
        match outcome {
            Ok((status, was_replayed, _))
                if status == expect.status && was_replayed == expect.replayed =>
            {
                stats.ok += 1;
                stats.latencies.push(micros);
                if status == StatusCode::CREATED && !was_replayed {
                    stats.fresh += 1;
                }
            }
            Ok((status, was_replayed, body)) => {
                stats.errors += 1;
                stats.latencies.push(micros);
                if status == StatusCode::CREATED && !was_replayed {
                    stats.fresh += 1;
                }
                stats.first_error.get_or_insert_with(|| {
                    format!(
                        "expected {}{}, got {status}{} {}",
                        expect.status,
                        if expect.replayed { " (replayed)" } else { "" },
                        if was_replayed { " (replayed)" } else { "" },
                        String::from_utf8_lossy(&body[..body.len().min(200)])
                    )
                });
            }
            Err(error) => {
                stats.errors += 1;
                stats
                    .first_error
                    .get_or_insert_with(|| format!("request failed: {error}"));
                // The connection may be broken: start a new one and go on.
                match connect(conn.addr, conn.rng).await {
                    Ok(fresh) => conn.sender = fresh.sender,
                    Err(_) => break,
                }
            }
        }
    }
    (conn, stats)
}
