//! A receiver of `order_created` events on PostgreSQL, served on 127.0.0.1:0: it reserves
//! stock for each event, with the event id recorded by a [`PostgresInbox`] in the same
//! transaction as the reservation. The PostgreSQL counterpart of `examples/inventory.rs`.
//!
//! Two ways to receive, as a real receiver would choose:
//!
//! - [`Mode::Inbox`]: a plain route; `PostgresInbox::process` opens its own transaction (in a
//!   task of its own, so that a sender hanging up does not cut it short).
//! - [`Mode::Layered`]: the route is behind `IdempotencyLayer` (the event id is the
//!   `Idempotency-Key`), and the handler records the id with `PostgresInbox::process_in` in
//!   the request's transaction: the id, the reservation and the saved response commit together.
//!
//! A delivery for the sku `fail-after-record` records the id, then fails (`500`): everything
//! it did must roll back. One for the sku `slow` holds its transaction open for a while.
//!
//! [`InventoryProcess`] is the example itself (`inventory --database-url ...`) as a child
//! process, for the tests that need no fault injection.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower_idempotency::extract::Tx;
type PostgresInbox =
    tower_idempotency::outbox::Inbox<tower_idempotency::store::tokio_postgres::PostgresStore>;
use tower_idempotency::outbox::{Processed, Receipt, EVENT_TOPIC};
use tower_idempotency::store::tokio_postgres::{PostgresHandle, PostgresStore};
use tower_idempotency::{IdempotencyLayer, IDEMPOTENCY_KEY};

use crate::support::common::{Post, Reply, Serving, PATIENCE};
use crate::support::pg_common::TestDb;

/// The receiver's own tables, next to `inbox_events`.
pub const INVENTORY_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS reservations (
    order_id BIGINT NOT NULL,
    tenant   TEXT   NOT NULL,
    sku      TEXT   NOT NULL,
    quantity BIGINT NOT NULL,
    event_id TEXT   NOT NULL
);
CREATE TABLE IF NOT EXISTS reserved_stock (
    sku      TEXT   PRIMARY KEY,
    reserved BIGINT NOT NULL
);";

/// The sku whose deliveries fail after the id was recorded.
pub const FAIL_AFTER_RECORD: &str = "fail-after-record";

/// The sku whose first application takes [`SLOW_FOR`] after reserving, its transaction
/// still open (`Mode::Inbox`): long enough for the sender to time out and deliver again
/// meanwhile.
pub const SLOW: &str = "slow";
pub const SLOW_FOR: std::time::Duration = std::time::Duration::from_millis(1500);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `PostgresInbox::process`, in a transaction of its own.
    Inbox,
    /// Behind `IdempotencyLayer`, with `PostgresInbox::process_in`.
    Layered,
}

/// The deliveries' log, shared with the SQLite end-to-end tests.
use crate::support::relay_scenarios::delivery_log;
pub use delivery_log::Delivery;
use delivery_log::{event_id_header, log_answer, DeliveryLog};

#[derive(Clone)]
struct Receiver {
    inbox: PostgresInbox,
}

/// The receiver, serving on 127.0.0.1 over its own schema.
pub struct InventoryServer {
    pub addr: SocketAddr,
    pub store: PostgresStore,
    pub inbox: PostgresInbox,
    deliveries: DeliveryLog,
    /// Serves the receiver until dropped.
    _serving: Serving,
}

impl InventoryServer {
    pub async fn spawn(db: &TestDb, mode: Mode) -> Self {
        let store = db
            .store_with(|options| options.with_max_connections(6).with_max_read_connections(2))
            .await;
        store
            .client()
            .await
            .expect("client")
            .batch_execute(INVENTORY_SCHEMA)
            .await
            .expect("inventory tables");
        let inbox = PostgresInbox::install(&store, "inventory")
            .await
            .expect("install the inbox");
        let receiver = Receiver {
            inbox: inbox.clone(),
        };
        let route = match mode {
            Mode::Inbox => post(receive_with_inbox),
            Mode::Layered => post(receive_in_request).layer(
                IdempotencyLayer::new(store.clone())
                    .with_operation("receive_event")
                    // One sender: the orders service.
                    .with_tenant_extractor(|_| Some("orders".into())),
            ),
        };
        let deliveries = Arc::new(Mutex::new(Vec::new()));
        let app = Router::new()
            .route("/events", route)
            .with_state(receiver)
            .layer(middleware::from_fn_with_state(
                deliveries.clone(),
                log_delivery,
            ));
        let serving = Serving::start(app).await;
        InventoryServer {
            addr: serving.addr,
            store,
            inbox,
            deliveries,
            _serving: serving,
        }
    }

    pub fn events_url(&self) -> http::Uri {
        format!("http://{}/events", self.addr).parse().expect("uri")
    }

    pub fn deliveries(&self) -> Vec<Delivery> {
        self.deliveries.lock().expect("deliveries").clone()
    }

    /// How many reservations were made.
    pub async fn reservations(&self) -> i64 {
        let client = self.store.client().await.expect("client");
        client
            .query_one("SELECT count(*) FROM reservations", &[])
            .await
            .expect("count reservations")
            .get(0)
    }

    /// How much of `sku` is reserved (0 if none).
    pub async fn reserved(&self, sku: &str) -> i64 {
        let client = self.store.client().await.expect("client");
        client
            .query_opt(
                "SELECT reserved FROM reserved_stock WHERE sku = $1",
                &[&sku],
            )
            .await
            .expect("reserved")
            .map_or(0, |row| row.get(0))
    }
}

/// Logs the event id and the answer of every `POST /events`.
async fn log_delivery(
    State(deliveries): State<DeliveryLog>,
    request: Request,
    next: Next,
) -> Response {
    let event_id = event_id_header(request.headers());
    log_answer(&deliveries, event_id, next.run(request).await).await
}

/// An `order_created` payload.
struct OrderCreated {
    order_id: i64,
    tenant: String,
    sku: String,
    quantity: i64,
}

/// The event id and the order, or the answer to give.
fn parse(
    headers: &HeaderMap,
    payload: &[u8],
) -> Result<(String, OrderCreated), (StatusCode, Value)> {
    let event_id = headers
        .get(IDEMPOTENCY_KEY)
        .and_then(|value| value.to_str().ok())
        .filter(|id| !id.is_empty())
        .ok_or((
            StatusCode::BAD_REQUEST,
            json!({ "error": "missing_event_id" }),
        ))?;
    if headers.get(EVENT_TOPIC).and_then(|v| v.to_str().ok()) != Some("order_created") {
        return Err((StatusCode::OK, json!({ "status": "ignored" })));
    }
    let order = serde_json::from_slice::<Value>(payload)
        .ok()
        .and_then(|value| {
            Some(OrderCreated {
                order_id: value.get("order_id")?.as_i64()?,
                tenant: value.get("tenant")?.as_str()?.to_owned(),
                sku: value.get("sku")?.as_str()?.to_owned(),
                quantity: value.get("quantity")?.as_i64().filter(|q| *q > 0)?,
            })
        })
        .ok_or((
            StatusCode::UNPROCESSABLE_ENTITY,
            json!({ "error": "invalid_event" }),
        ))?;
    Ok((event_id.to_owned(), order))
}

/// Reserves the order's stock through `tx`; returns the sku's new reserved total.
async fn reserve(
    tx: &PostgresHandle,
    event_id: &str,
    order: &OrderCreated,
) -> Result<i64, tower_idempotency::Error> {
    let client = tx.client().await?;
    client
        .execute(
            "INSERT INTO reservations (order_id, tenant, sku, quantity, event_id) \
             VALUES ($1, $2, $3, $4, $5)",
            &[
                &order.order_id,
                &order.tenant,
                &order.sku,
                &order.quantity,
                &event_id,
            ],
        )
        .await?;
    let row = client
        .query_one(
            "INSERT INTO reserved_stock (sku, reserved) VALUES ($1, $2) \
             ON CONFLICT (sku) DO UPDATE SET reserved = reserved_stock.reserved + excluded.reserved \
             RETURNING reserved",
            &[&order.sku, &order.quantity],
        )
        .await?;
    Ok(row.try_get(0)?)
}

/// `Mode::Inbox`: the id and the reservation in a transaction of the inbox's own.
async fn receive_with_inbox(
    State(receiver): State<Receiver>,
    headers: HeaderMap,
    payload: Bytes,
) -> Response {
    let (event_id, order) = match parse(&headers, &payload) {
        Ok(parsed) => parsed,
        Err((status, body)) => return reply(status, body),
    };
    let id = event_id.clone();
    // In a task of its own: a sender that hangs up (its delivery timed out) does not cut the
    // work short; its retry finds the outcome.
    let processed = tokio::spawn(async move {
        receiver
            .inbox
            .process(&event_id, |tx| async move {
                let reserved = reserve(&tx, &id, &order).await?;
                if order.sku == SLOW {
                    tokio::time::sleep(SLOW_FOR).await;
                }
                if order.sku == FAIL_AFTER_RECORD {
                    return Err(tower_idempotency::Error::Corrupt(
                        "injected failure after recording the id".into(),
                    ));
                }
                Ok((order.sku, reserved))
            })
            .await
    })
    .await
    .unwrap_or_else(|_| Err(tower_idempotency::Error::Panicked));
    match processed {
        Ok(Processed::First((sku, reserved))) => reply(
            StatusCode::OK,
            json!({ "status": "reserved", "sku": sku, "reserved": reserved }),
        ),
        Ok(Processed::Duplicate) => reply(StatusCode::OK, json!({ "status": "duplicate" })),
        Err(error) => reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            json!({ "error": error.to_string() }),
        ),
    }
}

/// `Mode::Layered`: the id, the reservation and the saved response in the request's
/// transaction.
async fn receive_in_request(
    State(receiver): State<Receiver>,
    Tx(tx): Tx<PostgresHandle>,
    headers: HeaderMap,
    payload: Bytes,
) -> Response {
    let (event_id, order) = match parse(&headers, &payload) {
        Ok(parsed) => parsed,
        Err((status, body)) => return reply(status, body),
    };
    let handled = async {
        if receiver.inbox.process_in(&tx, &event_id).await? == Receipt::Duplicate {
            return Ok(json!({ "status": "duplicate" }));
        }
        let reserved = reserve(&tx, &event_id, &order).await?;
        Ok::<_, tower_idempotency::Error>(
            json!({ "status": "reserved", "sku": &order.sku, "reserved": reserved }),
        )
    };
    match handled.await {
        Ok(_) if order.sku == FAIL_AFTER_RECORD => reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            json!({ "error": "injected failure after recording the id" }),
        ),
        Ok(body) => reply(StatusCode::OK, body),
        Err(error) if error.is_busy() => reply(
            StatusCode::SERVICE_UNAVAILABLE,
            json!({ "error": error.to_string() }),
        ),
        Err(error) => reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            json!({ "error": error.to_string() }),
        ),
    }
}

fn reply(status: StatusCode, body: Value) -> Response {
    (status, Json(body)).into_response()
}

use crate::support::common::process;

/// `inventory --addr 127.0.0.1:0 ARGS...` (the example), a child process killed when dropped,
/// with its stdout lines (one per delivery) readable by the test.
pub struct InventoryProcess {
    pub addr: SocketAddr,
    /// The first line: `listening on http://ADDR (database ...); ...`.
    pub banner: String,
    process: process::ExampleProcess,
}

impl InventoryProcess {
    /// Starts the example with these arguments and waits until it listens.
    pub async fn start(args: &[&str]) -> InventoryProcess {
        let process = process::ExampleProcess::start("inventory", args).await;
        InventoryProcess {
            addr: process.addr,
            banner: process.banner.clone(),
            process,
        }
    }

    /// Runs the example with these arguments (and `--addr 127.0.0.1:0`) to its end: for the
    /// command lines that exit at once.
    pub async fn run(args: &[&str]) -> std::process::Output {
        let args = [&["--addr", "127.0.0.1:0"][..], args].concat();
        process::run_example("inventory", &args, PATIENCE).await
    }

    pub fn events_url(&self) -> http::Uri {
        format!("http://{}/events", self.addr).parse().expect("uri")
    }

    /// The next line the example printed (a delivery: `event ID: ...`).
    pub async fn next_line(&mut self) -> String {
        self.process.next_line().await
    }

    /// `POST /events` by hand, as the orders example's relay does, but with no header: the
    /// event id and the topic only in the body's envelope.
    pub async fn deliver(&self, event_id: &str, topic: &str, payload: &Value) -> Reply {
        let envelope = json!({ "id": event_id, "topic": topic, "payload": payload });
        Post::order("unused", &envelope.to_string())
            .path("/events")
            .token(None)
            .no_key()
            .send(self.addr)
            .await
    }

    /// `GET /stock`.
    pub async fn stock(&self) -> Value {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Empty<Bytes>>();
        let uri: http::Uri = format!("http://{}/stock", self.addr).parse().expect("uri");
        let response = client.get(uri).await.expect("GET /stock");
        assert_eq!(response.status(), StatusCode::OK);
        let body = response
            .into_body()
            .collect()
            .await
            .expect("stock body")
            .to_bytes();
        serde_json::from_slice(&body).expect("stock is JSON")
    }
}

/// How many reservations the receiver on `db` made (the in-process one or the example).
pub async fn reservations(db: &TestDb) -> i64 {
    db.client()
        .await
        .query_one("SELECT count(*) FROM reservations", &[])
        .await
        .expect("count reservations")
        .get(0)
}
