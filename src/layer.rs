//! [`IdempotencyLayer`]: the configuration, and the [`Layer`] that wraps a service.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header::{self, HeaderName};
use http::{request, Method, Response, StatusCode};
use tokio::time::Instant;
use tower_layer::Layer;

use crate::error::{default_error_response, Rejection};
use crate::fingerprint::Fingerprinter;
use crate::in_flight::{InFlight, Running};
use crate::key::{KeyExtractor, DEFAULT_MAX_KEY_LEN};
use crate::problem::ProblemDetails;
use crate::response::is_never_replayed;
use crate::service::Idempotency;

/// The authenticated tenant of a request.
///
/// The default tenant extractor reads this value from the request extensions, where your
/// authentication layer puts it. It is never taken from a header the client picks.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Tenant(Arc<str>);

impl Tenant {
    /// A tenant with this identifier.
    pub fn new(id: impl Into<Arc<str>>) -> Self {
        Tenant(id.into())
    }

    /// The identifier.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

type TenantFn = dyn Fn(&request::Parts) -> Option<Arc<str>> + Send + Sync;
type SaveFn = dyn Fn(StatusCode) -> bool + Send + Sync;
type GrpcSaveFn = dyn Fn(i32) -> bool + Send + Sync;
type FilterFn = dyn Fn(&request::Parts) -> bool + Send + Sync;
type ResponderFn = dyn Fn(&Rejection, StatusCode) -> Response<Bytes> + Send + Sync;

/// The longest retention: 100 years of 365 days. A longer one (`Duration::MAX` for "forever") is
/// clamped to it, so that an expiry is always a time the clock and the stores can represent.
pub(crate) const MAX_RETENTION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The longest body and lock timeouts: 24 hours. Longer ones are clamped to it, so that a
/// deadline never overflows the clock, and the lock timeout stays within what PostgreSQL's
/// `lock_timeout` accepts (about 24.8 days).
pub(crate) const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// What the layer's error bodies are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ErrorFormat {
    /// `{"error": code}` (the default).
    Json,
    /// RFC 9457 problem details.
    Problem,
    /// A responder of the application's own.
    Custom,
}

/// The configuration shared by every clone of the layer and its services.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) operation: Option<Arc<str>>,
    pub(crate) key_required: bool,
    pub(crate) key_extractor: KeyExtractor,
    pub(crate) max_key_len: usize,
    pub(crate) methods: Vec<Method>,
    pub(crate) filter: Option<Arc<FilterFn>>,
    pub(crate) tenant: Arc<TenantFn>,
    pub(crate) body_limit: usize,
    pub(crate) drain_limit: usize,
    pub(crate) body_timeout: Duration,
    pub(crate) response_limit: usize,
    pub(crate) fingerprinter: Fingerprinter,
    pub(crate) lock_timeout: Duration,
    pub(crate) conflict_retries: u32,
    pub(crate) retry_after: Duration,
    pub(crate) retention: Duration,
    pub(crate) conflict_status: StatusCode,
    pub(crate) save: Arc<SaveFn>,
    pub(crate) grpc_save: Arc<GrpcSaveFn>,
    pub(crate) replayed_headers: Vec<HeaderName>,
    pub(crate) replayed_trailers: Vec<HeaderName>,
    pub(crate) error_responder: Arc<ResponderFn>,
    pub(crate) in_flight: InFlight,
    /// What the error responder writes (for the OpenAPI description).
    #[cfg_attr(not(feature = "utoipa"), allow(dead_code))]
    pub(crate) error_format: ErrorFormat,
    /// The scopes this layer's requests are running (for the in-flight policy).
    pub(crate) running: Arc<Running>,
    /// The steps mode ([`IdempotencyLayer::with_steps`]), if on.
    pub(crate) steps: Option<crate::steps::mode::StepsMode>,
    /// The keys of the operation's metrics, made at its first request.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) metric_keys: crate::metrics::Keys,
    /// Whether a handler's plain `Tx` on a request this layer passed through was logged.
    #[cfg(feature = "axum")]
    pub(crate) passed_through_logged: crate::extract::LoggedOnce,
}

/// The longest operation name, in bytes: the MySQL and MariaDB table's `VARBINARY(255)`
/// column (SQLite's and PostgreSQL's `TEXT` hold more, PostgreSQL's primary key index up to
/// about 2700 bytes of tenant, operation and key together). One bound on every store, so that
/// a route that works on one works on all. See
/// [`IdempotencyLayer::with_operation`].
pub const MAX_OPERATION_LEN: usize = 255;

impl Config {
    /// The status the layer answers a rejection with.
    pub(crate) fn status_of(&self, rejection: &Rejection) -> StatusCode {
        match rejection {
            Rejection::KeyReused => self.conflict_status,
            Rejection::InFlight => StatusCode::CONFLICT,
            other => other.status(),
        }
    }

    /// When a record saved at `now` expires. The retention is clamped to [`MAX_RETENTION`]
    /// when set; this saturates anyway, so that no setting can panic a request.
    pub(crate) fn expires_at(&self, now: SystemTime) -> SystemTime {
        now.checked_add(self.retention)
            .or_else(|| now.checked_add(MAX_RETENTION))
            // Only on a clock a century from its end: expire at once rather than panic.
            .unwrap_or(now)
    }

    /// The deadline of a request body that starts arriving now (saturating, like
    /// [`Config::expires_at`]).
    pub(crate) fn body_deadline(&self) -> Instant {
        let now = Instant::now();
        now.checked_add(self.body_timeout)
            .or_else(|| now.checked_add(MAX_TIMEOUT))
            .unwrap_or(now)
    }
}

/// The default tenant extractor: the [`Tenant`] in the request extensions.
fn tenant_from_extensions(parts: &request::Parts) -> Option<Arc<str>> {
    parts.extensions.get::<Tenant>().map(|t| t.0.clone())
}

/// A [`Layer`] that makes a route idempotent per `Idempotency-Key`, with its records in `St`.
///
/// Cheap to clone: the configuration sits behind an `Arc`. Every `with_*` setter documents its
/// default.
///
/// ```no_run
/// # async fn run() -> Result<(), tower_idempotency::Error> {
/// use std::time::Duration;
/// use tower_idempotency::{IdempotencyLayer, store::sqlite::SqliteStore};
///
/// let store = SqliteStore::open("orders.db").await?;
/// let layer = IdempotencyLayer::new(store)
///     .with_operation("create_order")
///     .with_body_limit(64 * 1024)
///     .with_retention(Duration::from_secs(48 * 3600));
/// # let _ = layer; Ok(()) }
/// ```
pub struct IdempotencyLayer<St> {
    store: St,
    config: Arc<Config>,
}

impl<St: Clone> Clone for IdempotencyLayer<St> {
    fn clone(&self) -> Self {
        IdempotencyLayer {
            store: self.store.clone(),
            config: self.config.clone(),
        }
    }
}

impl<St: fmt::Debug> fmt::Debug for IdempotencyLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("store", &self.store)
            .field("operation", &self.config.operation)
            .field("key_required", &self.config.key_required)
            .field("methods", &self.config.methods)
            .field("body_limit", &self.config.body_limit)
            .field("lock_timeout", &self.config.lock_timeout)
            .field("retention", &self.config.retention)
            .finish_non_exhaustive()
    }
}

impl<St> IdempotencyLayer<St> {
    /// A layer storing its records in `store`, with the defaults listed on each setter.
    pub fn new(store: St) -> Self {
        IdempotencyLayer {
            store,
            config: Arc::new(Config {
                operation: None,
                key_required: true,
                key_extractor: KeyExtractor::default(),
                max_key_len: DEFAULT_MAX_KEY_LEN,
                methods: vec![Method::POST, Method::PATCH],
                filter: None,
                tenant: Arc::new(tenant_from_extensions),
                body_limit: 1024 * 1024,
                drain_limit: 8 * 1024 * 1024,
                body_timeout: Duration::from_secs(30),
                response_limit: 1024 * 1024,
                fingerprinter: Fingerprinter::default(),
                lock_timeout: Duration::from_secs(5),
                conflict_retries: 3,
                retry_after: Duration::from_secs(1),
                retention: Duration::from_secs(24 * 3600),
                conflict_status: StatusCode::CONFLICT,
                save: Arc::new(|status: StatusCode| status.is_success()),
                grpc_save: Arc::new(|code: i32| code == 0),
                replayed_headers: vec![header::LOCATION, header::CONTENT_TYPE],
                replayed_trailers: vec![
                    HeaderName::from_static("grpc-status"),
                    HeaderName::from_static("grpc-message"),
                    HeaderName::from_static("grpc-status-details-bin"),
                ],
                error_responder: Arc::new(default_error_response),
                in_flight: InFlight::Wait,
                error_format: ErrorFormat::Json,
                running: Arc::default(),
                steps: None,
                metric_keys: Default::default(),
                #[cfg(feature = "axum")]
                passed_through_logged: Default::default(),
            }),
        }
    }

    /// The IETF draft's answers in one switch: the layer's own answers as RFC 9457 problem
    /// details ([`ProblemDetails::default`], with `Link: <...>; rel="describedby"` on those
    /// about the key), `422` for a key reused with another payload, and `409` with
    /// `Retry-After` at once for a duplicate of a request still running
    /// ([`InFlight::Reject`]). Setters called after it override each part: the answers the
    /// draft `draft-ietf-httpapi-idempotency-key-header` describes.
    ///
    /// ```
    /// # fn example(store: ()) {
    /// use tower_idempotency::{problem::ProblemDetails, IdempotencyLayer};
    ///
    /// let layer = IdempotencyLayer::new(store)
    ///     .with_ietf_draft()
    ///     .with_operation("create_order")
    ///     .with_problem_details(ProblemDetails::new("https://developer.example.com/idempotency"));
    /// # }
    /// ```
    pub fn with_ietf_draft(self) -> Self {
        self.with_problem_details(ProblemDetails::default())
            .with_conflict_status(StatusCode::UNPROCESSABLE_ENTITY)
            .with_in_flight(InFlight::Reject)
    }

    #[cfg(feature = "utoipa")]
    pub(crate) fn config(&self) -> &Config {
        &self.config
    }

    fn map_config(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// The operation name: records are scoped by `(tenant, operation, key)`, so the same key
    /// sent to two operations is two independent requests.
    ///
    /// Default: the request's path, as the client sent it (without the query): `/orders/1/cancel`
    /// and `/orders/2/cancel` are two operations, and a key sent to both is two independent
    /// requests. Name it explicitly (`"create_order"`) so that records survive a change of
    /// route, and so that the layer's [metrics](crate::metrics) are labelled with it: a layer
    /// without a name labels them all `operation="(unnamed)"`, never with a path a client
    /// picks.
    ///
    /// An operation is at most [`MAX_OPERATION_LEN`] bytes (255), what every store's table
    /// holds. Without a name, a request whose path is longer is answered `414`
    /// `{"error":"operation_too_long"}` ([`Rejection::OperationTooLong`]): nothing stored,
    /// handler not run.
    ///
    /// # Panics
    ///
    /// If `operation` is longer than [`MAX_OPERATION_LEN`] bytes: no request could be stored
    /// under it.
    ///
    /// ```
    /// # let store = ();
    /// use tower_idempotency::IdempotencyLayer;
    ///
    /// let layer = IdempotencyLayer::new(store).with_operation("create_order");
    /// ```
    pub fn with_operation(self, operation: impl Into<Arc<str>>) -> Self {
        let operation = operation.into();
        assert!(
            operation.len() <= MAX_OPERATION_LEN,
            "the operation name is {} bytes long; at most {MAX_OPERATION_LEN} fit the stores' \
             tables",
            operation.len()
        );
        self.map_config(|c| c.operation = Some(operation))
    }

    /// Whether a request without `Idempotency-Key` is refused (`400`, the default) or passed
    /// through to the inner service untouched (`false`).
    ///
    /// A request passed through gets no record and **no transaction handle**: the handler
    /// runs as without the layer, once per request. A handler that serves both kinds takes
    /// [`Option<Tx<H>>`](crate::extract::Tx) (feature `axum`): `Some` with a key, `None`
    /// without, when it writes through your own pool or connection, without idempotency. A
    /// handler that takes a plain `Tx<H>` cannot run without a transaction: a request without
    /// a key is answered `500` `{"error":"idempotency_layer_missing"}` (a server-side
    /// configuration error, not the client's), and the first such request is logged at error
    /// level with this fix. Outside axum, the handle is absent from the request extensions.
    ///
    /// ```no_run
    /// use axum::{routing::post, Router};
    /// use tower_idempotency::{extract::Tx, store::sqlite::{SqliteHandle, SqliteStore}};
    /// use tower_idempotency::IdempotencyLayer;
    ///
    /// async fn add_note(tx: Option<Tx<SqliteHandle>>) -> &'static str {
    ///     match tx {
    ///         Some(Tx(_tx)) => "once per key: written through the request's transaction",
    ///         None => "no key: written as without the layer",
    ///     }
    /// }
    ///
    /// # async fn run() -> Result<(), tower_idempotency::Error> {
    /// let store = SqliteStore::open("notes.db").await?;
    /// let layer = IdempotencyLayer::new(store)
    ///     .with_operation("add_note")
    ///     .with_key_required(false);
    /// let app: Router = Router::new().route("/notes", post(add_note).layer(layer));
    /// # let _ = app; Ok(()) }
    /// ```
    pub fn with_key_required(self, required: bool) -> Self {
        self.map_config(|c| c.key_required = required)
    }

    /// Where the key is: another header, a member of the JSON body, or a function of your own
    /// (see [`KeyExtractor`]). Default: the `Idempotency-Key` header.
    ///
    /// ```
    /// # fn example(layer: tower_idempotency::IdempotencyLayer<()>) {
    /// use tower_idempotency::key::KeyExtractor;
    ///
    /// // A webhook receiver: the sender's event id is the key.
    /// let layer = layer.with_key_extractor(KeyExtractor::json_pointer("/id"));
    /// # }
    /// ```
    pub fn with_key_extractor(self, extractor: KeyExtractor) -> Self {
        self.map_config(|c| c.key_extractor = extractor)
    }

    /// The longest key accepted, in bytes. Default: 128; Stripe and most peers accept 255.
    ///
    /// ```
    /// # fn example(layer: tower_idempotency::IdempotencyLayer<()>) {
    /// let layer = layer.with_max_key_len(255);
    /// # }
    /// ```
    pub fn with_max_key_len(self, max: usize) -> Self {
        self.map_config(|c| c.max_key_len = max.max(1))
    }

    /// The methods the layer handles; requests with other methods pass through untouched.
    ///
    /// Default: `POST` and `PATCH` (the methods that are not idempotent by themselves).
    pub fn with_methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.map_config(|c| c.methods = methods)
    }

    /// Which requests (of the handled methods) the layer handles; the others pass through
    /// untouched. Default: all of them.
    ///
    /// Useful where the layer wraps more than one route, such as a tonic server whose
    /// streaming RPCs must pass through (a stream cannot be replayed from a bounded buffer):
    ///
    /// ```
    /// # fn example(layer: tower_idempotency::IdempotencyLayer<()>) {
    /// let layer = layer.with_filter(|parts| parts.uri.path() == "/orders.Orders/CreateOrder");
    /// # }
    /// ```
    pub fn with_filter<F>(self, filter: F) -> Self
    where
        F: Fn(&request::Parts) -> bool + Send + Sync + 'static,
    {
        self.map_config(|c| c.filter = Some(Arc::new(filter)))
    }

    /// How the tenant of a request is found. Return `None` for an unauthenticated request
    /// (answered `401`).
    ///
    /// Default: the [`Tenant`] an authentication layer put in the request extensions.
    ///
    /// ```
    /// # fn example(layer: tower_idempotency::IdempotencyLayer<()>) {
    /// #[derive(Clone)]
    /// struct User { account: String }
    ///
    /// let layer = layer.with_tenant_extractor(|parts| {
    ///     parts.extensions.get::<User>().map(|user| user.account.as_str().into())
    /// });
    /// # }
    /// ```
    pub fn with_tenant_extractor<F>(self, extractor: F) -> Self
    where
        F: Fn(&request::Parts) -> Option<Arc<str>> + Send + Sync + 'static,
    {
        self.map_config(|c| c.tenant = Arc::new(extractor))
    }

    /// The largest request body accepted, in bytes (`413` past it, with or without
    /// `Content-Length`). Default: 1 MiB.
    pub fn with_body_limit(self, limit: usize) -> Self {
        self.map_config(|c| c.body_limit = limit)
    }

    /// After refusing a body as too large, the layer reads and discards up to this many bytes
    /// in all so that the client, still sending, receives the `413` instead of a connection
    /// reset. Default: 8 MiB. `0` answers at once.
    pub fn with_drain_limit(self, limit: usize) -> Self {
        self.map_config(|c| c.drain_limit = limit)
    }

    /// How long the whole request body may take to arrive (`408` past it). The write lock is
    /// not held while the body arrives. Default: 30 s. At most 24 hours: a longer timeout
    /// (`Duration::MAX` included) is clamped to that.
    pub fn with_body_timeout(self, timeout: Duration) -> Self {
        self.map_config(|c| c.body_timeout = timeout.min(MAX_TIMEOUT))
    }

    /// The largest response body that is saved. A saveable response past it is rolled back
    /// and answered `500`, since it could not be replayed. Default: 1 MiB.
    pub fn with_response_limit(self, limit: usize) -> Self {
        self.map_config(|c| c.response_limit = limit)
    }

    /// How the request is fingerprinted. Default: [`Fingerprinter::auto`] (canonical JSON for
    /// JSON bodies, raw bytes otherwise).
    pub fn with_fingerprinter(self, fingerprinter: Fingerprinter) -> Self {
        self.map_config(|c| c.fingerprinter = fingerprinter)
    }

    /// How long a request waits for the write lock: behind a duplicate in flight, other
    /// requests, or another process. Past it: `503` with `Retry-After`. Default: 5 s. At most
    /// 24 hours: a longer timeout (`Duration::MAX` included) is clamped to that.
    pub fn with_lock_timeout(self, timeout: Duration) -> Self {
        self.map_config(|c| c.lock_timeout = timeout.min(MAX_TIMEOUT))
    }

    /// How many times the request runs again (handler included, in a fresh transaction) when
    /// its commit, or one of the handler's statements run through the transaction handle,
    /// fails with a serialization failure or a deadlock that the database rolled back
    /// (PostgreSQL `40001`, `40P01`; SQLite never reports one). In steps mode, how many times
    /// the handler runs again under its claim when a local step's transaction was thrown away
    /// so (never while a foreign step it called has no saved result). Past it: `503` with
    /// `Retry-After`. Each run again counts in
    /// `idempotency_handler_rollbacks_total{reason="rerun"}`. Default: 3.
    pub fn with_conflict_retries(self, retries: u32) -> Self {
        self.map_config(|c| c.conflict_retries = retries)
    }

    /// The `Retry-After` sent with `503`, and with the `409` of a request in flight
    /// ([`with_in_flight`](Self::with_in_flight)). Default: 1 s.
    pub fn with_retry_after(self, delay: Duration) -> Self {
        self.map_config(|c| c.retry_after = delay)
    }

    /// How long a record is kept and replayed. It must cover your clients' retry window; an
    /// expired record counts as absent. Default: 24 h. At most 100 years (of 365 days): a longer
    /// retention (`Duration::MAX` for "keep forever") is clamped to that.
    ///
    /// ```
    /// # fn example(layer: tower_idempotency::IdempotencyLayer<()>) {
    /// use std::time::Duration;
    ///
    /// let layer = layer.with_retention(Duration::from_secs(7 * 24 * 3600));
    /// # }
    /// ```
    pub fn with_retention(self, retention: Duration) -> Self {
        self.map_config(|c| c.retention = retention.min(MAX_RETENTION))
    }

    /// The status for a key reused with a different payload. Default: `409 Conflict`; the IETF
    /// draft uses `422 Unprocessable Content`.
    pub fn with_conflict_status(self, status: StatusCode) -> Self {
        self.map_config(|c| c.conflict_status = status)
    }

    /// Which responses are saved (and their transaction committed). Anything else is rolled
    /// back, so the same key can be retried, for example with a corrected payload.
    ///
    /// Default: 2xx only.
    ///
    /// ```
    /// # fn example(layer: tower_idempotency::IdempotencyLayer<()>) {
    /// // Also keep "422: this order can never be placed" as the final answer for the key.
    /// let layer = layer.with_save_policy(|status| status.is_success() || status.as_u16() == 422);
    /// # }
    /// ```
    pub fn with_save_policy<F>(self, policy: F) -> Self
    where
        F: Fn(StatusCode) -> bool + Send + Sync + 'static,
    {
        self.map_config(|c| c.save = Arc::new(policy))
    }

    /// Which gRPC responses are saved, by their `grpc-status` (a gRPC response is HTTP `200`
    /// whatever its outcome, so its trailers decide). A response without `grpc-status` is never
    /// saved. Applies to responses with `content-type: application/grpc`; the HTTP
    /// [save policy](Self::with_save_policy) must also accept their status (`200`).
    ///
    /// Default: `0` (`OK`) only.
    pub fn with_grpc_save_policy<F>(self, policy: F) -> Self
    where
        F: Fn(i32) -> bool + Send + Sync + 'static,
    {
        self.map_config(|c| c.grpc_save = Arc::new(policy))
    }

    /// Adds a response header to save and replay. `Location` and `Content-Type` always are;
    /// `Set-Cookie`, `Content-Length` and hop-by-hop headers never are, whatever is added here.
    ///
    /// Default: `Location` and `Content-Type` only.
    pub fn with_replayed_header(self, name: HeaderName) -> Self {
        self.map_config(|c| {
            if !is_never_replayed(&name) && !c.replayed_headers.contains(&name) {
                c.replayed_headers.push(name);
            }
        })
    }

    /// Adds a response trailer to save and replay. `grpc-status`, `grpc-message` and
    /// `grpc-status-details-bin` always are.
    ///
    /// Default: those three only.
    pub fn with_replayed_trailer(self, name: HeaderName) -> Self {
        self.map_config(|c| {
            if !c.replayed_trailers.contains(&name) {
                c.replayed_trailers.push(name);
            }
        })
    }

    /// Replaces the error responses the layer writes itself (its own 400, 401, 408, 409, 413,
    /// 500 and 503). The function gets the rejection and the status the layer chose.
    /// `Retry-After` is added to `503` answers if the function does not set it.
    ///
    /// Default: `{"error":"<code>"}` as `application/json`.
    pub fn with_error_responder<F>(self, responder: F) -> Self
    where
        F: Fn(&Rejection, StatusCode) -> Response<Bytes> + Send + Sync + 'static,
    {
        self.map_config(|c| {
            c.error_responder = Arc::new(responder);
            c.error_format = ErrorFormat::Custom;
        })
    }

    /// Writes the layer's own answers as RFC 9457 problem details
    /// (`application/problem+json`), with the types documented where `problems` says. The
    /// statuses stay as configured ([`with_ietf_draft`](Self::with_ietf_draft) also sets the draft's).
    ///
    /// Default: `{"error":"<code>"}` as `application/json`.
    pub fn with_problem_details(self, problems: ProblemDetails) -> Self {
        self.with_error_responder(move |rejection, status| problems.response(rejection, status))
            .map_config(|c| c.error_format = ErrorFormat::Problem)
    }

    /// What a request gets while another with the same `(tenant, operation, key)` is still
    /// running: wait for it, `409` at once, or wait up to a bound then `409` (the `409`s with
    /// `Retry-After`, see [`with_retry_after`](Self::with_retry_after)).
    ///
    /// Default: [`InFlight::Wait`] (up to the lock timeout). A bound of [`InFlight::WaitUpTo`]
    /// is clamped to 24 hours. The policy also holds for a duplicate of a request running on
    /// another instance on the PostgreSQL and MySQL stores (see [`InFlight`]).
    ///
    /// ```
    /// # fn example(layer: tower_idempotency::IdempotencyLayer<()>) {
    /// use std::time::Duration;
    /// use tower_idempotency::InFlight;
    ///
    /// let layer = layer.with_in_flight(InFlight::WaitUpTo(Duration::from_millis(500)));
    /// # }
    /// ```
    pub fn with_in_flight(self, policy: InFlight) -> Self {
        let policy = match policy {
            InFlight::WaitUpTo(bound) => InFlight::WaitUpTo(bound.min(MAX_TIMEOUT)),
            other => other,
        };
        self.map_config(|c| c.in_flight = policy)
    }
}

impl<St: crate::steps::StepStore> IdempotencyLayer<St> {
    /// Runs the route step by step ([`steps`](crate::steps)): the handler gets a
    /// [`Steps`](crate::steps::Steps) handle instead of one transaction, each step commits on
    /// its own, and a retry (or the [`Completer`](crate::steps::Completer)) resumes after the
    /// last step that finished. For a handler that calls another service between its writes.
    ///
    /// The store's step tables must exist ([`StepStore::install_steps`](crate::steps::StepStore::install_steps)).
    /// The lease is [`with_step_lease`](Self::with_step_lease)'s (default 30 s).
    pub fn with_steps(self) -> Self {
        let lease = self
            .config
            .steps
            .as_ref()
            .map_or(DEFAULT_STEP_LEASE, |mode| mode.lease);
        let claimer = Arc::new(crate::steps::mode::StoreClaimer(self.store.clone()));
        self.map_config(|c| {
            c.steps = Some(crate::steps::mode::StepsMode { lease, claimer });
        })
    }

    /// How long a step-by-step request holds its key without committing a step: past it, a
    /// retry or the completer may take the key over, and this request's later commits are
    /// refused. A foreign call is cut off before the lease ends. Default 30 s; it only matters
    /// with [`with_steps`](Self::with_steps) (it turns the mode on).
    pub fn with_step_lease(self, lease: Duration) -> Self {
        let lease = lease.clamp(Duration::from_secs(1), MAX_TIMEOUT);
        let claimer = Arc::new(crate::steps::mode::StoreClaimer(self.store.clone()));
        self.map_config(|c| {
            c.steps = Some(crate::steps::mode::StepsMode { lease, claimer });
        })
    }

    /// The completer of this route: resumes keys that were left part-way (see
    /// [`Completer`](crate::steps::Completer)) by calling `handler`, the route's service
    /// without this layer, as the layer would. It resumes this layer's operation's keys only.
    ///
    /// # Panics
    ///
    /// If the layer has no [`with_operation`](Self::with_operation): its operation is then
    /// each request's path, and a completer could not tell this route's keys from another
    /// route's (it would run their requests through this handler).
    pub fn completer<S>(&self, handler: S) -> crate::steps::Completer<St, S> {
        let Some(operation) = self.config.operation.clone() else {
            panic!(
                "IdempotencyLayer::completer needs the layer's operation: set it with \
                 with_operation, so that the completer resumes this route's keys only"
            );
        };
        crate::steps::Completer::new(self.store.clone(), self.config.clone(), operation, handler)
    }
}

/// [`IdempotencyLayer::with_step_lease`]'s default.
const DEFAULT_STEP_LEASE: Duration = Duration::from_secs(30);

impl<S, St: Clone> Layer<S> for IdempotencyLayer<St> {
    type Service = Idempotency<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::from_parts(inner, self.store.clone(), self.config.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(layer: &IdempotencyLayer<()>) -> &Config {
        &layer.config
    }

    #[test]
    fn durations_past_their_maximum_are_clamped() {
        let near_max = Duration::MAX - Duration::from_nanos(1);
        for huge in [Duration::MAX, near_max, Duration::from_secs(u64::MAX)] {
            let layer = IdempotencyLayer::new(())
                .with_retention(huge)
                .with_body_timeout(huge)
                .with_lock_timeout(huge);
            assert_eq!(config(&layer).retention, MAX_RETENTION);
            assert_eq!(config(&layer).body_timeout, MAX_TIMEOUT);
            assert_eq!(config(&layer).lock_timeout, MAX_TIMEOUT);
        }
        // Values within the maximum are kept as given.
        let layer = IdempotencyLayer::new(())
            .with_retention(MAX_RETENTION)
            .with_body_timeout(Duration::from_secs(3))
            .with_lock_timeout(Duration::ZERO);
        assert_eq!(config(&layer).retention, MAX_RETENTION);
        assert_eq!(config(&layer).body_timeout, Duration::from_secs(3));
        assert_eq!(config(&layer).lock_timeout, Duration::ZERO);
        // PostgreSQL's `lock_timeout` takes milliseconds up to `i32::MAX`.
        assert!(MAX_TIMEOUT.as_millis() < i32::MAX as u128);
    }

    #[test]
    fn expiry_and_deadlines_saturate_whatever_the_config_holds() {
        let now = SystemTime::now();
        let layer = IdempotencyLayer::new(()).with_retention(Duration::MAX);
        assert_eq!(config(&layer).expires_at(now), now + MAX_RETENTION);
        // Even a configuration that bypassed the setters cannot overflow.
        let layer = IdempotencyLayer::new(()).map_config(|c| {
            c.retention = Duration::MAX;
            c.body_timeout = Duration::MAX;
        });
        assert_eq!(config(&layer).expires_at(now), now + MAX_RETENTION);
        let before = Instant::now();
        let deadline = config(&layer).body_deadline();
        assert!(deadline >= before + MAX_TIMEOUT);
        assert!(deadline <= Instant::now() + MAX_TIMEOUT);
        // The default is unchanged.
        let layer = IdempotencyLayer::new(());
        assert_eq!(
            config(&layer).expires_at(now),
            now + Duration::from_secs(24 * 3600)
        );
    }
}
