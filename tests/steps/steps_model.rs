//! The steps mode against a model, on every store: a random step program (1 to 6 steps, each
//! local or foreign) and a random schedule of attempts for one key, each stopping part-way in
//! one of the ways a request stops (the client goes away between steps, during a local step's
//! transaction or during a foreign call; the handler panics; the provider refuses the call or
//! its outcome is unknown, after it charged or before; the owner stalls past its lease and a
//! retry takes over), by a client's retry or by the completer, then a last attempt that runs to
//! the end.
//!
//! After every attempt the store, the business rows and the provider are compared with a model
//! of what the attempts so far must have done: a local step's row exists once it committed and
//! never twice, the provider charged each foreign step's key once it was called and never
//! twice, the key's progress and saved steps are what the model says. At the end the answer is
//! the one the model predicts (the list of step results, or the declined step's `402`), every
//! retry replays it byte for byte, and nothing is left of the key in progress.
//!
//! The generic part is written once over [`Backend`]; each store gives its local step (its
//! closure differs: SQLite's runs on the writer thread, the servers' are futures) and its table.
//! Requests go through the layer in-process (`tower::ServiceExt::oneshot` on an axum `Router`):
//! real HTTP is covered by tests/steps_sqlite.rs and the examples' crash matrix. PostgreSQL (both
//! drivers) runs when `TEST_DATABASE_URL` is set and MySQL or MariaDB when `TEST_MYSQL_URL` is;
//! they are reported as ignored otherwise.

use crate::listing;
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, SystemTime};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use bytes::Bytes;
use http_body_util::BodyExt;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{json, Value};
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_idempotency::key::IdempotencyKey;
use tower_idempotency::steps::{
    step_key, Ask, CallAgain, CompleterReport, Foreign, ProgressStatus, StepError, StepStore, Steps,
};
use tower_idempotency::store::Scope;
use tower_idempotency::{IdempotencyLayer, Tenant};

const TENANT: &str = "model";
const OPERATION: &str = "model";
/// What the handler panics with (kept out of the test's output).
const PANIC: &str = "the model's handler panics here";
/// The lease of a case with a stalled owner (the shortest the layer takes), and of the others.
const SHORT_LEASE: Duration = Duration::from_secs(1);
const LEASE: Duration = Duration::from_secs(30);
/// How long any one wait of the test may take before it counts as hung.
const HUNG: Duration = Duration::from_secs(30);

/// A store under test: its local step and how to read what the test checks.
trait Backend: Send + Sync + 'static {
    type Store: StepStore;

    fn store(&self) -> &Self::Store;

    /// The local step `name` of `key`'s request: inserts the row `(key, name)` into
    /// `model_rows` on the step's transaction and returns how many rows `key` has then. When
    /// `reached` is given, notifies it after the insert, before the transaction ends (the
    /// test drops the request there).
    fn local(
        steps: Steps<Self::Store>,
        name: String,
        key: String,
        reached: Option<Arc<Reached>>,
    ) -> impl Future<Output = Result<i64, StepError>> + Send;

    /// `key`'s rows in `model_rows`, counted by step.
    async fn rows(&self, key: &str) -> BTreeMap<String, i64>;

    /// How many rows `key` has in `idempotency_progress` and in `idempotency_steps`.
    async fn leftovers(&self, key: &str) -> (i64, i64);
}

// ---------------------------------------------------------------------------------------------
// The cases.

/// A foreign step's traits.
#[derive(Clone, Copy, Debug, PartialEq)]
struct ForeignStep {
    /// Its policy for an unknown outcome: [`Ask`] the provider, else [`CallAgain`].
    ask: bool,
    /// The provider declines it (`402`, terminal).
    declines: bool,
}

#[derive(Clone, Debug)]
struct Step {
    name: String,
    /// `None`: a local step.
    foreign: Option<ForeignStep>,
}

/// Where and how an attempt stops. Positions count the program's steps from 0; a boundary
/// `k` is before step `k` (after `k` steps), the program's length is after the last one.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Stop {
    /// Runs to the end.
    Full,
    /// The client goes away at boundary `k`: the request future is dropped.
    Gone(usize),
    /// The handler panics at boundary `k`.
    Panic(usize),
    /// The handler stalls at boundary `k` past its lease; the next attempt (a client's) takes
    /// the key over, then the stalled one goes on and must be refused.
    Stall(usize),
    /// The provider refuses step `k`'s call before charging ([`Foreign::unavailable`]).
    Unavailable(usize),
    /// Step `k`'s call ends in [`Foreign::unknown`], after the provider charged or before.
    Unknown { step: usize, charged: bool },
    /// The client goes away during step `k`'s call, after the provider charged or before.
    GoneInCall { step: usize, charged: bool },
    /// The client goes away during the local step `k`'s transaction, after its insert.
    GoneInLocal(usize),
}

impl Stop {
    fn at_boundary(self, i: usize) -> bool {
        matches!(self, Stop::Gone(k) | Stop::Panic(k) | Stop::Stall(k) if k == i)
    }

    /// The fault planned for the call of step `i`.
    fn fault_at(self, i: usize) -> Option<Stop> {
        match self {
            Stop::Unavailable(k)
            | Stop::Unknown { step: k, .. }
            | Stop::GoneInCall { step: k, .. }
                if k == i =>
            {
                Some(self)
            }
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Attempt {
    /// By the completer instead of a client's retry.
    completer: bool,
    stop: Stop,
}

#[derive(Clone, Debug)]
struct Case {
    program: Vec<Step>,
    /// The attempts before the last one, which is a client's and runs to the end.
    attempts: Vec<Attempt>,
}

impl Case {
    fn stalls(&self) -> bool {
        self.attempts
            .iter()
            .any(|a| matches!(a.stop, Stop::Stall(_)))
    }
}

/// The kinds of [`Stop`], before they are fitted to a program.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Full,
    Gone,
    Panic,
    Stall,
    Unavailable,
    Unknown,
    GoneInCall,
    GoneInLocal,
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        2 => Just(Kind::Full),
        3 => Just(Kind::Gone),
        2 => Just(Kind::Panic),
        1 => Just(Kind::Stall),
        3 => Just(Kind::Unavailable),
        3 => Just(Kind::Unknown),
        3 => Just(Kind::GoneInCall),
        2 => Just(Kind::GoneInLocal),
    ]
}

fn arb_case() -> impl Strategy<Value = Case> {
    let step = (any::<bool>(), any::<bool>(), prop::bool::weighted(0.1));
    let attempt = (prop::bool::weighted(0.25), kind(), 0usize..7, any::<bool>());
    (vec(step, 1..=6), vec(attempt, 0..=4)).prop_map(|(steps, attempts)| {
        let program: Vec<Step> = steps
            .into_iter()
            .enumerate()
            .map(|(i, (foreign, ask, declines))| Step {
                name: format!("{}{i}", if foreign { "call" } else { "write" }),
                foreign: foreign.then_some(ForeignStep { ask, declines }),
            })
            .collect();
        let fit = fitter(&program);
        let mut stalled = false;
        let mut after_stall = false;
        let attempts = attempts
            .into_iter()
            .map(|(completer, kind, k, charged)| {
                let mut stop = fit(kind, k, charged);
                // One stalled owner per case at most (each costs a lease).
                if matches!(stop, Stop::Stall(_)) {
                    if stalled {
                        stop = fit(Kind::Gone, k, charged);
                    }
                    stalled = true;
                }
                // A stalled owner is taken over by a client's retry (the completer only
                // resumes keys whose lease has passed), and a stall is a client's.
                let completer = completer && !after_stall && !matches!(stop, Stop::Stall(_));
                after_stall = matches!(stop, Stop::Stall(_));
                Attempt { completer, stop }
            })
            .collect();
        Case { program, attempts }
    })
}

/// Fits a kind of stop to `program`: a boundary in `0..=len`, a foreign or local step (the
/// client goes away at a boundary instead when the program has no such step).
fn fitter(program: &[Step]) -> impl Fn(Kind, usize, bool) -> Stop {
    let n = program.len();
    let foreign: Vec<usize> = (0..n).filter(|&i| program[i].foreign.is_some()).collect();
    let local: Vec<usize> = (0..n).filter(|&i| program[i].foreign.is_none()).collect();
    move |kind, k, charged| {
        let boundary = k % (n + 1);
        let pick = |of: &[usize]| (!of.is_empty()).then(|| of[k % of.len()]);
        match kind {
            Kind::Full => Stop::Full,
            Kind::Gone => Stop::Gone(boundary),
            Kind::Panic => Stop::Panic(boundary),
            Kind::Stall => Stop::Stall(boundary),
            Kind::Unavailable => pick(&foreign).map_or(Stop::Gone(boundary), Stop::Unavailable),
            Kind::Unknown => {
                pick(&foreign).map_or(Stop::Gone(boundary), |step| Stop::Unknown { step, charged })
            }
            Kind::GoneInCall => pick(&foreign).map_or(Stop::Gone(boundary), |step| {
                Stop::GoneInCall { step, charged }
            }),
            Kind::GoneInLocal => pick(&local).map_or(Stop::Gone(boundary), Stop::GoneInLocal),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The model.

/// What an attempt must have answered.
#[derive(Clone, Debug, PartialEq)]
enum Expect {
    /// A client's answer: the status, the body (when the model knows it) and whether replayed.
    Reply {
        status: StatusCode,
        body: Option<Value>,
        replayed: bool,
    },
    /// The request was dropped (the client went away).
    Dropped,
    /// The handler stalled; its answer, once taken over, is `503`.
    Stalled,
    /// The completer's round.
    Report { completed: usize, failed: usize },
}

/// The key's state as the attempts so far must have left it.
#[derive(Debug)]
struct Model {
    program: Vec<Step>,
    /// How many steps have their result saved (a prefix of the program).
    committed: usize,
    /// The foreign step at `committed` has its intent saved, without a result.
    intent: bool,
    /// The foreign steps the provider charged.
    charged: BTreeSet<usize>,
    /// The key has a progress row.
    progress: bool,
    /// The final answer, once saved.
    done: Option<(StatusCode, Value)>,
    /// The client went away during this local step's transaction: whether it committed is
    /// read from the store.
    uncertain: Option<usize>,
}

impl Model {
    fn new(program: &[Step]) -> Self {
        Model {
            program: program.to_vec(),
            committed: 0,
            intent: false,
            charged: BTreeSet::new(),
            progress: false,
            done: None,
            uncertain: None,
        }
    }

    /// The answer of a run to the end: the steps' results (the `n`th local step returns `n`,
    /// the `n`th charge is `ch_n`), or the first declined step's `402`.
    fn final_answer(&self) -> (StatusCode, Value) {
        let (mut locals, mut charges, mut results) = (0, 0, Vec::new());
        for step in &self.program {
            match step.foreign {
                None => {
                    locals += 1;
                    results.push(json!(locals));
                }
                Some(f) if f.declines => {
                    return (
                        StatusCode::PAYMENT_REQUIRED,
                        json!({ "declined": step.name }),
                    );
                }
                Some(_) => {
                    charges += 1;
                    results.push(json!(format!("ch_{charges}")));
                }
            }
        }
        (StatusCode::CREATED, json!({ "results": results }))
    }

    /// Runs `attempt` on the model: what it answers, and the key's state after it.
    fn attempt(&mut self, attempt: Attempt) -> Expect {
        let completer = attempt.completer;
        if let Some((status, body)) = &self.done {
            return if completer {
                Expect::Report {
                    completed: 0,
                    failed: 0,
                }
            } else {
                Expect::Reply {
                    status: *status,
                    body: Some(body.clone()),
                    replayed: true,
                }
            };
        }
        // The completer only resumes a key in progress.
        if completer && !self.progress {
            return Expect::Report {
                completed: 0,
                failed: 0,
            };
        }
        self.progress = true;
        let stop = attempt.stop;
        for i in 0..self.program.len() {
            if stop.at_boundary(i) {
                return self.stopped(stop, completer);
            }
            if i < self.committed {
                continue;
            }
            let Some(foreign) = self.program[i].foreign else {
                if stop == Stop::GoneInLocal(i) {
                    self.uncertain = Some(i);
                    return Expect::Dropped;
                }
                self.committed += 1;
                continue;
            };
            // `Ask` finds the charge an unknown outcome made.
            if self.intent && foreign.ask && self.charged.contains(&i) {
                self.intent = false;
                self.committed += 1;
                continue;
            }
            self.intent = true;
            match stop.fault_at(i) {
                None => {
                    self.intent = false;
                    self.committed += 1;
                    if foreign.declines {
                        return self.finish(completer);
                    }
                    self.charged.insert(i);
                }
                Some(Stop::Unavailable(_)) => {
                    self.intent = false;
                    self.release();
                    return failed(completer, StatusCode::SERVICE_UNAVAILABLE);
                }
                Some(Stop::Unknown { charged, .. } | Stop::GoneInCall { charged, .. }) => {
                    if charged && !foreign.declines {
                        self.charged.insert(i);
                    }
                    self.release();
                    if matches!(stop, Stop::GoneInCall { .. }) {
                        return Expect::Dropped;
                    }
                    return failed(completer, StatusCode::SERVICE_UNAVAILABLE);
                }
                Some(other) => unreachable!("{other:?}"),
            }
        }
        if stop.at_boundary(self.program.len()) {
            return self.stopped(stop, completer);
        }
        self.finish(completer)
    }

    fn stopped(&mut self, stop: Stop, completer: bool) -> Expect {
        match stop {
            Stop::Gone(_) => {
                self.release();
                Expect::Dropped
            }
            Stop::Panic(_) => {
                self.release();
                failed(completer, StatusCode::INTERNAL_SERVER_ERROR)
            }
            // Taken over by the next attempt: not released.
            Stop::Stall(_) => Expect::Stalled,
            other => unreachable!("{other:?}"),
        }
    }

    /// The key is let go: its progress is deleted unless a step (or an intent) is saved.
    fn release(&mut self) {
        self.progress = self.committed > 0 || self.intent;
    }

    fn finish(&mut self, completer: bool) -> Expect {
        let (status, body) = self.final_answer();
        self.done = Some((status, body.clone()));
        self.progress = false;
        self.intent = false;
        if completer {
            Expect::Report {
                completed: 1,
                failed: 0,
            }
        } else {
            Expect::Reply {
                status,
                body: Some(body),
                replayed: false,
            }
        }
    }

    /// The saved steps the key should have.
    fn saved_steps(&self) -> i64 {
        if self.done.is_some() {
            0
        } else {
            (self.committed + usize::from(self.intent)) as i64
        }
    }
}

/// An attempt that ended part-way with `status` (the client's) or a failed completer round.
fn failed(completer: bool, status: StatusCode) -> Expect {
    if completer {
        Expect::Report {
            completed: 0,
            failed: 1,
        }
    } else {
        Expect::Reply {
            status,
            body: None,
            replayed: false,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The application: a handler that runs the program, and a stand-in provider.

/// One charge the provider made.
#[derive(Debug)]
struct Charge {
    step: String,
    id: String,
    /// How many times it was charged.
    times: usize,
}

/// The payment provider: charges by its idempotency key (the step key), once per key when it
/// deduplicates (as a provider must for [`CallAgain`]).
#[derive(Debug, Default)]
struct Provider {
    deduplicates: bool,
    charges: BTreeMap<String, Charge>,
    issued: usize,
}

impl Provider {
    fn charge(&mut self, step: &str, key: &str) -> String {
        if self.deduplicates {
            if let Some(charge) = self.charges.get(key) {
                return charge.id.clone();
            }
        }
        self.issued += 1;
        let id = format!("ch_{}", self.issued);
        let charge = self.charges.entry(key.to_owned()).or_insert(Charge {
            step: step.to_owned(),
            id: String::new(),
            times: 0,
        });
        charge.id = id.clone();
        charge.times += 1;
        id
    }
}

/// A local step's closure ran (and the test is told, to drop the request there).
struct Reached {
    notify: Arc<Notify>,
    ran: AtomicBool,
}

impl Reached {
    fn new(notify: Arc<Notify>) -> Self {
        Reached {
            notify,
            ran: AtomicBool::new(false),
        }
    }

    fn hit(&self) {
        self.ran.store(true, Ordering::SeqCst);
        self.notify.notify_one();
    }

    fn ran(&self) -> bool {
        self.ran.load(Ordering::SeqCst)
    }
}

/// What the handler does on its next call.
#[derive(Clone)]
struct Plan {
    stop: Stop,
    /// Notified where the attempt stops (gone, stalled).
    reached: Arc<Notify>,
    /// Notified to let a stalled handler go on.
    resume: Arc<Notify>,
    /// Set when the handler was called.
    called: Arc<AtomicBool>,
}

impl Plan {
    fn new(stop: Stop) -> Self {
        Plan {
            stop,
            reached: Arc::default(),
            resume: Arc::default(),
            called: Arc::default(),
        }
    }

    /// At boundary `i`: stops there if planned.
    async fn boundary(&self, i: usize) {
        if !self.stop.at_boundary(i) {
            return;
        }
        match self.stop {
            Stop::Gone(_) => {
                self.reached.notify_one();
                std::future::pending::<()>().await;
            }
            Stop::Panic(_) => std::panic::panic_any(PANIC),
            Stop::Stall(_) => {
                self.reached.notify_one();
                self.resume.notified().await;
            }
            _ => {}
        }
    }
}

struct Shared<B> {
    key: String,
    program: Vec<Step>,
    provider: Mutex<Provider>,
    plan: Mutex<Option<Plan>>,
    /// The run id the handler's last attempt saw. A release before any step saved deletes the
    /// key's progress (the next attempt is a new life, with a new run id); once a step is
    /// saved, every attempt until the end sees the same one.
    run: Mutex<String>,
    _backend: std::marker::PhantomData<fn() -> B>,
}

struct App<B>(Arc<Shared<B>>);

impl<B> Clone for App<B> {
    fn clone(&self) -> Self {
        App(self.0.clone())
    }
}

impl<B: Backend> App<B> {
    fn provider(&self) -> std::sync::MutexGuard<'_, Provider> {
        self.0.provider.lock().unwrap()
    }

    /// The provider's side of step `name`'s call with `fault`.
    async fn call(
        &self,
        name: &str,
        key: &str,
        declines: bool,
        fault: Option<Stop>,
        reached: Arc<Notify>,
    ) -> Result<String, Foreign> {
        let charges = match fault {
            None => !declines,
            Some(Stop::Unavailable(_)) => return Err(Foreign::unavailable("provider down")),
            Some(Stop::Unknown { charged, .. } | Stop::GoneInCall { charged, .. }) => {
                charged && !declines
            }
            Some(other) => unreachable!("{other:?}"),
        };
        let id = charges.then(|| self.provider().charge(name, key));
        match fault {
            None => id.ok_or_else(|| {
                Foreign::terminal(StatusCode::PAYMENT_REQUIRED, json!({ "declined": name }))
            }),
            Some(Stop::GoneInCall { .. }) => {
                reached.notify_one();
                std::future::pending().await
            }
            _ => Err(Foreign::unknown("the connection dropped")),
        }
    }

    async fn foreign(
        &self,
        steps: &Steps<B::Store>,
        step: &Step,
        foreign: ForeignStep,
        fault: Option<Stop>,
        reached: Arc<Notify>,
    ) -> Result<String, StepError> {
        let name = step.name.as_str();
        let call = |key: String| async move {
            self.call(name, &key, foreign.declines, fault, reached)
                .await
        };
        if foreign.ask {
            let lookup = |key: String| async move {
                Ok(self.provider().charges.get(&key).map(|c| c.id.clone()))
            };
            steps.foreign(name, Ask(lookup), call).await
        } else {
            steps.foreign(name, CallAgain, call).await
        }
    }
}

/// Runs the program, stopping where the plan says.
async fn handler<B: Backend>(State(app): State<App<B>>, steps: Steps<B::Store>) -> Response {
    let plan = app.0.plan.lock().unwrap().take();
    let plan = plan.unwrap_or_else(|| Plan::new(Stop::Full));
    *app.0.run.lock().unwrap() = steps.run_id().to_owned();
    plan.called.store(true, Ordering::SeqCst);
    let mut results = Vec::new();
    for (i, step) in app.0.program.iter().enumerate() {
        plan.boundary(i).await;
        let result = match step.foreign {
            None => {
                let reached = (plan.stop == Stop::GoneInLocal(i))
                    .then(|| Arc::new(Reached::new(plan.reached.clone())));
                let result = B::local(
                    steps.clone(),
                    step.name.clone(),
                    app.0.key.clone(),
                    reached.clone(),
                )
                .await
                .map(Value::from);
                if reached.is_some_and(|reached| reached.ran()) {
                    // The client went away inside this step: nothing after it runs. (Else the
                    // handler may queue its next step before the test's abort reaches it, and
                    // SQLite's writer thread commits what was queued.)
                    std::future::pending::<()>().await;
                }
                result
            }
            Some(foreign) => {
                let fault = plan.stop.fault_at(i);
                app.foreign(&steps, step, foreign, fault, plan.reached.clone())
                    .await
                    .map(Value::from)
            }
        };
        match result {
            Ok(value) => results.push(value),
            Err(StepError::Terminal(answer)) => return answer.into_response(),
            Err(error) => return error.into_response(),
        }
    }
    plan.boundary(app.0.program.len()).await;
    (StatusCode::CREATED, Json(json!({ "results": results }))).into_response()
}

// ---------------------------------------------------------------------------------------------
// Running a case.

#[derive(Clone, Debug, PartialEq)]
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

/// How an attempt ended, as seen by the test.
#[derive(Debug)]
enum Ended {
    Reply(Reply),
    Report(CompleterReport),
    Dropped,
    Stalled,
}

struct Run<B: Backend> {
    backend: Arc<B>,
    app: App<B>,
    router: Router,
    layer: IdempotencyLayer<B::Store>,
    scope: Scope,
    model: Model,
    /// A stalled request, waiting for the next attempt to take its key over.
    stalled: Option<(tokio::task::JoinHandle<Reply>, Plan)>,
    /// What happened so far, for the failure message.
    log: Vec<String>,
}

fn fresh_key() -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "model-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

async fn send(router: Router, key: String) -> Reply {
    let request = http::Request::post("/run")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(axum::body::Body::from("{}"))
        .unwrap();
    let response = router.oneshot(request).await.unwrap();
    let status = response.status();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Reply {
        status,
        replayed,
        body,
    }
}

async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(HUNG, future)
        .await
        .unwrap_or_else(|_| panic!("{what} hung"))
}

impl<B: Backend> Run<B> {
    fn new(backend: Arc<B>, case: &Case, deduplicates: bool) -> Self {
        let key = fresh_key();
        let app = App(Arc::new(Shared {
            key: key.clone(),
            program: case.program.clone(),
            provider: Mutex::new(Provider {
                deduplicates,
                ..Provider::default()
            }),
            plan: Mutex::new(None),
            run: Mutex::new(String::new()),
            _backend: std::marker::PhantomData,
        }));
        let lease = if case.stalls() { SHORT_LEASE } else { LEASE };
        let layer = IdempotencyLayer::new(backend.store().clone())
            .with_operation(OPERATION)
            .with_lock_timeout(Duration::from_secs(10))
            .with_step_lease(lease);
        let router = Router::new()
            .route("/run", post(handler::<B>).layer(layer.clone()))
            .layer(Extension(Tenant::new(TENANT)))
            .with_state(app.clone());
        let scope = Scope::new(
            TENANT,
            OPERATION,
            IdempotencyKey::parse(key.as_bytes(), 128).unwrap(),
        );
        Run {
            backend,
            app,
            router,
            layer,
            scope,
            model: Model::new(&case.program),
            stalled: None,
            log: Vec::new(),
        }
    }

    fn key(&self) -> &str {
        self.scope.key.as_str()
    }

    /// Runs `attempt` and checks it against the model.
    async fn attempt(&mut self, attempt: Attempt) {
        let expected = self.model.attempt(attempt);
        let started = std::time::Instant::now();
        let ended = self.run(attempt).await;
        self.log.push(format!(
            "{attempt:?}: expected {expected:?}, got {ended:?} in {:?}",
            started.elapsed()
        ));
        if matches!(ended, Ended::Dropped) {
            let started = std::time::Instant::now();
            self.settle().await;
            self.log.push(format!("settled in {:?}", started.elapsed()));
        }
        if let Some(step) = self.model.uncertain.take() {
            // The client went away inside the step's transaction: it committed or not, and
            // its row and its result with it.
            let rows = self.backend.rows(self.key()).await;
            if rows.get(&self.model.program[step].name) == Some(&1) {
                self.model.committed += 1;
            }
            self.model.release();
        }
        self.check(&expected, &ended);
        // The attempt after a stall took the key over: the stalled one goes on and is refused.
        if !matches!(ended, Ended::Stalled) {
            if let Some((task, plan)) = self.stalled.take() {
                plan.resume.notify_one();
                let reply = within("the stalled request", task).await.unwrap();
                self.log.push(format!("the stalled request: {reply:?}"));
                self.assert(
                    reply.status == StatusCode::SERVICE_UNAVAILABLE,
                    "the stalled request is refused",
                );
            }
        }
        self.check_state().await;
    }

    async fn run(&mut self, attempt: Attempt) -> Ended {
        let plan = Plan::new(attempt.stop);
        *self.app.0.plan.lock().unwrap() = Some(plan.clone());
        let ended = if attempt.completer {
            let handler = post(handler::<B>).with_state(self.app.clone());
            let mut completer = self
                .layer
                .completer(handler)
                .with_idle(Duration::ZERO)
                .with_max_attempts(1000);
            let round = completer.run_once();
            within("the completer", async {
                tokio::select! {
                    report = round => Ended::Report(report.expect("the completer's round")),
                    // The completer's process went away: its round is dropped.
                    () = plan.reached.notified() => Ended::Dropped,
                }
            })
            .await
        } else {
            let mut task = tokio::spawn(send(self.router.clone(), self.key().to_owned()));
            let stall = matches!(attempt.stop, Stop::Stall(_));
            let ended = within("the request", async {
                tokio::select! {
                    reply = &mut task => Ended::Reply(reply.expect("the request")),
                    () = plan.reached.notified() => {
                        if stall { Ended::Stalled } else { Ended::Dropped }
                    }
                }
            })
            .await;
            match ended {
                // Still running: kept until the next attempt has taken the key over.
                Ended::Stalled => self.stalled = Some((task, plan.clone())),
                // The client went away: the request future is dropped.
                Ended::Dropped => {
                    task.abort();
                    let _ = task.await;
                }
                _ => {}
            }
            ended
        };
        self.app.0.plan.lock().unwrap().take();
        ended
    }

    /// Waits until a dropped request's key is let go (released in the background).
    async fn settle(&self) {
        within("the release of a dropped request", async {
            loop {
                let now = SystemTime::now();
                let idle = self
                    .backend
                    .store()
                    .progress(&listing(ProgressStatus::Running, Some(now), now, 1000))
                    .await
                    .expect("progress")
                    .keys;
                if idle.iter().any(|p| p.scope == self.scope)
                    || self.backend.leftovers(self.key()).await.0 == 0
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
    }

    fn assert(&self, holds: bool, what: &str) {
        assert!(
            holds,
            "{what}\nthe program: {:?}\nthe model: {:?}\nthe attempts:\n  {}",
            self.model.program,
            self.model,
            self.log.join("\n  ")
        );
    }

    fn check(&self, expected: &Expect, ended: &Ended) {
        let holds = match (expected, ended) {
            (
                Expect::Reply {
                    status,
                    body,
                    replayed,
                },
                Ended::Reply(reply),
            ) => {
                reply.status == *status
                    && reply.replayed == *replayed
                    && body.as_ref().is_none_or(|body| reply.json() == *body)
            }
            (Expect::Dropped, Ended::Dropped) | (Expect::Stalled, Ended::Stalled) => true,
            (Expect::Report { completed, failed }, Ended::Report(report)) => {
                report.completed == *completed && report.failed == *failed && report.dead == 0
            }
            _ => false,
        };
        self.assert(holds, "the attempt ended as the model says");
    }

    /// The business rows, the provider's charges and the key's progress against the model.
    async fn check_state(&self) {
        let rows = self.backend.rows(self.key()).await;
        let expected: BTreeMap<String, i64> = self.model.program[..self.model.committed]
            .iter()
            .filter(|step| step.foreign.is_none())
            .map(|step| (step.name.clone(), 1))
            .collect();
        self.assert(
            rows == expected,
            &format!("each committed local step wrote its row once: {rows:?}"),
        );
        let charges: BTreeMap<String, (String, usize)> = self
            .app
            .provider()
            .charges
            .iter()
            .map(|(key, c)| (c.step.clone(), (key.clone(), c.times)))
            .collect();
        let run = self.app.0.run.lock().unwrap().clone();
        let expected: BTreeMap<String, (String, usize)> = self
            .model
            .charged
            .iter()
            .map(|&i| {
                let name = &self.model.program[i].name;
                (name.clone(), (step_key(&run, &self.scope, name), 1))
            })
            .collect();
        self.assert(
            charges == expected,
            &format!("each called step was charged once, by its step key: {charges:?}"),
        );
        let leftovers = self.backend.leftovers(self.key()).await;
        self.assert(
            leftovers == (i64::from(self.model.progress), self.model.saved_steps()),
            &format!("the key's progress and saved steps (rows: {leftovers:?})"),
        );
    }

    /// The case: its attempts, the last one to the end, then the replays.
    async fn case(mut self, case: &Case) {
        for &attempt in &case.attempts {
            self.attempt(attempt).await;
        }
        self.attempt(Attempt {
            completer: false,
            stop: Stop::Full,
        })
        .await;
        let (status, body) = self.model.final_answer();
        self.assert(
            self.model.done.is_some(),
            "the last attempt finished the key",
        );
        let first = within("a replay", send(self.router.clone(), self.key().to_owned())).await;
        for _ in 0..2 {
            let again = within("a replay", send(self.router.clone(), self.key().to_owned())).await;
            self.assert(
                again == first && again.replayed,
                &format!("every retry replays the answer byte for byte: {again:?} {first:?}"),
            );
        }
        self.assert(
            first.status == status && first.json() == body,
            &format!("the answer is the model's: {first:?}"),
        );
        self.assert(
            self.backend.leftovers(self.key()).await == (0, 0),
            "nothing is left in progress",
        );
    }
}

/// Keeps the handler's planned panics out of the output (the layer catches them).
fn quiet_planned_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if info.payload().downcast_ref::<&str>() != Some(&PANIC) {
                default(info);
            }
        }));
    });
}

/// Runs `cases` random cases on the backend `make` gives (none when it is not available),
/// all on one runtime and one store, a fresh key each.
fn run_cases<B: Backend>(make: impl Future<Output = Option<B>>, cases: u32) {
    quiet_planned_panics();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let Some(backend) = runtime.block_on(make) else {
        return;
    };
    let backend = Arc::new(backend);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 256,
        ..Config::default()
    });
    let outcome = runner.run(&arb_case(), |case| {
        runtime.block_on(Run::new(backend.clone(), &case, true).case(&case));
        Ok(())
    });
    if let Err(error) = outcome {
        panic!("{error}");
    }
}

/// The cases per store; fewer than the property needs to be thorough, but each run draws new
/// ones.
const CASES: u32 = 48;

mod sqlite {
    use tower_idempotency::store::sqlite::{rusqlite, SqliteStore};

    use super::*;

    pub(super) struct Sqlite {
        store: SqliteStore,
        _dir: tempfile::TempDir,
    }

    pub(super) async fn backend() -> Option<Sqlite> {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = SqliteStore::open(dir.path().join("model.db"))
            .await
            .expect("open");
        store.install_steps().await.expect("install steps");
        store
            .write(|tx| {
                tx.execute_batch("CREATE TABLE model_rows (k TEXT NOT NULL, step TEXT NOT NULL)")
            })
            .await
            .expect("model_rows");
        Some(Sqlite { store, _dir: dir })
    }

    impl Backend for Sqlite {
        type Store = SqliteStore;

        fn store(&self) -> &SqliteStore {
            &self.store
        }

        async fn local(
            steps: Steps<SqliteStore>,
            name: String,
            key: String,
            reached: Option<Arc<Reached>>,
        ) -> Result<i64, StepError> {
            let step = name.clone();
            steps
                .local(&step, move |tx: &rusqlite::Transaction<'_>| {
                    tx.execute(
                        "INSERT INTO model_rows (k, step) VALUES (?1, ?2)",
                        [&key, &name],
                    )?;
                    if let Some(reached) = reached {
                        reached.hit();
                    }
                    tx.query_row(
                        "SELECT count(*) FROM model_rows WHERE k = ?1",
                        [&key],
                        |row| row.get(0),
                    )
                })
                .await
        }

        async fn rows(&self, key: &str) -> BTreeMap<String, i64> {
            let key = key.to_owned();
            self.store
                .read(move |conn| {
                    let mut statement = conn.prepare(
                        "SELECT step, count(*) FROM model_rows WHERE k = ?1 GROUP BY step",
                    )?;
                    let rows = statement.query_map([key], |row| Ok((row.get(0)?, row.get(1)?)))?;
                    rows.collect()
                })
                .await
                .expect("rows")
        }

        async fn leftovers(&self, key: &str) -> (i64, i64) {
            let key = key.to_owned();
            self.store
                .read(move |conn| {
                    conn.query_row(
                        "SELECT (SELECT count(*) FROM idempotency_progress \
                         WHERE idempotency_key = ?1), (SELECT count(*) FROM idempotency_steps \
                         WHERE idempotency_key = ?1)",
                        [key],
                        |row| Ok((row.get(0)?, row.get(1)?)),
                    )
                })
                .await
                .expect("leftovers")
        }
    }
}

/// The reads of both PostgreSQL backends, on a connection of the test's.
mod pg_reads {
    use tower_idempotency::store::tokio_postgres::tokio_postgres;

    use super::*;
    use support::pg_common::TestDb;

    pub(super) struct PgReads {
        pub(super) db: TestDb,
        client: tokio_postgres::Client,
    }

    impl PgReads {
        pub(super) async fn new() -> Option<PgReads> {
            let db = TestDb::create().await?;
            db.execute("CREATE TABLE model_rows (k TEXT NOT NULL, step TEXT NOT NULL)")
                .await;
            let client = db.client().await;
            Some(PgReads { db, client })
        }

        pub(super) async fn rows(&self, key: &str) -> BTreeMap<String, i64> {
            self.client
                .query(
                    "SELECT step, count(*) FROM model_rows WHERE k = $1 GROUP BY step",
                    &[&key],
                )
                .await
                .expect("rows")
                .iter()
                .map(|row| (row.get(0), row.get(1)))
                .collect()
        }

        pub(super) async fn leftovers(&self, key: &str) -> (i64, i64) {
            let row = self
                .client
                .query_one(
                    "SELECT (SELECT count(*) FROM idempotency_progress \
                     WHERE idempotency_key = $1), (SELECT count(*) FROM idempotency_steps \
                     WHERE idempotency_key = $1)",
                    &[&key],
                )
                .await
                .expect("leftovers");
            (row.get(0), row.get(1))
        }
    }
}

mod postgres {
    use tower_idempotency::store::tokio_postgres::{PostgresHandle, PostgresStore};

    use super::pg_reads::PgReads;
    use super::*;

    pub(super) struct Pg {
        store: PostgresStore,
        reads: PgReads,
    }

    pub(super) async fn backend() -> Option<Pg> {
        let reads = PgReads::new().await?;
        let store = reads.db.store().await;
        store.install_steps().await.expect("install steps");
        Some(Pg { store, reads })
    }

    impl Backend for Pg {
        type Store = PostgresStore;

        fn store(&self) -> &PostgresStore {
            &self.store
        }

        async fn local(
            steps: Steps<PostgresStore>,
            name: String,
            key: String,
            reached: Option<Arc<Reached>>,
        ) -> Result<i64, StepError> {
            let step = name.clone();
            steps
                .local(&step, move |tx: PostgresHandle| async move {
                    let client = tx.client().await?;
                    client
                        .execute(
                            "INSERT INTO model_rows (k, step) VALUES ($1, $2)",
                            &[&key, &name],
                        )
                        .await?;
                    if let Some(reached) = reached {
                        reached.hit();
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    let row = client
                        .query_one("SELECT count(*) FROM model_rows WHERE k = $1", &[&key])
                        .await?;
                    Ok(row.get::<_, i64>(0))
                })
                .await
        }

        async fn rows(&self, key: &str) -> BTreeMap<String, i64> {
            self.reads.rows(key).await
        }

        async fn leftovers(&self, key: &str) -> (i64, i64) {
            self.reads.leftovers(key).await
        }
    }
}

mod sqlx_postgres {
    use tower_idempotency::store::sqlx_postgres::{SqlxHandle, SqlxPostgresStore};

    use super::pg_reads::PgReads;
    use super::*;

    pub(super) struct SqlxPg {
        store: SqlxPostgresStore,
        reads: PgReads,
    }

    pub(super) async fn backend() -> Option<SqlxPg> {
        let reads = PgReads::new().await?;
        let store = reads.db.sqlx_store(4, 2).await;
        store.install_steps().await.expect("install steps");
        Some(SqlxPg { store, reads })
    }

    impl Backend for SqlxPg {
        type Store = SqlxPostgresStore;

        fn store(&self) -> &SqlxPostgresStore {
            &self.store
        }

        async fn local(
            steps: Steps<SqlxPostgresStore>,
            name: String,
            key: String,
            reached: Option<Arc<Reached>>,
        ) -> Result<i64, StepError> {
            let step = name.clone();
            steps
                .local(&step, move |tx: SqlxHandle| async move {
                    let mut conn = tx.acquire().await?;
                    sqlx::query("INSERT INTO model_rows (k, step) VALUES ($1, $2)")
                        .bind(&key)
                        .bind(&name)
                        .execute(&mut *conn)
                        .await?;
                    if let Some(reached) = reached {
                        reached.hit();
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    let rows: i64 =
                        sqlx::query_scalar("SELECT count(*) FROM model_rows WHERE k = $1")
                            .bind(&key)
                            .fetch_one(&mut *conn)
                            .await?;
                    Ok(rows)
                })
                .await
        }

        async fn rows(&self, key: &str) -> BTreeMap<String, i64> {
            self.reads.rows(key).await
        }

        async fn leftovers(&self, key: &str) -> (i64, i64) {
            self.reads.leftovers(key).await
        }
    }
}

mod sqlx_mysql {
    use sqlx::mysql::MySqlPool;
    use tower_idempotency::store::sqlx_mysql::{SqlxHandle, SqlxMySqlStore};

    use super::*;
    use support::mysql_common::TestDb;

    pub(super) struct MySql {
        store: SqlxMySqlStore,
        reads: MySqlPool,
        _db: TestDb,
    }

    pub(super) async fn backend() -> Option<MySql> {
        let db = TestDb::create().await?;
        db.execute(
            "CREATE TABLE model_rows (k VARCHAR(255) NOT NULL, step VARCHAR(255) NOT NULL) \
             ENGINE = InnoDB",
        )
        .await;
        let store = db.store(4).await;
        store.install_steps().await.expect("install steps");
        let reads = db.pool(1).await;
        Some(MySql {
            store,
            reads,
            _db: db,
        })
    }

    impl Backend for MySql {
        type Store = SqlxMySqlStore;

        fn store(&self) -> &SqlxMySqlStore {
            &self.store
        }

        async fn local(
            steps: Steps<SqlxMySqlStore>,
            name: String,
            key: String,
            reached: Option<Arc<Reached>>,
        ) -> Result<i64, StepError> {
            let step = name.clone();
            steps
                .local(&step, move |tx: SqlxHandle| async move {
                    let mut conn = tx.acquire().await?;
                    sqlx::query("INSERT INTO model_rows (k, step) VALUES (?, ?)")
                        .bind(&key)
                        .bind(&name)
                        .execute(&mut *conn)
                        .await?;
                    if let Some(reached) = reached {
                        reached.hit();
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    let rows: i64 =
                        sqlx::query_scalar("SELECT count(*) FROM model_rows WHERE k = ?")
                            .bind(&key)
                            .fetch_one(&mut *conn)
                            .await?;
                    Ok(rows)
                })
                .await
        }

        async fn rows(&self, key: &str) -> BTreeMap<String, i64> {
            sqlx::query_as::<_, (String, i64)>(
                "SELECT step, count(*) FROM model_rows WHERE k = ? GROUP BY step",
            )
            .bind(key)
            .fetch_all(&self.reads)
            .await
            .expect("rows")
            .into_iter()
            .collect()
        }

        async fn leftovers(&self, key: &str) -> (i64, i64) {
            sqlx::query_as(
                "SELECT (SELECT count(*) FROM idempotency_progress WHERE idempotency_key = ?), \
                 (SELECT count(*) FROM idempotency_steps WHERE idempotency_key = ?)",
            )
            .bind(key)
            .bind(key)
            .fetch_one(&self.reads)
            .await
            .expect("leftovers")
        }
    }
}

test! { random_programs_and_stops_match_the_model_on_sqlite, sync }
fn random_programs_and_stops_match_the_model_on_sqlite() {
    run_cases(sqlite::backend(), CASES);
}

test! { random_programs_and_stops_match_the_model_on_postgres, sync, postgres }
fn random_programs_and_stops_match_the_model_on_postgres() {
    run_cases(postgres::backend(), CASES);
}

test! { random_programs_and_stops_match_the_model_on_sqlx_postgres, sync, postgres }
fn random_programs_and_stops_match_the_model_on_sqlx_postgres() {
    run_cases(sqlx_postgres::backend(), CASES);
}

test! { random_programs_and_stops_match_the_model_on_mysql, sync, mysql }
fn random_programs_and_stops_match_the_model_on_mysql() {
    run_cases(sqlx_mysql::backend(), CASES);
}

/// Runs one given case on SQLite.
fn run_one(case: Case) {
    quiet_planned_panics();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let backend = Arc::new(sqlite::backend().await.expect("SQLite"));
        Run::new(backend, &case, true).case(&case).await;
    });
}

fn call_again(name: &str) -> Step {
    Step {
        name: name.to_owned(),
        foreign: Some(ForeignStep {
            ask: false,
            declines: false,
        }),
    }
}

fn client(stop: Stop) -> Attempt {
    Attempt {
        completer: false,
        stop,
    }
}

test! { a_stalled_owner_does_not_call_again_after_a_take_over, sync }
/// A request resumes a key whose foreign step has its intent saved (the outcome was unknown)
/// and stalls past its lease before the call; a retry takes the key over and goes away before
/// the call. The stalled request then goes on: it must not call the provider (its lease is
/// gone), as a fresh intent's commit would have stopped it.
fn a_stalled_owner_does_not_call_again_after_a_take_over() {
    run_one(Case {
        program: vec![call_again("call0")],
        attempts: vec![
            client(Stop::Unknown {
                step: 0,
                charged: false,
            }),
            client(Stop::Stall(0)),
            client(Stop::Gone(0)),
        ],
    });
}
