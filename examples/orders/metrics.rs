//! `GET /metrics`: what the layer recorded (feature `metrics`), in the Prometheus text format,
//! rendered by `metrics-exporter-prometheus` from the process's recorder.
//!
//! ```text
//! curl -s http://127.0.0.1:3000/metrics | grep idempotency_
//! ```

use std::time::Duration;

use axum::http::header::CONTENT_TYPE;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
/// The layer's lock-wait histogram (see the crate's `metrics` module).
const LOCK_WAIT_SECONDS: &str = "idempotency_lock_wait_seconds";

use super::BoxError;

/// Upper bounds of the lock-wait histogram's buckets, in seconds: a replay or a free writer
/// takes well under a millisecond, a busy one up to the lock timeout (5 s by default).
const LOCK_WAIT_BUCKETS: [f64; 10] = [0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0];

/// Installs the Prometheus recorder for the whole process and spawns its upkeep (the library
/// never spawns background work; the application does). Call it once.
pub(crate) fn install() -> Result<PrometheusHandle, BoxError> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(LOCK_WAIT_SECONDS.into()), &LOCK_WAIT_BUCKETS)?
        .install_recorder()?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

/// The `/metrics` route. Left outside the authentication layer, as scrapers expect: it shows
/// counts per operation and outcome, never a key or a tenant.
pub(crate) fn routes(handle: PrometheusHandle) -> Router {
    Router::new().route(
        "/metrics",
        get(move || {
            let text = handle.render();
            async move { ([(CONTENT_TYPE, "text/plain; version=0.0.4")], text) }
        }),
    )
}
