//! The MySQL store on a three-node MariaDB Galera cluster (a multi-primary cluster): each test
//! starts a cluster of its own (`support::galera`) and runs app instances each on another
//! node, each store's pool on its node. Reported as ignored where MariaDB, the Galera provider
//! or mariadb-backup is missing.
//!
//! Galera decides conflicts between nodes at commit (certification): the reservation's row
//! lock holds a duplicate back only on its own node, so duplicates sent to two nodes at once
//! both run their handler, and the one certified second is rolled back (`1213` at `COMMIT`, or
//! its transaction aborted by the winner's rows applied on its node, the deadlock then reported
//! on the statement after `COMMIT`); the layer runs it again, and it replays.
//!
//! - Duplicates racing across two nodes (the example program, and the tests' app in this
//!   process): one order per key, and every `201` names an order that exists, the same for
//!   every duplicate.
//! - A node killed with SIGKILL under load, the client sending again to the instance on another
//!   node (a store's pool is on one node): nothing lost, nothing doubled; the node started
//!   again rejoins (a full state transfer with mariabackup) and has every order.
//! - Outbox relays on two nodes; steps racing across two nodes (one provider call per key), the
//!   tables created on two nodes at once.
//! - `SERIALIZABLE` refused on a Galera node, taken on a plain server.

use support::apps::process::ExampleProcess;
use support::common;
use support::common::ChargeProvider;
use support::galera::GaleraDb;
use support::mysql_common::TestDb;
use support::pg_common::HookOutcome;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::routing::post as route_post;
use axum::{Json, Router};
use common::process::client;
use common::server_backed::OrderServer;
use common::{hook_for, AppBuilder, HookFor, OrderCallOf, Post, Reply, SHOP_A};
use http::StatusCode;
use serde_json::json;
use tokio::sync::Semaphore;
use tower_idempotency::outbox::{sink_fn, Enqueue, Outbox, OutboxEvent, Relay};
use tower_idempotency::steps::{CallAgain, StepError, StepStore, Steps};
use tower_idempotency::store::sqlx_mysql::{sqlx, SqlxMySqlHandle, SqlxMySqlStore};
use tower_idempotency::store::Isolation;
use tower_idempotency::{IdempotencyLayer, Tenant};

type Hook = HookFor<OrderCallOf<SqlxMySqlHandle>, HookOutcome>;
type Server = OrderServer<SqlxMySqlStore, SqlxMySqlHandle, HookOutcome>;

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

// ----- a node killed under load -----

/// How long one request may take before the client gives it up (its node was killed).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// How the load of [`load_with_failover`] went.
#[derive(Debug, Default)]
struct Load {
    /// Each key's `201` order ids.
    created: BTreeMap<String, Vec<i64>>,
    /// Statuses other than `201` and `503`, with the key.
    unexpected: Vec<(String, StatusCode)>,
    /// Sends cut off or answered `503`, sent again to the other instance.
    failed_over: usize,
}

/// Sends each of `keys` keys until it is answered `201`, `clients` at a time, first to the
/// instance the key picks and, after a `503` or no answer, to the other one (the client fails
/// over: each store has one node); `event` runs once `after` keys are answered, under the load.
async fn load_with_failover(
    instances: [SocketAddr; 2],
    keys: usize,
    clients: usize,
    after: usize,
    event: impl std::future::Future<Output = ()>,
) -> Load {
    let load = Arc::new(Mutex::new(Load::default()));
    let next = Arc::new(AtomicUsize::new(0));
    let answered = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..clients)
        .map(|_| {
            let (load, next, answered) = (load.clone(), next.clone(), answered.clone());
            tokio::spawn(async move {
                let client = client();
                loop {
                    let n = next.fetch_add(1, Ordering::SeqCst);
                    if n >= keys {
                        return;
                    }
                    let key = format!("load-{n}");
                    for attempt in 0usize.. {
                        let addr = instances[(n + attempt) % 2];
                        let reply = Post::order(&key, BOOK)
                            .token(Some(SHOP_A))
                            .try_send(&client, addr, REQUEST_TIMEOUT)
                            .await;
                        let created = {
                            let mut load = load.lock().unwrap();
                            match reply {
                                Some(reply) if reply.status == StatusCode::CREATED => {
                                    load.created
                                        .entry(key.clone())
                                        .or_default()
                                        .push(reply.order_id());
                                    true
                                }
                                Some(reply) if reply.status != StatusCode::SERVICE_UNAVAILABLE => {
                                    load.unexpected.push((key.clone(), reply.status));
                                    load.failed_over += 1;
                                    false
                                }
                                _ => {
                                    load.failed_over += 1;
                                    false
                                }
                            }
                        };
                        if created {
                            answered.fetch_add(1, Ordering::SeqCst);
                            break;
                        }
                        assert!(attempt < 200, "{key}: never answered 201");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            })
        })
        .collect();
    while answered.load(Ordering::SeqCst) < after {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    event.await;
    for worker in workers {
        worker.await.expect("a client");
    }
    let load = std::mem::take(&mut *load.lock().unwrap());
    load
}

test! { a_node_killed_under_load_loses_and_duplicates_nothing, multi_thread = 2, galera }

/// Two app instances, on nodes 0 and 1; node 1's `mariadbd` is killed (SIGKILL) under load.
/// The cluster goes on with two nodes; the instance on the killed node answers `503`, and the
/// client sends again to the other instance. Every key ends with one order, and every `201`
/// it got (before the kill, from either instance, and its replay after) names that order.
/// Then the killed node starts again, rejoins, and has every order.
async fn a_node_killed_under_load_loses_and_duplicates_nothing() {
    let mut db = GaleraDb::create().await;
    let one = serve(db.store(0, 16).await).await;
    let two = serve(db.store(1, 16).await).await;
    const KEYS: usize = 400;
    let cluster = &mut db.cluster;
    let mut load = load_with_failover([one.addr, two.addr], KEYS, 32, KEYS / 3, async {
        cluster.kill(1);
    })
    .await;
    db.cluster.wait_for_size(0, 2).await;
    // Every key once more, from the instance on a live node: a replay of its one order.
    for n in 0..KEYS {
        let key = format!("load-{n}");
        let replay = Post::order(&key, BOOK)
            .token(Some(SHOP_A))
            .send(one.addr)
            .await;
        assert_eq!(replay.status, StatusCode::CREATED, "{key}: {replay:?}");
        assert!(replay.replayed(), "{key}: a replay");
        load.created.entry(key).or_default().push(replay.order_id());
    }
    eprintln!(
        "galera kill: {} keys, {} sends failed over",
        load.created.len(),
        load.failed_over
    );
    assert!(load.unexpected.is_empty(), "{:?}", load.unexpected);
    assert!(load.failed_over > 0, "the kill was under load");
    let orders = db.order_ids().await;
    let recorded: BTreeMap<String, i64> = db.recorded_orders().await.into_iter().collect();
    for (key, ids) in &load.created {
        assert!(ids.iter().all(|id| *id == ids[0]), "{key}: {ids:?}");
        assert!(
            orders.binary_search(&ids[0]).is_ok(),
            "{key}: order {} exists",
            ids[0]
        );
        assert_eq!(recorded.get(key), Some(&ids[0]), "{key}");
    }
    assert_eq!(orders.len(), KEYS, "one order per key");
    assert_eq!(recorded.len(), KEYS, "one record per key");
    one.shutdown().await;
    two.shutdown().await;

    // The killed node rejoins, and has every order and record.
    let down = std::time::Instant::now();
    db.cluster.restart(1).await;
    db.cluster.wait_for_size(0, 3).await;
    let log = db.cluster.log(1);
    let transfer = if log.contains("mariabackup SST completed on joiner") {
        "a full copy (mariabackup)"
    } else {
        "an incremental transfer"
    };
    eprintln!(
        "galera kill: node 1 rejoined in {:.1} s by {transfer}",
        down.elapsed().as_secs_f64()
    );
    let mut rejoined = db.cluster.connect(1, Some("tidem")).await;
    sqlx::Executor::execute(&mut rejoined, "SET SESSION wsrep_sync_wait = 1")
        .await
        .expect("set wsrep_sync_wait");
    let on_rejoined: Vec<i64> = sqlx::query_scalar("SELECT id FROM orders ORDER BY id")
        .fetch_all(&mut rejoined)
        .await
        .expect("orders on the rejoined node");
    assert_eq!(on_rejoined, orders, "the rejoined node has every order");
}

// ----- the outbox relay -----

test! { relays_on_two_nodes_deliver_every_event, multi_thread = 2, galera }

/// Orders on two nodes enqueue an event each in their transaction; a relay on each of the two
/// nodes claims and delivers at once. A claim is a locking read that skips rows held by other
/// relays, but the row locks are a node's own: both relays may claim the same event, and the
/// claim certified second is rolled back at `COMMIT` (its round fails, nothing delivered).
async fn relays_on_two_nodes_deliver_every_event() {
    let db = GaleraDb::create().await;
    let stores = [db.store(0, 8).await, db.store(1, 8).await];
    let outboxes = [
        Outbox::install(&stores[0])
            .await
            .expect("install the outbox"),
        Outbox::install(&stores[1]).await.expect("install it again"),
    ];
    let enqueuing: Hook = hook_for(|call: OrderCallOf<SqlxMySqlHandle>| async move {
        let payload = json!({ "order_id": call.order_id });
        call.tx
            .enqueue("order_created", payload)
            .await
            .expect("enqueue");
        HookOutcome::default()
    });
    let apps = [
        AppBuilder::<SqlxMySqlStore, Hook, ()>::new(())
            .hook(enqueuing.clone())
            .serve_on(stores[0].clone())
            .await,
        AppBuilder::<SqlxMySqlStore, Hook, ()>::new(())
            .hook(enqueuing)
            .serve_on(stores[1].clone())
            .await,
    ];
    const EVENTS: usize = 60;
    let mut order_ids = Vec::new();
    for n in 0..EVENTS {
        let reply = post_until_answered(apps[n % 2].addr, &format!("ev-{n}"), BOOK)
            .await
            .pop()
            .expect("an answer");
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        order_ids.push(reply.order_id());
    }
    let delivered = Arc::new(Mutex::new(Vec::<i64>::new()));
    let failed_rounds = Arc::new(AtomicUsize::new(0));
    let relays: Vec<_> = outboxes
        .into_iter()
        .map(|outbox| {
            let (delivered, failed_rounds) = (delivered.clone(), failed_rounds.clone());
            let sink = sink_fn(move |event: OutboxEvent| {
                let delivered = delivered.clone();
                async move {
                    let payload: serde_json::Value =
                        serde_json::from_str(event.payload()).unwrap_or_default();
                    delivered
                        .lock()
                        .unwrap()
                        .push(payload["order_id"].as_i64().unwrap_or(-1));
                    Ok::<(), std::io::Error>(())
                }
            });
            tokio::spawn(async move {
                let mut relay = Relay::new(outbox.clone(), sink).with_batch_size(5);
                let mut idle = 0;
                while idle < 3 {
                    match relay.run_once().await {
                        Ok(round) if round.claimed == 0 => idle += 1,
                        Ok(_) => idle = 0,
                        Err(error) => {
                            assert!(error.is_busy(), "a relay round: {error}");
                            failed_rounds.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
                outbox
            })
        })
        .collect();
    let mut outbox = None;
    for relay in relays {
        outbox = Some(relay.await.expect("a relay"));
    }
    let mut delivered = std::mem::take(&mut *delivered.lock().unwrap());
    delivered.sort_unstable();
    order_ids.sort_unstable();
    eprintln!(
        "galera relays: {} deliveries of {EVENTS} events, {} rounds failed",
        delivered.len(),
        failed_rounds.load(Ordering::SeqCst)
    );
    assert_eq!(delivered, order_ids, "each event delivered once");
    let counts = outbox.unwrap().counts().await.expect("outbox counts");
    assert_eq!(
        (counts.delivered, counts.pending, counts.dead),
        (EVENTS as u64, 0, 0)
    );
    for app in apps {
        app.shutdown().await;
    }
}

// ----- steps -----

/// A foreign provider that charges once per key: its calls, and the charge of each key.
/// `POST /checkouts`: a local step (an order) and a foreign one (a charge).
async fn checkout(
    State(provider): State<ChargeProvider>,
    steps: Steps<SqlxMySqlStore>,
) -> Result<(StatusCode, Json<serde_json::Value>), StepError> {
    let order_id = steps
        .local("insert_order", |tx: SqlxMySqlHandle| async move {
            let mut conn = tx.acquire().await?;
            let done = sqlx::query(
                "INSERT INTO orders (tenant_id, sku, quantity) VALUES ('steps', 'book', 1)",
            )
            .execute(&mut *conn)
            .await?;
            Ok(i64::try_from(done.last_insert_id()).unwrap_or(-1))
        })
        .await?;
    let charge = steps
        .foreign("charge", CallAgain, |key| async move {
            Ok::<_, tower_idempotency::steps::Foreign>(provider.charge(key))
        })
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({"order_id": order_id, "charge_id": charge})),
    ))
}

test! { steps_racing_across_two_nodes_call_the_provider_once_per_key, multi_thread = 2, galera }

/// The checkout route on two nodes, each key sent to both at once: one charge and one order
/// per key, the same answer for both.
async fn steps_racing_across_two_nodes_call_the_provider_once_per_key() {
    let db = GaleraDb::create().await;
    let provider = ChargeProvider::default();
    // Both instances create the tables at once, each on its node: `GET_LOCK` holds on one
    // node only, the DDL is replicated in total order, and `IF NOT EXISTS` takes the second.
    let stores = [
        SqlxMySqlStore::new(db.pool(0, 8).await),
        SqlxMySqlStore::new(db.pool(1, 8).await),
    ];
    let (first, second) = tokio::join!(stores[0].migrate(), stores[1].migrate());
    first
        .and(second)
        .expect("create the records table on two nodes at once");
    let (first, second) = tokio::join!(stores[0].install_steps(), stores[1].install_steps());
    first
        .and(second)
        .expect("create the steps' table on two nodes at once");
    let mut servings = Vec::new();
    for store in stores {
        let layer = IdempotencyLayer::new(store)
            .with_operation("checkout")
            .with_lock_timeout(Duration::from_secs(5))
            .with_step_lease(Duration::from_secs(10));
        let router = Router::new()
            .route("/checkouts", route_post(checkout).layer(layer))
            .layer(axum::Extension(Tenant::new("shop-a")))
            .with_state(provider.clone());
        servings.push(common::Serving::start(router).await);
    }
    const KEYS: usize = 40;
    let mut sends = Vec::new();
    for n in 0..KEYS {
        for serving in &servings {
            let addr = serving.addr;
            sends.push(tokio::spawn(async move {
                let key = format!("steps-{n}");
                let mut replies = Vec::new();
                for _ in 0..50 {
                    let reply = Post::order(&key, r#"{"sku":"book"}"#)
                        .path("/checkouts")
                        .send(addr)
                        .await;
                    let again = matches!(
                        reply.status,
                        StatusCode::SERVICE_UNAVAILABLE | StatusCode::CONFLICT
                    );
                    replies.push(reply);
                    if !again {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                (key, replies)
            }));
        }
    }
    let mut answers: BTreeMap<String, Vec<Reply>> = BTreeMap::new();
    let mut again = 0;
    for send in sends {
        let (key, mut replies) = send.await.expect("a send");
        let last = replies.pop().expect("an answer");
        again += replies.len();
        answers.entry(key).or_default().push(last);
    }
    for (key, replies) in &answers {
        for reply in replies {
            assert_eq!(reply.status, StatusCode::CREATED, "{key}: {reply:?}");
            assert_eq!(reply.body, replies[0].body, "{key}");
        }
    }
    let calls = provider.calls();
    eprintln!(
        "galera steps: {calls} provider calls for {KEYS} keys, {again} answers 503/409 retried"
    );
    assert_eq!(calls, KEYS, "one call per key");
    assert_eq!(
        db.count("SELECT count(*) FROM orders WHERE tenant_id = 'steps'")
            .await,
        KEYS as i64,
        "one order per key"
    );
    for serving in servings {
        serving.stop().await;
    }
}

// ----- what a Galera node refuses -----

test! { serializable_is_refused_on_a_galera_node, galera }

/// Request transactions at `SERIALIZABLE` would be serializable on one node only: the store
/// refuses them when it installs its tables, and says why.
async fn serializable_is_refused_on_a_galera_node() {
    let db = GaleraDb::create().await;
    let store = SqlxMySqlStore::builder(db.pool(0, 2).await)
        .with_isolation(Isolation::Serializable)
        .build();
    let refused = store.migrate().await.expect_err("refused on a Galera node");
    assert!(
        refused.to_string().contains("Galera") && refused.to_string().contains("SERIALIZABLE"),
        "{refused}"
    );
    let steps = store
        .install_steps()
        .await
        .expect_err("refused on a Galera node");
    assert!(steps.to_string().contains("Galera"), "{steps}");
    // The other levels are taken.
    for isolation in [Isolation::ReadCommitted, Isolation::RepeatableRead] {
        SqlxMySqlStore::builder(db.pool(1, 2).await)
            .with_isolation(isolation)
            .build()
            .migrate()
            .await
            .unwrap_or_else(|error| panic!("{isolation:?}: {error}"));
    }
}

test! { serializable_is_taken_on_a_server_that_is_no_galera_node, mysql }

/// The same store on a plain server (`TEST_MYSQL_URL`): `SERIALIZABLE` is what it says there.
async fn serializable_is_taken_on_a_server_that_is_no_galera_node() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    SqlxMySqlStore::builder(db.pool(2).await)
        .with_isolation(Isolation::Serializable)
        .build()
        .migrate()
        .await
        .expect("SERIALIZABLE on a server that is no Galera node");
}
