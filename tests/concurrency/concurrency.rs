//! Duplicates in flight at the same time, and waits bounded by the lock timeout, written once
//! and run against a SQLite file through either store (`concurrency::sqlite::...`,
//! `concurrency::sqlx_sqlite::...`), a PostgreSQL schema through either store
//! (`concurrency::postgres::...`, `concurrency::sqlx_postgres::...`, reported as ignored without
//! `TEST_DATABASE_URL`) and a MySQL/MariaDB database (`concurrency::mysql::...`, ignored
//! without `TEST_MYSQL_URL`): duplicates serialize on their key (within one app instance or
//! across two, and behind a first request that rolls back), waits end in a `503` with
//! `Retry-After`, replays never wait for writers. Each backend's module also holds what only it
//! has: SQLite's single writer (another key, or another process, is busy); the parallel writers
//! of the others (two instances on one database); PostgreSQL's pool limits and serialization
//! failures; a handler's statement failing with a conflict on the sqlx stores on a server.

use support::backend;
use support::common;
use support::pg_common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use backend::{
    checking, first_call_only, hook, hook_sharing, replays, runs_afresh, Database, HandleConflict,
    Hook, Problems, Server,
};
use common::{post, Reply, PATIENCE, SHOP_A};
use http::StatusCode;
use tokio::sync::{Barrier, Notify};
use tokio::task::JoinHandle;
use tower_idempotency::{IdempotencyLayer, InFlight};

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

/// Sends every `(server, key, body)` at once (released together by a barrier), each on its
/// own connection; the replies come back in the same order.
async fn send_all_at_once(requests: Vec<(SocketAddr, String, String)>) -> Vec<Reply> {
    let barrier = Arc::new(Barrier::new(requests.len()));
    let tasks: Vec<_> = requests
        .into_iter()
        .map(|(addr, key, body)| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                post(addr, Some(SHOP_A), Some(&key), &body, &[]).await
            })
        })
        .collect();
    let mut replies = Vec::with_capacity(tasks.len());
    for task in tasks {
        replies.push(task.await.expect("request task"));
    }
    replies
}

/// `n` requests for `key` with a book, to one server.
fn same_request(addr: SocketAddr, key: &str, n: usize) -> Vec<(SocketAddr, String, String)> {
    vec![(addr, key.to_owned(), BOOK.to_owned()); n]
}

/// Checks that every key got the same 201 from all its requests, exactly one of them
/// original, and returns each key's order id and how many requests it had.
fn one_order_per_key(
    requests: &[(SocketAddr, String, String)],
    replies: &[Reply],
) -> HashMap<String, (i64, usize)> {
    let mut by_key: HashMap<&str, Vec<&Reply>> = HashMap::new();
    for ((_, key, _), reply) in requests.iter().zip(replies) {
        assert_eq!(reply.status, StatusCode::CREATED, "{key}: {reply:?}");
        by_key.entry(key).or_default().push(reply);
    }
    by_key
        .into_iter()
        .map(|(key, replies)| {
            let first = replies[0];
            for reply in &replies {
                assert_eq!(reply.body, first.body, "{key}: identical bodies");
                assert_eq!(reply.header("location"), first.header("location"));
            }
            let originals = replies.iter().filter(|r| !r.replayed()).count();
            assert_eq!(originals, 1, "{key}: one original, the rest replayed");
            (key.to_owned(), (first.order_id(), replies.len()))
        })
        .collect()
}

/// A small deterministic shuffle (xorshift), so failures are reproducible.
fn shuffle<T>(items: &mut [T], mut seed: u64) {
    for i in (1..items.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let j = (seed % (i as u64 + 1)) as usize;
        items.swap(i, j);
    }
}

/// Keys × duplicates, shuffled, spread over the given servers.
fn interleaved(
    servers: &[SocketAddr],
    keys: usize,
    duplicates: usize,
) -> Vec<(SocketAddr, String, String)> {
    let mut requests = Vec::new();
    for k in 0..keys {
        for d in 0..duplicates {
            let body = format!(r#"{{"sku":"sku-{k}","quantity":{}}}"#, k % 100 + 1);
            requests.push((servers[(k + d) % servers.len()], format!("key-{k}"), body));
        }
    }
    shuffle(&mut requests, 0x9E37_79B9_7F4A_7C15);
    requests
}

/// A hook that sleeps a little inside each transaction, so that duplicates pile up behind it.
fn slow_handler(millis: u64) -> Hook {
    hook(move |_| async move {
        tokio::time::sleep(Duration::from_millis(millis)).await;
        None
    })
}

/// Holds the handler of one key inside its open transaction until released.
struct Holder {
    key: &'static str,
    started: Arc<Notify>,
    release: Arc<Notify>,
}

impl Holder {
    fn new(key: &'static str) -> Holder {
        Holder {
            key,
            started: Arc::new(Notify::new()),
            release: Arc::new(Notify::new()),
        }
    }

    /// The hook that holds the key's handler (others run through).
    fn hook(&self) -> Hook {
        let (key, started, release) = (self.key, self.started.clone(), self.release.clone());
        hook(move |call| {
            let (started, release) = (started.clone(), release.clone());
            async move {
                if call.key.as_deref() == Some(key) {
                    started.notify_one();
                    release.notified().await;
                }
                None
            }
        })
    }

    /// Sends the key's request and waits until its handler is inside the transaction.
    async fn hold(&self, addr: SocketAddr) -> JoinHandle<Reply> {
        let key = self.key;
        let holder =
            tokio::spawn(async move { post(addr, Some(SHOP_A), Some(key), BOOK, &[]).await });
        tokio::time::timeout(PATIENCE, self.started.notified())
            .await
            .expect("the holder's handler started");
        holder
    }

    /// The app with this hook, waits bounded by `lock_timeout` and `Retry-After: 3`.
    async fn serve<B: Database>(&self, db: &B, lock_timeout: Duration) -> Server<B> {
        db.server()
            .layer(move |layer| {
                layer
                    .with_lock_timeout(lock_timeout)
                    .with_retry_after(Duration::from_secs(3))
            })
            .hook(self.hook())
            .spawn()
            .await
    }

    fn release(&self) {
        self.release.notify_one();
    }
}

/// Completes the key `done`, holds the holder's key inside its transaction, then sends `done`
/// again (a replay) and with another payload (a conflict). The first reply, the held request,
/// the replay and the conflict; the holder is still holding.
async fn done_while_held(
    addr: SocketAddr,
    holder: &Holder,
) -> (Reply, JoinHandle<Reply>, Reply, Reply) {
    let first = post(addr, Some(SHOP_A), Some("done"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let held = holder.hold(addr).await;
    let replay = post(addr, Some(SHOP_A), Some("done"), BOOK, &[]).await;
    let pen = r#"{"sku":"pen","quantity":1}"#;
    let conflict = post(addr, Some(SHOP_A), Some("done"), pen, &[]).await;
    (first, held, replay, conflict)
}

async fn concurrent_duplicates_run_the_handler_once<B: Database>(db: B) {
    const DUPLICATES: usize = 32;
    // The first handler holds its transaction until every duplicate has reached the server,
    // so that they are all in flight together.
    let gate = Arc::new(Notify::new());
    let server = db
        .server()
        .layer(|layer| layer.with_lock_timeout(Duration::from_secs(30)))
        .hook(hook_sharing(&gate, |gate, _| async move {
            gate.notified().await;
            None
        }))
        .spawn()
        .await;
    let all_arrived = Arc::new(AtomicBool::new(false));
    let opener = {
        let (app, gate, all_arrived) = (server.app.clone(), gate.clone(), all_arrived.clone());
        tokio::spawn(async move {
            all_arrived.store(
                app.wait_for_arrivals(DUPLICATES, PATIENCE).await,
                Ordering::SeqCst,
            );
            // Only one handler may ever be waiting; a permit is kept if it is not there yet.
            gate.notify_one();
        })
    };

    let requests = same_request(server.addr, "dup-key", DUPLICATES);
    let replies = send_all_at_once(requests.clone()).await;
    opener.await.expect("opener");

    assert!(
        all_arrived.load(Ordering::SeqCst),
        "all duplicates were in flight while the first held its transaction"
    );
    one_order_per_key(&requests, &replies);
    assert_eq!(server.app.handler_calls(), 1, "exactly one ran the handler");
    assert_eq!(db.order_count().await, 1, "exactly one order");
    assert_eq!(db.record_count().await, 1);
}

async fn many_keys_with_many_duplicates_interleaved<B: Database>(db: B) {
    const KEYS: usize = 20;
    const DUPLICATES: usize = 8;
    let server = db
        .server()
        .layer(|layer| layer.with_lock_timeout(Duration::from_secs(30)))
        .hook(slow_handler(3))
        .spawn()
        .await;
    let requests = interleaved(&[server.addr], KEYS, DUPLICATES);

    let replies = send_all_at_once(requests.clone()).await;

    let by_key = one_order_per_key(&requests, &replies);
    let mut ids: Vec<i64> = by_key.values().map(|(id, _)| *id).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), KEYS, "one distinct order per key");
    assert!(by_key.values().all(|(_, n)| *n == DUPLICATES));
    assert_eq!(db.order_count().await, KEYS as i64);
    assert_eq!(db.record_count().await, KEYS as i64);
    assert_eq!(server.app.handler_calls(), KEYS);
}

async fn replay_does_not_wait_for_a_writer_in_flight<B: Database>(db: B) {
    let holder = Holder::new("holder");
    let server = holder.serve(&db, Duration::from_millis(200)).await;
    // A writer is in flight past the lock timeout; a completed key still replays, and a
    // reused key still gets its 409, from the read-only fast path.
    let (first, held, replay, conflict) = done_while_held(server.addr, &holder).await;
    holder.release();

    assert_eq!(replay.status, StatusCode::CREATED, "{replay:?}");
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(conflict.status, StatusCode::CONFLICT, "{conflict:?}");
    assert_eq!(held.await.expect("holder").status, StatusCode::CREATED);
}

async fn duplicate_waiting_past_the_lock_timeout_is_503_then_replays<B: Database>(db: B) {
    let holder = Holder::new("held");
    let server = holder.serve(&db, Duration::from_millis(300)).await;
    let held = holder.hold(server.addr).await;

    let started = std::time::Instant::now();
    let waited = post(server.addr, Some(SHOP_A), Some("held"), BOOK, &[]).await;
    // MySQL bounds lock waits in whole seconds: 300 ms is 1 s there.
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "the wait was bounded"
    );
    // Where writers run in parallel, only that key waits: another one goes through meanwhile.
    let others = if B::PARALLEL_WRITERS {
        let other = post(server.addr, Some(SHOP_A), Some("other"), BOOK, &[]).await;
        assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
        1
    } else {
        0
    };

    assert_eq!(waited.status, StatusCode::SERVICE_UNAVAILABLE, "{waited:?}");
    assert_eq!(waited.header("retry-after"), Some("3"));
    assert_eq!(waited.error_code(), "busy_retry_later");
    assert_eq!(
        server.app.handler_calls(),
        1 + others,
        "the duplicate did not run the handler"
    );

    holder.release();
    let original = held.await.expect("original");
    assert_eq!(original.status, StatusCode::CREATED, "{original:?}");
    replays(server.addr, "held", BOOK, &original).await;
    assert_eq!(server.app.handler_calls(), 1 + others);
    assert_eq!(db.counts().await, (1 + others as i64, 1 + others as i64));
}

async fn when_the_original_fails_a_waiting_duplicate_runs_afresh<B: Database>(db: B) {
    let gate = Arc::new(Notify::new());
    let first = Arc::new(AtomicBool::new(true));
    let server = db
        .server()
        .layer(|layer| layer.with_lock_timeout(Duration::from_secs(30)))
        .hook(hook_sharing(&gate, move |gate, _| {
            let fail = first.swap(false, Ordering::SeqCst);
            async move {
                if !fail {
                    return None;
                }
                gate.notified().await;
                Some(StatusCode::INTERNAL_SERVER_ERROR)
            }
        }))
        .spawn()
        .await;
    let opener = {
        let app = server.app.clone();
        let gate = gate.clone();
        tokio::spawn(async move {
            let both = app.wait_for_arrivals(2, PATIENCE).await;
            gate.notify_one();
            both
        })
    };

    let replies = send_all_at_once(same_request(server.addr, "dup", 2)).await;

    assert!(
        opener.await.expect("opener"),
        "both were in flight together"
    );
    let mut statuses: Vec<_> = replies.iter().map(|r| r.status).collect();
    statuses.sort();
    assert_eq!(
        statuses,
        vec![StatusCode::CREATED, StatusCode::INTERNAL_SERVER_ERROR],
        "{replies:?}"
    );
    assert!(
        replies.iter().all(|r| !r.replayed()),
        "the failure was not saved"
    );
    assert_eq!(server.app.handler_calls(), 2);
    assert_eq!(
        db.order_count().await,
        1,
        "only the successful attempt's order"
    );
    assert_eq!(db.record_count().await, 1);
}

/// `n` duplicates of the holder's key, sent at once while its handler holds the transaction.
async fn duplicates_while_held(addr: SocketAddr, holder: &Holder, n: usize) -> Vec<Reply> {
    send_all_at_once(same_request(addr, holder.key, n)).await
}

/// The app with this hook, the duplicates of a running request answered by `policy`; the lock
/// timeout is far longer than the test, so that only the policy can answer early.
async fn serve_with_policy<B: Database>(db: &B, holder: &Holder, policy: InFlight) -> Server<B> {
    db.server()
        .layer(move |layer| {
            layer
                .with_in_flight(policy)
                .with_lock_timeout(Duration::from_secs(60))
                .with_retry_after(Duration::from_secs(3))
        })
        .hook(holder.hook())
        .spawn()
        .await
}

async fn in_flight_reject_answers_duplicates_409_with_retry_after_at_once<B: Database>(db: B) {
    const DUPLICATES: usize = 8;
    let holder = Holder::new("running");
    let server = serve_with_policy(&db, &holder, InFlight::Reject).await;
    let held = holder.hold(server.addr).await;

    // Answered while the first still holds its transaction: nobody waited for it.
    let duplicates = duplicates_while_held(server.addr, &holder, DUPLICATES).await;
    holder.release();

    for reply in &duplicates {
        assert_eq!(reply.status, StatusCode::CONFLICT, "{reply:?}");
        assert_eq!(reply.header("retry-after"), Some("3"));
        assert_eq!(reply.error_code(), "request_in_flight");
    }
    let first = held.await.expect("holder");
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    // Once it has ended, the same key replays.
    let retry = post(server.addr, Some(SHOP_A), Some(holder.key), BOOK, &[]).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(
        server.app.handler_calls(),
        1,
        "only the first ran the handler"
    );
    assert_eq!(db.counts().await, (1, 1));
}

/// Under `Reject`, retries of a key already completed all replay, however many arrive at once:
/// the key is not in flight, even while one of them holds it in this process to look it up.
async fn in_flight_reject_replays_every_retry_of_a_completed_key<B: Database>(db: B) {
    const RETRIES: usize = 16;
    let server = db
        .with_layer(|layer| {
            layer
                .with_in_flight(InFlight::Reject)
                .with_retry_after(Duration::from_secs(3))
        })
        .await;
    let first = post(server.addr, Some(SHOP_A), Some("completed"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");

    let retries = send_all_at_once(same_request(server.addr, "completed", RETRIES)).await;

    let refused = retries
        .iter()
        .filter(|reply| reply.status != StatusCode::CREATED)
        .count();
    assert_eq!(refused, 0, "retries not replayed: {retries:?}");
    for reply in &retries {
        assert!(reply.replayed(), "{reply:?}");
        assert_eq!(reply.body, first.body);
    }
    assert_eq!(server.app.handler_calls(), 1);
    assert_eq!(db.counts().await, (1, 1));
}

async fn in_flight_wait_up_to_a_bound_replays_when_the_first_ends_in_time<B: Database>(db: B) {
    const DUPLICATES: usize = 8;
    let holder = Holder::new("running");
    let policy = InFlight::WaitUpTo(Duration::from_secs(30));
    let server = serve_with_policy(&db, &holder, policy).await;
    let held = holder.hold(server.addr).await;

    let duplicates = {
        let (addr, key) = (server.addr, holder.key);
        tokio::spawn(async move { send_all_at_once(same_request(addr, key, DUPLICATES)).await })
    };
    assert!(
        server.app.wait_for_arrivals(1 + DUPLICATES, PATIENCE).await,
        "the duplicates reached the layer while the first held its transaction"
    );
    holder.release();
    let first = held.await.expect("holder");
    let duplicates = duplicates.await.expect("duplicates");

    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    for reply in &duplicates {
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        assert!(reply.replayed());
        assert_eq!(reply.body, first.body);
    }
    assert_eq!(server.app.handler_calls(), 1);
    assert_eq!(db.counts().await, (1, 1));
}

async fn in_flight_wait_up_to_a_bound_then_409<B: Database>(db: B) {
    let holder = Holder::new("running");
    let policy = InFlight::WaitUpTo(Duration::from_millis(200));
    let server = serve_with_policy(&db, &holder, policy).await;
    let held = holder.hold(server.addr).await;

    // The first is still held when the bound passes.
    let duplicates = duplicates_while_held(server.addr, &holder, 4).await;
    // Another key is not held back by the policy.
    let other = if B::PARALLEL_WRITERS {
        Some(post(server.addr, Some(SHOP_A), Some("other"), BOOK, &[]).await)
    } else {
        None
    };
    holder.release();

    for reply in &duplicates {
        assert_eq!(reply.status, StatusCode::CONFLICT, "{reply:?}");
        assert_eq!(reply.header("retry-after"), Some("3"));
        assert_eq!(reply.error_code(), "request_in_flight");
    }
    if let Some(other) = other {
        assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
    }
    assert_eq!(held.await.expect("holder").status, StatusCode::CREATED);
    let retry = post(server.addr, Some(SHOP_A), Some(holder.key), BOOK, &[]).await;
    assert!(retry.replayed(), "{retry:?}");
    let others = usize::from(B::PARALLEL_WRITERS);
    assert_eq!(server.app.handler_calls(), 1 + others);
    assert_eq!(db.order_count().await, 1 + others as i64);
}

/// Two app instances (two servers, two stores of their own) on one database; every key is
/// sent to both at once, several times: still one order per key, and both instances ran
/// handlers (on SQLite one instance's writer may win every race: backends with parallel writers).
async fn two_app_instances_sharing_the_database_create_one_order_per_key<B: Database>(db: B) {
    const KEYS: usize = 12;
    const DUPLICATES: usize = 6;
    let long_wait =
        |layer: IdempotencyLayer<B::Store>| layer.with_lock_timeout(Duration::from_secs(30));
    let instance = || db.server().layer(long_wait).hook(slow_handler(5)).spawn();
    let a = instance().await;
    let b = instance().await;
    let requests = interleaved(&[a.addr, b.addr], KEYS, DUPLICATES);

    let replies = send_all_at_once(requests.clone()).await;

    let by_key = one_order_per_key(&requests, &replies);
    assert_eq!(by_key.len(), KEYS);
    assert_eq!(db.order_count().await, KEYS as i64);
    assert_eq!(db.record_count().await, KEYS as i64);
    assert_eq!(a.app.handler_calls() + b.app.handler_calls(), KEYS);
    assert!(
        a.app.handler_calls() > 0 && b.app.handler_calls() > 0,
        "both instances ran handlers"
    );
}

/// Different keys do not queue behind one writer: both handlers are inside their
/// transactions at the same time.
async fn different_keys_run_their_handlers_in_parallel<B: Database>(db: B) {
    let together = Arc::new(Barrier::new(2));
    let server = db
        .server()
        .layer(|layer| layer.with_lock_timeout(Duration::from_millis(500)))
        .hook(hook_sharing(&together, |together, _| async move {
            // Passes only when the other handler is inside its transaction too.
            let met = tokio::time::timeout(PATIENCE, together.wait()).await;
            met.is_err().then_some(StatusCode::INTERNAL_SERVER_ERROR)
        }))
        .spawn()
        .await;

    let replies = send_all_at_once(two_keys(server.addr)).await;

    for reply in &replies {
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    }
    assert_eq!(db.order_count().await, 2);
}

/// `key-a` and `key-b`, with a book, to this server.
fn two_keys(addr: SocketAddr) -> Vec<(SocketAddr, String, String)> {
    ["key-a", "key-b"]
        .into_iter()
        .map(|key| (addr, key.to_owned(), BOOK.to_owned()))
        .collect()
}

/// Duplicates queued behind a key whose first request rolls back: one of them runs (on
/// InnoDB some of the waiters may be picked as deadlock victims, which the store retries), the
/// others replay it.
async fn duplicates_behind_a_rollback_run_once<B: Database>(db: B) {
    const DUPLICATES: usize = 6;
    let server = db
        .server()
        .layer(|layer| layer.with_lock_timeout(Duration::from_secs(10)))
        .hook(hook(first_call_only(|_| async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            Some(StatusCode::INTERNAL_SERVER_ERROR)
        })))
        .spawn()
        .await;
    let addr = server.addr;
    let first =
        tokio::spawn(async move { post(addr, Some(SHOP_A), Some("key-rb"), BOOK, &[]).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let replies = send_all_at_once(same_request(addr, "key-rb", DUPLICATES)).await;

    let first = first.await.expect("first request");
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR, "{first:?}");
    let order_id = replies[0].order_id();
    for reply in &replies {
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        assert_eq!(reply.order_id(), order_id);
    }
    assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1);
    assert_eq!(
        server.app.handler_calls(),
        2,
        "the failed run and one duplicate"
    );
    assert_eq!(db.counts().await, (1, 1));
}

/// A statement of the handler fails with the server's serialization or deadlock class (the
/// handler answers as if nothing happened): the layer knows better, rolls back and runs the
/// request again.
async fn a_handler_statement_conflict_runs_the_request_again<B: HandleConflict>(db: B) {
    let problems = Problems::default();
    let server = db
        .server()
        .hook(hook(first_call_only(checking::<B>(
            B::raise_conflict,
            &problems,
        ))))
        .spawn()
        .await;

    let reply = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(problems.found(), Vec::<String>::new());
    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    assert_eq!(
        server.app.handler_calls(),
        2,
        "the layer ran the request again"
    );
    assert_eq!(db.counts().await, (1, 1), "the first run rolled back");
}

/// The tests above, on one backend.
macro_rules! concurrency_tests {
    ($backend:ident) => {
        backend_tests!($backend;
            concurrent_duplicates_run_the_handler_once(multi_thread = 2),
            many_keys_with_many_duplicates_interleaved(multi_thread = 2),
            replay_does_not_wait_for_a_writer_in_flight,
            duplicate_waiting_past_the_lock_timeout_is_503_then_replays,
            when_the_original_fails_a_waiting_duplicate_runs_afresh(multi_thread = 2),
            in_flight_reject_answers_duplicates_409_with_retry_after_at_once(multi_thread = 2),
            in_flight_reject_replays_every_retry_of_a_completed_key(multi_thread = 2),
            in_flight_wait_up_to_a_bound_replays_when_the_first_ends_in_time(multi_thread = 2),
            in_flight_wait_up_to_a_bound_then_409(multi_thread = 2),
            duplicates_behind_a_rollback_run_once(multi_thread = 2),
        );
    };
}

/// What backends with writers in parallel (and several instances on one database) add.
macro_rules! parallel_writer_tests {
    ($backend:ident) => {
        backend_tests!($backend;
            two_app_instances_sharing_the_database_create_one_order_per_key(multi_thread = 2),
            different_keys_run_their_handlers_in_parallel(multi_thread = 2),
        );
    };
}

/// A backend on a SQLite file (the SQLite store, or the SQLite store on sqlx), for what another
/// process does to the file.
trait OnSqliteFile: Database {
    fn file(&self) -> PathBuf;
}

impl OnSqliteFile for backend::Sqlite {
    fn file(&self) -> PathBuf {
        self.path().to_path_buf()
    }
}

impl OnSqliteFile for backend::SqlxSqlite {
    fn file(&self) -> PathBuf {
        self.db.path()
    }
}

/// SQLite has one writer: a writer of another key holding the write lock makes a new key wait
/// past the lock timeout.
async fn store_busy_past_the_lock_timeout_is_503_with_retry_after<B: OnSqliteFile>(db: B) {
    let holder = Holder::new("holder");
    let server = holder.serve(&db, Duration::from_millis(200)).await;
    let held = holder.hold(server.addr).await;

    let busy = post(server.addr, Some(SHOP_A), Some("other"), BOOK, &[]).await;

    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE, "{busy:?}");
    assert_eq!(busy.header("retry-after"), Some("3"));
    assert_eq!(busy.error_code(), "busy_retry_later");
    assert_eq!(
        server.app.handler_calls(),
        1,
        "the busy request's handler never ran"
    );
    assert!(!db.record_exists("shop-a", "create_order", "other").await);

    holder.release();
    let held = held.await.expect("holder task");
    assert_eq!(held.status, StatusCode::CREATED, "{held:?}");

    runs_afresh(server.addr, "other", BOOK).await;
    assert_eq!(db.counts().await, (2, 2));
}

/// Another process holding SQLite's write lock makes a new key wait past the lock timeout,
/// while replays go on; the retry succeeds once it is gone.
async fn another_process_holding_the_write_lock_is_503_then_retry_succeeds<B: OnSqliteFile>(db: B) {
    let server = db
        .with_layer(|layer| layer.with_lock_timeout(Duration::from_millis(300)))
        .await;
    let first = post(server.addr, Some(SHOP_A), Some("done"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);

    // Another process: its own connection to the same file, holding SQLite's write lock.
    let path = db.file();
    let (locked_tx, locked_rx) = tokio::sync::oneshot::channel::<()>();
    let (unlock_tx, unlock_rx) = std::sync::mpsc::channel::<()>();
    let other_process = std::thread::spawn(move || {
        let conn = rusqlite::Connection::open(path).expect("open");
        conn.execute_batch(
            "BEGIN IMMEDIATE; INSERT INTO orders (tenant_id, sku, quantity) \
             VALUES ('shop-b', 'other-process', 1);",
        )
        .expect("take the write lock");
        let _ = locked_tx.send(());
        let _ = unlock_rx.recv_timeout(PATIENCE);
        conn.execute_batch("COMMIT").expect("commit");
    });
    locked_rx.await.expect("the other process holds the lock");

    let busy = post(server.addr, Some(SHOP_A), Some("new-key"), BOOK, &[]).await;
    let replay = post(server.addr, Some(SHOP_A), Some("done"), BOOK, &[]).await;
    let _ = unlock_tx.send(());
    other_process.join().expect("other process");

    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE, "{busy:?}");
    assert!(busy.header("retry-after").is_some(), "{busy:?}");
    assert!(!db.record_exists("shop-a", "create_order", "new-key").await);
    assert!(
        replay.replayed(),
        "replays do not wait for the writer: {replay:?}"
    );

    runs_afresh(server.addr, "new-key", BOOK).await;
    assert_eq!(
        db.order_count().await,
        3,
        "ours, the other process's, the retry's"
    );
}

/// What a backend with one writer adds: another key, or another process, holding the write
/// lock.
macro_rules! single_writer_tests {
    ($backend:ident) => {
        backend_tests!($backend;
            store_busy_past_the_lock_timeout_is_503_with_retry_after,
            another_process_holding_the_write_lock_is_503_then_retry_succeeds,
        );
    };
}

mod sqlite {
    //! SQLite has one writer: a writer of another key, or another process holding the write
    //! lock, makes a new key wait past the lock timeout.

    concurrency_tests!(Sqlite);
    single_writer_tests!(Sqlite);
}

mod sqlx_sqlite {
    //! The sqlx store on a SQLite file: the suite, and SQLite's one writer, as in `sqlite`.

    concurrency_tests!(SqlxSqlite);
    single_writer_tests!(SqlxSqlite);
    // Not `parallel_writer_tests!`: SQLite has one writer, so handlers of different keys never
    // run at once (`different_keys_run_their_handlers_in_parallel`), and one instance's writer
    // may win every race (`two_app_instances_sharing_the_database_create_one_order_per_key`).
    // Not `a_handler_statement_conflict_runs_the_request_again`: SQLite has no serialization
    // failures or deadlocks (writers take the lock one at a time), so no statement can fail
    // with a conflict for the layer to retry.
}

mod postgres {
    //! PostgreSQL runs writers of different keys in parallel, bounds them by its pools, and
    //! may fail a SERIALIZABLE transaction.

    use backend::Postgres;
    use pg_common::{hook as pg_hook, HookOutcome, PgServer};
    use tower_idempotency::store::tokio_postgres::PostgresStore;
    use tower_idempotency::store::{Isolation, ReplayCheck};

    use super::*;

    concurrency_tests!(Postgres);
    parallel_writer_tests!(Postgres);

    /// A server whose store has one transaction connection, with `holder`'s hook and
    /// `lock_timeout`.
    async fn one_connection(
        db: &Postgres,
        holder: &Holder,
        lock_timeout: Duration,
    ) -> Server<Postgres> {
        db.server()
            .layer(move |layer| layer.with_lock_timeout(lock_timeout))
            .hook(holder.hook())
            .spawn_with(|options| options.with_max_connections(1))
            .await
    }

    test! { replays_do_not_wait_for_writers_and_a_full_pool_is_503, postgres }
    /// With one transaction connection, held by a slow handler: a new key waits for the pool
    /// past the lock timeout (`503`), while completed keys still replay from the read pool.
    async fn replays_do_not_wait_for_writers_and_a_full_pool_is_503() {
        let Some(db) = Postgres::create().await else {
            return;
        };
        let holder = Holder::new("holder");
        let server = one_connection(&db, &holder, Duration::from_millis(300)).await;
        let (done, held, replay, conflict) = done_while_held(server.addr, &holder).await;
        let busy = post(server.addr, Some(SHOP_A), Some("new-key"), BOOK, &[]).await;
        holder.release();

        assert!(replay.replayed(), "{replay:?}");
        assert_eq!(replay.body, done.body);
        assert_eq!(conflict.status, StatusCode::CONFLICT, "{conflict:?}");
        assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE, "{busy:?}");
        assert!(busy.header("retry-after").is_some());
        assert_eq!(held.await.expect("holder").status, StatusCode::CREATED);
        assert!(!db.record_exists("shop-a", "create_order", "new-key").await);
        runs_afresh(server.addr, "new-key", BOOK).await;
    }

    test! { a_replay_waits_only_briefly_for_connections_that_writers_hold, postgres }
    /// Under the default replay check, retries rare so far: with every transaction connection
    /// held by a slow handler, a replay waits for one only briefly, then is answered from the
    /// read pool, long before the lock timeout (30 s) would end its wait; so is another
    /// payload's `409`.
    async fn a_replay_waits_only_briefly_for_connections_that_writers_hold() {
        let Some(db) = Postgres::create().await else {
            return;
        };
        let holder = Holder::new("holder");
        let server = one_connection(&db, &holder, Duration::from_secs(30)).await;
        let started = std::time::Instant::now();
        let (done, held, replay, conflict) = done_while_held(server.addr, &holder).await;
        let answered = started.elapsed();
        holder.release();

        assert!(replay.replayed(), "{replay:?}");
        assert_eq!(replay.body, done.body);
        assert_eq!(conflict.status, StatusCode::CONFLICT, "{conflict:?}");
        assert!(
            answered < Duration::from_secs(10),
            "answered after {answered:?}, not after the lock timeout"
        );
        assert_eq!(held.await.expect("holder").status, StatusCode::CREATED);
    }

    test! { replay_check_in_the_reservation_keeps_the_contract, postgres }
    /// With the replay check in the reservation (no read before the transaction), the key's
    /// contract holds: a retry replays, another payload is `409`, and duplicates in flight
    /// together wait on the key's row and create one order.
    async fn replay_check_in_the_reservation_keeps_the_contract() {
        const DUPLICATES: usize = 16;
        let Some(db) = Postgres::create().await else {
            return;
        };
        let gate = Arc::new(Notify::new());
        let held = gate.clone();
        let server = db
            .server()
            .layer(|layer| layer.with_lock_timeout(Duration::from_secs(30)))
            // The first handler holds its transaction until every duplicate has arrived.
            .hook(hook(first_call_only(move |_| {
                let gate = held.clone();
                async move {
                    gate.notified().await;
                    None
                }
            })))
            .spawn_with(|options| options.with_replay_check(ReplayCheck::FavorNewKeys))
            .await;
        let opener = {
            let (app, gate) = (server.app.clone(), gate.clone());
            tokio::spawn(async move {
                let arrived = app.wait_for_arrivals(DUPLICATES, PATIENCE).await;
                gate.notify_one();
                arrived
            })
        };
        let requests = same_request(server.addr, "dup-key", DUPLICATES);
        let replies = send_all_at_once(requests.clone()).await;
        assert!(
            opener.await.expect("opener"),
            "all duplicates were in flight together"
        );
        one_order_per_key(&requests, &replies);
        assert_eq!(server.app.handler_calls(), 1, "exactly one ran the handler");

        let first = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        let replay = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
        assert!(replay.replayed(), "{replay:?}");
        assert_eq!(replay.body, first.body);
        let pen = r#"{"sku":"pen","quantity":1}"#;
        let other = post(server.addr, Some(SHOP_A), Some("key-1"), pen, &[]).await;
        assert_eq!(other.status, StatusCode::CONFLICT, "{other:?}");
        assert_eq!(server.app.handler_calls(), 2);
        assert_eq!(db.order_count().await, 2, "one order per key");
    }

    /// A SERIALIZABLE app whose first two handlers both read the whole `orders` table, then
    /// wait for each other, before inserting: they cannot both commit.
    async fn racing_readers(
        db: &Postgres,
        layer: impl Fn(IdempotencyLayer<PostgresStore>) -> IdempotencyLayer<PostgresStore>
            + Send
            + 'static,
    ) -> PgServer {
        let both_read = Arc::new(Barrier::new(2));
        let first_call = Arc::new(AtomicBool::new(true));
        PgServer::builder()
            .store(|options| options.with_isolation(Isolation::Serializable))
            .layer(layer)
            .hook(pg_hook(move |call| {
                let (both_read, first_call) = (both_read.clone(), first_call.clone());
                async move {
                    // Only the first two calls race; a retry runs alone.
                    if first_call.load(Ordering::SeqCst) {
                        let client = call.tx.client().await.expect("client");
                        client
                            .query_one("SELECT count(*) FROM orders", &[])
                            .await
                            .expect("read orders");
                        drop(client);
                        let _ = tokio::time::timeout(PATIENCE, both_read.wait()).await;
                        first_call.store(false, Ordering::SeqCst);
                    }
                    HookOutcome::default()
                }
            }))
            .spawn(&db.db)
            .await
    }

    test! { serialization_failure_is_503_and_the_retry_succeeds, multi_thread = 2, postgres }
    /// The loser's serialization failure is a `503` with `Retry-After`, nothing of it is
    /// kept, and its retry succeeds.
    async fn serialization_failure_is_503_and_the_retry_succeeds() {
        let Some(db) = Postgres::create().await else {
            return;
        };
        let server = racing_readers(&db, |layer| {
            layer
                .with_lock_timeout(Duration::from_secs(5))
                .with_conflict_retries(0)
        })
        .await;

        let replies = send_all_at_once(two_keys(server.addr)).await;

        let mut statuses: Vec<u16> = replies.iter().map(|r| r.status.as_u16()).collect();
        statuses.sort();
        assert_eq!(statuses, [201, 503], "{replies:?}");
        let (loser, key) = if replies[0].status == StatusCode::SERVICE_UNAVAILABLE {
            (&replies[0], "key-a")
        } else {
            (&replies[1], "key-b")
        };
        assert!(loser.header("retry-after").is_some(), "{loser:?}");
        assert_eq!(
            db.order_count().await,
            1,
            "the loser's order was rolled back"
        );
        assert!(!db.record_exists("shop-a", "create_order", key).await);

        runs_afresh(server.addr, key, BOOK).await;
        assert_eq!(db.counts().await, (2, 2));
    }

    test! { serialization_failure_at_commit_runs_the_request_again, multi_thread = 2, postgres }
    /// The same race with the layer's conflict retries: the loser runs again and commits.
    async fn serialization_failure_at_commit_runs_the_request_again() {
        let Some(db) = Postgres::create().await else {
            return;
        };
        let server =
            racing_readers(&db, |layer| layer.with_lock_timeout(Duration::from_secs(5))).await;

        let replies = send_all_at_once(two_keys(server.addr)).await;

        for reply in &replies {
            assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
            assert!(!reply.replayed());
        }
        assert_eq!(
            server.app.handler_calls(),
            3,
            "the loser's handler ran again"
        );
        assert_eq!(db.counts().await, (2, 2));
    }

    test! { serializable_duplicates_are_retried_into_replays, multi_thread = 2, postgres }
    /// SERIALIZABLE transactions and duplicates in flight: reserving a key that a concurrent
    /// transaction just committed is a serialization failure under this isolation; the store
    /// retries it, and every duplicate still gets the one response.
    async fn serializable_duplicates_are_retried_into_replays() {
        const KEYS: usize = 8;
        const DUPLICATES: usize = 4;
        let Some(db) = Postgres::create().await else {
            return;
        };
        let server = db
            .server()
            .layer(|layer| layer.with_lock_timeout(Duration::from_secs(30)))
            .hook(slow_handler(5))
            .spawn_with(|options| options.with_isolation(Isolation::Serializable))
            .await;
        let requests = interleaved(&[server.addr], KEYS, DUPLICATES);

        let replies = send_all_at_once(requests.clone()).await;

        one_order_per_key(&requests, &replies);
        assert_eq!(db.order_count().await, KEYS as i64);
        assert_eq!(server.app.handler_calls(), KEYS);
    }
}

mod sqlx_postgres {
    //! The sqlx store: the suite, two instances on one database, and a handler's serialization
    //! failure running the request again. Not here yet: the tests of `postgres` that size the
    //! store's pools or set its isolation (`spawn_with`) need the sqlx store's options in the
    //! fixture.

    concurrency_tests!(SqlxPostgres);
    parallel_writer_tests!(SqlxPostgres);
    backend_tests!(SqlxPostgres; a_handler_statement_conflict_runs_the_request_again);
}

mod mysql {
    //! The sqlx store on MySQL or MariaDB: the suite, two instances on one database, and a
    //! handler's statement failing as a deadlock victim running the request again.

    concurrency_tests!(MySql);
    parallel_writer_tests!(MySql);
    backend_tests!(MySql; a_handler_statement_conflict_runs_the_request_again);
}
