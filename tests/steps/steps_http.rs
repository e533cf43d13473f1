//! The steps mode over real HTTP, on every store: a handler with a local step, a foreign call
//! to a stand-in provider (in this process, deduplicating by the step key) and a second local
//! step, through every way a request can stop part-way.
//!
//! Written once, generic over [`Shop`] (the store and the handler's SQL for it), and run by
//! `steps_http_tests!` on SQLite in a temp dir (the SQLite store and the sqlx store), on
//! PostgreSQL (the tokio-postgres store and the sqlx store) in a schema of its own when
//! `TEST_DATABASE_URL` is set, and on MySQL or MariaDB (the sqlx store) in a database of its
//! own when `TEST_MYSQL_URL` is set (reported as ignored otherwise).

use crate::listing;
use support::pg_common;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tower_idempotency::steps::{
    Ask, CallAgain, Foreign, LeaveInDoubt, ProgressStatus, Resolution, Settled, StepError,
    StepStore, Steps,
};
use tower_idempotency::{IdempotencyLayer, Tenant};

/// A store under test and what the handler needs beside the steps: the `shop_orders` table
/// (`id`, `sku`, `status`, `charge_id`), the three local steps' SQL on it, and its rows.
trait Shop: Sized + Send + Sync + 'static {
    type Store: StepStore + tower_idempotency::admin::AdminBackend + Clone + Send + Sync + 'static;

    /// A fresh database with the table and the steps' tables, and its store; `None` (after
    /// saying so) when the server is not configured.
    fn create() -> impl Future<Output = Option<(Self, Self::Store)>> + Send;

    /// Step `insert_order`: a `pending` order of `sku`; its id (ids count up from 1).
    fn insert_order(
        steps: &Steps<Self::Store>,
        sku: String,
    ) -> impl Future<Output = Result<i64, StepError>> + Send;

    /// Step `mark_declined`.
    fn mark_declined(
        steps: &Steps<Self::Store>,
        order_id: i64,
    ) -> impl Future<Output = Result<(), StepError>> + Send;

    /// Step `mark_paid`, with `charge_id`.
    fn mark_paid(
        steps: &Steps<Self::Store>,
        order_id: i64,
        charge_id: String,
    ) -> impl Future<Output = Result<(), StepError>> + Send;

    /// The orders as `(id, status, charge_id)`, by id (committed).
    fn orders(&self) -> impl Future<Output = Vec<(i64, String, Option<String>)>> + Send;
}

/// What the provider does on its next calls.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Behaviour {
    Charge,
    /// Charges, then the answer is lost (the outcome is unknown to the caller).
    ChargeThenLose,
    /// Refuses before charging.
    Refuse,
    Decline,
}

#[derive(Default)]
struct Provider {
    /// Charges by step key.
    charges: HashMap<String, String>,
    calls: usize,
    plan: Vec<Behaviour>,
}

#[derive(Clone)]
struct App {
    provider: Arc<Mutex<Provider>>,
    /// How long the handler pauses after its first step (the stalled owner).
    pause: Arc<Mutex<Duration>>,
    /// The second step's name (a renamed step).
    second: Arc<Mutex<&'static str>>,
    in_doubt: bool,
}

impl App {
    fn new() -> Self {
        App {
            provider: Arc::default(),
            pause: Arc::default(),
            second: Arc::new(Mutex::new("charge")),
            in_doubt: false,
        }
    }

    fn plan(&self, plan: &[Behaviour]) {
        self.provider.lock().unwrap().plan = plan.to_vec();
    }

    fn charges(&self) -> usize {
        self.provider.lock().unwrap().charges.len()
    }

    fn calls(&self) -> usize {
        self.provider.lock().unwrap().calls
    }

    fn call(&self, key: &str) -> Result<String, Foreign> {
        let mut provider = self.provider.lock().unwrap();
        provider.calls += 1;
        let behaviour = if provider.plan.is_empty() {
            Behaviour::Charge
        } else {
            provider.plan.remove(0)
        };
        let next = provider.charges.len() + 1;
        match behaviour {
            Behaviour::Refuse => Err(Foreign::unavailable("provider down")),
            Behaviour::Decline => Err(Foreign::terminal(
                StatusCode::PAYMENT_REQUIRED,
                json!({"error": "card_declined"}),
            )),
            Behaviour::Charge | Behaviour::ChargeThenLose => {
                let id = provider
                    .charges
                    .entry(key.to_owned())
                    .or_insert_with(|| format!("ch_{next}"))
                    .clone();
                if behaviour == Behaviour::ChargeThenLose {
                    Err(Foreign::unknown("connection lost after sending"))
                } else {
                    Ok(id)
                }
            }
        }
    }

    fn charge_for(&self, key: &str) -> Option<String> {
        self.provider.lock().unwrap().charges.get(key).cloned()
    }
}

async fn checkout<D: Shop>(
    State(app): State<App>,
    steps: Steps<D::Store>,
    Json(body): Json<Value>,
) -> Result<(StatusCode, Json<Value>), StepError> {
    let Some(sku) = body["sku"]
        .as_str()
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
    else {
        return Ok((
            StatusCode::BAD_REQUEST,
            Json(json!({"error": "invalid_sku"})),
        ));
    };
    let order_id = D::insert_order(&steps, sku).await?;
    let pause = *app.pause.lock().unwrap();
    tokio::time::sleep(pause).await;
    let second = *app.second.lock().unwrap();
    let provider = app.clone();
    let charged = if app.in_doubt {
        steps
            .foreign(
                second,
                LeaveInDoubt,
                |key| async move { provider.call(&key) },
            )
            .await
    } else {
        steps
            .foreign(second, CallAgain, |key| async move { provider.call(&key) })
            .await
    };
    let charge_id = match charged {
        Ok(id) => id,
        Err(StepError::Terminal(answer)) => {
            D::mark_declined(&steps, order_id).await?;
            return Ok((answer.status(), Json(answer.body().clone())));
        }
        Err(other) => return Err(other),
    };
    D::mark_paid(&steps, order_id, charge_id.clone()).await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({"order_id": order_id, "charge_id": charge_id})),
    ))
}

struct Served<D: Shop> {
    addr: SocketAddr,
    store: D::Store,
    layer: IdempotencyLayer<D::Store>,
    db: D,
}

/// The handler on a fresh database of `D`, behind the layer with a step lease of `lease`;
/// `None` when `D`'s server is not configured.
async fn serve<D: Shop>(app: App, lease: Duration) -> Option<Served<D>> {
    let (db, store) = D::create().await?;
    let layer = IdempotencyLayer::new(store.clone())
        .with_operation("checkout")
        .with_lock_timeout(Duration::from_secs(3))
        .with_step_lease(lease);
    let router = Router::new()
        .route("/checkouts", post(checkout::<D>).layer(layer.clone()))
        .layer(axum::Extension(Tenant::new("shop-a")))
        .with_state(app);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    Some(Served {
        addr,
        store,
        layer,
        db,
    })
}

#[derive(Debug, Clone, PartialEq)]
struct Reply {
    status: StatusCode,
    replayed: bool,
    body: Bytes,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

async fn send(addr: SocketAddr, key: &str, body: &str) -> Reply {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let request = http::Request::post(format!("http://{addr}/checkouts"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let response = tokio::time::timeout(Duration::from_secs(20), client.request(request))
        .await
        .expect("answered in time")
        .unwrap();
    let status = response.status();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Reply {
        status,
        replayed,
        body,
    }
}

const BODY: &str = r#"{"sku":"book"}"#;

async fn a_key_runs_its_steps_once_and_every_retry_replays_the_answer<D: Shop>() {
    let app = App::new();
    let Some(served) = serve::<D>(app.clone(), Duration::from_secs(10)).await else {
        return;
    };
    let first = send(served.addr, "k1", BODY).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    for _ in 0..3 {
        let again = send(served.addr, "k1", BODY).await;
        assert!(again.replayed);
        assert_eq!((again.status, &again.body), (first.status, &first.body));
    }
    assert_eq!(app.calls(), 1);
    assert_eq!(
        served.db.orders().await,
        vec![(1, "paid".into(), Some("ch_1".into()))]
    );
    let other = send(served.addr, "k1", r#"{"sku":"pen"}"#).await;
    assert_eq!(other.status, StatusCode::CONFLICT);
}

async fn an_unknown_outcome_answers_503_and_the_retry_resumes_with_the_same_step_key<D: Shop>() {
    let app = App::new();
    let Some(served) = serve::<D>(app.clone(), Duration::from_secs(10)).await else {
        return;
    };
    app.plan(&[Behaviour::ChargeThenLose]);
    let first = send(served.addr, "k1", BODY).await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{first:?}");
    let retry = send(served.addr, "k1", BODY).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert_eq!(app.calls(), 2, "called again with the same key");
    assert_eq!(app.charges(), 1, "the provider deduplicated it");
    // Step 1 ran once: one order, paid with the one charge.
    assert_eq!(
        served.db.orders().await,
        vec![(1, "paid".into(), Some("ch_1".into()))]
    );
    assert_eq!(retry.json()["charge_id"], "ch_1");
}

async fn a_refused_call_releases_the_key_and_a_retry_calls_again<D: Shop>() {
    let app = App::new();
    let Some(served) = serve::<D>(app.clone(), Duration::from_secs(10)).await else {
        return;
    };
    app.plan(&[Behaviour::Refuse, Behaviour::Refuse]);
    for _ in 0..2 {
        let refused = send(served.addr, "k1", BODY).await;
        assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    }
    let done = send(served.addr, "k1", BODY).await;
    assert_eq!(done.status, StatusCode::CREATED, "{done:?}");
    assert_eq!(served.db.orders().await.len(), 1);
    assert_eq!(app.charges(), 1);
}

async fn a_declined_card_is_the_saved_answer_of_every_retry<D: Shop>() {
    let app = App::new();
    let Some(served) = serve::<D>(app.clone(), Duration::from_secs(10)).await else {
        return;
    };
    app.plan(&[Behaviour::Decline]);
    let first = send(served.addr, "k1", BODY).await;
    assert_eq!(first.status, StatusCode::PAYMENT_REQUIRED, "{first:?}");
    let again = send(served.addr, "k1", BODY).await;
    assert!(again.replayed);
    assert_eq!((again.status, again.body), (first.status, first.body));
    assert_eq!(app.calls(), 1);
    assert_eq!(app.charges(), 0);
    assert_eq!(served.db.orders().await, vec![(1, "declined".into(), None)]);
}

async fn a_validation_error_before_any_step_keeps_nothing<D: Shop>() {
    let app = App::new();
    let Some(served) = serve::<D>(app.clone(), Duration::from_secs(10)).await else {
        return;
    };
    let bad = send(served.addr, "k1", r#"{"sku":""}"#).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    // The same key with a corrected payload runs afresh (no 409).
    let good = send(served.addr, "k1", BODY).await;
    assert_eq!(good.status, StatusCode::CREATED, "{good:?}");
}

async fn renamed_steps_are_refused_on_resume<D: Shop>() {
    let app = App::new();
    let Some(served) = serve::<D>(app.clone(), Duration::from_secs(10)).await else {
        return;
    };
    app.plan(&[Behaviour::Refuse]);
    // Step 1 commits, the foreign call is refused: the key is released with one step saved.
    assert_eq!(
        send(served.addr, "k1", BODY).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    // Then the handler changes: its second step has another name, but the first matches...
    *app.second.lock().unwrap() = "charge_card";
    // ...the step after the saved ones is new, so this runs (nothing saved there yet).
    let fresh = send(served.addr, "k2", BODY).await;
    assert_eq!(fresh.status, StatusCode::CREATED);
    // A key whose saved steps differ from the handler's.
    app.plan(&[Behaviour::ChargeThenLose]);
    *app.second.lock().unwrap() = "charge";
    assert_eq!(
        send(served.addr, "k3", BODY).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    *app.second.lock().unwrap() = "charge_card";
    let changed = send(served.addr, "k3", BODY).await;
    assert_eq!(
        changed.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{changed:?}"
    );
    assert_eq!(changed.json()["error"], "steps_changed");
}

async fn a_stalled_owner_past_its_lease_cannot_commit_after_a_retry_took_over<D: Shop>() {
    let app = App::new();
    let Some(served) = serve::<D>(app.clone(), Duration::from_secs(1)).await else {
        return;
    };
    *app.pause.lock().unwrap() = Duration::from_millis(2500);
    let stalled = tokio::spawn(send(served.addr, "k1", BODY));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // The first request holds step 1 and sleeps past its lease: the retry takes over.
    *app.pause.lock().unwrap() = Duration::ZERO;
    let retry = send(served.addr, "k1", BODY).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    let stalled = stalled.await.unwrap();
    assert_eq!(
        stalled.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{stalled:?}"
    );
    assert_eq!(
        served.db.orders().await,
        vec![(1, "paid".into(), Some("ch_1".into()))]
    );
    assert_eq!(app.calls(), 1, "the stalled request never called");
    let replay = send(served.addr, "k1", BODY).await;
    assert_eq!((replay.status, replay.body), (retry.status, retry.body));
}

async fn duplicates_in_flight_wait_for_the_first_and_replay_it<D: Shop>() {
    let app = App::new();
    let Some(served) = serve::<D>(app.clone(), Duration::from_secs(10)).await else {
        return;
    };
    *app.pause.lock().unwrap() = Duration::from_millis(300);
    let sends: Vec<_> = (0..8)
        .map(|_| tokio::spawn(send(served.addr, "k1", BODY)))
        .collect();
    let mut bodies = Vec::new();
    for send in sends {
        let reply = send.await.unwrap();
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        bodies.push(reply.body);
    }
    assert!(bodies.windows(2).all(|w| w[0] == w[1]));
    assert_eq!(app.calls(), 1);
    assert_eq!(served.db.orders().await.len(), 1);
}

async fn the_completer_finishes_a_key_the_client_abandoned<D: Shop>() {
    let app = App::new();
    let Some(served) = serve::<D>(app.clone(), Duration::from_secs(10)).await else {
        return;
    };
    app.plan(&[Behaviour::ChargeThenLose]);
    assert_eq!(
        send(served.addr, "k1", BODY).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let handler = post(checkout::<D>).with_state(app.clone());
    let mut completer = served
        .layer
        .completer(handler)
        .with_idle(Duration::ZERO)
        .with_max_attempts(3);
    let report = completer.run_once().await.unwrap();
    assert_eq!(report.completed, 1, "{report:?}");
    assert_eq!(
        served.db.orders().await,
        vec![(1, "paid".into(), Some("ch_1".into()))]
    );
    let replay = send(served.addr, "k1", BODY).await;
    assert!(replay.replayed);
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(app.charges(), 1);
}

async fn the_completer_dead_letters_a_key_after_its_attempts<D: Shop>() {
    let app = App::new();
    let Some(served) = serve::<D>(app.clone(), Duration::from_secs(10)).await else {
        return;
    };
    app.plan(&[Behaviour::Refuse; 10]);
    assert_eq!(
        send(served.addr, "k1", BODY).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let handler = post(checkout::<D>).with_state(app.clone());
    let mut completer = served
        .layer
        .completer(handler)
        .with_idle(Duration::ZERO)
        .with_max_attempts(2);
    let mut dead = 0;
    for _ in 0..4 {
        dead += completer.run_once().await.unwrap().dead;
    }
    assert_eq!(dead, 1);
    let now = SystemTime::now();
    let listed = served
        .store
        .progress(&listing(ProgressStatus::Dead, None, now, 10))
        .await
        .unwrap()
        .keys;
    assert_eq!(listed.len(), 1);
    // A client's retry may still take a dead key.
    app.plan(&[]);
    assert_eq!(
        send(served.addr, "k1", BODY).await.status,
        StatusCode::CREATED
    );
}

async fn a_step_left_in_doubt_waits_for_an_operator<D: Shop>() {
    let mut app = App::new();
    app.in_doubt = true;
    let Some(served) = serve::<D>(app.clone(), Duration::from_secs(10)).await else {
        return;
    };
    app.plan(&[Behaviour::ChargeThenLose]);
    assert_eq!(
        send(served.addr, "k1", BODY).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let doubt = send(served.addr, "k1", BODY).await;
    assert_eq!(doubt.status, StatusCode::CONFLICT, "{doubt:?}");
    assert_eq!(doubt.json()["error"], "outcome_in_doubt");
    assert_eq!(
        send(served.addr, "k1", BODY).await.status,
        StatusCode::CONFLICT
    );
    assert_eq!(app.calls(), 1, "never called again");
    // The operator looks the charge up and settles the step with it.
    let admin = tower_idempotency::admin::Admin::new(served.store.clone());
    let listed = admin
        .keys_in_progress(ProgressStatus::InDoubt, 10)
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    let reason = listed[0].last_error.as_deref().unwrap_or_default();
    assert!(reason.contains("step 1 (\"charge\")"), "{reason}");
    let step_key = tower_idempotency::steps::step_key(&listed[0].run, &listed[0].scope, "charge");
    let charge = app.charge_for(&step_key).unwrap();
    let resolved = admin
        .resolve_steps(
            "shop-a",
            "checkout",
            "k1",
            Some(1),
            &Resolution::Done(json!(charge)),
        )
        .await
        .unwrap();
    assert_eq!(resolved, Settled::Resolved);
    let done = send(served.addr, "k1", BODY).await;
    assert_eq!(done.status, StatusCode::CREATED, "{done:?}");
    assert_eq!(done.json()["charge_id"], "ch_1");
    assert_eq!(app.calls(), 1);
}

async fn ask_settles_an_unknown_outcome_from_the_service<D: Shop>() {
    let app = App::new();
    let Some((_db, store)) = D::create().await else {
        return;
    };
    let provider = app.clone();
    let handler = move |steps: Steps<D::Store>| {
        let provider = provider.clone();
        async move {
            let lookup = provider.clone();
            let charged = steps
                .foreign(
                    "charge",
                    Ask(|key: String| async move { Ok(lookup.charge_for(&key)) }),
                    |key| async move { provider.call(&key) },
                )
                .await?;
            Ok::<_, StepError>((StatusCode::CREATED, charged))
        }
    };
    let layer = IdempotencyLayer::new(store.clone())
        .with_operation("ask")
        .with_steps();
    let router = Router::new()
        .route("/checkouts", post(handler).layer(layer))
        .layer(axum::Extension(Tenant::new("shop-a")));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    app.plan(&[Behaviour::ChargeThenLose]);
    assert_eq!(
        send(addr, "k1", BODY).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let asked = send(addr, "k1", BODY).await;
    assert_eq!(asked.status, StatusCode::CREATED, "{asked:?}");
    assert_eq!(&asked.body[..], b"ch_1");
    assert_eq!(app.calls(), 1, "asked, not called again");
}

/// The scenarios above, each a test on the shop `$shop`, in the module `$backend`.
/// A client key used again after its record was deleted by an operator, or after it expired,
/// is a new order: its foreign step goes out with a new step key (the key's run id is new),
/// so a deduplicating provider charges again instead of answering with the old charge.
async fn a_key_used_again_after_a_delete_or_its_expiry_takes_a_new_charge<D: Shop>() {
    let app = App::new();
    let Some(served) = serve::<D>(app.clone(), Duration::from_secs(10)).await else {
        return;
    };
    let first = send(served.addr, "order-77", BODY).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let admin = tower_idempotency::admin::Admin::new(served.store.clone());
    assert!(admin
        .delete("shop-a", "checkout", "order-77")
        .await
        .expect("delete"));
    let second = send(served.addr, "order-77", BODY).await;
    assert_eq!(second.status, StatusCode::CREATED, "{second:?}");
    assert!(!second.replayed);
    assert_ne!(
        first.json()["charge_id"],
        second.json()["charge_id"],
        "the new order is paid with a charge of its own"
    );
    assert_eq!(app.charges(), 2, "money taken == orders paid");
    let orders = served.db.orders().await;
    assert_eq!(orders.len(), 2);
    assert!(orders.iter().all(|(_, status, _)| status == "paid"));

    // The same after the record expired: a layer that keeps records for a moment.
    let layer = served
        .layer
        .clone()
        .with_retention(Duration::from_millis(200));
    let router = Router::new()
        .route("/checkouts", post(checkout::<D>).layer(layer))
        .layer(axum::Extension(Tenant::new("shop-a")))
        .with_state(app.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let short = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    let before = send(short, "order-78", BODY).await;
    assert_eq!(before.status, StatusCode::CREATED, "{before:?}");
    tokio::time::sleep(Duration::from_millis(400)).await;
    let after = send(short, "order-78", BODY).await;
    assert_eq!(after.status, StatusCode::CREATED, "{after:?}");
    assert!(!after.replayed, "the record expired");
    assert_ne!(before.json()["charge_id"], after.json()["charge_id"]);
    assert_eq!(app.charges(), 4, "money taken == orders paid");
    assert_eq!(served.db.orders().await.len(), 4);
}

/// A completer serves its layer's operation only: another route's completer on the same store
/// never runs this route's key through its own handler; and a layer without an operation
/// (each request's path is its operation) cannot make one.
async fn a_completer_resumes_its_own_operation_only<D: Shop>() {
    let app = App::new();
    let Some(served) = serve::<D>(app.clone(), Duration::from_secs(10)).await else {
        return;
    };
    app.plan(&[Behaviour::ChargeThenLose]);
    assert_eq!(
        send(served.addr, "k1", BODY).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let refunds = IdempotencyLayer::new(served.store.clone())
        .with_operation("refund")
        .with_steps();
    let ran_refund = Arc::new(Mutex::new(0));
    let counted = ran_refund.clone();
    let refund = post(move || {
        let counted = counted.clone();
        async move {
            *counted.lock().unwrap() += 1;
            StatusCode::OK
        }
    });
    let mut other = refunds
        .completer(refund)
        .with_idle(Duration::ZERO)
        .with_max_attempts(1);
    for _ in 0..3 {
        let report = other.run_once().await.unwrap();
        assert_eq!(report, Default::default(), "not its key");
    }
    assert_eq!(*ran_refund.lock().unwrap(), 0);
    let handler = post(checkout::<D>).with_state(app.clone());
    let mut own = served
        .layer
        .completer(handler)
        .with_idle(Duration::ZERO)
        .with_max_attempts(1);
    assert_eq!(own.run_once().await.unwrap().completed, 1);

    let unnamed = IdempotencyLayer::new(served.store.clone()).with_steps();
    let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let handler: axum::routing::MethodRouter = post(|| async { StatusCode::OK });
        drop(unnamed.completer(handler));
    }));
    assert!(refused.is_err(), "a completer needs the layer's operation");
}

/// A key in progress whose client key is a quoted string (`"\"evil"` is the key `"evil`, and
/// `"\"x\""` the key `"x"`) is listed exactly as it was scoped: the listing and the
/// completer go on for every key.
async fn quoted_keys_are_listed_as_scoped_and_stop_no_one<D: Shop>() {
    let app = App::new();
    let Some(served) = serve::<D>(app.clone(), Duration::from_secs(10)).await else {
        return;
    };
    app.plan(&[
        Behaviour::ChargeThenLose,
        Behaviour::ChargeThenLose,
        Behaviour::ChargeThenLose,
    ]);
    for key in [r#""\"evil""#, r#""\"x\"""#, "plain"] {
        let left = send(served.addr, key, BODY).await;
        assert_eq!(
            left.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{key}: {left:?}"
        );
    }
    let admin = tower_idempotency::admin::Admin::new(served.store.clone());
    let listed = admin
        .keys_in_progress(ProgressStatus::Running, 10)
        .await
        .expect("listing");
    let mut keys: Vec<_> = listed.iter().map(|p| p.scope.key.as_str()).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["\"evil", "\"x\"", "plain"]);
    let handler = post(checkout::<D>).with_state(app.clone());
    let mut completer = served
        .layer
        .completer(handler)
        .with_idle(Duration::ZERO)
        .with_max_attempts(2);
    let report = completer.run_once().await.unwrap();
    assert_eq!((report.completed, report.skipped), (3, 0), "{report:?}");
    // Each replays to its client as it was sent.
    let replay = send(served.addr, r#""\"x\"""#, BODY).await;
    assert!(replay.replayed, "{replay:?}");
    assert_eq!(app.charges(), 3);
}

/// A retry that finds the charge's intent of an earlier attempt (whose answer was lost: the
/// provider may have charged) and whose own call is refused keeps that intent: the key still
/// says a call may have taken money, whatever happens to it next (a purge makes it a dead
/// letter for an operator rather than forgetting it).
async fn a_refused_call_keeps_an_earlier_attempts_intent<D: Shop>() {
    let app = App::new();
    let Some(served) = serve::<D>(app.clone(), Duration::from_secs(10)).await else {
        return;
    };
    app.plan(&[Behaviour::ChargeThenLose, Behaviour::Refuse]);
    for _ in 0..2 {
        let reply = send(served.addr, "k1", BODY).await;
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{reply:?}");
    }
    let admin = tower_idempotency::admin::Admin::new(served.store.clone());
    let listed = admin
        .keys_in_progress(ProgressStatus::Running, 10)
        .await
        .unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].steps, 2, "the order and the charge's intent");
    let purged = served
        .store
        .purge_progress(SystemTime::now() + Duration::from_secs(3 * 24 * 3600), 10)
        .await
        .unwrap();
    assert_eq!(purged, 1);
    let dead = admin
        .keys_in_progress(ProgressStatus::Dead, 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1, "a dead letter, not forgotten");
    assert_eq!(app.charges(), 1);
}

macro_rules! steps_http_tests {
    ($backend:ident, $shop:ty $(, $needs:ident)?) => {
        mod $backend {
            steps_http_tests!(@tests $shop; [$($needs)?];
                a_key_runs_its_steps_once_and_every_retry_replays_the_answer,
                an_unknown_outcome_answers_503_and_the_retry_resumes_with_the_same_step_key,
                a_refused_call_releases_the_key_and_a_retry_calls_again,
                a_declined_card_is_the_saved_answer_of_every_retry,
                a_validation_error_before_any_step_keeps_nothing,
                renamed_steps_are_refused_on_resume,
                a_stalled_owner_past_its_lease_cannot_commit_after_a_retry_took_over,
                duplicates_in_flight_wait_for_the_first_and_replay_it,
                the_completer_finishes_a_key_the_client_abandoned,
                the_completer_dead_letters_a_key_after_its_attempts,
                a_step_left_in_doubt_waits_for_an_operator,
                ask_settles_an_unknown_outcome_from_the_service,
                a_key_used_again_after_a_delete_or_its_expiry_takes_a_new_charge,
                a_completer_resumes_its_own_operation_only,
                quoted_keys_are_listed_as_scoped_and_stop_no_one,
                a_refused_call_keeps_an_earlier_attempts_intent,
            );
        }
    };
    (@tests $shop:ty; [$($needs:ident)?]; $name:ident, $($rest:ident,)*) => {
        test! { $name $(, $needs)? }
        async fn $name() {
            super::$name::<$shop>().await;
        }
        steps_http_tests!(@tests $shop; [$($needs)?]; $($rest,)*);
    };
    (@tests $shop:ty; [$($needs:ident)?];) => {};
}

mod sqlite {
    use tower_idempotency::store::sqlite::{rusqlite, SqliteStore};

    use super::*;

    pub(super) struct Sqlite {
        store: SqliteStore,
        _dir: tempfile::TempDir,
    }

    impl Shop for Sqlite {
        type Store = SqliteStore;

        async fn create() -> Option<(Self, SqliteStore)> {
            let dir = tempfile::tempdir().unwrap();
            let store = SqliteStore::open(dir.path().join("shop.db")).await.unwrap();
            store
                .write(|tx| {
                    tx.execute_batch(
                        "CREATE TABLE shop_orders (id INTEGER PRIMARY KEY, sku TEXT NOT NULL, \
                         status TEXT NOT NULL, charge_id TEXT)",
                    )
                })
                .await
                .unwrap();
            store.install_steps().await.unwrap();
            let shop = Sqlite {
                store: store.clone(),
                _dir: dir,
            };
            Some((shop, store))
        }

        async fn insert_order(steps: &Steps<SqliteStore>, sku: String) -> Result<i64, StepError> {
            steps
                .local("insert_order", move |tx| {
                    tx.execute(
                        "INSERT INTO shop_orders (sku, status) VALUES (?1, 'pending')",
                        [sku],
                    )?;
                    Ok(tx.last_insert_rowid())
                })
                .await
        }

        async fn mark_declined(steps: &Steps<SqliteStore>, order_id: i64) -> Result<(), StepError> {
            steps
                .local("mark_declined", move |tx| {
                    tx.execute(
                        "UPDATE shop_orders SET status = 'declined' WHERE id = ?1",
                        [order_id],
                    )
                    .map(drop)
                })
                .await
        }

        async fn mark_paid(
            steps: &Steps<SqliteStore>,
            order_id: i64,
            charge_id: String,
        ) -> Result<(), StepError> {
            steps
                .local("mark_paid", move |tx| {
                    tx.execute(
                        "UPDATE shop_orders SET status = 'paid', charge_id = ?1 WHERE id = ?2",
                        rusqlite::params![charge_id, order_id],
                    )
                    .map(drop)
                })
                .await
        }

        async fn orders(&self) -> Vec<(i64, String, Option<String>)> {
            self.store
                .read(|conn| {
                    let mut statement =
                        conn.prepare("SELECT id, status, charge_id FROM shop_orders ORDER BY id")?;
                    let rows = statement
                        .query_map([], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))?;
                    rows.collect()
                })
                .await
                .unwrap()
        }
    }
}

/// The table on PostgreSQL, for both drivers.
const PG_SCHEMA: &str = "CREATE TABLE shop_orders (id BIGSERIAL PRIMARY KEY, sku TEXT NOT NULL, \
                         status TEXT NOT NULL, charge_id TEXT)";

/// The orders of a PostgreSQL test schema, read on a connection of its own.
async fn pg_orders(db: &pg_common::TestDb) -> Vec<(i64, String, Option<String>)> {
    db.client()
        .await
        .query(
            "SELECT id, status, charge_id FROM shop_orders ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect()
}

mod postgres {
    use tower_idempotency::store::tokio_postgres::{PostgresHandle, PostgresStore};

    use super::*;
    use support::pg_common::TestDb;

    pub(super) struct Pg(TestDb);

    impl Shop for Pg {
        type Store = PostgresStore;

        async fn create() -> Option<(Self, PostgresStore)> {
            let db = TestDb::create().await?;
            db.execute(PG_SCHEMA).await;
            let store = db.store().await;
            store.install_steps().await.unwrap();
            Some((Pg(db), store))
        }

        async fn insert_order(steps: &Steps<PostgresStore>, sku: String) -> Result<i64, StepError> {
            steps
                .local("insert_order", move |tx: PostgresHandle| async move {
                    let row = tx
                        .client()
                        .await?
                        .query_one(
                            "INSERT INTO shop_orders (sku, status) VALUES ($1, 'pending') \
                             RETURNING id",
                            &[&sku],
                        )
                        .await?;
                    Ok(row.try_get::<_, i64>(0)?)
                })
                .await
        }

        async fn mark_declined(
            steps: &Steps<PostgresStore>,
            order_id: i64,
        ) -> Result<(), StepError> {
            steps
                .local("mark_declined", move |tx: PostgresHandle| async move {
                    tx.client()
                        .await?
                        .execute(
                            "UPDATE shop_orders SET status = 'declined' WHERE id = $1",
                            &[&order_id],
                        )
                        .await?;
                    Ok(())
                })
                .await
        }

        async fn mark_paid(
            steps: &Steps<PostgresStore>,
            order_id: i64,
            charge_id: String,
        ) -> Result<(), StepError> {
            steps
                .local("mark_paid", move |tx: PostgresHandle| async move {
                    tx.client()
                        .await?
                        .execute(
                            "UPDATE shop_orders SET status = 'paid', charge_id = $1 WHERE id = $2",
                            &[&charge_id, &order_id],
                        )
                        .await?;
                    Ok(())
                })
                .await
        }

        async fn orders(&self) -> Vec<(i64, String, Option<String>)> {
            pg_orders(&self.0).await
        }
    }
}

/// `mark_declined` and `mark_paid` of a sqlx backend's [`Shop`], each a local step of ordinary
/// sqlx code on the step's handle, with the database's statements (in its placeholders):
/// `declined` binds the order's id, `paid` the charge's id and then the order's.
macro_rules! sqlx_marks {
    ($store:ty, $handle:ty, $declined:literal, $paid:literal) => {
        async fn mark_declined(steps: &Steps<$store>, order_id: i64) -> Result<(), StepError> {
            steps
                .local("mark_declined", move |tx: $handle| async move {
                    let mut conn = tx.acquire().await?;
                    sqlx::query($declined)
                        .bind(order_id)
                        .execute(&mut *conn)
                        .await?;
                    Ok(())
                })
                .await
        }

        async fn mark_paid(
            steps: &Steps<$store>,
            order_id: i64,
            charge_id: String,
        ) -> Result<(), StepError> {
            steps
                .local("mark_paid", move |tx: $handle| async move {
                    let mut conn = tx.acquire().await?;
                    sqlx::query($paid)
                        .bind(charge_id)
                        .bind(order_id)
                        .execute(&mut *conn)
                        .await?;
                    Ok(())
                })
                .await
        }
    };
}

mod sqlx_postgres {
    use sqlx::Row;
    use tower_idempotency::store::sqlx_postgres::{SqlxPostgresHandle, SqlxPostgresStore};

    use super::*;
    use support::pg_common::TestDb;

    pub(super) struct SqlxPg(TestDb);

    impl Shop for SqlxPg {
        type Store = SqlxPostgresStore;

        async fn create() -> Option<(Self, SqlxPostgresStore)> {
            let db = TestDb::create().await?;
            db.execute(PG_SCHEMA).await;
            let store = db.sqlx_store(4, 2).await;
            store.install_steps().await.unwrap();
            Some((SqlxPg(db), store))
        }

        async fn insert_order(
            steps: &Steps<SqlxPostgresStore>,
            sku: String,
        ) -> Result<i64, StepError> {
            steps
                .local("insert_order", move |tx: SqlxPostgresHandle| async move {
                    let mut conn = tx.acquire().await?;
                    let row = sqlx::query(
                        "INSERT INTO shop_orders (sku, status) VALUES ($1, 'pending') \
                         RETURNING id",
                    )
                    .bind(sku)
                    .fetch_one(&mut *conn)
                    .await?;
                    Ok(row.try_get::<i64, _>(0)?)
                })
                .await
        }

        sqlx_marks!(
            SqlxPostgresStore,
            SqlxPostgresHandle,
            "UPDATE shop_orders SET status = 'declined' WHERE id = $1",
            "UPDATE shop_orders SET status = 'paid', charge_id = $1 WHERE id = $2"
        );

        async fn orders(&self) -> Vec<(i64, String, Option<String>)> {
            pg_orders(&self.0).await
        }
    }
}

mod sqlx_mysql {
    use sqlx::Row;
    use tower_idempotency::store::sqlx_mysql::{SqlxMySqlHandle, SqlxMySqlStore};

    use super::*;
    use support::mysql_common::TestDb;

    pub(super) struct MySql(TestDb);

    impl Shop for MySql {
        type Store = SqlxMySqlStore;

        async fn create() -> Option<(Self, SqlxMySqlStore)> {
            let db = TestDb::create().await?;
            db.execute(
                "CREATE TABLE shop_orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
                 sku VARCHAR(64) NOT NULL, status VARCHAR(16) NOT NULL, charge_id VARCHAR(64))",
            )
            .await;
            let store = db.store(4).await;
            store.install_steps().await.unwrap();
            Some((MySql(db), store))
        }

        async fn insert_order(
            steps: &Steps<SqlxMySqlStore>,
            sku: String,
        ) -> Result<i64, StepError> {
            steps
                .local("insert_order", move |tx: SqlxMySqlHandle| async move {
                    let mut conn = tx.acquire().await?;
                    let done =
                        sqlx::query("INSERT INTO shop_orders (sku, status) VALUES (?, 'pending')")
                            .bind(sku)
                            .execute(&mut *conn)
                            .await?;
                    i64::try_from(done.last_insert_id())
                        .map_err(|_| tower_idempotency::Error::Corrupt("an order id".into()))
                })
                .await
        }

        sqlx_marks!(
            SqlxMySqlStore,
            SqlxMySqlHandle,
            "UPDATE shop_orders SET status = 'declined' WHERE id = ?",
            "UPDATE shop_orders SET status = 'paid', charge_id = ? WHERE id = ?"
        );

        async fn orders(&self) -> Vec<(i64, String, Option<String>)> {
            sqlx::query("SELECT id, status, charge_id FROM shop_orders ORDER BY id")
                .fetch_all(&self.0.pool(1).await)
                .await
                .unwrap()
                .iter()
                .map(|row| (row.get(0), row.get(1), row.get(2)))
                .collect()
        }
    }
}

mod sqlx_sqlite {
    use sqlx::Row;
    use tower_idempotency::store::sqlx_sqlite::{SqlxSqliteHandle, SqlxSqliteStore};

    use super::*;
    use support::sqlx_sqlite_common::TestDb;

    pub(super) struct SqlxSqlite(TestDb);

    impl Shop for SqlxSqlite {
        type Store = SqlxSqliteStore;

        async fn create() -> Option<(Self, SqlxSqliteStore)> {
            let db = TestDb::create().await?;
            let store = db.store(4).await;
            db.execute(
                "CREATE TABLE shop_orders (id INTEGER PRIMARY KEY, sku TEXT NOT NULL, \
                 status TEXT NOT NULL, charge_id TEXT)",
            )
            .await;
            store.install_steps().await.unwrap();
            Some((SqlxSqlite(db), store))
        }

        async fn insert_order(
            steps: &Steps<SqlxSqliteStore>,
            sku: String,
        ) -> Result<i64, StepError> {
            steps
                .local("insert_order", move |tx: SqlxSqliteHandle| async move {
                    let mut conn = tx.acquire().await?;
                    let row = sqlx::query(
                        "INSERT INTO shop_orders (sku, status) VALUES (?1, 'pending') \
                         RETURNING id",
                    )
                    .bind(sku)
                    .fetch_one(&mut *conn)
                    .await?;
                    Ok(row.try_get::<i64, _>(0)?)
                })
                .await
        }

        sqlx_marks!(
            SqlxSqliteStore,
            SqlxSqliteHandle,
            "UPDATE shop_orders SET status = 'declined' WHERE id = ?1",
            "UPDATE shop_orders SET status = 'paid', charge_id = ?1 WHERE id = ?2"
        );

        async fn orders(&self) -> Vec<(i64, String, Option<String>)> {
            sqlx::query_as("SELECT id, status, charge_id FROM shop_orders ORDER BY id")
                .fetch_all(&mut self.0.connection().await)
                .await
                .unwrap()
        }
    }
}

steps_http_tests!(sqlite_store, super::sqlite::Sqlite);
steps_http_tests!(postgres_store, super::postgres::Pg, postgres);
steps_http_tests!(sqlx_postgres_store, super::sqlx_postgres::SqlxPg, postgres);
steps_http_tests!(sqlx_mysql_store, super::sqlx_mysql::MySql, mysql);
steps_http_tests!(sqlx_sqlite_store, super::sqlx_sqlite::SqlxSqlite);

test! { a_steps_request_waits_for_the_sqlite_writer_no_longer_than_the_lock_timeout }
/// On SQLite every step write waits for the one writer: behind other work that holds it, a
/// steps request is answered `503` with `Retry-After` once the layer's lock timeout (3 s here)
/// has passed, as a single-transaction request is, and its queued claim never runs; once the
/// writer is free, the retry goes through.
async fn a_steps_request_waits_for_the_sqlite_writer_no_longer_than_the_lock_timeout() {
    let app = App::new();
    let served = serve::<sqlite::Sqlite>(app.clone(), Duration::from_secs(10))
        .await
        .expect("SQLite is always there");
    let store = served.store.clone();
    let holder = tokio::spawn(async move {
        store
            .write(|_tx| {
                std::thread::sleep(Duration::from_secs(6));
                Ok(())
            })
            .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = std::time::Instant::now();
    let busy = send(served.addr, "k1", BODY).await;
    let waited = started.elapsed();
    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE, "{busy:?}");
    assert!(
        waited < Duration::from_millis(4500),
        "answered after {waited:?}, the lock timeout is 3 s"
    );
    holder.await.unwrap().unwrap();
    let admin = tower_idempotency::admin::Admin::new(served.store.clone());
    assert!(
        admin
            .keys_in_progress(ProgressStatus::Running, 10)
            .await
            .unwrap()
            .is_empty(),
        "the abandoned claim never ran"
    );
    let done = send(served.addr, "k1", BODY).await;
    assert_eq!(done.status, StatusCode::CREATED, "{done:?}");
    assert_eq!(app.charges(), 1);
}
