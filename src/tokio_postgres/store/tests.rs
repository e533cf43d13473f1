//! White-box checks against a real PostgreSQL (`TEST_DATABASE_URL`): what `commit` does when
//! the transaction it holds is no longer the one `begin` opened. The handle refuses transaction
//! control, and nothing public reaches the reservation's connection past it, so these end the
//! transaction through the connection itself: they stay here, marked ignored (the lib's tests
//! run on libtest, which cannot decide at run time), and CI runs them with
//! `cargo test --lib --all-features -- --ignored`. The store's behaviour a user sees is tested
//! through its public API in `tests/contract/postgres_store.rs`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio_postgres::NoTls;

use super::*;
use crate::error::Error;
use crate::row_lock::test_records::{record, scope};
use crate::store::{Begin, IdempotencyStore, Reservation, Scope};

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

#[ignore = "needs PostgreSQL: cargo test --lib --all-features -- --ignored with TEST_DATABASE_URL"]
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

#[ignore = "needs PostgreSQL: cargo test --lib --all-features -- --ignored with TEST_DATABASE_URL"]
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
