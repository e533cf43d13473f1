//! The sqlx store over real HTTP on loopback: an axum order route whose handler runs ordinary
//! sqlx code on the request's transaction, on a fresh PostgreSQL schema per test.
//!
//! Every test needs PostgreSQL (`TEST_DATABASE_URL`) and is reported as ignored without it.

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use serde_json::json;
use sqlx::Executor as _;
use tower_idempotency::extract::Tx;
use tower_idempotency::store::sqlx_postgres::{SqlxPostgresStore, SqlxTransaction};
use tower_idempotency::{Fingerprinter, IdempotencyLayer, Tenant};

mod common;
mod pg_common;

use common::{Post, Serving};
use pg_common::TestDb;

/// What the tests watch and steer.
#[derive(Default)]
struct App {
    /// How many times the handler ran.
    calls: AtomicUsize,
    /// The backend pid of the handler's connection (`slow` orders).
    pid: AtomicI32,
    /// How many more `conflict` orders raise a serialization failure.
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
    let order_id: i64 = match sqlx::query_scalar(
        "INSERT INTO orders (tenant_id, sku, quantity) VALUES ($1, $2, $3) RETURNING id",
    )
    .bind(tenant.as_str())
    .bind(&sku)
    .bind(quantity)
    .fetch_one(&mut *conn)
    .await
    {
        Ok(id) => id,
        Err(error) => return server_error(error),
    };
    let mut refused = 0;
    match sku.as_str() {
        "fail" => return server_error("injected failure"),
        "panic" => panic!("the handler panics after its insert"),
        "duplicate" => tokio::time::sleep(Duration::from_millis(300)).await,
        "slow" if call == 1 => {
            let pid: i32 = match sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut *conn)
                .await
            {
                Ok(pid) => pid,
                Err(error) => return server_error(error),
            };
            app.pid.store(pid, Ordering::SeqCst);
            // The test terminates this backend meanwhile.
            if let Err(error) = sqlx::query("SELECT pg_sleep(10)").execute(&mut *conn).await {
                return server_error(error);
            }
        }
        "conflict" if app.conflicts.load(Ordering::SeqCst) > 0 => {
            app.conflicts.fetch_sub(1, Ordering::SeqCst);
            let conflict = sqlx::query(
                "DO $$ BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = '40001'; END $$",
            )
            .execute(&mut *conn)
            .await;
            // The handler answers as if nothing happened: the layer knows better.
            assert!(conflict.is_err(), "the injected conflict fails");
        }
        "commit" => {
            // Transaction control is refused whichever way it is sent, and nothing of a
            // refused string runs.
            let attempts = [
                sqlx::query("COMMIT").execute(&mut *conn).await.err(),
                (&mut *conn).execute("ROLLBACK").await.err(),
                // `raw_sql` through the executor's method: `raw_sql(..).execute(&mut *conn)`
                // is not `Send` in an axum handler, with any sqlx connection.
                (&mut *conn)
                    .execute(sqlx::raw_sql(
                        "INSERT INTO orders (tenant_id, sku, quantity) VALUES ('x', 'hidden', 1); \
                         COMMIT",
                    ))
                    .await
                    .err(),
                sqlx::query("begin").execute(&mut *conn).await.err(),
            ];
            for error in attempts.into_iter().flatten() {
                assert!(error.to_string().contains("refused"), "{error}");
                refused += 1;
            }
            // Savepoints stay inside the transaction: allowed.
            if let Err(error) = (&mut *conn)
                .execute(sqlx::raw_sql("SAVEPOINT s; RELEASE SAVEPOINT s"))
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

struct Server {
    serving: Serving,
    app: Arc<App>,
    db: TestDb,
}

impl Server {
    async fn start() -> Option<Server> {
        let db = TestDb::create().await?;
        let store = SqlxPostgresStore::builder(db.sqlx_pool(10).await)
            .max_read_connections(4)
            .build();
        store.migrate().await.expect("create the table");
        let app = Arc::new(App::default());
        let idempotency = IdempotencyLayer::new(store)
            .with_operation("create_order")
            .with_fingerprinter(Fingerprinter::json());
        let router = Router::new()
            .route("/orders", post(create_order).layer(idempotency))
            .layer(middleware::from_fn(authenticate))
            .with_state(app.clone());
        let serving = Serving::start(router).await;
        Some(Server { serving, app, db })
    }

    async fn send(&self, key: &str, body: &str) -> common::Reply {
        Post::order(key, body).send(self.serving.addr).await
    }

    fn calls(&self) -> usize {
        self.app.calls.load(Ordering::SeqCst)
    }
}

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

#[tokio::test]
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
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
    assert_eq!(server.db.order_count().await, 1);
    assert_eq!(server.db.record_count().await, 1);
}

#[tokio::test]
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
async fn the_key_with_another_payload_is_a_conflict() {
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
    assert_eq!(other.status, StatusCode::CONFLICT);
    assert_eq!(server.calls(), 1);
    assert_eq!(server.db.order_count().await, 1);
}

#[tokio::test]
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
async fn concurrent_duplicates_create_one_order() {
    let Some(server) = Server::start().await else {
        return;
    };
    let body = r#"{"sku":"duplicate","quantity":1}"#;
    let replies = futures_join_all(
        (0..8)
            .map(|_| Post::order("order-dup", body))
            .collect::<Vec<_>>(),
        server.serving.addr,
    )
    .await;

    let first = replies[0].order_id();
    for reply in &replies {
        assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
        assert_eq!(reply.order_id(), first);
    }
    assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1);
    assert_eq!(server.calls(), 1);
    assert_eq!(server.db.order_count().await, 1);
    assert_eq!(server.db.record_count().await, 1);
}

/// Sends all of `posts` at once, each on its own task and connection.
async fn futures_join_all(posts: Vec<Post>, addr: std::net::SocketAddr) -> Vec<common::Reply> {
    let tasks: Vec<_> = posts
        .into_iter()
        .map(|post| tokio::spawn(async move { post.send(addr).await }))
        .collect();
    let mut replies = Vec::new();
    for task in tasks {
        replies.push(task.await.expect("request task"));
    }
    replies
}

#[tokio::test]
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
async fn a_handler_error_rolls_back() {
    let Some(server) = Server::start().await else {
        return;
    };
    let failed = server
        .send("order-1", r#"{"sku":"fail","quantity":1}"#)
        .await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(server.db.order_count().await, 0, "the order rolled back");
    assert_eq!(server.db.record_count().await, 0);
    assert!(
        !server
            .db
            .record_exists("shop-a", "create_order", "order-1")
            .await
    );

    // The key is free again.
    let retried = server.send("order-1", BOOK).await;
    assert_eq!(retried.status, StatusCode::CREATED);
    assert_eq!(server.db.order_count().await, 1);
}

#[tokio::test]
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
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
    assert_eq!(server.db.order_count().await, 1);
}

#[tokio::test]
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
async fn a_terminated_backend_rolls_back_and_the_retry_succeeds() {
    let Some(server) = Server::start().await else {
        return;
    };
    let body = r#"{"sku":"slow","quantity":1}"#;
    let post = Post::order("order-1", body);
    let addr = server.serving.addr;
    let request = tokio::spawn(async move { post.send(addr).await });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let pid = loop {
        let pid = server.app.pid.load(Ordering::SeqCst);
        if pid != 0 {
            break pid;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the handler started"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let admin = server.db.client().await;
    let terminated: bool = admin
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .expect("terminate")
        .get(0);
    assert!(terminated);

    let failed = request.await.expect("request task");
    // The database went away under the handler, as in a failover: not a final failure.
    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE, "{failed:?}");
    assert!(failed.header("retry-after").is_some(), "{failed:?}");
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
    assert_eq!(server.db.order_count().await, 1);
    assert_eq!(server.db.record_count().await, 1);
}

#[tokio::test]
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
async fn transaction_control_through_the_handle_is_refused() {
    let Some(server) = Server::start().await else {
        return;
    };
    let reply = server
        .send("order-1", r#"{"sku":"commit","quantity":1}"#)
        .await;
    assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
    assert_eq!(reply.json()["refused"], 4);
    // Nothing of the refused statements ran: the one order, committed with its record.
    let orders = server.db.orders().await;
    assert_eq!(orders.len(), 1, "{orders:?}");
    assert_eq!(orders[0].2, "commit");
    assert_eq!(server.db.record_count().await, 1);
    let again = server
        .send("order-1", r#"{"sku":"commit","quantity":1}"#)
        .await;
    assert!(again.replayed());
}

#[tokio::test]
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
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
        server.db.order_count().await,
        1,
        "the first run rolled back"
    );
    assert_eq!(server.db.record_count().await, 1);
}
