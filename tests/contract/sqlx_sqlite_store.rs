//! The sqlx SQLite store through its public API, each test on a SQLite file of its own: the
//! reservation is the file's write lock (another key waits for it, bounded by the lock
//! timeout; a duplicate waits and then replays), the connection goes back to the pool with
//! sqlx's default busy timeout, the handle refuses transaction control, a transaction whose
//! marking savepoint is gone saves nothing, and `migrate` leaves the file in WAL mode.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::StatusCode;
use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::key::IdempotencyKey;
use tower_idempotency::response::SavedResponse;
use tower_idempotency::store::sqlx_sqlite::{sqlx, SqlxSqliteStore};
use tower_idempotency::store::{Begin, IdempotencyStore, NewRecord, Reservation, Scope};
use tower_idempotency::Error;

use support::sqlx_sqlite_common::TestDb;

/// `key` of the tenant `shop` on the operation `create_order`.
fn scope(key: &str) -> Scope {
    let key = IdempotencyKey::parse(key.as_bytes(), 128).expect("key");
    Scope::new("shop", "create_order", key)
}

/// A `201` with the body `{}`, saved now for an hour.
fn record() -> NewRecord {
    let now = SystemTime::now();
    let response = SavedResponse::new(StatusCode::CREATED, Vec::new(), Bytes::from_static(b"{}"));
    NewRecord::new(
        Fingerprint::new(2, [7; 32]),
        response,
        now,
        now + Duration::from_secs(3600),
    )
}

/// `begin` of `key`, which must reserve it.
async fn reserve(
    store: &SqlxSqliteStore,
    key: &str,
    lock_timeout: Duration,
) -> <SqlxSqliteStore as IdempotencyStore>::Reservation {
    match store
        .begin(&scope(key), lock_timeout, SystemTime::now())
        .await
        .expect("begin")
    {
        Begin::Reserved(reservation) => reservation,
        Begin::Existing(_) => panic!("{key} has a record"),
    }
}

test! { another_key_waits_for_the_write_lock_up_to_the_lock_timeout }
async fn another_key_waits_for_the_write_lock_up_to_the_lock_timeout() {
    let db = TestDb::create().await.expect("db");
    let store = db.store(4).await;
    let first = reserve(&store, "a", Duration::from_secs(5)).await;
    let started = tokio::time::Instant::now();
    let other = store
        .begin(&scope("b"), Duration::from_millis(300), SystemTime::now())
        .await;
    let waited = started.elapsed();
    let Err(error) = other else {
        panic!("the write lock is held: another key cannot begin");
    };
    assert!(error.is_busy(), "{error}");
    assert!(waited >= Duration::from_millis(250), "waited {waited:?}");
    assert!(waited < Duration::from_secs(3), "waited {waited:?}");
    first.commit(record()).await.expect("commit");
    let second = reserve(&store, "b", Duration::from_secs(5)).await;
    second.rollback().await.expect("rollback");
}

test! { a_duplicate_waits_for_the_first_and_replays_its_record }
async fn a_duplicate_waits_for_the_first_and_replays_its_record() {
    let db = TestDb::create().await.expect("db");
    let store = db.store(4).await;
    let first = reserve(&store, "a", Duration::from_secs(5)).await;
    let waiter = {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .begin(&scope("a"), Duration::from_secs(10), SystemTime::now())
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiter.is_finished(), "the duplicate did not wait");
    first.commit(record()).await.expect("commit");
    match waiter.await.expect("task").expect("begin") {
        Begin::Existing(found) => assert_eq!(found.response.status, StatusCode::CREATED),
        Begin::Reserved(_) => panic!("the duplicate reserved the key again"),
    }
}

test! { connections_go_back_with_the_default_busy_timeout }
async fn connections_go_back_with_the_default_busy_timeout() {
    let db = TestDb::create().await.expect("db");
    // One connection: the request's and the check's are the same.
    let store = db.store(1).await;
    let pool = store.pool().clone();
    let busy_timeout = || async {
        let (ms,): (i64,) = sqlx::query_as("PRAGMA busy_timeout")
            .fetch_one(&pool)
            .await
            .expect("busy_timeout");
        ms
    };
    reserve(&store, "a", Duration::from_millis(1500))
        .await
        .commit(record())
        .await
        .expect("commit");
    assert_eq!(busy_timeout().await, 5000);
    reserve(&store, "b", Duration::from_millis(1500))
        .await
        .rollback()
        .await
        .expect("rollback");
    assert_eq!(busy_timeout().await, 5000);
}

test! { the_handle_refuses_transaction_control_and_the_transaction_goes_on }
async fn the_handle_refuses_transaction_control_and_the_transaction_goes_on() {
    let db = TestDb::create().await.expect("db");
    let store = db.store(4).await;
    let pool = store.pool().clone();
    let reservation = reserve(&store, "a", Duration::from_secs(5)).await;
    let handle = reservation.handle();
    {
        let mut conn = handle.acquire().await.expect("connection");
        sqlx::query("INSERT INTO orders (tenant_id, sku, quantity) VALUES ('shop', 'book', 1)")
            .execute(&mut *conn)
            .await
            .expect("insert");
        for refused in [
            "COMMIT",
            "END TRANSACTION",
            "ROLLBACK",
            "BEGIN",
            "SELECT 1; COMMIT",
            "SELECT 1 /* /* */ ; COMMIT",
        ] {
            let error = sqlx::raw_sql(sqlx::AssertSqlSafe(refused))
                .execute(&mut *conn)
                .await
                .expect_err(refused);
            assert!(error.to_string().contains("refused"), "{refused}: {error}");
        }
        sqlx::query("SAVEPOINT mine; INSERT INTO orders (tenant_id, sku, quantity) VALUES ('shop', 'pen', 1); \
             ROLLBACK TO mine")
            .execute(&mut *conn)
            .await
            .expect("savepoints are allowed");
    }
    // Nothing of it is visible yet: the transaction is still open.
    let (orders,): (i64,) = sqlx::query_as("SELECT count(*) FROM orders")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(orders, 0);
    reservation.commit(record()).await.expect("commit");
    let skus: Vec<(String,)> = sqlx::query_as("SELECT sku FROM orders")
        .fetch_all(&pool)
        .await
        .expect("orders");
    assert_eq!(skus, [("book".to_owned(),)]);
}

test! { a_transaction_whose_mark_is_gone_saves_nothing }
async fn a_transaction_whose_mark_is_gone_saves_nothing() {
    let db = TestDb::create().await.expect("db");
    let store = db.store(4).await;
    let pool = store.pool().clone();
    let reservation = reserve(&store, "a", Duration::from_secs(5)).await;
    {
        let handle = reservation.handle();
        let mut conn = handle.acquire().await.expect("connection");
        sqlx::query("INSERT INTO orders (tenant_id, sku, quantity) VALUES ('shop', 'book', 1)")
            .execute(&mut *conn)
            .await
            .expect("insert");
        // What the store checks before it saves the record: the savepoint it opened with the
        // transaction. Gone, the transaction may have been rolled back under the handler.
        sqlx::query("RELEASE tower_idempotency_transaction")
            .execute(&mut *conn)
            .await
            .expect("release");
    }
    let error: Error = reservation.commit(record()).await.expect_err("commit");
    assert!(!error.is_busy(), "{error}");
    let found = store
        .lookup(&scope("a"), SystemTime::now())
        .await
        .expect("lookup");
    assert!(found.is_none(), "a record was saved");
    let (orders,): (i64,) = sqlx::query_as("SELECT count(*) FROM orders")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(orders, 0, "the handler's row was committed");
}

test! { migrate_turns_on_wal_and_is_safe_to_run_again }
async fn migrate_turns_on_wal_and_is_safe_to_run_again() {
    let db = TestDb::create().await.expect("db");
    let store = db.store(4).await;
    let pool = store.pool().clone();
    store.migrate().await.expect("migrate again");
    let (mode,): (String,) = sqlx::query_as("PRAGMA journal_mode")
        .fetch_one(&pool)
        .await
        .expect("journal_mode");
    assert_eq!(mode, "wal");
}
