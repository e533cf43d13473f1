//! The client half: a retry that keeps its key survives a lost `201`.
//!
//! Starts, in this process, the order service of `examples/orders.rs` over a fresh SQLite
//! file, and a loopback TCP proxy in front of it that loses one response after the server
//! committed, then delays another past the client's per-attempt timeout. The client,
//! `RetryLayer` over hyper-util's client, places an order through the proxy each time and
//! prints what happened:
//!
//! ```text
//! cargo run --example client
//! ```
//!
//! ```text
//! lost response: 201 {"order_id":1} after 2 attempts, replayed=true, orders=1
//! delayed response: 201 {"order_id":2} after 2 attempts, replayed=true, orders=2
//! ```
//!
//! Logs go to stderr; `RUST_LOG=tower_idempotency=debug` shows each retry (with a redacted
//! key).

use std::collections::VecDeque;
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::StatusCode;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::{Layer, ServiceExt};
use tower_idempotency::body::BoxError;
use tower_idempotency::client::{BufferedBody, RetryLayer, RetryOutcome};

/// The order app that `examples/orders.rs` serves (this example does not print its banner).
#[allow(dead_code)]
#[path = "orders/app.rs"]
mod app;
/// Logging, as every example has it.
#[path = "common/cli.rs"]
mod cli;

#[tokio::main]
async fn main() -> ExitCode {
    cli::init_logging();

    // A bug that makes a request hang must fail the example, not hang it.
    match tokio::time::timeout(Duration::from_secs(30), run()).await {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(error)) => {
            eprintln!("client example failed: {error}");
            ExitCode::FAILURE
        }
        Err(_) => {
            eprintln!("client example failed: no result within 30 s");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), BoxError> {
    let dir = tempfile::tempdir()?;
    let store = app::open_store(&dir.path().join("orders.db")).await?;
    let server = TcpListener::bind("127.0.0.1:0").await?;
    let server_addr = server.local_addr()?;
    tokio::spawn(axum::serve(server, app::app(store.clone(), false)).into_future());

    // The proxy loses the first response and holds the second one for 3 s.
    let proxy = spawn_proxy(
        server_addr,
        [
            Fault::Drop,
            Fault::Forward,
            Fault::Delay(Duration::from_secs(3)),
        ],
    )
    .await?;
    let url = format!("http://{proxy}/orders");

    // The client: one line around hyper-util's client. The defaults would do; the example
    // shortens the per-attempt timeout so the delayed response is given up on quickly.
    let client = RetryLayer::new()
        .with_attempt_timeout(Duration::from_millis(500))
        .layer(Client::builder(TokioExecutor::new()).build_http::<BufferedBody>());

    for label in ["lost response", "delayed response"] {
        // No Idempotency-Key here: the client adds one and keeps it across its retries.
        let request = axum::http::Request::post(&url)
            .header(AUTHORIZATION, "Bearer shop-a-token")
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(r#"{"sku":"book","quantity":1}"#)))?;
        let response = client.clone().oneshot(request).await?;
        let status = response.status();
        let outcome = response
            .extensions()
            .get::<RetryOutcome>()
            .cloned()
            .ok_or("the response has no RetryOutcome")?;
        let body = response.into_body().collect().await?.to_bytes();
        let body = String::from_utf8(body.to_vec())?;
        let orders: i64 = store
            .read(|conn| conn.query_row("SELECT count(*) FROM orders", [], |row| row.get(0)))
            .await?;
        println!(
            "{label}: {} {body} after {} attempts, replayed={}, orders={orders}",
            status.as_u16(),
            outcome.attempts,
            outcome.replayed,
        );
        if status != StatusCode::CREATED || outcome.attempts != 2 || !outcome.replayed {
            return Err(format!("{label}: expected a replayed 201 on attempt 2").into());
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// A lossy proxy
// ---------------------------------------------------------------------------------------------

/// What the proxy does with one response, in the order responses arrive.
#[derive(Clone, Copy, Debug)]
enum Fault {
    Forward,
    /// Closes both connections as the response arrives: the server has already committed.
    Drop,
    /// Holds the response this long.
    Delay(Duration),
}

/// A TCP proxy on 127.0.0.1 in front of `upstream`; the faults apply to the first responses,
/// then everything is forwarded. HTTP/1.1 without pipelining: the first bytes from the server
/// after request bytes went up start a response.
async fn spawn_proxy(
    upstream: SocketAddr,
    faults: impl IntoIterator<Item = Fault>,
) -> Result<SocketAddr, BoxError> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let faults = Arc::new(Mutex::new(faults.into_iter().collect::<VecDeque<_>>()));
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            tokio::spawn(relay(client, upstream, faults.clone()));
        }
    });
    Ok(addr)
}

async fn relay(client: TcpStream, upstream: SocketAddr, faults: Arc<Mutex<VecDeque<Fault>>>) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let (mut up, mut down) = (vec![0u8; 16 * 1024], vec![0u8; 16 * 1024]);
    let mut client_open = true;
    let mut awaiting_response = false;
    loop {
        tokio::select! {
            read = client_read.read(&mut up), if client_open => match read {
                Ok(0) | Err(_) => {
                    client_open = false;
                    let _ = server_write.shutdown().await;
                }
                Ok(n) => {
                    if server_write.write_all(&up[..n]).await.is_err() {
                        return;
                    }
                    awaiting_response = true;
                }
            },
            read = server_read.read(&mut down) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if std::mem::take(&mut awaiting_response) {
                        let fault = faults
                            .lock()
                            .map(|mut faults| faults.pop_front())
                            .unwrap_or_default()
                            .unwrap_or(Fault::Forward);
                        match fault {
                            Fault::Forward => {}
                            Fault::Drop => {
                                eprintln!("proxy: lost a response after the server committed");
                                return;
                            }
                            Fault::Delay(delay) => {
                                eprintln!("proxy: holding a response for {delay:?}");
                                tokio::time::sleep(delay).await;
                            }
                        }
                    }
                    if client_write.write_all(&down[..n]).await.is_err() {
                        return;
                    }
                }
            },
        }
    }
}
