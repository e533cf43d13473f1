//! The store contract, written once as generic functions over [`IdempotencyStore`] and run
//! against every backend by `store_contract_tests!`: SQLite in a temp dir (the SQLite store and
//! the sqlx store), and PostgreSQL (the tokio-postgres store and the sqlx store) in a schema of
//! its own when `TEST_DATABASE_URL` is set, and MySQL or MariaDB (the sqlx store) in a database
//! of its own when `TEST_MYSQL_URL` is set (reported as ignored otherwise).
//!
//! These check the verbs the flow relies on: reserve, commit, roll back (explicitly or by
//! drop), the scope staying reserved until then, bounded waiting, expiry and purge.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header::{self, HeaderName};
use http::{HeaderValue, StatusCode};
use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::key::IdempotencyKey;
use tower_idempotency::response::SavedResponse;
use tower_idempotency::store::{
    Begin, IdempotencyStore, NewRecord, Reservation, Scope, StoredRecord,
};

const LOCK_TIMEOUT: Duration = Duration::from_secs(5);
const HOUR: Duration = Duration::from_secs(3600);

fn scope(tenant: &str, operation: &str, key: &str) -> Scope {
    Scope::new(
        tenant,
        operation,
        IdempotencyKey::parse(key.as_bytes(), 128).expect("valid key"),
    )
}

fn record(now: SystemTime, seed: u8) -> NewRecord {
    let response = SavedResponse::new(
        StatusCode::CREATED,
        vec![
            (header::LOCATION, HeaderValue::from_static("/orders/7")),
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ),
        ],
        Bytes::from(format!("{{\"order_id\":{seed}}}")),
    )
    .with_trailers(vec![(
        HeaderName::from_static("grpc-status"),
        HeaderValue::from_static("0"),
    )]);
    NewRecord::new(Fingerprint::new(1, [seed; 32]), response, now, now + HOUR)
}

async fn reserve<S: IdempotencyStore>(store: &S, scope: &Scope, now: SystemTime) -> S::Reservation {
    match store.begin(scope, LOCK_TIMEOUT, now).await.expect("begin") {
        Begin::Reserved(tx) => tx,
        Begin::Existing(record) => panic!("expected a reservation, found {record:?}"),
    }
}

/// Reserves `scope` (it must be free) and commits `record` under it.
async fn reserve_and_commit<S: IdempotencyStore>(
    store: &S,
    scope: &Scope,
    now: SystemTime,
    record: NewRecord,
) {
    reserve(store, scope, now)
        .await
        .commit(record)
        .await
        .expect("commit");
}

/// Reserves `scope` (it must be free) and rolls the reservation back.
async fn reserve_and_roll_back<S: IdempotencyStore>(store: &S, scope: &Scope, now: SystemTime) {
    reserve(store, scope, now)
        .await
        .rollback()
        .await
        .expect("rollback");
}

async fn existing<S: IdempotencyStore>(store: &S, scope: &Scope, now: SystemTime) -> StoredRecord {
    match store.begin(scope, LOCK_TIMEOUT, now).await.expect("begin") {
        Begin::Existing(record) => record,
        Begin::Reserved(_) => panic!("expected the existing record, got a reservation"),
    }
}

fn assert_same_record(stored: &StoredRecord, saved: &NewRecord) {
    assert!(stored.fingerprint.matches(&saved.fingerprint));
    assert_eq!(stored.response, saved.response);
    let millis = |t: SystemTime| {
        t.duration_since(SystemTime::UNIX_EPOCH)
            .expect("after epoch")
            .as_millis()
    };
    assert_eq!(millis(stored.expires_at), millis(saved.expires_at));
    assert_eq!(millis(stored.created_at), millis(saved.created_at));
}

async fn commit_saves_the_record<S: IdempotencyStore>(store: S) {
    let now = SystemTime::now();
    let scope = scope("shop-a", "create_order", "key-1");
    let tx = reserve(&store, &scope, now).await;
    assert!(
        store.lookup(&scope, now).await.expect("lookup").is_none(),
        "an uncommitted record is invisible"
    );
    let saved = record(now, 1);

    tx.commit(saved.clone()).await.expect("commit");

    let found = store.lookup(&scope, now).await.expect("lookup");
    assert_same_record(&found.expect("committed record"), &saved);
    assert_same_record(&existing(&store, &scope, now).await, &saved);
}

async fn rollback_leaves_nothing<S: IdempotencyStore>(store: S) {
    let now = SystemTime::now();
    let scope = scope("shop-a", "create_order", "key-1");

    reserve_and_roll_back(&store, &scope, now).await;

    assert!(store.lookup(&scope, now).await.expect("lookup").is_none());
    // The scope is free again.
    reserve_and_commit(&store, &scope, now, record(now, 2)).await;
}

async fn dropping_the_transaction_rolls_back<S: IdempotencyStore>(store: S) {
    let now = SystemTime::now();
    let scope = scope("shop-a", "create_order", "key-1");

    drop(reserve(&store, &scope, now).await);

    // Not left open: the next begin gets the lock (well within the timeout) and the scope.
    let tx = reserve(&store, &scope, now).await;
    assert!(store.lookup(&scope, now).await.expect("lookup").is_none());
    tx.rollback().await.expect("rollback");
}

async fn scope_stays_reserved_until_commit<S: IdempotencyStore>(store: S) {
    let now = SystemTime::now();
    let scope = scope("shop-a", "create_order", "key-1");
    let tx = reserve(&store, &scope, now).await;

    // A duplicate begins while the first is open: it must end up with the committed record,
    // never with a reservation of its own.
    let mut duplicate = tokio::spawn({
        let (store, scope) = (store.clone(), scope.clone());
        async move { existing(&store, &scope, now).await }
    });
    assert!(
        tokio::time::timeout(Duration::from_millis(50), &mut duplicate)
            .await
            .is_err(),
        "the duplicate waits while the scope is reserved"
    );
    let saved = record(now, 3);
    tx.commit(saved.clone()).await.expect("commit");

    assert_same_record(&duplicate.await.expect("duplicate"), &saved);
}

/// A duplicate of a reserved scope waits at most the lock timeout. (Only the same scope is
/// sure to wait: SQLite queues every writer, PostgreSQL only the same key.)
async fn begin_past_the_lock_timeout_is_busy<S: IdempotencyStore>(store: S) {
    let now = SystemTime::now();
    let scope = scope("shop-a", "create_order", "key-1");
    let held = reserve(&store, &scope, now).await;

    let started = std::time::Instant::now();
    let outcome = store.begin(&scope, Duration::from_millis(100), now).await;

    match outcome {
        Err(error) => assert!(error.is_busy(), "{error}"),
        Ok(_) => panic!("expected Busy while another transaction holds the scope"),
    }
    assert!(started.elapsed() < LOCK_TIMEOUT, "the wait was bounded");
    held.rollback().await.expect("rollback");
    reserve_and_roll_back(&store, &scope, now).await;
}

async fn scopes_are_independent<S: IdempotencyStore>(store: S) {
    let now = SystemTime::now();
    let base = scope("shop-a", "create_order", "key-1");
    reserve_and_commit(&store, &base, now, record(now, 4)).await;

    for other in [
        scope("shop-b", "create_order", "key-1"),
        scope("shop-a", "refund_order", "key-1"),
        scope("shop-a", "create_order", "key-2"),
    ] {
        assert!(store.lookup(&other, now).await.expect("lookup").is_none());
        reserve_and_roll_back(&store, &other, now).await;
    }
}

async fn expired_record_is_absent_and_replaced<S: IdempotencyStore>(store: S) {
    let t0 = SystemTime::now();
    let later = t0 + 2 * HOUR;
    let scope = scope("shop-a", "create_order", "key-1");
    reserve_and_commit(&store, &scope, t0, record(t0, 5)).await;

    assert!(store.lookup(&scope, later).await.expect("lookup").is_none());
    let replacement = record(later, 6);
    reserve(&store, &scope, later)
        .await
        .commit(replacement.clone())
        .await
        .expect("commit over an expired record");

    let found = store.lookup(&scope, later).await.expect("lookup");
    assert_same_record(&found.expect("replacement"), &replacement);
}

async fn purge_deletes_expired_records_in_batches<S: IdempotencyStore>(store: S) {
    let t0 = SystemTime::now();
    for k in 0..5 {
        let scope = scope("shop-a", "create_order", &format!("key-{k}"));
        reserve_and_commit(&store, &scope, t0, record(t0, k)).await;
    }
    // One record that lives longer.
    let long = scope("shop-a", "create_order", "long");
    let mut long_record = record(t0, 9);
    long_record.expires_at = t0 + 10 * HOUR;
    reserve_and_commit(&store, &long, t0, long_record).await;

    assert_eq!(store.purge_expired(t0, 2).await.expect("purge"), 0);
    let later = t0 + 2 * HOUR;
    let mut deleted = Vec::new();
    for _ in 0..4 {
        deleted.push(store.purge_expired(later, 2).await.expect("purge"));
    }
    assert_eq!(deleted, vec![2, 2, 1, 0]);
    assert!(store.lookup(&long, later).await.expect("lookup").is_some());
}

macro_rules! store_contract_tests {
    ($backend:ident, $make:expr $(, $needs:ident)?) => {
        mod $backend {
            use super::*;

            store_contract_tests!(@tests $make; [$($needs)?];
                commit_saves_the_record,
                rollback_leaves_nothing,
                dropping_the_transaction_rolls_back,
                scope_stays_reserved_until_commit,
                begin_past_the_lock_timeout_is_busy,
                scopes_are_independent,
                expired_record_is_absent_and_replaced,
                purge_deletes_expired_records_in_batches,
            );
        }
    };
    (@tests $make:expr; [$($needs:ident)?]; $name:ident, $($rest:ident,)*) => {
        test! { $name $(, $needs)? }
        async fn $name() {
            // `None`: the backend is not available here.
            let Some((store, _guard)) = $make.await else {
                return;
            };
            super::$name(store).await;
        }
        store_contract_tests!(@tests $make; [$($needs)?]; $($rest,)*);
    };
    (@tests $make:expr; [$($needs:ident)?];) => {};
}

use support::mysql_common;
use support::pg_common;
use support::sqlx_sqlite_common;

/// The store `open` opens on the fresh database `db` (when there is one), and the database,
/// which lives as long as the test.
async fn on<D, S>(db: Option<D>, open: impl AsyncFnOnce(&D) -> S) -> Option<(S, D)> {
    let db = db?;
    Some((open(&db).await, db))
}

async fn sqlite_store() -> Option<(
    tower_idempotency::store::sqlite::SqliteStore,
    tempfile::TempDir,
)> {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = tower_idempotency::store::sqlite::SqliteStore::open(dir.path().join("store.db"))
        .await
        .expect("open");
    Some((store, dir))
}

store_contract_tests!(sqlite, sqlite_store());
store_contract_tests!(
    postgres,
    on(pg_common::TestDb::create().await, async |db| db
        .store()
        .await),
    postgres
);
store_contract_tests!(
    sqlx_postgres,
    on(pg_common::TestDb::create().await, async |db| db
        .sqlx_store(4, 2)
        .await),
    postgres
);
store_contract_tests!(
    sqlx_sqlite,
    on(
        sqlx_sqlite_common::TestDb::with_orders().await,
        async |db| db.store(4).await
    )
);
store_contract_tests!(
    sqlx_mysql,
    on(mysql_common::TestDb::create().await, async |db| db
        .store(4)
        .await),
    mysql
);
