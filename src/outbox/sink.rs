//! Sinks: where the relay delivers events. Any `tower::Service<OutboxEvent>` is one; these are
//! the two common shapes (an async function, an HTTP endpoint).

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{Method, Request, Response, Uri};
use http_body::Body;
use http_body_util::{BodyExt, Limited};
use tower_service::Service;

use super::OutboxEvent;
use crate::body::BoxError;
use crate::service::IDEMPOTENCY_KEY;

/// The header carrying an event's topic in [`HttpSink`] deliveries.
pub const EVENT_TOPIC: HeaderName = HeaderName::from_static("event-topic");

/// A sink error that retrying cannot fix (the receiver refused the event for good): the relay
/// dead-letters the event at once instead of retrying it.
///
/// ```
/// use tower_idempotency::outbox::{sink_fn, OutboxEvent, Permanent};
///
/// let sink = sink_fn(|event: OutboxEvent| async move {
///     if event.payload_json().is_err() {
///         return Err(Permanent::new("payload is not JSON").into());
///     }
///     Ok::<(), tower_idempotency::body::BoxError>(())
/// });
/// # let _ = sink;
/// ```
#[derive(Debug)]
pub struct Permanent(BoxError);

impl Permanent {
    /// Marks `error` as permanent.
    pub fn new(error: impl Into<BoxError>) -> Self {
        Permanent(error.into())
    }
}

impl fmt::Display for Permanent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "permanent: {}", self.0)
    }
}

impl std::error::Error for Permanent {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

/// A sink made of an async function; see [`sink_fn`].
#[derive(Clone)]
pub struct SinkFn<F> {
    f: F,
}

impl<F> fmt::Debug for SinkFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SinkFn").finish_non_exhaustive()
    }
}

/// A sink that calls `f` with each event: `Ok` means the event was accepted, an error means it
/// is retried later (or dead-lettered if the error is [`Permanent`]).
///
/// ```
/// use tower_idempotency::outbox::{sink_fn, OutboxEvent};
///
/// let sink = sink_fn(|event: OutboxEvent| async move {
///     println!("{} {}", event.topic(), event.payload());
///     Ok::<(), std::io::Error>(())
/// });
/// # let _ = sink;
/// ```
pub fn sink_fn<F, Fut, E>(f: F) -> SinkFn<F>
where
    F: Fn(OutboxEvent) -> Fut,
    Fut: Future<Output = Result<(), E>>,
{
    SinkFn { f }
}

impl<F, Fut, E> Service<OutboxEvent> for SinkFn<F>
where
    F: Fn(OutboxEvent) -> Fut,
    Fut: Future<Output = Result<(), E>>,
{
    type Response = ();
    type Error = E;
    type Future = Fut;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), E>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, event: OutboxEvent) -> Fut {
        (self.f)(event)
    }
}

/// How much of a refusal's body is kept as the event's last error.
const ERROR_BODY_LIMIT: usize = 512;
/// How much of a response body is read at all (so that the connection can be reused).
const RESPONSE_READ_LIMIT: usize = 64 * 1024;

/// A sink that POSTs each event to one URL through an HTTP client (any tower service over
/// `http::Request`, such as hyper-util's client).
///
/// The request carries the payload as `application/json`, the event id as `Idempotency-Key`
/// (so a receiver behind [`IdempotencyLayer`](crate::IdempotencyLayer), or an inbox, drops
/// redeliveries) and the topic as `Event-Topic`. With
/// [`with_event_envelope`](Self::with_event_envelope) the body also carries the id and the
/// topic, as webhook events commonly do. Any `2xx` is an acceptance; anything else, or a client
/// error, is a failure to retry.
///
/// `B` is the client's request body type (any body made `From<Bytes>`), inferred from the
/// client.
///
/// ```no_run
/// use hyper_util::client::legacy::Client;
/// use hyper_util::rt::TokioExecutor;
/// use tower_idempotency::body::RequestBody;
/// use tower_idempotency::outbox::HttpSink;
///
/// let client = Client::builder(TokioExecutor::new()).build_http::<RequestBody>();
/// let sink = HttpSink::new(client, "http://127.0.0.1:3001/events".parse().unwrap());
/// # let _ = sink;
/// ```
pub struct HttpSink<C, B> {
    client: C,
    uri: Uri,
    envelope: bool,
    /// The request body type: `fn() -> B` keeps the sink `Send`/`Sync` whatever `B` is.
    body: PhantomData<fn() -> B>,
}

impl<C: Clone, B> Clone for HttpSink<C, B> {
    fn clone(&self) -> Self {
        HttpSink {
            client: self.client.clone(),
            uri: self.uri.clone(),
            envelope: self.envelope,
            body: PhantomData,
        }
    }
}

impl<C: fmt::Debug, B> fmt::Debug for HttpSink<C, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpSink")
            .field("client", &self.client)
            .field("uri", &self.uri)
            .field("envelope", &self.envelope)
            .finish()
    }
}

impl<C, B> HttpSink<C, B> {
    /// Delivers to `uri` through `client`.
    pub fn new(client: C, uri: Uri) -> Self
    where
        C: Service<Request<B>>,
    {
        HttpSink {
            client,
            uri,
            envelope: false,
            body: PhantomData,
        }
    }

    /// POSTs each event as `{"id": "<event id>", "topic": "<topic>", "payload": <payload>}`
    /// instead of the bare payload (the headers stay). The id then travels with the event's
    /// content, the way Stripe's events carry their `id`: a receiver keys its idempotency on it
    /// with [`KeyExtractor::json_pointer("/id")`](crate::key::KeyExtractor::json_pointer), and a
    /// redelivery is recognised whatever headers a proxy on the way kept or dropped. Default:
    /// the bare payload.
    ///
    /// ```no_run
    /// # use hyper_util::client::legacy::Client;
    /// # use hyper_util::rt::TokioExecutor;
    /// # use tower_idempotency::body::RequestBody;
    /// # use tower_idempotency::outbox::HttpSink;
    /// # let client = Client::builder(TokioExecutor::new()).build_http::<RequestBody>();
    /// let sink = HttpSink::new(client, "http://127.0.0.1:3001/events".parse().unwrap())
    ///     .with_event_envelope();
    /// # let _ = sink;
    /// ```
    pub fn with_event_envelope(mut self) -> Self {
        self.envelope = true;
        self
    }

    /// The URL events are POSTed to.
    pub fn uri(&self) -> &Uri {
        &self.uri
    }
}

impl<C, B, ResB> Service<OutboxEvent> for HttpSink<C, B>
where
    C: Service<Request<B>, Response = Response<ResB>> + Clone + Send + 'static,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
    B: From<Bytes>,
    ResB: Body + Send + 'static,
    ResB::Data: Send,
    ResB::Error: Into<BoxError>,
{
    type Response = ();
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.client.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, event: OutboxEvent) -> Self::Future {
        // `self.client` is the instance that was driven to readiness; take it and leave the
        // clone behind, so the ready one is the one we call.
        let clone = self.client.clone();
        let mut client = std::mem::replace(&mut self.client, clone);
        let call = match webhook_request(&self.uri, &event, self.envelope) {
            Ok(request) => client.call(request),
            Err(error) => return Box::pin(std::future::ready(Err(error))),
        };
        Box::pin(async move {
            let response = call.await.map_err(Into::into)?;
            let status = response.status();
            // Read (a bounded part of) the body either way, so the connection can be reused.
            let body = Limited::new(response.into_body(), RESPONSE_READ_LIMIT)
                .collect()
                .await
                .map(|collected| collected.to_bytes())
                .unwrap_or_default();
            if status.is_success() {
                return Ok(());
            }
            let excerpt = String::from_utf8_lossy(&body[..body.len().min(ERROR_BODY_LIMIT)])
                .trim()
                .to_owned();
            Err(format!("the receiver answered {status}: {excerpt}").into())
        })
    }
}

/// The POST that carries `event` to `uri`: its payload, or the payload in an envelope with
/// the id and the topic.
fn webhook_request<B: From<Bytes>>(
    uri: &Uri,
    event: &OutboxEvent,
    envelope: bool,
) -> Result<Request<B>, BoxError> {
    let body = if envelope {
        Bytes::from(event_envelope(event)?)
    } else {
        Bytes::copy_from_slice(event.payload().as_bytes())
    };
    let request = Request::builder()
        .method(Method::POST)
        .uri(uri.clone())
        .header(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )
        .header(IDEMPOTENCY_KEY, HeaderValue::from_str(event.id().as_str())?)
        .header(EVENT_TOPIC, HeaderValue::from_str(event.topic())?)
        .body(B::from(body))?;
    Ok(request)
}

/// `{"id":…,"topic":…,"payload":…}`, the payload as it was stored (its numbers keep every
/// digit). A stored payload that is not JSON is refused for good: no retry will make it JSON.
fn event_envelope(event: &OutboxEvent) -> Result<String, BoxError> {
    let payload: &serde_json::value::RawValue = serde_json::from_str(event.payload())
        .map_err(|error| Permanent::new(format!("the payload is not JSON: {error}")))?;
    Ok(format!(
        r#"{{"id":{},"topic":{},"payload":{}}}"#,
        serde_json::Value::from(event.id().as_str()),
        serde_json::Value::from(event.topic()),
        payload.get()
    ))
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use super::*;
    use crate::outbox::EventId;

    #[test]
    fn webhook_request_carries_the_event_id_topic_and_payload() {
        let event = OutboxEvent::new(
            EventId::from("0190-abc".to_owned()),
            "order_created",
            r#"{"order_id":1}"#,
            1,
            SystemTime::now(),
        );
        let uri: Uri = "http://127.0.0.1:9/events".parse().expect("uri");
        let request: Request<Bytes> = webhook_request(&uri, &event, false).expect("request");
        assert_eq!(request.method(), Method::POST);
        assert_eq!(request.uri(), &uri);
        assert_eq!(request.headers()["idempotency-key"], "0190-abc");
        assert_eq!(request.headers()["event-topic"], "order_created");
        assert_eq!(request.headers()["content-type"], "application/json");
        assert_eq!(request.body().as_ref(), br#"{"order_id":1}"#);
    }

    #[test]
    fn an_enveloped_request_carries_the_id_and_topic_in_the_body_too() {
        let event = OutboxEvent::new(
            EventId::from("0190-abc".to_owned()),
            "order_created",
            r#"{"order_id":1,"amount":12.50}"#,
            1,
            SystemTime::now(),
        );
        let uri: Uri = "http://127.0.0.1:9/events".parse().expect("uri");
        let request: Request<Bytes> = webhook_request(&uri, &event, true).expect("request");
        assert_eq!(request.headers()["idempotency-key"], "0190-abc");
        assert_eq!(request.headers()["event-topic"], "order_created");
        assert_eq!(
            request.body().as_ref(),
            br#"{"id":"0190-abc","topic":"order_created","payload":{"order_id":1,"amount":12.50}}"#
        );

        let not_json = OutboxEvent::new(
            EventId::from("0190-abd".to_owned()),
            "order_created",
            "{not json",
            1,
            SystemTime::now(),
        );
        let error = webhook_request::<Bytes>(&uri, &not_json, true).expect_err("refused");
        assert!(crate::outbox::is_permanent(&error), "{error}");
    }
}
