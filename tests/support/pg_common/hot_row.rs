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

/// The hot rows: two counters, which the orders read and write back incremented; and a
/// ledger, which the orders count and add a row to.
pub const HOT_TABLE: &str = "CREATE TABLE hot (id INT PRIMARY KEY, n BIGINT NOT NULL); \
                             INSERT INTO hot VALUES (1, 0), (2, 0); \
                             CREATE TABLE ledger (seen BIGINT NOT NULL)";
/// Writes a counter back (`$1`: the value read, plus one; `$2`: the row).
pub const WRITE_HOT: &str = "UPDATE hot SET n = $1 WHERE id = $2";

/// How a handler reads and writes: both read-then-write, which SERIALIZABLE aborts with
/// `40001` when concurrent requests overlap.
#[derive(Clone, Copy, Debug)]
pub enum Shape {
    /// Reads hot row 1 and writes it back incremented: a lost update unless serialized, caught
    /// at the `UPDATE` (`could not serialize access due to concurrent update`).
    HotRow,
    /// Counts the ledger's rows and adds one with the count it saw: no row in common (a
    /// phantom), caught by the predicate locks at the `INSERT` or at the commit
    /// (`read/write dependencies among transactions`).
    Ledger,
}

impl Shape {
    /// What the handler reads: one number.
    pub fn read(self) -> &'static str {
        match self {
            Shape::HotRow => "SELECT n FROM hot WHERE id = 1",
            Shape::Ledger => "SELECT count(*) FROM ledger",
        }
    }

    /// What it writes, with one parameter: the number read (plus one for the counter).
    pub fn write(self, read: i64) -> (&'static str, i64) {
        match self {
            Shape::HotRow => ("UPDATE hot SET n = $1 WHERE id = 1", read + 1),
            Shape::Ledger => ("INSERT INTO ledger (seen) VALUES ($1)", read),
        }
    }

    /// Checks what the orders of `keys` keys wrote: one increment each, none lost and none of
    /// a rolled-back run; or one ledger row each, every one seeing the rows before it (as if
    /// the orders ran one at a time: counts 0 to `keys - 1`).
    pub async fn check(self, db: &TestDb, keys: usize) {
        match self {
            Shape::HotRow => {
                let n: i64 = db.value("SELECT n FROM hot WHERE id = 1", &[]).await;
                assert_eq!(n, keys as i64, "one increment per order");
            }
            Shape::Ledger => {
                let seen: Vec<i64> = db
                    .client()
                    .await
                    .query("SELECT seen FROM ledger ORDER BY seen", &[])
                    .await
                    .expect("the ledger")
                    .iter()
                    .map(|row| row.get(0))
                    .collect();
                let serial: Vec<i64> = (0..keys as i64).collect();
                assert_eq!(seen, serial, "one row per order, as if one at a time");
            }
        }
    }
}

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
/// completed record per key, each key's `201`s naming one order.
pub async fn check_one_order_per_key(db: &TestDb, answers: &Answers, keys: usize) {
    assert_eq!(answers.orders.len(), keys);
    assert_eq!(db.order_count().await, keys as i64, "orders == keys");
    assert_eq!(db.record_count().await, keys as i64);
}
