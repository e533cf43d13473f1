//! The transactional outbox on real SQLite files: events commit or roll back with the
//! handler's rows (through the order app over real HTTP), and the relay's retries, backoff,
//! dead letters, timeouts and abandoned leases.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{hook, post, HookOutcome, TestServer, PATIENCE, SHOP_A};
use http::StatusCode;
use serde_json::json;
use tower_idempotency::body::BoxError;
use tower_idempotency::outbox::sqlite::{enqueue, SqliteOutbox};
use tower_idempotency::outbox::{
    sink_fn, Enqueue, EventId, EventStatus, OutboxEvent, Permanent, Relay,
};
use tower_idempotency::store::sqlite::SqliteStore;

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

/// A hook that enqueues `order_created` in the request's transaction and remembers its id.
fn enqueueing_hook(ids: Arc<Mutex<Vec<EventId>>>, fail_with: Option<StatusCode>) -> common::Hook {
    hook(move |call| {
        let ids = ids.clone();
        async move {
            let payload = json!({ "order_id": call.order_id, "sku": call.sku });
            let id = call
                .tx
                .enqueue("order_created", payload)
                .await
                .expect("enqueue in the request's transaction");
            ids.lock().expect("ids").push(id);
            HookOutcome {
                fail_with,
                ..HookOutcome::default()
            }
        }
    })
}

async fn event_count(store: &SqliteStore) -> i64 {
    store
        .read(|conn| conn.query_row("SELECT count(*) FROM outbox_events", [], |row| row.get(0)))
        .await
        .expect("count events")
}

/// Enqueues an event outside any request (in a transaction of its own).
async fn enqueue_now(
    store: &SqliteStore,
    topic: &'static str,
    payload: serde_json::Value,
) -> EventId {
    store
        .write(move |tx| enqueue(tx, topic, &payload))
        .await
        .expect("enqueue")
}

#[tokio::test]
async fn a_handler_failure_rolls_the_event_back_with_the_order() {
    let ids = Arc::new(Mutex::new(Vec::new()));
    let server = TestServer::builder()
        .hook(enqueueing_hook(
            ids.clone(),
            Some(StatusCode::INTERNAL_SERVER_ERROR),
        ))
        .spawn()
        .await;
    SqliteOutbox::install(&server.store).await.expect("install");

    let reply = post(server.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    // The handler did enqueue (it got an id), but nothing of the request was kept.
    assert_eq!(ids.lock().expect("ids").len(), 1);
    assert_eq!(event_count(&server.store).await, 0, "the event rolled back");
    assert_eq!(server.order_count().await, 0);
    assert_eq!(server.record_count().await, 0);
}

#[tokio::test]
async fn a_failed_commit_rolls_the_event_back_with_the_order() {
    let ids = Arc::new(Mutex::new(Vec::new()));
    let server = TestServer::builder()
        .hook(enqueueing_hook(ids.clone(), None))
        .spawn()
        .await;
    SqliteOutbox::install(&server.store).await.expect("install");
    // Saving the response fails after the handler wrote its order and its event.
    common::execute(
        &server.store,
        "CREATE TRIGGER fail_record BEFORE INSERT ON idempotency_records \
         BEGIN SELECT RAISE(ABORT, 'injected'); END;",
    )
    .await;

    let reply = post(server.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(ids.lock().expect("ids").len(), 1);
    assert_eq!(event_count(&server.store).await, 0, "the event rolled back");
    assert_eq!(server.order_count().await, 0);
}

#[tokio::test]
async fn a_committed_order_has_exactly_one_event_and_replays_add_none() {
    let ids = Arc::new(Mutex::new(Vec::new()));
    let server = TestServer::builder()
        .hook(enqueueing_hook(ids.clone(), None))
        .spawn()
        .await;
    let outbox = SqliteOutbox::install(&server.store).await.expect("install");

    let first = post(server.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
    let retry = post(server.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(event_count(&server.store).await, 1);

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
        json!({ "order_id": first.order_id(), "sku": "book" })
    );
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

    fn sink(
        &self,
    ) -> tower_idempotency::outbox::SinkFn<
        impl Fn(OutboxEvent) -> std::future::Ready<Result<(), BoxError>> + Clone,
    > {
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

#[tokio::test]
async fn a_poison_event_is_dead_lettered_while_the_others_flow() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("orders.db"))
        .await
        .expect("open");
    let outbox = SqliteOutbox::install(&store).await.expect("install");
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
        let event = outbox
            .event(id.as_str())
            .await
            .expect("read")
            .expect("event");
        assert_eq!(event.status, EventStatus::Delivered);
    }
    let counts = outbox.counts().await.expect("counts");
    assert_eq!((counts.delivered, counts.dead, counts.pending), (6, 1, 0));

    // A dead letter stays put: later rounds do not touch it.
    let idle = relay.run_once().await.expect("round");
    assert_eq!(idle.claimed, 0);
    assert_eq!(recorder.attempts_of(&poison).len(), 3);
}

#[tokio::test]
async fn a_permanent_error_dead_letters_at_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("orders.db"))
        .await
        .expect("open");
    let outbox = SqliteOutbox::install(&store).await.expect("install");
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
}

#[tokio::test]
async fn a_sink_that_hangs_or_panics_is_a_failed_attempt_not_a_dead_relay() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("orders.db"))
        .await
        .expect("open");
    let outbox = SqliteOutbox::install(&store).await.expect("install");
    let hangs = enqueue_now(&store, "t", json!("hang")).await;
    let panics = enqueue_now(&store, "t", json!("panic")).await;
    let fine = enqueue_now(&store, "t", json!("fine")).await;
    let mut relay = Relay::new(
        outbox.clone(),
        sink_fn(|event: OutboxEvent| async move {
            match event.payload() {
                "\"hang\"" => std::future::pending::<()>().await,
                "\"panic\"" => panic!("the sink panicked on purpose"),
                _ => {}
            }
            Ok::<(), BoxError>(())
        }),
    )
    .with_delivery_timeout(Duration::from_millis(200))
    .with_backoff(Duration::from_secs(60), Duration::from_secs(60));

    let report = relay.run_once().await.expect("round");
    assert_eq!((report.delivered, report.retried), (1, 2), "{report:?}");
    let hung = outbox
        .event(hangs.as_str())
        .await
        .expect("read")
        .expect("event");
    assert_eq!(hung.status, EventStatus::Pending);
    assert!(
        hung.last_error
            .as_deref()
            .is_some_and(|e| e.contains("did not answer")),
        "{hung:?}"
    );
    let panicked = outbox
        .event(panics.as_str())
        .await
        .expect("read")
        .expect("event");
    assert_eq!(panicked.last_error.as_deref(), Some("the sink panicked"));
    let delivered = outbox
        .event(fine.as_str())
        .await
        .expect("read")
        .expect("event");
    assert_eq!(delivered.status, EventStatus::Delivered);
}

#[tokio::test]
async fn an_abandoned_last_attempt_is_dead_lettered_when_its_lease_runs_out() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("orders.db"))
        .await
        .expect("open");
    let outbox = SqliteOutbox::install(&store).await.expect("install");
    let id = enqueue_now(&store, "order_created", json!({ "order_id": 1 })).await;

    // A relay allowed one attempt dies while delivering (its round is dropped mid-delivery).
    let mut dying = Relay::new(
        outbox.clone(),
        sink_fn(|_event: OutboxEvent| std::future::pending::<Result<(), BoxError>>()),
    )
    .with_max_attempts(1)
    .with_lease(Duration::from_millis(300));
    let cut = tokio::time::timeout(Duration::from_millis(100), dying.run_once()).await;
    assert!(cut.is_err(), "the round was still delivering");
    drop(dying);
    let event = outbox
        .event(id.as_str())
        .await
        .expect("read")
        .expect("event");
    assert_eq!(event.status, EventStatus::InFlight);

    // Within the lease, nobody else takes it.
    let calls = Arc::new(Mutex::new(0));
    let counted = calls.clone();
    let mut next = Relay::new(
        outbox.clone(),
        sink_fn(move |_event: OutboxEvent| {
            *counted.lock().expect("calls") += 1;
            std::future::ready(Ok::<(), BoxError>(()))
        }),
    )
    .with_max_attempts(1);
    assert_eq!(next.run_once().await.expect("round").claimed, 0);

    // After it, the event is not delivered again: its only attempt is spent.
    tokio::time::sleep(Duration::from_millis(350)).await;
    let report = next.run_once().await.expect("round");
    assert_eq!((report.claimed, report.dead_lettered), (0, 1));
    assert_eq!(*calls.lock().expect("calls"), 0);
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

#[tokio::test]
async fn enqueue_needs_the_outbox_table_and_fails_the_request_without_it() {
    let errors = Arc::new(Mutex::new(Vec::new()));
    let seen = errors.clone();
    let server = TestServer::builder()
        .hook(hook(move |call| {
            let seen = seen.clone();
            async move {
                let result = call.tx.enqueue("order_created", json!({})).await;
                if let Err(error) = &result {
                    seen.lock().expect("errors").push(error.to_string());
                }
                HookOutcome {
                    fail_with: result.is_err().then_some(StatusCode::INTERNAL_SERVER_ERROR),
                    ..HookOutcome::default()
                }
            }
        }))
        .spawn()
        .await;
    // No `SqliteOutbox::install`: the handler's enqueue fails, the handler answers 500, and
    // the order rolls back with it.
    let reply = post(server.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    let errors = errors.lock().expect("errors").clone();
    assert!(
        errors.len() == 1 && errors[0].contains("no such table: outbox_events"),
        "{errors:?}"
    );
    assert_eq!(server.order_count().await, 0);
}
