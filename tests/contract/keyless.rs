//! A request the layer passes through (no key on a route with `with_key_required(false)`, a
//! method it does not handle), over real HTTP on SQLite: `Option<Tx<H>>` is `None` for it and
//! `Some` with a key; a plain `Tx<H>` answers it `500`, logged once per layer at error level
//! with the fix; and a route without the layer is never mistaken for a request without a key.

use support::common;

use std::sync::{Arc, Mutex};

use axum::routing::post;
use axum::{Extension, Router};
use common::{record_count, Post, Serving};
use http::StatusCode;
use tower_idempotency::extract::Tx;
use tower_idempotency::store::sqlite::{SqliteHandle, SqliteStore};
use tower_idempotency::{IdempotencyLayer, Tenant};

/// Writes a note through the request's transaction when it has one; says which it got.
async fn note(tx: Option<Tx<SqliteHandle>>) -> (StatusCode, &'static str) {
    match tx {
        Some(Tx(tx)) => {
            tx.run(|conn| conn.execute("INSERT INTO notes (text) VALUES ('hi')", []))
                .await
                .expect("insert through the transaction");
            (StatusCode::CREATED, "in the transaction")
        }
        None => (StatusCode::OK, "passed through"),
    }
}

/// Needs the transaction.
async fn strict_note(Tx(_tx): Tx<SqliteHandle>) -> StatusCode {
    StatusCode::CREATED
}

/// `/notes` (`Option<Tx>`) and `/strict` (`Tx`), each behind its own layer with the key
/// optional and `POST` and `PUT` handled; `/unwrapped` (`Option<Tx>`) without the layer.
async fn serve(dir: &tempfile::TempDir) -> (Serving, SqliteStore) {
    let store = SqliteStore::open(dir.path().join("notes.db"))
        .await
        .expect("open");
    store
        .write(|tx| tx.execute_batch("CREATE TABLE notes (text TEXT NOT NULL)"))
        .await
        .expect("notes table");
    let layer = |operation: &'static str| {
        IdempotencyLayer::new(store.clone())
            .with_operation(operation)
            .with_key_required(false)
            .with_methods([http::Method::POST, http::Method::PUT])
    };
    let router = Router::new()
        .route(
            "/notes",
            post(note).put(note).patch(note).layer(layer("note")),
        )
        .route(
            "/strict",
            post(strict_note)
                .patch(strict_note)
                .layer(layer("strict_note")),
        )
        .route("/unwrapped", post(note))
        .layer(Extension(Tenant::new("shop-a")));
    (Serving::start(router).await, store)
}

async fn notes(store: &SqliteStore) -> i64 {
    store
        .read(|conn| conn.query_row("SELECT COUNT(*) FROM notes", [], |row| row.get(0)))
        .await
        .expect("count notes")
}

test! { option_tx_is_some_with_a_key_and_none_for_a_request_passed_through }
async fn option_tx_is_some_with_a_key_and_none_for_a_request_passed_through() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (server, store) = serve(&dir).await;
    let note = |key: &str| Post::order(key, r#"{"text":"hi"}"#).path("/notes");

    let keyed = note("note-1").send(server.addr).await;
    assert_eq!(keyed.status, StatusCode::CREATED, "{keyed:?}");
    assert_eq!(keyed.body, "in the transaction");
    let again = note("note-1").send(server.addr).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(again.replayed(), "a retry with the key is replayed");

    // No key: the handler runs, each time, without a transaction and without a record.
    for _ in 0..2 {
        let keyless = note("unused").no_key().send(server.addr).await;
        assert_eq!(keyless.status, StatusCode::OK, "{keyless:?}");
        assert_eq!(keyless.body, "passed through");
        assert!(!keyless.replayed());
    }
    // A method the layer does not handle is passed through too, key or not.
    let patch = common::send(
        http::Request::patch(format!("http://{}/notes", server.addr))
            .header("idempotency-key", "note-2")
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .expect("request"),
    )
    .await;
    assert_eq!(patch.status, StatusCode::OK, "{patch:?}");
    assert_eq!(patch.body, "passed through");

    assert_eq!(
        notes(&store).await,
        1,
        "one note, written once, with the key"
    );
    assert_eq!(
        record_count(&store).await,
        1,
        "one record: the keyed request's"
    );
    server.stop().await;
}

/// Collects what a `fmt` subscriber writes.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("logs").extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    /// The lines written at `level` that contain `text`.
    fn lines(&self, level: &str, text: &str) -> Vec<String> {
        let logs = String::from_utf8(self.0.lock().expect("logs").clone()).expect("UTF-8");
        logs.lines()
            .filter(|line| line.contains(level) && line.contains(text))
            .map(str::to_owned)
            .collect()
    }
}

test! { a_plain_tx_on_a_request_passed_through_is_500_logged_once_per_layer_with_the_fix }
async fn a_plain_tx_on_a_request_passed_through_is_500_logged_once_per_layer_with_the_fix() {
    // The test, the server and its handlers run on this thread (the requests passed through
    // never reach the store's writer thread): this thread's subscriber sees their logs.
    let logs = Logs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .with_writer(move || writer.clone())
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);
    let dir = tempfile::tempdir().expect("temp dir");
    let (server, store) = serve(&dir).await;
    let strict = |key: &str| Post::order(key, "{}").path("/strict");

    for _ in 0..3 {
        let keyless = strict("unused").no_key().send(server.addr).await;
        assert_eq!(
            keyless.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "{keyless:?}"
        );
        assert_eq!(keyless.error_code(), "idempotency_layer_missing");
    }
    let fix = "take Option<Tx<";
    let keyless = logs.lines("ERROR", "with_key_required(false)");
    assert_eq!(keyless.len(), 1, "logged once for the layer: {keyless:?}");
    assert!(keyless[0].contains(fix), "{}", keyless[0]);
    assert!(keyless[0].contains("SqliteHandle"), "{}", keyless[0]);
    assert!(keyless[0].contains("strict_note"), "{}", keyless[0]);

    // A method the layer does not handle: its own message, once too.
    for _ in 0..2 {
        let patch = common::send(
            http::Request::patch(format!("http://{}/strict", server.addr))
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .expect("request"),
        )
        .await;
        assert_eq!(patch.status, StatusCode::INTERNAL_SERVER_ERROR, "{patch:?}");
    }
    let unhandled = logs.lines("ERROR", "does not handle");
    assert_eq!(unhandled.len(), 1, "{unhandled:?}");
    assert!(unhandled[0].contains(fix), "{}", unhandled[0]);

    // With a key the same handler has its transaction.
    let keyed = strict("strict-1").send(server.addr).await;
    assert_eq!(keyed.status, StatusCode::CREATED, "{keyed:?}");
    assert_eq!(record_count(&store).await, 1);
    assert_eq!(
        logs.lines("ERROR", "").len(),
        2,
        "nothing else logged at error level"
    );
    server.stop().await;
}

test! { option_tx_on_a_route_without_the_layer_is_500_not_none }
async fn option_tx_on_a_route_without_the_layer_is_500_not_none() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (server, store) = serve(&dir).await;

    for key in [Some("note-1"), None] {
        let mut request = Post::order(key.unwrap_or("unused"), "{}").path("/unwrapped");
        if key.is_none() {
            request = request.no_key();
        }
        let reply = request.send(server.addr).await;
        assert_eq!(
            reply.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "{key:?}: {reply:?}"
        );
        assert_eq!(reply.error_code(), "idempotency_layer_missing");
    }
    assert_eq!(notes(&store).await, 0);
    server.stop().await;
}
