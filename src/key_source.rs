//! Where the layer finds a request's key: [`KeyExtractor`].

use std::fmt;
use std::sync::Arc;

use http::header::HeaderName;
use http::request;

use crate::error::Rejection;
use crate::fingerprint::FingerprintError;
use crate::key::{IdempotencyKey, KeyError};
use crate::service::IDEMPOTENCY_KEY;

type CustomFn = dyn Fn(&request::Parts, &[u8]) -> Option<String> + Send + Sync;

/// Where the key of a request is: a header (`Idempotency-Key` by default), a member of a JSON
/// body, or a function of your own. Set with
/// [`IdempotencyLayer::with_key_extractor`](crate::IdempotencyLayer::with_key_extractor).
///
/// Webhook receivers take the key the sender gives its deliveries:
///
/// ```
/// use tower_idempotency::key::KeyExtractor;
///
/// let github = KeyExtractor::header(http::HeaderName::from_static("x-github-delivery"));
/// let stripe = KeyExtractor::json_pointer("/id"); // a Stripe event's `evt_...` id
/// let custom = KeyExtractor::custom(|parts, _body| {
///     parts.uri.query()?.strip_prefix("delivery=").map(str::to_owned)
/// });
/// # let _ = (github, stripe, custom);
/// ```
///
/// A key found anywhere is checked like the header's (1 to the
/// [maximum](crate::IdempotencyLayer::with_max_key_len) of visible ASCII characters). A key
/// taken from the body is read once the body has arrived, and is required whatever
/// [`with_key_required`](crate::IdempotencyLayer::with_key_required) says: without it the
/// request is `400`.
#[derive(Clone)]
pub struct KeyExtractor(Source);

#[derive(Clone)]
enum Source {
    Header(HeaderName),
    JsonPointer(Arc<str>),
    Custom(Arc<CustomFn>),
}

impl Default for KeyExtractor {
    /// The `Idempotency-Key` header.
    fn default() -> Self {
        KeyExtractor::header(IDEMPOTENCY_KEY)
    }
}

impl fmt::Debug for KeyExtractor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Source::Header(name) => write!(f, "KeyExtractor::header({name})"),
            Source::JsonPointer(pointer) => write!(f, "KeyExtractor::json_pointer({pointer})"),
            Source::Custom(_) => f.write_str("KeyExtractor::custom(..)"),
        }
    }
}

impl KeyExtractor {
    /// The value of this header (sent at most once: twice is `400`).
    pub fn header(name: HeaderName) -> Self {
        KeyExtractor(Source::Header(name))
    }

    /// The string (or number) at this JSON pointer (RFC 6901, such as `/id` or
    /// `/data/object/id`) in the request's JSON body.
    pub fn json_pointer(pointer: impl Into<Arc<str>>) -> Self {
        KeyExtractor(Source::JsonPointer(pointer.into()))
    }

    /// Whatever `f` returns for the request head and its buffered body; `None` is a missing
    /// key.
    pub fn custom<F>(f: F) -> Self
    where
        F: Fn(&request::Parts, &[u8]) -> Option<String> + Send + Sync + 'static,
    {
        KeyExtractor(Source::Custom(Arc::new(f)))
    }

    /// The header the key is in, if it is in one (its presence is known before the body).
    pub(crate) fn header_name(&self) -> Option<&HeaderName> {
        match &self.0 {
            Source::Header(name) => Some(name),
            _ => None,
        }
    }

    /// The key of a request whose body has arrived (sources other than a header).
    pub(crate) fn extract(
        &self,
        parts: &request::Parts,
        body: &[u8],
        max_len: usize,
    ) -> Result<IdempotencyKey, Rejection> {
        let raw = match &self.0 {
            Source::Header(name) => {
                let mut values = parts.headers.get_all(name).iter();
                let value = values.next().ok_or(Rejection::MissingKey)?;
                if values.next().is_some() {
                    return Err(Rejection::DuplicateKeyHeader);
                }
                // Parsed where it lies: the key's own copy is the only one.
                return IdempotencyKey::parse(value.as_bytes(), max_len)
                    .map_err(Rejection::InvalidKey);
            }
            Source::JsonPointer(pointer) => {
                let document: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
                    Rejection::InvalidPayload(FingerprintError::Custom(format!(
                        "the body is not JSON: {e}"
                    )))
                })?;
                match document.pointer(pointer) {
                    None | Some(serde_json::Value::Null) => return Err(Rejection::MissingKey),
                    Some(serde_json::Value::String(key)) => key.clone().into_bytes(),
                    Some(serde_json::Value::Number(key)) => key.to_string().into_bytes(),
                    Some(_) => return Err(Rejection::InvalidKey(KeyError::Malformed)),
                }
            }
            Source::Custom(f) => f(parts, body).ok_or(Rejection::MissingKey)?.into_bytes(),
        };
        IdempotencyKey::parse(&raw, max_len).map_err(Rejection::InvalidKey)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts() -> request::Parts {
        http::Request::post("/events")
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    #[test]
    fn a_json_pointer_finds_strings_and_numbers_and_refuses_the_rest() {
        let id = KeyExtractor::json_pointer("/data/id");
        let key = |body: &str| id.extract(&parts(), body.as_bytes(), 128);
        assert_eq!(key(r#"{"data":{"id":"evt_1"}}"#).unwrap().as_str(), "evt_1");
        assert_eq!(key(r#"{"data":{"id":42}}"#).unwrap().as_str(), "42");
        assert!(matches!(key(r#"{"data":{}}"#), Err(Rejection::MissingKey)));
        assert!(matches!(
            key(r#"{"data":{"id":null}}"#),
            Err(Rejection::MissingKey)
        ));
        assert!(matches!(
            key(r#"{"data":{"id":[1]}}"#),
            Err(Rejection::InvalidKey(KeyError::Malformed))
        ));
        assert!(matches!(
            key(r#"{"data":{"id":"a b"}}"#),
            Err(Rejection::InvalidKey(KeyError::Malformed))
        ));
        assert!(matches!(key("not json"), Err(Rejection::InvalidPayload(_))));
    }
}
