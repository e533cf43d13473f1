//! `--demo`: the article's retry lab (`common/lab.rs`), with a tonic client over real HTTP/2
//! against the app on a fresh SQLite file.

use tower_idempotency::body::BoxError;

use crate::order_table::open_store;
use crate::serve_on;

/// The six steps, their checks and their lines, shared with the HTTP example.
#[path = "../common/lab.rs"]
mod lab;
/// The lab's client: the generated tonic client.
#[path = "lab_client.rs"]
mod lab_client;

/// Serves the app on an ephemeral loopback port, runs the lab against it and stops.
pub(crate) async fn run() -> Result<(), BoxError> {
    lab::demo(
        |db| async move { open_store(&db).await },
        serve_on,
        lab_client::GrpcShop::connect,
    )
    .await
}
