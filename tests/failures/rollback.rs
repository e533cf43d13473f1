//! Failures roll everything back: the handler's order and the record commit together or not
//! at all, and a retry with the same key runs afresh (the README's contract, "handler fails").
//! Written once and run against a SQLite file through either store (`rollback::sqlite::...`,
//! `rollback::sqlx_sqlite::...`), a PostgreSQL schema through either store
//! (`rollback::postgres::...`, `rollback::sqlx_postgres::...`, reported as ignored without
//! `TEST_DATABASE_URL`) and a MySQL/MariaDB database (`rollback::mysql::...`, ignored without
//! `TEST_MYSQL_URL`): the record or the order cannot be saved, the handler fails or panics,
//! the client goes away. Transaction control through the handle is refused (once over the sqlx
//! stores, `backend::HandleSql`, and on tokio-postgres in `postgres`). The stores on a server
//! also have their own: the connection killed mid-transaction (written once over them,
//! `backend::HandleSession`); MySQL's session restored after a request.

use support::backend;
use support::common;
use support::pg_common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use backend::{
    checking, first_call_only, hook, replays, runs_afresh, Call, Database, HandleSession,
    HandleSql, Problems,
};
use common::{post, Post, Reply, PATIENCE, SHOP_A};
use http::StatusCode;
use tokio::io::AsyncWriteExt;
use tokio::sync::Notify;
use tower_idempotency::InFlight;

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

/// The article's lab: saving the record of `key-3` fails after the handler inserted its order.
async fn injected_failure_saving_the_record_rolls_back_the_order<B: Database>(db: B) {
    let server = db.spawn().await;
    db.fail_saving_the_record_of("key-3").await;
    for key in ["key-1", "key-2"] {
        let reply = post(server.addr, Some(SHOP_A), Some(key), BOOK, &[]).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{key}: {reply:?}");
    }

    let failed = post(server.addr, Some(SHOP_A), Some("key-3"), BOOK, &[]).await;

    assert_eq!(
        failed.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{failed:?}"
    );
    assert_eq!(failed.error_code(), "internal_error");
    assert_eq!(
        server.app.handler_calls(),
        3,
        "the handler ran and inserted"
    );
    assert_eq!(db.order_count().await, 2, "key-3's order was rolled back");
    assert!(!db.record_exists("shop-a", "create_order", "key-3").await);
    assert_eq!(db.record_count().await, 2);

    db.stop_failing().await;
    let recovered = runs_afresh(server.addr, "key-3", BOOK).await;
    assert_eq!(db.order_count().await, 3);
    assert!(db.record_exists("shop-a", "create_order", "key-3").await);
    replays(server.addr, "key-3", BOOK, &recovered).await;
}

/// The handler's own insert fails: it answers 500, which is not saved.
async fn failing_order_insert_is_500_and_not_saved<B: Database>(db: B) {
    let server = db.spawn().await;
    db.fail_inserting_orders_of("book").await;

    let failed = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(
        failed.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{failed:?}"
    );
    assert_eq!(failed.error_code(), "database_error");
    assert_eq!(db.order_count().await, 0);
    assert_eq!(db.record_count().await, 0, "a 500 is never saved");

    db.stop_failing().await;
    runs_afresh(server.addr, "key-1", BOOK).await;
    assert_eq!(db.order_count().await, 1);
    assert_eq!(server.app.handler_calls(), 2);
}

async fn handler_500_after_inserting_rolls_back_its_order<B: Database>(db: B) {
    let server = db
        .server()
        .hook(hook(first_call_only(|_| async {
            Some(StatusCode::INTERNAL_SERVER_ERROR)
        })))
        .spawn()
        .await;

    let failed = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        failed.error_code(),
        "injected_failure",
        "the handler's own 500"
    );
    assert_eq!(
        db.order_count().await,
        0,
        "the inserted order was rolled back"
    );
    assert_eq!(db.record_count().await, 0);
    assert!(!db.record_exists("shop-a", "create_order", "key-1").await);

    runs_afresh(server.addr, "key-1", BOOK).await;
    assert_eq!(db.order_count().await, 1);
    assert_eq!(server.app.handler_calls(), 2);
}

async fn panicking_handler_rolls_back_and_the_server_keeps_serving<B: Database>(db: B) {
    let server = db
        .server()
        .hook(hook(first_call_only(|_| async {
            panic!("injected handler panic (expected by the test)");
        })))
        .spawn()
        .await;

    let failed = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(
        failed.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{failed:?}"
    );
    assert_eq!(failed.error_code(), "internal_error");
    assert_eq!(
        db.order_count().await,
        0,
        "the order inserted before the panic"
    );
    assert_eq!(db.record_count().await, 0);
    assert!(!db.record_exists("shop-a", "create_order", "key-1").await);

    let other = post(server.addr, Some(SHOP_A), Some("key-2"), BOOK, &[]).await;
    assert_eq!(other.status, StatusCode::CREATED, "the server still serves");
    runs_afresh(server.addr, "key-1", BOOK).await;
    assert_eq!(db.counts().await, (2, 2));
}

/// Notifies on drop: tells the test that the handler's future was dropped.
struct DropSignal(Arc<Notify>);

impl Drop for DropSignal {
    fn drop(&mut self) {
        self.0.notify_one();
    }
}

async fn client_disconnect_mid_handler_rolls_back<B: Database>(db: B) {
    let started = Arc::new(Notify::new());
    let dropped = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let server = db
        .server()
        // A transaction leaked by the disconnected request would make the retry 503 quickly.
        .layer(|layer| layer.with_lock_timeout(Duration::from_secs(2)))
        .hook({
            let (started, dropped, release) = (started.clone(), dropped.clone(), release.clone());
            hook(first_call_only(move |_| {
                let (started, dropped, release) =
                    (started.clone(), dropped.clone(), release.clone());
                async move {
                    // The order is already inserted in the open transaction.
                    let _signal = DropSignal(dropped);
                    started.notify_one();
                    release.notified().await;
                    None
                }
            }))
        })
        .spawn()
        .await;

    let mut stream = tokio::net::TcpStream::connect(server.addr)
        .await
        .expect("connect");
    let request = Post::order("key-1", BOOK).to_http1_bytes(server.addr);
    stream.write_all(&request).await.expect("write request");
    tokio::time::timeout(PATIENCE, started.notified())
        .await
        .expect("the handler started");

    drop(stream);

    tokio::time::timeout(PATIENCE, dropped.notified())
        .await
        .expect("the server dropped the handler of the client that went away");
    // Had the handler survived, letting it finish would commit its order.
    release.notify_one();
    assert_eq!(server.app.handler_calls(), 1);

    let retry = runs_afresh(server.addr, "key-1", BOOK).await;
    assert_eq!(server.app.handler_calls(), 2);
    let rows = db.orders().await;
    assert_eq!(rows.len(), 1, "only the retry's order exists: {rows:?}");
    assert_eq!(rows[0].0, retry.order_id());
    assert_eq!(db.record_count().await, 1);
}

/// The connection under the transaction is killed while the handler is inside it (its next
/// statement fails): the request is answered as the backend says ([`HandleSession`]), nothing is
/// kept, and the retry succeeds on a fresh connection.
async fn killed_connection_rolls_back_and_the_retry_succeeds<B: HandleSession>(db: B) {
    let (id_tx, id_rx) = tokio::sync::oneshot::channel::<i64>();
    let id_tx = Arc::new(Mutex::new(Some(id_tx)));
    let server = db
        .server()
        .hook(hook(first_call_only(move |call: Call| {
            let id_tx = id_tx.clone();
            async move {
                let tx = call.tx.handle::<B::Handle>().expect("the backend's handle");
                let id = B::connection_id(&tx).await.expect("the connection's id");
                if let Some(sender) = id_tx.lock().expect("id slot").take() {
                    let _ = sender.send(id);
                }
                // The test kills the connection meanwhile.
                B::sleep_then_query(&tx)
                    .await
                    .err()
                    .map(|_| StatusCode::INTERNAL_SERVER_ERROR)
            }
        })))
        .spawn()
        .await;

    let addr = server.addr;
    let first =
        tokio::spawn(async move { post(addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await });
    let id = tokio::time::timeout(PATIENCE, id_rx)
        .await
        .expect("the handler reported its connection")
        .expect("connection id");
    db.kill(id).await;
    let failed = first.await.expect("first request");

    let (status, code) = B::KILLED_CONNECTION;
    assert_eq!(failed.status, status, "{failed:?}");
    assert_eq!(failed.error_code(), code, "{failed:?}");
    if status == StatusCode::SERVICE_UNAVAILABLE {
        assert!(failed.header("retry-after").is_some(), "{failed:?}");
    }
    assert_eq!(
        db.order_count().await,
        0,
        "the killed transaction rolled back"
    );
    assert!(!db.record_exists("shop-a", "create_order", "key-1").await);

    runs_afresh(server.addr, "key-1", BOOK).await;
    assert_eq!(server.app.handler_calls(), 2);
    assert_eq!(db.counts().await, (1, 1));
}

/// Transaction control sent through the handle, whichever way the driver sends it, is refused
/// (and nothing of a refused batch runs), savepoints stay allowed, and the layer commits the
/// order with its record.
async fn transaction_control_through_the_handle_is_refused<B: HandleSql>(db: B) {
    let problems = Problems::default();
    let server = db
        .server()
        .hook(hook(checking::<B>(B::transaction_control, &problems)))
        .spawn()
        .await;
    let commit = r#"{"sku":"commit","quantity":1}"#;

    let reply = post(server.addr, Some(SHOP_A), Some("key-1"), commit, &[]).await;

    assert_eq!(
        problems.found(),
        Vec::<String>::new(),
        "every transaction-control statement is refused, and nothing else"
    );
    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    // Nothing of the refused statements ran: the one order, committed with its record.
    let skus: Vec<String> = db.orders().await.into_iter().map(|o| o.2).collect();
    assert_eq!(skus, ["commit"]);
    assert_eq!(db.record_count().await, 1);
    let again = post(server.addr, Some(SHOP_A), Some("key-1"), commit, &[]).await;
    assert!(again.replayed());
}

/// The tests above, on one backend.
macro_rules! rollback_tests {
    ($backend:ident) => {
        backend_tests!($backend;
            injected_failure_saving_the_record_rolls_back_the_order,
            failing_order_insert_is_500_and_not_saved,
            handler_500_after_inserting_rolls_back_its_order,
            panicking_handler_rolls_back_and_the_server_keeps_serving,
            client_disconnect_mid_handler_rolls_back,
        );
    };
}

/// A backend on a PostgreSQL schema of its own (either driver), for what another session
/// does to its tables.
trait OnPostgres: Database {
    fn test_db(&self) -> &pg_common::TestDb;
}

impl OnPostgres for backend::Postgres {
    fn test_db(&self) -> &pg_common::TestDb {
        &self.db
    }
}

impl OnPostgres for backend::SqlxPostgres {
    fn test_db(&self) -> &pg_common::TestDb {
        &self.db
    }
}

/// Another session's `LOCK TABLE idempotency_records IN SHARE MODE` (what a backup or a
/// migration may take), held until the sender is used or dropped, or `at_most` has passed;
/// the task ends once the lock is released.
async fn lock_the_records_table(
    db: &pg_common::TestDb,
    at_most: Duration,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let holder = db.client().await;
    holder
        .batch_execute("BEGIN; LOCK TABLE idempotency_records IN SHARE MODE")
        .await
        .expect("lock the table");
    let (release, released) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let _ = tokio::time::timeout(at_most, released).await;
        holder.batch_execute("ROLLBACK").await.expect("unlock");
    });
    (release, task)
}

/// While another session holds a lock on the records table, a new key gets `503` with
/// `Retry-After` by the lock timeout (+1 s), under `policy`: first on the store's new
/// connections (none has prepared the reservation yet: preparing it waits for the table's lock
/// too), then on a pooled one that has. Nothing is stored; the key runs once the lock goes.
async fn a_locked_table_is_503_within_the_lock_timeout<B: OnPostgres>(db: B, policy: InFlight) {
    let lock_timeout = Duration::from_secs(1);
    // A server of its own: a new store, whose pools open new connections.
    let server = db
        .with_layer(move |layer| {
            layer
                .with_lock_timeout(lock_timeout)
                .with_in_flight(policy)
                .with_retry_after(Duration::from_secs(2))
        })
        .await;
    for (round, key) in ["on-a-new-connection", "on-a-pooled-connection"]
        .into_iter()
        .enumerate()
    {
        // Held far longer than the bound: a request that waits for it is seen waiting.
        let (release, holder) = lock_the_records_table(db.test_db(), Duration::from_secs(6)).await;
        let started = std::time::Instant::now();
        let reply = post(server.addr, Some(SHOP_A), Some(key), BOOK, &[]).await;
        let waited = started.elapsed();
        let _ = release.send(());
        holder.await.expect("the lock's holder");

        assert_eq!(
            reply.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{key}: {reply:?}"
        );
        assert_eq!(reply.error_code(), "busy_retry_later", "{key}");
        assert_eq!(reply.header("retry-after"), Some("2"), "{key}: {reply:?}");
        assert!(
            waited < lock_timeout + Duration::from_secs(1),
            "{key}: answered after {waited:?}"
        );
        // Nobody else held the key: the wait was the lock timeout's, not answered at once as
        // a request of the same key in flight.
        assert!(
            waited >= lock_timeout - Duration::from_millis(100),
            "{key}: answered after {waited:?}"
        );
        let stored = round as i64;
        assert_eq!(db.counts().await, (stored, stored), "{key}: nothing stored");
        let retry = post(server.addr, Some(SHOP_A), Some(key), BOOK, &[]).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{key}: {retry:?}");
    }
    assert_eq!(server.app.handler_calls(), 2);
    assert_eq!(db.counts().await, (2, 2));
}

async fn a_table_locked_by_another_session_is_503_within_the_lock_timeout<B: OnPostgres>(db: B) {
    a_locked_table_is_503_within_the_lock_timeout(db, InFlight::Wait).await;
}

/// Under `InFlight::Reject` only a lock held by a request of the same key is "in flight":
/// another session's lock on the whole table is waited for up to the lock timeout, then `503`.
async fn under_reject_a_locked_table_is_503_not_a_request_in_flight<B: OnPostgres>(db: B) {
    a_locked_table_is_503_within_the_lock_timeout(db, InFlight::Reject).await;
}

mod sqlite {
    rollback_tests!(Sqlite);
}

mod sqlx_sqlite {
    //! The suite through the sqlx store on a SQLite file, and what its handle runs
    //! ([`HandleSql`]).

    rollback_tests!(SqlxSqlite);
    backend_tests!(SqlxSqlite;
        transaction_control_through_the_handle_is_refused,
        // Not `killed_connection_rolls_back_and_the_retry_succeeds` (`HandleSession`): a SQLite
        // file has no server whose session a test could end under the handler. Not the tests of
        // a table locked by another session: `LOCK TABLE` is PostgreSQL's.
    );
}

mod postgres {
    //! The tokio-postgres store: its connection killed under the transaction (the test written
    //! once over the stores on a server, `HandleSession`), and what only its handle has here:
    //! transaction control refused in every spelling, work refused after the request, a
    //! connection still borrowed when the handler returns.

    use std::sync::Mutex;

    use pg_common::{hook as pg_hook, HookOutcome, OrderCall, PgServer, TestDb};
    use tower_idempotency::store::tokio_postgres::PostgresHandle;
    use tower_idempotency::store::ReplayCheck;
    use tower_idempotency::Error;

    use super::*;

    rollback_tests!(Postgres);
    backend_tests!(Postgres;
        a_table_locked_by_another_session_is_503_within_the_lock_timeout,
        under_reject_a_locked_table_is_503_not_a_request_in_flight,
    );
    // The database went away under the handler (`pg_terminate_backend`), as in a failover: a
    // `503` with `Retry-After`, not a final failure.
    backend_tests!(Postgres;
        connection_killed_mid_transaction_rolls_back_and_the_retry_succeeds =
            killed_connection_rolls_back_and_the_retry_succeeds,
    );

    /// A server on `db` whose order handler runs `hook` with a slot of the test's (what the hook
    /// saw, for the test to read after the request), and that slot.
    async fn spawn_keeping<T, Fut>(
        db: &TestDb,
        hook: impl Fn(Arc<Mutex<T>>, OrderCall) -> Fut + Send + Sync + 'static,
    ) -> (PgServer, Arc<Mutex<T>>)
    where
        T: Default + Send + 'static,
        Fut: std::future::Future<Output = HookOutcome> + Send + 'static,
    {
        let slot: Arc<Mutex<T>> = Arc::default();
        let server = PgServer::builder()
            .hook({
                let slot = slot.clone();
                pg_hook(move |call| hook(slot.clone(), call))
            })
            .spawn(db)
            .await;
        (server, slot)
    }

    /// The only order is `reply`'s book, committed with its record, and `key-1` replays it.
    async fn assert_the_one_order_is(db: &TestDb, addr: std::net::SocketAddr, reply: &Reply) {
        let orders = db.orders().await;
        assert_eq!(orders.len(), 1, "exactly one order: {orders:?}");
        assert_eq!(orders[0].0, reply.order_id());
        assert_eq!(orders[0].2, "book");
        assert_eq!(db.record_count().await, 1);
        replays(addr, "key-1", BOOK, reply).await;
        assert_eq!(db.order_count().await, 1);
    }

    test! { transaction_control_through_the_handle_is_refused_and_the_transaction_goes_on, postgres }
    /// Transaction control that a handler sends through its handle, in any spelling and through
    /// any method, is refused before it reaches the server: nothing of the refused SQL runs (not
    /// even the statements of a batch before it), the transaction goes on, and the layer commits
    /// the order with its record. Savepoints stay allowed.
    async fn transaction_control_through_the_handle_is_refused_and_the_transaction_goes_on() {
        let Some(db) = TestDb::create().await else {
            return;
        };
        let (server, problems) = spawn_keeping(&db, |problems: Arc<Mutex<Vec<String>>>, call| {
            async move {
                let mut found = Vec::new();
                let client = call.tx.client().await.expect("client");
                let refused = |what: String, outcome: Result<(), Error>| match outcome {
                    Err(Error::TransactionControl(_)) => None,
                    other => Some(format!("{what}: not refused: {other:?}")),
                };
                for sql in [
                    "COMMIT; BEGIN",
                    "commit",
                    "END",
                    "ROLLBACK",
                    "ROLLBACK AND CHAIN",
                    "ABORT",
                    "BEGIN",
                    "START TRANSACTION",
                    "/* the layer commits */ COMMIT",
                    "-- a comment\nEND",
                    "SELECT 1; COMMIT",
                    "PREPARE TRANSACTION 'gid'",
                    "COMMIT PREPARED 'gid'",
                    "ROLLBACK PREPARED 'gid'",
                ] {
                    found.extend(refused(
                        format!("batch_execute({sql:?})"),
                        client.batch_execute(sql).await,
                    ));
                    found.extend(refused(
                        format!("simple_query({sql:?})"),
                        client.simple_query(sql).await.map(drop),
                    ));
                    found.extend(refused(
                        format!("execute({sql:?})"),
                        client.execute(sql, &[]).await.map(drop),
                    ));
                    found.extend(refused(
                        format!("query({sql:?})"),
                        client.query(sql, &[]).await.map(drop),
                    ));
                    found.extend(refused(
                        format!("prepare({sql:?})"),
                        client.prepare(sql).await.map(drop),
                    ));
                }
                // A refused batch runs none of its statements, not even the first.
                found.extend(refused(
                    "an insert then COMMIT".to_owned(),
                    client
                        .batch_execute(
                            "INSERT INTO orders (tenant_id, sku, quantity) \
                                     VALUES ('shop-a', 'before-commit', 1); COMMIT",
                        )
                        .await,
                ));
                // The transaction is still the layer's, and savepoints work inside it;
                // a COMMIT inside a string or a dollar quote is only text.
                if let Err(error) = client
                    .batch_execute(
                        "SAVEPOINT undo; \
                                 INSERT INTO orders (tenant_id, sku, quantity) \
                                 VALUES ('shop-a', 'undone', 1); \
                                 ROLLBACK TO SAVEPOINT undo; RELEASE undo; \
                                 SELECT 'COMMIT; BEGIN', $$ROLLBACK$$",
                    )
                    .await
                {
                    found.push(format!("savepoints: {error}"));
                }
                problems.lock().expect("problems").extend(found);
                HookOutcome::default()
            }
        })
        .await;

        let reply = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

        assert_eq!(
            *problems.lock().expect("problems"),
            Vec::<String>::new(),
            "every transaction-control statement is refused, and nothing else"
        );
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        assert_the_one_order_is(&db, server.addr, &reply).await;
    }

    test! { commit_then_begin_in_a_handler_leaves_no_order_without_a_record, postgres }
    /// `COMMIT; BEGIN` through the handle would commit the order with no record behind the
    /// layer's back, and the retry would create a second one. It is refused instead: the handler
    /// answers 500 on the error, its order rolls back with the transaction, and the retry with the
    /// same key ends with exactly one order.
    async fn commit_then_begin_in_a_handler_leaves_no_order_without_a_record() {
        let Some(db) = TestDb::create().await else {
            return;
        };
        let refusal: Arc<Mutex<Option<String>>> = Arc::default();
        let server = PgServer::builder()
            .hook({
                let refusal = refusal.clone();
                pg_hook(first_call_only(move |call: OrderCall| {
                    let refusal = refusal.clone();
                    async move {
                        let client = call.tx.client().await.expect("client");
                        match client.batch_execute("COMMIT; BEGIN").await {
                            Ok(()) => HookOutcome::default(),
                            Err(error) => {
                                *refusal.lock().expect("refusal") = Some(error.to_string());
                                HookOutcome {
                                    fail_with: Some(StatusCode::INTERNAL_SERVER_ERROR),
                                }
                            }
                        }
                    }
                }))
            })
            .spawn(&db)
            .await;

        let failed = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

        assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            failed.error_code(),
            "injected_failure",
            "the handler's own 500"
        );
        let refusal = refusal.lock().expect("refusal").clone();
        let refusal = refusal.expect("the handler got an error");
        assert!(
            refusal.contains("COMMIT refused") && refusal.contains("the layer commits"),
            "a clear refusal: {refusal}"
        );
        assert_eq!(db.order_count().await, 0, "no order without a record");
        assert!(!db.record_exists("shop-a", "create_order", "key-1").await);

        let retry = runs_afresh(server.addr, "key-1", BOOK).await;
        assert_the_one_order_is(&db, server.addr, &retry).await;
    }

    test! { handle_refuses_work_after_the_request, postgres }
    /// After the request, the handle refuses work: it cannot write outside the transaction.
    async fn handle_refuses_work_after_the_request() {
        let Some(db) = TestDb::create().await else {
            return;
        };
        let (server, kept) =
            spawn_keeping(&db, |kept: Arc<Mutex<Option<PostgresHandle>>>, call| {
                *kept.lock().expect("slot") = Some(call.tx);
                async { HookOutcome::default() }
            })
            .await;

        let reply = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
        assert_eq!(reply.status, StatusCode::CREATED);

        let tx = kept
            .lock()
            .expect("slot")
            .take()
            .expect("the hook kept the handle");
        assert!(tx.is_finished());
        assert!(matches!(tx.client().await, Err(Error::TransactionFinished)));
    }

    test! { connection_still_borrowed_after_the_handler_is_not_committed, postgres }
    /// A task that outlives its request while still borrowing the connection: the layer refuses
    /// to commit under it (500), and the transaction rolls back once the task lets go.
    async fn connection_still_borrowed_after_the_handler_is_not_committed() {
        let Some(db) = TestDb::create().await else {
            return;
        };
        let server = PgServer::builder()
            .layer(|layer| layer.with_lock_timeout(Duration::from_secs(5)))
            .hook(pg_hook(first_call_only(|call: OrderCall| async move {
                let client = call.tx.client().await.expect("client");
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    drop(client);
                });
                HookOutcome::default()
            })))
            .spawn(&db)
            .await;

        let failed = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

        assert_eq!(
            failed.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "{failed:?}"
        );
        // The retry waits on the key until the borrowed transaction is gone, then runs afresh.
        runs_afresh(server.addr, "key-1", BOOK).await;
        assert_eq!(db.counts().await, (1, 1));
    }

    test! { a_server_that_stops_answering_is_503_within_the_lock_timeout, postgres }
    /// A primary that stops answering without a reset (a proxy between the store and the
    /// server that stops forwarding): no request is held; the store's own statements are
    /// bounded by the lock timeout and a margin, then `503` with `Retry-After`.
    async fn a_server_that_stops_answering_is_503_within_the_lock_timeout() {
        a_server_that_stops_answering_under(ReplayCheck::Adaptive).await;
    }

    test! { with_reads_first_a_server_that_stops_answering_is_503_within_the_lock_timeout, postgres }
    /// The same when every first attempt reads before its transaction: the read's wait
    /// (`read_wait`, 1 s by default) comes out of the lock timeout, not on top of it.
    async fn with_reads_first_a_server_that_stops_answering_is_503_within_the_lock_timeout() {
        a_server_that_stops_answering_under(ReplayCheck::FavorReplays).await;
    }

    async fn a_server_that_stops_answering_under(replay_check: ReplayCheck) {
        let Some(db) = TestDb::create().await else {
            return;
        };
        let proxy = Arc::new(pg_common::FreezingProxy::to(&db).await);
        let store =
            tower_idempotency::store::tokio_postgres::PostgresStore::builder(proxy.config(&db))
                .with_max_connections(4)
                .with_max_read_connections(2)
                .with_replay_check(replay_check)
                .build()
                .await
                .expect("open the store through the proxy");
        let freezer = proxy.clone();
        let server = PgServer::builder()
            .layer(one_second_lock_timeout)
            .hook(pg_hook(move |call: OrderCall| {
                let freezer = freezer.clone();
                async move {
                    if call.sku == "freeze" {
                        freezer.freeze();
                    }
                    HookOutcome::default()
                }
            }))
            .serve_on(store)
            .await;
        check_a_server_that_stops_answering(server.addr).await;
    }

    test! { a_lock_held_on_the_handlers_table_is_503_within_the_lock_timeout, postgres }
    /// A lock another session holds on the handler's own table (the whole table, or the row
    /// the handler inserts): the handler's statement waits up to the lock timeout and fails
    /// (`55P03`), the handler answers its own `500`, and the layer answers `503` with
    /// `Retry-After` instead, nothing stored; the retry after the lock goes commits once.
    async fn a_lock_held_on_the_handlers_table_is_503_within_the_lock_timeout() {
        let Some(db) = TestDb::create().await else {
            return;
        };
        db.execute("CREATE TABLE handler_ledger (id BIGINT PRIMARY KEY)")
            .await;
        let server = PgServer::builder()
            .layer(one_second_lock_timeout)
            .hook(pg_hook(|call: OrderCall| async move {
                let written = match call.tx.client().await {
                    Ok(client) => client
                        .execute("INSERT INTO handler_ledger (id) VALUES (1)", &[])
                        .await
                        .map(drop)
                        .map_err(|error| error.to_string()),
                    Err(error) => Err(error.to_string()),
                };
                HookOutcome {
                    fail_with: written.err().map(|_| StatusCode::INTERNAL_SERVER_ERROR),
                }
            }))
            .spawn(&db)
            .await;
        for (i, lock) in [
            "LOCK TABLE handler_ledger IN ACCESS EXCLUSIVE MODE",
            "INSERT INTO handler_ledger (id) VALUES (1)",
        ]
        .into_iter()
        .enumerate()
        {
            let holder = db.client().await;
            holder
                .batch_execute(&format!("BEGIN; {lock}"))
                .await
                .expect("lock");
            let key = format!("held-{i}");
            let started = std::time::Instant::now();
            let reply = post(server.addr, Some(SHOP_A), Some(&key), BOOK, &[]).await;
            let waited = started.elapsed();
            assert_eq!(
                reply.status,
                StatusCode::SERVICE_UNAVAILABLE,
                "{lock}: {reply:?}"
            );
            assert_eq!(reply.error_code(), "busy_retry_later", "{lock}");
            assert!(reply.header("retry-after").is_some(), "{lock}: {reply:?}");
            assert!(
                waited < Duration::from_secs(2),
                "{lock}: answered after {waited:?}"
            );
            holder.batch_execute("ROLLBACK").await.expect("unlock");
            drop(holder);
            assert_eq!(db.counts().await, (0, 0), "{lock}: nothing stored");
            let retry = post(server.addr, Some(SHOP_A), Some(&key), BOOK, &[]).await;
            assert_eq!(retry.status, StatusCode::CREATED, "{lock}: {retry:?}");
            assert_eq!(db.counts().await, (1, 1), "{lock}");
            db.execute("DELETE FROM handler_ledger").await;
            db.execute("DELETE FROM orders").await;
            db.execute("DELETE FROM idempotency_records").await;
        }
    }

    test! { a_handler_statement_the_server_stops_answering_is_503_within_the_lock_timeout, postgres }
    /// A server that stops answering while the handler's own statement is in flight, or
    /// while the layer rolls back after the handler: the request is answered within the lock
    /// timeout and 1 s, and the connection is closed, not pooled.
    async fn a_handler_statement_the_server_stops_answering_is_503_within_the_lock_timeout() {
        // A schema each: the first leaves a transaction open on the server, which the second
        // store's migration would wait for.
        for sku in ["stall", "stall-then-422"] {
            let Some(db) = TestDb::create().await else {
                return;
            };
            let proxy = Arc::new(pg_common::FreezingProxy::to(&db).await);
            let store =
                tower_idempotency::store::tokio_postgres::PostgresStore::builder(proxy.config(&db))
                    .with_max_connections(4)
                    .with_max_read_connections(2)
                    .build()
                    .await
                    .expect("open the store through the proxy");
            let pool = store.pool().clone();
            let freezer = proxy.clone();
            let server = PgServer::builder()
                .layer(one_second_lock_timeout)
                .hook(pg_hook(move |call: OrderCall| {
                    let freezer = freezer.clone();
                    async move { stall_in_the_handler(&freezer, &call.sku, &call.tx).await }
                }))
                .serve_on(store)
                .await;
            check_a_handler_the_server_stops_answering(server.addr, &db, sku, || {
                pool.status().size
            })
            .await;
        }
    }
}

/// Sends one request, failing the test if it is not answered within `at_most`.
async fn answered_within(
    addr: std::net::SocketAddr,
    key: &str,
    body: &str,
    at_most: Duration,
) -> Reply {
    tokio::time::timeout(at_most, post(addr, Some(SHOP_A), Some(key), body, &[]))
        .await
        .unwrap_or_else(|_| panic!("{key}: held for {at_most:?} without an answer"))
}

/// Checks, on a server whose store reaches the database through `proxy` with a lock timeout of
/// 1 s, that once the server stops answering (frozen under the handler of the sku `freeze`) a
/// commit and then a new key are each answered `503` with `Retry-After` within the lock
/// timeout and 1 s, and that neither request is held.
async fn check_a_server_that_stops_answering(addr: std::net::SocketAddr) {
    let lock_timeout = Duration::from_secs(1);
    let warm_up = post(addr, Some(SHOP_A), Some("before"), BOOK, &[]).await;
    assert_eq!(warm_up.status, StatusCode::CREATED, "{warm_up:?}");
    for (key, body) in [
        // The handler freezes the proxy: its commit gets no answer.
        ("frozen-at-commit", r#"{"sku":"freeze","quantity":1}"#),
        // A new key while nothing answers: the reservation on a pooled connection.
        ("while-frozen", BOOK),
    ] {
        let started = std::time::Instant::now();
        let reply = answered_within(addr, key, body, Duration::from_secs(10)).await;
        let waited = started.elapsed();
        assert_eq!(
            reply.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{key}: {reply:?}"
        );
        assert_eq!(reply.header("retry-after"), Some("2"), "{key}: {reply:?}");
        assert!(
            waited < lock_timeout + Duration::from_secs(1),
            "{key}: answered after {waited:?}"
        );
    }
}

/// What the handler of [`check_a_handler_the_server_stops_answering`] does for `sku`: for
/// `stall`, freezes the proxy, then inserts a second order of its own (the statement in
/// flight when the server stops answering), answering `500` if that fails; for
/// `stall-then-422`, freezes it and answers `422` (not saved: the layer rolls back).
async fn stall_in_the_handler<T: common::InsertOrder>(
    freezer: &pg_common::FreezingProxy,
    sku: &str,
    tx: &T,
) -> pg_common::HookOutcome {
    let fail_with = match sku {
        "stall" => {
            freezer.freeze();
            let tenant = tower_idempotency::Tenant::new("shop-a");
            match tx.insert_order(&tenant, "second", 1).await {
                Ok(_) => None,
                Err(_) => Some(StatusCode::INTERNAL_SERVER_ERROR),
            }
        }
        "stall-then-422" => {
            freezer.freeze();
            Some(StatusCode::UNPROCESSABLE_ENTITY)
        }
        _ => None,
    };
    pg_common::HookOutcome { fail_with }
}

/// Checks, on a server whose store reaches `db` through a proxy with a lock timeout of 1 s and
/// whose handler is [`stall_in_the_handler`], that a request of `sku` is answered within the
/// lock timeout and 1 s once the server stops answering under its handler: `503` with
/// `Retry-After` when the handler's own statement got no answer, the handler's `422` when
/// only the rollback after it got none; that nothing of it is stored; and that its
/// connection is not returned to the pool (`connections`: how many the pool of request
/// transactions holds).
async fn check_a_handler_the_server_stops_answering(
    addr: std::net::SocketAddr,
    db: &pg_common::TestDb,
    sku: &str,
    connections: impl Fn() -> usize,
) {
    let lock_timeout = Duration::from_secs(1);
    let warm_up = post(addr, Some(SHOP_A), Some("before"), BOOK, &[]).await;
    assert_eq!(warm_up.status, StatusCode::CREATED, "{warm_up:?}");
    // The warm-up's connection back in the pool (sqlx returns it in a task of its own): the
    // next request takes it rather than opening another.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let pooled = connections();
    let started = std::time::Instant::now();
    let body = format!(r#"{{"sku":"{sku}","quantity":1}}"#);
    let reply = answered_within(addr, sku, &body, Duration::from_secs(10)).await;
    let waited = started.elapsed();
    if sku == "stall" {
        assert_eq!(
            reply.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{sku}: {reply:?}"
        );
        assert_eq!(reply.header("retry-after"), Some("2"), "{sku}: {reply:?}");
    } else {
        assert_eq!(
            reply.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{sku}: {reply:?}"
        );
    }
    assert!(
        waited < lock_timeout + Duration::from_secs(1),
        "{sku}: answered after {waited:?}"
    );
    assert_eq!(db.order_count().await, 1, "{sku}: only the warm-up's order");
    assert!(!db.record_exists("shop-a", "create_order", sku).await);
    assert_eq!(
        connections(),
        pooled - 1,
        "{sku}: the connection that got no answer is not returned to the pool"
    );
}

/// The layer of [`check_a_server_that_stops_answering`].
fn one_second_lock_timeout<S: tower_idempotency::store::IdempotencyStore>(
    layer: tower_idempotency::IdempotencyLayer<S>,
) -> tower_idempotency::IdempotencyLayer<S> {
    layer
        .with_lock_timeout(Duration::from_secs(1))
        .with_retry_after(Duration::from_secs(2))
}

mod sqlx_postgres {
    //! The suite through the sqlx store, and what its handle runs ([`HandleSql`]). Not yet on
    //! sqlx: the handle refusing work after the request, and a connection still borrowed when
    //! the handler returns.

    rollback_tests!(SqlxPostgres);
    backend_tests!(SqlxPostgres;
        a_table_locked_by_another_session_is_503_within_the_lock_timeout,
        under_reject_a_locked_table_is_503_not_a_request_in_flight,
        a_terminated_backend_rolls_back_and_the_retry_succeeds =
            killed_connection_rolls_back_and_the_retry_succeeds,
        transaction_control_through_the_handle_is_refused,
    );

    test! { a_server_that_stops_answering_is_503_within_the_lock_timeout, postgres }
    /// A primary that stops answering without a reset, as in `postgres`, on the sqlx store.
    async fn a_server_that_stops_answering_is_503_within_the_lock_timeout() {
        use super::*;
        use common::{hook_for, AppBuilder};
        use pg_common::sqlx_app::{SqlxOrderCall, SqlxPgApp};
        use pg_common::{FreezingProxy, HookOutcome, TestDb};
        use tower_idempotency::store::sqlx_postgres::SqlxPostgresStore;

        let Some(db) = TestDb::create().await else {
            return;
        };
        let proxy = Arc::new(FreezingProxy::to(&db).await);
        let pool = db.sqlx_pool_via(4, proxy.addr.port()).await;
        let store = SqlxPostgresStore::builder(pool)
            .with_max_read_connections(2)
            .build();
        store.migrate().await.expect("create the table");
        let freezer = proxy.clone();
        let server = AppBuilder::new(SqlxPgApp)
            .layer(one_second_lock_timeout)
            .hook(hook_for(move |call: SqlxOrderCall| {
                let freezer = freezer.clone();
                async move {
                    if call.sku == "freeze" {
                        freezer.freeze();
                    }
                    HookOutcome::default()
                }
            }))
            .serve_on(store)
            .await;
        check_a_server_that_stops_answering(server.addr).await;
    }

    test! { a_handler_statement_the_server_stops_answering_is_503_within_the_lock_timeout, postgres }
    /// A server that stops answering under the handler, as in `postgres`, on the sqlx store.
    async fn a_handler_statement_the_server_stops_answering_is_503_within_the_lock_timeout() {
        use super::*;
        use common::{hook_for, AppBuilder};
        use pg_common::sqlx_app::{SqlxOrderCall, SqlxPgApp};
        use pg_common::{FreezingProxy, TestDb};
        use tower_idempotency::store::sqlx_postgres::SqlxPostgresStore;

        // A schema each: the first leaves a transaction open on the server, which the second
        // store's migration would wait for.
        for sku in ["stall", "stall-then-422"] {
            let Some(db) = TestDb::create().await else {
                return;
            };
            let proxy = Arc::new(FreezingProxy::to(&db).await);
            let pool = db.sqlx_pool_via(4, proxy.addr.port()).await;
            let store = SqlxPostgresStore::builder(pool.clone())
                .with_max_read_connections(2)
                .build();
            store.migrate().await.expect("create the table");
            let freezer = proxy.clone();
            let server = AppBuilder::new(SqlxPgApp)
                .layer(one_second_lock_timeout)
                .hook(hook_for(move |call: SqlxOrderCall| {
                    let freezer = freezer.clone();
                    async move { stall_in_the_handler(&freezer, &call.sku, &call.tx).await }
                }))
                .serve_on(store)
                .await;
            check_a_handler_the_server_stops_answering(server.addr, &db, sku, || {
                pool.size() as usize
            })
            .await;
        }
    }
}

mod mysql {
    //! The suite on a MySQL or MariaDB database of its own (the sqlx store), what its handle
    //! runs ([`HandleSql`]), and the session of the pooled connection, restored after a
    //! request.

    use backend::MySql;
    use common::{hook_for, AppBuilder, HookOutcome, OrderCallOf, Outcome};
    use tower_idempotency::store::sqlx_mysql::SqlxMySqlHandle;
    use tower_idempotency::InFlight;

    use super::*;

    rollback_tests!(MySql);
    backend_tests!(MySql;
        a_killed_connection_rolls_back_and_the_retry_succeeds =
            killed_connection_rolls_back_and_the_retry_succeeds,
        transaction_control_through_the_handle_is_refused,
    );

    test! { the_session_is_restored_after_a_request, mysql }
    /// The connection goes back to the application's pool as it came: `autocommit` on and the
    /// server's lock wait timeout, whatever the request set.
    async fn the_session_is_restored_after_a_request() {
        let Some(db) = MySql::create().await else {
            return;
        };
        // One connection: the request's and the check's are the same.
        let store = db.db.store(1).await;
        let pool = store.pool().clone();
        let server = AppBuilder::new(())
            .hook(hook_for(|call: OrderCallOf<SqlxMySqlHandle>| async move {
                HookOutcome::failing(
                    (call.sku == "fail").then_some(StatusCode::INTERNAL_SERVER_ERROR),
                )
            }))
            .serve_on(store)
            .await;
        let settings = || async {
            sqlx::query_as::<_, (i64, i64)>(
                "SELECT @@autocommit, CAST(@@innodb_lock_wait_timeout AS SIGNED)",
            )
            .fetch_one(&pool)
            .await
            .expect("session settings")
        };
        let before = settings().await;
        for (key, sku) in [("order-1", "book"), ("order-2", "fail")] {
            let body = format!(r#"{{"sku":"{sku}","quantity":1}}"#);
            post(server.addr, Some(SHOP_A), Some(key), &body, &[]).await;
            assert_eq!(settings().await, before, "after {sku}");
        }
        assert_eq!(db.counts().await, (1, 1));
    }

    test! { a_table_locked_by_another_session_is_503_within_the_lock_timeout, mysql }
    /// Another session's `LOCK TABLES ... WRITE` on the records table holds a metadata lock,
    /// whose wait follows `lock_wait_timeout` (a year by default), not the row-lock timeout: a
    /// new key gets `503` + `Retry-After` soon after the lock timeout (MySQL counts whole
    /// seconds), nothing stored, and runs once the lock goes.
    async fn a_table_locked_by_another_session_is_503_within_the_lock_timeout() {
        let Some(db) = MySql::create().await else {
            return;
        };
        let lock_timeout = Duration::from_secs(1);
        let store = db.db.store(4).await;
        let server = AppBuilder::new(())
            .layer(move |layer| layer.with_lock_timeout(lock_timeout))
            .hook(hook_for(|_: OrderCallOf<SqlxMySqlHandle>| async {
                HookOutcome::default()
            }))
            .serve_on(store)
            .await;
        for (i, table) in ["idempotency_records"].into_iter().enumerate() {
            let mut holder = db.db.connection().await;
            sqlx::query(sqlx::AssertSqlSafe(format!("LOCK TABLES {table} WRITE")))
                .execute(&mut holder)
                .await
                .expect("lock");
            let key = format!("locked-{i}");
            let started = std::time::Instant::now();
            let reply = post(server.addr, Some(SHOP_A), Some(&key), BOOK, &[]).await;
            let waited = started.elapsed();
            assert_eq!(
                reply.status,
                StatusCode::SERVICE_UNAVAILABLE,
                "{table}: {reply:?}"
            );
            assert!(reply.header("retry-after").is_some(), "{table}: {reply:?}");
            // MySQL counts the wait in whole seconds; measured on MariaDB 10.11: the lock
            // timeout plus about one second (2.01 s for 1 s).
            assert!(
                waited < lock_timeout + Duration::from_millis(1500),
                "{table}: answered after {waited:?}"
            );
            sqlx::query("UNLOCK TABLES")
                .execute(&mut holder)
                .await
                .expect("unlock");
            drop(holder);
            assert_eq!(
                db.counts().await,
                (i as i64, i as i64),
                "{table}: nothing stored"
            );
            let retry = post(server.addr, Some(SHOP_A), Some(&key), BOOK, &[]).await;
            assert_eq!(retry.status, StatusCode::CREATED, "{table}: {retry:?}");
        }
    }
    test! { a_lock_held_on_the_handlers_table_is_503_within_the_lock_timeout, mysql }
    /// The handler's own statements wait no longer than the store's: while another session
    /// holds a lock the handler's insert (through the request's handle) needs, a metadata
    /// lock (`LOCK TABLES ... WRITE`) or a row lock (an uncommitted row with the same primary
    /// key), the insert fails with `1205` after the lock timeout, and although the handler
    /// answers its own `500`, the layer answers `503` + `Retry-After` and rolls back: no
    /// order, no record; once the lock goes, the same key runs.
    async fn a_lock_held_on_the_handlers_table_is_503_within_the_lock_timeout() {
        let Some(db) = MySql::create().await else {
            return;
        };
        db.db
            .execute("CREATE TABLE handler_ledger (id BIGINT NOT NULL PRIMARY KEY) ENGINE = InnoDB")
            .await;
        let lock_timeout = Duration::from_secs(1);
        let store = db.db.store(4).await;
        let server = AppBuilder::new(())
            .layer(move |layer| layer.with_lock_timeout(lock_timeout))
            .hook(hook_for(|call: OrderCallOf<SqlxMySqlHandle>| async move {
                let written = match call.tx.acquire().await {
                    Ok(mut conn) => sqlx::query("INSERT INTO handler_ledger (id) VALUES (1)")
                        .execute(&mut *conn)
                        .await
                        .map(drop)
                        .map_err(|error| error.to_string()),
                    Err(error) => Err(error.to_string()),
                };
                HookOutcome::failing(written.err().map(|_| StatusCode::INTERNAL_SERVER_ERROR))
            }))
            .serve_on(store)
            .await;
        let ledger = || db.db.count("SELECT count(*) FROM handler_ledger");
        for (i, (lock, unlock)) in [
            ("LOCK TABLES handler_ledger WRITE", "UNLOCK TABLES"),
            (
                "BEGIN; INSERT INTO handler_ledger (id) VALUES (1)",
                "ROLLBACK",
            ),
        ]
        .into_iter()
        .enumerate()
        {
            let mut holder = db.db.connection().await;
            sqlx::raw_sql(lock)
                .execute(&mut holder)
                .await
                .expect("lock");
            let key = format!("held-{i}");
            let started = std::time::Instant::now();
            let reply = post(server.addr, Some(SHOP_A), Some(&key), BOOK, &[]).await;
            let waited = started.elapsed();
            assert_eq!(
                reply.status,
                StatusCode::SERVICE_UNAVAILABLE,
                "{lock}: {reply:?}"
            );
            assert_eq!(reply.error_code(), "busy_retry_later", "{lock}");
            assert!(reply.header("retry-after").is_some(), "{lock}: {reply:?}");
            // MySQL counts the wait in whole seconds: the lock timeout plus about one second.
            assert!(
                waited < lock_timeout + Duration::from_millis(1500),
                "{lock}: answered after {waited:?}"
            );
            sqlx::raw_sql(unlock)
                .execute(&mut holder)
                .await
                .expect("unlock");
            drop(holder);
            assert_eq!(db.counts().await, (0, 0), "{lock}: nothing stored");
            let retry = post(server.addr, Some(SHOP_A), Some(&key), BOOK, &[]).await;
            assert_eq!(retry.status, StatusCode::CREATED, "{lock}: {retry:?}");
            assert_eq!(db.counts().await, (1, 1), "{lock}");
            assert_eq!(ledger().await, 1, "{lock}");
            // The next round's insert of the same id must wait on the holder alone.
            db.db.execute("DELETE FROM handler_ledger").await;
            db.db.execute("DELETE FROM orders").await;
            db.db.execute("DELETE FROM idempotency_records").await;
        }
    }

    test! { a_locked_records_table_is_503_not_in_flight_under_reject, mysql }
    /// Under the in-flight policies that answer `409` (`Reject`, `WaitUpTo`), a brand-new key
    /// while another session holds `LOCK TABLES idempotency_records WRITE` is not "in flight":
    /// nothing of its key is held by a request. It gets `503` + `Retry-After` once the lock
    /// timeout has passed (not `409` at once, as when every `1205` of the reservation was read
    /// as the key's row), nothing stored, and runs once the lock goes.
    async fn a_locked_records_table_is_503_not_in_flight_under_reject() {
        let Some(db) = MySql::create().await else {
            return;
        };
        let lock_timeout = Duration::from_secs(1);
        for (i, policy) in [
            InFlight::Reject,
            InFlight::WaitUpTo(Duration::from_millis(200)),
        ]
        .into_iter()
        .enumerate()
        {
            let store = db.db.store(4).await;
            let server = AppBuilder::new(())
                .layer(move |layer| layer.with_lock_timeout(lock_timeout).with_in_flight(policy))
                .hook(hook_for(|_: OrderCallOf<SqlxMySqlHandle>| async {
                    HookOutcome::default()
                }))
                .serve_on(store)
                .await;
            let mut holder = db.db.connection().await;
            sqlx::query("LOCK TABLES idempotency_records WRITE")
                .execute(&mut holder)
                .await
                .expect("lock");
            let key = format!("new-{i}");
            let started = std::time::Instant::now();
            let reply = post(server.addr, Some(SHOP_A), Some(&key), BOOK, &[]).await;
            let waited = started.elapsed();
            assert_eq!(
                reply.status,
                StatusCode::SERVICE_UNAVAILABLE,
                "{policy:?}: {reply:?}"
            );
            assert_eq!(reply.error_code(), "busy_retry_later", "{policy:?}");
            assert!(reply.header("retry-after").is_some(), "{policy:?}");
            assert!(
                waited >= lock_timeout - Duration::from_millis(50)
                    && waited < lock_timeout + Duration::from_millis(1500),
                "{policy:?}: answered after {waited:?}"
            );
            sqlx::query("UNLOCK TABLES")
                .execute(&mut holder)
                .await
                .expect("unlock");
            drop(holder);
            assert_eq!(db.counts().await, (i as i64, i as i64), "{policy:?}");
            let retry = post(server.addr, Some(SHOP_A), Some(&key), BOOK, &[]).await;
            assert_eq!(retry.status, StatusCode::CREATED, "{policy:?}: {retry:?}");
        }
    }
}
