//! The apps under test on SQLite: the orders example's route under the layer, the hand-written
//! baselines (H inline, D under `spawn_blocking`), the read baseline and the slow routes; and
//! the server each case gets (SQLite; SQLite through sqlx, see `sqlx_sqlite.rs`; or PostgreSQL,
//! see `postgres.rs`).

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::header::{AUTHORIZATION, LOCATION};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::{Extension, Json, Router};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tower_idempotency::extract::Tx;
use tower_idempotency::fingerprint::Fingerprinter;
type SqliteOutbox =
    tower_idempotency::outbox::Outbox<tower_idempotency::store::sqlite::SqliteStore>;
use tower_idempotency::outbox::Enqueue;
use tower_idempotency::store::sqlite::rusqlite::{self, Connection, OptionalExtension};
use tower_idempotency::store::sqlite::{SqliteHandle, SqliteStore};
use tower_idempotency::{IdempotencyLayer, Tenant};

use crate::cli::Mode;
use crate::hand::{self, HandRequest};
use crate::postgres::{self, PgDatabase};
use crate::sqlx_sqlite::{self, SqlxSqliteDatabase};
use crate::BoxError;

/// The business table, as in `examples/orders.rs`.
pub(crate) const ORDERS_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS orders (
    id        INTEGER PRIMARY KEY,
    tenant_id TEXT    NOT NULL,
    sku       TEXT    NOT NULL,
    quantity  INTEGER NOT NULL
);";

pub(crate) const INSERT_ORDER: &str =
    "INSERT INTO orders (tenant_id, sku, quantity) VALUES (?1, ?2, ?3)";

/// How long the slow routes hold the write transaction.
pub(crate) const HOLD: Duration = Duration::from_millis(100);

#[derive(Clone)]
struct AppState {
    store: SqliteStore,
    baseline: BaselineWriter,
    /// Baseline H's connection: statements run inline, on the executor, under the lock.
    hand: Arc<tokio::sync::Mutex<Connection>>,
    /// The file H and D write ([`HAND_FILE`]).
    hand_path: PathBuf,
    /// Baseline R's read-only connection: the query runs inline, on the executor, under the
    /// lock, with a cached statement (the fastest honest `GET` a user writes).
    reader: Arc<tokio::sync::Mutex<Connection>>,
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
        .route("/hand/orders", post(create_order_hand))
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
pub(crate) async fn authenticate(mut request: Request, next: Next) -> Response {
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

/// `POST /orders` under the layer: the handler of `examples/orders.rs` (the order, then its
/// `order_created` event, in the request's transaction; the statement prepared once per
/// connection, as H's are).
async fn create_order(
    Extension(tenant): Extension<Tenant>,
    Tx(tx): Tx<SqliteHandle>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let order = NewOrder::parse(&body)?;
    let tenant_id = tenant.as_str().to_owned();
    let (sku, quantity) = (order.sku.clone(), order.quantity);
    let order_id = tx
        .run(move |conn| {
            conn.prepare_cached(INSERT_ORDER)?
                .execute((tenant_id, order.sku, order.quantity))?;
            Ok(conn.last_insert_rowid())
        })
        .await
        .map_err(|_| ApiError::Internal)?;
    let event = json!({
        "order_id": order_id,
        "tenant": tenant.as_str(),
        "sku": sku,
        "quantity": quantity,
    });
    tx.enqueue("order_created", event)
        .await
        .map_err(|_| ApiError::Internal)?;
    Ok(created(order_id))
}

/// Baseline H: the hand-written transaction, run inline under an async mutex.
async fn create_order_hand(
    State(state): State<AppState>,
    request: Request,
) -> Result<Response, ApiError> {
    let request = HandRequest::read(request).await?;
    let mut conn = state.hand.lock().await;
    let outcome = hand::sqlite_transaction(&mut conn, &request).map_err(|_| ApiError::Internal)?;
    drop(conn);
    Ok(outcome.into_response())
}

/// Baseline D (the old one): the same transaction as H, run under `spawn_blocking`.
async fn create_order_baseline(
    State(state): State<AppState>,
    request: Request,
) -> Result<Response, ApiError> {
    let request = HandRequest::read(request).await?;
    let mut conn = state.baseline.conn.clone().lock_owned().await;
    let outcome =
        tokio::task::spawn_blocking(move || hand::sqlite_transaction(&mut conn, &request))
            .await
            .map_err(|_| ApiError::Internal)?
            .map_err(|_| ApiError::Internal)?;
    Ok(outcome.into_response())
}

/// Inserts an order, then holds the open transaction for [`HOLD`] while awaiting (the writer
/// thread is free; the write lock is not).
async fn slow_async(
    Extension(tenant): Extension<Tenant>,
    Tx(tx): Tx<SqliteHandle>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let order = NewOrder::parse(&body)?;
    let tenant_id = tenant.as_str().to_owned();
    let order_id = tx
        .run(move |conn| {
            conn.prepare_cached(INSERT_ORDER)?
                .execute((tenant_id, order.sku, order.quantity))?;
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
    Tx(tx): Tx<SqliteHandle>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let order = NewOrder::parse(&body)?;
    let tenant_id = tenant.as_str().to_owned();
    let order_id = tx
        .run(move |conn| {
            conn.prepare_cached(INSERT_ORDER)?
                .execute((tenant_id, order.sku, order.quantity))?;
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

/// Baseline R: `GET /orders/{id}`, read inline on a read-only connection under a lock with a
/// cached statement (as H writes). The orders example reads through `SqliteStore::read`, on
/// the blocking pool, which is slower (two thread hand-overs).
async fn get_order(
    State(state): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let order_id: i64 = id.parse().map_err(|_| ApiError::NotFound)?;
    let conn = state.reader.lock().await;
    let order = conn
        .prepare_cached("SELECT sku, quantity FROM orders WHERE id = ?1 AND tenant_id = ?2")
        .and_then(|mut select| {
            select
                .query_row((order_id, tenant.as_str()), |row| {
                    Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?))
                })
                .optional()
        })
        .map_err(|_| ApiError::Internal)?;
    drop(conn);
    let (sku, quantity) = order.ok_or(ApiError::NotFound)?;
    Ok(Json(
        json!({ "order_id": order_id, "sku": sku, "quantity": quantity }),
    ))
}

/// A validated order request, parsed as in the orders example.
pub(crate) struct NewOrder {
    pub(crate) sku: String,
    pub(crate) quantity: i64,
}

impl NewOrder {
    pub(crate) fn parse(body: &[u8]) -> Result<Self, ApiError> {
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
pub(crate) enum ApiError {
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

/// The file of the hand-written baselines (H, D), beside the store's `orders.db`, with the
/// same tables: on the store's own file, their commits would read to the store as another
/// process writing to it, which it gives way to for a second after each (`SqliteStore`'s
/// fairness between processes), and every round of the layer after one of H would pay it.
const HAND_FILE: &str = "hand.db";

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
}

/// A fresh database at `path` with every table a case writes: the crate's records and outbox
/// tables (created by the crate, so the layer and the baselines write identical rows) and
/// `orders`.
pub(crate) async fn create_database(path: &FsPath, mode: Mode) -> Result<SqliteStore, BoxError> {
    let store = SqliteStore::builder(path)
        .with_synchronous(mode.synchronous())
        .build()
        .await?;
    store.write(|tx| tx.execute_batch(ORDERS_SCHEMA)).await?;
    SqliteOutbox::install(&store).await?;
    Ok(store)
}

/// A writer connection configured like the store's: WAL, the mode's `synchronous` (a
/// per-connection setting), a busy timeout.
pub(crate) fn open_connection(path: &FsPath, mode: Mode) -> Result<Connection, BoxError> {
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
pub(crate) fn prime_wal(conn: &Connection, mode: Mode) -> Result<(), BoxError> {
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

/// What a server stores its rows in.
enum Backend {
    /// A fresh SQLite database; the temp dir is dropped after the store.
    Sqlite(AppState, tempfile::TempDir),
    /// A fresh SQLite database written through sqlx (cases QA, QH); the temp dir is dropped
    /// after it.
    SqlxSqlite(Box<SqlxSqliteDatabase>, tempfile::TempDir),
    Postgres(Box<PgDatabase>),
}

pub(crate) struct Server {
    pub(crate) addr: SocketAddr,
    backend: Backend,
    stop: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Server {
    /// A server on a fresh SQLite database.
    pub(crate) async fn start(mode: Mode) -> Result<Self, BoxError> {
        Self::start_in(tempfile::tempdir()?, mode).await
    }

    /// A server on the database `orders.db` in `dir`, created there unless it exists (the
    /// scale measurements fill it beforehand, `scale.rs`); the hand-written baselines write
    /// [`HAND_FILE`] beside it.
    pub(crate) async fn start_in(dir: tempfile::TempDir, mode: Mode) -> Result<Self, BoxError> {
        let path = dir.path().join("orders.db");
        let store = create_database(&path, mode).await?;
        // Primed through a connection of its own (the store's connections keep the WAL file).
        prime_wal(&open_connection(&path, mode)?, mode)?;
        let hand_path = dir.path().join(HAND_FILE);
        // The same tables (the store that creates them closes; D's connection primes the WAL
        // and keeps it).
        drop(create_database(&hand_path, mode).await?);
        let baseline = BaselineWriter::open(&hand_path, mode)?;
        let hand = Arc::new(tokio::sync::Mutex::new(open_connection(&hand_path, mode)?));
        let reader =
            Connection::open_with_flags(&path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)?;
        let reader = Arc::new(tokio::sync::Mutex::new(reader));
        let state = AppState {
            store,
            baseline,
            hand,
            hand_path,
            reader,
        };
        let router = app(state.clone());
        Self::serve(router, Backend::Sqlite(state, dir)).await
    }

    /// A server on a fresh SQLite database written through sqlx (`sqlx_sqlite.rs`).
    pub(crate) async fn start_sqlx_sqlite(mode: Mode) -> Result<Self, BoxError> {
        let dir = tempfile::tempdir()?;
        let database = SqlxSqliteDatabase::create(dir.path(), mode).await?;
        let router = sqlx_sqlite::app(database.state.clone());
        Self::serve(router, Backend::SqlxSqlite(Box::new(database), dir)).await
    }

    /// A server on PostgreSQL, its tables in a fresh `schema`.
    pub(crate) async fn start_postgres(url: &str, schema: &str) -> Result<Self, BoxError> {
        let database = PgDatabase::create(url, schema).await?;
        let router = postgres::app(database.state.clone());
        Self::serve(router, Backend::Postgres(Box::new(database))).await
    }

    async fn serve(router: Router, backend: Backend) -> Result<Self, BoxError> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        // Responses are small and written whole: no reason to let Nagle hold them.
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(
            axum::serve(listener, router)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .into_future(),
        );
        Ok(Server {
            addr,
            backend,
            stop,
            task,
        })
    }

    /// The database file a SQLite server's route writes (for the WAL count, `wal.rs`): the
    /// store's, or [`HAND_FILE`] for the hand-written baselines (`hand`).
    pub(crate) fn sqlite_path(&self, hand: bool) -> Option<PathBuf> {
        match &self.backend {
            Backend::Sqlite(state, _) if hand => Some(state.hand_path.clone()),
            Backend::Sqlite(state, _) => Some(state.store.path().to_path_buf()),
            Backend::SqlxSqlite(database, _) => Some(database.path().to_path_buf()),
            Backend::Postgres(_) => None,
        }
    }

    /// Inserts `count` orders with `sku` for the read baseline; returns the first id.
    pub(crate) async fn insert_orders(
        &self,
        sku: &'static str,
        count: u64,
    ) -> Result<u64, BoxError> {
        match &self.backend {
            Backend::Sqlite(state, _) => {
                let first = state
                    .store
                    .write(move |tx| {
                        let mut insert = tx.prepare(INSERT_ORDER)?;
                        let mut first = None;
                        for _ in 0..count {
                            insert.execute(("shop-a", sku, 1))?;
                            first.get_or_insert(tx.last_insert_rowid());
                        }
                        Ok(first.unwrap_or_default())
                    })
                    .await?;
                Ok(u64::try_from(first)?)
            }
            Backend::SqlxSqlite(..) => Err("case R runs on the rusqlite store's server".into()),
            Backend::Postgres(database) => {
                Ok(u64::try_from(database.insert_orders(sku, count).await?)?)
            }
        }
    }

    /// Checks that the database holds `expected` orders with `sku`, as seen by a new
    /// connection (what is committed now) and, on SQLite, through `SqliteStore::read` (what the
    /// store's readers see). Returns the problem, if any.
    pub(crate) async fn check_orders(
        &self,
        sku: &str,
        expected: i64,
    ) -> Result<Option<String>, BoxError> {
        let (committed, via_store) = match &self.backend {
            Backend::Sqlite(state, _) => {
                // A case's orders are in one of the two files, by its route.
                let hand = count_orders(state.hand_path.clone(), sku.to_owned()).await?;
                let committed =
                    count_orders(state.store.path().to_path_buf(), sku.to_owned()).await? + hand;
                let sku = sku.to_owned();
                let via_store: i64 = state
                    .store
                    .read(move |conn| {
                        conn.query_row("SELECT count(*) FROM orders WHERE sku = ?1", [sku], |row| {
                            row.get(0)
                        })
                    })
                    .await?;
                (committed, via_store + hand)
            }
            Backend::SqlxSqlite(database, _) => {
                let committed = count_orders(database.path().to_path_buf(), sku.to_owned()).await?;
                (committed, database.count_orders_via_store(sku).await?)
            }
            Backend::Postgres(database) => {
                let committed = database.count_orders(sku).await?;
                (committed, committed)
            }
        };
        Ok((committed != expected || via_store != expected).then(|| {
            format!(
                "expected {expected} orders of {sku} (one per fresh 201); a new connection counts \
                 {committed}, the store's readers count {via_store}"
            )
        }))
    }

    /// The SQLite store of this server (none on PostgreSQL).
    pub(crate) fn sqlite_store(&self) -> Option<&SqliteStore> {
        match &self.backend {
            Backend::Sqlite(state, _) => Some(&state.store),
            Backend::SqlxSqlite(..) | Backend::Postgres(_) => None,
        }
    }

    /// The PostgreSQL database of this server (none on SQLite).
    pub(crate) fn postgres(&self) -> Option<&PgDatabase> {
        match &self.backend {
            Backend::Sqlite(..) | Backend::SqlxSqlite(..) => None,
            Backend::Postgres(database) => Some(database),
        }
    }

    /// The PostgreSQL backends serving this server (none on SQLite).
    pub(crate) async fn backends(&self) -> Vec<i32> {
        match &self.backend {
            Backend::Sqlite(..) | Backend::SqlxSqlite(..) => Vec::new(),
            Backend::Postgres(database) => database.backends().await.unwrap_or_default(),
        }
    }

    /// Stops the server once the client connections are closed (drop them first), then
    /// drops its database.
    pub(crate) async fn shut_down(self) -> Result<(), BoxError> {
        let _ = self.stop.send(());
        match tokio::time::timeout(Duration::from_secs(10), self.task).await {
            Ok(joined) => joined??,
            Err(_) => return Err("the server did not shut down within 10 s".into()),
        }
        match self.backend {
            Backend::Sqlite(state, dir) => {
                drop(state);
                drop(dir);
            }
            Backend::SqlxSqlite(database, dir) => {
                (*database).close().await;
                drop(dir);
            }
            Backend::Postgres(database) => (*database).drop_schema().await?,
        }
        Ok(())
    }
}

/// The orders with `sku` committed in the database at `path`, counted on a new read-only
/// connection: its first read sees every transaction committed so far.
async fn count_orders(path: PathBuf, sku: String) -> Result<i64, BoxError> {
    tokio::task::spawn_blocking(move || {
        let conn = Connection::open_with_flags(&path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)?;
        conn.busy_timeout(Duration::from_secs(5))?;
        Ok(
            conn.query_row("SELECT count(*) FROM orders WHERE sku = ?1", [sku], |row| {
                row.get(0)
            })?,
        )
    })
    .await?
}
