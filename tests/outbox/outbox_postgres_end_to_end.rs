//! The outbox end to end on PostgreSQL, over real HTTP: the PostgreSQL order app enqueues
//! `order_created` in each order's transaction, relays (`PostgresOutbox`) POST the events to
//! the inventory example's app on PostgreSQL (`examples/inventory/app.rs`, served in-process
//! in a schema of its own), and the receiver's `PostgresInbox` applies each event once.
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

use support::common;
use support::pg_common;

use support::apps::inventory::{SLOW, SLOW_FOR};
use support::pg_common::inventory;
use support::relay_scenarios;

use std::time::Duration;

use common::{post, Post, PATIENCE, SHOP_A};
use http::StatusCode;
use inventory::{reservations, InventoryProcess, InventoryServer, Mode};
use pg_common::{hook, HookOutcome, PgServer, TestDb};
use relay_scenarios::{
    assert_each_delivered_once, deliver_then_kill, enveloped_sink, redeliver, relays_deliver_all,
    wait_delivered, Http,
};
use serde_json::json;
type PostgresOutbox =
    tower_idempotency::outbox::Outbox<tower_idempotency::store::tokio_postgres::PostgresStore>;
use tower_idempotency::outbox::Relay;

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
                PostgresOutbox::enqueue_in(&client, "order_created", &payload).await
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

/// Orders 2 books, lets a relay deliver the event to the receiver at `events_url` (its tables
/// in `inventory_db`) through `sink` and then hang (killed before it marks the event
/// delivered), then lets a second relay deliver it again. Returns the event id.
async fn deliver_then_kill_then_redeliver(
    orders: &PgServer,
    orders_db: &TestDb,
    (events_url, sink): (http::Uri, fn(http::Uri) -> Http),
    inventory_db: &TestDb,
) -> String {
    let outbox = PostgresOutbox::existing(&orders.store);
    let event_id = deliver_then_kill(&outbox, orders.addr, sink(events_url.clone())).await;
    assert_eq!(event_id.as_str(), only_event(orders_db).await);
    assert_eq!(reservations(inventory_db).await, 1);
    redeliver(&outbox, &event_id, sink(events_url)).await;
    event_id.to_string()
}

/// What [`killed_relay_redelivered`] leaves.
struct Redelivered {
    receiver: InventoryServer,
    orders: PgServer,
    event_id: String,
    /// The receiver's log: both deliveries, answered `200`.
    deliveries: Vec<inventory::Delivery>,
    _dbs: [TestDb; 2],
}

/// [`deliver_then_kill_then_redeliver`] to the test receiver in `mode`, on fresh databases
/// (orders, inventory; `None` without PostgreSQL): the receiver saw both deliveries, with the
/// same id.
async fn killed_relay_redelivered(mode: Mode) -> Option<Redelivered> {
    let (orders_db, inventory_db) = (TestDb::create().await?, TestDb::create().await?);
    let receiver = InventoryServer::spawn(&inventory_db, mode).await;
    let orders = order_app(&orders_db).await;
    let event_id = deliver_then_kill_then_redeliver(
        &orders,
        &orders_db,
        (receiver.events_url(), enveloped_sink),
        &inventory_db,
    )
    .await;
    let deliveries = receiver.deliveries();
    assert_eq!(deliveries.len(), 2, "{deliveries:?}");
    for delivery in &deliveries {
        assert_eq!(delivery.event_id, event_id, "same id on every delivery");
        assert_eq!(delivery.status, StatusCode::OK);
    }
    Some(Redelivered {
        receiver,
        orders,
        event_id,
        deliveries,
        _dbs: [orders_db, inventory_db],
    })
}

test! { a_relay_killed_after_delivery_redelivers_the_same_id_and_the_inbox_applies_it_once, postgres }
async fn a_relay_killed_after_delivery_redelivers_the_same_id_and_the_inbox_applies_it_once() {
    let Some(Redelivered {
        receiver,
        orders,
        event_id,
        deliveries,
        _dbs,
    }) = killed_relay_redelivered(Mode::Inbox).await
    else {
        return;
    };
    assert_eq!(deliveries[0].answer["status"], "reserved");
    assert_eq!(deliveries[1].answer["status"], "duplicate");
    // Applied once: one reservation of 2 books, and the id is in the receiver's inbox.
    assert_eq!(receiver.reservations().await, 1);
    assert_eq!(receiver.reserved("book").await, 2);
    assert!(receiver.inbox.contains(&event_id).await.expect("inbox"));
    orders.shutdown().await;
}

test! { behind_the_layer_the_redelivery_is_replayed_and_the_event_applied_once, postgres }
async fn behind_the_layer_the_redelivery_is_replayed_and_the_event_applied_once() {
    let Some(Redelivered {
        receiver,
        orders,
        event_id,
        deliveries,
        _dbs,
    }) = killed_relay_redelivered(Mode::Layered).await
    else {
        return;
    };
    assert!(!deliveries[0].replayed);
    assert!(deliveries[1].replayed, "the layer answered from its record");
    assert_eq!(deliveries[0].answer, deliveries[1].answer);
    assert_eq!(deliveries[1].answer["status"], "reserved");
    assert_eq!(receiver.reservations().await, 1);
    assert!(receiver.inbox.contains(&event_id).await.expect("inbox"));
    orders.shutdown().await;
}

test! { a_delivery_timed_out_while_the_receiver_applies_it_is_applied_once, multi_thread = 2, postgres }
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
        Relay::new(outbox.clone(), enveloped_sink(receiver.events_url()))
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

test! { two_relays_of_two_instances_deliver_each_event_exactly_once, multi_thread = 4, postgres }
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
            PostgresOutbox::enqueue_in(&*tx, "order_created", &payload)
                .await
                .expect("enqueue");
        }
        tx.commit().await.expect("commit");
    }

    // A second store: another instance, with its own pool and its own relay.
    let other_instance = orders_db
        .store_with(|o| o.with_max_connections(4).with_max_read_connections(1))
        .await;
    relays_deliver_all(
        [
            PostgresOutbox::existing(&orders.store),
            PostgresOutbox::existing(&other_instance),
        ],
        || enveloped_sink(receiver.events_url()),
        EVENTS as u64,
    )
    .await;

    let deliveries = receiver.deliveries();
    assert_each_delivered_once(
        deliveries.iter().map(|d| (d.event_id.as_str(), &d.answer)),
        EVENTS as usize,
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

test! { the_inventory_example_on_postgres_applies_a_redelivered_event_once, postgres }
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

test! { the_orders_example_relays_to_the_inventory_example_on_postgres_once_in_effect, postgres }
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

test! { the_inventory_example_takes_one_store_and_never_prints_the_url }
/// The inventory example's command line for PostgreSQL (no database needed).
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
