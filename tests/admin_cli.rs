//! The admin tool (`examples/admin.rs`, run as a process) against a real orders database: records made by the order app over
//! HTTP, and outbox events delivered, retried and dead-lettered by a real relay.

mod common;

#[path = "admin_tool/mod.rs"]
mod admin;

use std::path::Path;
use std::time::{Duration, SystemTime};

use admin::{Exit, Failure};
use common::{post, TestServer, SHOP_A, SHOP_B};
use http::StatusCode;
use serde_json::json;
use tower_idempotency::admin::{Admin, RecordFilter, RecordState};
use tower_idempotency::body::BoxError;
use tower_idempotency::outbox::sqlite::{enqueue, SqliteOutbox};
use tower_idempotency::outbox::{sink_fn, EventStatus, OutboxEvent, Relay};

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

/// Runs `admin --db <db> <args>` and returns how it ended and what it printed.
async fn admin(db: &Path, args: &[&str]) -> (Result<Exit, Failure>, String) {
    let mut argv = vec!["--db".to_owned(), db.display().to_string()];
    argv.extend(args.iter().map(|arg| (*arg).to_owned()));
    let mut out = Vec::new();
    let result = admin::run(argv, &mut out).await;
    (result, String::from_utf8(out).expect("utf-8 output"))
}

/// A line of the output starting with `label`, with the label and padding removed.
fn field<'a>(output: &'a str, label: &str) -> &'a str {
    output
        .lines()
        .find_map(|line| line.strip_prefix(label))
        .map(str::trim)
        .unwrap_or_else(|| panic!("no `{label}` in:\n{output}"))
}

/// An order app with three records: shop-a's `k1` and `k2`, shop-b's `k1`.
async fn server_with_records() -> TestServer {
    let server = TestServer::spawn().await;
    for (token, key) in [(SHOP_A, "k1"), (SHOP_A, "k2"), (SHOP_B, "k1")] {
        let reply = post(server.addr, Some(token), Some(key), BOOK, &[]).await;
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    server
}

#[tokio::test]
async fn inspect_shows_the_record_without_its_body_unless_asked() {
    let server = server_with_records().await;
    let db = server.db_path.clone();

    let (result, output) = admin(
        &db,
        &[
            "inspect",
            "--tenant",
            "shop-a",
            "--operation",
            "create_order",
            "--key",
            "k1",
        ],
    )
    .await;
    assert!(matches!(result, Ok(Exit::Done)), "{result:?}");
    assert_eq!(field(&output, "tenant:"), "shop-a");
    assert_eq!(field(&output, "key:"), "k1");
    assert_eq!(field(&output, "state:"), "live");
    assert_eq!(field(&output, "status:"), "201");
    assert!(
        field(&output, "fingerprint:").starts_with("v2 sha256:"),
        "{output}"
    );
    assert_eq!(
        field(&output, "fingerprint:").len(),
        "v2 sha256:".len() + 64
    );
    assert!(output.contains("location: /orders/1"), "{output}");
    assert_eq!(field(&output, "body:"), "14 bytes (add --body to show it)");
    assert!(
        !output.contains("order_id"),
        "the body stays hidden:\n{output}"
    );
    // Times are RFC 3339 UTC, the expiry a day after the creation (the default retention).
    let created = field(&output, "created_at:");
    assert!(created.ends_with('Z') && created.len() == 24, "{created}");

    let (result, output) = admin(
        &db,
        &[
            "inspect",
            "--tenant=shop-a",
            "--operation=create_order",
            "--key=k1",
            "--body",
        ],
    )
    .await;
    assert!(matches!(result, Ok(Exit::Done)), "{result:?}");
    assert_eq!(field(&output, "body:"), r#"{"order_id":1}"#);

    let (result, output) = admin(
        &db,
        &[
            "inspect",
            "--tenant",
            "shop-a",
            "--operation",
            "create_order",
            "--key",
            "nope",
        ],
    )
    .await;
    assert!(matches!(result, Ok(Exit::NotFound)), "{result:?}");
    assert!(output.contains("no record"), "{output}");
}

#[tokio::test]
async fn delete_removes_one_key_and_the_next_request_runs_afresh() {
    let server = server_with_records().await;
    let db = server.db_path.clone();
    let scope = [
        "--tenant",
        "shop-a",
        "--operation",
        "create_order",
        "--key",
        "k1",
    ];

    let (result, output) = admin(&db, &[&["delete"][..], &scope].concat()).await;
    assert!(matches!(result, Ok(Exit::Done)), "{result:?} {output}");
    assert_eq!(server.record_count().await, 2, "only that record went");
    let (result, _) = admin(&db, &[&["delete"][..], &scope].concat()).await;
    assert!(matches!(result, Ok(Exit::NotFound)), "{result:?}");

    // Deleting a record forgets the key: the same request creates a new order.
    let reply = post(server.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert!(!reply.replayed());
    assert_eq!(server.order_count().await, 4);
}

#[tokio::test]
async fn count_and_purge_by_state() {
    let server = server_with_records().await;
    let db = server.db_path.clone();
    // shop-b's record expired an hour ago.
    common::execute(
        &server.store,
        "UPDATE idempotency_records SET expires_at = created_at - 3600000 WHERE tenant = 'shop-b'",
    )
    .await;

    let (result, output) = admin(&db, &["count"]).await;
    assert!(matches!(result, Ok(Exit::Done)), "{result:?}");
    assert_eq!(output, "live: 2\nexpired: 1\n");
    let (_, output) = admin(&db, &["count", "--tenant", "shop-a"]).await;
    assert_eq!(output, "live: 2\nexpired: 0\n");
    let (_, output) = admin(&db, &["count", "--operation", "create_note"]).await;
    assert_eq!(output, "live: 0\nexpired: 0\n");
    let (_, output) = admin(
        &db,
        &[
            "inspect",
            "--tenant",
            "shop-b",
            "--operation",
            "create_order",
            "--key",
            "k1",
        ],
    )
    .await;
    assert_eq!(field(&output, "state:"), "expired");

    let (result, output) = admin(&db, &["purge", "--batch", "1"]).await;
    assert!(matches!(result, Ok(Exit::Done)), "{result:?}");
    assert_eq!(output, "purged 1 expired record(s)\n");
    let (_, output) = admin(&db, &["count"]).await;
    assert_eq!(output, "live: 2\nexpired: 0\n");
}

#[tokio::test]
async fn dead_letters_are_listed_and_requeued() {
    let server = TestServer::spawn().await;
    let db = server.db_path.clone();
    let outbox = SqliteOutbox::install(&server.store).await.expect("install");
    let ids = server
        .store
        .write(|tx| {
            Ok((
                enqueue(tx, "order_created", &json!({ "sku": "poison" }))?,
                enqueue(tx, "order_created", &json!({ "sku": "book" }))?,
                enqueue(tx, "order_created", &json!({ "sku": "poison", "n": 2 }))?,
            ))
        })
        .await
        .expect("enqueue");
    let (poison, good, poison_2) = ids;
    let refuse_poison = sink_fn(|event: OutboxEvent| async move {
        if event.payload().contains("poison") {
            Err::<(), BoxError>("the receiver answered 422: unknown sku".into())
        } else {
            Ok(())
        }
    });
    let mut relay = Relay::new(outbox.clone(), refuse_poison).with_max_attempts(1);
    let report = relay.run_once().await.expect("round");
    assert_eq!((report.delivered, report.dead_lettered), (1, 2));

    let (_, output) = admin(&db, &["outbox"]).await;
    assert_eq!(output, "pending: 0\nin_flight: 0\ndelivered: 1\ndead: 2\n");

    let (result, output) = admin(&db, &["dead-letters"]).await;
    assert!(matches!(result, Ok(Exit::Done)), "{result:?}");
    let listed: Vec<&str> = output
        .lines()
        .filter_map(|line| line.strip_prefix("id:"))
        .map(str::trim)
        .collect();
    assert_eq!(listed, [poison.as_str(), poison_2.as_str()], "oldest first");
    assert!(
        output.contains("last_error:   the receiver answered 422: unknown sku"),
        "{output}"
    );
    assert!(
        output.contains(r#"payload:      {"sku":"poison"}"#),
        "{output}"
    );
    let (_, output) = admin(&db, &["dead-letters", "--limit", "1"]).await;
    assert_eq!(output.lines().filter(|l| l.starts_with("id:")).count(), 1);

    let (_, output) = admin(&db, &["event", "--id", good.as_str()]).await;
    assert_eq!(field(&output, "status:"), "delivered");
    assert_eq!(field(&output, "attempts:"), "1");

    // One by id: due again at once, attempts reset.
    let (result, output) = admin(&db, &["requeue", "--id", poison.as_str()]).await;
    assert!(matches!(result, Ok(Exit::Done)), "{result:?}");
    assert_eq!(output, format!("requeued {poison}\n"));
    let event = outbox
        .event(poison.as_str())
        .await
        .expect("read")
        .expect("event");
    assert_eq!((event.status, event.attempts), (EventStatus::Pending, 0));
    assert!(event.available_at <= SystemTime::now());
    // Only dead events can be requeued.
    let (result, _) = admin(&db, &["requeue", "--id", good.as_str()]).await;
    assert!(matches!(result, Ok(Exit::NotFound)), "{result:?}");

    // All of them; a relay that now accepts everything delivers both.
    let (_, output) = admin(&db, &["requeue", "--all"]).await;
    assert_eq!(output, "requeued 1 event(s)\n");
    let mut accepting = Relay::new(
        outbox.clone(),
        sink_fn(|_event: OutboxEvent| async { Ok::<(), BoxError>(()) }),
    );
    assert_eq!(accepting.run_once().await.expect("round").delivered, 2);
    let (_, output) = admin(&db, &["outbox"]).await;
    assert_eq!(output, "pending: 0\nin_flight: 0\ndelivered: 3\ndead: 0\n");
    let (_, output) = admin(&db, &["dead-letters"]).await;
    assert_eq!(output, "no dead-lettered events\n");
}

#[tokio::test]
async fn usage_errors_and_missing_databases_are_reported() {
    let dir = tempfile::tempdir().expect("temp dir");
    let missing = dir.path().join("missing.db");
    let (result, _) = admin(&missing, &["count"]).await;
    match result {
        Err(Failure::Failed(error)) => assert!(error.to_string().contains("no database")),
        other => panic!("expected a failure, got {other:?}"),
    }
    assert!(!missing.exists(), "the tool must not create a database");

    let server = TestServer::spawn().await;
    let db = server.db_path.clone();
    for args in [
        &["inspect", "--tenant", "shop-a"][..],
        &["frobnicate"],
        &["purge", "--batch", "0"],
        &["requeue"],
        &["count", "--bogus"],
    ] {
        let (result, _) = admin(&db, args).await;
        assert!(
            matches!(result, Err(Failure::Usage(_))),
            "{args:?}: {result:?}"
        );
    }
    let mut out = Vec::new();
    assert!(matches!(
        admin::run(Vec::<String>::new(), &mut out).await,
        Err(Failure::Usage(_))
    ));

    // A database without an outbox says so instead of creating one.
    let (result, _) = admin(&db, &["dead-letters"]).await;
    match result {
        Err(Failure::Failed(error)) => {
            assert!(error.to_string().contains("no outbox"), "{error}")
        }
        other => panic!("expected a failure, got {other:?}"),
    }

    let (result, output) = admin(&db, &["--help"]).await;
    assert!(matches!(result, Ok(Exit::Done)));
    assert!(output.starts_with("usage: admin"));
}

#[tokio::test]
async fn the_library_calls_behind_the_tool() {
    let server = server_with_records().await;
    let admin = Admin::new(server.store.clone());
    let record = admin
        .inspect("shop-a", "create_order", "k2", true)
        .await
        .expect("inspect")
        .expect("record");
    assert_eq!(record.state, RecordState::Live);
    assert_eq!(record.status, StatusCode::CREATED);
    assert_eq!(record.body.as_deref(), Some(&br#"{"order_id":2}"#[..]));
    assert_eq!(record.body_len, 14);
    let retention = record
        .expires_at
        .duration_since(record.created_at)
        .expect("expires after creation");
    assert_eq!(retention, Duration::from_secs(24 * 3600));
    let hidden = admin
        .inspect("shop-a", "create_order", "k2", false)
        .await
        .expect("inspect")
        .expect("record");
    assert_eq!((hidden.body, hidden.body_len), (None, 14));
    assert_eq!(hidden.fingerprint.to_hex(), record.fingerprint.to_hex());

    let counts = admin
        .counts(
            &RecordFilter::default()
                .tenant("shop-b")
                .operation("create_order"),
        )
        .await
        .expect("counts");
    assert_eq!((counts.live, counts.expired), (1, 0));
    assert!(admin
        .delete("shop-b", "create_order", "k1")
        .await
        .expect("delete"));
    assert_eq!(admin.purge_expired(10).await.expect("purge"), 0);
    let counts = admin
        .counts(&RecordFilter::default())
        .await
        .expect("counts");
    assert_eq!((counts.live, counts.expired), (2, 0));
}
