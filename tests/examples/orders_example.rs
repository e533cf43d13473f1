//! The order example (`examples/orders.rs`) as a user runs it, a process on loopback: its
//! `/metrics` after some traffic, its `/openapi.json`, and its `--ietf` answers.

use support::common;

use std::net::SocketAddr;

use common::process::{arg, ExampleProcess};
use common::{post, Post, Reply, PATIENCE, SHOP_A};
use http::StatusCode;
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;
const PEN: &str = r#"{"sku":"pen","quantity":1}"#;

/// `GET path` with a fresh client, as `curl` would.
async fn get(addr: SocketAddr, path: &str) -> Reply {
    let client: Client<_, Empty<bytes::Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let uri = format!("http://{addr}{path}").parse().expect("uri");
    let response = tokio::time::timeout(PATIENCE, client.get(uri))
        .await
        .expect("response in time")
        .expect("response");
    Reply::read(response).await
}

/// The value of the sample `name{labels...}` whose labels include every one of `labels`.
fn sample(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|line| line.starts_with(&format!("{name}{{")))
        .find(|line| labels.iter().all(|label| line.contains(label)))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
}

test! { metrics_after_traffic_count_each_outcome_and_the_lock_wait }
async fn metrics_after_traffic_count_each_outcome_and_the_lock_wait() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("orders.db");
    let app = ExampleProcess::start("orders", &["--db", arg(&db)]).await;

    let first = post(app.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
    let replay = post(app.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
    let conflict = post(app.addr, Some(SHOP_A), Some("k1"), PEN, &[]).await;
    let second = post(app.addr, Some(SHOP_A), Some("k2"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(conflict.status, StatusCode::CONFLICT);
    assert_eq!(second.status, StatusCode::CREATED);

    let scrape = get(app.addr, "/metrics").await;

    assert_eq!(scrape.status, StatusCode::OK, "{scrape:?}");
    assert!(scrape
        .header("content-type")
        .is_some_and(|t| t.starts_with("text/plain")));
    let text = String::from_utf8(scrape.body.to_vec()).expect("UTF-8");
    let requests = |outcome: &str| {
        let outcome = format!("outcome=\"{outcome}\"");
        let labels = ["operation=\"create_order\"", outcome.as_str()];
        sample(&text, "idempotency_requests_total", &labels)
    };
    assert_eq!(requests("executed"), Some(2.0), "{text}");
    assert_eq!(requests("replayed"), Some(1.0), "{text}");
    assert_eq!(requests("conflict"), Some(1.0), "{text}");
    // A histogram with buckets (not a summary), one observation per write transaction opened:
    // the two new keys' at least; the replay and the 409 open one too when the store skips its
    // read before the transaction (retries rare so far and the writer idle), else their read
    // finds the record and opens none.
    let wait = "idempotency_lock_wait_seconds";
    let all = ["operation=\"create_order\"", "le=\"+Inf\""];
    let observed = sample(&text, &format!("{wait}_bucket"), &all).expect("the +Inf bucket");
    assert!((2.0..=4.0).contains(&observed), "{text}");
    assert!(
        text.contains(&format!(
            "{wait}_count{{operation=\"create_order\"}} {observed}"
        )),
        "{text}"
    );
}

test! { the_ietf_flag_answers_the_drafts_way }
async fn the_ietf_flag_answers_the_drafts_way() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("orders.db");
    let app = ExampleProcess::start("orders", &["--db", arg(&db), "--ietf"]).await;

    let missing = Post::order("unused", BOOK).no_key().send(app.addr).await;
    post(app.addr, Some(SHOP_A), Some("k1"), BOOK, &[]).await;
    let reused = post(app.addr, Some(SHOP_A), Some("k1"), PEN, &[]).await;

    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        missing.header("content-type"),
        Some("application/problem+json")
    );
    assert!(missing
        .header("link")
        .is_some_and(|l| l.contains("rel=\"describedby\"")));
    assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(reused.json()["title"], "Idempotency-Key is already used");

    // The OpenAPI document follows the configuration: problem details, 422, 409 in flight.
    let api = get(app.addr, "/openapi.json").await.json();
    let responses = &api["paths"]["/orders"]["post"]["responses"];
    let problem = |status: &str| &responses[status]["content"]["application/problem+json"];
    assert_eq!(
        problem("422")["schema"]["properties"]["type"]["format"],
        "uri"
    );
    assert!(problem("409")["schema"].is_object(), "{responses}");
    assert!(responses["409"]["headers"]["Retry-After"].is_object());
    assert!(responses["422"]["headers"]["Link"].is_object());
}

test! { openapi_json_documents_what_the_layer_adds_to_post_orders }
async fn openapi_json_documents_what_the_layer_adds_to_post_orders() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("orders.db");
    let app = ExampleProcess::start("orders", &["--db", arg(&db)]).await;

    let reply = get(app.addr, "/openapi.json").await;

    assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
    let api = reply.json();
    assert!(api["openapi"].as_str().is_some_and(|v| v.starts_with("3.")));
    let create = &api["paths"]["/orders"]["post"];
    let parameters = create["parameters"].as_array().expect("parameters");
    let key = parameters
        .iter()
        .find(|p| p["name"] == "Idempotency-Key")
        .expect("the key parameter");
    assert_eq!(key["in"], "header");
    assert_eq!(key["required"], true);
    assert_eq!(key["schema"]["maxLength"], 128);
    assert_eq!(key["schema"]["minLength"], 1);
    let responses = &create["responses"];
    // The handler's own responses stay, the 2xx gains the replay header.
    assert!(responses["201"]["headers"]["Location"].is_object());
    assert_eq!(
        responses["201"]["headers"]["Idempotent-Replayed"]["schema"]["enum"],
        serde_json::json!(["true"])
    );
    let own_400 = responses["400"]["description"].as_str().expect("400");
    assert!(
        own_400.starts_with("The sku or the quantity is invalid"),
        "{own_400}"
    );
    assert!(
        own_400.contains("Idempotency-Key"),
        "the layer's causes added: {own_400}"
    );
    // The layer's answers, with the default `{"error": code}` bodies.
    for status in ["401", "408", "409", "413", "500", "503"] {
        let schema = &responses[status]["content"]["application/json"]["schema"];
        assert_eq!(schema["required"], serde_json::json!(["error"]), "{status}");
    }
    assert!(responses["503"]["headers"]["Retry-After"].is_object());
    // The default waits for a request in flight: no 409 for it.
    let conflict = responses["409"]["description"].as_str().expect("409");
    assert!(!conflict.contains("still being processed"), "{conflict}");
    assert!(responses.get("422").is_none());
    // GET is not wrapped: no key parameter added (its only parameter is the path's `id`).
    let get_order = &api["paths"]["/orders/{id}"]["get"];
    let get_parameters = get_order["parameters"]
        .as_array()
        .expect("the id parameter");
    assert!(
        get_parameters.iter().all(|p| p["in"] == "path"),
        "{get_order}"
    );
}

test! { openapi_json_declares_path_parameters_and_every_code_sent }
/// The document describes what the server sends: every `{name}` of a path is a declared path
/// parameter, and each error code the app answers is in its status's documented enum.
async fn openapi_json_declares_path_parameters_and_every_code_sent() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("orders.db");
    let app = ExampleProcess::start("orders", &["--db", arg(&db)]).await;
    let api = get(app.addr, "/openapi.json").await.json();

    let paths = api["paths"].as_object().expect("paths");
    for (path, item) in paths {
        let names: Vec<&str> = path
            .split('/')
            .filter_map(|s| s.strip_prefix('{')?.strip_suffix('}'))
            .collect();
        for (method, operation) in item.as_object().expect("path item") {
            let declared = operation["parameters"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            for name in &names {
                assert!(
                    declared
                        .iter()
                        .any(|p| p["in"] == "path" && p["name"] == *name && p["required"] == true),
                    "{method} {path}: no required path parameter {name}"
                );
            }
        }
    }

    let documented = |path: &str, method: &str, status: &str| -> Vec<serde_json::Value> {
        api["paths"][path][method]["responses"][status]["content"]["application/json"]["schema"]
            ["properties"]["error"]["enum"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    };
    let bad = [
        ("not JSON", "{", "invalid_json"),
        (
            "quantity 0",
            r#"{"sku":"book","quantity":0}"#,
            "invalid_quantity",
        ),
        (
            "empty sku",
            r#"{"sku":"","quantity":1}"#,
            "invalid_key_or_sku",
        ),
    ];
    for (i, (what, body, code)) in bad.into_iter().enumerate() {
        let key = format!("openapi-bad-{i}");
        let reply = post(app.addr, Some(SHOP_A), Some(&key), body, &[]).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{what}: {reply:?}");
        assert_eq!(reply.error_code(), code, "{what}");
        assert!(
            documented("/orders", "post", "400").contains(&serde_json::json!(code)),
            "{what}: {code} not in the 400 enum"
        );
    }

    let reply = get(app.addr, "/orders/1").await;
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{reply:?}");
    assert!(
        documented("/orders/{id}", "get", "401").contains(&serde_json::json!(reply.error_code()))
    );
    assert!(!documented("/orders/{id}", "get", "404").is_empty());
}
