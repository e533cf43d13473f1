//! The layer around a plain hyper 1 service: no axum, a `tower::service_fn` handler that
//! takes the transaction handle from the request extensions.

use support::common;

use std::sync::Arc;

use bytes::Bytes;
use common::{order_count, record_count, InsertOrder, Post, PATIENCE, SHOP_A, SHOP_B};
use http::{header, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tower::ServiceBuilder;
use tower_idempotency::body::{BoxError, RequestBody};
use tower_idempotency::store::sqlite::{SqliteHandle, SqliteStore};
use tower_idempotency::{IdempotencyLayer, Tenant};

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

/// The server's authentication, as a tenant extractor over the `Authorization` header.
fn tenant_of(headers: &http::HeaderMap) -> Option<Arc<str>> {
    match headers.get(header::AUTHORIZATION)?.to_str().ok()? {
        "Bearer shop-a-token" => Some("shop-a".into()),
        "Bearer shop-b-token" => Some("shop-b".into()),
        _ => None,
    }
}

/// Inserts the order through the request's transaction. A `"sku":"explode"` order fails with
/// an error from the service itself, after its row was inserted.
async fn create_order(request: Request<RequestBody>) -> Result<Response<Full<Bytes>>, BoxError> {
    let tx = request
        .extensions()
        .get::<SqliteHandle>()
        .cloned()
        .ok_or("no idempotency transaction")?;
    let tenant = tenant_of(request.headers()).ok_or("no tenant")?;
    let body = request.into_body().collect().await?.to_bytes();
    let order: serde_json::Value = serde_json::from_slice(&body)?;
    let sku = order["sku"].as_str().ok_or("no sku")?.to_owned();
    let quantity = order["quantity"].as_i64().ok_or("no quantity")?;
    let explode = sku == "explode";
    let id = tx
        .insert_order(&Tenant::new(tenant), &sku, quantity)
        .await?;
    if explode {
        return Err("injected service error".into());
    }
    Ok(Response::builder()
        .status(StatusCode::CREATED)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::LOCATION, format!("/orders/{id}"))
        .body(Full::new(Bytes::from(format!("{{\"order_id\":{id}}}"))))?)
}

struct HyperServer {
    addr: std::net::SocketAddr,
    store: SqliteStore,
    task: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

impl Drop for HyperServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn spawn_hyper_server() -> HyperServer {
    let (dir, store) = common::sqlite_orders::orders_store_in_a_temp_dir().await;
    let service = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::new(store.clone())
                .with_operation("create_order")
                .with_tenant_extractor(|parts| tenant_of(&parts.headers)),
        )
        .service(tower::service_fn(create_order));

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let service = TowerToHyperService::new(service.clone());
            tokio::spawn(async move {
                // A service error ends the connection: that is what the client sees.
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    HyperServer {
        addr,
        store,
        task,
        _dir: dir,
    }
}

test! { plain_hyper_service_new_replay_and_conflict }
async fn plain_hyper_service_new_replay_and_conflict() {
    let server = spawn_hyper_server().await;

    let first = Post::order("key-1", BOOK).send(server.addr).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(!first.replayed());
    let id = first.order_id();
    assert_eq!(first.header("location"), Some(&*format!("/orders/{id}")));

    let replay = Post::order("key-1", r#"{ "quantity": 1, "sku": "book" }"#)
        .send(server.addr)
        .await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("location"), first.header("location"));
    replay.assert_content_length_matches();

    let conflict = Post::order("key-1", r#"{"sku":"book","quantity":9}"#)
        .send(server.addr)
        .await;
    assert_eq!(conflict.status, StatusCode::CONFLICT);
    assert_eq!(conflict.error_code(), "key_reused_with_different_payload");

    let other_tenant = Post::order("key-1", BOOK)
        .token(Some(SHOP_B))
        .send(server.addr)
        .await;
    assert_eq!(other_tenant.status, StatusCode::CREATED);
    assert!(!other_tenant.replayed());

    let anonymous = Post::order("key-2", BOOK)
        .token(None)
        .send(server.addr)
        .await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);

    assert_eq!(order_count(&server.store).await, 2);
    assert_eq!(record_count(&server.store).await, 2);
}

test! { service_error_rolls_back_and_the_key_can_be_retried }
async fn service_error_rolls_back_and_the_key_can_be_retried() {
    let server = spawn_hyper_server().await;
    let explode = Post::order("key-1", r#"{"sku":"explode","quantity":1}"#);

    // The error reaches hyper, which drops the connection without an answer.
    let client: hyper_util::client::legacy::Client<_, Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let request = Request::post(format!("http://{}/orders", server.addr))
        .header(header::AUTHORIZATION, format!("Bearer {SHOP_A}"))
        .header(header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", "key-1")
        .body(Full::new(explode.body.clone()))
        .expect("request");
    let outcome = tokio::time::timeout(PATIENCE, client.request(request))
        .await
        .expect("an outcome in time");
    assert!(
        outcome.is_err(),
        "no response for a failed service: {outcome:?}"
    );
    assert_eq!(
        order_count(&server.store).await,
        0,
        "the inserted row was rolled back"
    );
    assert_eq!(record_count(&server.store).await, 0);

    let retry = Post::order("key-2", BOOK).send(server.addr).await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "the store is usable again"
    );
    // Same key, fixed payload: nothing was kept for the failure.
    let fixed = Post::order("key-1", BOOK).send(server.addr).await;
    assert_eq!(fixed.status, StatusCode::CREATED, "{fixed:?}");
    assert!(!fixed.replayed());
    assert_eq!(order_count(&server.store).await, 2);
}
