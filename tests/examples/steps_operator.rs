//! What an operator does to step-by-step keys, on real processes: the `checkout` example
//! (`examples/checkout.rs`) charging at the `payments` example, which deduplicates by the
//! idempotency key it is sent, and the `admin` tool (`examples/admin.rs`) run as a process on
//! the checkout's database while the checkout runs.
//!
//! - A key used again after its record was deleted (`admin delete`) or expired starts a new
//!   life: its steps get new step keys, so the provider takes a second charge instead of
//!   answering the first one again, and each order is paid with a charge of its own.
//! - `admin resolve` refuses a key that is running (its owner is paused after the charge's
//!   intent, or in the middle of the call): exit status 1, `admin: refused:` on stderr, and
//!   nothing changes; the request finishes and the provider is called once.
//! - Keys that look like sf-strings once unquoted (`"evil`, `"x"`) are listed by `admin steps`
//!   exactly as they are stored, beside another tenant's key, and the checkout's completer
//!   still finishes every key in progress.
//!
//! Each scenario runs on SQLite (`--db`) and on PostgreSQL (`--database-url`, a schema of its
//! own per test in the database of `TEST_DATABASE_URL`; reported as ignored without it).

use support::apps::process::{self, arg, ExampleProcess};
use support::pg_common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::Value;
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tower_idempotency::store::sqlite::rusqlite;

const ORDER: &str = r#"{"sku":"book","quantity":1,"amount_cents":1200}"#;
const SHOP_A: &str = "shop-a-token";
const SHOP_B: &str = "shop-b-token";
/// How long a test waits for something that must happen (reached only when it fails).
const PATIENCE: Duration = Duration::from_secs(25);
/// How long the admin tool may take for one command.
const ADMIN_PATIENCE: Duration = Duration::from_secs(60);

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

    /// The `charge_id` of a `201`.
    fn charge_id(&self) -> String {
        self.json()["charge_id"]
            .as_str()
            .unwrap_or_else(|| panic!("no charge id in {self:?}"))
            .to_owned()
    }

    /// A refusal to retry later: the key is busy or the provider unavailable.
    fn is_retry_later(&self) -> bool {
        matches!(self.status, 503 | 409)
    }
}

/// One HTTP/1.1 request on its own connection; `None` when the connection closed without an
/// answer.
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

/// `POST /checkouts` as the tenant of `token`, with `key` as the `Idempotency-Key` header's
/// value exactly as given (a raw token or an sf-string).
async fn checkout(addr: SocketAddr, token: &str, key: &str, body: &str) -> Answer {
    let authorization = format!("Bearer {token}");
    request(
        addr,
        "POST",
        "/checkouts",
        &[("Authorization", &authorization), ("Idempotency-Key", key)],
        body,
    )
    .await
    .unwrap_or_else(|| panic!("POST /checkouts with key {key} is answered"))
}

/// `GET /orders/{id}` as the tenant of `token`.
async fn order(addr: SocketAddr, token: &str, id: i64) -> Answer {
    let authorization = format!("Bearer {token}");
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

/// Polls `GET /orders/{id}` until it is paid; returns its JSON.
async fn wait_until_paid(addr: SocketAddr, token: &str, id: i64) -> Value {
    let started = Instant::now();
    loop {
        let answer = order(addr, token, id).await;
        if answer.status == 200 && answer.json()["status"] == "paid" {
            return answer.json();
        }
        assert!(
            started.elapsed() < PATIENCE,
            "order {id} not paid after {PATIENCE:?}: {answer:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The provider's `GET /stats`: `requests`, `charges`, `charges_by_key`.
async fn stats(payments: SocketAddr) -> Value {
    request(payments, "GET", "/stats", &[], "")
        .await
        .expect("stats answered")
        .json()
}

/// The store the checkout runs on.
#[derive(Clone, Copy, Debug)]
enum Store {
    /// `--db FILE`.
    Sqlite,
    /// `--database-url URL`.
    Postgres,
}

/// The checkout's database.
enum CheckoutDb {
    Sqlite(PathBuf),
    Postgres(pg_common::TestDb),
}

/// The provider's file and the checkout's database.
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

/// What a run of the admin tool printed, and how it ended.
#[derive(Debug)]
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Ran {
    /// Asserts that it exited 0; returns its stdout.
    fn done(self) -> String {
        assert_eq!(self.code, Some(0), "{self:#?}");
        self.stdout
    }

    /// Asserts that it was refused (exit status 1, `admin: refused:` on stderr, nothing on
    /// stdout) because the key is running; returns its stderr.
    fn refused_as_running(self) -> String {
        assert_eq!(self.code, Some(1), "{self:#?}");
        assert!(self.stderr.starts_with("admin: refused:"), "{self:#?}");
        assert!(self.stderr.contains("is running"), "{self:#?}");
        assert_eq!(self.stdout, "", "{self:#?}");
        self.stderr
    }
}

impl Files {
    /// The flags naming the checkout's database, for the checkout and the admin tool.
    fn database_args(&self) -> [String; 2] {
        match &self.checkout {
            CheckoutDb::Sqlite(path) => ["--db".to_owned(), arg(path).to_owned()],
            CheckoutDb::Postgres(db) => ["--database-url".to_owned(), db.url()],
        }
    }

    /// Runs `admin <the checkout's database> <args>` as a process.
    async fn admin(&self, args: &[&str]) -> Ran {
        let database = self.database_args();
        let mut argv = vec![database[0].as_str(), database[1].as_str()];
        argv.extend_from_slice(args);
        let output = process::run_example("admin", &argv, ADMIN_PATIENCE).await;
        Ran {
            code: output.status.code(),
            stdout: String::from_utf8(output.stdout).expect("UTF-8 stdout"),
            stderr: String::from_utf8(output.stderr).expect("UTF-8 stderr"),
        }
    }

    /// Makes the record of `(tenant, checkout, key)` expired, as time would: its `expires_at`
    /// before its creation.
    async fn expire_record(&self, tenant: &str, key: &str) {
        const EXPIRE: &str = "UPDATE idempotency_records SET expires_at = created_at - 1 \
                              WHERE tenant = $1 AND operation = 'checkout' \
                              AND idempotency_key = $2";
        let changed = match &self.checkout {
            CheckoutDb::Sqlite(path) => {
                let connection = rusqlite::Connection::open(path).expect("open checkout.db");
                connection
                    .busy_timeout(Duration::from_secs(10))
                    .expect("busy timeout");
                let changed = connection
                    .execute(&EXPIRE.replace('$', "?"), [tenant, key])
                    .expect("expire the record");
                u64::try_from(changed).expect("a count")
            }
            CheckoutDb::Postgres(db) => db
                .client()
                .await
                .execute(EXPIRE, &[&tenant, &key])
                .await
                .expect("expire the record"),
        };
        assert_eq!(changed, 1, "one record expired");
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
    let database = files.database_args();
    let mut args = vec![
        database[0].as_str(),
        database[1].as_str(),
        "--payments",
        &url,
    ];
    args.extend_from_slice(flags);
    ExampleProcess::start_with_env("checkout", &args, env).await
}

/// `(tenant, key)` of each key `admin steps` lists, sorted; the key exactly as printed after
/// its label's padding (nothing trimmed).
fn listed(output: &str) -> Vec<(&str, &str)> {
    let mut keys: Vec<_> = output
        .split("\n\n")
        .map(|block| {
            let key = block
                .lines()
                .find_map(|line| line.strip_prefix("key:         "))
                .unwrap_or_else(|| panic!("no key in:\n{block}"));
            (field(block, "tenant:"), key)
        })
        .collect();
    keys.sort_unstable();
    keys
}

/// The value of the first line starting with `label` (the label and padding removed).
fn field<'a>(output: &'a str, label: &str) -> &'a str {
    output
        .lines()
        .find_map(|line| line.strip_prefix(label))
        .map(str::trim)
        .unwrap_or_else(|| panic!("no `{label}` in:\n{output}"))
}

// ---------------------------------------------------------------------------------------------
// 1. A key used again after its record was deleted or expired: a new charge
// ---------------------------------------------------------------------------------------------

/// How the first life of the key ends.
#[derive(Clone, Copy, Debug)]
enum Forget {
    /// `admin delete`.
    Deleted,
    /// Its record's `expires_at` passes.
    Expired,
}

/// `order-77` is paid (order 1, charge X), its record deleted or expired, and the same request
/// sent again: a new life of the key, order 2, paid with a second charge Y. The provider
/// deduplicates by the key it is sent, so a step key that did not change with the life would
/// get X back (one charge at the provider, two orders paid with it).
async fn a_key_used_again_after_its_record_is_gone_is_charged_again(store: Store, forget: Forget) {
    let Some(files) = files(store).await else {
        return;
    };
    let payments = start_payments(&files, &[]).await;
    let shop = start_checkout(&files, payments.addr, &[], &[]).await;

    let first = checkout(shop.addr, SHOP_A, "order-77", ORDER).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(first.json()["order_id"], 1, "{first:?}");
    let first_charge = first.charge_id();

    match forget {
        Forget::Deleted => {
            let out = files
                .admin(&[
                    "delete",
                    "--tenant",
                    "shop-a",
                    "--operation",
                    "checkout",
                    "--key",
                    "order-77",
                ])
                .await
                .done();
            assert_eq!(out, "deleted the record for (shop-a, checkout, order-77)\n");
        }
        Forget::Expired => {
            files.expire_record("shop-a", "order-77").await;
            let out = files.admin(&["count", "--operation", "checkout"]).await;
            assert_eq!(out.done(), "live: 0\nexpired: 1\n");
        }
    }

    let second = checkout(shop.addr, SHOP_A, "order-77", ORDER).await;
    assert_eq!(second.status, 201, "{second:?}");
    assert_eq!(second.header("idempotent-replayed"), None, "{second:?}");
    assert_eq!(second.json()["order_id"], 2, "{second:?}");
    assert_eq!(second.header("location"), Some("/orders/2"), "{second:?}");
    let second_charge = second.charge_id();
    assert_ne!(
        second_charge, first_charge,
        "the key's second life was paid with its first life's charge"
    );
    // The second life is saved and replayed as any key.
    let replay = checkout(shop.addr, SHOP_A, "order-77", ORDER).await;
    assert_eq!(
        replay.header("idempotent-replayed"),
        Some("true"),
        "{replay:?}"
    );
    assert_eq!((replay.status, &replay.body), (201, &second.body));

    // Two charges taken, each under a provider key of its own, once each.
    let stats = stats(payments.addr).await;
    assert_eq!(stats["requests"], 2, "{stats}");
    assert_eq!(stats["charges"], 2, "{stats}");
    let by_key = stats["charges_by_key"].as_object().expect("charges_by_key");
    assert_eq!(by_key.len(), 2, "{stats}");
    assert!(by_key.values().all(|count| count == 1), "{stats}");
    // And as many orders paid, each with its own charge.
    for (id, charge) in [(1, &first_charge), (2, &second_charge)] {
        assert_eq!(
            order(shop.addr, SHOP_A, id).await.json(),
            serde_json::json!({ "order_id": id, "status": "paid", "charge_id": charge })
        );
    }
    assert_eq!(order(shop.addr, SHOP_A, 3).await.status, 404);
}

async fn a_key_used_again_after_admin_delete_is_charged_again(store: Store) {
    a_key_used_again_after_its_record_is_gone_is_charged_again(store, Forget::Deleted).await;
}

async fn a_key_used_again_after_its_record_expired_is_charged_again(store: Store) {
    a_key_used_again_after_its_record_is_gone_is_charged_again(store, Forget::Expired).await;
}

// ---------------------------------------------------------------------------------------------
// 2. resolve refuses a running key
// ---------------------------------------------------------------------------------------------

/// Where the running request is while the operator tries to resolve its key.
#[derive(Clone, Copy, Debug)]
enum Holding {
    /// Paused (`CHECKOUT_PAUSE_AT=after_intent`) after the charge's intent committed, before
    /// the call.
    AfterIntent,
    /// In the call: the provider takes 4 s to answer (`--delay-ms`).
    MidCall,
}

impl Holding {
    /// How long the request holds its key: long enough for the admin commands and a retry to
    /// happen meanwhile; in the call, less than the checkout's 5 s budget for a charge.
    fn millis(self) -> u64 {
        match self {
            Holding::AfterIntent => 6000,
            Holding::MidCall => 4000,
        }
    }
}

/// A key whose request is `holding`: `admin steps --status running` shows it with its run id;
/// `admin resolve` refuses it however asked (call again, done with a result, or as a dead
/// letter) and changes nothing; a retry meanwhile does not call the provider; the request
/// finishes with one call and one charge.
async fn resolve_refuses_a_running_key(store: Store, holding: Holding) {
    let Some(files) = files(store).await else {
        return;
    };
    let hold = Duration::from_millis(holding.millis());
    let delay = holding.millis().to_string();
    let (provider_flags, env): (&[&str], &[(&str, &str)]) = match holding {
        Holding::AfterIntent => (
            &[],
            &[
                ("CHECKOUT_PAUSE_AT", "after_intent"),
                ("CHECKOUT_PAUSE_MS", &delay),
            ],
        ),
        Holding::MidCall => (&["--delay-ms", &delay], &[]),
    };
    let payments = start_payments(&files, provider_flags).await;
    // A lease far longer than the hold: nobody may take the key over meanwhile.
    let mut shop = start_checkout(&files, payments.addr, &["--lease-ms", "30000"], env).await;
    let addr = shop.addr;
    let pending = tokio::spawn(async move { checkout(addr, SHOP_A, "k1", ORDER).await });
    match holding {
        Holding::AfterIntent => {
            assert_eq!(shop.next_line().await, "paused at after_intent");
        }
        Holding::MidCall => {
            // The provider counts a request as it arrives, before its delay.
            let started = Instant::now();
            while stats(payments.addr).await["requests"] != 1 {
                assert!(started.elapsed() < PATIENCE, "the charge never arrived");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }

    let held_at = Instant::now();
    let running = files.admin(&["steps", "--status", "running"]).await.done();
    assert_eq!(listed(&running), [("shop-a", "k1")], "{running}");
    assert_eq!(field(&running, "operation:"), "checkout");
    assert_eq!(field(&running, "status:"), "running");
    // The order, then the charge's intent.
    assert_eq!(field(&running, "steps saved:"), "2", "{running}");
    let run = field(&running, "run:");
    assert!(
        run.len() == 32 && run.bytes().all(|b| b.is_ascii_hexdigit()),
        "the run id: {run:?}"
    );

    let scope = [
        "resolve",
        "--tenant",
        "shop-a",
        "--operation",
        "checkout",
        "--key",
        "k1",
    ];
    for how in [
        &["--step", "1", "--call-again"][..],
        &["--step", "1", "--done", r#""ch_forged""#],
        // As a dead letter.
        &[],
    ] {
        let ran = files.admin(&[&scope[..], how].concat()).await;
        let stderr = ran.refused_as_running();
        assert!(
            stderr.contains("(shop-a, checkout, k1)"),
            "{how:?}: {stderr}"
        );
    }
    // Nothing changed: the same key, run, steps, attempts and times.
    let after = files.admin(&["steps", "--status", "running"]).await.done();
    assert!(
        held_at.elapsed() < hold,
        "the checks took {:?}, longer than the {hold:?} the key was held: inconclusive",
        held_at.elapsed()
    );
    assert_eq!(after, running, "resolve changed a running key");
    assert_eq!(files.admin(&["steps"]).await.done(), "no keys in_doubt\n");

    // A retry meanwhile waits for the running request or is told to come back: it never calls
    // the provider itself.
    let retry = tokio::spawn(async move { checkout(addr, SHOP_A, "k1", ORDER).await });

    let first = pending.await.unwrap();
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(first.json()["order_id"], 1, "{first:?}");
    let charge = first.charge_id();
    assert_ne!(charge, "ch_forged");
    let retry = retry.await.unwrap();
    assert!(
        retry.is_retry_later() || (retry.status, &retry.body) == (201, &first.body),
        "{retry:?}"
    );
    let replay = checkout(addr, SHOP_A, "k1", ORDER).await;
    assert_eq!((replay.status, &replay.body), (201, &first.body));

    let stats = stats(payments.addr).await;
    assert_eq!(
        stats["requests"], 1,
        "the provider was called again: {stats}"
    );
    assert_eq!(stats["charges"], 1, "{stats}");
    assert_eq!(
        order(addr, SHOP_A, 1).await.json(),
        serde_json::json!({ "order_id": 1, "status": "paid", "charge_id": charge })
    );
    assert_eq!(order(addr, SHOP_A, 2).await.status, 404);
    let running = files.admin(&["steps", "--status", "running"]).await.done();
    assert_eq!(running, "no keys running\n");
}

async fn resolve_refuses_a_key_paused_after_its_charge_intent(store: Store) {
    resolve_refuses_a_running_key(store, Holding::AfterIntent).await;
}

async fn resolve_refuses_a_key_in_the_middle_of_its_charge(store: Store) {
    resolve_refuses_a_running_key(store, Holding::MidCall).await;
}

// ---------------------------------------------------------------------------------------------
// 3. Keys that look quoted once unquoted
// ---------------------------------------------------------------------------------------------

/// shop-a's keys sent as `"\"x\""` (the key `"x"`) and `"\"evil"` (the key `"evil`), and
/// shop-b's `k1`, left running by an unavailable provider (`503`, the order saved): `admin
/// steps --status running` lists the three exactly as stored; then, with the provider back, a
/// checkout with `--completer` finishes all three, and each key's retry replays its own order.
async fn keys_that_look_quoted_are_listed_as_stored_and_completed(store: Store) {
    let Some(files) = files(store).await else {
        return;
    };
    let payments = start_payments(&files, &["--fail-rate", "1"]).await;
    let shop = start_checkout(&files, payments.addr, &[], &[]).await;

    let x = checkout(shop.addr, SHOP_A, r#""\"x\"""#, ORDER).await;
    assert_eq!(x.status, 503, "{x:?}");
    let output = files.admin(&["steps", "--status", "running"]).await.done();
    assert_eq!(listed(&output), [("shop-a", r#""x""#)], "{output}");

    let evil = checkout(shop.addr, SHOP_A, r#""\"evil""#, ORDER).await;
    assert_eq!(evil.status, 503, "{evil:?}");
    let other = checkout(shop.addr, SHOP_B, "k1", ORDER).await;
    assert_eq!(other.status, 503, "{other:?}");
    assert_eq!(stats(payments.addr).await["charges"], 0);

    let output = files.admin(&["steps", "--status", "running"]).await.done();
    assert_eq!(
        listed(&output),
        [
            ("shop-a", r#""evil"#),
            ("shop-a", r#""x""#),
            ("shop-b", "k1")
        ],
        "{output}"
    );
    assert_eq!(files.admin(&["steps"]).await.done(), "no keys in_doubt\n");

    // The provider is back (a new process on its file); a checkout with the completer
    // finishes every key left for 5 s, without the clients.
    payments.kill().await;
    let payments = start_payments(&files, &[]).await;
    shop.kill().await;
    let shop = start_checkout(&files, payments.addr, &["--completer"], &[]).await;
    // The orders were inserted in the order the keys were sent.
    let paid_b = wait_until_paid(shop.addr, SHOP_B, 3).await;
    let paid_x = wait_until_paid(shop.addr, SHOP_A, 1).await;
    let paid_evil = wait_until_paid(shop.addr, SHOP_A, 2).await;

    // Each key's retry replays its own order, paid with its own charge.
    for (token, key, paid) in [
        (SHOP_B, "k1", &paid_b),
        (SHOP_A, r#""\"x\"""#, &paid_x),
        (SHOP_A, r#""\"evil""#, &paid_evil),
    ] {
        let replay = checkout(shop.addr, token, key, ORDER).await;
        assert_eq!(replay.status, 201, "{key}: {replay:?}");
        assert_eq!(replay.header("idempotent-replayed"), Some("true"), "{key}");
        assert_eq!(replay.json()["order_id"], paid["order_id"], "{key}");
        assert_eq!(replay.json()["charge_id"], paid["charge_id"], "{key}");
    }
    // `x` unquoted is another key: a new order.
    let plain = checkout(shop.addr, SHOP_A, "x", ORDER).await;
    assert_eq!(plain.status, 201, "{plain:?}");
    assert_eq!(plain.header("idempotent-replayed"), None, "{plain:?}");
    assert_eq!(plain.json()["order_id"], 4, "{plain:?}");

    let stats = stats(payments.addr).await;
    assert_eq!(stats["charges"], 4, "{stats}");
    let running = files.admin(&["steps", "--status", "running"]).await.done();
    assert_eq!(running, "no keys running\n");
    // The records are named as listed.
    let record = files
        .admin(&[
            "inspect",
            "--tenant",
            "shop-a",
            "--operation",
            "checkout",
            "--key",
            r#""evil"#,
        ])
        .await
        .done();
    assert_eq!(field(&record, "key:"), r#""evil"#, "{record}");
    assert_eq!(field(&record, "status:"), "201", "{record}");
}

/// The scenarios above, each a test on the store `$store`, in the module `$backend`.
macro_rules! operator_tests {
    ($backend:ident, $store:expr $(, $needs:ident)?) => {
        mod $backend {
            use super::*;

            operator_tests!(@tests $store; [$($needs)?];
                a_key_used_again_after_admin_delete_is_charged_again,
                a_key_used_again_after_its_record_expired_is_charged_again,
                resolve_refuses_a_key_paused_after_its_charge_intent,
                resolve_refuses_a_key_in_the_middle_of_its_charge,
                keys_that_look_quoted_are_listed_as_stored_and_completed,
            );
        }
    };
    (@tests $store:expr; [$($needs:ident)?]; $name:ident, $($rest:ident,)*) => {
        test! { $name $(, $needs)? }
        async fn $name() {
            super::$name($store).await;
        }
        operator_tests!(@tests $store; [$($needs)?]; $($rest,)*);
    };
    (@tests $store:expr; [$($needs:ident)?];) => {};
}

operator_tests!(sqlite, Store::Sqlite);
operator_tests!(postgres, Store::Postgres, postgres);
