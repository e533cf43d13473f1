//! The order examples as real processes on one database, each on its store:
//! `examples/orders.rs --database-url ...` (tokio-postgres), `examples/orders_sqlx.rs` (sqlx
//! PostgreSQL), `examples/orders_mysql.rs` (sqlx MySQL/MariaDB) and
//! `examples/orders_sqlx_sqlite.rs` (sqlx SQLite, one file that both instances open). Two
//! instances answer duplicates at once, and an instance killed with SIGKILL under load is
//! started again; each serves the same order API (rules, error codes, `Location`,
//! `GET /orders/{id}`): one suite, run against each example.
//!
//! Needs the example binary (built on first use) and, for the SQL servers, the database's server
//! (`TEST_DATABASE_URL`, `TEST_MYSQL_URL`): without the variable `cargo test` reports those
//! tests as ignored. The SQLite example's tests need nothing more and always run.

use support::common;
use support::mysql_common;
use support::pg_common;
use support::sqlx_sqlite_common;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::process::client;
use common::process::ExampleProcess;
use common::{post, Post, Reply, SHOP_A};
use http::StatusCode;
use tokio::sync::Barrier;

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

/// A fresh database that an order example serves on.
trait ExampleDatabase: Sized + Send + Sync + 'static {
    /// The example that serves on it.
    const EXAMPLE: &'static str;

    /// A fresh database; `None` (after saying so) without the server.
    fn create() -> impl Future<Output = Option<Self>> + Send;
    /// The example's `--database-url`.
    fn url(&self) -> String;
    /// The orders as `(id, tenant_id, sku, quantity)`, by id.
    fn orders(&self) -> impl Future<Output = Vec<(i64, String, String, i64)>> + Send;
    /// Completed records.
    fn record_count(&self) -> impl Future<Output = i64> + Send;
    /// Records in any state.
    fn row_count(&self) -> impl Future<Output = i64> + Send;
    /// The `order_id` in each completed record's saved body.
    fn recorded_order_ids(&self) -> impl Future<Output = Vec<i64>> + Send;

    /// The example serving on this database.
    fn start(&self) -> impl Future<Output = ExampleProcess> + Send {
        let url = self.url();
        async move { ExampleProcess::start(Self::EXAMPLE, &["--database-url", &url]).await }
    }
}

/// A PostgreSQL schema served by `examples/orders.rs`.
struct TokioPostgres(pg_common::TestDb);
/// A PostgreSQL schema served by `examples/orders_sqlx.rs`.
struct SqlxPostgres(pg_common::TestDb);
/// A MySQL or MariaDB database served by `examples/orders_mysql.rs`.
struct MySql(mysql_common::TestDb);
/// A SQLite file served by `examples/orders_sqlx_sqlite.rs`.
struct SqlxSqlite(sqlx_sqlite_common::TestDb);

/// `$database` is a `$test_db` served by the example `$example`.
macro_rules! example_database {
    ($database:ident, $test_db:ty, $example:literal) => {
        impl ExampleDatabase for $database {
            const EXAMPLE: &'static str = $example;

            async fn create() -> Option<Self> {
                <$test_db>::create().await.map($database)
            }

            fn url(&self) -> String {
                self.0.url()
            }

            async fn orders(&self) -> Vec<(i64, String, String, i64)> {
                self.0.orders().await
            }

            async fn record_count(&self) -> i64 {
                self.0.record_count().await
            }

            async fn row_count(&self) -> i64 {
                self.0.row_count().await
            }

            async fn recorded_order_ids(&self) -> Vec<i64> {
                self.0.recorded_order_ids().await
            }
        }
    };
}

example_database!(TokioPostgres, pg_common::TestDb, "orders");
example_database!(SqlxPostgres, pg_common::TestDb, "orders_sqlx");
example_database!(MySql, mysql_common::TestDb, "orders_mysql");
example_database!(SqlxSqlite, sqlx_sqlite_common::TestDb, "orders_sqlx_sqlite");

/// `GET path` as `token` (or without `Authorization`).
async fn get_as(addr: std::net::SocketAddr, token: Option<&str>, path: &str) -> Reply {
    let mut request = http::Request::get(format!("http://{addr}{path}"));
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    common::send(
        request
            .body(http_body_util::Empty::<Bytes>::new())
            .expect("request"),
    )
    .await
}

/// The example serves the API of `examples/orders.rs`: invalid orders are `400` with the
/// field's code and create nothing, a missing or unknown token is `401 unauthenticated`, a
/// new order is `201` with its `Location`, which `GET` answers to its tenant alone (`404
/// not_found` to another, and for an id that is none).
async fn serves_the_order_api<D: ExampleDatabase>() {
    let Some(db) = D::create().await else {
        return;
    };
    let app = db.start().await;
    let bad = [
        ("not JSON", "{", "invalid_json"),
        (
            "quantity 0",
            r#"{"sku":"book","quantity":0}"#,
            "invalid_quantity",
        ),
        (
            "quantity 101",
            r#"{"sku":"book","quantity":101}"#,
            "invalid_quantity",
        ),
        ("no quantity", r#"{"sku":"book"}"#, "invalid_quantity"),
        (
            "empty sku",
            r#"{"sku":"","quantity":1}"#,
            "invalid_key_or_sku",
        ),
        ("no sku", r#"{"quantity":1}"#, "invalid_key_or_sku"),
    ];
    for (i, (what, body, code)) in bad.into_iter().enumerate() {
        let reply = post(app.addr, Some(SHOP_A), Some(&format!("bad-{i}")), body, &[]).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{what}: {reply:?}");
        assert_eq!(reply.error_code(), code, "{what}");
    }
    let unauthenticated = post(app.addr, Some("nobody"), Some("k"), BOOK, &[]).await;
    assert_eq!(unauthenticated.status, StatusCode::UNAUTHORIZED);
    assert_eq!(unauthenticated.error_code(), "unauthenticated");
    assert!(db.orders().await.is_empty(), "nothing created");

    let created = post(app.addr, Some(SHOP_A), Some("good"), BOOK, &[]).await;
    assert_eq!(created.status, StatusCode::CREATED, "{created:?}");
    let id = created.order_id();
    let location = format!("/orders/{id}");
    assert_eq!(created.header("location"), Some(location.as_str()));
    let replay = post(app.addr, Some(SHOP_A), Some("good"), BOOK, &[]).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.header("location"), Some(location.as_str()));

    let own = get_as(app.addr, Some(SHOP_A), &location).await;
    assert_eq!(own.status, StatusCode::OK, "{own:?}");
    assert_eq!(
        own.json(),
        serde_json::json!({"order_id": id, "sku": "book", "quantity": 1})
    );
    for (token, path) in [
        (Some("shop-b-token"), location.as_str()),
        (Some(SHOP_A), "/orders/999999"),
        (Some(SHOP_A), "/orders/not-a-number"),
    ] {
        let reply = get_as(app.addr, token, path).await;
        assert_eq!(
            reply.status,
            StatusCode::NOT_FOUND,
            "{token:?} {path}: {reply:?}"
        );
        assert_eq!(reply.error_code(), "not_found");
    }
    let anonymous = get_as(app.addr, None, &location).await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);
    assert_eq!(anonymous.error_code(), "unauthenticated");
    assert_eq!(db.orders().await.len(), 1);
}

/// Two instances of the example share one database; every key goes to both at the same
/// moment, several times: one order per key, and every reply of a key is the same 201.
async fn two_instances_create_one_order_per_key<D: ExampleDatabase>() {
    const KEYS: usize = 10;
    const DUPLICATES: usize = 4;
    let Some(db) = D::create().await else {
        return;
    };
    let a = db.start().await;
    let b = db.start().await;
    assert_ne!(a.addr, b.addr);

    let mut requests = Vec::new();
    for k in 0..KEYS {
        for d in 0..DUPLICATES {
            let addr = if d % 2 == 0 { a.addr } else { b.addr };
            requests.push((addr, format!("key-{k}"), k));
        }
    }
    let barrier = Arc::new(Barrier::new(requests.len()));
    let tasks: Vec<_> = requests
        .iter()
        .cloned()
        .map(|(addr, key, k)| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                let body = format!(r#"{{"sku":"sku-{k}","quantity":1}}"#);
                post(addr, Some(SHOP_A), Some(&key), &body, &[]).await
            })
        })
        .collect();
    let mut by_key: HashMap<String, Vec<Reply>> = HashMap::new();
    for ((_, key, _), task) in requests.iter().zip(tasks) {
        by_key
            .entry(key.clone())
            .or_default()
            .push(task.await.expect("request"));
    }

    for (key, replies) in &by_key {
        for reply in replies {
            assert_eq!(reply.status, StatusCode::CREATED, "{key}: {reply:?}");
            assert_eq!(reply.body, replies[0].body, "{key}: the same response");
        }
        let originals = replies.iter().filter(|r| !r.replayed()).count();
        assert_eq!(originals, 1, "{key}: one original, the rest replayed");
    }
    assert_eq!(db.orders().await.len(), KEYS);
    assert_eq!(db.record_count().await, KEYS as i64);
    a.kill().await;
    b.kill().await;
}

/// `POST /orders` of `key` (its sku is the key) on a server that may die under it: `None`
/// when no complete answer came.
async fn try_order(
    client: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Full<Bytes>,
    >,
    addr: std::net::SocketAddr,
    key: &str,
) -> Option<Reply> {
    let body = format!(r#"{{"sku":"{key}","quantity":1}}"#);
    Post::order(key, &body)
        .try_send(client, addr, Duration::from_secs(5))
        .await
}

/// SIGKILL under load, then a restart on the same database. Afterwards: every key that got a
/// 201 replays exactly that 201; every key the clients tried ends with one order of its own (a
/// transaction cut by the kill either committed whole or left nothing); every order has
/// exactly one record, every record points at an existing order, and no reservation is left.
async fn killed_under_load_keeps_one_order_per_key<D: ExampleDatabase>() {
    const WORKERS: usize = 8;
    const KEYS_PER_WORKER: usize = 400;
    let Some(db) = D::create().await else {
        return;
    };
    let server = db.start().await;
    let addr = server.addr;

    // Each worker sends new keys, one after the other, until the server dies under it. What it
    // saw of each key: the body of its 201, if one arrived.
    let answered = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let answered = answered.clone();
            tokio::spawn(async move {
                let client = client();
                let mut seen: BTreeMap<String, Option<Bytes>> = BTreeMap::new();
                for i in 0..KEYS_PER_WORKER {
                    let key = format!("crash-{w}-{i}");
                    match try_order(&client, addr, &key).await {
                        Some(reply) if reply.status == StatusCode::CREATED => {
                            seen.insert(key, Some(reply.body));
                            answered.fetch_add(1, Ordering::SeqCst);
                        }
                        Some(reply) => panic!("{key}: {reply:?}"),
                        None => {
                            seen.insert(key, None);
                            break; // the server is gone
                        }
                    }
                }
                seen
            })
        })
        .collect();
    // Let the load build up, then kill in the middle of it.
    let deadline = tokio::time::Instant::now() + common::PATIENCE;
    while answered.load(Ordering::SeqCst) < 50 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    server.kill().await;
    let mut seen: BTreeMap<String, Option<Bytes>> = BTreeMap::new();
    for worker in workers {
        seen.extend(worker.await.expect("worker"));
    }
    let created_before = seen.values().filter(|s| s.is_some()).count();
    assert!(created_before > 0, "the load ran before the kill");
    assert!(
        created_before < seen.len(),
        "the kill landed with requests in flight ({created_before} of {} answered)",
        seen.len()
    );

    let server = db.start().await;
    let client = client();
    let mut final_ids: HashMap<String, i64> = HashMap::new();
    for (key, before) in &seen {
        let reply = try_order(&client, server.addr, key)
            .await
            .unwrap_or_else(|| panic!("{key}: no answer after the restart"));
        assert_eq!(reply.status, StatusCode::CREATED, "{key}: {reply:?}");
        if let Some(created) = before {
            assert!(reply.replayed(), "{key}: a key that got its 201 replays it");
            assert_eq!(
                &reply.body, created,
                "{key}: the same body as before the crash"
            );
        }
        final_ids.insert(key.clone(), reply.order_id());
    }
    server.kill().await;

    let orders = db.orders().await;
    assert_eq!(orders.len(), seen.len(), "one order per distinct key");
    let order_ids: BTreeSet<i64> = orders.iter().map(|o| o.0).collect();
    let records = db.recorded_order_ids().await;
    assert_eq!(records.len(), orders.len(), "one record per order");
    assert_eq!(
        records.into_iter().collect::<BTreeSet<_>>(),
        order_ids,
        "every record points at an order and back"
    );
    assert_eq!(
        db.row_count().await,
        orders.len() as i64,
        "no stray reservation"
    );
    let by_sku: HashMap<&str, i64> = orders.iter().map(|o| (o.2.as_str(), o.0)).collect();
    let distinct: HashSet<i64> = final_ids.values().copied().collect();
    assert_eq!(
        distinct.len(),
        final_ids.len(),
        "no two keys share an order"
    );
    for (key, id) in &final_ids {
        assert_eq!(by_sku.get(key.as_str()), Some(id), "{key}: its own order");
    }
}

mod postgres {
    //! `examples/orders.rs` on the tokio-postgres store.

    use super::*;

    test! { two_example_instances_create_one_order_per_key, multi_thread = 2, postgres }
    async fn two_example_instances_create_one_order_per_key() {
        two_instances_create_one_order_per_key::<TokioPostgres>().await;
    }

    test! { example_killed_under_load_keeps_one_order_per_key, multi_thread = 2, postgres }
    async fn example_killed_under_load_keeps_one_order_per_key() {
        killed_under_load_keeps_one_order_per_key::<TokioPostgres>().await;
    }

    test! { example_serves_the_order_api, multi_thread = 2, postgres }
    /// The reference the sqlx examples are held to: `examples/orders.rs` on PostgreSQL.
    async fn example_serves_the_order_api() {
        serves_the_order_api::<TokioPostgres>().await;
    }
}

mod sqlx_postgres {
    //! `examples/orders_sqlx.rs` on the sqlx PostgreSQL store.

    use super::*;

    test! { sqlx_two_example_instances_create_one_order_per_key, multi_thread = 2, postgres }
    async fn sqlx_two_example_instances_create_one_order_per_key() {
        two_instances_create_one_order_per_key::<SqlxPostgres>().await;
    }

    test! { sqlx_example_serves_the_order_api, multi_thread = 2, postgres }
    async fn sqlx_example_serves_the_order_api() {
        serves_the_order_api::<SqlxPostgres>().await;
    }

    test! { sqlx_example_killed_under_load_keeps_one_order_per_key, multi_thread = 2, postgres }
    async fn sqlx_example_killed_under_load_keeps_one_order_per_key() {
        killed_under_load_keeps_one_order_per_key::<SqlxPostgres>().await;
    }
}

mod mysql {
    //! `examples/orders_mysql.rs` on the sqlx MySQL/MariaDB store.

    use super::*;

    test! { two_example_instances_create_one_order_per_key, multi_thread = 2, mysql }
    async fn two_example_instances_create_one_order_per_key() {
        two_instances_create_one_order_per_key::<MySql>().await;
    }

    test! { example_serves_the_order_api, multi_thread = 2, mysql }
    async fn example_serves_the_order_api() {
        serves_the_order_api::<MySql>().await;
    }

    test! { example_killed_under_load_keeps_one_order_per_key, multi_thread = 2, mysql }
    async fn example_killed_under_load_keeps_one_order_per_key() {
        killed_under_load_keeps_one_order_per_key::<MySql>().await;
    }
}

mod sqlx_sqlite {
    //! `examples/orders_sqlx_sqlite.rs` on the sqlx SQLite store: no server, so these run in a
    //! plain `cargo test`.

    use super::*;

    test! { two_example_instances_create_one_order_per_key, multi_thread = 2 }
    async fn two_example_instances_create_one_order_per_key() {
        two_instances_create_one_order_per_key::<SqlxSqlite>().await;
    }

    test! { example_serves_the_order_api, multi_thread = 2 }
    async fn example_serves_the_order_api() {
        serves_the_order_api::<SqlxSqlite>().await;
    }

    test! { example_killed_under_load_keeps_one_order_per_key, multi_thread = 2 }
    async fn example_killed_under_load_keeps_one_order_per_key() {
        killed_under_load_keeps_one_order_per_key::<SqlxSqlite>().await;
    }
}
