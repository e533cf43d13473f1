//! The benchmark of issue 4: what the idempotency layer costs, measured against baselines in the
//! same process run, over real HTTP on loopback.
//!
//! ```text
//! cargo run --release --example bench                 # full run (a few minutes on 2 cores)
//! cargo run --release --example bench -- --quick      # smoke run, under a minute
//! cargo run --release --example bench -- --help
//! ```
//!
//! Every case gets a fresh SQLite database (WAL) in a temp dir (`TMPDIR` picks where: keep it on
//! a real disk, or `synchronous=FULL` measures no fsync at all), its own server on
//! `127.0.0.1:0` and `N` keep-alive HTTP/1.1 connections from a load generator in this program,
//! each with one request in flight (`N` = the concurrency). Client and server share the
//! machine, as they share one tokio runtime.
//!
//! | case | what runs |
//! |---|---|
//! | A | `POST /orders` under the layer (the handler of `examples/orders.rs`), a new key each time |
//! | B | the same route, replays of keys created beforehand |
//! | C | the same route, 90% new keys and 10% retries of the connection's recent keys |
//! | D | baseline: the same handler and insert without the layer (one writer connection behind an async mutex, one transaction per request, `spawn_blocking`) |
//! | R | baseline: `GET /orders/{id}` on the same server, read through `SqliteStore::read` |
//! | E | ceiling: the same SQL (check the record, insert the order, insert the record, commit) in a tight rusqlite loop on one thread, no HTTP |
//!
//! Throughput is the median of the rounds; latencies (p50, p99) pool every request of every
//! round; `cpu us` is the whole process's CPU time per request over the rounds (on Linux), which
//! tells a case bounded by the two cores from one bounded by waiting. After each case a check counts the orders, on a new connection and through
//! `SqliteStore::read`: each fresh `201` the clients received must have exactly one committed
//! order. Two extra measurements follow the table: replay latency while a handler holds the
//! write transaction for 100 ms at a time (`hold`), and bytes allocated per request for a
//! 64 KiB JSON body with and without the layer (`alloc`, a counting global allocator that only
//! counts during that measurement). The disk's `fsync` latency is probed before and after: every
//! `synchronous=FULL` figure depends on it. The table goes to `bench/results.csv`, the extras to
//! `bench/extras.csv` and the chart to `bench/throughput.svg`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::VecDeque;
use std::error::Error;
use std::fmt::Write as _;
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::path::{Path as FsPath, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, HOST, LOCATION};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::{Extension, Json, Router};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tower_idempotency::extract::Tx;
use tower_idempotency::fingerprint::Fingerprinter;
use tower_idempotency::response::IDEMPOTENT_REPLAYED;
use tower_idempotency::store::sqlite::rusqlite::{self, Connection, OptionalExtension};
use tower_idempotency::store::sqlite::{SqliteStore, SqliteTransaction, Synchronous};
use tower_idempotency::{IdempotencyLayer, Tenant, IDEMPOTENCY_KEY};

type BoxError = Box<dyn Error + Send + Sync>;

const USAGE: &str = "\
usage: bench [--quick] [--duration SECS] [--rounds N] [--cases A,B,C,D,R,E,hold,alloc]
             [--concurrency 1,16,64] [--modes full,normal] [--out DIR]

  --quick              short rounds (smoke run, under a minute)
  --duration SECS      length of one round (default 2; --quick 0.4)
  --rounds N           rounds per case; throughput is their median (default 3; --quick 2)
  --cases LIST         what to run (default all): A B C D R E, hold (replays while a handler
                       holds the write transaction), alloc (bytes allocated per request)
  --concurrency LIST   connections, one request in flight each (default 1,16,64)
  --modes LIST         durability: full, normal (default both)
  --out DIR            where results.csv, extras.csv and throughput.svg go (default bench)
  -h, --help           show this help

Temp databases go to the system temp dir (TMPDIR): keep it on a real disk.";

// ---------------------------------------------------------------------------------------------
// Counting allocator
// ---------------------------------------------------------------------------------------------

/// Counts the bytes and blocks the whole process allocates while [`COUNTING`] is on. Off, it
/// costs one relaxed load per allocation, so it does not distort the throughput cases.
struct CountingAlloc;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATED_BYTES: AtomicU64 = AtomicU64::new(0);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

#[global_allocator]
static ALLOCATOR: CountingAlloc = CountingAlloc;

impl CountingAlloc {
    fn count(size: usize) {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATED_BYTES.fetch_add(size as u64, Ordering::Relaxed);
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
    }
}

// SAFETY: every method forwards its arguments unchanged to the system allocator, which upholds
// the `GlobalAlloc` contract; the counting touches only atomics and never allocates.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Self::count(layout.size());
        // SAFETY: the caller upholds `alloc`'s contract; forwarded as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Self::count(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` through this allocator, with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // Counted as a new block of the new size: a growing buffer may be moved and copied.
        Self::count(new_size);
        // SAFETY: `ptr` came from `System` through this allocator, with this layout.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// What the allocator counted between two points.
#[derive(Clone, Copy, Debug, Default)]
struct AllocCount {
    bytes: u64,
    blocks: u64,
}

impl AllocCount {
    fn start() {
        ALLOCATED_BYTES.store(0, Ordering::SeqCst);
        ALLOCATIONS.store(0, Ordering::SeqCst);
        COUNTING.store(true, Ordering::SeqCst);
    }

    fn stop() -> Self {
        COUNTING.store(false, Ordering::SeqCst);
        AllocCount {
            bytes: ALLOCATED_BYTES.load(Ordering::SeqCst),
            blocks: ALLOCATIONS.load(Ordering::SeqCst),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Case {
    A,
    B,
    C,
    D,
    R,
    E,
}

impl Case {
    const HTTP: [Case; 5] = [Case::A, Case::B, Case::C, Case::D, Case::R];

    fn name(self) -> &'static str {
        match self {
            Case::A => "A",
            Case::B => "B",
            Case::C => "C",
            Case::D => "D",
            Case::R => "R",
            Case::E => "E",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Case::A => "layer, new keys",
            Case::B => "layer, replays",
            Case::C => "layer, 90% new / 10% retries",
            Case::D => "no layer (baseline)",
            Case::R => "GET /orders/{id} (baseline)",
            Case::E => "rusqlite loop, no HTTP (ceiling)",
        }
    }

    /// The baseline a case is compared with in the table's ratio column.
    fn baseline(self) -> Option<Case> {
        match self {
            Case::A | Case::C => Some(Case::D),
            Case::B => Some(Case::R),
            Case::D | Case::R | Case::E => None,
        }
    }

    fn color(self) -> &'static str {
        match self {
            Case::A => "#1f77b4",
            Case::B => "#ff7f0e",
            Case::C => "#2ca02c",
            Case::D => "#d62728",
            Case::R => "#9467bd",
            Case::E => "#555555",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Mode {
    Full,
    Normal,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Full => "FULL",
            Mode::Normal => "NORMAL",
        }
    }

    fn synchronous(self) -> Synchronous {
        match self {
            Mode::Full => Synchronous::Full,
            Mode::Normal => Synchronous::Normal,
        }
    }
}

#[derive(Clone, Debug)]
struct Options {
    duration: Duration,
    warmup: Duration,
    rounds: usize,
    cases: Vec<Case>,
    hold: bool,
    alloc: bool,
    concurrency: Vec<usize>,
    modes: Vec<Mode>,
    out: PathBuf,
    quick: bool,
}

enum Command {
    Help,
    Run(Options),
}

impl Command {
    /// Hand-parsed, like the orders example: a few flags do not justify a dependency.
    fn parse(mut args: impl Iterator<Item = String>) -> Result<Self, String> {
        let mut quick = false;
        let mut duration = None;
        let mut rounds = None;
        let mut selected: Option<Vec<String>> = None;
        let mut concurrency = vec![1, 16, 64];
        let mut modes = vec![Mode::Full, Mode::Normal];
        let mut out = PathBuf::from("bench");
        while let Some(arg) = args.next() {
            let (flag, inline) = match arg.split_once('=') {
                Some((flag, value)) if flag.starts_with("--") => (flag, Some(value.to_owned())),
                _ => (arg.as_str(), None),
            };
            let mut value = || {
                inline
                    .clone()
                    .or_else(|| args.next())
                    .ok_or_else(|| format!("{flag} needs a value"))
            };
            match flag {
                "-h" | "--help" => return Ok(Command::Help),
                "--quick" if inline.is_none() => quick = true,
                "--duration" => {
                    let secs: f64 = value()?
                        .parse()
                        .map_err(|_| "--duration takes seconds, such as 2 or 0.5")?;
                    if !(0.05..=3600.0).contains(&secs) {
                        return Err("--duration must be between 0.05 and 3600 seconds".into());
                    }
                    duration = Some(Duration::from_secs_f64(secs));
                }
                "--rounds" => {
                    let n: usize = value()?
                        .parse()
                        .map_err(|_| "--rounds takes a positive integer")?;
                    if n == 0 {
                        return Err("--rounds must be at least 1".into());
                    }
                    rounds = Some(n);
                }
                "--cases" => selected = Some(list(&value()?)),
                "--concurrency" => {
                    concurrency = list(&value()?)
                        .iter()
                        .map(|c| c.parse::<usize>().ok().filter(|c| (1..=1024).contains(c)))
                        .collect::<Option<Vec<_>>>()
                        .ok_or("--concurrency takes integers from 1 to 1024, such as 1,16,64")?;
                    concurrency.sort_unstable();
                    concurrency.dedup();
                }
                "--modes" => {
                    modes = list(&value()?)
                        .iter()
                        .map(|m| match m.to_ascii_lowercase().as_str() {
                            "full" => Ok(Mode::Full),
                            "normal" => Ok(Mode::Normal),
                            other => Err(format!("unknown mode `{other}` (full, normal)")),
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    modes.sort_unstable();
                    modes.dedup();
                }
                "--out" => out = PathBuf::from(value()?),
                _ => return Err(format!("unknown argument `{arg}`")),
            }
        }

        let (mut cases, mut hold, mut alloc) = (Vec::new(), false, false);
        match selected {
            None => {
                cases = vec![Case::A, Case::B, Case::C, Case::D, Case::R, Case::E];
                (hold, alloc) = (true, true);
            }
            Some(names) => {
                for name in names {
                    match name.to_ascii_lowercase().as_str() {
                        "a" => cases.push(Case::A),
                        "b" => cases.push(Case::B),
                        "c" => cases.push(Case::C),
                        "d" => cases.push(Case::D),
                        "r" => cases.push(Case::R),
                        "e" => cases.push(Case::E),
                        "hold" => hold = true,
                        "alloc" => alloc = true,
                        _ => return Err(format!("unknown case `{name}`")),
                    }
                }
                cases.sort_unstable();
                cases.dedup();
            }
        }
        if modes.is_empty() || concurrency.is_empty() {
            return Err("--modes and --concurrency need at least one value".into());
        }
        let duration = duration.unwrap_or(if quick {
            Duration::from_millis(400)
        } else {
            Duration::from_secs(2)
        });
        Ok(Command::Run(Options {
            duration,
            warmup: (duration / 4).clamp(Duration::from_millis(100), Duration::from_millis(500)),
            rounds: rounds.unwrap_or(if quick { 2 } else { 3 }),
            cases,
            hold,
            alloc,
            concurrency,
            modes,
            out,
            quick,
        }))
    }
}

fn list(value: &str) -> Vec<String> {
    value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The app: the orders example's handler, plus the baseline and the slow routes
// ---------------------------------------------------------------------------------------------

/// The business table, as in `examples/orders.rs`.
const ORDERS_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS orders (
    id        INTEGER PRIMARY KEY,
    tenant_id TEXT    NOT NULL,
    sku       TEXT    NOT NULL,
    quantity  INTEGER NOT NULL
);";

const INSERT_ORDER: &str = "INSERT INTO orders (tenant_id, sku, quantity) VALUES (?1, ?2, ?3)";

/// How long the slow routes hold the write transaction.
const HOLD: Duration = Duration::from_millis(100);

#[derive(Clone)]
struct AppState {
    store: SqliteStore,
    baseline: BaselineWriter,
}

fn app(state: AppState) -> Router {
    let layer = |operation: &'static str| {
        IdempotencyLayer::new(state.store.clone())
            .with_operation(operation)
            // As in the orders example.
            .with_fingerprinter(Fingerprinter::json())
    };
    Router::new()
        .route("/orders", post(create_order).layer(layer("create_order")))
        .route("/orders/{id}", get(get_order))
        .route("/baseline/orders", post(create_order_baseline))
        // The same route with the raw-bytes fingerprint: isolates what JSON canonicalization
        // allocates in the `alloc` measurement.
        .route(
            "/raw/orders",
            post(create_order)
                .layer(layer("create_order_raw").with_fingerprinter(Fingerprinter::raw())),
        )
        .route("/slow/async", post(slow_async).layer(layer("slow_async")))
        .route(
            "/slow/blocking",
            post(slow_blocking).layer(layer("slow_blocking")),
        )
        .layer(middleware::from_fn(authenticate))
        .with_state(state)
}

/// The orders example's demo authentication.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let tenant = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .and_then(|token| match token {
            "shop-a-token" => Some(Tenant::new("shop-a")),
            "shop-b-token" => Some(Tenant::new("shop-b")),
            _ => None,
        });
    match tenant {
        Some(tenant) => {
            request.extensions_mut().insert(tenant);
            next.run(request).await
        }
        None => ApiError::Unauthenticated.into_response(),
    }
}

/// `POST /orders` under the layer: the handler of `examples/orders.rs`.
async fn create_order(
    Extension(tenant): Extension<Tenant>,
    Tx(tx): Tx<SqliteTransaction>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let order = NewOrder::parse(&body)?;
    let tenant_id = tenant.as_str().to_owned();
    let order_id = tx
        .run(move |conn| {
            conn.execute(INSERT_ORDER, (tenant_id, order.sku, order.quantity))?;
            Ok(conn.last_insert_rowid())
        })
        .await
        .map_err(|_| ApiError::Internal)?;
    Ok(created(order_id))
}

/// Baseline D: the same handler and insert, without the layer.
async fn create_order_baseline(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let order = NewOrder::parse(&body)?;
    let tenant_id = tenant.as_str().to_owned();
    let order_id = state
        .baseline
        .transaction(move |tx| {
            tx.execute(INSERT_ORDER, (tenant_id, order.sku, order.quantity))?;
            Ok(tx.last_insert_rowid())
        })
        .await
        .map_err(|_| ApiError::Internal)?;
    Ok(created(order_id))
}

/// Inserts an order, then holds the open transaction for [`HOLD`] while awaiting (the writer
/// thread is free; the write lock is not).
async fn slow_async(
    Extension(tenant): Extension<Tenant>,
    Tx(tx): Tx<SqliteTransaction>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let order = NewOrder::parse(&body)?;
    let tenant_id = tenant.as_str().to_owned();
    let order_id = tx
        .run(move |conn| {
            conn.execute(INSERT_ORDER, (tenant_id, order.sku, order.quantity))?;
            Ok(conn.last_insert_rowid())
        })
        .await
        .map_err(|_| ApiError::Internal)?;
    tokio::time::sleep(HOLD).await;
    Ok(created(order_id))
}

/// Inserts an order and sleeps [`HOLD`] inside the statement closure: the transaction and the
/// writer connection's thread are both busy.
async fn slow_blocking(
    Extension(tenant): Extension<Tenant>,
    Tx(tx): Tx<SqliteTransaction>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let order = NewOrder::parse(&body)?;
    let tenant_id = tenant.as_str().to_owned();
    let order_id = tx
        .run(move |conn| {
            conn.execute(INSERT_ORDER, (tenant_id, order.sku, order.quantity))?;
            std::thread::sleep(HOLD);
            Ok(conn.last_insert_rowid())
        })
        .await
        .map_err(|_| ApiError::Internal)?;
    Ok(created(order_id))
}

fn created(order_id: i64) -> Response {
    (
        StatusCode::CREATED,
        [(LOCATION, format!("/orders/{order_id}"))],
        Json(json!({ "order_id": order_id })),
    )
        .into_response()
}

/// Baseline R: `GET /orders/{id}` as in the orders example.
async fn get_order(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let order_id: i64 = id.parse().map_err(|_| ApiError::NotFound)?;
    let tenant_id = tenant.as_str().to_owned();
    let order = state
        .store
        .read(move |conn| {
            conn.query_row(
                "SELECT sku, quantity FROM orders WHERE id = ?1 AND tenant_id = ?2",
                (order_id, tenant_id),
                |row| Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?)),
            )
            .optional()
        })
        .await
        .map_err(|_| ApiError::Internal)?;
    let (sku, quantity) = order.ok_or(ApiError::NotFound)?;
    Ok(Json(
        json!({ "order_id": order_id, "sku": sku, "quantity": quantity }),
    ))
}

/// A validated order request, parsed as in the orders example.
struct NewOrder {
    sku: String,
    quantity: i64,
}

impl NewOrder {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let value: Value = serde_json::from_slice(body).map_err(|_| ApiError::InvalidKeyOrSku)?;
        let sku = value
            .get("sku")
            .and_then(Value::as_str)
            .filter(|sku| (1..=100).contains(&sku.chars().count()))
            .ok_or(ApiError::InvalidKeyOrSku)?;
        let quantity = value
            .get("quantity")
            .and_then(Value::as_i64)
            .filter(|quantity| (1..=100).contains(quantity))
            .ok_or(ApiError::InvalidQuantity)?;
        Ok(NewOrder {
            sku: sku.to_owned(),
            quantity,
        })
    }
}

#[derive(Debug)]
enum ApiError {
    Unauthenticated,
    InvalidKeyOrSku,
    InvalidQuantity,
    NotFound,
    Internal,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = match self {
            ApiError::Unauthenticated => (StatusCode::UNAUTHORIZED, "unauthenticated"),
            ApiError::InvalidKeyOrSku => (StatusCode::BAD_REQUEST, "invalid_key_or_sku"),
            ApiError::InvalidQuantity => (StatusCode::BAD_REQUEST, "invalid_quantity"),
            ApiError::NotFound => (StatusCode::NOT_FOUND, "not_found"),
            ApiError::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal_error"),
        };
        (status, Json(json!({ "error": code }))).into_response()
    }
}

/// Baseline D's database access: one writer connection behind an async mutex, each request its
/// own `BEGIN IMMEDIATE` ... `COMMIT` run under `spawn_blocking` (never on the executor).
#[derive(Clone)]
struct BaselineWriter {
    conn: Arc<tokio::sync::Mutex<Connection>>,
}

impl BaselineWriter {
    /// Opens the connection and primes the WAL through it (it stays open as long as the
    /// server, so the primed WAL file is not deleted).
    fn open(path: &FsPath, mode: Mode) -> Result<Self, BoxError> {
        let conn = open_connection(path, mode)?;
        prime_wal(&conn, mode)?;
        Ok(BaselineWriter {
            conn: Arc::new(tokio::sync::Mutex::new(conn)),
        })
    }

    async fn transaction<T, F>(&self, f: F) -> Result<T, BoxError>
    where
        F: FnOnce(&rusqlite::Transaction<'_>) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let mut conn = self.conn.clone().lock_owned().await;
        let value = tokio::task::spawn_blocking(move || {
            let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let value = f(&tx)?;
            tx.commit()?;
            Ok::<_, rusqlite::Error>(value)
        })
        .await??;
        Ok(value)
    }
}

/// A writer connection configured like the store's: WAL, the mode's `synchronous` (a
/// per-connection setting), a busy timeout.
fn open_connection(path: &FsPath, mode: Mode) -> Result<Connection, BoxError> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(5))?;
    let journal: String = conn.query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))?;
    if !journal.eq_ignore_ascii_case("wal") {
        return Err(format!("SQLite refused WAL (journal_mode={journal})").into());
    }
    conn.pragma_update(None, "synchronous", mode.name())?;
    Ok(conn)
}

/// Pages of ballast written by [`prime_wal`]: a little more than the WAL holds before its
/// automatic checkpoint (1000 pages).
const BALLAST_PAGES: usize = 1100;

/// Brings a fresh database to its steady state before anything is measured: a WAL file already
/// at its working size, and free pages in the database file.
///
/// A fresh WAL grows with every commit until the first checkpoint; from then on SQLite reuses
/// the file from its start, as it does in a long-running server. Extending a file costs more at
/// each sync than overwriting it, and with a fresh database per case the slowest cases would be
/// measured mostly in that start-up phase. So: ballast committed and dropped, then a `RESTART`
/// checkpoint so the next writer starts the WAL from its beginning, all synced before the
/// measurement. SQLite deletes the WAL file when the database's last connection closes: `conn`
/// must stay open while the case runs.
fn prime_wal(conn: &Connection, mode: Mode) -> Result<(), BoxError> {
    conn.pragma_update(None, "synchronous", "OFF")?;
    conn.execute_batch("BEGIN IMMEDIATE; CREATE TABLE bench_ballast (filler BLOB);")?;
    let filled = (|| {
        let mut insert =
            conn.prepare("INSERT INTO bench_ballast (filler) VALUES (zeroblob(4000))")?;
        for _ in 0..BALLAST_PAGES {
            insert.execute([])?;
        }
        Ok::<_, rusqlite::Error>(())
    })();
    if let Err(error) = filled {
        let _ = conn.execute_batch("ROLLBACK");
        return Err(error.into());
    }
    conn.execute_batch("COMMIT; DROP TABLE bench_ballast;")?;
    // Synced from here: the checkpoint flushes the WAL and the database file before measuring.
    conn.pragma_update(None, "synchronous", mode.name())?;
    let (busy, _, _): (i64, i64, i64) =
        conn.query_row("PRAGMA wal_checkpoint(RESTART)", [], |row| {
            Ok((row.get(0)?, row.get(1)?, row.get(2)?))
        })?;
    if busy != 0 {
        return Err("priming the WAL: the checkpoint could not restart the WAL".into());
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// A server per case
// ---------------------------------------------------------------------------------------------

struct Server {
    addr: SocketAddr,
    state: AppState,
    stop: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
    // Last: removed after the store above is dropped (or handed back by `shut_down`).
    _dir: tempfile::TempDir,
}

impl Server {
    async fn start(mode: Mode) -> Result<Self, BoxError> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("orders.db");
        let store = SqliteStore::builder(&path)
            .synchronous(mode.synchronous())
            .open()
            .await?;
        store.write(|tx| tx.execute_batch(ORDERS_SCHEMA)).await?;
        let baseline = BaselineWriter::open(&path, mode)?;
        let state = AppState { store, baseline };

        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        // Responses are small and written whole: no reason to let Nagle hold them.
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(
            axum::serve(listener, app(state.clone()))
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .into_future(),
        );
        Ok(Server {
            addr,
            state,
            stop,
            task,
            _dir: dir,
        })
    }

    /// Checks that the database holds `expected` orders, as seen by a new connection (what is
    /// committed now) and through `SqliteStore::read` (what the store's readers see). Returns
    /// the problem, if any.
    async fn check_orders(&self, expected: i64) -> Result<Option<String>, BoxError> {
        let committed = count_orders(self.state.store.path().to_path_buf()).await?;
        let via_store: i64 = self
            .state
            .store
            .read(|conn| conn.query_row("SELECT count(*) FROM orders", [], |row| row.get(0)))
            .await?;
        Ok((committed != expected || via_store != expected).then(|| {
            format!(
                "expected {expected} orders (one per fresh 201); a new connection counts \
                 {committed}, SqliteStore::read counts {via_store}"
            )
        }))
    }

    /// Stops the server once the client connections are closed (drop them first). Returns
    /// the temp dir, still holding the database.
    async fn shut_down(self) -> Result<tempfile::TempDir, BoxError> {
        let _ = self.stop.send(());
        match tokio::time::timeout(Duration::from_secs(10), self.task).await {
            Ok(joined) => joined??,
            Err(_) => return Err("the server did not shut down within 10 s".into()),
        }
        Ok(self._dir)
    }
}

/// The orders committed in the database at `path`, counted on a new read-only connection: its
/// first read sees every transaction committed so far.
async fn count_orders(path: PathBuf) -> Result<i64, BoxError> {
    tokio::task::spawn_blocking(move || {
        let conn = Connection::open_with_flags(&path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)?;
        conn.busy_timeout(Duration::from_secs(5))?;
        Ok(conn.query_row("SELECT count(*) FROM orders", [], |row| row.get(0))?)
    })
    .await?
}

// ---------------------------------------------------------------------------------------------
// The load generator
// ---------------------------------------------------------------------------------------------

/// The order every new-key request sends.
const ORDER_BODY: &str = r#"{"sku":"book","quantity":1}"#;

/// One keep-alive HTTP/1.1 connection with its own request in flight.
struct Conn {
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

async fn connect_all(addr: SocketAddr, n: usize) -> Result<Vec<Conn>, BoxError> {
    let mut conns = Vec::with_capacity(n);
    for i in 0..n {
        conns.push(connect(addr, i as u64 + 1).await?);
    }
    Ok(conns)
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
enum Workload {
    /// `POST path` with a new key each time (`{prefix}{n}`, n counting from 0).
    Create {
        path: &'static str,
        prefix: String,
        body: Bytes,
        next: AtomicU64,
    },
    /// `POST /orders` replaying one of the keys `{prefix}0` .. `{prefix}{count-1}`.
    Replay { prefix: String, count: u64 },
    /// `POST /orders`: new keys, and `retry_percent` % retries of the connection's recent keys.
    Mixed {
        prefix: String,
        retry_percent: u64,
        next: AtomicU64,
    },
    /// `GET /orders/{id}` for ids 1 ..= `max_id`.
    Read { max_id: u64 },
}

/// What a response must look like to count as a success.
struct Expect {
    status: StatusCode,
    replayed: bool,
}

impl Workload {
    fn create(path: &'static str, prefix: &str) -> Self {
        Workload::Create {
            path,
            prefix: prefix.to_owned(),
            body: Bytes::from_static(ORDER_BODY.as_bytes()),
            next: AtomicU64::new(0),
        }
    }

    fn plan(&self, conn: &mut Conn) -> (http::Request<Full<Bytes>>, Expect) {
        let order = || Full::new(Bytes::from_static(ORDER_BODY.as_bytes()));
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
            Workload::Replay { prefix, count } => {
                let key = format!("{prefix}{}", conn.next_random() % count);
                (post_request(conn, "/orders", &key, order()), replayed())
            }
            Workload::Mixed {
                prefix,
                retry_percent,
                next,
            } => {
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
            Workload::Read { max_id } => {
                let id = 1 + conn.next_random() % max_id;
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
enum Limit {
    For(Duration),
    Requests(u64),
}

/// What one load run measured.
#[derive(Default)]
struct LoadStats {
    /// Latency of every completed request, in microseconds.
    latencies: Vec<u32>,
    ok: u64,
    errors: u64,
    /// Successful `201`s that were not replays: each created an order.
    fresh: u64,
    first_error: Option<String>,
    elapsed: Duration,
}

impl LoadStats {
    fn merge(&mut self, other: LoadStats) {
        self.latencies.extend(other.latencies);
        self.ok += other.ok;
        self.errors += other.errors;
        self.fresh += other.fresh;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }

    fn requests_per_second(&self) -> f64 {
        (self.ok + self.errors) as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Runs `workload` on every connection until the limit; returns the connections for reuse.
async fn run_load(
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

// ---------------------------------------------------------------------------------------------
// The measurements
// ---------------------------------------------------------------------------------------------

/// One row of the table.
#[derive(Clone, Debug)]
struct Row {
    case: Case,
    mode: Mode,
    concurrency: usize,
    /// Requests per second of each round.
    rounds: Vec<f64>,
    p50_ms: f64,
    p99_ms: f64,
    requests: u64,
    errors: u64,
    /// CPU time of the whole process (server, load generator, writer thread) per request
    /// over the measured rounds, in microseconds: where the throughput is bounded by the two
    /// cores rather than by waiting. `None` where the process CPU time cannot be read.
    cpu_us: Option<f64>,
    /// What the order count check found wrong, if anything.
    integrity: Option<String>,
}

impl Row {
    fn median(&self) -> f64 {
        median(&self.rounds)
    }
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The nearest-rank percentile of latencies in microseconds, in milliseconds.
fn percentile_ms(sorted_micros: &[u32], percentile: f64) -> f64 {
    if sorted_micros.is_empty() {
        return 0.0;
    }
    let rank = (percentile / 100.0 * sorted_micros.len() as f64).ceil() as usize;
    f64::from(sorted_micros[rank.clamp(1, sorted_micros.len()) - 1]) / 1000.0
}

/// The keys case B replays, created (over HTTP, through the layer) before it starts.
const REPLAY_KEYS: u64 = 1000;
/// The orders case R reads, inserted before it starts.
const READ_ORDERS: u64 = 1000;

async fn run_http_case(
    case: Case,
    mode: Mode,
    concurrency: usize,
    options: &Options,
) -> Result<Row, BoxError> {
    let server = Server::start(mode).await?;
    // Orders the setup created: each fresh 201 must leave exactly one.
    let mut expected_orders = 0i64;
    let workload = Arc::new(match case {
        Case::A => Workload::create("/orders", "a-"),
        Case::B => {
            let setup = connect_all(server.addr, 16).await?;
            let create = Arc::new(Workload::create("/orders", "b-"));
            let (setup, stats) = run_load(setup, &create, Limit::Requests(REPLAY_KEYS)).await;
            drop(setup);
            if stats.errors > 0 {
                return Err(format!(
                    "creating the keys to replay failed: {}",
                    stats.first_error.unwrap_or_default()
                )
                .into());
            }
            expected_orders += stats.fresh as i64;
            Workload::Replay {
                prefix: "b-".into(),
                count: REPLAY_KEYS,
            }
        }
        Case::C => Workload::Mixed {
            prefix: "c-".into(),
            retry_percent: 10,
            next: AtomicU64::new(0),
        },
        Case::D => Workload::create("/baseline/orders", "d-"),
        Case::R => {
            server
                .state
                .store
                .write(|tx| {
                    let mut insert = tx.prepare(INSERT_ORDER)?;
                    for _ in 0..READ_ORDERS {
                        insert.execute(("shop-a", "book", 1))?;
                    }
                    Ok(())
                })
                .await?;
            expected_orders += READ_ORDERS as i64;
            Workload::Read {
                max_id: READ_ORDERS,
            }
        }
        Case::E => return Err("case E does not run over HTTP".into()),
    });
    let label = format!("{} {} c={concurrency}", case.name(), mode.name());
    let mut problems = Vec::new();
    if let Some(problem) = server.check_orders(expected_orders).await? {
        problems.push(format!("after the setup: {problem}"));
    }

    let conns = connect_all(server.addr, concurrency).await?;
    let (mut conns, warmup) = run_load(conns, &workload, Limit::For(options.warmup)).await;
    let mut fresh = warmup.fresh;
    let mut pooled = LoadStats::default();
    let mut rounds = Vec::with_capacity(options.rounds);
    let cpu_before = process_cpu();
    for _ in 0..options.rounds {
        let (back, stats) = run_load(conns, &workload, Limit::For(options.duration)).await;
        conns = back;
        rounds.push(stats.requests_per_second());
        fresh += stats.fresh;
        pooled.merge(stats);
    }
    let cpu_us = cpu_per_request(cpu_before, pooled.ok + pooled.errors);
    drop(conns);

    // Every fresh 201 must have its order committed by the time the client has it (the commit
    // comes before the response), and nothing else may have created one.
    expected_orders += fresh as i64;
    if let Some(problem) = server.check_orders(expected_orders).await? {
        problems.push(format!("after the load: {problem}"));
    }
    if let Some(error) = &pooled.first_error {
        eprintln!(
            "  !! {label}: {} unexpected answers, first: {error}",
            pooled.errors
        );
    }
    let dir = server.shut_down().await?;
    if !problems.is_empty() {
        // Late commits show up here; lost ones do not.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let settled = count_orders(dir.path().join("orders.db")).await?;
        problems.push(format!("after shutdown: {settled} orders"));
        eprintln!("  !! {label}: {}", problems.join("; "));
    }
    drop(dir);

    pooled.latencies.sort_unstable();
    Ok(Row {
        case,
        mode,
        concurrency,
        rounds,
        p50_ms: percentile_ms(&pooled.latencies, 50.0),
        p99_ms: percentile_ms(&pooled.latencies, 99.0),
        requests: pooled.ok + pooled.errors,
        errors: pooled.errors,
        cpu_us,
        integrity: (!problems.is_empty()).then(|| problems.join("; ")),
    })
}

/// Case E: check the record, insert the order, insert the record, commit; on one thread.
async fn run_ceiling(mode: Mode, options: &Options) -> Result<Row, BoxError> {
    // The store creates the records table; then it is closed and a bare connection takes over.
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("orders.db");
    {
        let store = SqliteStore::builder(&path)
            .synchronous(mode.synchronous())
            .open()
            .await?;
        store.write(|tx| tx.execute_batch(ORDERS_SCHEMA)).await?;
    }
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
        integrity: None,
    })
}

/// The CPU time this process has used so far (all threads, user and system), on Linux.
fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may hold spaces: count fields after its closing parenthesis.
    let fields: Vec<&str> = stat.get(stat.rfind(')')? + 2..)?.split(' ').collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // The kernel reports in clock ticks of USER_HZ, 100 per second on Linux.
    Some(Duration::from_millis(ticks * 10))
}

/// CPU microseconds per request since `before`.
fn cpu_per_request(before: Option<Duration>, requests: u64) -> Option<f64> {
    let used = process_cpu()?.checked_sub(before?)?;
    (requests > 0).then(|| used.as_secs_f64() * 1e6 / requests as f64)
}

/// One line of the extra measurements (`bench/extras.csv`).
struct Extra {
    measure: &'static str,
    variant: String,
    metric: &'static str,
    value: f64,
    unit: &'static str,
}

/// Replay latency while a handler holds the write transaction 100 ms at a time, in a loop.
async fn run_hold(options: &Options) -> Result<Vec<Extra>, BoxError> {
    const REPLAY_CONCURRENCY: usize = 16;
    let duration = (options.duration * options.rounds as u32).max(Duration::from_millis(800));
    let server = Server::start(Mode::Full).await?;
    let setup = connect_all(server.addr, 16).await?;
    let create = Arc::new(Workload::create("/orders", "h-"));
    let (setup, stats) = run_load(setup, &create, Limit::Requests(REPLAY_KEYS)).await;
    drop(setup);
    if stats.errors > 0 {
        return Err(format!(
            "creating the keys to replay failed: {}",
            stats.first_error.unwrap_or_default()
        )
        .into());
    }
    let replays = Arc::new(Workload::Replay {
        prefix: "h-".into(),
        count: REPLAY_KEYS,
    });
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
                    let slow = Arc::new(Workload::create(path, "slow-"));
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

/// Bytes allocated per request (the whole process: client, server, SQLite) for a 64 KiB JSON
/// body, sent one at a time, through the layer and through baseline D.
async fn run_alloc(options: &Options) -> Result<Vec<Extra>, BoxError> {
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
        ("D: no layer", "/baseline/orders"),
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
        AllocCount::start();
        let (conns, stats) = run_load(conns, &workload, Limit::Requests(requests)).await;
        let count = AllocCount::stop();
        drop(conns);
        if let Some(error) = warmup.first_error.or(stats.first_error) {
            eprintln!("  !! alloc {variant}: {error}");
        }
        let per_request = count.bytes as f64 / requests as f64;
        let blocks = count.blocks as f64 / requests as f64;
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
            .zip(["layer (JSON) minus D", "layer (raw) minus D"])
        {
            let extra = bytes - baseline;
            println!(
                "  {label:<42} {extra:>12.0} {:>12.1} {:>10.2}",
                blocks - baseline_blocks,
                extra / BODY_SIZE as f64
            );
            extras.push(Extra {
                measure: "alloc_per_request_64k_body",
                variant: format!("{variant} minus D"),
                metric: "bytes_over_body",
                value: extra / BODY_SIZE as f64,
                unit: "ratio",
            });
        }
    }
    Ok(extras)
}

/// Measures and prints the disk's sync latency (`when`: before or after the cases).
async fn disk_probe(when: &'static str, options: &Options) -> Result<Vec<Extra>, BoxError> {
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

// ---------------------------------------------------------------------------------------------
// Output: the table, the ratios, the CSV files and the chart
// ---------------------------------------------------------------------------------------------

fn find(rows: &[Row], case: Case, mode: Mode, concurrency: usize) -> Option<&Row> {
    rows.iter()
        .find(|r| r.case == case && r.mode == mode && r.concurrency == concurrency)
}

/// The row's ratio to its baseline at the same mode and concurrency.
fn ratio(rows: &[Row], row: &Row) -> Option<(Case, f64)> {
    let baseline = row.case.baseline()?;
    let base = find(rows, baseline, row.mode, row.concurrency)?;
    Some((baseline, row.median() / base.median()))
}

fn print_table(rows: &[Row], options: &Options) {
    println!();
    println!(
        "requests/s: median of {} rounds of {:.1} s; latency p50/p99 over all rounds",
        options.rounds,
        options.duration.as_secs_f64()
    );
    println!(
        "{:<4} {:<33} {:<6} {:>4} {:>9} {:>17} {:>8} {:>8} {:>8} {:>9} {:>6} {:>9}",
        "case",
        "",
        "mode",
        "c",
        "req/s",
        "rounds min-max",
        "p50 ms",
        "p99 ms",
        "cpu us",
        "requests",
        "errors",
        "ratio"
    );
    for row in rows {
        let (min, max) = row
            .rounds
            .iter()
            .fold((f64::MAX, 0.0f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        let ratio = ratio(rows, row)
            .map(|(base, r)| format!("{r:.2}x {}", base.name()))
            .unwrap_or_default();
        println!(
            "{:<4} {:<33} {:<6} {:>4} {:>9.0} {:>17} {:>8.3} {:>8.3} {:>8} {:>9} {:>6} {:>9}",
            row.case.name(),
            row.case.describe(),
            row.mode.name(),
            row.concurrency,
            row.median(),
            format!("{min:.0}-{max:.0}"),
            row.p50_ms,
            row.p99_ms,
            row.cpu_us
                .map_or_else(|| "-".to_owned(), |cpu| format!("{cpu:.0}")),
            row.requests,
            row.errors,
            ratio
        );
    }
    let failed: Vec<&Row> = rows.iter().filter(|r| r.integrity.is_some()).collect();
    let mut checked: Vec<&str> = rows
        .iter()
        .filter(|r| r.case != Case::E)
        .map(|r| r.case.name())
        .collect();
    checked.dedup();
    if failed.is_empty() && !checked.is_empty() {
        println!(
            "order check: every fresh 201 had exactly one committed order when its client had it \
             ({})",
            checked.join(", ")
        );
    }
    for row in failed {
        println!(
            "order check FAILED for {} {} c={}: {}",
            row.case.name(),
            row.mode.name(),
            row.concurrency,
            row.integrity.as_deref().unwrap_or_default()
        );
    }
}

fn print_ratios(rows: &[Row], options: &Options) {
    let mut lines = Vec::new();
    let verdict = |value: f64, target: f64| if value >= target { "met" } else { "NOT met" };
    for &mode in &options.modes {
        for &c in &options.concurrency {
            let a = find(rows, Case::A, mode, c);
            let d = find(rows, Case::D, mode, c);
            if let (Some(a), Some(d)) = (a, d) {
                let r = a.median() / d.median();
                let target = if c == 16 {
                    format!("  (target >= 0.8: {})", verdict(r, 0.8))
                } else {
                    String::new()
                };
                lines.push(format!("A/D  {:<6} c={c:<3} {r:>6.2}{target}", mode.name()));
            }
        }
    }
    if let (Some(a), Some(d)) = (
        find(rows, Case::A, Mode::Full, 64),
        find(rows, Case::D, Mode::Full, 64),
    ) {
        let r = a.median() / d.median();
        lines.push(format!(
            "A(FULL, c=64) / D(FULL, c=64)  {r:>6.2}  (target >= 3, group commit: {})",
            verdict(r, 3.0)
        ));
    }
    for &mode in &options.modes {
        if let (Some(b), Some(r)) = (find(rows, Case::B, mode, 64), find(rows, Case::R, mode, 64)) {
            let ratio = b.median() / r.median();
            lines.push(format!(
                "B/R  {:<6} c=64  {ratio:>6.2}  (target >= 0.8: {})",
                mode.name(),
                verdict(ratio, 0.8)
            ));
        }
    }
    for &mode in &options.modes {
        let Some(e) = find(rows, Case::E, mode, 1) else {
            continue;
        };
        let best = |case| {
            options
                .concurrency
                .iter()
                .filter_map(|&c| find(rows, case, mode, c))
                .max_by(|x, y| x.median().total_cmp(&y.median()))
        };
        for case in [Case::A, Case::D] {
            if let Some(row) = best(case) {
                lines.push(format!(
                    "{}/E  {:<6} best (c={}) {:>6.2}",
                    case.name(),
                    mode.name(),
                    row.concurrency,
                    row.median() / e.median()
                ));
            }
        }
    }
    if !lines.is_empty() {
        println!();
        println!("Ratios (same run)");
        for line in lines {
            println!("  {line}");
        }
    }
}

fn write_results_csv(path: &FsPath, rows: &[Row]) -> std::io::Result<()> {
    let mut csv = String::from(
        "case,description,mode,concurrency,requests_per_s,rounds_min,rounds_max,rounds,\
         p50_ms,p99_ms,cpu_us_per_request,requests,errors,baseline,ratio_to_baseline,order_check\n",
    );
    for row in rows {
        let (min, max) = row
            .rounds
            .iter()
            .fold((f64::MAX, 0.0f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        let (baseline, ratio) = ratio(rows, row)
            .map(|(base, r)| (base.name().to_owned(), format!("{r:.3}")))
            .unwrap_or_default();
        let _ = writeln!(
            csv,
            "{},\"{}\",{},{},{:.0},{min:.0},{max:.0},{},{:.3},{:.3},{},{},{},{baseline},{ratio},{}",
            row.case.name(),
            row.case.describe(),
            row.mode.name(),
            row.concurrency,
            row.median(),
            row.rounds.len(),
            row.p50_ms,
            row.p99_ms,
            row.cpu_us
                .map_or_else(String::new, |cpu| format!("{cpu:.1}")),
            row.requests,
            row.errors,
            match (&row.integrity, row.case) {
                (_, Case::E) => String::new(),
                (None, _) => "ok".to_owned(),
                (Some(problem), _) => format!("\"FAILED: {}\"", problem.replace('"', "'")),
            },
        );
    }
    std::fs::write(path, csv)
}

fn write_extras_csv(path: &FsPath, extras: &[Extra]) -> std::io::Result<()> {
    let mut csv = String::from("measure,variant,metric,value,unit\n");
    for extra in extras {
        let _ = writeln!(
            csv,
            "{},\"{}\",{},{:.3},{}",
            extra.measure, extra.variant, extra.metric, extra.value, extra.unit
        );
    }
    std::fs::write(path, csv)
}

/// A hand-written SVG: one panel per durability mode, requests/s (log scale) by concurrency,
/// one line per case; the ceiling E as a dashed level.
fn throughput_svg(rows: &[Row], options: &Options) -> String {
    let modes: Vec<Mode> = options
        .modes
        .iter()
        .copied()
        .filter(|&m| rows.iter().any(|r| r.mode == m))
        .collect();
    let concurrency = &options.concurrency;
    let (panel_w, panel_h) = (440.0, 320.0);
    let (left, top, gap) = (70.0, 50.0, 60.0);
    let width = left + modes.len().max(1) as f64 * (panel_w + gap);
    let height = top + panel_h + 110.0;

    let values: Vec<f64> = rows.iter().map(Row::median).filter(|v| *v > 0.0).collect();
    let lo = values.iter().copied().fold(f64::MAX, f64::min).max(1.0);
    let hi = values.iter().copied().fold(1.0, f64::max);
    let (log_lo, log_hi) = (
        lo.log10().floor(),
        hi.log10().ceil().max(lo.log10().floor() + 1.0),
    );
    let y_of = |v: f64| top + panel_h * (1.0 - (v.max(1.0).log10() - log_lo) / (log_hi - log_lo));
    let x_of = |panel: usize, i: usize| {
        let x0 = left + panel as f64 * (panel_w + gap);
        let n = concurrency.len();
        if n == 1 {
            x0 + panel_w / 2.0
        } else {
            x0 + 30.0 + (panel_w - 60.0) * i as f64 / (n - 1) as f64
        }
    };

    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="sans-serif" font-size="12">"##
    );
    let _ = writeln!(
        svg,
        r##"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r##"<text x="{:.0}" y="22" text-anchor="middle" font-size="15" font-weight="bold">tower-idempotency: requests/s by concurrency (median of {} rounds, log scale)</text>"##,
        width / 2.0,
        options.rounds
    );
    for (p, &mode) in modes.iter().enumerate() {
        let x0 = left + p as f64 * (panel_w + gap);
        let _ = writeln!(
            svg,
            r##"<text x="{:.0}" y="{:.0}" text-anchor="middle" font-weight="bold">synchronous={}</text>"##,
            x0 + panel_w / 2.0,
            top - 10.0,
            mode.name()
        );
        // Grid: 1, 2, 5 per decade.
        let mut decade = 10f64.powf(log_lo);
        while decade < 10f64.powf(log_hi) * 1.001 {
            for step in [1.0, 2.0, 5.0] {
                let v = decade * step;
                if v > 10f64.powf(log_hi) * 1.001 {
                    break;
                }
                let y = y_of(v);
                let stroke = if step == 1.0 { "#bbbbbb" } else { "#e5e5e5" };
                let _ = writeln!(
                    svg,
                    r##"<line x1="{x0:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{stroke}"/>"##,
                    x0 + panel_w
                );
                let _ = writeln!(
                    svg,
                    r##"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="#444">{}</text>"##,
                    x0 - 6.0,
                    y + 4.0,
                    short_number(v)
                );
            }
            decade *= 10.0;
        }
        let _ = writeln!(
            svg,
            r##"<rect x="{x0:.1}" y="{top:.1}" width="{panel_w:.1}" height="{panel_h:.1}" fill="none" stroke="#333"/>"##
        );
        for (i, c) in concurrency.iter().enumerate() {
            let _ = writeln!(
                svg,
                r##"<text x="{:.1}" y="{:.1}" text-anchor="middle">{c}</text>"##,
                x_of(p, i),
                top + panel_h + 18.0
            );
        }
        let _ = writeln!(
            svg,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#444">concurrency (connections, one request in flight each)</text>"##,
            x0 + panel_w / 2.0,
            top + panel_h + 38.0
        );
        if p == 0 {
            let _ = writeln!(
                svg,
                r##"<text transform="translate(16 {:.1}) rotate(-90)" text-anchor="middle" fill="#444">requests/s</text>"##,
                top + panel_h / 2.0
            );
        }
        if let Some(e) = find(rows, Case::E, mode, 1) {
            let y = y_of(e.median());
            let _ = writeln!(
                svg,
                r##"<line x1="{x0:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{}" stroke-width="1.5" stroke-dasharray="6 4"/>"##,
                x0 + panel_w,
                Case::E.color()
            );
            let _ = writeln!(
                svg,
                r##"<text x="{:.1}" y="{:.1}" fill="{}" stroke="white" stroke-width="3" paint-order="stroke">E ceiling {}</text>"##,
                x0 + 6.0,
                y - 4.0,
                Case::E.color(),
                short_number(e.median())
            );
        }
        for case in Case::HTTP {
            let points: Vec<(f64, f64)> = concurrency
                .iter()
                .enumerate()
                .filter_map(|(i, &c)| {
                    find(rows, case, mode, c).map(|row| (x_of(p, i), y_of(row.median())))
                })
                .collect();
            if points.is_empty() {
                continue;
            }
            let path: Vec<String> = points
                .iter()
                .map(|(x, y)| format!("{x:.1},{y:.1}"))
                .collect();
            let _ = writeln!(
                svg,
                r##"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"/>"##,
                path.join(" "),
                case.color()
            );
            for (x, y) in &points {
                let _ = writeln!(
                    svg,
                    r##"<circle cx="{x:.1}" cy="{y:.1}" r="3.5" fill="{}"/>"##,
                    case.color()
                );
            }
        }
    }
    // Legend.
    let legend_y = top + panel_h + 62.0;
    let cases: Vec<Case> = [Case::A, Case::B, Case::C, Case::D, Case::R, Case::E]
        .into_iter()
        .filter(|&case| rows.iter().any(|r| r.case == case))
        .collect();
    for (i, case) in cases.iter().enumerate() {
        let x = left + (i % 3) as f64 * 300.0;
        let y = legend_y + (i / 3) as f64 * 20.0;
        let dash = if *case == Case::E {
            r##" stroke-dasharray="6 4""##
        } else {
            ""
        };
        let _ = writeln!(
            svg,
            r##"<line x1="{x:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{}" stroke-width="2"{dash}/>"##,
            y - 4.0,
            x + 24.0,
            y - 4.0,
            case.color()
        );
        let _ = writeln!(
            svg,
            r##"<text x="{:.1}" y="{y:.1}">{} {}</text>"##,
            x + 30.0,
            case.name(),
            xml_escape(case.describe())
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn short_number(v: f64) -> String {
    if v >= 1000.0 {
        let k = v / 1000.0;
        if (k - k.round()).abs() < 0.05 {
            format!("{k:.0}k")
        } else {
            format!("{k:.1}k")
        }
    } else {
        format!("{v:.0}")
    }
}

fn xml_escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

// ---------------------------------------------------------------------------------------------
// Main
// ---------------------------------------------------------------------------------------------

#[tokio::main]
async fn main() -> ExitCode {
    let options = match Command::parse(std::env::args().skip(1)) {
        Ok(Command::Help) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Ok(Command::Run(options)) => options,
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
    extras.extend(disk_probe("before", options).await?);

    let mut rows = Vec::new();
    for &mode in &options.modes {
        for &case in &options.cases {
            if case == Case::E {
                eprintln!("running E {} ...", mode.name());
                rows.push(run_ceiling(mode, options).await?);
                continue;
            }
            for &concurrency in &options.concurrency {
                eprintln!(
                    "running {} {} c={concurrency} ...",
                    case.name(),
                    mode.name()
                );
                let row = run_http_case(case, mode, concurrency, options).await?;
                eprintln!(
                    "  {:.0} req/s, p50 {:.2} ms, p99 {:.2} ms",
                    row.median(),
                    row.p50_ms,
                    row.p99_ms
                );
                rows.push(row);
            }
        }
    }
    rows.sort_by_key(|x| (x.mode, x.case, x.concurrency));

    if !rows.is_empty() {
        print_table(&rows, options);
        print_ratios(&rows, options);
    }
    if options.hold {
        eprintln!("running hold ...");
        extras.extend(run_hold(options).await?);
    }
    if options.alloc {
        eprintln!("running alloc ...");
        extras.extend(run_alloc(options).await?);
    }

    extras.extend(disk_probe("after", options).await?);

    std::fs::create_dir_all(&options.out)?;
    let mut written = Vec::new();
    if !rows.is_empty() {
        let csv = options.out.join("results.csv");
        write_results_csv(&csv, &rows)?;
        let svg = options.out.join("throughput.svg");
        std::fs::write(&svg, throughput_svg(&rows, options))?;
        written.extend([csv, svg]);
    }
    if options.hold || options.alloc || !rows.is_empty() {
        let csv = options.out.join("extras.csv");
        write_extras_csv(&csv, &extras)?;
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
