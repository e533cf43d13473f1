//! `--webhook URL`: a relay beside the server POSTs each outbox event to `URL` as
//! `{"id", "topic", "payload"}` (the event id in the body, and as `Idempotency-Key`), until the
//! receiver accepts it (`examples/inventory.rs` is one).

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower_idempotency::body::{BoxError, RequestBody};
use tower_idempotency::outbox::{HttpSink, OutboxStore, Relay};

/// The relay's sink: POSTs each event to one URL, in the envelope that carries its id.
type WebhookSink = HttpSink<Client<HttpConnector, RequestBody>, RequestBody>;

/// Starts a relay that delivers `outbox`'s events to `url`, in a task of its own: the library
/// never spawns its background work. Claims are leased, so every instance of the app may run
/// one. Fails at once if `url` is not a URL.
pub(crate) fn spawn_relay<O: OutboxStore>(outbox: O, url: &str) -> Result<(), BoxError> {
    tokio::spawn(Relay::new(outbox, webhook_sink(url)?).run());
    Ok(())
}

fn webhook_sink(url: &str) -> Result<WebhookSink, BoxError> {
    let uri: axum::http::Uri = url
        .parse()
        .map_err(|error| format!("--webhook {url}: {error}"))?;
    let client = Client::builder(TokioExecutor::new()).build_http::<RequestBody>();
    Ok(HttpSink::new(client, uri).with_event_envelope())
}
