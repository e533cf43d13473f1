//! The in-flight policy across instances: two store instances (two pools, as two servers
//! would have) on one database, each behind a layer of its own, so that a duplicate sent to
//! the second instance is not seen by the first one's running set and meets the first
//! request only on the key's row. For tokio-postgres, sqlx on PostgreSQL and sqlx on MySQL or
//! MariaDB: `Reject` answers `409` with `Retry-After` at once, `WaitUpTo(d)` after about `d`
//! (and replays if the first finishes within `d`), `Wait` waits and replays; the handler runs
//! once in every case.
//!
//! The PostgreSQL tests need `TEST_DATABASE_URL`, the MySQL ones `TEST_MYSQL_URL`; without
//! them they are reported as ignored.

use support::mysql_common;
use support::pg_common;

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tower::{Layer, ServiceExt};
use tower_idempotency::body::RequestBody;
use tower_idempotency::response::IDEMPOTENT_REPLAYED;
use tower_idempotency::store::IdempotencyStore;
use tower_idempotency::{IdempotencyLayer, InFlight};

/// The lock timeout: far longer than what the policies answer within, so that only the
/// policy can answer early.
const LOCK_TIMEOUT: Duration = Duration::from_secs(20);

/// A bound no test should come near for an answer given "at once".
const AT_ONCE: Duration = Duration::from_secs(2);

/// A handler that counts its runs and, while `held`, holds its request (and so the
/// transaction and the key's row) until the test releases it.
#[derive(Clone)]
struct Handler {
    runs: Arc<AtomicUsize>,
    entered: Arc<Semaphore>,
    release: Arc<Semaphore>,
}

impl Default for Handler {
    fn default() -> Self {
        Handler {
            runs: Arc::default(),
            entered: Arc::new(Semaphore::new(0)),
            release: Arc::new(Semaphore::new(0)),
        }
    }
}

impl Handler {
    async fn call(
        self,
        _request: Request<RequestBody>,
    ) -> Result<Response<Full<Bytes>>, Infallible> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        self.entered.add_permits(1);
        if let Ok(permit) = self.release.acquire().await {
            permit.forget();
        }
        Ok(Response::builder()
            .status(StatusCode::CREATED)
            .body(Full::new(Bytes::from_static(b"{\"order_id\":1}")))
            .unwrap_or_default())
    }

    /// Waits until a request is inside the handler (holding its transaction).
    async fn entered(&self) {
        tokio::time::timeout(AT_ONCE * 5, self.entered.acquire())
            .await
            .expect("the first request reached the handler")
            .expect("open semaphore")
            .forget();
    }

    fn release(&self) {
        self.release.add_permits(1);
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

/// What a request got, and how long it took.
struct Reply {
    status: StatusCode,
    retry_after: Option<String>,
    replayed: bool,
    took: Duration,
}

/// Sends one request with `key` through a layer on `store` under `policy`.
async fn send<St: IdempotencyStore>(
    store: &St,
    policy: InFlight,
    handler: &Handler,
    key: &str,
) -> Reply {
    let handler = handler.clone();
    let service = IdempotencyLayer::new(store.clone())
        .with_operation("create_order")
        .with_tenant_extractor(|_| Some("shop".into()))
        .with_lock_timeout(LOCK_TIMEOUT)
        .with_retry_after(Duration::from_secs(3))
        .with_in_flight(policy)
        .layer(tower::service_fn(move |request| {
            handler.clone().call(request)
        }));
    let request = Request::post("/orders")
        .header("idempotency-key", key)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from_static(b"{\"sku\":\"book\"}")))
        .expect("request");
    let started = Instant::now();
    let response = service.oneshot(request).await.expect("the layer answers");
    let took = started.elapsed();
    let header = |name| {
        response
            .headers()
            .get(name)
            .and_then(|value: &http::HeaderValue| value.to_str().ok())
            .map(str::to_owned)
    };
    let (retry_after, replayed) = (
        header(header::RETRY_AFTER),
        header(IDEMPOTENT_REPLAYED).as_deref() == Some("true"),
    );
    let status = response.status();
    drop(response.into_body().collect().await);
    Reply {
        status,
        retry_after,
        replayed,
        took,
    }
}

/// The first request with `key` on `first`, held in its handler until released.
async fn hold<St: IdempotencyStore>(
    first: &St,
    handler: &Handler,
    key: &'static str,
) -> tokio::task::JoinHandle<Reply> {
    let (store, handler_of_first) = (first.clone(), handler.clone());
    let task =
        tokio::spawn(async move { send(&store, InFlight::Wait, &handler_of_first, key).await });
    handler.entered().await;
    task
}

/// `Reject` on the second instance: `409` with `Retry-After` at once while the first holds
/// the key, a replay once it committed; the handler ran once.
async fn reject_across_instances<St: IdempotencyStore>(first: St, second: St) {
    let handler = Handler::default();
    let running = hold(&first, &handler, "reject").await;
    let duplicate = send(&second, InFlight::Reject, &handler, "reject").await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT);
    assert_eq!(duplicate.retry_after.as_deref(), Some("3"));
    assert!(duplicate.took < AT_ONCE, "answered in {:?}", duplicate.took);
    handler.release();
    let original = running.await.expect("the first request");
    assert_eq!(original.status, StatusCode::CREATED);
    let retry = send(&second, InFlight::Reject, &handler, "reject").await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed);
    assert_eq!(handler.runs(), 1);
}

/// `WaitUpTo(bound)` on the second instance: `409` after about `bound` while the first holds
/// the key past it; a replay when the first finishes within it; the handler ran once each.
async fn wait_up_to_across_instances<St: IdempotencyStore>(first: St, second: St, bound: Duration) {
    let policy = InFlight::WaitUpTo(bound);
    let handler = Handler::default();
    let running = hold(&first, &handler, "held-past-bound").await;
    let duplicate = send(&second, policy, &handler, "held-past-bound").await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT);
    assert_eq!(duplicate.retry_after.as_deref(), Some("3"));
    assert!(
        duplicate.took >= bound.mul_f32(0.9) && duplicate.took < bound + AT_ONCE,
        "answered in {:?}",
        duplicate.took
    );
    handler.release();
    assert_eq!(running.await.expect("first").status, StatusCode::CREATED);
    assert_eq!(handler.runs(), 1);

    let handler = Handler::default();
    let running = hold(&first, &handler, "done-within-bound").await;
    let releasing = {
        let handler = handler.clone();
        tokio::spawn(async move {
            tokio::time::sleep(bound / 4).await;
            handler.release();
        })
    };
    let duplicate = send(&second, policy, &handler, "done-within-bound").await;
    releasing.await.expect("release");
    assert_eq!(running.await.expect("first").status, StatusCode::CREATED);
    assert_eq!(duplicate.status, StatusCode::CREATED);
    assert!(duplicate.replayed);
    assert!(duplicate.took < bound, "answered in {:?}", duplicate.took);
    assert_eq!(handler.runs(), 1);
}

/// `Wait` (the default) on the second instance: the duplicate waits for the first and
/// replays its response; the handler ran once.
async fn wait_across_instances<St: IdempotencyStore>(first: St, second: St) {
    const HELD: Duration = Duration::from_millis(1500);
    let handler = Handler::default();
    let running = hold(&first, &handler, "wait").await;
    let releasing = {
        let handler = handler.clone();
        tokio::spawn(async move {
            tokio::time::sleep(HELD).await;
            handler.release();
        })
    };
    let duplicate = send(&second, InFlight::Wait, &handler, "wait").await;
    releasing.await.expect("release");
    assert_eq!(running.await.expect("first").status, StatusCode::CREATED);
    assert_eq!(duplicate.status, StatusCode::CREATED);
    assert!(duplicate.replayed);
    assert!(
        duplicate.took >= HELD.mul_f32(0.8),
        "answered in {:?}",
        duplicate.took
    );
    assert_eq!(handler.runs(), 1);
}

/// A bound under a second for the PostgreSQL stores (`lock_timeout` counts milliseconds).
const PG_BOUND: Duration = Duration::from_millis(600);

/// MySQL's `innodb_lock_wait_timeout` counts whole seconds: a bound of one.
const MYSQL_BOUND: Duration = Duration::from_secs(1);

/// The three policies' tests for one driver, on the stores its `two_instances()` opens (`None`
/// without the server), registered as needing `$server` (`postgres` or `mysql`).
macro_rules! across_instances {
    ($server:ident, $bound:expr) => {
        test! { reject_answers_409_at_once_across_instances, $server }
        async fn reject_answers_409_at_once_across_instances() {
            let Some((_db, [first, second])) = two_instances().await else {
                return;
            };
            reject_across_instances(first, second).await;
        }

        test! { wait_up_to_answers_409_after_its_bound_across_instances, $server }
        async fn wait_up_to_answers_409_after_its_bound_across_instances() {
            let Some((_db, [first, second])) = two_instances().await else {
                return;
            };
            wait_up_to_across_instances(first, second, $bound).await;
        }

        test! { wait_replays_across_instances, $server }
        async fn wait_replays_across_instances() {
            let Some((_db, [first, second])) = two_instances().await else {
                return;
            };
            wait_across_instances(first, second).await;
        }
    };
}

mod tokio_postgres_store {
    use super::*;
    use pg_common::TestDb;
    use tower_idempotency::store::tokio_postgres::PostgresStore;

    async fn two_instances() -> Option<(TestDb, [PostgresStore; 2])> {
        let db = TestDb::create().await?;
        let stores = [db.store().await, db.store().await];
        Some((db, stores))
    }

    across_instances!(postgres, PG_BOUND);
}

mod sqlx_postgres_store {
    use super::*;
    use pg_common::TestDb;
    use tower_idempotency::store::sqlx_postgres::SqlxPostgresStore;

    async fn two_instances() -> Option<(TestDb, [SqlxPostgresStore; 2])> {
        let db = TestDb::create().await?;
        let stores = [db.sqlx_store(4, 2).await, db.sqlx_store(4, 2).await];
        Some((db, stores))
    }

    across_instances!(postgres, PG_BOUND);
}

mod sqlx_mysql_store {
    use super::*;
    use mysql_common::TestDb;
    use tower_idempotency::store::sqlx_mysql::SqlxMySqlStore;

    async fn two_instances() -> Option<(TestDb, [SqlxMySqlStore; 2])> {
        let db = TestDb::create().await?;
        let stores = [db.store(4).await, db.store(4).await];
        Some((db, stores))
    }

    across_instances!(mysql, MYSQL_BOUND);
}
