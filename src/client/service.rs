//! [`Retry`]: the service made by [`RetryLayer`], and its [`ResponseFuture`].
//!
//! Why a dedicated future rather than `tower::retry::Retry` with a `Policy`:
//!
//! - the body must be read, asynchronously, before the first attempt; `Policy::clone_request`
//!   is synchronous, so `Retry` could only clone a request whose body is already buffered, and
//!   a second service in front of it would be needed anyway;
//! - the overall deadline must cut the attempt in flight and shrink the per-attempt timeout to
//!   what is left of it; `Retry` knows nothing of time, and `tower::timeout` has a fixed
//!   duration;
//! - the outcome (attempts, key) must reach the caller on errors too, but a `Policy` cannot
//!   change the error type of the service it retries, so the count would be lost;
//! - a `Policy` keeps per-request state (attempts, start time) only by being cloned in `call`.
//!
//! So the loop is one `async` block, boxed behind the named [`ResponseFuture`] (a hand-written
//! state machine over timers, readiness and the inner future would say the same thing at three
//! times the length). The decisions it takes are plain functions in `policy.rs`.

use std::fmt;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use http::{request, HeaderValue, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::time::{sleep, timeout_at, Instant};
use tower_service::Service;

use super::body::BufferedBody;
use super::outcome::{RetryError, RetryOutcome};
use super::policy::{backoff, is_idempotent, retry_after};
use super::{Config, RetryLayer};
use crate::body::BoxError;
use crate::key::IdempotencyKey;
use crate::response::IDEMPOTENT_REPLAYED;
use crate::IDEMPOTENCY_KEY;

/// The client made by [`RetryLayer`]: sends each request until it gets a final answer, with
/// the same `Idempotency-Key` and the same bytes every time.
///
/// The inner client takes `http::Request<BufferedBody>`; this service takes
/// `http::Request<B>` for any body `B` and answers the inner client's responses, each with a
/// [`RetryOutcome`] in its extensions.
pub struct Retry<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S: Clone> Clone for Retry<S> {
    fn clone(&self) -> Self {
        Retry {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for Retry<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Retry")
            .field("inner", &self.inner)
            .field("max_attempts", &self.config.max_attempts)
            .field("deadline", &self.config.deadline)
            .finish_non_exhaustive()
    }
}

impl<S> Retry<S> {
    /// Wraps `inner` with the defaults of [`RetryLayer::new`].
    pub fn new(inner: S) -> Self {
        tower_layer::Layer::layer(&RetryLayer::new(), inner)
    }

    /// A layer that wraps clients; see [`RetryLayer`].
    pub fn layer() -> RetryLayer {
        RetryLayer::new()
    }

    pub(crate) fn from_parts(inner: S, config: Arc<Config>) -> Self {
        Retry { inner, config }
    }

    /// The inner client.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner client, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner client.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B, ResBody> Service<Request<B>> for Retry<S>
where
    S: Service<Request<BufferedBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    ResBody: Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = RetryError;
    type Future = ResponseFuture<ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), RetryError>> {
        self.inner
            .poll_ready(cx)
            .map_err(|error| RetryError::NotReady(error.into()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let started = Instant::now();
        // `poll_ready` readied `self.inner`, not a clone of it: send the first attempt with the
        // ready one and keep the clone for the next call.
        let clone = self.inner.clone();
        let service = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();

        let (mut parts, body) = request.into_parts();
        // The key is fixed before the first send and never changes: a retry with another key
        // would be a second operation to the server.
        let key = match parts.headers.get(IDEMPOTENCY_KEY) {
            Some(key) => Some(key.clone()),
            None if config.key_methods.contains(&parts.method) => {
                let key = config.key_format.generate();
                parts.headers.insert(IDEMPOTENCY_KEY, key.clone());
                Some(key)
            }
            None => None,
        };
        let max_attempts = if key.is_some() || is_idempotent(&parts.method) {
            config.max_attempts
        } else {
            1
        };
        let deadline = started
            .checked_add(config.deadline)
            // A deadline too far to represent: none, in practice.
            .unwrap_or_else(|| started + Duration::from_secs(100 * 365 * 24 * 3600));

        ResponseFuture {
            inner: Box::pin(async move {
                let body = match timeout_at(deadline, buffer(body, config.body_limit)).await {
                    Ok(body) => body?,
                    Err(_) => {
                        return Err(RetryError::DeadlineExceeded {
                            outcome: outcome(0, false, key, started),
                        })
                    }
                };
                let attempts = Attempts {
                    service,
                    config,
                    parts,
                    body,
                    key,
                    max_attempts,
                    started,
                    deadline,
                };
                attempts.run().await
            }),
        }
    }
}

/// The future returned by [`Retry`]: the response to the last attempt, or why there is none.
///
/// A boxed `async` block (see the module source for why it is not tower's `Retry`).
pub struct ResponseFuture<ResBody> {
    inner: Pin<Box<dyn Future<Output = Result<Response<ResBody>, RetryError>> + Send>>,
}

impl<ResBody> fmt::Debug for ResponseFuture<ResBody> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<ResBody> Future for ResponseFuture<ResBody> {
    type Output = Result<Response<ResBody>, RetryError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

/// Reads the caller's body once, so that every attempt can send the same bytes.
async fn buffer<B>(body: B, limit: usize) -> Result<BufferedBody, RetryError>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let collected = Limited::new(body, limit).collect().await.map_err(|error| {
        if error.is::<LengthLimitError>() {
            RetryError::BodyTooLarge { limit }
        } else {
            RetryError::Body(error)
        }
    })?;
    let trailers = collected.trailers().cloned();
    Ok(BufferedBody::with_trailers(collected.to_bytes(), trailers))
}

fn outcome(
    attempts: u32,
    replayed: bool,
    key: Option<HeaderValue>,
    started: Instant,
) -> RetryOutcome {
    RetryOutcome {
        attempts,
        replayed,
        key,
        elapsed: started.elapsed(),
    }
}

/// One request's attempts: everything needed to send it again.
struct Attempts<S> {
    service: S,
    config: Arc<Config>,
    parts: request::Parts,
    body: BufferedBody,
    key: Option<HeaderValue>,
    max_attempts: u32,
    started: Instant,
    deadline: Instant,
}

/// Why an attempt got no response.
enum Failure {
    /// The inner client's error.
    Error(BoxError),
    /// No response head within the per-attempt timeout.
    TimedOut,
}

impl<S, ResBody> Attempts<S>
where
    S: Service<Request<BufferedBody>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
{
    async fn run(mut self) -> Result<Response<ResBody>, RetryError> {
        let mut rng = fastrand::Rng::new();
        let mut attempts = 0;
        loop {
            // The caller's `poll_ready` readied the service for the first attempt only.
            let needs_ready = attempts > 0;
            attempts += 1;
            let attempt_deadline = Instant::now()
                .checked_add(self.config.attempt_timeout)
                .map_or(self.deadline, |end| end.min(self.deadline));

            let failure = match timeout_at(attempt_deadline, self.attempt(needs_ready)).await {
                Ok(Ok(response)) => {
                    if !self.config.retryable_statuses.contains(&response.status()) {
                        return Ok(self.finish(response, attempts));
                    }
                    let server_wait = retry_after(response.headers(), SystemTime::now());
                    match self.next_wait(attempts, server_wait, &mut rng) {
                        Some(wait) => {
                            tracing::debug!(
                                attempt = attempts,
                                status = response.status().as_u16(),
                                wait_ms = wait.as_millis() as u64,
                                key = %self.key_tag(),
                                "retryable answer; retrying with the same key",
                            );
                            // Dropped before the wait: it frees the connection.
                            drop(response);
                            sleep(wait).await;
                            continue;
                        }
                        // Out of attempts or time: the caller gets the server's answer, with
                        // its `Retry-After`.
                        None => return Ok(self.finish(response, attempts)),
                    }
                }
                Ok(Err(AttemptError::NotReady(source))) => {
                    // A client that fails `poll_ready` is broken, not busy: stop here.
                    return Err(RetryError::Failed {
                        outcome: self.outcome(attempts - 1),
                        source,
                    });
                }
                Ok(Err(AttemptError::Call(error))) => {
                    if !(self.config.retryable_error)(&*error) {
                        return Err(RetryError::Failed {
                            outcome: self.outcome(attempts),
                            source: error,
                        });
                    }
                    Failure::Error(error)
                }
                Err(_elapsed) if Instant::now() >= self.deadline => {
                    return Err(RetryError::DeadlineExceeded {
                        outcome: self.outcome(attempts),
                    });
                }
                Err(_elapsed) => Failure::TimedOut,
            };

            match self.next_wait(attempts, None, &mut rng) {
                Some(wait) => {
                    tracing::debug!(
                        attempt = attempts,
                        error = %match &failure {
                            Failure::Error(error) => error.to_string(),
                            Failure::TimedOut => "attempt timed out".to_owned(),
                        },
                        wait_ms = wait.as_millis() as u64,
                        key = %self.key_tag(),
                        "no answer; retrying with the same key",
                    );
                    sleep(wait).await;
                }
                None => {
                    let outcome = self.outcome(attempts);
                    return Err(match failure {
                        Failure::Error(source) => RetryError::Failed { outcome, source },
                        Failure::TimedOut => RetryError::AttemptTimedOut { outcome },
                    });
                }
            }
        }
    }

    /// Sends one attempt: the same method, URI, headers (key included), extensions and bytes.
    async fn attempt(&mut self, needs_ready: bool) -> Result<Response<ResBody>, AttemptError> {
        if needs_ready {
            poll_fn(|cx| self.service.poll_ready(cx))
                .await
                .map_err(|error| AttemptError::NotReady(error.into()))?;
        }
        let mut request = Request::new(self.body.clone());
        *request.method_mut() = self.parts.method.clone();
        *request.uri_mut() = self.parts.uri.clone();
        *request.version_mut() = self.parts.version;
        *request.headers_mut() = self.parts.headers.clone();
        *request.extensions_mut() = self.parts.extensions.clone();
        self.service
            .call(request)
            .await
            .map_err(|error| AttemptError::Call(error.into()))
    }

    /// The wait before the next attempt, or `None` if there is no next attempt: out of
    /// attempts, or the wait (the backoff, or the server's `Retry-After` if longer) would end
    /// past the deadline.
    fn next_wait(
        &self,
        attempts: u32,
        server_wait: Option<Duration>,
        rng: &mut fastrand::Rng,
    ) -> Option<Duration> {
        if attempts >= self.max_attempts {
            return None;
        }
        let jittered = backoff(
            attempts,
            self.config.initial_backoff,
            self.config.max_backoff,
            rng,
        );
        let wait = jittered.max(server_wait.unwrap_or_default());
        let remaining = self.deadline.saturating_duration_since(Instant::now());
        (wait < remaining).then_some(wait)
    }

    fn finish(&self, mut response: Response<ResBody>, attempts: u32) -> Response<ResBody> {
        let replayed = response
            .headers()
            .get(IDEMPOTENT_REPLAYED)
            .is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"true"));
        let outcome = outcome(attempts, replayed, self.key.clone(), self.started);
        response.extensions_mut().insert(outcome);
        response
    }

    fn outcome(&self, attempts: u32) -> RetryOutcome {
        outcome(attempts, false, self.key.clone(), self.started)
    }

    /// The key as logs may show it: a redacted tag, never the key.
    fn key_tag(&self) -> String {
        match &self.key {
            None => "none".to_owned(),
            Some(key) => IdempotencyKey::parse(key.as_bytes(), usize::MAX)
                .map_or_else(|_| "malformed".to_owned(), |key| key.redacted()),
        }
    }
}

enum AttemptError {
    NotReady(BoxError),
    Call(BoxError),
}
