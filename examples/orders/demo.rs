//! `--demo`: the article's retry lab (`common/lab.rs`), over real HTTP against the app on a
//! fresh SQLite file.

use std::future::IntoFuture;

use tower_idempotency::body::BoxError;

use crate::{app, cli, open_store};

/// The six steps, their checks and their lines, shared with the gRPC example.
#[path = "../common/lab.rs"]
mod lab;
/// The lab's client: plain HTTP.
#[path = "../common/lab_http.rs"]
mod lab_http;

/// Serves the app on an ephemeral loopback port, runs the lab against it and stops.
pub(crate) async fn run() -> Result<(), BoxError> {
    let dir = tempfile::tempdir()?;
    let store = open_store(&dir.path().join("orders.db")).await?;
    let (listener, addr) = cli::listen("127.0.0.1:0").await?;
    let client = lab_http::HttpShop::new(addr);
    let router = app(store.clone(), false);
    let serve = move |shutdown: lab::Shutdown| {
        axum::serve(listener, router)
            .with_graceful_shutdown(shutdown)
            .into_future()
    };
    lab::demo(store, serve, async { Ok(client) }).await
}
