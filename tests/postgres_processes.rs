//! The example app (`examples/orders.rs --database-url ...`, and `examples/orders_sqlx.rs` on
//! the sqlx store: the `sqlx_` tests) as real processes on one PostgreSQL database: two
//! instances answering duplicates at once, and an instance killed with SIGKILL under load and
//! started again.
//!
//! Needs `TEST_DATABASE_URL` and the example binary that `cargo test` builds; without the
//! variable `cargo test` reports these tests as ignored.

mod common;
mod pg_common;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{post, Reply, SHOP_A};
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use pg_common::{start_order_example, OrderExample, TestDb};
use tokio::sync::Barrier;

/// Two instances of the example share one database; every key goes to both at the same
/// moment, several times: one order per key, and every reply of a key is the same 201.
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_example_instances_create_one_order_per_key() {
    two_instances_create_one_order_per_key(OrderExample::TokioPostgres).await;
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_two_example_instances_create_one_order_per_key() {
    two_instances_create_one_order_per_key(OrderExample::Sqlx).await;
}

async fn two_instances_create_one_order_per_key(example: OrderExample) {
    const KEYS: usize = 10;
    const DUPLICATES: usize = 4;
    let Some(db) = TestDb::create().await else {
        return;
    };
    let a = start_order_example(example, &db).await;
    let b = start_order_example(example, &db).await;
    assert_ne!(a.addr, b.addr);

    let mut requests = Vec::new();
    for k in 0..KEYS {
        for d in 0..DUPLICATES {
            let addr = if d % 2 == 0 { a.addr } else { b.addr };
            requests.push((addr, format!("key-{k}"), k));
        }
    }
    let barrier = Arc::new(Barrier::new(requests.len()));
    let tasks: Vec<_> = requests
        .iter()
        .cloned()
        .map(|(addr, key, k)| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                let body = format!(r#"{{"sku":"sku-{k}","quantity":1}}"#);
                post(addr, Some(SHOP_A), Some(&key), &body, &[]).await
            })
        })
        .collect();
    let mut by_key: HashMap<String, Vec<Reply>> = HashMap::new();
    for ((_, key, _), task) in requests.iter().zip(tasks) {
        by_key
            .entry(key.clone())
            .or_default()
            .push(task.await.expect("request"));
    }

    for (key, replies) in &by_key {
        for reply in replies {
            assert_eq!(reply.status, StatusCode::CREATED, "{key}: {reply:?}");
            assert_eq!(reply.body, replies[0].body, "{key}: the same response");
        }
        let originals = replies.iter().filter(|r| !r.replayed()).count();
        assert_eq!(originals, 1, "{key}: one original, the rest replayed");
    }
    assert_eq!(db.order_count().await, KEYS as i64);
    assert_eq!(db.record_count().await, KEYS as i64);
    a.kill().await;
    b.kill().await;
}

/// What a client saw for one key before the crash.
#[derive(Debug, Default)]
struct Seen {
    /// The body of the 201, if one arrived.
    created: Option<Bytes>,
}

/// Sends `POST /orders` and tolerates a dead server: `None` when no complete answer came.
async fn try_post(
    client: &Client<HttpConnector, Full<Bytes>>,
    addr: SocketAddr,
    key: &str,
    body: &str,
) -> Option<(StatusCode, bool, Bytes)> {
    let request = http::Request::post(format!("http://{addr}/orders"))
        .header("authorization", format!("Bearer {}", common::SHOP_A))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
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

/// SIGKILL under load, then a restart on the same database. Afterwards: every key that got a
/// 201 replays exactly that 201; every key the clients tried ends with one order (a
/// transaction cut by the kill either committed whole or left nothing); every order has
/// exactly one record, and every record points at an existing order.
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_killed_under_load_keeps_one_order_per_key() {
    killed_under_load_keeps_one_order_per_key(OrderExample::TokioPostgres).await;
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_example_killed_under_load_keeps_one_order_per_key() {
    killed_under_load_keeps_one_order_per_key(OrderExample::Sqlx).await;
}

async fn killed_under_load_keeps_one_order_per_key(example: OrderExample) {
    const WORKERS: usize = 8;
    const KEYS_PER_WORKER: usize = 400;
    let Some(db) = TestDb::create().await else {
        return;
    };
    let server = start_order_example(example, &db).await;
    let addr = server.addr;
    let body_of = |key: &str| format!(r#"{{"sku":"{key}","quantity":1}}"#);

    // Each worker sends new keys, one after the other, until the server dies under it.
    let answered = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let answered = answered.clone();
            tokio::spawn(async move {
                let client: Client<HttpConnector, Full<Bytes>> =
                    Client::builder(TokioExecutor::new()).build_http();
                let mut seen: BTreeMap<String, Seen> = BTreeMap::new();
                for i in 0..KEYS_PER_WORKER {
                    let key = format!("crash-{w}-{i}");
                    let body = format!(r#"{{"sku":"{key}","quantity":1}}"#);
                    let entry = seen.entry(key.clone()).or_default();
                    match try_post(&client, addr, &key, &body).await {
                        Some((StatusCode::CREATED, _, body)) => {
                            entry.created = Some(body);
                            answered.fetch_add(1, Ordering::SeqCst);
                        }
                        Some((status, _, body)) => panic!("{key}: {status} {body:?}"),
                        None => break, // the server is gone
                    }
                }
                seen
            })
        })
        .collect();
    // Let the load build up, then kill in the middle of it.
    let deadline = tokio::time::Instant::now() + common::PATIENCE;
    while answered.load(Ordering::SeqCst) < 50 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    server.kill().await;
    let mut seen: BTreeMap<String, Seen> = BTreeMap::new();
    for worker in workers {
        seen.extend(worker.await.expect("worker"));
    }
    let created_before = seen.values().filter(|s| s.created.is_some()).count();
    assert!(created_before > 0, "the load ran before the kill");
    assert!(
        created_before < seen.len(),
        "the kill landed with requests in flight ({created_before} of {} answered)",
        seen.len()
    );

    let server = start_order_example(example, &db).await;
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let mut final_ids: HashMap<String, i64> = HashMap::new();
    for (key, before) in &seen {
        let (status, replayed, body) = try_post(&client, server.addr, key, &body_of(key))
            .await
            .unwrap_or_else(|| panic!("{key}: no answer after the restart"));
        assert_eq!(status, StatusCode::CREATED, "{key}: {body:?}");
        if let Some(created) = &before.created {
            assert!(replayed, "{key}: a key that got its 201 replays it");
            assert_eq!(&body, created, "{key}: the same body as before the crash");
        }
        let id = serde_json::from_slice::<serde_json::Value>(&body).expect("JSON")["order_id"]
            .as_i64()
            .expect("order_id");
        final_ids.insert(key.clone(), id);
    }
    server.kill().await;

    let orders = db.orders().await;
    assert_eq!(orders.len(), seen.len(), "one order per distinct key");
    let order_ids: BTreeSet<i64> = orders.iter().map(|o| o.0).collect();
    let records = db.recorded_order_ids().await;
    let recorded: BTreeSet<i64> = records.iter().map(|r| r.1).collect();
    assert_eq!(records.len(), orders.len(), "one record per order");
    assert_eq!(
        recorded, order_ids,
        "every record points at an order and back"
    );
    let by_sku: HashMap<&str, i64> = orders.iter().map(|o| (o.2.as_str(), o.0)).collect();
    let distinct: HashSet<i64> = final_ids.values().copied().collect();
    assert_eq!(
        distinct.len(),
        final_ids.len(),
        "no two keys share an order"
    );
    for (key, id) in &final_ids {
        assert_eq!(by_sku.get(key.as_str()), Some(id), "{key}: its own order");
    }
}
