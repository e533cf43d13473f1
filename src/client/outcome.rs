//! What the caller learns: [`RetryOutcome`] on every response, [`RetryError`] when none came.

use std::fmt;
use std::time::Duration;

use http::HeaderValue;

use crate::body::BoxError;
use crate::key::IdempotencyKey;

/// How a request went: put in the extensions of every response the client returns, and in
/// every [`RetryError`] raised after an attempt.
///
/// ```
/// # fn example(response: http::Response<()>) {
/// use tower_idempotency::client::RetryOutcome;
///
/// if let Some(outcome) = response.extensions().get::<RetryOutcome>() {
///     println!("{} attempt(s), replayed: {}", outcome.attempts, outcome.replayed);
/// }
/// # }
/// ```
///
/// `Debug` prints a redacted tag of the key, never the key: whoever holds a key can replay the
/// saved response.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryOutcome {
    /// How many attempts were sent (1 when the first one was answered).
    pub attempts: u32,
    /// Whether the final response carried `Idempotent-Replayed: true`: the server had already
    /// run the operation (on an attempt whose response was lost) and sent its saved response.
    pub replayed: bool,
    /// The `Idempotency-Key` every attempt carried: the caller's own, or the one the client
    /// generated. `None` for requests sent without one (`GET`, `PUT`, ...). Keep it to retry
    /// the same operation later, after a [`RetryError`].
    pub key: Option<HeaderValue>,
    /// The time from the call to the final answer (buffering the body included).
    pub elapsed: Duration,
}

impl fmt::Debug for RetryOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let key = self.key.as_ref().map(|value| {
            IdempotencyKey::parse(value.as_bytes(), usize::MAX)
                .map_or_else(|_| "<malformed>".to_owned(), |key| key.redacted())
        });
        f.debug_struct("RetryOutcome")
            .field("attempts", &self.attempts)
            .field("replayed", &self.replayed)
            .field("key", &key)
            .field("elapsed", &self.elapsed)
            .finish()
    }
}

/// Why the client returned no response.
///
/// A retryable answer that is still retryable when the attempts or the time run out (a `503`,
/// say) is returned as the response, not as an error: the caller sees the server's status and
/// `Retry-After`. Errors are for attempts that got no answer at all.
///
/// After an attempt was sent, the error carries the [`RetryOutcome`]: retry later with
/// [`RetryOutcome::key`] to complete the same operation, never with a new key.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RetryError {
    /// The inner client's `poll_ready` failed: nothing was sent.
    #[error("the inner client is not ready")]
    NotReady(#[source] BoxError),
    /// Reading the caller's request body failed: nothing was sent.
    #[error("reading the request body failed")]
    Body(#[source] BoxError),
    /// The request body is larger than the buffer ([`RetryLayer::with_body_limit`]): nothing
    /// was sent.
    ///
    /// [`RetryLayer::with_body_limit`]: crate::client::RetryLayer::with_body_limit
    #[error("the request body is larger than the {limit}-byte retry buffer")]
    BodyTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The last attempt failed with this error (a refused or dropped connection, say) and no
    /// retry was left (attempts, time, or an error the filter does not retry).
    #[error("the request failed after {} attempt(s)", outcome.attempts)]
    Failed {
        /// The attempts made, with the key they carried.
        outcome: RetryOutcome,
        /// The last attempt's error, from the inner client.
        #[source]
        source: BoxError,
    },
    /// The last attempt got no answer within the per-attempt timeout and no retry was left.
    #[error("no answer within the attempt timeout, after {} attempt(s)", outcome.attempts)]
    AttemptTimedOut {
        /// The attempts made, with the key they carried.
        outcome: RetryOutcome,
    },
    /// The overall deadline passed while an attempt was in flight (or the body was being
    /// read).
    #[error("no answer before the deadline, after {} attempt(s)", outcome.attempts)]
    DeadlineExceeded {
        /// The attempts made, with the key they carried.
        outcome: RetryOutcome,
    },
}

impl RetryError {
    /// The attempts made and the key they carried, if the request got as far as sending one.
    pub fn outcome(&self) -> Option<&RetryOutcome> {
        match self {
            RetryError::Failed { outcome, .. }
            | RetryError::AttemptTimedOut { outcome }
            | RetryError::DeadlineExceeded { outcome } => Some(outcome),
            RetryError::NotReady(_) | RetryError::Body(_) | RetryError::BodyTooLarge { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_prints_a_redacted_tag_not_the_key() {
        let outcome = RetryOutcome {
            attempts: 2,
            replayed: true,
            key: Some(HeaderValue::from_static("order-secret-42")),
            elapsed: Duration::from_millis(5),
        };
        let printed = format!("{outcome:?}");
        assert!(!printed.contains("order-secret-42"), "{printed}");
        assert!(printed.contains("k:"), "{printed}");

        let error = RetryError::AttemptTimedOut { outcome };
        assert!(!format!("{error:?}").contains("order-secret-42"));
        assert_eq!(
            error.to_string(),
            "no answer within the attempt timeout, after 2 attempt(s)"
        );
        assert_eq!(error.outcome().map(|o| o.attempts), Some(2));
    }
}
