//! The sqlx PostgreSQL store on a real PostgreSQL (`TEST_DATABASE_URL`), through its public
//! API, each test in a schema of its own: the round trips a new key costs (counted by a proxy
//! between the pools and the server), a store whose idle connections the server ended, the
//! lock timeout a handler gets under an in-flight bound, and the values the store writes into
//! its SQL as literals, read back as they were.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header::HeaderName;
use http::{HeaderValue, StatusCode};
use proptest::prelude::*;
use proptest::test_runner::{TestCaseError, TestRunner};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::key::IdempotencyKey;
use tower_idempotency::response::SavedResponse;
use tower_idempotency::store::sqlx_postgres::sqlx::postgres::{
    PgConnectOptions, PgPoolOptions, PgSslMode,
};
use tower_idempotency::store::sqlx_postgres::{sqlx, SqlxPostgresStore};
use tower_idempotency::store::{
    Begin, IdempotencyStore, NewRecord, ReplayCheck, Reservation, RunOutcome, Scope,
};
use tower_idempotency::{Error, InFlight};

use support::pg_common::TestDb;

type SqlxReservation = <SqlxPostgresStore as IdempotencyStore>::Reservation;

/// `key` of `tenant` on the operation `create_order`.
fn tenant_scope(tenant: &str, key: &str) -> Scope {
    let key = IdempotencyKey::parse(key.as_bytes(), 128).expect("key");
    Scope::new(tenant, "create_order", key)
}

/// `key` of the tenant `shop`.
fn scope(key: &str) -> Scope {
    tenant_scope("shop", key)
}

/// A `201` with the body `{}`, saved now for an hour.
fn record() -> NewRecord {
    let now = SystemTime::now();
    let response = SavedResponse::new(StatusCode::CREATED, Vec::new(), Bytes::from_static(b"{}"));
    let fingerprint = Fingerprint::new(2, [7; 32]);
    NewRecord::new(fingerprint, response, now, now + Duration::from_secs(3600))
}

/// The schema's connection settings, without TLS (the counting proxy reads the messages).
fn options(db: &TestDb) -> PgConnectOptions {
    db.sqlx_options().ssl_mode(PgSslMode::Disable)
}

/// A store on pools of one connection each (so that each request reuses the same two
/// connections, their statements already prepared), with sqlx's default pool checks, whose
/// first attempts always check the read pool first (`ReplayCheck::FavorReplays`).
fn store(options: PgConnectOptions) -> SqlxPostgresStore {
    store_of(options, 1, ReplayCheck::FavorReplays)
}

/// The same with a write pool of up to `connections` (opened as needed) and `check`.
fn store_of(options: PgConnectOptions, connections: u32, check: ReplayCheck) -> SqlxPostgresStore {
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .connect_lazy_with(options);
    SqlxPostgresStore::builder(pool)
        .with_max_read_connections(1)
        .with_replay_check(check)
        .build()
}

/// A new key through the store as the layer drives it: the fast-path lookup, `begin`, and
/// `commit` of the record.
async fn new_key(store: &SqlxPostgresStore, scope: &Scope) {
    let outcome = store
        .lookup_then_begin_and_run(
            scope,
            Duration::from_secs(5),
            SystemTime::now(),
            |reservation: SqlxReservation| async move {
                reservation.commit(record()).await.expect("commit");
            },
        )
        .await
        .expect("first attempt");
    assert!(
        matches!(outcome, RunOutcome::Ran { .. }),
        "a fresh key has no record"
    );
}

/// What a proxy saw its clients send.
#[derive(Default)]
struct Seen {
    /// Round trips that run statements: each simple query (`Q`), and each `Sync` (`S`) that
    /// ends an extended-protocol exchange (`Parse`, `Bind`, `Execute`...).
    statements: AtomicUsize,
    /// Bare `Sync`s: sqlx's ping (on `acquire` with `test_before_acquire`, and on every release
    /// to the pool, in a task of its own).
    pings: AtomicUsize,
}

impl Seen {
    fn now(&self) -> (usize, usize) {
        (
            self.statements.load(Ordering::SeqCst),
            self.pings.load(Ordering::SeqCst),
        )
    }
}

/// A proxy to `upstream` that counts the round trips its clients start (see [`Seen`]).
async fn counting_proxy(upstream: SocketAddr) -> (SocketAddr, Arc<Seen>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let seen = Arc::new(Seen::default());
    let counter = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(upstream).await else {
                continue;
            };
            let counter = Arc::clone(&counter);
            tokio::spawn(async move {
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_server, mut to_server) = server.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
                });
                let _ = relay_counting(&mut from_client, &mut to_server, &counter).await;
            });
        }
    });
    (address, seen)
}

/// Copies the client's messages to the server, counting them into `seen`. The first message
/// (the startup message, TLS being off) has no type byte.
async fn relay_counting(
    from: &mut tokio::net::tcp::OwnedReadHalf,
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    seen: &Seen,
) -> std::io::Result<()> {
    let mut length = [0; 4];
    from.read_exact(&mut length).await?;
    let mut startup = vec![0; (u32::from_be_bytes(length) as usize).saturating_sub(4)];
    from.read_exact(&mut startup).await?;
    to.write_all(&length).await?;
    to.write_all(&startup).await?;
    let mut extended = false;
    loop {
        let mut head = [0; 5];
        from.read_exact(&mut head).await?;
        let length = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        let mut body = vec![0; length.saturating_sub(4)];
        from.read_exact(&mut body).await?;
        match head[0] {
            b'Q' => {
                seen.statements.fetch_add(1, Ordering::SeqCst);
            }
            b'S' if extended => {
                seen.statements.fetch_add(1, Ordering::SeqCst);
                extended = false;
            }
            b'S' => {
                seen.pings.fetch_add(1, Ordering::SeqCst);
            }
            b'X' => {}
            _ => extended = true,
        }
        to.write_all(&head).await?;
        to.write_all(&body).await?;
    }
}

/// Waits until both pools have every connection they opened back (sqlx pings each connection
/// given back, in a task of its own, before it is idle again).
async fn settled(store: &SqlxPostgresStore) {
    let all_idle = |pool: &sqlx::PgPool| pool.num_idle() == pool.size() as usize;
    for _ in 0..500 {
        if all_idle(store.pool()) && all_idle(store.read_pool()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("the pools did not get their connections back");
}

/// The round trips (statements, pings) of a new key, from settled pools to settled pools.
async fn counted(store: &SqlxPostgresStore, seen: &Seen, scope: &Scope) -> (usize, usize) {
    settled(store).await;
    let before = seen.now();
    new_key(store, scope).await;
    settled(store).await;
    let after = seen.now();
    (after.0 - before.0, after.1 - before.1)
}

async fn upstream(options: &PgConnectOptions) -> SocketAddr {
    tokio::net::lookup_host((options.get_host(), options.get_port()))
        .await
        .expect("host")
        .next()
        .expect("address")
}

test! { a_new_key_costs_three_round_trips, postgres }
/// Lookup, `BEGIN` with the reservation, the completed record with `COMMIT`: three round trips
/// for a new key on warm connections, and no ping on the request's path though the pool's
/// `test_before_acquire` is on (sqlx's ping when each connection goes back to its pool
/// remains: two). A scope that is not plain ASCII (a tenant: keys are ASCII) takes two more:
/// its `INSERT` and its completed record go with bind parameters, each in a round trip of its
/// own. Under `ReplayCheck::Adaptive` (the default), with no retry seen, the lookup is skipped:
/// one round trip and one ping less.
async fn a_new_key_costs_three_round_trips() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let options = options(&db);
    let (proxy, seen) = counting_proxy(upstream(&options).await).await;
    let proxied = options.clone().host("127.0.0.1").port(proxy.port());
    let store = store(proxied.clone());
    assert!(store.pool().options().get_test_before_acquire());
    store.migrate().await.expect("migrate");
    // Both connections open, and their statements prepared (the first `INSERT` with
    // parameters too).
    new_key(&store, &scope("warm-up")).await;
    new_key(&store, &tenant_scope("café", "warm-up")).await;

    let ascii = counted(&store, &seen, &scope("counted")).await;
    let not_ascii = counted(&store, &seen, &tenant_scope("café", "counted")).await;
    store.pool().close().await;
    store.read_pool().close().await;

    let adaptive = store_of(proxied, 1, ReplayCheck::Adaptive);
    new_key(&adaptive, &scope("warm-up-adaptive")).await;
    new_key(&adaptive, &tenant_scope("café", "warm-up-adaptive")).await;
    let adaptive_ascii = counted(&adaptive, &seen, &scope("adaptive")).await;
    let adaptive_not_ascii = counted(&adaptive, &seen, &tenant_scope("café", "adaptive")).await;
    adaptive.pool().close().await;
    adaptive.read_pool().close().await;
    assert_eq!(
        ascii,
        (3, 2),
        "round trips (statements, pings) of a new key"
    );
    assert_eq!(
        not_ascii,
        (5, 2),
        "the same with a tenant that is not ASCII"
    );
    assert_eq!(adaptive_ascii, (2, 1), "the same without the lookup");
    assert_eq!(
        adaptive_not_ascii,
        (4, 1),
        "the same without the lookup, with a tenant that is not ASCII"
    );
}

test! { idle_connections_the_server_ended_are_replaced, postgres }
/// The server ended both pools' idle connections (a restart, an idle timeout of a proxy): the
/// lookup and `begin` find out at their first statement and go on, on fresh connections.
async fn idle_connections_the_server_ended_are_replaced() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let store = store(options(&db));
    store.migrate().await.expect("migrate");
    new_key(&store, &scope("before")).await;
    let pid = "SELECT pg_backend_pid()";
    let writer: i32 = sqlx::query_scalar(pid)
        .fetch_one(store.pool())
        .await
        .expect("pid");
    let reader: i32 = sqlx::query_scalar(pid)
        .fetch_one(store.read_pool())
        .await
        .expect("pid");
    let admin = db.client().await;
    for backend in [writer, reader] {
        admin
            .execute("SELECT pg_terminate_backend($1)", &[&backend])
            .await
            .expect("terminate");
    }
    for _ in 0..100 {
        let alive: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)",
                &[&vec![writer, reader]],
            )
            .await
            .expect("activity")
            .get(0);
        if alive == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(store.pool().num_idle(), 1, "the dead connection is idle");

    new_key(&store, &scope("after")).await;

    store.pool().close().await;
    store.read_pool().close().await;
}

test! { an_in_flight_bound_is_lifted_for_the_handler_in_the_same_round_trip, postgres }
/// Under an in-flight policy (the layer bounds its store's wait for a duplicate with
/// `bound_duplicate_wait`) the reservation waits on the key's row only up to the policy's
/// bound, and its statement sets the lock timeout back for the handler: the same three round
/// trips, and the handler's `lock_timeout` is what is left of the layer's, not the bound.
async fn an_in_flight_bound_is_lifted_for_the_handler_in_the_same_round_trip() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let options = options(&db);
    let (proxy, seen) = counting_proxy(upstream(&options).await).await;
    let proxied = options.clone().host("127.0.0.1").port(proxy.port());
    // Two connections: the duplicate below needs its own.
    let store =
        store_of(proxied, 2, ReplayCheck::FavorReplays).bound_duplicate_wait(InFlight::Reject);
    store.migrate().await.expect("migrate");
    new_key(&store, &scope("warm-up")).await;
    let counted = counted(&store, &seen, &scope("counted")).await;

    let scope = scope("lock-timeout");
    let begun = store
        .begin(&scope, Duration::from_secs(5), SystemTime::now())
        .await
        .expect("begin");
    let Begin::Reserved(reservation) = begun else {
        panic!("a fresh key has no record");
    };
    let handle = reservation.handle();
    let mut conn = handle.acquire().await.expect("connection");
    let shown: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&mut *conn)
        .await
        .expect("SHOW");
    drop(conn);
    // A held key: the duplicate is refused at once, not after the lock timeout.
    let duplicate = store
        .begin(&scope, Duration::from_secs(5), SystemTime::now())
        .await;
    reservation.commit(record()).await.expect("commit");

    store.pool().close().await;
    store.read_pool().close().await;
    assert_eq!(
        counted,
        (3, 2),
        "round trips (statements, pings) of a new key"
    );
    let millis: u64 = match shown.strip_suffix("ms") {
        Some(ms) => ms.parse().expect("ms"),
        None => {
            shown
                .strip_suffix('s')
                .expect("s")
                .parse::<u64>()
                .expect("s")
                * 1000
        }
    };
    assert!((4000..=5000).contains(&millis), "lock_timeout {shown}");
    assert!(matches!(duplicate, Err(Error::InFlight)), "{duplicate:?}");
}

/// Text the store may write into SQL: anything, and ASCII full of what a literal must escape.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[\\\\'\"a-zA-Z0-9 ;$\\-\\x01-\\x1f\\x7f]{0,40}",
        "(\\\\|'|E'|\\$\\$|\\\\x41|\\\\u0041|\\\\0|\\n)*",
    ]
    // PostgreSQL text cannot hold NUL (the store refuses a scope with one).
    .prop_map(|text| text.replace('\0', ""))
}

/// A header value with the characters a literal must escape.
fn header_value() -> impl Strategy<Value = HeaderValue> {
    "[ -~]{0,40}".prop_map(|value| HeaderValue::from_str(&value).expect("visible ASCII"))
}

test! { values_written_into_sql_read_back_as_they_were, sync, postgres }
/// The store writes a reservation's scope, and a record's fingerprint, headers, body and
/// trailers, into its SQL as literals when they are plain ASCII (and as bind parameters
/// otherwise): whatever the values (without NUL, which PostgreSQL text cannot hold), the server
/// reads them as they were. The scope is found in the table with bind parameters, and the
/// replay gives back the record; under either setting of `standard_conforming_strings`.
fn values_written_into_sql_read_back_as_they_were() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    // The pools start their tasks on it.
    let _runtime = runtime.enter();
    let Some(db) = runtime.block_on(TestDb::create()) else {
        return;
    };
    let admin = runtime.block_on(db.client());
    let case = (
        (text(), text(), "[!-~]{1,60}"),
        (header_value(), header_value()),
        proptest::collection::vec(any::<u8>(), 0..300),
        any::<[u8; 32]>(),
    );
    let cases = std::cell::Cell::new(0);
    for setting in ["on", "off"] {
        let pool = PgPoolOptions::new().max_connections(1).connect_lazy_with(
            db.sqlx_options()
                .options([("standard_conforming_strings", setting)]),
        );
        let store = SqlxPostgresStore::builder(pool)
            .with_max_read_connections(1)
            .build();
        runtime.block_on(store.migrate()).expect("migrate");
        let shown: String = runtime
            .block_on(
                sqlx::query_scalar("SHOW standard_conforming_strings").fetch_one(store.pool()),
            )
            .expect("SHOW");
        assert_eq!(shown, setting);
        let mut runner = TestRunner::new(ProptestConfig {
            cases: 256,
            // A failing case is printed; there is no source file to keep it in.
            failure_persistence: None,
            ..ProptestConfig::default()
        });
        runner
            .run(
                &case,
                |((tenant, operation, token), (header, trailer), body, digest)| {
                    cases.set(cases.get() + 1);
                    // Unique, so that every case reserves a fresh scope.
                    let key = format!("{}.{token}", cases.get());
                    let scope = Scope::new(
                        tenant.as_str(),
                        operation.as_str(),
                        IdempotencyKey::parse(key.as_bytes(), 128).expect("key"),
                    );
                    let response = SavedResponse::new(
                        StatusCode::CREATED,
                        vec![(HeaderName::from_static("x-value"), header)],
                        Bytes::from(body),
                    )
                    .with_trailers(vec![(HeaderName::from_static("grpc-message"), trailer)]);
                    let now = SystemTime::now();
                    let fingerprint = Fingerprint::new(1, digest);
                    let record = NewRecord::new(
                        fingerprint,
                        response.clone(),
                        now,
                        now + Duration::from_secs(3600),
                    );
                    let fail = |what: &str, error: &dyn std::fmt::Debug| {
                        TestCaseError::fail(format!("{what}: {error:?}"))
                    };
                    let replayed = runtime.block_on(async {
                        match store.begin(&scope, Duration::from_secs(5), now).await {
                            Ok(Begin::Reserved(reservation)) => reservation
                                .commit(record)
                                .await
                                .map_err(|error| fail("commit", &error))?,
                            Ok(Begin::Existing(_)) => {
                                return Err(TestCaseError::fail("a fresh scope has a record"))
                            }
                            Err(error) => return Err(fail("begin", &error)),
                        }
                        store
                            .lookup(&scope, SystemTime::now())
                            .await
                            .map_err(|error| fail("lookup", &error))
                    })?;
                    let found: i64 = runtime
                        .block_on(admin.query_one(
                            "SELECT count(*) FROM idempotency_records \
                         WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3",
                            &[&tenant, &operation, &key],
                        ))
                        .map_err(|error| fail("count", &error))?
                        .get(0);
                    prop_assert_eq!(found, 1, "the scope as it was written");
                    let replayed = replayed.ok_or_else(|| TestCaseError::fail("no record"))?;
                    prop_assert_eq!(replayed.fingerprint.digest(), fingerprint.digest());
                    prop_assert_eq!(replayed.response, response);
                    Ok(())
                },
            )
            .unwrap();
    }
}
