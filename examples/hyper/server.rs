//! The connection loop of `examples/hyper_orders.rs`: what any hyper 1 server writes around its
//! service, with nothing of this crate's in it.

use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use crate::Body;

/// Serves HTTP/1.1 connections on `listener` with `service` until `shutdown` resolves, then
/// lets the requests in flight finish (for at most 10 s): one committed and never answered
/// would be replayed to the retry anyway, but there is no reason to make the client retry.
pub async fn serve_http1<S, F>(
    listener: TcpListener,
    service: S,
    shutdown: impl Future<Output = ()>,
) where
    S: Fn(Request<Incoming>) -> F + Clone + Send + 'static,
    F: Future<Output = Result<Response<Body>, Infallible>> + Send + 'static,
{
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    // Out of file descriptors, for instance: wait a little instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let connection = http1::Builder::new()
            .serve_connection(TokioIo::new(stream), service_fn(service.clone()));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "connection ended with an error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(Duration::from_secs(10), graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after 10 s; closing them");
    }
}
