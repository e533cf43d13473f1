//! Group commit: requests queued for the writer share one SQLite commit, each isolated by its
//! own savepoint, and no response leaves before the commit that makes it durable.

use support::common;

use std::sync::Arc;
use std::time::Duration;

use common::{
    hook, post, record_exists, HeldHandler, HookOutcome, Outcome, Reply, TestServer, PATIENCE,
    SHOP_A,
};
use http::StatusCode;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tower_idempotency::store::sqlite::SqliteStore;

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

/// Waits until `n` requests are queued for the store's writer.
async fn until_writers_waiting(store: &SqliteStore, n: usize) {
    tokio::time::timeout(PATIENCE, async {
        while store.writers_waiting() < n {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("requests queued for the writer in time");
}

async fn started(signal: &Notify) {
    tokio::time::timeout(PATIENCE, signal.notified())
        .await
        .expect("the handler started in time");
}

fn send(server: &TestServer, key: &'static str) -> JoinHandle<Reply> {
    let addr = server.addr;
    tokio::spawn(async move { post(addr, Some(SHOP_A), Some(key), BOOK, &[]).await })
}

/// The replies to these requests, in their order.
async fn replies<const N: usize>(requests: [JoinHandle<Reply>; N]) -> [Reply; N] {
    let mut replies = Vec::with_capacity(N);
    for request in requests {
        replies.push(request.await.expect("request task"));
    }
    replies.try_into().expect("one reply per request")
}

/// What the test hooks share: C's handler signals that it started and waits to be released.
#[derive(Default)]
struct Gates {
    a_started: Notify,
    c: HeldHandler,
}

/// The server for these tests: a long group delay, so that group membership is decided by
/// the queue alone; `a` holds the writer until `queued_behind_a` requests wait behind it; `b`
/// fails after inserting its order; `c` waits for the test.
async fn server(gates: Arc<Gates>, queued_behind_a: usize, max_requests: usize) -> TestServer {
    let store_slot: Arc<std::sync::OnceLock<SqliteStore>> = Arc::default();
    let server = TestServer::builder()
        .store_options(move |options| {
            options.with_group_commit(max_requests, Duration::from_secs(30))
        })
        .layer(|layer| layer.with_lock_timeout(PATIENCE))
        .hook({
            let store_slot = store_slot.clone();
            hook(move |call| {
                let gates = gates.clone();
                let store_slot = store_slot.clone();
                async move {
                    match call.key.as_deref() {
                        Some("a") => {
                            gates.a_started.notify_one();
                            if let Some(store) = store_slot.get() {
                                until_writers_waiting(store, queued_behind_a).await;
                            }
                            HookOutcome::default()
                        }
                        Some("b") => HookOutcome::failing(Some(StatusCode::INTERNAL_SERVER_ERROR)),
                        Some("c") => {
                            gates.c.hold().await;
                            HookOutcome::default()
                        }
                        _ => HookOutcome::default(),
                    }
                }
            })
        })
        .spawn()
        .await;
    store_slot
        .set(server.store.clone())
        .expect("store set once");
    server
}

/// A test's server with its gates.
struct Group {
    gates: Arc<Gates>,
    server: TestServer,
}

impl Group {
    /// See [`server`].
    async fn start(queued_behind_a: usize, max_requests: usize) -> Group {
        let gates = Arc::new(Gates::default());
        let server = server(gates.clone(), queued_behind_a, max_requests).await;
        Group { gates, server }
    }

    /// [`Group::start`], then `a` and `c` sent: both their handlers have started.
    async fn running_a_and_c(
        queued_behind_a: usize,
        max_requests: usize,
    ) -> (Group, JoinHandle<Reply>, JoinHandle<Reply>) {
        let group = Group::start(queued_behind_a, max_requests).await;
        let a = group.send_a().await;
        let c = group.send_c().await;
        (group, a, c)
    }

    /// Sends `a` and waits until its handler runs (on the writer).
    async fn send_a(&self) -> JoinHandle<Reply> {
        let a = send(&self.server, "a");
        started(&self.gates.a_started).await;
        a
    }

    /// Sends `c` and waits until its handler runs (and holds the writer).
    async fn send_c(&self) -> JoinHandle<Reply> {
        let c = send(&self.server, "c");
        self.gates.c.started().await;
        c
    }
}

test! { a_group_commits_together_and_a_failing_member_rolls_back_alone, multi_thread = 2 }
async fn a_group_commits_together_and_a_failing_member_rolls_back_alone() {
    let group = Group::start(2, 64).await;
    let (gates, server) = (&group.gates, &group.server);

    // `a` holds the writer until `b` and `c` queue behind it: all three share one group.
    let a = group.send_a().await;
    let b = send(server, "b");
    let c = group.send_c().await;

    // `a` finished its handler long ago, but its group is still open (`c` is in it): its
    // response must not have left, and nothing is committed yet.
    tokio::time::sleep(Duration::from_millis(100)).await;
    if a.is_finished() {
        let early = a.await;
        panic!("a's answer left before its group committed: {early:?}");
    }
    assert_eq!(
        server.order_count().await,
        0,
        "nothing committed while the group is open"
    );
    assert_eq!(server.record_count().await, 0);

    gates.c.release();
    let [a, b, c] = replies([a, b, c]).await;
    assert_eq!(a.status, StatusCode::CREATED, "{a:?}");
    assert_eq!(c.status, StatusCode::CREATED, "{c:?}");
    assert_eq!(b.status, StatusCode::INTERNAL_SERVER_ERROR, "{b:?}");

    // b's savepoint was rolled back: its order and record are gone, a's and c's are kept.
    let orders = common::orders(&server.store).await;
    let ids: Vec<i64> = orders.iter().map(|o| o.0).collect();
    assert_eq!(orders.len(), 2, "{orders:?}");
    assert!(
        ids.contains(&a.order_id()) && ids.contains(&c.order_id()),
        "{orders:?}"
    );
    assert!(record_exists(&server.store, "shop-a", "create_order", "a").await);
    assert!(record_exists(&server.store, "shop-a", "create_order", "c").await);
    assert!(!record_exists(&server.store, "shop-a", "create_order", "b").await);

    // b can be retried and runs afresh (its failure was only its own).
    let retry = post(server.addr, Some(SHOP_A), Some("b"), BOOK, &[]).await;
    assert_eq!(
        retry.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "the hook still fails b"
    );
    assert_eq!(server.order_count().await, 2);
}

test! { a_duplicate_of_a_member_is_answered_only_after_the_group_commits, multi_thread = 2 }
async fn a_duplicate_of_a_member_is_answered_only_after_the_group_commits() {
    let (group, a, c) = Group::running_a_and_c(1, 64).await;
    let (gates, server) = (&group.gates, &group.server);

    // The duplicate of `a` finds no committed record on the fast path and queues for the
    // writer; inside the group it sees a's record, which is not durable yet.
    let duplicate = send(server, "a");
    until_writers_waiting(&server.store, 1).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!a.is_finished(), "a answered before its group committed");
    assert!(
        !duplicate.is_finished(),
        "the duplicate answered before a's commit"
    );
    assert_eq!(server.record_count().await, 0);

    gates.c.release();
    let [a, c, duplicate] = replies([a, c, duplicate]).await;
    assert_eq!(a.status, StatusCode::CREATED);
    assert_eq!(c.status, StatusCode::CREATED);
    assert_eq!(duplicate.status, StatusCode::CREATED, "{duplicate:?}");
    assert!(duplicate.replayed(), "the duplicate is a replay");
    assert_eq!(duplicate.body, a.body);
    assert_eq!(server.order_count().await, 2);
    assert_eq!(server.app.handler_calls(), 2, "a's handler ran once");
}

test! { without_grouping_each_request_commits_on_its_own, multi_thread = 2 }
async fn without_grouping_each_request_commits_on_its_own() {
    let (group, a, c) = Group::running_a_and_c(1, 1).await;
    let (gates, server) = (&group.gates, &group.server);

    // With groups of one, a commits and answers while c still holds the writer.
    let a = tokio::time::timeout(PATIENCE, a)
        .await
        .expect("a answered while c holds the writer")
        .expect("a");
    assert_eq!(a.status, StatusCode::CREATED);
    assert_eq!(server.order_count().await, 1, "a's order is committed");

    gates.c.release();
    assert_eq!(c.await.expect("c").status, StatusCode::CREATED);
    assert_eq!(server.order_count().await, 2);
}
