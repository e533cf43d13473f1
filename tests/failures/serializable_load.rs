//! The PostgreSQL store at `SERIALIZABLE` under load, with a handler whose reads and writes
//! conflict: each request reads a hot row and writes it back incremented (read-then-write, the
//! pattern SERIALIZABLE aborts with `40001`), 64 clients at once, every key sent twice at the
//! same time. The layer runs a request whose transaction the database threw away again, within
//! its conflict retries, then answers `503` with `Retry-After`; clients retry those with the
//! same key. Never a `500`, never a duplicate: orders == keys, and the hot row counts exactly
//! one increment per order (no lost update, no increment of a rolled-back run).
//!
//! Needs `TEST_DATABASE_URL`; without it `cargo test` reports this test as ignored.

use support::common;
use support::pg_common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{post, SHOP_A};
use http::{header, StatusCode};
use pg_common::{hook, HookOutcome, PgServer, TestDb};
use tokio::sync::Semaphore;
use tower_idempotency::store::Isolation;

const KEYS: usize = 150;
const CLIENTS: usize = 64;
/// How often one client sends its key again after a `503`, at most.
const TRIES: usize = 40;

test! { serializable_read_then_write_under_load_keeps_one_order_per_key, postgres }
async fn serializable_read_then_write_under_load_keeps_one_order_per_key() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    db.execute(
        "CREATE TABLE hot (id INT PRIMARY KEY, n BIGINT NOT NULL); INSERT INTO hot VALUES (1, 0)",
    )
    .await;
    let server = PgServer::builder()
        .store(|options| {
            options
                .with_isolation(Isolation::Serializable)
                .with_max_connections(24)
        })
        .layer(|layer| layer.with_conflict_retries(5))
        .hook(hook(|call| async move {
            let outcome = async {
                let client = call.tx.client().await?;
                let row = client
                    .query_one("SELECT n FROM hot WHERE id = 1", &[])
                    .await?;
                let n: i64 = row.get(0);
                client
                    .execute("UPDATE hot SET n = $1 WHERE id = 1", &[&(n + 1)])
                    .await
            }
            .await;
            match outcome {
                Ok(_) => HookOutcome::default(),
                // As an application would: its own 500 on a database error.
                Err(_) => HookOutcome {
                    fail_with: Some(StatusCode::INTERNAL_SERVER_ERROR),
                },
            }
        }))
        .spawn(&db)
        .await;

    let started = Instant::now();
    let gate = Arc::new(Semaphore::new(CLIENTS));
    let mut clients = Vec::new();
    for key in 0..KEYS {
        for _duplicate in 0..2 {
            let (gate, addr) = (gate.clone(), server.addr);
            clients.push(tokio::spawn(async move {
                let _slot = gate.acquire_owned().await.expect("gate");
                let key = format!("hot-{key}");
                let mut busy = 0;
                for _ in 0..TRIES {
                    let reply = post(
                        addr,
                        Some(SHOP_A),
                        Some(&key),
                        r#"{"sku":"book","quantity":1}"#,
                        &[],
                    )
                    .await;
                    match reply.status {
                        StatusCode::CREATED => return (key, Ok((reply.order_id(), busy))),
                        StatusCode::SERVICE_UNAVAILABLE => {
                            assert!(
                                reply.headers.contains_key(header::RETRY_AFTER),
                                "a 503 says when to retry: {reply:?}"
                            );
                            busy += 1;
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        _ => return (key, Err(format!("{reply:?}"))),
                    }
                }
                (key, Err(format!("still 503 after {TRIES} tries")))
            }));
        }
    }
    let mut orders: HashMap<String, i64> = HashMap::new();
    let mut busy = 0;
    for client in clients {
        let (key, outcome) = client.await.expect("client");
        match outcome {
            Ok((order, answered_busy)) => {
                busy += answered_busy;
                if let Some(first) = orders.insert(key.clone(), order) {
                    assert_eq!(first, order, "both duplicates of {key} name one order");
                }
            }
            Err(reply) => panic!("{key}: neither 201 nor a retryable 503: {reply}"),
        }
    }
    let took = started.elapsed();
    assert_eq!(orders.len(), KEYS);
    assert_eq!(db.order_count().await, KEYS as i64, "orders == keys");
    assert_eq!(db.record_count().await, KEYS as i64);
    let n: i64 = db.value("SELECT n FROM hot WHERE id = 1", &[]).await;
    assert_eq!(
        n, KEYS as i64,
        "one increment per order: none lost, none of a rolled-back run"
    );
    let runs = server.app.handler_calls();
    assert!(
        runs > KEYS,
        "the handlers conflicted and ran again ({runs} runs for {KEYS} keys)"
    );
    eprintln!(
        "serializable: {KEYS} keys x2 at {CLIENTS} clients in {took:?}: {runs} handler runs, {busy} answers 503"
    );
}
