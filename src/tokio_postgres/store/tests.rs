//! White-box checks against a real PostgreSQL (`TEST_DATABASE_URL`): what `commit` does when
//! the transaction it holds is no longer the one `begin` opened (handles refuse transaction
//! control, so these end the transaction through the connection itself), and a store on a
//! pool of the app's own.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use deadpool_postgres::{Manager, Pool};
use http::StatusCode;
use tokio_postgres::NoTls;

use super::*;
use crate::error::Error;
use crate::row_lock::test_records::{record, scope};
use crate::store::{Begin, IdempotencyStore, Reservation, RunOutcome, Scope};

/// A schema of its own: the admin client that drops it, its name, and settings whose
/// connections use it.
async fn schema() -> (tokio_postgres::Client, String, tokio_postgres::Config) {
    let url = std::env::var("TEST_DATABASE_URL").expect("TEST_DATABASE_URL");
    let (admin, connection) = tokio_postgres::connect(&url, NoTls).await.expect("connect");
    tokio::spawn(connection);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_nanos();
    let schema = format!("tidem_unit_{}_{nanos}", std::process::id());
    admin
        .batch_execute(&format!("CREATE SCHEMA {schema}"))
        .await
        .expect("schema");
    let mut config: tokio_postgres::Config = url.parse().expect("url");
    config.options(format!("-c search_path={schema}"));
    (admin, schema, config)
}

/// A store in a schema of its own, and the admin client that drops the schema.
async fn store() -> (PostgresStore, tokio_postgres::Client, String) {
    let (admin, schema, config) = schema().await;
    let store = PostgresStore::builder(config).build().await.expect("store");
    (store, admin, schema)
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

/// Runs `sql` on the reservation's own connection, past the handle's guard.
async fn run_raw(reservation: &PostgresReservation, sql: &str) {
    let slot = reservation.tx.connection.lock().await;
    slot.client()
        .expect("open")
        .batch_execute(sql)
        .await
        .expect(sql);
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn a_transaction_committed_behind_the_layer_does_not_save_the_record() {
    let (store, admin, schema) = store().await;
    let scope = scope("behind-commit");
    let reservation = reserve(&store, &scope).await;
    // The reservation is committed as it stands; the record's UPDATE then runs in a transaction
    // of its own, which did not write the reservation row.
    run_raw(&reservation, "COMMIT").await;

    let committed = reservation.commit(record()).await;

    assert!(
        matches!(committed, Err(Error::TransactionAborted(_))),
        "{committed:?}"
    );
    let state: String = admin
        .query_one(
            &format!("SELECT state FROM {schema}.idempotency_records WHERE idempotency_key = $1"),
            &[&"behind-commit"],
        )
        .await
        .expect("row")
        .get(0);
    assert_eq!(state, "in_progress", "no completed record was saved");
    admin
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
        .expect("drop");
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn a_transaction_rolled_back_behind_the_layer_saves_nothing_and_frees_the_key() {
    let (store, admin, schema) = store().await;
    let scope = scope("behind-rollback");
    let reservation = reserve(&store, &scope).await;
    run_raw(&reservation, "ROLLBACK").await;

    let committed = reservation.commit(record()).await;

    assert!(
        matches!(committed, Err(Error::TransactionAborted(_))),
        "{committed:?}"
    );
    assert!(store
        .lookup(&scope, SystemTime::now())
        .await
        .expect("lookup")
        .is_none());
    // The connection went back to the pool with no transaction open: the key can be reserved
    // and completed again.
    reserve(&store, &scope)
        .await
        .commit(record())
        .await
        .expect("commit");
    assert!(store
        .lookup(&scope, SystemTime::now())
        .await
        .expect("lookup")
        .is_some());
    admin
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
        .expect("drop");
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test]
async fn a_store_on_the_apps_own_pool_installs_reserves_and_replays_through_it() {
    let (admin, schema, config) = schema().await;
    let pool = Pool::builder(Manager::new(config.clone(), NoTls))
        .max_size(2)
        .build()
        .expect("pool");
    let table_exists = || async {
        admin
            .query_one(
                "SELECT to_regclass($1) IS NOT NULL",
                &[&format!("{schema}.idempotency_records")],
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
        .commit(record())
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
    let reads = Pool::builder(Manager::new(config, NoTls))
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

    drop((store, pool, reads));
    admin
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
        .expect("drop");
}

/// A completed record of `key` whose body names the key.
async fn complete(store: &PostgresStore, key: &str) {
    let reservation = reserve(store, &scope(key)).await;
    let mut record = record();
    record.response.body = Bytes::from(format!("{{\"key\":\"{key}\"}}"));
    reservation.commit(record).await.expect("commit");
}

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_checks_queued_under_load_each_get_their_own_record() {
    let (store, admin, schema) = store().await;
    for i in 0..40 {
        complete(&store, &format!("done-{i}")).await;
    }
    // Expired records are not live: their checks find nothing, batched or not.
    admin
        .batch_execute(&format!(
            "UPDATE {schema}.idempotency_records SET expires_at = 0 \
             WHERE idempotency_key IN ('done-0', 'done-1')"
        ))
        .await
        .expect("expire");
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
    admin
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
        .expect("drop");
}

/// A first attempt under `ReplayCheck::Adaptive`: `Found` when it read before the transaction,
/// `Existing` when the reservation found the record.
async fn first_attempt(store: &PostgresStore, key: &str) -> &'static str {
    let outcome = store
        .lookup_then_begin_and_run(
            &scope(key),
            Duration::from_secs(5),
            SystemTime::now(),
            |reservation: PostgresReservation| async move {
                reservation.commit(record()).await.expect("commit");
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

#[cfg_attr(not(pg_tests), ignore = "needs PostgreSQL: set TEST_DATABASE_URL")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adaptive_replay_checks_read_first_only_while_retries_are_frequent() {
    let (store, admin, schema) = store().await;
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

    admin
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
        .expect("drop");
}
