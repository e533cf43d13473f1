//! The contract table of the README, row by row, over real HTTP, written once and run
//! against a real SQLite file through either store (`contract::sqlite::...`,
//! `contract::sqlx_sqlite::...`), a real PostgreSQL schema through either store
//! (`contract::postgres::...`, `contract::sqlx_postgres::...`, reported as ignored without
//! `TEST_DATABASE_URL`) and a real MySQL/MariaDB database (`contract::mysql::...`, ignored
//! without `TEST_MYSQL_URL`): new key, replay, changed payload, other tenant and
//! operation, what is never stored, keys as long as allowed, expiry and purging, durability
//! across a restart. Each backend's module also holds the tests that only make sense there
//! (the PostgreSQL schema created and migrated on open; the SQLite app's routes without a
//! store).

use support::backend;
use support::common;
use support::pg_common;

use std::net::SocketAddr;
use std::time::{Duration, SystemTime};

use backend::{hook, replays, replays_as, runs_afresh, Database, Server};
use common::{post, Post, Reply, PATIENCE, SHOP_A, SHOP_B};
use http::header::{self, HeaderName};
use http::{HeaderValue, StatusCode};
use tower_idempotency::store::{continuously_purge_expired, IdempotencyStore};

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

/// The order [`BOOK`] under `key`, posted to `path` (which may carry a query).
async fn order_at(addr: SocketAddr, key: &str, path: &str) -> Reply {
    Post::order(key, BOOK).path(path).send(addr).await
}

async fn new_key_runs_the_handler_once_and_answers_201_with_location<B: Database>(db: B) {
    let server = db.spawn().await;

    let reply = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    let id = reply.order_id();
    assert_eq!(reply.header("location"), Some(&*format!("/orders/{id}")));
    assert_eq!(reply.header("content-type"), Some("application/json"));
    assert!(!reply.replayed(), "a first response is not a replay");
    assert_eq!(server.app.handler_calls(), 1);
    assert_eq!(
        db.orders().await,
        vec![(id, "shop-a".to_owned(), "book".to_owned(), 1)]
    );
    assert!(db.record_exists("shop-a", "create_order", "key-1").await);
    assert_eq!(db.record_count().await, 1);
}

async fn same_key_and_payload_replays_without_running_the_handler<B: Database>(db: B) {
    let server = db.spawn().await;
    let first = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");

    for _ in 0..2 {
        let again = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
        assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
        assert_eq!(again.body, first.body);
        assert_eq!(again.header("location"), first.header("location"));
        assert_eq!(again.header("content-type"), Some("application/json"));
        assert!(again.replayed(), "a retry is marked as replayed");
        again.assert_content_length_matches();
    }
    assert_eq!(server.app.handler_calls(), 1, "the handler ran only once");
    assert_eq!(db.counts().await, (1, 1));
}

async fn same_key_with_another_payload_is_409_and_the_original_stays<B: Database>(db: B) {
    let server = db.spawn().await;
    let first = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let before = db.orders().await;

    let other = r#"{"sku":"pen","quantity":2}"#;
    let conflict = post(server.addr, Some(SHOP_A), Some("key-1"), other, &[]).await;

    assert_eq!(conflict.status, StatusCode::CONFLICT, "{conflict:?}");
    assert_eq!(conflict.error_code(), "key_reused_with_different_payload");
    assert!(!conflict.replayed());
    assert_eq!(server.app.handler_calls(), 1, "the handler did not run");
    assert_eq!(db.orders().await, before, "the original order stays");

    // The saved response is untouched: the original request still replays it.
    let replay = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("location"), first.header("location"));
    assert!(replay.replayed());
    assert_eq!(db.record_count().await, 1);
}

async fn conflict_status_is_configurable<B: Database>(db: B) {
    let server = db
        .with_layer(|layer| layer.with_conflict_status(StatusCode::UNPROCESSABLE_ENTITY))
        .await;
    let first = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);

    let other = r#"{"sku":"book","quantity":3}"#;
    let conflict = post(server.addr, Some(SHOP_A), Some("key-1"), other, &[]).await;

    assert_eq!(conflict.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(conflict.error_code(), "key_reused_with_different_payload");
    assert_eq!(server.app.handler_calls(), 1, "the handler did not run");
    assert_eq!(db.counts().await, (1, 1));
}

async fn another_tenant_with_the_same_key_gets_its_own_order<B: Database>(db: B) {
    let server = db.spawn().await;

    let a = post(server.addr, Some(SHOP_A), Some("shared-key"), BOOK, &[]).await;
    let b = post(server.addr, Some(SHOP_B), Some("shared-key"), BOOK, &[]).await;

    assert_eq!(a.status, StatusCode::CREATED);
    assert_eq!(b.status, StatusCode::CREATED);
    assert!(!b.replayed(), "another tenant's record is never replayed");
    assert_ne!(a.order_id(), b.order_id());
    let rows = db.orders().await;
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].1, "shop-a");
    assert_eq!(rows[1].1, "shop-b");
    assert!(
        db.record_exists("shop-b", "create_order", "shared-key")
            .await
    );

    // And each tenant's retry replays its own response.
    replays_as(server.addr, SHOP_B, "shared-key", BOOK, &b).await;
}

async fn same_key_on_another_operation_is_independent<B: Database>(db: B) {
    let server = db.spawn().await;

    let order = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    let express = order_at(server.addr, "key-1", "/express-orders").await;

    assert_eq!(order.status, StatusCode::CREATED);
    assert_eq!(express.status, StatusCode::CREATED, "{express:?}");
    assert!(!express.replayed());
    assert_ne!(order.order_id(), express.order_id());
    assert_eq!(db.order_count().await, 2);
    assert!(db.record_exists("shop-a", "create_order", "key-1").await);
    assert!(
        db.record_exists("shop-a", "create_express_order", "key-1")
            .await
    );

    // A different payload on the other operation is not a conflict with the first one.
    let express_other = order_at(server.addr, "key-2", "/express-orders").await;
    assert_eq!(express_other.status, StatusCode::CREATED);
}

/// Asserts that a refused request left nothing behind and never reached the handler.
async fn assert_nothing_happened<B: Database>(db: &B, server: &Server<B>) {
    assert_eq!(server.app.handler_calls(), 0, "the handler must not run");
    assert_eq!(db.order_count().await, 0, "no order");
    assert_eq!(db.record_count().await, 0, "no record");
}

async fn missing_key_is_400_and_nothing_is_stored<B: Database>(db: B) {
    let server = db.spawn().await;

    let reply = post(server.addr, Some(SHOP_A), None, BOOK, &[]).await;

    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{reply:?}");
    assert_eq!(reply.error_code(), "missing_idempotency_key");
    assert_nothing_happened(&db, &server).await;
}

async fn malformed_keys_are_400_and_nothing_is_stored<B: Database>(db: B) {
    let server = db.spawn().await;
    let too_long = "k".repeat(129);
    let cases: [(&str, &[u8], &str); 7] = [
        (
            "control character (tab)",
            b"key\t1",
            "invalid_idempotency_key",
        ),
        ("non-ASCII", "clé-1".as_bytes(), "invalid_idempotency_key"),
        ("space", b"key 1", "invalid_idempotency_key"),
        ("empty", b"", "invalid_idempotency_key"),
        ("empty quoted string", b"\"\"", "invalid_idempotency_key"),
        ("unterminated quote", b"\"key-1", "invalid_idempotency_key"),
        (
            "129 characters",
            too_long.as_bytes(),
            "idempotency_key_too_long",
        ),
    ];
    let requests =
        cases.map(|(what, key, code)| (what, Post::order("unused", BOOK).raw_keys(&[key]), code));
    common::assert_each_is_400(server.addr, requests).await;
    assert_nothing_happened(&db, &server).await;
}

async fn key_with_a_raw_control_byte_is_400_over_the_wire<B: Database>(db: B) {
    // No HTTP client library sends \x01 in a header value: write the request by hand.
    let server = db.spawn().await;
    let request = format!(
        "POST /orders HTTP/1.1\r\nhost: {}\r\nauthorization: Bearer {SHOP_A}\r\n\
         content-type: application/json\r\nidempotency-key: key\x011\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{BOOK}",
        server.addr,
        BOOK.len()
    );
    let response = common::exchange_raw(server.addr, request.as_bytes()).await;
    assert!(
        response.starts_with("HTTP/1.1 400"),
        "expected a 400, got {response:?}"
    );
    assert_nothing_happened(&db, &server).await;
}

async fn key_of_128_characters_is_accepted<B: Database>(db: B) {
    let server = db.spawn().await;
    let key = "k".repeat(128);

    let reply = post(server.addr, Some(SHOP_A), Some(&key), BOOK, &[]).await;

    assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    assert!(db.record_exists("shop-a", "create_order", &key).await);
    let again = post(server.addr, Some(SHOP_A), Some(&key), BOOK, &[]).await;
    assert!(again.replayed());
}

/// Keys as long as the layer allows (255 here) are stored whole: two that differ only in their
/// last character are two keys.
async fn keys_of_255_characters_are_kept_apart<B: Database>(db: B) {
    let server = db.with_layer(|layer| layer.with_max_key_len(255)).await;
    let long = "k".repeat(255);
    let other = format!("{}x", "k".repeat(254));

    let first = post(server.addr, Some(SHOP_A), Some(&long), BOOK, &[]).await;
    let second = post(server.addr, Some(SHOP_A), Some(&other), BOOK, &[]).await;

    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(second.status, StatusCode::CREATED, "{second:?}");
    assert!(!second.replayed());
    assert_ne!(first.order_id(), second.order_id());
    let again = post(server.addr, Some(SHOP_A), Some(&long), BOOK, &[]).await;
    assert!(again.replayed());
    assert_eq!(again.order_id(), first.order_id());
    assert!(db.record_exists("shop-a", "create_order", &long).await);
    assert_eq!(db.counts().await, (2, 2));
}

async fn key_header_sent_twice_is_400_even_when_both_are_equal<B: Database>(db: B) {
    let server = db.spawn().await;
    for keys in [[&b"key-1"[..], b"key-2"], [b"key-1", b"key-1"]] {
        let reply = Post::order("unused", BOOK)
            .raw_keys(&keys)
            .send(server.addr)
            .await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{keys:?}: {reply:?}");
        assert_eq!(reply.error_code(), "duplicate_idempotency_key_header");
    }
    assert_nothing_happened(&db, &server).await;
}

async fn quoted_key_is_the_same_key_as_its_bare_form<B: Database>(db: B) {
    let server = db.spawn().await;

    let quoted = post(server.addr, Some(SHOP_A), Some("\"abc\""), BOOK, &[]).await;
    let bare = post(server.addr, Some(SHOP_A), Some("abc"), BOOK, &[]).await;

    assert_eq!(quoted.status, StatusCode::CREATED, "{quoted:?}");
    assert!(!quoted.replayed());
    assert!(bare.replayed(), "the bare key replays the quoted one");
    assert_eq!(bare.body, quoted.body);
    assert_eq!(server.app.handler_calls(), 1);
    assert!(db.record_exists("shop-a", "create_order", "abc").await);
}

async fn equivalent_json_spellings_are_the_same_request<B: Database>(db: B) {
    let server = db.spawn().await;

    let first = Post::order("key-1", r#"{ "quantity":1,  "sku":"book"}"#)
        .send(server.addr)
        .await;
    let second = Post::order("key-1", r#"{"sku":"\u0062ook","quantity":1}"#)
        .send(server.addr)
        .await;

    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(second.status, StatusCode::CREATED, "{second:?}");
    assert!(second.replayed(), "same canonical payload: a replay");
    assert_eq!(second.body, first.body);
    assert_eq!(db.order_count().await, 1);

    let third = Post::order("key-1", r#"{"sku":"book","quantity":2}"#)
        .send(server.addr)
        .await;
    assert_eq!(third.status, StatusCode::CONFLICT, "{third:?}");
    assert_eq!(db.order_count().await, 1);
}

async fn invalid_json_or_utf8_is_400_and_nothing_is_stored<B: Database>(db: B) {
    let server = db.spawn().await;
    let cases: [(&str, &[u8], &str); 3] = [
        (
            "truncated JSON",
            br#"{"sku":"book","quantity":"#,
            "invalid_json",
        ),
        (
            "trailing garbage",
            br#"{"sku":"book","quantity":1} x"#,
            "invalid_json",
        ),
        (
            "invalid UTF-8",
            b"{\"sku\":\"b\xffok\",\"quantity\":1}",
            "invalid_utf8",
        ),
    ];
    let requests =
        cases.map(|(what, body, code)| (what, Post::order("key-1", "").body(body.to_vec()), code));
    common::assert_each_is_400(server.addr, requests).await;
    assert_nothing_happened(&db, &server).await;
}

async fn deeply_nested_json_is_refused_and_the_server_keeps_serving<B: Database>(db: B) {
    let server = db.spawn().await;
    let depth = 100_000;
    let body = format!("{}{}", "[".repeat(depth), "]".repeat(depth));

    let reply = Post::order("deep", "").body(body).send(server.addr).await;

    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{reply:?}");
    assert_eq!(reply.error_code(), "json_too_deep");
    assert_nothing_happened(&db, &server).await;
    let next = post(server.addr, Some(SHOP_A), Some("after-deep"), BOOK, &[]).await;
    assert_eq!(next.status, StatusCode::CREATED, "the server still serves");
}

async fn set_cookie_is_never_replayed_and_content_length_is_right<B: Database>(db: B) {
    let server = db
        .server()
        .layer(|layer| layer.with_replayed_header(header::SET_COOKIE))
        .response_header(
            header::SET_COOKIE,
            HeaderValue::from_static("session=first-client; HttpOnly"),
        )
        .spawn()
        .await;

    let first = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(
        first.header("set-cookie"),
        Some("session=first-client; HttpOnly"),
        "the first response carries the handler's cookie"
    );
    first.assert_content_length_matches();

    let replay = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert!(replay.replayed());
    assert_eq!(
        replay.header("set-cookie"),
        None,
        "a cookie is never replayed, even when allow-listed"
    );
    replay.assert_content_length_matches();
    assert_eq!(replay.body, first.body);
}

async fn allow_listed_header_is_replayed_and_others_are_not<B: Database>(db: B) {
    let cost = HeaderName::from_static("x-order-cost");
    let server = db
        .server()
        .layer({
            let cost = cost.clone();
            move |layer| layer.with_replayed_header(cost.clone())
        })
        .response_header(cost, HeaderValue::from_static("12.50"))
        .response_header(
            HeaderName::from_static("x-not-listed"),
            HeaderValue::from_static("1"),
        )
        .spawn()
        .await;

    let first = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(first.header("x-order-cost"), Some("12.50"));
    assert_eq!(first.header("x-not-listed"), Some("1"));

    let replay = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert!(replay.replayed());
    assert_eq!(replay.header("x-order-cost"), Some("12.50"));
    assert_eq!(replay.header("x-not-listed"), None);
    assert_eq!(replay.header("location"), first.header("location"));
}

async fn validation_error_is_not_saved_and_a_corrected_payload_succeeds<B: Database>(db: B) {
    let server = db.spawn().await;

    let bad_quantity = Post::order("key-1", r#"{"sku":"book","quantity":0}"#)
        .send(server.addr)
        .await;
    assert_eq!(bad_quantity.status, StatusCode::BAD_REQUEST);
    assert_eq!(bad_quantity.error_code(), "invalid_quantity");
    let bad_sku = Post::order("key-1", r#"{"sku":"","quantity":1}"#)
        .send(server.addr)
        .await;
    assert_eq!(bad_sku.status, StatusCode::BAD_REQUEST);
    assert_eq!(bad_sku.error_code(), "invalid_key_or_sku");
    assert!(!bad_sku.replayed(), "the first 400 was not saved");
    assert_eq!(db.record_count().await, 0);
    assert_eq!(db.order_count().await, 0);

    runs_afresh(server.addr, "key-1", BOOK).await;
    assert_eq!(db.order_count().await, 1);
    assert_eq!(server.app.handler_calls(), 3);
}

async fn other_methods_pass_through<B: Database>(db: B) {
    // GET is idempotent by itself: the layer lets it through without asking for a key (a
    // handled request without a key would be 400; here axum's method fallback answers 405).
    let server = db.spawn().await;
    let client: hyper_util::client::legacy::Client<_, http_body_util::Empty<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let request = http::Request::get(format!("http://{}/orders", server.addr))
        .header("authorization", format!("Bearer {SHOP_A}"))
        .body(http_body_util::Empty::new())
        .expect("request");
    let response = tokio::time::timeout(PATIENCE, client.request(request))
        .await
        .expect("in time")
        .expect("response");
    assert_eq!(response.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(db.record_count().await, 0);
}

async fn response_too_large_to_save_is_500_and_rolled_back<B: Database>(db: B) {
    // `{"order_id":1}` is 14 bytes: it cannot be saved, so it must not be committed either.
    let server = db.with_layer(|layer| layer.with_response_limit(8)).await;

    let reply = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{reply:?}");
    assert_eq!(reply.error_code(), "response_too_large_to_save");
    assert_eq!(server.app.handler_calls(), 1);
    assert_eq!(db.order_count().await, 0, "the order was rolled back");
    assert_eq!(db.record_count().await, 0);
}

async fn widened_save_policy_commits_and_replays_a_422<B: Database>(db: B) {
    let server = db
        .server()
        .layer(|layer| layer.with_save_policy(|status| status.is_success() || status == 422))
        .hook(hook(|call| async move {
            (call.sku == "sold-out").then_some(StatusCode::UNPROCESSABLE_ENTITY)
        }))
        .spawn()
        .await;
    let sold_out = r#"{"sku":"sold-out","quantity":1}"#;

    let first = post(server.addr, Some(SHOP_A), Some("key-1"), sold_out, &[]).await;
    assert_eq!(first.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(!first.replayed());
    // A saved response commits the transaction, with whatever the handler wrote.
    assert_eq!(db.counts().await, (1, 1));

    let again = post(server.addr, Some(SHOP_A), Some("key-1"), sold_out, &[]).await;
    assert_eq!(again.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(again.replayed(), "the 422 is the key's final answer");
    assert_eq!(again.body, first.body);
    assert_eq!(server.app.handler_calls(), 1);

    // Still not saved: a 400 from validation.
    let invalid = r#"{"sku":"book","quantity":0}"#;
    let bad = post(server.addr, Some(SHOP_A), Some("key-2"), invalid, &[]).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert!(!db.record_exists("shop-a", "create_order", "key-2").await);
}

async fn json_content_type_parameters_and_case_do_not_matter<B: Database>(db: B) {
    let server = db.spawn().await;

    let first = Post::order("key-1", r#"{"sku":"book","quantity":1}"#)
        .send(server.addr)
        .await;
    let second = Post::order("key-1", r#"{ "quantity" : 1 , "sku" : "book" }"#)
        .content_type(Some("Application/JSON; charset=utf-8"))
        .send(server.addr)
        .await;

    assert_eq!(first.status, StatusCode::CREATED);
    assert!(second.replayed(), "{second:?}");
    assert_eq!(db.order_count().await, 1);
}

async fn http2_clients_get_the_same_contract<B: Database>(db: B) {
    let server = db.with_layer(|layer| layer.with_body_limit(1024)).await;

    let first = Post::order("key-1", BOOK).send_http2(server.addr).await;
    let replay = Post::order("key-1", BOOK).send_http2(server.addr).await;
    let conflict = Post::order("key-1", r#"{"sku":"pen","quantity":1}"#)
        .send_http2(server.addr)
        .await;
    let too_large = Post::order("key-2", "")
        .body(vec![b' '; 64 * 1024])
        .send_http2(server.addr)
        .await;

    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(!first.replayed());
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("location"), first.header("location"));
    assert_eq!(conflict.status, StatusCode::CONFLICT);
    assert_eq!(
        too_large.status,
        StatusCode::PAYLOAD_TOO_LARGE,
        "{too_large:?}"
    );
    assert_eq!(db.counts().await, (1, 1));
}

async fn query_string_is_part_of_the_request<B: Database>(db: B) {
    let server = db.spawn().await;
    let order = Post::order("key-1", BOOK).send(server.addr).await;
    assert_eq!(order.status, StatusCode::CREATED, "{order:?}");

    // The same key and body with a query is another request: never a replay of the order.
    let dry_run = order_at(server.addr, "key-1", "/orders?dry_run=true").await;
    assert_eq!(dry_run.status, StatusCode::CONFLICT, "{dry_run:?}");
    assert_eq!(dry_run.error_code(), "key_reused_with_different_payload");

    // The query is compared decoded, its pairs in order.
    let first = order_at(server.addr, "key-2", "/orders?note=gift+wrap&a=1&b=2").await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let respelled = order_at(server.addr, "key-2", "/orders?note=gift%20wrap&a=%31&&b=2&").await;
    assert!(respelled.replayed(), "{respelled:?}");
    assert_eq!(respelled.body, first.body);
    for path in ["/orders?a=1&b=2&note=gift+wrap", "/orders"] {
        let other = order_at(server.addr, "key-2", path).await;
        assert_eq!(other.status, StatusCode::CONFLICT, "{path}: {other:?}");
    }
    assert_eq!(server.app.handler_calls(), 2);
    assert_eq!(db.order_count().await, 2);
}

async fn records_saved_before_the_query_counted_still_compare_as_they_did<B: Database>(db: B) {
    let server = db.spawn().await;
    // Saved by canonicalization version 1 for `POST /orders?source=app`: the path only.
    let fingerprint =
        common::version_1_fingerprint("json", "POST", "/orders", br#"{"quantity":1,"sku":"book"}"#);
    let scope = ("shop-a", "create_order", "old-key");
    common::save_record(
        &server.store,
        scope,
        fingerprint,
        "/orders/41",
        r#"{"order_id":41}"#,
    )
    .await;

    // Replayed as version 1 would have: whatever the query.
    for path in ["/orders?source=app", "/orders", "/orders?source=web"] {
        let request = Post::order("old-key", BOOK).path(path);
        let reply = request.send(server.addr).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{path}: {reply:?}");
        assert!(reply.replayed(), "{path}");
        assert_eq!(reply.body, r#"{"order_id":41}"#);
        assert_eq!(reply.header("location"), Some("/orders/41"));
    }
    let other = Post::order("old-key", r#"{"sku":"pen","quantity":1}"#)
        .path("/orders?source=app")
        .send(server.addr)
        .await;
    assert_eq!(other.status, StatusCode::CONFLICT, "{other:?}");
    assert_eq!(server.app.handler_calls(), 0);
    assert_eq!(db.order_count().await, 0);

    // A record saved now keeps its query.
    let order = order_at(server.addr, "new-key", "/orders?source=app").await;
    assert_eq!(order.status, StatusCode::CREATED, "{order:?}");
    let dry_run = order_at(server.addr, "new-key", "/orders?source=app&dry_run=true").await;
    assert_eq!(dry_run.status, StatusCode::CONFLICT, "{dry_run:?}");
    let retry = order_at(server.addr, "new-key", "/orders?source=app").await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(server.app.handler_calls(), 1);
    assert_eq!(db.order_count().await, 1);
}

/// A `Location` in raw UTF-8 (obs-text on the wire).
const NON_ASCII_LOCATION: &str = "/commandes/été/🦀";
/// Latin-1 bytes: not UTF-8 at all.
const LATIN1_VALUE: &[u8] = b"caf\xe9 cr\xe8me";

fn header_bytes<'a>(reply: &'a common::Reply, name: &str) -> Option<&'a [u8]> {
    reply.headers.get(name).map(HeaderValue::as_bytes)
}

async fn header_values_that_are_not_visible_ascii_are_replayed_byte_for_byte<B: Database>(db: B) {
    let latin1 = HeaderName::from_static("x-latin1");
    let server = db
        .server()
        .response_header(
            header::LOCATION,
            HeaderValue::from_bytes(NON_ASCII_LOCATION.as_bytes()).expect("obs-text"),
        )
        .response_header(
            latin1.clone(),
            HeaderValue::from_bytes(LATIN1_VALUE).expect("obs-text"),
        )
        .layer(move |layer| layer.with_replayed_header(latin1.clone()))
        .spawn()
        .await;

    let first = Post::order("key-1", BOOK).send(server.addr).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(
        header_bytes(&first, "location"),
        Some(NON_ASCII_LOCATION.as_bytes())
    );

    for _ in 0..2 {
        let replay = Post::order("key-1", BOOK).send(server.addr).await;
        assert!(replay.replayed(), "{replay:?}");
        assert_eq!(
            header_bytes(&replay, "location"),
            Some(NON_ASCII_LOCATION.as_bytes())
        );
        assert_eq!(header_bytes(&replay, "x-latin1"), Some(LATIN1_VALUE));
        assert_eq!(replay.body, first.body);
        replay.assert_content_length_matches();
    }
    assert_eq!(server.app.handler_calls(), 1);
}

async fn durations_past_their_maximum_cannot_panic_a_request<B: Database>(db: B) {
    let server = db
        .server()
        .layer(|layer| {
            layer
                .with_retention(Duration::MAX)
                .with_body_timeout(Duration::MAX - Duration::from_nanos(1))
                .with_lock_timeout(Duration::MAX)
        })
        .spawn()
        .await;

    let first = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    replays(server.addr, "key-1", BOOK, &first).await;
    assert_eq!(server.app.handler_calls(), 1);

    // Kept for the longest retention, 100 years: there in 99, gone in 101.
    let scope = common::scope("shop-a", "create_order", "key-1");
    let year = Duration::from_secs(365 * 24 * 3600);
    let now = SystemTime::now();
    let lookup = |at| server.store.lookup(&scope, at);
    assert!(lookup(now + 99 * year).await.expect("lookup").is_some());
    assert!(lookup(now + 101 * year).await.expect("lookup").is_none());
}

async fn another_tenant_or_operation_with_the_same_key_is_independent<B: Database>(db: B) {
    let server = db.spawn().await;

    let a = post(server.addr, Some(SHOP_A), Some("shared-key"), BOOK, &[]).await;
    let b = post(server.addr, Some(SHOP_B), Some("shared-key"), BOOK, &[]).await;
    let express = order_at(server.addr, "shared-key", "/express-orders").await;

    for reply in [&a, &b, &express] {
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        assert!(!reply.replayed(), "{reply:?}");
    }
    let ids = [a.order_id(), b.order_id(), express.order_id()];
    assert!(ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2]);
    let tenants: Vec<String> = db.orders().await.into_iter().map(|o| o.1).collect();
    assert_eq!(tenants, ["shop-a", "shop-b", "shop-a"]);
    assert!(
        db.record_exists("shop-b", "create_order", "shared-key")
            .await
    );
    assert!(
        db.record_exists("shop-a", "create_express_order", "shared-key")
            .await
    );

    replays_as(server.addr, SHOP_B, "shared-key", BOOK, &b).await;
    assert_eq!(db.order_count().await, 3);
}

async fn refused_requests_store_nothing<B: Database>(db: B) {
    let server = db.spawn().await;

    let no_key = post(server.addr, Some(SHOP_A), None, BOOK, &[]).await;
    let no_tenant = post(server.addr, None, Some("key-1"), BOOK, &[]).await;
    let bad_json = post(server.addr, Some(SHOP_A), Some("key-1"), "{", &[]).await;
    let invalid = Post::order("key-1", r#"{"sku":"book","quantity":0}"#)
        .send(server.addr)
        .await;

    assert_eq!(no_key.status, StatusCode::BAD_REQUEST, "{no_key:?}");
    assert_eq!(no_tenant.status, StatusCode::UNAUTHORIZED, "{no_tenant:?}");
    assert_eq!(bad_json.status, StatusCode::BAD_REQUEST, "{bad_json:?}");
    assert_eq!(invalid.status, StatusCode::BAD_REQUEST, "{invalid:?}");
    assert_eq!(invalid.error_code(), "invalid_quantity");
    assert_eq!(
        server.app.handler_calls(),
        1,
        "only the invalid quantity reached the handler"
    );
    assert_eq!(db.order_count().await, 0);
    assert!(!db.record_exists("shop-a", "create_order", "key-1").await);

    // The validation error was not saved: the corrected payload runs under the same key.
    runs_afresh(server.addr, "key-1", BOOK).await;
    assert_eq!(db.order_count().await, 1);
}

/// Waits until `SystemTime::now()` is past `instant` (records expire on the wall clock).
async fn wait_until_past(instant: SystemTime) {
    while SystemTime::now() <= instant {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn expired_record_counts_as_absent_and_is_taken_over<B: Database>(db: B) {
    const RETENTION: Duration = Duration::from_millis(100);
    let server = db.with_layer(|layer| layer.with_retention(RETENTION)).await;

    let first = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    let saved_by = SystemTime::now();
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    // Within the retention (unless this machine stalled for 100 ms): a replay.
    if SystemTime::now() < saved_by + RETENTION - Duration::from_millis(20) {
        assert!(replay.replayed(), "{replay:?}");
    }
    wait_until_past(saved_by + RETENTION + Duration::from_millis(5)).await;

    let fresh = runs_afresh(server.addr, "key-1", BOOK).await;
    assert_ne!(fresh.order_id(), first.order_id(), "a new order");
    assert_eq!(db.order_count().await, 2);
    assert_eq!(
        db.record_count().await,
        1,
        "the expired record was replaced"
    );

    // Nor is an expired record a conflict: another payload runs afresh too.
    wait_until_past(SystemTime::now() + RETENTION + Duration::from_millis(5)).await;
    let other = Post::order("key-1", r#"{"sku":"pen","quantity":2}"#)
        .send(server.addr)
        .await;
    assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
    assert!(!other.replayed());
    assert_eq!(db.counts().await, (3, 1));
}

async fn purge_expired_deletes_in_batches_and_returns_counts<B: Database>(db: B) {
    let server = db.spawn().await; // default retention: 24 h
    for k in 0..5 {
        let key = format!("key-{k}");
        let reply = post(server.addr, Some(SHOP_A), Some(&key), BOOK, &[]).await;
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    let store = &server.store;
    // Nothing has expired yet.
    assert_eq!(
        store
            .purge_expired(SystemTime::now(), 2)
            .await
            .expect("purge"),
        0
    );
    assert_eq!(db.record_count().await, 5);

    // Two days later, everything has.
    let later = SystemTime::now() + Duration::from_secs(48 * 3600);
    let mut deleted = Vec::new();
    for _ in 0..4 {
        deleted.push(store.purge_expired(later, 2).await.expect("purge"));
        let left = 5 - deleted.iter().sum::<u64>() as i64;
        assert_eq!(db.record_count().await, left, "after batches {deleted:?}");
    }

    assert_eq!(deleted, vec![2, 2, 1, 0]);
    assert_eq!(db.record_count().await, 0);
    assert_eq!(
        db.order_count().await,
        5,
        "purging never touches the orders"
    );
    runs_afresh(server.addr, "key-0", BOOK).await;
    assert_eq!(db.order_count().await, 6);
}

async fn continuous_purge_removes_expired_records_only<B: Database>(db: B) {
    let server = db
        .server()
        .layer_per_operation(|layer, operation| match operation {
            "create_order" => layer.with_retention(Duration::from_millis(1)),
            _ => layer.with_retention(Duration::from_secs(3600)),
        })
        .spawn()
        .await;
    for k in 0..3 {
        let key = format!("key-{k}");
        let reply = post(server.addr, Some(SHOP_A), Some(&key), BOOK, &[]).await;
        assert_eq!(reply.status, StatusCode::CREATED);
    }
    let live = order_at(server.addr, "live-key", "/express-orders").await;
    assert_eq!(live.status, StatusCode::CREATED);
    assert_eq!(db.record_count().await, 4);

    let purge = tokio::spawn(continuously_purge_expired(
        server.store.clone(),
        Duration::from_millis(20),
        2,
    ));
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while db.record_count().await > 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "expired records still there"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    purge.abort();

    assert_eq!(db.record_count().await, 1);
    assert!(
        db.record_exists("shop-a", "create_express_order", "live-key")
            .await,
        "the unexpired record stays"
    );
    assert_eq!(db.order_count().await, 4);
}

async fn saved_response_survives_a_restart_of_the_app<B: Database>(db: B) {
    let server = db.spawn().await;
    let first = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    server.shutdown().await;

    let server = db.spawn().await;
    let replay = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;

    assert_eq!(replay.status, StatusCode::CREATED, "{replay:?}");
    assert!(replay.replayed(), "the record was durable: {replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("location"), first.header("location"));
    assert_eq!(
        server.app.handler_calls(),
        0,
        "the new server never ran the handler"
    );
    assert_eq!(db.order_count().await, 1);
}

/// The tests above, on one backend.
macro_rules! contract_tests {
    ($backend:ident) => {
        backend_tests!($backend;
            new_key_runs_the_handler_once_and_answers_201_with_location,
            same_key_and_payload_replays_without_running_the_handler,
            same_key_with_another_payload_is_409_and_the_original_stays,
            conflict_status_is_configurable,
            another_tenant_with_the_same_key_gets_its_own_order,
            same_key_on_another_operation_is_independent,
            another_tenant_or_operation_with_the_same_key_is_independent,
            missing_key_is_400_and_nothing_is_stored,
            malformed_keys_are_400_and_nothing_is_stored,
            key_with_a_raw_control_byte_is_400_over_the_wire,
            key_of_128_characters_is_accepted,
            keys_of_255_characters_are_kept_apart,
            key_header_sent_twice_is_400_even_when_both_are_equal,
            quoted_key_is_the_same_key_as_its_bare_form,
            equivalent_json_spellings_are_the_same_request,
            invalid_json_or_utf8_is_400_and_nothing_is_stored,
            deeply_nested_json_is_refused_and_the_server_keeps_serving,
            set_cookie_is_never_replayed_and_content_length_is_right,
            allow_listed_header_is_replayed_and_others_are_not,
            validation_error_is_not_saved_and_a_corrected_payload_succeeds,
            refused_requests_store_nothing,
            other_methods_pass_through,
            response_too_large_to_save_is_500_and_rolled_back,
            widened_save_policy_commits_and_replays_a_422,
            json_content_type_parameters_and_case_do_not_matter,
            http2_clients_get_the_same_contract,
            query_string_is_part_of_the_request,
            records_saved_before_the_query_counted_still_compare_as_they_did,
            header_values_that_are_not_visible_ascii_are_replayed_byte_for_byte,
            durations_past_their_maximum_cannot_panic_a_request,
            expired_record_counts_as_absent_and_is_taken_over,
            purge_expired_deletes_in_batches_and_returns_counts,
            continuous_purge_removes_expired_records_only,
            saved_response_survives_a_restart_of_the_app,
        );
    };
}

mod sqlite {
    //! The contract on a SQLite file, and the SQLite app's routes that need no store.

    use common::{record_exists, TestServer};

    use super::*;

    contract_tests!(Sqlite);
    // The names two of them had in the SQLite-only expiry suite this one took over.
    backend_tests!(Sqlite;
        expired_record_counts_as_absent_and_the_key_runs_afresh =
            expired_record_counts_as_absent_and_is_taken_over,
        saved_response_survives_a_restart = saved_response_survives_a_restart_of_the_app,
    );

    /// Asserts that a refused request left nothing behind and never reached the handler.
    async fn assert_nothing_happened(server: &TestServer) {
        assert_eq!(server.app.handler_calls(), 0, "the handler must not run");
        assert_eq!(server.order_count().await, 0, "no order");
        assert_eq!(server.record_count().await, 0, "no record");
    }

    test! { optional_key_passes_the_request_through_untouched }
    async fn optional_key_passes_the_request_through_untouched() {
        let server = TestServer::with_layer(|layer| layer.with_key_required(false)).await;

        // Not JSON at all: a request the layer handled would be refused (invalid_json); a
        // passed-through one reaches the handler with its exact bytes.
        let body = b"not json \xff\x00 at all".to_vec();
        let unkeyed_note = || async {
            Post::order("unused", "")
                .no_key()
                .path("/notes")
                .body(body.clone())
                .send(server.addr)
                .await
        };
        let reply = unkeyed_note().await;

        assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
        assert_eq!(reply.body, body, "the body reached the handler untouched");
        assert_eq!(reply.header("x-saw-transaction"), Some("no"));
        assert!(!reply.replayed());
        assert_eq!(server.app.note_calls(), 1);
        assert_eq!(server.record_count().await, 0, "nothing stored");

        // Twice: not idempotent without a key, the handler runs again.
        let again = unkeyed_note().await;
        assert_eq!(again.status, StatusCode::OK);
        assert!(!again.replayed());
        assert_eq!(server.app.note_calls(), 2);
        assert_eq!(server.record_count().await, 0);

        // With a key the same route is idempotent, and the handler sees the transaction.
        let keyed = Post::order("note-1", r#"{"text":"hi"}"#)
            .path("/notes")
            .send(server.addr)
            .await;
        assert_eq!(keyed.status, StatusCode::OK);
        assert_eq!(keyed.header("x-saw-transaction"), Some("yes"));
        assert!(record_exists(&server.store, "shop-a", "create_note", "note-1").await);
    }

    test! { request_without_tenant_is_401_and_nothing_is_stored }
    async fn request_without_tenant_is_401_and_nothing_is_stored() {
        // The layer itself refuses a request no authentication layer vouched for.
        let server = TestServer::builder().without_auth().spawn().await;
        let reply = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{reply:?}");
        assert_eq!(reply.error_code(), "unauthenticated");
        assert_nothing_happened(&server).await;

        // Behind the app's auth: no token, or an unknown one.
        let server = TestServer::spawn().await;
        for token in [None, Some("forged-token")] {
            let reply = post(server.addr, token, Some("key-1"), BOOK, &[]).await;
            assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{token:?}");
        }
        assert_nothing_happened(&server).await;
    }

    test! { tx_extractor_without_the_layer_is_500 }
    async fn tx_extractor_without_the_layer_is_500() {
        let server = TestServer::spawn().await;

        let reply = order_at(server.addr, "key-1", "/unguarded/orders").await;

        assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(reply.error_code(), "idempotency_layer_missing");
        assert_eq!(server.order_count().await, 0);
        assert_eq!(server.record_count().await, 0);
    }

    test! { non_json_bodies_are_fingerprinted_by_their_exact_bytes }
    async fn non_json_bodies_are_fingerprinted_by_their_exact_bytes() {
        let server = TestServer::spawn().await;
        let note = |body: &'static str| {
            Post::order("note-1", body)
                .path("/notes")
                .content_type(Some("text/plain"))
        };

        let first = note("hello").send(server.addr).await;
        assert_eq!(first.status, StatusCode::OK);
        assert!(!first.replayed());
        let same = note("hello").send(server.addr).await;
        assert!(same.replayed(), "{same:?}");
        assert_eq!(same.body, "hello");
        let spaced = note("hello ").send(server.addr).await;
        assert_eq!(spaced.status, StatusCode::CONFLICT, "{spaced:?}");
        assert_eq!(server.app.note_calls(), 1);
    }
}

mod postgres {
    //! The contract on a PostgreSQL schema, and the schema the store creates and migrates.

    use pg_common::{PgServer, TestDb};
    use tower_idempotency::store::tokio_postgres::PostgresStore;

    use super::*;

    contract_tests!(Postgres);

    test! { instances_starting_together_create_the_schema_once, postgres }
    async fn instances_starting_together_create_the_schema_once() {
        let Some(db) = TestDb::create().await else {
            return;
        };
        let opens: Vec<_> = (0..4)
            .map(|_| {
                let config = db.config();
                tokio::spawn(async move { PostgresStore::builder(config).build().await })
            })
            .collect();
        for open in opens {
            open.await.expect("task").expect("every instance opens");
        }
        let sql = "SELECT count(*) FROM information_schema.tables \
             WHERE table_schema = current_schema() AND table_name = 'idempotency_records'";
        let tables: i64 = db.value(sql, &[]).await;
        assert_eq!(tables, 1);
    }

    test! { table_with_the_sqlite_layout_is_migrated_on_open, postgres }
    /// A table made with the SQLite layout (no `state`, response columns `NOT NULL`) is migrated
    /// on open, and its records keep replaying.
    async fn table_with_the_sqlite_layout_is_migrated_on_open() {
        let Some(db) = TestDb::create().await else {
            return;
        };
        db.execute(
            "CREATE TABLE idempotency_records (
            tenant TEXT NOT NULL, operation TEXT NOT NULL, idempotency_key TEXT NOT NULL,
            fingerprint BYTEA NOT NULL, fingerprint_version INTEGER NOT NULL,
            status INTEGER NOT NULL, headers TEXT NOT NULL, body BYTEA NOT NULL, trailers TEXT,
            created_at BIGINT NOT NULL, expires_at BIGINT NOT NULL,
            PRIMARY KEY (tenant, operation, idempotency_key))",
        )
        .await;
        let server = PgServer::spawn(&db).await;
        let first = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        server.shutdown().await;

        // Opening again finds the column and leaves the table alone.
        let server = PgServer::spawn(&db).await;
        replays(server.addr, "key-1", BOOK, &first).await;
        let sql = "SELECT count(*) FROM information_schema.columns WHERE table_schema = \
             current_schema() AND table_name = 'idempotency_records' AND column_name = 'state'";
        let state_columns: i64 = db.value(sql, &[]).await;
        assert_eq!(state_columns, 1);
    }
}

mod sqlx_postgres {
    //! The contract on a PostgreSQL schema through the sqlx store. The schema tests of
    //! `postgres` are the tokio-postgres store's `connect`; the sqlx store's `migrate` runs the
    //! same install (every sqlx app of the fixture and `store_contract` use it).

    contract_tests!(SqlxPostgres);
}

mod mysql {
    //! The contract on a MySQL or MariaDB database of its own (the sqlx store).

    contract_tests!(MySql);
}

mod sqlx_sqlite {
    //! The contract on a SQLite file through the sqlx store. The SQLite app's routes that need
    //! no store are `sqlite`'s.

    contract_tests!(SqlxSqlite);
}
