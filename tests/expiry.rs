//! Retention, purging and durability: records expire, are purged in batches, and survive a
//! restart of the server on the same database file.

mod common;

use std::time::{Duration, SystemTime};

use common::{post, record_exists, TestServer, PATIENCE, SHOP_A};
use http::StatusCode;
use tower_idempotency::store::{continuously_purge_expired, IdempotencyStore};

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

/// Waits until `SystemTime::now()` is past `instant` (records expire on the wall clock).
async fn wait_until_past(instant: SystemTime) {
    while SystemTime::now() <= instant {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn expired_record_counts_as_absent_and_the_key_runs_afresh() {
    const RETENTION: Duration = Duration::from_millis(100);
    let server = TestServer::builder()
        .layer(|layer| layer.with_retention(RETENTION))
        .spawn()
        .await;

    let first = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    let saved_by = SystemTime::now();
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    // Within the retention (unless this machine stalled for 100 ms): a replay.
    if SystemTime::now() < saved_by + RETENTION - Duration::from_millis(20) {
        assert!(replay.replayed(), "{replay:?}");
    }

    wait_until_past(saved_by + RETENTION + Duration::from_millis(5)).await;
    let fresh = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(fresh.status, StatusCode::CREATED, "{fresh:?}");
    assert!(!fresh.replayed(), "an expired record is not replayed");
    assert_ne!(fresh.order_id(), first.order_id(), "a new order");
    assert_eq!(server.order_count().await, 2);
    assert_eq!(
        server.record_count().await,
        1,
        "the expired record was replaced"
    );

    // Expired records are not a conflict either: another payload runs afresh too.
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
    assert_eq!(server.order_count().await, 3);
}

#[tokio::test]
async fn purge_expired_deletes_in_batches_and_returns_counts() {
    let server = TestServer::spawn().await; // default retention: 24 h
    for k in 0..5 {
        let key = format!("key-{k}");
        let reply = post(server.addr, Some(SHOP_A), Some(&key), BOOK, &[]).await;
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    let store = &server.store;

    // Nothing has expired yet.
    assert_eq!(
        store
            .purge_expired(SystemTime::now(), 2)
            .await
            .expect("purge"),
        0
    );
    assert_eq!(server.record_count().await, 5);

    // Two days later, everything has.
    let later = SystemTime::now() + Duration::from_secs(48 * 3600);
    let mut deleted = Vec::new();
    for _ in 0..4 {
        deleted.push(store.purge_expired(later, 2).await.expect("purge"));
        let left = 5 - deleted.iter().sum::<u64>() as i64;
        assert_eq!(
            server.record_count().await,
            left,
            "after batches {deleted:?}"
        );
    }
    assert_eq!(deleted, vec![2, 2, 1, 0]);
    assert_eq!(
        server.order_count().await,
        5,
        "purging never touches the orders"
    );

    // The key is free again.
    let again = post(server.addr, Some(SHOP_A), Some("key-0"), BOOK, &[]).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(!again.replayed());
    assert_eq!(server.order_count().await, 6);
}

#[tokio::test]
async fn continuous_purge_removes_expired_records_only() {
    let server = TestServer::builder()
        .layer_per_operation(|layer, operation| match operation {
            "create_order" => layer.with_retention(Duration::from_millis(1)),
            _ => layer.with_retention(Duration::from_secs(3600)),
        })
        .spawn()
        .await;
    for k in 0..5 {
        let key = format!("key-{k}");
        let reply = post(server.addr, Some(SHOP_A), Some(&key), BOOK, &[]).await;
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    let live = common::Post::order("live-key", BOOK)
        .path("/express-orders")
        .send(server.addr)
        .await;
    assert_eq!(live.status, StatusCode::CREATED);
    assert_eq!(server.record_count().await, 6);

    let purge = tokio::spawn(continuously_purge_expired(
        server.store.clone(),
        Duration::from_millis(20),
        2,
    ));
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while server.record_count().await > 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "expired records still there"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    purge.abort();

    assert_eq!(server.record_count().await, 1);
    assert!(
        record_exists(&server.store, "shop-a", "create_express_order", "live-key").await,
        "the unexpired record stays"
    );
    assert_eq!(server.order_count().await, 6);
}

#[tokio::test]
async fn saved_response_survives_a_restart() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("orders.db");

    let server = TestServer::builder().db_path(&db).spawn().await;
    let first = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    server.shutdown().await;

    let server = TestServer::builder().db_path(&db).spawn().await;
    let replay = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(replay.status, StatusCode::CREATED, "{replay:?}");
    assert!(replay.replayed(), "the record was durable");
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("location"), first.header("location"));
    assert_eq!(
        server.app.handler_calls(),
        0,
        "the new server never ran the handler"
    );
    assert_eq!(server.order_count().await, 1);
}
