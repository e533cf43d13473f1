//! Where the layer finds a request's key: [`KeyExtractor`].

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use http::header::HeaderName;
use http::request;
use serde_json::value::RawValue;

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
    ///
    /// A number is taken as written, digit for digit, never through a floating-point value:
    /// `18446744073709551616` and `18446744073709551617` are two keys, and so are `100`,
    /// `100.0` and `1e2`. A string is taken with its escapes decoded. Either must then be a
    /// valid key (its length and characters); `null` or no member is a missing key, any other
    /// value a malformed one (`400`).
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
                let not_json = |e: serde_json::Error| {
                    Rejection::InvalidPayload(FingerprintError::Custom(format!(
                        "the body is not JSON: {e}"
                    )))
                };
                let text = std::str::from_utf8(body).map_err(|e| {
                    Rejection::InvalidPayload(FingerprintError::Custom(format!(
                        "the body is not JSON: {e}"
                    )))
                })?;
                let root: &RawValue = serde_json::from_str(text).map_err(not_json)?;
                let value = raw_at(root, pointer).map_err(not_json)?;
                let written = value.map(|value| value.get().trim());
                match written.and_then(|written| written.bytes().next()) {
                    None | Some(b'n') => return Err(Rejection::MissingKey),
                    Some(b'"') => serde_json::from_str::<String>(written.unwrap_or_default())
                        .map_err(not_json)?
                        .into_bytes(),
                    // As written: a float would make distinct large numbers one key.
                    Some(b'-' | b'0'..=b'9') => written.unwrap_or_default().as_bytes().to_vec(),
                    Some(_) => return Err(Rejection::InvalidKey(KeyError::Malformed)),
                }
            }
            Source::Custom(f) => f(parts, body).ok_or(Rejection::MissingKey)?.into_bytes(),
        };
        IdempotencyKey::parse(&raw, max_len).map_err(Rejection::InvalidKey)
    }
}

/// The value at an RFC 6901 pointer, as written in the document; `None` if there is none.
fn raw_at<'a>(
    root: &'a RawValue,
    pointer: &str,
) -> Result<Option<&'a RawValue>, serde_json::Error> {
    if pointer.is_empty() {
        return Ok(Some(root));
    }
    let Some(tokens) = pointer.strip_prefix('/') else {
        return Ok(None);
    };
    let mut value = root;
    for token in tokens.split('/') {
        let token = token.replace("~1", "/").replace("~0", "~");
        let text = value.get().trim_start();
        let next = match text.bytes().next() {
            Some(b'{') => {
                let members: HashMap<String, &'a RawValue> = serde_json::from_str(value.get())?;
                members.get(&token).copied()
            }
            Some(b'[') => {
                let items: Vec<&'a RawValue> = serde_json::from_str(value.get())?;
                // RFC 6901: digits without a leading zero (but `0` itself).
                let index = (!token.is_empty()
                    && token.bytes().all(|b| b.is_ascii_digit())
                    && (token == "0" || !token.starts_with('0')))
                .then(|| token.parse::<usize>().ok())
                .flatten();
                index.and_then(|index| items.get(index).copied())
            }
            _ => None,
        };
        match next {
            Some(next) => value = next,
            None => return Ok(None),
        }
    }
    Ok(Some(value))
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

    #[test]
    fn a_number_key_is_taken_as_written() {
        let id = KeyExtractor::json_pointer("/id");
        let key = |body: &str| {
            id.extract(&parts(), body.as_bytes(), 128)
                .map(|k| k.as_str().to_owned())
        };
        assert_eq!(
            key(r#"{"id":18446744073709551616}"#).unwrap(),
            "18446744073709551616"
        );
        assert_eq!(
            key(r#"{"id":18446744073709551617}"#).unwrap(),
            "18446744073709551617"
        );
        assert_eq!(key(r#"{"id": 100 }"#).unwrap(), "100");
        assert_ne!(key(r#"{"id":1e2}"#).unwrap(), key(r#"{"id":100}"#).unwrap());
        assert_eq!(key(r#"{"id":"a\u0062c"}"#).unwrap(), "abc");
        assert!(matches!(
            key(r#"{"id":true}"#),
            Err(Rejection::InvalidKey(KeyError::Malformed))
        ));
        assert!(matches!(
            key(r#"{"id":{"x":1}}"#),
            Err(Rejection::InvalidKey(KeyError::Malformed))
        ));
    }

    #[test]
    fn a_pointer_walks_objects_and_arrays_as_rfc_6901_says() {
        let body = r#"{"a/b":{"m~n":[10,{"id":"deep"}]},"list":["x","y"]}"#;
        let key = |pointer: &str| {
            KeyExtractor::json_pointer(pointer)
                .extract(&parts(), body.as_bytes(), 128)
                .map(|k| k.as_str().to_owned())
        };
        assert_eq!(key("/a~1b/m~0n/1/id").unwrap(), "deep");
        assert_eq!(key("/a~1b/m~0n/0").unwrap(), "10");
        assert_eq!(key("/list/1").unwrap(), "y");
        assert!(matches!(key("/list/01"), Err(Rejection::MissingKey)));
        assert!(matches!(key("/list/2"), Err(Rejection::MissingKey)));
        assert!(matches!(key("/list/-"), Err(Rejection::MissingKey)));
        assert!(matches!(key("no-slash"), Err(Rejection::MissingKey)));
    }
}
