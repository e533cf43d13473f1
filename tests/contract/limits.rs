//! Body size and body time limits: 413 and 408, with nothing stored and the handler not run;
//! an operation name longer than the stores hold: refused when the layer is built, `414` when
//! the request's path names it (on SQLite and, with `TEST_MYSQL_URL`, MySQL or MariaDB).

use support::common;
use support::mysql_common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{ChannelBody, Post, Reply, TestServer, PATIENCE};
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const LIMIT: usize = 1024;

async fn limited_server() -> TestServer {
    TestServer::builder()
        .layer(|layer| layer.with_body_limit(LIMIT))
        .spawn()
        .await
}

/// A JSON order of exactly `len` bytes (the padding field is ignored by the handler).
fn order_of_len(len: usize) -> String {
    let bare = r#"{"sku":"book","quantity":1,"pad":""}"#;
    assert!(len >= bare.len());
    format!(
        r#"{{"sku":"book","quantity":1,"pad":"{}"}}"#,
        "x".repeat(len - bare.len())
    )
}

async fn assert_too_large_and_nothing_stored(server: &TestServer, reply: &Reply) {
    assert_eq!(reply.status, StatusCode::PAYLOAD_TOO_LARGE, "{reply:?}");
    assert_eq!(reply.error_code(), "payload_too_large");
    assert_eq!(server.counts().await, (0, 0, 0), "the handler must not run");
}

test! { body_at_the_limit_passes_and_one_byte_more_is_413 }
async fn body_at_the_limit_passes_and_one_byte_more_is_413() {
    let server = limited_server().await;

    let over = Post::order("key-1", &order_of_len(LIMIT + 1))
        .send(server.addr)
        .await;
    assert_too_large_and_nothing_stored(&server, &over).await;

    // The same key with a body at the limit is a new request: nothing was kept for the 413.
    let at_limit = Post::order("key-1", &order_of_len(LIMIT))
        .send(server.addr)
        .await;
    assert_eq!(at_limit.status, StatusCode::CREATED, "{at_limit:?}");
    assert!(!at_limit.replayed());
    assert_eq!(server.order_count().await, 1);
}

test! { body_over_the_limit_with_content_length_is_413 }
async fn body_over_the_limit_with_content_length_is_413() {
    let server = limited_server().await;

    let reply = Post::order("key-1", &order_of_len(4 * LIMIT))
        .send(server.addr)
        .await;

    assert_too_large_and_nothing_stored(&server, &reply).await;
    reply.assert_content_length_matches();
}

test! { chunked_body_over_the_limit_is_413 }
async fn chunked_body_over_the_limit_is_413() {
    // Written by hand so the request is certainly chunked, without a Content-Length.
    let server = limited_server().await;
    let body = order_of_len(3 * LIMIT);
    let (first, second) = body.as_bytes().split_at(LIMIT / 2);
    let mut raw = format!(
        "POST /orders HTTP/1.1\r\nhost: {}\r\nauthorization: Bearer shop-a-token\r\n\
         content-type: application/json\r\nidempotency-key: key-1\r\n\
         transfer-encoding: chunked\r\n\r\n",
        server.addr
    )
    .into_bytes();
    for chunk in [first, second] {
        raw.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        raw.extend_from_slice(chunk);
        raw.extend_from_slice(b"\r\n");
    }
    raw.extend_from_slice(b"0\r\n\r\n");

    let text = common::exchange_raw(server.addr, &raw).await;
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    assert!(text.contains("payload_too_large"), "{text}");
    assert_eq!(server.counts().await, (0, 0, 0));
}

/// Streams `total` bytes in 64 KiB chunks from another task while the request is in flight.
fn stream_body(total: usize) -> ChannelBody {
    let (sender, body) = ChannelBody::new();
    tokio::spawn(async move {
        let chunk = Bytes::from(vec![b' '; 64 * 1024]);
        let mut sent = 0;
        while sent < total {
            let n = chunk.len().min(total - sent);
            if sender.send(chunk.slice(..n)).await.is_err() {
                return; // the request is over
            }
            sent += n;
        }
    });
    body
}

test! { multi_megabyte_streamed_upload_receives_the_413 }
async fn multi_megabyte_streamed_upload_receives_the_413() {
    const TOTAL: usize = 5 * 1024 * 1024;
    let server = limited_server().await;

    // Chunked: the server only learns the size by reading.
    let chunked = Post::order("key-1", "")
        .send_streaming(server.addr, stream_body(TOTAL))
        .await;
    assert_too_large_and_nothing_stored(&server, &chunked).await;

    // Declared: the server refuses on the header, and still lets the client finish sending.
    let declared = Post::order("key-2", "")
        .header("content-length", &TOTAL.to_string())
        .send_streaming(server.addr, stream_body(TOTAL))
        .await;
    assert_too_large_and_nothing_stored(&server, &declared).await;
}

/// A naive client: writes the whole request (headers and a 5 MiB body) before it reads
/// anything. It gets the 413 only if the server reads the rest of the body instead of
/// closing the connection on it (which resets the connection under the client).
async fn send_whole_then_read(server: &TestServer, chunked: bool) -> String {
    const TOTAL: usize = 5 * 1024 * 1024;
    let framing = if chunked {
        "transfer-encoding: chunked".to_owned()
    } else {
        format!("content-length: {TOTAL}")
    };
    let mut raw = format!(
        "POST /orders HTTP/1.1\r\nhost: {}\r\nauthorization: Bearer shop-a-token\r\n\
         content-type: application/json\r\nidempotency-key: key-1\r\n{framing}\r\n\r\n",
        server.addr
    )
    .into_bytes();
    let chunk = vec![b' '; 64 * 1024];
    for _ in 0..TOTAL / chunk.len() {
        if chunked {
            raw.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        }
        raw.extend_from_slice(&chunk);
        if chunked {
            raw.extend_from_slice(b"\r\n");
        }
    }
    if chunked {
        raw.extend_from_slice(b"0\r\n\r\n");
    }

    let mut stream = tokio::net::TcpStream::connect(server.addr)
        .await
        .expect("connect");
    let exchange = async {
        stream.write_all(&raw).await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        Ok::<_, std::io::Error>(response)
    };
    let response = tokio::time::timeout(PATIENCE, exchange)
        .await
        .expect("exchange in time")
        .unwrap_or_else(|e| panic!("the client did not get a response: {e}"));
    String::from_utf8_lossy(&response).into_owned()
}

test! { naive_client_sending_5_mib_before_reading_receives_the_413 }
async fn naive_client_sending_5_mib_before_reading_receives_the_413() {
    let server = limited_server().await;
    for chunked in [false, true] {
        let response = send_whole_then_read(&server, chunked).await;
        assert!(
            response.starts_with("HTTP/1.1 413"),
            "chunked={chunked}: {response:?}"
        );
        assert!(response.contains("payload_too_large"), "{response}");
    }
    assert_eq!(server.counts().await, (0, 0, 0));
}

test! { body_trickling_past_the_body_timeout_is_408 }
async fn body_trickling_past_the_body_timeout_is_408() {
    const TIMEOUT: Duration = Duration::from_millis(300);
    let server = TestServer::with_layer(|layer| layer.with_body_timeout(TIMEOUT)).await;
    let (trickle, body) = ChannelBody::trickling();
    let started = Instant::now();

    let reply = Post::order("key-1", "")
        .send_streaming(server.addr, body)
        .await;

    assert!(started.elapsed() >= TIMEOUT, "answered before the timeout");
    assert_eq!(reply.status, StatusCode::REQUEST_TIMEOUT, "{reply:?}");
    assert_eq!(reply.error_code(), "request_body_timeout");
    assert_eq!(server.app.handler_calls(), 0);
    assert_eq!(server.record_count().await, 0);
    trickle.abort();

    // A body that arrives in time, with the same key, is a new request.
    let reply = Post::order("key-1", r#"{"sku":"book","quantity":1}"#)
        .send(server.addr)
        .await;
    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    assert!(!reply.replayed());
}

/// A route that answers every `POST` under `/` (so any path names its operation) behind a
/// layer on `store` without an operation name, for tenant `shop-a`.
async fn serve_any_path<S>(store: S) -> common::Serving
where
    S: tower_idempotency::store::IdempotencyStore + Clone + Send + Sync + 'static,
{
    use axum::routing::post;
    async fn created() -> (StatusCode, axum::Json<serde_json::Value>) {
        (
            StatusCode::CREATED,
            axum::Json(serde_json::json!({"ok": true})),
        )
    }
    async fn tenant(
        mut request: axum::extract::Request,
        next: axum::middleware::Next,
    ) -> axum::response::Response {
        request
            .extensions_mut()
            .insert(tower_idempotency::Tenant::new("shop-a"));
        next.run(request).await
    }
    let router = axum::Router::new()
        .route("/{*path}", post(created))
        .layer(tower_idempotency::IdempotencyLayer::new(store))
        .layer(axum::middleware::from_fn(tenant));
    common::Serving::start(router).await
}

/// A path of `len` bytes.
fn path_of_len(len: usize) -> String {
    format!("/{}", "p".repeat(len - 1))
}

/// Without `with_operation` the path is the operation: one of `MAX_OPERATION_LEN` bytes is
/// kept, one byte more is `414 operation_too_long` with nothing stored (it was stored on
/// SQLite, and a `500` on MySQL, whose column holds 255 bytes). Returns the replies.
async fn a_path_longer_than_an_operation_is_414(addr: std::net::SocketAddr) -> [Reply; 2] {
    let max = tower_idempotency::MAX_OPERATION_LEN;
    let body = r#"{"sku":"book","quantity":1}"#;
    let at_max = Post::order("key-1", body)
        .path(&path_of_len(max))
        .send(addr)
        .await;
    assert_eq!(at_max.status, StatusCode::CREATED, "{at_max:?}");
    let over = Post::order("key-1", body)
        .path(&path_of_len(max + 1))
        .send(addr)
        .await;
    assert_eq!(over.status, StatusCode::URI_TOO_LONG, "{over:?}");
    assert_eq!(over.error_code(), "operation_too_long");
    [at_max, over]
}

test! { sqlite_a_path_longer_than_an_operation_is_414_and_not_stored }
async fn sqlite_a_path_longer_than_an_operation_is_414_and_not_stored() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = tower_idempotency::store::sqlite::SqliteStore::open(dir.path().join("ops.db"))
        .await
        .expect("open");
    let serving = serve_any_path(store.clone()).await;
    a_path_longer_than_an_operation_is_414(serving.addr).await;
    assert_eq!(
        common::record_count(&store).await,
        1,
        "only the first is kept"
    );
    serving.stop().await;
}

test! { mysql_a_path_longer_than_an_operation_is_414_and_not_stored, mysql }
async fn mysql_a_path_longer_than_an_operation_is_414_and_not_stored() {
    let Some(db) = mysql_common::TestDb::create().await else {
        return;
    };
    let serving = serve_any_path(db.store(2).await).await;
    a_path_longer_than_an_operation_is_414(serving.addr).await;
    assert_eq!(db.row_count().await, 1, "only the first is kept");
    serving.stop().await;
}

test! { an_operation_name_longer_than_the_stores_hold_is_refused, sync }
/// An operation name the stores cannot hold is refused when the layer is built: a panic that
/// says how many fit.
fn an_operation_name_longer_than_the_stores_hold_is_refused() {
    let refused = std::panic::catch_unwind(|| {
        tower_idempotency::IdempotencyLayer::new(())
            .with_operation("o".repeat(tower_idempotency::MAX_OPERATION_LEN + 1))
    });
    let payload = refused.expect_err("the layer refuses the name");
    let message = payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or_default();
    assert!(message.contains("at most 255 fit"), "{message}");
}

test! { an_operation_name_the_stores_hold_is_taken, sync }
fn an_operation_name_the_stores_hold_is_taken() {
    let _ = tower_idempotency::IdempotencyLayer::new(())
        .with_operation("o".repeat(tower_idempotency::MAX_OPERATION_LEN));
}
