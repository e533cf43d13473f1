//! The client against the real order app, through a loopback TCP proxy that loses or delays
//! responses after the server committed: the article's opening scenario, end to end.

use support::client_common;

use std::collections::HashSet;
use std::time::Duration;

use http::StatusCode;
use tokio::time::Instant;
use tower_idempotency::client::{Retry, RetryError};

use client_common::{
    client, fast, order_request, send, Answer, Fault, HttpClient, OrdersServer, Plan, Proxy,
    SHOP_A, SHOP_B,
};

/// Orders a book as shop A through `proxy`; the client retries until it gets an answer.
async fn order_a_book(client: &Retry<HttpClient>, proxy: &Proxy) -> Answer {
    send(client, order_request(&proxy.url("/orders"), SHOP_A, "book"))
        .await
        .expect("the retry gets an answer")
}

/// Asserts that `answer` is the saved `201` of the one order there is, which the second
/// attempt got as a replay; returns the order's id.
async fn assert_one_order_replayed(server: &OrdersServer, answer: &Answer) -> i64 {
    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(answer.outcome.attempts, 2);
    assert!(
        answer.outcome.replayed,
        "the second attempt must get the saved 201, not run again"
    );
    let orders = server.orders().await;
    assert_eq!(orders.len(), 1, "exactly one order: {orders:?}");
    assert_eq!(answer.order_id(), orders[0].0, "the original order's id");
    orders[0].0
}

test! { a_201_lost_after_the_commit_is_recovered_by_a_retry_with_the_same_key }
async fn a_201_lost_after_the_commit_is_recovered_by_a_retry_with_the_same_key() {
    let server = OrdersServer::spawn().await;
    let proxy = Proxy::spawn(server.addr, Plan::script([Fault::Drop])).await;
    let client = client(fast());

    let answer = order_a_book(&client, &proxy).await;

    // The first response was lost on the way back: the server had committed the order.
    assert_eq!(proxy.dropped(), 1);
    let order_id = assert_one_order_replayed(&server, &answer).await;
    let location = format!("/orders/{order_id}");
    assert_eq!(
        answer.headers.get("location").and_then(|v| v.to_str().ok()),
        Some(location.as_str())
    );
}

test! { a_201_delayed_past_the_attempt_timeout_is_recovered_without_waiting_for_it }
async fn a_201_delayed_past_the_attempt_timeout_is_recovered_without_waiting_for_it() {
    let server = OrdersServer::spawn().await;
    let held = Duration::from_secs(5);
    let proxy = Proxy::spawn(server.addr, Plan::script([Fault::Delay(held)])).await;
    let client = client(fast().with_attempt_timeout(Duration::from_secs(1)));

    let started = Instant::now();
    let answer = order_a_book(&client, &proxy).await;

    assert_eq!(proxy.delayed(), 1);
    assert!(
        started.elapsed() < held,
        "the client gave up on the held response and retried: {:?}",
        started.elapsed()
    );
    assert_one_order_replayed(&server, &answer).await;
}

test! { a_burst_of_50_operations_through_a_proxy_that_drops_30_percent_makes_50_orders }
async fn a_burst_of_50_operations_through_a_proxy_that_drops_30_percent_makes_50_orders() {
    const OPERATIONS: usize = 50;
    let server = OrdersServer::spawn().await;
    let proxy = Proxy::spawn(server.addr, Plan::random(0x5eed_2024, 0.3)).await;
    // Enough attempts that 0.3^n is out of reach; quick backoff.
    let client = client(fast().with_max_attempts(12));
    let url = proxy.url("/orders");

    let tasks: Vec<_> = (0..OPERATIONS)
        .map(|i| {
            let (client, url) = (client.clone(), url.clone());
            let token = if i % 2 == 0 { SHOP_A } else { SHOP_B };
            tokio::spawn(async move {
                let sku = format!("item-{i}");
                let answer = client_common::send(&client, order_request(&url, token, &sku))
                    .await
                    .unwrap_or_else(|error| panic!("operation {i}: {error}"));
                (sku, token, answer)
            })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.expect("operation task"));
    }

    let orders = server.orders().await;
    assert_eq!(orders.len(), OPERATIONS, "exactly one order per operation");
    for (sku, token, answer) in &answers {
        assert_eq!(answer.status, StatusCode::CREATED, "{sku}");
        let tenant = if *token == SHOP_A { "shop-a" } else { "shop-b" };
        let mine: Vec<_> = orders.iter().filter(|(_, _, s)| s == sku).collect();
        assert_eq!(mine.len(), 1, "{sku}: {mine:?}");
        assert_eq!(answer.order_id(), mine[0].0, "{sku} holds its own order id");
        assert_eq!(mine[0].1, tenant, "{sku}");
        // A retry happens only after a lost response, and is then answered from the save.
        assert_eq!(
            answer.outcome.replayed,
            answer.outcome.attempts > 1,
            "{sku}: {:?}",
            answer.outcome
        );
    }
    let ids: HashSet<i64> = answers.iter().map(|(_, _, a)| a.order_id()).collect();
    assert_eq!(
        ids.len(),
        OPERATIONS,
        "every client holds a different order"
    );
    let keys: HashSet<&str> = answers.iter().map(|(_, _, a)| a.key()).collect();
    assert_eq!(keys.len(), OPERATIONS, "one key per operation");

    // Each lost response cost exactly one more attempt.
    let attempts: u32 = answers.iter().map(|(_, _, a)| a.outcome.attempts).sum();
    let dropped = proxy.dropped();
    assert!(
        dropped > 0,
        "the proxy dropped nothing: the test proves nothing"
    );
    assert_eq!(attempts as usize, OPERATIONS + dropped);
    assert_eq!(proxy.responses(), OPERATIONS + dropped);
}

test! { the_layers_busy_answer_is_retried_after_its_retry_after }
async fn the_layers_busy_answer_is_retried_after_its_retry_after() {
    let server = OrdersServer::spawn_with(|layer| {
        layer
            .with_lock_timeout(Duration::from_millis(100))
            .with_retry_after(Duration::from_secs(1))
    })
    .await;
    // Another writer holds the store's write lock for a while.
    let (locked, lock_taken) = tokio::sync::oneshot::channel();
    let holder = tokio::spawn({
        let store = server.store.clone();
        async move {
            store
                .write(move |_tx| {
                    let _ = locked.send(());
                    std::thread::sleep(Duration::from_millis(600));
                    Ok(())
                })
                .await
        }
    });
    lock_taken.await.expect("the writer took the lock");

    let client = client(fast());
    let url = format!("http://{}/orders", server.addr);
    let started = Instant::now();
    let answer = send(&client, order_request(&url, SHOP_A, "book"))
        .await
        .expect("an answer");

    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(answer.outcome.attempts, 2, "one 503, then the order");
    assert!(!answer.outcome.replayed);
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "waited for Retry-After: {:?}",
        started.elapsed()
    );
    holder.await.expect("holder").expect("holder's write");
    assert_eq!(server.orders().await.len(), 1);
}

test! { a_key_reused_with_another_payload_is_a_final_409 }
async fn a_key_reused_with_another_payload_is_a_final_409() {
    let server = OrdersServer::spawn().await;
    let client = client(fast());
    let url = format!("http://{}/orders", server.addr);

    let with_key = |sku: &str| {
        let mut request = order_request(&url, SHOP_A, sku);
        let key = http::HeaderValue::from_static("caller-key-1");
        request.headers_mut().insert("idempotency-key", key);
        request
    };
    let first = send(&client, with_key("book")).await.expect("first");
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.key(), "caller-key-1", "the caller's key is kept");

    let changed = send(&client, with_key("pen")).await.expect("second");
    assert_eq!(changed.status, StatusCode::CONFLICT);
    assert_eq!(changed.outcome.attempts, 1, "a 409 is final");
    assert_eq!(server.orders().await.len(), 1);
}

test! { when_every_response_is_lost_the_error_carries_the_key_to_retry_later }
async fn when_every_response_is_lost_the_error_carries_the_key_to_retry_later() {
    let server = OrdersServer::spawn().await;
    let proxy = Proxy::spawn(server.addr, Plan::random(1, 1.0)).await;
    let client = client(fast().with_max_attempts(3));

    let error = send(
        &client,
        order_request(&proxy.url("/orders"), SHOP_A, "book"),
    )
    .await
    .expect_err("no response ever arrives");
    let RetryError::Failed { outcome, .. } = &error else {
        panic!("expected Failed, got {error:?}");
    };
    assert_eq!(outcome.attempts, 3);
    assert_eq!(proxy.dropped(), 3);
    let key = outcome.key.clone().expect("the generated key");
    assert_eq!(
        server.orders().await.len(),
        1,
        "the first attempt committed"
    );

    // Later, with the network back, the same key completes the same operation.
    let mut later = order_request(&format!("http://{}/orders", server.addr), SHOP_A, "book");
    later.headers_mut().insert("idempotency-key", key);
    let answer = send(&client, later).await.expect("answer");
    assert_eq!(answer.status, StatusCode::CREATED);
    assert!(answer.outcome.replayed);
    assert_eq!(answer.order_id(), server.orders().await[0].0);
    assert_eq!(server.orders().await.len(), 1);
}
