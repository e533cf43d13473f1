//! Serialization failures and deadlocks raised by the handler's own statements on the
//! PostgreSQL store: the handler answers `500` on the database error (as the example does), but
//! the transaction was rolled back under it by the database; the layer notices through the
//! handle and runs the request again in a fresh transaction, within `with_conflict_retries`,
//! then answers `503` with `Retry-After`. Never the handler's `500`.
//!
//! Needs `TEST_DATABASE_URL`; without it `cargo test` reports these tests as ignored.

use support::common;
use support::pg_common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use common::{post, Reply, PATIENCE, SHOP_A};
use http::{header, StatusCode};
use pg_common::{hook, HookOutcome, PgServer, TestDb};
use tokio::sync::{Barrier, Notify};
use tower_idempotency::store::tokio_postgres::tokio_postgres::error::SqlState;
use tower_idempotency::store::tokio_postgres::CheckedClient;
use tower_idempotency::store::Isolation;
use tower_idempotency::Error;

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

const STOCK: &str = "CREATE TABLE stock (sku TEXT PRIMARY KEY, reserved BIGINT NOT NULL); \
     INSERT INTO stock VALUES ('a', 0), ('b', 0)";

async fn reserved(db: &TestDb, sku: &str) -> i64 {
    db.client()
        .await
        .query_one("SELECT reserved FROM stock WHERE sku = $1", &[&sku])
        .await
        .expect("stock")
        .get(0)
}

/// Reserves one of `sku` through the request's transaction.
async fn reserve(client: &CheckedClient, sku: &str) -> Result<u64, Error> {
    client
        .execute(
            "UPDATE stock SET reserved = reserved + 1 WHERE sku = $1",
            &[&sku],
        )
        .await
}

/// The handler's answer to its stock statements, as the example's: `500` on a database
/// error, noting in `hit` whether the error was `code`.
fn answer(outcome: Result<u64, Error>, code: &SqlState, hit: &AtomicBool) -> HookOutcome {
    match outcome {
        Ok(_) => HookOutcome::default(),
        Err(error) => {
            if matches!(&error, Error::TokioPostgres(e) if e.code() == Some(code)) {
                hit.store(true, Ordering::SeqCst);
            }
            HookOutcome {
                fail_with: Some(StatusCode::INTERNAL_SERVER_ERROR),
            }
        }
    }
}

/// A fresh database with the `stock` table; `None` without PostgreSQL.
async fn stock_db() -> Option<TestDb> {
    let db = TestDb::create().await?;
    db.execute(STOCK).await;
    Some(db)
}

/// A REPEATABLE READ request whose row is updated by another transaction after its snapshot:
/// its own `UPDATE` of that row fails with `40001`. The handler answers 500 on it.
struct ConcurrentUpdate {
    /// The first run reached the point where the other transaction must update the row.
    snapshot_taken: Arc<Notify>,
    /// The other transaction has committed.
    updated: Arc<Notify>,
    /// The first run's `UPDATE` got the serialization failure.
    conflicted: Arc<AtomicBool>,
}

impl ConcurrentUpdate {
    fn new() -> Self {
        ConcurrentUpdate {
            snapshot_taken: Arc::new(Notify::new()),
            updated: Arc::new(Notify::new()),
            conflicted: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The order app on a REPEATABLE READ store whose handler reserves stock `a`; its first
    /// run waits for the test to update that row from outside.
    async fn server(&self, db: &TestDb, conflict_retries: u32) -> PgServer {
        let first = Arc::new(AtomicBool::new(true));
        let (snapshot_taken, updated, conflicted) = (
            self.snapshot_taken.clone(),
            self.updated.clone(),
            self.conflicted.clone(),
        );
        PgServer::builder()
            .store(|options| options.with_isolation(Isolation::RepeatableRead))
            .layer(move |layer| layer.with_conflict_retries(conflict_retries))
            .hook(hook(move |call| {
                let first = first.swap(false, Ordering::SeqCst);
                let (snapshot_taken, updated, conflicted) =
                    (snapshot_taken.clone(), updated.clone(), conflicted.clone());
                async move {
                    if first {
                        // The snapshot was taken by the transaction's first statements.
                        snapshot_taken.notify_one();
                        let _ = tokio::time::timeout(PATIENCE, updated.notified()).await;
                    }
                    let outcome = async {
                        let client = call.tx.client().await?;
                        reserve(&client, "a").await
                    }
                    .await;
                    answer(outcome, &SqlState::T_R_SERIALIZATION_FAILURE, &conflicted)
                }
            }))
            .spawn(db)
            .await
    }

    /// On a fresh stock database, the server with these conflict retries, sent `key-1` while
    /// stock `a` is updated from outside; `None` without PostgreSQL.
    async fn run(conflict_retries: u32) -> Option<(TestDb, ConcurrentUpdate, PgServer, Reply)> {
        let db = stock_db().await?;
        let scenario = ConcurrentUpdate::new();
        let server = scenario.server(&db, conflict_retries).await;
        let reply = scenario
            .post_with_a_concurrent_update(&db, &server, "key-1")
            .await;
        Some((db, scenario, server, reply))
    }

    /// Sends `key`, and updates stock `a` from another connection while the first run is
    /// inside its transaction.
    async fn post_with_a_concurrent_update(
        &self,
        db: &TestDb,
        server: &PgServer,
        key: &str,
    ) -> Reply {
        let request = tokio::spawn({
            let (addr, key) = (server.addr, key.to_owned());
            async move { post(addr, Some(SHOP_A), Some(&key), BOOK, &[]).await }
        });
        tokio::time::timeout(PATIENCE, self.snapshot_taken.notified())
            .await
            .expect("the handler took its snapshot");
        db.execute("UPDATE stock SET reserved = reserved + 1 WHERE sku = 'a'")
            .await;
        self.updated.notify_one();
        request.await.expect("request")
    }
}

test! { serialization_failure_in_a_handler_statement_runs_the_request_again, postgres }
async fn serialization_failure_in_a_handler_statement_runs_the_request_again() {
    let Some((db, scenario, server, reply)) = ConcurrentUpdate::run(3).await else {
        return;
    };

    assert!(
        scenario.conflicted.load(Ordering::SeqCst),
        "the first run's UPDATE hit a real serialization failure"
    );
    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    assert!(!reply.replayed());
    assert_eq!(
        server.app.handler_calls(),
        2,
        "run once more after the conflict"
    );
    let orders = db.orders().await;
    assert_eq!(orders.len(), 1, "exactly one order: {orders:?}");
    assert_eq!(orders[0].0, reply.order_id());
    assert_eq!(db.record_count().await, 1);
    assert_eq!(
        reserved(&db, "a").await,
        2,
        "the outside update and the retry's"
    );
    let again = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert!(again.replayed());
    assert_eq!(again.body, reply.body);
}

test! { serialization_failure_past_the_conflict_retries_answers_503_with_retry_after, postgres }
async fn serialization_failure_past_the_conflict_retries_answers_503_with_retry_after() {
    let Some((db, scenario, server, reply)) = ConcurrentUpdate::run(0).await else {
        return;
    };

    assert!(scenario.conflicted.load(Ordering::SeqCst));
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "never the handler's 500: {reply:?}"
    );
    assert_eq!(reply.error_code(), "busy_retry_later");
    assert!(
        reply.headers.contains_key(header::RETRY_AFTER),
        "{:?}",
        reply.headers
    );
    assert_eq!(server.app.handler_calls(), 1);
    assert_eq!(db.order_count().await, 0);
    assert_eq!(db.record_count().await, 0);
    assert_eq!(reserved(&db, "a").await, 1, "only the outside update");

    // The client's retry (the same key) runs afresh.
    let retry = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(db.order_count().await, 1);
    assert_eq!(db.record_count().await, 1);
    assert_eq!(reserved(&db, "a").await, 2);
}

test! { deadlock_between_two_handlers_runs_the_loser_again, postgres }
/// Two requests whose handlers lock two rows in opposite orders: PostgreSQL breaks the
/// deadlock by failing one handler's statement with `40P01`. That request runs again once the
/// other has committed; both end `201`, with one order each.
async fn deadlock_between_two_handlers_runs_the_loser_again() {
    let Some(db) = stock_db().await else {
        return;
    };
    let both_locked = Arc::new(Barrier::new(2));
    let first_runs: Arc<Mutex<HashSet<String>>> = Arc::default();
    let deadlocked = Arc::new(AtomicBool::new(false));
    let server = PgServer::builder()
        .hook({
            let (both_locked, first_runs, deadlocked) =
                (both_locked.clone(), first_runs.clone(), deadlocked.clone());
            hook(move |call| {
                let (both_locked, first_runs, deadlocked) =
                    (both_locked.clone(), first_runs.clone(), deadlocked.clone());
                async move {
                    let key = call.key.clone().unwrap_or_default();
                    let first = first_runs.lock().expect("keys").insert(key.clone());
                    let (one, other) = if key == "key-1" {
                        ("a", "b")
                    } else {
                        ("b", "a")
                    };
                    let outcome = async {
                        let client = call.tx.client().await?;
                        reserve(&client, one).await?;
                        if first {
                            // Each first run holds its first row before either takes its
                            // second: a deadlock.
                            let _ = tokio::time::timeout(PATIENCE, both_locked.wait()).await;
                        }
                        reserve(&client, other).await
                    }
                    .await;
                    answer(outcome, &SqlState::T_R_DEADLOCK_DETECTED, &deadlocked)
                }
            })
        })
        .spawn(&db)
        .await;

    let send = |key: &'static str| {
        let addr = server.addr;
        tokio::spawn(async move { post(addr, Some(SHOP_A), Some(key), BOOK, &[]).await })
    };
    let (first, second) = (send("key-1"), send("key-2"));
    let first = first.await.expect("key-1");
    let second = second.await.expect("key-2");

    assert!(
        deadlocked.load(Ordering::SeqCst),
        "one handler's statement hit a real deadlock"
    );
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(second.status, StatusCode::CREATED, "{second:?}");
    assert_eq!(server.app.handler_calls(), 3, "the loser ran once more");
    let orders = db.orders().await;
    assert_eq!(orders.len(), 2, "one order per key: {orders:?}");
    let mut order_ids = vec![first.order_id(), second.order_id()];
    order_ids.sort_unstable();
    assert_eq!(
        orders.iter().map(|order| order.0).collect::<Vec<_>>(),
        order_ids
    );
    assert_eq!(db.record_count().await, 2);
    assert_eq!(reserved(&db, "a").await, 2);
    assert_eq!(reserved(&db, "b").await, 2);
}
