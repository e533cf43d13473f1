//! The relay: claims due events, delivers them through the sink, records the outcome.

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures_util::FutureExt;
use tokio::time::Instant;
use tower_service::Service;

use super::{
    backoff, is_permanent, ClaimRequest, LeaseToken, OutboxEvent, OutboxStore, Settlement,
};
use crate::body::BoxError;
use crate::error::Error;
use crate::metrics::outbox as record;

/// How much of a failure's message is kept as the event's last error.
const MAX_ERROR_LEN: usize = 1000;

/// Delivers outbox events through a sink, at least once; see the [module docs](super).
///
/// A future you spawn ([`run`](Self::run)); dropping it at any point is safe: events it had
/// claimed are delivered again (with the same id) once their lease runs out.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use serde_json::json;
/// use tower_idempotency::outbox::{sink_fn, Outbox, OutboxEvent, Relay};
/// use tower_idempotency::store::sqlite::SqliteStore;
///
/// # let dir = tempfile::tempdir()?;
/// let store = SqliteStore::open(dir.path().join("orders.db")).await?;
/// let outbox = Outbox::install(&store).await?;
/// store.write(|tx| Outbox::<SqliteStore>::enqueue_in(tx, "order_created", &json!({ "order_id": 1 }))).await?;
///
/// let mut relay = Relay::new(outbox, sink_fn(|event: OutboxEvent| async move {
///     assert_eq!(event.payload(), r#"{"order_id":1}"#);
///     Ok::<(), std::io::Error>(())
/// }))
/// .with_max_attempts(5)
/// .with_backoff(Duration::from_secs(1), Duration::from_secs(300));
///
/// // One round by hand (a test, a cron job)...
/// assert_eq!(relay.run_once().await?.delivered, 1);
/// // ...or forever, in a task of your own: `tokio::spawn(relay.run());`
/// # Ok(()) }
/// ```
pub struct Relay<O, S> {
    outbox: O,
    sink: S,
    /// Makes this relay's lease tokens unique among all relays on the same outbox.
    id: Arc<str>,
    rounds: u64,
    batch: usize,
    lease: Duration,
    delivery_timeout: Duration,
    max_attempts: u32,
    initial_backoff: Duration,
    max_backoff: Duration,
    poll_interval: Duration,
    last_sampled: Option<Instant>,
}

impl<O: fmt::Debug, S> fmt::Debug for Relay<O, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("outbox", &self.outbox)
            .field("id", &self.id)
            .field("batch", &self.batch)
            .field("lease", &self.lease)
            .field("delivery_timeout", &self.delivery_timeout)
            .field("max_attempts", &self.max_attempts)
            .field("initial_backoff", &self.initial_backoff)
            .field("max_backoff", &self.max_backoff)
            .field("poll_interval", &self.poll_interval)
            .finish_non_exhaustive()
    }
}

/// What one [`Relay::run_once`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RoundReport {
    /// Events claimed (and delivered, successfully or not).
    pub claimed: usize,
    /// Events the sink accepted.
    pub delivered: usize,
    /// Events that failed and were scheduled again.
    pub retried: usize,
    /// Events moved to the dead-letter state (failed ones and abandoned ones).
    pub dead_lettered: usize,
}

impl<O, S> Relay<O, S> {
    /// A relay delivering the events of `outbox` through `sink`, with the defaults listed on
    /// each setter.
    pub fn new(outbox: O, sink: S) -> Self {
        Relay {
            outbox,
            sink,
            id: Arc::from(uuid::Uuid::new_v4().simple().to_string()),
            rounds: 0,
            batch: 16,
            lease: Duration::from_secs(60),
            delivery_timeout: Duration::from_secs(10),
            max_attempts: 10,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(600),
            poll_interval: Duration::from_millis(500),
            last_sampled: None,
        }
    }

    /// How many events one round claims and delivers (concurrently). Default: 16.
    pub fn with_batch_size(mut self, batch: usize) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// How long a claim holds: while it does, no other relay delivers the claimed events; once
    /// it runs out (this relay died), they are delivered again. Default: 60 s. Each delivery is
    /// cut off at half the lease at most, so that a claim never runs out while its relay is
    /// still delivering.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_millis(2));
        self
    }

    /// How long the sink may take for one event before the attempt counts as failed.
    /// Default: 10 s (and at most half the lease).
    pub fn with_delivery_timeout(mut self, timeout: Duration) -> Self {
        self.delivery_timeout = timeout;
        self
    }

    /// After this many failed attempts an event is dead-lettered. Default: 10.
    pub fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The wait after the first failure, doubled after each further one up to `max`, with
    /// jitter (a random point in the upper half of each wait). Default: 1 s up to 10 min.
    pub fn with_backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.initial_backoff = initial;
        self.max_backoff = max.max(initial);
        self
    }

    /// How long [`run`](Self::run) sleeps when nothing was due. Default: 500 ms.
    pub fn with_poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// The outbox.
    pub fn outbox(&self) -> &O {
        &self.outbox
    }

    /// The sink.
    pub fn sink(&self) -> &S {
        &self.sink
    }
}

impl<O, S> Relay<O, S>
where
    O: OutboxStore,
    S: Service<OutboxEvent> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
{
    /// Delivers events forever: a round ([`run_once`](Self::run_once)) after another, at once
    /// while full batches come back, else every poll interval. Store failures are logged and
    /// retried after the poll interval.
    pub async fn run(mut self) {
        loop {
            let wait = match self.run_once().await {
                Ok(report) if report.claimed >= self.batch => None,
                Ok(_) => Some(self.poll_interval),
                Err(error) => {
                    tracing::warn!(%error, "outbox relay round failed; retrying");
                    Some(self.poll_interval)
                }
            };
            match wait {
                Some(wait) => tokio::time::sleep(wait).await,
                // More may be due: go on, but let other tasks on this thread run first.
                None => tokio::task::yield_now().await,
            }
        }
    }

    /// One round: claims up to a batch of due events, delivers them concurrently, and records
    /// each outcome (delivered, retry later, or dead letter).
    pub async fn run_once(&mut self) -> Result<RoundReport, Error> {
        self.sample_backlog().await;
        self.rounds += 1;
        let token = LeaseToken::new(format!("{}:{}", self.id, self.rounds));
        let claimed = self
            .outbox
            .claim(ClaimRequest {
                token: token.clone(),
                batch: self.batch,
                lease: self.lease,
                max_attempts: self.max_attempts,
                now: SystemTime::now(),
            })
            .await?;
        let mut report = RoundReport {
            claimed: claimed.events.len(),
            dead_lettered: claimed.abandoned.len(),
            ..RoundReport::default()
        };
        for event in &claimed.abandoned {
            tracing::error!(
                event_id = %event.id(),
                topic = event.topic(),
                "outbox event dead-lettered: its last attempt was abandoned (lease ran out)"
            );
            record::dead_lettered(event.topic());
        }
        if claimed.events.is_empty() {
            return Ok(report);
        }

        let timeout = self.delivery_timeout.min(self.lease / 2);
        let deliveries = claimed.events.into_iter().map(|event| {
            let sink = self.sink.clone();
            async move {
                let started = Instant::now();
                let result = deliver(sink, event.clone(), timeout).await;
                record::delivery(event.topic(), result.is_ok(), started.elapsed());
                (event, result)
            }
        });
        let outcomes = futures_util::future::join_all(deliveries).await;

        let now = SystemTime::now();
        let mut settlements = Vec::with_capacity(outcomes.len());
        for (event, result) in outcomes {
            let id = event.id().clone();
            let error = match result {
                Ok(()) => {
                    tracing::debug!(event_id = %id, topic = event.topic(), "outbox event delivered");
                    report.delivered += 1;
                    settlements.push(Settlement::Delivered { id });
                    continue;
                }
                Err(error) => error,
            };
            let message = describe(&*error);
            if is_permanent(&error) || event.attempt() >= self.max_attempts {
                tracing::error!(
                    event_id = %id,
                    topic = event.topic(),
                    attempt = event.attempt(),
                    error = %message,
                    "outbox event dead-lettered"
                );
                record::dead_lettered(event.topic());
                report.dead_lettered += 1;
                settlements.push(Settlement::Dead {
                    id,
                    token: token.clone(),
                    error: message,
                });
            } else {
                let delay = backoff(event.attempt(), self.initial_backoff, self.max_backoff);
                tracing::warn!(
                    event_id = %id,
                    topic = event.topic(),
                    attempt = event.attempt(),
                    retry_in = ?delay,
                    error = %message,
                    "outbox delivery failed; will retry"
                );
                report.retried += 1;
                settlements.push(Settlement::Retry {
                    id,
                    token: token.clone(),
                    at: now + delay,
                    error: message,
                });
            }
        }
        // If this fails the events stay claimed until the lease runs out, then are delivered
        // again: at least once, never lost.
        self.outbox.settle(settlements).await?;
        Ok(report)
    }

    /// Sets the backlog gauges, at most once per poll interval (only with the `metrics`
    /// feature: without it there is nothing to report and the count is not worth a query).
    async fn sample_backlog(&mut self) {
        if !cfg!(feature = "metrics")
            || self
                .last_sampled
                .is_some_and(|at| at.elapsed() < self.poll_interval)
        {
            return;
        }
        self.last_sampled = Some(Instant::now());
        match self.outbox.backlog().await {
            Ok(backlog) => record::backlog(backlog.pending, backlog.dead),
            Err(error) => tracing::warn!(%error, "counting the outbox backlog failed"),
        }
    }
}

/// One delivery attempt: readiness, the call, bounded by `timeout`; a panicking sink is a
/// failed attempt, not a dead relay.
async fn deliver<S>(mut sink: S, event: OutboxEvent, timeout: Duration) -> Result<(), BoxError>
where
    S: Service<OutboxEvent>,
    S::Error: Into<BoxError>,
{
    let attempt = async move {
        std::future::poll_fn(|cx| sink.poll_ready(cx))
            .await
            .map_err(Into::into)?;
        sink.call(event).await.map(drop).map_err(Into::into)
    };
    match tokio::time::timeout(timeout, AssertUnwindSafe(attempt).catch_unwind()).await {
        Ok(Ok(result)) => result,
        Ok(Err(_panic)) => Err("the sink panicked".into()),
        Err(_elapsed) => Err(format!("the sink did not answer within {timeout:?}").into()),
    }
}

/// The error and its sources, `: `-separated, truncated for storage.
fn describe(error: &(dyn std::error::Error + 'static)) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        // Wrappers often repeat their source's message; say it once.
        if !message.ends_with(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    if message.len() > MAX_ERROR_LEN {
        let mut end = MAX_ERROR_LEN;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push('…');
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::Permanent;

    #[test]
    fn describe_joins_sources_once_and_truncates() {
        let error = Permanent::new("no such sku");
        assert_eq!(describe(&error), "permanent: no such sku");
        let long = std::io::Error::other("é".repeat(MAX_ERROR_LEN));
        let message = describe(&long);
        assert!(message.len() <= MAX_ERROR_LEN + '…'.len_utf8());
        assert!(message.ends_with('…'));
    }
}
