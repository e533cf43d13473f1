//! The order service over gRPC (tonic), with `CreateOrder` safe to retry.
//!
//! The same guarantees as the HTTP example (`examples/orders.rs`), on a tonic server: the client
//! sends an `idempotency-key` metadata entry with each new order (metadata entries are HTTP/2
//! headers, so the layer reads it as it reads the HTTP header); the handler inserts the order
//! through the transaction handle the layer put in the request extensions, so the order row
//! and the saved response (body frames plus the `grpc-status` trailers) commit together. A
//! retry with the same key gets the same `CreateOrderResponse` back, with
//! `idempotent-replayed: true` metadata, and never creates a second order.
//!
//! ```text
//! cargo run --example grpc_orders                # serves on 127.0.0.1:50051, database ./grpc_orders.db
//! cargo run --example grpc_orders -- --demo      # runs the retry lab against itself and exits
//! cargo run --example grpc_orders -- --help
//! ```
//!
//! With `grpcurl` (it needs the schema: `-import-path proto -proto orders.proto`):
//!
//! ```text
//! grpcurl -plaintext -import-path proto -proto orders.proto \
//!     -H 'authorization: Bearer shop-a-token' -H 'idempotency-key: key-1' \
//!     -d '{"sku":"book","quantity":1}' 127.0.0.1:50051 orders.Orders/CreateOrder
//! ```
//!
//! Layer rejections reach gRPC clients as gRPC statuses: a missing or malformed key is
//! `INVALID_ARGUMENT`, a key reused with another request `FAILED_PRECONDITION`, a busy store
//! `UNAVAILABLE`, a request too large `RESOURCE_EXHAUSTED`, no tenant `UNAUTHENTICATED`; the
//! status message is the code the HTTP API puts in `{"error": ...}`.
//!
//! Logs go to stderr; set `RUST_LOG` (default `warn`) to see more.
//!
//! (`tests/grpc.rs` includes this file as a module and serves it in-process: the items it uses
//! are `pub(crate)`.)

use std::error::Error;
use std::future::Future;
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{oneshot, Barrier};
use tonic::metadata::MetadataValue;
use tonic::service::InterceptorLayer;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Code, Request, Response, Status};
use tower_idempotency::response::IDEMPOTENT_REPLAYED;
use tower_idempotency::store::continuously_purge_expired;
use tower_idempotency::store::sqlite::rusqlite::OptionalExtension;
use tower_idempotency::store::sqlite::{SqliteStore, SqliteTransaction};
use tower_idempotency::{IdempotencyLayer, Tenant};

use pb::orders_client::OrdersClient;
use pb::orders_server::{Orders, OrdersServer};
use pb::{CreateOrderRequest, CreateOrderResponse, GetOrderRequest, ListOrdersRequest, Order};

/// The code generated from `proto/orders.proto`.
///
/// Checked in (so that building the example needs no `protoc`) and kept current by the test
/// `generated_code_is_current` in `tests/grpc.rs`. Included rather than declared as a module
/// file so that rustfmt leaves it exactly as generated.
#[allow(clippy::all, clippy::pedantic)]
pub(crate) mod pb {
    include!("grpc/orders.rs");
}

type BoxError = Box<dyn Error + Send + Sync>;

const USAGE: &str = "\
usage: grpc_orders [--addr ADDR] [--db PATH]
       grpc_orders --demo

  --addr ADDR   address to listen on (default 127.0.0.1:50051)
  --db PATH     SQLite database for orders and idempotency records (default ./grpc_orders.db)
  --demo        serve on an ephemeral loopback port with a fresh database, run the retry
                lab against it with a tonic client, print its six lines and exit
  -h, --help    show this help";

/// The only RPC the idempotency layer handles. Every gRPC call is an HTTP/2 `POST`, so the
/// layer, which wraps the whole server, is told which path is the one to make idempotent.
pub(crate) const CREATE_ORDER_PATH: &str = "/orders.Orders/CreateOrder";

/// The business table, in the same database file as `idempotency_records`: that is what lets
/// an order and its saved response commit in one transaction. The same table as the HTTP
/// example's; the default file is another one (`grpc_orders.db`) so that the two examples can
/// run side by side without mixing their orders.
const ORDERS_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS orders (
    id        INTEGER PRIMARY KEY,
    tenant_id TEXT    NOT NULL,
    sku       TEXT    NOT NULL,
    quantity  INTEGER NOT NULL
);";

#[tokio::main]
async fn main() -> ExitCode {
    // Logs on stderr, so that stdout carries only what the program is asked to print.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();

    let command = match Command::parse(std::env::args().skip(1)) {
        Ok(command) => command,
        Err(message) => {
            eprintln!("grpc_orders: {message}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let outcome = match command {
        Command::Help => {
            println!("{USAGE}");
            Ok(())
        }
        Command::Serve { addr, db } => serve(&addr, &db).await,
        Command::Demo => demo().await,
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("grpc_orders: {error}");
            ExitCode::FAILURE
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------------------------

enum Command {
    Help,
    Serve { addr: String, db: PathBuf },
    Demo,
}

impl Command {
    /// Hand-parsed, like the HTTP example: three flags do not justify a dependency.
    fn parse(mut args: impl Iterator<Item = String>) -> Result<Self, String> {
        let mut addr = None;
        let mut db = None;
        let mut demo = false;
        while let Some(arg) = args.next() {
            // Accept both `--addr VALUE` and `--addr=VALUE`.
            let (flag, inline) = match arg.split_once('=') {
                Some((flag, value)) if flag.starts_with("--") => (flag, Some(value.to_owned())),
                _ => (arg.as_str(), None),
            };
            let mut value = || {
                inline
                    .clone()
                    .or_else(|| args.next())
                    .ok_or_else(|| format!("{flag} needs a value"))
            };
            match flag {
                "-h" | "--help" => return Ok(Command::Help),
                "--addr" => addr = Some(value()?),
                "--db" => db = Some(PathBuf::from(value()?)),
                "--demo" if inline.is_none() => demo = true,
                _ => return Err(format!("unknown argument `{arg}`")),
            }
        }
        match (demo, addr.is_some() || db.is_some()) {
            (true, true) => Err("--demo picks its own address and database".into()),
            (true, false) => Ok(Command::Demo),
            (false, _) => Ok(Command::Serve {
                addr: addr.unwrap_or_else(|| "127.0.0.1:50051".into()),
                db: db.unwrap_or_else(|| "grpc_orders.db".into()),
            }),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The app
// ---------------------------------------------------------------------------------------------

/// Opens the store and creates the `orders` table next to the idempotency records.
pub(crate) async fn open_store(db: &Path) -> Result<SqliteStore, BoxError> {
    let store = SqliteStore::open(db)
        .await
        .map_err(|error| format!("cannot open {}: {error}", db.display()))?;
    store.write(|tx| tx.execute_batch(ORDERS_SCHEMA)).await?;
    Ok(store)
}

/// The idempotency layer of the app, around the whole tonic server.
///
/// The default fingerprint of a gRPC request is its method, path and raw body (the
/// length-prefixed protobuf message), which is stable: prost encodes a message the same way
/// every time.
pub(crate) fn idempotency_layer(store: SqliteStore) -> IdempotencyLayer<SqliteStore> {
    IdempotencyLayer::new(store)
        // Name the operation so that records survive a change of service or package name.
        .with_operation("create_order")
        // Only `CreateOrder` is handled. `GetOrder` is a read, idempotent by itself, and
        // `ListOrders` a server stream: a stream cannot be replayed from a bounded buffer, so
        // it passes through untouched. Both are POSTs, like every gRPC call.
        .with_filter(|parts| parts.uri.path() == CREATE_ORDER_PATH)
}

/// Demo authentication: a fixed token per tenant, from the `authorization` metadata.
///
/// A tonic interceptor, but installed with [`InterceptorLayer`] as a tower layer *outside* the
/// idempotency layer: it must run first, since the layer scopes every record by the [`Tenant`]
/// it finds in the request extensions (an interceptor on the generated service would run after
/// the layer, too late). A real app verifies a signed token here; what matters is that the
/// tenant comes from the server, never from metadata the client picks freely.
pub(crate) fn authenticate(mut request: Request<()>) -> Result<Request<()>, Status> {
    let tenant = match request
        .metadata()
        .get("authorization")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
    {
        Some("shop-a-token") => Tenant::new("shop-a"),
        Some("shop-b-token") => Tenant::new("shop-b"),
        _ => return Err(Status::unauthenticated("unauthenticated")),
    };
    // Tonic hands these extensions back to the http request, where the layer looks.
    request.extensions_mut().insert(tenant);
    Ok(request)
}

/// Serves the app on `listener` until `shutdown` resolves: authentication, then the
/// idempotency `layer`, around the `orders` service.
pub(crate) async fn serve_on<S: Orders>(
    listener: TcpListener,
    layer: IdempotencyLayer<SqliteStore>,
    orders: S,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    Server::builder()
        // Layers added first are outermost: authentication runs before idempotency.
        .layer(InterceptorLayer::new(authenticate))
        .layer(layer)
        .add_service(OrdersServer::new(orders))
        .serve_with_incoming_shutdown(TcpIncoming::from(listener), shutdown)
        .await
}

/// The `Orders` service.
#[derive(Clone, Debug)]
pub(crate) struct OrderService {
    store: SqliteStore,
}

impl OrderService {
    pub(crate) fn new(store: SqliteStore) -> Self {
        OrderService { store }
    }
}

/// The authenticated tenant (put in the extensions by [`authenticate`]).
fn tenant_of<T>(request: &Request<T>) -> Result<String, Status> {
    request
        .extensions()
        .get::<Tenant>()
        .map(|tenant| tenant.as_str().to_owned())
        .ok_or_else(|| Status::unauthenticated("unauthenticated"))
}

#[tonic::async_trait]
impl Orders for OrderService {
    /// Runs once per `(tenant, key)`; the layer replays its answer to retries.
    ///
    /// Every error answer here is a non-OK `grpc-status`, which the layer does not save: it
    /// rolls the transaction back, so the client may retry the same key (with a corrected
    /// request).
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<CreateOrderResponse>, Status> {
        let tenant_id = tenant_of(&request)?;
        // The layer put the handle in the http request's extensions; tonic copies those into
        // the `tonic::Request`. Without it (the layer missing, or its filter not matching) the
        // order is refused rather than written outside the idempotency transaction.
        let Some(tx) = request.extensions().get::<SqliteTransaction>().cloned() else {
            tracing::error!("CreateOrder reached without an idempotency transaction");
            return Err(Status::internal("internal_error"));
        };
        let order = NewOrder::parse(request.into_inner())?;
        // Same connection, same transaction as the idempotency record the layer saves after us.
        let order_id = tx
            .run(move |conn| {
                conn.execute(
                    "INSERT INTO orders (tenant_id, sku, quantity) VALUES (?1, ?2, ?3)",
                    (tenant_id, order.sku, order.quantity),
                )?;
                Ok(conn.last_insert_rowid())
            })
            .await
            .map_err(|error| {
                tracing::error!(%error, "inserting the order failed");
                Status::internal("internal_error")
            })?;
        Ok(Response::new(CreateOrderResponse { order_id }))
    }

    /// The caller's own order. Another tenant's order is answered exactly like a missing one,
    /// so ids reveal nothing across tenants.
    async fn get_order(
        &self,
        request: Request<GetOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        let tenant_id = tenant_of(&request)?;
        let order_id = request.into_inner().order_id;
        let order = self
            .store
            .read(move |conn| {
                conn.query_row(
                    "SELECT sku, quantity FROM orders WHERE id = ?1 AND tenant_id = ?2",
                    (order_id, tenant_id),
                    |row| Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?)),
                )
                .optional()
            })
            .await
            .map_err(|error| {
                tracing::error!(%error, "reading the order failed");
                Status::internal("internal_error")
            })?;
        let (sku, quantity) = order.ok_or_else(|| Status::not_found("not_found"))?;
        Ok(Response::new(Order {
            order_id,
            sku,
            quantity,
        }))
    }

    type ListOrdersStream = tokio_stream::Iter<std::vec::IntoIter<Result<Order, Status>>>;

    /// The caller's orders, oldest first. Passed through the idempotency layer untouched.
    async fn list_orders(
        &self,
        request: Request<ListOrdersRequest>,
    ) -> Result<Response<Self::ListOrdersStream>, Status> {
        let tenant_id = tenant_of(&request)?;
        let orders = self
            .store
            .read(move |conn| {
                let mut statement = conn.prepare(
                    "SELECT id, sku, quantity FROM orders WHERE tenant_id = ?1 ORDER BY id",
                )?;
                let rows = statement.query_map([tenant_id], |row| {
                    Ok(Order {
                        order_id: row.get(0)?,
                        sku: row.get(1)?,
                        quantity: row.get(2)?,
                    })
                })?;
                rows.collect::<Result<Vec<_>, _>>()
            })
            .await
            .map_err(|error| {
                tracing::error!(%error, "listing the orders failed");
                Status::internal("internal_error")
            })?;
        // Read in full first: a page of a demo's orders, not an unbounded cursor.
        Ok(Response::new(tokio_stream::iter(
            orders.into_iter().map(Ok).collect::<Vec<_>>(),
        )))
    }
}

/// A validated order request, with the HTTP API's rules and error codes.
struct NewOrder {
    sku: String,
    quantity: i64,
}

impl NewOrder {
    fn parse(request: CreateOrderRequest) -> Result<Self, Status> {
        // Counted in characters, not bytes: "書" is one character.
        if !(1..=100).contains(&request.sku.chars().count()) {
            return Err(Status::invalid_argument("invalid_key_or_sku"));
        }
        if !(1..=100).contains(&request.quantity) {
            return Err(Status::invalid_argument("invalid_quantity"));
        }
        Ok(NewOrder {
            sku: request.sku,
            quantity: request.quantity,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Serving
// ---------------------------------------------------------------------------------------------

async fn serve(addr: &str, db: &Path) -> Result<(), BoxError> {
    let store = open_store(db).await?;
    // The library never spawns background work; expired records are purged by this task.
    tokio::spawn(continuously_purge_expired(
        store.clone(),
        Duration::from_secs(60),
        1000,
    ));

    let listener = TcpListener::bind(addr)
        .await
        .map_err(|error| format!("cannot listen on {addr}: {error}"))?;
    let local = listener.local_addr()?;
    println!(
        "listening on {local} (gRPC, database {}); try: grpcurl -plaintext -import-path proto \
         -proto orders.proto -H 'authorization: Bearer shop-a-token' \
         -H 'idempotency-key: key-1' -d '{{\"sku\":\"book\",\"quantity\":1}}' \
         {local} orders.Orders/CreateOrder",
        db.display()
    );
    serve_on(
        listener,
        idempotency_layer(store.clone()),
        OrderService::new(store),
        ctrl_c(),
    )
    .await?;
    Ok(())
}

/// Resolves on Ctrl-C. If the handler cannot be installed, never resolves (rather than
/// shutting the server down at once).
async fn ctrl_c() {
    match tokio::signal::ctrl_c().await {
        Ok(()) => eprintln!("shutting down: finishing requests in flight"),
        Err(error) => {
            tracing::error!(%error, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The demo: the article's lab, with a tonic client over real HTTP/2 against the app above
// ---------------------------------------------------------------------------------------------

/// Fails the demo with a message when a condition does not hold.
macro_rules! ensure {
    ($condition:expr, $($message:tt)+) => {
        if !$condition {
            return Err(format!($($message)+).into());
        }
    };
}

pub(crate) async fn demo() -> Result<(), BoxError> {
    let dir = tempfile::tempdir()?;
    let store = open_store(&dir.path().join("orders.db")).await?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;

    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(serve_on(
        listener,
        idempotency_layer(store.clone()),
        OrderService::new(store.clone()),
        async {
            let _ = stopped.await;
        },
    ));

    // A bug that makes a call hang must fail the demo, not hang it.
    let lab = tokio::time::timeout(Duration::from_secs(30), async {
        let client = DemoClient::connect(addr).await?;
        run_lab(&client, &store).await
    })
    .await
    .unwrap_or_else(|_| Err("the lab did not finish within 30 s".into()));

    let _ = stop.send(());
    server.await??;
    lab.map_err(|error| format!("demo failed: {error}").into())
}

async fn run_lab(client: &DemoClient, store: &SqliteStore) -> Result<(), BoxError> {
    const SHOP_A: &str = "shop-a-token";
    const SHOP_B: &str = "shop-b-token";

    // 1. The first response is lost on the way; the client retries with the same key.
    let first = client.create_order(SHOP_A, "key-1", "book", 1).await?;
    let retry = client.create_order(SHOP_A, "key-1", "book", 1).await?;
    ensure!(
        first.code == Code::Ok && !first.replayed,
        "first call: expected a fresh OK, got {first:?}"
    );
    ensure!(
        retry.replayed && retry.code == Code::Ok && retry.order_id == first.order_id,
        "retry: expected a replay of {first:?}, got {retry:?}"
    );
    let orders = expect_orders(store, 1).await?;
    println!("retry: {} orders={orders}", retry.summary());

    // 2. Same key, different request: refused, nothing changes.
    let conflict = client.create_order(SHOP_A, "key-1", "book", 2).await?;
    ensure!(
        conflict.code == Code::FailedPrecondition
            && conflict.message == "key_reused_with_different_payload",
        "changed payload: expected FAILED_PRECONDITION, got {conflict:?}"
    );
    let orders = expect_orders(store, 1).await?;
    println!("changed payload: {} orders={orders}", conflict.summary());

    // 3. Another tenant may use the same key: it is a different scope.
    let other = client.create_order(SHOP_B, "key-1", "book", 1).await?;
    ensure!(
        other.code == Code::Ok && !other.replayed && other.order_id != first.order_id,
        "other tenant: expected a new order, got {other:?}"
    );
    let orders = expect_orders(store, 2).await?;
    println!("other tenant: {} orders={orders}", other.summary());

    // 4. Two copies of one call in flight at once: exactly one runs the handler, the other
    //    gets its response.
    let barrier = Arc::new(Barrier::new(2));
    let spawn_copy = || {
        let (client, barrier) = (client.clone(), barrier.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            client.create_order(SHOP_A, "key-2", "book", 1).await
        })
    };
    let (a, b) = (spawn_copy(), spawn_copy());
    let (a, b) = (a.await??, b.await??);
    ensure!(
        a.code == Code::Ok && b.code == Code::Ok && a.order_id == b.order_id,
        "concurrent retry: expected the same order twice, got {a:?} and {b:?}"
    );
    ensure!(
        a.replayed != b.replayed,
        "concurrent retry: expected exactly one replay, got {a:?} and {b:?}"
    );
    let orders = expect_orders(store, 3).await?;
    println!("concurrent retry: {} orders={orders}", a.summary());

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
    let failed = client.create_order(SHOP_A, "key-3", "book", 1).await?;
    ensure!(
        failed.code == Code::Internal && failed.message == "internal_error",
        "injected failure: expected INTERNAL internal_error, got {failed:?}"
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
    let recovered = client.create_order(SHOP_A, "key-3", "book", 1).await?;
    ensure!(
        recovered.code == Code::Ok && !recovered.replayed,
        "retry after rollback: expected a fresh OK, got {recovered:?}"
    );
    let orders = expect_orders(store, 4).await?;
    println!(
        "retry after rollback: {} orders={orders}",
        recovered.summary()
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

/// The generated tonic client: the demo goes through HTTP/2 like any real client.
#[derive(Clone)]
struct DemoClient {
    orders: OrdersClient<Channel>,
}

/// What the demo looks at in an answer.
#[derive(Debug)]
struct Reply {
    code: Code,
    message: String,
    order_id: Option<i64>,
    replayed: bool,
}

impl Reply {
    /// `OK {order_id: 1}` or `FAILED_PRECONDITION key_reused_with_different_payload`.
    fn summary(&self) -> String {
        match self.order_id {
            Some(order_id) => format!("OK {{order_id: {order_id}}}"),
            None => format!("{} {}", code_name(self.code), self.message),
        }
    }
}

/// The canonical name of a status code, as gRPC documents it (`FAILED_PRECONDITION`).
fn code_name(code: Code) -> String {
    let mut name = String::new();
    for (i, c) in format!("{code:?}").char_indices() {
        if c.is_ascii_uppercase() && i > 0 {
            name.push('_');
        }
        name.push(c.to_ascii_uppercase());
    }
    name
}

impl DemoClient {
    async fn connect(addr: SocketAddr) -> Result<Self, BoxError> {
        let channel = Endpoint::from_shared(format!("http://{addr}"))?
            .connect()
            .await?;
        Ok(DemoClient {
            orders: OrdersClient::new(channel),
        })
    }

    async fn create_order(
        &self,
        token: &str,
        key: &str,
        sku: &str,
        quantity: i64,
    ) -> Result<Reply, BoxError> {
        let mut request = Request::new(CreateOrderRequest {
            sku: sku.to_owned(),
            quantity,
        });
        let metadata = request.metadata_mut();
        metadata.insert(
            "authorization",
            MetadataValue::try_from(format!("Bearer {token}"))?,
        );
        metadata.insert("idempotency-key", MetadataValue::try_from(key)?);
        // The client is a cheap handle on one HTTP/2 connection; a clone per call lets calls
        // run concurrently.
        match self.orders.clone().create_order(request).await {
            Ok(response) => Ok(Reply {
                code: Code::Ok,
                message: String::new(),
                replayed: response
                    .metadata()
                    .get(IDEMPOTENT_REPLAYED.as_str())
                    .is_some_and(|value| value == "true"),
                order_id: Some(response.into_inner().order_id),
            }),
            Err(status) => Ok(Reply {
                code: status.code(),
                message: status.message().to_owned(),
                order_id: None,
                replayed: false,
            }),
        }
    }
}
