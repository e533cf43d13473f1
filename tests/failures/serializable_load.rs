//! The PostgreSQL stores (tokio-postgres and sqlx) at `SERIALIZABLE` under load, with a
//! handler whose reads and writes conflict: each request reads a hot row and writes it back
//! incremented (read-then-write, the pattern SERIALIZABLE aborts with `40001`), 64 clients at
//! once, every key sent twice at the same time. The layer runs a request whose transaction the
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
    check_one_order_and_one_increment_per_key, send_every_key_twice, Load, HOT_TABLE, READ_HOT,
    WRITE_HOT,
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

/// Reports what the run took and checks that the handlers conflicted and ran again.
fn report(store: &str, answers: &pg_common::hot_row::Answers, runs: usize, load: Load) {
    assert!(
        runs > load.keys,
        "the handlers conflicted and ran again ({runs} runs for {} keys)",
        load.keys
    );
    eprintln!(
        "serializable ({store}): {} keys x2 at {} clients in {:?}: {runs} handler runs, {} answers 503",
        load.keys, load.clients, answers.took, answers.busy
    );
}

test! { serializable_read_then_write_under_load_keeps_one_order_per_key, postgres }
async fn serializable_read_then_write_under_load_keeps_one_order_per_key() {
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
        .hook(hook(|call| async move {
            let outcome = async {
                let client = call.tx.client().await?;
                let n: i64 = client.query_one(READ_HOT, &[]).await?.get(0);
                client.execute(WRITE_HOT, &[&(n + 1)]).await.map(drop)
            }
            .await;
            answer(outcome)
        }))
        .spawn(&db)
        .await;
    let load = Load::default();
    let answers = send_every_key_twice(server.addr, "hot", load).await;
    check_one_order_and_one_increment_per_key(&db, &answers, load.keys).await;
    report("tokio-postgres", &answers, server.app.handler_calls(), load);
}

test! { serializable_read_then_write_under_load_keeps_one_order_per_key_on_sqlx, postgres }
/// The same on the sqlx store, the handler's statements through the request's connection.
async fn serializable_read_then_write_under_load_keeps_one_order_per_key_on_sqlx() {
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
        .hook(hook_for(|call: SqlxOrderCall| async move {
            let outcome = async {
                let mut conn = call.tx.acquire().await?;
                let n: i64 = sqlx::query_scalar(READ_HOT).fetch_one(&mut *conn).await?;
                sqlx::query(WRITE_HOT)
                    .bind(n + 1)
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
    let load = Load::default();
    let answers = send_every_key_twice(server.addr, "hot", load).await;
    check_one_order_and_one_increment_per_key(&db, &answers, load.keys).await;
    report("sqlx", &answers, server.app.handler_calls(), load);
}
