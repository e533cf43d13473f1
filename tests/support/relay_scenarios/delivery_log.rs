//! A receiver's log of deliveries, as the end-to-end tests read it: the event id each came
//! with and what the receiver answered. Shared by the logging proxy in front of the inventory
//! example and the PostgreSQL test receiver.

use std::sync::{Arc, Mutex};

use axum::response::Response;
use http::{HeaderMap, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use tower_idempotency::IDEMPOTENCY_KEY;

/// One delivery as the receiver saw it: the event id header and what it answered.
#[derive(Clone, Debug)]
pub struct Delivery {
    pub event_id: String,
    pub status: StatusCode,
    pub answer: Value,
    /// Answered by the layer from a saved response (`Idempotent-Replayed: true`).
    pub replayed: bool,
}

/// The deliveries, in the order they were answered.
pub type DeliveryLog = Arc<Mutex<Vec<Delivery>>>;

/// The `Idempotency-Key` a delivery came with (empty without one).
pub fn event_id_header(headers: &HeaderMap) -> String {
    headers
        .get(IDEMPOTENCY_KEY)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// Logs `response`, the answer to a delivery of `event_id`, and returns it.
pub async fn log_answer(log: &DeliveryLog, event_id: String, response: Response) -> Response {
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("the answer").to_bytes();
    log.lock().expect("deliveries").push(Delivery {
        event_id,
        status: parts.status,
        answer: serde_json::from_slice(&body).unwrap_or(Value::Null),
        replayed: parts.headers.contains_key("idempotent-replayed"),
    });
    Response::from_parts(parts, axum::body::Body::from(body))
}
