//! gRPC over the layer: telling a gRPC request apart, its status in a captured response, and
//! the layer's own answers as gRPC statuses.

use super::*;

/// What the answer's framing depends on: the HTTP version, and whether the client speaks gRPC.
#[derive(Clone, Copy, Debug)]
pub(super) struct Wire {
    pub(super) version: Version,
    pub(super) grpc: bool,
}

impl Wire {
    pub(super) fn of(version: Version, headers: &HeaderMap) -> Self {
        Wire {
            version,
            grpc: is_grpc(headers),
        }
    }
}

/// Whether a message's content type is gRPC (`application/grpc`, `application/grpc+proto`...).
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| {
            let ct = ct.trim_start();
            ct.len() >= 16
                && ct[..16].eq_ignore_ascii_case("application/grpc")
                && matches!(ct.as_bytes().get(16), None | Some(b'+' | b';'))
        })
}

/// The `grpc-status` of a response: in the trailers, or in the headers of a trailers-only
/// response.
pub(super) fn grpc_status(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> Option<i32> {
    let name = HeaderName::from_static("grpc-status");
    trailers
        .and_then(|t| t.get(&name))
        .or_else(|| headers.get(&name))
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
}

/// A layer rejection as a gRPC client expects it: HTTP 200, trailers-only, with `grpc-status`
/// and `grpc-message` in the headers. A busy store also says when to retry, as gRPC retry
/// policies read it (`grpc-retry-pushback-ms`, gRFC A6).
pub(super) fn grpc_rejection<B>(
    rejection: &Rejection,
    retry_after: Duration,
) -> Response<ResponseBody<B>> {
    let mut response = Response::new(ResponseBody::full(Bytes::new(), None));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.insert("grpc-status", HeaderValue::from(rejection.grpc_code()));
    headers.insert("grpc-message", HeaderValue::from_static(rejection.code()));
    if matches!(rejection, Rejection::Busy | Rejection::InFlight) {
        let millis = u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX);
        headers.insert("grpc-retry-pushback-ms", HeaderValue::from(millis));
    }
    response
}

/// Lets a wrapped tonic service be added on its own (`Server::add_service`), keeping the
/// server's other services out of the layer.
#[cfg(feature = "tonic")]
impl<S: tonic::server::NamedService, St> tonic::server::NamedService for Idempotency<S, St> {
    const NAME: &'static str = S::NAME;
}
