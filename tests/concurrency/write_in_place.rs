//! On SQLite, a request whose writer is idle runs its whole transaction in place, on its own
//! task (`SqliteOptions::with_write_in_place`, on by default); requests that arrive while the writer
//! is busy queue for the writer thread and share a group commit. These tests pin which thread
//! runs a request, and that the guarantees of the writer thread hold in place too.

use support::common;

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use bytes::Bytes;

use common::{hook, post, HeldHandler, HookOutcome, TestServer, PATIENCE, SHOP_A};
use http::StatusCode;
use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::response::SavedResponse;
use tower_idempotency::store::sqlite::SqliteStore;
use tower_idempotency::store::{IdempotencyStore, NewRecord, Reservation, RunOutcome, Scope};
use tower_idempotency::{key::IdempotencyKey, Error};

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;
const WRITER_THREAD: &str = "tower-idempotency-sqlite-writer";

/// The writer thread leaves the writer idle (for a request to run in place) a moment after
/// its last job: wait that moment.
async fn until_the_writer_is_idle() {
    tokio::time::sleep(Duration::from_millis(20)).await;
}

/// Whether the current thread is a SQLite store's writer thread.
fn on_writer_thread() -> bool {
    std::thread::current().name() == Some(WRITER_THREAD)
}

/// Per key: whether its handler and its statement ran on the writer thread.
type Threads = Arc<Mutex<Vec<(String, bool, bool)>>>;

fn thread_recorder(threads: Threads) -> common::Hook {
    hook(move |call| {
        let threads = threads.clone();
        async move {
            let handler = on_writer_thread();
            let statement = call.tx.run(|_conn| Ok(on_writer_thread())).await;
            let key = call.key.clone().unwrap_or_default();
            if let Ok(mut threads) = threads.lock() {
                threads.push((key, handler, statement.unwrap_or(true)));
            }
            HookOutcome::default()
        }
    })
}

test! { a_lone_request_runs_on_its_own_task_unless_turned_off, multi_thread = 2 }
/// A lone request runs its handler and statements on its own task, not on the writer
/// thread; with `with_write_in_place(false)` on the writer thread, as before.
async fn a_lone_request_runs_on_its_own_task_unless_turned_off() {
    for in_place in [true, false] {
        let threads = Threads::default();
        let server = TestServer::builder()
            .store_options(move |options| options.with_write_in_place(in_place))
            .hook(thread_recorder(threads.clone()))
            .spawn()
            .await;

        // The first lookup opens the reader connection the later ones reuse in place.
        let warm_up = post(server.addr, Some(SHOP_A), Some("warm-up"), BOOK, &[]).await;
        assert_eq!(warm_up.status, StatusCode::CREATED, "{warm_up:?}");
        threads.lock().map(|mut t| t.clear()).unwrap_or_default();
        for key in ["k1", "k2", "k3"] {
            until_the_writer_is_idle().await;
            let reply = post(server.addr, Some(SHOP_A), Some(key), BOOK, &[]).await;
            assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        }
        let replay = post(server.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
        assert!(replay.replayed(), "{replay:?}");

        let threads = threads.lock().map(|t| t.clone()).unwrap_or_default();
        assert_eq!(threads.len(), 3, "{threads:?}");
        for (key, handler, statement) in threads {
            assert_eq!(handler, !in_place, "in_place={in_place}: {key}'s handler");
            assert_eq!(
                statement, !in_place,
                "in_place={in_place}: {key}'s statement"
            );
        }
        assert_eq!(server.order_count().await, 4);
        assert_eq!(server.record_count().await, 4);
    }
}

test! { requests_arriving_meanwhile_queue_and_the_duplicate_waits, multi_thread = 2 }
/// While a request holds the writer in place (awaiting inside its transaction), requests
/// with other keys queue for the writer thread and commit once it is done, and a duplicate
/// of its key waits for it and gets its replay: the handler runs once per key.
async fn requests_arriving_meanwhile_queue_and_the_duplicate_waits() {
    let slow_handler = HeldHandler::default();
    let threads = Threads::default();
    let server = TestServer::with_hook({
        let (slow_handler, record) = (slow_handler.clone(), thread_recorder(threads.clone()));
        hook(move |call| {
            let (slow_handler, record) = (slow_handler.clone(), record.clone());
            async move {
                if call.key.as_deref() == Some("slow") {
                    slow_handler.hold().await;
                }
                record(call).await
            }
        })
    })
    .await;
    let addr = server.addr;
    let warm_up = post(addr, Some(SHOP_A), Some("warm-up"), BOOK, &[]).await;
    assert_eq!(warm_up.status, StatusCode::CREATED, "{warm_up:?}");
    threads.lock().map(|mut t| t.clear()).unwrap_or_default();
    until_the_writer_is_idle().await;
    let slow = tokio::spawn(async move { post(addr, Some(SHOP_A), Some("slow"), BOOK, &[]).await });
    slow_handler.started().await;

    let mut others = Vec::new();
    for key in ["slow", "a", "b", "c"] {
        others.push(tokio::spawn(async move {
            post(addr, Some(SHOP_A), Some(key), BOOK, &[]).await
        }));
    }
    // They queue behind the open transaction (only the warm-up order is committed).
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(server.order_count().await, 1);
    assert!(server.store.writers_waiting() >= 1);
    slow_handler.release();

    let first = slow.await.expect("the slow request");
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let mut replies = Vec::new();
    for other in others {
        replies.push(other.await.expect("a queued request"));
    }
    let duplicate = &replies[0];
    assert!(duplicate.replayed(), "{duplicate:?}");
    assert_eq!(duplicate.order_id(), first.order_id());
    for reply in &replies[1..] {
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        assert!(!reply.replayed(), "{reply:?}");
    }
    assert_eq!(server.app.handler_calls(), 5);
    assert_eq!(server.order_count().await, 5);
    assert_eq!(server.record_count().await, 5);

    let threads = threads.lock().map(|t| t.clone()).unwrap_or_default();
    let slow_ran = threads.iter().find(|(key, ..)| key == "slow");
    assert_eq!(slow_ran.map(|(_, h, s)| (*h, *s)), Some((false, false)));
    // Those that queued ran on the writer thread, where they share a commit.
    assert!(
        threads
            .iter()
            .any(|(key, handler, _)| key != "slow" && *handler),
        "{threads:?}"
    );
}

/// A store on a new file in a temp dir (kept while the returned directory lives).
async fn store_in_a_temp_dir() -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("in-place.db"))
        .await
        .expect("store");
    (dir, store)
}

fn scope(key: &str) -> Scope {
    let key = IdempotencyKey::parse(key.as_bytes(), 128).expect("a valid key");
    Scope::new("shop-a", "create_order", key)
}

fn record() -> NewRecord {
    let now = SystemTime::now();
    let response = SavedResponse::new(StatusCode::CREATED, Vec::new(), Bytes::new());
    NewRecord::new(
        Fingerprint::new(1, [7; 32]),
        response,
        now,
        now + Duration::from_secs(3600),
    )
}

test! { calls_that_wait_for_the_writer_fail_at_once_inside_a_request_in_place, multi_thread = 2 }
/// A store call that would wait for the writer (a write, a purge), made from inside a request that holds it in
/// place, fails at once instead of waiting for the request's own end; so does a nested
/// request on the same store.
async fn calls_that_wait_for_the_writer_fail_at_once_inside_a_request_in_place() {
    let (_dir, store) = store_in_a_temp_dir().await;
    let inner = store.clone();
    until_the_writer_is_idle().await;
    let ran = tokio::time::timeout(
        PATIENCE,
        store.begin_and_run(
            &scope("outer"),
            PATIENCE,
            SystemTime::now(),
            move |reservation| async move {
                let on_writer = reservation
                    .handle()
                    .run(|_conn| Ok(on_writer_thread()))
                    .await;
                let write = inner.write(|_tx| Ok(())).await;
                let purges = (
                    inner.purge_expired(SystemTime::now(), 10).await.map(|_| ()),
                    inner
                        .purge_expired_step(SystemTime::now(), 10)
                        .await
                        .map(|_| ()),
                );
                let nested = inner
                    .begin_and_run(
                        &scope("inner"),
                        PATIENCE,
                        SystemTime::now(),
                        |reservation| async move { reservation.rollback().await },
                    )
                    .await;
                let _ = reservation.rollback().await;
                (on_writer, write, purges, nested.map(|_| ()))
            },
        ),
    )
    .await
    .expect("answered without waiting for its own end");
    let Ok(RunOutcome::Ran {
        output: (on_writer, write, (purge, purge_step), nested),
        ..
    }) = ran
    else {
        panic!("the outer request ran: {ran:?}");
    };
    assert!(
        matches!(on_writer, Ok(false)),
        "ran in place: {on_writer:?}"
    );
    assert!(matches!(write, Err(Error::InsideRequest(_))), "{write:?}");
    // Each refusal names the call refused.
    assert!(
        matches!(
            purge,
            Err(Error::InsideRequest("IdempotencyStore::purge_expired"))
        ),
        "{purge:?}"
    );
    assert!(
        matches!(
            purge_step,
            Err(Error::InsideRequest("IdempotencyStore::purge_expired_step"))
        ),
        "{purge_step:?}"
    );
    assert!(matches!(nested, Err(Error::InsideRequest(_))), "{nested:?}");
    // The writer is free again.
    store
        .write(|tx| tx.execute_batch("CREATE TABLE after (id INTEGER)"))
        .await
        .expect("a write after the request");
}

test! { a_dropped_request_in_place_rolls_back_and_frees_the_writer, multi_thread = 2 }
/// A request in place that is dropped mid-transaction (its client went away) rolls back
/// its rows and gives the writer back: the next request runs and commits.
async fn a_dropped_request_in_place_rolls_back_and_frees_the_writer() {
    let (_dir, store) = store_in_a_temp_dir().await;
    store
        .write(|tx| tx.execute_batch("CREATE TABLE items (name TEXT NOT NULL)"))
        .await
        .expect("schema");
    let inserted = Arc::new(OnceLock::new());
    until_the_writer_is_idle().await;
    let dropped = tokio::time::timeout(
        Duration::from_millis(200),
        store.begin_and_run(&scope("dropped"), PATIENCE, SystemTime::now(), {
            let inserted = inserted.clone();
            move |reservation| async move {
                let insert = reservation
                    .handle()
                    .run(|conn| {
                        conn.execute("INSERT INTO items VALUES ('lost')", [])?;
                        Ok(on_writer_thread())
                    })
                    .await;
                let _ = inserted.set(insert);
                std::future::pending::<()>().await;
                drop(reservation);
            }
        }),
    )
    .await;
    assert!(dropped.is_err(), "the request was still running");
    assert!(
        matches!(inserted.get(), Some(Ok(false))),
        "inserted in place: {inserted:?}"
    );

    let next = tokio::time::timeout(
        PATIENCE,
        store.begin_and_run(
            &scope("next"),
            PATIENCE,
            SystemTime::now(),
            |reservation| async move {
                reservation
                    .handle()
                    .run(|conn| conn.execute("INSERT INTO items VALUES ('kept')", []))
                    .await?;
                reservation.commit(record()).await
            },
        ),
    )
    .await
    .expect("the writer was given back");
    assert!(
        matches!(next, Ok(RunOutcome::Ran { output: Ok(()), .. })),
        "{next:?}"
    );
    let names = store
        .read(|conn| {
            let mut select = conn.prepare("SELECT name FROM items")?;
            let names = select.query_map([], |row| row.get::<_, String>(0))?;
            names.collect::<Result<Vec<_>, _>>()
        })
        .await
        .expect("read");
    assert_eq!(names, ["kept"]);
}

test! { a_duplicate_of_a_request_running_in_place_is_409_at_once_under_reject, multi_thread = 1 }
/// Under `InFlight::Reject`, a duplicate of a request running in place gets `409` at once,
/// as on a cold server (where the request runs on the writer thread), however the first
/// request's handler spends its time: awaiting, or in a slow statement of its own (which
/// blocks the thread it runs on). On a runtime of one worker the duplicate waited for the
/// whole first request (its connection was not even accepted) and then got the replay; with
/// more workers, when the accept loop sat in the blocked worker's LIFO slot.
async fn a_duplicate_of_a_request_running_in_place_is_409_at_once_under_reject() {
    duplicate_of_a_slow_request_is_409_at_once().await;
}

test! { a_duplicate_of_a_slow_request_on_a_current_thread_runtime_is_409_at_once }
/// The same on a current-thread runtime, which has no other thread to take over while a
/// statement blocks: requests there run on the writer thread, not in place.
async fn a_duplicate_of_a_slow_request_on_a_current_thread_runtime_is_409_at_once() {
    duplicate_of_a_slow_request_is_409_at_once().await;
}

test! { with_an_inline_limit_of_zero_a_slow_statement_is_409_at_once_after_fast_ones, multi_thread = 1 }
/// With `with_inline_limit(Duration::ZERO)` every statement of a request in place runs under
/// `block_in_place`, even at a site that has been fast many times: when that site's statement
/// turns slow, a duplicate still gets its `409` at once on a runtime of one worker.
async fn with_an_inline_limit_of_zero_a_slow_statement_is_409_at_once_after_fast_ones() {
    let server = TestServer::builder()
        .store_options(|options| options.with_inline_limit(Duration::ZERO))
        .layer(|layer| layer.with_in_flight(tower_idempotency::InFlight::Reject))
        .hook(hook(move |call| async move {
            // One site for every key: the same closure type, slow only for "slow".
            let slow = call.key.as_deref() == Some("slow");
            let ran = call
                .tx
                .run(move |_conn| {
                    if slow {
                        std::thread::sleep(Duration::from_secs(3));
                    }
                    Ok(())
                })
                .await;
            assert!(ran.is_ok(), "{ran:?}");
            HookOutcome::default()
        }))
        .spawn()
        .await;
    let addr = server.addr;
    warm_up(addr).await;
    for i in 0..20 {
        until_the_writer_is_idle().await;
        let fast = post(addr, Some(SHOP_A), Some(&format!("fast-{i}")), BOOK, &[]).await;
        assert_eq!(fast.status, StatusCode::CREATED, "{fast:?}");
    }
    // Counted only for requests in place: at least the hook's statement and the commit of
    // each fast request ran there, all handed off.
    let (inline, handed_off) = server.store.__blocking_calls();
    assert_eq!(inline, 0, "nothing inline with a zero limit");
    assert!(handed_off >= 40, "{handed_off} calls in place");

    until_the_writer_is_idle().await;
    a_duplicate_of_the_slow_request_is_409_at_once(addr, "after fast ones").await;
    // The slow request ran in place too (its calls were counted), and not inline.
    let (inline, handed_off_after) = server.store.__blocking_calls();
    assert_eq!(inline, 0);
    assert!(
        handed_off_after > handed_off,
        "{handed_off_after} calls in place"
    );
}

test! { a_site_seen_fast_runs_inline_until_one_slow_call, multi_thread = 2 }
/// A call site of a request in place runs under `block_in_place` the first time, inline
/// once it has run fast (under the inline limit), and under `block_in_place` again right
/// after one call at or over the limit. The handler's statement (one closure type) and the
/// commit are sites of their own. Observed through the store's internal counters, not by
/// timing: the limit here is far above what the fast calls take.
async fn a_site_seen_fast_runs_inline_until_one_slow_call() {
    const LIMIT: Duration = Duration::from_secs(2);
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::builder(dir.path().join("inline.db"))
        .with_inline_limit(LIMIT)
        .build()
        .await
        .expect("store");
    store
        .write(|tx| tx.execute_batch("CREATE TABLE items (name TEXT NOT NULL)"))
        .await
        .expect("schema");

    // (key, how long its statement sleeps, the counts (inline, handed off) after it)
    let steps = [
        // Both sites new: handed off.
        ("first", Duration::ZERO, (0, 2)),
        // Both seen fast: inline.
        ("second", Duration::ZERO, (2, 2)),
        ("third", Duration::ZERO, (4, 2)),
        // The statement site turns slow: it blocks its worker this once...
        ("slow", LIMIT + Duration::from_millis(500), (6, 2)),
        // ...and is handed off next time; the commit's site is still fast.
        ("after", Duration::ZERO, (7, 3)),
    ];
    for (key, sleep, counts) in steps {
        until_the_writer_is_idle().await;
        let ran = tokio::time::timeout(
            PATIENCE,
            store.begin_and_run(
                &scope(key),
                PATIENCE,
                SystemTime::now(),
                move |reservation| async move {
                    let inserted = reservation
                        .handle()
                        .run(move |conn| {
                            std::thread::sleep(sleep);
                            conn.execute("INSERT INTO items VALUES (?1)", [key])?;
                            Ok(on_writer_thread())
                        })
                        .await;
                    (inserted, reservation.commit(record()).await)
                },
            ),
        )
        .await
        .expect("answered");
        let Ok(RunOutcome::Ran {
            output: (inserted, committed),
            ..
        }) = ran
        else {
            panic!("{key} ran: {ran:?}");
        };
        assert!(
            matches!(inserted, Ok(false)),
            "{key} in place: {inserted:?}"
        );
        assert!(committed.is_ok(), "{key}: {committed:?}");
        assert_eq!(store.__blocking_calls(), counts, "after {key}");
    }
    let count = store
        .read(|conn| conn.query_row("SELECT count(*) FROM items", [], |row| row.get::<_, i64>(0)))
        .await
        .expect("read");
    assert_eq!(count, 5);
}

async fn duplicate_of_a_slow_request_is_409_at_once() {
    for slow_statement in [false, true] {
        let server = TestServer::builder()
            .layer(|layer| layer.with_in_flight(tower_idempotency::InFlight::Reject))
            .hook(hook(move |call| async move {
                if call.key.as_deref() == Some("slow") {
                    if slow_statement {
                        let slept = call
                            .tx
                            .run(|_conn| {
                                std::thread::sleep(Duration::from_secs(3));
                                Ok(())
                            })
                            .await;
                        assert!(slept.is_ok(), "{slept:?}");
                    } else {
                        tokio::time::sleep(Duration::from_secs(3)).await;
                    }
                }
                HookOutcome::default()
            }))
            .spawn()
            .await;
        let addr = server.addr;
        warm_up(addr).await;
        until_the_writer_is_idle().await;
        let label = format!("slow_statement={slow_statement}");
        a_duplicate_of_the_slow_request_is_409_at_once(addr, &label).await;
        assert_eq!(server.app.handler_calls(), 2);
    }
}

/// A first request (key `warm-up`), answered `201`.
async fn warm_up(addr: std::net::SocketAddr) {
    let warm_up = post(addr, Some(SHOP_A), Some("warm-up"), BOOK, &[]).await;
    assert_eq!(warm_up.status, StatusCode::CREATED, "{warm_up:?}");
}

/// Sends the request of key `slow` (whose handler takes 3 s), then after 400 ms its
/// duplicate, which must get `409 request_in_flight` within a second; then the first its `201`.
async fn a_duplicate_of_the_slow_request_is_409_at_once(addr: std::net::SocketAddr, label: &str) {
    let first =
        tokio::spawn(async move { post(addr, Some(SHOP_A), Some("slow"), BOOK, &[]).await });
    tokio::time::sleep(Duration::from_millis(400)).await;
    let started = std::time::Instant::now();
    let duplicate = post(addr, Some(SHOP_A), Some("slow"), BOOK, &[]).await;
    let waited = started.elapsed();
    assert_eq!(
        duplicate.status,
        StatusCode::CONFLICT,
        "{label}: {duplicate:?}"
    );
    assert_eq!(duplicate.error_code(), "request_in_flight", "{label}");
    assert!(
        waited < Duration::from_millis(1000),
        "{label}: answered after {waited:?}"
    );
    let first = first.await.expect("the first request");
    assert_eq!(first.status, StatusCode::CREATED, "{label}: {first:?}");
}
