//! The receiving end of the orders example's outbox: reserves stock for each `order_created`
//! event, exactly once in effect however often the event is delivered.
//!
//! The orders example (`cargo run --example orders -- --webhook http://127.0.0.1:3001/events`)
//! enqueues an `order_created` event in the same transaction as each order, and its relay
//! POSTs the event here as `{"id": "<event id>", "topic": "order_created", "payload": {...}}`
//! ([`HttpSink::with_event_envelope`](tower_idempotency::outbox::HttpSink::with_event_envelope)).
//! Delivery is at least once: a relay that dies after this service answered, or an answer lost
//! on the way, means the same event arrives again.
//!
//! `POST /events` is behind [`IdempotencyLayer`] keyed on the event's own id, taken from the
//! body ([`KeyExtractor::json_pointer("/id")`](KeyExtractor::json_pointer)), as a webhook
//! receiver keys on a Stripe event's `id`: a redelivery (the same body, whatever its headers)
//! gets the first answer replayed, and the handler does not run again. The handler also
//! records the id in an inbox ([`SqliteInbox`], or [`PostgresInbox`] with `--database-url`)
//! in the same transaction as the reservation and the saved answer, so a redelivery that comes
//! after the saved answer expired (24 hours) is still acknowledged as a `duplicate` and
//! changes nothing.
//!
//! ```text
//! cargo run --example inventory                  # serves on 127.0.0.1:3001, database ./inventory.db
//! cargo run --example inventory -- --database-url postgres://postgres@127.0.0.1/inventory
//! cargo run --example inventory -- --reject-sku broken   # refuses events for one sku (422)
//! curl -s http://127.0.0.1:3001/stock
//! ```
//!
//! Every delivery the handler applied or acknowledged is printed on stdout once its answer has
//! committed (`reserved` or `duplicate`; a replayed one is answered by the layer and not
//! printed); logs go to stderr (set `RUST_LOG`, default `warn`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{Extensions, StatusCode};
use axum::middleware;
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
use tower_idempotency::store::sqlite::{SqliteHandle, SqliteStore};
#[cfg(feature = "tokio-postgres")]
use tower_idempotency::store::tokio_postgres::{tokio_postgres, PostgresHandle, PostgresStore};
use tower_idempotency::{IdempotencyLayer, Rejection};

use cli::{Flag, Flags};

/// Logging, flags and exit codes, as every example has them.
#[path = "common/cli.rs"]
mod cli;

const USAGE: &str = "\
usage: inventory [--addr ADDR] [--db PATH | --database-url URL] [--reject-sku SKU]

  --addr ADDR       address to listen on (default 127.0.0.1:3001)
  --db PATH         SQLite database for reservations and processed event ids
                    (default ./inventory.db)
  --database-url URL
                    PostgreSQL instead (postgres://user@host:5432/db): the tables go in the
                    first schema of the connection's search_path
  --reject-sku SKU  answer 422 to events for this sku (a poison event, to see the sender's
                    relay retry it and then dead-letter it)
  -h, --help        show this help";

/// The receiver's own tables: what it did, and how much of each sku is reserved. The inbox's
/// `inbox_events` lives in the same database, which is what lets an event id and its
/// reservation commit in one transaction.
const INVENTORY_SCHEMA: &str = "
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
const POSTGRES_SCHEMA: &str = "
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

#[tokio::main]
async fn main() -> ExitCode {
    let flags = [
        Flag::Value("--addr"),
        Flag::Value("--db"),
        Flag::Value("--database-url"),
        Flag::Value("--reject-sku"),
    ];
    cli::main("inventory", USAGE, &flags, Options::parse, serve).await
}

/// Where the reservations and the inbox live.
enum Database {
    /// `--db PATH` (the default).
    Sqlite(PathBuf),
    /// `--database-url URL`.
    Postgres(String),
}

struct Options {
    addr: String,
    database: Database,
    reject_sku: Option<String>,
}

impl Options {
    fn parse(mut flags: Flags) -> Result<Self, String> {
        let addr = flags.value("--addr");
        let db = flags.value("--db").map(PathBuf::from);
        let database_url = flags.value("--database-url");
        let reject_sku = flags.value("--reject-sku");
        let database = match (db, database_url) {
            (Some(_), Some(_)) => {
                return Err("--db and --database-url are two different stores: pick one".into())
            }
            (_, Some(url)) => Database::Postgres(url),
            (db, None) => Database::Sqlite(db.unwrap_or_else(|| "inventory.db".into())),
        };
        Ok(Options {
            addr: addr.unwrap_or_else(|| "127.0.0.1:3001".into()),
            database,
            reject_sku,
        })
    }
}

async fn serve(options: Options) -> Result<(), BoxError> {
    let (inventory, described) = match &options.database {
        Database::Sqlite(db) => (
            Inventory::open(db, options.reject_sku).await?,
            db.display().to_string(),
        ),
        #[cfg(feature = "tokio-postgres")]
        Database::Postgres(url) => (
            Inventory::connect(url, options.reject_sku).await?,
            // The URL is not printed: it may carry a password.
            "PostgreSQL".to_owned(),
        ),
        #[cfg(not(feature = "tokio-postgres"))]
        Database::Postgres(_) => {
            return Err("--database-url needs the `tokio-postgres` feature".into())
        }
    };
    let (listener, local) = cli::listen(&options.addr).await?;
    println!(
        "listening on http://{local} (database {described}); events go to POST /events, stock \
         is at GET /stock"
    );
    axum::serve(listener, app(inventory))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

/// The receiver's state: its inbox (with the tables it commits with), and what it refuses.
#[derive(Clone)]
struct Inventory {
    inbox: Inbox,
    reject_sku: Option<Arc<str>>,
}

impl Inventory {
    /// Opens (creating if needed) the SQLite database, the inventory tables and the inbox.
    async fn open(db: &Path, reject_sku: Option<String>) -> Result<Self, BoxError> {
        let store = SqliteStore::open(db)
            .await
            .map_err(|error| format!("cannot open {}: {error}", db.display()))?;
        store.write(|tx| tx.execute_batch(INVENTORY_SCHEMA)).await?;
        let inbox = SqliteInbox::install(&store, "inventory").await?;
        Ok(Inventory {
            inbox: Inbox::Sqlite { store, inbox },
            reject_sku: reject_sku.map(Arc::from),
        })
    }

    /// Connects to PostgreSQL at `url` and creates (if needed) the inventory tables and the
    /// inbox. Several instances may share the database: the inbox applies each event once
    /// between them.
    #[cfg(feature = "tokio-postgres")]
    async fn connect(url: &str, reject_sku: Option<String>) -> Result<Self, BoxError> {
        // The URL is not repeated in errors: it may carry a password.
        let config: tokio_postgres::Config = url
            .parse()
            .map_err(|error| format!("--database-url: {error}"))?;
        // Creates `idempotency_records` too: the layer keeps the answers it replays there.
        let store = PostgresStore::builder(config)
            .build()
            .await
            .map_err(|error| format!("cannot connect: {error}"))?;
        store.client().await?.batch_execute(POSTGRES_SCHEMA).await?;
        let inbox = PostgresInbox::install(&store, "inventory").await?;
        Ok(Inventory {
            inbox: Inbox::Postgres { store, inbox },
            reject_sku: reject_sku.map(Arc::from),
        })
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
                let reserved = tx
                    .run(move |conn| {
                        conn.execute(
                            "INSERT INTO reservations (order_id, tenant, sku, quantity, event_id) \
                             VALUES (?1, ?2, ?3, ?4, ?5)",
                            (order.order_id, &order.tenant, &order.sku, order.quantity, &id),
                        )?;
                        conn.query_row(
                            "INSERT INTO reserved_stock (sku, reserved) VALUES (?1, ?2) \
                             ON CONFLICT (sku) DO UPDATE SET reserved = reserved + excluded.reserved \
                             RETURNING reserved",
                            (&order.sku, order.quantity),
                            |row| row.get::<_, i64>(0),
                        )
                    })
                    .await?;
                Ok(Processed::First(reserved))
            }
            #[cfg(feature = "tokio-postgres")]
            Inbox::Postgres { inbox, .. } => {
                let tx = request.get::<PostgresHandle>().ok_or(missing)?;
                if inbox.process_in(tx, event_id).await? == Receipt::Duplicate {
                    return Ok(Processed::Duplicate);
                }
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
                Ok(Processed::First(row.try_get::<_, i64>(0)?))
            }
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

fn app(inventory: Inventory) -> Router {
    let events = match &inventory.inbox {
        Inbox::Sqlite { store, .. } => post(receive_event).layer(by_event_id(store.clone())),
        #[cfg(feature = "tokio-postgres")]
        Inbox::Postgres { store, .. } => post(receive_event).layer(by_event_id(store.clone())),
    }
    // Outside the layer: the answer has committed by then.
    .layer(middleware::map_response(print_applied));
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

/// What the handler did with a delivery, printed once its answer has committed (a replay,
/// answered by the layer, prints nothing).
#[derive(Clone)]
struct Applied(String);

/// Prints the [`Applied`] line of an answer.
async fn print_applied(response: Response) -> Response {
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
/// layer replays the first answer), so the sender's relay marks it delivered and stops.
async fn receive_event(
    State(inventory): State<Inventory>,
    request: Extensions,
    body: Bytes,
) -> Response {
    // The layer has checked the id already (a body without one is answered `400`).
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

    let processed = inventory.inbox.reserve_in(&request, &id, &order).await;
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
            // Nothing is kept (the layer rolls back): the sender retries, and the retry
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
