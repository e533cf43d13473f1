//! The transactional outbox on real SQLite files (through either store), on PostgreSQL and on
//! MySQL/MariaDB: the relay's deliveries, retries, backoff, dead letters, timeouts and
//! abandoned leases, written once over [`Outbox`] and run against each backend; and events
//! committing or rolling back with the handler's rows through the order app over real HTTP. On
//! the pooled stores (all but the SQLite store's one writer thread): two relays on separate
//! pools at once.
//!
//! The PostgreSQL tests need `TEST_DATABASE_URL`; without it `cargo test` reports them as
//! ignored.

use support::backend;
use support::common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use backend::{event_of, hook, Backend, Server};
use common::{post, PATIENCE, SHOP_A};
use http::StatusCode;
use serde_json::json;
use tower_idempotency::body::BoxError;
use tower_idempotency::outbox::{
    sink_fn, EventId, EventStatus, Outbox, OutboxEvent, OutboxStore, Permanent, Relay, SinkFn,
};

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

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

async fn a_relay_delivers_each_event_once<B: Backend>(backend: B) {
    let outbox = Outbox::install(backend.store().await)
        .await
        .expect("install");
    // Installing twice is harmless.
    Outbox::install(backend.store().await)
        .await
        .expect("install again");
    let ids = backend.enqueue_orders(0..25).await;
    let recorder = RecordingSink::default();
    let mut relay = Relay::new(outbox.clone(), recorder.sink()).with_batch_size(10);

    let mut claimed = Vec::new();
    for _ in 0..4 {
        claimed.push(relay.run_once().await.expect("round").claimed);
    }
    assert_eq!(claimed, vec![10, 10, 5, 0]);
    for id in &ids {
        assert_eq!(recorder.attempts_of(id), vec![1], "delivered once: {id}");
        let event = event_of(&outbox, id).await;
        assert_eq!(event.status, EventStatus::Delivered);
        assert!(event.delivered_at.is_some());
    }
    let counts = outbox.counts().await.expect("counts");
    assert_eq!((counts.delivered, counts.pending, counts.dead), (25, 0, 0));
    assert_eq!(outbox.backlog().await.expect("backlog").pending, 0);

    // Delivered events can be purged.
    let purged = outbox
        .purge_delivered(SystemTime::now() + Duration::from_secs(1), 100)
        .await
        .expect("purge");
    assert_eq!(purged, 25);
    assert_eq!(backend.event_count().await, 0);
}

async fn a_poison_event_is_dead_lettered_while_the_others_flow<B: Backend>(backend: B) {
    let outbox = Outbox::install(backend.store().await)
        .await
        .expect("install");
    let recorder = RecordingSink::default();
    // Retries wait 0.5 to 1 s: long enough that the rounds below run while the poison event
    // is not due, short enough for a fast test.
    let mut relay = Relay::new(outbox.clone(), recorder.sink())
        .with_max_attempts(3)
        .with_backoff(Duration::from_secs(1), Duration::from_secs(1));

    // The poison event is the oldest: it is claimed first.
    let poison = backend
        .enqueue_now("order_created", json!({ "sku": "poison" }))
        .await;
    let mut good = backend.enqueue_orders(0..3).await;

    let first = relay.run_once().await.expect("round");
    assert_eq!((first.claimed, first.delivered, first.retried), (4, 3, 1));

    // New events flow while the poison event waits for its retry.
    good.extend(backend.enqueue_orders(3..6).await);
    let second = relay.run_once().await.expect("round");
    assert_eq!((second.claimed, second.delivered), (3, 3), "{second:?}");
    assert_eq!(recorder.attempts_of(&poison), vec![1], "not retried yet");

    // It is retried until its attempts run out, then dead-lettered.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        relay.run_once().await.expect("round");
        let event = event_of(&outbox, &poison).await;
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
        let event = event_of(&outbox, id).await;
        assert_eq!(event.status, EventStatus::Delivered);
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

async fn a_permanent_error_dead_letters_at_once<B: Backend>(backend: B) {
    let outbox = Outbox::install(backend.store().await)
        .await
        .expect("install");
    let id = backend
        .enqueue_now("order_created", json!({ "sku": "gone" }))
        .await;
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
    let event = event_of(&outbox, &id).await;
    assert_eq!(event.status, EventStatus::Dead);
    assert_eq!(event.attempts, 1);
    assert_eq!(
        event.last_error.as_deref(),
        Some("permanent: sku gone for good")
    );
    assert_eq!(outbox.requeue_all_dead().await.expect("requeue"), 1);
}

async fn a_sink_that_hangs_or_panics_is_a_failed_attempt_not_a_dead_relay<B: Backend>(backend: B) {
    let outbox = Outbox::install(backend.store().await)
        .await
        .expect("install");
    let hangs = backend.enqueue_now("t", json!("hang")).await;
    let panics = backend.enqueue_now("t", json!("panic")).await;
    let fine = backend.enqueue_now("t", json!("fine")).await;
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
    let hung = event_of(&outbox, &hangs).await;
    assert_eq!(hung.status, EventStatus::Pending);
    assert!(
        hung.last_error
            .as_deref()
            .is_some_and(|e| e.contains("did not answer")),
        "{hung:?}"
    );
    let panicked = event_of(&outbox, &panics).await;
    assert_eq!(panicked.last_error.as_deref(), Some("the sink panicked"));
    let delivered = event_of(&outbox, &fine).await;
    assert_eq!(delivered.status, EventStatus::Delivered);
}

async fn an_abandoned_last_attempt_is_dead_lettered_when_its_lease_runs_out<B: Backend>(
    backend: B,
) {
    let outbox = Outbox::install(backend.store().await)
        .await
        .expect("install");
    let id = backend
        .enqueue_now("order_created", json!({ "order_id": 1 }))
        .await;

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
    let event = event_of(&outbox, &id).await;
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
    let event = event_of(&outbox, &id).await;
    assert_eq!(event.status, EventStatus::Dead);
    assert!(event
        .last_error
        .as_deref()
        .is_some_and(|e| e.contains("abandoned")));
}

/// The ids of the events the order handler enqueued.
type Ids = Arc<Mutex<Vec<EventId>>>;

/// The order app whose handler enqueues `order_created` in the request's transaction (and
/// remembers its id) and then answers `fail_with` (or its 201); its outbox installed.
async fn enqueueing_app<B: Backend>(
    db: &B,
    fail_with: Option<StatusCode>,
) -> (Server<B>, Outbox<B::Store>, Ids) {
    let ids = Ids::default();
    let enqueued = ids.clone();
    let server = db
        .server()
        .hook(hook(move |call| {
            let ids = enqueued.clone();
            async move {
                let payload = json!({
                    "order_id": call.order_id,
                    "sku": call.sku,
                    "tenant": call.tenant,
                });
                let id = call
                    .tx
                    .enqueue("order_created", payload)
                    .await
                    .expect("enqueue in the request's transaction");
                ids.lock().expect("ids").push(id);
                fail_with
            }
        }))
        .spawn()
        .await;
    let outbox = Outbox::install(&server.store).await.expect("install");
    (server, outbox, ids)
}

/// Posts an order that fails with a 500 after its handler enqueued its event; asserts that
/// nothing of it was kept.
async fn assert_failed_order_rolls_back<B: Backend>(db: &B, server: Server<B>, ids: Ids) {
    let reply = post(server.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    // The handler did enqueue (it got an id), but nothing of the request was kept.
    assert_eq!(ids.lock().expect("ids").len(), 1);
    assert_eq!(db.event_count().await, 0, "the event rolled back");
    assert_eq!(db.counts().await, (0, 0));
    server.shutdown().await;
}

async fn a_handler_failure_rolls_the_event_back_with_the_order<B: Backend>(db: B) {
    let failing = Some(StatusCode::INTERNAL_SERVER_ERROR);
    let (server, _, ids) = enqueueing_app(&db, failing).await;
    assert_failed_order_rolls_back(&db, server, ids).await;
}

async fn a_failed_commit_rolls_the_event_back_with_the_order<B: Backend>(db: B) {
    let (server, _, ids) = enqueueing_app(&db, None).await;
    // Saving the response fails after the handler wrote its order and its event.
    db.fail_saving_the_record_of("k1").await;
    assert_failed_order_rolls_back(&db, server, ids).await;
}

async fn a_committed_order_has_exactly_one_event_and_replays_add_none<B: Backend>(db: B) {
    let (server, outbox, ids) = enqueueing_app(&db, None).await;

    let first = post(server.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
    let retry = post(server.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(db.event_count().await, 1);
    assert_eq!(db.order_count().await, 1);

    let id = ids.lock().expect("ids")[0].clone();
    let event = event_of(&outbox, &id).await;
    assert_eq!(event.topic, "order_created");
    assert_eq!(event.status, EventStatus::Pending);
    assert_eq!(event.attempts, 0);
    let payload: serde_json::Value = serde_json::from_str(&event.payload).expect("json");
    assert_eq!(
        payload,
        json!({ "order_id": first.order_id(), "sku": "book", "tenant": "shop-a" })
    );
    let backlog = outbox.backlog().await.expect("backlog");
    assert_eq!((backlog.pending, backlog.dead), (1, 0));
    server.shutdown().await;
}

async fn enqueue_needs_the_outbox_table_and_fails_the_request_without_it<B: Backend>(db: B) {
    let errors = Arc::new(Mutex::new(Vec::new()));
    let seen = errors.clone();
    // The handler answers 500 when its enqueue fails, and notes why.
    let enqueue_or_fail = hook(move |call| {
        let seen = seen.clone();
        async move {
            let result = call.tx.enqueue("order_created", json!({})).await;
            if let Err(error) = &result {
                seen.lock()
                    .expect("errors")
                    .push(format!("{error} ({error:?})"));
            }
            result.is_err().then_some(StatusCode::INTERNAL_SERVER_ERROR)
        }
    });
    let server = db.server().hook(enqueue_or_fail).spawn().await;
    // No `Outbox::install`: the handler's enqueue fails, the handler answers 500, and the order
    // rolls back with it.
    let reply = post(server.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    let errors = errors.lock().expect("errors").clone();
    assert!(
        errors.len() == 1 && errors[0].contains(B::NO_OUTBOX_TABLE),
        "{errors:?}"
    );
    assert_eq!(db.order_count().await, 0);
    server.shutdown().await;
}

/// Two relays on separate pools (two app instances) share the work: each event is delivered
/// once (PostgreSQL backends: `FOR UPDATE SKIP LOCKED`).
async fn two_relays_at_once_deliver_each_event_once<B: Backend>(backend: B) {
    // Two stores: two app instances, each with its own pool and its own relay.
    let first = Outbox::install(backend.store().await)
        .await
        .expect("install");
    let second = Outbox::install(&backend.another_store().await)
        .await
        .expect("install");
    const EVENTS: usize = 300;
    let ids = backend.enqueue_orders(0..EVENTS).await;

    // One recorder for both relays: every delivery of every event, whichever relay made it.
    let recorder = RecordingSink::default();
    let run = |outbox: Outbox<B::Store>| {
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

/// The tests above, on one backend.
macro_rules! outbox_tests {
    ($backend:ident) => {
        backend_tests!($backend;
            a_relay_delivers_each_event_once,
            a_poison_event_is_dead_lettered_while_the_others_flow,
            a_permanent_error_dead_letters_at_once,
            a_sink_that_hangs_or_panics_is_a_failed_attempt_not_a_dead_relay,
            an_abandoned_last_attempt_is_dead_lettered_when_its_lease_runs_out,
            a_handler_failure_rolls_the_event_back_with_the_order,
            a_failed_commit_rolls_the_event_back_with_the_order,
            a_committed_order_has_exactly_one_event_and_replays_add_none,
            enqueue_needs_the_outbox_table_and_fails_the_request_without_it,
        );
    };
}

mod sqlite {
    //! On a SQLite file.

    outbox_tests!(Sqlite);
}

mod postgres {
    //! On PostgreSQL: the suite, and two relays on separate pools.

    outbox_tests!(Postgres);
    backend_tests!(Postgres;
        two_relays_at_once_deliver_each_event_once(multi_thread = 4),
    );
}

mod sqlx_postgres {
    //! On PostgreSQL through the sqlx store: the suite, and two relays on separate pools.

    outbox_tests!(SqlxPostgres);
    backend_tests!(SqlxPostgres;
        two_relays_at_once_deliver_each_event_once(multi_thread = 4),
    );
}

mod mysql {
    //! On MySQL or MariaDB through the sqlx store: the suite, and two relays on separate pools.

    outbox_tests!(MySql);
    backend_tests!(MySql;
        two_relays_at_once_deliver_each_event_once(multi_thread = 4),
    );
}

mod sqlx_sqlite {
    //! On a SQLite file through the sqlx store: the suite, and two relays on separate pools
    //! (their claims take the write lock one at a time).

    outbox_tests!(SqlxSqlite);
    backend_tests!(SqlxSqlite;
        two_relays_at_once_deliver_each_event_once(multi_thread = 4),
    );
}
