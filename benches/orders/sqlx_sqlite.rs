//! The SQLite app on sqlx: the layer on `SqlxSqliteStore` with the handler of
//! `examples/orders_sqlx_sqlite.rs` (case QA), and H's transaction written with sqlx (case QH),
//! on a fresh file of their own, set up for the same durability as case A's (WAL, the mode's
//! `synchronous`).

use std::path::{Path as FsPath, PathBuf};
use std::sync::Mutex;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::header::LOCATION;
use axum::http::StatusCode;
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use serde_json::json;
use tower_idempotency::extract::Tx;
use tower_idempotency::fingerprint::Fingerprinter;
use tower_idempotency::outbox::{Enqueue, Outbox};
use tower_idempotency::store::sqlite::rusqlite::Connection;
use tower_idempotency::store::sqlx_sqlite::sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use tower_idempotency::store::sqlx_sqlite::sqlx::{self, Executor as _, Row as _};
use tower_idempotency::store::sqlx_sqlite::{SqlxSqliteHandle, SqlxSqliteStore};
use tower_idempotency::{IdempotencyLayer, Tenant};

use crate::cli::Mode;
use crate::hand::{self, HandRequest, OPERATION, SQLITE_INSERT_ORDER_RETURNING};
use crate::servers::{authenticate, open_connection, prime_wal, ApiError, NewOrder, ORDERS_SCHEMA};
use crate::BoxError;

/// The file QA and QH write, in the server's temp dir.
const FILE: &str = "sqlx.db";

/// Connections of the application's pool, as in `examples/orders_sqlx_sqlite.rs`; the store's
/// read pool is its default (8).
const POOL_SIZE: u32 = 8;

#[derive(Clone)]
pub(crate) struct SqlxSqliteState {
    /// The store (case QA) on the application's pool.
    pub(crate) store: SqlxSqliteStore,
    /// The application's pool: QH's transactions (each case has a server of its own, so QA's
    /// and QH's never share a file).
    pool: SqlitePool,
}

/// The database side of a sqlx SQLite server.
pub(crate) struct SqlxSqliteDatabase {
    pub(crate) state: SqlxSqliteState,
    path: PathBuf,
    /// The connection that primed the WAL, kept open: SQLite deletes the WAL file when the
    /// file's last connection closes, and the pool may close idle ones. (A `Mutex` keeps the
    /// server `Sync`.)
    _wal_keeper: Mutex<Connection>,
}

impl SqlxSqliteDatabase {
    /// Creates [`FILE`] in `dir` with the tables A's file has, each the sqlx SQLite store's
    /// own where it has one: `idempotency_records` (by `migrate`), `outbox_events` (by the
    /// outbox's `install`; QA enqueues through it, QH inserts into it with H's statement) and
    /// `orders`; then primes the WAL as A's.
    pub(crate) async fn create(dir: &FsPath, mode: Mode) -> Result<Self, BoxError> {
        let path = dir.join(FILE);
        let synchronous = match mode {
            Mode::Full | Mode::Postgres => SqliteSynchronous::Full,
            Mode::Normal => SqliteSynchronous::Normal,
        };
        // A's durability: WAL (which `migrate` turns on too) and the mode's `synchronous`, a
        // per-connection setting, on every connection of the pool.
        let options = SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(synchronous);
        let pool = SqlitePoolOptions::new()
            .max_connections(POOL_SIZE)
            .connect_with(options)
            .await?;
        let store = SqlxSqliteStore::new(pool.clone());
        store.migrate().await?;
        Outbox::<SqlxSqliteStore>::install(&store).await?;
        let mut conn = pool.acquire().await?;
        // What the pool's connections commit with, checked rather than assumed.
        let journal: String = conn.fetch_one("PRAGMA journal_mode").await?.try_get(0)?;
        let level: i64 = conn.fetch_one("PRAGMA synchronous").await?.try_get(0)?;
        let expected = if mode == Mode::Normal { 1 } else { 2 };
        if !journal.eq_ignore_ascii_case("wal") || level != expected {
            return Err(format!(
                "the sqlx pool's connections have journal_mode={journal}, synchronous={level} \
                 (expected wal, {expected})"
            )
            .into());
        }
        conn.execute(ORDERS_SCHEMA).await?;
        drop(conn);
        let wal_keeper = open_connection(&path, mode)?;
        prime_wal(&wal_keeper, mode)?;
        Ok(SqlxSqliteDatabase {
            state: SqlxSqliteState { store, pool },
            path,
            _wal_keeper: Mutex::new(wal_keeper),
        })
    }

    /// The file the routes write.
    pub(crate) fn path(&self) -> &FsPath {
        &self.path
    }

    /// Orders with `sku`, as the store's read pool sees them.
    pub(crate) async fn count_orders_via_store(&self, sku: &str) -> Result<i64, BoxError> {
        let count = sqlx::query("SELECT count(*) FROM orders WHERE sku = ?1").bind(sku);
        Ok(self
            .state
            .store
            .read_pool()
            .fetch_one(count)
            .await?
            .try_get(0)?)
    }

    /// Closes the pools.
    pub(crate) async fn close(self) {
        self.state.store.read_pool().close().await;
        self.state.pool.close().await;
    }
}

pub(crate) fn app(state: SqlxSqliteState) -> Router {
    let idempotency = IdempotencyLayer::new(state.store.clone())
        .with_operation(OPERATION)
        .with_fingerprinter(Fingerprinter::json());
    Router::new()
        .route("/sqlx/orders", post(create_order).layer(idempotency))
        .route("/sqlx/hand/orders", post(create_order_hand))
        .layer(middleware::from_fn(authenticate))
        .with_state(state)
}

/// Case QA: `POST /orders` under the layer on the sqlx SQLite store, the handler of
/// `examples/orders_sqlx_sqlite.rs` plus the `order_created` event, enqueued on the handle as
/// case A does (in the request's transaction).
async fn create_order(
    Extension(tenant): Extension<Tenant>,
    Tx(tx): Tx<SqlxSqliteHandle>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let order = NewOrder::parse(&body)?;
    // The connection is lent once at a time: it goes back before `enqueue` borrows it.
    let order_id = {
        let mut conn = tx.acquire().await.map_err(internal)?;
        let (order_id,): (i64,) = sqlx::query_as(SQLITE_INSERT_ORDER_RETURNING)
            .bind(tenant.as_str())
            .bind(&order.sku)
            .bind(order.quantity)
            .fetch_one(&mut *conn)
            .await
            .map_err(internal)?;
        order_id
    };
    let event = json!({
        "order_id": order_id,
        "tenant": tenant.as_str(),
        "sku": order.sku,
        "quantity": order.quantity,
    });
    tx.enqueue("order_created", event).await.map_err(internal)?;
    let response = (
        StatusCode::CREATED,
        [(LOCATION, format!("/orders/{order_id}"))],
        Json(json!({ "order_id": order_id })),
    );
    Ok(response.into_response())
}

/// Baseline QH: H's transaction on sqlx, no layer.
async fn create_order_hand(
    State(state): State<SqlxSqliteState>,
    request: Request,
) -> Result<Response, ApiError> {
    let request = HandRequest::read(request).await?;
    let outcome = hand::sqlx_sqlite_transaction(&state.pool, &request)
        .await
        .map_err(internal)?;
    Ok(outcome.into_response())
}

fn internal(error: impl std::fmt::Display) -> ApiError {
    tracing::error!(%error, "request failed");
    ApiError::Internal
}
