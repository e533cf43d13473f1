//! Shared setup for the integration tests: the order app of the example (axum, a demo auth
//! layer, `POST /orders` writing through the idempotency transaction), served on 127.0.0.1:0
//! over a real SQLite file in a temp dir, and a real HTTP client over loopback.
//!
//! Each test customises the layer (a closure over it) and the handler's behaviour (a [`Hook`]
//! run after the order row is inserted, while the transaction is open).

pub mod server_backed;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{self, Route};
use axum::{Extension, Router};
use bytes::Bytes;
use http::header::{self, HeaderName};
use http::{HeaderMap, HeaderValue, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tower::{Layer, Service};
use tower_idempotency::extract::Tx;
use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::key::IdempotencyKey;
use tower_idempotency::response::SavedResponse;
use tower_idempotency::store::sqlite::{SqliteHandle, SqliteOptions, SqliteStore};
use tower_idempotency::store::{Begin, IdempotencyStore, NewRecord, Reservation, Scope};
use tower_idempotency::{IdempotencyLayer, Tenant};

pub const SHOP_A: &str = "shop-a-token";
pub const SHOP_B: &str = "shop-b-token";

/// A generous bound for anything a test waits for: reached only when the test fails.
pub const PATIENCE: Duration = Duration::from_secs(10);

use crate::apps::process as example_process;
use crate::splitmix;
pub use crate::sqlite_orders;

/// What the order handler knows when it calls the hook: its order row is already inserted,
/// inside the open idempotency transaction `tx` (a [`SqliteHandle`] here, a
/// `PostgresHandle` in `tests/support/pg_common`).
#[derive(Clone, Debug)]
pub struct OrderCallOf<T> {
    pub tenant: String,
    pub key: Option<String>,
    pub sku: String,
    pub quantity: i64,
    pub order_id: i64,
    pub tx: T,
}

pub type OrderCall = OrderCallOf<SqliteHandle>;

/// What the hook asks the handler to do next.
#[derive(Debug, Default)]
pub struct HookOutcome {
    /// Answer this status with `{"error":"injected_failure"}` instead of the 201.
    pub fail_with: Option<StatusCode>,
    /// Extra headers on the 201.
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

/// What a hook of either app answers.
pub trait Outcome: Default + Send + 'static {
    /// Answer this status instead of the 201 (or, `None`, go on).
    fn failing(fail_with: Option<StatusCode>) -> Self;
    fn fail_with(&self) -> Option<StatusCode>;
    /// Extra headers on the 201.
    fn into_headers(self) -> Vec<(HeaderName, HeaderValue)>;
}

impl Outcome for HookOutcome {
    fn failing(fail_with: Option<StatusCode>) -> Self {
        HookOutcome {
            fail_with,
            ..HookOutcome::default()
        }
    }

    fn fail_with(&self) -> Option<StatusCode> {
        self.fail_with
    }

    fn into_headers(self) -> Vec<(HeaderName, HeaderValue)> {
        self.headers
    }
}

/// A hook of the tests: run by the order handler after its insert, with the call `C`.
pub type HookFor<C, O> = Arc<dyn Fn(C) -> Pin<Box<dyn Future<Output = O> + Send>> + Send + Sync>;

/// Wraps an async closure as a hook.
pub fn hook_for<C, O, F, Fut>(f: F) -> HookFor<C, O>
where
    F: Fn(C) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = O> + Send + 'static,
{
    Arc::new(move |call| Box::pin(f(call)))
}

pub type Hook = HookFor<OrderCall, HookOutcome>;

/// Wraps an async closure as a [`Hook`].
pub fn hook<F, Fut>(f: F) -> Hook
where
    F: Fn(OrderCall) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = HookOutcome> + Send + 'static,
{
    hook_for(f)
}

/// A handler the test holds inside its open transaction: the hook awaits
/// [`HeldHandler::hold`]; the test waits for [`HeldHandler::started`] and ends the hold with
/// [`HeldHandler::release`].
#[derive(Clone, Debug, Default)]
pub struct HeldHandler {
    started: Arc<tokio::sync::Notify>,
    release: Arc<tokio::sync::Notify>,
}

impl HeldHandler {
    /// In the hook: signals that the handler runs, and waits until the test releases it.
    pub async fn hold(&self) {
        self.started.notify_one();
        self.release.notified().await;
    }

    /// Waits (within [`PATIENCE`]) until the held handler runs.
    pub async fn started(&self) {
        tokio::time::timeout(PATIENCE, self.started.notified())
            .await
            .expect("the held handler started in time");
    }

    /// Lets the held handler go on.
    pub fn release(&self) {
        self.release.notify_one();
    }
}

/// The state shared by an app's handlers and the test, for a transaction handle `T` and the
/// hook's outcome `O`.
pub struct AppOf<T, O> {
    /// How many times the order handler ran (entered its body).
    pub handler_calls: AtomicUsize,
    /// How many times the note handler ran (the SQLite app's).
    pub note_calls: AtomicUsize,
    /// Requests that reached the app (counted by the auth middleware, before the layer).
    arrivals: watch::Sender<usize>,
    hook: Option<HookFor<OrderCallOf<T>, O>>,
    /// Set on every `201` of the order handler, replacing its own (see
    /// [`AppBuilder::response_header`]).
    response_headers: Vec<(HeaderName, HeaderValue)>,
}

pub type App = AppOf<SqliteHandle, HookOutcome>;

impl<T: Send + 'static, O: Outcome> AppOf<T, O> {
    pub fn new(
        hook: Option<HookFor<OrderCallOf<T>, O>>,
        response_headers: Vec<(HeaderName, HeaderValue)>,
    ) -> Arc<Self> {
        Arc::new(AppOf {
            handler_calls: AtomicUsize::new(0),
            note_calls: AtomicUsize::new(0),
            arrivals: watch::channel(0usize).0,
            hook,
            response_headers,
        })
    }

    pub fn handler_calls(&self) -> usize {
        self.handler_calls.load(Ordering::SeqCst)
    }

    pub fn note_calls(&self) -> usize {
        self.note_calls.load(Ordering::SeqCst)
    }

    /// Waits until at least `n` requests reached the app; `false` if that took too long.
    pub async fn wait_for_arrivals(&self, n: usize, timeout: Duration) -> bool {
        let mut arrivals = self.arrivals.subscribe();
        let reached = tokio::time::timeout(timeout, arrivals.wait_for(|seen| *seen >= n)).await;
        matches!(reached, Ok(Ok(_)))
    }

    /// The rest of the order handler once its order row is inserted: runs the hook (with the
    /// transaction still open), then answers its injected failure or the 201.
    pub async fn respond(
        &self,
        tenant: &Tenant,
        headers: &HeaderMap,
        (sku, quantity): (String, i64),
        order_id: i64,
        tx: T,
    ) -> Response {
        let outcome = match &self.hook {
            Some(hook) => {
                hook(OrderCallOf {
                    tenant: tenant.as_str().to_owned(),
                    key: headers
                        .get("idempotency-key")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned),
                    sku,
                    quantity,
                    order_id,
                    tx,
                })
                .await
            }
            None => O::default(),
        };
        if let Some(status) = outcome.fail_with() {
            return json_error(status, "injected_failure");
        }
        let mut response = (
            StatusCode::CREATED,
            [
                (header::CONTENT_TYPE, "application/json".to_owned()),
                (header::LOCATION, format!("/orders/{order_id}")),
            ],
            format!("{{\"order_id\":{order_id}}}"),
        )
            .into_response();
        for (name, value) in &self.response_headers {
            response.headers_mut().insert(name.clone(), value.clone());
        }
        for (name, value) in outcome.into_headers() {
            response.headers_mut().append(name, value);
        }
        response
    }
}

type Customise<S> = Box<dyn Fn(IdempotencyLayer<S>, &str) -> IdempotencyLayer<S> + Send>;

/// Builds an app on the store `S` with hooks `H`; `X` is what only one backend's app takes
/// (the database file, the store's options...).
pub struct AppBuilder<S, H, X> {
    pub customise: Customise<S>,
    pub hook: Option<H>,
    pub response_headers: Vec<(HeaderName, HeaderValue)>,
    pub extra: X,
}

impl<S: 'static, H, X> AppBuilder<S, H, X> {
    pub fn new(extra: X) -> Self {
        AppBuilder {
            customise: Box::new(|layer, _| layer),
            hook: None,
            response_headers: Vec::new(),
            extra,
        }
    }

    /// Customises every route's layer (already given its operation name).
    pub fn layer<F>(self, f: F) -> Self
    where
        F: Fn(IdempotencyLayer<S>) -> IdempotencyLayer<S> + Send + 'static,
    {
        self.layer_per_operation(move |layer, _| f(layer))
    }

    /// Customises the layer per operation (`create_order`, `create_express_order`, and the
    /// SQLite app's `create_note`).
    pub fn layer_per_operation<F>(mut self, f: F) -> Self
    where
        F: Fn(IdempotencyLayer<S>, &str) -> IdempotencyLayer<S> + Send + 'static,
    {
        self.customise = Box::new(f);
        self
    }

    pub fn hook(mut self, hook: H) -> Self {
        self.hook = Some(hook);
        self
    }

    /// Sets this header on every `201` of the order handler, replacing the handler's own of that
    /// name (such as `Location`). Any bytes a header value may hold, obs-text included.
    pub fn response_header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.response_headers.push((name, value));
        self
    }

    /// The same settings with another kind of hook and another `extra`.
    pub fn convert<H2, X2>(self, hook: impl FnOnce(H) -> H2, extra: X2) -> AppBuilder<S, H2, X2> {
        AppBuilder {
            customise: self.customise,
            hook: self.hook.map(hook),
            response_headers: self.response_headers,
            extra,
        }
    }

    /// The layer of one route.
    pub fn layer_for(&self, store: &S, operation: &str) -> IdempotencyLayer<S>
    where
        S: Clone,
    {
        (self.customise)(
            IdempotencyLayer::new(store.clone()).with_operation(operation.to_owned()),
            operation,
        )
    }
}

impl<S: Clone + 'static, H, X> AppBuilder<S, H, X> {
    /// `POST /orders` and `POST /express-orders`: the order handler, each behind its layer.
    pub fn order_routes<T: InsertOrder, O: Outcome>(&self, store: &S) -> Router<Arc<AppOf<T, O>>>
    where
        IdempotencyLayer<S>: Layer<Route> + Clone + Send + Sync + 'static,
        Guarded<S>: Service<Request, Error = Infallible> + Clone + Send + Sync + 'static,
        <Guarded<S> as Service<Request>>::Response: IntoResponse + 'static,
        <Guarded<S> as Service<Request>>::Future: Send + 'static,
    {
        let mut router = Router::new();
        for (path, operation) in [
            ("/orders", "create_order"),
            ("/express-orders", "create_express_order"),
        ] {
            router = router.route(
                path,
                routing::post(create_order::<T, O>).layer(self.layer_for(store, operation)),
            );
        }
        router
    }
}

impl<S: Clone + 'static, T: InsertOrder, O: Outcome, X>
    AppBuilder<S, HookFor<OrderCallOf<T>, O>, X>
{
    /// The order routes on `store`, behind the demo authentication, served on 127.0.0.1:0:
    /// the app of a database backend whose handle is `T` (the SQLite app adds its own routes).
    pub async fn serve_orders(&self, store: &S) -> (Arc<AppOf<T, O>>, Serving)
    where
        IdempotencyLayer<S>: Layer<Route> + Clone + Send + Sync + 'static,
        Guarded<S>: Service<Request, Error = Infallible> + Clone + Send + Sync + 'static,
        <Guarded<S> as Service<Request>>::Response: IntoResponse + 'static,
        <Guarded<S> as Service<Request>>::Future: Send + 'static,
    {
        let app = AppOf::<T, O>::new(self.hook.clone(), self.response_headers.clone());
        let router = self
            .order_routes::<T, O>(store)
            .layer(middleware::from_fn_with_state(app.clone(), authenticate))
            .with_state(app.clone());
        (app, Serving::start(router).await)
    }
}

/// A route's service behind the idempotency layer on the store `S`.
type Guarded<S> = <IdempotencyLayer<S> as Layer<Route>>::Service;

/// A router served on 127.0.0.1:0 until stopped (or dropped: aborted).
pub struct Serving {
    pub addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Serving {
    pub async fn start(router: Router) -> Serving {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let (shutdown, signal) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(async move {
                    let _ = signal.await;
                })
                .await
                .expect("serve");
        });
        Serving {
            addr,
            shutdown: Some(shutdown),
            task: Some(task),
        }
    }

    /// Stops serving, gracefully but bounded.
    pub async fn stop(mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(task) = self.task.take() {
            let abort = task.abort_handle();
            if tokio::time::timeout(PATIENCE, task).await.is_err() {
                abort.abort();
            }
        }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

type StoreOptions = Box<dyn FnOnce(SqliteOptions) -> SqliteOptions + Send>;

/// What only the SQLite app takes.
pub struct SqliteApp {
    db_path: Option<PathBuf>,
    auth: bool,
    store_options: Option<StoreOptions>,
}

impl Default for SqliteApp {
    fn default() -> Self {
        SqliteApp {
            db_path: None,
            auth: true,
            store_options: None,
        }
    }
}

impl SqliteApp {
    /// On this database file.
    pub fn on(path: impl AsRef<Path>) -> SqliteApp {
        SqliteApp {
            db_path: Some(path.as_ref().to_path_buf()),
            ..SqliteApp::default()
        }
    }
}

/// Builds a [`TestServer`].
pub type ServerBuilder = AppBuilder<SqliteStore, Hook, SqliteApp>;

impl Default for ServerBuilder {
    fn default() -> Self {
        AppBuilder::new(SqliteApp::default())
    }
}

impl ServerBuilder {
    /// Uses this database file instead of a fresh one in a temp dir.
    pub fn db_path(mut self, path: impl AsRef<Path>) -> Self {
        self.extra.db_path = Some(path.as_ref().to_path_buf());
        self
    }

    /// Opens the store with these options (group commit, durability...).
    pub fn store_options<F>(mut self, f: F) -> Self
    where
        F: FnOnce(SqliteOptions) -> SqliteOptions + Send + 'static,
    {
        self.extra.store_options = Some(Box::new(f));
        self
    }

    /// Leaves out the auth middleware: requests reach the layer without a tenant.
    pub fn without_auth(mut self) -> Self {
        self.extra.auth = false;
        self
    }

    pub async fn spawn(mut self) -> TestServer {
        let (dir, db_path) = match self.extra.db_path.clone() {
            Some(path) => (None, path),
            None => {
                let dir = tempfile::tempdir().expect("temp dir");
                let path = dir.path().join("orders.db");
                (Some(dir), path)
            }
        };
        let options = SqliteStore::builder(&db_path);
        let options = match self.extra.store_options.take() {
            Some(f) => f(options),
            None => options,
        };
        let store = options.build().await.expect("open store");
        sqlite_orders::create_orders_table(&store).await;

        let app = App::new(self.hook.clone(), self.response_headers.clone());
        let mut router = self
            .order_routes::<SqliteHandle, HookOutcome>(&store)
            .route(
                "/notes",
                routing::post(create_note).layer(self.layer_for(&store, "create_note")),
            )
            // The extractor on a route the layer does not wrap.
            .route(
                "/unguarded/orders",
                routing::post(create_order::<SqliteHandle, HookOutcome>),
            );
        if self.extra.auth {
            router = router.layer(middleware::from_fn_with_state(app.clone(), authenticate));
        }
        let serving = Serving::start(router.with_state(app.clone())).await;
        TestServer {
            addr: serving.addr,
            store,
            db_path,
            app,
            serving,
            _dir: dir,
        }
    }
}

/// A running app on 127.0.0.1 and its store.
pub struct TestServer {
    pub addr: SocketAddr,
    pub store: SqliteStore,
    pub db_path: PathBuf,
    pub app: Arc<App>,
    serving: Serving,
    _dir: Option<tempfile::TempDir>,
}

impl TestServer {
    /// The default app, its layers customised by `f`.
    pub async fn with_layer<F>(f: F) -> TestServer
    where
        F: Fn(IdempotencyLayer<SqliteStore>) -> IdempotencyLayer<SqliteStore> + Send + 'static,
    {
        Self::builder().layer(f).spawn().await
    }

    /// The default app, its handler running `hook` after the insert.
    pub async fn with_hook(hook: Hook) -> TestServer {
        Self::builder().hook(hook).spawn().await
    }

    pub fn builder() -> ServerBuilder {
        ServerBuilder::default()
    }

    /// The default app.
    pub async fn spawn() -> TestServer {
        ServerBuilder::default().spawn().await
    }

    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops serving (gracefully, bounded) and drops the store, so that the database file can
    /// be opened afresh.
    pub async fn shutdown(self) {
        self.serving.stop().await;
    }

    pub async fn order_count(&self) -> i64 {
        order_count(&self.store).await
    }

    pub async fn record_count(&self) -> i64 {
        record_count(&self.store).await
    }

    /// `(handler calls, orders, records)`: what the requests so far left behind.
    pub async fn counts(&self) -> (usize, i64, i64) {
        let calls = self.app.handler_calls();
        (calls, self.order_count().await, self.record_count().await)
    }
}

/// The demo authentication of the example: a known bearer token becomes a [`Tenant`] in the
/// extensions, anything else is 401. Also counts arrivals, before the idempotency layer sees
/// the request.
pub async fn authenticate<T, O>(
    State(app): State<Arc<AppOf<T, O>>>,
    mut request: Request,
    next: Next,
) -> Response {
    app.arrivals.send_modify(|seen| *seen += 1);
    let tenant = match request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        Some("Bearer shop-a-token") => "shop-a",
        Some("Bearer shop-b-token") => "shop-b",
        _ => return json_error(StatusCode::UNAUTHORIZED, "unauthenticated"),
    };
    request.extensions_mut().insert(Tenant::new(tenant));
    next.run(request).await
}

pub fn json_error(status: StatusCode, code: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        format!("{{\"error\":\"{code}\"}}"),
    )
        .into_response()
}

/// The order app's validation, shared by the SQLite and PostgreSQL test apps: `(sku, quantity)`,
/// or the code of the 400 to answer.
pub fn parse_order(body: &[u8]) -> Result<(String, i64), &'static str> {
    let Ok(input) = serde_json::from_slice::<serde_json::Value>(body) else {
        return Err("invalid_json");
    };
    let Some(sku) = input
        .get("sku")
        .and_then(|v| v.as_str())
        .filter(|sku| (1..=100).contains(&sku.chars().count()))
        .map(str::to_owned)
    else {
        return Err("invalid_key_or_sku");
    };
    let Some(quantity) = input
        .get("quantity")
        .and_then(|v| v.as_i64())
        .filter(|q| (1..=100).contains(q))
    else {
        return Err("invalid_quantity");
    };
    Ok((sku, quantity))
}

/// How an app's transaction handle inserts an order row (returning its id).
pub trait InsertOrder: Clone + Send + Sync + 'static {
    fn insert_order(
        &self,
        tenant: &Tenant,
        sku: &str,
        quantity: i64,
    ) -> impl Future<Output = Result<i64, tower_idempotency::Error>> + Send;
}

impl InsertOrder for SqliteHandle {
    fn insert_order(
        &self,
        tenant: &Tenant,
        sku: &str,
        quantity: i64,
    ) -> impl Future<Output = Result<i64, tower_idempotency::Error>> + Send {
        sqlite_orders::insert_order(self, tenant.as_str(), sku, quantity)
    }
}

/// `POST /orders` of both apps: validates, inserts the order through the idempotency
/// transaction, runs the test's hook (with the transaction still open), and answers 201.
pub async fn create_order<T: InsertOrder, O: Outcome>(
    State(app): State<Arc<AppOf<T, O>>>,
    Extension(tenant): Extension<Tenant>,
    Tx(tx): Tx<T>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    app.handler_calls.fetch_add(1, Ordering::SeqCst);
    let (sku, quantity) = match parse_order(&body) {
        Ok(order) => order,
        Err(code) => return json_error(StatusCode::BAD_REQUEST, code),
    };
    let order_id = match tx.insert_order(&tenant, &sku, quantity).await {
        Ok(id) => id,
        Err(_) => return json_error(StatusCode::INTERNAL_SERVER_ERROR, "database_error"),
    };
    app.respond(&tenant, &headers, (sku, quantity), order_id, tx)
        .await
}

/// `POST /notes`: no database; echoes the body it received and says whether a transaction
/// handle was in the extensions (`x-saw-transaction`).
async fn create_note(
    State(app): State<Arc<App>>,
    tx: Option<Extension<SqliteHandle>>,
    body: Bytes,
) -> Response {
    app.note_calls.fetch_add(1, Ordering::SeqCst);
    let saw = if tx.is_some() { "yes" } else { "no" };
    (StatusCode::OK, [("x-saw-transaction", saw)], body).into_response()
}

// ----- client side -----

/// A response as the client received it.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    /// Reads the whole response (its body within [`PATIENCE`]).
    pub async fn read<B>(response: http::Response<B>) -> Reply
    where
        B: Body,
        B::Error: std::fmt::Debug,
    {
        let (parts, body) = response.into_parts();
        let body = tokio::time::timeout(PATIENCE, body.collect())
            .await
            .expect("response body in time")
            .expect("response body")
            .to_bytes();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.body))
    }

    /// The `error` code of a JSON error body.
    pub fn error_code(&self) -> String {
        self.json()["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no error code in {:?}", self.body))
            .to_owned()
    }

    pub fn order_id(&self) -> i64 {
        self.json()["order_id"]
            .as_i64()
            .unwrap_or_else(|| panic!("no order_id in {:?}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn replayed(&self) -> bool {
        match self.header("idempotent-replayed") {
            None => false,
            Some("true") => true,
            Some(other) => panic!("idempotent-replayed: {other:?}"),
        }
    }

    /// The `Content-Length` header, checked against the body actually received.
    pub fn assert_content_length_matches(&self) {
        let declared: usize = self
            .header("content-length")
            .unwrap_or_else(|| panic!("no content-length in {:?}", self.headers))
            .parse()
            .expect("numeric content-length");
        assert_eq!(declared, self.body.len(), "content-length vs body");
    }
}

/// A request to the app, built step by step.
#[derive(Clone, Debug)]
pub struct Post {
    pub path: String,
    pub token: Option<String>,
    pub keys: Vec<HeaderValue>,
    pub content_type: Option<String>,
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub body: Bytes,
}

impl Post {
    /// `POST /orders` as shop-a, JSON, with this key and body.
    pub fn order(key: &str, body: &str) -> Post {
        Post {
            path: "/orders".into(),
            token: Some(SHOP_A.into()),
            keys: vec![HeaderValue::from_str(key).expect("key is a valid header value")],
            content_type: Some("application/json".into()),
            headers: Vec::new(),
            body: Bytes::copy_from_slice(body.as_bytes()),
        }
    }

    pub fn path(mut self, path: &str) -> Post {
        self.path = path.into();
        self
    }

    pub fn token(mut self, token: Option<&str>) -> Post {
        self.token = token.map(str::to_owned);
        self
    }

    /// Replaces the key headers with these raw values (none, one or several).
    pub fn raw_keys(mut self, keys: &[&[u8]]) -> Post {
        self.keys = keys
            .iter()
            .map(|k| HeaderValue::from_bytes(k).expect("sendable header value"))
            .collect();
        self
    }

    pub fn no_key(mut self) -> Post {
        self.keys.clear();
        self
    }

    pub fn content_type(mut self, content_type: Option<&str>) -> Post {
        self.content_type = content_type.map(str::to_owned);
        self
    }

    pub fn body(mut self, body: impl Into<Bytes>) -> Post {
        self.body = body.into();
        self
    }

    pub fn header(mut self, name: &'static str, value: &str) -> Post {
        self.headers.push((
            HeaderName::from_static(name),
            HeaderValue::from_str(value).expect("header value"),
        ));
        self
    }

    fn request<B>(&self, addr: SocketAddr, body: B) -> http::Request<B> {
        let mut request = http::Request::post(format!("http://{addr}{}", self.path))
            .body(body)
            .expect("request");
        let headers = request.headers_mut();
        if let Some(token) = &self.token {
            headers.insert(
                header::AUTHORIZATION,
                HeaderValue::from_str(&format!("Bearer {token}")).expect("token"),
            );
        }
        if let Some(content_type) = &self.content_type {
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_str(content_type).expect("content type"),
            );
        }
        for key in &self.keys {
            headers.append("idempotency-key", key.clone());
        }
        for (name, value) in &self.headers {
            headers.append(name.clone(), value.clone());
        }
        request
    }

    /// Sends it with a fresh hyper-util client (its own connection) and reads the whole reply.
    pub async fn send(&self, addr: SocketAddr) -> Reply {
        send(self.request(addr, Full::new(self.body.clone()))).await
    }

    /// Sends it over HTTP/2 (prior knowledge, h2c) with a fresh client.
    pub async fn send_http2(&self, addr: SocketAddr) -> Reply {
        let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build_http();
        let request = self.request(addr, Full::new(self.body.clone()));
        let response = tokio::time::timeout(PATIENCE, client.request(request))
            .await
            .expect("response in time")
            .expect("response");
        assert_eq!(response.version(), http::Version::HTTP_2);
        Reply::read(response).await
    }

    /// Sends it with a streamed body (chunked unless a `content-length` header was added).
    pub async fn send_streaming(&self, addr: SocketAddr, body: ChannelBody) -> Reply {
        send(self.request(addr, body)).await
    }

    /// The request as raw HTTP/1.1 bytes (with `Connection: close`), for raw TCP tests.
    pub fn to_http1_bytes(&self, addr: SocketAddr) -> Vec<u8> {
        let request = self.request(addr, ());
        let mut raw = format!("POST {} HTTP/1.1\r\nhost: {addr}\r\n", self.path).into_bytes();
        for (name, value) in request.headers() {
            raw.extend_from_slice(name.as_str().as_bytes());
            raw.extend_from_slice(b": ");
            raw.extend_from_slice(value.as_bytes());
            raw.extend_from_slice(b"\r\n");
        }
        raw.extend_from_slice(
            format!(
                "content-length: {}\r\nconnection: close\r\n\r\n",
                self.body.len()
            )
            .as_bytes(),
        );
        raw.extend_from_slice(&self.body);
        raw
    }
}

/// Sends `request` with a fresh hyper-util client (its own connection) and reads the whole
/// reply, within [`PATIENCE`].
pub async fn send<B>(request: http::Request<B>) -> Reply
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let client: Client<_, B> = Client::builder(TokioExecutor::new()).build_http();
    let response = tokio::time::timeout(PATIENCE, client.request(request))
        .await
        .expect("response in time")
        .expect("response");
    Reply::read(response).await
}

/// Sends raw bytes on a connection of its own (the request says `Connection: close`) and
/// returns all the server answered, within [`PATIENCE`].
pub async fn exchange_raw(addr: SocketAddr, raw: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.write_all(raw).await.expect("write request");
    let mut response = Vec::new();
    tokio::time::timeout(PATIENCE, stream.read_to_end(&mut response))
        .await
        .expect("response in time")
        .expect("read response");
    String::from_utf8_lossy(&response).into_owned()
}

/// Sends each `(what, request, code)` and asserts that the answer is a `400` with that error
/// code.
pub async fn assert_each_is_400<'a>(
    addr: SocketAddr,
    cases: impl IntoIterator<Item = (&'a str, Post, &'a str)>,
) {
    for (what, request, code) in cases {
        let reply = request.send(addr).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{what}: {reply:?}");
        assert_eq!(reply.error_code(), code, "{what}");
    }
}

/// `POST /orders` as `token` (or unauthenticated), with `key` (or none), a JSON `body` and
/// extra headers.
pub async fn post(
    addr: SocketAddr,
    token: Option<&str>,
    key: Option<&str>,
    body: &str,
    extra: &[(&'static str, &str)],
) -> Reply {
    let mut request = Post::order(key.unwrap_or("unused"), body).token(token);
    if key.is_none() {
        request = request.no_key();
    }
    for (name, value) in extra {
        request = request.header(name, value);
    }
    request.send(addr).await
}

/// A request body fed by the test, chunk by chunk; it ends when the sender is dropped.
#[derive(Debug)]
pub struct ChannelBody {
    chunks: mpsc::Receiver<Bytes>,
}

impl ChannelBody {
    pub fn new() -> (mpsc::Sender<Bytes>, ChannelBody) {
        let (sender, chunks) = mpsc::channel(4);
        (sender, ChannelBody { chunks })
    }

    /// A body that never ends: one space every 50 ms, for as long as the request lasts (the
    /// connection is never idle for long, but the whole body takes forever). Abort the task
    /// to stop it.
    pub fn trickling() -> (JoinHandle<()>, ChannelBody) {
        let (sender, body) = ChannelBody::new();
        let trickle = tokio::spawn(async move {
            while sender.send(Bytes::from_static(b" ")).await.is_ok() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        (trickle, body)
    }
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.chunks
            .poll_recv(cx)
            .map(|chunk| chunk.map(|c| Ok(Frame::data(c))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

// ----- database side -----

/// The scope `(tenant, operation, key)` of a record.
pub fn scope(tenant: &str, operation: &str, key: &str) -> Scope {
    Scope::new(
        tenant,
        operation,
        IdempotencyKey::parse(key.as_bytes(), 128).expect("valid key"),
    )
}

/// The fingerprint canonicalization version 1 gave a request: SHA-256 over the length-prefixed
/// domain, scheme tag (`json`, `raw`), version `1`, method, path (not the query) and canonical
/// body. Written out here from that format, so that the crate is not its own witness.
pub fn version_1_fingerprint(tag: &str, method: &str, path: &str, canonical: &[u8]) -> Fingerprint {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    for field in [
        &b"tower-idempotency/request-fingerprint"[..],
        tag.as_bytes(),
        &1u16.to_be_bytes(),
        method.as_bytes(),
        path.as_bytes(),
        canonical,
    ] {
        hasher.update((field.len() as u64).to_be_bytes());
        hasher.update(field);
    }
    Fingerprint::new(1, hasher.finalize().into())
}

/// Saves a record through the store's own verbs, as an earlier version of the layer did: a
/// `201` with this body and `Location`, kept for a day.
pub async fn save_record<S: IdempotencyStore>(
    store: &S,
    (tenant, operation, key): (&str, &str, &str),
    fingerprint: Fingerprint,
    location: &str,
    body: &str,
) {
    let scope = scope(tenant, operation, key);
    let now = SystemTime::now();
    let Begin::Reserved(transaction) = store.begin(&scope, PATIENCE, now).await.expect("begin")
    else {
        panic!("{scope:?} already has a record");
    };
    let response = SavedResponse::new(
        StatusCode::CREATED,
        vec![
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ),
            (
                header::LOCATION,
                HeaderValue::from_str(location).expect("location"),
            ),
        ],
        Bytes::copy_from_slice(body.as_bytes()),
    );
    transaction
        .commit(NewRecord::new(
            fingerprint,
            response,
            now,
            now + Duration::from_secs(24 * 3600),
        ))
        .await
        .expect("commit the record");
}

pub async fn order_count(store: &SqliteStore) -> i64 {
    count(store, "SELECT COUNT(*) FROM orders").await
}

pub async fn record_count(store: &SqliteStore) -> i64 {
    count(store, "SELECT COUNT(*) FROM idempotency_records").await
}

async fn count(store: &SqliteStore, sql: &'static str) -> i64 {
    store
        .read(move |conn| conn.query_row(sql, [], |row| row.get(0)))
        .await
        .expect("count")
}

/// Whether a record exists for `(tenant, operation, key)` (expired or not).
pub async fn record_exists(store: &SqliteStore, tenant: &str, operation: &str, key: &str) -> bool {
    let scope = (tenant.to_owned(), operation.to_owned(), key.to_owned());
    store
        .read(move |conn| {
            conn.query_row(
                "SELECT COUNT(*) FROM idempotency_records \
                 WHERE tenant = ?1 AND operation = ?2 AND idempotency_key = ?3",
                (&scope.0, &scope.1, &scope.2),
                |row| row.get::<_, i64>(0),
            )
        })
        .await
        .expect("record lookup")
        > 0
}

/// The orders as `(id, tenant_id, sku, quantity)`, by id.
pub async fn orders(store: &SqliteStore) -> Vec<(i64, String, String, i64)> {
    store
        .read(|conn| {
            let mut statement =
                conn.prepare("SELECT id, tenant_id, sku, quantity FROM orders ORDER BY id")?;
            let rows = statement
                .query_map([], |row| {
                    Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?))
                })?
                .collect::<Result<Vec<_>, _>>()?;
            Ok(rows)
        })
        .await
        .expect("orders")
}

// ----- the example app as a child process (crash and multi-process tests) -----

/// The `orders` example as real processes on a SQLite file, and a client that tolerates a
/// server that dies under it.
pub mod process {
    use std::net::SocketAddr;
    use std::path::Path;
    use std::time::Duration;

    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    pub use super::example_process::*;
    use super::{Post, Reply};

    /// `orders --addr 127.0.0.1:0 --db <file>` (or another order app), a child process killed
    /// when dropped.
    pub struct OrdersProcess {
        pub addr: SocketAddr,
        process: ExampleProcess,
    }

    impl OrdersProcess {
        /// Starts the example on the SQLite file `db` and waits until it listens.
        pub async fn start(db: &Path) -> OrdersProcess {
            Self::start_with(&["--db", arg(db)]).await
        }

        /// Starts the example on `127.0.0.1:0` with these store arguments (`--db PATH` or
        /// `--database-url URL`) and waits until it listens (it prints its address).
        pub async fn start_with(store_args: &[&str]) -> OrdersProcess {
            Self::start_example("orders", store_args).await
        }

        /// Starts the example `name` (an order app that takes `--addr` and prints its
        /// address first, as `orders` and `orders_sqlx` do) with these store arguments.
        pub async fn start_example(name: &str, store_args: &[&str]) -> OrdersProcess {
            let process = ExampleProcess::start(name, store_args).await;
            OrdersProcess {
                addr: process.addr,
                process,
            }
        }

        /// SIGKILL (`Child::start_kill` on Unix): nothing in flight gets to finish.
        pub async fn kill(self) {
            self.process.kill().await;
        }
    }

    /// A client with its own connection pool, as one of many clients of a server.
    pub fn client() -> Client<HttpConnector, Full<Bytes>> {
        Client::builder(TokioExecutor::new()).build_http()
    }

    impl Post {
        /// Sends it with `client`; `None` when no complete answer came within `timeout` (the
        /// server died, or the connection broke).
        pub async fn try_send(
            &self,
            client: &Client<HttpConnector, Full<Bytes>>,
            addr: SocketAddr,
            timeout: Duration,
        ) -> Option<Reply> {
            let request = self.request(addr, Full::new(self.body.clone()));
            let exchange = async {
                let response = client.request(request).await.ok()?;
                let (parts, body) = response.into_parts();
                let body = body.collect().await.ok()?.to_bytes();
                Some(Reply {
                    status: parts.status,
                    headers: parts.headers,
                    body,
                })
            };
            tokio::time::timeout(timeout, exchange).await.ok().flatten()
        }
    }

    /// `PRAGMA integrity_check` on the file, from a connection of its own (which also
    /// recovers the WAL of a killed process).
    pub fn integrity_check(db: &Path) -> String {
        let conn = rusqlite::Connection::open(db).expect("open the database");
        conn.query_row("PRAGMA integrity_check", [], |row| row.get(0))
            .expect("integrity_check")
    }

    /// Every `(tenant, key, saved body)` of `create_order`, read from the file directly.
    pub fn saved_records(db: &Path) -> Vec<(String, String, Vec<u8>)> {
        let conn = rusqlite::Connection::open(db).expect("open the database");
        let mut statement = conn
            .prepare(
                "SELECT tenant, idempotency_key, body FROM idempotency_records \
                 WHERE operation = 'create_order' ORDER BY tenant, idempotency_key",
            )
            .expect("prepare");
        let rows = statement
            .query_map([], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))
            .expect("query")
            .collect::<Result<Vec<_>, _>>()
            .expect("records");
        rows
    }

    /// Every order as `(id, tenant_id, sku, quantity)`, read from the file directly.
    pub fn saved_orders(db: &Path) -> Vec<(i64, String, String, i64)> {
        let conn = rusqlite::Connection::open(db).expect("open the database");
        let mut statement = conn
            .prepare("SELECT id, tenant_id, sku, quantity FROM orders ORDER BY id")
            .expect("prepare");
        let rows = statement
            .query_map([], |row| {
                Ok((row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?))
            })
            .expect("query")
            .collect::<Result<Vec<_>, _>>()
            .expect("orders");
        rows
    }

    /// A small deterministic generator (SplitMix64): tests print their seed, so a failing
    /// run can be replayed with `STRESS_SEED=<seed>`.
    #[derive(Clone, Debug)]
    pub struct Rng(u64);

    impl Rng {
        /// From `STRESS_SEED` if set, else from the clock.
        pub fn from_env_or_clock() -> (Rng, u64) {
            let seed = std::env::var("STRESS_SEED")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| {
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map(|d| d.as_nanos() as u64)
                        .unwrap_or(0)
                });
            (Rng(seed), seed)
        }

        pub fn next_u64(&mut self) -> u64 {
            super::splitmix::next_u64(&mut self.0)
        }

        /// Uniform in `0..n` (n > 0).
        pub fn below(&mut self, n: u64) -> u64 {
            self.next_u64() % n
        }

        pub fn shuffle<T>(&mut self, items: &mut [T]) {
            for i in (1..items.len()).rev() {
                let j = self.below(i as u64 + 1) as usize;
                items.swap(i, j);
            }
        }
    }
}

/// A payment provider for steps tests across instances: a charge per step key, however often
/// it is called with that key, and a count of the calls (each call beyond one per key is a
/// foreign step called again). Cloned into every instance's state.
#[derive(Clone, Default)]
pub struct ChargeProvider {
    calls: Arc<AtomicUsize>,
    charges: Arc<std::sync::Mutex<std::collections::BTreeMap<String, String>>>,
}

impl ChargeProvider {
    /// One call with the step's `key`: the charge id this key got, a new one the first time.
    pub fn charge(&self, key: String) -> String {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let mut charges = self
            .charges
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let next = charges.len() + 1;
        charges
            .entry(key)
            .or_insert_with(|| format!("ch_{next}"))
            .clone()
    }

    /// How many calls it got.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}
