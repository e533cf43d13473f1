//! Crash test: the example server (`examples/orders.rs`) as a child process on one SQLite file,
//! killed with SIGKILL in the middle of concurrent load and started again, several times.
//!
//! The promise under test: a retry never creates a second order and never loses the first.
//! After the rounds, every key is resent until it is answered, and then:
//! - every key that ever received a `201` gets the same body back;
//! - there are exactly as many orders as distinct keys, each with the key's own payload;
//! - every order has exactly one saved record and every record its order;
//! - the database passes `PRAGMA integrity_check`.
//!
//! The payloads and the schedule come from a seed printed at the start; `STRESS_SEED=<seed>`
//! replays a run.

use support::common;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::process::{self, OrdersProcess, Rng};
use common::{Post, SHOP_A, SHOP_B};
use http::StatusCode;

/// Concurrent clients.
const CLIENTS: usize = 16;
/// Distinct `(tenant, key)` scopes.
const SCOPES: usize = 1000;
/// Kill-and-restart rounds under load.
const ROUNDS: usize = 12;
/// How long one request may take before the client gives up on it (a killed server).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// A bound on one round, for a server that never answers.
const ROUND_PATIENCE: Duration = Duration::from_secs(20);
/// A bound on the whole final pass, for a server that never answers.
const FINAL_PASS_PATIENCE: Duration = Duration::from_secs(60);

/// One scope and the payload every send of it carries.
#[derive(Debug)]
struct Plan {
    token: &'static str,
    tenant: &'static str,
    key: String,
    sku: String,
    quantity: i64,
}

impl Plan {
    fn request(&self) -> Post {
        let body = serde_json::json!({ "sku": self.sku, "quantity": self.quantity });
        Post::order(&self.key, &body.to_string()).token(Some(self.token))
    }
}

fn plans(rng: &mut Rng) -> Vec<Plan> {
    (0..SCOPES)
        .map(|i| {
            // Each key name is used by both tenants: independent scopes.
            let (token, tenant) = if i % 2 == 0 {
                (SHOP_A, "shop-a")
            } else {
                (SHOP_B, "shop-b")
            };
            let len = 1 + rng.below(40) as usize;
            let sku = (0..len)
                .map(|_| char::from(b'a' + rng.below(26) as u8))
                .collect();
            Plan {
                token,
                tenant,
                key: format!("crash-{}", i / 2),
                sku,
                quantity: 1 + rng.below(100) as i64,
            }
        })
        .collect()
}

/// What the clients saw, shared by all of them.
#[derive(Default)]
struct Observed {
    /// The body of the first `201` of each scope (index into the plans).
    created: BTreeMap<usize, Bytes>,
    /// Answers by status, over the whole run.
    statuses: BTreeMap<u16, usize>,
    /// Requests that got no answer (cut by a kill).
    cut: usize,
}

impl Observed {
    /// Records a `201` and checks it against the first one of its scope.
    fn created(&mut self, scope: usize, plan: &Plan, body: &Bytes) {
        match self.created.get(&scope) {
            Some(first) => assert_eq!(
                first, body,
                "{}/{}: a second 201 with another body",
                plan.tenant, plan.key
            ),
            None => {
                self.created.insert(scope, body.clone());
            }
        }
    }
}

/// One round: `CLIENTS` clients take sends from the queue until the server is killed under
/// them (a send without an answer goes back to the queue). The kill lands once `kill_after`
/// answers came back (so in the middle of the load however fast the machine is), or after
/// [`ROUND_PATIENCE`]. Returns how many requests were in flight when the kill landed.
async fn round(
    server: OrdersProcess,
    plans: &Arc<Vec<Plan>>,
    queue: &Arc<Mutex<VecDeque<usize>>>,
    observed: &Arc<Mutex<Observed>>,
    kill_after: usize,
) -> usize {
    let addr = server.addr;
    let in_flight = Arc::new(AtomicUsize::new(0));
    let answered = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (plans, queue, observed) = (plans.clone(), queue.clone(), observed.clone());
            let (in_flight, answered) = (in_flight.clone(), answered.clone());
            tokio::spawn(async move {
                let client = process::client();
                loop {
                    let Some(scope) = queue.lock().expect("queue").pop_front() else {
                        return;
                    };
                    let plan = &plans[scope];
                    in_flight.fetch_add(1, Ordering::SeqCst);
                    let reply = plan
                        .request()
                        .try_send(&client, addr, REQUEST_TIMEOUT)
                        .await;
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                    let mut seen = observed.lock().expect("observed");
                    let Some(reply) = reply else {
                        // The server is gone: this send is retried in a later round.
                        seen.cut += 1;
                        queue.lock().expect("queue").push_back(scope);
                        return;
                    };
                    answered.fetch_add(1, Ordering::SeqCst);
                    *seen.statuses.entry(reply.status.as_u16()).or_default() += 1;
                    match reply.status {
                        StatusCode::CREATED => seen.created(scope, plan, &reply.body),
                        // Retryable with the same key: send it again later.
                        StatusCode::SERVICE_UNAVAILABLE => {
                            assert!(reply.header("retry-after").is_some(), "{reply:?}");
                            queue.lock().expect("queue").push_back(scope);
                        }
                        _ => panic!("{}/{}: unexpected {reply:?}", plan.tenant, plan.key),
                    }
                }
            })
        })
        .collect();

    let started = Instant::now();
    while answered.load(Ordering::SeqCst) < kill_after && started.elapsed() < ROUND_PATIENCE {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let cut_in_flight = in_flight.load(Ordering::SeqCst);
    server.kill().await;
    for client in clients {
        client.await.expect("client task");
    }
    cut_in_flight
}

test! { sigkill_under_load_never_duplicates_or_loses_an_order, multi_thread = 2 }
async fn sigkill_under_load_never_duplicates_or_loses_an_order() {
    let started = Instant::now();
    let (mut rng, seed) = Rng::from_env_or_clock();
    eprintln!("crash test seed: STRESS_SEED={seed}");
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("orders.db");
    let plans = Arc::new(plans(&mut rng));

    // Every scope is sent three times: twice back to back (duplicates in flight together)
    // and once more later in the run.
    let mut order: Vec<usize> = (0..SCOPES).collect();
    rng.shuffle(&mut order);
    let mut sends: Vec<usize> = order.iter().flat_map(|&s| [s, s]).collect();
    rng.shuffle(&mut order);
    sends.extend(&order);
    let total_sends = sends.len();
    let queue = Arc::new(Mutex::new(VecDeque::from(sends)));
    let observed = Arc::new(Mutex::new(Observed::default()));

    let mut kills_mid_load = 0;
    for _ in 0..ROUNDS {
        if queue.lock().expect("queue").is_empty() {
            break;
        }
        let server = OrdersProcess::start(&db).await;
        // Somewhere between a twentieth and a fifth of what is left.
        let left = queue.lock().expect("queue").len() as u64;
        let kill_after = (left / 20 + rng.below(left / 7 + 1)) as usize;
        if round(server, &plans, &queue, &observed, kill_after).await > 0 {
            kills_mid_load += 1;
        }
    }
    let (cut, created_before) = {
        let seen = observed.lock().expect("observed");
        (seen.cut, seen.created.len())
    };
    eprintln!(
        "crash test: {total_sends} sends planned, {created_before} scopes answered 201 and \
         {cut} requests cut by {kills_mid_load} kills under load"
    );
    assert_eq!(kills_mid_load, ROUNDS, "every kill landed under load");
    assert!(cut > 0, "some requests were in flight when the server died");
    assert!(created_before > 0, "the load ran between the kills");

    // The final pass: every scope is resent until it is answered with its 201.
    let server = OrdersProcess::start(&db).await;
    let client = process::client();
    let deadline = Instant::now() + FINAL_PASS_PATIENCE;
    for (scope, plan) in plans.iter().enumerate() {
        let reply = loop {
            assert!(Instant::now() < deadline, "{}: never answered", plan.key);
            match plan
                .request()
                .try_send(&client, server.addr, REQUEST_TIMEOUT)
                .await
            {
                Some(reply) if reply.status == StatusCode::SERVICE_UNAVAILABLE => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Some(reply) => break reply,
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        assert_eq!(
            reply.status,
            StatusCode::CREATED,
            "{}/{}: {reply:?}",
            plan.tenant,
            plan.key
        );
        let mut seen = observed.lock().expect("observed");
        if seen.created.contains_key(&scope) {
            assert!(
                reply.replayed(),
                "{}/{}: a key that got its 201 gets it replayed",
                plan.tenant,
                plan.key
            );
        }
        seen.created(scope, plan, &reply.body);
    }
    server.kill().await;

    // The file, read directly after the last kill.
    assert_eq!(process::integrity_check(&db), "ok");
    let orders = process::saved_orders(&db);
    let records = process::saved_records(&db);
    assert_eq!(orders.len(), SCOPES, "one order per distinct key");
    assert_eq!(records.len(), SCOPES, "one record per distinct key");

    let seen = observed.lock().expect("observed");
    let by_id: BTreeMap<i64, &(i64, String, String, i64)> =
        orders.iter().map(|order| (order.0, order)).collect();
    let mut recorded_ids = BTreeSet::new();
    for (scope, plan) in plans.iter().enumerate() {
        let body = &seen.created[&scope];
        let record = records
            .iter()
            .find(|(tenant, key, _)| tenant == plan.tenant && *key == plan.key)
            .unwrap_or_else(|| panic!("{}/{}: no record", plan.tenant, plan.key));
        assert_eq!(&record.2[..], &body[..], "{}: the saved body", plan.key);
        let id = serde_json::from_slice::<serde_json::Value>(body).expect("JSON body")["order_id"]
            .as_i64()
            .expect("order_id");
        let order = by_id
            .get(&id)
            .unwrap_or_else(|| panic!("{}/{}: order {id} is missing", plan.tenant, plan.key));
        assert_eq!(
            (order.1.as_str(), order.2.as_str(), order.3),
            (plan.tenant, plan.sku.as_str(), plan.quantity),
            "{}/{}: the order holds the key's own payload",
            plan.tenant,
            plan.key
        );
        assert!(recorded_ids.insert(id), "order {id} has two records");
    }
    let order_ids: BTreeSet<i64> = by_id.keys().copied().collect();
    assert_eq!(recorded_ids, order_ids, "every order has its record");
    eprintln!(
        "crash test: statuses {:?}, {} s",
        seen.statuses,
        started.elapsed().as_secs_f32()
    );
}
