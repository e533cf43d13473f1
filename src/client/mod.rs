#![doc = include_str!("../docs/client.md")]

mod body;
mod outcome;
mod policy;
mod service;

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderValue, Method, StatusCode};
use tower_layer::Layer;

pub use self::body::BufferedBody;
pub use self::outcome::{RetryError, RetryOutcome};
pub use self::service::Retry;

/// How the client generates the `Idempotency-Key` of a request that has none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyFormat {
    /// A random UUID (version 4): reveals nothing. The default.
    #[default]
    UuidV4,
    /// A time-ordered UUID (version 7): its first 48 bits are the creation time in
    /// milliseconds, which keeps the server's key index append-mostly, and tells the server
    /// when the key was made.
    UuidV7,
}

impl KeyFormat {
    /// A new key in this format. Marked sensitive: HTTP/2 does not index it, and `Debug` of
    /// the header value does not print it.
    fn generate(self) -> HeaderValue {
        let uuid = match self {
            KeyFormat::UuidV4 => uuid::Uuid::new_v4(),
            KeyFormat::UuidV7 => uuid::Uuid::now_v7(),
        };
        let mut buffer = uuid::Uuid::encode_buffer();
        let mut value = HeaderValue::from_str(uuid.hyphenated().encode_lower(&mut buffer))
            // A hyphenated UUID is 36 characters of `[0-9a-f-]`, always a valid header value;
            // were it not, the fallback is still a fresh random key, never a shared one.
            .unwrap_or_else(|_| HeaderValue::from(fastrand::u64(..)));
        value.set_sensitive(true);
        value
    }
}

type ErrorFilter = Arc<dyn Fn(&(dyn StdError + Send + Sync + 'static)) -> bool + Send + Sync>;

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) max_attempts: u32,
    pub(crate) attempt_timeout: Duration,
    pub(crate) deadline: Duration,
    pub(crate) initial_backoff: Duration,
    pub(crate) max_backoff: Duration,
    pub(crate) body_limit: usize,
    pub(crate) key_methods: Vec<Method>,
    pub(crate) key_format: KeyFormat,
    pub(crate) retryable_statuses: Vec<StatusCode>,
    pub(crate) retryable_error: ErrorFilter,
}

/// A tower layer that makes an HTTP client send each non-idempotent request with an
/// `Idempotency-Key` and retry it safely: same key, same bytes. See the [module
/// docs](crate::client).
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::client::RetryLayer;
///
/// let layer = RetryLayer::new()
///     .with_max_attempts(4)
///     .with_deadline(Duration::from_secs(10));
/// # let _ = layer;
/// ```
#[derive(Clone)]
pub struct RetryLayer {
    config: Arc<Config>,
}

impl Default for RetryLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for RetryLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        f.debug_struct("RetryLayer")
            .field("max_attempts", &c.max_attempts)
            .field("attempt_timeout", &c.attempt_timeout)
            .field("deadline", &c.deadline)
            .field("initial_backoff", &c.initial_backoff)
            .field("max_backoff", &c.max_backoff)
            .field("body_limit", &c.body_limit)
            .field("key_methods", &c.key_methods)
            .field("key_format", &c.key_format)
            .field("retryable_statuses", &c.retryable_statuses)
            .finish_non_exhaustive()
    }
}

impl RetryLayer {
    /// A layer with the defaults listed on each setter.
    pub fn new() -> Self {
        RetryLayer {
            config: Arc::new(Config {
                max_attempts: 5,
                attempt_timeout: Duration::from_secs(10),
                deadline: Duration::from_secs(30),
                initial_backoff: Duration::from_millis(100),
                max_backoff: Duration::from_secs(5),
                body_limit: 1024 * 1024,
                key_methods: vec![Method::POST, Method::PATCH],
                key_format: KeyFormat::UuidV4,
                retryable_statuses: vec![
                    StatusCode::REQUEST_TIMEOUT,
                    StatusCode::TOO_MANY_REQUESTS,
                    StatusCode::SERVICE_UNAVAILABLE,
                ],
                retryable_error: Arc::new(|_| true),
            }),
        }
    }

    fn map_config(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// The most attempts per request, the first included (`1`: never retry). Default: 5.
    pub fn with_max_attempts(self, attempts: u32) -> Self {
        self.map_config(|c| c.max_attempts = attempts.max(1))
    }

    /// How long one attempt may wait for the response head (readiness of the inner client
    /// included); past it the attempt is dropped and retried. Default: 10 s.
    ///
    /// The body of the final response is not covered: it streams to the caller.
    pub fn with_attempt_timeout(self, timeout: Duration) -> Self {
        self.map_config(|c| c.attempt_timeout = timeout)
    }

    /// The overall time budget of a request, from the call to the final response head: reading
    /// the body, every attempt and every wait. An attempt in flight at the deadline is dropped
    /// ([`RetryError::DeadlineExceeded`]); a retry that could not start before it is not made.
    /// Default: 30 s.
    ///
    /// Keep it well below the server's retention of idempotency records (24 h by default).
    pub fn with_deadline(self, deadline: Duration) -> Self {
        self.map_config(|c| c.deadline = deadline)
    }

    /// The backoff ceiling of the first retry; it doubles at each retry, up to
    /// [`with_max_backoff`](Self::with_max_backoff). The wait is drawn uniformly between zero
    /// and the ceiling ("full jitter"), or is the server's `Retry-After` if that is longer.
    /// Default: 100 ms.
    pub fn with_initial_backoff(self, backoff: Duration) -> Self {
        self.map_config(|c| c.initial_backoff = backoff)
    }

    /// The largest backoff ceiling. Default: 5 s.
    pub fn with_max_backoff(self, backoff: Duration) -> Self {
        self.map_config(|c| c.max_backoff = backoff)
    }

    /// The largest request body the client buffers, in bytes; a larger one is refused before
    /// anything is sent ([`RetryError::BodyTooLarge`]). Default: 1 MiB (the server layer's
    /// default limit).
    pub fn with_body_limit(self, limit: usize) -> Self {
        self.map_config(|c| c.body_limit = limit)
    }

    /// The methods that get an `Idempotency-Key` when the caller set none.
    ///
    /// Default: `POST` and `PATCH`, the methods that are not idempotent by themselves (and the
    /// ones the server layer handles by default).
    pub fn with_key_methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        let methods = methods.into_iter().collect();
        self.map_config(|c| c.key_methods = methods)
    }

    /// How a new key is generated. Default: [`KeyFormat::UuidV4`].
    pub fn with_key_format(self, format: KeyFormat) -> Self {
        self.map_config(|c| c.key_format = format)
    }

    /// The response statuses that are retried (honouring `Retry-After`); every other answer is
    /// final. Default: `408`, `429` and `503` (the server layer's "busy, retry later").
    ///
    /// With a key, a `502` or `504` from a gateway is safe to retry too:
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_idempotency::client::RetryLayer;
    ///
    /// let layer = RetryLayer::new().with_retryable_statuses([
    ///     StatusCode::REQUEST_TIMEOUT,
    ///     StatusCode::TOO_MANY_REQUESTS,
    ///     StatusCode::BAD_GATEWAY,
    ///     StatusCode::SERVICE_UNAVAILABLE,
    ///     StatusCode::GATEWAY_TIMEOUT,
    /// ]);
    /// # let _ = layer;
    /// ```
    pub fn with_retryable_statuses(self, statuses: impl IntoIterator<Item = StatusCode>) -> Self {
        let statuses = statuses.into_iter().collect();
        self.map_config(|c| c.retryable_statuses = statuses)
    }

    /// Which errors of the inner client are retried. Default: all of them. A refused, reset
    /// or dropped connection may or may not have reached the server; with the key, resending
    /// is safe either way.
    ///
    /// ```
    /// use tower_idempotency::client::RetryLayer;
    ///
    /// // Only errors hyper-util reports as connection failures.
    /// let layer = RetryLayer::new().with_retryable_error(|error| {
    ///     error
    ///         .downcast_ref::<hyper_util::client::legacy::Error>()
    ///         .is_some_and(|error| error.is_connect())
    /// });
    /// # let _ = layer;
    /// ```
    pub fn with_retryable_error<F>(self, filter: F) -> Self
    where
        F: Fn(&(dyn StdError + Send + Sync + 'static)) -> bool + Send + Sync + 'static,
    {
        let filter: ErrorFilter = Arc::new(filter);
        self.map_config(|c| c.retryable_error = filter)
    }
}

impl<S> Layer<S> for RetryLayer {
    type Service = Retry<S>;

    fn layer(&self, inner: S) -> Retry<S> {
        Retry::from_parts(inner, self.config.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_keys_are_fresh_uuids_of_the_chosen_version() {
        for (format, version) in [(KeyFormat::UuidV4, 4), (KeyFormat::UuidV7, 7)] {
            let first = format.generate();
            let second = format.generate();
            assert_ne!(first, second);
            assert!(first.is_sensitive());
            let uuid = uuid::Uuid::parse_str(first.to_str().expect("ascii")).expect("a UUID");
            assert_eq!(uuid.get_version_num(), version);
        }
    }

    #[test]
    fn setters_replace_the_defaults() {
        let layer = RetryLayer::new()
            .with_max_attempts(0)
            .with_key_methods([Method::POST])
            .with_retryable_statuses([StatusCode::BAD_GATEWAY]);
        // Zero attempts would send nothing: it means one.
        assert_eq!(layer.config.max_attempts, 1);
        assert_eq!(layer.config.key_methods, [Method::POST]);
        assert_eq!(layer.config.retryable_statuses, [StatusCode::BAD_GATEWAY]);
        let printed = format!("{layer:?}");
        assert!(printed.contains("max_attempts: 1"), "{printed}");
    }
}
