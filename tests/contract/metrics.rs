//! What the `metrics` feature records, captured with metrics-util's `DebuggingRecorder`: the
//! layer's requests by outcome, rollbacks and lock waits (over real HTTP), and the outbox
//! relay's deliveries, failures, dead letters and backlog, and the inbox's duplicates (SQLite,
//! and PostgreSQL when `TEST_DATABASE_URL` is set).
//!
//! Each test installs its recorder for its own thread only (`set_default_local_recorder`):
//! `#[tokio::test]` runs the test, the server and the relay on that one thread, and tests in
//! parallel do not see each other's metrics.

use support::common;
use support::pg_common;

use support::pg_common::inventory;

use std::collections::HashMap;
use std::time::Duration;

use axum::routing::post as post_route;
use axum::{Extension, Router};
use common::{hook, post, HeldHandler, HookOutcome, Outcome, Post, Serving, TestServer, SHOP_A};
use http::StatusCode;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use serde_json::json;
use tower_idempotency::body::BoxError;
const REQUESTS_TOTAL: &str = "idempotency_requests_total";
const HANDLER_ROLLBACKS_TOTAL: &str = "idempotency_handler_rollbacks_total";
const LOCK_WAIT_SECONDS: &str = "idempotency_lock_wait_seconds";
const OUTBOX_BACKLOG: &str = "outbox_backlog";
const OUTBOX_DEAD_LETTERS: &str = "outbox_dead_letters";
const OUTBOX_DELIVERED_TOTAL: &str = "outbox_delivered_total";
const OUTBOX_DELIVERY_FAILURES_TOTAL: &str = "outbox_delivery_failures_total";
const OUTBOX_DEAD_LETTERED_TOTAL: &str = "outbox_dead_lettered_total";
const OUTBOX_DELIVERY_SECONDS: &str = "outbox_delivery_seconds";
const INBOX_EVENTS_TOTAL: &str = "inbox_events_total";
type SqliteInbox = tower_idempotency::outbox::Inbox<tower_idempotency::store::sqlite::SqliteStore>;
use tower_idempotency::outbox::Processed;
type PostgresInbox =
    tower_idempotency::outbox::Inbox<tower_idempotency::store::tokio_postgres::PostgresStore>;
type SqliteOutbox =
    tower_idempotency::outbox::Outbox<tower_idempotency::store::sqlite::SqliteStore>;
use tower_idempotency::extract::Tx;
use tower_idempotency::outbox::{sink_fn, OutboxEvent, Relay};
use tower_idempotency::store::sqlite::{SqliteHandle, SqliteStore};
use tower_idempotency::{IdempotencyLayer, Tenant};

/// Everything recorded since the last snapshot, by `name{label=value,...}` (labels sorted).
fn take(snapshotter: &Snapshotter) -> HashMap<String, DebugValue> {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let mut labels: Vec<String> = key
                .key()
                .labels()
                .map(|label| format!("{}={}", label.key(), label.value()))
                .collect();
            labels.sort();
            (
                format!("{}{{{}}}", key.key().name(), labels.join(",")),
                value,
            )
        })
        .collect()
}

fn counter(metrics: &HashMap<String, DebugValue>, key: &str) -> u64 {
    match metrics.get(key) {
        Some(DebugValue::Counter(n)) => *n,
        None => 0,
        Some(other) => panic!("{key} is not a counter: {other:?}"),
    }
}

fn gauge(metrics: &HashMap<String, DebugValue>, key: &str) -> f64 {
    match metrics.get(key) {
        Some(DebugValue::Gauge(value)) => value.into_inner(),
        other => panic!("{key} is not a recorded gauge: {other:?}"),
    }
}

fn histogram(metrics: &HashMap<String, DebugValue>, key: &str) -> Vec<f64> {
    match metrics.get(key) {
        Some(DebugValue::Histogram(values)) => values.iter().map(|v| v.into_inner()).collect(),
        other => panic!("{key} is not a recorded histogram: {other:?}"),
    }
}

fn requests(metrics: &HashMap<String, DebugValue>, outcome: &str) -> u64 {
    counter(
        metrics,
        &format!("{REQUESTS_TOTAL}{{operation=create_order,outcome={outcome}}}"),
    )
}

/// The relay's counter `name` of `topic`.
fn by_topic(metrics: &HashMap<String, DebugValue>, name: &str, topic: &str) -> u64 {
    counter(metrics, &format!("{name}{{topic={topic}}}"))
}

/// The inbox events of `consumer` counted with `result` (`processed`, `duplicate`).
fn inbox_events(metrics: &HashMap<String, DebugValue>, consumer: &str, result: &str) -> u64 {
    counter(
        metrics,
        &format!("{INBOX_EVENTS_TOTAL}{{consumer={consumer},result={result}}}"),
    )
}

test! { the_layer_counts_requests_by_outcome_rollbacks_and_lock_waits }
async fn the_layer_counts_requests_by_outcome_rollbacks_and_lock_waits() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);

    // `fail` answers 500 (rolled back); `slow` holds its transaction until released.
    let slow_handler = HeldHandler::default();
    let held = slow_handler.clone();
    let server = TestServer::builder()
        .layer(|layer| layer.with_lock_timeout(Duration::from_millis(100)))
        .hook(hook(move |call| {
            let held = held.clone();
            async move {
                match call.sku.as_str() {
                    "fail" => HookOutcome::failing(Some(StatusCode::INTERNAL_SERVER_ERROR)),
                    "slow" => {
                        held.hold().await;
                        HookOutcome::default()
                    }
                    _ => HookOutcome::default(),
                }
            }
        }))
        .spawn()
        .await;
    let addr = server.addr;
    let book = r#"{"sku":"book","quantity":1}"#;
    let send =
        |key: Option<&'static str>, body: &'static str| post(addr, Some(SHOP_A), key, body, &[]);

    assert_eq!(send(Some("k1"), book).await.status, StatusCode::CREATED);
    assert!(send(Some("k1"), book).await.replayed());
    let conflict = send(Some("k1"), r#"{"sku":"book","quantity":2}"#).await;
    assert_eq!(conflict.status, StatusCode::CONFLICT);
    let rejected = send(None, book).await;
    assert_eq!(rejected.status, StatusCode::BAD_REQUEST);
    let failed = send(Some("k2"), r#"{"sku":"fail","quantity":1}"#).await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);

    // A request that holds the writer, and one that gives up waiting for it.
    let slow = tokio::spawn(send(Some("k3"), r#"{"sku":"slow","quantity":1}"#));
    slow_handler.started().await;
    let busy = send(Some("k4"), book).await;
    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE);
    slow_handler.release();
    assert_eq!(
        slow.await.expect("slow request").status,
        StatusCode::CREATED
    );

    let metrics = take(&snapshotter);
    assert_eq!(requests(&metrics, "executed"), 2, "{metrics:#?}");
    assert_eq!(requests(&metrics, "replayed"), 1);
    assert_eq!(requests(&metrics, "conflict"), 1);
    assert_eq!(requests(&metrics, "rejected"), 1);
    assert_eq!(requests(&metrics, "rolled_back"), 1);
    assert_eq!(requests(&metrics, "busy"), 1);
    assert_eq!(requests(&metrics, "error"), 0);
    assert_eq!(
        counter(
            &metrics,
            &format!("{HANDLER_ROLLBACKS_TOTAL}{{operation=create_order,reason=not_saved}}")
        ),
        1
    );
    // One lock wait per request that reached the write path: k1, k2, k3 and k4. The replay and
    // the 409 were answered from the read before the transaction: on this current-thread
    // runtime no request runs in place on the executor (its statements would block the only
    // thread), and a request queued for the writer thread reads first.
    let waits = histogram(
        &metrics,
        &format!("{LOCK_WAIT_SECONDS}{{operation=create_order}}"),
    );
    assert_eq!(waits.len(), 4, "{waits:?}");
    // The busy request waited its whole lock timeout.
    assert!(
        waits.iter().any(|wait| *wait >= 0.1),
        "no wait as long as the lock timeout: {waits:?}"
    );
}

test! { a_layer_without_an_operation_name_makes_a_bounded_number_of_series_whatever_the_paths }
/// A layer around a whole router, without an operation name: its records are scoped by each
/// request's path, but its metrics never are (one series per path a client sends would grow
/// without bound): every request counts under `operation="(unnamed)"`.
async fn a_layer_without_an_operation_name_makes_a_bounded_number_of_series_whatever_the_paths() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);

    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("orders.db"))
        .await
        .expect("open");
    async fn cancel(Tx(_tx): Tx<SqliteHandle>) -> StatusCode {
        StatusCode::OK
    }
    let router = Router::new()
        .route("/orders/{id}/cancel", post_route(cancel))
        // Around the router: the unknown paths' 404 (the fallback) go through it too.
        .layer(IdempotencyLayer::new(store.clone()))
        .layer(Extension(Tenant::new("shop-a")));
    let server = Serving::start(router).await;

    let requests: u64 = 100;
    for i in 0..requests {
        let key = format!("key-{i}");
        let cancel = Post::order(&key, "{}")
            .path(&format!("/orders/{i}/cancel"))
            .send(server.addr)
            .await;
        assert_eq!(cancel.status, StatusCode::OK, "{cancel:?}");
        let unknown = Post::order(&key, "{}")
            .path(&format!("/{:x}/{i}", i.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
            .send(server.addr)
            .await;
        assert_eq!(unknown.status, StatusCode::NOT_FOUND, "{unknown:?}");
    }
    // A path too long to name an operation: refused before the store, counted the same way.
    let long = Post::order("key-long", "{}")
        .path(&format!("/{}", "a".repeat(300)))
        .send(server.addr)
        .await;
    assert_eq!(long.status, StatusCode::URI_TOO_LONG, "{long:?}");
    server.stop().await;

    let metrics = take(&snapshotter);
    let series = |name: &str| -> Vec<&String> {
        let mut series: Vec<&String> = metrics
            .keys()
            .filter(|key| key.starts_with(&format!("{name}{{")))
            .collect();
        series.sort();
        series
    };
    let unnamed = |labels: &str| format!("operation=(unnamed){labels}");
    assert_eq!(
        series(REQUESTS_TOTAL),
        [
            &format!("{REQUESTS_TOTAL}{{{}}}", unnamed(",outcome=executed")),
            &format!("{REQUESTS_TOTAL}{{{}}}", unnamed(",outcome=rejected")),
            &format!("{REQUESTS_TOTAL}{{{}}}", unnamed(",outcome=rolled_back")),
        ],
        "{metrics:#?}"
    );
    let count = |outcome: &str| {
        counter(
            &metrics,
            &format!(
                "{REQUESTS_TOTAL}{{{}}}",
                unnamed(&format!(",outcome={outcome}"))
            ),
        )
    };
    assert_eq!(count("executed"), requests);
    assert_eq!(count("rolled_back"), requests, "each 404 rolled back");
    assert_eq!(count("rejected"), 1);
    assert_eq!(
        series(HANDLER_ROLLBACKS_TOTAL),
        [&format!(
            "{HANDLER_ROLLBACKS_TOTAL}{{{}}}",
            unnamed(",reason=not_saved")
        )]
    );
    assert_eq!(
        series(LOCK_WAIT_SECONDS),
        [&format!("{LOCK_WAIT_SECONDS}{{{}}}", unnamed(""))]
    );
    // The records stay scoped by path: each key went to a cancel and to an unknown path, two
    // operations (the 404 ran rather than conflict); the cancels' 200s were saved.
    assert_eq!(common::record_count(&store).await, requests as i64);
}

test! { the_relay_and_the_inbox_record_deliveries_failures_dead_letters_and_backlog }
async fn the_relay_and_the_inbox_record_deliveries_failures_dead_letters_and_backlog() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);

    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("orders.db"))
        .await
        .expect("open");
    let outbox = SqliteOutbox::install(&store).await.expect("install");
    store
        .write(|tx| {
            SqliteOutbox::enqueue_in(tx, "order_created", &json!({ "sku": "book" }))?;
            SqliteOutbox::enqueue_in(tx, "order_created", &json!({ "sku": "pen" }))?;
            SqliteOutbox::enqueue_in(tx, "order_cancelled", &json!({ "sku": "poison" }))?;
            Ok(())
        })
        .await
        .expect("enqueue");

    let mut relay = Relay::new(
        outbox,
        sink_fn(|event: OutboxEvent| async move {
            if event.payload().contains("poison") {
                Err::<(), BoxError>("refused".into())
            } else {
                Ok(())
            }
        }),
    )
    .with_max_attempts(2)
    .with_backoff(Duration::from_millis(1), Duration::from_millis(1))
    // Sample the backlog every round.
    .with_poll_interval(Duration::ZERO);

    relay.run_once().await.expect("first round");
    let metrics = take(&snapshotter);
    // Sampled before the round claimed anything.
    assert_eq!(gauge(&metrics, &format!("{OUTBOX_BACKLOG}{{}}")), 3.0);
    assert_eq!(gauge(&metrics, &format!("{OUTBOX_DEAD_LETTERS}{{}}")), 0.0);
    assert_eq!(
        by_topic(&metrics, OUTBOX_DELIVERED_TOTAL, "order_created"),
        2
    );
    assert_eq!(
        by_topic(&metrics, OUTBOX_DELIVERY_FAILURES_TOTAL, "order_cancelled"),
        1
    );
    let took = histogram(
        &metrics,
        &format!("{OUTBOX_DELIVERY_SECONDS}{{topic=order_created}}"),
    );
    assert_eq!(took.len(), 2);

    // The second (and last) attempt fails too: dead-lettered.
    tokio::time::sleep(Duration::from_millis(5)).await;
    relay.run_once().await.expect("second round");
    relay.run_once().await.expect("third round");
    let metrics = take(&snapshotter);
    assert_eq!(
        by_topic(&metrics, OUTBOX_DELIVERY_FAILURES_TOTAL, "order_cancelled"),
        1
    );
    assert_eq!(
        by_topic(&metrics, OUTBOX_DEAD_LETTERED_TOTAL, "order_cancelled"),
        1
    );
    assert_eq!(gauge(&metrics, &format!("{OUTBOX_BACKLOG}{{}}")), 0.0);
    assert_eq!(gauge(&metrics, &format!("{OUTBOX_DEAD_LETTERS}{{}}")), 1.0);

    // The receiver's inbox: one event delivered twice is processed once.
    let inbox = SqliteInbox::install(&store, "inventory")
        .await
        .expect("inbox");
    for _ in 0..2 {
        inbox
            .process("event-1", |_tx| Ok(()))
            .await
            .expect("process");
    }
    assert_eq!(
        inbox
            .process("event-1", |_tx| Ok(()))
            .await
            .expect("process"),
        Processed::Duplicate
    );
    let metrics = take(&snapshotter);
    assert_eq!(inbox_events(&metrics, "inventory", "processed"), 1);
    assert_eq!(inbox_events(&metrics, "inventory", "duplicate"), 2);
}

test! { the_postgres_inbox_counts_processed_events_and_duplicates, postgres }
async fn the_postgres_inbox_counts_processed_events_and_duplicates() {
    let Some(db) = pg_common::TestDb::create().await else {
        return;
    };
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);

    // On transactions of the inbox's own.
    let store = db.store().await;
    let inbox = PostgresInbox::install(&store, "billing")
        .await
        .expect("inbox");
    for _ in 0..3 {
        inbox
            .process("event-1", |_tx| async { Ok(()) })
            .await
            .expect("process");
    }
    // A failed attempt counts nothing: the event was neither processed nor a duplicate.
    let failed = inbox
        .process("event-2", |_tx| async {
            Err::<(), _>(tower_idempotency::Error::Corrupt("refused".into()))
        })
        .await;
    assert!(failed.is_err());
    let metrics = take(&snapshotter);
    assert_eq!(inbox_events(&metrics, "billing", "processed"), 1);
    assert_eq!(inbox_events(&metrics, "billing", "duplicate"), 2);

    // In the request's transaction (`process_in`), over HTTP behind the layer: the server runs
    // on this thread, so this thread's recorder sees it.
    let receiver = inventory::InventoryServer::spawn(&db, inventory::Mode::Layered).await;
    let envelope = r#"{"id":"event-1","topic":"order_created","payload":{"order_id":1,"tenant":"shop-a","sku":"book","quantity":1}}"#;
    let delivery = common::Post::order("event-1", envelope)
        .path("/events")
        .token(None)
        .header("event-topic", "order_created");
    assert_eq!(
        delivery.send(receiver.addr).await.json()["status"],
        "reserved"
    );
    // Replayed by the layer: the handler, and so the inbox, is not called again.
    assert!(delivery.send(receiver.addr).await.replayed());
    let metrics = take(&snapshotter);
    assert_eq!(inbox_events(&metrics, "inventory", "processed"), 1);
    assert_eq!(inbox_events(&metrics, "inventory", "duplicate"), 0);
}
