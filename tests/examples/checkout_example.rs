//! The steps mode proven on real processes: the `checkout` example (`examples/checkout.rs`)
//! charging at the `payments` example (with its SQLite file), killed with SIGKILL at every
//! boundary of a request (the example's `CHECKOUT_PAUSE_AT` stops it there first), stalled with
//! SIGSTOP past its lease, raced by concurrent retries, finished by its completer, declined and
//! refused by the provider. After each, every key ends with exactly one charge at the provider,
//! one order, paid with that charge, and every answer to the key is the same bytes.
//!
//! The suite is written once and run by `checkout_tests!` on each of the example's stores:
//! SQLite (`--db`, a file in a temp dir) and PostgreSQL (`--database-url`, a schema of its own
//! per test in the database of `TEST_DATABASE_URL`; reported as ignored without it).

use support::{common, pg_common};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::process::{self, arg, ExampleProcess};
use serde_json::Value;
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const ORDER: &str = r#"{"sku":"book","quantity":1,"amount_cents":1200}"#;
const DECLINED: &str = r#"{"sku":"book","quantity":1,"amount_cents":402}"#;
const TOKEN: &str = "shop-a-token";
/// The lease the tests run with, so that a retry takes a killed request's key over quickly.
const LEASE_MS: &str = "2000";
/// How long a test waits for a key to finish (reached only when it fails).
const PATIENCE: Duration = Duration::from_secs(25);

/// An answer: status, headers (lowercase names) and the body as sent.
#[derive(Clone, Debug)]
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }

    /// What must be the same on every answer to a key: status, `Location`, `Content-Type`
    /// and the body's bytes (the replay marker and `Date` differ).
    fn replayed_part(&self) -> (u16, Option<&str>, Option<&str>, &str) {
        (
            self.status,
            self.header("location"),
            self.header("content-type"),
            &self.body,
        )
    }

    /// A refusal to retry later: the key is busy or the provider unavailable.
    fn is_retry_later(&self) -> bool {
        matches!(self.status, 503 | 409)
    }
}

/// One HTTP/1.1 request on its own connection; `None` when the connection closed without an
/// answer (the process was killed).
async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Option<Answer> {
    let mut stream = TcpStream::connect(addr).await.ok()?;
    let headers: String = headers
        .iter()
        .map(|(name, value)| format!("{name}: {value}\r\n"))
        .collect();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{headers}\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.ok()?;
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
        body: body.to_owned(),
    })
}

async fn checkout(addr: SocketAddr, key: &str, body: &str) -> Option<Answer> {
    let authorization = format!("Bearer {TOKEN}");
    request(
        addr,
        "POST",
        "/checkouts",
        &[("Authorization", &authorization), ("Idempotency-Key", key)],
        body,
    )
    .await
}

/// `GET /orders/{id}` as shop-a.
async fn order(addr: SocketAddr, id: i64) -> Answer {
    let authorization = format!("Bearer {TOKEN}");
    request(
        addr,
        "GET",
        &format!("/orders/{id}"),
        &[("Authorization", &authorization)],
        "",
    )
    .await
    .expect("the order is answered")
}

async fn stats(payments: SocketAddr) -> Value {
    request(payments, "GET", "/stats", &[], "")
        .await
        .expect("stats answered")
        .json()
}

/// Retries `key` until it gets an answer that is not "retry later".
async fn retry_until_final(addr: SocketAddr, key: &str, body: &str) -> Answer {
    let started = Instant::now();
    loop {
        match checkout(addr, key, body).await {
            Some(answer) if !answer.is_retry_later() => return answer,
            other => assert!(
                started.elapsed() < PATIENCE,
                "{key} still not final after {PATIENCE:?}: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The store the checkout processes run on.
#[derive(Clone, Copy, Debug)]
enum Store {
    /// `--db FILE`.
    Sqlite,
    /// `--database-url URL`.
    Postgres,
}

/// The checkout's database: shared by every checkout process of a test.
enum CheckoutDb {
    Sqlite(PathBuf),
    Postgres(pg_common::TestDb),
}

/// The two programs' databases: the provider's file and the checkout's store.
struct Files {
    checkout: CheckoutDb,
    payments: PathBuf,
    // Last: removed after the checkout's database is dropped.
    _dir: TempDir,
}

/// Fresh databases for a test on `store`; `None` (after saying so) when its server is not
/// configured.
async fn files(store: Store) -> Option<Files> {
    let dir = tempfile::tempdir().unwrap();
    let checkout = match store {
        Store::Sqlite => CheckoutDb::Sqlite(dir.path().join("checkout.db")),
        Store::Postgres => CheckoutDb::Postgres(pg_common::TestDb::create().await?),
    };
    Some(Files {
        checkout,
        payments: dir.path().join("payments.db"),
        _dir: dir,
    })
}

impl Files {
    /// The checkout's flags for its database.
    fn checkout_args(&self) -> [String; 2] {
        match &self.checkout {
            CheckoutDb::Sqlite(path) => ["--db".to_owned(), arg(path).to_owned()],
            CheckoutDb::Postgres(db) => ["--database-url".to_owned(), db.url()],
        }
    }
}

async fn start_payments(files: &Files, flags: &[&str]) -> ExampleProcess {
    let mut args = vec!["--db", arg(&files.payments)];
    args.extend_from_slice(flags);
    ExampleProcess::start("payments", &args).await
}

/// A checkout process on the test's database charging at `payments`, with `flags` and `env`.
async fn start_checkout(
    files: &Files,
    payments: SocketAddr,
    flags: &[&str],
    env: &[(&str, &str)],
) -> ExampleProcess {
    let url = format!("http://{payments}");
    let database = files.checkout_args();
    let mut args = vec![
        database[0].as_str(),
        database[1].as_str(),
        "--payments",
        &url,
        "--lease-ms",
        LEASE_MS,
    ];
    args.extend_from_slice(flags);
    ExampleProcess::start_with_env("checkout", &args, env).await
}

/// Waits for the line `paused at POINT`.
async fn paused_at(process: &mut ExampleProcess, point: &str) {
    let line = process.next_line().await;
    assert_eq!(line, format!("paused at {point}"));
}

/// Polls `GET /orders/1` until it is `status`.
async fn wait_for_order(addr: SocketAddr, status: &str) -> Value {
    let started = Instant::now();
    loop {
        let answer = order(addr, 1).await;
        if answer.status == 200 && answer.json()["status"] == status {
            return answer.json();
        }
        assert!(
            started.elapsed() < PATIENCE,
            "order 1 not {status} after {PATIENCE:?}: {answer:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The end every paid key must reach: one charge at the provider for one provider key, order
/// 1 paid with that charge (and no order 2), and `answers` all the same `201` naming them.
async fn assert_paid_once(checkout: SocketAddr, payments: SocketAddr, answers: &[Answer]) {
    let first = &answers[0];
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(first.header("location"), Some("/orders/1"), "{first:?}");
    for answer in answers {
        assert_eq!(
            answer.replayed_part(),
            first.replayed_part(),
            "{answers:#?}"
        );
    }
    let charge_id = first.json()["charge_id"]
        .as_str()
        .expect("a charge id")
        .to_owned();
    assert_eq!(first.json()["order_id"], 1);
    let stats = stats(payments).await;
    assert_eq!(stats["charges"], 1, "{stats}");
    let by_key = stats["charges_by_key"].as_object().expect("charges_by_key");
    assert_eq!(by_key.len(), 1, "{stats}");
    assert_eq!(by_key.values().next(), Some(&Value::from(1)), "{stats}");
    let order = order(checkout, 1).await;
    assert_eq!(order.status, 200);
    assert_eq!(
        order.json(),
        serde_json::json!({ "order_id": 1, "status": "paid", "charge_id": charge_id })
    );
    assert_eq!(order_count(checkout).await, 1);
}

/// How many orders exist: ids count up from 1, so the first missing id.
async fn order_count(checkout: SocketAddr) -> i64 {
    let mut id = 1;
    while order(checkout, id).await.status == 200 {
        id += 1;
    }
    id - 1
}

async fn a_checkout_is_paid_once_and_every_retry_replays_it(store: Store) {
    let Some(files) = files(store).await else {
        return;
    };
    let payments = start_payments(&files, &[]).await;
    let shop = start_checkout(&files, payments.addr, &[], &[]).await;
    let first = checkout(shop.addr, "k1", ORDER).await.expect("answered");
    assert_eq!(first.header("idempotent-replayed"), None, "{first:?}");
    let mut answers = vec![first];
    for _ in 0..2 {
        let replay = checkout(shop.addr, "k1", ORDER).await.expect("answered");
        assert_eq!(
            replay.header("idempotent-replayed"),
            Some("true"),
            "{replay:?}"
        );
        answers.push(replay);
    }
    assert_paid_once(shop.addr, payments.addr, &answers).await;
    // The next key is the next order.
    let second = checkout(shop.addr, "k2", ORDER).await.expect("answered");
    assert_eq!(second.status, 201, "{second:?}");
    assert_eq!(second.json()["order_id"], 2, "{second:?}");
    assert_eq!(stats(payments.addr).await["charges"], 2);
}

/// How the key is finished after the kill.
#[derive(Clone, Copy, PartialEq)]
enum Finish {
    /// The client retries the same key.
    Retry,
    /// A restarted process with `--completer` finishes it; the client only retries after.
    Completer,
    /// Two restarted processes on the same database get 8 retries of the key at once (under a
    /// short lease, so the killed request's runs out soon).
    ConcurrentRetries,
}

/// The lease of [`Finish::ConcurrentRetries`]' processes.
const SHORT_LEASE: [&str; 2] = ["--lease-ms", "1500"];

/// SIGKILLs a checkout process stopped at `point` in a request, restarts it (and the provider,
/// if it ran with `provider_flags`) and finishes the key as `finish` says.
async fn crash_at(store: Store, point: &str, provider_flags: &[&str], finish: Finish) {
    let Some(files) = files(store).await else {
        return;
    };
    let payments = start_payments(&files, provider_flags).await;
    let lease: &[&str] = match finish {
        Finish::ConcurrentRetries => &SHORT_LEASE,
        _ => &[],
    };
    let mut first = start_checkout(
        &files,
        payments.addr,
        lease,
        &[("CHECKOUT_PAUSE_AT", point)],
    )
    .await;
    let addr = first.addr;
    let pending = tokio::spawn(async move { checkout(addr, "k1", ORDER).await });
    paused_at(&mut first, point).await;
    first.kill().await;
    let lost = pending.await.unwrap();
    assert!(
        lost.is_none(),
        "the killed request was not answered: {lost:?}"
    );

    let payments = if provider_flags.is_empty() {
        payments
    } else {
        // The provider charged and dropped the answer: it runs without faults from now on.
        payments.kill().await;
        start_payments(&files, &[]).await
    };
    if finish == Finish::ConcurrentRetries {
        let a = start_checkout(&files, payments.addr, lease, &[]).await;
        let b = start_checkout(&files, payments.addr, lease, &[]).await;
        let tasks: Vec<_> = (0..8)
            .map(|i| {
                let addr = if i % 2 == 0 { a.addr } else { b.addr };
                tokio::spawn(async move { retry_until_final(addr, "k1", ORDER).await })
            })
            .collect();
        let mut answers = Vec::new();
        for task in tasks {
            answers.push(task.await.unwrap());
        }
        answers.push(checkout(b.addr, "k1", ORDER).await.expect("answered"));
        assert_paid_once(a.addr, payments.addr, &answers).await;
        return;
    }
    let flags: &[&str] = match finish {
        Finish::Completer => &["--completer"],
        _ => &[],
    };
    let second = start_checkout(&files, payments.addr, flags, &[]).await;
    if finish == Finish::Completer {
        // Nobody retries: the completer finishes the key once it has been left 5 s.
        wait_for_order(second.addr, "paid").await;
    }
    let mut answers = vec![retry_until_final(second.addr, "k1", ORDER).await];
    for _ in 0..2 {
        answers.push(checkout(second.addr, "k1", ORDER).await.expect("answered"));
    }
    // And after another restart.
    second.kill().await;
    let third = start_checkout(&files, payments.addr, &[], &[]).await;
    answers.push(checkout(third.addr, "k1", ORDER).await.expect("answered"));
    if point == "before_response" {
        assert_eq!(answers[0].header("idempotent-replayed"), Some("true"));
    }
    assert_paid_once(third.addr, payments.addr, &answers).await;
}

async fn killed_after_taking_the_key_a_retry_finishes_it_once(store: Store) {
    crash_at(store, "after_claim", &[], Finish::Retry).await;
}

async fn killed_after_the_order_committed_a_retry_finishes_it_once(store: Store) {
    crash_at(store, "after_insert", &[], Finish::Retry).await;
}

async fn killed_after_the_intent_before_the_call_a_retry_finishes_it_once(store: Store) {
    crash_at(store, "after_intent", &[], Finish::Retry).await;
}

async fn killed_after_the_provider_charged_before_its_answer_arrived_a_retry_charges_once(
    store: Store,
) {
    crash_at(
        store,
        "after_call",
        &["--drop-after-charge-rate", "1"],
        Finish::Retry,
    )
    .await;
}

async fn killed_after_the_answer_before_its_commit_a_retry_charges_once(store: Store) {
    crash_at(store, "after_call", &[], Finish::Retry).await;
}

async fn killed_after_the_last_step_a_retry_finishes_it_once(store: Store) {
    crash_at(store, "after_paid", &[], Finish::Retry).await;
}

async fn killed_after_saving_before_answering_a_retry_replays(store: Store) {
    crash_at(store, "before_response", &[], Finish::Retry).await;
}

/// Concurrent retries on two processes at each recovery point: after taking the key, after
/// the order's commit, after the intent, after the provider charged but its answer was lost,
/// after the answer before its commit, after the last step, after the response was saved.
async fn concurrent_retries_at_every_recovery_point_charge_once(store: Store) {
    for (point, provider_flags) in [
        ("after_claim", &[][..]),
        ("after_insert", &[]),
        ("after_intent", &[]),
        ("after_call", &["--drop-after-charge-rate", "1"]),
        ("after_call", &[]),
        ("after_paid", &[]),
        ("before_response", &[]),
    ] {
        crash_at(store, point, provider_flags, Finish::ConcurrentRetries).await;
    }
}

async fn the_completer_finishes_a_key_abandoned_after_the_order_committed(store: Store) {
    crash_at(store, "after_insert", &[], Finish::Completer).await;
}

async fn the_completer_finishes_a_key_whose_charge_answer_was_lost(store: Store) {
    crash_at(
        store,
        "after_call",
        &["--drop-after-charge-rate", "1"],
        Finish::Completer,
    )
    .await;
}

async fn the_completer_racing_a_client_retry_charges_once(store: Store) {
    let Some(files) = files(store).await else {
        return;
    };
    let payments = start_payments(&files, &["--delay-ms", "1000"]).await;
    let mut first = start_checkout(
        &files,
        payments.addr,
        &[],
        &[("CHECKOUT_PAUSE_AT", "after_insert")],
    )
    .await;
    let addr = first.addr;
    let pending = tokio::spawn(async move { checkout(addr, "k1", ORDER).await });
    paused_at(&mut first, "after_insert").await;
    first.kill().await;
    assert!(pending.await.unwrap().is_none());
    let killed_at = Instant::now();
    let second = start_checkout(&files, payments.addr, &["--completer"], &[]).await;
    // The completer takes the key 5 to 5.5 s after it was left and holds it for the charge (1 s
    // at the provider): the client retries before, during and after.
    tokio::time::sleep(Duration::from_millis(4900).saturating_sub(killed_at.elapsed())).await;
    let addr = second.addr;
    let tasks: Vec<_> = (0..4)
        .map(|i| {
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(400 * i)).await;
                retry_until_final(addr, "k1", ORDER).await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    assert_paid_once(second.addr, payments.addr, &answers).await;
}

/// A process stopped at `point` (SIGSTOP) past its lease; a retry on a second process takes
/// the key over and finishes it; then the stopped one resumes (SIGCONT), and its next commit
/// is refused: it answers `503`. Returns the provider's stats (`None`: skipped).
async fn stalled_at(store: Store, point: &str) -> Option<Value> {
    let files = files(store).await?;
    let payments = start_payments(&files, &[]).await;
    // It stops for a second at the point: long enough for the test to SIGSTOP it there.
    let mut stalled = start_checkout(
        &files,
        payments.addr,
        &[],
        &[("CHECKOUT_PAUSE_AT", point), ("CHECKOUT_PAUSE_MS", "1000")],
    )
    .await;
    let other = start_checkout(&files, payments.addr, &[], &[]).await;
    let addr = stalled.addr;
    let pending = tokio::spawn(async move { checkout(addr, "k1", ORDER).await });
    paused_at(&mut stalled, point).await;
    stalled.signal("STOP");
    // Past its lease (2 s from its last commit).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let taken_over = retry_until_final(other.addr, "k1", ORDER).await;
    assert_eq!(taken_over.status, 201, "{taken_over:?}");
    stalled.signal("CONT");
    let refused = pending
        .await
        .unwrap()
        .expect("the stalled request is answered");
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(refused.header("retry-after"), Some("1"), "{refused:?}");
    let answers = vec![
        taken_over,
        checkout(stalled.addr, "k1", ORDER).await.unwrap(),
        checkout(other.addr, "k1", ORDER).await.unwrap(),
    ];
    assert_paid_once(other.addr, payments.addr, &answers).await;
    Some(stats(payments.addr).await)
}

async fn a_stalled_owner_past_its_lease_cannot_commit_the_charge_it_got(store: Store) {
    let Some(stats) = stalled_at(store, "after_call").await else {
        return;
    };
    // Both processes called (the same provider key): one charge.
    assert_eq!(stats["requests"], 2, "{stats}");
}

async fn a_stalled_owner_past_its_lease_cannot_commit_its_intent_nor_call(store: Store) {
    let Some(stats) = stalled_at(store, "after_insert").await else {
        return;
    };
    // Only the process that took over called the provider.
    assert_eq!(stats["requests"], 1, "{stats}");
}

async fn concurrent_retries_on_two_processes_after_a_kill_charge_once(store: Store) {
    let Some(files) = files(store).await else {
        return;
    };
    let payments = start_payments(&files, &["--delay-ms", "300"]).await;
    let mut first = start_checkout(
        &files,
        payments.addr,
        &[],
        &[("CHECKOUT_PAUSE_AT", "after_intent")],
    )
    .await;
    let addr = first.addr;
    let pending = tokio::spawn(async move { checkout(addr, "k1", ORDER).await });
    paused_at(&mut first, "after_intent").await;
    first.kill().await;
    assert!(pending.await.unwrap().is_none());
    let a = start_checkout(&files, payments.addr, &[], &[]).await;
    let b = start_checkout(&files, payments.addr, &[], &[]).await;
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let addr = if i % 2 == 0 { a.addr } else { b.addr };
            tokio::spawn(async move { retry_until_final(addr, "k1", ORDER).await })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    assert_paid_once(a.addr, payments.addr, &answers).await;
}

async fn concurrent_first_requests_of_one_key_charge_once(store: Store) {
    let Some(files) = files(store).await else {
        return;
    };
    let payments = start_payments(&files, &["--delay-ms", "300"]).await;
    let shop = start_checkout(&files, payments.addr, &[], &[]).await;
    let addr = shop.addr;
    let tasks: Vec<_> = (0..8)
        .map(|_| tokio::spawn(async move { retry_until_final(addr, "k1", ORDER).await }))
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    assert_paid_once(addr, payments.addr, &answers).await;
}

async fn a_declined_card_is_402_on_every_retry_never_charged_and_the_order_declined(store: Store) {
    let Some(files) = files(store).await else {
        return;
    };
    let payments = start_payments(&files, &[]).await;
    let mut first = start_checkout(
        &files,
        payments.addr,
        &[],
        &[("CHECKOUT_PAUSE_AT", "after_call")],
    )
    .await;
    let addr = first.addr;
    let pending = tokio::spawn(async move { checkout(addr, "k402", DECLINED).await });
    // Killed with the decline in hand, before it committed.
    paused_at(&mut first, "after_call").await;
    first.kill().await;
    assert!(pending.await.unwrap().is_none());
    let shop = start_checkout(&files, payments.addr, &[], &[]).await;
    let mut answers = vec![retry_until_final(shop.addr, "k402", DECLINED).await];
    for _ in 0..2 {
        answers.push(checkout(shop.addr, "k402", DECLINED).await.unwrap());
    }
    for answer in &answers {
        assert_eq!(answer.replayed_part(), answers[0].replayed_part());
    }
    assert_eq!(answers[0].status, 402, "{:?}", answers[0]);
    assert_eq!(answers[0].body, r#"{"error":"card_declined"}"#);
    let stats = stats(payments.addr).await;
    assert_eq!(stats["charges"], 0, "{stats}");
    assert_eq!(
        order(shop.addr, 1).await.json(),
        serde_json::json!({ "order_id": 1, "status": "declined", "charge_id": null })
    );
    assert_eq!(order_count(shop.addr).await, 1);
}

async fn an_unavailable_provider_is_503_and_a_later_retry_completes_the_same_order(store: Store) {
    let Some(files) = files(store).await else {
        return;
    };
    let payments = start_payments(&files, &["--fail-rate", "1"]).await;
    let shop = start_checkout(&files, payments.addr, &[], &[]).await;
    for _ in 0..2 {
        let refused = checkout(shop.addr, "k1", ORDER).await.unwrap();
        assert_eq!(refused.status, 503, "{refused:?}");
        assert!(refused.header("retry-after").is_some(), "{refused:?}");
    }
    // The order is in, pending, once.
    assert_eq!(order(shop.addr, 1).await.json()["status"], "pending");
    assert_eq!(order_count(shop.addr).await, 1);
    assert_eq!(stats(payments.addr).await["charges"], 0);
    // The provider is healthy again (a new process on its file, so a new address).
    payments.kill().await;
    let payments = start_payments(&files, &[]).await;
    shop.kill().await;
    let shop = start_checkout(&files, payments.addr, &[], &[]).await;
    let answers = vec![
        retry_until_final(shop.addr, "k1", ORDER).await,
        checkout(shop.addr, "k1", ORDER).await.unwrap(),
    ];
    assert_paid_once(shop.addr, payments.addr, &answers).await;
}

async fn bad_requests_are_answered_like_the_orders_example(store: Store) {
    let Some(files) = files(store).await else {
        return;
    };
    let payments = start_payments(&files, &[]).await;
    let shop = start_checkout(&files, payments.addr, &[], &[]).await;
    for (body, code) in [
        (
            r#"{"sku":"","quantity":1,"amount_cents":5}"#,
            "invalid_key_or_sku",
        ),
        (
            r#"{"sku":"book","quantity":0,"amount_cents":5}"#,
            "invalid_quantity",
        ),
        (
            r#"{"sku":"book","quantity":1,"amount_cents":0}"#,
            "invalid_amount_cents",
        ),
        (
            r#"{"sku":"book","quantity":1,"amount_cents":1.5}"#,
            "invalid_amount_cents",
        ),
        (r#"{"sku":"book","quantity":1}"#, "invalid_amount_cents"),
    ] {
        let answer = checkout(shop.addr, "bad", body).await.unwrap();
        assert_eq!(answer.status, 400, "{body}: {answer:?}");
        assert_eq!(answer.json()["error"], code, "{body}");
    }
    let unauthenticated = request(
        shop.addr,
        "POST",
        "/checkouts",
        &[("Idempotency-Key", "x")],
        ORDER,
    )
    .await
    .unwrap();
    assert_eq!(unauthenticated.status, 401);
    // Nothing was charged or kept: the same key with a good body is a new order 1.
    let answer = checkout(shop.addr, "bad", ORDER).await.unwrap();
    assert_paid_once(shop.addr, payments.addr, &[answer]).await;
    // Another tenant does not see it.
    let other = request(
        shop.addr,
        "GET",
        "/orders/1",
        &[("Authorization", "Bearer shop-b-token")],
        "",
    )
    .await
    .unwrap();
    assert_eq!(other.status, 404);
}

test! { bad_command_lines_are_refused_with_a_clear_message }
async fn bad_command_lines_are_refused_with_a_clear_message() {
    let both = process::run_example(
        "checkout",
        &[
            "--payments",
            "http://127.0.0.1:9",
            "--db",
            "x.db",
            "--database-url",
            "postgres://x/y",
        ],
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(both.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&both.stderr);
    assert!(
        stderr.contains("--db and --database-url: give one of them"),
        "{stderr}"
    );
    // Nothing listens on port 9: the store cannot connect, and says so.
    let unreachable = process::run_example(
        "checkout",
        &[
            "--payments",
            "http://127.0.0.1:9",
            "--database-url",
            "postgres://postgres@127.0.0.1:9/none",
        ],
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(unreachable.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&unreachable.stderr);
    assert!(stderr.contains("cannot open the store"), "{stderr}");
    let missing = process::run_example("checkout", &[], Duration::from_secs(60)).await;
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("--payments URL is required"));
}

/// The scenarios above, each a test on the store `$store`, in the module
/// `$backend`.
macro_rules! checkout_tests {
    ($backend:ident, $store:expr $(, $needs:ident)?) => {
        mod $backend {
            use super::*;

            checkout_tests!(@tests $store; [$($needs)?];
                a_checkout_is_paid_once_and_every_retry_replays_it,
                killed_after_taking_the_key_a_retry_finishes_it_once,
                killed_after_the_order_committed_a_retry_finishes_it_once,
                killed_after_the_intent_before_the_call_a_retry_finishes_it_once,
                killed_after_the_provider_charged_before_its_answer_arrived_a_retry_charges_once,
                killed_after_the_answer_before_its_commit_a_retry_charges_once,
                killed_after_the_last_step_a_retry_finishes_it_once,
                killed_after_saving_before_answering_a_retry_replays,
                the_completer_finishes_a_key_abandoned_after_the_order_committed,
                the_completer_finishes_a_key_whose_charge_answer_was_lost,
                the_completer_racing_a_client_retry_charges_once,
                a_stalled_owner_past_its_lease_cannot_commit_the_charge_it_got,
                a_stalled_owner_past_its_lease_cannot_commit_its_intent_nor_call,
                concurrent_retries_on_two_processes_after_a_kill_charge_once,
                concurrent_retries_at_every_recovery_point_charge_once,
                concurrent_first_requests_of_one_key_charge_once,
                a_declined_card_is_402_on_every_retry_never_charged_and_the_order_declined,
                an_unavailable_provider_is_503_and_a_later_retry_completes_the_same_order,
                bad_requests_are_answered_like_the_orders_example,
            );
        }
    };
    (@tests $store:expr; [$($needs:ident)?]; $name:ident, $($rest:ident,)*) => {
        test! { $name $(, $needs)? }
        async fn $name() {
            super::$name($store).await;
        }
        checkout_tests!(@tests $store; [$($needs)?]; $($rest,)*);
    };
    (@tests $store:expr; [$($needs:ident)?];) => {};
}

checkout_tests!(sqlite, Store::Sqlite);
checkout_tests!(postgres, Store::Postgres, postgres);
