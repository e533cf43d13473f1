//! What is captured from the handler's response, saved, and replayed.

use bytes::Bytes;
use http::header::{self, HeaderName};
use http::{HeaderMap, HeaderValue, Response, StatusCode};

use crate::body::ResponseBody;

/// The header added to every replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// A response as saved in the store and replayed to retries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedResponse {
    /// The status code.
    pub status: StatusCode,
    /// The headers that are replayed (`Location`, `Content-Type` and the allow-list).
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The full body.
    pub body: Bytes,
    /// The trailers, if the response had any (gRPC answers in trailers).
    pub trailers: Option<Vec<(HeaderName, HeaderValue)>>,
}

// The encoding is for the stores; without one (a client-only build) it goes unused.
#[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
impl SavedResponse {
    /// Builds the replayed response, marked with `Idempotent-Replayed: true`.
    pub(crate) fn replay<B>(&self) -> Response<ResponseBody<B>> {
        let trailers = self.trailers.as_ref().map(|t| to_header_map(t));
        let mut response = Response::new(ResponseBody::full(self.body.clone(), trailers));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        for (name, value) in &self.headers {
            headers.append(name.clone(), value.clone());
        }
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        response
    }

    /// Encodes a header list for storage: a JSON array of `[name, value]` pairs.
    pub(crate) fn encode_headers(headers: &[(HeaderName, HeaderValue)]) -> String {
        let pairs: Vec<serde_json::Value> = headers
            .iter()
            .filter_map(|(name, value)| {
                let value = value.to_str().ok()?;
                Some(serde_json::json!([name.as_str(), value]))
            })
            .collect();
        serde_json::Value::Array(pairs).to_string()
    }

    /// Decodes what [`SavedResponse::encode_headers`] wrote.
    pub(crate) fn decode_headers(text: &str) -> Result<Vec<(HeaderName, HeaderValue)>, String> {
        let pairs: Vec<(String, String)> =
            serde_json::from_str(text).map_err(|e| format!("saved headers: {e}"))?;
        pairs
            .into_iter()
            .map(|(name, value)| {
                let name = HeaderName::try_from(name).map_err(|e| e.to_string())?;
                let value = HeaderValue::try_from(value).map_err(|e| e.to_string())?;
                Ok((name, value))
            })
            .collect()
    }
}

fn to_header_map(pairs: &[(HeaderName, HeaderValue)]) -> HeaderMap {
    let mut map = HeaderMap::with_capacity(pairs.len());
    for (name, value) in pairs {
        map.append(name.clone(), value.clone());
    }
    map
}

/// Headers that are never saved or replayed, whatever the allow-list says: cookies belong to
/// one client session, hop-by-hop headers to one connection, and the length is recomputed.
pub(crate) fn is_never_replayed(name: &HeaderName) -> bool {
    const HOP_BY_HOP: [&str; 6] = [
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "proxy-authenticate",
    ];
    *name == header::SET_COOKIE
        || *name == header::CONTENT_LENGTH
        || *name == header::CONNECTION
        || *name == header::TRANSFER_ENCODING
        || *name == IDEMPOTENT_REPLAYED
        || HOP_BY_HOP.contains(&name.as_str())
}

/// Picks the headers to save from a response: those on the allow-list, minus the ones that
/// are never replayed.
pub(crate) fn select_headers(
    headers: &HeaderMap,
    allowed: &[HeaderName],
) -> Vec<(HeaderName, HeaderValue)> {
    headers
        .iter()
        .filter(|(name, _)| allowed.contains(name) && !is_never_replayed(name))
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_never_keep_cookies() {
        let mut headers = HeaderMap::new();
        headers.insert(header::LOCATION, HeaderValue::from_static("/orders/7"));
        headers.insert(header::SET_COOKIE, HeaderValue::from_static("s=1"));
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("12"));
        let allowed = vec![header::LOCATION, header::SET_COOKIE, header::CONTENT_LENGTH];
        let selected = select_headers(&headers, &allowed);
        assert_eq!(
            selected,
            vec![(header::LOCATION, HeaderValue::from_static("/orders/7"))]
        );
        let text = SavedResponse::encode_headers(&selected);
        assert_eq!(SavedResponse::decode_headers(&text).unwrap(), selected);
    }

    #[test]
    fn replay_marks_the_response() {
        let saved = SavedResponse {
            status: StatusCode::CREATED,
            headers: vec![(header::LOCATION, HeaderValue::from_static("/orders/1"))],
            body: Bytes::from_static(b"{\"order_id\":1}"),
            trailers: None,
        };
        let response = saved.replay::<http_body_util::Empty<Bytes>>();
        assert_eq!(response.status(), StatusCode::CREATED);
        assert_eq!(response.headers()[header::LOCATION], "/orders/1");
        assert_eq!(response.headers()[IDEMPOTENT_REPLAYED], "true");
    }
}
