//! On SQLite, the part of a request that runs while its transaction is open (the handler, its
//! statements, the commit) is polled on the store's writer thread, with the server's tokio
//! runtime entered. These tests pin what a handler can still do there, and what becomes of
//! requests that stop waiting for the writer.

use support::common;

use std::time::{Duration, Instant};

use common::{hook, post, HeldHandler, HookOutcome, Outcome, TestServer, PATIENCE, SHOP_A};
use http::StatusCode;
use tower_idempotency::store::sqlite::SqliteHandle;
use tower_idempotency::Error;

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

const INSERT_GIFT: &str =
    "INSERT INTO orders (tenant_id, sku, quantity) VALUES ('shop-a', 'gift', 1)";

/// Inserts a gift row from a task of its own, through the request's transaction `tx`.
async fn insert_a_gift_from_a_spawned_task(tx: &SqliteHandle) {
    let tx = tx.clone();
    let spawned =
        tokio::spawn(async move { tx.run(|conn| conn.execute(INSERT_GIFT, [])).await }).await;
    assert!(
        matches!(spawned, Ok(Ok(1))),
        "the spawned task's insert: {spawned:?}"
    );
}

test! { handlers_use_timers_spawned_tasks_and_the_blocking_pool }
/// Timers, `tokio::spawn` and `spawn_blocking` work in a handler, and a statement sent from
/// another task joins the same transaction.
async fn handlers_use_timers_spawned_tasks_and_the_blocking_pool() {
    let server = TestServer::with_hook(hook(|call| async move {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let blocking = tokio::task::spawn_blocking(|| 6 * 7).await;
        assert_eq!(blocking.ok(), Some(42));
        // Another task's statement joins the same transaction.
        insert_a_gift_from_a_spawned_task(&call.tx).await;
        HookOutcome::default()
    }))
    .await;

    let reply = post(server.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;

    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    // The order and the gift committed together with the record.
    assert_eq!(server.order_count().await, 2);
    assert_eq!(server.record_count().await, 1);
    let replay = post(server.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
    assert!(replay.replayed(), "{replay:?}");
}

test! { a_spawned_tasks_rows_roll_back_with_the_request }
/// A row written from a spawned task is rolled back with the rest when the handler fails.
async fn a_spawned_tasks_rows_roll_back_with_the_request() {
    let server = TestServer::with_hook(hook(|call| async move {
        insert_a_gift_from_a_spawned_task(&call.tx).await;
        HookOutcome::failing(Some(StatusCode::INTERNAL_SERVER_ERROR))
    }))
    .await;

    let reply = post(server.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;

    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{reply:?}");
    assert_eq!(
        server.counts().await,
        (1, 0, 0),
        "(handler calls, orders, records)"
    );
}

test! { a_panicking_statement_is_an_error_for_the_handler }
/// A statement closure that panics is an error for the handler (as on any other thread), not
/// a panic through it; the request rolls back and the writer goes on serving.
async fn a_panicking_statement_is_an_error_for_the_handler() {
    let server = TestServer::with_hook(hook(|call| async move {
        if call.key.as_deref() != Some("boom") {
            return HookOutcome::default();
        }
        let result = call
            .tx
            .run(|_conn| -> Result<(), _> { panic!("a statement closure panicked") })
            .await;
        assert!(matches!(result, Err(Error::Panicked)), "{result:?}");
        HookOutcome::failing(Some(StatusCode::INTERNAL_SERVER_ERROR))
    }))
    .await;

    let failed = post(server.addr, Some(SHOP_A), Some("boom"), BOOK, &[]).await;
    assert_eq!(
        failed.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{failed:?}"
    );
    let next = post(server.addr, Some(SHOP_A), Some("k2"), BOOK, &[]).await;
    assert_eq!(next.status, StatusCode::CREATED, "{next:?}");

    assert_eq!(
        server.counts().await,
        (2, 1, 1),
        "(handler calls, orders, records)"
    );
}

test! { requests_that_give_up_leave_the_writers_queue }
/// Requests that give up on their lock timeout while a long handler holds the writer get their
/// `503` on time, leave the writer's queue (with the bodies they hold) as soon as another
/// request arrives, and never run. (The slow request runs on the writer thread here: one that
/// holds the writer in place keeps them queued until it gives the writer back.)
async fn requests_that_give_up_leave_the_writers_queue() {
    let slow_handler = HeldHandler::default();
    let lock_timeout = Duration::from_millis(150);
    let server = TestServer::builder()
        .store_options(|options| options.with_write_in_place(false))
        .layer(move |layer| layer.with_lock_timeout(lock_timeout))
        .hook({
            let slow_handler = slow_handler.clone();
            hook(move |call| {
                let slow_handler = slow_handler.clone();
                async move {
                    if call.key.as_deref() == Some("slow") {
                        slow_handler.hold().await;
                    }
                    HookOutcome::default()
                }
            })
        })
        .spawn()
        .await;
    let addr = server.addr;
    let slow = tokio::spawn(async move { post(addr, Some(SHOP_A), Some("slow"), BOOK, &[]).await });
    slow_handler.started().await;

    let began = Instant::now();
    let waiters: Vec<_> = (0..5)
        .map(|i| {
            tokio::spawn(async move {
                post(addr, Some(SHOP_A), Some(&format!("w{i}")), BOOK, &[]).await
            })
        })
        .collect();
    for waiter in waiters {
        let reply = waiter.await.expect("waiter");
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{reply:?}");
    }
    assert!(
        began.elapsed() < lock_timeout + PATIENCE / 4,
        "the 503s took {:?}",
        began.elapsed()
    );
    // The five are abandoned but still queued behind the slow handler...
    assert_eq!(server.store.writers_waiting(), 5);
    // ...until the next request arrives at the writer and they are dropped.
    let late = post(addr, Some(SHOP_A), Some("late"), BOOK, &[]).await;
    assert_eq!(late.status, StatusCode::SERVICE_UNAVAILABLE, "{late:?}");
    assert_eq!(server.store.writers_waiting(), 1);

    slow_handler.release();
    let slow = slow.await.expect("slow request");
    assert_eq!(slow.status, StatusCode::CREATED, "{slow:?}");
    // Only the slow request ran; the abandoned begins were skipped.
    assert_eq!(server.app.handler_calls(), 1);
    assert_eq!(server.order_count().await, 1);
    assert_eq!(server.record_count().await, 1);
    let deadline = Instant::now() + PATIENCE;
    while server.store.writers_waiting() > 0 {
        assert!(Instant::now() < deadline, "the queue never drained");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let retry = post(addr, Some(SHOP_A), Some("w0"), BOOK, &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
}
