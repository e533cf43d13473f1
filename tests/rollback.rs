//! Failures roll everything back: the handler's order and the record go together or not at
//! all, and a retry with the same key runs afresh (DESIGN.md §1, "the handler fails").

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{
    execute, hook, orders, post, record_exists, HookOutcome, Post, TestServer, PATIENCE, SHOP_A,
};
use http::StatusCode;
use tokio::io::AsyncWriteExt;
use tokio::sync::Notify;

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

/// The article's lab: saving the record of `key-3` fails after the handler inserted its order.
#[tokio::test]
async fn injected_failure_saving_the_record_rolls_back_the_order() {
    let server = TestServer::spawn().await;
    execute(
        &server.store,
        "CREATE TRIGGER fail_record BEFORE INSERT ON idempotency_records \
         WHEN NEW.idempotency_key = 'key-3' \
         BEGIN SELECT RAISE(ABORT, 'injected record failure'); END;",
    )
    .await;
    for key in ["key-1", "key-2"] {
        let reply = post(server.addr, Some(SHOP_A), Some(key), BOOK, &[]).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{key}: {reply:?}");
    }

    let failed = post(server.addr, Some(SHOP_A), Some("key-3"), BOOK, &[]).await;

    assert_eq!(
        failed.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{failed:?}"
    );
    assert_eq!(failed.error_code(), "internal_error");
    assert_eq!(
        server.app.handler_calls(),
        3,
        "the handler ran and inserted"
    );
    assert_eq!(
        server.order_count().await,
        2,
        "key-3's order was rolled back"
    );
    assert!(!record_exists(&server.store, "shop-a", "create_order", "key-3").await);
    assert_eq!(server.record_count().await, 2);

    execute(&server.store, "DROP TRIGGER fail_record").await;
    let recovered = post(server.addr, Some(SHOP_A), Some("key-3"), BOOK, &[]).await;

    assert_eq!(recovered.status, StatusCode::CREATED, "{recovered:?}");
    assert!(!recovered.replayed(), "the retry ran afresh");
    assert_eq!(server.order_count().await, 3);
    assert!(record_exists(&server.store, "shop-a", "create_order", "key-3").await);
    let again = post(server.addr, Some(SHOP_A), Some("key-3"), BOOK, &[]).await;
    assert!(again.replayed());
    assert_eq!(again.body, recovered.body);
}

/// The handler's own insert fails: it answers 500, which is not saved.
#[tokio::test]
async fn failing_order_insert_is_500_and_not_saved() {
    let server = TestServer::spawn().await;
    execute(
        &server.store,
        "CREATE TRIGGER fail_order BEFORE INSERT ON orders WHEN NEW.sku = 'book' \
         BEGIN SELECT RAISE(ABORT, 'injected order failure'); END;",
    )
    .await;

    let failed = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(
        failed.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{failed:?}"
    );
    assert_eq!(failed.error_code(), "database_error");
    assert_eq!(server.order_count().await, 0);
    assert_eq!(server.record_count().await, 0, "a 500 is never saved");

    execute(&server.store, "DROP TRIGGER fail_order").await;
    let recovered = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(recovered.status, StatusCode::CREATED, "{recovered:?}");
    assert!(!recovered.replayed());
    assert_eq!(server.order_count().await, 1);
    assert_eq!(server.app.handler_calls(), 2);
}

/// Runs `behaviour` on the first call only; later calls succeed normally.
fn first_call_only<F, Fut>(behaviour: F) -> common::Hook
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = HookOutcome> + Send + 'static,
{
    let first = Arc::new(AtomicBool::new(true));
    let behaviour = Arc::new(behaviour);
    hook(move |_| {
        let first = first.swap(false, Ordering::SeqCst);
        let behaviour = behaviour.clone();
        async move {
            if first {
                behaviour().await
            } else {
                HookOutcome::default()
            }
        }
    })
}

#[tokio::test]
async fn handler_500_after_inserting_rolls_back_its_order() {
    let server = TestServer::builder()
        .hook(first_call_only(|| async {
            HookOutcome {
                fail_with: Some(StatusCode::INTERNAL_SERVER_ERROR),
                ..HookOutcome::default()
            }
        }))
        .spawn()
        .await;

    let failed = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        failed.error_code(),
        "injected_failure",
        "the handler's own 500"
    );
    assert_eq!(
        server.order_count().await,
        0,
        "the inserted order was rolled back"
    );
    assert_eq!(server.record_count().await, 0);

    let retry = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(server.order_count().await, 1);
    assert_eq!(server.app.handler_calls(), 2);
}

#[tokio::test]
async fn panicking_handler_rolls_back_and_the_server_keeps_serving() {
    let server = TestServer::builder()
        .hook(first_call_only(|| async {
            panic!("injected handler panic (expected by the test)");
        }))
        .spawn()
        .await;

    let failed = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(
        failed.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{failed:?}"
    );
    assert_eq!(failed.error_code(), "internal_error");
    assert_eq!(
        server.order_count().await,
        0,
        "the order inserted before the panic"
    );
    assert_eq!(server.record_count().await, 0);

    let other = post(server.addr, Some(SHOP_A), Some("key-2"), BOOK, &[]).await;
    assert_eq!(other.status, StatusCode::CREATED, "the server still serves");
    let retry = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(server.order_count().await, 2);
    assert_eq!(server.record_count().await, 2);
}

/// Notifies on drop: tells the test that the handler's future was dropped.
struct DropSignal(Arc<Notify>);

impl Drop for DropSignal {
    fn drop(&mut self) {
        self.0.notify_one();
    }
}

#[tokio::test]
async fn client_disconnect_mid_handler_rolls_back() {
    let started = Arc::new(Notify::new());
    let dropped = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let server = TestServer::builder()
        // A transaction leaked by the disconnected request would make the retry 503 quickly.
        .layer(|layer| layer.with_lock_timeout(Duration::from_secs(2)))
        .hook({
            let (started, dropped, release) = (started.clone(), dropped.clone(), release.clone());
            first_call_only(move || {
                let (started, dropped, release) =
                    (started.clone(), dropped.clone(), release.clone());
                async move {
                    // The order is already inserted in the open transaction.
                    let _signal = DropSignal(dropped);
                    started.notify_one();
                    release.notified().await;
                    HookOutcome::default()
                }
            })
        })
        .spawn()
        .await;

    let mut stream = tokio::net::TcpStream::connect(server.addr)
        .await
        .expect("connect");
    let request = Post::order("key-1", BOOK).to_http1_bytes(server.addr);
    stream.write_all(&request).await.expect("write request");
    tokio::time::timeout(PATIENCE, started.notified())
        .await
        .expect("the handler started");

    drop(stream);

    tokio::time::timeout(PATIENCE, dropped.notified())
        .await
        .expect("the server dropped the handler of the client that went away");
    // Had the handler survived, letting it finish would commit its order.
    release.notify_one();
    assert_eq!(server.app.handler_calls(), 1);

    let retry = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed(), "nothing was saved for the first attempt");
    assert_eq!(server.app.handler_calls(), 2);
    let rows = orders(&server.store).await;
    assert_eq!(rows.len(), 1, "only the retry's order exists: {rows:?}");
    assert_eq!(rows[0].0, retry.order_id());
    assert_eq!(server.record_count().await, 1);
}
