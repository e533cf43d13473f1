//! [`Idempotency`]: the request flow of the layer, and its [`ResponseFuture`].

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderName};
use http::{request, HeaderMap, HeaderValue, Request, Response, Version};
use http_body::Body;
use http_body_util::BodyExt;
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower_service::Service;
use tracing::Instrument;

use crate::body::{BoxError, RequestBody, ResponseBody};
use crate::error::{Error, Rejection};
use crate::layer::{Config, IdempotencyLayer};
use crate::metrics::{self, Outcome, RollbackReason};
use crate::response::{select_headers, SavedResponse};
use crate::store::{IdempotencyStore, NewRecord, Reservation, RunOutcome, Scope, StoredRecord};

// What lives where: the flow of a request (this file), its two phases as one future
// (`phases`), one run of the handler in the reserved transaction (`attempt`), reading request
// and response bodies (`read`), gRPC (`grpc`).
mod attempt;
mod grpc;
mod phases;
mod read;
pub(crate) mod steps;

use attempt::*;
use grpc::*;
use read::*;

/// The header carrying the client's key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The service made by [`IdempotencyLayer`]: runs the inner service at most once per
/// `(tenant, operation, key)` and replays its saved response to every retry.
pub struct Idempotency<S, St> {
    inner: S,
    store: St,
    config: Arc<Config>,
}

impl<S: Clone, St: Clone> Clone for Idempotency<S, St> {
    fn clone(&self) -> Self {
        Idempotency {
            inner: self.inner.clone(),
            store: self.store.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: fmt::Debug, St: fmt::Debug> fmt::Debug for Idempotency<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("store", &self.store)
            .field("operation", &self.config.operation)
            .finish_non_exhaustive()
    }
}

impl<S, St> Idempotency<S, St> {
    /// Wraps `inner` with the default configuration of [`IdempotencyLayer::new`].
    pub fn new(inner: S, store: St) -> Self
    where
        St: Clone,
    {
        tower_layer::Layer::layer(&IdempotencyLayer::new(store), inner)
    }

    /// A layer that wraps services with this store; see [`IdempotencyLayer`].
    pub fn layer(store: St) -> IdempotencyLayer<St> {
        IdempotencyLayer::new(store)
    }

    pub(crate) fn from_parts(inner: S, store: St, config: Arc<Config>) -> Self {
        Idempotency {
            inner,
            store,
            config,
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

type BoxedResponse<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

/// The future returned by [`Idempotency`].
///
/// A boxed `async` flow rather than a hand-written state machine: the flow awaits the body,
/// the store (several times) and the inner service, and a boxed future keeps it readable and
/// lets every early exit drop the transaction (which rolls it back) without extra states.
pub struct ResponseFuture<B, E> {
    inner: BoxedResponse<B, E>,
}

impl<B, E> fmt::Debug for ResponseFuture<B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<B, E> Future for ResponseFuture<B, E> {
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<S, St, ReqB, ResB> Service<Request<ReqB>> for Idempotency<S, St>
where
    S: Service<Request<RequestBody>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: IdempotencyStore,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + 'static,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        let (parts, body) = request.into_parts();
        let handled = self.config.methods.contains(&parts.method)
            && self
                .config
                .filter
                .as_ref()
                .is_none_or(|filter| filter(&parts));
        // A key in a header is known before the body; one in the body only after it.
        let key_headers = (self.config.key_extractor.header_name())
            .map(|name| parts.headers.get_all(name).iter().count());
        let request = Request::from_parts(parts, body);
        if !handled || (key_headers == Some(0) && !self.config.key_required) {
            // Marked, so that `Option<Tx>` is `None` for it and a plain `Tx` says why it has
            // no transaction (not as on a route without the layer).
            #[cfg(feature = "axum")]
            let request = crate::extract::PassedThrough::mark(request, handled, &self.config);
            // Passed through: the ready instance is called at once, as without the layer.
            let call = self.inner.call(request.map(RequestBody::streaming));
            return ResponseFuture {
                inner: Box::pin(async move { Ok(call.await?.map(ResponseBody::inner)) }),
            };
        }
        // The flow owns the service it calls (lent to the store's work, perhaps on another
        // thread, once the transaction is open), so it needs an instance of its own: the one
        // driven to readiness, `self.inner`, goes with it and a clone stays behind (which
        // `poll_ready` drives before the next call). A service whose readiness is held by its
        // instance (a concurrency permit, a buffer slot) is thus called ready.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let flow = Flow {
            inner: Some(inner),
            store: self.store.clone(),
            config: self.config.clone(),
        };
        ResponseFuture {
            inner: Box::pin(flow.run(request, key_headers)),
        }
    }
}

/// One request's trip through the layer.
struct Flow<S, St> {
    /// The service made ready for this call (lent to each attempt).
    inner: Option<S>,
    store: St,
    config: Arc<Config>,
}

/// What the checks before the store produce.
struct Checked {
    parts: request::Parts,
    body: Bytes,
    scope: Scope,
    fingerprint: crate::fingerprint::Fingerprint,
}

impl<S, St, ResB> Flow<S, St>
where
    S: Service<Request<RequestBody>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: IdempotencyStore,
    ResB: Body<Data = Bytes> + Send + 'static,
{
    /// A request the layer handles (the method and filter say so, and a key is sent or
    /// required), with `key_headers` key headers if the key is read from a header.
    ///
    /// Two phases, the checks and then [`execute`](Self::execute), of which the future holds
    /// one at a time (see `phases`). Each is an `async` block rather than an `async fn`, whose
    /// future keeps each argument twice: as given, and moved into the body.
    fn run<ReqB>(
        self,
        request: Request<ReqB>,
        key_headers: Option<usize>,
    ) -> impl Future<Output = Result<Response<ResponseBody<ResB>>, S::Error>>
    where
        ReqB: Body<Data = Bytes> + Send + 'static,
        ReqB::Error: Into<BoxError>,
    {
        let wire = Wire::of(request.version(), request.headers());
        let config = self.config.clone();
        let checks = async move { check(&config, request, key_headers).await };
        phases::then(checks, move |checked| {
            let checked = match checked {
                Ok(checked) => checked,
                Err(rejection) => {
                    metrics::request(&self.config, Outcome::Rejected);
                    return phases::Second::Answered {
                        answer: Some(Ok(self.reject(&rejection, wire))),
                    };
                }
            };
            let span = tracing::info_span!(
                "idempotency",
                operation = %checked.scope.operation,
                tenant = %checked.scope.tenant,
                key = %checked.scope.key.redacted_lazily(),
            );
            // Without a subscriber that wants it, the span is disabled: entering and leaving it on
            // every poll would do nothing but cost.
            if span.is_disabled() {
                phases::Second::Plain {
                    execute: self.execute(checked, wire),
                }
            } else {
                phases::Second::Traced {
                    execute: self.execute(checked, wire).instrument(span),
                }
            }
        })
    }

    /// The checked request's trip through the store and the handler; `wire` is the request's
    /// (its head is the one checked).
    fn execute(
        mut self,
        checked: Checked,
        wire: Wire,
    ) -> impl Future<Output = Result<Response<ResponseBody<ResB>>, S::Error>> {
        let Checked {
            parts,
            body,
            scope,
            fingerprint,
        } = checked;
        // Taken by each attempt, and given back by one the store did not run.
        let mut parts = Some(parts);
        async move {
            // One clock read for both the in-flight bound and the first attempt's lock wait (the
            // claim does not wait under the default policy; under the others the attempt reads
            // the clock again after it).
            let started = Instant::now();
            // Held until the request ends: duplicates meanwhile follow the in-flight policy.
            let _running = match self
                .config
                .running
                .claim(&scope, self.config.in_flight)
                .await
            {
                Ok(claim) => claim,
                Err(rejection) => {
                    // The request that holds the key may be one more retry of a key completed
                    // long ago: a completed key is replayed, never answered "in flight". One read,
                    // without the write lock (the store bounds its wait); failing it, the 409.
                    let found = self.store.lookup(&scope, SystemTime::now()).await;
                    return Ok(self.answer_in_flight(found, &rejection, &fingerprint, wire));
                }
            };
            if let Some(mode) = self.config.steps.clone() {
                if let Some(parts) = parts.take() {
                    let checked = Checked {
                        parts,
                        body,
                        scope,
                        fingerprint,
                    };
                    // Boxed: only routes with steps take this path, and unboxed its state would
                    // size every request's future.
                    return Box::pin(self.execute_steps(mode, checked, wire, started)).await;
                }
            }
            if self.config.in_flight != crate::InFlight::Wait {
                // A duplicate on another instance holds the key in the database: the store bounds
                // that wait too, by what is left of the bound after the wait in this process.
                let policy = match self.config.in_flight {
                    crate::InFlight::WaitUpTo(bound) => {
                        crate::InFlight::WaitUpTo(bound.saturating_sub(started.elapsed()))
                    }
                    policy => policy,
                };
                self.store = self.store.clone().bound_duplicate_wait(policy);
            }
            let now = SystemTime::now();
            let mut first_started =
                (self.config.in_flight == crate::InFlight::Wait).then_some(started);

            let mut reruns = Reruns::default();
            loop {
                let (Some(mut inner), Some(attempt_parts)) = (self.inner.take(), parts.take())
                else {
                    // Only a panic inside a store's `begin_and_run` could lose them.
                    return Ok(self.reject(&Rejection::HandlerPanicked, wire));
                };
                if reruns.attempts() > 0 {
                    // The service was made ready for the first call only.
                    std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
                }
                let attempt = Attempt {
                    body: body.clone(),
                    scope: scope.clone(),
                    fingerprint,
                    now,
                    config: self.config.clone(),
                    keep_a_copy: reruns.any_left(&self.config),
                };
                // The service, the request head and the attempt are lent to the work, and the
                // first two taken back here if the store drops the work without running it (a
                // begin that found a record, or failed): a failed begin may run again.
                let lent = Arc::new(std::sync::Mutex::new(Some((inner, attempt_parts, attempt))));
                let lent_to_work = lent.clone();
                // Everything done while the transaction is open: the store may run it where the
                // transaction lives (the SQLite store, on its writer thread).
                let lock_started = first_started.take().unwrap_or_else(Instant::now);
                let work = move |transaction| Attempt::run(lent_to_work, transaction);
                let lock_timeout = self.config.lock_timeout;
                let began = if reruns.attempts() == 0 {
                    // The first attempt starts with the fast path: a completed record, read
                    // without waiting for the writer.
                    self.store
                        .lookup_then_begin_and_run(&scope, lock_timeout, now, work)
                        .await
                } else {
                    // Boxed: runs again are rare, and unboxed their state would size every
                    // request's future beside the first attempt's.
                    Box::pin(self.store.begin_and_run(&scope, lock_timeout, now, work)).await
                };
                let (inner, spare_parts, finished) = match began {
                    Ok(RunOutcome::Found { record }) => {
                        return Ok(self.answer_existing(record, &fingerprint, wire));
                    }
                    Ok(RunOutcome::Existing { record, waited }) => {
                        metrics::lock_wait(&self.config, waited);
                        return Ok(self.answer_existing(record, &fingerprint, wire));
                    }
                    Ok(RunOutcome::Ran { output, waited }) => {
                        metrics::lock_wait(&self.config, waited);
                        output
                    }
                    Err(error) => {
                        // Mostly a lock wait that timed out.
                        metrics::lock_wait(&self.config, lock_started.elapsed());
                        // A duplicate that found its original's record in a commit group which
                        // was then rolled back: the key is free again.
                        if reruns.take(&error, &self.config) {
                            tracing::info!(%error, "the record found was rolled back; running again");
                            if let Some((inner, lent, _)) =
                                lent.lock().ok().and_then(|mut l| l.take())
                            {
                                self.inner = Some(inner);
                                parts = Some(lent);
                            }
                            continue;
                        }
                        return Ok(self.store_failure(error, wire));
                    }
                };
                self.inner = inner;
                parts = spare_parts;

                return match finished {
                    // The database threw the work away through no fault of the request's own: a
                    // conflict with a concurrent transaction (PostgreSQL 40001, 40P01), or another
                    // member of its SQLite commit group. Running it again may commit.
                    Finished::CommitFailed(error) if reruns.take(&error, &self.config) => {
                        tracing::info!(%error, attempt = reruns.attempts(), "transaction thrown away; running again");
                        metrics::rollback(&self.config, RollbackReason::Rerun);
                        continue;
                    }
                    finished => self.answer_finished(finished, wire),
                };
            }
        }
    }

    /// The answer to a request whose scope another request of this layer holds, `found` the
    /// read of its record: a completed record is replayed; otherwise `rejection` (`409`).
    fn answer_in_flight(
        &self,
        found: Result<Option<StoredRecord>, Error>,
        rejection: &Rejection,
        fingerprint: &crate::fingerprint::Fingerprint,
        wire: Wire,
    ) -> Response<ResponseBody<ResB>> {
        if let Ok(Some(record)) = found {
            return self.answer_existing(record, fingerprint, wire);
        }
        tracing::info!("a request with the same key is running; answered 409");
        metrics::request(&self.config, Outcome::InFlight);
        self.reject(rejection, wire)
    }

    /// The answer to an attempt that ended and will not run again: its committed response, the
    /// store's failure, or the answer of its rollback.
    fn answer_finished(
        &self,
        finished: Finished<ResB, S::Error>,
        wire: Wire,
    ) -> Result<Response<ResponseBody<ResB>>, S::Error> {
        match finished {
            Finished::Committed(parts, body, trailers) => {
                tracing::debug!(status = %parts.status, "response saved and committed");
                Ok(self.executed(parts, body, trailers))
            }
            Finished::CommitFailed(error) => {
                metrics::rollback(&self.config, RollbackReason::CommitFailed);
                Ok(self.store_failure(error, wire))
            }
            Finished::RolledBack(reason, answer) => {
                metrics::rolled_back(&self.config, reason);
                match answer {
                    Answer::ServiceError(error) => {
                        tracing::warn!("inner service failed; idempotency transaction rolled back");
                        Err(error)
                    }
                    Answer::Reject(rejection) => {
                        if matches!(rejection, Rejection::HandlerPanicked) {
                            tracing::error!(
                                "handler panicked; idempotency transaction rolled back"
                            );
                        } else {
                            tracing::warn!(%rejection, "response could not be captured; rolled back");
                        }
                        Ok(self.reject(&rejection, wire))
                    }
                    Answer::Inner(response) => {
                        tracing::debug!(status = %response.status(), "response not saveable; rolled back");
                        Ok(response.map(ResponseBody::inner))
                    }
                    Answer::Full(parts, body, trailers) => {
                        tracing::debug!("gRPC status not saveable; rolled back");
                        Ok(Response::from_parts(
                            parts,
                            ResponseBody::full(body, trailers),
                        ))
                    }
                }
            }
        }
    }

    fn answer_existing(
        &self,
        record: StoredRecord,
        fingerprint: &crate::fingerprint::Fingerprint,
        wire: Wire,
    ) -> Response<ResponseBody<ResB>> {
        if record.fingerprint.matches(fingerprint) {
            tracing::debug!(status = %record.response.status, "replayed saved response");
            metrics::request(&self.config, Outcome::Replayed);
            record.response.into_replay()
        } else {
            tracing::info!("idempotency key reused with a different payload");
            metrics::request(&self.config, Outcome::Conflict);
            self.reject(&Rejection::KeyReused, wire)
        }
    }

    /// The answer to a request whose response was saved and committed: counted as executed.
    fn executed(
        &self,
        parts: http::response::Parts,
        body: Bytes,
        trailers: Option<HeaderMap>,
    ) -> Response<ResponseBody<ResB>> {
        metrics::request(&self.config, Outcome::Executed);
        Response::from_parts(parts, ResponseBody::full(body, trailers))
    }

    fn store_failure(&self, error: Error, wire: Wire) -> Response<ResponseBody<ResB>> {
        if matches!(error, Error::InFlight) {
            tracing::info!(
                "the key is held by a request running on another instance; answered 409"
            );
            metrics::request(&self.config, Outcome::InFlight);
            self.reject(&Rejection::InFlight, wire)
        } else if error.is_busy() {
            tracing::warn!(%error, "idempotency store busy; answered 503");
            metrics::request(&self.config, Outcome::Busy);
            self.reject(&Rejection::Busy, wire)
        } else {
            tracing::error!(%error, "idempotency store failed; rolled back");
            metrics::request(&self.config, Outcome::Error);
            self.reject(&Rejection::Store(Arc::new(error)), wire)
        }
    }

    fn reject(&self, rejection: &Rejection, wire: Wire) -> Response<ResponseBody<ResB>> {
        if wire.grpc {
            return grpc_rejection(rejection, self.config.retry_after);
        }
        let status = self.config.status_of(rejection);
        let mut response = (self.config.error_responder)(rejection, status);
        let headers = response.headers_mut();
        if matches!(rejection, Rejection::Busy | Rejection::InFlight)
            && !headers.contains_key(header::RETRY_AFTER)
        {
            let seconds = self.config.retry_after.as_secs().max(1);
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        // The rest of an oversized body was not read: the connection cannot be reused.
        if matches!(rejection, Rejection::BodyTooLarge | Rejection::BodyTimeout)
            && wire.version <= Version::HTTP_11
        {
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        response.map(|body| ResponseBody::full(body, None))
    }
}

/// Key, tenant, body and fingerprint: everything decided before the store is touched.
async fn check<ReqB>(
    config: &Config,
    request: Request<ReqB>,
    key_headers: Option<usize>,
) -> Result<Checked, Rejection>
where
    ReqB: Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<BoxError>,
{
    let (mut parts, body) = request.into_parts();
    let tenant = (config.tenant)(&parts).ok_or(Rejection::MissingTenant)?;
    let key = match key_headers {
        Some(0) => return Err(Rejection::MissingKey),
        Some(1) => Some(
            config
                .key_extractor
                .extract(&parts, &[], config.max_key_len)?,
        ),
        Some(_) => return Err(Rejection::DuplicateKeyHeader),
        None => None,
    };
    // Before the body is read: no store could keep the record.
    let operation = match &config.operation {
        Some(operation) => operation.clone(),
        None if parts.uri.path().len() > crate::MAX_OPERATION_LEN => {
            return Err(Rejection::OperationTooLong)
        }
        None => Arc::from(parts.uri.path()),
    };
    let body = read_body(body, &parts.headers, config).await?;
    let key = match key {
        Some(key) => key,
        None => (config.key_extractor).extract(&parts, &body, config.max_key_len)?,
    };
    let fingerprint = config
        .fingerprinter
        .fingerprint(&parts, &body)
        .map_err(Rejection::InvalidPayload)?;
    // Kept until the handler has run, through every wait for the store.
    detach_head(&mut parts);
    Ok(Checked {
        parts,
        body,
        scope: Scope {
            tenant,
            operation,
            key,
        },
        fingerprint,
    })
}

/// How often a request may run again after its transaction was thrown away: up to the layer's
/// `conflict_retries` for serialization conflicts, and up to [`GROUP_RERUNS`] for a SQLite
/// commit group rolled back by another member (the store then runs it alone, so once is
/// enough; the second covers a duplicate that ran in its original's place).
#[derive(Default)]
struct Reruns {
    conflicts: u32,
    group: u32,
}

/// See [`Reruns`].
const GROUP_RERUNS: u32 = 2;

impl Reruns {
    fn attempts(&self) -> u32 {
        self.conflicts + self.group
    }

    /// Whether some error could still run the request again.
    fn any_left(&self, config: &Config) -> bool {
        self.conflicts < config.conflict_retries || self.group < GROUP_RERUNS
    }

    /// Counts a run again for `error`, if it is one that runs again and any are left.
    fn take(&mut self, error: &Error, config: &Config) -> bool {
        if matches!(error, Error::GroupRolledBack(_)) && self.group < GROUP_RERUNS {
            self.group += 1;
            true
        } else if error.is_serialization_conflict() && self.conflicts < config.conflict_retries {
            self.conflicts += 1;
            true
        } else {
            false
        }
    }
}

/// A copy of a request head, extensions included (the body is buffered separately).
fn copy_parts(parts: &request::Parts) -> request::Parts {
    let mut request = Request::new(());
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = parts.uri.clone();
    *request.version_mut() = parts.version;
    *request.headers_mut() = parts.headers.clone();
    *request.extensions_mut() = parts.extensions.clone();
    request.into_parts().0
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    use http::{Method, StatusCode};
    use http_body_util::Full;
    use tower_layer::Layer;

    use super::*;
    use crate::store::sqlite::SqliteStore;
    use crate::Tenant;

    /// A handler that counts its clones and answers `201`.
    struct Counted {
        clones: Arc<AtomicUsize>,
    }

    impl Clone for Counted {
        fn clone(&self) -> Self {
            self.clones.fetch_add(1, Ordering::SeqCst);
            Counted {
                clones: self.clones.clone(),
            }
        }
    }

    impl Service<Request<RequestBody>> for Counted {
        type Response = Response<Full<Bytes>>;
        type Error = Infallible;
        type Future = std::future::Ready<Result<Self::Response, Infallible>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: Request<RequestBody>) -> Self::Future {
            let mut response = Response::new(Full::new(Bytes::from_static(b"{}")));
            *response.status_mut() = StatusCode::CREATED;
            std::future::ready(Ok(response))
        }
    }

    fn request(method: Method, key: Option<&str>) -> Request<Full<Bytes>> {
        let mut request = Request::new(Full::new(Bytes::from_static(b"{\"a\":1}")));
        *request.method_mut() = method;
        *request.uri_mut() = http::Uri::from_static("/orders");
        if let Some(key) = key {
            request
                .headers_mut()
                .insert(IDEMPOTENCY_KEY, HeaderValue::from_str(key).unwrap());
        }
        request.extensions_mut().insert(Tenant::new("t"));
        request
    }

    async fn send<S>(service: &mut S, request: Request<Full<Bytes>>) -> StatusCode
    where
        S: Service<Request<Full<Bytes>>, Response = Response<ResponseBody<Full<Bytes>>>>,
        S::Error: fmt::Debug,
    {
        std::future::poll_fn(|cx| service.poll_ready(cx))
            .await
            .unwrap();
        service.call(request).await.unwrap().status()
    }

    /// A subscriber for this thread: the tests in this module run in parallel, and tracing
    /// caches a callsite's interest from whichever thread registers it first, so one test
    /// without a subscriber could disable the span for the other.
    fn subscriber(writer: Capture) -> tracing::subscriber::DefaultGuard {
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::set_default(subscriber)
    }

    /// A store in a file of `dir`.
    async fn store_in(dir: &tempfile::TempDir) -> SqliteStore {
        SqliteStore::open(dir.path().join("records.db"))
            .await
            .unwrap()
    }

    /// A request waiting for the store holds the second phase's state only, not the room the
    /// checks needed (see `phases`): the flow's future is no larger than `execute`'s and a
    /// tag.
    #[tokio::test]
    async fn a_request_waiting_for_the_store_holds_nothing_of_its_checks() {
        let dir = tempfile::tempdir().unwrap();
        let service = IdempotencyLayer::new(store_in(&dir).await).layer(Counted {
            clones: Arc::default(),
        });
        let flow = |service: &Idempotency<Counted, SqliteStore>| Flow {
            inner: Some(service.inner.clone()),
            store: service.store.clone(),
            config: service.config.clone(),
        };
        let run = flow(&service).run(request(Method::POST, Some("k")), Some(1));
        let key = crate::key::IdempotencyKey::parse(b"k", 16).unwrap();
        let checked = Checked {
            parts: Request::new(()).into_parts().0,
            body: Bytes::new(),
            scope: Scope::new("t", "op", key),
            fingerprint: crate::fingerprint::Fingerprint::new(1, [0; 32]),
        };
        let execute =
            flow(&service).execute(checked, Wire::of(Version::HTTP_11, &HeaderMap::new()));
        let (run, execute) = (std::mem::size_of_val(&run), std::mem::size_of_val(&execute));
        assert!(
            run <= execute + 64,
            "run: {run} bytes, execute: {execute} bytes"
        );
    }

    /// The size of a request's future under the layer on `store` (a new key, not yet polled).
    fn flow_size<St: IdempotencyStore>(store: St) -> usize {
        let service = IdempotencyLayer::new(store).layer(Counted {
            clones: Arc::default(),
        });
        let flow = Flow {
            inner: Some(service.inner.clone()),
            store: service.store.clone(),
            config: service.config.clone(),
        };
        std::mem::size_of_val(&flow.run(request(Method::POST, Some("k")), Some(1)))
    }

    /// On a server store, a request's future holds no room for the store's own futures (a
    /// statement's preparation and query, the pool's wait, their time bounds: several KB),
    /// which the store boxes while they run, nor for the handler's run until the key is
    /// reserved: it is about the size of SQLite's, whose writer runs them elsewhere. (It was
    /// 8 KB on tokio-postgres and 6 KB on sqlx, moved whole on each move of the future.)
    #[cfg(feature = "sqlx-postgres")]
    #[tokio::test]
    async fn a_request_on_a_server_store_holds_no_room_for_the_stores_statements() {
        let dir = tempfile::tempdir().unwrap();
        let sqlite = flow_size(store_in(&dir).await);
        // A pool that connects on first use: nothing here connects.
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://127.0.0.1:1/none")
            .unwrap();
        let sqlx = flow_size(crate::store::sqlx_postgres::SqlxPostgresStore::builder(pool).build());
        assert!(
            sqlx <= 2 * sqlite,
            "sqlx store: {sqlx} bytes, SQLite: {sqlite} bytes"
        );
    }

    /// The same on tokio-postgres, whose store checks a connection when it is built.
    #[cfg(feature = "tokio-postgres")]
    #[ignore = "needs PostgreSQL: cargo test --lib --all-features -- --ignored with TEST_DATABASE_URL"]
    #[tokio::test]
    async fn a_request_on_tokio_postgres_holds_no_room_for_the_stores_statements() {
        let dir = tempfile::tempdir().unwrap();
        let sqlite = flow_size(store_in(&dir).await);
        let url = std::env::var("TEST_DATABASE_URL").expect("TEST_DATABASE_URL");
        let store = crate::store::tokio_postgres::PostgresStore::builder(url.parse().unwrap())
            .with_create_schema(false)
            .build()
            .await
            .unwrap();
        let postgres = flow_size(store);
        assert!(
            postgres <= 2 * sqlite,
            "tokio-postgres store: {postgres} bytes, SQLite: {sqlite} bytes"
        );
    }

    #[tokio::test]
    async fn only_a_request_the_layer_handles_takes_an_instance_of_its_own() {
        let _default = subscriber(Capture::default());
        let dir = tempfile::tempdir().unwrap();
        let store = store_in(&dir).await;
        let clones = Arc::new(AtomicUsize::new(0));
        let inner = Counted {
            clones: clones.clone(),
        };
        let mut service = IdempotencyLayer::new(store)
            .with_operation("op")
            .with_key_required(false)
            .layer(inner);
        let before = clones.load(Ordering::SeqCst);
        // Passed through (another method; no key where none is required): called as it is.
        assert_eq!(
            send(&mut service, request(Method::GET, None)).await,
            StatusCode::CREATED
        );
        assert_eq!(
            send(&mut service, request(Method::POST, None)).await,
            StatusCode::CREATED
        );
        assert_eq!(clones.load(Ordering::SeqCst), before);
        // Handled: the ready instance goes with the request, one clone stays behind.
        assert_eq!(
            send(&mut service, request(Method::POST, Some("k1"))).await,
            StatusCode::CREATED
        );
        assert_eq!(clones.load(Ordering::SeqCst), before + 1);
    }

    /// What a handler got (a header's name, `body`, `uri`) and where it is in memory.
    type Noted = Vec<(String, std::ops::Range<usize>)>;

    /// A handler that notes where the request head and body it gets are in memory.
    #[derive(Clone, Default)]
    struct Addresses(Arc<Mutex<Noted>>);

    impl Addresses {
        fn note(&self, what: impl Into<String>, bytes: &[u8]) {
            let start = bytes.as_ptr() as usize;
            let noted = (what.into(), start..start + bytes.len());
            self.0.lock().unwrap().push(noted);
        }
    }

    impl Service<Request<RequestBody>> for Addresses {
        type Response = Response<Full<Bytes>>;
        type Error = Infallible;
        type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: Request<RequestBody>) -> Self::Future {
            let addresses = self.clone();
            Box::pin(async move {
                let (parts, body) = request.into_parts();
                let body = body.collect().await.unwrap().to_bytes();
                assert_eq!(&body[..], br#"{"a":1}"#);
                addresses.note("body", &body);
                for (name, value) in &parts.headers {
                    addresses.note(name.as_str(), value.as_bytes());
                }
                assert_eq!(parts.uri, "/orders?x=1");
                addresses.note("uri", parts.uri.path().as_bytes());
                #[cfg(feature = "axum")]
                {
                    let original = parts
                        .extensions
                        .get::<axum::extract::OriginalUri>()
                        .unwrap();
                    assert_eq!(original.0, "/orders?x=1");
                    addresses.note("OriginalUri", original.0.path().as_bytes());
                }
                let mut response = Response::new(Full::new(Bytes::from_static(b"{}")));
                *response.status_mut() = StatusCode::CREATED;
                Ok(response)
            })
        }
    }

    /// A server (hyper) parses the URI and the header values as views into the connection's
    /// read buffer, where the body usually is too: a request that keeps a view while it waits
    /// for the store keeps the whole buffer. The handler gets copies, of the body too.
    #[tokio::test]
    async fn the_handler_gets_no_view_into_the_connections_read_buffer() {
        let read = Bytes::from_static(
            b"/orders?x=1 k1 application/json 7 {\"a\":1} and the rest of an 8 KiB read buffer",
        );
        let view = |from: usize, to: usize| read.slice(from..to);
        let value =
            |from: usize, to: usize| HeaderValue::from_maybe_shared(view(from, to)).unwrap();
        let mut request = Request::new(Full::new(view(34, 41)));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = http::Uri::from_maybe_shared(view(0, 11)).unwrap();
        let headers = request.headers_mut();
        headers.insert(IDEMPOTENCY_KEY, value(12, 14));
        headers.insert(header::CONTENT_TYPE, value(15, 31));
        headers.insert(header::CONTENT_LENGTH, value(32, 33));
        request.extensions_mut().insert(Tenant::new("t"));
        // What axum's router adds before any route layer.
        #[cfg(feature = "axum")]
        {
            let original = axum::extract::OriginalUri(request.uri().clone());
            request.extensions_mut().insert(original);
        }
        let buffer = read.as_ptr() as usize..read.as_ptr() as usize + read.len();
        let in_buffer = |at: *const u8| buffer.contains(&(at as usize));
        assert!(in_buffer(request.uri().path().as_ptr()));
        assert!(in_buffer(
            request.headers()[IDEMPOTENCY_KEY].as_bytes().as_ptr()
        ));

        let dir = tempfile::tempdir().unwrap();
        let store = store_in(&dir).await;
        let addresses = Addresses::default();
        let mut service = IdempotencyLayer::new(store)
            .with_operation("create_order")
            .layer(addresses.clone());
        assert_eq!(send(&mut service, request).await, StatusCode::CREATED);

        let noted = addresses.0.lock().unwrap().clone();
        let expected = 5 + usize::from(cfg!(feature = "axum"));
        assert_eq!(noted.len(), expected, "{noted:?}");
        for (what, range) in &noted {
            assert!(
                !in_buffer(range.start as *const u8) && !in_buffer((range.end - 1) as *const u8),
                "the handler's {what} is a view into the read buffer"
            );
        }
    }

    /// Collects what a `fmt` subscriber writes.
    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Capture {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn with_a_subscriber_the_flow_runs_in_its_span() {
        let capture = Capture::default();
        // The current-thread runtime polls the request here, where the subscriber is set.
        let _default = subscriber(capture.clone());
        let dir = tempfile::tempdir().unwrap();
        let store = store_in(&dir).await;
        let inner = Counted {
            clones: Arc::new(AtomicUsize::new(0)),
        };
        let mut service = IdempotencyLayer::new(store)
            .with_operation("create_order")
            .layer(inner);
        for _ in 0..2 {
            let status = send(&mut service, request(Method::POST, Some("k1"))).await;
            assert_eq!(status, StatusCode::CREATED);
        }
        let logged = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
        let replayed = logged
            .lines()
            .find(|line| line.contains("replayed saved response"))
            .unwrap_or_else(|| panic!("no replay logged in {logged}"));
        assert!(
            replayed.contains("idempotency{operation=create_order tenant=t key=k:"),
            "{replayed}"
        );
        assert!(
            !logged.contains("k1"),
            "the key itself is never logged: {logged}"
        );
    }
}
