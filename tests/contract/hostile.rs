//! Hostile input over real HTTP: each request is refused with the right 4xx, the handler does
//! not run, nothing is stored, nothing panics, and the server keeps serving.
//!
//! Complements `tests/contract/limits.rs` (bodies over the limit with and without Content-Length and
//! chunked, a trickling body) and `tests/contract/contract.rs` (malformed keys, invalid JSON and UTF-8,
//! 100k-deep arrays).

use support::common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{post, ChannelBody, Post, TestServer, PATIENCE, SHOP_A};
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

/// The handler never ran, and nothing was stored.
async fn assert_nothing_happened(server: &TestServer) {
    assert_eq!(server.counts().await, (0, 0, 0), "the handler must not run");
}

/// A normal request still gets its 201 afterwards.
async fn assert_still_serving(server: &TestServer, key: &str) {
    let reply = post(server.addr, Some(SHOP_A), Some(key), BOOK, &[]).await;
    assert_eq!(
        reply.status,
        StatusCode::CREATED,
        "still serving: {reply:?}"
    );
}

/// Writes `request` on a fresh connection (while reading, so that a server answering early
/// does not block the writer) and returns everything the server sent until it closed.
async fn raw_exchange(addr: std::net::SocketAddr, request: Vec<u8>) -> String {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut reader, mut writer) = stream.into_split();
    let write = tokio::spawn(async move {
        // The server may answer and close before reading everything: not an error here.
        let _ = writer.write_all(&request).await;
        writer
    });
    let mut response = Vec::new();
    let read = tokio::time::timeout(PATIENCE, async {
        let mut buffer = [0u8; 16 * 1024];
        loop {
            match reader.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => response.extend_from_slice(&buffer[..n]),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the server answered and closed in time");
    drop(write.await);
    String::from_utf8_lossy(&response).into_owned()
}

/// The head of `POST /orders` as shop-a with `key`, JSON, and `extra` header lines.
fn head(addr: std::net::SocketAddr, key: &[u8], extra: &str) -> Vec<u8> {
    let mut raw = format!(
        "POST /orders HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {SHOP_A}\r\n\
         content-type: application/json\r\nconnection: close\r\nidempotency-key: "
    )
    .into_bytes();
    raw.extend_from_slice(key);
    raw.extend_from_slice(b"\r\n");
    raw.extend_from_slice(extra.as_bytes());
    raw
}

/// `head` plus a Content-Length body.
fn request_with_body(addr: std::net::SocketAddr, key: &[u8], extra: &str, body: &[u8]) -> Vec<u8> {
    let mut raw = head(addr, key, extra);
    raw.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
    raw.extend_from_slice(body);
    raw
}

fn status_line(response: &str) -> &str {
    response.lines().next().unwrap_or_default()
}

/// Sends an order for `key` with the `extra` header lines, raw, and returns what came back.
async fn raw_order(addr: std::net::SocketAddr, key: &[u8], extra: &str) -> String {
    raw_exchange(addr, request_with_body(addr, key, extra, BOOK.as_bytes())).await
}

/// Asserts that the raw `response` has this status line (`HTTP/1.1 431`).
fn assert_status(response: &str, status: &str) {
    assert!(
        status_line(response).starts_with(status),
        "{}",
        &response[..response.len().min(200)]
    );
}

test! { trickling_body_is_408_and_holds_no_write_lock_meanwhile, multi_thread = 2 }
/// A body that trickles must not hold the write lock: while it trickles, another request
/// commits (within a lock timeout far shorter than the trickle) and another process can take
/// SQLite's write lock; the trickle ends in a 408 with nothing stored.
async fn trickling_body_is_408_and_holds_no_write_lock_meanwhile() {
    const BODY_TIMEOUT: Duration = Duration::from_millis(1500);
    let server = TestServer::builder()
        .layer(|layer| {
            layer
                .with_body_timeout(BODY_TIMEOUT)
                .with_lock_timeout(Duration::from_millis(100))
        })
        .spawn()
        .await;
    let (trickle, body) = ChannelBody::trickling();
    let started = Instant::now();
    let slow = tokio::spawn({
        let addr = server.addr;
        async move { Post::order("slow", "").send_streaming(addr, body).await }
    });
    assert!(server.app.wait_for_arrivals(1, PATIENCE).await);
    tokio::time::sleep(Duration::from_millis(200)).await;

    // While the slow body trickles: nobody waits for the writer, another process takes and
    // releases SQLite's write lock at once, and a fast request commits.
    assert_eq!(server.store.writers_waiting(), 0);
    let other_process = rusqlite::Connection::open(&server.db_path).expect("open");
    other_process
        .busy_timeout(Duration::ZERO)
        .expect("no busy wait");
    other_process
        .execute_batch("BEGIN IMMEDIATE; ROLLBACK;")
        .expect("the write lock is free while the body trickles");
    let fast = post(server.addr, Some(SHOP_A), Some("fast"), BOOK, &[]).await;
    assert_eq!(fast.status, StatusCode::CREATED, "{fast:?}");
    assert!(!slow.is_finished(), "the fast request finished first");
    assert!(started.elapsed() < BODY_TIMEOUT);

    let slow = slow.await.expect("slow request");
    trickle.abort();
    assert!(started.elapsed() >= BODY_TIMEOUT);
    assert_eq!(slow.status, StatusCode::REQUEST_TIMEOUT, "{slow:?}");
    assert_eq!(slow.error_code(), "request_body_timeout");
    assert_eq!(
        server.counts().await,
        (1, 1, 1),
        "only the fast request ran"
    );
}

test! { huge_declared_content_length_is_413_at_once }
/// A declared length far past what the server would even drain: refused at once from the
/// header, without waiting for a body that never comes.
async fn huge_declared_content_length_is_413_at_once() {
    let server = TestServer::with_layer(|layer| layer.with_body_limit(1024)).await;
    let mut raw = head(server.addr, b"huge", "content-length: 10000000000\r\n\r\n");
    raw.extend_from_slice(b"{\"sku\":");
    let started = Instant::now();

    let response = raw_exchange(server.addr, raw).await;

    assert!(
        status_line(&response).starts_with("HTTP/1.1 413"),
        "{response}"
    );
    assert!(response.contains("payload_too_large"), "{response}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "refused at once"
    );
    assert_nothing_happened(&server).await;
    assert_still_serving(&server, "after").await;
}

test! { body_over_the_limit_over_http2_is_413 }
async fn body_over_the_limit_over_http2_is_413() {
    let server = TestServer::with_layer(|layer| layer.with_body_limit(1024)).await;
    let body = format!(r#"{{"sku":"{}","quantity":1}}"#, "x".repeat(4096));

    let reply = Post::order("h2-large", &body).send_http2(server.addr).await;

    assert_eq!(reply.status, StatusCode::PAYLOAD_TOO_LARGE, "{reply:?}");
    assert_eq!(reply.error_code(), "payload_too_large");
    assert_nothing_happened(&server).await;
}

test! { broken_chunked_framing_and_abandoned_uploads_store_nothing }
/// Broken framing, or a client that stops sending mid-body: the body cannot be read, nothing
/// is stored.
async fn broken_chunked_framing_and_abandoned_uploads_store_nothing() {
    let server = TestServer::spawn().await;

    let mut bad_chunk = head(
        server.addr,
        b"bad-chunk",
        "transfer-encoding: chunked\r\n\r\n",
    );
    bad_chunk.extend_from_slice(b"5\r\n{\"sku\r\nzz\r\nnot hex\r\n0\r\n\r\n");
    let response = raw_exchange(server.addr, bad_chunk).await;
    assert!(
        status_line(&response).starts_with("HTTP/1.1 400"),
        "{response}"
    );
    assert!(response.contains("request_body_unreadable"), "{response}");

    // Half the declared body, then the client closes its side.
    let mut abandoned = head(server.addr, b"abandoned", "content-length: 100\r\n\r\n");
    abandoned.extend_from_slice(&BOOK.as_bytes()[..10]);
    let mut stream = tokio::net::TcpStream::connect(server.addr)
        .await
        .expect("connect");
    stream.write_all(&abandoned).await.expect("write");
    stream.shutdown().await.expect("half-close");
    let mut response = Vec::new();
    let _ = tokio::time::timeout(PATIENCE, stream.read_to_end(&mut response))
        .await
        .expect("the server is done with the connection in time");
    let response = String::from_utf8_lossy(&response);
    assert!(
        status_line(&response).starts_with("HTTP/1.1 400"),
        "{response}"
    );
    assert!(response.contains("request_body_unreadable"), "{response}");

    assert_nothing_happened(&server).await;
    assert_still_serving(&server, "after").await;
}

test! { hundred_thousand_deep_objects_and_mixed_nesting_are_400 }
/// 100k-deep objects, and mixed or unclosed nestings, fail on the depth limit (the parser is
/// iterative: no stack overflow).
async fn hundred_thousand_deep_objects_and_mixed_nesting_are_400() {
    let server = TestServer::spawn().await;
    let depth = 100_000;
    let bodies = [
        format!("{}1{}", r#"{"a":"#.repeat(depth), "}".repeat(depth)),
        format!(
            "{}1{}",
            r#"[{"a":"#.repeat(depth / 2),
            "}]".repeat(depth / 2)
        ),
        "[".repeat(depth),
        format!(
            "{}{}",
            r#"{"a":["#.repeat(depth / 2),
            "]}".repeat(depth / 2 - 1)
        ),
    ];
    for (i, body) in bodies.into_iter().enumerate() {
        let reply = Post::order(&format!("deep-{i}"), "")
            .body(body)
            .send(server.addr)
            .await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "body {i}: {reply:?}");
        assert_eq!(reply.error_code(), "json_too_deep", "body {i}");
    }
    assert_nothing_happened(&server).await;
    assert_still_serving(&server, "after").await;
}

test! { invalid_utf8_anywhere_in_the_body_is_400 }
async fn invalid_utf8_anywhere_in_the_body_is_400() {
    let server = TestServer::spawn().await;
    let cases: [(&str, &[u8], &str); 7] = [
        (
            "overlong '/'",
            b"{\"sku\":\"\xc0\xaf\",\"quantity\":1}",
            "invalid_utf8",
        ),
        (
            "UTF-8 surrogate",
            b"{\"sku\":\"\xed\xa0\x80\",\"quantity\":1}",
            "invalid_utf8",
        ),
        (
            "truncated sequence at the end",
            b"{\"sku\":\"book\",\"quantity\":1}\xe2\x82",
            "invalid_utf8",
        ),
        (
            "invalid byte in a key",
            b"{\"s\xffku\":\"book\",\"quantity\":1}",
            "invalid_utf8",
        ),
        (
            "invalid byte in a number",
            b"{\"sku\":\"book\",\"quantity\":1\x80}",
            "invalid_utf8",
        ),
        (
            "byte order mark",
            b"\xef\xbb\xbf{\"sku\":\"book\",\"quantity\":1}",
            "invalid_json",
        ),
        (
            "lone surrogate escape",
            br#"{"sku":"\ud800","quantity":1}"#,
            "invalid_json",
        ),
    ];
    let requests =
        cases.map(|(what, body, code)| (what, Post::order("utf8", "").body(body.to_vec()), code));
    common::assert_each_is_400(server.addr, requests).await;
    assert_nothing_happened(&server).await;
    assert_still_serving(&server, "after").await;
}

test! { numbers_past_the_canonical_range_are_400_and_huge_ones_do_no_harm }
/// Numbers are kept exactly in the fingerprint: an exponent too large to write is a 400
/// (serde_json would read `1e-99999999999999999999` as 0.0), and a 10,000-digit number is
/// fingerprinted without trouble and reaches the handler, whose JSON parser refuses it (past
/// a double's range): a 400 from the handler, not stored.
async fn numbers_past_the_canonical_range_are_400_and_huge_ones_do_no_harm() {
    let server = TestServer::spawn().await;
    for quantity in ["1e-99999999999999999999", "-1.5E+99999999999999999999"] {
        let body = format!(r#"{{"sku":"book","quantity":{quantity}}}"#);
        let reply = post(server.addr, Some(SHOP_A), Some("exponent"), &body, &[]).await;
        assert_eq!(
            reply.status,
            StatusCode::BAD_REQUEST,
            "{quantity}: {reply:?}"
        );
        assert_eq!(reply.error_code(), "number_out_of_range", "{quantity}");
    }
    assert_nothing_happened(&server).await;

    let body = format!(r#"{{"sku":"book","quantity":1{}}}"#, "0".repeat(10_000));
    let reply = post(server.addr, Some(SHOP_A), Some("digits"), &body, &[]).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{reply:?}");
    assert_eq!(
        reply.error_code(),
        "invalid_json",
        "the handler's own answer"
    );
    assert_eq!(server.counts().await, (1, 0, 0));
    assert_still_serving(&server, "after").await;
}

test! { nul_bytes_are_400_and_an_escaped_nul_is_a_distinct_value }
/// Raw NUL bytes are refused; an escaped NUL (`\u0000`) is a legal character, kept exactly:
/// the value with it differs from the value without it, or with another character after it.
async fn nul_bytes_are_400_and_an_escaped_nul_is_a_distinct_value() {
    let server = TestServer::spawn().await;
    let cases: [(&str, &[u8]); 4] = [
        ("NUL in a string", b"{\"sku\":\"bo\x00ok\",\"quantity\":1}"),
        (
            "NUL between tokens",
            b"{\"sku\":\"book\",\x00\"quantity\":1}",
        ),
        (
            "NUL after the value",
            b"{\"sku\":\"book\",\"quantity\":1}\x00",
        ),
        ("only NULs", b"\x00\x00\x00\x00"),
    ];
    for (what, body) in cases {
        let reply = Post::order("nul", "")
            .body(body.to_vec())
            .send(server.addr)
            .await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{what}: {reply:?}");
        assert_eq!(reply.error_code(), "invalid_json", "{what}");
    }
    assert_nothing_happened(&server).await;

    let with_nul = r#"{"sku":"a\u0000b","quantity":1}"#;
    let first = post(server.addr, Some(SHOP_A), Some("nul"), with_nul, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let orders = common::orders(&server.store).await;
    assert_eq!(orders[0].2, "a\0b", "the NUL is stored as it was sent");
    let same = post(
        server.addr,
        Some(SHOP_A),
        Some("nul"),
        r#"{"quantity":1,"sku":"a\u0000\u0062"}"#,
        &[],
    )
    .await;
    assert!(
        same.replayed(),
        "the same value spelled otherwise: {same:?}"
    );
    for other in [
        r#"{"sku":"a","quantity":1}"#,
        r#"{"sku":"a\u0000c","quantity":1}"#,
        r#"{"sku":"a\u0000","quantity":1}"#,
    ] {
        let reply = post(server.addr, Some(SHOP_A), Some("nul"), other, &[]).await;
        assert_eq!(reply.status, StatusCode::CONFLICT, "{other}: {reply:?}");
    }
    assert_eq!(server.order_count().await, 1);
}

test! { keys_with_control_characters_and_non_ascii_bytes_are_400 }
/// Every control character, DEL and non-ASCII byte in a key (raw or inside a quoted key),
/// over the wire: 400 from the HTTP parser or from the layer, never a stored record.
async fn keys_with_control_characters_and_non_ascii_bytes_are_400() {
    let server = TestServer::spawn().await;
    let mut bytes: Vec<u8> = (0x00..=0x1f)
        .filter(|b| *b != b'\r' && *b != b'\n')
        .collect();
    bytes.extend([0x7f, 0x80, 0xa0, 0xc3, 0xff]);
    let mut keys: Vec<Vec<u8>> = Vec::new();
    for byte in bytes {
        keys.push([b"key".as_slice(), &[byte], b"1"].concat());
        keys.push([b"\"key".as_slice(), &[byte], b"1\""].concat());
    }
    keys.push("clé-ünïcödé".as_bytes().to_vec());
    keys.push("\"clé\"".as_bytes().to_vec());
    keys.push("ключ".as_bytes().to_vec());
    keys.push("🔑".as_bytes().to_vec());

    for key in &keys {
        let response = raw_order(server.addr, key, "").await;
        assert!(
            status_line(&response).starts_with("HTTP/1.1 400"),
            "key {key:?}: {response}"
        );
    }
    assert_nothing_happened(&server).await;
    assert_still_serving(&server, "after").await;
}

test! { ten_thousand_distinct_headers_are_431 }
/// 10,000 distinct headers: the HTTP server refuses the head (431) before the layer sees it.
async fn ten_thousand_distinct_headers_are_431() {
    let server = TestServer::spawn().await;
    let extra: String = (0..10_000).map(|i| format!("x-h-{i}: {i}\r\n")).collect();

    let response = raw_order(server.addr, b"many-headers", &extra).await;

    assert_status(&response, "HTTP/1.1 431");
    assert_nothing_happened(&server).await;
    assert_still_serving(&server, "after").await;
}

test! { very_long_header_values_are_refused_and_a_long_key_is_400 }
/// A header past the server's head buffer is refused by the HTTP server (431); a long key
/// that fits is the layer's 400, raw or quoted; a long Content-Type is read as what it is.
async fn very_long_header_values_are_refused_and_a_long_key_is_400() {
    let server = TestServer::spawn().await;

    let huge = format!("x-long: {}\r\n", "a".repeat(1024 * 1024));
    let response = raw_order(server.addr, b"huge-header", &huge).await;
    assert_status(&response, "HTTP/1.1 431");

    let long_key = "k".repeat(64 * 1024);
    let quoted_key = format!("\"{}\"", "\\\"".repeat(32 * 1024));
    for key in [long_key, quoted_key] {
        let reply = Post::order(&key, BOOK).send(server.addr).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{reply:?}");
        assert_eq!(reply.error_code(), "idempotency_key_too_long");
    }
    assert_nothing_happened(&server).await;

    // Long, but nothing wrong with it: JSON with a long parameter is still JSON.
    let content_type = format!("application/json; x={}", "y".repeat(64 * 1024));
    let reply = Post::order("long-content-type", BOOK)
        .content_type(Some(&content_type))
        .send(server.addr)
        .await;
    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    let respelled = Post::order("long-content-type", r#"{ "quantity": 1, "sku": "book" }"#)
        .content_type(Some(&content_type))
        .send(server.addr)
        .await;
    assert!(respelled.replayed(), "fingerprinted as JSON: {respelled:?}");
}

test! { body_in_one_byte_chunks_is_the_same_request }
/// A body sent in one-byte chunks is the same request as the body in one piece.
async fn body_in_one_byte_chunks_is_the_same_request() {
    let server = TestServer::spawn().await;
    let (sender, body) = ChannelBody::new();
    let feed = tokio::spawn(async move {
        for byte in BOOK.bytes() {
            if sender.send(Bytes::from(vec![byte])).await.is_err() {
                return;
            }
        }
    });

    let chunked = Post::order("bytes", "")
        .send_streaming(server.addr, body)
        .await;
    feed.await.expect("feed");
    assert_eq!(chunked.status, StatusCode::CREATED, "{chunked:?}");

    let whole = post(server.addr, Some(SHOP_A), Some("bytes"), BOOK, &[]).await;
    assert!(whole.replayed(), "{whole:?}");
    assert_eq!(whole.body, chunked.body);
    assert_eq!(server.order_count().await, 1);
}
