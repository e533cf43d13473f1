//! What the IETF draft (`draft-ietf-httpapi-idempotency-key-header`) and the users of other
//! idempotency libraries ask for, over real HTTP on the SQLite store, the tokio-postgres store and
//! the sqlx SQLite store (`ietf_draft::sqlite::...`, `ietf_draft::postgres::...`,
//! `ietf_draft::sqlx_sqlite::...`): the draft's statuses and RFC 9457 problem details in one
//! switch, keys of 255 characters (Stripe's longest) end to end, the key from another header or
//! from the body, and fingerprints over chosen JSON members. The in-flight policies are in
//! `tests/concurrency/concurrency.rs`.

use support::backend;
use support::common;

use std::net::SocketAddr;

use backend::{Backend, Server};
use common::{post, Post, Reply, SHOP_A};
use http::StatusCode;
use tower_idempotency::fingerprint::Fingerprinter;
use tower_idempotency::key::KeyExtractor;
use tower_idempotency::problem::{ProblemDetails, DEFAULT_DOCUMENTATION, PROBLEM_JSON};

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;
const PEN: &str = r#"{"sku":"pen","quantity":1}"#;
const DOCS: &str = "https://developer.example.com/idempotency";

/// Checks a problem-details answer: media type, status in the body, and the `type` of `code`
/// under `docs`; returns the body.
fn problem(reply: &Reply, status: StatusCode, docs: &str, code: &str) -> serde_json::Value {
    assert_eq!(reply.status, status, "{reply:?}");
    assert_eq!(
        reply.header("content-type"),
        Some(PROBLEM_JSON),
        "{reply:?}"
    );
    let body = reply.json();
    assert_eq!(body["status"], status.as_u16(), "{body}");
    assert_eq!(body["type"], format!("{docs}#{code}"), "{body}");
    assert_eq!(body["code"], code, "{body}");
    assert!(body["title"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(body["detail"].as_str().is_some_and(|d| !d.is_empty()));
    body
}

/// Orders a book with the key `k`, then a pen with the same key: the answer to the pen.
async fn reuse_a_key(addr: SocketAddr) -> Reply {
    post(addr, Some(SHOP_A), Some("k"), BOOK, &[]).await;
    post(addr, Some(SHOP_A), Some("k"), PEN, &[]).await
}

/// The handler ran `orders` times, and left that many orders and records: nothing of the
/// refusals was stored.
async fn assert_only_orders_were_stored<B: Backend>(db: &B, server: &Server<B>, orders: usize) {
    assert_eq!(server.app.handler_calls(), orders, "handler calls");
    let stored = i64::try_from(orders).expect("a small count");
    assert_eq!(
        db.counts().await,
        (stored, stored),
        "nothing of the refusals was stored"
    );
}

/// Checks a [`problem`] answer about the key: its `(status, code)`, its title, and the `Link`
/// to the documentation.
fn key_problem(reply: &Reply, (status, code): (StatusCode, &str), docs: &str, title: &str) {
    let body = problem(reply, status, docs, code);
    assert_eq!(body["title"], title);
    assert_eq!(reply.header("link"), Some(described_by(docs).as_str()));
}

fn described_by(docs: &str) -> String {
    format!("<{docs}>; rel=\"describedby\"; type=\"text/html\"")
}

async fn ietf_draft_answers_with_its_statuses_and_problem_details<B: Backend>(db: B) {
    let server = db
        .server()
        .layer(|layer| layer.with_ietf_draft().with_body_limit(1024))
        .spawn()
        .await;
    let addr = server.addr;
    let docs = DEFAULT_DOCUMENTATION;

    let missing = Post::order("unused", BOOK).no_key().send(addr).await;
    let missing_key = (StatusCode::BAD_REQUEST, "missing_idempotency_key");
    key_problem(&missing, missing_key, docs, "Idempotency-Key is missing");

    let first = post(addr, Some(SHOP_A), Some("order-1"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let reused = post(addr, Some(SHOP_A), Some("order-1"), PEN, &[]).await;
    let reused_key = (
        StatusCode::UNPROCESSABLE_ENTITY,
        "key_reused_with_different_payload",
    );
    key_problem(&reused, reused_key, docs, "Idempotency-Key is already used");

    let malformed = Post::order("bad key", BOOK).send(addr).await;
    problem(
        &malformed,
        StatusCode::BAD_REQUEST,
        docs,
        "invalid_idempotency_key",
    );
    let large = Post::order("order-2", &"x".repeat(2048)).send(addr).await;
    problem(
        &large,
        StatusCode::PAYLOAD_TOO_LARGE,
        docs,
        "payload_too_large",
    );
    assert_eq!(large.header("link"), None, "not an answer about the key");
    let anonymous = post(addr, None, Some("order-3"), BOOK, &[]).await;
    // The test app's own authentication answers before the layer.
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);

    // The replay is the handler's response, untouched.
    let replay = post(addr, Some(SHOP_A), Some("order-1"), BOOK, &[]).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_only_orders_were_stored(&db, &server, 1).await;
}

async fn problem_details_with_own_documentation_keep_the_configured_statuses<B: Backend>(db: B) {
    let server = db
        .server()
        .layer(|layer| layer.with_problem_details(ProblemDetails::new(DOCS)))
        .spawn()
        .await;

    let reused = reuse_a_key(server.addr).await;

    // Bodies only: the default 409 stays.
    problem(
        &reused,
        StatusCode::CONFLICT,
        DOCS,
        "key_reused_with_different_payload",
    );
    assert_eq!(reused.header("link"), Some(described_by(DOCS).as_str()));
}

async fn the_default_stays_the_json_error_body<B: Backend>(db: B) {
    let server = db.spawn().await;

    let reused = reuse_a_key(server.addr).await;

    assert_eq!(reused.status, StatusCode::CONFLICT);
    assert_eq!(reused.header("content-type"), Some("application/json"));
    assert_eq!(reused.error_code(), "key_reused_with_different_payload");
    assert_eq!(reused.header("link"), None);
}

/// A key of `len` characters, every one allowed by the key syntax.
fn long_key(len: usize) -> String {
    let alphabet = b"abcdefghijklmnopqrstuvwxyz0123456789-_ABCDEFGHIJKLMNOPQRSTUVWXYZ";
    (0..len)
        .map(|i| char::from(alphabet[i % alphabet.len()]))
        .collect()
}

async fn keys_of_255_characters_are_stored_and_replayed_with_max_key_len_255<B: Backend>(db: B) {
    let server = db
        .server()
        .layer(|layer| layer.with_max_key_len(255))
        .spawn()
        .await;
    let key = long_key(255);

    let first = post(server.addr, Some(SHOP_A), Some(&key), BOOK, &[]).await;
    let replay = post(server.addr, Some(SHOP_A), Some(&key), BOOK, &[]).await;
    let reused = post(server.addr, Some(SHOP_A), Some(&key), PEN, &[]).await;
    let too_long = post(server.addr, Some(SHOP_A), Some(&long_key(256)), BOOK, &[]).await;

    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(db.record_exists("shop-a", "create_order", &key).await);
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(
        reused.status,
        StatusCode::CONFLICT,
        "the whole key is compared"
    );
    assert_eq!(too_long.status, StatusCode::BAD_REQUEST);
    assert_eq!(too_long.error_code(), "idempotency_key_too_long");
    assert_only_orders_were_stored(&db, &server, 1).await;
}

async fn the_default_stays_128_characters<B: Backend>(db: B) {
    let server = db.spawn().await;

    let longest = post(server.addr, Some(SHOP_A), Some(&long_key(128)), BOOK, &[]).await;
    let too_long = post(server.addr, Some(SHOP_A), Some(&long_key(129)), BOOK, &[]).await;

    assert_eq!(longest.status, StatusCode::CREATED, "{longest:?}");
    assert_eq!(too_long.status, StatusCode::BAD_REQUEST);
    assert_eq!(too_long.error_code(), "idempotency_key_too_long");
}

async fn the_key_from_another_header<B: Backend>(db: B) {
    let delivery = http::HeaderName::from_static("x-github-delivery");
    let server = db
        .server()
        .layer(move |layer| layer.with_key_extractor(KeyExtractor::header(delivery.clone())))
        .spawn()
        .await;
    let send = |delivery: Option<&str>| {
        let mut request = Post::order("unused", BOOK).no_key();
        if let Some(delivery) = delivery {
            request = request.header("x-github-delivery", delivery);
        }
        async move { request.send(server.addr).await }
    };

    let first = send(Some("72d3162e-cc78")).await;
    let redelivery = send(Some("72d3162e-cc78")).await;
    let missing = send(None).await;
    // `Idempotency-Key` is not the key any more.
    let other_header = Post::order("72d3162e-cc78", BOOK).send(server.addr).await;

    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(redelivery.replayed(), "{redelivery:?}");
    assert_eq!(redelivery.body, first.body);
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(missing.error_code(), "missing_idempotency_key");
    assert_eq!(other_header.status, StatusCode::BAD_REQUEST);
    assert!(
        db.record_exists("shop-a", "create_order", "72d3162e-cc78")
            .await
    );
    assert_eq!(db.counts().await, (1, 1));
}

async fn the_key_from_the_json_body<B: Backend>(db: B) {
    let server = db
        .server()
        .layer(|layer| layer.with_key_extractor(KeyExtractor::json_pointer("/event/id")))
        .spawn()
        .await;
    let event =
        |id: &str, sku: &str| format!(r#"{{"event":{{"id":"{id}"}},"sku":"{sku}","quantity":1}}"#);
    let send =
        |body: String| async move { Post::order("x", &body).no_key().send(server.addr).await };

    let first = send(event("evt_1", "book")).await;
    let redelivery = send(event("evt_1", "book")).await;
    let reused = send(event("evt_1", "pen")).await;
    let second = send(event("evt_2", "book")).await;
    let without = send(BOOK.to_owned()).await;
    let not_a_key =
        send(r#"{"event":{"id":["evt_3"]},"sku":"book","quantity":1}"#.to_owned()).await;

    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(redelivery.replayed(), "{redelivery:?}");
    assert_eq!(reused.status, StatusCode::CONFLICT);
    assert_eq!(second.status, StatusCode::CREATED);
    assert_eq!(without.status, StatusCode::BAD_REQUEST);
    assert_eq!(without.error_code(), "missing_idempotency_key");
    assert_eq!(not_a_key.status, StatusCode::BAD_REQUEST);
    assert_eq!(not_a_key.error_code(), "invalid_idempotency_key");
    assert!(db.record_exists("shop-a", "create_order", "evt_1").await);
    assert_only_orders_were_stored(&db, &server, 2).await;
}

/// Numeric event ids past what a float holds exactly are distinct keys: taken as written, two
/// events one apart are two orders, with the default fingerprint and with one that leaves the
/// id out (where a shared key would replay the second event as the first: a lost event).
async fn the_key_from_a_large_json_number_keeps_every_digit<B: Backend>(db: B) {
    let server = db
        .server()
        .layer(|layer| {
            layer
                .with_key_extractor(KeyExtractor::json_pointer("/id"))
                .with_fingerprinter(Fingerprinter::json_except(["/id"]))
        })
        .spawn()
        .await;
    let event = |id: &str| format!(r#"{{"id":{id},"sku":"book","quantity":1}}"#);
    let send =
        |body: String| async move { Post::order("x", &body).no_key().send(server.addr).await };

    let first = send(event("18446744073709551616")).await;
    let second = send(event("18446744073709551617")).await;
    let redelivery = send(event("18446744073709551617")).await;

    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(second.status, StatusCode::CREATED, "{second:?}");
    assert!(
        !second.replayed(),
        "a distinct event is not a replay: {second:?}"
    );
    assert_ne!(second.body, first.body);
    assert!(redelivery.replayed(), "{redelivery:?}");
    assert!(
        db.record_exists("shop-a", "create_order", "18446744073709551617")
            .await
    );
    assert_only_orders_were_stored(&db, &server, 2).await;
}

async fn a_fingerprint_over_chosen_members_ignores_the_others<B: Backend>(db: B) {
    let server = db
        .server()
        .layer_per_operation(|layer, operation| match operation {
            // `/orders`: every member but the client's timestamp.
            "create_order" => layer.with_fingerprinter(Fingerprinter::json_except(["/sent_at"])),
            // `/express-orders`: only the business members.
            _ => layer.with_fingerprinter(Fingerprinter::json_only(["/sku", "/quantity"])),
        })
        .spawn()
        .await;
    let order = |sku: &str, extra: &str| format!(r#"{{"sku":"{sku}","quantity":1,{extra}}}"#);
    let send = |path: &'static str, key: &'static str, body: String| async move {
        Post::order(key, &body).path(path).send(server.addr).await
    };

    let first = send("/orders", "a", order("book", r#""sent_at":"10:00""#)).await;
    let later = send("/orders", "a", order("book", r#""sent_at":"10:05""#)).await;
    let noted = send(
        "/orders",
        "a",
        order("book", r#""sent_at":"10:05","note":"x""#),
    )
    .await;
    let express = send("/express-orders", "b", order("book", r#""note":"x""#)).await;
    let express_retry = send("/express-orders", "b", order("book", r#""note":"y""#)).await;
    let express_other = send("/express-orders", "b", order("pen", r#""note":"x""#)).await;

    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(later.replayed(), "the timestamp does not count: {later:?}");
    assert_eq!(noted.status, StatusCode::CONFLICT, "any other member does");
    assert_eq!(express.status, StatusCode::CREATED, "{express:?}");
    assert!(express_retry.replayed(), "only sku and quantity count");
    assert_eq!(express_other.status, StatusCode::CONFLICT);
    assert_eq!(db.counts().await, (2, 2));
}

macro_rules! ietf_tests {
    ($backend:ident) => {
        backend_tests!($backend;
            ietf_draft_answers_with_its_statuses_and_problem_details,
            problem_details_with_own_documentation_keep_the_configured_statuses,
            the_default_stays_the_json_error_body,
            keys_of_255_characters_are_stored_and_replayed_with_max_key_len_255,
            the_default_stays_128_characters,
            the_key_from_another_header,
            the_key_from_the_json_body,
            the_key_from_a_large_json_number_keeps_every_digit,
            a_fingerprint_over_chosen_members_ignores_the_others,
        );
    };
}

mod sqlite {
    ietf_tests!(Sqlite);
}

mod postgres {
    ietf_tests!(Postgres);
}

mod sqlx_sqlite {
    ietf_tests!(SqlxSqlite);
}
