//! A stand-in payment provider: the counterpart of the `checkout` example, which calls it to
//! charge each order, with faults to inject by flag.
//!
//! `POST /charges` takes its own `Idempotency-Key` and `{"amount_cents": N}`. The route is
//! behind this crate's own `IdempotencyLayer` on a `SqliteStore`: the charge row is written
//! through the request's transaction, so it commits with the saved `201` or not at all, and a
//! key is never charged twice, across crashes too. `amount_cents` 402 is a declined card
//! (`402`, never saved: a retry is declined again).
//!
//! ```text
//! cargo run --example payments -- --addr 127.0.0.1:3002 --db payments.db
//! curl -i http://127.0.0.1:3002/charges -H 'Idempotency-Key: k1' \
//!     -H 'Content-Type: application/json' -d '{"amount_cents":1200}'
//! curl -i http://127.0.0.1:3002/charges -H 'Idempotency-Key: k1' \
//!     -H 'Content-Type: application/json' -d '{"amount_cents":1200}'   # same charge_id
//! curl http://127.0.0.1:3002/stats
//! ```
//!
//! Faults, each drawn per request (see `--help`): `--fail-rate P` answers `503` with
//! `Retry-After: 1` before charging; `--drop-after-charge-rate P` lets the charge commit, then
//! closes the connection without an answer (a repeat of the key gets the saved charge);
//! `--delay-ms N` waits before each charge. A repeat that arrives while the first request with
//! its key is still being handled is answered `409 {"error":"request_in_flight"}` by the layer:
//! a caller retries it later.
//!
//! `GET /stats` counts `requests` (every `POST /charges` received since the database file was
//! created: durable across restarts), `charges` (money taken) and `charges_by_key`.
//!
//! Logs go to stderr; set `RUST_LOG` (default `warn`) to see more.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{json, Map, Value};
use tower::ServiceExt;
use tower_idempotency::body::BoxError;
use tower_idempotency::extract::Tx;
use tower_idempotency::fingerprint::Fingerprinter;
use tower_idempotency::store::sqlite::rusqlite::{self, Connection};
use tower_idempotency::store::sqlite::{SqliteHandle, SqliteStore};
use tower_idempotency::{IdempotencyLayer, Tenant};

use cli::{Flag, Flags};

/// Logging, flags and exit codes, as every example has them.
#[path = "common/cli.rs"]
mod cli;

const USAGE: &str = "\
A stand-in payment provider (the counterpart of the checkout example).

usage: payments [--addr ADDR] [--db FILE] [--fail-rate P] [--drop-after-charge-rate P]
                [--delay-ms N]

  --addr ADDR                 listen on ADDR (default 127.0.0.1:3002)
  --db FILE                   the SQLite file of charges and keys (default payments.db)
  --fail-rate P               answer 503 + Retry-After: 1 before charging, with probability
                              P in 0..=1 per request (default 0)
  --drop-after-charge-rate P  commit the charge, then close the connection without an answer,
                              with probability P per request (default 0)
  --delay-ms N                wait N ms before handling each charge (default 0)

POST /charges (Idempotency-Key, {\"amount_cents\": N}): 201 {\"charge_id\"}, the same id on a
repeat; 402 {\"error\":\"card_declined\"} for amount_cents 402.
GET /stats: {\"requests\", \"charges\", \"charges_by_key\"}; requests counts every POST /charges
since the database file was created (durable across restarts).";

const FLAGS: &[Flag] = &[
    Flag::Value("--addr"),
    Flag::Value("--db"),
    Flag::Value("--fail-rate"),
    Flag::Value("--drop-after-charge-rate"),
    Flag::Value("--delay-ms"),
];

/// The tables beside the idempotency records.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS payment_charges (
    charge_id TEXT PRIMARY KEY,
    idempotency_key TEXT NOT NULL,
    amount_cents INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS payment_requests (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    received INTEGER NOT NULL
);
INSERT OR IGNORE INTO payment_requests (id, received) VALUES (1, 0);
";

/// The command line.
struct Options {
    addr: String,
    db: PathBuf,
    faults: Faults,
}

/// The injected faults.
#[derive(Clone, Copy)]
struct Faults {
    /// Probability of a `503` before charging (default 0).
    fail_rate: f64,
    /// Probability of closing the connection after the charge committed (default 0).
    drop_rate: f64,
    /// Wait before handling each charge (default none).
    delay: Duration,
}

/// Marks a response whose connection is to be closed instead of answered.
#[derive(Clone, Copy)]
struct DropConnection;

#[derive(Clone)]
struct App {
    store: SqliteStore,
    faults: Faults,
}

#[tokio::main]
async fn main() -> ExitCode {
    cli::main("payments", USAGE, FLAGS, parse, run).await
}

fn parse(mut flags: Flags) -> Result<Options, String> {
    let rate = |value: Option<String>, name: &str| -> Result<f64, String> {
        match value {
            None => Ok(0.0),
            Some(value) => match value.parse::<f64>() {
                Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
                _ => Err(format!(
                    "{name} needs a probability in 0..=1, not `{value}`"
                )),
            },
        }
    };
    let fail_rate = rate(flags.value("--fail-rate"), "--fail-rate")?;
    let drop_rate = rate(
        flags.value("--drop-after-charge-rate"),
        "--drop-after-charge-rate",
    )?;
    let delay =
        match flags.value("--delay-ms") {
            None => Duration::ZERO,
            Some(value) => Duration::from_millis(value.parse().map_err(|_| {
                format!("--delay-ms needs a number of milliseconds, not `{value}`")
            })?),
        };
    Ok(Options {
        addr: flags
            .value("--addr")
            .unwrap_or_else(|| "127.0.0.1:3002".to_owned()),
        db: PathBuf::from(
            flags
                .value("--db")
                .unwrap_or_else(|| "payments.db".to_owned()),
        ),
        faults: Faults {
            fail_rate,
            drop_rate,
            delay,
        },
    })
}

async fn run(options: Options) -> Result<(), BoxError> {
    let store = SqliteStore::open(&options.db)
        .await
        .map_err(|error| format!("cannot open {}: {error}", options.db.display()))?;
    store.write(|tx| tx.execute_batch(SCHEMA)).await?;
    let app = router(App {
        store,
        faults: options.faults,
    });
    let (listener, local) = cli::listen(&options.addr).await?;
    println!(
        "listening on http://{local} (database {}); try: curl -i http://{local}/charges \
         -H 'Idempotency-Key: k1' -H 'Content-Type: application/json' \
         -d '{{\"amount_cents\":1200}}'",
        options.db.display()
    );
    let builder = Arc::new(auto::Builder::new(TokioExecutor::new()));
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => accepted?,
            () = cli::ctrl_c() => return Ok(()),
        };
        let (app, builder) = (app.clone(), builder.clone());
        tokio::spawn(async move {
            // A service error makes hyper close the connection without an answer: that is
            // how `--drop-after-charge-rate` drops a response whose charge has committed.
            let service =
                hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
                    let app = app.clone();
                    async move {
                        let response = match app.oneshot(request.map(Body::new)).await {
                            Ok(response) => response,
                            Err(never) => match never {},
                        };
                        if response.extensions().get::<DropConnection>().is_some() {
                            return Err(std::io::Error::other("dropped after the charge"));
                        }
                        Ok(response)
                    }
                });
            let _ = builder
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn router(app: App) -> Router {
    let layer = IdempotencyLayer::new(app.store.clone())
        .with_operation("charge")
        .with_fingerprinter(Fingerprinter::json());
    Router::new()
        .route(
            "/charges",
            post(charge)
                .layer(layer)
                .layer(middleware::from_fn_with_state(app.clone(), faults))
                .layer(middleware::from_fn_with_state(app.clone(), count_request)),
        )
        .route("/stats", get(stats))
        .with_state(app)
}

/// Counts every `POST /charges` received, durably, before anything else happens to it.
async fn count_request(State(app): State<App>, mut request: Request, next: Next) -> Response {
    let counted = app
        .store
        .write(|tx| {
            tx.execute(
                "UPDATE payment_requests SET received = received + 1 WHERE id = 1",
                [],
            )
        })
        .await;
    if let Err(error) = counted {
        return internal(error, "counting the request");
    }
    // One provider, one tenant: the layer scopes its records by it.
    request.extensions_mut().insert(Tenant::new("payments"));
    next.run(request).await
}

/// The injected faults around the idempotent route.
async fn faults(State(app): State<App>, request: Request, next: Next) -> Response {
    let faults = app.faults;
    if !faults.delay.is_zero() {
        tokio::time::sleep(faults.delay).await;
    }
    if draw(faults.fail_rate) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            [("retry-after", "1")],
            Json(json!({ "error": "unavailable" })),
        )
            .into_response();
    }
    let mut response = next.run(request).await;
    // Past the layer: the charge and its saved answer have committed.
    if response.status() == StatusCode::CREATED && draw(faults.drop_rate) {
        response.extensions_mut().insert(DropConnection);
    }
    response
}

/// True with probability `p`.
fn draw(p: f64) -> bool {
    p > 0.0 && fastrand::f64() < p
}

/// `POST /charges`: runs once per key; the layer replays its `201` to repeats.
async fn charge(Tx(tx): Tx<SqliteHandle>, headers: HeaderMap, body: Bytes) -> Response {
    let amount = match amount_cents(&body) {
        Ok(amount) => amount,
        Err(code) => {
            return (StatusCode::BAD_REQUEST, Json(json!({ "error": code }))).into_response()
        }
    };
    if amount == 402 {
        // Not saved by the layer (a 4xx): nothing taken, and a repeat is declined again.
        return (
            StatusCode::PAYMENT_REQUIRED,
            Json(json!({ "error": "card_declined" })),
        )
            .into_response();
    }
    // The layer has already refused a request without a valid key.
    let key = headers
        .get("idempotency-key")
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let charge_id = format!("ch_{:016x}", fastrand::u64(..));
    let id = charge_id.clone();
    let inserted = tx
        .run(move |conn: &Connection| {
            conn.execute(
                "INSERT INTO payment_charges (charge_id, idempotency_key, amount_cents) \
                 VALUES (?1, ?2, ?3)",
                rusqlite::params![id, key, amount],
            )
        })
        .await;
    if let Err(error) = inserted {
        return internal(error, "inserting the charge");
    }
    (StatusCode::CREATED, Json(json!({ "charge_id": charge_id }))).into_response()
}

/// The positive integer `amount_cents` of the body, or the code of what is wrong with it.
fn amount_cents(body: &[u8]) -> Result<i64, &'static str> {
    let value: Value = serde_json::from_slice(body).map_err(|_| "invalid_json")?;
    match value.get("amount_cents").and_then(Value::as_i64) {
        Some(amount) if amount > 0 => Ok(amount),
        _ => Err("invalid_amount_cents"),
    }
}

/// `GET /stats`.
async fn stats(State(app): State<App>) -> Response {
    let read = app
        .store
        .read(|conn| {
            let requests: i64 =
                conn.query_row("SELECT received FROM payment_requests", [], |row| {
                    row.get(0)
                })?;
            let mut by_key = Map::new();
            let mut charges = 0;
            let mut statement = conn.prepare(
                "SELECT idempotency_key, COUNT(*) FROM payment_charges GROUP BY idempotency_key",
            )?;
            let rows = statement.query_map([], |row| {
                Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?))
            })?;
            for row in rows {
                let (key, count) = row?;
                charges += count;
                by_key.insert(key, json!(count));
            }
            Ok::<_, rusqlite::Error>(
                json!({ "requests": requests, "charges": charges, "charges_by_key": by_key }),
            )
        })
        .await;
    match read {
        Ok(stats) => Json(stats).into_response(),
        Err(error) => internal(error, "reading the stats"),
    }
}

/// Logs what failed; the client only learns `internal_error`.
fn internal(error: impl std::fmt::Display, doing: &str) -> Response {
    tracing::error!(%error, "{doing} failed");
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        Json(json!({ "error": "internal_error" })),
    )
        .into_response()
}
