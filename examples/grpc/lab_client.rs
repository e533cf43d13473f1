//! The `--demo` client of `examples/grpc_orders.rs`: the generated tonic client, over HTTP/2
//! like any real client.

use std::net::SocketAddr;

use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request};
use tower_idempotency::body::BoxError;
use tower_idempotency::response::IDEMPOTENT_REPLAYED;

use super::lab::{Attempt, Outcome, Reply, Shop};
use crate::pb::orders_client::OrdersClient;
use crate::pb::CreateOrderRequest;

/// `CreateOrder` on the server at one address.
#[derive(Clone)]
pub struct GrpcShop {
    orders: OrdersClient<Channel>,
}

impl GrpcShop {
    pub async fn connect(addr: SocketAddr) -> Result<Self, BoxError> {
        let channel = Endpoint::from_shared(format!("http://{addr}"))?
            .connect()
            .await?;
        Ok(GrpcShop {
            orders: OrdersClient::new(channel),
        })
    }
}

impl Shop for GrpcShop {
    async fn create_order(&self, attempt: Attempt) -> Result<Reply, BoxError> {
        let mut request = Request::new(CreateOrderRequest {
            sku: "book".to_owned(),
            quantity: attempt.quantity,
        });
        let metadata = request.metadata_mut();
        metadata.insert(
            "authorization",
            MetadataValue::try_from(format!("Bearer {}", attempt.token))?,
        );
        metadata.insert("idempotency-key", MetadataValue::try_from(attempt.key)?);
        // The client is a cheap handle on one HTTP/2 connection; a clone per call lets calls
        // run concurrently.
        match self.orders.clone().create_order(request).await {
            Ok(response) => {
                let replayed = response
                    .metadata()
                    .get(IDEMPOTENT_REPLAYED.as_str())
                    .is_some_and(|value| value == "true");
                let order_id = response.into_inner().order_id;
                Ok(Reply {
                    outcome: Outcome::Created,
                    replayed,
                    answer: order_id.to_string(),
                    // `OK {order_id: 1}`.
                    summary: format!("OK {{order_id: {order_id}}}"),
                })
            }
            Err(status) => {
                let outcome = match (status.code(), status.message()) {
                    (Code::FailedPrecondition, "key_reused_with_different_payload") => {
                        Outcome::KeyReused
                    }
                    (Code::Internal, "internal_error") => Outcome::Internal,
                    _ => Outcome::Other,
                };
                Ok(Reply {
                    outcome,
                    replayed: false,
                    answer: String::new(),
                    // `FAILED_PRECONDITION key_reused_with_different_payload`.
                    summary: format!("{} {}", code_name(status.code()), status.message()),
                })
            }
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
