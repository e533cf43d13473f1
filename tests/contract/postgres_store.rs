//! The tokio-postgres store on a real PostgreSQL (`TEST_DATABASE_URL`), through its public API,
//! each test in a schema of its own: a store on a pool of the app's own, and its replay checks
//! (batched under load, and adaptive: read first only while retries are frequent).

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::StatusCode;
use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::key::IdempotencyKey;
use tower_idempotency::response::SavedResponse;
use tower_idempotency::store::tokio_postgres::deadpool_postgres::{Manager, Pool};
use tower_idempotency::store::tokio_postgres::tokio_postgres::NoTls;
use tower_idempotency::store::tokio_postgres::PostgresStore;
use tower_idempotency::store::{
    Begin, IdempotencyStore, NewRecord, Reservation, RunOutcome, Scope,
};
use tower_idempotency::Error;

use support::pg_common::TestDb;

type PostgresReservation = <PostgresStore as IdempotencyStore>::Reservation;

/// `key` of the tenant `shop` on the operation `create_order`.
fn scope(key: &str) -> Scope {
    let key = IdempotencyKey::parse(key.as_bytes(), 128).expect("key");
    Scope::new("shop", "create_order", key)
}

/// A `201` with the body `body`, saved now for an hour.
fn record(body: impl Into<Bytes>) -> NewRecord {
    let now = SystemTime::now();
    let response = SavedResponse::new(StatusCode::CREATED, Vec::new(), body.into());
    let fingerprint = Fingerprint::new(2, [7; 32]);
    NewRecord::new(fingerprint, response, now, now + Duration::from_secs(3600))
}

async fn reserve(store: &PostgresStore, scope: &Scope) -> PostgresReservation {
    match store
        .begin(scope, Duration::from_secs(5), SystemTime::now())
        .await
        .expect("begin")
    {
        Begin::Reserved(reservation) => reservation,
        Begin::Existing(_) => panic!("a fresh scope has no record"),
    }
}

test! { a_store_on_the_apps_own_pool_installs_reserves_and_replays_through_it, postgres }
async fn a_store_on_the_apps_own_pool_installs_reserves_and_replays_through_it() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let admin = db.client().await;
    let pool = Pool::builder(Manager::new(db.config(), NoTls))
        .max_size(2)
        .build()
        .expect("pool");
    let table_exists = || async {
        admin
            .query_one(
                "SELECT to_regclass($1) IS NOT NULL",
                &[&format!("{}.idempotency_records", db.schema)],
            )
            .await
            .expect("to_regclass")
            .get::<_, bool>(0)
    };

    // Without schema creation, connecting only takes a connection from the pool; the
    // migration is then a call of its own.
    let unmigrated = PostgresStore::builder_from_pool(pool.clone())
        .with_create_schema(false)
        .build()
        .await
        .expect("store without schema creation");
    assert!(!table_exists().await, "nothing was created");
    unmigrated.migrate().await.expect("migrate");
    assert!(table_exists().await, "migrate created the table");
    drop(unmigrated);

    // With it (the default; the table is there already, so it changes nothing), the store
    // reserves, commits and replays on the app's pool: writes and reads share it.
    let store = PostgresStore::builder_from_pool(pool.clone())
        .with_read_wait(Duration::from_millis(200))
        .build()
        .await
        .expect("store");
    assert_eq!(store.pool().status().max_size, 2, "the app's pool itself");
    let scope = scope("own-pool");
    reserve(&store, &scope)
        .await
        .commit(record("{}"))
        .await
        .expect("commit");
    let replayed = store
        .lookup(&scope, SystemTime::now())
        .await
        .expect("lookup")
        .expect("the saved record");
    assert_eq!(replayed.response.status, StatusCode::CREATED);
    {
        // The app's own connections see the record; while they hold the whole pool, the
        // replay check (which reads from the same pool) gives up after `read_wait`.
        let first = pool.get().await.expect("connection");
        let _second = pool.get().await.expect("connection");
        let completed: i64 = first
            .query_one(
                "SELECT count(*) FROM idempotency_records WHERE state = 'completed'",
                &[],
            )
            .await
            .expect("count")
            .get(0);
        assert_eq!(completed, 1);
        let waited = store.lookup(&scope, SystemTime::now()).await;
        assert!(matches!(waited, Err(Error::Busy)), "{waited:?}");
    }

    // A read pool of its own serves the replay check instead.
    let reads = Pool::builder(Manager::new(db.config(), NoTls))
        .max_size(1)
        .build()
        .expect("read pool");
    let store = PostgresStore::builder_from_pool(pool.clone())
        .with_read_pool(reads.clone())
        .build()
        .await
        .expect("store with a read pool");
    assert_eq!(reads.status().size, 0);
    assert!(store
        .lookup(&scope, SystemTime::now())
        .await
        .expect("lookup")
        .is_some());
    assert_eq!(
        reads.status().size,
        1,
        "the replay check used the read pool"
    );
}

/// A completed record of `key` whose body names the key.
async fn complete(store: &PostgresStore, key: &str) {
    let reservation = reserve(store, &scope(key)).await;
    let record = record(format!("{{\"key\":\"{key}\"}}"));
    reservation.commit(record).await.expect("commit");
}

test! { replay_checks_queued_under_load_each_get_their_own_record, multi_thread = 2, postgres }
async fn replay_checks_queued_under_load_each_get_their_own_record() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let store = db.store().await;
    for i in 0..40 {
        complete(&store, &format!("done-{i}")).await;
    }
    // Expired records are not live: their checks find nothing, batched or not.
    db.execute(
        "UPDATE idempotency_records SET expires_at = 0 \
         WHERE idempotency_key IN ('done-0', 'done-1')",
    )
    .await;
    // Many more checks at once than run in flight: most queue and go in batches, duplicates
    // of one key included.
    let checks = (0..400).map(|i| {
        let store = store.clone();
        tokio::spawn(async move {
            let key = match i % 4 {
                0 => format!("new-{i}"),
                _ => format!("done-{}", i % 40),
            };
            let found = store
                .lookup(&scope(&key), SystemTime::now())
                .await
                .expect("lookup");
            (key, found)
        })
    });
    let live = (0..400).filter(|i| i % 4 != 0 && i % 40 > 1).count();
    let mut replays = 0;
    for check in checks.collect::<Vec<_>>() {
        let (key, found) = check.await.expect("task");
        let expired = key == "done-0" || key == "done-1";
        match found {
            Some(record) => {
                assert!(
                    key.starts_with("done-") && !expired,
                    "{key} has no live record"
                );
                assert_eq!(
                    record.response.body,
                    format!("{{\"key\":\"{key}\"}}"),
                    "{key}"
                );
                replays += 1;
            }
            None => assert!(key.starts_with("new-") || expired, "{key} was not found"),
        }
    }
    assert_eq!(replays, live, "every live record found once per check");
}

/// A first attempt under `ReplayCheck::Adaptive` (the default): `Found` when it read before
/// the transaction, `Existing` when the reservation found the record.
async fn first_attempt(store: &PostgresStore, key: &str) -> &'static str {
    let outcome = store
        .lookup_then_begin_and_run(
            &scope(key),
            Duration::from_secs(5),
            SystemTime::now(),
            |reservation: PostgresReservation| async move {
                reservation.commit(record("{}")).await.expect("commit");
            },
        )
        .await
        .expect("first attempt");
    match outcome {
        RunOutcome::Found { .. } => "read first",
        RunOutcome::Existing { .. } => "found by the reservation",
        RunOutcome::Ran { .. } => "ran",
    }
}

test! { adaptive_replay_checks_read_first_only_while_retries_are_frequent, multi_thread = 2, postgres }
async fn adaptive_replay_checks_read_first_only_while_retries_are_frequent() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let store = db.store().await;
    for i in 0..20 {
        assert_eq!(first_attempt(&store, &format!("new-{i}")).await, "ran");
    }
    // Retries are rare so far: the reservation finds the record (one query less per new key).
    assert_eq!(
        first_attempt(&store, "new-0").await,
        "found by the reservation"
    );
    // A few more retries and they are checked on the read pool first.
    let mut paths = Vec::new();
    for _ in 0..5 {
        paths.push(first_attempt(&store, "new-1").await);
    }
    assert_eq!(paths.last(), Some(&"read first"), "{paths:?}");
    // A stretch of new keys, and the read before the transaction stops again.
    for i in 20..80 {
        assert_eq!(first_attempt(&store, &format!("new-{i}")).await, "ran");
    }
    assert_eq!(
        first_attempt(&store, "new-2").await,
        "found by the reservation"
    );
}
