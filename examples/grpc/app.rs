//! The gRPC order app: its layer, its authentication and its `Orders` service, served by
//! `examples/grpc_orders.rs` and by the tests (`tests/examples/grpc.rs`, which wrap its handler
//! or change its layer). Declared with `#[path = "grpc/app.rs"] mod app;`.

use std::future::Future;

use tokio::net::TcpListener;
use tonic::service::InterceptorLayer;
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;
use tonic::{Request, Response, Status};
use tower_idempotency::store::sqlite::{SqliteHandle, SqliteStore};
use tower_idempotency::{IdempotencyLayer, Tenant};

use order_table::NewOrder;
use pb::orders_server::{Orders, OrdersServer};
use pb::{CreateOrderRequest, CreateOrderResponse, GetOrderRequest, ListOrdersRequest, Order};

/// The code generated from `proto/orders.proto`.
///
/// Checked in (so that building the example needs no `protoc`) and kept current by
/// `proto/codegen` (`cargo run -p tower-idempotency-proto-codegen -- --check`, in CI). Included
/// rather than declared as a module file so that rustfmt leaves it exactly as generated.
#[allow(clippy::all, clippy::pedantic)]
pub mod pb {
    include!("orders.rs");
}

/// The `orders` table and the rules of a valid order, shared with the other order examples.
#[path = "../common/order_table.rs"]
pub mod order_table;

/// The only RPC the idempotency layer handles. Every gRPC call is an HTTP/2 `POST`, so the
/// layer, which wraps the whole server, is told which path is the one to make idempotent.
pub const CREATE_ORDER_PATH: &str = "/orders.Orders/CreateOrder";

/// The idempotency layer of the app, around the whole tonic server.
///
/// The default fingerprint of a gRPC request is its method, path and raw body (the
/// length-prefixed protobuf message), which is stable: prost encodes a message the same way
/// every time.
pub fn idempotency_layer(store: SqliteStore) -> IdempotencyLayer<SqliteStore> {
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
fn authenticate(mut request: Request<()>) -> Result<Request<()>, Status> {
    let authorization = request.metadata().get("authorization");
    let tenant = order_table::tenant_of(authorization.and_then(|value| value.to_str().ok()))
        .ok_or_else(|| Status::unauthenticated("unauthenticated"))?;
    // Tonic hands these extensions back to the http request, where the layer looks.
    request.extensions_mut().insert(tenant);
    Ok(request)
}

/// Serves the app on `listener` until `shutdown` resolves: authentication, then the
/// idempotency layer, around the `Orders` service.
pub async fn serve_on(
    listener: TcpListener,
    store: SqliteStore,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let layer = idempotency_layer(store.clone());
    serve_with(listener, layer, OrderService::new(store), shutdown).await
}

/// Serves `orders` behind `layer` on `listener` until `shutdown` resolves, authentication
/// first. [`serve_on`] with the app's own layer and service; the tests pass theirs.
pub async fn serve_with<S: Orders>(
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
pub struct OrderService {
    store: SqliteStore,
}

impl OrderService {
    /// The service on `store`, whose file holds the `orders` table.
    pub fn new(store: SqliteStore) -> Self {
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

fn internal(error: impl std::fmt::Display, doing: &str) -> Status {
    tracing::error!(%error, "{doing} failed");
    Status::internal("internal_error")
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
        let Some(tx) = request.extensions().get::<SqliteHandle>().cloned() else {
            tracing::error!("CreateOrder reached without an idempotency transaction");
            return Err(Status::internal("internal_error"));
        };
        let CreateOrderRequest { sku, quantity } = request.into_inner();
        let order = NewOrder::new(sku, quantity).map_err(Status::invalid_argument)?;
        // Same connection, same transaction as the idempotency record the layer saves after us.
        let order_id = tx
            .run(move |conn| order_table::insert(conn, &tenant_id, &order))
            .await
            .map_err(|error| internal(error, "inserting the order"))?;
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
        let (sku, quantity) = order_table::find(&self.store, &tenant_id, order_id)
            .await
            .map_err(|error| internal(error, "reading the order"))?
            .ok_or_else(|| Status::not_found("not_found"))?;
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
            .map_err(|error| internal(error, "listing the orders"))?;
        // Read in full first: a page of a demo's orders, not an unbounded cursor.
        Ok(Response::new(tokio_stream::iter(
            orders.into_iter().map(Ok).collect::<Vec<_>>(),
        )))
    }
}
