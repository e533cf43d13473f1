//! [`Completer`]: drives keys left part-way to their end without the client.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::backend::{Acquired, Claim, ProgressCursor, ProgressQuery, ProgressStatus, StepStore};
use super::handle::{Granted, Steps};
use super::mode::{owner, Owned};
use crate::body::RequestBody;
use crate::error::Error;
use crate::layer::{Config, Tenant};
use crate::response::SavedResponse;
use crate::service::steps::{drive, Driven};

/// Finds keys of a step-by-step route that were left part-way (a step done, then the
/// process died, the client gave up, or a foreign service failed, and no retry came) and
/// drives them to their end by calling the route's handler as the layer would, with the
/// request as it was first sent. Made by [`IdempotencyLayer::completer`]; a future you spawn
/// (the library never spawns tasks):
///
/// ```no_run
/// # #[cfg(all(feature = "sqlite", feature = "axum"))]
/// # async fn run() -> Result<(), tower_idempotency::Error> {
/// use std::time::Duration;
/// use axum::routing::post;
/// use tower_idempotency::{steps::Steps, store::sqlite::SqliteStore, IdempotencyLayer};
///
/// async fn checkout(steps: Steps<SqliteStore>) -> &'static str { "..." }
///
/// let store = SqliteStore::open("shop.db").await?;
/// let layer = IdempotencyLayer::new(store).with_operation("checkout").with_steps();
/// let completer = layer
///     .completer(post(checkout))
///     .with_idle(Duration::from_secs(60))
///     .with_max_attempts(5);
/// tokio::spawn(completer.run());
/// # Ok(()) }
/// ```
///
/// A completer serves one operation, its layer's ([`IdempotencyLayer::with_operation`]): it
/// lists and resumes that operation's keys only. A round looks at a page of keys at a time
/// and the next round goes on after it, so every idle key is reached however many others
/// wait. A key is resumed once its lease has passed and it has not changed for the idle time
/// ([`with_idle`](Self::with_idle)), so a client's own retry usually comes first. Each attempt
/// counts; past [`with_max_attempts`](Self::with_max_attempts) the key becomes a dead letter,
/// listed by [`StepStore::progress`] with [`ProgressStatus::Dead`] (the `admin` calls), and
/// left alone (a client's retry may still take it). Keys in doubt wait for an operator.
///
/// The handler gets the [`Steps`] handle, the key's [`Scope`](crate::store::Scope) and a
/// [`Tenant`] in the request extensions; the request's method, path, body, `Content-Type` and
/// `Accept` are as first sent (credentials are not kept).
///
/// [`IdempotencyLayer::completer`]: crate::IdempotencyLayer::completer
/// [`IdempotencyLayer::with_operation`]: crate::IdempotencyLayer::with_operation
pub struct Completer<St, S> {
    store: St,
    config: Arc<Config>,
    operation: Arc<str>,
    /// Where the last round's page ended: the next round starts after it.
    cursor: Option<ProgressCursor>,
    handler: S,
    idle: Duration,
    poll: Duration,
    max_attempts: u32,
    batch: usize,
}

impl<St: fmt::Debug, S> fmt::Debug for Completer<St, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completer")
            .field("store", &self.store)
            .field("operation", &self.operation)
            .field("idle", &self.idle)
            .field("poll", &self.poll)
            .field("max_attempts", &self.max_attempts)
            .finish_non_exhaustive()
    }
}

/// What one [`Completer::run_once`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CompleterReport {
    /// Keys driven to a saved response.
    pub completed: usize,
    /// Keys tried and left for later (a transient failure, a non-final answer).
    pub failed: usize,
    /// Keys that ran out of attempts and became dead letters.
    pub dead: usize,
    /// Rows that could not be read (logged, and counted by
    /// `idempotency_steps_unreadable_total`), skipped.
    pub skipped: usize,
}

impl<St, S> Completer<St, S> {
    pub(crate) fn new(store: St, config: Arc<Config>, operation: Arc<str>, handler: S) -> Self {
        Completer {
            store,
            config,
            operation,
            cursor: None,
            handler,
            idle: Duration::from_secs(60),
            poll: Duration::from_secs(5),
            max_attempts: 5,
            batch: 32,
        }
    }

    /// How long a key must have been left untouched (its lease passed, no step committed)
    /// before the completer resumes it. Default 60 s.
    pub fn with_idle(mut self, idle: Duration) -> Self {
        self.idle = idle;
        self
    }

    /// How often [`run`](Self::run) looks for such keys. Default 5 s.
    pub fn with_poll_interval(mut self, poll: Duration) -> Self {
        self.poll = poll.max(Duration::from_millis(10));
        self
    }

    /// How many times the completer tries a key before it becomes a dead letter. Default 5.
    pub fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }
}

impl<St, S, ResB> Completer<St, S>
where
    St: StepStore,
    S: Service<Request<RequestBody>, Response = Response<ResB>>,
    S::Error: fmt::Display,
    ResB: Body<Data = Bytes>,
{
    /// Resumes abandoned keys every poll interval, forever.
    pub async fn run(mut self) {
        loop {
            match self.run_once().await {
                Ok(report) if report != CompleterReport::default() => {
                    tracing::info!(?report, "completer round");
                }
                Ok(_) => {}
                Err(error) => tracing::warn!(%error, "completer round failed"),
            }
            tokio::time::sleep(self.poll).await;
        }
    }

    /// One round: resumes the keys of its operation abandoned now (a page of them, after
    /// where the last round's ended), one after the other.
    pub async fn run_once(&mut self) -> Result<CompleterReport, Error> {
        let now = SystemTime::now();
        let idle_since = now.checked_sub(self.idle).unwrap_or(SystemTime::UNIX_EPOCH);
        let mut query = ProgressQuery::new(ProgressStatus::Running, self.batch)
            .operation(&*self.operation)
            .after(self.cursor.take());
        query.idle_since = Some(idle_since);
        query.now = now;
        let page = self.store.progress(&query).await?;
        // A full page: the next round goes on after it (the keys this one could not finish
        // do not stay first); else the next round starts again from the oldest.
        self.cursor = page.next;
        let mut report = CompleterReport {
            skipped: page.skipped,
            ..CompleterReport::default()
        };
        for progress in page.keys {
            let lease = self
                .config
                .steps
                .as_ref()
                .map_or(Duration::from_secs(30), |mode| mode.lease);
            let now = SystemTime::now();
            let claim = Claim {
                scope: progress.scope.clone(),
                fingerprint: progress.fingerprint,
                request: None,
                owner: owner(),
                lease_until: now + lease,
                now,
                max_attempts: Some(self.max_attempts),
                expires_at: self.config.expires_at(now),
                wait: self.config.lock_timeout,
            };
            let (generation, run, steps) = match self.store.acquire(&claim).await {
                Ok(Acquired::Owned {
                    generation,
                    run,
                    steps,
                }) => (generation, run, steps),
                Err(error) => {
                    tracing::warn!(%error, key = %progress.scope.key.redacted_lazily(), "the completer could not claim a key");
                    report.failed += 1;
                    continue;
                }
                Ok(Acquired::Dead) => {
                    tracing::warn!(key = %progress.scope.key.redacted_lazily(), "key dead-lettered after its attempts");
                    report.dead += 1;
                    continue;
                }
                // Taken, finished or settled meanwhile.
                Ok(_) => continue,
            };
            let granted = Granted {
                scope: progress.scope.clone(),
                generation,
                run,
                steps,
                lease,
                lease_until: claim.lease_until,
                wait: claim.wait,
            };
            let handle = Steps::new(self.store.clone(), granted);
            let Some(parts) = request_parts(&progress.request, &progress.scope) else {
                tracing::error!("a saved request does not parse; left for an operator");
                report.failed += 1;
                continue;
            };
            if let Err(error) = std::future::poll_fn(|cx| self.handler.poll_ready(cx)).await {
                tracing::warn!(%error, "the completer's handler is not ready");
                let _ = Owned::release(&handle).await;
                report.failed += 1;
                continue;
            }
            let driven = drive(
                Box::new(handle),
                &mut self.handler,
                parts,
                progress.request.body.clone(),
                progress.scope.clone(),
                progress.fingerprint,
                &self.config,
            )
            .await;
            match driven {
                Driven::Saved(parts, ..) => {
                    tracing::info!(status = %parts.status, "completer finished a key");
                    report.completed += 1;
                }
                Driven::Answer(_) => report.failed += 1,
            }
        }
        Ok(report)
    }
}

/// The head of the saved request, with the key's tenant and scope in its extensions.
fn request_parts(
    saved: &super::backend::SavedRequest,
    scope: &crate::store::Scope,
) -> Option<http::request::Parts> {
    let mut builder = Request::builder()
        .method(saved.method.as_str())
        .uri(saved.uri.as_str());
    for (name, value) in SavedResponse::decode_headers(&saved.headers).ok()? {
        builder = builder.header(name, value);
    }
    let mut request = builder.body(()).ok()?;
    request
        .extensions_mut()
        .insert(Tenant::new(scope.tenant.clone()));
    Some(request.into_parts().0)
}
