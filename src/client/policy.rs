//! The retry decisions, as pure functions: which requests may be retried, how long to wait.

use std::time::{Duration, SystemTime};

use http::{header, HeaderMap, Method};

/// Whether RFC 9110 (section 9.2.2) defines the method as idempotent: such requests are
/// retried as they are, without a key.
pub(crate) fn is_idempotent(method: &Method) -> bool {
    [
        Method::GET,
        Method::HEAD,
        Method::PUT,
        Method::DELETE,
        Method::OPTIONS,
        Method::TRACE,
    ]
    .contains(method)
}

/// The wait before retry number `retry` (1 for the first retry): "full jitter", uniform in
/// `[0, min(max, initial * 2^(retry - 1))]`.
///
/// Full jitter spreads the retries of many clients that failed together (a server restart)
/// instead of sending them back in waves.
pub(crate) fn backoff(
    retry: u32,
    initial: Duration,
    max: Duration,
    rng: &mut fastrand::Rng,
) -> Duration {
    let factor = 1u128
        .checked_shl(retry.saturating_sub(1))
        .unwrap_or(u128::MAX);
    let ceiling = initial
        .as_nanos()
        .saturating_mul(factor)
        .min(max.as_nanos())
        .min(u128::from(u64::MAX));
    // `ceiling` fits in a u64 after the `min` above.
    let ceiling = u64::try_from(ceiling).unwrap_or(u64::MAX);
    Duration::from_nanos(rng.u64(0..=ceiling))
}

/// The server's `Retry-After`, as a wait from `now`: delay-seconds (`120`) or an HTTP-date
/// (`Wed, 21 Oct 2015 07:28:00 GMT`; a date in the past is no wait). `None` when absent or
/// unreadable.
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(header::RETRY_AFTER)?.to_str().ok()?.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // All digits: only an absurdly long number fails to parse; treat it as "a long time".
        let seconds = value.parse::<u64>().unwrap_or(u64::MAX);
        return Some(Duration::from_secs(seconds));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn headers(retry_after: &'static str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::RETRY_AFTER, HeaderValue::from_static(retry_after));
        headers
    }

    #[test]
    fn full_jitter_stays_under_the_exponential_ceiling_and_the_cap() {
        let initial = Duration::from_millis(100);
        let max = Duration::from_secs(2);
        let mut rng = fastrand::Rng::with_seed(7);
        for retry in 1..=40 {
            let ceiling = (initial * 2u32.saturating_pow(retry - 1).min(1 << 20)).min(max);
            let mut seen_max = Duration::ZERO;
            for _ in 0..200 {
                let wait = backoff(retry, initial, max, &mut rng);
                assert!(wait <= ceiling, "retry {retry}: {wait:?} > {ceiling:?}");
                seen_max = seen_max.max(wait);
            }
            // Spread over the whole range, not stuck near zero.
            assert!(seen_max > ceiling / 2, "retry {retry}: max {seen_max:?}");
        }
    }

    #[test]
    fn backoff_survives_extreme_settings() {
        let mut rng = fastrand::Rng::with_seed(1);
        let wait = backoff(u32::MAX, Duration::MAX, Duration::MAX, &mut rng);
        assert!(wait <= Duration::from_nanos(u64::MAX));
        assert_eq!(
            backoff(3, Duration::ZERO, Duration::from_secs(1), &mut rng),
            Duration::ZERO
        );
    }

    #[test]
    fn retry_after_reads_seconds_and_http_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_480); // 07:28:00
        assert_eq!(
            retry_after(&headers("120"), now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(
            retry_after(&headers(" 0 "), now),
            Some(Duration::from_secs(0))
        );
        assert_eq!(
            retry_after(&headers("Wed, 21 Oct 2015 07:28:30 GMT"), now),
            Some(Duration::from_secs(30))
        );
        // A date in the past: no wait.
        assert_eq!(
            retry_after(&headers("Wed, 21 Oct 2015 07:00:00 GMT"), now),
            Some(Duration::ZERO)
        );
        assert_eq!(
            retry_after(&headers("99999999999999999999999"), now),
            Some(Duration::from_secs(u64::MAX))
        );
        assert_eq!(retry_after(&headers("soon"), now), None);
        assert_eq!(retry_after(&headers("-5"), now), None);
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
    }

    #[test]
    fn only_rfc_9110_idempotent_methods_are_retried_without_a_key() {
        for method in ["GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"] {
            assert!(is_idempotent(&method.parse().expect("method")), "{method}");
        }
        for method in ["POST", "PATCH", "CONNECT", "PURGE"] {
            assert!(!is_idempotent(&method.parse().expect("method")), "{method}");
        }
    }
}
