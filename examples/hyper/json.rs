//! The JSON answers of `examples/hyper_orders.rs`: a body with its `Content-Type`, and the
//! `{"error":"<code>"}` bodies the app writes (the layer writes its own the same way).

use bytes::Bytes;
use http::header::{ALLOW, CONTENT_TYPE};
use http::{HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};

use crate::Body;

/// `value` as an `application/json` answer with this status.
pub fn full_json(status: StatusCode, value: &Value) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(value.to_string())));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// `{"error":"<code>"}` with this status, as the handler answers.
pub fn full_json_error(status: StatusCode, code: &str) -> Response<Full<Bytes>> {
    full_json(status, &json!({ "error": code }))
}

/// `500 {"error":"internal_error"}` (what failed is logged, not told).
pub fn internal_error() -> Response<Full<Bytes>> {
    full_json_error(StatusCode::INTERNAL_SERVER_ERROR, "internal_error")
}

/// `{"error":"<code>"}` with this status, as the router answers.
pub fn json_error(status: StatusCode, code: &str) -> Response<Body> {
    full_json_error(status, code).map(BodyExt::boxed_unsync)
}

/// `405` with the method the path allows.
pub fn method_not_allowed(allow: &'static str) -> Response<Body> {
    let mut response = json_error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed");
    response
        .headers_mut()
        .insert(ALLOW, HeaderValue::from_static(allow));
    response
}
