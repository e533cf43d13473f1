//! The relay scenarios of the end-to-end tests, written once for the SQLite and the PostgreSQL
//! outbox: a relay killed after the receiver accepted an event (and the next relay that
//! delivers it again), and two relays sharing the work.

pub mod delivery_log;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use http::StatusCode;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tokio::sync::mpsc;
use tower::ServiceExt;
use tower_idempotency::body::{BoxError, RequestBody};
use tower_idempotency::outbox::{
    sink_fn, EventId, EventStatus, HttpSink, Outbox, OutboxBackend, OutboxEvent, Relay,
};

use crate::common::{post, PATIENCE, SHOP_A};

/// The sinks of these tests: POSTs over hyper-util's client.
pub type Http = HttpSink<Client<HttpConnector, RequestBody>, RequestBody>;

/// A sink that POSTs the bare payload to `url`, the id as `Idempotency-Key`.
pub fn http_sink(url: http::Uri) -> Http {
    HttpSink::new(Client::builder(TokioExecutor::new()).build_http(), url)
}

/// A sink as the orders example's: the event in an envelope, its id in the body.
pub fn enveloped_sink(url: http::Uri) -> Http {
    http_sink(url).with_event_envelope()
}

/// Waits until `outbox` has `delivered` delivered events.
pub async fn wait_delivered<S: OutboxBackend>(outbox: &Outbox<S>, delivered: u64) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let counts = outbox.counts().await.expect("counts");
        if counts.delivered >= delivered {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not delivered in time: {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Starts a relay on `outbox` whose sink delivers through `http` for real, then never returns,
/// so that the relay never marks the event delivered; orders 2 books from the order app at
/// `orders` (whose handler enqueues the event); and kills the relay once the receiver accepted
/// the event. Returns the event's id; the event is left in flight.
pub async fn deliver_then_kill<S: OutboxBackend>(
    outbox: &Outbox<S>,
    orders: SocketAddr,
    http: Http,
) -> EventId {
    let (accepted_tx, mut accepted) = mpsc::unbounded_channel::<EventId>();
    let accept_then_hang = sink_fn(move |event: OutboxEvent| {
        let (http, accepted_tx) = (http.clone(), accepted_tx.clone());
        async move {
            let id = event.id().clone();
            http.oneshot(event).await?;
            let _ = accepted_tx.send(id);
            std::future::pending::<Result<(), BoxError>>().await
        }
    });
    let first = tokio::spawn(
        Relay::new(outbox.clone(), accept_then_hang)
            .with_lease(Duration::from_millis(600))
            .with_poll_interval(Duration::from_millis(10))
            .run(),
    );

    let order = post(
        orders,
        Some(SHOP_A),
        Some("k1"),
        r#"{"sku":"book","quantity":2}"#,
        &[],
    )
    .await;
    assert_eq!(order.status, StatusCode::CREATED);

    let event_id = tokio::time::timeout(PATIENCE, accepted.recv())
        .await
        .expect("the first relay delivered in time")
        .expect("accepted");
    // Killed: the receiver applied the event, the sender never recorded it.
    first.abort();
    let _ = first.await;
    let event = outbox
        .event(event_id.as_str())
        .await
        .expect("read")
        .expect("event");
    assert_eq!(event.status, EventStatus::InFlight, "{event:?}");
    event_id
}

/// A second relay, delivering through `http`, until the event the killed one left in flight is
/// delivered: on its second attempt.
pub async fn redeliver<S: OutboxBackend>(outbox: &Outbox<S>, event_id: &EventId, http: Http) {
    let second = tokio::spawn(
        Relay::new(outbox.clone(), http)
            .with_poll_interval(Duration::from_millis(10))
            .run(),
    );
    wait_delivered(outbox, 1).await;
    second.abort();
    let event = outbox
        .event(event_id.as_str())
        .await
        .expect("read")
        .expect("event");
    assert_eq!((event.status, event.attempts), (EventStatus::Delivered, 2));
}

/// Runs a relay on each of `outboxes` (one database, as two processes or instances see it),
/// delivering through `sink()` in batches of 4, until `events` events are delivered.
pub async fn relays_deliver_all<S: OutboxBackend>(
    outboxes: [Outbox<S>; 2],
    sink: impl Fn() -> Http,
    events: u64,
) {
    let watched = outboxes[0].clone();
    let relays: Vec<_> = outboxes
        .into_iter()
        .map(|outbox| {
            tokio::spawn(
                Relay::new(outbox, sink())
                    .with_batch_size(4)
                    .with_poll_interval(Duration::from_millis(5))
                    .run(),
            )
        })
        .collect();
    wait_delivered(&watched, events).await;
    for relay in relays {
        relay.abort();
    }
}

/// The receiver's log of `(event id, answer)`: each of `events` ids delivered exactly once, and
/// each answered `reserved`.
pub fn assert_each_delivered_once<'a>(
    deliveries: impl IntoIterator<Item = (&'a str, &'a Value)>,
    events: usize,
) {
    let mut per_id: HashMap<&str, usize> = HashMap::new();
    for (event_id, answer) in deliveries {
        *per_id.entry(event_id).or_default() += 1;
        assert_eq!(answer["status"], "reserved", "{event_id}: {answer}");
    }
    assert_eq!(per_id.len(), events);
    assert!(
        per_id.values().all(|n| *n == 1),
        "an event was delivered twice"
    );
}
