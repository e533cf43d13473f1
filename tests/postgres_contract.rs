//! The contract (DESIGN.md §1) against the PostgreSQL store, over real HTTP: new key, replay,
//! changed payload, other tenant and operation, what is never stored, expiry and purging,
//! durability across a restart, and the schema created and migrated on open.
//!
//! Needs `TEST_DATABASE_URL`; without it `cargo test` reports these tests as ignored.

mod common;
mod pg_common;

use std::time::{Duration, SystemTime};

use common::{post, Post, PATIENCE, SHOP_A, SHOP_B};
use http::header::{self, HeaderName};
use http::{HeaderValue, StatusCode};
use pg_common::{PgServer, TestDb};
use tower_idempotency::store::postgres::PostgresStore;
use tower_idempotency::store::{continuously_purge_expired, IdempotencyStore};

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn new_key_runs_the_handler_once_and_answers_201_with_location() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let server = PgServer::spawn(&db).await;

    let reply = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    let id = reply.order_id();
    assert_eq!(reply.header("location"), Some(&*format!("/orders/{id}")));
    assert_eq!(reply.header("content-type"), Some("application/json"));
    assert!(!reply.replayed());
    assert_eq!(server.app.handler_calls(), 1);
    assert_eq!(
        db.orders().await,
        vec![(id, "shop-a".to_owned(), "book".to_owned(), 1)]
    );
    assert!(db.record_exists("shop-a", "create_order", "key-1").await);
    assert_eq!(db.record_count().await, 1);
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn same_key_and_payload_replays_without_running_the_handler() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let server = PgServer::spawn(&db).await;
    let first = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");

    for _ in 0..2 {
        let again = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
        assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
        assert_eq!(again.body, first.body);
        assert_eq!(again.header("location"), first.header("location"));
        assert_eq!(again.header("content-type"), Some("application/json"));
        assert!(again.replayed());
        again.assert_content_length_matches();
    }
    assert_eq!(server.app.handler_calls(), 1, "the handler ran only once");
    assert_eq!(db.order_count().await, 1);
    assert_eq!(db.record_count().await, 1);
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn same_key_with_another_payload_is_409_and_the_original_stays() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let server = PgServer::spawn(&db).await;
    let first = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let before = db.orders().await;

    let other = r#"{"sku":"pen","quantity":2}"#;
    let conflict = post(server.addr, Some(SHOP_A), Some("key-1"), other, &[]).await;

    assert_eq!(conflict.status, StatusCode::CONFLICT, "{conflict:?}");
    assert_eq!(conflict.error_code(), "key_reused_with_different_payload");
    assert_eq!(server.app.handler_calls(), 1, "the handler did not run");
    assert_eq!(db.orders().await, before, "the original order stays");
    let replay = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(db.record_count().await, 1);
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn another_tenant_or_operation_with_the_same_key_is_independent() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let server = PgServer::spawn(&db).await;

    let a = post(server.addr, Some(SHOP_A), Some("shared-key"), BOOK, &[]).await;
    let b = post(server.addr, Some(SHOP_B), Some("shared-key"), BOOK, &[]).await;
    let express = Post::order("shared-key", BOOK)
        .path("/express-orders")
        .send(server.addr)
        .await;

    for reply in [&a, &b, &express] {
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        assert!(!reply.replayed(), "{reply:?}");
    }
    let ids = [a.order_id(), b.order_id(), express.order_id()];
    assert!(ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2]);
    let tenants: Vec<String> = db.orders().await.into_iter().map(|o| o.1).collect();
    assert_eq!(tenants, ["shop-a", "shop-b", "shop-a"]);
    assert!(
        db.record_exists("shop-b", "create_order", "shared-key")
            .await
    );
    assert!(
        db.record_exists("shop-a", "create_express_order", "shared-key")
            .await
    );

    let b_again = post(server.addr, Some(SHOP_B), Some("shared-key"), BOOK, &[]).await;
    assert!(b_again.replayed());
    assert_eq!(b_again.body, b.body);
    assert_eq!(db.order_count().await, 3);
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn refused_requests_store_nothing() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let server = PgServer::spawn(&db).await;

    let no_key = post(server.addr, Some(SHOP_A), None, BOOK, &[]).await;
    let no_tenant = post(server.addr, None, Some("key-1"), BOOK, &[]).await;
    let bad_json = post(server.addr, Some(SHOP_A), Some("key-1"), "{", &[]).await;
    let invalid = post(
        server.addr,
        Some(SHOP_A),
        Some("key-1"),
        r#"{"sku":"book","quantity":0}"#,
        &[],
    )
    .await;

    assert_eq!(no_key.status, StatusCode::BAD_REQUEST, "{no_key:?}");
    assert_eq!(no_tenant.status, StatusCode::UNAUTHORIZED, "{no_tenant:?}");
    assert_eq!(bad_json.status, StatusCode::BAD_REQUEST, "{bad_json:?}");
    assert_eq!(invalid.status, StatusCode::BAD_REQUEST, "{invalid:?}");
    assert_eq!(invalid.error_code(), "invalid_quantity");
    assert_eq!(
        server.app.handler_calls(),
        1,
        "only the invalid quantity reached the handler"
    );
    assert_eq!(db.order_count().await, 0);
    assert!(!db.record_exists("shop-a", "create_order", "key-1").await);

    // The validation error was not saved: the corrected payload runs under the same key.
    let corrected = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(corrected.status, StatusCode::CREATED, "{corrected:?}");
    assert!(!corrected.replayed());
    assert_eq!(db.order_count().await, 1);
}

/// Waits until `SystemTime::now()` is past `instant` (records expire on the wall clock).
async fn wait_until_past(instant: SystemTime) {
    while SystemTime::now() <= instant {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn expired_record_counts_as_absent_and_is_taken_over() {
    const RETENTION: Duration = Duration::from_millis(100);
    let Some(db) = TestDb::create().await else {
        return;
    };
    let server = PgServer::builder()
        .layer(|layer| layer.with_retention(RETENTION))
        .spawn(&db)
        .await;

    let first = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    let saved_by = SystemTime::now();
    assert_eq!(first.status, StatusCode::CREATED);
    wait_until_past(saved_by + RETENTION + Duration::from_millis(5)).await;

    let fresh = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(fresh.status, StatusCode::CREATED, "{fresh:?}");
    assert!(!fresh.replayed(), "an expired record is not replayed");
    assert_ne!(fresh.order_id(), first.order_id(), "a new order");
    assert_eq!(db.order_count().await, 2);
    assert_eq!(
        db.record_count().await,
        1,
        "the expired record was replaced"
    );

    // Nor is an expired record a conflict: another payload runs afresh too.
    wait_until_past(SystemTime::now() + RETENTION + Duration::from_millis(5)).await;
    let other = post(
        server.addr,
        Some(SHOP_A),
        Some("key-1"),
        r#"{"sku":"pen","quantity":2}"#,
        &[],
    )
    .await;
    assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
    assert!(!other.replayed());
    assert_eq!(db.order_count().await, 3);
    assert_eq!(db.record_count().await, 1);
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn purge_expired_deletes_in_batches_and_returns_counts() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let server = PgServer::spawn(&db).await; // default retention: 24 h
    for k in 0..5 {
        let key = format!("key-{k}");
        let reply = post(server.addr, Some(SHOP_A), Some(&key), BOOK, &[]).await;
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    let store = &server.store;
    assert_eq!(
        store
            .purge_expired(SystemTime::now(), 2)
            .await
            .expect("purge"),
        0
    );
    assert_eq!(db.record_count().await, 5);

    let later = SystemTime::now() + Duration::from_secs(48 * 3600);
    let mut deleted = Vec::new();
    for _ in 0..4 {
        deleted.push(store.purge_expired(later, 2).await.expect("purge"));
    }

    assert_eq!(deleted, vec![2, 2, 1, 0]);
    assert_eq!(db.record_count().await, 0);
    assert_eq!(
        db.order_count().await,
        5,
        "purging never touches the orders"
    );
    let again = post(server.addr, Some(SHOP_A), Some("key-0"), BOOK, &[]).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(!again.replayed(), "the key is free again");
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn continuous_purge_removes_expired_records_only() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let server = PgServer::builder()
        .layer_per_operation(|layer, operation| match operation {
            "create_order" => layer.with_retention(Duration::from_millis(1)),
            _ => layer.with_retention(Duration::from_secs(3600)),
        })
        .spawn(&db)
        .await;
    for k in 0..3 {
        let key = format!("key-{k}");
        let reply = post(server.addr, Some(SHOP_A), Some(&key), BOOK, &[]).await;
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    let live = Post::order("live-key", BOOK)
        .path("/express-orders")
        .send(server.addr)
        .await;
    assert_eq!(live.status, StatusCode::CREATED);

    let purge = tokio::spawn(continuously_purge_expired(
        server.store.clone(),
        Duration::from_millis(20),
        2,
    ));
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while db.record_count().await > 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "expired records still there"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    purge.abort();

    assert!(
        db.record_exists("shop-a", "create_express_order", "live-key")
            .await
    );
    assert_eq!(db.order_count().await, 4);
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn saved_response_survives_a_restart_of_the_app() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let server = PgServer::spawn(&db).await;
    let first = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    server.shutdown().await;

    let server = PgServer::spawn(&db).await;
    let replay = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("location"), first.header("location"));
    assert_eq!(server.app.handler_calls(), 0);
    assert_eq!(db.order_count().await, 1);
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn instances_starting_together_create_the_schema_once() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let opens: Vec<_> = (0..4)
        .map(|_| {
            let config = db.config();
            tokio::spawn(async move { PostgresStore::builder(config).connect().await })
        })
        .collect();
    for open in opens {
        open.await.expect("task").expect("every instance opens");
    }
    let tables = db
        .client()
        .await
        .query_one(
            "SELECT count(*) FROM information_schema.tables \
             WHERE table_schema = current_schema() AND table_name = 'idempotency_records'",
            &[],
        )
        .await
        .expect("tables")
        .get::<_, i64>(0);
    assert_eq!(tables, 1);
}

/// A table made with the SQLite layout (no `state`, response columns `NOT NULL`) is migrated
/// on open, and its records keep replaying.
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn table_with_the_sqlite_layout_is_migrated_on_open() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    db.execute(
        "CREATE TABLE idempotency_records (
            tenant TEXT NOT NULL, operation TEXT NOT NULL, idempotency_key TEXT NOT NULL,
            fingerprint BYTEA NOT NULL, fingerprint_version INTEGER NOT NULL,
            status INTEGER NOT NULL, headers TEXT NOT NULL, body BYTEA NOT NULL, trailers TEXT,
            created_at BIGINT NOT NULL, expires_at BIGINT NOT NULL,
            PRIMARY KEY (tenant, operation, idempotency_key))",
    )
    .await;
    let server = PgServer::spawn(&db).await;
    let first = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    server.shutdown().await;

    // Opening again finds the column and leaves the table alone.
    let server = PgServer::spawn(&db).await;
    let replay = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    let state_columns = db
        .client()
        .await
        .query_one(
            "SELECT count(*) FROM information_schema.columns WHERE table_schema = \
             current_schema() AND table_name = 'idempotency_records' AND column_name = 'state'",
            &[],
        )
        .await
        .expect("columns")
        .get::<_, i64>(0);
    assert_eq!(state_columns, 1);
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn records_saved_before_the_query_counted_still_compare_as_they_did() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let server = PgServer::spawn(&db).await;
    // Saved by canonicalization version 1 for `POST /orders?source=app`: the path only.
    let fingerprint =
        common::version_1_fingerprint("json", "POST", "/orders", br#"{"quantity":1,"sku":"book"}"#);
    let scope = ("shop-a", "create_order", "old-key");
    common::save_record(
        &server.store,
        scope,
        fingerprint,
        "/orders/41",
        r#"{"order_id":41}"#,
    )
    .await;

    for path in ["/orders?source=app", "/orders", "/orders?source=web"] {
        let reply = Post::order("old-key", BOOK)
            .path(path)
            .send(server.addr)
            .await;
        assert_eq!(reply.status, StatusCode::CREATED, "{path}: {reply:?}");
        assert!(reply.replayed(), "{path}");
        assert_eq!(reply.body, r#"{"order_id":41}"#);
    }
    let other = Post::order("old-key", r#"{"sku":"pen","quantity":1}"#)
        .path("/orders?source=app")
        .send(server.addr)
        .await;
    assert_eq!(other.status, StatusCode::CONFLICT, "{other:?}");

    // A record saved now keeps its query.
    let order = Post::order("new-key", BOOK)
        .path("/orders?source=app")
        .send(server.addr)
        .await;
    assert_eq!(order.status, StatusCode::CREATED, "{order:?}");
    let dry_run = Post::order("new-key", BOOK)
        .path("/orders?source=app&dry_run=true")
        .send(server.addr)
        .await;
    assert_eq!(dry_run.status, StatusCode::CONFLICT, "{dry_run:?}");
    let retry = Post::order("new-key", BOOK)
        .path("/orders?source=app")
        .send(server.addr)
        .await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(server.app.handler_calls(), 1);
    assert_eq!(db.order_count().await, 1);
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn header_values_that_are_not_visible_ascii_are_replayed_byte_for_byte() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    // A `Location` in raw UTF-8 (obs-text on the wire), and Latin-1 bytes (not UTF-8).
    let location = "/commandes/été/🦀".as_bytes();
    let latin1_value: &[u8] = b"caf\xe9 cr\xe8me";
    let latin1 = HeaderName::from_static("x-latin1");
    let server = PgServer::builder()
        .response_header(
            header::LOCATION,
            HeaderValue::from_bytes(location).expect("obs-text"),
        )
        .response_header(
            latin1.clone(),
            HeaderValue::from_bytes(latin1_value).expect("obs-text"),
        )
        .layer(move |layer| layer.with_replayed_header(latin1.clone()))
        .spawn(&db)
        .await;
    let bytes = |reply: &common::Reply, name: &str| {
        reply
            .headers
            .get(name)
            .map(|value| value.as_bytes().to_vec())
    };

    let first = Post::order("key-1", BOOK).send(server.addr).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(bytes(&first, "location").as_deref(), Some(location));

    for _ in 0..2 {
        let replay = Post::order("key-1", BOOK).send(server.addr).await;
        assert!(replay.replayed(), "{replay:?}");
        assert_eq!(bytes(&replay, "location").as_deref(), Some(location));
        assert_eq!(bytes(&replay, "x-latin1").as_deref(), Some(latin1_value));
        assert_eq!(replay.body, first.body);
        replay.assert_content_length_matches();
    }
    assert_eq!(server.app.handler_calls(), 1);
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn durations_past_their_maximum_cannot_panic_a_request() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let server = PgServer::builder()
        .layer(|layer| {
            layer
                .with_retention(Duration::MAX)
                .with_body_timeout(Duration::MAX - Duration::from_nanos(1))
                .with_lock_timeout(Duration::MAX)
        })
        .spawn(&db)
        .await;

    let first = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let replay = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(server.app.handler_calls(), 1);

    // Kept for the longest retention, 100 years: there in 99, gone in 101.
    let scope = common::scope("shop-a", "create_order", "key-1");
    let year = Duration::from_secs(365 * 24 * 3600);
    let now = SystemTime::now();
    let lookup = |at| server.store.lookup(&scope, at);
    assert!(lookup(now + 99 * year).await.expect("lookup").is_some());
    assert!(lookup(now + 101 * year).await.expect("lookup").is_none());
}
