//! The layer's own answers as RFC 9457 problem details (`application/problem+json`), the way
//! the IETF draft `draft-ietf-httpapi-idempotency-key-header` shows them.
//!
//! [`IdempotencyLayer::with_ietf_draft`](crate::IdempotencyLayer::with_ietf_draft) turns this on together with the
//! draft's statuses; [`IdempotencyLayer::with_problem_details`](crate::IdempotencyLayer::with_problem_details)
//! turns on the bodies alone. Every answer carries `type` (a stable URI per rejection: the
//! documentation URI with the rejection's code as fragment), `title`, `status`, `detail` and
//! `code` (the same code as the default `{"error": code}` body). The answers about the key
//! (missing, malformed, reused with another payload, in flight) also carry
//! `Link: <documentation>; rel="describedby"; type="text/html"`, as the draft shows.
//!
//! ```
//! use tower_idempotency::problem::ProblemDetails;
//! use tower_idempotency::Rejection;
//!
//! let problems = ProblemDetails::new("https://developer.example.com/idempotency");
//! assert_eq!(
//!     problems.type_uri(&Rejection::MissingKey),
//!     "https://developer.example.com/idempotency#missing_idempotency_key"
//! );
//! ```

use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};

use crate::error::Rejection;

/// The media type of RFC 9457 problem details in JSON.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Where the problem types are documented by default: this module's page on docs.rs.
pub const DEFAULT_DOCUMENTATION: &str =
    "https://docs.rs/tower-idempotency/latest/tower_idempotency/problem/index.html";

/// How the layer writes its own answers as problem details: the documentation URI their
/// `type` and `Link` point to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProblemDetails {
    documentation: Arc<str>,
}

impl Default for ProblemDetails {
    /// Types under [`DEFAULT_DOCUMENTATION`].
    fn default() -> Self {
        ProblemDetails::new(DEFAULT_DOCUMENTATION)
    }
}

impl ProblemDetails {
    /// Problem types documented at `documentation` (your API's page on idempotency keys).
    pub fn new(documentation: impl Into<Arc<str>>) -> Self {
        ProblemDetails {
            documentation: documentation.into(),
        }
    }

    /// The documentation URI.
    pub fn documentation(&self) -> &str {
        &self.documentation
    }

    /// The `type` of a rejection: the documentation URI with the rejection's
    /// [code](Rejection::code) as fragment. Stable: codes do not change.
    pub fn type_uri(&self, rejection: &Rejection) -> String {
        format!("{}#{}", self.documentation, rejection.code())
    }

    /// The problem-details answer to `rejection` with `status`.
    pub fn response(&self, rejection: &Rejection, status: StatusCode) -> Response<Bytes> {
        let body = serde_json::json!({
            "type": self.type_uri(rejection),
            "title": title(rejection),
            "status": status.as_u16(),
            "detail": detail(rejection),
            "code": rejection.code(),
        });
        let mut response = Response::new(Bytes::from(body.to_string()));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        headers.insert(header::CONTENT_LANGUAGE, HeaderValue::from_static("en"));
        if is_about_the_key(rejection) {
            let link = format!(
                "<{}>; rel=\"describedby\"; type=\"text/html\"",
                self.documentation
            );
            // A documentation URI that is not a valid header value only loses its `Link`.
            if let Ok(link) = HeaderValue::try_from(link) {
                headers.insert(header::LINK, link);
            }
        }
        response
    }
}

/// The answers the draft shows with a `Link` to the documentation.
fn is_about_the_key(rejection: &Rejection) -> bool {
    matches!(
        rejection,
        Rejection::MissingKey
            | Rejection::DuplicateKeyHeader
            | Rejection::InvalidKey(_)
            | Rejection::KeyReused
            | Rejection::InFlight
    )
}

/// The short summary: the draft's titles where it gives one.
fn title(rejection: &Rejection) -> &'static str {
    match rejection {
        Rejection::MissingKey => "Idempotency-Key is missing",
        Rejection::DuplicateKeyHeader => "Idempotency-Key is sent more than once",
        Rejection::InvalidKey(_) => "Idempotency-Key is malformed",
        Rejection::KeyReused => "Idempotency-Key is already used",
        Rejection::InFlight => "A request is outstanding for this Idempotency-Key",
        Rejection::InDoubt => "The outcome of this Idempotency-Key is in doubt",
        Rejection::MissingTenant => "Authentication required",
        Rejection::BodyTooLarge => "Request body too large",
        Rejection::OperationTooLong => "Request path too long",
        Rejection::BodyTimeout => "Request body too slow",
        Rejection::BodyRead => "Request body unreadable",
        Rejection::InvalidPayload(_) => "Request body malformed",
        Rejection::Busy => "Service busy",
        Rejection::HandlerPanicked
        | Rejection::ResponseTooLarge
        | Rejection::ResponseBody
        | Rejection::Store(_) => "Internal error",
    }
}

/// What the client should do about it.
fn detail(rejection: &Rejection) -> String {
    match rejection {
        Rejection::MissingKey => {
            "This operation is idempotent and it requires correct usage of Idempotency Key."
                .to_owned()
        }
        Rejection::DuplicateKeyHeader => "Send exactly one Idempotency-Key header.".to_owned(),
        Rejection::InvalidKey(error) => format!("The Idempotency-Key is not accepted: {error}."),
        Rejection::KeyReused => "This operation is idempotent and it requires correct usage of \
             Idempotency Key. Idempotency Key MUST not be reused across different payloads of \
             this operation."
            .to_owned(),
        Rejection::InFlight => "A request with the same Idempotency-Key for the same operation \
             is being processed or is outstanding. Retry later with the same key."
            .to_owned(),
        Rejection::InvalidPayload(error) => format!("The request body is not accepted: {error}."),
        Rejection::InDoubt => "A call this request made to another service has an unknown \
             outcome; an operator resolves it. Do not retry with another key."
            .to_owned(),
        Rejection::Busy => "Retry later with the same Idempotency-Key.".to_owned(),
        Rejection::BodyTimeout | Rejection::BodyRead => {
            "Retry with the same Idempotency-Key.".to_owned()
        }
        Rejection::MissingTenant => "Authenticate, then retry.".to_owned(),
        Rejection::BodyTooLarge => "Send a smaller body.".to_owned(),
        Rejection::OperationTooLong => format!(
            "The request path names the operation and is longer than {} bytes.",
            crate::MAX_OPERATION_LEN
        ),
        Rejection::HandlerPanicked
        | Rejection::ResponseTooLarge
        | Rejection::ResponseBody
        | Rejection::Store(_) => {
            "Nothing of the request was kept; retry with the same Idempotency-Key.".to_owned()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_answer_is_problem_json_with_a_stable_type() {
        let problems = ProblemDetails::new("https://api.example.com/idempotency");
        let response = problems.response(&Rejection::KeyReused, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(response.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
        assert_eq!(
            response.headers()[header::LINK],
            "<https://api.example.com/idempotency>; rel=\"describedby\"; type=\"text/html\""
        );
        let body: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
        assert_eq!(
            body["type"],
            "https://api.example.com/idempotency#key_reused_with_different_payload"
        );
        assert_eq!(body["status"], 422);
        assert_eq!(body["title"], "Idempotency-Key is already used");

        let busy = problems.response(&Rejection::Busy, StatusCode::SERVICE_UNAVAILABLE);
        assert!(busy.headers().get(header::LINK).is_none());
    }

    #[test]
    fn a_documentation_uri_that_is_no_header_value_only_loses_the_link() {
        let problems = ProblemDetails::new("https://api.example.com/\nbad");
        let response = problems.response(&Rejection::MissingKey, StatusCode::BAD_REQUEST);
        assert!(response.headers().get(header::LINK).is_none());
        let body: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
        assert_eq!(body["status"], 400);
    }
}
