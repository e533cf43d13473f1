//! The client's retry policy over real HTTP, against a scripted server: what is retried, with
//! which key and bytes, how long it waits, and when it stops.

use support::client_common;

use std::collections::VecDeque;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{Method, StatusCode};
use http_body_util::{Empty, Full};
use tokio::net::TcpListener;
use tokio::time::Instant;
use tower_idempotency::client::{KeyFormat, Retry, RetryError};

use client_common::{client, fast, send, Chunks, HttpClient, Scripted, ScriptedServer};

fn post(url: &str, body: &'static str) -> http::Request<Full<Bytes>> {
    http::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .expect("request")
}

/// `POST /orders` to a server that never answers in time: the error, and how long it took.
async fn unanswered(client: &Retry<HttpClient>, server: &ScriptedServer) -> (RetryError, Duration) {
    let started = Instant::now();
    let error = send(client, post(&server.url("/orders"), "{}"))
        .await
        .expect_err("no answer");
    (error, started.elapsed())
}

/// A port on 127.0.0.1 that was free a moment ago, and nothing listens on now.
async fn closed_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

test! { final_answers_are_returned_after_one_attempt }
async fn final_answers_are_returned_after_one_attempt() {
    for status in [400, 401, 409, 413, 422, 500, 404, 200] {
        let server = ScriptedServer::spawn([Scripted::status(status)]).await;
        let client = client(fast());
        let answer = send(&client, post(&server.url("/orders"), "{}"))
            .await
            .expect("an answer");
        assert_eq!(answer.status.as_u16(), status);
        assert_eq!(answer.outcome.attempts, 1, "{status} is final");
        assert!(!answer.outcome.replayed);
        assert_eq!(server.seen().len(), 1, "{status}: sent once");
    }
}

test! { retryable_answers_are_retried_with_the_same_key_and_the_same_bytes }
async fn retryable_answers_are_retried_with_the_same_key_and_the_same_bytes() {
    let server = ScriptedServer::spawn([
        Scripted::status(503),
        Scripted::status(429),
        Scripted::status(408),
    ])
    .await;
    let client = client(fast());
    let answer = send(
        &client,
        post(&server.url("/orders"), r#"{"sku":"book","quantity":1}"#),
    )
    .await
    .expect("an answer");

    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(answer.outcome.attempts, 4);
    assert!(!answer.outcome.replayed, "no Idempotent-Replayed header");
    let seen = server.seen();
    assert_eq!(seen.len(), 4);
    let key = answer.key().to_owned();
    let uuid = uuid::Uuid::parse_str(&key).expect("the generated key is a UUID");
    assert_eq!(uuid.get_version_num(), 4, "UUID v4 by default");
    for request in &seen {
        assert_eq!(
            request.keys,
            [key.as_str()],
            "one key, the same on every attempt"
        );
        assert_eq!(request.body, r#"{"sku":"book","quantity":1}"#);
    }
}

test! { a_replayed_answer_is_reported }
async fn a_replayed_answer_is_reported() {
    let server =
        ScriptedServer::spawn([Scripted::status(201).header("idempotent-replayed", "true")]).await;
    let answer = send(&client(fast()), post(&server.url("/orders"), "{}"))
        .await
        .expect("an answer");
    assert_eq!(answer.outcome.attempts, 1);
    assert!(answer.outcome.replayed);
}

test! { a_callers_key_is_kept_as_it_is }
async fn a_callers_key_is_kept_as_it_is() {
    let server = ScriptedServer::spawn([Scripted::status(503)]).await;
    let mut request = post(&server.url("/orders"), "{}");
    request
        .headers_mut()
        .insert("idempotency-key", "\"caller-7\"".parse().expect("value"));
    let answer = send(&client(fast()), request).await.expect("an answer");

    assert_eq!(answer.outcome.attempts, 2);
    assert_eq!(answer.key(), "\"caller-7\"");
    for request in server.seen() {
        assert_eq!(request.keys, ["\"caller-7\""]);
    }
}

test! { uuid_v7_keys_on_request }
async fn uuid_v7_keys_on_request() {
    let server = ScriptedServer::spawn([]).await;
    let client = client(fast().with_key_format(KeyFormat::UuidV7));
    let answer = send(&client, post(&server.url("/orders"), "{}"))
        .await
        .expect("an answer");
    let uuid = uuid::Uuid::parse_str(answer.key()).expect("a UUID");
    assert_eq!(uuid.get_version_num(), 7);
}

test! { get_is_retried_without_a_key_and_patch_gets_one }
async fn get_is_retried_without_a_key_and_patch_gets_one() {
    let server = ScriptedServer::spawn([Scripted::status(503)]).await;
    let client = client(fast());
    let get = http::Request::get(server.url("/orders/1"))
        .body(Empty::<Bytes>::new())
        .expect("request");
    let answer = send(&client, get).await.expect("an answer");
    assert_eq!(answer.outcome.attempts, 2, "GET is idempotent: retried");
    assert_eq!(answer.outcome.key, None);
    assert!(
        server.seen().iter().all(|r| r.keys.is_empty()),
        "no key on GET"
    );

    let patch = http::Request::patch(server.url("/orders/1"))
        .body(Full::new(Bytes::from_static(b"{}")))
        .expect("request");
    let answer = send(&client, patch).await.expect("an answer");
    assert!(answer.outcome.key.is_some());
    assert_eq!(server.seen()[2].method, Method::PATCH);
    assert_eq!(server.seen()[2].keys.len(), 1);
}

test! { a_non_idempotent_method_without_a_key_is_sent_once }
async fn a_non_idempotent_method_without_a_key_is_sent_once() {
    let server = ScriptedServer::spawn([Scripted::status(503)]).await;
    let request = http::Request::builder()
        .method(Method::from_bytes(b"PURGE").expect("method"))
        .uri(server.url("/cache"))
        .body(Empty::<Bytes>::new())
        .expect("request");
    let answer = send(&client(fast()), request).await.expect("an answer");
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.outcome.attempts, 1);
    assert_eq!(answer.outcome.key, None);
}

/// One `status` answer with this `Retry-After`, then the retry's answer: the wait between
/// the two attempts.
async fn wait_after_a_retry_after(status: u16, retry_after: &str) -> Duration {
    let server =
        ScriptedServer::spawn([Scripted::status(status).header("retry-after", retry_after)]).await;
    let answer = send(&client(fast()), post(&server.url("/orders"), "{}"))
        .await
        .expect("an answer");
    assert_eq!(answer.outcome.attempts, 2);
    let seen = server.seen();
    seen[1].at - seen[0].at
}

test! { retry_after_in_seconds_is_honoured }
async fn retry_after_in_seconds_is_honoured() {
    let gap = wait_after_a_retry_after(503, "1").await;
    assert!(gap >= Duration::from_secs(1), "waited only {gap:?}");
    assert!(gap < Duration::from_secs(3), "waited {gap:?}");
}

test! { retry_after_as_an_http_date_is_honoured }
async fn retry_after_as_an_http_date_is_honoured() {
    // HTTP-dates have whole seconds: two seconds ahead is a wait of more than one.
    let date = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(2));
    let gap = wait_after_a_retry_after(429, &date).await;
    assert!(gap >= Duration::from_millis(900), "waited only {gap:?}");
    assert!(gap < Duration::from_secs(4), "waited {gap:?}");
}

test! { a_retry_after_beyond_the_deadline_returns_the_answer_at_once }
async fn a_retry_after_beyond_the_deadline_returns_the_answer_at_once() {
    let server = ScriptedServer::spawn([Scripted::status(503).header("retry-after", "60")]).await;
    let client = client(fast().with_deadline(Duration::from_secs(5)));
    let started = Instant::now();
    let answer = send(&client, post(&server.url("/orders"), "{}"))
        .await
        .expect("an answer");
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.outcome.attempts, 1);
    assert_eq!(
        answer.headers.get("retry-after").map(|v| v.as_bytes()),
        Some(&b"60"[..]),
        "the caller sees the server's Retry-After"
    );
}

test! { attempts_are_capped }
async fn attempts_are_capped() {
    let server = ScriptedServer::spawn(vec![Scripted::status(503); 10]).await;
    let client = client(fast().with_max_attempts(3));
    let answer = send(&client, post(&server.url("/orders"), "{}"))
        .await
        .expect("an answer");
    assert_eq!(
        answer.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "the last answer"
    );
    assert_eq!(answer.outcome.attempts, 3);
    assert_eq!(server.seen().len(), 3);
}

test! { an_attempt_without_an_answer_times_out_and_is_retried }
async fn an_attempt_without_an_answer_times_out_and_is_retried() {
    let server = ScriptedServer::spawn([Scripted::hang(), Scripted::hang()]).await;
    let client = client(
        fast()
            .with_max_attempts(2)
            .with_attempt_timeout(Duration::from_millis(150)),
    );
    let error = send(&client, post(&server.url("/orders"), "{}"))
        .await
        .expect_err("no answer");
    let RetryError::AttemptTimedOut { outcome } = &error else {
        panic!("expected AttemptTimedOut, got {error:?}");
    };
    assert_eq!(outcome.attempts, 2);
    let seen = server.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].keys, seen[1].keys, "the same key");

    // One hang, then an answer: the timeout leads to a retry, not an error.
    let server = ScriptedServer::spawn([Scripted::hang()]).await;
    let answer = send(&client, post(&server.url("/orders"), "{}"))
        .await
        .expect("the retry is answered");
    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(answer.outcome.attempts, 2);
}

test! { the_deadline_cuts_the_attempt_in_flight }
async fn the_deadline_cuts_the_attempt_in_flight() {
    let server = ScriptedServer::spawn([Scripted::hang()]).await;
    let client = client(
        fast()
            .with_attempt_timeout(Duration::from_secs(30))
            .with_deadline(Duration::from_millis(400)),
    );
    let (error, elapsed) = unanswered(&client, &server).await;
    let RetryError::DeadlineExceeded { outcome } = &error else {
        panic!("expected DeadlineExceeded, got {error:?}");
    };
    assert_eq!(outcome.attempts, 1);
    assert!(outcome.key.is_some());
    assert!(elapsed >= Duration::from_millis(400), "{elapsed:?}");
    assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");
}

test! { the_deadline_bounds_the_retries }
async fn the_deadline_bounds_the_retries() {
    let server = ScriptedServer::spawn(vec![Scripted::hang(); 100]).await;
    let client = client(
        fast()
            .with_max_attempts(100)
            .with_attempt_timeout(Duration::from_millis(150))
            .with_deadline(Duration::from_millis(500)),
    );
    let (error, elapsed) = unanswered(&client, &server).await;
    assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");
    let attempts = error.outcome().expect("an outcome").attempts;
    assert!(
        (2..=4).contains(&attempts),
        "{attempts} attempts: {error:?}"
    );
    // The last attempt may have been cut before its request reached the server.
    let seen = server.seen().len() as u32;
    assert!(
        seen == attempts || seen + 1 == attempts,
        "{seen} seen, {attempts} sent"
    );
}

test! { connection_errors_are_retried_until_the_server_is_up }
async fn connection_errors_are_retried_until_the_server_is_up() {
    // A free port, closed until the server starts on it a little later.
    let port = closed_port().await;
    let starting = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("rebind");
        ScriptedServer::serve(listener, [])
    });
    let client = client(
        fast()
            .with_max_attempts(50)
            .with_max_backoff(Duration::from_millis(50)),
    );
    let answer = send(
        &client,
        post(&format!("http://127.0.0.1:{port}/orders"), "{}"),
    )
    .await
    .expect("an answer once the server is up");
    let server = starting.await.expect("server");
    assert_eq!(answer.status, StatusCode::CREATED);
    assert!(answer.outcome.attempts >= 2, "{:?}", answer.outcome);
    assert_eq!(server.seen().len(), 1, "refused connections reach nothing");
}

test! { connection_errors_end_in_an_error_with_the_outcome }
async fn connection_errors_end_in_an_error_with_the_outcome() {
    let port = closed_port().await;
    let url = format!("http://127.0.0.1:{port}/orders");

    let error = send(&client(fast().with_max_attempts(3)), post(&url, "{}"))
        .await
        .expect_err("nothing listens");
    let RetryError::Failed { outcome, source } = &error else {
        panic!("expected Failed, got {error:?}");
    };
    assert_eq!(outcome.attempts, 3);
    let hyper_error = source
        .downcast_ref::<hyper_util::client::legacy::Error>()
        .expect("hyper-util's error");
    assert!(hyper_error.is_connect(), "{hyper_error:?}");

    // A filter that retries nothing: one attempt.
    let client = client(fast().with_retryable_error(|_| false));
    let error = send(&client, post(&url, "{}")).await.expect_err("refused");
    assert_eq!(error.outcome().map(|o| o.attempts), Some(1));
}

test! { a_streamed_body_is_read_once_and_resent_whole }
async fn a_streamed_body_is_read_once_and_resent_whole() {
    let server = ScriptedServer::spawn([Scripted::status(503)]).await;
    let chunks = ["{\"sku\":", "\"book\",", "\"quantity\":1}"]
        .into_iter()
        .map(|chunk: &'static str| Bytes::from_static(chunk.as_bytes()))
        .collect::<VecDeque<_>>();
    let request = http::Request::post(server.url("/orders"))
        .body(Chunks(chunks))
        .expect("request");
    let answer = send(&client(fast()), request).await.expect("an answer");
    assert_eq!(answer.outcome.attempts, 2);
    for request in server.seen() {
        assert_eq!(request.body, r#"{"sku":"book","quantity":1}"#);
    }
}

test! { a_body_over_the_limit_is_refused_before_anything_is_sent }
async fn a_body_over_the_limit_is_refused_before_anything_is_sent() {
    let server = ScriptedServer::spawn([]).await;
    let client = client(fast().with_body_limit(8));
    let error = send(
        &client,
        post(&server.url("/orders"), r#"{"sku":"a long one"}"#),
    )
    .await
    .expect_err("too large");
    assert!(
        matches!(error, RetryError::BodyTooLarge { limit: 8 }),
        "{error:?}"
    );
    assert!(error.outcome().is_none());
    assert!(server.seen().is_empty());
}
