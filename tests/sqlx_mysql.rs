//! The MySQL/MariaDB store over real HTTP on loopback: an axum order route whose handler runs
//! ordinary sqlx code on the request's transaction, on a fresh database per test; two store
//! instances (two pools) racing on the same keys; and the example as a process killed with
//! SIGKILL under load.
//!
//! Every test needs MySQL or MariaDB (`TEST_MYSQL_URL`) and is reported as ignored without it.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::json;
use sqlx::Executor as _;
use tokio::sync::Barrier;
use tower_idempotency::extract::Tx;
use tower_idempotency::store::sqlx_mysql::{SqlxMySqlStore, SqlxTransaction};
use tower_idempotency::{Fingerprinter, IdempotencyLayer, Tenant};

mod common;
mod mysql_common;
#[path = "apps/process.rs"]
mod process;

use common::{Post, Serving};
use mysql_common::TestDb;

/// What the tests watch and steer.
#[derive(Default)]
struct App {
    /// How many times the handler ran.
    calls: AtomicUsize,
    /// The connection id of the handler's connection (`slow` orders).
    connection_id: AtomicU64,
    /// How many more `conflict` orders raise a deadlock-class error.
    conflicts: AtomicUsize,
}

/// Puts the tenant of `Bearer shop-a-token` in the extensions.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let authorized = request
        .headers()
        .get("authorization")
        .is_some_and(|value| value == "Bearer shop-a-token");
    if !authorized {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    request.extensions_mut().insert(Tenant::new("shop-a"));
    next.run(request).await
}

fn server_error(what: impl std::fmt::Display) -> Response {
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        Json(json!({ "error": what.to_string() })),
    )
        .into_response()
}

/// `POST /orders {"sku": ..., "quantity": ...}`: inserts the order through the handle; some
/// SKUs then misbehave on purpose.
async fn create_order(
    State(app): State<Arc<App>>,
    Extension(tenant): Extension<Tenant>,
    Tx(tx): Tx<SqlxTransaction>,
    body: Bytes,
) -> Response {
    let call = app.calls.fetch_add(1, Ordering::SeqCst) + 1;
    let Ok(order) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let sku = order["sku"].as_str().unwrap_or_default().to_owned();
    let quantity = order["quantity"].as_i64().unwrap_or(1);
    let mut conn = match tx.acquire().await {
        Ok(conn) => conn,
        Err(error) => return server_error(error),
    };
    let inserted = sqlx::query("INSERT INTO orders (tenant_id, sku, quantity) VALUES (?, ?, ?)")
        .bind(tenant.as_str())
        .bind(&sku)
        .bind(quantity)
        .execute(&mut *conn)
        .await;
    let order_id = match inserted {
        Ok(done) => done.last_insert_id(),
        Err(error) => return server_error(error),
    };
    let mut refused = 0;
    match sku.as_str() {
        "fail" => return server_error("injected failure"),
        "panic" => panic!("the handler panics after its insert"),
        "duplicate" => tokio::time::sleep(Duration::from_millis(300)).await,
        "hold" => tokio::time::sleep(Duration::from_secs(3)).await,
        "fail-slowly" if call == 1 => {
            tokio::time::sleep(Duration::from_millis(300)).await;
            return server_error("injected failure");
        }
        "slow" if call == 1 => {
            let id: u64 = match sqlx::query_scalar("SELECT CONNECTION_ID()")
                .fetch_one(&mut *conn)
                .await
            {
                Ok(id) => id,
                Err(error) => return server_error(error),
            };
            app.connection_id.store(id, Ordering::SeqCst);
            // The test kills this connection meanwhile.
            if let Err(error) = sqlx::query("DO SLEEP(10)").execute(&mut *conn).await {
                return server_error(error);
            }
            // MariaDB ends a killed SLEEP early without an error; the next statement fails.
            if let Err(error) = sqlx::query("DO 1").execute(&mut *conn).await {
                return server_error(error);
            }
        }
        "conflict" if app.conflicts.load(Ordering::SeqCst) > 0 => {
            app.conflicts.fetch_sub(1, Ordering::SeqCst);
            let conflict = sqlx::query("SIGNAL SQLSTATE '40001' SET MESSAGE_TEXT = 'injected'")
                .execute(&mut *conn)
                .await;
            // The handler answers as if nothing happened: the layer knows better.
            assert!(conflict.is_err(), "the injected conflict fails");
            // And nothing more runs in the transaction that the deadlock ended.
            let after = sqlx::query("DO 1").execute(&mut *conn).await;
            assert!(after.is_err_and(|e| e.to_string().contains("refused")));
        }
        "commit" => {
            // Transaction control and implicit commits are refused whichever way they are
            // sent, and nothing of a refused string runs.
            let attempts = [
                sqlx::query("COMMIT").execute(&mut *conn).await.err(),
                (&mut *conn).execute("ROLLBACK").await.err(),
                (&mut *conn)
                    .execute(sqlx::raw_sql(
                        "INSERT INTO orders (tenant_id, sku, quantity) VALUES ('x', 'hidden', 1); \
                         COMMIT",
                    ))
                    .await
                    .err(),
                sqlx::query("begin").execute(&mut *conn).await.err(),
                sqlx::query("SET autocommit = 1")
                    .execute(&mut *conn)
                    .await
                    .err(),
                (&mut *conn).execute("CREATE TABLE t (a INT)").await.err(),
                (&mut *conn).execute("/*!COMMIT*/").await.err(),
            ];
            for error in attempts.into_iter().flatten() {
                assert!(error.to_string().contains("refused"), "{error}");
                refused += 1;
            }
            // Savepoints and temporary tables stay inside the transaction: allowed.
            if let Err(error) = (&mut *conn)
                .execute(sqlx::raw_sql(
                    "SAVEPOINT s; CREATE TEMPORARY TABLE scratch (a INT); \
                     INSERT INTO scratch VALUES (1); ROLLBACK TO SAVEPOINT s; \
                     RELEASE SAVEPOINT s",
                ))
                .await
            {
                return server_error(error);
            }
        }
        _ => {}
    }
    (
        StatusCode::CREATED,
        Json(json!({ "order_id": order_id, "refused": refused })),
    )
        .into_response()
}

/// The order route on `store`.
fn router(store: SqlxMySqlStore, app: Arc<App>) -> Router {
    let idempotency = IdempotencyLayer::new(store)
        .with_operation("create_order")
        .with_fingerprinter(Fingerprinter::json())
        // The IETF draft's status for a key reused with another payload.
        .with_conflict_status(StatusCode::UNPROCESSABLE_ENTITY)
        .with_lock_timeout(Duration::from_secs(1))
        .with_max_key_len(255);
    Router::new()
        .route("/orders", post(create_order).layer(idempotency))
        .layer(middleware::from_fn(authenticate))
        .with_state(app)
}

struct Server {
    serving: Serving,
    app: Arc<App>,
    db: TestDb,
}

impl Server {
    async fn start() -> Option<Server> {
        let db = TestDb::create().await?;
        let store = db.store(10).await;
        let app = Arc::new(App::default());
        let serving = Serving::start(router(store, app.clone())).await;
        Some(Server { serving, app, db })
    }

    async fn send(&self, key: &str, body: &str) -> common::Reply {
        Post::order(key, body).send(self.serving.addr).await
    }

    fn calls(&self) -> usize {
        self.app.calls.load(Ordering::SeqCst)
    }
}

/// Sends all of `posts` at once, each on its own task and connection.
async fn send_all(posts: Vec<(SocketAddr, Post)>) -> Vec<common::Reply> {
    let tasks: Vec<_> = posts
        .into_iter()
        .map(|(addr, post)| tokio::spawn(async move { post.send(addr).await }))
        .collect();
    let mut replies = Vec::new();
    for task in tasks {
        replies.push(task.await.expect("request task"));
    }
    replies
}

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

#[tokio::test]
#[cfg_attr(
    not(mysql_tests),
    ignore = "needs MySQL or MariaDB: set TEST_MYSQL_URL"
)]
async fn a_new_order_is_created_and_replayed() {
    let Some(server) = Server::start().await else {
        return;
    };
    let first = server.send("order-1", BOOK).await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    assert!(!first.replayed());

    let again = server.send("order-1", BOOK).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(again.replayed());
    assert_eq!(again.order_id(), first.order_id());
    assert_eq!(again.body, first.body);

    assert_eq!(server.calls(), 1);
    assert_eq!(server.db.counts().await, (1, 1));
}

#[tokio::test]
#[cfg_attr(
    not(mysql_tests),
    ignore = "needs MySQL or MariaDB: set TEST_MYSQL_URL"
)]
async fn the_key_with_another_payload_is_422() {
    let Some(server) = Server::start().await else {
        return;
    };
    assert_eq!(
        server.send("order-1", BOOK).await.status,
        StatusCode::CREATED
    );

    let other = server
        .send("order-1", r#"{"sku":"book","quantity":2}"#)
        .await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.error_code(), "key_reused_with_different_payload");
    assert_eq!(server.calls(), 1);
    assert_eq!(server.db.counts().await, (1, 1));
}

#[tokio::test]
#[cfg_attr(
    not(mysql_tests),
    ignore = "needs MySQL or MariaDB: set TEST_MYSQL_URL"
)]
async fn concurrent_duplicates_create_one_order() {
    let Some(server) = Server::start().await else {
        return;
    };
    let body = r#"{"sku":"duplicate","quantity":1}"#;
    let addr = server.serving.addr;
    let replies = send_all(
        (0..8)
            .map(|_| (addr, Post::order("order-dup", body)))
            .collect(),
    )
    .await;

    let first = replies[0].order_id();
    for reply in &replies {
        assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
        assert_eq!(reply.order_id(), first);
    }
    assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1);
    assert_eq!(server.calls(), 1);
    assert_eq!(server.db.counts().await, (1, 1));
}

/// Duplicates queued behind a key whose first request rolls back: one of them runs (InnoDB
/// may pick some of the waiters as deadlock victims, which the store retries), the others
/// replay it.
#[tokio::test]
#[cfg_attr(
    not(mysql_tests),
    ignore = "needs MySQL or MariaDB: set TEST_MYSQL_URL"
)]
async fn duplicates_behind_a_rollback_run_once() {
    let Some(server) = Server::start().await else {
        return;
    };
    let addr = server.serving.addr;
    let body = r#"{"sku":"fail-slowly","quantity":1}"#;
    let first = tokio::spawn(async move { Post::order("order-rb", body).send(addr).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let replies = send_all(
        (0..6)
            .map(|_| (addr, Post::order("order-rb", body)))
            .collect(),
    )
    .await;

    let first = first.await.expect("first request");
    assert_eq!(
        first.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{:?}",
        first.body
    );
    let order_id = replies[0].order_id();
    for reply in &replies {
        assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
        assert_eq!(reply.order_id(), order_id);
    }
    assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1);
    assert_eq!(server.calls(), 2, "the failed run and one duplicate");
    assert_eq!(server.db.counts().await, (1, 1));
}

#[tokio::test]
#[cfg_attr(
    not(mysql_tests),
    ignore = "needs MySQL or MariaDB: set TEST_MYSQL_URL"
)]
async fn a_handler_error_rolls_back() {
    let Some(server) = Server::start().await else {
        return;
    };
    let failed = server
        .send("order-1", r#"{"sku":"fail","quantity":1}"#)
        .await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(server.db.order_count().await, 0, "the order rolled back");
    assert!(
        !server
            .db
            .record_exists("shop-a", "create_order", "order-1")
            .await
    );

    // The key is free again.
    let retried = server.send("order-1", BOOK).await;
    assert_eq!(retried.status, StatusCode::CREATED);
    assert_eq!(server.db.counts().await, (1, 1));
}

#[tokio::test]
#[cfg_attr(
    not(mysql_tests),
    ignore = "needs MySQL or MariaDB: set TEST_MYSQL_URL"
)]
async fn a_handler_panic_rolls_back() {
    let Some(server) = Server::start().await else {
        return;
    };
    let panicked = server
        .send("order-1", r#"{"sku":"panic","quantity":1}"#)
        .await;
    assert_eq!(panicked.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(server.db.order_count().await, 0, "the order rolled back");
    assert!(
        !server
            .db
            .record_exists("shop-a", "create_order", "order-1")
            .await
    );

    let retried = server.send("order-1", BOOK).await;
    assert_eq!(retried.status, StatusCode::CREATED);
    assert_eq!(server.db.counts().await, (1, 1));
}

/// A duplicate of a key whose holder runs past the lock timeout (1 s here) gets `503` with
/// `Retry-After`, and nothing of it is kept; once the holder commits, the key replays.
#[tokio::test]
#[cfg_attr(
    not(mysql_tests),
    ignore = "needs MySQL or MariaDB: set TEST_MYSQL_URL"
)]
async fn a_holder_beyond_the_lock_timeout_answers_503() {
    let Some(server) = Server::start().await else {
        return;
    };
    let hold = r#"{"sku":"hold","quantity":1}"#;
    let addr = server.serving.addr;
    let holder = tokio::spawn(async move { Post::order("order-1", hold).send(addr).await });
    tokio::time::sleep(Duration::from_millis(200)).await;

    let started = std::time::Instant::now();
    let busy = server.send("order-1", hold).await;
    assert_eq!(
        busy.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        busy.body
    );
    assert!(busy.header("retry-after").is_some(), "{:?}", busy.headers);
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "the wait was bounded"
    );

    let held = holder.await.expect("holder");
    assert_eq!(held.status, StatusCode::CREATED, "{:?}", held.body);
    assert_eq!(server.calls(), 1, "the busy duplicate did not run");
    let again = server.send("order-1", hold).await;
    assert!(again.replayed());
    assert_eq!(server.db.counts().await, (1, 1));
}

#[tokio::test]
#[cfg_attr(
    not(mysql_tests),
    ignore = "needs MySQL or MariaDB: set TEST_MYSQL_URL"
)]
async fn keys_of_255_characters_are_kept_apart() {
    let Some(server) = Server::start().await else {
        return;
    };
    let long = "k".repeat(255);
    // The same 254 first characters: only the last one differs.
    let other = format!("{}x", "k".repeat(254));
    let first = server.send(&long, BOOK).await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    let second = server.send(&other, BOOK).await;
    assert_eq!(second.status, StatusCode::CREATED, "{:?}", second.body);
    assert!(!second.replayed());
    assert_ne!(first.order_id(), second.order_id());

    let again = server.send(&long, BOOK).await;
    assert!(again.replayed());
    assert_eq!(again.order_id(), first.order_id());
    assert!(
        server
            .db
            .record_exists("shop-a", "create_order", &long)
            .await
    );
    assert_eq!(server.db.counts().await, (2, 2));
}

#[tokio::test]
#[cfg_attr(
    not(mysql_tests),
    ignore = "needs MySQL or MariaDB: set TEST_MYSQL_URL"
)]
async fn a_killed_connection_rolls_back_and_the_retry_succeeds() {
    let Some(server) = Server::start().await else {
        return;
    };
    let body = r#"{"sku":"slow","quantity":1}"#;
    let post = Post::order("order-1", body);
    let addr = server.serving.addr;
    let request = tokio::spawn(async move { post.send(addr).await });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let id = loop {
        let id = server.app.connection_id.load(Ordering::SeqCst);
        if id != 0 {
            break id;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the handler started"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    server.db.execute(&format!("KILL {id}")).await;

    let failed = request.await.expect("request task");
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(server.db.order_count().await, 0, "the order rolled back");
    assert!(
        !server
            .db
            .record_exists("shop-a", "create_order", "order-1")
            .await
    );

    let retried = server.send("order-1", body).await;
    assert_eq!(retried.status, StatusCode::CREATED, "{:?}", retried.body);
    assert!(!retried.replayed());
    assert_eq!(server.calls(), 2);
    assert_eq!(server.db.counts().await, (1, 1));
}

#[tokio::test]
#[cfg_attr(
    not(mysql_tests),
    ignore = "needs MySQL or MariaDB: set TEST_MYSQL_URL"
)]
async fn transaction_control_through_the_handle_is_refused() {
    let Some(server) = Server::start().await else {
        return;
    };
    let reply = server
        .send("order-1", r#"{"sku":"commit","quantity":1}"#)
        .await;
    assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
    assert_eq!(reply.json()["refused"], 7);
    // Nothing of the refused statements ran: the one order, committed with its record.
    assert_eq!(server.db.order_skus().await, ["commit"]);
    assert_eq!(server.db.record_count().await, 1);
    let again = server
        .send("order-1", r#"{"sku":"commit","quantity":1}"#)
        .await;
    assert!(again.replayed());
}

#[tokio::test]
#[cfg_attr(
    not(mysql_tests),
    ignore = "needs MySQL or MariaDB: set TEST_MYSQL_URL"
)]
async fn a_handler_statement_conflict_runs_the_request_again() {
    let Some(server) = Server::start().await else {
        return;
    };
    server.app.conflicts.store(1, Ordering::SeqCst);
    let reply = server
        .send("order-1", r#"{"sku":"conflict","quantity":1}"#)
        .await;
    assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
    assert_eq!(server.calls(), 2, "the layer ran the request again");
    assert_eq!(
        server.db.counts().await,
        (1, 1),
        "the first run rolled back"
    );
}

/// The connection goes back to the application's pool as it came: `autocommit` on and the
/// server's lock wait timeout, whatever the request set.
#[tokio::test]
#[cfg_attr(
    not(mysql_tests),
    ignore = "needs MySQL or MariaDB: set TEST_MYSQL_URL"
)]
async fn the_session_is_restored_after_a_request() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    // One connection: the request's and the check's are the same.
    let store = db.store(1).await;
    let pool = store.pool().clone();
    let app = Arc::new(App::default());
    let serving = Serving::start(router(store, app)).await;
    let before: (i64, i64) =
        sqlx::query_as("SELECT @@autocommit, CAST(@@innodb_lock_wait_timeout AS SIGNED)")
            .fetch_one(&pool)
            .await
            .expect("session settings");
    for (key, sku) in [("order-1", "book"), ("order-2", "fail")] {
        let body = format!(r#"{{"sku":"{sku}","quantity":1}}"#);
        Post::order(key, &body).send(serving.addr).await;
        let after: (i64, i64) =
            sqlx::query_as("SELECT @@autocommit, CAST(@@innodb_lock_wait_timeout AS SIGNED)")
                .fetch_one(&pool)
                .await
                .expect("session settings");
        assert_eq!(after, before, "after {sku}");
    }
    assert_eq!(db.counts().await, (1, 1));
}

/// Two store instances, each with its own pool (two application instances), answer the same
/// keys at the same moment: one order per key, and every reply of a key is the same 201.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(mysql_tests),
    ignore = "needs MySQL or MariaDB: set TEST_MYSQL_URL"
)]
async fn two_store_instances_create_one_order_per_key() {
    const KEYS: usize = 12;
    const DUPLICATES: usize = 4;
    let Some(db) = TestDb::create().await else {
        return;
    };
    let a = Serving::start(router(db.store(6).await, Arc::default())).await;
    let b = Serving::start(router(db.store(6).await, Arc::default())).await;

    let barrier = Arc::new(Barrier::new(KEYS * DUPLICATES));
    let mut tasks = Vec::new();
    for k in 0..KEYS {
        for d in 0..DUPLICATES {
            let addr = if d % 2 == 0 { a.addr } else { b.addr };
            let barrier = barrier.clone();
            tasks.push((
                k,
                tokio::spawn(async move {
                    barrier.wait().await;
                    let body = format!(r#"{{"sku":"duplicate-{k}","quantity":1}}"#);
                    Post::order(&format!("key-{k}"), &body).send(addr).await
                }),
            ));
        }
    }
    let mut by_key: BTreeMap<usize, Vec<common::Reply>> = BTreeMap::new();
    for (k, task) in tasks {
        by_key
            .entry(k)
            .or_default()
            .push(task.await.expect("request"));
    }
    for (k, replies) in &by_key {
        for reply in replies {
            assert_eq!(reply.status, StatusCode::CREATED, "key-{k}: {reply:?}");
            assert_eq!(reply.body, replies[0].body, "key-{k}: the same response");
        }
        let originals = replies.iter().filter(|r| !r.replayed()).count();
        assert_eq!(originals, 1, "key-{k}: one original, the rest replayed");
    }
    assert_eq!(db.counts().await, (KEYS as i64, KEYS as i64));
}

/// Sends `POST /orders` and tolerates a dead server: `None` when no complete answer came.
async fn try_post(
    client: &Client<HttpConnector, Full<Bytes>>,
    addr: SocketAddr,
    key: &str,
) -> Option<(StatusCode, bool, Bytes)> {
    let body = format!(r#"{{"sku":"{key}","quantity":1}}"#);
    let request = http::Request::post(format!("http://{addr}/orders"))
        .header("authorization", format!("Bearer {}", common::SHOP_A))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .ok()?;
    let exchange = async {
        let response = client.request(request).await.ok()?;
        let status = response.status();
        let replayed = response.headers().contains_key("idempotent-replayed");
        let body = response.into_body().collect().await.ok()?.to_bytes();
        Some((status, replayed, body))
    };
    tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .ok()
        .flatten()
}

/// The example (`examples/orders_mysql.rs`) killed with SIGKILL under load, then started again
/// on the same database. Afterwards every key that got a 201 replays exactly that 201, and
/// orders == distinct keys == records: a transaction cut by the kill either committed whole or
/// left nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(mysql_tests),
    ignore = "needs MySQL or MariaDB: set TEST_MYSQL_URL"
)]
async fn example_killed_under_load_keeps_one_order_per_key() {
    const WORKERS: usize = 8;
    const KEYS_PER_WORKER: usize = 400;
    let Some(db) = TestDb::create().await else {
        return;
    };
    let url = db.url();
    let server = process::ExampleProcess::start("orders_mysql", &["--database-url", &url]).await;
    let addr = server.addr;

    let answered = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let answered = answered.clone();
            tokio::spawn(async move {
                let client: Client<HttpConnector, Full<Bytes>> =
                    Client::builder(TokioExecutor::new()).build_http();
                let mut seen: BTreeMap<String, Option<Bytes>> = BTreeMap::new();
                for i in 0..KEYS_PER_WORKER {
                    let key = format!("crash-{w}-{i}");
                    match try_post(&client, addr, &key).await {
                        Some((StatusCode::CREATED, _, body)) => {
                            seen.insert(key, Some(body));
                            answered.fetch_add(1, Ordering::SeqCst);
                        }
                        Some((status, _, body)) => panic!("{key}: {status} {body:?}"),
                        None => {
                            seen.insert(key, None);
                            break; // the server is gone
                        }
                    }
                }
                seen
            })
        })
        .collect();
    let deadline = tokio::time::Instant::now() + common::PATIENCE;
    while answered.load(Ordering::SeqCst) < 50 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // SIGKILL (the child is killed on drop).
    drop(server);
    let mut seen: BTreeMap<String, Option<Bytes>> = BTreeMap::new();
    for worker in workers {
        seen.extend(worker.await.expect("worker"));
    }
    let created_before = seen.values().filter(|s| s.is_some()).count();
    assert!(created_before > 0, "the load ran before the kill");
    assert!(
        created_before < seen.len(),
        "the kill landed with requests in flight ({created_before} of {} answered)",
        seen.len()
    );

    let server = process::ExampleProcess::start("orders_mysql", &["--database-url", &url]).await;
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let mut final_ids = HashSet::new();
    for (key, before) in &seen {
        let (status, replayed, body) = try_post(&client, server.addr, key)
            .await
            .unwrap_or_else(|| panic!("{key}: no answer after the restart"));
        assert_eq!(status, StatusCode::CREATED, "{key}: {body:?}");
        if let Some(created) = before {
            assert!(replayed, "{key}: a key that got its 201 replays it");
            assert_eq!(&body, created, "{key}: the same body as before the crash");
        }
        let id = serde_json::from_slice::<serde_json::Value>(&body).expect("JSON")["order_id"]
            .as_i64()
            .expect("order_id");
        assert!(final_ids.insert(id), "{key}: no two keys share an order");
    }
    drop(server);

    let orders: BTreeSet<i64> = db.order_ids().await.into_iter().collect();
    let records = db.recorded_order_ids().await;
    assert_eq!(orders.len(), seen.len(), "one order per distinct key");
    assert_eq!(records.len(), orders.len(), "one record per order");
    assert_eq!(
        records.into_iter().collect::<BTreeSet<_>>(),
        orders,
        "every record points at an order and back"
    );
    assert_eq!(
        db.row_count().await,
        orders.len() as i64,
        "no stray reservation"
    );
}
