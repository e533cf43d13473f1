//! Failures roll everything back on the PostgreSQL store: the handler's order and the record
//! commit together or not at all, whether the handler fails, panics, the client goes away,
//! the database connection is killed mid-transaction, or the handler tries to end the
//! transaction itself (refused).
//!
//! Needs `TEST_DATABASE_URL`; without it `cargo test` reports these tests as ignored.

mod common;
mod pg_common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{post, Post, PATIENCE, SHOP_A};
use http::StatusCode;
use pg_common::{hook, Hook, HookOutcome, PgServer, TestDb};
use tokio::io::AsyncWriteExt;
use tokio::sync::{oneshot, Notify};
use tower_idempotency::store::postgres::PostgresTransaction;
use tower_idempotency::Error;

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

/// Runs `behaviour` on the first call only; later calls succeed normally.
fn first_call_only<F, Fut>(behaviour: F) -> Hook
where
    F: Fn(pg_common::OrderCall) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = HookOutcome> + Send + 'static,
{
    let first = Arc::new(AtomicBool::new(true));
    let behaviour = Arc::new(behaviour);
    hook(move |call| {
        let first = first.swap(false, Ordering::SeqCst);
        let behaviour = behaviour.clone();
        async move {
            if first {
                behaviour(call).await
            } else {
                HookOutcome::default()
            }
        }
    })
}

/// The article's lab: saving the record of `key-3` fails after the handler inserted its order.
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn injected_failure_saving_the_record_rolls_back_the_order() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let server = PgServer::spawn(&db).await;
    db.execute(
        "CREATE FUNCTION fail_record() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN RAISE EXCEPTION 'injected record failure'; END $$; \
         CREATE TRIGGER fail_record BEFORE UPDATE ON idempotency_records FOR EACH ROW \
         WHEN (NEW.idempotency_key = 'key-3' AND NEW.state = 'completed') \
         EXECUTE FUNCTION fail_record();",
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
    assert_eq!(db.order_count().await, 2, "key-3's order was rolled back");
    assert!(!db.record_exists("shop-a", "create_order", "key-3").await);

    db.execute("DROP TRIGGER fail_record ON idempotency_records")
        .await;
    let recovered = post(server.addr, Some(SHOP_A), Some("key-3"), BOOK, &[]).await;
    assert_eq!(recovered.status, StatusCode::CREATED, "{recovered:?}");
    assert!(!recovered.replayed(), "the retry ran afresh");
    assert_eq!(db.order_count().await, 3);
    let again = post(server.addr, Some(SHOP_A), Some("key-3"), BOOK, &[]).await;
    assert!(again.replayed());
    assert_eq!(again.body, recovered.body);
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn handler_500_after_inserting_rolls_back_its_order() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let server = PgServer::builder()
        .hook(first_call_only(|_| async {
            HookOutcome {
                fail_with: Some(StatusCode::INTERNAL_SERVER_ERROR),
            }
        }))
        .spawn(&db)
        .await;

    let failed = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        failed.error_code(),
        "injected_failure",
        "the handler's own 500"
    );
    assert_eq!(
        db.order_count().await,
        0,
        "the inserted order was rolled back"
    );
    assert_eq!(db.record_count().await, 0);
    let retry = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(db.order_count().await, 1);
    assert_eq!(server.app.handler_calls(), 2);
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn panicking_handler_rolls_back_and_the_server_keeps_serving() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let server = PgServer::builder()
        .hook(first_call_only(|_| async {
            panic!("injected handler panic (expected by the test)");
        }))
        .spawn(&db)
        .await;

    let failed = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(
        failed.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{failed:?}"
    );
    assert_eq!(failed.error_code(), "internal_error");
    assert_eq!(
        db.order_count().await,
        0,
        "the order inserted before the panic"
    );
    assert_eq!(db.record_count().await, 0);
    let retry = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(db.order_count().await, 1);
}

/// Notifies on drop: tells the test that the handler's future was dropped.
struct DropSignal(Arc<Notify>);

impl Drop for DropSignal {
    fn drop(&mut self) {
        self.0.notify_one();
    }
}

/// The request future is dropped with the transaction open: `Drop` closes the connection, and
/// PostgreSQL rolls back. Had the transaction leaked, the retry of the same key would wait
/// for it and get a 503.
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn client_disconnect_mid_handler_rolls_back() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let started = Arc::new(Notify::new());
    let dropped = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let server = PgServer::builder()
        .layer(|layer| layer.with_lock_timeout(Duration::from_secs(2)))
        .hook({
            let (started, dropped, release) = (started.clone(), dropped.clone(), release.clone());
            first_call_only(move |_| {
                let (started, dropped, release) =
                    (started.clone(), dropped.clone(), release.clone());
                async move {
                    let _signal = DropSignal(dropped);
                    started.notify_one();
                    release.notified().await;
                    HookOutcome::default()
                }
            })
        })
        .spawn(&db)
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
    release.notify_one();

    let retry = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed(), "nothing was saved for the first attempt");
    let rows = db.orders().await;
    assert_eq!(rows.len(), 1, "only the retry's order exists: {rows:?}");
    assert_eq!(rows[0].0, retry.order_id());
    assert_eq!(db.record_count().await, 1);
}

/// The transaction's backend is killed (`pg_terminate_backend`) while the handler is inside
/// it: the request fails, nothing is kept, and the retry succeeds on a fresh connection.
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn connection_killed_mid_transaction_rolls_back_and_the_retry_succeeds() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let (pid_tx, pid_rx) = oneshot::channel::<i32>();
    let (killed_tx, killed_rx) = oneshot::channel::<()>();
    let pid_tx = Arc::new(Mutex::new(Some(pid_tx)));
    let killed_rx = Arc::new(tokio::sync::Mutex::new(Some(killed_rx)));
    let server = PgServer::builder()
        .hook(first_call_only(move |call| {
            let (pid_tx, killed_rx) = (pid_tx.clone(), killed_rx.clone());
            async move {
                let client = call.tx.client().await.expect("client");
                let pid: i32 = client
                    .query_one("SELECT pg_backend_pid()", &[])
                    .await
                    .expect("backend pid")
                    .get(0);
                drop(client);
                if let Some(sender) = pid_tx.lock().expect("pid slot").take() {
                    let _ = sender.send(pid);
                }
                if let Some(killed) = killed_rx.lock().await.take() {
                    let _ = tokio::time::timeout(PATIENCE, killed).await;
                }
                HookOutcome::default()
            }
        }))
        .spawn(&db)
        .await;

    let first = tokio::spawn({
        let addr = server.addr;
        async move { post(addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await }
    });
    let pid = tokio::time::timeout(PATIENCE, pid_rx)
        .await
        .expect("the handler reported its backend")
        .expect("pid");
    let terminated: bool = db
        .client()
        .await
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .expect("terminate")
        .get(0);
    assert!(terminated);
    let _ = killed_tx.send(());
    let failed = first.await.expect("first request");

    assert_eq!(
        failed.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{failed:?}"
    );
    assert_eq!(failed.error_code(), "internal_error");
    assert_eq!(
        db.order_count().await,
        0,
        "the killed transaction rolled back"
    );
    assert!(!db.record_exists("shop-a", "create_order", "key-1").await);

    let retry = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(db.order_count().await, 1);
    assert_eq!(db.record_count().await, 1);
}

/// Transaction control that a handler sends through its handle, in any spelling and through
/// any method, is refused before it reaches the server: nothing of the refused SQL runs (not
/// even the statements of a batch before it), the transaction goes on, and the layer commits
/// the order with its record. Savepoints stay allowed.
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn transaction_control_through_the_handle_is_refused_and_the_transaction_goes_on() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let problems: Arc<Mutex<Vec<String>>> = Arc::default();
    let server = PgServer::builder()
        .hook({
            let problems = problems.clone();
            hook(move |call| {
                let problems = problems.clone();
                async move {
                    let mut found = Vec::new();
                    let client = call.tx.client().await.expect("client");
                    let refused = |what: String, outcome: Result<(), Error>| match outcome {
                        Err(Error::TransactionControl(_)) => None,
                        other => Some(format!("{what}: not refused: {other:?}")),
                    };
                    for sql in [
                        "COMMIT; BEGIN",
                        "commit",
                        "END",
                        "ROLLBACK",
                        "ROLLBACK AND CHAIN",
                        "ABORT",
                        "BEGIN",
                        "START TRANSACTION",
                        "/* the layer commits */ COMMIT",
                        "-- a comment\nEND",
                        "SELECT 1; COMMIT",
                        "PREPARE TRANSACTION 'gid'",
                        "COMMIT PREPARED 'gid'",
                        "ROLLBACK PREPARED 'gid'",
                    ] {
                        found.extend(refused(
                            format!("batch_execute({sql:?})"),
                            client.batch_execute(sql).await,
                        ));
                        found.extend(refused(
                            format!("simple_query({sql:?})"),
                            client.simple_query(sql).await.map(drop),
                        ));
                        found.extend(refused(
                            format!("execute({sql:?})"),
                            client.execute(sql, &[]).await.map(drop),
                        ));
                        found.extend(refused(
                            format!("query({sql:?})"),
                            client.query(sql, &[]).await.map(drop),
                        ));
                        found.extend(refused(
                            format!("prepare({sql:?})"),
                            client.prepare(sql).await.map(drop),
                        ));
                    }
                    // A refused batch runs none of its statements, not even the first.
                    found.extend(refused(
                        "an insert then COMMIT".to_owned(),
                        client
                            .batch_execute(
                                "INSERT INTO orders (tenant_id, sku, quantity) \
                                 VALUES ('shop-a', 'before-commit', 1); COMMIT",
                            )
                            .await,
                    ));
                    // The transaction is still the layer's, and savepoints work inside it;
                    // a COMMIT inside a string or a dollar quote is only text.
                    if let Err(error) = client
                        .batch_execute(
                            "SAVEPOINT undo; \
                             INSERT INTO orders (tenant_id, sku, quantity) \
                             VALUES ('shop-a', 'undone', 1); \
                             ROLLBACK TO SAVEPOINT undo; RELEASE undo; \
                             SELECT 'COMMIT; BEGIN', $$ROLLBACK$$",
                        )
                        .await
                    {
                        found.push(format!("savepoints: {error}"));
                    }
                    problems.lock().expect("problems").extend(found);
                    HookOutcome::default()
                }
            })
        })
        .spawn(&db)
        .await;

    let reply = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(
        *problems.lock().expect("problems"),
        Vec::<String>::new(),
        "every transaction-control statement is refused, and nothing else"
    );
    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    let orders = db.orders().await;
    assert_eq!(orders.len(), 1, "only the handler's order: {orders:?}");
    assert_eq!(orders[0].0, reply.order_id());
    assert_eq!(orders[0].2, "book");
    assert_eq!(db.record_count().await, 1);
    let again = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert!(again.replayed());
    assert_eq!(again.body, reply.body);
    assert_eq!(db.order_count().await, 1);
}

/// `COMMIT; BEGIN` through the handle would commit the order with no record behind the
/// layer's back, and the retry would create a second one. It is refused instead: the handler
/// answers 500 on the error, its order rolls back with the transaction, and the retry with the
/// same key ends with exactly one order.
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn commit_then_begin_in_a_handler_leaves_no_order_without_a_record() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let refusal: Arc<Mutex<Option<String>>> = Arc::default();
    let server = PgServer::builder()
        .hook({
            let refusal = refusal.clone();
            first_call_only(move |call| {
                let refusal = refusal.clone();
                async move {
                    let client = call.tx.client().await.expect("client");
                    match client.batch_execute("COMMIT; BEGIN").await {
                        Ok(()) => HookOutcome::default(),
                        Err(error) => {
                            *refusal.lock().expect("refusal") = Some(error.to_string());
                            HookOutcome {
                                fail_with: Some(StatusCode::INTERNAL_SERVER_ERROR),
                            }
                        }
                    }
                }
            })
        })
        .spawn(&db)
        .await;

    let failed = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        failed.error_code(),
        "injected_failure",
        "the handler's own 500"
    );
    let refusal = refusal.lock().expect("refusal").clone();
    let refusal = refusal.expect("the handler got an error");
    assert!(
        refusal.contains("COMMIT refused") && refusal.contains("the layer commits"),
        "a clear refusal: {refusal}"
    );
    assert_eq!(db.order_count().await, 0, "no order without a record");
    assert!(!db.record_exists("shop-a", "create_order", "key-1").await);

    let retry = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    let again = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert!(again.replayed());
    assert_eq!(again.body, retry.body);
    let orders = db.orders().await;
    assert_eq!(orders.len(), 1, "exactly one order: {orders:?}");
    assert_eq!(orders[0].0, retry.order_id());
    assert_eq!(db.record_count().await, 1);
}

/// After the request, the handle refuses work: it cannot write outside the transaction.
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn handle_refuses_work_after_the_request() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let kept: Arc<Mutex<Option<PostgresTransaction>>> = Arc::default();
    let server = PgServer::builder()
        .hook({
            let kept = kept.clone();
            hook(move |call| {
                *kept.lock().expect("slot") = Some(call.tx);
                async { HookOutcome::default() }
            })
        })
        .spawn(&db)
        .await;

    let reply = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(reply.status, StatusCode::CREATED);

    let tx = kept
        .lock()
        .expect("slot")
        .take()
        .expect("the hook kept the handle");
    assert!(tx.is_finished());
    assert!(matches!(tx.client().await, Err(Error::TransactionFinished)));
}

/// A task that outlives its request while still borrowing the connection: the layer refuses
/// to commit under it (500), and the transaction rolls back once the task lets go.
#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn connection_still_borrowed_after_the_handler_is_not_committed() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let server = PgServer::builder()
        .layer(|layer| layer.with_lock_timeout(Duration::from_secs(5)))
        .hook(first_call_only(|call| async move {
            let client = call.tx.client().await.expect("client");
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(200)).await;
                drop(client);
            });
            HookOutcome::default()
        }))
        .spawn(&db)
        .await;

    let failed = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(
        failed.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{failed:?}"
    );
    // The retry waits on the key until the borrowed transaction is gone, then runs afresh.
    let retry = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(db.order_count().await, 1);
    assert_eq!(db.record_count().await, 1);
}
