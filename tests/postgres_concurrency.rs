//! Concurrency on the PostgreSQL store: duplicates serialize on their key alone (within one
//! app instance or across two), different keys run in parallel, waits are bounded (`503` with
//! `Retry-After`), replays never wait for writers, and serialization failures are `503`s
//! that a retry gets past.
//!
//! Needs `TEST_DATABASE_URL`; without it `cargo test` reports these tests as ignored.

mod common;
mod pg_common;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{post, Reply, PATIENCE, SHOP_A};
use http::StatusCode;
use pg_common::{hook, HookOutcome, PgServer, TestDb};
use tokio::sync::{Barrier, Notify};
use tower_idempotency::store::postgres::Isolation;

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

/// Sends every `(server, key, body)` at once (released together by a barrier), each on its
/// own connection; the replies come back in the same order.
async fn send_all_at_once(requests: Vec<(SocketAddr, String, String)>) -> Vec<Reply> {
    let barrier = Arc::new(Barrier::new(requests.len()));
    let tasks: Vec<_> = requests
        .into_iter()
        .map(|(addr, key, body)| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                post(addr, Some(SHOP_A), Some(&key), &body, &[]).await
            })
        })
        .collect();
    let mut replies = Vec::with_capacity(tasks.len());
    for task in tasks {
        replies.push(task.await.expect("request task"));
    }
    replies
}

/// Checks that every key got the same 201 from all its requests, exactly one of them
/// original, and returns the order id of each key.
fn one_order_per_key<'a>(
    requests: impl IntoIterator<Item = &'a String>,
    replies: &[Reply],
) -> HashMap<String, i64> {
    let mut by_key: HashMap<&str, Vec<&Reply>> = HashMap::new();
    for (key, reply) in requests.into_iter().zip(replies) {
        assert_eq!(reply.status, StatusCode::CREATED, "{key}: {reply:?}");
        by_key.entry(key).or_default().push(reply);
    }
    by_key
        .into_iter()
        .map(|(key, replies)| {
            let first = replies[0];
            for reply in &replies {
                assert_eq!(reply.body, first.body, "{key}: identical bodies");
                assert_eq!(reply.header("location"), first.header("location"));
            }
            let originals = replies.iter().filter(|r| !r.replayed()).count();
            assert_eq!(originals, 1, "{key}: one original, the rest replayed");
            (key.to_owned(), first.order_id())
        })
        .collect()
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_run_the_handler_once() {
    const DUPLICATES: usize = 32;
    let Some(db) = TestDb::create().await else {
        return;
    };
    // The first handler holds its transaction until every duplicate has reached the server.
    let gate = Arc::new(Notify::new());
    let server = PgServer::builder()
        .layer(|layer| layer.with_lock_timeout(Duration::from_secs(30)))
        .hook({
            let gate = gate.clone();
            hook(move |_| {
                let gate = gate.clone();
                async move {
                    gate.notified().await;
                    HookOutcome::default()
                }
            })
        })
        .spawn(&db)
        .await;
    let all_arrived = Arc::new(AtomicBool::new(false));
    let opener = {
        let (app, gate, all_arrived) = (server.app.clone(), gate.clone(), all_arrived.clone());
        tokio::spawn(async move {
            all_arrived.store(
                app.wait_for_arrivals(DUPLICATES, PATIENCE).await,
                Ordering::SeqCst,
            );
            gate.notify_one();
        })
    };

    let requests = vec![(server.addr, "dup-key".to_owned(), BOOK.to_owned()); DUPLICATES];
    let replies = send_all_at_once(requests.clone()).await;
    opener.await.expect("opener");

    assert!(
        all_arrived.load(Ordering::SeqCst),
        "all were in flight together"
    );
    let keys: Vec<String> = requests.into_iter().map(|r| r.1).collect();
    one_order_per_key(&keys, &replies);
    assert_eq!(server.app.handler_calls(), 1, "exactly one ran the handler");
    assert_eq!(db.order_count().await, 1);
    assert_eq!(db.record_count().await, 1);
}

/// A small deterministic shuffle (xorshift), so failures are reproducible.
fn shuffle<T>(items: &mut [T], mut seed: u64) {
    for i in (1..items.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let j = (seed % (i as u64 + 1)) as usize;
        items.swap(i, j);
    }
}

/// Keys × duplicates, shuffled, spread over the given servers.
fn interleaved(
    servers: &[SocketAddr],
    keys: usize,
    duplicates: usize,
) -> Vec<(SocketAddr, String, String)> {
    let mut requests = Vec::new();
    for k in 0..keys {
        for d in 0..duplicates {
            let body = format!(r#"{{"sku":"sku-{k}","quantity":{}}}"#, k % 100 + 1);
            requests.push((servers[(k + d) % servers.len()], format!("key-{k}"), body));
        }
    }
    shuffle(&mut requests, 0x9E37_79B9_7F4A_7C15);
    requests
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_keys_with_many_duplicates_interleaved() {
    const KEYS: usize = 20;
    const DUPLICATES: usize = 8;
    let Some(db) = TestDb::create().await else {
        return;
    };
    let server = PgServer::builder()
        .layer(|layer| layer.with_lock_timeout(Duration::from_secs(30)))
        .hook(hook(|_| async {
            tokio::time::sleep(Duration::from_millis(3)).await;
            HookOutcome::default()
        }))
        .spawn(&db)
        .await;
    let requests = interleaved(&[server.addr], KEYS, DUPLICATES);

    let replies = send_all_at_once(requests.clone()).await;

    let ids = one_order_per_key(requests.iter().map(|r| &r.1), &replies);
    assert_eq!(ids.values().collect::<HashSet<_>>().len(), KEYS);
    assert_eq!(db.order_count().await, KEYS as i64);
    assert_eq!(db.record_count().await, KEYS as i64);
    assert_eq!(server.app.handler_calls(), KEYS);
}

/// Two app instances (two servers, two stores with their own pools) on one database; every
/// key is sent to both at once, several times: still one order per key.
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_app_instances_sharing_the_database_create_one_order_per_key() {
    const KEYS: usize = 12;
    const DUPLICATES: usize = 6;
    let Some(db) = TestDb::create().await else {
        return;
    };
    let slow = || {
        hook(|_| async {
            tokio::time::sleep(Duration::from_millis(5)).await;
            HookOutcome::default()
        })
    };
    let long_wait = |layer: tower_idempotency::IdempotencyLayer<_>| {
        layer.with_lock_timeout(Duration::from_secs(30))
    };
    let a = PgServer::builder()
        .layer(long_wait)
        .hook(slow())
        .spawn(&db)
        .await;
    let b = PgServer::builder()
        .layer(long_wait)
        .hook(slow())
        .spawn(&db)
        .await;
    let requests = interleaved(&[a.addr, b.addr], KEYS, DUPLICATES);

    let replies = send_all_at_once(requests.clone()).await;

    let ids = one_order_per_key(requests.iter().map(|r| &r.1), &replies);
    assert_eq!(ids.values().collect::<HashSet<_>>().len(), KEYS);
    assert_eq!(db.order_count().await, KEYS as i64);
    assert_eq!(db.record_count().await, KEYS as i64);
    assert_eq!(a.app.handler_calls() + b.app.handler_calls(), KEYS);
    assert!(
        a.app.handler_calls() > 0 && b.app.handler_calls() > 0,
        "both instances ran handlers"
    );
}

/// Different keys do not queue behind one writer: both handlers are inside their
/// transactions at the same time.
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn different_keys_run_their_handlers_in_parallel() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let together = Arc::new(Barrier::new(2));
    let server = PgServer::builder()
        .layer(|layer| layer.with_lock_timeout(Duration::from_millis(500)))
        .hook({
            let together = together.clone();
            hook(move |_| {
                let together = together.clone();
                async move {
                    // Passes only when the other handler is inside its transaction too.
                    let met = tokio::time::timeout(PATIENCE, together.wait()).await;
                    HookOutcome {
                        fail_with: met.is_err().then_some(StatusCode::INTERNAL_SERVER_ERROR),
                    }
                }
            })
        })
        .spawn(&db)
        .await;

    let replies = send_all_at_once(vec![
        (server.addr, "key-a".to_owned(), BOOK.to_owned()),
        (server.addr, "key-b".to_owned(), BOOK.to_owned()),
    ])
    .await;

    for reply in &replies {
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    }
    assert_eq!(db.order_count().await, 2);
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn duplicate_waiting_past_the_lock_timeout_is_503_then_replays() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let started = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let server = PgServer::builder()
        .layer(|layer| {
            layer
                .with_lock_timeout(Duration::from_millis(300))
                .with_retry_after(Duration::from_secs(3))
        })
        .hook({
            let (started, release) = (started.clone(), release.clone());
            hook(move |call| {
                let (started, release) = (started.clone(), release.clone());
                async move {
                    if call.key.as_deref() == Some("held") {
                        started.notify_one();
                        release.notified().await;
                    }
                    HookOutcome::default()
                }
            })
        })
        .spawn(&db)
        .await;
    let holder = tokio::spawn({
        let addr = server.addr;
        async move { post(addr, Some(SHOP_A), Some("held"), BOOK, &[]).await }
    });
    tokio::time::timeout(PATIENCE, started.notified())
        .await
        .expect("the holder's handler started");

    let busy = post(server.addr, Some(SHOP_A), Some("held"), BOOK, &[]).await;
    // Only that key waits: another one goes through meanwhile.
    let other = post(server.addr, Some(SHOP_A), Some("other"), BOOK, &[]).await;
    release.notify_one();
    let held = holder.await.expect("holder");

    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE, "{busy:?}");
    assert_eq!(busy.header("retry-after"), Some("3"));
    assert_eq!(busy.error_code(), "busy_retry_later");
    assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
    assert_eq!(held.status, StatusCode::CREATED, "{held:?}");
    let retry = post(server.addr, Some(SHOP_A), Some("held"), BOOK, &[]).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, held.body);
    assert_eq!(
        server.app.handler_calls(),
        2,
        "the busy request never ran the handler"
    );
    assert_eq!(db.order_count().await, 2);
}

/// With one transaction connection, held by a slow handler: a new key waits for the pool past
/// the lock timeout (`503`), while completed keys still replay from the read pool.
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn replays_do_not_wait_for_writers_and_a_full_pool_is_503() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let started = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let server = PgServer::builder()
        .store(|options| options.max_connections(1))
        .layer(|layer| layer.with_lock_timeout(Duration::from_millis(300)))
        .hook({
            let (started, release) = (started.clone(), release.clone());
            hook(move |call| {
                let (started, release) = (started.clone(), release.clone());
                async move {
                    if call.key.as_deref() == Some("holder") {
                        started.notify_one();
                        release.notified().await;
                    }
                    HookOutcome::default()
                }
            })
        })
        .spawn(&db)
        .await;
    let done = post(server.addr, Some(SHOP_A), Some("done"), BOOK, &[]).await;
    assert_eq!(done.status, StatusCode::CREATED);
    let holder = tokio::spawn({
        let addr = server.addr;
        async move { post(addr, Some(SHOP_A), Some("holder"), BOOK, &[]).await }
    });
    tokio::time::timeout(PATIENCE, started.notified())
        .await
        .expect("the holder's handler started");

    let replay = post(server.addr, Some(SHOP_A), Some("done"), BOOK, &[]).await;
    let conflict = post(
        server.addr,
        Some(SHOP_A),
        Some("done"),
        r#"{"sku":"pen","quantity":1}"#,
        &[],
    )
    .await;
    let busy = post(server.addr, Some(SHOP_A), Some("new-key"), BOOK, &[]).await;
    release.notify_one();

    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, done.body);
    assert_eq!(conflict.status, StatusCode::CONFLICT, "{conflict:?}");
    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE, "{busy:?}");
    assert!(busy.header("retry-after").is_some());
    assert_eq!(holder.await.expect("holder").status, StatusCode::CREATED);
    assert!(!db.record_exists("shop-a", "create_order", "new-key").await);
    let retry = post(server.addr, Some(SHOP_A), Some("new-key"), BOOK, &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
}

/// SERIALIZABLE: two handlers that both read the whole `orders` table and insert into it
/// cannot both commit. The loser's serialization failure is a `503` with `Retry-After`,
/// nothing of it is kept, and its retry succeeds.
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serialization_failure_is_503_and_the_retry_succeeds() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let both_read = Arc::new(Barrier::new(2));
    let first_call = Arc::new(AtomicBool::new(true));
    let server = PgServer::builder()
        .store(|options| options.isolation(Isolation::Serializable))
        .layer(|layer| {
            layer
                .with_lock_timeout(Duration::from_secs(5))
                .with_conflict_retries(0)
        })
        .hook({
            let (both_read, first_call) = (both_read.clone(), first_call.clone());
            hook(move |call| {
                let (both_read, first_call) = (both_read.clone(), first_call.clone());
                async move {
                    // Only the first two calls race; the retry runs alone.
                    if first_call.load(Ordering::SeqCst) {
                        let client = call.tx.client().await.expect("client");
                        client
                            .query_one("SELECT count(*) FROM orders", &[])
                            .await
                            .expect("read orders");
                        drop(client);
                        let _ = tokio::time::timeout(PATIENCE, both_read.wait()).await;
                        first_call.store(false, Ordering::SeqCst);
                    }
                    HookOutcome::default()
                }
            })
        })
        .spawn(&db)
        .await;

    let replies = send_all_at_once(vec![
        (server.addr, "key-a".to_owned(), BOOK.to_owned()),
        (server.addr, "key-b".to_owned(), BOOK.to_owned()),
    ])
    .await;

    let mut statuses: Vec<u16> = replies.iter().map(|r| r.status.as_u16()).collect();
    statuses.sort();
    assert_eq!(statuses, [201, 503], "{replies:?}");
    let (loser, key) = if replies[0].status == StatusCode::SERVICE_UNAVAILABLE {
        (&replies[0], "key-a")
    } else {
        (&replies[1], "key-b")
    };
    assert!(loser.header("retry-after").is_some(), "{loser:?}");
    assert_eq!(
        db.order_count().await,
        1,
        "the loser's order was rolled back"
    );
    assert!(!db.record_exists("shop-a", "create_order", key).await);

    let retry = post(server.addr, Some(SHOP_A), Some(key), BOOK, &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(db.order_count().await, 2);
    assert_eq!(db.record_count().await, 2);
}

/// The same race with the layer's conflict retries: the loser runs again and commits.
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serialization_failure_at_commit_runs_the_request_again() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let both_read = Arc::new(Barrier::new(2));
    let first_call = Arc::new(AtomicBool::new(true));
    let server = PgServer::builder()
        .store(|options| options.isolation(Isolation::Serializable))
        .layer(|layer| layer.with_lock_timeout(Duration::from_secs(5)))
        .hook({
            let (both_read, first_call) = (both_read.clone(), first_call.clone());
            hook(move |call| {
                let (both_read, first_call) = (both_read.clone(), first_call.clone());
                async move {
                    // Only the first two calls race; the retry runs alone.
                    if first_call.load(Ordering::SeqCst) {
                        let client = call.tx.client().await.expect("client");
                        client
                            .query_one("SELECT count(*) FROM orders", &[])
                            .await
                            .expect("read orders");
                        drop(client);
                        let _ = tokio::time::timeout(PATIENCE, both_read.wait()).await;
                        first_call.store(false, Ordering::SeqCst);
                    }
                    HookOutcome::default()
                }
            })
        })
        .spawn(&db)
        .await;

    let replies = send_all_at_once(vec![
        (server.addr, "key-a".to_owned(), BOOK.to_owned()),
        (server.addr, "key-b".to_owned(), BOOK.to_owned()),
    ])
    .await;

    for reply in &replies {
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        assert!(!reply.replayed());
    }
    assert_eq!(
        server.app.handler_calls(),
        3,
        "the loser's handler ran again"
    );
    assert_eq!(db.order_count().await, 2);
    assert_eq!(db.record_count().await, 2);
}

/// SERIALIZABLE transactions and duplicates in flight: reserving a key that a concurrent
/// transaction just committed is a serialization failure under this isolation; the store
/// retries it, and every duplicate still gets the one response.
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serializable_duplicates_are_retried_into_replays() {
    const KEYS: usize = 8;
    const DUPLICATES: usize = 4;
    let Some(db) = TestDb::create().await else {
        return;
    };
    let server = PgServer::builder()
        .store(|options| options.isolation(Isolation::Serializable))
        .layer(|layer| layer.with_lock_timeout(Duration::from_secs(30)))
        .hook(hook(|_| async {
            tokio::time::sleep(Duration::from_millis(5)).await;
            HookOutcome::default()
        }))
        .spawn(&db)
        .await;
    let requests = interleaved(&[server.addr], KEYS, DUPLICATES);

    let replies = send_all_at_once(requests.clone()).await;

    one_order_per_key(requests.iter().map(|r| &r.1), &replies);
    assert_eq!(db.order_count().await, KEYS as i64);
    assert_eq!(server.app.handler_calls(), KEYS);
}
