//! The stand-in payment provider (`examples/payments.rs`) as a real process on loopback, with
//! its SQLite file: a key is charged once, declines and bad bodies take nothing, the injected
//! faults do what their flags say, and charges survive a SIGKILL.

use support::apps::process;

use std::net::SocketAddr;
use std::path::Path;

use process::{arg, ExampleProcess};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// An answer: status, headers (lowercase names) and JSON body.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Value,
}

/// One HTTP/1.1 request on its own connection; `None` when the server closed the connection
/// without answering.
async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: &str,
) -> Option<Answer> {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let key = key
        .map(|key| format!("Idempotency-Key: {key}\r\n"))
        .unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{key}\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.expect("send");
    let mut raw = Vec::new();
    // A reset is a dropped connection too.
    let _ = stream.read_to_end(&mut raw).await;
    if raw.is_empty() {
        return None;
    }
    let text = String::from_utf8(raw).expect("a UTF-8 answer");
    let (head, body) = text.split_once("\r\n\r\n").expect("a complete answer");
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|line| line.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let headers = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_owned()))
        .collect();
    Some(Answer {
        status,
        headers,
        body: serde_json::from_str(body).unwrap_or(Value::Null),
    })
}

async fn charge(addr: SocketAddr, key: &str, body: &str) -> Option<Answer> {
    request(addr, "POST", "/charges", Some(key), body).await
}

async fn stats(addr: SocketAddr) -> Value {
    request(addr, "GET", "/stats", None, "")
        .await
        .expect("stats answered")
        .body
}

async fn start(db: &Path, flags: &[&str]) -> ExampleProcess {
    let mut args = vec!["--db", arg(db)];
    args.extend_from_slice(flags);
    ExampleProcess::start("payments", &args).await
}

test! { a_key_and_its_repeat_are_one_charge_with_one_id }
async fn a_key_and_its_repeat_are_one_charge_with_one_id() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("payments.db");
    let server = start(&db, &[]).await;
    let first = charge(server.addr, "k1", r#"{"amount_cents":1200}"#)
        .await
        .unwrap();
    assert_eq!(first.status, 201, "{first:?}");
    let id = first.body["charge_id"]
        .as_str()
        .expect("a charge id")
        .to_owned();
    let repeat = charge(server.addr, "k1", r#"{"amount_cents": 1200}"#)
        .await
        .unwrap();
    assert_eq!(
        (repeat.status, repeat.body["charge_id"].as_str()),
        (201, Some(id.as_str()))
    );
    let other = charge(server.addr, "k1", r#"{"amount_cents":1300}"#)
        .await
        .unwrap();
    assert_eq!(other.status, 409);
    assert_eq!(other.body["error"], "key_reused_with_different_payload");
    let stats = stats(server.addr).await;
    assert_eq!(stats["requests"], 3);
    assert_eq!(stats["charges"], 1);
    assert_eq!(stats["charges_by_key"], serde_json::json!({ "k1": 1 }));
}

test! { a_declined_card_is_declined_on_every_repeat_and_never_charged }
async fn a_declined_card_is_declined_on_every_repeat_and_never_charged() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("payments.db"), &[]).await;
    for _ in 0..2 {
        let declined = charge(server.addr, "k402", r#"{"amount_cents":402}"#)
            .await
            .unwrap();
        assert_eq!(declined.status, 402);
        assert_eq!(declined.body["error"], "card_declined");
    }
    let stats = stats(server.addr).await;
    assert_eq!(
        (stats["requests"].as_i64(), stats["charges"].as_i64()),
        (Some(2), Some(0))
    );
}

test! { bad_bodies_and_keys_are_400_and_take_nothing }
async fn bad_bodies_and_keys_are_400_and_take_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("payments.db"), &[]).await;
    for body in [
        "not json",
        r#"{"amount_cents":0}"#,
        r#"{"amount_cents":-5}"#,
        r#"{"amount_cents":1.5}"#,
        r#"{"amount_cents":"7"}"#,
        "{}",
    ] {
        let answer = charge(server.addr, "bad", body).await.unwrap();
        assert_eq!(answer.status, 400, "{body}: {answer:?}");
        assert!(answer.body["error"].is_string(), "{body}: {answer:?}");
    }
    let missing = request(
        server.addr,
        "POST",
        "/charges",
        None,
        r#"{"amount_cents":5}"#,
    )
    .await
    .unwrap();
    assert_eq!(missing.status, 400);
    assert!(missing.body["error"].is_string());
    // A bad body is never saved: the same key with a good one charges.
    assert_eq!(
        charge(server.addr, "bad", r#"{"amount_cents":5}"#)
            .await
            .unwrap()
            .status,
        201
    );
    assert_eq!(stats(server.addr).await["charges"], 1);
}

test! { fail_rate_one_answers_503_and_takes_nothing }
async fn fail_rate_one_answers_503_and_takes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("payments.db"), &["--fail-rate", "1"]).await;
    let answer = charge(server.addr, "k1", r#"{"amount_cents":100}"#)
        .await
        .unwrap();
    assert_eq!(answer.status, 503);
    assert!(
        answer
            .headers
            .contains(&("retry-after".to_owned(), "1".to_owned())),
        "{answer:?}"
    );
    assert_eq!(stats(server.addr).await["charges"], 0);
}

test! { a_dropped_answer_is_the_saved_charge_on_a_repeat }
async fn a_dropped_answer_is_the_saved_charge_on_a_repeat() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("payments.db");
    let server = start(&db, &["--drop-after-charge-rate", "1"]).await;
    assert!(
        charge(server.addr, "k1", r#"{"amount_cents":100}"#)
            .await
            .is_none(),
        "no answer"
    );
    let before = stats(server.addr).await;
    assert_eq!(before["charges_by_key"], serde_json::json!({ "k1": 1 }));
    server.kill().await;
    let server = start(&db, &["--drop-after-charge-rate", "0"]).await;
    let repeat = charge(server.addr, "k1", r#"{"amount_cents":100}"#)
        .await
        .unwrap();
    assert_eq!(repeat.status, 201);
    let id = repeat.body["charge_id"].as_str().unwrap().to_owned();
    let again = charge(server.addr, "k1", r#"{"amount_cents":100}"#)
        .await
        .unwrap();
    assert_eq!(again.body["charge_id"].as_str(), Some(id.as_str()));
    let after = stats(server.addr).await;
    assert_eq!(
        (after["charges"].as_i64(), after["requests"].as_i64()),
        (Some(1), Some(3))
    );
}

test! { sigkill_with_charges_in_flight_and_restart_keep_every_charge_once }
async fn sigkill_with_charges_in_flight_and_restart_keep_every_charge_once() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("payments.db");
    // The delay keeps charges in flight when the kill lands.
    let server = start(&db, &["--delay-ms", "30"]).await;
    let keys: Vec<String> = (0..40).map(|i| format!("key-{i}")).collect();
    let addr = server.addr;
    let tasks: Vec<_> = keys
        .iter()
        .cloned()
        .map(|key| tokio::spawn(async move { charge(addr, &key, r#"{"amount_cents":250}"#).await }))
        .collect();
    tokio::time::sleep(std::time::Duration::from_millis(45)).await;
    server.kill().await;
    // What each key answered before the kill, if anything.
    let mut before = Vec::new();
    for task in tasks {
        let answer = task.await.unwrap();
        before.push(answer.and_then(|answer| {
            assert_eq!(answer.status, 201, "{answer:?}");
            answer.body["charge_id"].as_str().map(str::to_owned)
        }));
    }
    let server = start(&db, &[]).await;
    let taken = stats(server.addr).await;
    for key in &keys {
        assert!(
            taken["charges_by_key"][key].as_i64().unwrap_or(0) <= 1,
            "{key}: {taken}"
        );
    }
    for (key, id) in keys.iter().zip(&before) {
        let answer = charge(server.addr, key, r#"{"amount_cents":250}"#)
            .await
            .unwrap();
        assert_eq!(answer.status, 201, "{key}: {answer:?}");
        if let Some(id) = id {
            assert_eq!(
                answer.body["charge_id"].as_str(),
                Some(id.as_str()),
                "{key}"
            );
        }
    }
    let stats = stats(server.addr).await;
    assert_eq!(stats["charges"], 40, "{stats}");
    for key in &keys {
        assert_eq!(stats["charges_by_key"][key], 1, "{key}");
    }
    // Durable: at least every retry and every request that reached the first process.
    assert!(stats["requests"].as_i64().unwrap() >= 40, "{stats}");
}

test! { concurrent_repeats_of_a_key_charge_once_and_delay_ms_waits }
async fn concurrent_repeats_of_a_key_charge_once_and_delay_ms_waits() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("payments.db"), &["--delay-ms", "200"]).await;
    let addr = server.addr;
    let started = std::time::Instant::now();
    let tasks: Vec<_> = (0..8)
        .map(|_| tokio::spawn(async move { charge(addr, "same", r#"{"amount_cents":900}"#).await }))
        .collect();
    let mut ids = Vec::new();
    for task in tasks {
        let answer = task.await.unwrap().expect("an answer");
        match answer.status {
            201 => ids.push(answer.body["charge_id"].as_str().unwrap().to_owned()),
            // The layer's answer to a duplicate while the first is still being handled.
            409 => assert_eq!(answer.body["error"], "request_in_flight", "{answer:?}"),
            _ => panic!("unexpected answer {answer:?}"),
        }
    }
    assert!(
        started.elapsed() >= std::time::Duration::from_millis(200),
        "--delay-ms waits"
    );
    ids.dedup();
    assert_eq!(ids.len(), 1, "one charge id: {ids:?}");
    assert_eq!(
        stats(addr).await["charges_by_key"],
        serde_json::json!({ "same": 1 })
    );
}
