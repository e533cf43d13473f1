//! The `--demo` client of `examples/orders.rs`: plain HTTP, through the network stack like
//! any real client. Included beside `lab.rs` by `orders/demo.rs`.

use std::net::SocketAddr;

use axum::body::Bytes;
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, LOCATION};
use axum::http::StatusCode;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::json;
use tower_idempotency::body::BoxError;
use tower_idempotency::response::IDEMPOTENT_REPLAYED;
use tower_idempotency::IDEMPOTENCY_KEY;

use super::lab::{Attempt, Outcome, Reply, Shop};

/// `POST /orders` on the app at one address.
#[derive(Clone)]
pub struct HttpShop {
    http: Client<HttpConnector, Full<Bytes>>,
    base: String,
}

impl HttpShop {
    pub fn new(addr: SocketAddr) -> Self {
        HttpShop {
            http: Client::builder(TokioExecutor::new()).build_http(),
            base: format!("http://{addr}"),
        }
    }
}

impl Shop for HttpShop {
    async fn create_order(&self, attempt: Attempt) -> Result<Reply, BoxError> {
        let body = json!({ "sku": "book", "quantity": attempt.quantity }).to_string();
        let request = axum::http::Request::post(format!("{}/orders", self.base))
            .header(AUTHORIZATION, format!("Bearer {}", attempt.token))
            .header(IDEMPOTENCY_KEY, attempt.key)
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))?;
        let response = self.http.request(request).await?;
        let status = response.status();
        let replayed = response
            .headers()
            .get(IDEMPOTENT_REPLAYED)
            .is_some_and(|value| value == "true");
        let location = response.headers().get(LOCATION).cloned();
        let body = response.into_body().collect().await?.to_bytes();
        let body = String::from_utf8(body.to_vec())?;
        let outcome = match (status, body.as_str()) {
            (StatusCode::CREATED, _) => Outcome::Created,
            (StatusCode::CONFLICT, r#"{"error":"key_reused_with_different_payload"}"#) => {
                Outcome::KeyReused
            }
            (StatusCode::INTERNAL_SERVER_ERROR, r#"{"error":"internal_error"}"#) => {
                Outcome::Internal
            }
            _ => Outcome::Other,
        };
        Ok(Reply {
            outcome,
            replayed,
            answer: format!("{status} {body} {location:?}"),
            summary: format!("{} {body}", status.as_u16()),
        })
    }
}
