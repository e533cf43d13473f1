#![doc = include_str!("docs/metrics.md")]

#[cfg(feature = "metrics")]
use std::sync::Arc;
use std::time::Duration;

use crate::layer::Config;

/// Counter: requests the layer handled, labelled `operation` and `outcome` ([`Outcome`]).
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub(crate) const REQUESTS_TOTAL: &str = "idempotency_requests_total";
/// Counter: transactions rolled back after the handler was called, labelled `operation` and
/// `reason` ([`RollbackReason`]).
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub(crate) const HANDLER_ROLLBACKS_TOTAL: &str = "idempotency_handler_rollbacks_total";
/// Histogram (seconds): how long opening the write transaction took, labelled `operation`.
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub(crate) const LOCK_WAIT_SECONDS: &str = "idempotency_lock_wait_seconds";
/// Gauge: pending outbox events (not yet delivered, not dead-lettered).
#[cfg_attr(not(all(feature = "metrics", feature = "outbox")), allow(dead_code))]
pub(crate) const OUTBOX_BACKLOG: &str = "outbox_backlog";
/// Gauge: dead-lettered outbox events.
#[cfg_attr(not(all(feature = "metrics", feature = "outbox")), allow(dead_code))]
pub(crate) const OUTBOX_DEAD_LETTERS: &str = "outbox_dead_letters";
/// Counter: events delivered, labelled `topic`.
#[cfg_attr(not(all(feature = "metrics", feature = "outbox")), allow(dead_code))]
pub(crate) const OUTBOX_DELIVERED_TOTAL: &str = "outbox_delivered_total";
/// Counter: failed delivery attempts, labelled `topic`.
#[cfg_attr(not(all(feature = "metrics", feature = "outbox")), allow(dead_code))]
pub(crate) const OUTBOX_DELIVERY_FAILURES_TOTAL: &str = "outbox_delivery_failures_total";
/// Counter: events dead-lettered, labelled `topic`.
#[cfg_attr(not(all(feature = "metrics", feature = "outbox")), allow(dead_code))]
pub(crate) const OUTBOX_DEAD_LETTERED_TOTAL: &str = "outbox_dead_lettered_total";
/// Histogram (seconds): how long one delivery took, labelled `topic`.
#[cfg_attr(not(all(feature = "metrics", feature = "outbox")), allow(dead_code))]
pub(crate) const OUTBOX_DELIVERY_SECONDS: &str = "outbox_delivery_seconds";
/// Counter: events offered to an inbox, labelled `consumer` and `result`
/// (`processed` or `duplicate`).
#[cfg_attr(
    not(all(feature = "metrics", feature = "outbox", feature = "_sql-store")),
    allow(dead_code)
)]
pub(crate) const INBOX_EVENTS_TOTAL: &str = "inbox_events_total";

/// Counter: rows of a step-by-step key in progress that could not be read, skipped by a
/// listing (the completer's or the admin's), labelled `table`.
#[cfg_attr(
    not(all(feature = "metrics", feature = "_sql-store")),
    allow(dead_code)
)]
pub(crate) const STEPS_UNREADABLE_TOTAL: &str = "idempotency_steps_unreadable_total";

/// The `outcome` label of `idempotency_requests_total`: how the layer answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The handler ran and its response was saved and committed.
    Executed,
    /// A saved response was replayed.
    Replayed,
    /// The key was reused with a different payload.
    Conflict,
    /// The store stayed busy past the lock timeout (`503`).
    Busy,
    /// A request with the same key was still running and the layer's in-flight policy
    /// answered `409` ([`InFlight`](crate::InFlight)).
    InFlight,
    /// The layer refused the request before the store (bad or missing key, no tenant, body
    /// too large or too slow, invalid payload).
    Rejected,
    /// The handler ran but nothing was kept (see [`RollbackReason`]).
    RolledBack,
    /// The store failed (`500`).
    Error,
}

impl Outcome {
    /// Every outcome, in [`index`](Self::index) order.
    #[cfg(feature = "metrics")]
    const ALL: [Outcome; 8] = [
        Outcome::Executed,
        Outcome::Replayed,
        Outcome::Conflict,
        Outcome::Busy,
        Outcome::InFlight,
        Outcome::Rejected,
        Outcome::RolledBack,
        Outcome::Error,
    ];

    /// Where this outcome is in [`ALL`](Self::ALL).
    #[cfg(feature = "metrics")]
    fn index(self) -> usize {
        match self {
            Outcome::Executed => 0,
            Outcome::Replayed => 1,
            Outcome::Conflict => 2,
            Outcome::Busy => 3,
            Outcome::InFlight => 4,
            Outcome::Rejected => 5,
            Outcome::RolledBack => 6,
            Outcome::Error => 7,
        }
    }

    /// The label value.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Executed => "executed",
            Outcome::Replayed => "replayed",
            Outcome::Conflict => "conflict",
            Outcome::Busy => "busy",
            Outcome::InFlight => "in_flight",
            Outcome::Rejected => "rejected",
            Outcome::RolledBack => "rolled_back",
            Outcome::Error => "error",
        }
    }
}

/// The `reason` label of `idempotency_handler_rollbacks_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RollbackReason {
    /// The response was not saveable (a non-2xx status by default, a non-OK gRPC status).
    NotSaved,
    /// The inner service returned an error.
    ServiceError,
    /// The handler panicked.
    Panic,
    /// The response could not be captured (too large, or its body failed).
    Capture,
    /// Saving the record or the commit failed.
    CommitFailed,
    /// The database threw the transaction away (a serialization failure or a deadlock, or
    /// another member of a SQLite commit group failed) and the request runs again, within
    /// the layer's conflict retries.
    Rerun,
}

impl RollbackReason {
    /// The label value.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            RollbackReason::NotSaved => "not_saved",
            RollbackReason::ServiceError => "service_error",
            RollbackReason::Panic => "panic",
            RollbackReason::Capture => "capture_failed",
            RollbackReason::CommitFailed => "commit_failed",
            RollbackReason::Rerun => "rerun",
        }
    }
}

// The recording functions below are the only places that touch the `metrics` crate, so that
// the rest of the crate calls them unconditionally and the feature switch lives here. The
// `operation` label is the layer's operation name, or `UNNAMED_OPERATION` for a layer without
// one: never the request's path, which the client picks (one series per path ever sent would
// grow without bound). A label made from the name shares it (no copy per request).

/// The `operation` label of a layer without an
/// [operation name](crate::IdempotencyLayer::with_operation).
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub(crate) const UNNAMED_OPERATION: &str = "(unnamed)";

/// The keys of a layer's per-request metrics (`idempotency_requests_total` by outcome,
/// `idempotency_handler_rollbacks_total`'s label and `idempotency_lock_wait_seconds`), made
/// once for the layer's configuration rather than on every request: a key's labels and hash
/// are built when it is made.
#[derive(Default)]
pub(crate) struct Keys {
    #[cfg(feature = "metrics")]
    made: std::sync::OnceLock<Made>,
}

#[cfg(feature = "metrics")]
struct Made {
    /// The `operation` label.
    operation: Arc<str>,
    /// By [`Outcome::index`].
    requests: [metrics::Key; Outcome::ALL.len()],
    lock_wait: metrics::Key,
}

#[cfg(feature = "metrics")]
impl Keys {
    /// The keys of the layer named `operation` (`None`: unnamed), made at the first call. A
    /// configuration has one name: a changed one makes its keys afresh (see `Clone`).
    fn of(&self, operation: Option<&Arc<str>>) -> &Made {
        self.made.get_or_init(|| {
            let operation = operation.map_or_else(|| Arc::from(UNNAMED_OPERATION), Arc::clone);
            Made {
                requests: Outcome::ALL.map(|outcome| request_key(&operation, outcome)),
                lock_wait: lock_wait_key(&operation),
                operation,
            }
        })
    }
}

/// A changed configuration makes its keys afresh (its operation may be another).
impl Clone for Keys {
    fn clone(&self) -> Self {
        Keys::default()
    }
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keys").finish_non_exhaustive()
    }
}

/// What `metrics::counter!` and `metrics::histogram!` register a metric with here.
#[cfg(feature = "metrics")]
static METADATA: metrics::Metadata<'static> =
    metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

#[cfg(feature = "metrics")]
fn request_key(operation: &Arc<str>, outcome: Outcome) -> metrics::Key {
    let labels = [
        metrics::Label::new("operation", operation.clone()),
        metrics::Label::new("outcome", outcome.as_str()),
    ];
    metrics::Key::from_parts(REQUESTS_TOTAL, labels.to_vec())
}

#[cfg(feature = "metrics")]
fn lock_wait_key(operation: &Arc<str>) -> metrics::Key {
    let labels = [metrics::Label::new("operation", operation.clone())];
    metrics::Key::from_parts(LOCK_WAIT_SECONDS, labels.to_vec())
}

/// Counts one request the layer handled.
pub(crate) fn request(config: &Config, outcome: Outcome) {
    #[cfg(feature = "metrics")]
    count_request(&config.metric_keys, config.operation.as_ref(), outcome);
    #[cfg(not(feature = "metrics"))]
    let _ = (config, outcome);
}

#[cfg(feature = "metrics")]
fn count_request(keys: &Keys, operation: Option<&Arc<str>>, outcome: Outcome) {
    let key = &keys.of(operation).requests[outcome.index()];
    metrics::with_recorder(|recorder| recorder.register_counter(key, &METADATA)).increment(1);
}

/// Counts one rollback after the handler was called.
pub(crate) fn rollback(config: &Config, reason: RollbackReason) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        HANDLER_ROLLBACKS_TOTAL,
        "operation" => config.metric_keys.of(config.operation.as_ref()).operation.clone(),
        "reason" => reason.as_str()
    )
    .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (config, reason);
}

/// Counts a request whose handler ran but whose transaction was rolled back.
pub(crate) fn rolled_back(config: &Config, reason: RollbackReason) {
    rollback(config, reason);
    request(config, Outcome::RolledBack);
}

/// Records how long opening the write transaction took.
pub(crate) fn lock_wait(config: &Config, waited: Duration) {
    #[cfg(feature = "metrics")]
    record_lock_wait(&config.metric_keys, config.operation.as_ref(), waited);
    #[cfg(not(feature = "metrics"))]
    let _ = (config, waited);
}

#[cfg(feature = "metrics")]
fn record_lock_wait(keys: &Keys, operation: Option<&Arc<str>>, waited: Duration) {
    let key = &keys.of(operation).lock_wait;
    metrics::with_recorder(|recorder| recorder.register_histogram(key, &METADATA))
        .record(waited.as_secs_f64());
}

/// Reports a row of `idempotency_progress` that a listing skipped: logged at error level (with
/// the row's scope as stored, its key redacted) and counted.
#[cfg(feature = "_sql-store")]
pub(crate) fn unreadable_progress(tenant: &str, operation: &str, key: &str, error: &crate::Error) {
    let key = crate::key::IdempotencyKey::from_unquoted(key)
        .map_or_else(|_| "(not a key)".to_owned(), |key| key.redacted());
    tracing::error!(
        tenant,
        operation,
        key,
        %error,
        "a step-by-step key in progress could not be read; skipped"
    );
    #[cfg(feature = "metrics")]
    metrics::counter!(STEPS_UNREADABLE_TOTAL, "table" => "idempotency_progress").increment(1);
}

/// The outbox relay's events (feature `outbox`).
#[cfg(feature = "outbox")]
pub(crate) mod outbox {
    use std::time::Duration;

    /// Sets the backlog gauges.
    pub(crate) fn backlog(pending: u64, dead: u64) {
        #[cfg(feature = "metrics")]
        {
            // Gauges are f64; a backlog past 2^53 events is not a concern.
            metrics::gauge!(super::OUTBOX_BACKLOG).set(pending as f64);
            metrics::gauge!(super::OUTBOX_DEAD_LETTERS).set(dead as f64);
        }
        #[cfg(not(feature = "metrics"))]
        let _ = (pending, dead);
    }

    /// One delivery attempt: accepted or failed, and how long it took.
    pub(crate) fn delivery(topic: &str, accepted: bool, took: Duration) {
        #[cfg(feature = "metrics")]
        {
            let name = if accepted {
                super::OUTBOX_DELIVERED_TOTAL
            } else {
                super::OUTBOX_DELIVERY_FAILURES_TOTAL
            };
            metrics::counter!(name, "topic" => topic.to_owned()).increment(1);
            metrics::histogram!(super::OUTBOX_DELIVERY_SECONDS, "topic" => topic.to_owned())
                .record(took.as_secs_f64());
        }
        #[cfg(not(feature = "metrics"))]
        let _ = (topic, accepted, took);
    }

    /// An event moved to the dead-letter state.
    pub(crate) fn dead_lettered(topic: &str) {
        #[cfg(feature = "metrics")]
        metrics::counter!(super::OUTBOX_DEAD_LETTERED_TOTAL, "topic" => topic.to_owned())
            .increment(1);
        #[cfg(not(feature = "metrics"))]
        let _ = topic;
    }

    /// An event offered to an inbox.
    #[cfg(feature = "_sql-store")]
    pub(crate) fn inbox(consumer: &str, first: bool) {
        #[cfg(feature = "metrics")]
        metrics::counter!(
            super::INBOX_EVENTS_TOTAL,
            "consumer" => consumer.to_owned(),
            "result" => if first { "processed" } else { "duplicate" }
        )
        .increment(1);
        #[cfg(not(feature = "metrics"))]
        let _ = (consumer, first);
    }
}

#[cfg(all(test, feature = "metrics"))]
mod tests {
    use std::collections::HashMap;

    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    use super::*;

    /// Everything recorded by `recorder` so far, by `name{label=value,...}`.
    fn recorded(snapshotter: &metrics_util::debugging::Snapshotter) -> HashMap<String, DebugValue> {
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, _, _, value)| {
                let labels: Vec<String> = key
                    .key()
                    .labels()
                    .map(|label| format!("{}={}", label.key(), label.value()))
                    .collect();
                (
                    format!("{}{{{}}}", key.key().name(), labels.join(",")),
                    value,
                )
            })
            .collect()
    }

    #[test]
    fn a_named_layer_is_labelled_with_its_name_and_an_unnamed_one_with_one_fixed_label() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let (named, unnamed) = (Keys::default(), Keys::default());
        let name: Arc<str> = Arc::from("create_order");
        metrics::with_local_recorder(&recorder, || {
            count_request(&named, Some(&name), Outcome::Executed);
            count_request(&named, Some(&name), Outcome::Executed);
            count_request(&unnamed, None, Outcome::Executed);
            count_request(&unnamed, None, Outcome::Replayed);
            record_lock_wait(&named, Some(&name), Duration::from_millis(5));
            record_lock_wait(&unnamed, None, Duration::from_millis(7));
        });
        let recorded = recorded(&snapshotter);
        let counter = |key: &str| match recorded.get(key) {
            Some(DebugValue::Counter(n)) => *n,
            other => panic!("{key}: {other:?} in {recorded:?}"),
        };
        let requests = |operation: &str, outcome: &str| {
            counter(&format!(
                "{REQUESTS_TOTAL}{{operation={operation},outcome={outcome}}}"
            ))
        };
        assert_eq!(requests("create_order", "executed"), 2);
        assert_eq!(requests(UNNAMED_OPERATION, "executed"), 1);
        assert_eq!(requests(UNNAMED_OPERATION, "replayed"), 1);
        for (operation, seconds) in [("create_order", 0.005), (UNNAMED_OPERATION, 0.007)] {
            let key = format!("{LOCK_WAIT_SECONDS}{{operation={operation}}}");
            match recorded.get(&key) {
                Some(DebugValue::Histogram(values)) => {
                    assert_eq!(values.iter().map(|v| v.0).collect::<Vec<_>>(), [seconds])
                }
                other => panic!("{key}: {other:?}"),
            }
        }
        assert_eq!(recorded.len(), 5, "{recorded:?}");
    }
}
