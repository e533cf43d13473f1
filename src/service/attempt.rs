//! One run of the handler in the reserved transaction ([`Attempt`]): lending the inner service,
//! capturing its response, committing or rolling back, and catching a panic.

use super::*;

pub(super) enum Captured<B> {
    NotSaved(Response<B>),
    Saveable(http::response::Parts, Bytes, Option<HeaderMap>),
    Failed(Rejection),
}

/// How an attempt ended, with the transaction closed either way.
pub(super) enum Finished<B, E> {
    /// Saved and committed: answer with this response.
    Committed(http::response::Parts, Bytes, Option<HeaderMap>),
    /// The commit failed (the transaction is rolled back).
    CommitFailed(Error),
    /// Rolled back, for this reason; answer as given.
    RolledBack(RollbackReason, Answer<B, E>),
}

/// The answer to a rolled-back attempt.
pub(crate) enum Answer<B, E> {
    /// The inner service failed.
    ServiceError(E),
    /// The layer's own error response.
    Reject(Rejection),
    /// The handler's response, not saved, passed through.
    Inner(Response<B>),
    /// The handler's captured response, not saved (a gRPC status the policy does not keep).
    Full(http::response::Parts, Bytes, Option<HeaderMap>),
}

/// The service, the request head and the attempt that an attempt's work borrows (see
/// [`Attempt::run`]). The work holds this one pointer: the store's futures that carry it
/// (each keeping its arguments) carry eight bytes, not the attempt.
pub(super) type Lent<S> = Arc<std::sync::Mutex<Option<(S, request::Parts, Attempt)>>>;

/// One run of the handler with the transaction open: what the store drives.
pub(super) struct Attempt {
    pub(super) body: Bytes,
    pub(super) scope: Scope,
    pub(super) fingerprint: crate::fingerprint::Fingerprint,
    pub(super) now: SystemTime,
    pub(super) config: Arc<Config>,
    /// Whether the request may run again: keep a copy of its head for that.
    pub(super) keep_a_copy: bool,
}

impl Attempt {
    /// Calls the lent service with the lent request head and the transaction's handle in the
    /// request extensions, captures the response and commits it with the handler's rows, or
    /// rolls back, as the lent attempt says. Gives the service back, with a copy of the head if
    /// it may run again.
    pub(super) async fn run<S, T, ResB>(
        lent: Lent<S>,
        transaction: T,
    ) -> (Option<S>, Option<request::Parts>, Finished<ResB, S::Error>)
    where
        S: Service<Request<RequestBody>, Response = Response<ResB>>,
        T: Reservation,
        ResB: Body<Data = Bytes>,
    {
        let lent = lent.lock().ok().and_then(|mut lent| lent.take());
        let Some((mut inner, mut parts, attempt)) = lent else {
            // Never: the work runs once, and the service takes nothing back after that.
            let _ = roll_back(transaction).await;
            let failed = Finished::RolledBack(
                RollbackReason::Panic,
                Answer::Reject(Rejection::HandlerPanicked),
            );
            return (None, None, failed);
        };
        let Attempt {
            body,
            scope,
            fingerprint,
            now,
            config,
            keep_a_copy,
        } = attempt;
        let spare = keep_a_copy.then(|| copy_parts(&parts));
        parts.extensions.insert(transaction.handle());
        parts.extensions.insert(scope);
        let request = Request::from_parts(parts, RequestBody::buffered(body));
        // Panics in the handler (or its response body) end here, with the transaction still
        // owned by this frame: it is rolled back below.
        let call = std::panic::catch_unwind(AssertUnwindSafe(|| inner.call(request)));
        let outcome = match call {
            Ok(call) => {
                let save = config.save.clone();
                let response_limit = config.response_limit;
                CatchUnwind {
                    inner: async move {
                        let response = call.await?;
                        if !save(response.status()) {
                            return Ok(Captured::NotSaved(response));
                        }
                        let (parts, body) = response.into_parts();
                        Ok(match collect_response(body, response_limit).await {
                            Ok((body, trailers)) => Captured::Saveable(parts, body, trailers),
                            Err(rejection) => Captured::Failed(rejection),
                        })
                    },
                }
                .await
            }
            Err(panic) => Err(panic),
        };
        let (reason, answer) = match outcome {
            Ok(Ok(Captured::Saveable(parts, body, trailers)))
                if !is_grpc(&parts.headers)
                    || grpc_status(&parts.headers, trailers.as_ref())
                        .is_some_and(|code| (config.grpc_save)(code)) =>
            {
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
                let finished = match transaction.commit(record).await {
                    Ok(()) => Finished::Committed(parts, body, trailers),
                    Err(error) => Finished::CommitFailed(error),
                };
                return (Some(inner), spare, finished);
            }
            Ok(Ok(Captured::Saveable(parts, body, trailers))) => (
                RollbackReason::NotSaved,
                Answer::Full(parts, body, trailers),
            ),
            Ok(Ok(Captured::NotSaved(response))) => {
                (RollbackReason::NotSaved, Answer::Inner(response))
            }
            Ok(Ok(Captured::Failed(rejection))) => {
                (RollbackReason::Capture, Answer::Reject(rejection))
            }
            Ok(Err(error)) => (RollbackReason::ServiceError, Answer::ServiceError(error)),
            Err(_panic) => (
                RollbackReason::Panic,
                Answer::Reject(Rejection::HandlerPanicked),
            ),
        };
        if let Err(conflict) = roll_back(transaction).await {
            // The handler answered from a transaction the database had already rolled back (or
            // lost).
            return (Some(inner), spare, Finished::CommitFailed(conflict));
        }
        (Some(inner), spare, Finished::RolledBack(reason, answer))
    }
}

/// Rolls back. A serialization conflict that one of the handler's statements hit (a store
/// reports it from `rollback`) is returned, so that the request runs again; so is a database
/// that went away or became read-only under the handler (a failover), so that the request is
/// answered `503` with `Retry-After` rather than with the handler's own error, and so is a
/// statement of the handler's that waited for a lock past the lock timeout
/// ([`Error::LockTimeout`]): the handler's failure is the store's being busy.
pub(super) async fn roll_back<T: Reservation>(transaction: T) -> Result<(), Error> {
    match transaction.rollback().await {
        Err(error)
            if error.is_serialization_conflict()
                || error.is_unavailable()
                || matches!(error, Error::LockTimeout(_)) =>
        {
            Err(error)
        }
        Err(error) => {
            tracing::error!(%error, "idempotency rollback failed");
            Ok(())
        }
        Ok(()) => Ok(()),
    }
}

pin_project! {
    /// Polls a future, turning a panic into an `Err`.
    pub(super) struct CatchUnwind<F> {
        #[pin]
        pub(super) inner: F,
    }
}

impl<F: Future> Future for CatchUnwind<F> {
    type Output = Result<F::Output, Box<dyn Any + Send>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = self.project().inner;
        match std::panic::catch_unwind(AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}
