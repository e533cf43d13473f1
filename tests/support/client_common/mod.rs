//! Shared setup for the client tests: the order app of `examples/orders.rs` itself
//! ([`apps::orders`](crate::apps::orders)) on a SQLite file of its own, a scripted
//! HTTP server for the retry policy, a loopback TCP proxy that loses or delays responses, and
//! the client under test over hyper-util's client.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::Router;
use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE};
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower::{Layer, ServiceExt};
use tower_idempotency::client::{BufferedBody, Retry, RetryError, RetryLayer, RetryOutcome};
use tower_idempotency::store::sqlite::SqliteStore;
use tower_idempotency::IdempotencyLayer;

pub const SHOP_A: &str = "shop-a-token";
pub const SHOP_B: &str = "shop-b-token";

/// A bound for anything a test waits for; reached only when the test fails.
pub const PATIENCE: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------------------------
// The order app
// ---------------------------------------------------------------------------------------------

use crate::apps::orders::{app_with, idempotency, open_store};

/// The example's order app on 127.0.0.1, over a SQLite file in a temp dir.
pub struct OrdersServer {
    pub addr: SocketAddr,
    pub store: SqliteStore,
    task: JoinHandle<()>,
    _dir: tempfile::TempDir,
}

impl OrdersServer {
    pub async fn spawn() -> OrdersServer {
        Self::spawn_with(|layer| layer).await
    }

    /// With the example's idempotency layer customised (lock timeout, `Retry-After`...).
    pub async fn spawn_with(
        customise: impl FnOnce(IdempotencyLayer<SqliteStore>) -> IdempotencyLayer<SqliteStore>,
    ) -> OrdersServer {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = open_store(&dir.path().join("orders.db"))
            .await
            .expect("open the store");
        let layer = customise(idempotency(store.clone(), false));
        let app = app_with(store.clone(), layer);
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let task = tokio::spawn(serve(listener, app));
        OrdersServer {
            addr,
            store,
            task,
            _dir: dir,
        }
    }

    /// Every order in the database: `(id, tenant, sku)`, by id.
    pub async fn orders(&self) -> Vec<(i64, String, String)> {
        self.store
            .read(|conn| {
                let mut statement =
                    conn.prepare("SELECT id, tenant_id, sku FROM orders ORDER BY id")?;
                let rows = statement
                    .query_map([], |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)))?
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(rows)
            })
            .await
            .expect("read orders")
    }
}

impl Drop for OrdersServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn json(status: StatusCode, body: String) -> Response {
    (status, [(CONTENT_TYPE, "application/json")], body).into_response()
}

// ---------------------------------------------------------------------------------------------
// A scripted server, for the retry policy
// ---------------------------------------------------------------------------------------------

/// One answer of the scripted server.
#[derive(Clone, Debug)]
pub struct Scripted {
    status: StatusCode,
    headers: Vec<(HeaderName, HeaderValue)>,
    hang: bool,
}

impl Scripted {
    pub fn status(status: u16) -> Scripted {
        Scripted {
            status: StatusCode::from_u16(status).expect("status"),
            headers: Vec::new(),
            hang: false,
        }
    }

    /// Never answers (until the client goes away).
    pub fn hang() -> Scripted {
        Scripted {
            hang: true,
            ..Scripted::status(200)
        }
    }

    pub fn header(mut self, name: &'static str, value: &str) -> Scripted {
        self.headers.push((
            HeaderName::from_static(name),
            HeaderValue::from_str(value).expect("header value"),
        ));
        self
    }
}

/// A request as the scripted server received it.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: Method,
    pub keys: Vec<HeaderValue>,
    pub body: Bytes,
    pub at: Instant,
}

#[derive(Default)]
struct Script {
    answers: Mutex<VecDeque<Scripted>>,
    seen: Mutex<Vec<Seen>>,
}

/// Answers every request with the next scripted answer, then `201 {"ok":true}`; records what
/// it received.
pub struct ScriptedServer {
    pub addr: SocketAddr,
    script: Arc<Script>,
    task: JoinHandle<()>,
}

impl ScriptedServer {
    pub async fn spawn(answers: impl IntoIterator<Item = Scripted>) -> ScriptedServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        Self::serve(listener, answers)
    }

    /// Serves on a listener the test bound itself.
    pub fn serve(
        listener: TcpListener,
        answers: impl IntoIterator<Item = Scripted>,
    ) -> ScriptedServer {
        let script = Arc::new(Script {
            answers: Mutex::new(answers.into_iter().collect()),
            seen: Mutex::default(),
        });
        let app = Router::new().fallback(answer).with_state(script.clone());
        let addr = listener.local_addr().expect("local addr");
        let task = tokio::spawn(serve(listener, app));
        ScriptedServer { addr, script, task }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.script.seen.lock().expect("lock").clone()
    }
}

impl Drop for ScriptedServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn answer(State(script): State<Arc<Script>>, request: Request) -> Response {
    let at = Instant::now();
    let (parts, body) = request.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    script.seen.lock().expect("lock").push(Seen {
        method: parts.method,
        keys: parts
            .headers
            .get_all("idempotency-key")
            .iter()
            .cloned()
            .collect(),
        body,
        at,
    });
    let next = script.answers.lock().expect("lock").pop_front();
    match next {
        None => json(StatusCode::CREATED, r#"{"ok":true}"#.into()),
        Some(scripted) if scripted.hang => std::future::pending().await,
        Some(scripted) => {
            let mut response = json(scripted.status, r#"{"scripted":true}"#.into());
            for (name, value) in scripted.headers {
                response.headers_mut().insert(name, value);
            }
            response
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The lossy proxy
// ---------------------------------------------------------------------------------------------

/// What the proxy does with one response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Passes it on.
    Forward,
    /// Closes both connections when the response starts to arrive: the server has committed
    /// (it commits before it answers), the client never sees the answer.
    Drop,
    /// Holds it this long before passing it on.
    Delay(Duration),
}

/// Which fault each response gets, in the order responses arrive.
pub enum Plan {
    /// These faults, then `Forward` for every later response.
    Script(Mutex<VecDeque<Fault>>),
    /// `Drop` with this probability, from a seeded generator.
    Random {
        rng: Mutex<fastrand::Rng>,
        drop_ratio: f64,
    },
}

impl Plan {
    pub fn script(faults: impl IntoIterator<Item = Fault>) -> Plan {
        Plan::Script(Mutex::new(faults.into_iter().collect()))
    }

    pub fn random(seed: u64, drop_ratio: f64) -> Plan {
        Plan::Random {
            rng: Mutex::new(fastrand::Rng::with_seed(seed)),
            drop_ratio,
        }
    }

    fn next(&self) -> Fault {
        match self {
            Plan::Script(faults) => faults
                .lock()
                .expect("lock")
                .pop_front()
                .unwrap_or(Fault::Forward),
            Plan::Random { rng, drop_ratio } => {
                if rng.lock().expect("lock").f64() < *drop_ratio {
                    Fault::Drop
                } else {
                    Fault::Forward
                }
            }
        }
    }
}

#[derive(Default)]
struct Counters {
    responses: AtomicUsize,
    dropped: AtomicUsize,
    delayed: AtomicUsize,
}

/// A TCP proxy on 127.0.0.1 in front of `upstream`, applying a [`Plan`] to each response.
///
/// HTTP/1.1 without pipelining: after the client sent request bytes, the next bytes from the
/// server start the response to it. That is where the fault applies.
pub struct Proxy {
    pub addr: SocketAddr,
    counters: Arc<Counters>,
    task: JoinHandle<()>,
}

impl Proxy {
    pub async fn spawn(upstream: SocketAddr, plan: Plan) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("local addr");
        let counters = Arc::new(Counters::default());
        let plan = Arc::new(plan);
        let task = tokio::spawn({
            let counters = counters.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    tokio::spawn(relay(client, upstream, plan.clone(), counters.clone()));
                }
            }
        });
        Proxy {
            addr,
            counters,
            task,
        }
    }

    /// How many responses started to come back from the server.
    pub fn responses(&self) -> usize {
        self.counters.responses.load(Ordering::SeqCst)
    }

    pub fn dropped(&self) -> usize {
        self.counters.dropped.load(Ordering::SeqCst)
    }

    pub fn delayed(&self) -> usize {
        self.counters.delayed.load(Ordering::SeqCst)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(client: TcpStream, upstream: SocketAddr, plan: Arc<Plan>, counters: Arc<Counters>) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let mut up = vec![0u8; 16 * 1024];
    let mut down = vec![0u8; 16 * 1024];
    let mut client_open = true;
    // Request bytes went up since the last response started: the next bytes down start one.
    let mut awaiting_response = false;
    loop {
        tokio::select! {
            read = client_read.read(&mut up), if client_open => match read {
                Ok(0) | Err(_) => {
                    client_open = false;
                    let _ = server_write.shutdown().await;
                }
                Ok(n) => {
                    if server_write.write_all(&up[..n]).await.is_err() {
                        return;
                    }
                    awaiting_response = true;
                }
            },
            read = server_read.read(&mut down) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if awaiting_response {
                        awaiting_response = false;
                        counters.responses.fetch_add(1, Ordering::SeqCst);
                        match plan.next() {
                            Fault::Forward => {}
                            Fault::Drop => {
                                counters.dropped.fetch_add(1, Ordering::SeqCst);
                                // Returning drops both connections.
                                return;
                            }
                            Fault::Delay(delay) => {
                                counters.delayed.fetch_add(1, Ordering::SeqCst);
                                tokio::time::sleep(delay).await;
                            }
                        }
                    }
                    if client_write.write_all(&down[..n]).await.is_err() {
                        return;
                    }
                }
            },
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The client under test
// ---------------------------------------------------------------------------------------------

pub type HttpClient = Client<HttpConnector, BufferedBody>;

/// The retry layer over hyper-util's client, with test-sized waits unless `layer` says
/// otherwise.
pub fn client(layer: RetryLayer) -> Retry<HttpClient> {
    layer.layer(Client::builder(TokioExecutor::new()).build_http::<BufferedBody>())
}

/// Quick backoff, so that retries do not slow the tests down.
pub fn fast() -> RetryLayer {
    RetryLayer::new()
        .with_initial_backoff(Duration::from_millis(2))
        .with_max_backoff(Duration::from_millis(20))
}

/// A response as the caller saw it, with its outcome.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub outcome: RetryOutcome,
}

impl Answer {
    pub fn order_id(&self) -> i64 {
        let value: serde_json::Value = serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.body));
        value["order_id"]
            .as_i64()
            .unwrap_or_else(|| panic!("no order_id in {:?}", self.body))
    }

    pub fn key(&self) -> &str {
        self.outcome
            .key
            .as_ref()
            .and_then(|key| key.to_str().ok())
            .expect("a key")
    }
}

/// Sends one request through the client and reads the whole answer.
pub async fn send<B>(
    client: &Retry<HttpClient>,
    request: http::Request<B>,
) -> Result<Answer, RetryError>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let response = tokio::time::timeout(PATIENCE, client.clone().oneshot(request))
        .await
        .expect("the client answered within the test's patience")?;
    let (parts, body) = response.into_parts();
    let outcome = parts
        .extensions
        .get::<RetryOutcome>()
        .cloned()
        .expect("every response carries a RetryOutcome");
    let body = body.collect().await.expect("response body").to_bytes();
    Ok(Answer {
        status: parts.status,
        headers: parts.headers,
        body,
        outcome,
    })
}

/// `POST {url}` with a JSON order as the given tenant, without a key (the client adds one).
pub fn order_request(url: &str, token: &str, sku: &str) -> http::Request<Full<Bytes>> {
    http::Request::post(url)
        .header(AUTHORIZATION, format!("Bearer {token}"))
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(format!(
            r#"{{"sku":"{sku}","quantity":1}}"#
        ))))
        .expect("request")
}

/// A request body that arrives in several frames, as a streamed upload would.
pub struct Chunks(pub VecDeque<Bytes>);

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.get_mut().0.pop_front().map(|c| Ok(Frame::data(c))))
    }
}

/// Serves `app` on `listener` until the task is aborted.
async fn serve(listener: TcpListener, app: Router) {
    axum::serve(listener, app).await.expect("serve");
}
