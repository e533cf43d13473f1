//! `--demo`: the article's retry lab (`common/lab.rs`), over real HTTP against the app on a
//! fresh SQLite file.

use std::future::IntoFuture;

use tower_idempotency::body::BoxError;

use crate::app::{app, open_store};

/// The six steps, their checks and their lines, shared with the gRPC example.
#[path = "../common/lab.rs"]
mod lab;
/// The lab's client: plain HTTP.
#[path = "../common/lab_http.rs"]
mod lab_http;

/// Serves the app on an ephemeral loopback port, runs the lab against it and stops.
pub(crate) async fn run() -> Result<(), BoxError> {
    lab::demo(
        |db| async move { open_store(&db).await },
        |listener, store, shutdown| {
            axum::serve(listener, app(store, false))
                .with_graceful_shutdown(shutdown)
                .into_future()
        },
        |addr| async move { Ok(lab_http::HttpShop::new(addr)) },
    )
    .await
}
