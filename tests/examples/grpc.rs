//! The gRPC order app of the example (`examples/grpc/app.rs`, the module `examples/grpc_orders.rs`
//! serves) served in-process by tonic, called over real HTTP/2 on loopback
//! with the generated tonic client: replays, conflicts, concurrent duplicates, rollbacks and
//! the layer's rejections as gRPC statuses. Also runs the example's `--demo` as a process.
//! (`proto/codegen`, run by CI, checks the checked-in generated code.)

use support::apps::grpc_orders as app;
use support::apps::process;
use support::sqlite_faults;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use app::pb::orders_client::OrdersClient;
use app::pb::orders_server::{Orders, OrdersServer};
use app::pb::{CreateOrderRequest, CreateOrderResponse, GetOrderRequest, ListOrdersRequest, Order};
use app::{OrderService, CREATE_ORDER_PATH};
use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use prost::Message;
use sqlite_faults::{fail_saving_records, stop_failing_saves, OtherProcessLock};
use tokio::sync::{oneshot, Barrier};
use tokio::task::JoinHandle;
use tonic::metadata::MetadataValue;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Code, Request, Response, Status};
use tower_idempotency::store::sqlite::SqliteStore;
use tower_idempotency::IdempotencyLayer;

const SHOP_A: &str = "shop-a-token";
const SHOP_B: &str = "shop-b-token";

/// A generous bound for anything a test waits for: reached only when the test fails.
const PATIENCE: Duration = Duration::from_secs(10);

// ----- the server -----

/// The example's `OrderService`, counting its calls and able to fail on demand.
#[derive(Clone)]
struct TestOrders {
    inner: OrderService,
    /// How many times `CreateOrder` reached the handler.
    create_calls: Arc<AtomicUsize>,
    /// Answer the next `sku: "flaky"` order `INTERNAL` after its row was inserted.
    fail_next_flaky: Arc<AtomicBool>,
}

#[tonic::async_trait]
impl Orders for TestOrders {
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<CreateOrderResponse>, Status> {
        self.create_calls.fetch_add(1, Ordering::SeqCst);
        let sku = request.get_ref().sku.clone();
        if sku == "slow" {
            // Holds the write transaction a while, so that duplicates sent together are in
            // flight together.
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // The example's handler runs in full: the order row is inserted in the transaction.
        let response = self.inner.create_order(request).await?;
        if sku == "flaky" && self.fail_next_flaky.swap(false, Ordering::SeqCst) {
            // A failure after the insert: an `Err` becomes a trailers-only response with HTTP
            // 200 and `grpc-status: 13`, which must roll the order back.
            return Err(Status::internal("injected_failure"));
        }
        Ok(response)
    }

    async fn get_order(
        &self,
        request: Request<GetOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        self.inner.get_order(request).await
    }

    type ListOrdersStream = <OrderService as Orders>::ListOrdersStream;

    async fn list_orders(
        &self,
        request: Request<ListOrdersRequest>,
    ) -> Result<Response<Self::ListOrdersStream>, Status> {
        self.inner.list_orders(request).await
    }
}

struct GrpcServer {
    addr: SocketAddr,
    store: SqliteStore,
    db_path: std::path::PathBuf,
    create_calls: Arc<AtomicUsize>,
    fail_next_flaky: Arc<AtomicBool>,
    client: OrdersClient<Channel>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
    _dir: tempfile::TempDir,
}

impl Drop for GrpcServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.abort();
    }
}

/// How the server is put together.
struct Setup {
    customise: Box<dyn FnOnce(IdempotencyLayer<SqliteStore>) -> IdempotencyLayer<SqliteStore>>,
    auth: bool,
}

impl Setup {
    fn example() -> Self {
        Setup {
            customise: Box::new(|layer| layer),
            auth: true,
        }
    }

    fn layer(
        mut self,
        customise: impl FnOnce(IdempotencyLayer<SqliteStore>) -> IdempotencyLayer<SqliteStore> + 'static,
    ) -> Self {
        self.customise = Box::new(customise);
        self
    }

    /// Leaves out the example's authentication: requests reach the layer without a tenant.
    fn without_auth(mut self) -> Self {
        self.auth = false;
        self
    }

    async fn spawn(self) -> GrpcServer {
        let dir = tempfile::tempdir().expect("temp dir");
        let db_path = dir.path().join("orders.db");
        let store = app::order_table::open_store(&db_path)
            .await
            .expect("open store");
        let create_calls = Arc::new(AtomicUsize::new(0));
        let fail_next_flaky = Arc::new(AtomicBool::new(false));
        let orders = TestOrders {
            inner: OrderService::new(store.clone()),
            create_calls: create_calls.clone(),
            fail_next_flaky: fail_next_flaky.clone(),
        };
        let layer = (self.customise)(app::idempotency_layer(store.clone()));

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let shutdown = async {
            let _ = stopped.await;
        };
        let task = if self.auth {
            tokio::spawn(async move {
                app::serve_with(listener, layer, orders, shutdown)
                    .await
                    .expect("serve");
            })
        } else {
            tokio::spawn(async move {
                Server::builder()
                    .layer(layer)
                    .add_service(OrdersServer::new(orders))
                    .serve_with_incoming_shutdown(TcpIncoming::from(listener), shutdown)
                    .await
                    .expect("serve");
            })
        };
        let channel = Endpoint::from_shared(format!("http://{addr}"))
            .expect("endpoint")
            .connect_timeout(PATIENCE)
            .timeout(PATIENCE)
            .connect()
            .await
            .expect("connect");
        GrpcServer {
            addr,
            store,
            db_path,
            create_calls,
            fail_next_flaky,
            client: OrdersClient::new(channel),
            stop: Some(stop),
            task,
            _dir: dir,
        }
    }
}

impl GrpcServer {
    fn create_calls(&self) -> usize {
        self.create_calls.load(Ordering::SeqCst)
    }

    async fn order_count(&self) -> i64 {
        self.count("SELECT COUNT(*) FROM orders").await
    }

    async fn record_count(&self) -> i64 {
        self.count("SELECT COUNT(*) FROM idempotency_records").await
    }

    /// Asserts how many times the handler ran, and how many orders and records there are.
    async fn assert_counts(&self, (calls, orders, records): (usize, i64, i64), what: &str) {
        let counts = (
            self.create_calls(),
            self.order_count().await,
            self.record_count().await,
        );
        assert_eq!(
            counts,
            (calls, orders, records),
            "{what}: (handler calls, orders, records)"
        );
    }

    async fn count(&self, sql: &'static str) -> i64 {
        self.store
            .read(move |conn| conn.query_row(sql, [], |row| row.get(0)))
            .await
            .expect("count")
    }

    /// `GetOrder` as shop-a, through the RPC the layer passes through.
    async fn get_order(&self, order_id: i64) -> Result<Order, Status> {
        let request = authorized(GetOrderRequest { order_id });
        let response = self.client.clone().get_order(request).await?;
        Ok(response.into_inner())
    }

    /// `CreateOrder` with the generated client, on the shared HTTP/2 connection.
    async fn create(&self, call: Call) -> Result<Created, Status> {
        let response = self.client.clone().create_order(call.request()).await?;
        let replayed = match response.metadata().get("idempotent-replayed") {
            None => false,
            Some(value) if value == "true" => true,
            Some(other) => panic!("idempotent-replayed: {other:?}"),
        };
        Ok(Created {
            order_id: response.into_inner().order_id,
            replayed,
        })
    }
}

/// A `CreateOrder` call, built step by step.
#[derive(Clone, Debug)]
struct Call {
    token: Option<&'static str>,
    keys: Vec<String>,
    sku: String,
    quantity: i64,
}

impl Call {
    /// As shop-a, with this key, one `book`.
    fn order(key: &str) -> Call {
        Call {
            token: Some(SHOP_A),
            keys: vec![key.to_owned()],
            sku: "book".into(),
            quantity: 1,
        }
    }

    fn token(mut self, token: Option<&'static str>) -> Call {
        self.token = token;
        self
    }

    fn keys(mut self, keys: &[&str]) -> Call {
        self.keys = keys.iter().map(|k| (*k).to_owned()).collect();
        self
    }

    fn sku(mut self, sku: impl Into<String>) -> Call {
        self.sku = sku.into();
        self
    }

    fn quantity(mut self, quantity: i64) -> Call {
        self.quantity = quantity;
        self
    }

    fn request(&self) -> Request<CreateOrderRequest> {
        let mut request = Request::new(CreateOrderRequest {
            sku: self.sku.clone(),
            quantity: self.quantity,
        });
        let metadata = request.metadata_mut();
        if let Some(token) = self.token {
            metadata.insert(
                "authorization",
                MetadataValue::try_from(format!("Bearer {token}")).expect("token"),
            );
        }
        for key in &self.keys {
            metadata.append(
                "idempotency-key",
                MetadataValue::try_from(key.as_str()).expect("key"),
            );
        }
        request
    }
}

/// A successful `CreateOrder` as the client decoded it.
#[derive(Debug, PartialEq, Eq)]
struct Created {
    order_id: i64,
    replayed: bool,
}

#[track_caller]
fn assert_status(result: Result<Created, Status>, code: Code, message: &str) {
    match result {
        Ok(created) => panic!("expected {code:?} {message}, got {created:?}"),
        Err(status) => {
            assert_eq!(status.code(), code, "{status:?}");
            assert_eq!(status.message(), message, "{status:?}");
        }
    }
}

// ----- replay -----

test! { retry_is_decoded_as_the_original_response_with_replayed_metadata }
async fn retry_is_decoded_as_the_original_response_with_replayed_metadata() {
    let server = Setup::example().spawn().await;

    let first = server.create(Call::order("key-1")).await.expect("first");
    assert!(!first.replayed, "a first answer is not a replay");

    for _ in 0..2 {
        let retry = server.create(Call::order("key-1")).await.expect("retry");
        assert_eq!(
            retry,
            Created {
                order_id: first.order_id,
                replayed: true
            }
        );
    }
    server
        .assert_counts((1, 1, 1), "the handler ran once")
        .await;

    // The order is there, read through the RPC the layer passes through.
    let order = server.get_order(first.order_id).await.expect("get order");
    assert_eq!((order.sku.as_str(), order.quantity), ("book", 1));
}

test! { another_tenant_with_the_same_key_gets_its_own_order }
async fn another_tenant_with_the_same_key_gets_its_own_order() {
    let server = Setup::example().spawn().await;

    let a = server.create(Call::order("key-1")).await.expect("shop-a");
    let b = server
        .create(Call::order("key-1").token(Some(SHOP_B)))
        .await
        .expect("shop-b");

    assert!(!b.replayed);
    assert_ne!(a.order_id, b.order_id);
    assert_eq!(server.order_count().await, 2);
    // Each tenant reads only its own order.
    let other = server
        .get_order(b.order_id)
        .await
        .expect_err("shop-b's order, read by shop-a");
    assert_eq!(other.code(), Code::NotFound);
}

test! { replay_is_the_saved_body_and_trailers_byte_for_byte }
/// The replay is the saved answer byte for byte: the same HTTP/2 body (the length-prefixed
/// protobuf message) and the same `grpc-status`/`grpc-message` trailers, over a raw HTTP/2
/// client rather than tonic's.
async fn replay_is_the_saved_body_and_trailers_byte_for_byte() {
    let server = Setup::example().spawn().await;
    let message = CreateOrderRequest {
        sku: "book".into(),
        quantity: 1,
    };

    let first = raw_grpc_call(server.addr, "key-1", &message).await;
    let replay = raw_grpc_call(server.addr, "key-1", &message).await;

    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(replay.status, StatusCode::OK);
    assert!(first.headers.get("idempotent-replayed").is_none());
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(
        replay.headers["content-type"], first.headers["content-type"],
        "the content type is replayed"
    );
    assert_eq!(replay.body, first.body, "the body frames");
    let trailers = first.trailers.as_ref().expect("the original has trailers");
    assert_eq!(trailers["grpc-status"], "0");
    assert_eq!(
        grpc_trailers(&replay.trailers),
        grpc_trailers(&first.trailers),
        "the gRPC trailers"
    );
    let decoded = decode_grpc_frame::<CreateOrderResponse>(&replay.body);
    assert_eq!(decoded.order_id, 1);
    assert_eq!(server.order_count().await, 1);
}

// ----- conflict -----

test! { same_key_with_another_request_is_failed_precondition_and_the_original_stays }
async fn same_key_with_another_request_is_failed_precondition_and_the_original_stays() {
    let server = Setup::example().spawn().await;
    let first = server.create(Call::order("key-1")).await.expect("first");

    let conflict = server.create(Call::order("key-1").quantity(2)).await;
    assert_status(
        conflict,
        Code::FailedPrecondition,
        "key_reused_with_different_payload",
    );
    let conflict = server.create(Call::order("key-1").sku("pen")).await;
    assert_status(
        conflict,
        Code::FailedPrecondition,
        "key_reused_with_different_payload",
    );

    assert_eq!(server.create_calls(), 1);
    assert_eq!(server.order_count().await, 1);
    let again = server.create(Call::order("key-1")).await.expect("replay");
    assert_eq!(again.order_id, first.order_id);
    assert!(again.replayed);
}

// ----- concurrency -----

test! { concurrent_duplicates_create_one_order }
async fn concurrent_duplicates_create_one_order() {
    const COPIES: usize = 6;
    let server = Arc::new(Setup::example().spawn().await);
    let barrier = Arc::new(Barrier::new(COPIES));

    let copies: Vec<_> = (0..COPIES)
        .map(|_| {
            let (server, barrier) = (server.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                server.create(Call::order("dup").sku("slow")).await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for copy in copies {
        let answer = tokio::time::timeout(PATIENCE, copy)
            .await
            .expect("answer in time")
            .expect("task");
        answers.push(answer.expect("every copy succeeds"));
    }

    let order_id = answers[0].order_id;
    assert!(
        answers.iter().all(|a| a.order_id == order_id),
        "{answers:?}"
    );
    assert_eq!(
        answers.iter().filter(|a| !a.replayed).count(),
        1,
        "one original, the rest replayed: {answers:?}"
    );
    server
        .assert_counts((1, 1, 1), "the handler ran once")
        .await;
}

// ----- rollback -----

test! { non_ok_status_after_the_insert_rolls_back_and_the_retry_runs_afresh }
async fn non_ok_status_after_the_insert_rolls_back_and_the_retry_runs_afresh() {
    let server = Setup::example().spawn().await;
    server.fail_next_flaky.store(true, Ordering::SeqCst);

    let failed = server.create(Call::order("key-1").sku("flaky")).await;
    assert_status(failed, Code::Internal, "injected_failure");
    server
        .assert_counts(
            (1, 0, 0),
            "the handler ran (and inserted), the order was rolled back, nothing was saved",
        )
        .await;

    let retry = server
        .create(Call::order("key-1").sku("flaky"))
        .await
        .expect("retry");
    assert!(!retry.replayed, "the retry ran afresh");
    server.assert_counts((2, 1, 1), "the retry ran").await;
}

test! { invalid_argument_from_the_handler_is_not_saved_so_a_corrected_request_succeeds }
async fn invalid_argument_from_the_handler_is_not_saved_so_a_corrected_request_succeeds() {
    let server = Setup::example().spawn().await;

    let invalid = server.create(Call::order("key-1").quantity(0)).await;
    assert_status(invalid, Code::InvalidArgument, "invalid_quantity");
    let invalid = server.create(Call::order("key-1").sku("")).await;
    assert_status(invalid, Code::InvalidArgument, "invalid_key_or_sku");
    assert_eq!(server.record_count().await, 0);

    let corrected = server
        .create(Call::order("key-1"))
        .await
        .expect("corrected");
    assert!(!corrected.replayed);
    assert_eq!(server.order_count().await, 1);
}

test! { store_failure_while_saving_is_internal_and_rolls_the_order_back }
async fn store_failure_while_saving_is_internal_and_rolls_the_order_back() {
    let server = Setup::example().spawn().await;
    fail_saving_records(&server.store).await;

    let failed = server.create(Call::order("key-1")).await;
    assert_status(failed, Code::Internal, "internal_error");
    assert_eq!(server.create_calls(), 1);
    assert_eq!(server.order_count().await, 0);

    stop_failing_saves(&server.store).await;
    let retry = server.create(Call::order("key-1")).await.expect("retry");
    assert!(!retry.replayed);
    assert_eq!(server.order_count().await, 1);
}

// ----- the layer's rejections, as gRPC statuses -----

test! { key_problems_are_invalid_argument_and_nothing_runs }
async fn key_problems_are_invalid_argument_and_nothing_runs() {
    let server = Setup::example().spawn().await;

    let missing = server.create(Call::order("unused").keys(&[])).await;
    assert_status(missing, Code::InvalidArgument, "missing_idempotency_key");

    let too_long = "k".repeat(129);
    let long = server.create(Call::order(&too_long)).await;
    assert_status(long, Code::InvalidArgument, "idempotency_key_too_long");

    let malformed = server.create(Call::order("a b")).await;
    assert_status(malformed, Code::InvalidArgument, "invalid_idempotency_key");

    let twice = server.create(Call::order("a").keys(&["a", "b"])).await;
    assert_status(
        twice,
        Code::InvalidArgument,
        "duplicate_idempotency_key_header",
    );

    server
        .assert_counts((0, 0, 0), "the handler never ran")
        .await;
}

test! { unauthenticated_calls_are_refused_by_the_auth_layer_and_by_the_idempotency_layer }
async fn unauthenticated_calls_are_refused_by_the_auth_layer_and_by_the_idempotency_layer() {
    // The example's own authentication refuses an unknown token before the layer.
    let server = Setup::example().spawn().await;
    let refused = server
        .create(Call::order("key-1").token(Some("stolen-token")))
        .await;
    assert_status(refused, Code::Unauthenticated, "unauthenticated");
    assert_eq!(server.create_calls(), 0);

    // Without an authentication layer no tenant reaches the idempotency layer: it refuses the
    // call itself rather than keep records without a tenant.
    let bare = Setup::example().without_auth().spawn().await;
    let refused = bare.create(Call::order("key-1").token(None)).await;
    assert_status(refused, Code::Unauthenticated, "unauthenticated");
    assert_eq!(bare.create_calls(), 0);
    assert_eq!(bare.record_count().await, 0);
}

test! { request_over_the_body_limit_is_resource_exhausted }
async fn request_over_the_body_limit_is_resource_exhausted() {
    let server = Setup::example()
        .layer(|layer| layer.with_body_limit(64))
        .spawn()
        .await;

    let large = server
        .create(Call::order("key-1").sku("x".repeat(100)))
        .await;
    assert_status(large, Code::ResourceExhausted, "payload_too_large");
    assert_eq!(server.create_calls(), 0);
    assert_eq!(server.record_count().await, 0);

    // The connection is still good, and a small order goes through.
    let small = server.create(Call::order("key-2")).await.expect("small");
    assert!(!small.replayed);
}

test! { store_busy_past_the_lock_timeout_is_unavailable_then_the_retry_succeeds }
async fn store_busy_past_the_lock_timeout_is_unavailable_then_the_retry_succeeds() {
    let server = Setup::example()
        .layer(|layer| layer.with_lock_timeout(Duration::from_millis(300)))
        .spawn()
        .await;
    let done = server.create(Call::order("done")).await.expect("first");

    // Another process: its own connection to the same file, holding SQLite's write lock.
    let other_process = OtherProcessLock::take(&server.db_path, PATIENCE).await;

    let busy = server.create(Call::order("new-key")).await;
    // A completed key still replays: the fast path reads without the write lock.
    let replay = server.create(Call::order("done")).await;
    other_process.release();

    let pushback = busy
        .as_ref()
        .err()
        .and_then(|status| status.metadata().get("grpc-retry-pushback-ms"))
        .map(|value| value.to_str().unwrap_or_default().to_owned());
    assert_eq!(
        pushback.as_deref(),
        Some("1000"),
        "the retry hint of a busy store"
    );
    assert_status(busy, Code::Unavailable, "busy_retry_later");
    assert_eq!(
        replay.expect("replay while busy"),
        Created {
            order_id: done.order_id,
            replayed: true
        }
    );
    let retry = server.create(Call::order("new-key")).await.expect("retry");
    assert!(!retry.replayed);
    assert_eq!(server.order_count().await, 2);
}

test! { a_single_wrapped_service_can_be_added_to_the_server }
/// One service wrapped on its own (`add_service` takes it: the wrapper is a `NamedService`),
/// leaving the server's other services outside the layer.
async fn a_single_wrapped_service_can_be_added_to_the_server() {
    use tower::Layer;

    let dir = tempfile::tempdir().expect("temp dir");
    let store = app::order_table::open_store(&dir.path().join("orders.db"))
        .await
        .expect("open store");
    let service = app::idempotency_layer(store.clone())
        .layer(OrdersServer::new(OrderService::new(store.clone())));
    // Stands in for authentication, server-wide and outside the wrapped service.
    let authenticate = tower::util::MapRequestLayer::new(|mut request: http::Request<_>| {
        request
            .extensions_mut()
            .insert(tower_idempotency::Tenant::new("shop-a"));
        request
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("local addr");
    let server = tokio::spawn(
        Server::builder()
            .layer(authenticate)
            .add_service(service)
            .serve_with_incoming(TcpIncoming::from(listener)),
    );
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut client = OrdersClient::new(channel);
    let first = client
        .create_order(Call::order("single").request())
        .await
        .expect("first");
    let retry = client
        .create_order(Call::order("single").request())
        .await
        .expect("retry");
    assert!(first.metadata().get("idempotent-replayed").is_none());
    assert_eq!(
        retry
            .metadata()
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    assert_eq!(first.into_inner(), retry.into_inner());
    server.abort();
}

test! { json_request_to_the_same_route_gets_the_http_error }
/// The same server answers a non-gRPC request with the HTTP JSON errors.
async fn json_request_to_the_same_route_gets_the_http_error() {
    let server = Setup::example().spawn().await;
    let request = http::Request::post(format!("http://{}{CREATE_ORDER_PATH}", server.addr))
        .header("authorization", format!("Bearer {SHOP_A}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            br#"{"sku":"book","quantity":1}"#,
        )))
        .expect("request");

    let reply = send_http2(request).await;

    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(reply.headers["content-type"], "application/json");
    assert_eq!(&reply.body[..], br#"{"error":"missing_idempotency_key"}"#);
}

// ----- pass-through -----

test! { streaming_and_read_rpcs_pass_through_without_a_key }
async fn streaming_and_read_rpcs_pass_through_without_a_key() {
    let server = Setup::example().spawn().await;
    let a = server.create(Call::order("key-1")).await.expect("a");
    let b = server
        .create(Call::order("key-2").sku("pen").quantity(3))
        .await
        .expect("b");

    let mut stream = server
        .client
        .clone()
        .list_orders(authorized(ListOrdersRequest {}))
        .await
        .expect("list orders")
        .into_inner();
    let mut listed = Vec::new();
    while let Some(order) = stream.message().await.expect("stream item") {
        listed.push((order.order_id, order.sku, order.quantity));
    }

    assert_eq!(
        listed,
        vec![
            (a.order_id, "book".into(), 1),
            (b.order_id, "pen".into(), 3)
        ]
    );
    assert_eq!(server.record_count().await, 2, "reads leave no records");
}

// ----- the example's demo -----

test! { the_demo_runs }
/// `cargo run --example grpc_orders -- --demo`, as CI runs it: the retry lab's six lines.
async fn the_demo_runs() {
    let output = process::run_example("grpc_orders", &["--demo"], Duration::from_secs(60)).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the demo fails: {}\n{stdout}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(
        stdout.lines().collect::<Vec<_>>(),
        [
            "retry: OK {order_id: 1} orders=1",
            "changed payload: FAILED_PRECONDITION key_reused_with_different_payload orders=1",
            "other tenant: OK {order_id: 2} orders=2",
            "concurrent retry: OK {order_id: 3} orders=3",
            "injected failure: rolled back, orders=3",
            "retry after rollback: OK {order_id: 4} orders=4",
        ]
    );
}

test! { create_order_path_is_the_generated_service_path, sync }
fn create_order_path_is_the_generated_service_path() {
    assert_eq!(
        CREATE_ORDER_PATH,
        format!("/{}/CreateOrder", app::pb::orders_server::SERVICE_NAME)
    );
}

// ----- helpers -----

/// A request as shop-a (for the RPCs without a key).
fn authorized<T>(message: T) -> Request<T> {
    let mut request = Request::new(message);
    request.metadata_mut().insert(
        "authorization",
        MetadataValue::try_from(format!("Bearer {SHOP_A}")).expect("token"),
    );
    request
}

/// An HTTP/2 answer, in full.
#[derive(Debug)]
struct RawReply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    trailers: Option<HeaderMap>,
}

/// `CreateOrder` by hand: one length-prefixed protobuf message over a plain HTTP/2 client.
async fn raw_grpc_call(addr: SocketAddr, key: &str, message: &CreateOrderRequest) -> RawReply {
    let encoded = message.encode_to_vec();
    let mut frame = BytesMut::with_capacity(5 + encoded.len());
    frame.put_u8(0); // not compressed
    frame.put_u32(u32::try_from(encoded.len()).expect("small message"));
    frame.put_slice(&encoded);
    let request = http::Request::post(format!("http://{addr}{CREATE_ORDER_PATH}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", format!("Bearer {SHOP_A}"))
        .header("idempotency-key", key)
        .body(Full::new(frame.freeze()))
        .expect("request");
    send_http2(request).await
}

async fn send_http2(request: http::Request<Full<Bytes>>) -> RawReply {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let response = tokio::time::timeout(PATIENCE, client.request(request))
        .await
        .expect("response in time")
        .expect("response");
    let (parts, body) = response.into_parts();
    let collected = tokio::time::timeout(PATIENCE, body.collect())
        .await
        .expect("body in time")
        .expect("body");
    let trailers = collected.trailers().cloned();
    RawReply {
        status: parts.status,
        headers: parts.headers,
        body: collected.to_bytes(),
        trailers,
    }
}

/// The `grpc-*` trailers, in order.
fn grpc_trailers(trailers: &Option<HeaderMap>) -> Vec<(String, Vec<u8>)> {
    trailers
        .iter()
        .flat_map(|t| t.iter())
        .filter(|(name, _)| name.as_str().starts_with("grpc-"))
        .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
        .collect()
}

fn decode_grpc_frame<M: Message + Default>(body: &[u8]) -> M {
    assert!(body.len() >= 5, "a gRPC frame: {body:?}");
    assert_eq!(body[0], 0, "not compressed");
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    assert_eq!(body.len(), 5 + len, "one message");
    M::decode(&body[5..]).expect("protobuf message")
}
