//! The plain hyper example (`examples/hyper_orders.rs`) run as a process, as `cargo run
//! --example hyper_orders` runs it, and checked against the contract of the README with the
//! shared HTTP client of `tests/support/common` over loopback.

use support::common;
use support::sqlite_faults;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use common::process::{arg, ExampleProcess};
use common::{assert_each_is_400, orders, record_exists, Post, Reply, PATIENCE, SHOP_A, SHOP_B};
use http::StatusCode;
use sqlite_faults::{fail_saving_records, stop_failing_saves, OtherProcessLock};
use tokio::sync::Barrier;
use tower_idempotency::store::sqlite::SqliteStore;

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

/// The example on 127.0.0.1, over a fresh database file.
struct HyperExample {
    addr: SocketAddr,
    /// Killed first when dropped, before the directory of its file goes.
    _process: ExampleProcess,
    /// The test's own connection to the example's file, as another process has one: to count
    /// rows and to inject faults.
    store: SqliteStore,
    db_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl HyperExample {
    /// The example exactly as `cargo run --example hyper_orders -- --db FILE` serves it.
    async fn spawn() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let db_path = dir.path().join("orders.db");
        let process = ExampleProcess::start("hyper_orders", &["--db", arg(&db_path)]).await;
        let store = SqliteStore::open(&db_path)
            .await
            .expect("open the example's database");
        HyperExample {
            addr: process.addr,
            _process: process,
            store,
            db_path,
            _dir: dir,
        }
    }

    async fn order_count(&self) -> i64 {
        common::order_count(&self.store).await
    }

    async fn record_count(&self) -> i64 {
        common::record_count(&self.store).await
    }

    /// Posts the book order with `key`, and asserts that it ran afresh: `201`, not a replay.
    async fn assert_created_afresh(&self, key: &str) {
        let reply = Post::order(key, BOOK).send(self.addr).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        assert!(!reply.replayed(), "{reply:?}");
    }

    /// `GET /orders/{id}` as `token`.
    async fn get(&self, id: i64, token: &str) -> Reply {
        get(self.addr, &format!("/orders/{id}"), Some(token)).await
    }
}

/// A `GET` with the shared client's conventions (its own connection, the whole reply).
async fn get(addr: SocketAddr, path: &str, token: Option<&str>) -> Reply {
    let mut request = http::Request::get(format!("http://{addr}{path}"));
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    let request = request
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .expect("request");
    common::send(request).await
}

test! { new_key_creates_the_order_and_answers_201_with_location }
async fn new_key_creates_the_order_and_answers_201_with_location() {
    let server = HyperExample::spawn().await;

    let reply = Post::order("key-1", BOOK).send(server.addr).await;

    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    let id = reply.order_id();
    assert_eq!(reply.body, format!("{{\"order_id\":{id}}}"));
    assert_eq!(reply.header("location"), Some(&*format!("/orders/{id}")));
    assert_eq!(reply.header("content-type"), Some("application/json"));
    assert!(!reply.replayed());
    assert_eq!(
        orders(&server.store).await,
        vec![(id, "shop-a".to_owned(), "book".to_owned(), 1)]
    );
    assert!(record_exists(&server.store, "shop-a", "create_order", "key-1").await);
}

test! { same_key_and_payload_replays_the_saved_response }
async fn same_key_and_payload_replays_the_saved_response() {
    let server = HyperExample::spawn().await;
    let first = Post::order("key-1", BOOK).send(server.addr).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");

    // The same JSON written another way is the same request.
    for body in [BOOK, r#"{ "quantity": 1, "sku": "\u0062ook" }"#] {
        let again = Post::order("key-1", body).send(server.addr).await;
        assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
        assert!(again.replayed(), "{again:?}");
        assert_eq!(again.body, first.body);
        assert_eq!(again.header("location"), first.header("location"));
        assert_eq!(again.header("content-type"), Some("application/json"));
        again.assert_content_length_matches();
    }
    assert_eq!(server.order_count().await, 1);
    assert_eq!(server.record_count().await, 1);
}

test! { same_key_with_another_payload_is_409_and_the_original_stays }
async fn same_key_with_another_payload_is_409_and_the_original_stays() {
    let server = HyperExample::spawn().await;
    let first = Post::order("key-1", BOOK).send(server.addr).await;

    let conflict = Post::order("key-1", r#"{"sku":"book","quantity":2}"#)
        .send(server.addr)
        .await;

    assert_eq!(conflict.status, StatusCode::CONFLICT, "{conflict:?}");
    assert_eq!(conflict.error_code(), "key_reused_with_different_payload");
    assert_eq!(server.order_count().await, 1);
    let again = Post::order("key-1", BOOK).send(server.addr).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
}

test! { another_tenant_gets_its_own_order_and_reads_only_its_own }
async fn another_tenant_gets_its_own_order_and_reads_only_its_own() {
    let server = HyperExample::spawn().await;
    let a = Post::order("key-1", BOOK).send(server.addr).await;
    let b = Post::order("key-1", BOOK)
        .token(Some(SHOP_B))
        .send(server.addr)
        .await;

    assert_eq!(b.status, StatusCode::CREATED, "{b:?}");
    assert!(!b.replayed());
    assert_ne!(a.order_id(), b.order_id());

    let own = server.get(a.order_id(), SHOP_A).await;
    assert_eq!(own.status, StatusCode::OK, "{own:?}");
    assert_eq!(
        own.json(),
        serde_json::json!({ "order_id": a.order_id(), "sku": "book", "quantity": 1 })
    );
    let foreign = server.get(b.order_id(), SHOP_A).await;
    assert_eq!(foreign.status, StatusCode::NOT_FOUND, "{foreign:?}");
    assert_eq!(foreign.error_code(), "not_found");
}

test! { concurrent_duplicates_create_one_order }
async fn concurrent_duplicates_create_one_order() {
    const COPIES: usize = 8;
    let server = HyperExample::spawn().await;
    let barrier = Arc::new(Barrier::new(COPIES));

    let copies: Vec<_> = (0..COPIES)
        .map(|_| {
            let (addr, barrier) = (server.addr, barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                Post::order("dup", BOOK).send(addr).await
            })
        })
        .collect();
    let mut replies = Vec::new();
    for copy in copies {
        replies.push(copy.await.expect("task"));
    }

    assert!(replies.iter().all(|r| r.status == StatusCode::CREATED));
    assert!(replies.iter().all(|r| r.body == replies[0].body));
    assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1);
    assert_eq!(server.order_count().await, 1);
    assert_eq!(server.record_count().await, 1);
}

test! { failure_after_the_insert_rolls_back_and_the_retry_runs_afresh }
async fn failure_after_the_insert_rolls_back_and_the_retry_runs_afresh() {
    let server = HyperExample::spawn().await;
    // Saving the response fails after the handler inserted its order (the article's trigger).
    fail_saving_records(&server.store).await;

    let failed = Post::order("key-1", BOOK).send(server.addr).await;
    assert_eq!(
        failed.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{failed:?}"
    );
    assert_eq!(failed.error_code(), "internal_error");
    assert_eq!(server.order_count().await, 0, "the order was rolled back");
    assert_eq!(server.record_count().await, 0);

    stop_failing_saves(&server.store).await;
    server.assert_created_afresh("key-1").await;
    assert_eq!(server.order_count().await, 1);
}

test! { validation_errors_are_not_saved_so_a_corrected_payload_succeeds }
async fn validation_errors_are_not_saved_so_a_corrected_payload_succeeds() {
    let server = HyperExample::spawn().await;

    let cases = [
        (r#"{"sku":"","quantity":1}"#, "invalid_key_or_sku"),
        (r#"{"quantity":1}"#, "invalid_key_or_sku"),
        (r#"{"sku":"book","quantity":0}"#, "invalid_quantity"),
        (r#"{"sku":"book","quantity":1.5}"#, "invalid_quantity"),
        (r#"{"sku":"book""#, "invalid_json"),
    ];
    let requests = cases.map(|(body, code)| (body, Post::order("key-1", body), code));
    assert_each_is_400(server.addr, requests).await;
    assert_eq!(server.record_count().await, 0);

    server.assert_created_afresh("key-1").await;
    assert_eq!(server.order_count().await, 1);
}

test! { key_problems_are_400_and_nothing_is_stored }
async fn key_problems_are_400_and_nothing_is_stored() {
    let server = HyperExample::spawn().await;
    let too_long = "k".repeat(129);
    let cases: [(Post, &str); 4] = [
        (
            Post::order("unused", BOOK).no_key(),
            "missing_idempotency_key",
        ),
        (Post::order("a b", BOOK), "invalid_idempotency_key"),
        (Post::order(&too_long, BOOK), "idempotency_key_too_long"),
        (
            Post::order("a", BOOK).raw_keys(&[b"a", b"b"]),
            "duplicate_idempotency_key_header",
        ),
    ];
    assert_each_is_400(
        server.addr,
        cases.map(|(request, code)| (code, request, code)),
    )
    .await;
    assert_eq!(server.order_count().await, 0);
    assert_eq!(server.record_count().await, 0);
}

test! { unauthenticated_requests_are_401 }
async fn unauthenticated_requests_are_401() {
    let server = HyperExample::spawn().await;

    for token in [None, Some("stolen-token")] {
        let post = Post::order("key-1", BOOK)
            .token(token)
            .send(server.addr)
            .await;
        assert_eq!(post.status, StatusCode::UNAUTHORIZED, "{post:?}");
        assert_eq!(post.error_code(), "unauthenticated");
        let read = get(server.addr, "/orders/1", token).await;
        assert_eq!(read.status, StatusCode::UNAUTHORIZED, "{read:?}");
    }
    assert_eq!(server.record_count().await, 0);
}

test! { body_over_the_limit_is_413 }
async fn body_over_the_limit_is_413() {
    let server = HyperExample::spawn().await;
    // The example keeps the default limit, 1 MiB.
    let large = format!(r#"{{"sku":"{}","quantity":1}}"#, "x".repeat(1024 * 1024));

    let reply = Post::order("key-1", &large).send(server.addr).await;

    assert_eq!(
        reply.status,
        StatusCode::PAYLOAD_TOO_LARGE,
        "{:?}",
        reply.status
    );
    assert_eq!(reply.error_code(), "payload_too_large");
    assert_eq!(server.record_count().await, 0);
}

test! { store_busy_past_the_lock_timeout_is_503_then_the_retry_succeeds }
async fn store_busy_past_the_lock_timeout_is_503_then_the_retry_succeeds() {
    // The example keeps the default lock timeout, 5 s: the busy answer takes that long.
    let server = HyperExample::spawn().await;

    // Another process: its own connection to the same file, holding SQLite's write lock.
    let other_process = OtherProcessLock::take(&server.db_path, PATIENCE).await;

    let busy = Post::order("key-1", BOOK).send(server.addr).await;
    other_process.release();

    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE, "{busy:?}");
    assert_eq!(busy.error_code(), "busy_retry_later");
    assert!(busy.header("retry-after").is_some(), "{busy:?}");
    server.assert_created_afresh("key-1").await;
}

test! { other_methods_and_paths_are_405_and_404 }
async fn other_methods_and_paths_are_405_and_404() {
    let server = HyperExample::spawn().await;

    let list = get(server.addr, "/orders", Some(SHOP_A)).await;
    assert_eq!(list.status, StatusCode::METHOD_NOT_ALLOWED, "{list:?}");
    assert_eq!(list.header("allow"), Some("POST"));

    let post_to_order = Post::order("key-1", BOOK)
        .path("/orders/1")
        .send(server.addr)
        .await;
    assert_eq!(post_to_order.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(post_to_order.header("allow"), Some("GET"));

    for path in ["/", "/nowhere", "/orders/1/items", "/orders/not-a-number"] {
        let reply = get(server.addr, path, Some(SHOP_A)).await;
        assert_eq!(reply.status, StatusCode::NOT_FOUND, "{path}: {reply:?}");
    }
    assert_eq!(server.record_count().await, 0);
}
