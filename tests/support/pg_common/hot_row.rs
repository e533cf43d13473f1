//! A hot row under load at `SERIALIZABLE`, for either PostgreSQL store: the table, the
//! clients that send every key twice at once and retry a `503` with the same key, and what
//! must hold after (orders == keys, one increment of the hot row per order).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{header, StatusCode};
use tokio::sync::Semaphore;

use super::TestDb;
use crate::common::{post, SHOP_A};

/// The hot row: one counter every order reads and writes back incremented.
pub const HOT_TABLE: &str =
    "CREATE TABLE hot (id INT PRIMARY KEY, n BIGINT NOT NULL); INSERT INTO hot VALUES (1, 0)";
/// Reads the hot counter.
pub const READ_HOT: &str = "SELECT n FROM hot WHERE id = 1";
/// Writes it back (`$1`: the value read, plus one).
pub const WRITE_HOT: &str = "UPDATE hot SET n = $1 WHERE id = 1";

/// How many keys, and how many clients at once.
#[derive(Clone, Copy, Debug)]
pub struct Load {
    pub keys: usize,
    pub clients: usize,
    /// How often one client sends its key again after a `503`, at most.
    pub tries: usize,
}

impl Default for Load {
    fn default() -> Self {
        Load {
            keys: 150,
            clients: 64,
            tries: 40,
        }
    }
}

/// What the clients got.
#[derive(Debug)]
pub struct Answers {
    /// The order id each key's `201`s named (the same for both duplicates).
    pub orders: HashMap<String, i64>,
    /// How many `503`s (each with `Retry-After`) the clients retried.
    pub busy: usize,
    /// The most `503`s one client retried.
    pub most_busy: usize,
    pub took: Duration,
}

/// Sends `POST /orders` for every key twice at once (`load.clients` at a time), each client
/// retrying a `503` (which must carry `Retry-After`) with the same key. Panics on any other
/// answer, or on a key whose two `201`s name two orders.
pub async fn send_every_key_twice(addr: SocketAddr, prefix: &str, load: Load) -> Answers {
    let started = Instant::now();
    let gate = Arc::new(Semaphore::new(load.clients));
    let mut clients = Vec::new();
    for key in 0..load.keys {
        for _duplicate in 0..2 {
            let gate = gate.clone();
            let key = format!("{prefix}-{key}");
            clients.push(tokio::spawn(async move {
                let _slot = gate.acquire_owned().await.expect("gate");
                let mut busy = 0;
                for _ in 0..load.tries {
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
                (key, Err(format!("still 503 after {} tries", load.tries)))
            }));
        }
    }
    let mut orders: HashMap<String, i64> = HashMap::new();
    let (mut busy, mut most_busy) = (0, 0);
    for client in clients {
        let (key, outcome) = client.await.expect("client");
        match outcome {
            Ok((order, answered_busy)) => {
                busy += answered_busy;
                most_busy = most_busy.max(answered_busy);
                if let Some(first) = orders.insert(key.clone(), order) {
                    assert_eq!(first, order, "both duplicates of {key} name one order");
                }
            }
            Err(reply) => panic!("{key}: neither 201 nor a retryable 503: {reply}"),
        }
    }
    Answers {
        orders,
        busy,
        most_busy,
        took: started.elapsed(),
    }
}

/// Checks the database after [`send_every_key_twice`] on a fresh schema: one order and one
/// completed record per key, and the hot row incremented once per order (none lost, none of
/// a rolled-back run).
pub async fn check_one_order_and_one_increment_per_key(
    db: &TestDb,
    answers: &Answers,
    keys: usize,
) {
    assert_eq!(answers.orders.len(), keys);
    assert_eq!(db.order_count().await, keys as i64, "orders == keys");
    assert_eq!(db.record_count().await, keys as i64);
    let n: i64 = db.value(READ_HOT, &[]).await;
    assert_eq!(
        n, keys as i64,
        "one increment per order: none lost, none of a rolled-back run"
    );
}
