//! Duplicates in flight at the same time, and a store busy past the lock timeout.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{hook, post, record_exists, HookOutcome, Reply, TestServer, PATIENCE, SHOP_A};
use http::StatusCode;
use tokio::sync::{Barrier, Notify};

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

/// Sends every `(key, body)` at once (released together by a barrier), each on its own
/// connection; the replies come back in the same order.
async fn send_all_at_once(server: &TestServer, requests: Vec<(String, String)>) -> Vec<Reply> {
    let barrier = Arc::new(Barrier::new(requests.len()));
    let tasks: Vec<_> = requests
        .into_iter()
        .map(|(key, body)| {
            let barrier = barrier.clone();
            let addr = server.addr;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_run_the_handler_once() {
    const DUPLICATES: usize = 32;
    let arrivals_complete = Arc::new(AtomicBool::new(false));
    // The first handler holds its transaction until every duplicate has reached the server,
    // so that they are all in flight together.
    let gate = Arc::new(Notify::new());
    let server = TestServer::builder()
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
        .spawn()
        .await;
    let opener = {
        let app = server.app.clone();
        let gate = gate.clone();
        let arrivals_complete = arrivals_complete.clone();
        tokio::spawn(async move {
            let all = app.wait_for_arrivals(DUPLICATES, PATIENCE).await;
            arrivals_complete.store(all, Ordering::SeqCst);
            // Only one handler may ever be waiting; a permit is kept if it is not there yet.
            gate.notify_one();
        })
    };

    let requests = vec![("dup-key".to_owned(), BOOK.to_owned()); DUPLICATES];
    let replies = send_all_at_once(&server, requests).await;
    opener.await.expect("opener");

    assert!(
        arrivals_complete.load(Ordering::SeqCst),
        "all duplicates were in flight while the first held its transaction"
    );
    assert_eq!(server.app.handler_calls(), 1, "exactly one ran the handler");
    assert_eq!(server.order_count().await, 1, "exactly one order");
    assert_eq!(server.record_count().await, 1);
    let first = &replies[0];
    for reply in &replies {
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        assert_eq!(reply.body, first.body, "identical bodies");
        assert_eq!(reply.header("location"), first.header("location"));
    }
    let originals = replies.iter().filter(|r| !r.replayed()).count();
    assert_eq!(originals, 1, "one original response, the others replayed");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_keys_with_many_duplicates_interleaved() {
    const KEYS: usize = 20;
    const DUPLICATES: usize = 8;
    let server = TestServer::builder()
        .layer(|layer| layer.with_lock_timeout(Duration::from_secs(30)))
        // Hold each transaction a little, so that duplicates pile up behind it.
        .hook(hook(|_| async {
            tokio::time::sleep(Duration::from_millis(3)).await;
            HookOutcome::default()
        }))
        .spawn()
        .await;
    let mut requests = Vec::new();
    for k in 0..KEYS {
        for _ in 0..DUPLICATES {
            let body = format!(r#"{{"sku":"sku-{k}","quantity":{}}}"#, k % 100 + 1);
            requests.push((format!("key-{k}"), body));
        }
    }
    shuffle(&mut requests, 0x9E37_79B9_7F4A_7C15);

    let replies = send_all_at_once(&server, requests.clone()).await;

    let mut by_key: HashMap<&str, Vec<&Reply>> = HashMap::new();
    for ((key, _), reply) in requests.iter().zip(&replies) {
        assert_eq!(reply.status, StatusCode::CREATED, "{key}: {reply:?}");
        by_key.entry(key).or_default().push(reply);
    }
    let mut order_ids = HashSet::new();
    for (key, replies) in &by_key {
        assert_eq!(replies.len(), DUPLICATES);
        let first = replies[0];
        for reply in replies {
            assert_eq!(reply.body, first.body, "{key}: identical bodies");
            assert_eq!(reply.header("location"), first.header("location"));
        }
        let originals = replies.iter().filter(|r| !r.replayed()).count();
        assert_eq!(originals, 1, "{key}: one original, the rest replayed");
        order_ids.insert(first.order_id());
    }
    assert_eq!(order_ids.len(), KEYS, "one distinct order per key");
    assert_eq!(server.order_count().await, KEYS as i64);
    assert_eq!(server.record_count().await, KEYS as i64);
    assert_eq!(server.app.handler_calls(), KEYS);
}

#[tokio::test]
async fn store_busy_past_the_lock_timeout_is_503_with_retry_after() {
    let started = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let server = TestServer::builder()
        .layer(|layer| {
            layer
                .with_lock_timeout(Duration::from_millis(200))
                .with_retry_after(Duration::from_secs(3))
        })
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
        .spawn()
        .await;

    let holder = tokio::spawn({
        let addr = server.addr;
        async move { post(addr, Some(SHOP_A), Some("holder"), BOOK, &[]).await }
    });
    tokio::time::timeout(PATIENCE, started.notified())
        .await
        .expect("the holder's handler started");

    let busy = post(server.addr, Some(SHOP_A), Some("other"), BOOK, &[]).await;

    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE, "{busy:?}");
    assert_eq!(busy.header("retry-after"), Some("3"));
    assert_eq!(busy.error_code(), "busy_retry_later");
    assert_eq!(
        server.app.handler_calls(),
        1,
        "the busy request's handler never ran"
    );
    assert!(!record_exists(&server.store, "shop-a", "create_order", "other").await);

    release.notify_one();
    let held = holder.await.expect("holder task");
    assert_eq!(held.status, StatusCode::CREATED, "{held:?}");

    let retry = post(server.addr, Some(SHOP_A), Some("other"), BOOK, &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(server.order_count().await, 2);
    assert_eq!(server.record_count().await, 2);
}

#[tokio::test]
async fn replay_does_not_wait_for_a_writer_in_flight() {
    let started = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let server = TestServer::builder()
        .layer(|layer| layer.with_lock_timeout(Duration::from_millis(200)))
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
        .spawn()
        .await;
    let first = post(server.addr, Some(SHOP_A), Some("done"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let holder = tokio::spawn({
        let addr = server.addr;
        async move { post(addr, Some(SHOP_A), Some("holder"), BOOK, &[]).await }
    });
    tokio::time::timeout(PATIENCE, started.notified())
        .await
        .expect("the holder's handler started");

    // The write lock is held past the lock timeout; a completed key still replays, and a
    // reused key still gets its 409, from the read-only fast path.
    let replay = post(server.addr, Some(SHOP_A), Some("done"), BOOK, &[]).await;
    let conflict = post(
        server.addr,
        Some(SHOP_A),
        Some("done"),
        r#"{"sku":"pen","quantity":1}"#,
        &[],
    )
    .await;
    release.notify_one();

    assert_eq!(replay.status, StatusCode::CREATED, "{replay:?}");
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(conflict.status, StatusCode::CONFLICT, "{conflict:?}");
    assert_eq!(holder.await.expect("holder").status, StatusCode::CREATED);
}

#[tokio::test]
async fn another_process_holding_the_write_lock_is_503_then_retry_succeeds() {
    let server = TestServer::builder()
        .layer(|layer| layer.with_lock_timeout(Duration::from_millis(300)))
        .spawn()
        .await;
    let first = post(server.addr, Some(SHOP_A), Some("done"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);

    // Another process: its own connection to the same file, holding SQLite's write lock.
    let path = server.db_path.clone();
    let (locked_tx, locked_rx) = tokio::sync::oneshot::channel::<()>();
    let (unlock_tx, unlock_rx) = std::sync::mpsc::channel::<()>();
    let other_process = std::thread::spawn(move || {
        let conn = rusqlite::Connection::open(path).expect("open");
        conn.execute_batch(
            "BEGIN IMMEDIATE; INSERT INTO orders (tenant_id, sku, quantity) \
             VALUES ('shop-b', 'other-process', 1);",
        )
        .expect("take the write lock");
        let _ = locked_tx.send(());
        let _ = unlock_rx.recv_timeout(PATIENCE);
        conn.execute_batch("COMMIT").expect("commit");
    });
    locked_rx.await.expect("the other process holds the lock");

    let busy = post(server.addr, Some(SHOP_A), Some("new-key"), BOOK, &[]).await;
    let replay = post(server.addr, Some(SHOP_A), Some("done"), BOOK, &[]).await;
    let _ = unlock_tx.send(());
    other_process.join().expect("other process");

    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE, "{busy:?}");
    assert!(busy.header("retry-after").is_some(), "{busy:?}");
    assert!(!record_exists(&server.store, "shop-a", "create_order", "new-key").await);
    assert!(
        replay.replayed(),
        "replays do not wait for the writer: {replay:?}"
    );

    let retry = post(server.addr, Some(SHOP_A), Some("new-key"), BOOK, &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(
        server.order_count().await,
        3,
        "ours, the other process's, the retry's"
    );
}

#[tokio::test]
async fn duplicate_waiting_past_the_lock_timeout_is_503_then_replays() {
    let started = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let server = TestServer::builder()
        .layer(|layer| layer.with_lock_timeout(Duration::from_millis(200)))
        .hook({
            let (started, release) = (started.clone(), release.clone());
            hook(move |_| {
                let (started, release) = (started.clone(), release.clone());
                async move {
                    started.notify_one();
                    release.notified().await;
                    HookOutcome::default()
                }
            })
        })
        .spawn()
        .await;
    let original = tokio::spawn({
        let addr = server.addr;
        async move { post(addr, Some(SHOP_A), Some("slow"), BOOK, &[]).await }
    });
    tokio::time::timeout(PATIENCE, started.notified())
        .await
        .expect("the original's handler started");

    let waited = post(server.addr, Some(SHOP_A), Some("slow"), BOOK, &[]).await;

    assert_eq!(waited.status, StatusCode::SERVICE_UNAVAILABLE, "{waited:?}");
    assert!(waited.header("retry-after").is_some());
    assert_eq!(
        server.app.handler_calls(),
        1,
        "the duplicate did not run the handler"
    );

    release.notify_one();
    let original = original.await.expect("original");
    assert_eq!(original.status, StatusCode::CREATED);
    let retried = post(server.addr, Some(SHOP_A), Some("slow"), BOOK, &[]).await;
    assert!(retried.replayed(), "{retried:?}");
    assert_eq!(retried.body, original.body);
    assert_eq!(server.order_count().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_the_original_fails_a_waiting_duplicate_runs_afresh() {
    let gate = Arc::new(Notify::new());
    let first = Arc::new(AtomicBool::new(true));
    let server = TestServer::builder()
        .layer(|layer| layer.with_lock_timeout(Duration::from_secs(30)))
        .hook({
            let gate = gate.clone();
            hook(move |_| {
                let gate = gate.clone();
                let fail = first.swap(false, Ordering::SeqCst);
                async move {
                    if !fail {
                        return HookOutcome::default();
                    }
                    gate.notified().await;
                    HookOutcome {
                        fail_with: Some(StatusCode::INTERNAL_SERVER_ERROR),
                        ..HookOutcome::default()
                    }
                }
            })
        })
        .spawn()
        .await;
    let opener = {
        let app = server.app.clone();
        let gate = gate.clone();
        tokio::spawn(async move {
            let both = app.wait_for_arrivals(2, PATIENCE).await;
            gate.notify_one();
            both
        })
    };

    let replies = send_all_at_once(&server, vec![("dup".to_owned(), BOOK.to_owned()); 2]).await;

    assert!(
        opener.await.expect("opener"),
        "both were in flight together"
    );
    let mut statuses: Vec<_> = replies.iter().map(|r| r.status).collect();
    statuses.sort();
    assert_eq!(
        statuses,
        vec![StatusCode::CREATED, StatusCode::INTERNAL_SERVER_ERROR],
        "{replies:?}"
    );
    assert!(
        replies.iter().all(|r| !r.replayed()),
        "the failure was not saved"
    );
    assert_eq!(server.app.handler_calls(), 2);
    assert_eq!(
        server.order_count().await,
        1,
        "only the successful attempt's order"
    );
    assert_eq!(server.record_count().await, 1);
}
