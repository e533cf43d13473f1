//! The MySQL store on a three-node MariaDB Galera cluster (a multi-primary cluster): each test
//! starts a cluster of its own (`support::galera`) and runs app instances each on another
//! node. Reported as ignored where MariaDB, the Galera provider or mariadb-backup is missing.
//!
//! Galera decides conflicts between nodes at commit (certification): the reservation's row
//! lock holds a duplicate back only on its own node, so duplicates sent to two nodes at once
//! both run their handler, and the one certified second is rolled back (`1213` at `COMMIT`, or
//! its transaction aborted by the winner's rows applied on its node).
//!
//! - Duplicates racing across two nodes: one order per key, and every `201` names an order
//!   that exists, the same for every duplicate.

use support::apps::process::ExampleProcess;
use support::common;
use support::galera::GaleraDb;
use support::pg_common::HookOutcome;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::server_backed::OrderServer;
use common::{AppBuilder, HookFor, OrderCallOf, Post, Reply, SHOP_A};
use http::StatusCode;
use tokio::sync::Semaphore;
use tower_idempotency::store::sqlx_mysql::{SqlxHandle, SqlxMySqlStore};

type Hook = HookFor<OrderCallOf<SqlxHandle>, HookOutcome>;
type Server = OrderServer<SqlxMySqlStore, SqlxHandle, HookOutcome>;

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

/// The order app on `store`.
async fn serve(store: SqlxMySqlStore) -> Server {
    AppBuilder::<SqlxMySqlStore, Hook, ()>::new(())
        .serve_on(store)
        .await
}

/// Sends `body` under `key` as shop-a, again while the answer is `503` (a conflict past the
/// layer's retries, or a node that went away), as a client that honours `Retry-After` does;
/// every answer, the last one other than `503`.
async fn post_until_answered(addr: SocketAddr, key: &str, body: &str) -> Vec<Reply> {
    let mut replies = Vec::new();
    for _ in 0..50 {
        let reply = Post::order(key, body).token(Some(SHOP_A)).send(addr).await;
        let busy = reply.status == StatusCode::SERVICE_UNAVAILABLE;
        replies.push(reply);
        if !busy {
            return replies;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{key}: busy for 50 attempts");
}

test! { duplicates_racing_across_two_nodes_get_one_order_that_exists, multi_thread = 2, galera }

/// Two `orders_mysql` example processes, each on another node, as a user runs them.
async fn duplicates_racing_across_two_nodes_get_one_order_that_exists() {
    let db = GaleraDb::create().await;
    let one = ExampleProcess::start("orders_mysql", &["--database-url", &db.cluster.url(0)]).await;
    let two = ExampleProcess::start("orders_mysql", &["--database-url", &db.cluster.url(1)]).await;
    race_duplicates(&db, one.addr, two.addr).await;
    one.kill().await;
    two.kill().await;
}

test! { duplicates_racing_across_two_nodes_in_process, multi_thread = 2, galera }

/// The same with the tests' order app, in this process.
async fn duplicates_racing_across_two_nodes_in_process() {
    let db = GaleraDb::create().await;
    let one = serve(db.store(0, 16).await).await;
    let two = serve(db.store(1, 16).await).await;
    race_duplicates(&db, one.addr, two.addr).await;
    eprintln!(
        "{} handler calls",
        one.app.handler_calls() + two.app.handler_calls()
    );
    one.shutdown().await;
    two.shutdown().await;
}

/// Sends each of 300 keys to both instances at once: one order per key, and every `201`
/// names the key's order, which exists.
async fn race_duplicates(db: &GaleraDb, one: SocketAddr, two: SocketAddr) {
    // Each key is sent to both instances at once, with `IN_FLIGHT` keys at a time.
    const KEYS: usize = 300;
    const IN_FLIGHT: usize = 64;
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut sends = Vec::new();
    for n in 0..KEYS {
        let key = format!("race-{n}");
        let slot = slots.clone().acquire_owned().await.expect("a slot");
        sends.push(tokio::spawn(async move {
            let (at_one, at_two) = tokio::join!(
                post_until_answered(one, &key, BOOK),
                post_until_answered(two, &key, BOOK)
            );
            drop(slot);
            (key, [at_one, at_two])
        }));
    }
    let mut answers: BTreeMap<String, Vec<Reply>> = BTreeMap::new();
    let mut busy = 0;
    for send in sends {
        let (key, both) = send.await.expect("a send");
        for mut replies in both {
            let last = replies.pop().expect("an answer");
            busy += replies.len();
            answers.entry(key.clone()).or_default().push(last);
        }
    }
    let orders = db.order_ids().await;
    let recorded: BTreeMap<String, i64> = db.recorded_orders().await.into_iter().collect();
    let mut wrong = Vec::new();
    for (key, replies) in &answers {
        for reply in replies {
            assert_eq!(reply.status, StatusCode::CREATED, "{key}: {reply:?}");
            let id = reply.order_id();
            if orders.binary_search(&id).is_err() || recorded.get(key) != Some(&id) {
                wrong.push(format!(
                    "{key}: answered order {id}, recorded {:?}",
                    recorded.get(key)
                ));
            }
        }
    }
    eprintln!(
        "galera race: {} orders, {} records, {busy} answers 503 retried",
        orders.len(),
        recorded.len(),
    );
    assert!(
        wrong.is_empty(),
        "{} answers name an order that is not the key's: {wrong:#?}",
        wrong.len()
    );
    assert_eq!(orders.len(), KEYS, "one order per key");
    assert_eq!(recorded.len(), KEYS, "one record per key");
}
