//! The inventory app: its tables, its inbox on SQLite or PostgreSQL, and its routes
//! (`POST /events`, `GET /stock`). Served by `examples/inventory.rs` and by the tests, which
//! serve it in-process on a PostgreSQL schema of their own
//! (`tests/support/pg_common/inventory.rs`). Declared with
//! `#[path = "inventory/app.rs"] mod app;`.
//!
//! The example serves [`Mode::Layered`]: `POST /events` behind the idempotency layer, keyed on
//! the event's id. Two options show what the command line does not, and only the tests turn
//! them on: [`Mode::Inbox`], the same receiver without the layer, and
//! [`Inventory::with_fault_skus`], two skus whose deliveries fail or take their time.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{Extensions, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use tower_idempotency::body::BoxError;
use tower_idempotency::key::KeyExtractor;
type SqliteInbox = tower_idempotency::outbox::Inbox<tower_idempotency::store::sqlite::SqliteStore>;
use tower_idempotency::outbox::Processed;
#[cfg(feature = "tokio-postgres")]
type PostgresInbox =
    tower_idempotency::outbox::Inbox<tower_idempotency::store::tokio_postgres::PostgresStore>;
use tower_idempotency::outbox::Receipt;
use tower_idempotency::store::sqlite::rusqlite::{self, Connection};
use tower_idempotency::store::sqlite::{SqliteHandle, SqliteStore};
#[cfg(feature = "tokio-postgres")]
use tower_idempotency::store::tokio_postgres::{tokio_postgres, PostgresHandle, PostgresStore};
use tower_idempotency::{IdempotencyLayer, Rejection};

/// The receiver's own tables: what it did, and how much of each sku is reserved. The inbox's
/// `inbox_events` lives in the same database, which is what lets an event id and its
/// reservation commit in one transaction.
pub const INVENTORY_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS reservations (
    order_id  INTEGER NOT NULL,
    tenant    TEXT    NOT NULL,
    sku       TEXT    NOT NULL,
    quantity  INTEGER NOT NULL,
    event_id  TEXT    NOT NULL
);
CREATE TABLE IF NOT EXISTS reserved_stock (
    sku      TEXT    PRIMARY KEY,
    reserved INTEGER NOT NULL
);";

/// The same tables on PostgreSQL (64-bit integers, as SQLite's are).
#[cfg(feature = "tokio-postgres")]
pub const POSTGRES_SCHEMA: &str = "
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

/// How `POST /events` applies an event once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// What the example serves: behind the idempotency layer, keyed on the event's id; the
    /// handler records the id with `Inbox::process_in` in the request's transaction, so the
    /// id, the reservation and the saved answer commit together. A redelivery gets the first
    /// answer replayed; once that answer expired, the inbox still acknowledges it as a
    /// `duplicate`.
    Layered,
    /// Without the layer, as a receiver that saves no answers would be: `Inbox::process`
    /// records the id and reserves in a transaction of the inbox's own (in a task of its own,
    /// so that a sender hanging up does not cut it short). A redelivery that arrives while the
    /// first is still being applied waits for it, then is a `duplicate`.
    // Only the tests serve it: the command line serves `Layered`.
    #[allow(dead_code)]
    Inbox,
}

/// With [`Inventory::with_fault_skus`], a delivery for this sku records the event id and
/// reserves, then fails (`500`): everything it did rolls back, the id included, so the
/// sender's retry applies the event again.
pub const FAIL_AFTER_RECORD: &str = "fail-after-record";

/// With [`Inventory::with_fault_skus`], a delivery for this sku holds its transaction open for
/// [`SLOW_FOR`] after reserving: long enough for a sender to time out and deliver again
/// meanwhile.
pub const SLOW: &str = "slow";
/// How long a delivery for [`SLOW`] holds its transaction.
pub const SLOW_FOR: Duration = Duration::from_millis(1500);

/// What a delivery does after reserving (see [`Inventory::with_fault_skus`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    FailAfterRecord,
    Slow,
}

impl Fault {
    /// Before the transaction commits: waits for [`SLOW`], fails for [`FAIL_AFTER_RECORD`].
    async fn strike(self) -> Result<(), tower_idempotency::Error> {
        match self {
            Fault::None => Ok(()),
            Fault::Slow => {
                tokio::time::sleep(SLOW_FOR).await;
                Ok(())
            }
            Fault::FailAfterRecord => Err(std::io::Error::other(INJECTED).into()),
        }
    }

    /// The same on SQLite's writer thread, in the inbox's own transaction.
    fn strike_on_writer(self) -> rusqlite::Result<()> {
        match self {
            Fault::None => Ok(()),
            Fault::Slow => {
                std::thread::sleep(SLOW_FOR);
                Ok(())
            }
            // rusqlite's error that carries an error of ours.
            Fault::FailAfterRecord => Err(rusqlite::Error::ToSqlConversionFailure(INJECTED.into())),
        }
    }
}

const INJECTED: &str = "injected failure after recording the id";

/// The receiver's state: its inbox (with the tables it commits with), what it refuses, and
/// how it applies events.
#[derive(Clone)]
pub struct Inventory {
    inbox: Inbox,
    reject_sku: Option<Arc<str>>,
    mode: Mode,
    fault_skus: bool,
}

impl Inventory {
    /// Opens (creating if needed) the SQLite database, the inventory tables and the inbox.
    pub async fn open(db: &Path, reject_sku: Option<String>) -> Result<Self, BoxError> {
        let store = SqliteStore::open(db)
            .await
            .map_err(|error| format!("cannot open {}: {error}", db.display()))?;
        store.write(|tx| tx.execute_batch(INVENTORY_SCHEMA)).await?;
        let inbox = SqliteInbox::install(&store, "inventory").await?;
        Ok(Inventory::new(Inbox::Sqlite { store, inbox }, reject_sku))
    }

    /// Connects to PostgreSQL at `url` and creates (if needed) the inventory tables and the
    /// inbox. Several instances may share the database: the inbox applies each event once
    /// between them.
    #[cfg(feature = "tokio-postgres")]
    pub async fn connect(url: &str, reject_sku: Option<String>) -> Result<Self, BoxError> {
        // The URL is not repeated in errors: it may carry a password.
        let config: tokio_postgres::Config = url
            .parse()
            .map_err(|error| format!("--database-url: {error}"))?;
        // Creates `idempotency_records` too: the layer keeps the answers it replays there.
        let store = PostgresStore::builder(config)
            .build()
            .await
            .map_err(|error| format!("cannot connect: {error}"))?;
        Inventory::on_postgres(store, reject_sku).await
    }

    /// The inventory tables and the inbox on a PostgreSQL store already open (created if
    /// needed).
    #[cfg(feature = "tokio-postgres")]
    pub async fn on_postgres(
        store: PostgresStore,
        reject_sku: Option<String>,
    ) -> Result<Self, BoxError> {
        store.client().await?.batch_execute(POSTGRES_SCHEMA).await?;
        let inbox = PostgresInbox::install(&store, "inventory").await?;
        Ok(Inventory::new(Inbox::Postgres { store, inbox }, reject_sku))
    }

    fn new(inbox: Inbox, reject_sku: Option<String>) -> Self {
        Inventory {
            inbox,
            reject_sku: reject_sku.map(Arc::from),
            mode: Mode::Layered,
            fault_skus: false,
        }
    }

    fn fault(&self, sku: &str) -> Fault {
        match sku {
            _ if !self.fault_skus => Fault::None,
            FAIL_AFTER_RECORD => Fault::FailAfterRecord,
            SLOW => Fault::Slow,
            _ => Fault::None,
        }
    }

    /// How much of each sku is reserved.
    async fn reserved(&self) -> Result<Map<String, Value>, BoxError> {
        let rows = self.inbox.reserved().await?;
        Ok(rows
            .into_iter()
            .map(|(sku, reserved)| (sku, Value::from(reserved)))
            .collect())
    }

    /// How many reservations were made (one per order, however often its event came).
    async fn reservation_count(&self) -> Result<i64, BoxError> {
        self.inbox.reservation_count().await
    }

    /// Applies the event as [`Mode`] says. Returns the sku's new total.
    async fn apply(
        &self,
        request: &Extensions,
        event_id: &str,
        order: &OrderCreated,
    ) -> Result<Processed<i64>, BoxError> {
        let fault = self.fault(&order.sku);
        match self.mode {
            Mode::Layered => {
                let processed = self.inbox.reserve_in(request, event_id, order).await?;
                if let Processed::First(_) = processed {
                    // The layer rolls back the request's transaction if this fails.
                    fault.strike().await?;
                }
                Ok(processed)
            }
            Mode::Inbox => {
                let (inbox, id, order) = (self.inbox.clone(), event_id.to_owned(), order.clone());
                // In a task of its own: a sender that hangs up (its delivery timed out) does not
                // cut the work short; its retry finds the outcome.
                tokio::spawn(async move { inbox.process(&id, order, fault).await })
                    .await
                    .unwrap_or_else(|_| Err("processing the event panicked".into()))
            }
        }
    }
}

/// The options only the tests turn on: the command line serves [`Mode::Layered`] without the
/// fault skus.
#[allow(dead_code)]
impl Inventory {
    /// Applies events in `mode` ([`Mode::Layered`] unless told).
    pub fn with_mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// Turns on the skus [`FAIL_AFTER_RECORD`] and [`SLOW`], to see a rollback and a
    /// redelivery that waits for the first. Off unless told: the example's command line never
    /// turns them on.
    pub fn with_fault_skus(mut self) -> Self {
        self.fault_skus = true;
        self
    }
}

/// The inbox and the database it shares with the inventory tables: the same queries, in
/// each database's own SQL and client.
#[derive(Clone)]
enum Inbox {
    Sqlite {
        store: SqliteStore,
        inbox: SqliteInbox,
    },
    #[cfg(feature = "tokio-postgres")]
    Postgres {
        store: PostgresStore,
        inbox: PostgresInbox,
    },
}

impl Inbox {
    /// Reserves the order's stock in the request's transaction (the one the layer opened),
    /// unless `event_id` was processed before: the id, the reservation and the saved answer
    /// commit together, or none does. Returns the sku's new total.
    async fn reserve_in(
        &self,
        request: &Extensions,
        event_id: &str,
        order: &OrderCreated,
    ) -> Result<Processed<i64>, BoxError> {
        let missing = "no transaction: the route is not behind the layer";
        match self {
            Inbox::Sqlite { inbox, .. } => {
                let tx = request.get::<SqliteHandle>().ok_or(missing)?;
                if inbox.process_in(tx, event_id).await? == Receipt::Duplicate {
                    return Ok(Processed::Duplicate);
                }
                let (id, order) = (event_id.to_owned(), order.clone());
                let reserved = tx.run(move |conn| reserve_on(conn, &id, &order)).await?;
                Ok(Processed::First(reserved))
            }
            #[cfg(feature = "tokio-postgres")]
            Inbox::Postgres { inbox, .. } => {
                let tx = request.get::<PostgresHandle>().ok_or(missing)?;
                if inbox.process_in(tx, event_id).await? == Receipt::Duplicate {
                    return Ok(Processed::Duplicate);
                }
                Ok(Processed::First(
                    reserve_through(tx, event_id, order).await?,
                ))
            }
        }
    }

    /// Records `event_id` and reserves the order's stock in a transaction of the inbox's own
    /// ([`Mode::Inbox`]), unless it was processed before; `fault` strikes before the commit.
    async fn process(
        &self,
        event_id: &str,
        order: OrderCreated,
        fault: Fault,
    ) -> Result<Processed<i64>, BoxError> {
        let id = event_id.to_owned();
        match self {
            Inbox::Sqlite { inbox, .. } => Ok(inbox
                .process(event_id, move |tx| {
                    let reserved = reserve_on(tx, &id, &order)?;
                    fault.strike_on_writer()?;
                    Ok(reserved)
                })
                .await?),
            #[cfg(feature = "tokio-postgres")]
            Inbox::Postgres { inbox, .. } => Ok(inbox
                .process(event_id, move |tx| async move {
                    let reserved = reserve_through(&tx, &id, &order).await?;
                    fault.strike().await?;
                    Ok(reserved)
                })
                .await?),
        }
    }

    /// `(sku, reserved)`, by sku.
    async fn reserved(&self) -> Result<Vec<(String, i64)>, BoxError> {
        const QUERY: &str = "SELECT sku, reserved FROM reserved_stock ORDER BY sku";
        match self {
            Inbox::Sqlite { store, .. } => Ok(store
                .read(|conn| {
                    let mut statement = conn.prepare(QUERY)?;
                    let rows = statement
                        .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?
                        .collect::<Result<Vec<_>, _>>()?;
                    Ok(rows)
                })
                .await?),
            #[cfg(feature = "tokio-postgres")]
            Inbox::Postgres { store, .. } => {
                let rows = store.client().await?.query(QUERY, &[]).await?;
                let rows = rows
                    .iter()
                    .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
                    .collect::<Result<Vec<_>, tokio_postgres::Error>>()?;
                Ok(rows)
            }
        }
    }

    async fn reservation_count(&self) -> Result<i64, BoxError> {
        const QUERY: &str = "SELECT count(*) FROM reservations";
        match self {
            Inbox::Sqlite { store, .. } => Ok(store
                .read(|conn| conn.query_row(QUERY, [], |row| row.get(0)))
                .await?),
            #[cfg(feature = "tokio-postgres")]
            Inbox::Postgres { store, .. } => Ok(store
                .client()
                .await?
                .query_one(QUERY, &[])
                .await?
                .try_get(0)?),
        }
    }
}

/// Reserves the order's stock on SQLite, on the connection of the transaction it runs in;
/// returns the sku's new total.
fn reserve_on(conn: &Connection, event_id: &str, order: &OrderCreated) -> rusqlite::Result<i64> {
    conn.execute(
        "INSERT INTO reservations (order_id, tenant, sku, quantity, event_id) \
         VALUES (?1, ?2, ?3, ?4, ?5)",
        (
            order.order_id,
            &order.tenant,
            &order.sku,
            order.quantity,
            event_id,
        ),
    )?;
    conn.query_row(
        "INSERT INTO reserved_stock (sku, reserved) VALUES (?1, ?2) \
         ON CONFLICT (sku) DO UPDATE SET reserved = reserved + excluded.reserved \
         RETURNING reserved",
        (&order.sku, order.quantity),
        |row| row.get::<_, i64>(0),
    )
}

/// Reserves the order's stock on PostgreSQL through the transaction `tx`; returns the sku's
/// new total.
#[cfg(feature = "tokio-postgres")]
async fn reserve_through(
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
             ON CONFLICT (sku) DO UPDATE \
             SET reserved = reserved_stock.reserved + excluded.reserved \
             RETURNING reserved",
            &[&order.sku, &order.quantity],
        )
        .await?;
    Ok(row.try_get::<_, i64>(0)?)
}

/// `POST /events` (behind the layer in [`Mode::Layered`]) and `GET /stock`.
pub fn app(inventory: Inventory) -> Router {
    let events = match (&inventory.inbox, inventory.mode) {
        (_, Mode::Inbox) => post(receive_event),
        (Inbox::Sqlite { store, .. }, Mode::Layered) => {
            post(receive_event).layer(by_event_id(store.clone()))
        }
        #[cfg(feature = "tokio-postgres")]
        (Inbox::Postgres { store, .. }, Mode::Layered) => {
            post(receive_event).layer(by_event_id(store.clone()))
        }
    };
    Router::new()
        .route("/events", events)
        .route("/stock", get(stock))
        .with_state(inventory)
}

/// The idempotency of `POST /events`, keyed on the event's own id in the body: a redelivery is
/// the same body with the same id, whatever headers it came with.
fn by_event_id<S>(store: S) -> IdempotencyLayer<S> {
    IdempotencyLayer::new(store)
        .with_operation("receive_event")
        .with_key_extractor(KeyExtractor::json_pointer("/id"))
        // One sender here. With several, the tenant would be the sender an authentication
        // layer (a signature, mTLS) recognised, so that their ids cannot collide.
        .with_tenant_extractor(|_| Some(Arc::from("orders")))
        // Said in the receiver's terms: an event without its id in the body.
        .with_error_responder(|rejection, status| {
            let code = match rejection {
                Rejection::MissingKey => "missing_event_id",
                other => other.code(),
            };
            let body = Bytes::from(json!({ "error": code }).to_string());
            let mut response = axum::http::Response::new(body);
            *response.status_mut() = status;
            response.headers_mut().insert(
                axum::http::header::CONTENT_TYPE,
                axum::http::HeaderValue::from_static("application/json"),
            );
            response
        })
}

/// An `order_created` event's payload, as the orders example enqueues it.
#[derive(Clone)]
struct OrderCreated {
    order_id: i64,
    tenant: String,
    sku: String,
    quantity: i64,
}

impl OrderCreated {
    fn parse(value: &Value) -> Option<Self> {
        Some(OrderCreated {
            order_id: value.get("order_id")?.as_i64()?,
            tenant: value.get("tenant")?.as_str()?.to_owned(),
            sku: value.get("sku")?.as_str()?.to_owned(),
            quantity: value.get("quantity")?.as_i64().filter(|q| *q > 0)?,
        })
    }
}

/// What the handler did with a delivery, in its answer's extensions, for
/// [`print_applied`] to print once the answer has committed (a replay, answered by the layer,
/// carries none).
#[derive(Clone)]
pub struct Applied(pub String);

/// Prints the [`Applied`] line of an answer: the example puts it around the app, outside the
/// layer, where the answer has committed.
pub async fn print_applied(response: Response) -> Response {
    if let Some(Applied(line)) = response.extensions().get() {
        println!("{line}");
    }
    response
}

/// `reply`, with the line to print once it has committed.
fn reply_applied(status: StatusCode, body: Value, line: String) -> Response {
    let mut response = reply(status, body);
    response.extensions_mut().insert(Applied(line));
    response
}

/// An event as the orders example's relay POSTs it: `{"id", "topic", "payload"}`.
struct Delivery {
    id: String,
    topic: String,
    payload: Value,
}

impl Delivery {
    fn parse(body: &[u8]) -> Option<Self> {
        let mut value: Value = serde_json::from_slice(body).ok()?;
        Some(Delivery {
            id: value.get("id")?.as_str()?.to_owned(),
            topic: value.get("topic")?.as_str()?.to_owned(),
            payload: value.get_mut("payload")?.take(),
        })
    }
}

/// `POST /events`: applies an event once; a redelivery is acknowledged with `200` too (the
/// layer replays the first answer, or the inbox answers `duplicate`), so the sender's relay
/// marks it delivered and stops.
async fn receive_event(
    State(inventory): State<Inventory>,
    request: Extensions,
    body: Bytes,
) -> Response {
    // Behind the layer, a body without an id was answered `400` already.
    let Some(Delivery { id, topic, payload }) = Delivery::parse(&body) else {
        return reply(
            StatusCode::UNPROCESSABLE_ENTITY,
            json!({ "error": "invalid_event" }),
        );
    };
    if topic != "order_created" {
        // Not ours to act on: acknowledged, so the sender does not retry it forever.
        return reply(StatusCode::OK, json!({ "status": "ignored" }));
    }
    // A payload that cannot be understood will not be understood on a retry either; the
    // sender retries it a few times all the same, then dead-letters it for a person to see.
    let Some(order) = OrderCreated::parse(&payload) else {
        return reply(
            StatusCode::UNPROCESSABLE_ENTITY,
            json!({ "error": "invalid_event" }),
        );
    };
    if inventory.reject_sku.as_deref() == Some(order.sku.as_str()) {
        return reply(
            StatusCode::UNPROCESSABLE_ENTITY,
            json!({ "error": "unknown_sku" }),
        );
    }

    let processed = inventory.apply(&request, &id, &order).await;
    let OrderCreated {
        order_id,
        sku,
        quantity,
        ..
    } = order;
    match processed {
        Ok(Processed::First(reserved)) => reply_applied(
            StatusCode::OK,
            json!({ "status": "reserved", "sku": sku, "reserved": reserved }),
            format!(
                "event {id}: order {order_id} reserved {quantity} x {sku} \
                 ({sku} reserved: {reserved})"
            ),
        ),
        Ok(Processed::Duplicate) => reply_applied(
            StatusCode::OK,
            json!({ "status": "duplicate" }),
            format!("event {id}: duplicate, acknowledged without reserving again"),
        ),
        Err(error) => {
            // Nothing is kept (the transaction rolls back): the sender retries, and the retry
            // applies it.
            tracing::error!(%error, "processing an event failed");
            reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                json!({ "error": "internal_error" }),
            )
        }
    }
}

/// `GET /stock`: `{"reserved":{"book":2},"reservations":2}`.
async fn stock(State(inventory): State<Inventory>) -> Response {
    let counted = async {
        let reserved = inventory.reserved().await?;
        let reservations = inventory.reservation_count().await?;
        Ok::<_, BoxError>(json!({ "reserved": reserved, "reservations": reservations }))
    };
    match counted.await {
        Ok(body) => reply(StatusCode::OK, body),
        Err(error) => {
            tracing::error!(%error, "reading the stock failed");
            reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                json!({ "error": "internal_error" }),
            )
        }
    }
}

fn reply(status: StatusCode, body: Value) -> Response {
    (status, Json(body)).into_response()
}
