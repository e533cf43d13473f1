//! The outbox end to end on PostgreSQL, over real HTTP: the PostgreSQL order app enqueues
//! `order_created` in each order's transaction, relays (`PostgresOutbox`) POST the events to
//! a receiver on PostgreSQL (`tests/pg_common/inventory.rs`, in a schema of its own), and the
//! receiver's `PostgresInbox` applies each event once.
//!
//! - A relay killed after the receiver accepted an event, before marking it delivered: the
//!   next relay delivers it again with the same id, and the receiver acknowledges it without
//!   reserving twice (with the inbox's own transactions, and behind the idempotency layer
//!   with `process_in`).
//! - A delivery that times out at the sender while the receiver is still applying it: the
//!   retry arrives while the first transaction is open, waits for it, and reserves nothing
//!   more.
//! - Two relays of two instances deliver every event exactly once between them.
//! - The inventory example itself (`inventory --database-url ...`, a child process) as the
//!   receiver: of that killed relay's events, and of the orders example's relay (`orders --db
//!   FILE --webhook URL`, a child process too: its relay reads the SQLite store's outbox). It
//!   takes the event id from the body: a redelivery by hand, without the header, is replayed,
//!   and answered `duplicate` by the inbox once the saved answer is gone.
//!
//! Needs `TEST_DATABASE_URL`; without it `cargo test` reports these tests as ignored.
//! (except the command-line checks of the inventory example, which need no database).

mod common;
mod pg_common;

#[path = "pg_common/inventory.rs"]
mod inventory;

use std::collections::HashMap;
use std::time::Duration;

use common::{post, Post, PATIENCE, SHOP_A};
use http::StatusCode;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use inventory::{reservations, InventoryProcess, InventoryServer, Mode, SLOW, SLOW_FOR};
use pg_common::{hook, HookOutcome, PgServer, TestDb};
use serde_json::json;
use tokio::sync::mpsc;
use tower::ServiceExt;
use tower_idempotency::body::{BoxError, RequestBody};
use tower_idempotency::outbox::postgres::{enqueue, PostgresOutbox};
use tower_idempotency::outbox::{sink_fn, EventId, EventStatus, HttpSink, OutboxEvent, Relay};

type Http = HttpSink<Client<HttpConnector, RequestBody>, RequestBody>;

/// A sink as the tests' own receivers take it: the bare payload, the id in the header.
fn http_sink(url: http::Uri) -> Http {
    HttpSink::new(Client::builder(TokioExecutor::new()).build_http(), url)
}

/// The orders example's sink, as the inventory example takes it: the id in the body.
fn enveloped_sink(url: http::Uri) -> Http {
    http_sink(url).with_event_envelope()
}

/// Forgets the inventory example's saved answers (as if they had expired): only its inbox
/// still knows the events.
async fn forget_saved_answers(inventory_db: &TestDb) {
    inventory_db
        .client()
        .await
        .execute("DELETE FROM idempotency_records", &[])
        .await
        .expect("delete the saved answers");
}

/// The PostgreSQL order app whose handler enqueues `order_created` (with the order's sku and
/// quantity, read back through the request's transaction), as the orders example does.
async fn order_app(db: &TestDb) -> PgServer {
    let server = PgServer::builder()
        .hook(hook(|call| async move {
            let enqueued = async {
                let client = call.tx.client().await?;
                let row = client
                    .query_one(
                        "SELECT sku, quantity FROM orders WHERE id = $1",
                        &[&call.order_id],
                    )
                    .await?;
                let payload = json!({
                    "order_id": call.order_id,
                    "tenant": call.tenant,
                    "sku": row.try_get::<_, String>(0)?,
                    "quantity": row.try_get::<_, i64>(1)?,
                });
                enqueue(&client, "order_created", &payload).await
            };
            HookOutcome {
                fail_with: enqueued
                    .await
                    .is_err()
                    .then_some(StatusCode::INTERNAL_SERVER_ERROR),
            }
        }))
        .spawn(db)
        .await;
    PostgresOutbox::install(&server.store)
        .await
        .expect("install outbox");
    server
}

async fn only_event(orders: &TestDb) -> String {
    orders
        .client()
        .await
        .query_one("SELECT event_id FROM outbox_events", &[])
        .await
        .expect("the one event")
        .get(0)
}

/// Waits until `outbox` has `delivered` delivered events.
async fn wait_delivered(outbox: &PostgresOutbox, delivered: u64) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let counts = outbox.counts().await.expect("counts");
        if counts.delivered >= delivered {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not delivered in time: {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Orders 2 books, lets a relay deliver the event to the receiver at `events_url` (its tables
/// in `inventory_db`) and then hang (killed before it
/// marks the event delivered), then lets a second relay deliver it again. Returns the event id.
async fn deliver_then_kill_then_redeliver(
    orders: &PgServer,
    orders_db: &TestDb,
    (events_url, sink): (http::Uri, fn(http::Uri) -> Http),
    inventory_db: &TestDb,
) -> String {
    let outbox = PostgresOutbox::existing(&orders.store);
    // The first relay's sink: delivers for real, reports it, then never returns.
    let (accepted_tx, mut accepted) = mpsc::unbounded_channel::<EventId>();
    let http = sink(events_url.clone());
    let accept_then_hang = sink_fn(move |event: OutboxEvent| {
        let (http, accepted_tx) = (http.clone(), accepted_tx.clone());
        async move {
            let id = event.id().clone();
            http.oneshot(event).await?;
            let _ = accepted_tx.send(id);
            std::future::pending::<Result<(), BoxError>>().await
        }
    });
    let first = tokio::spawn(
        Relay::new(outbox.clone(), accept_then_hang)
            .with_lease(Duration::from_millis(600))
            .with_poll_interval(Duration::from_millis(10))
            .run(),
    );

    let order = post(
        orders.addr,
        Some(SHOP_A),
        Some("k1"),
        r#"{"sku":"book","quantity":2}"#,
        &[],
    )
    .await;
    assert_eq!(order.status, StatusCode::CREATED);
    let event_id = only_event(orders_db).await;

    let accepted_id = tokio::time::timeout(PATIENCE, accepted.recv())
        .await
        .expect("the first relay delivered in time")
        .expect("accepted");
    assert_eq!(accepted_id.as_str(), event_id);
    // Killed: the receiver applied the event, the sender never recorded it.
    first.abort();
    let _ = first.await;
    let event = outbox.event(&event_id).await.expect("read").expect("event");
    assert_eq!(event.status, EventStatus::InFlight, "{event:?}");
    assert_eq!(reservations(inventory_db).await, 1);

    let second = tokio::spawn(
        Relay::new(outbox.clone(), sink(events_url))
            .with_poll_interval(Duration::from_millis(10))
            .run(),
    );
    wait_delivered(&outbox, 1).await;
    second.abort();
    let event = outbox.event(&event_id).await.expect("read").expect("event");
    assert_eq!((event.status, event.attempts), (EventStatus::Delivered, 2));
    event_id
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn a_relay_killed_after_delivery_redelivers_the_same_id_and_the_inbox_applies_it_once() {
    let (Some(orders_db), Some(inventory_db)) = (TestDb::create().await, TestDb::create().await)
    else {
        return;
    };
    let receiver = InventoryServer::spawn(&inventory_db, Mode::Inbox).await;
    let orders = order_app(&orders_db).await;

    let event_id = deliver_then_kill_then_redeliver(
        &orders,
        &orders_db,
        (receiver.events_url(), http_sink),
        &inventory_db,
    )
    .await;

    let deliveries = receiver.deliveries();
    assert_eq!(deliveries.len(), 2, "{deliveries:?}");
    for delivery in &deliveries {
        assert_eq!(delivery.event_id, event_id, "same id on every delivery");
        assert_eq!(delivery.status, StatusCode::OK);
    }
    assert_eq!(deliveries[0].answer["status"], "reserved");
    assert_eq!(deliveries[1].answer["status"], "duplicate");
    // Applied once: one reservation of 2 books, and the id is in the receiver's inbox.
    assert_eq!(receiver.reservations().await, 1);
    assert_eq!(receiver.reserved("book").await, 2);
    assert!(receiver.inbox.contains(&event_id).await.expect("inbox"));
    orders.shutdown().await;
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn behind_the_layer_the_redelivery_is_replayed_and_the_event_applied_once() {
    let (Some(orders_db), Some(inventory_db)) = (TestDb::create().await, TestDb::create().await)
    else {
        return;
    };
    let receiver = InventoryServer::spawn(&inventory_db, Mode::Layered).await;
    let orders = order_app(&orders_db).await;

    let event_id = deliver_then_kill_then_redeliver(
        &orders,
        &orders_db,
        (receiver.events_url(), http_sink),
        &inventory_db,
    )
    .await;

    let deliveries = receiver.deliveries();
    assert_eq!(deliveries.len(), 2, "{deliveries:?}");
    assert!(!deliveries[0].replayed);
    assert!(deliveries[1].replayed, "the layer answered from its record");
    assert_eq!(deliveries[0].answer, deliveries[1].answer);
    assert_eq!(deliveries[1].answer["status"], "reserved");
    assert_eq!(receiver.reservations().await, 1);
    assert!(receiver.inbox.contains(&event_id).await.expect("inbox"));
    orders.shutdown().await;
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_timed_out_while_the_receiver_applies_it_is_applied_once() {
    let (Some(orders_db), Some(inventory_db)) = (TestDb::create().await, TestDb::create().await)
    else {
        return;
    };
    let receiver = InventoryServer::spawn(&inventory_db, Mode::Inbox).await;
    let orders = order_app(&orders_db).await;
    let order = post(
        orders.addr,
        Some(SHOP_A),
        Some("k1"),
        &format!(r#"{{"sku":"{SLOW}","quantity":1}}"#),
        &[],
    )
    .await;
    assert_eq!(order.status, StatusCode::CREATED);
    let event_id = only_event(&orders_db).await;

    // The receiver takes longer than the relay waits: the first attempt times out while the
    // receiver's transaction is still open, and the retries arrive meanwhile. They wait on the
    // event id's primary key until the first commits, then are duplicates.
    let outbox = PostgresOutbox::existing(&orders.store);
    let relay = tokio::spawn(
        Relay::new(outbox.clone(), http_sink(receiver.events_url()))
            .with_delivery_timeout(Duration::from_millis(300))
            .with_backoff(Duration::from_millis(50), Duration::from_millis(100))
            .with_poll_interval(Duration::from_millis(10))
            .run(),
    );
    wait_delivered(&outbox, 1).await;
    relay.abort();

    let event = outbox.event(&event_id).await.expect("read").expect("event");
    assert!(event.attempts >= 2, "the relay delivered again: {event:?}");
    // Let any delivery still running at the receiver finish.
    tokio::time::sleep(SLOW_FOR).await;
    assert_eq!(receiver.reservations().await, 1);
    assert_eq!(receiver.reserved(SLOW).await, 1);
    assert!(receiver.inbox.contains(&event_id).await.expect("inbox"));
    // Only answers the relay waited for are logged (the others' futures were dropped when
    // it hung up): the one that let it mark the event delivered acknowledged a duplicate.
    let deliveries = receiver.deliveries();
    assert!(!deliveries.is_empty());
    for delivery in &deliveries {
        assert_eq!(delivery.event_id, event_id);
        assert_eq!(delivery.status, StatusCode::OK, "{delivery:?}");
        assert_eq!(delivery.answer["status"], "duplicate", "{delivery:?}");
    }
    orders.shutdown().await;
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_of_two_instances_deliver_each_event_exactly_once() {
    const EVENTS: i64 = 40;
    let (Some(orders_db), Some(inventory_db)) = (TestDb::create().await, TestDb::create().await)
    else {
        return;
    };
    let receiver = InventoryServer::spawn(&inventory_db, Mode::Inbox).await;
    let orders = order_app(&orders_db).await;
    // The events of 40 orders, committed before the relays start.
    {
        let mut client = orders.store.client().await.expect("client");
        let tx = client.transaction().await.expect("begin");
        for order_id in 1..=EVENTS {
            let payload = json!({
                "order_id": order_id, "tenant": "shop-a", "sku": "book", "quantity": 1,
            });
            enqueue(&*tx, "order_created", &payload)
                .await
                .expect("enqueue");
        }
        tx.commit().await.expect("commit");
    }

    // A second store: another instance, with its own pool and its own relay.
    let other_instance = orders_db
        .store_with(|o| o.max_connections(4).max_read_connections(1))
        .await;
    let relays: Vec<_> = [
        PostgresOutbox::existing(&orders.store),
        PostgresOutbox::existing(&other_instance),
    ]
    .into_iter()
    .map(|outbox| {
        tokio::spawn(
            Relay::new(outbox, http_sink(receiver.events_url()))
                .with_batch_size(4)
                .with_poll_interval(Duration::from_millis(5))
                .run(),
        )
    })
    .collect();
    let outbox = PostgresOutbox::existing(&orders.store);
    wait_delivered(&outbox, EVENTS as u64).await;
    for relay in relays {
        relay.abort();
    }

    let deliveries = receiver.deliveries();
    let mut per_id: HashMap<&str, usize> = HashMap::new();
    for delivery in &deliveries {
        *per_id.entry(delivery.event_id.as_str()).or_default() += 1;
        assert_eq!(delivery.answer["status"], "reserved", "{delivery:?}");
    }
    assert_eq!(per_id.len(), EVENTS as usize);
    assert!(
        per_id.values().all(|n| *n == 1),
        "an event was delivered twice"
    );
    assert_eq!(receiver.reservations().await, EVENTS);
    assert_eq!(receiver.reserved("book").await, EVENTS);
    orders.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// The inventory example (`examples/inventory.rs --database-url ...`) as a real process
// ---------------------------------------------------------------------------------------------

/// The event id of a delivery line: `event ID: order 1 reserved ...` or `event ID: duplicate...`.
fn event_id_of(line: &str) -> &str {
    line.strip_prefix("event ")
        .and_then(|rest| rest.split_once(": "))
        .map(|(id, _)| id)
        .unwrap_or_else(|| panic!("not a delivery line: {line}"))
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn the_inventory_example_on_postgres_applies_a_redelivered_event_once() {
    let (Some(orders_db), Some(inventory_db)) = (TestDb::create().await, TestDb::create().await)
    else {
        return;
    };
    let mut inventory = InventoryProcess::start(&["--database-url", &inventory_db.url()]).await;
    assert!(
        inventory.banner.contains("(database PostgreSQL)"),
        "{}",
        inventory.banner
    );
    let orders = order_app(&orders_db).await;

    // A relay delivers the event and is killed before it records that; the next relay
    // delivers it again with the same id.
    let event_id = deliver_then_kill_then_redeliver(
        &orders,
        &orders_db,
        (inventory.events_url(), enveloped_sink),
        &inventory_db,
    )
    .await;

    assert_eq!(
        inventory.next_line().await,
        format!("event {event_id}: order 1 reserved 2 x book (book reserved: 2)")
    );
    // The redelivery was replayed by the layer (keyed on the body's id: the handler did not
    // run). Once the saved answer is gone, the inbox acknowledges it.
    forget_saved_answers(&inventory_db).await;
    let payload = json!({ "order_id": 1, "tenant": "shop-a", "sku": "book", "quantity": 2 });
    let late = inventory
        .deliver(&event_id, "order_created", &payload)
        .await;
    assert_eq!(late.json(), json!({ "status": "duplicate" }));
    assert_eq!(
        inventory.next_line().await,
        format!("event {event_id}: duplicate, acknowledged without reserving again")
    );
    assert_eq!(
        inventory.stock().await,
        json!({ "reservations": 1, "reserved": { "book": 2 } })
    );
    assert_eq!(reservations(&inventory_db).await, 1);
    orders.shutdown().await;
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn the_orders_example_relays_to_the_inventory_example_on_postgres_once_in_effect() {
    let Some(inventory_db) = TestDb::create().await else {
        return;
    };
    let mut inventory = InventoryProcess::start(&[
        "--database-url",
        &inventory_db.url(),
        "--reject-sku",
        "broken",
    ])
    .await;
    // PostgreSQL all the way: the orders example's order, its event and the relay's claims in
    // one schema, the inventory's reservation and inbox in another.
    let Some(orders_db) = TestDb::create().await else {
        return;
    };
    let webhook = inventory.events_url().to_string();
    let orders = common::process::OrdersProcess::start_with(&[
        "--database-url",
        &orders_db.url(),
        "--webhook",
        &webhook,
    ])
    .await;

    // An order, and its retry (replayed: no second order, no second event).
    let order = r#"{"sku":"book","quantity":2}"#;
    let created = post(orders.addr, Some(SHOP_A), Some("k1"), order, &[]).await;
    assert_eq!(created.status, StatusCode::CREATED);
    let retried = post(orders.addr, Some(SHOP_A), Some("k1"), order, &[]).await;
    assert_eq!(retried.status, StatusCode::CREATED);
    assert!(retried.replayed());
    let order_id = created.order_id();

    // The relay delivers the event: the inventory reserves the stock.
    let line = inventory.next_line().await;
    let event_id = event_id_of(&line).to_owned();
    assert_eq!(
        line,
        format!("event {event_id}: order {order_id} reserved 2 x book (book reserved: 2)")
    );

    // The same event again (an answer lost on the way, a relay that died), its id only in
    // the body: the first answer replayed, nothing reserved again.
    let payload = json!({ "order_id": order_id, "tenant": "shop-a", "sku": "book", "quantity": 2 });
    let again = inventory
        .deliver(&event_id, "order_created", &payload)
        .await;
    assert_eq!(again.status, StatusCode::OK);
    assert!(again.replayed());
    assert_eq!(
        again.json(),
        json!({ "status": "reserved", "sku": "book", "reserved": 2 })
    );
    // And once the saved answer is gone, the inbox acknowledges it.
    forget_saved_answers(&inventory_db).await;
    let late = inventory
        .deliver(&event_id, "order_created", &payload)
        .await;
    assert_eq!(late.status, StatusCode::OK);
    assert_eq!(late.json(), json!({ "status": "duplicate" }));
    assert_eq!(
        inventory.next_line().await,
        format!("event {event_id}: duplicate, acknowledged without reserving again")
    );
    assert_eq!(
        inventory.stock().await,
        json!({ "reservations": 1, "reserved": { "book": 2 } })
    );
    let rows = inventory_db
        .client()
        .await
        .query(
            "SELECT order_id, tenant, sku, quantity, event_id FROM reservations",
            &[],
        )
        .await
        .expect("reservations");
    assert_eq!(rows.len(), 1);
    let row = &rows[0];
    assert_eq!(
        (
            row.get::<_, i64>(0),
            row.get::<_, String>(1),
            row.get::<_, String>(2),
            row.get::<_, i64>(3),
            row.get::<_, String>(4),
        ),
        (
            order_id,
            "shop-a".into(),
            "book".into(),
            2,
            event_id.clone()
        )
    );
    let recorded: i64 = inventory_db
        .client()
        .await
        .query_one(
            "SELECT count(*) FROM inbox_events WHERE consumer = 'inventory' AND event_id = $1",
            &[&event_id],
        )
        .await
        .expect("inbox")
        .get(0);
    assert_eq!(recorded, 1);

    // The other answers, as on SQLite.
    let refused = inventory
        .deliver(
            "e-broken",
            "order_created",
            &json!({ "order_id": 9, "tenant": "shop-a", "sku": "broken", "quantity": 1 }),
        )
        .await;
    assert_eq!(refused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(refused.json(), json!({ "error": "unknown_sku" }));
    let invalid = inventory
        .deliver("e-invalid", "order_created", &json!({ "sku": "book" }))
        .await;
    assert_eq!(invalid.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(invalid.json(), json!({ "error": "invalid_event" }));
    let ignored = inventory
        .deliver("e-other", "order_shipped", &payload)
        .await;
    assert_eq!(ignored.status, StatusCode::OK);
    assert_eq!(ignored.json(), json!({ "status": "ignored" }));
    let no_id = Post::order("unused", &payload.to_string())
        .path("/events")
        .token(None)
        .no_key()
        .header("event-topic", "order_created")
        .send(inventory.addr)
        .await;
    assert_eq!(no_id.status, StatusCode::BAD_REQUEST);
    assert_eq!(no_id.json(), json!({ "error": "missing_event_id" }));

    // A second order goes through too, and none of the above reserved anything.
    let second = post(
        orders.addr,
        Some(SHOP_A),
        Some("k2"),
        r#"{"sku":"book","quantity":1}"#,
        &[],
    )
    .await;
    assert_eq!(second.status, StatusCode::CREATED);
    let line = inventory.next_line().await;
    assert!(
        line.ends_with("reserved 1 x book (book reserved: 3)"),
        "{line}"
    );
    assert_eq!(
        inventory.stock().await,
        json!({ "reservations": 2, "reserved": { "book": 3 } })
    );
    // The orders side: one event per order (none for the replay), both marked delivered.
    let deadline = std::time::Instant::now() + PATIENCE;
    loop {
        let events: Vec<(String, String)> = orders_db
            .client()
            .await
            .query("SELECT topic, status FROM outbox_events ORDER BY seq", &[])
            .await
            .expect("outbox events")
            .iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect();
        let delivered = ("order_created".to_owned(), "delivered".to_owned());
        if events == [delivered.clone(), delivered] {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "outbox: {events:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    orders.kill().await;
}

/// The inventory example's command line for PostgreSQL (no database needed).
#[tokio::test]
async fn the_inventory_example_takes_one_store_and_never_prints_the_url() {
    // Nothing listens on port 1: it fails at once, without repeating the URL.
    let unreachable = InventoryProcess::run(&[
        "--database-url",
        "postgres://inventory:s3cret-pw@127.0.0.1:1/inventory",
    ])
    .await;
    assert_eq!(unreachable.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&unreachable.stderr);
    assert!(stderr.starts_with("inventory: cannot connect"), "{stderr}");
    assert!(
        !stderr.contains("s3cret-pw"),
        "the password leaked: {stderr}"
    );
    assert!(unreachable.stdout.is_empty());

    let invalid =
        InventoryProcess::run(&["--database-url", "postgres://u:s3cret-pw@h:notaport/db"]).await;
    assert_eq!(invalid.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&invalid.stderr);
    assert!(
        stderr.starts_with("inventory: --database-url: "),
        "{stderr}"
    );
    assert!(
        !stderr.contains("s3cret-pw"),
        "the password leaked: {stderr}"
    );

    let both =
        InventoryProcess::run(&["--db", "inventory.db", "--database-url", "postgres://x@y/z"])
            .await;
    assert_eq!(both.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&both.stderr);
    assert!(
        stderr.starts_with("inventory: --db and --database-url are two different stores"),
        "{stderr}"
    );

    let help = InventoryProcess::run(&["--help"]).await;
    assert!(help.status.success());
    assert!(String::from_utf8_lossy(&help.stdout).contains("--database-url URL"));
}
