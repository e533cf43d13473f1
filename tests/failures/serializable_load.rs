//! The PostgreSQL stores (tokio-postgres and sqlx) at `SERIALIZABLE` under load, with a
//! handler whose reads and writes conflict: each request reads a hot row and writes it back
//! incremented (read-then-write, the pattern SERIALIZABLE aborts with `40001`, at the
//! `UPDATE`), or counts a ledger's rows and adds one (no row in common: aborted at the insert or
//! at the commit), 64 clients at once, every key sent twice at the same time. The layer runs a request whose transaction the
//! database threw away again, within its conflict retries, then answers `503` with
//! `Retry-After`; clients retry those with the same key. Never a `500`, never a duplicate:
//! orders == keys, and the hot row counts exactly one increment per order (no lost update, no
//! increment of a rolled-back run). The clients and the checks are `pg_common::hot_row`'s.
//!
//! Needs `TEST_DATABASE_URL`; without it `cargo test` reports these tests as ignored.

use support::common;
use support::pg_common;

use common::{hook_for, AppBuilder};
use http::StatusCode;
use pg_common::hot_row::{
    check_one_order_per_key, send_every_key_twice, Answers, Load, Shape, HOT_TABLE,
};
use pg_common::sqlx_app::{SqlxOrderCall, SqlxPgApp};
use pg_common::{hook, HookOutcome, PgServer, TestDb};
use tower_idempotency::store::sqlx_postgres::sqlx;
use tower_idempotency::store::sqlx_postgres::SqlxPostgresStore;
use tower_idempotency::store::Isolation;

/// Transaction connections of each store: more than the layer's requests need at once, fewer
/// than the 64 clients, so that requests also wait for a connection.
const CONNECTIONS: u32 = 24;
/// Conflict retries of the layer.
const RETRIES: u32 = 5;

/// As an application would: its own 500 on a database error.
fn answer(outcome: Result<(), impl std::fmt::Debug>) -> HookOutcome {
    match outcome {
        Ok(()) => HookOutcome::default(),
        Err(_) => HookOutcome {
            fail_with: Some(StatusCode::INTERNAL_SERVER_ERROR),
        },
    }
}

/// Checks the run: one order and one increment per key, and handlers that conflicted and ran
/// again; reports what it took.
async fn check(db: &TestDb, store: &str, shape: Shape, answers: &Answers, runs: usize) {
    let load = Load::default();
    check_one_order_per_key(db, answers, load.keys).await;
    shape.check(db, load.keys).await;
    assert!(
        runs > load.keys,
        "the handlers conflicted and ran again ({runs} runs for {} keys)",
        load.keys
    );
    eprintln!(
        "serializable ({store}, {shape:?}): {} keys x2 at {} clients in {:?}: {runs} handler runs, {} answers 503",
        load.keys, load.clients, answers.took, answers.busy
    );
}

async fn on_tokio_postgres(shape: Shape) {
    let Some(db) = TestDb::create().await else {
        return;
    };
    db.execute(HOT_TABLE).await;
    let server = PgServer::builder()
        .store(|options| {
            options
                .with_isolation(Isolation::Serializable)
                .with_max_connections(CONNECTIONS as usize)
        })
        .layer(|layer| layer.with_conflict_retries(RETRIES))
        .hook(hook(move |call| async move {
            let outcome = async {
                let client = call.tx.client().await?;
                let read: i64 = client.query_one(shape.read(), &[]).await?.get(0);
                let (write, value) = shape.write(read);
                client.execute(write, &[&value]).await.map(drop)
            }
            .await;
            answer(outcome)
        }))
        .spawn(&db)
        .await;
    let answers = send_every_key_twice(server.addr, "hot", Load::default()).await;
    check(
        &db,
        "tokio-postgres",
        shape,
        &answers,
        server.app.handler_calls(),
    )
    .await;
}

/// The same on the sqlx store, the handler's statements through the request's connection.
async fn on_sqlx(shape: Shape) {
    let Some(db) = TestDb::create().await else {
        return;
    };
    db.execute(HOT_TABLE).await;
    let store = SqlxPostgresStore::builder(db.sqlx_pool(CONNECTIONS).await)
        .with_max_read_connections(4)
        .with_isolation(Isolation::Serializable)
        .build();
    store.migrate().await.expect("create the table");
    let server = AppBuilder::new(SqlxPgApp)
        .layer(|layer| layer.with_conflict_retries(RETRIES))
        .hook(hook_for(move |call: SqlxOrderCall| async move {
            let outcome = async {
                let mut conn = call.tx.acquire().await?;
                let read: i64 = sqlx::query_scalar(shape.read())
                    .fetch_one(&mut *conn)
                    .await?;
                let (write, value) = shape.write(read);
                sqlx::query(write)
                    .bind(value)
                    .execute(&mut *conn)
                    .await
                    .map(drop)
                    .map_err(tower_idempotency::Error::from)
            }
            .await;
            answer(outcome)
        }))
        .serve_on(store)
        .await;
    let answers = send_every_key_twice(server.addr, "hot", Load::default()).await;
    check(&db, "sqlx", shape, &answers, server.app.handler_calls()).await;
}

test! { serializable_read_then_write_under_load_keeps_one_order_per_key, postgres }
async fn serializable_read_then_write_under_load_keeps_one_order_per_key() {
    on_tokio_postgres(Shape::HotRow).await;
}

test! { serializable_read_then_write_under_load_keeps_one_order_per_key_on_sqlx, postgres }
async fn serializable_read_then_write_under_load_keeps_one_order_per_key_on_sqlx() {
    on_sqlx(Shape::HotRow).await;
}

test! { serializable_count_then_insert_under_load_keeps_one_order_per_key, postgres }
async fn serializable_count_then_insert_under_load_keeps_one_order_per_key() {
    on_tokio_postgres(Shape::Ledger).await;
}

test! { serializable_count_then_insert_under_load_keeps_one_order_per_key_on_sqlx, postgres }
async fn serializable_count_then_insert_under_load_keeps_one_order_per_key_on_sqlx() {
    on_sqlx(Shape::Ledger).await;
}
