//! The OpenAPI document describes every answer of an operation the layer wraps
//! (`IdempotencyLayer::document`): the orders example's app and its document
//! (`examples/orders/openapi.rs`, as its server builds it) served on loopback, with its default
//! settings and the IETF draft's, each of the layer's answers provoked, and each body checked
//! against the schema the document gives for its status and media type; and a layer without
//! an operation name around a router whose operation documents statuses of its own (a schema
//! requiring more than the layer sends, a `$ref`).
//!
//! The schemas are checked by [`check`], a JSON Schema checker over serde_json for the
//! keywords these documents use, which refuses any other keyword rather than pass it
//! unchecked (no validator crate among the dev-dependencies).

use support::apps::orders::{app_with, idempotency, open_store};
use support::common::{ChannelBody, Post, Reply, Serving};
use support::sqlite_faults::{fail_saving_records, stop_failing_saves, OtherProcessLock};

use std::collections::BTreeSet;
use std::time::Duration;

use axum::body::Bytes;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use http::StatusCode;
use serde_json::{json, Value};
use tower_idempotency::body::BoxError;
use tower_idempotency::extract::Tx;
use tower_idempotency::store::sqlite::{SqliteHandle, SqliteStore};
use tower_idempotency::{IdempotencyLayer, Tenant};
use utoipa::openapi::content::Content;
use utoipa::openapi::path::{HttpMethod, Operation, OperationBuilder, PathItem};
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::schema::{ObjectBuilder, Ref, Schema, Type};
use utoipa::openapi::{ComponentsBuilder, OpenApiBuilder, PathsBuilder, RefOr};

/// The orders example's document, the very module its server serves at `/openapi.json` (it
/// names its error type `super::BoxError`).
#[allow(dead_code)] // Its route: the tests read the document itself.
#[path = "../../examples/orders/openapi.rs"]
mod orders_openapi;

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;
const PEN: &str = r#"{"sku":"pen","quantity":1}"#;

// ----- the checker -----

/// Checks `value` against `schema`, a JSON Schema in the OpenAPI document `root` (`$ref`s are
/// JSON pointers into it). Knows `$ref`, `type`, `enum`, `const`, `properties`, `required`,
/// `additionalProperties`, `items`, `anyOf`, `oneOf`, `allOf`, `minimum`, `maximum`,
/// `minLength`, `maxLength` and the annotations; refuses any other keyword.
fn check(root: &Value, schema: &Value, value: &Value, at: &str) -> Result<(), String> {
    let schema = match schema {
        Value::Object(schema) => schema,
        Value::Bool(true) => return Ok(()),
        Value::Bool(false) => return Err(format!("{at}: nothing fits `false`")),
        other => return Err(format!("{at}: not a schema: {other}")),
    };
    let number = |keyword: &Value| {
        keyword
            .as_f64()
            .ok_or_else(|| format!("{at}: not a number: {keyword}"))
    };
    for (keyword, argument) in schema {
        match keyword.as_str() {
            "$ref" => {
                let target = argument
                    .as_str()
                    .and_then(|reference| reference.strip_prefix('#'))
                    .and_then(|pointer| root.pointer(pointer))
                    .ok_or_else(|| format!("{at}: unresolved $ref {argument}"))?;
                check(root, target, value, at)?;
            }
            "type" => {
                let types: Vec<&str> = match argument {
                    Value::String(one) => vec![one],
                    Value::Array(many) => many.iter().filter_map(Value::as_str).collect(),
                    other => return Err(format!("{at}: type {other}")),
                };
                if !types.iter().any(|name| is_of_type(value, name)) {
                    return Err(format!("{at}: {value} is not of type {argument}"));
                }
            }
            "enum" => {
                let values = argument
                    .as_array()
                    .ok_or(format!("{at}: enum {argument}"))?;
                if !values.contains(value) {
                    return Err(format!("{at}: {value} is not one of {argument}"));
                }
            }
            "const" => {
                if argument != value {
                    return Err(format!("{at}: {value} is not {argument}"));
                }
            }
            "properties" => {
                let properties = argument.as_object().ok_or(format!("{at}: properties"))?;
                if let Some(object) = value.as_object() {
                    for (name, property) in properties {
                        if let Some(member) = object.get(name) {
                            check(root, property, member, &format!("{at}/{name}"))?;
                        }
                    }
                }
            }
            "required" => {
                let names = argument.as_array().ok_or(format!("{at}: required"))?;
                if let Some(object) = value.as_object() {
                    for name in names {
                        let name = name.as_str().ok_or(format!("{at}: required {name}"))?;
                        if !object.contains_key(name) {
                            return Err(format!("{at}: `{name}` is required"));
                        }
                    }
                }
            }
            "additionalProperties" => {
                let known = schema.get("properties").and_then(Value::as_object);
                if let Some(object) = value.as_object() {
                    for (name, member) in object {
                        if !known.is_some_and(|known| known.contains_key(name)) {
                            check(root, argument, member, &format!("{at}/{name}"))?;
                        }
                    }
                }
            }
            "items" => {
                if let Some(items) = value.as_array() {
                    for (i, item) in items.iter().enumerate() {
                        check(root, argument, item, &format!("{at}/{i}"))?;
                    }
                }
            }
            "anyOf" | "oneOf" | "allOf" => {
                let alternatives = argument.as_array().ok_or(format!("{at}: {keyword}"))?;
                let failures: Vec<String> = alternatives
                    .iter()
                    .filter_map(|alternative| check(root, alternative, value, at).err())
                    .collect();
                let fits = alternatives.len() - failures.len();
                let ok = match keyword.as_str() {
                    "anyOf" => fits >= 1,
                    "oneOf" => fits == 1,
                    _ => failures.is_empty(),
                };
                if !ok {
                    return Err(format!(
                        "{at}: {fits} of {keyword} fit {value}: {failures:?}"
                    ));
                }
            }
            "minimum" | "maximum" => {
                if let Some(n) = value.as_f64() {
                    let bound = number(argument)?;
                    if (keyword == "minimum" && n < bound) || (keyword == "maximum" && n > bound) {
                        return Err(format!("{at}: {n} is past the {keyword} {bound}"));
                    }
                }
            }
            "minLength" | "maxLength" => {
                if let Some(text) = value.as_str() {
                    let (length, bound) = (text.chars().count() as f64, number(argument)?);
                    if (keyword == "minLength" && length < bound)
                        || (keyword == "maxLength" && length > bound)
                    {
                        return Err(format!("{at}: {text:?} is past the {keyword} {bound}"));
                    }
                }
            }
            "description" | "title" | "format" | "examples" | "example" | "default"
            | "deprecated" | "readOnly" | "writeOnly" => {}
            other => return Err(format!("{at}: the checker does not know `{other}`")),
        }
    }
    Ok(())
}

fn is_of_type(value: &Value, name: &str) -> bool {
    match name {
        "object" => value.is_object(),
        "array" => value.is_array(),
        "string" => value.is_string(),
        "boolean" => value.is_boolean(),
        "null" => value.is_null(),
        "number" => value.is_number(),
        "integer" => value.is_i64() || value.is_u64(),
        _ => false,
    }
}

test! { the_checker_refuses_what_does_not_fit, sync }
fn the_checker_refuses_what_does_not_fit() {
    let root = json!({"components": {"schemas": {"Code": {"type": "string", "enum": ["a"]}}}});
    let fits = |schema: Value, value: Value| check(&root, &schema, &value, "").is_ok();
    // The orders example's own 400 before the layer's codes were merged in (issue 49): the
    // layer's answer to a missing key did not fit it.
    let apps_400 = json!({"type": "object", "properties": {"error": {"type": "string",
        "enum": ["invalid_key_or_sku", "invalid_quantity", "invalid_json"]}}});
    assert!(fits(apps_400.clone(), json!({"error": "invalid_quantity"})));
    assert!(!fits(apps_400, json!({"error": "missing_idempotency_key"})));
    let code = json!({"$ref": "#/components/schemas/Code"});
    assert!(fits(code.clone(), json!("a")));
    assert!(!fits(code.clone(), json!("b")));
    let either = json!({"anyOf": [code, {"type": "integer"}]});
    assert!(fits(either.clone(), json!(1)));
    assert!(!fits(either, json!(1.5)));
    let required = json!({"type": "object", "required": ["error", "note"]});
    assert!(!fits(required, json!({"error": "x"})));
    assert!(!fits(
        json!({"type": "string", "maxLength": 1}),
        json!("ab")
    ));
    assert!(
        !fits(json!({"pattern": "^a$"}), json!("a")),
        "unknown keywords fail"
    );
}

// ----- answers against the document -----

/// Checks `reply`, an answer of `POST path`, against `api`: its status is documented inline,
/// with a schema for its media type that its body fits, and with `Retry-After` if it sent
/// one. Returns its status.
fn assert_documented(api: &Value, path: &str, what: &str, reply: &Reply) -> u16 {
    let response = &api["paths"][path]["post"]["responses"][reply.status.as_str()];
    assert!(
        response.is_object() && response.get("$ref").is_none(),
        "{what}: {} is not documented inline: {response}",
        reply.status
    );
    let media = reply
        .header("content-type")
        .and_then(|value| value.split(';').next())
        .unwrap_or_else(|| panic!("{what}: no content type: {reply:?}"))
        .trim();
    let schema = &response["content"][media]["schema"];
    assert!(
        schema.is_object(),
        "{what}: no schema for {media} in {response}"
    );
    let body = reply.json();
    if let Err(why) = check(api, schema, &body, "") {
        panic!(
            "{what}: {body} does not fit the {} {media} schema {schema}: {why}",
            reply.status
        );
    }
    if reply.header("retry-after").is_some() {
        assert!(
            response["headers"]["Retry-After"].is_object(),
            "{what}: Retry-After not documented: {response}"
        );
    }
    reply.status.as_u16()
}

/// The statuses `api` documents for `POST path`.
fn documented(api: &Value, path: &str) -> BTreeSet<u16> {
    let responses = api["paths"][path]["post"]["responses"]
        .as_object()
        .expect("responses");
    responses
        .keys()
        .map(|status| status.parse().expect("a status"))
        .collect()
}

/// The orders app on a SQLite file of `dir` behind `layer` (configured by `configure` from
/// the example's own), its document as its server builds it, and the store.
async fn orders_app(
    dir: &tempfile::TempDir,
    ietf: bool,
    configure: impl FnOnce(IdempotencyLayer<SqliteStore>) -> IdempotencyLayer<SqliteStore>,
) -> (Serving, Value, SqliteStore) {
    let store = open_store(&dir.path().join("orders.db"))
        .await
        .expect("open the store");
    let layer = configure(idempotency(store.clone(), ietf));
    let api = serde_json::to_value(orders_openapi::document(&layer)).expect("the document");
    let server = Serving::start(app_with(store.clone(), layer)).await;
    (server, api, store)
}

/// Sends `request` and checks that it is answered `status` with the error `code` (`error`
/// in JSON, `code` in problem details), and that the answer fits the document.
async fn expect_error(
    api: &Value,
    server: &Serving,
    what: &str,
    request: Post,
    status: StatusCode,
    code: &str,
) -> u16 {
    let reply = request.send(server.addr).await;
    assert_eq!(reply.status, status, "{what}: {reply:?}");
    let body = reply.json();
    let sent = body.get("error").or_else(|| body.get("code"));
    assert_eq!(sent, Some(&json!(code)), "{what}: {body}");
    assert_documented(api, "/orders", what, &reply)
}

/// The answers both configurations send alike (but for their bodies): the app's `201` and its
/// replay, its own `400` and `401`, and the layer's `400`s, `408`, `413` and `500`. Returns
/// the statuses seen.
async fn common_answers(api: &Value, server: &Serving, store: &SqliteStore) -> BTreeSet<u16> {
    let mut seen = BTreeSet::new();
    let created = Post::order("k1", BOOK).send(server.addr).await;
    assert_eq!(created.status, StatusCode::CREATED, "{created:?}");
    seen.insert(assert_documented(api, "/orders", "created", &created));
    let replayed = Post::order("k1", BOOK).send(server.addr).await;
    assert!(replayed.replayed());
    seen.insert(assert_documented(api, "/orders", "replayed", &replayed));

    let bad = StatusCode::BAD_REQUEST;
    let long_key = "k".repeat(129);
    let cases = [
        (
            "missing key",
            Post::order("unused", BOOK).no_key(),
            "missing_idempotency_key",
        ),
        (
            "malformed key",
            Post::order("two words", BOOK),
            "invalid_idempotency_key",
        ),
        (
            "long key",
            Post::order(&long_key, BOOK),
            "idempotency_key_too_long",
        ),
        (
            "key twice",
            Post::order("a", BOOK).raw_keys(&[b"a", b"b"]),
            "duplicate_idempotency_key_header",
        ),
        ("not JSON", Post::order("k-json", "{"), "invalid_json"),
        (
            "the app's own 400",
            Post::order("k-quantity", r#"{"sku":"book","quantity":0}"#),
            "invalid_quantity",
        ),
    ];
    for (what, request, code) in cases {
        seen.insert(expect_error(api, server, what, request, bad, code).await);
    }
    // The app's authentication answers before the layer.
    let unauthenticated = Post::order("k2", BOOK).token(None);
    let status = StatusCode::UNAUTHORIZED;
    seen.insert(
        expect_error(
            api,
            server,
            "no token",
            unauthenticated,
            status,
            "unauthenticated",
        )
        .await,
    );

    let large = Post::order("k-large", "").body(vec![b' '; 1024 * 1024 + 1]);
    let status = StatusCode::PAYLOAD_TOO_LARGE;
    seen.insert(
        expect_error(
            api,
            server,
            "large body",
            large,
            status,
            "payload_too_large",
        )
        .await,
    );

    let (trickle, body) = ChannelBody::trickling();
    let slow = Post::order("k-slow", "")
        .send_streaming(server.addr, body)
        .await;
    trickle.abort();
    assert_eq!(slow.status, StatusCode::REQUEST_TIMEOUT, "{slow:?}");
    seen.insert(assert_documented(api, "/orders", "slow body", &slow));

    // The order is inserted, then saving its record fails: all rolled back.
    fail_saving_records(store).await;
    let failed = Post::order("k-fail", BOOK);
    let status = StatusCode::INTERNAL_SERVER_ERROR;
    seen.insert(expect_error(api, server, "save failed", failed, status, "internal_error").await);
    stop_failing_saves(store).await;
    seen
}

test! { every_answer_of_the_orders_example_fits_its_openapi_document }
async fn every_answer_of_the_orders_example_fits_its_openapi_document() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (server, api, store) = orders_app(&dir, false, |layer| {
        layer
            .with_lock_timeout(Duration::from_millis(300))
            .with_body_timeout(Duration::from_millis(300))
    })
    .await;

    let mut seen = common_answers(&api, &server, &store).await;
    let reused = Post::order("k1", PEN);
    let status = StatusCode::CONFLICT;
    let code = "key_reused_with_different_payload";
    seen.insert(expect_error(&api, &server, "key reused", reused, status, code).await);

    // Another process holds the database's write lock past the lock timeout.
    let lock = OtherProcessLock::take(dir.path().join("orders.db"), Duration::from_secs(10)).await;
    let busy = Post::order("k-busy", BOOK).send(server.addr).await;
    lock.release();
    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE, "{busy:?}");
    assert!(busy.header("retry-after").is_some());
    assert_eq!(busy.error_code(), "busy_retry_later");
    seen.insert(assert_documented(&api, "/orders", "busy", &busy));

    // Each status the document lists was sent, and each one sent is documented.
    assert_eq!(seen, documented(&api, "/orders"));
    // The app's own 400 keeps its shape, its enum widened with the layer's codes.
    let codes = &api["paths"]["/orders"]["post"]["responses"]["400"]["content"]["application/json"]
        ["schema"]["properties"]["error"]["enum"];
    for code in [
        "invalid_quantity",
        "missing_idempotency_key",
        "invalid_utf8",
    ] {
        assert!(
            codes.as_array().is_some_and(|c| c.contains(&json!(code))),
            "{codes}"
        );
    }
    server.stop().await;
}

test! { every_answer_fits_the_document_under_the_ietf_draft }
async fn every_answer_fits_the_document_under_the_ietf_draft() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (server, api, store) = orders_app(&dir, true, |layer| {
        layer
            .with_lock_timeout(Duration::from_millis(500))
            .with_body_timeout(Duration::from_millis(300))
    })
    .await;

    let mut seen = common_answers(&api, &server, &store).await;
    let reused = Post::order("k1", PEN);
    let status = StatusCode::UNPROCESSABLE_ENTITY;
    let code = "key_reused_with_different_payload";
    seen.insert(expect_error(&api, &server, "key reused", reused, status, code).await);

    // Two requests with one key while another process holds the write lock: one holds the
    // key while it waits (503 past the lock timeout), the other is answered 409 at once.
    let lock = OtherProcessLock::take(dir.path().join("orders.db"), Duration::from_secs(10)).await;
    let send = || {
        let request = Post::order("k-held", BOOK);
        let addr = server.addr;
        tokio::spawn(async move { request.send(addr).await })
    };
    let (first, second) = (send(), send());
    let mut replies = [first.await.expect("first"), second.await.expect("second")];
    lock.release();
    replies.sort_by_key(|reply| reply.status);
    let [in_flight, busy] = replies;
    assert_eq!(in_flight.status, StatusCode::CONFLICT, "{in_flight:?}");
    assert_eq!(in_flight.json()["code"], "request_in_flight");
    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE, "{busy:?}");
    assert_eq!(busy.json()["code"], "busy_retry_later");
    for (what, reply) in [("in flight", &in_flight), ("busy", &busy)] {
        assert!(reply.header("retry-after").is_some(), "{what}");
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json")
        );
        seen.insert(assert_documented(&api, "/orders", what, reply));
    }

    assert_eq!(seen, documented(&api, "/orders"));
    server.stop().await;
}

// ----- a layer around a router, merged into an operation's own statuses -----

/// `POST /notes/{id}`: `locked` is the app's own `409`, `bad` its own `400`, anything else a
/// `201`.
async fn add_note(Tx(_tx): Tx<SqliteHandle>, body: Bytes) -> Response {
    match &body[..] {
        b"locked" => {
            let locked = json!({"error": "note_locked", "note": 1});
            (StatusCode::CONFLICT, Json(locked)).into_response()
        }
        b"bad" => (
            StatusCode::BAD_REQUEST,
            Json(json!({"message": "bad note"})),
        )
            .into_response(),
        _ => (StatusCode::CREATED, Json(json!({"note": 1}))).into_response(),
    }
}

/// `POST /notes/{id}` as the app documents it: a `201`, its `409` (a schema requiring more
/// than the layer's body has) and its `400` (a `$ref`).
fn add_note_operation() -> Operation {
    let json = |schema: RefOr<Schema>| Content::new(Some(schema));
    let integer = || ObjectBuilder::new().schema_type(Type::Integer);
    let locked = ObjectBuilder::new()
        .property(
            "error",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some(["note_locked"])),
        )
        .property("note", integer())
        .required("error")
        .required("note");
    let created = ObjectBuilder::new()
        .property("note", integer())
        .required("note");
    OperationBuilder::new()
        .response(
            "201",
            ResponseBuilder::new()
                .description("The note")
                .content("application/json", json(created.into())),
        )
        .response(
            "409",
            ResponseBuilder::new()
                .description("The note is locked")
                .content("application/json", json(locked.into())),
        )
        .response(
            "400",
            ResponseBuilder::new().description("A bad note").content(
                "application/json",
                json(Ref::from_schema_name("BadNote").into()),
            ),
        )
        .build()
}

test! { a_layer_without_an_operation_name_merges_its_answers_into_the_operations_own }
async fn a_layer_without_an_operation_name_merges_its_answers_into_the_operations_own() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("notes.db"))
        .await
        .expect("open");
    let layer = IdempotencyLayer::new(store.clone());
    let mut add = add_note_operation();
    layer.document(&mut add);
    let once = serde_json::to_value(&add).expect("JSON");
    layer.document(&mut add);
    assert_eq!(
        serde_json::to_value(&add).expect("JSON"),
        once,
        "a second call adds nothing"
    );
    let bad_note = ObjectBuilder::new()
        .property("message", ObjectBuilder::new().schema_type(Type::String))
        .required("message");
    let api = OpenApiBuilder::new()
        .paths(PathsBuilder::new().path("/notes/{id}", PathItem::new(HttpMethod::Post, add)))
        .components(Some(
            ComponentsBuilder::new().schema("BadNote", bad_note).build(),
        ))
        .build();
    let api = serde_json::to_value(api).expect("the document");
    let router = Router::new()
        .route("/notes/{id}", post(add_note))
        .layer(layer)
        .layer(Extension(Tenant::new("shop-a")));
    let server = Serving::start(router).await;
    let path = "/notes/{id}";
    let note = |key: &str, body: &'static str| {
        Post::order(key, body)
            .path("/notes/1")
            .content_type(Some("text/plain"))
    };

    let mut seen = BTreeSet::new();
    let mut send = async |what: &str, request: Post, status: StatusCode| {
        let reply = request.send(server.addr).await;
        assert_eq!(reply.status, status, "{what}: {reply:?}");
        seen.insert(assert_documented(&api, path, what, &reply));
        reply
    };
    send("created", note("n1", "hi"), StatusCode::CREATED).await;
    let reused = send("key reused", note("n1", "ho"), StatusCode::CONFLICT).await;
    assert_eq!(reused.error_code(), "key_reused_with_different_payload");
    let locked = send("the app's 409", note("n2", "locked"), StatusCode::CONFLICT).await;
    assert_eq!(locked.error_code(), "note_locked");
    send("the app's 400", note("n3", "bad"), StatusCode::BAD_REQUEST).await;
    let missing = send("no key", note("n4", "hi").no_key(), StatusCode::BAD_REQUEST).await;
    assert_eq!(missing.error_code(), "missing_idempotency_key");
    let long = note("n5", "hi").path(&format!("/notes/{}", "a".repeat(300)));
    let long = send("long path", long, StatusCode::URI_TOO_LONG).await;
    assert_eq!(long.error_code(), "operation_too_long");
    assert_eq!(seen, BTreeSet::from([201, 400, 409, 414]));

    // The app's schemas could not take the layer's codes: each is one of `anyOf`, beside the
    // layer's; its 409's alone refuses the layer's answer.
    let responses = &api["paths"][path]["post"]["responses"];
    let schema = |status: &str| &responses[status]["content"]["application/json"]["schema"];
    assert_eq!(
        schema("400")["anyOf"][0]["$ref"],
        "#/components/schemas/BadNote"
    );
    let apps_409 = &schema("409")["anyOf"][0];
    assert!(check(&api, apps_409, &reused.json(), "").is_err());
    assert_eq!(schema("409")["anyOf"].as_array().map(Vec::len), Some(2));
    server.stop().await;
}
