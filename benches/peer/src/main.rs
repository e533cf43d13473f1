//! The peer: what a user who does not know tower-idempotency would build for the same order
//! API. `axum-idempotent` caches each response in a `ruts` session store (in memory with
//! `moka`, or Redis), and the handler writes the order and its `order_created` event by hand in
//! one rusqlite transaction on a durable SQLite file (WAL, `synchronous=FULL`).
//!
//! The API is the `orders` example's: `POST /orders` with `Authorization: Bearer
//! shop-a-token`, `Idempotency-Key` and `{"sku":"book","quantity":1}` answers `201` with
//! `Location: /orders/{id}` and `{"order_id":id}`; `GET /orders/{id}`. One thing more: the
//! middleware caches only for a request that carries a session, so `POST /login` (same
//! `Authorization`) writes the session and answers its cookie, which every order request then
//! sends.
//!
//! With `--minimal` it is the other baseline instead: no middleware, and the handler in the
//! style of the article the crate's contract comes from, which keeps its own `(tenant, key,
//! payload, status, body)` table: in one `BEGIN IMMEDIATE` transaction it looks the key up
//! (a stored answer is replayed, or `409` for another payload), else inserts the order, its
//! event and that row. No session, no cookie.
//!
//! ```text
//! peer [--addr 127.0.0.1:3001] [--db peer.db] [--store moka | --store redis://127.0.0.1:6380 | --minimal]
//! ```
//!
//! Prints `listening on http://ADDR` first, as the `orders` example does.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::header::{AUTHORIZATION, LOCATION};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use fred::prelude::{Builder, ClientLike, Config, ReconnectPolicy};
use rusqlite::{Connection, OptionalExtension};
use ruts::store::moka::MokaStore;
use ruts::store::redis::RedisStore;
use ruts::store::{SessionStore, Ttl};
use ruts::{CookieOptions, Session, SessionLayer};
use serde_json::{json, Value};
use tower_cookies::CookieManagerLayer;

/// How long a session, and so each cached response, lives: a day.
const SESSION_SECS: u64 = 24 * 60 * 60;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS orders (
    id        INTEGER PRIMARY KEY,
    tenant_id TEXT    NOT NULL,
    sku       TEXT    NOT NULL,
    quantity  INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS order_events (
    id      INTEGER PRIMARY KEY,
    topic   TEXT NOT NULL,
    payload TEXT NOT NULL
);";

/// `--minimal`: the table the article's handler keeps its answers in (shared with the WAL
/// count of `benches/orders`).
const MINIMAL_SCHEMA: &str = include_str!("../minimal_idempotency.sql");

/// The one SQLite connection every write goes through (SQLite has one writer at a time).
type Db = Arc<Mutex<Connection>>;

struct Args {
    addr: String,
    db: PathBuf,
    store: String,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        addr: "127.0.0.1:3001".into(),
        db: "peer.db".into(),
        store: "moka".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--addr" => args.addr = value()?,
            "--db" => args.db = value()?.into(),
            "--store" => args.store = value()?,
            "--minimal" => args.store = "minimal".into(),
            "-h" | "--help" => return Err(
                "usage: peer [--addr ADDR] [--db PATH] [--store moka | --store redis://HOST:PORT | --minimal]"
                    .into(),
            ),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("peer: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let args = parse_args()?;
    let conn = Connection::open(&args.db)?;
    // Durable: a `201` only after the commit reached the disk.
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.execute_batch(SCHEMA)?;
    conn.execute_batch(MINIMAL_SCHEMA)?;
    let db: Db = Arc::new(Mutex::new(conn));

    let app = if args.store == "minimal" {
        minimal_app(db)
    } else if args.store == "moka" {
        app(Arc::new(MokaStore::builder().build()), db)
    } else if args.store.starts_with("redis://") {
        let mut builder = Builder::from_config(Config::from_url(&args.store)?);
        builder.set_policy(ReconnectPolicy::default());
        let client = builder.build()?;
        client.init().await?;
        app(Arc::new(RedisStore::new(Arc::new(client)).await?), db)
    } else {
        return Err(format!("unknown store {}", args.store).into());
    };

    let listener = tokio::net::TcpListener::bind(&args.addr).await?;
    println!(
        "listening on http://{} (database {}, sessions in {})",
        listener.local_addr()?,
        args.db.display(),
        args.store
    );
    axum::serve(listener, app).await?;
    Ok(())
}

/// The order API, with the layers in the order the middleware's documentation gives:
/// cookies outermost, then the session, then the idempotency cache.
fn app<T: SessionStore>(store: Arc<T>, db: Db) -> Router {
    let idempotent = IdempotentOptions::default()
        // The recommended mode: the client's key is the cache key.
        .use_idempotency_key_header(Some("Idempotency-Key"), true)
        .expire_after(SESSION_SECS as i64);
    Router::new()
        .route(
            "/orders",
            post(create_order).layer(IdempotentLayer::<T>::new(idempotent)),
        )
        .route("/orders/{id}", get(get_order))
        .route("/login", post(login::<T>))
        .layer(middleware::from_fn(authenticate))
        .layer(
            SessionLayer::new(store).with_cookie_options(
                CookieOptions::build()
                    .name("session")
                    .path("/")
                    .max_age(SESSION_SECS),
            ),
        )
        .layer(CookieManagerLayer::new())
        .with_state(db)
}

/// `--minimal`: the order API with the article's handler and no middleware but the
/// authentication.
fn minimal_app(db: Db) -> Router {
    Router::new()
        .route("/orders", post(create_order_minimal))
        .route("/orders/{id}", get(get_order))
        .layer(middleware::from_fn(authenticate))
        .with_state(db)
}

/// What the article's handler answers a key with.
enum Answer {
    Created(i64),
    Replay(u16, Vec<u8>),
    KeyReused,
}

/// `POST /orders` without middleware: validates like the `orders` example, then
/// [`minimal_transaction`].
async fn create_order_minimal(
    State(db): State<Db>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    let Some(key) = headers
        .get("idempotency-key")
        .and_then(|value| value.to_str().ok())
        .filter(|key| (1..=128).contains(&key.len()))
        .map(str::to_owned)
    else {
        return error(StatusCode::BAD_REQUEST, "invalid_key_or_sku");
    };
    let (sku, quantity) = match parse_order(&body) {
        Ok(order) => order,
        Err(code) => return error(StatusCode::BAD_REQUEST, code),
    };
    let answered = with_db(db, move |conn| {
        minimal_transaction(conn, tenant, &key, &body, &sku, quantity)
    })
    .await;
    match answered {
        Ok(Answer::Created(order_id)) => created(order_id),
        Ok(Answer::Replay(status, body)) => (
            StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response(),
        Ok(Answer::KeyReused) => error(StatusCode::CONFLICT, "idempotency_key_reused"),
        Err(response) => response,
    }
}

/// The article's transaction: look `(tenant, key)` up; a stored answer is replayed if the
/// payload is the same; else the order, its event and the answer, committed together.
fn minimal_transaction(
    conn: &mut Connection,
    tenant: &str,
    key: &str,
    payload: &[u8],
    sku: &str,
    quantity: i64,
) -> rusqlite::Result<Answer> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let stored = tx
        .prepare_cached(
            "SELECT payload, status, body FROM idempotency WHERE tenant = ?1 AND key = ?2",
        )?
        .query_row((tenant, key), |row| {
            Ok((
                row.get::<_, Vec<u8>>(0)?,
                row.get::<_, u16>(1)?,
                row.get::<_, Vec<u8>>(2)?,
            ))
        })
        .optional()?;
    if let Some((stored_payload, status, body)) = stored {
        return Ok(if stored_payload == payload {
            Answer::Replay(status, body)
        } else {
            Answer::KeyReused
        });
    }
    let order_id = write_order(&tx, tenant, sku, quantity)?;
    let body = json!({ "order_id": order_id }).to_string();
    tx.prepare_cached(
        "INSERT INTO idempotency (tenant, key, payload, status, body) VALUES (?1, ?2, ?3, 201, ?4)",
    )?
    .execute((tenant, key, payload, body.as_bytes()))?;
    tx.commit()?;
    Ok(Answer::Created(order_id))
}

/// A new order's `201`, as the `orders` example answers it.
fn created(order_id: i64) -> Response {
    (
        StatusCode::CREATED,
        [(LOCATION, format!("/orders/{order_id}"))],
        Json(json!({ "order_id": order_id })),
    )
        .into_response()
}

/// The `orders` example's demo authentication: a fixed token per tenant.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let token = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "));
    let tenant = match token {
        Some("shop-a-token") => "shop-a",
        Some("shop-b-token") => "shop-b",
        _ => return error(StatusCode::UNAUTHORIZED, "unauthenticated"),
    };
    request.extensions_mut().insert(Tenant(tenant));
    next.run(request).await
}

#[derive(Clone, Copy)]
struct Tenant(&'static str);

/// `POST /login`: writes the session, so that it gets an id and its cookie.
async fn login<T: SessionStore>(
    Extension(Tenant(tenant)): Extension<Tenant>,
    session: Session<T>,
) -> Response {
    let Ok(ttl) = Ttl::new(SESSION_SECS as i64) else {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "internal_error");
    };
    match session.set("tenant", &tenant, ttl, None).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(err) => {
            eprintln!("login: {err}");
            error(StatusCode::SERVICE_UNAVAILABLE, "session_store_unavailable")
        }
    }
}

/// `POST /orders`: validates like the `orders` example, then inserts the order and its event
/// in one transaction.
async fn create_order(
    State(db): State<Db>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    body: Bytes,
) -> Response {
    let (sku, quantity) = match parse_order(&body) {
        Ok(order) => order,
        Err(code) => return error(StatusCode::BAD_REQUEST, code),
    };
    match with_db(db, move |conn| insert_order(conn, tenant, &sku, quantity)).await {
        Ok(order_id) => created(order_id),
        Err(response) => response,
    }
}

/// `work` on the one connection, under `spawn_blocking`; a failure is logged and answered
/// `500`.
async fn with_db<T: Send + 'static>(
    db: Db,
    work: impl FnOnce(&mut Connection) -> rusqlite::Result<T> + Send + 'static,
) -> Result<T, Response> {
    let done = tokio::task::spawn_blocking(move || {
        let mut conn = db
            .lock()
            .map_err(|_| "database lock poisoned".to_string())?;
        work(&mut conn).map_err(|e| e.to_string())
    })
    .await
    .unwrap_or_else(|e| Err(e.to_string()));
    done.map_err(|err| {
        eprintln!("the database: {err}");
        error(StatusCode::INTERNAL_SERVER_ERROR, "internal_error")
    })
}

/// The order and its `order_created` event, in one transaction.
fn insert_order(
    conn: &mut Connection,
    tenant: &str,
    sku: &str,
    quantity: i64,
) -> rusqlite::Result<i64> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let order_id = write_order(&tx, tenant, sku, quantity)?;
    tx.commit()?;
    Ok(order_id)
}

/// Inserts the order and its `order_created` event in `tx`; the order's id.
fn write_order(
    tx: &rusqlite::Transaction<'_>,
    tenant: &str,
    sku: &str,
    quantity: i64,
) -> rusqlite::Result<i64> {
    tx.prepare_cached("INSERT INTO orders (tenant_id, sku, quantity) VALUES (?1, ?2, ?3)")?
        .execute((tenant, sku, quantity))?;
    let order_id = tx.last_insert_rowid();
    let event = json!({ "order_id": order_id, "tenant": tenant, "sku": sku, "quantity": quantity });
    tx.prepare_cached("INSERT INTO order_events (topic, payload) VALUES ('order_created', ?1)")?
        .execute([event.to_string()])?;
    Ok(order_id)
}

/// The `orders` example's rules: an sku of 1 to 100 characters, a quantity of 1 to 100.
fn parse_order(body: &[u8]) -> Result<(String, i64), &'static str> {
    let value: Value = serde_json::from_slice(body).map_err(|_| "invalid_key_or_sku")?;
    let sku = value
        .get("sku")
        .and_then(Value::as_str)
        .filter(|sku| (1..=100).contains(&sku.chars().count()))
        .ok_or("invalid_key_or_sku")?;
    let quantity = value.get("quantity").and_then(Value::as_i64).unwrap_or(0);
    if !(1..=100).contains(&quantity) {
        return Err("invalid_quantity");
    }
    Ok((sku.to_owned(), quantity))
}

/// `GET /orders/{id}`: the caller's own order.
async fn get_order(
    State(db): State<Db>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    Path(id): Path<String>,
) -> Response {
    let Ok(id) = id.parse::<i64>() else {
        return error(StatusCode::NOT_FOUND, "not_found");
    };
    let found = with_db(db, move |conn| {
        conn.query_row(
            "SELECT sku, quantity FROM orders WHERE id = ?1 AND tenant_id = ?2",
            (id, tenant),
            |row| Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?)),
        )
        .optional()
    })
    .await;
    match found {
        Ok(Some((sku, quantity))) => {
            Json(json!({ "order_id": id, "sku": sku, "quantity": quantity })).into_response()
        }
        Ok(None) => error(StatusCode::NOT_FOUND, "not_found"),
        Err(response) => response,
    }
}

fn error(status: StatusCode, code: &str) -> Response {
    (status, Json(json!({ "error": code }))).into_response()
}
