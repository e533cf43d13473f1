//! The gRPC order service that `tests/examples/grpc.rs` serves in-process: the app of
//! `examples/grpc_orders.rs` (the same proto, table, authentication, layer set-up and handler
//! rules), here so that the tests can wrap its handler, change its layer and leave its
//! authentication out. The example program itself runs as a process (`--demo`).

use std::future::Future;
use std::path::Path;

use tokio::net::TcpListener;
use tonic::service::InterceptorLayer;
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;
use tonic::{Request, Response, Status};
use tower_idempotency::body::BoxError;
use tower_idempotency::store::sqlite::rusqlite::OptionalExtension;
use tower_idempotency::store::sqlite::{SqliteStore, SqliteTransaction};
use tower_idempotency::{IdempotencyLayer, Tenant};

use crate::support::sqlite_orders;

use pb::orders_server::{Orders, OrdersServer};
use pb::{CreateOrderRequest, CreateOrderResponse, GetOrderRequest, ListOrdersRequest, Order};
use sqlite_orders::{insert_order, ORDERS_SCHEMA};

/// The code generated from `proto/orders.proto`, as the example uses it (checked in next to
/// the example; `generated_code_is_current` keeps it current).
#[allow(clippy::all, clippy::pedantic)]
pub mod pb {
    include!("../../../examples/grpc/orders.rs");
}

/// The only RPC the idempotency layer handles.
pub const CREATE_ORDER_PATH: &str = "/orders.Orders/CreateOrder";

/// Opens the store and creates the `orders` table next to the idempotency records.
pub async fn open_store(db: &Path) -> Result<SqliteStore, BoxError> {
    let store = SqliteStore::open(db).await?;
    store.write(|tx| tx.execute_batch(ORDERS_SCHEMA)).await?;
    Ok(store)
}

/// The example's layer: `CreateOrder` only, as the operation `create_order`.
pub fn idempotency_layer(store: SqliteStore) -> IdempotencyLayer<SqliteStore> {
    IdempotencyLayer::new(store)
        .with_operation("create_order")
        .with_filter(|parts| parts.uri.path() == CREATE_ORDER_PATH)
}

/// The example's authentication: a fixed bearer token per tenant, in the `authorization`
/// metadata.
fn authenticate(mut request: Request<()>) -> Result<Request<()>, Status> {
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
    request.extensions_mut().insert(tenant);
    Ok(request)
}

/// Serves `orders` on `listener` until `shutdown` resolves: authentication, then `layer`.
pub async fn serve_on<S: Orders>(
    listener: TcpListener,
    layer: IdempotencyLayer<SqliteStore>,
    orders: S,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    Server::builder()
        .layer(InterceptorLayer::new(authenticate))
        .layer(layer)
        .add_service(OrdersServer::new(orders))
        .serve_with_incoming_shutdown(TcpIncoming::from(listener), shutdown)
        .await
}

/// The example's `Orders` service.
#[derive(Clone, Debug)]
pub struct OrderService {
    store: SqliteStore,
}

impl OrderService {
    pub fn new(store: SqliteStore) -> Self {
        OrderService { store }
    }
}

fn tenant_of<T>(request: &Request<T>) -> Result<String, Status> {
    request
        .extensions()
        .get::<Tenant>()
        .map(|tenant| tenant.as_str().to_owned())
        .ok_or_else(|| Status::unauthenticated("unauthenticated"))
}

fn internal(error: tower_idempotency::Error) -> Status {
    eprintln!("the order service failed: {error}");
    Status::internal("internal_error")
}

#[tonic::async_trait]
impl Orders for OrderService {
    /// Inserts the order in the request's idempotency transaction; the example's rules.
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<CreateOrderResponse>, Status> {
        let tenant_id = tenant_of(&request)?;
        let Some(tx) = request.extensions().get::<SqliteTransaction>().cloned() else {
            return Err(Status::internal("internal_error"));
        };
        let CreateOrderRequest { sku, quantity } = request.into_inner();
        if !(1..=100).contains(&sku.chars().count()) {
            return Err(Status::invalid_argument("invalid_key_or_sku"));
        }
        if !(1..=100).contains(&quantity) {
            return Err(Status::invalid_argument("invalid_quantity"));
        }
        let order_id = insert_order(&tx, &tenant_id, &sku, quantity)
            .await
            .map_err(internal)?;
        Ok(Response::new(CreateOrderResponse { order_id }))
    }

    /// The caller's own order; another tenant's is `NOT_FOUND`.
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
                    |row| Ok((row.get(0)?, row.get(1)?)),
                )
                .optional()
            })
            .await
            .map_err(internal)?;
        let (sku, quantity) = order.ok_or_else(|| Status::not_found("not_found"))?;
        Ok(Response::new(Order {
            order_id,
            sku,
            quantity,
        }))
    }

    type ListOrdersStream = tokio_stream::Iter<std::vec::IntoIter<Result<Order, Status>>>;

    /// The caller's orders, oldest first (a stream: outside the layer's filter).
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
                    Ok(Ok(Order {
                        order_id: row.get(0)?,
                        sku: row.get(1)?,
                        quantity: row.get(2)?,
                    }))
                })?;
                rows.collect::<Result<Vec<Result<Order, Status>>, _>>()
            })
            .await
            .map_err(internal)?;
        Ok(Response::new(tokio_stream::iter(orders)))
    }
}
