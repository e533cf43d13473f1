//! A failing request fails alone, whatever ends the transaction its commit group shares.
//!
//! Each test sends many new orders at once (48 connections, so that requests really share
//! SQLite transactions: every good handler checks that it saw another member's uncommitted
//! order), one in ten of them poisoned in a way that ends the shared transaction: a trigger's
//! `RAISE(ROLLBACK)`, `INSERT OR ROLLBACK` or `ON CONFLICT ROLLBACK`, or a deferred foreign key
//! that only fails at `COMMIT`. Every good request must get its `201` with its order and
//! record (the store runs the innocent members of a rolled-back group again, alone), no
//! poisoned one a `201`, and `orders == records == good requests`; every `201` replays.

use support::common;

use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use common::{hook, post, HookOutcome, Reply, TestServer, PATIENCE, SHOP_A};
use http::StatusCode;
use tokio::sync::Semaphore;
type SqliteInbox = tower_idempotency::outbox::Inbox<tower_idempotency::store::sqlite::SqliteStore>;
type SqliteOutbox =
    tower_idempotency::outbox::Outbox<tower_idempotency::store::sqlite::SqliteStore>;
use tower_idempotency::store::sqlite::SqliteStore;
use tower_idempotency::Error;

const REQUESTS: usize = 240;
const CONNECTIONS: usize = 48;
const GOOD: &str = r#"{"sku":"book","quantity":1}"#;
const POISONED: &str = r#"{"sku":"poison","quantity":1}"#;

/// What the poisoned requests do, and the tables it needs.
struct Poison {
    /// Run once on the store before the load (tables, triggers).
    setup: &'static str,
    /// Run by a poisoned request's handler after its order, through its handle.
    statement: Option<&'static str>,
    /// Whether the poison ends the group's transaction (so innocents must run again).
    ends_the_group: bool,
    /// Caps the database at this many pages beyond its size after the setup.
    max_pages: Option<i64>,
}

/// What the handlers saw.
#[derive(Default)]
struct Seen {
    /// The most uncommitted orders of other requests one good handler saw in its own
    /// transaction: above zero, requests shared a group.
    others_in_group: AtomicI64,
    /// Errors the poisoned statements returned to their handlers.
    poison_errors: std::sync::Mutex<Vec<String>>,
    poisoned_runs: AtomicUsize,
}

fn count_orders(conn: &rusqlite::Connection) -> rusqlite::Result<i64> {
    conn.query_row("SELECT COUNT(*) FROM orders", [], |row| row.get(0))
}

async fn server(poison: &Poison, seen: Arc<Seen>) -> TestServer {
    let store_slot: Arc<OnceLock<SqliteStore>> = Arc::default();
    let statement = poison.statement;
    let server = TestServer::builder()
        .layer(|layer| layer.with_lock_timeout(PATIENCE))
        .hook({
            let store_slot = store_slot.clone();
            hook(move |call| {
                let (seen, store_slot) = (seen.clone(), store_slot.clone());
                async move {
                    if call.sku == "poison" {
                        seen.poisoned_runs.fetch_add(1, Ordering::SeqCst);
                        let Some(sql) = statement else {
                            return HookOutcome::default();
                        };
                        return match call.tx.run(move |conn| conn.execute_batch(sql)).await {
                            Ok(()) => HookOutcome::default(),
                            Err(error) => {
                                seen.poison_errors
                                    .lock()
                                    .expect("lock")
                                    .push(error.to_string());
                                HookOutcome {
                                    fail_with: Some(StatusCode::INTERNAL_SERVER_ERROR),
                                    ..HookOutcome::default()
                                }
                            }
                        };
                    }
                    // Orders inside this transaction, then committed ones: the group cannot
                    // commit while this request is in it, so the difference (less its own
                    // order) is other members' uncommitted orders.
                    let inside = call.tx.run(count_orders).await.expect("count inside");
                    let store = store_slot.get().expect("store").clone();
                    let committed = store.read(count_orders).await.expect("count committed");
                    seen.others_in_group
                        .fetch_max(inside - committed - 1, Ordering::SeqCst);
                    HookOutcome::default()
                }
            })
        })
        .spawn()
        .await;
    let _ = store_slot.set(server.store.clone());
    server
        .store
        .write(move |tx| tx.execute_batch(poison_setup()))
        .await
        .expect("setup");
    let setup = poison.setup;
    server
        .store
        .write(move |tx| tx.execute_batch(setup))
        .await
        .expect("poison setup");
    if let Some(extra) = poison.max_pages {
        // `max_page_count` belongs to the connection: set it on the writer's.
        server
            .store
            .write(move |tx| {
                let pages: i64 = tx.query_row("PRAGMA page_count", [], |row| row.get(0))?;
                tx.execute_batch(&format!("PRAGMA max_page_count = {}", pages + extra))
            })
            .await
            .expect("cap the size");
    }
    server
}

/// Tables every poison may use.
fn poison_setup() -> &'static str {
    "CREATE TABLE parents (id INTEGER PRIMARY KEY);
     INSERT INTO parents (id) VALUES (1);"
}

/// Sends the load and checks every invariant; returns what the handlers saw.
async fn poisoned_load(poison: Poison) -> Arc<Seen> {
    let seen = Arc::new(Seen::default());
    let server = server(&poison, seen.clone()).await;
    let permits = Arc::new(Semaphore::new(CONNECTIONS));
    let tasks: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let (permits, addr) = (permits.clone(), server.addr);
            tokio::spawn(async move {
                let _permit = permits.acquire_owned().await.expect("permit");
                let poisoned = i % 10 == 0;
                let key = format!("key-{i}");
                let body = if poisoned { POISONED } else { GOOD };
                let reply = post(addr, Some(SHOP_A), Some(&key), body, &[]).await;
                (key, poisoned, reply)
            })
        })
        .collect();
    let mut outcomes: Vec<(String, bool, Reply)> = Vec::new();
    for task in tasks {
        outcomes.push(task.await.expect("request"));
    }

    let mut good = 0i64;
    for (key, poisoned, reply) in &outcomes {
        if *poisoned {
            assert_ne!(
                reply.status,
                StatusCode::CREATED,
                "{key} was poisoned: {reply:?}"
            );
            assert!(
                !common::record_exists(&server.store, "shop-a", "create_order", key).await,
                "{key}: a failure is not saved"
            );
        } else {
            assert_eq!(
                reply.status,
                StatusCode::CREATED,
                "{key} was good: {reply:?}"
            );
            assert!(!reply.replayed(), "{key}");
            good += 1;
        }
    }
    assert_eq!(
        server.order_count().await,
        good,
        "one order per good request"
    );
    assert_eq!(
        server.record_count().await,
        good,
        "one record per good request"
    );
    let orders = common::orders(&server.store).await;
    assert!(
        orders.iter().all(|(_, _, sku, _)| sku == "book"),
        "no poisoned order kept"
    );

    // Every 201 replays exactly.
    for (key, poisoned, reply) in &outcomes {
        if !*poisoned {
            let again = post(server.addr, Some(SHOP_A), Some(key), GOOD, &[]).await;
            assert!(again.replayed(), "{key}: {again:?}");
            assert_eq!(again.status, reply.status, "{key}");
            assert_eq!(again.body, reply.body, "{key}");
        }
    }
    assert!(
        seen.others_in_group.load(Ordering::SeqCst) > 0,
        "requests shared commit groups"
    );
    let runs = server.app.handler_calls();
    eprintln!(
        "{good} good of {REQUESTS}; {runs} handler runs; up to {} others seen in a group",
        seen.others_in_group.load(Ordering::SeqCst)
    );
    if poison.ends_the_group {
        assert!(
            runs > REQUESTS,
            "poisoned groups were rolled back and their innocent members ran again \
             ({runs} runs for {REQUESTS} requests)"
        );
    }
    seen
}

test! { a_trigger_raising_rollback_fails_only_its_own_request, multi_thread = 2 }
async fn a_trigger_raising_rollback_fails_only_its_own_request() {
    poisoned_load(Poison {
        setup: "CREATE TRIGGER poison AFTER INSERT ON orders WHEN NEW.sku = 'poison'
                BEGIN SELECT RAISE(ROLLBACK, 'poisoned order'); END;",
        statement: None,
        ends_the_group: true,
        max_pages: None,
    })
    .await;
}

test! { insert_or_rollback_fails_only_its_own_request, multi_thread = 2 }
async fn insert_or_rollback_fails_only_its_own_request() {
    poisoned_load(Poison {
        setup: "CREATE TABLE once (id INTEGER PRIMARY KEY);",
        statement: Some(
            "INSERT OR ROLLBACK INTO once (id) VALUES (1); \
             INSERT OR ROLLBACK INTO once (id) VALUES (1);",
        ),
        ends_the_group: true,
        max_pages: None,
    })
    .await;
}

test! { on_conflict_rollback_fails_only_its_own_request, multi_thread = 2 }
async fn on_conflict_rollback_fails_only_its_own_request() {
    poisoned_load(Poison {
        setup: "CREATE TABLE unique_once (id INTEGER UNIQUE ON CONFLICT ROLLBACK);",
        statement: Some(
            "INSERT INTO unique_once (id) VALUES (1); INSERT INTO unique_once (id) VALUES (1);",
        ),
        ends_the_group: true,
        max_pages: None,
    })
    .await;
}

test! { a_deferred_foreign_key_violated_by_one_request_fails_only_it_at_commit, multi_thread = 2 }
async fn a_deferred_foreign_key_violated_by_one_request_fails_only_it_at_commit() {
    poisoned_load(Poison {
        setup: "CREATE TABLE children (parent_id INTEGER
                    REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED);",
        statement: Some("INSERT INTO children (parent_id) VALUES (999999);"),
        ends_the_group: true,
        max_pages: None,
    })
    .await;
}

test! { pragma_defer_foreign_keys_violated_by_one_request_fails_only_it_at_commit, multi_thread = 2 }
async fn pragma_defer_foreign_keys_violated_by_one_request_fails_only_it_at_commit() {
    poisoned_load(Poison {
        setup: "CREATE TABLE kids (parent_id INTEGER REFERENCES parents (id));",
        statement: Some(
            "PRAGMA defer_foreign_keys = ON; INSERT INTO kids (parent_id) VALUES (999999);",
        ),
        ends_the_group: true,
        max_pages: None,
    })
    .await;
}

test! { a_full_disk_during_one_members_statement_fails_only_it, multi_thread = 2 }
/// A full disk during one member's statement (the database capped with `max_page_count`,
/// a poisoned request writing more than fits): SQLite rolls the whole transaction back; that
/// request fails with `SQLITE_FULL`, and the others of its group run again and keep their
/// orders.
async fn a_full_disk_during_one_members_statement_fails_only_it() {
    let seen = poisoned_load(Poison {
        setup: "CREATE TABLE blobs (b BLOB);",
        statement: Some("INSERT INTO blobs (b) VALUES (zeroblob(64000000));"),
        ends_the_group: true,
        max_pages: Some(4000),
    })
    .await;
    let errors = seen.poison_errors.lock().expect("lock").clone();
    assert!(!errors.is_empty());
    assert!(
        errors
            .iter()
            .all(|error| error.contains("database or disk is full")),
        "{errors:?}"
    );
}

test! { transaction_control_through_the_handle_is_refused_and_ends_nothing, multi_thread = 2 }
/// Transaction control through the handle is refused (the authorizer), so it ends nothing:
/// the poisoned handler gets the refusal, fails, and only its own savepoint rolls back.
async fn transaction_control_through_the_handle_is_refused_and_ends_nothing() {
    for (statement, named) in [
        ("COMMIT; BEGIN", "COMMIT"),
        ("ROLLBACK", "ROLLBACK"),
        ("END", "COMMIT"),
        ("BEGIN", "BEGIN"),
        (
            "RELEASE tower_idempotency_request; SAVEPOINT tower_idempotency_request",
            "RELEASE of the request's savepoint",
        ),
        (
            "ROLLBACK TO tower_idempotency_request",
            "ROLLBACK TO the request's savepoint",
        ),
        (
            "release TOWER_IDEMPOTENCY_REQUEST",
            "RELEASE of the request's savepoint",
        ),
    ] {
        let seen = poisoned_load(Poison {
            setup: "SELECT 1;",
            statement: Some(statement),
            ends_the_group: false,
            max_pages: None,
        })
        .await;
        let errors = seen.poison_errors.lock().expect("lock").clone();
        assert_eq!(
            errors.len(),
            seen.poisoned_runs.load(Ordering::SeqCst),
            "{statement}: every poisoned run was refused"
        );
        assert!(
            errors.iter().all(|error| error.starts_with(&format!(
                "{named} refused: the layer commits; run no transaction control"
            ))),
            "{statement}: {errors:?}"
        );
    }
}

test! { the_refusal_holds_for_cached_statements_and_allows_a_handlers_own_savepoints, multi_thread = 2 }
/// The refusal cannot be bypassed through the statement cache: the store's own cached
/// `COMMIT` is not what a handler's `prepare_cached("COMMIT")` gets. A handler's own
/// savepoints (other names) are allowed and nest inside the request's.
async fn the_refusal_holds_for_cached_statements_and_allows_a_handlers_own_savepoints() {
    let outcome: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let seen = outcome.clone();
    let server = TestServer::builder()
        .hook(hook(move |call| {
            let outcome = seen.clone();
            async move {
                let cached = call
                    .tx
                    .run(|conn| {
                        for sql in ["COMMIT", "BEGIN IMMEDIATE", "ROLLBACK"] {
                            conn.prepare_cached(sql)?.execute([])?;
                        }
                        Ok(())
                    })
                    .await;
                let own = call
                    .tx
                    .run(|conn| {
                        conn.execute_batch(
                            "SAVEPOINT mine; \
                             INSERT INTO orders (tenant_id, sku, quantity) VALUES ('x', 'y', 1); \
                             ROLLBACK TO mine; RELEASE mine;",
                        )
                    })
                    .await;
                let mut outcome = outcome.lock().expect("lock");
                outcome.push(match cached {
                    Ok(()) => "cached: ran".to_owned(),
                    Err(error) => format!("cached: {error}"),
                });
                outcome.push(match own {
                    Ok(()) => "own savepoint: ran".to_owned(),
                    Err(error) => format!("own savepoint: {error}"),
                });
                HookOutcome::default()
            }
        }))
        .spawn()
        .await;
    // Twice: the second request's statements meet a warm cache.
    for key in ["first", "second"] {
        let reply = post(server.addr, Some(SHOP_A), Some(key), GOOD, &[]).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    }
    let outcome = outcome.lock().expect("lock").clone();
    assert_eq!(outcome.len(), 4, "{outcome:?}");
    for line in &outcome {
        if line.starts_with("cached") {
            assert!(line.contains("run no transaction control"), "{line}");
        } else {
            assert_eq!(line, "own savepoint: ran");
        }
    }
    assert_eq!(
        server.order_count().await,
        2,
        "the savepoint's row rolled back"
    );
    assert_eq!(server.record_count().await, 2);
}

test! { calls_that_need_the_writer_fail_at_once_inside_a_request, multi_thread = 2 }
/// Calls that need the writer to themselves, made from a handler inside its own request,
/// fail at once with an error naming `SqliteHandle::run`, instead of waiting for the
/// request that waits for them; the request, and every other one, goes on.
async fn calls_that_need_the_writer_fail_at_once_inside_a_request() {
    let errors: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let store_slot: Arc<OnceLock<(SqliteStore, SqliteInbox)>> = Arc::default();
    let server = TestServer::builder()
        .layer(|layer| layer.with_lock_timeout(Duration::from_secs(2)))
        .hook({
            let (errors, store_slot) = (errors.clone(), store_slot.clone());
            hook(move |_call| {
                let (errors, store_slot) = (errors.clone(), store_slot.clone());
                async move {
                    let (store, inbox) = store_slot.get().expect("store").clone();
                    let outbox = SqliteOutbox::existing(&store);
                    let calls = async {
                        let mut seen: Vec<Result<(), Error>> = Vec::new();
                        seen.push(
                            store
                                .write(|tx| tx.execute_batch("INSERT INTO parents VALUES (7)"))
                                .await,
                        );
                        seen.push(
                            tower_idempotency::store::IdempotencyStore::purge_expired(
                                &store,
                                std::time::SystemTime::now(),
                                10,
                            )
                            .await
                            .map(drop),
                        );
                        seen.push(outbox.requeue("nope").await.map(drop));
                        seen.push(
                            outbox
                                .purge_delivered(std::time::SystemTime::now(), 10)
                                .await
                                .map(drop),
                        );
                        seen.push(inbox.process("event-1", |_tx| Ok(())).await.map(drop));
                        seen
                    };
                    let seen = tokio::time::timeout(Duration::from_secs(1), calls)
                        .await
                        .expect("the calls fail at once, they do not wait");
                    let mut errors = errors.lock().expect("lock");
                    for result in seen {
                        errors.push(match result {
                            Ok(()) => "ran".to_owned(),
                            Err(error) => error.to_string(),
                        });
                    }
                    HookOutcome::default()
                }
            })
        })
        .spawn()
        .await;
    server
        .store
        .write(|tx| tx.execute_batch(poison_setup()))
        .await
        .expect("setup");
    SqliteOutbox::install(&server.store).await.expect("outbox");
    let inbox = SqliteInbox::install(&server.store, "tests")
        .await
        .expect("inbox");
    let _ = store_slot.set((server.store.clone(), inbox));

    let reply = post(server.addr, Some(SHOP_A), Some("reentrant"), GOOD, &[]).await;
    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    let errors = errors.lock().expect("lock").clone();
    assert_eq!(errors.len(), 5, "{errors:?}");
    for error in &errors {
        assert!(error.contains("SqliteHandle::run"), "{error}");
    }
    // Nothing the refused calls would have written was kept, and the writer is free.
    let parents: i64 = server
        .store
        .read(|conn| conn.query_row("SELECT COUNT(*) FROM parents", [], |row| row.get(0)))
        .await
        .expect("count");
    assert_eq!(parents, 1);
    let next = post(server.addr, Some(SHOP_A), Some("next"), GOOD, &[]).await;
    assert_eq!(next.status, StatusCode::CREATED, "{next:?}");
}

/// One request of the mixed load.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Good,
    /// Resends an earlier good request (same key, same body) while it may still run.
    Duplicate(usize),
    /// The trigger's `RAISE(ROLLBACK)`.
    RaiseRollback,
    /// A deferred foreign key that fails at `COMMIT`.
    DeferredForeignKey,
    /// `COMMIT; BEGIN` through the handle.
    TransactionControl,
    Panic,
    /// The client gives up while the handler still runs.
    Disconnect,
}

impl Kind {
    fn sku(self) -> &'static str {
        match self {
            Kind::Good | Kind::Duplicate(_) => "book",
            Kind::RaiseRollback => "poison-trigger",
            Kind::DeferredForeignKey => "poison-fk",
            Kind::TransactionControl => "poison-commit",
            Kind::Panic => "poison-panic",
            Kind::Disconnect => "slow",
        }
    }
}

fn arb_kinds() -> impl proptest::strategy::Strategy<Value = Vec<Kind>> {
    use proptest::prelude::*;
    let kind = prop_oneof![
        12 => Just(Kind::Good),
        2 => (0usize..1000).prop_map(Kind::Duplicate),
        1 => Just(Kind::RaiseRollback),
        1 => Just(Kind::DeferredForeignKey),
        1 => Just(Kind::TransactionControl),
        1 => Just(Kind::Panic),
        1 => Just(Kind::Disconnect),
    ];
    proptest::collection::vec(kind, 100..160)
}

/// Random mixes of good requests, duplicates, poisons, panics and disconnects, 48 at a time:
/// every good request (and its duplicates) gets the same `201` with one order and record,
/// nothing else keeps anything, and every `201` replays exactly afterwards.
/// A server whose handler poisons by sku (see [`Kind::sku`]), with the tables that needs.
async fn mixed_server() -> TestServer {
    let server = TestServer::builder()
        .layer(|layer| layer.with_lock_timeout(PATIENCE))
        .hook(hook(|call| async move {
            match call.sku.as_str() {
                "poison-fk" => {
                    let _ = call
                        .tx
                        .run(|conn| conn.execute_batch("INSERT INTO children VALUES (999999)"))
                        .await;
                }
                "poison-commit" => {
                    let refused = call
                        .tx
                        .run(|conn| conn.execute_batch("COMMIT; BEGIN"))
                        .await
                        .is_err();
                    if refused {
                        return HookOutcome {
                            fail_with: Some(StatusCode::INTERNAL_SERVER_ERROR),
                            ..HookOutcome::default()
                        };
                    }
                }
                "poison-panic" => panic!("a handler panics"),
                "slow" => tokio::time::sleep(Duration::from_millis(300)).await,
                _ => {}
            }
            HookOutcome::default()
        }))
        .spawn()
        .await;
    server
        .store
        .write(|tx| {
            tx.execute_batch(
                "CREATE TABLE parents (id INTEGER PRIMARY KEY);
                 CREATE TABLE children (parent_id INTEGER
                     REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED);
                 CREATE TRIGGER poison AFTER INSERT ON orders WHEN NEW.sku = 'poison-trigger'
                 BEGIN SELECT RAISE(ROLLBACK, 'poisoned order'); END;",
            )
        })
        .await
        .expect("setup");
    server
}

async fn mixed_load(kinds: Vec<Kind>) {
    let server = mixed_server().await;

    // A duplicate resends an earlier good request's key; one that names anything else is a
    // good request of its own.
    let requests: Vec<(String, Kind)> = kinds
        .iter()
        .enumerate()
        .map(|(i, kind)| match *kind {
            Kind::Duplicate(of) if i > 0 && matches!(kinds[of % i], Kind::Good) => {
                (format!("mixed-{}", of % i), *kind)
            }
            Kind::Duplicate(_) => (format!("mixed-{i}"), Kind::Good),
            other => (format!("mixed-{i}"), other),
        })
        .collect();
    let permits = Arc::new(Semaphore::new(CONNECTIONS));
    let tasks: Vec<_> = requests
        .into_iter()
        .map(|(key, kind)| {
            let (permits, addr) = (permits.clone(), server.addr);
            tokio::spawn(async move {
                let _permit = permits.acquire_owned().await.expect("permit");
                let body = format!(r#"{{"sku":"{}","quantity":1}}"#, kind.sku());
                let send = post(addr, Some(SHOP_A), Some(&key), &body, &[]);
                let reply = if matches!(kind, Kind::Disconnect) {
                    tokio::time::timeout(Duration::from_millis(50), send)
                        .await
                        .ok()
                } else {
                    Some(send.await)
                };
                (key, kind, reply)
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.expect("request"));
    }
    // Disconnected handlers finish their sleep and roll back.
    tokio::time::sleep(Duration::from_millis(400)).await;

    let mut answers: std::collections::HashMap<String, Vec<u8>> = Default::default();
    for (key, kind, reply) in &outcomes {
        let stored = common::record_exists(&server.store, "shop-a", "create_order", key).await;
        match kind {
            Kind::Good | Kind::Duplicate(_) => {
                let reply = reply.as_ref().expect("answered");
                assert_eq!(reply.status, StatusCode::CREATED, "{key}: {reply:?}");
                assert!(stored, "{key}");
                let first = answers
                    .entry(key.clone())
                    .or_insert_with(|| reply.body.to_vec());
                assert_eq!(
                    first,
                    &reply.body.to_vec(),
                    "{key}: duplicates get the same answer"
                );
            }
            Kind::Disconnect => {
                assert!(reply.is_none(), "{key}: the client gave up first");
                assert!(!stored, "{key}: a disconnected request keeps nothing");
            }
            _ => {
                let reply = reply.as_ref().expect("answered");
                assert_ne!(
                    reply.status,
                    StatusCode::CREATED,
                    "{key} ({kind:?}): {reply:?}"
                );
                assert!(!stored, "{key} ({kind:?}): a failure keeps nothing");
            }
        }
    }
    let good = answers.len() as i64;
    assert_eq!(server.order_count().await, good, "one order per good key");
    assert_eq!(server.record_count().await, good, "one record per good key");
    for (key, body) in &answers {
        let again = post(server.addr, Some(SHOP_A), Some(key), GOOD, &[]).await;
        assert!(again.replayed(), "{key}: {again:?}");
        assert_eq!(&again.body.to_vec(), body, "{key}");
    }
    server.shutdown().await;
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 4, ..Default::default() })]

    fn mixed_poisons_panics_and_disconnects_fail_alone(kinds in arb_kinds()) {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(mixed_load(kinds));
    }
}

// The property above, a test.
test! { mixed_poisons_panics_and_disconnects_fail_alone, sync }

test! { same_key_rounds_in_a_flood_of_poisoned_groups_never_fail, multi_thread = 2 }
/// Poisoned members keep ending their groups (a trigger's `RAISE(ROLLBACK)` and a deferred
/// foreign key that fails the group's `COMMIT`, each sent over 4 connections with fresh keys)
/// while 60 rounds of 8 simultaneous requests share one key and payload each: every request of
/// a round gets the same `201`, never a `5xx` of another member's failure (a rolled-back request
/// runs again in a group of its own, and a request that finds a committed record waits for no
/// group), and each round's key has one order.
async fn same_key_rounds_in_a_flood_of_poisoned_groups_never_fail() {
    const ROUNDS: usize = 60;
    const DUPLICATES: usize = 8;
    let server = mixed_server().await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood: Vec<_> = ["poison-trigger", "poison-fk"]
        .into_iter()
        .flat_map(|sku| std::iter::repeat_n(sku, 4))
        .enumerate()
        .map(|(connection, sku)| {
            let (stop, addr) = (stop.clone(), server.addr);
            tokio::spawn(async move {
                let body = format!(r#"{{"sku":"{sku}","quantity":1}}"#);
                let mut sent = 0usize;
                while !stop.load(Ordering::Acquire) {
                    let key = format!("flood-{connection}-{sent}");
                    let reply = post(addr, Some(SHOP_A), Some(&key), &body, &[]).await;
                    assert_ne!(reply.status, StatusCode::CREATED, "{key}: {reply:?}");
                    sent += 1;
                }
                sent
            })
        })
        .collect();
    let mut innocent_failures = Vec::new();
    for round in 0..ROUNDS {
        let key = format!("round-{round}");
        let sends: Vec<_> = (0..DUPLICATES)
            .map(|_| {
                let (addr, key) = (server.addr, key.clone());
                tokio::spawn(async move { post(addr, Some(SHOP_A), Some(&key), GOOD, &[]).await })
            })
            .collect();
        let mut bodies = Vec::new();
        for send in sends {
            let reply = send.await.expect("request");
            if reply.status != StatusCode::CREATED {
                innocent_failures.push(format!("{key}: {reply:?}"));
            } else {
                bodies.push(reply.body);
            }
        }
        assert!(
            bodies.windows(2).all(|pair| pair[0] == pair[1]),
            "{key}: every duplicate gets the same answer"
        );
    }
    stop.store(true, Ordering::Release);
    let mut poisoned = 0;
    for task in flood {
        poisoned += task.await.expect("flood");
    }
    assert!(
        innocent_failures.is_empty(),
        "{} innocent requests failed among {poisoned} poisoned ones: {innocent_failures:#?}",
        innocent_failures.len()
    );
    assert_eq!(
        server.order_count().await,
        ROUNDS as i64,
        "one order per round"
    );
    assert_eq!(
        server.record_count().await,
        ROUNDS as i64,
        "one record per round"
    );
    eprintln!("{ROUNDS} rounds of {DUPLICATES} among {poisoned} poisoned requests");
    server.shutdown().await;
}
