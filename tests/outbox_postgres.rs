//! The transactional outbox on the PostgreSQL store: events commit or roll back with the
//! handler's rows (through the order app over real HTTP), relays deliver each event once, even
//! two relays at once on separate pools, and a poison event is dead-lettered while the rest
//! flow.
//!
//! Needs `TEST_DATABASE_URL`; without it `cargo test` reports these tests as ignored.

mod common;
mod pg_common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{post, PATIENCE, SHOP_A};
use http::StatusCode;
use pg_common::{hook, Hook, HookOutcome, PgServer, TestDb};
use serde_json::json;
use tower_idempotency::body::BoxError;
use tower_idempotency::outbox::postgres::{enqueue, PostgresOutbox};
use tower_idempotency::outbox::{
    sink_fn, Enqueue, EventId, EventStatus, OutboxEvent, OutboxStore, Permanent, Relay, SinkFn,
};
use tower_idempotency::store::postgres::PostgresStore;

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

/// A hook that enqueues `order_created` in the request's transaction and remembers its id.
fn enqueueing_hook(ids: Arc<Mutex<Vec<EventId>>>, fail_with: Option<StatusCode>) -> Hook {
    hook(move |call| {
        let ids = ids.clone();
        async move {
            let payload = json!({ "order_id": call.order_id, "tenant": call.tenant });
            let id = call
                .tx
                .enqueue("order_created", payload)
                .await
                .expect("enqueue in the request's transaction");
            ids.lock().expect("ids").push(id);
            HookOutcome { fail_with }
        }
    })
}

async fn event_count(db: &TestDb) -> i64 {
    db.client()
        .await
        .query_one("SELECT count(*) FROM outbox_events", &[])
        .await
        .expect("count events")
        .get(0)
}

/// Enqueues an event outside any request (autocommit, on a pooled connection).
async fn enqueue_now(store: &PostgresStore, topic: &str, payload: serde_json::Value) -> EventId {
    let client = store.client().await.expect("client");
    enqueue(&**client, topic, &payload).await.expect("enqueue")
}

/// Records every delivery attempt by event id; fails those whose payload says `poison`.
#[derive(Clone, Default)]
struct RecordingSink {
    attempts: Arc<Mutex<HashMap<String, Vec<u32>>>>,
}

impl RecordingSink {
    fn attempts_of(&self, id: &EventId) -> Vec<u32> {
        self.attempts
            .lock()
            .expect("attempts")
            .get(id.as_str())
            .cloned()
            .unwrap_or_default()
    }

    fn deliveries(&self) -> usize {
        self.attempts
            .lock()
            .expect("attempts")
            .values()
            .map(Vec::len)
            .sum()
    }

    fn sink(
        &self,
    ) -> SinkFn<impl Fn(OutboxEvent) -> std::future::Ready<Result<(), BoxError>> + Clone> {
        let attempts = self.attempts.clone();
        sink_fn(move |event: OutboxEvent| {
            attempts
                .lock()
                .expect("attempts")
                .entry(event.id().to_string())
                .or_default()
                .push(event.attempt());
            let result = if event.payload().contains("poison") {
                Err("the receiver refused it".into())
            } else {
                Ok(())
            };
            std::future::ready(result)
        })
    }
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn a_handler_failure_rolls_the_event_back_with_the_order() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let ids = Arc::new(Mutex::new(Vec::new()));
    let server = PgServer::builder()
        .hook(enqueueing_hook(
            ids.clone(),
            Some(StatusCode::INTERNAL_SERVER_ERROR),
        ))
        .spawn(&db)
        .await;
    PostgresOutbox::install(&server.store)
        .await
        .expect("install");

    let reply = post(server.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    // The handler did enqueue (it got an id), but nothing of the request was kept.
    assert_eq!(ids.lock().expect("ids").len(), 1);
    assert_eq!(event_count(&db).await, 0, "the event rolled back");
    assert_eq!(db.order_count().await, 0);
    assert_eq!(db.record_count().await, 0);
    server.shutdown().await;
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn a_committed_order_has_exactly_one_event_and_replays_add_none() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let ids = Arc::new(Mutex::new(Vec::new()));
    let server = PgServer::builder()
        .hook(enqueueing_hook(ids.clone(), None))
        .spawn(&db)
        .await;
    let outbox = PostgresOutbox::install(&server.store)
        .await
        .expect("install");

    let first = post(server.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
    let retry = post(server.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(event_count(&db).await, 1);
    assert_eq!(db.order_count().await, 1);

    let id = ids.lock().expect("ids")[0].clone();
    let event = outbox
        .event(id.as_str())
        .await
        .expect("read")
        .expect("event");
    assert_eq!(event.topic, "order_created");
    assert_eq!(event.status, EventStatus::Pending);
    assert_eq!(event.attempts, 0);
    let payload: serde_json::Value = serde_json::from_str(&event.payload).expect("json");
    assert_eq!(
        payload,
        json!({ "order_id": first.order_id(), "tenant": "shop-a" })
    );
    let backlog = outbox.backlog().await.expect("backlog");
    assert_eq!((backlog.pending, backlog.dead), (1, 0));
    server.shutdown().await;
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn a_relay_delivers_each_event_once() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let store = db
        .store_with(|o| o.max_connections(4).max_read_connections(2))
        .await;
    let outbox = PostgresOutbox::install(&store).await.expect("install");
    // Installing twice is harmless.
    PostgresOutbox::install(&store)
        .await
        .expect("install again");
    let mut ids = Vec::new();
    for n in 0..25 {
        ids.push(enqueue_now(&store, "order_created", json!({ "order_id": n })).await);
    }
    let recorder = RecordingSink::default();
    let mut relay = Relay::new(outbox.clone(), recorder.sink()).with_batch_size(10);

    let mut claimed = Vec::new();
    for _ in 0..4 {
        claimed.push(relay.run_once().await.expect("round").claimed);
    }
    assert_eq!(claimed, vec![10, 10, 5, 0]);
    for id in &ids {
        assert_eq!(recorder.attempts_of(id), vec![1], "delivered once: {id}");
        let event = outbox
            .event(id.as_str())
            .await
            .expect("read")
            .expect("event");
        assert_eq!(event.status, EventStatus::Delivered);
        assert!(event.delivered_at.is_some());
    }
    let counts = outbox.counts().await.expect("counts");
    assert_eq!((counts.delivered, counts.pending, counts.dead), (25, 0, 0));
    assert_eq!(outbox.backlog().await.expect("backlog").pending, 0);

    // Delivered events can be purged.
    let purged = outbox
        .purge_delivered(std::time::SystemTime::now() + Duration::from_secs(1), 100)
        .await
        .expect("purge");
    assert_eq!(purged, 25);
    assert_eq!(event_count(&db).await, 0);
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_at_once_deliver_each_event_once() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    // Two stores: two app instances, each with its own pool and its own relay.
    let first_store = db
        .store_with(|o| o.max_connections(4).max_read_connections(2))
        .await;
    let second_store = db
        .store_with(|o| o.max_connections(4).max_read_connections(2))
        .await;
    let first = PostgresOutbox::install(&first_store)
        .await
        .expect("install");
    let second = PostgresOutbox::install(&second_store)
        .await
        .expect("install");
    const EVENTS: usize = 300;
    let mut ids = Vec::new();
    for n in 0..EVENTS {
        ids.push(enqueue_now(&first_store, "order_created", json!({ "order_id": n })).await);
    }

    // One recorder for both relays: every delivery of every event, whichever relay made it.
    let recorder = RecordingSink::default();
    let run = |outbox: PostgresOutbox| {
        let recorder = recorder.clone();
        async move {
            let mut relay = Relay::new(outbox.clone(), recorder.sink()).with_batch_size(7);
            let deadline = tokio::time::Instant::now() + PATIENCE * 3;
            let mut claimed = 0;
            loop {
                claimed += relay.run_once().await.expect("round").claimed;
                if outbox.backlog().await.expect("backlog").pending == 0 {
                    return claimed;
                }
                assert!(tokio::time::Instant::now() < deadline, "events left over");
                tokio::task::yield_now().await;
            }
        }
    };
    let (by_first, by_second) = tokio::join!(
        tokio::spawn(run(first.clone())),
        tokio::spawn(run(second.clone()))
    );
    let (by_first, by_second) = (by_first.expect("relay"), by_second.expect("relay"));
    println!("the first relay claimed {by_first}, the second {by_second}");
    assert_eq!(by_first + by_second, EVENTS, "{by_first} + {by_second}");
    assert_eq!(recorder.deliveries(), EVENTS);
    for id in &ids {
        assert_eq!(recorder.attempts_of(id), vec![1], "delivered once: {id}");
    }
    let counts = first.counts().await.expect("counts");
    assert_eq!(
        (counts.delivered, counts.pending, counts.in_flight),
        (300, 0, 0)
    );
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn a_poison_event_is_dead_lettered_while_the_others_flow() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let store = db
        .store_with(|o| o.max_connections(4).max_read_connections(2))
        .await;
    let outbox = PostgresOutbox::install(&store).await.expect("install");
    let recorder = RecordingSink::default();
    // Retries wait 0.5 to 1 s: long enough that the rounds below run while the poison event
    // is not due, short enough for a fast test.
    let mut relay = Relay::new(outbox.clone(), recorder.sink())
        .with_max_attempts(3)
        .with_backoff(Duration::from_secs(1), Duration::from_secs(1));

    // The poison event is the oldest: it is claimed first.
    let poison = enqueue_now(&store, "order_created", json!({ "sku": "poison" })).await;
    let mut good = Vec::new();
    for n in 0..3 {
        good.push(enqueue_now(&store, "order_created", json!({ "order_id": n })).await);
    }

    let first = relay.run_once().await.expect("round");
    assert_eq!((first.claimed, first.delivered, first.retried), (4, 3, 1));

    // New events flow while the poison event waits for its retry.
    for n in 3..6 {
        good.push(enqueue_now(&store, "order_created", json!({ "order_id": n })).await);
    }
    let second = relay.run_once().await.expect("round");
    assert_eq!((second.claimed, second.delivered), (3, 3), "{second:?}");
    assert_eq!(recorder.attempts_of(&poison), vec![1], "not retried yet");

    // It is retried until its attempts run out, then dead-lettered.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        relay.run_once().await.expect("round");
        let event = outbox
            .event(poison.as_str())
            .await
            .expect("read")
            .expect("event");
        if event.status == EventStatus::Dead {
            assert_eq!(event.attempts, 3);
            assert!(
                event
                    .last_error
                    .as_deref()
                    .is_some_and(|e| e.contains("refused")),
                "{event:?}"
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never dead-lettered: {event:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(recorder.attempts_of(&poison), vec![1, 2, 3]);
    for id in &good {
        assert_eq!(recorder.attempts_of(id), vec![1], "delivered once: {id}");
    }
    let counts = outbox.counts().await.expect("counts");
    assert_eq!((counts.delivered, counts.dead, counts.pending), (6, 1, 0));
    let backlog = outbox.backlog().await.expect("backlog");
    assert_eq!((backlog.pending, backlog.dead), (0, 1));
    let dead = outbox.dead_letters(10).await.expect("dead letters");
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, poison);

    // A dead letter stays put: later rounds do not touch it.
    let idle = relay.run_once().await.expect("round");
    assert_eq!(idle.claimed, 0);
    assert_eq!(recorder.attempts_of(&poison).len(), 3);

    // Requeued, it flows again (and fails again, from attempt 1).
    assert!(outbox.requeue(poison.as_str()).await.expect("requeue"));
    assert!(!outbox.requeue(poison.as_str()).await.expect("requeue"));
    let again = relay.run_once().await.expect("round");
    assert_eq!((again.claimed, again.retried), (1, 1));
    assert_eq!(recorder.attempts_of(&poison), vec![1, 2, 3, 1]);
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn a_permanent_error_dead_letters_at_once() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let store = db
        .store_with(|o| o.max_connections(4).max_read_connections(2))
        .await;
    let outbox = PostgresOutbox::install(&store).await.expect("install");
    let id = enqueue_now(&store, "order_created", json!({ "sku": "gone" })).await;
    let mut relay = Relay::new(
        outbox.clone(),
        sink_fn(|_event: OutboxEvent| async {
            Err::<(), BoxError>(Permanent::new("sku gone for good").into())
        }),
    );
    let report = relay.run_once().await.expect("round");
    assert_eq!(
        (report.claimed, report.dead_lettered, report.retried),
        (1, 1, 0)
    );
    let event = outbox
        .event(id.as_str())
        .await
        .expect("read")
        .expect("event");
    assert_eq!(event.status, EventStatus::Dead);
    assert_eq!(event.attempts, 1);
    assert_eq!(
        event.last_error.as_deref(),
        Some("permanent: sku gone for good")
    );
    assert_eq!(outbox.requeue_all_dead().await.expect("requeue"), 1);
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn an_abandoned_last_attempt_is_dead_lettered_when_its_lease_runs_out() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let store = db
        .store_with(|o| o.max_connections(4).max_read_connections(2))
        .await;
    let outbox = PostgresOutbox::install(&store).await.expect("install");
    let id = enqueue_now(&store, "order_created", json!({ "order_id": 1 })).await;

    // A relay allowed one attempt dies while delivering (its round is dropped mid-delivery).
    let mut dying = Relay::new(
        outbox.clone(),
        sink_fn(|_event: OutboxEvent| std::future::pending::<Result<(), BoxError>>()),
    )
    .with_max_attempts(1)
    .with_lease(Duration::from_millis(1000));
    let cut = tokio::time::timeout(Duration::from_millis(250), dying.run_once()).await;
    assert!(cut.is_err(), "the round was still delivering");
    drop(dying);
    let event = outbox
        .event(id.as_str())
        .await
        .expect("read")
        .expect("event");
    assert_eq!(event.status, EventStatus::InFlight);

    // Within the lease, nobody else takes it.
    let recorder = RecordingSink::default();
    let mut next = Relay::new(outbox.clone(), recorder.sink()).with_max_attempts(1);
    assert_eq!(next.run_once().await.expect("round").claimed, 0);

    // After it, the event is not delivered again: its only attempt is spent.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let report = next.run_once().await.expect("round");
    assert_eq!((report.claimed, report.dead_lettered), (0, 1));
    assert_eq!(recorder.deliveries(), 0);
    let event = outbox
        .event(id.as_str())
        .await
        .expect("read")
        .expect("event");
    assert_eq!(event.status, EventStatus::Dead);
    assert!(event
        .last_error
        .as_deref()
        .is_some_and(|e| e.contains("abandoned")));
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn enqueue_needs_the_outbox_table_and_fails_the_request_without_it() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let errors = Arc::new(Mutex::new(Vec::new()));
    let seen = errors.clone();
    let server = PgServer::builder()
        .hook(hook(move |call| {
            let seen = seen.clone();
            async move {
                let result = call.tx.enqueue("order_created", json!({})).await;
                if let Err(error) = &result {
                    seen.lock().expect("errors").push(format!("{error:?}"));
                }
                HookOutcome {
                    fail_with: result.is_err().then_some(StatusCode::INTERNAL_SERVER_ERROR),
                }
            }
        }))
        .spawn(&db)
        .await;
    // No `PostgresOutbox::install`: the enqueue fails, the handler answers 500, and the order
    // rolls back with it.
    let reply = post(server.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    let errors = errors.lock().expect("errors").clone();
    assert!(
        errors.len() == 1 && errors[0].contains("outbox_events"),
        "{errors:?}"
    );
    assert_eq!(db.order_count().await, 0);
    server.shutdown().await;
}
