//! The steps mode's request flow ([`IdempotencyLayer::with_steps`](crate::IdempotencyLayer::with_steps)):
//! claim the key, call the handler with its [`Steps`](crate::steps::Steps) handle, then save
//! the final response or release the key. [`drive`] is shared with the completer.

use super::*;
use crate::error::Rejection;
use crate::steps::mode::{owner, Claimed, Owned, StepsMode};
use crate::steps::{Acquired, Claim, SavedRequest};

/// How a driven request ended.
pub(crate) enum Driven<B, E> {
    /// Saved: answer with this response.
    Saved(http::response::Parts, Bytes, Option<HeaderMap>),
    /// Not saved (the key released, or left as the steps left it): answer as given.
    Answer(Answer<B, E>),
}

/// Releases the key if the request future is dropped before it ended (the client went away).
struct ReleaseOnDrop(Option<Box<dyn Owned>>);

impl ReleaseOnDrop {
    fn take(&mut self) -> Option<Box<dyn Owned>> {
        self.0.take()
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        if let Some(owned) = self.0.take() {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let release = owned.release();
                runtime.spawn(async move {
                    if let Err(error) = release.await {
                        tracing::warn!(%error, "releasing a dropped request's key failed");
                    }
                });
            }
        }
    }
}

/// Calls `inner` with the claimed key's handle in the request extensions, then saves the
/// response as the key's (a saveable one, or any but a `5xx` after a terminal step) or
/// releases the key.
pub(crate) async fn drive<S, ResB>(
    owned: Box<dyn Owned>,
    inner: &mut S,
    mut parts: request::Parts,
    body: Bytes,
    scope: Scope,
    fingerprint: crate::fingerprint::Fingerprint,
    config: &Config,
) -> Driven<ResB, S::Error>
where
    S: Service<Request<RequestBody>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes>,
{
    parts.extensions.insert(scope);
    let mut guard = ReleaseOnDrop(Some(owned));
    let mut reruns = 0;
    let (owned, flags, outcome) = loop {
        let Some(owned) = guard.0.as_ref() else {
            return Driven::Answer(Answer::Reject(Rejection::HandlerPanicked));
        };
        // A copy of the head for a run again: the handle of this run goes into this one's.
        let spare = (reruns < config.conflict_retries).then(|| copy_parts(&parts));
        owned.insert_into(&mut parts.extensions);
        let request = Request::from_parts(parts, RequestBody::buffered(body.clone()));
        let call = std::panic::catch_unwind(AssertUnwindSafe(|| inner.call(request)));
        let outcome = match call {
            Ok(call) => CatchUnwind { inner: call }.await,
            Err(panic) => Err(panic),
        };
        let Some(owned) = guard.take() else {
            return Driven::Answer(Answer::Reject(Rejection::HandlerPanicked));
        };
        let flags = owned.flags();
        // A local step's transaction the database threw away (a serialization failure or a
        // deadlock) saved nothing, and every foreign step called has its result saved: the
        // handler runs again at once under the same claim, as a retry of the client's would,
        // getting the saved results back without calling. Bounded by the conflict retries.
        let again = match (&outcome, spare) {
            (Ok(Ok(_)), Some(spare)) => owned.rerun().map(|again| (again, spare)),
            _ => None,
        };
        let Some((again, spare)) = again else {
            break (owned, flags, outcome);
        };
        reruns += 1;
        tracing::info!(
            attempt = reruns,
            "a step's transaction was thrown away; running the handler again"
        );
        metrics::rollback(config, RollbackReason::Rerun);
        drop(outcome);
        guard = ReleaseOnDrop(Some(again));
        parts = spare;
        if let Err(error) = std::future::poll_fn(|cx| inner.poll_ready(cx)).await {
            if let Some(owned) = guard.take() {
                release(&*owned, &flags).await;
            }
            return Driven::Answer(Answer::ServiceError(error));
        }
    };
    let response = match outcome {
        Ok(Ok(response)) => response,
        Ok(Err(error)) => {
            release(&*owned, &flags).await;
            return Driven::Answer(Answer::ServiceError(error));
        }
        Err(_panic) => {
            release(&*owned, &flags).await;
            return Driven::Answer(Answer::Reject(Rejection::HandlerPanicked));
        }
    };
    if flags.lease_lost {
        tracing::warn!("another request took the key over; this one's steps were refused");
        return Driven::Answer(Answer::Reject(Rejection::Busy));
    }
    if flags.transient {
        release(&*owned, &flags).await;
        return Driven::Answer(Answer::Reject(Rejection::Busy));
    }
    let status = response.status();
    let saveable = !flags.in_doubt
        && !flags.changed
        && ((config.save)(status) || (flags.terminal && !status.is_server_error()));
    if !saveable {
        release(&*owned, &flags).await;
        return Driven::Answer(Answer::Inner(response));
    }
    let (parts, body) = response.into_parts();
    let (body, trailers) = match collect_response(body, config.response_limit).await {
        Ok(collected) => collected,
        Err(rejection) => {
            release(&*owned, &flags).await;
            return Driven::Answer(Answer::Reject(rejection));
        }
    };
    let now = SystemTime::now();
    let record = NewRecord {
        fingerprint,
        response: SavedResponse {
            status: parts.status,
            headers: select_headers(&parts.headers, &config.replayed_headers),
            body: body.clone(),
            trailers: trailers
                .as_ref()
                .map(|t| select_headers(t, &config.replayed_trailers)),
        },
        created_at: now,
        expires_at: config.expires_at(now),
    };
    match owned.finish(record).await {
        Ok(()) => Driven::Saved(parts, body, trailers),
        Err(Error::LeaseLost) => Driven::Answer(Answer::Reject(Rejection::Busy)),
        Err(error) => {
            release(&*owned, &flags).await;
            if error.is_busy() {
                tracing::warn!(%error, "saving the final response failed; answered 503");
                Driven::Answer(Answer::Reject(Rejection::Busy))
            } else {
                tracing::error!(%error, "saving the final response failed");
                Driven::Answer(Answer::Reject(Rejection::Store(Arc::new(error))))
            }
        }
    }
}

/// Lets the key go, unless it is in doubt (it stays for an operator).
async fn release(owned: &dyn Owned, flags: &crate::steps::mode::Flags) {
    if flags.in_doubt || flags.lease_lost {
        return;
    }
    if let Err(error) = owned.release().await {
        tracing::warn!(%error, "releasing the key failed; it is free again when its lease ends");
    }
}

/// The request as kept for the completer.
fn saved_request(parts: &request::Parts, body: &Bytes) -> SavedRequest {
    let headers: Vec<(HeaderName, HeaderValue)> = SavedRequest::KEPT_HEADERS
        .iter()
        .filter_map(|name| Some((name.clone(), parts.headers.get(name)?.clone())))
        .collect();
    SavedRequest {
        method: parts.method.as_str().to_owned(),
        uri: parts
            .uri
            .path_and_query()
            .map_or_else(|| parts.uri.path().to_owned(), |pq| pq.as_str().to_owned()),
        headers: SavedResponse::encode_headers(&headers),
        body: body.clone(),
    }
}

impl<S, St, ResB> Flow<S, St>
where
    S: Service<Request<RequestBody>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: IdempotencyStore,
    ResB: Body<Data = Bytes> + Send + 'static,
{
    /// The checked request in steps mode.
    pub(super) async fn execute_steps(
        mut self,
        mode: StepsMode,
        checked: Checked,
        wire: Wire,
        started: Instant,
    ) -> Result<Response<ResponseBody<ResB>>, S::Error> {
        let Checked {
            parts,
            body,
            scope,
            fingerprint,
        } = checked;
        let now = SystemTime::now();
        match self.store.lookup(&scope, now).await {
            Ok(Some(record)) => return Ok(self.answer_existing(record, &fingerprint, wire)),
            Ok(None) => {}
            Err(error) => tracing::warn!(%error, "idempotency fast-path lookup failed"),
        }
        let request = saved_request(&parts, &body);
        let bound = match self.config.in_flight {
            crate::InFlight::Wait => self.config.lock_timeout,
            crate::InFlight::Reject => Duration::ZERO,
            crate::InFlight::WaitUpTo(bound) => bound,
        };
        let owned = loop {
            let now = SystemTime::now();
            let claim = Claim {
                scope: scope.clone(),
                fingerprint,
                request: Some(request.clone()),
                owner: owner(),
                lease_until: now + mode.lease,
                now,
                max_attempts: None,
                expires_at: self.config.expires_at(now),
                wait: self.config.lock_timeout,
            };
            let claimed = match mode.claimer.claim(claim, mode.lease).await {
                Ok(claimed) => claimed,
                Err(error) => return Ok(self.store_failure(error, wire)),
            };
            match claimed {
                Claimed::Owned(owned) => break owned,
                Claimed::Not(Acquired::Completed(record)) => {
                    return Ok(self.answer_existing(record, &fingerprint, wire));
                }
                Claimed::Not(Acquired::Mismatch) => {
                    metrics::request(&self.config, Outcome::Conflict);
                    return Ok(self.reject(&Rejection::KeyReused, wire));
                }
                Claimed::Not(Acquired::InDoubt) => {
                    return Ok(self.reject(&Rejection::InDoubt, wire));
                }
                Claimed::Not(Acquired::Held { until }) => {
                    let waited = started.elapsed();
                    if waited >= bound {
                        let rejection = match self.config.in_flight {
                            crate::InFlight::Wait => Rejection::Busy,
                            _ => Rejection::InFlight,
                        };
                        metrics::request(&self.config, Outcome::InFlight);
                        return Ok(self.reject(&rejection, wire));
                    }
                    let left = until
                        .duration_since(SystemTime::now())
                        .unwrap_or_default()
                        .min(bound - waited);
                    tokio::time::sleep(
                        left.clamp(Duration::from_millis(5), Duration::from_millis(50)),
                    )
                    .await;
                }
                Claimed::Not(other) => {
                    tracing::error!(?other, "unexpected answer to a request's claim");
                    return Ok(self.reject(&Rejection::Busy, wire));
                }
            }
        };
        let Some(mut inner) = self.inner.take() else {
            return Ok(self.reject(&Rejection::HandlerPanicked, wire));
        };
        let driven = drive(
            owned,
            &mut inner,
            parts,
            body,
            scope.clone(),
            fingerprint,
            &self.config,
        )
        .await;
        match driven {
            Driven::Saved(parts, body, trailers) => Ok(self.executed(parts, body, trailers)),
            Driven::Answer(Answer::ServiceError(error)) => Err(error),
            Driven::Answer(Answer::Reject(rejection)) => Ok(self.reject(&rejection, wire)),
            Driven::Answer(Answer::Inner(response)) => Ok(response.map(ResponseBody::inner)),
            Driven::Answer(Answer::Full(parts, body, trailers)) => Ok(Response::from_parts(
                parts,
                ResponseBody::full(body, trailers),
            )),
        }
    }
}
