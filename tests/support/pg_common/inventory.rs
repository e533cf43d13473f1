//! The inventory example's app ([`apps::inventory`](crate::apps::inventory), the
//! module `examples/inventory.rs` serves) in-process on PostgreSQL, on a test schema of its
//! own: [`InventoryServer`], with the fault skus on and a log of every delivery, in either
//! [`Mode`] (behind the idempotency layer, or on the inbox's own transactions). A delivery
//! for the sku `FAIL_AFTER_RECORD` records the id, then fails (`500`): everything it did
//! must roll back. One for the sku `SLOW` holds its transaction open for `SLOW_FOR` (the app's
//! constants).
//!
//! [`InventoryProcess`] is the example itself (`inventory --database-url ...`) as a child
//! process, for the tests that need no fault injection.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::Response;
use http_body_util::BodyExt;
use serde_json::{json, Value};
type PostgresInbox =
    tower_idempotency::outbox::Inbox<tower_idempotency::store::tokio_postgres::PostgresStore>;
use tower_idempotency::store::tokio_postgres::PostgresStore;

pub use crate::apps::inventory::Mode;
use crate::apps::inventory::{app, Inventory};
use crate::common::{Post, Reply, Serving, PATIENCE};
use crate::pg_common::TestDb;

/// The deliveries' log, shared with the SQLite end-to-end tests.
use crate::relay_scenarios::delivery_log;
pub use delivery_log::Delivery;
use delivery_log::{event_id_header, log_answer, DeliveryLog};

/// The example's app, serving on 127.0.0.1 over its own schema, its deliveries logged.
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
        let inventory = Inventory::on_postgres(store.clone(), None)
            .await
            .expect("the inventory's tables and inbox")
            .with_mode(mode)
            .with_fault_skus();
        // The app's inbox, as the test reads it (installed by the app already).
        let inbox = PostgresInbox::install(&store, "inventory")
            .await
            .expect("the inventory's inbox");
        let deliveries = Arc::new(Mutex::new(Vec::new()));
        let app = app(inventory).layer(middleware::from_fn_with_state(
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

/// Logs the event id (its `Idempotency-Key`, which the relay sends beside the body's) and the
/// answer of every delivery.
async fn log_delivery(
    State(deliveries): State<DeliveryLog>,
    request: Request,
    next: Next,
) -> Response {
    let event_id = event_id_header(request.headers());
    log_answer(&deliveries, event_id, next.run(request).await).await
}

use crate::common::process;

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
