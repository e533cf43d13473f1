//! The admin tool (`examples/admin.rs`, run as a process) and the `Admin` calls behind it, on
//! SQLite files and on PostgreSQL: records made by the order app over HTTP, and outbox events
//! delivered, retried and dead-lettered by a real relay. The commands' suite is written once
//! over a backend fixture and run on each; what differs (opening a missing file or an
//! unreachable server, a database without tables, the library calls) stays per backend.
//!
//! The PostgreSQL tests need `TEST_DATABASE_URL`; without it `cargo test` reports them as
//! ignored.

use support::backend;
use support::common;

use support::admin_tool as admin;

use std::time::SystemTime;

use admin::{Exit, Failure};
use backend::{event_of, Backend, Server};
use common::{post, SHOP_A, SHOP_B};
use http::StatusCode;
use serde_json::json;
use std::time::Duration;

use tower_idempotency::admin::{Admin, RecordFilter, RecordState};
use tower_idempotency::body::BoxError;
use tower_idempotency::outbox::{sink_fn, EventStatus, Outbox, OutboxEvent, Relay};

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

/// Runs `admin <the database's flag> <args>` and returns how it ended and what it printed.
async fn admin<B: Backend>(db: &B, args: &[&str]) -> (Result<Exit, Failure>, String) {
    let mut argv = db.tool_args().await;
    argv.extend(args.iter().map(|arg| (*arg).to_owned()));
    run(argv).await
}

async fn run(argv: Vec<String>) -> (Result<Exit, Failure>, String) {
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

fn failure_message(result: Result<Exit, Failure>) -> String {
    match result {
        Err(Failure::Failed(error)) => error.to_string(),
        other => panic!("expected a failure, got {other:?}"),
    }
}

/// The order app with three records: shop-a's `k1` and `k2`, shop-b's `k1` (orders 1 to 3).
async fn server_with_records<B: Backend>(db: &B) -> Server<B> {
    let server = db.spawn().await;
    for (token, key) in [(SHOP_A, "k1"), (SHOP_A, "k2"), (SHOP_B, "k1")] {
        let reply = post(server.addr, Some(token), Some(key), BOOK, &[]).await;
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    server
}

const SHOP_A_K1: [&str; 6] = [
    "--tenant",
    "shop-a",
    "--operation",
    "create_order",
    "--key",
    "k1",
];

async fn inspect_shows_the_record_without_its_body_unless_asked<B: Backend>(db: B) {
    let server = server_with_records(&db).await;

    let (result, output) = admin(&db, &[&["inspect"][..], &SHOP_A_K1].concat()).await;
    assert!(matches!(result, Ok(Exit::Done)), "{result:?}");
    assert_eq!(field(&output, "tenant:"), "shop-a");
    assert_eq!(field(&output, "operation:"), "create_order");
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
    server.shutdown().await;
}

async fn delete_removes_one_key_and_the_next_request_runs_afresh<B: Backend>(db: B) {
    let server = server_with_records(&db).await;

    let (result, output) = admin(&db, &[&["delete"][..], &SHOP_A_K1].concat()).await;
    assert!(matches!(result, Ok(Exit::Done)), "{result:?} {output}");
    assert_eq!(
        output,
        "deleted the record for (shop-a, create_order, k1)\n"
    );
    assert_eq!(db.record_count().await, 2, "only that record went");
    let (result, _) = admin(&db, &[&["delete"][..], &SHOP_A_K1].concat()).await;
    assert!(matches!(result, Ok(Exit::NotFound)), "{result:?}");

    // Deleting a record forgets the key: the same request creates a new order.
    let reply = post(server.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert!(!reply.replayed());
    assert_eq!(db.order_count().await, 4);
    server.shutdown().await;
}

async fn count_and_purge_by_state<B: Backend>(db: B) {
    let server = server_with_records(&db).await;
    // shop-b's record expired an hour ago.
    db.execute(
        "UPDATE idempotency_records SET expires_at = created_at - 3600000 \
         WHERE tenant = 'shop-b'",
    )
    .await;

    let (result, output) = admin(&db, &["count"]).await;
    assert!(matches!(result, Ok(Exit::Done)), "{result:?}");
    assert_eq!(output, "live: 2\nexpired: 1\n");
    let (_, output) = admin(&db, &["count", "--tenant", "shop-a"]).await;
    assert_eq!(output, "live: 2\nexpired: 0\n");
    let (_, output) = admin(
        &db,
        &["count", "--tenant", "shop-b", "--operation", "create_order"],
    )
    .await;
    assert_eq!(output, "live: 0\nexpired: 1\n");
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
    server.shutdown().await;
}

async fn dead_letters_are_listed_and_requeued<B: Backend>(db: B) {
    let outbox = Outbox::install(db.store().await).await.expect("install");
    let poison = db
        .enqueue_now("order_created", json!({ "sku": "poison" }))
        .await;
    let good = db
        .enqueue_now("order_created", json!({ "sku": "book" }))
        .await;
    let poison_2 = db
        .enqueue_now("order_created", json!({ "sku": "poison", "n": 2 }))
        .await;
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
    assert!(output.contains("delivered_at:"), "{output}");
    let (result, output) = admin(&db, &["event", "--id", "no-such-event"]).await;
    assert!(matches!(result, Ok(Exit::NotFound)), "{result:?}");
    assert_eq!(output, "no event no-such-event\n");

    // One by id: due again at once, attempts reset.
    let (result, output) = admin(&db, &["requeue", "--id", poison.as_str()]).await;
    assert!(matches!(result, Ok(Exit::Done)), "{result:?}");
    assert_eq!(output, format!("requeued {poison}\n"));
    let event = event_of(&outbox, &poison).await;
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

/// The `Admin` calls behind the tool, on the records of [`server_with_records`] and an outbox
/// event; returns the server, still running.
async fn library_calls<B: Backend>(db: &B) -> Server<B> {
    let server = server_with_records(db).await;
    let admin = Admin::new(db.store().await.clone());
    let record = admin
        .inspect("shop-a", "create_order", "k2", true)
        .await
        .expect("inspect")
        .expect("record");
    assert_eq!(
        (
            record.tenant.as_str(),
            record.operation.as_str(),
            record.key.as_str()
        ),
        ("shop-a", "create_order", "k2")
    );
    assert_eq!(record.state, RecordState::Live);
    assert_eq!(record.status, StatusCode::CREATED);
    assert_eq!(record.body.as_deref(), Some(&br#"{"order_id":2}"#[..]));
    assert_eq!(record.body_len, 14);
    assert!(record
        .headers
        .iter()
        .any(|(name, value)| name == "location" && value == "/orders/2"));
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
    assert!(admin
        .inspect("shop-a", "create_note", "k2", false)
        .await
        .expect("inspect")
        .is_none());

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
    assert!(!admin
        .delete("shop-b", "create_order", "k1")
        .await
        .expect("delete"));
    assert_eq!(admin.purge_expired(10).await.expect("purge"), 0);
    let counts = admin
        .counts(&RecordFilter::default())
        .await
        .expect("counts");
    assert_eq!((counts.live, counts.expired), (2, 0));

    // The outbox calls (the table exists once installed).
    Outbox::install(db.store().await).await.expect("install");
    let id = db
        .enqueue_now("order_created", json!({ "order_id": 1 }))
        .await;
    let counts = admin.outbox().counts().await.expect("outbox counts");
    assert_eq!((counts.pending, counts.dead), (1, 0));
    let event = admin
        .outbox()
        .event(id.as_str())
        .await
        .expect("event")
        .expect("exists");
    assert_eq!(event.status, EventStatus::Pending);
    assert!(admin
        .outbox()
        .dead_letters(10)
        .await
        .expect("dead")
        .is_empty());
    assert!(!admin.outbox().requeue(id.as_str()).await.expect("requeue"));
    assert_eq!(
        admin
            .outbox()
            .requeue_all_dead()
            .await
            .expect("requeue all"),
        0
    );
    server
}

async fn the_library_calls_behind_the_tool<B: Backend>(db: B) {
    library_calls(&db).await.shutdown().await;
}

mod sqlite {
    //! On a SQLite file.

    use std::path::Path;

    use super::admin::{self, Exit, Failure};
    use support::common::TestServer;

    backend_tests!(Sqlite;
        inspect_shows_the_record_without_its_body_unless_asked,
        delete_removes_one_key_and_the_next_request_runs_afresh,
        count_and_purge_by_state,
        dead_letters_are_listed_and_requeued,
        the_library_calls_behind_the_tool,
    );

    /// Runs `admin --db <db> <args>`.
    async fn admin(db: &Path, args: &[&str]) -> (Result<Exit, Failure>, String) {
        let mut argv = vec!["--db".to_owned(), db.display().to_string()];
        argv.extend(args.iter().map(|arg| (*arg).to_owned()));
        super::run(argv).await
    }

    test! { usage_errors_and_missing_databases_are_reported }
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

    test! { keys_in_doubt_are_listed_and_resolved }
    async fn keys_in_doubt_are_listed_and_resolved() {
        use std::time::{Duration, SystemTime};

        use tower_idempotency::fingerprint::Fingerprint;
        use tower_idempotency::key::IdempotencyKey;
        use tower_idempotency::steps::__private::{
            Acquired, Claim, Lease, SavedRequest, StepKind, StepProtocol, StepRow,
        };
        use tower_idempotency::steps::{ProgressStatus, StepStore};
        use tower_idempotency::store::sqlite::SqliteStore;
        use tower_idempotency::store::Scope;

        use super::{failure_message, field};

        let dir = tempfile::tempdir().expect("temp dir");
        let db = dir.path().join("checkout.db");
        let store = SqliteStore::open(&db).await.expect("open");
        // Before the tables exist, the tool says so.
        let (result, _) = admin(&db, &["steps"]).await;
        assert!(failure_message(result).contains("no step-by-step keys"));
        store.install_steps().await.expect("install");
        let (result, output) = admin(&db, &["steps"]).await;
        assert!(matches!(result, Ok(Exit::Done)));
        assert_eq!(output.trim(), "no keys in_doubt");

        // A key whose charge was left in doubt (intent saved, the outcome unknown).
        let scope = Scope::new(
            "shop-a",
            "checkout",
            IdempotencyKey::parse(b"k1", 128).unwrap(),
        );
        let now = SystemTime::now();
        let request = SavedRequest::new(
            "POST".into(),
            "/checkouts".into(),
            String::new(),
            bytes::Bytes::from_static(b"{}"),
        );
        let mut claim = Claim::new(
            scope.clone(),
            Fingerprint::new(1, [7; 32]),
            "owner".into(),
            now + Duration::from_secs(30),
            now,
        );
        claim.request = Some(request);
        let Acquired::Owned {
            generation, run, ..
        } = store.acquire(&claim).await.expect("acquire")
        else {
            panic!("not owned");
        };
        let lease = Lease::new(
            scope.clone(),
            run,
            generation,
            now + Duration::from_secs(30),
            now,
        );
        let intent = StepRow::new(0, "charge".into(), StepKind::Foreign, None);
        store.save_step(&lease, &intent).await.expect("intent");
        store
            .set_status(
                &lease,
                ProgressStatus::InDoubt,
                "the outcome of step 0 (\"charge\") is unknown",
            )
            .await
            .expect("in doubt");

        let (result, output) = admin(&db, &["steps", "--status", "in_doubt"]).await;
        assert!(matches!(result, Ok(Exit::Done)), "{output}");
        assert_eq!(field(&output, "key:"), "k1");
        assert_eq!(field(&output, "status:"), "in_doubt");
        assert_eq!(field(&output, "steps saved:"), "1");
        assert!(field(&output, "reason:").contains("step 0"));

        let scope_args = [
            "--tenant",
            "shop-a",
            "--operation",
            "checkout",
            "--key",
            "k1",
        ];
        for bad in [
            &["--step", "0"][..],
            &["--step", "0", "--done", "{"][..],
            &["--step", "0", "--call-again", "--done", "1"][..],
        ] {
            let (result, _) = admin(&db, &[&["resolve"][..], &scope_args, bad].concat()).await;
            assert!(
                matches!(result, Err(Failure::Usage(_))),
                "{bad:?}: {result:?}"
            );
        }
        let (result, output) = admin(
            &db,
            &[
                &["resolve"][..],
                &scope_args,
                &["--step", "0", "--done", "\"ch_9\""],
            ]
            .concat(),
        )
        .await;
        assert!(matches!(result, Ok(Exit::Done)), "{output}");
        let (_, output) = admin(&db, &["steps"]).await;
        assert_eq!(output.trim(), "no keys in_doubt");
        let (_, output) = admin(&db, &["steps", "--status", "running"]).await;
        assert_eq!(field(&output, "key:"), "k1");
        // The step now has its result: the next claim resumes after it.
        let later = SystemTime::now();
        let claim = Claim::new(
            scope,
            Fingerprint::new(1, [7; 32]),
            "next".into(),
            later + Duration::from_secs(30),
            later,
        );
        match store.acquire(&claim).await.expect("acquire") {
            Acquired::Owned { steps, .. } => {
                assert_eq!(steps.len(), 1);
                assert!(steps[0]
                    .result
                    .as_deref()
                    .unwrap_or_default()
                    .contains("ch_9"));
            }
            other => panic!("{other:?}"),
        }
        let (result, _) = admin(
            &db,
            &[
                "resolve",
                "--tenant",
                "shop-a",
                "--operation",
                "checkout",
                "--key",
                "nope",
                "--call-again",
            ],
        )
        .await;
        assert!(matches!(result, Ok(Exit::NotFound)));
    }
}

mod postgres {
    //! On PostgreSQL.

    use std::sync::Arc;

    use http::StatusCode;
    use tokio::sync::Notify;
    use tower_idempotency::admin::{Admin, RecordFilter};
    use tower_idempotency::store::tokio_postgres::PostgresStore;

    use super::admin::{Exit, Failure};
    use super::{failure_message, field, BOOK, SHOP_A_K1};
    use support::backend::{Backend, Database, Postgres};
    use support::common::{post, PATIENCE, SHOP_A};
    use support::pg_common::{hook, HookOutcome, PgServer, TestDb};

    backend_tests!(Postgres;
        inspect_shows_the_record_without_its_body_unless_asked,
        delete_removes_one_key_and_the_next_request_runs_afresh,
        count_and_purge_by_state,
        dead_letters_are_listed_and_requeued,
    );

    /// Runs `admin --database-url <db> <args>`.
    async fn admin(db: &TestDb, args: &[&str]) -> (Result<Exit, Failure>, String) {
        run(&[&["--database-url", &db.url()][..], args].concat()).await
    }

    async fn run(argv: &[&str]) -> (Result<Exit, Failure>, String) {
        super::run(argv.iter().map(|arg| (*arg).to_owned()).collect()).await
    }

    test! { a_database_without_the_tables_is_reported_and_left_alone, postgres }
    async fn a_database_without_the_tables_is_reported_and_left_alone() {
        let Some(db) = TestDb::create().await else {
            return;
        };
        // A schema with only `orders`: no idempotency records, no outbox.
        for args in [
            &["count"][..],
            &["purge"],
            &[&["inspect"][..], &SHOP_A_K1].concat(),
        ] {
            let (result, _) = admin(&db, args).await;
            let message = failure_message(result);
            assert!(
                message.contains("no idempotency records"),
                "{args:?}: {message}"
            );
        }
        for args in [&["outbox"][..], &["dead-letters"], &["requeue", "--all"]] {
            let (result, _) = admin(&db, args).await;
            let message = failure_message(result);
            assert!(message.contains("no outbox"), "{args:?}: {message}");
        }
        let tables = "SELECT count(*) FROM information_schema.tables \
                      WHERE table_schema = $1 AND table_name <> 'orders'";
        let created: i64 = db.value(tables, &[&db.schema]).await;
        assert_eq!(created, 0, "the tool created no table");
    }

    test! { usage_errors_and_unreachable_databases_are_reported, postgres }
    async fn usage_errors_and_unreachable_databases_are_reported() {
        let Some(db) = TestDb::create().await else {
            return;
        };
        let url = db.url();
        let (result, _) = run(&["--db", "orders.db", "--database-url", &url, "count"]).await;
        assert!(matches!(result, Err(Failure::Usage(_))), "{result:?}");
        let (result, _) = run(&["count"]).await;
        assert!(matches!(result, Err(Failure::Usage(_))), "{result:?}");
        let (result, _) = run(&[
            "--database-url",
            "postgres://localhost:notaport/shop",
            "count",
        ])
        .await;
        assert!(matches!(result, Err(Failure::Usage(_))), "{result:?}");
        for args in [
            &["inspect", "--tenant", "shop-a"][..],
            &["frobnicate"],
            &["requeue"],
            &["event"],
        ] {
            let (result, _) = admin(&db, args).await;
            assert!(
                matches!(result, Err(Failure::Usage(_))),
                "{args:?}: {result:?}"
            );
        }

        // Nothing listens on port 1: a clear failure, without the URL (it may carry a password).
        let (result, _) = tokio::time::timeout(
            PATIENCE,
            run(&[
                "--database-url",
                "postgres://admin:s3cret@127.0.0.1:1/shop",
                "count",
            ]),
        )
        .await
        .expect("failed in time");
        let message = failure_message(result);
        assert!(
            message.starts_with("cannot connect: PostgreSQL"),
            "{message}"
        );
        assert!(!message.contains("s3cret"), "{message}");
    }

    test! { the_library_calls_behind_the_tool, postgres }
    async fn the_library_calls_behind_the_tool() {
        let Some(backend) = Postgres::create().await else {
            return;
        };
        let server = super::library_calls(&backend).await;
        let db = &backend.db;
        let admin = Admin::new(backend.store().await.clone());
        assert!(format!("{admin:?}").contains("PostgresStore"));

        // A reservation a handler committed itself is no record: not shown, counted as expired
        // (it was written already expired), and purged.
        db.execute(
            "INSERT INTO idempotency_records \
             (tenant, operation, idempotency_key, state, created_at, expires_at) \
             VALUES ('shop-a', 'create_order', 'stray', 'in_progress', 1, 1)",
        )
        .await;
        assert!(admin
            .inspect("shop-a", "create_order", "stray", true)
            .await
            .expect("inspect")
            .is_none());
        let counts = admin
            .counts(&RecordFilter::default().tenant("shop-a"))
            .await
            .expect("counts");
        assert_eq!((counts.live, counts.expired), (2, 1));
        // Purged in batches: three expired records, two per batch.
        db.execute("UPDATE idempotency_records SET expires_at = 1 WHERE idempotency_key = 'k2'")
            .await;
        db.execute(
            "INSERT INTO idempotency_records \
             (tenant, operation, idempotency_key, state, created_at, expires_at) \
             VALUES ('shop-b', 'create_order', 'stray', 'in_progress', 1, 1)",
        )
        .await;
        assert_eq!(admin.purge_expired(2).await.expect("purge"), 3);
        let counts = admin
            .counts(&RecordFilter::default())
            .await
            .expect("counts");
        assert_eq!((counts.live, counts.expired), (1, 0));

        server.shutdown().await;
    }

    test! { a_request_running_now_is_not_deleted_under_it, postgres }
    async fn a_request_running_now_is_not_deleted_under_it() {
        let Some(db) = TestDb::create().await else {
            return;
        };
        // The handler waits (its reservation open) until the test lets it finish.
        let entered = Arc::new(Notify::new());
        let release = Arc::new(Notify::new());
        let (entered_hook, release_hook) = (entered.clone(), release.clone());
        let server = PgServer::builder()
            .hook(hook(move |_call| {
                let (entered, release) = (entered_hook.clone(), release_hook.clone());
                async move {
                    entered.notify_one();
                    release.notified().await;
                    HookOutcome::default()
                }
            }))
            .spawn(&db)
            .await;
        let addr = server.addr;
        let request =
            tokio::spawn(async move { post(addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await });
        tokio::time::timeout(PATIENCE, entered.notified())
            .await
            .expect("the handler runs");

        // The first request for a key is invisible while it runs: nothing to inspect or delete.
        let (result, _) = admin(&db, &[&["inspect"][..], &SHOP_A_K1].concat()).await;
        assert!(matches!(result, Ok(Exit::NotFound)), "{result:?}");
        let (result, _) = admin(&db, &[&["delete"][..], &SHOP_A_K1].concat()).await;
        assert!(matches!(result, Ok(Exit::NotFound)), "{result:?}");
        let (_, output) = admin(&db, &["count"]).await;
        assert_eq!(output, "live: 0\nexpired: 0\n");

        release.notify_one();
        let reply = request.await.expect("request");
        assert_eq!(reply.status, StatusCode::CREATED);
        let (result, output) = admin(&db, &[&["inspect"][..], &SHOP_A_K1].concat()).await;
        assert!(matches!(result, Ok(Exit::Done)), "{result:?}");
        assert_eq!(field(&output, "state:"), "live");
        server.shutdown().await;
    }

    async fn records_table_exists(db: &TestDb) -> bool {
        db.value("SELECT to_regclass('idempotency_records') IS NOT NULL", &[])
            .await
    }

    test! { a_store_opened_without_creating_the_schema_creates_nothing, postgres }
    /// A store opened for administration creates nothing, but sees what is there.
    async fn a_store_opened_without_creating_the_schema_creates_nothing() {
        let Some(db) = TestDb::create().await else {
            return;
        };
        let store = PostgresStore::builder(db.config())
            .with_create_schema(false)
            .build()
            .await
            .expect("connect");
        assert!(!records_table_exists(&db).await);
        let missing = Admin::new(store.clone())
            .counts(&RecordFilter::default())
            .await;
        assert!(missing.is_err(), "{missing:?}");
        // Once the app created it, the same store works.
        let _app_store = db.store().await;
        assert!(records_table_exists(&db).await);
        let counts = Admin::new(store)
            .counts(&RecordFilter::default())
            .await
            .expect("counts");
        assert_eq!((counts.live, counts.expired), (0, 0));
    }
}

mod sqlx_postgres {
    //! Records and events written through the sqlx store, read and changed by the admin tool
    //! (`--database-url`, the tokio-postgres store) and by `Admin` on the sqlx store itself.

    backend_tests!(SqlxPostgres;
        inspect_shows_the_record_without_its_body_unless_asked,
        delete_removes_one_key_and_the_next_request_runs_afresh,
        count_and_purge_by_state,
        dead_letters_are_listed_and_requeued,
        the_library_calls_behind_the_tool,
    );
}

mod mysql {
    //! Records and events written through the MySQL store, read and changed by `Admin` on that
    //! store. The tests that run the admin tool leave MySQL out: the tool opens a SQLite file
    //! or a PostgreSQL database (`--db`, `--database-url`), not MySQL.

    backend_tests!(MySql; the_library_calls_behind_the_tool);
}

mod sqlx_sqlite {
    //! Records and events written through the sqlx store on a SQLite file, read and changed by
    //! the admin tool (`--db`, the SQLite store) and by `Admin` on the sqlx store itself.

    backend_tests!(SqlxSqlite;
        inspect_shows_the_record_without_its_body_unless_asked,
        delete_removes_one_key_and_the_next_request_runs_afresh,
        count_and_purge_by_state,
        dead_letters_are_listed_and_requeued,
        the_library_calls_behind_the_tool,
    );
}
