//! The order service over gRPC (tonic), with `CreateOrder` safe to retry.
//!
//! The same guarantees as the HTTP example (`examples/orders.rs`), on a tonic server: the client
//! sends an `idempotency-key` metadata entry with each new order (metadata entries are HTTP/2
//! headers, so the layer reads it as it reads the HTTP header); the handler inserts the order
//! through the transaction handle the layer put in the request extensions, so the order row
//! and the saved response (body frames plus the `grpc-status` trailers) commit together. A
//! retry with the same key gets the same `CreateOrderResponse` back, with
//! `idempotent-replayed: true` metadata, and never creates a second order.
//!
//! ```text
//! cargo run --example grpc_orders                # serves on 127.0.0.1:50051, database ./grpc_orders.db
//! cargo run --example grpc_orders -- --demo      # runs the retry lab against itself and exits
//! cargo run --example grpc_orders -- --help
//! ```
//!
//! With `grpcurl` (it needs the schema: `-import-path proto -proto orders.proto`):
//!
//! ```text
//! grpcurl -plaintext -import-path proto -proto orders.proto \
//!     -H 'authorization: Bearer shop-a-token' -H 'idempotency-key: key-1' \
//!     -d '{"sku":"book","quantity":1}' 127.0.0.1:50051 orders.Orders/CreateOrder
//! ```
//!
//! Layer rejections reach gRPC clients as gRPC statuses: a missing or malformed key is
//! `INVALID_ARGUMENT`, a key reused with another request `FAILED_PRECONDITION`, a busy store
//! `UNAVAILABLE`, a request too large `RESOURCE_EXHAUSTED`, no tenant `UNAUTHENTICATED`; the
//! status message is the code the HTTP API puts in `{"error": ...}`.
//!
//! Logs go to stderr; set `RUST_LOG` (default `warn`) to see more.

use std::path::Path;
use std::process::ExitCode;

use tower_idempotency::body::BoxError;

use app::{order_table, pb, serve_on};
use cli::ctrl_c;
use command::{Command, FLAGS, USAGE};
use order_table::open_store;

/// The app: the layer, the authentication and the `Orders` service (the tests serve it too).
#[path = "grpc/app.rs"]
mod app;
/// Logging, flags and exit codes, as every example has them.
#[path = "common/cli.rs"]
mod cli;
/// The command line: usage, flags, and what each command runs.
#[path = "grpc/command.rs"]
mod command;
/// The `--demo`: the retry lab, with a tonic client.
#[path = "grpc/demo.rs"]
mod demo;

#[tokio::main]
async fn main() -> ExitCode {
    cli::main("grpc_orders", USAGE, FLAGS, Command::parse, Command::run).await
}

// ---------------------------------------------------------------------------------------------
// Serving
// ---------------------------------------------------------------------------------------------

async fn serve(addr: &str, db: &Path) -> Result<(), BoxError> {
    let store = open_store(db).await?;
    // The library never spawns background work; expired records are purged by this task.
    order_table::spawn_purge(&store);
    let (listener, local) = cli::listen(addr).await?;
    println!(
        "listening on {local} (gRPC, database {}); try: grpcurl -plaintext -import-path proto \
         -proto orders.proto -H 'authorization: Bearer shop-a-token' \
         -H 'idempotency-key: key-1' -d '{{\"sku\":\"book\",\"quantity\":1}}' \
         {local} orders.Orders/CreateOrder",
        db.display()
    );
    serve_on(listener, store, ctrl_c()).await?;
    Ok(())
}
