//! The `--demo` of the order examples: the article's retry lab, run over the network against
//! the example's own app on a fresh SQLite file. Each example brings a client for its protocol
//! ([`Shop`]); the six steps, their checks and the six lines printed are the same. Each
//! example's demo module includes it with `#[path]`, beside its client.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{oneshot, Barrier};
use tower_idempotency::body::BoxError;
use tower_idempotency::store::sqlite::SqliteStore;

/// A client of the order API, as the lab drives it.
pub trait Shop: Clone + Send + Sync + 'static {
    /// Places the order of `attempt`.
    fn create_order(
        &self,
        attempt: Attempt,
    ) -> impl Future<Output = Result<Reply, BoxError>> + Send;
}

/// An order the lab places: `quantity` books, as the tenant of `token`, with this
/// `Idempotency-Key`.
#[derive(Clone, Copy, Debug)]
pub struct Attempt {
    pub token: &'static str,
    pub key: &'static str,
    pub quantity: i64,
}

fn attempt(token: &'static str, key: &'static str, quantity: i64) -> Attempt {
    Attempt {
        token,
        key,
        quantity,
    }
}

/// What the lab looks at in an answer.
#[derive(Debug)]
pub struct Reply {
    pub outcome: Outcome,
    /// `Idempotent-Replayed: true` (or the gRPC metadata entry) was on the answer.
    pub replayed: bool,
    /// What a replay must repeat exactly: the status, body and `Location` of an HTTP answer,
    /// the order id of a gRPC one.
    pub answer: String,
    /// `201 {"order_id":1}`, as the lab prints it.
    pub summary: String,
}

/// The answers the lab expects, each in its protocol's terms.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// `201` over HTTP, `OK` over gRPC.
    Created,
    /// `409 {"error":"key_reused_with_different_payload"}`, or `FAILED_PRECONDITION` with that
    /// message.
    KeyReused,
    /// `500 {"error":"internal_error"}`, or `INTERNAL` with that message.
    Internal,
    /// Anything else.
    Other,
}

/// Stops a server that [`demo`] started.
pub type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Opens the store with `open` on a fresh file in a temporary directory, serves the app on it
/// with `serve` on an ephemeral loopback port (until the [`Shutdown`] it is given resolves),
/// runs the lab with the client `connect` makes for that address, and stops the server. A bug
/// that makes a request hang fails the demo rather than hang it.
pub async fn demo<C, O, S, E, K>(
    open: impl FnOnce(PathBuf) -> O,
    serve: impl FnOnce(TcpListener, SqliteStore, Shutdown) -> S,
    connect: impl FnOnce(SocketAddr) -> K,
) -> Result<(), BoxError>
where
    C: Shop,
    O: Future<Output = Result<SqliteStore, BoxError>>,
    S: Future<Output = Result<(), E>> + Send + 'static,
    E: Into<BoxError> + Send + 'static,
    K: Future<Output = Result<C, BoxError>>,
{
    let dir = tempfile::tempdir()?;
    let store = open(dir.path().join("orders.db")).await?;
    let (listener, addr) = crate::cli::listen("127.0.0.1:0").await?;
    let connect = connect(addr);
    let (stop, stopped) = oneshot::channel::<()>();
    let shutdown = Box::pin(async {
        let _ = stopped.await;
    });
    let server = tokio::spawn(serve(listener, store.clone(), shutdown));
    let lab = tokio::time::timeout(Duration::from_secs(30), async {
        let client = connect.await?;
        run_lab(&client, &store).await
        // The client is dropped here, closing its idle connections, so that the graceful
        // shutdown does not wait for them.
    })
    .await
    .unwrap_or_else(|_| Err("the lab did not finish within 30 s".into()));

    let _ = stop.send(());
    server.await?.map_err(Into::<BoxError>::into)?;
    lab.map_err(|error| format!("demo failed: {error}").into())
}

/// Fails the demo with a message when a condition does not hold.
macro_rules! ensure {
    ($condition:expr, $($message:tt)+) => {
        if !$condition {
            return Err(format!($($message)+).into());
        }
    };
}

async fn run_lab(client: &impl Shop, store: &SqliteStore) -> Result<(), BoxError> {
    const SHOP_A: &str = "shop-a-token";
    const SHOP_B: &str = "shop-b-token";

    // 1. The first response is lost on the way; the client retries with the same key.
    let first = client.create_order(attempt(SHOP_A, "key-1", 1)).await?;
    let retry = client.create_order(attempt(SHOP_A, "key-1", 1)).await?;
    ensure!(
        first.outcome == Outcome::Created && !first.replayed,
        "first request: expected a fresh order, got {first:?}"
    );
    ensure!(
        retry.replayed && retry.outcome == Outcome::Created && retry.answer == first.answer,
        "retry: expected a replay of {first:?}, got {retry:?}"
    );
    let orders = expect_orders(store, 1).await?;
    println!("retry: {} orders={orders}", retry.summary);

    // 2. Same key, different payload: refused, nothing changes.
    let conflict = client.create_order(attempt(SHOP_A, "key-1", 2)).await?;
    ensure!(
        conflict.outcome == Outcome::KeyReused,
        "changed payload: expected key_reused_with_different_payload, got {conflict:?}"
    );
    let orders = expect_orders(store, 1).await?;
    println!("changed payload: {} orders={orders}", conflict.summary);

    // 3. Another tenant may use the same key: it is a different scope.
    let other = client.create_order(attempt(SHOP_B, "key-1", 1)).await?;
    ensure!(
        other.outcome == Outcome::Created && !other.replayed && other.answer != first.answer,
        "other tenant: expected a new order, got {other:?}"
    );
    let orders = expect_orders(store, 2).await?;
    println!("other tenant: {} orders={orders}", other.summary);

    // 4. Two copies of one request in flight at once: exactly one runs the handler, the other
    //    gets its response.
    let barrier = Arc::new(Barrier::new(2));
    let spawn_copy = || {
        let (client, barrier) = (client.clone(), barrier.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            client.create_order(attempt(SHOP_A, "key-2", 1)).await
        })
    };
    let (a, b) = (spawn_copy(), spawn_copy());
    let (a, b) = (a.await??, b.await??);
    ensure!(
        a.outcome == Outcome::Created && b.outcome == Outcome::Created && a.answer == b.answer,
        "concurrent retry: expected the same order twice, got {a:?} and {b:?}"
    );
    ensure!(
        a.replayed != b.replayed,
        "concurrent retry: expected exactly one replay, got {a:?} and {b:?}"
    );
    let orders = expect_orders(store, 3).await?;
    println!("concurrent retry: {} orders={orders}", a.summary);

    // 5. Saving the response fails after the handler inserted its order: both roll back.
    store
        .write(|tx| {
            tx.execute_batch(
                "CREATE TRIGGER fail_replay BEFORE INSERT ON idempotency_records \
                 WHEN NEW.idempotency_key = 'key-3' \
                 BEGIN SELECT RAISE(ABORT, 'injected replay failure'); END;",
            )
        })
        .await?;
    let failed = client.create_order(attempt(SHOP_A, "key-3", 1)).await?;
    ensure!(
        failed.outcome == Outcome::Internal,
        "injected failure: expected internal_error, got {failed:?}"
    );
    let records = store
        .read(|conn| {
            conn.query_row(
                "SELECT count(*) FROM idempotency_records WHERE idempotency_key = 'key-3'",
                [],
                |row| row.get::<_, i64>(0),
            )
        })
        .await?;
    ensure!(
        records == 0,
        "injected failure: expected no saved record for key-3, found {records}"
    );
    let orders = expect_orders(store, 3).await?;
    println!("injected failure: rolled back, orders={orders}");

    // 6. Nothing was kept for key-3, so once the fault is gone the same key runs afresh.
    store
        .write(|tx| tx.execute_batch("DROP TRIGGER fail_replay"))
        .await?;
    let recovered = client.create_order(attempt(SHOP_A, "key-3", 1)).await?;
    ensure!(
        recovered.outcome == Outcome::Created && !recovered.replayed,
        "retry after rollback: expected a fresh order, got {recovered:?}"
    );
    let orders = expect_orders(store, 4).await?;
    println!(
        "retry after rollback: {} orders={orders}",
        recovered.summary
    );
    Ok(())
}

/// Counts the orders (through the store, as any reader would) and checks the count.
async fn expect_orders(store: &SqliteStore, expected: i64) -> Result<i64, BoxError> {
    let orders = store
        .read(|conn| conn.query_row("SELECT count(*) FROM orders", [], |row| row.get(0)))
        .await?;
    ensure!(
        orders == expected,
        "expected {expected} orders in the database, found {orders}"
    );
    Ok(orders)
}
