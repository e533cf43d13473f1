//! A checkout that charges a card at another service, safe to retry and to kill at any point:
//! the steps mode of the idempotency layer.
//!
//! `POST /checkouts` (with an `Idempotency-Key`, `{"sku", "quantity", "amount_cents"}`) runs
//! three steps, each committed on its own:
//!
//! 1. `insert_order` (local): inserts the order as `pending`;
//! 2. `charge` (foreign): charges it at the payment provider (`examples/payments.rs`), with a
//!    key derived from the request's as the provider's own `Idempotency-Key`, so that calling
//!    again after a crash charges once (the policy is `CallAgain`);
//! 3. `mark_paid` (local): marks the order paid with the charge id and enqueues an
//!    `order_paid` event in the outbox, in the same transaction.
//!
//! It answers `201 {"order_id", "charge_id"}` with `Location: /orders/{id}`, saved and
//! replayed to every retry. A declined card (`amount_cents` 402 at the stand-in provider) is a
//! final answer: the order is marked `declined` and every retry gets the same `402`. If the
//! provider is unavailable, the client gets `503` with `Retry-After` and the retry resumes
//! where the request stopped (the order is not inserted twice). If the process dies in the
//! middle, the retry resumes the same way; with `--completer`, a key left part-way and
//! untouched for 5 s is finished without the client.
//!
//! ```text
//! cargo run --example payments -- --addr 127.0.0.1:3002 --db payments.db
//! cargo run --example checkout -- --payments http://127.0.0.1:3002 --db checkout.db --completer
//! # or on PostgreSQL, where several instances may serve the same shop:
//! cargo run --example checkout -- --payments http://127.0.0.1:3002 \
//!     --database-url postgres://postgres@127.0.0.1/shop --completer
//! curl -i http://127.0.0.1:3003/checkouts \
//!     -H 'Authorization: Bearer shop-a-token' -H 'Idempotency-Key: order-1' \
//!     -H 'Content-Type: application/json' \
//!     -d '{"sku":"book","quantity":1,"amount_cents":1200}'
//! curl -i http://127.0.0.1:3003/orders/1 -H 'Authorization: Bearer shop-a-token'
//! curl http://127.0.0.1:3002/stats
//! ```
//!
//! The orders, the keys' progress, the steps and the outbox's events live in one database:
//! the SQLite file of `--db` (default `checkout.db`), or PostgreSQL with `--database-url`
//! (the tokio-postgres store). Everything but the store is written once; the store's part
//! (its tables, the local steps' SQL, reading an order back) is `CheckoutStore`, in
//! `checkout/sqlite.rs` and `checkout/postgres.rs`. The orders table is `checkout_orders` on
//! both.
//!
//! The tenants and tokens are the `orders` example's (`Bearer shop-a-token`, `shop-b-token`).
//! `GET /orders/{id}` answers `{"order_id", "status": "pending" | "paid" | "declined",
//! "charge_id"}` for the caller's own orders. Order ids count up from 1 (on PostgreSQL a
//! sequence: a step rolled back after its insert leaves a gap).
//!
//! For tests that kill the process at a chosen point: `CHECKOUT_PAUSE_AT=POINT` makes a
//! request stop there, print `paused at POINT` on stdout and wait (an hour, or
//! `CHECKOUT_PAUSE_MS` milliseconds) before it goes on. The points, in order:
//! `after_claim` (the key is taken, no step yet), `after_insert` (step 1 committed),
//! `after_intent` (the charge's intent committed, the call not sent), `after_call` (the
//! provider's answer, or the failure, is in; its result not committed), `after_paid` (step 3
//! committed, the final response not saved), `before_response` (the response saved, not sent).
//! A request holds its key under a lease of 10 s between commits (`--lease-ms`): a retry, or
//! the completer, takes a killed or stalled request's key over once it has passed, and the
//! stalled request's next commit is refused (it answers `503`). On PostgreSQL the
//! lease holds across processes: instances on one database never both advance a key.
//!
//! Logs go to stderr; set `RUST_LOG` (default `warn`) to see more.

use std::future::Future;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, LOCATION};
use axum::http::{StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{json, Value};
use tower::ServiceExt;
use tower_idempotency::body::BoxError;
use tower_idempotency::fingerprint::Fingerprinter;
use tower_idempotency::steps::{CallAgain, Foreign, StepError, StepStore, Steps};
use tower_idempotency::{IdempotencyLayer, Tenant};

use cli::{Flag, Flags};
use order_table::NewOrder;

/// Logging, flags and exit codes, as every example has them.
#[path = "common/cli.rs"]
mod cli;
/// The rules of a valid order and the demo tenants, shared with the other order examples.
#[path = "common/order_table.rs"]
mod order_table;
/// The checkout's tables and steps on PostgreSQL (`--database-url`).
#[cfg(feature = "tokio-postgres")]
#[path = "checkout/postgres.rs"]
mod postgres;
/// The checkout's tables and steps on SQLite (`--db`).
#[path = "checkout/sqlite.rs"]
mod sqlite;

const USAGE: &str = "\
A checkout that charges a card at the payments example, safe to retry and to kill.

usage: checkout --payments URL [--addr ADDR] [--db FILE | --database-url URL] [--completer]
                [--lease-ms N]

  --payments URL      the payment provider (the payments example), e.g. http://127.0.0.1:3002
  --addr ADDR         listen on ADDR (default 127.0.0.1:3003)
  --db FILE           the SQLite file of orders, keys and steps (default checkout.db)
  --database-url URL  PostgreSQL instead (postgres://user@host:5432/db): several instances
                      may serve the same shop
  --completer         finish keys left part-way (untouched for 5 s) without the client
  --lease-ms N        how long a request holds its key between commits: a killed request's
                      key is taken over after it (default 10000, at least 1000)

POST /checkouts (Idempotency-Key, Authorization: Bearer shop-a-token,
{\"sku\", \"quantity\", \"amount_cents\"}): 201 {\"order_id\", \"charge_id\"} with Location; 402
{\"error\":\"card_declined\"}; 503 + Retry-After when the provider is unavailable.
GET /orders/{id}: {\"order_id\", \"status\", \"charge_id\"}.";

const FLAGS: &[Flag] = &[
    Flag::Value("--payments"),
    Flag::Value("--addr"),
    Flag::Value("--db"),
    Flag::Value("--database-url"),
    Flag::Switch("--completer"),
    Flag::Value("--lease-ms"),
];

/// How long a request holds its key between commits unless `--lease-ms` says otherwise: short
/// enough that a demo sees a killed request's key taken over soon, long enough for a charge.
const LEASE: Duration = Duration::from_secs(10);
/// How long a key must have been left untouched before the completer finishes it.
const COMPLETER_IDLE: Duration = Duration::from_secs(5);
/// How long the provider may take to answer a charge (the step's lease may cut it sooner).
const CHARGE_TIMEOUT: Duration = Duration::from_secs(5);
/// How much of the provider's answer is read.
const ANSWER_LIMIT: usize = 64 * 1024;

/// The command line.
struct Options {
    addr: String,
    database: Database,
    payments: String,
    completer: bool,
    lease: Duration,
}

/// Where the orders, keys and steps live.
enum Database {
    /// `--db FILE`.
    Sqlite(PathBuf),
    /// `--database-url URL`.
    Postgres(String),
}

/// The part of the checkout that depends on the store: its tables, the local steps (their
/// SQL, in the step's own transaction) and reading an order back. The step names are the same
/// on every store.
trait CheckoutStore: StepStore + Clone + Send + Sync + 'static {
    /// Creates the orders table, the steps' tables and the outbox, if needed.
    fn install(&self) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// Step `insert_order`: `order` for `tenant`, `pending`; returns its id.
    fn insert_order(
        steps: &Steps<Self>,
        tenant: &Tenant,
        order: NewOrder,
        amount_cents: i64,
    ) -> impl Future<Output = Result<i64, StepError>> + Send;

    /// Step `mark_declined`: the order is `declined`.
    fn mark_declined(
        steps: &Steps<Self>,
        order_id: i64,
    ) -> impl Future<Output = Result<(), StepError>> + Send;

    /// Step `mark_paid`: the order is `paid` with `charge_id`, and `event` is enqueued as
    /// `order_paid` in the same transaction.
    fn mark_paid(
        steps: &Steps<Self>,
        order_id: i64,
        charge_id: String,
        event: Value,
    ) -> impl Future<Output = Result<(), StepError>> + Send;

    /// `(status, charge_id)` of the order `order_id`, if `tenant` placed it.
    fn find_order(
        &self,
        tenant: &Tenant,
        order_id: i64,
    ) -> impl Future<Output = Result<Option<(String, Option<String>)>, BoxError>> + Send;
}

#[derive(Clone)]
struct App<S> {
    store: S,
    payments: Payments,
}

#[tokio::main]
async fn main() -> ExitCode {
    cli::main("checkout", USAGE, FLAGS, parse, run).await
}

fn parse(mut flags: Flags) -> Result<Options, String> {
    let payments = flags
        .value("--payments")
        .ok_or("--payments URL is required (the payments example's address)")?;
    let database = match (flags.value("--db"), flags.value("--database-url")) {
        (Some(_), Some(_)) => return Err("--db and --database-url: give one of them".to_owned()),
        (_, Some(url)) => Database::Postgres(url),
        (db, None) => Database::Sqlite(PathBuf::from(
            db.unwrap_or_else(|| "checkout.db".to_owned()),
        )),
    };
    let lease = match flags.value("--lease-ms") {
        None => LEASE,
        Some(value) => match value.parse::<u64>() {
            Ok(ms) if ms >= 1000 => Duration::from_millis(ms),
            _ => {
                return Err(format!(
                    "--lease-ms needs a number of milliseconds of at least 1000, not `{value}`"
                ))
            }
        },
    };
    Ok(Options {
        addr: flags
            .value("--addr")
            .unwrap_or_else(|| "127.0.0.1:3003".to_owned()),
        database,
        payments,
        completer: flags.switch("--completer"),
        lease,
    })
}

async fn run(options: Options) -> Result<(), BoxError> {
    let payments = Payments::new(&options.payments)?;
    match &options.database {
        Database::Sqlite(path) => {
            let store = sqlite::open(path).await?;
            serve(store, payments, &options, &path.display().to_string()).await
        }
        #[cfg(feature = "tokio-postgres")]
        Database::Postgres(url) => {
            let store = postgres::connect(url).await?;
            // The URL is not printed: it may carry a password.
            serve(store, payments, &options, "PostgreSQL").await
        }
        #[cfg(not(feature = "tokio-postgres"))]
        Database::Postgres(_) => Err("--database-url needs the `tokio-postgres` feature".into()),
    }
}

/// Serves the checkout on `store` until Ctrl-C.
async fn serve<S: CheckoutStore>(
    store: S,
    payments: Payments,
    options: &Options,
    database: &str,
) -> Result<(), BoxError> {
    store.install().await?;
    let app = App { store, payments };

    let layer = IdempotencyLayer::new(app.store.clone())
        .with_operation("checkout")
        .with_fingerprinter(Fingerprinter::json())
        .with_steps()
        .with_step_lease(options.lease);
    if options.completer {
        // The completer calls the handler as the layer would, with the request as first sent
        // and the key's tenant in its extensions: no authentication in front of it.
        let handler = Router::new()
            .route("/checkouts", post(checkout::<S>))
            .with_state(app.clone());
        let completer = layer
            .completer(handler)
            .with_idle(COMPLETER_IDLE)
            .with_poll_interval(Duration::from_millis(500));
        tokio::spawn(completer.run());
    }
    let router = Router::new()
        .route(
            "/checkouts",
            post(checkout::<S>)
                .layer(layer)
                .layer(middleware::from_fn(pause_before_response)),
        )
        .route("/orders/{id}", get(get_order::<S>))
        // Outermost: the layer scopes every key by the tenant it finds here.
        .layer(middleware::from_fn(authenticate))
        .with_state(app);

    let (listener, local) = cli::listen(&options.addr).await?;
    println!(
        "listening on http://{local} (database {}, payments {}); try: curl -i \
         http://{local}/checkouts -H 'Authorization: Bearer shop-a-token' \
         -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' \
         -d '{{\"sku\":\"book\",\"quantity\":1,\"amount_cents\":1200}}'",
        database, options.payments
    );
    let builder = Arc::new(auto::Builder::new(TokioExecutor::new()));
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => accepted?,
            () = cli::ctrl_c() => return Ok(()),
        };
        let (router, builder) = (router.clone(), builder.clone());
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
                    router.clone().oneshot(request.map(Body::new))
                });
            let _ = builder
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Demo authentication, as in the `orders` example: a fixed token per tenant.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let authorization = request.headers().get(AUTHORIZATION);
    match order_table::tenant_of(authorization.and_then(|value| value.to_str().ok())) {
        Some(tenant) => {
            request.extensions_mut().insert(tenant);
            next.run(request).await
        }
        None => error(StatusCode::UNAUTHORIZED, "unauthenticated"),
    }
}

/// A valid checkout: an order and what to charge for it.
struct Checkout {
    order: NewOrder,
    amount_cents: i64,
}

impl Checkout {
    /// The `orders` example's rules and codes for `sku` and `quantity`, and a positive integer
    /// `amount_cents` (`invalid_amount_cents`).
    fn from_json(body: &[u8]) -> Result<Self, &'static str> {
        let order = NewOrder::from_json(body)?;
        let value: Value = serde_json::from_slice(body).map_err(|_| "invalid_json")?;
        match value.get("amount_cents").and_then(Value::as_i64) {
            Some(amount_cents) if amount_cents > 0 => Ok(Checkout {
                order,
                amount_cents,
            }),
            _ => Err("invalid_amount_cents"),
        }
    }
}

/// `POST /checkouts`: the three steps. A retry (or the completer) runs it again: the steps
/// that finished return their saved results without running.
async fn checkout<S: CheckoutStore>(
    State(app): State<App<S>>,
    Extension(tenant): Extension<Tenant>,
    steps: Steps<S>,
    body: Bytes,
) -> Response {
    pause("after_claim").await;
    let checkout = match Checkout::from_json(&body) {
        Ok(checkout) => checkout,
        // A 4xx is not saved: the key is let go, and may be retried with a corrected body.
        Err(code) => return error(StatusCode::BAD_REQUEST, code),
    };
    match run_steps(&app, &tenant, &steps, checkout).await {
        Ok(response) => response,
        // `503` + `Retry-After` for a transient failure (the layer releases the key), `402`
        // for a saved decline...
        Err(error) => error.into_response(),
    }
}

async fn run_steps<S: CheckoutStore>(
    app: &App<S>,
    tenant: &Tenant,
    steps: &Steps<S>,
    checkout: Checkout,
) -> Result<Response, StepError> {
    let Checkout {
        order,
        amount_cents,
    } = checkout;
    // 1. The order, pending.
    let order_id = S::insert_order(steps, tenant, order, amount_cents).await?;
    pause("after_insert").await;

    // 2. The charge: the provider deduplicates by the step key, so after a crash during the
    // call it is safe to call again.
    let payments = app.payments.clone();
    let charged = steps
        .foreign("charge", CallAgain, |key| async move {
            pause("after_intent").await;
            let outcome = payments.charge(&key, amount_cents).await;
            pause("after_call").await;
            outcome
        })
        .await;
    let charge_id: String = match charged {
        Ok(charge_id) => charge_id,
        Err(StepError::Terminal(declined)) => {
            // The decline is saved as the step's result; the order says so too.
            S::mark_declined(steps, order_id).await?;
            return Ok(declined.into_response());
        }
        Err(error) => return Err(error),
    };

    // 3. Paid, and the event for whoever ships it, in one transaction.
    let event = json!({ "order_id": order_id, "tenant": tenant.as_str(), "charge_id": charge_id });
    S::mark_paid(steps, order_id, charge_id.clone(), event).await?;
    pause("after_paid").await;

    Ok((
        StatusCode::CREATED,
        [(LOCATION, format!("/orders/{order_id}"))],
        Json(json!({ "order_id": order_id, "charge_id": charge_id })),
    )
        .into_response())
}

/// `GET /orders/{id}`: the caller's own order; another tenant's is answered like a missing one.
async fn get_order<S: CheckoutStore>(
    State(app): State<App<S>>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Response {
    let Ok(order_id) = id.parse::<i64>() else {
        return error(StatusCode::NOT_FOUND, "not_found");
    };
    let found = app.store.find_order(&tenant, order_id).await;
    match found {
        Ok(Some((status, charge_id))) => {
            Json(json!({ "order_id": order_id, "status": status, "charge_id": charge_id }))
                .into_response()
        }
        Ok(None) => error(StatusCode::NOT_FOUND, "not_found"),
        Err(failure) => {
            tracing::error!(%failure, "reading the order failed");
            error(StatusCode::INTERNAL_SERVER_ERROR, "internal_error")
        }
    }
}

/// `{"error": code}` with `status`.
fn error(status: StatusCode, code: &str) -> Response {
    (status, Json(json!({ "error": code }))).into_response()
}

// ---------------------------------------------------------------------------------------------
// The payment provider's client
// ---------------------------------------------------------------------------------------------

/// `POST {payments}/charges` through hyper-util's client.
#[derive(Clone)]
struct Payments {
    client: Client<HttpConnector, Full<Bytes>>,
    charges: Uri,
}

impl Payments {
    fn new(base: &str) -> Result<Self, BoxError> {
        let charges = format!("{}/charges", base.trim_end_matches('/'))
            .parse::<Uri>()
            .map_err(|error| format!("--payments {base}: {error}"))?;
        if charges.scheme_str() != Some("http") {
            return Err(format!("--payments {base}: an http:// URL is needed").into());
        }
        Ok(Payments {
            client: Client::builder(TokioExecutor::new()).build_http(),
            charges,
        })
    }

    /// Charges `amount_cents` under the provider key `key`; maps each answer to what the step
    /// does with it.
    async fn charge(&self, key: &str, amount_cents: i64) -> Result<String, Foreign> {
        let request = axum::http::Request::post(self.charges.clone())
            .header("idempotency-key", key)
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(
                json!({ "amount_cents": amount_cents }).to_string(),
            )))
            .map_err(Foreign::unavailable)?;
        let answered = tokio::time::timeout(CHARGE_TIMEOUT, async {
            let response = self.client.request(request).await?;
            let status = response.status();
            let body = Limited::new(response.into_body(), ANSWER_LIMIT)
                .collect()
                .await?
                .to_bytes();
            Ok::<_, BoxError>((status, body))
        })
        .await;
        let (status, body) = match answered {
            Ok(Ok(answer)) => answer,
            // Not connected: the request never reached the provider.
            Ok(Err(error)) if is_connect(&*error) => return Err(Foreign::unavailable(error)),
            // A dropped connection or a timeout: it may have charged.
            Ok(Err(error)) => return Err(Foreign::unknown(error)),
            Err(_elapsed) => return Err(Foreign::unknown("the provider did not answer in time")),
        };
        let answer: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        match status {
            StatusCode::CREATED => match answer["charge_id"].as_str() {
                Some(charge_id) => Ok(charge_id.to_owned()),
                None => Err(Foreign::unknown(format!(
                    "a 201 without a charge id: {answer}"
                ))),
            },
            StatusCode::PAYMENT_REQUIRED => Err(Foreign::terminal(
                StatusCode::PAYMENT_REQUIRED,
                json!({ "error": "card_declined" }),
            )),
            // Refused before charging.
            StatusCode::SERVICE_UNAVAILABLE => Err(Foreign::unavailable(format!(
                "the provider is unavailable: {answer}"
            ))),
            // `409 request_in_flight` (an earlier call with this key is still running), or
            // anything else: whether it charged is not known; the retry calls again.
            _ => Err(Foreign::unknown(format!(
                "the provider answered {status}: {answer}"
            ))),
        }
    }
}

/// Whether the client failed to connect (nothing was sent).
fn is_connect(error: &(dyn std::error::Error + 'static)) -> bool {
    error
        .downcast_ref::<hyper_util::client::legacy::Error>()
        .is_some_and(hyper_util::client::legacy::Error::is_connect)
}

// ---------------------------------------------------------------------------------------------
// Stopping at a point, for the tests that kill the process there
// ---------------------------------------------------------------------------------------------

/// With `CHECKOUT_PAUSE_AT=point`: says so on stdout and waits (`CHECKOUT_PAUSE_MS`, default
/// an hour) before going on.
async fn pause(point: &str) {
    if std::env::var("CHECKOUT_PAUSE_AT").is_ok_and(|at| at == point) {
        let ms = std::env::var("CHECKOUT_PAUSE_MS")
            .ok()
            .and_then(|ms| ms.parse().ok())
            .unwrap_or(3_600_000);
        println!("paused at {point}");
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

/// `before_response`: after the layer saved the response, before it is sent.
async fn pause_before_response(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    pause("before_response").await;
    response
}
