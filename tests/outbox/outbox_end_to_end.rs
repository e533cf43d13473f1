//! The outbox end to end over real HTTP: the order app enqueues `order_created` in each
//! order's transaction, relays POST the events to the inventory example (`examples/inventory.rs`,
//! run as a process on loopback, behind a proxy that logs each delivery), and the inventory's
//! inbox applies each event once.
//!
//! - A relay killed after the receiver accepted an event but before marking it delivered: the
//!   next relay delivers it again with the same id, and the receiver (keyed on the id in the
//!   body) replays its first answer without reserving twice.
//! - The same event body posted again without the header, or with another one, is applied
//!   once; once the saved answer is gone, the inbox still acknowledges it as a duplicate.
//! - Two relays on two connections to one file (as two processes would be) deliver every event
//!   exactly once between them.

use support::common;
use support::relay_scenarios;
use support::relay_scenarios::delivery_log;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::{Request, State};
use axum::response::Response;
use axum::Router;
use bytes::Bytes;
use common::process::{arg, ExampleProcess};
use common::{hook, post, HookOutcome, Serving, TestServer, PATIENCE, SHOP_A};
use delivery_log::{event_id_header, log_answer, Delivery, DeliveryLog};
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use relay_scenarios::{
    assert_each_delivered_once, deliver_then_kill, enveloped_sink, redeliver, relays_deliver_all,
};
use serde_json::{json, Value};
type SqliteInbox = tower_idempotency::outbox::Inbox<tower_idempotency::store::sqlite::SqliteStore>;
type SqliteOutbox =
    tower_idempotency::outbox::Outbox<tower_idempotency::store::sqlite::SqliteStore>;
use tower_idempotency::outbox::{EventStatus, OutboxStore, Relay};
use tower_idempotency::store::sqlite::SqliteStore;

/// The inventory example as a process on a fresh SQLite file, behind a loopback proxy that
/// logs every delivery.
struct InventoryServer {
    /// The proxy's address: where the relays deliver.
    addr: SocketAddr,
    deliveries: DeliveryLog,
    /// Serves the proxy until dropped.
    _proxy: Serving,
    /// Killed first when dropped, before the directory of its file goes.
    process: ExampleProcess,
    /// The test's own connection to the inventory's file.
    store: SqliteStore,
    _dir: tempfile::TempDir,
}

impl InventoryServer {
    /// `inventory --db FILE ARGS...`, behind the logging proxy.
    async fn spawn(args: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = dir.path().join("inventory.db");
        let process =
            ExampleProcess::start("inventory", &[&["--db", arg(&db)][..], args].concat()).await;
        let store = SqliteStore::open(&db)
            .await
            .expect("open the inventory's database");
        let deliveries = Arc::new(Mutex::new(Vec::new()));
        let proxy = Proxy {
            upstream: process.addr,
            client: Client::builder(TokioExecutor::new()).build_http(),
            deliveries: deliveries.clone(),
        };
        let proxy = Serving::start(Router::new().fallback(forward).with_state(proxy)).await;
        InventoryServer {
            addr: proxy.addr,
            deliveries,
            _proxy: proxy,
            process,
            store,
            _dir: dir,
        }
    }

    fn events_url(&self) -> http::Uri {
        format!("http://{}/events", self.addr).parse().expect("uri")
    }

    fn deliveries(&self) -> Vec<Delivery> {
        self.deliveries.lock().expect("deliveries").clone()
    }

    /// How many reservations the inventory made.
    async fn reservations(&self) -> i64 {
        self.stock().await["reservations"]
            .as_i64()
            .expect("a count of reservations")
    }

    /// `GET /stock` on the example: `{"reserved":{"book":2},"reservations":1}`.
    async fn stock(&self) -> Value {
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let uri: http::Uri = format!("http://{}/stock", self.process.addr)
            .parse()
            .expect("uri");
        let response = tokio::time::timeout(PATIENCE, client.get(uri))
            .await
            .expect("stock in time")
            .expect("GET /stock");
        assert_eq!(response.status(), StatusCode::OK);
        let body = response.into_body().collect().await.expect("stock body");
        serde_json::from_slice(&body.to_bytes()).expect("stock is JSON")
    }

    /// Whether the inventory's inbox recorded `event_id`.
    async fn processed(&self, event_id: &str) -> bool {
        SqliteInbox::install(&self.store, "inventory")
            .await
            .expect("the inventory's inbox")
            .contains(event_id)
            .await
            .expect("inbox")
    }
}

/// The proxy in front of the inventory example.
#[derive(Clone)]
struct Proxy {
    upstream: SocketAddr,
    client: Client<HttpConnector, Full<Bytes>>,
    deliveries: DeliveryLog,
}

/// Forwards a request to the inventory, and logs the event id and the answer of each.
async fn forward(State(proxy): State<Proxy>, request: Request) -> Response {
    let event_id = event_id_header(request.headers());
    let (mut parts, body) = request.into_parts();
    let body = body.collect().await.expect("delivery").to_bytes();
    parts.uri = format!("http://{}{}", proxy.upstream, parts.uri.path())
        .parse()
        .expect("uri");
    let response = proxy
        .client
        .request(http::Request::from_parts(parts, Full::new(body)))
        .await
        .expect("the inventory answers");
    log_answer(
        &proxy.deliveries,
        event_id,
        response.map(axum::body::Body::new),
    )
    .await
}

/// The order app whose handler enqueues `order_created` as the orders example does.
async fn order_app() -> TestServer {
    let server = TestServer::builder()
        .hook(hook(|call| async move {
            let payload = json!({
                "order_id": call.order_id,
                "tenant": call.tenant,
                "sku": call.sku,
                "quantity": call.quantity,
            });
            let enqueued = call
                .tx
                .run(move |conn| SqliteOutbox::enqueue_in(conn, "order_created", &payload))
                .await;
            HookOutcome {
                fail_with: enqueued
                    .is_err()
                    .then_some(StatusCode::INTERNAL_SERVER_ERROR),
                ..HookOutcome::default()
            }
        }))
        .spawn()
        .await;
    SqliteOutbox::install(&server.store)
        .await
        .expect("install outbox");
    server
}

async fn only_event(store: &SqliteStore) -> String {
    store
        .read(|conn| conn.query_row("SELECT event_id FROM outbox_events", [], |row| row.get(0)))
        .await
        .expect("the one event")
}

test! { a_relay_killed_after_delivery_redelivers_the_same_id_and_the_receiver_applies_it_once }
async fn a_relay_killed_after_delivery_redelivers_the_same_id_and_the_receiver_applies_it_once() {
    let inventory = InventoryServer::spawn(&[]).await;
    let orders = order_app().await;
    let outbox = SqliteOutbox::existing(&orders.store);

    // A relay delivers the event and is killed before it records that; the next relay
    // delivers it again with the same id.
    let event_id =
        deliver_then_kill(&outbox, orders.addr, enveloped_sink(inventory.events_url())).await;
    assert_eq!(event_id.as_str(), only_event(&orders.store).await);
    assert_eq!(inventory.reservations().await, 1);
    redeliver(&outbox, &event_id, enveloped_sink(inventory.events_url())).await;
    let event_id = event_id.to_string();

    let deliveries = inventory.deliveries();
    assert_eq!(deliveries.len(), 2, "{deliveries:?}");
    for delivery in &deliveries {
        assert_eq!(delivery.event_id, event_id, "same id on every delivery");
        assert_eq!(delivery.status, StatusCode::OK);
    }
    assert_eq!(deliveries[0].answer["status"], "reserved");
    // The redelivery is the same body: the layer answers it from its record.
    assert!(!deliveries[0].replayed);
    assert!(deliveries[1].replayed, "{deliveries:?}");
    assert_eq!(deliveries[1].answer, deliveries[0].answer);
    // Applied once: one reservation of 2 books, and the id is in the receiver's inbox.
    assert_eq!(inventory.reservations().await, 1);
    assert_eq!(inventory.stock().await["reserved"]["book"], json!(2));
    assert!(inventory.processed(&event_id).await);
}

test! { two_relays_at_once_deliver_each_event_exactly_once }
async fn two_relays_at_once_deliver_each_event_exactly_once() {
    const EVENTS: i64 = 40;
    let inventory = InventoryServer::spawn(&[]).await;
    let orders = order_app().await;
    // The events of 40 orders, committed before the relays start.
    orders
        .store
        .write(|tx| {
            for order_id in 1..=EVENTS {
                let payload = json!({
                    "order_id": order_id, "tenant": "shop-a", "sku": "book", "quantity": 1,
                });
                SqliteOutbox::enqueue_in(tx, "order_created", &payload)?;
            }
            Ok(())
        })
        .await
        .expect("enqueue");

    // A second store on the same file: its own writer connection, as another process has.
    let other_process = SqliteStore::open(&orders.db_path)
        .await
        .expect("open again");
    let outbox = SqliteOutbox::existing(&orders.store);
    relays_deliver_all(
        [outbox.clone(), SqliteOutbox::existing(&other_process)],
        || enveloped_sink(inventory.events_url()),
        EVENTS as u64,
    )
    .await;

    let deliveries = inventory.deliveries();
    assert_each_delivered_once(
        deliveries.iter().map(|d| (d.event_id.as_str(), &d.answer)),
        EVENTS as usize,
    );
    assert_eq!(inventory.reservations().await, EVENTS);
    let backlog = outbox.backlog().await.expect("backlog");
    assert_eq!((backlog.pending, backlog.dead), (0, 0));
}

test! { the_receiver_refusing_an_event_leaves_it_for_retry_and_reserves_nothing }
async fn the_receiver_refusing_an_event_leaves_it_for_retry_and_reserves_nothing() {
    let inventory = InventoryServer::spawn(&["--reject-sku", "broken"]).await;
    let url = inventory.events_url();

    let orders = order_app().await;
    let reply = post(
        orders.addr,
        Some(SHOP_A),
        Some("k1"),
        r#"{"sku":"broken","quantity":1}"#,
        &[],
    )
    .await;
    assert_eq!(reply.status, StatusCode::CREATED);
    let outbox = SqliteOutbox::existing(&orders.store);
    let mut relay = Relay::new(outbox.clone(), enveloped_sink(url)).with_max_attempts(2);
    let report = relay.run_once().await.expect("round");
    assert_eq!((report.claimed, report.retried), (1, 1));
    let event = outbox
        .event(&only_event(&orders.store).await)
        .await
        .expect("read")
        .expect("event");
    assert_eq!(event.status, EventStatus::Pending);
    let error = event.last_error.unwrap_or_default();
    assert!(
        error.contains("422") && error.contains("unknown_sku"),
        "the receiver's answer is kept for the operator: {error}"
    );
    assert_eq!(inventory.reservations().await, 0);
}

test! { the_same_event_body_without_the_header_is_applied_once }
async fn the_same_event_body_without_the_header_is_applied_once() {
    let inventory = InventoryServer::spawn(&[]).await;
    let event_id = "0193a4b2-7c1d-7e2f-9a3b-4c5d6e7f8091";
    let body = json!({
        "id": event_id,
        "topic": "order_created",
        "payload": { "order_id": 1, "tenant": "shop-a", "sku": "book", "quantity": 2 },
    })
    .to_string();
    let deliver = |key: Option<&'static str>| {
        let body = body.clone();
        let addr = inventory.addr;
        async move {
            let post = common::Post::order(key.unwrap_or("unused"), &body)
                .path("/events")
                .token(None);
            let post = if key.is_some() { post } else { post.no_key() };
            post.send(addr).await
        }
    };

    let first = deliver(Some("header-1")).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.json()["status"], "reserved");
    assert!(!first.replayed());
    // The same event: no header, then another header. The key is the body's `/id`.
    for again in [deliver(None).await, deliver(Some("header-2")).await] {
        assert_eq!(again.status, StatusCode::OK);
        assert!(again.replayed(), "answered from the record");
        assert_eq!(again.json(), first.json());
    }
    assert_eq!(inventory.reservations().await, 1);
    assert_eq!(inventory.stock().await["reserved"]["book"], json!(2));

    // Once the saved answer is gone (expired, or deleted as here), the inbox still has the
    // id: acknowledged as a duplicate, nothing reserved again.
    let admin = tower_idempotency::admin::Admin::new(inventory.store.clone());
    assert!(admin
        .delete("orders", "receive_event", event_id)
        .await
        .expect("delete the record"));
    let late = deliver(None).await;
    assert_eq!(late.status, StatusCode::OK);
    assert_eq!(late.json(), json!({ "status": "duplicate" }));
    assert_eq!(inventory.reservations().await, 1);
    assert!(inventory.processed(event_id).await);

    // An event without its id in the body is refused, whatever header it carries.
    let payload = json!({ "order_id": 2, "tenant": "shop-a", "sku": "book", "quantity": 1 });
    let no_id = common::Post::order("header-3", &payload.to_string())
        .path("/events")
        .token(None)
        .send(inventory.addr)
        .await;
    assert_eq!(no_id.status, StatusCode::BAD_REQUEST);
    assert_eq!(no_id.json(), json!({ "error": "missing_event_id" }));
    assert_eq!(inventory.reservations().await, 1);
}
