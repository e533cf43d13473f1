//! Body size and body time limits: 413 and 408, with nothing stored and the handler not run.

mod common;

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

#[tokio::test]
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

#[tokio::test]
async fn body_over_the_limit_with_content_length_is_413() {
    let server = limited_server().await;

    let reply = Post::order("key-1", &order_of_len(4 * LIMIT))
        .send(server.addr)
        .await;

    assert_too_large_and_nothing_stored(&server, &reply).await;
    reply.assert_content_length_matches();
}

#[tokio::test]
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

#[tokio::test]
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

#[tokio::test]
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

#[tokio::test]
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
