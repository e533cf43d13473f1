//! `--demo`: the article's retry lab (`common/lab.rs`), with a tonic client over real HTTP/2
//! against the app on a fresh SQLite file.

use tower_idempotency::body::BoxError;

use crate::order_table::open_store;
use crate::{cli, serve_on};

/// The six steps, their checks and their lines, shared with the HTTP example.
#[path = "../common/lab.rs"]
mod lab;
/// The lab's client: the generated tonic client.
#[path = "lab_client.rs"]
mod lab_client;

/// Serves the app on an ephemeral loopback port, runs the lab against it and stops.
pub(crate) async fn run() -> Result<(), BoxError> {
    let dir = tempfile::tempdir()?;
    let store = open_store(&dir.path().join("orders.db")).await?;
    let (listener, addr) = cli::listen("127.0.0.1:0").await?;
    let client = lab_client::GrpcShop::connect(addr);
    let server = store.clone();
    lab::demo(
        store,
        |shutdown| serve_on(listener, server, shutdown),
        client,
    )
    .await
}
