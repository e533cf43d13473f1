//! An order service whose `POST /orders` is safe to retry.
//!
//! The client sends an `Idempotency-Key` with each new order. The handler inserts the order
//! through the transaction handle the layer gives it, so the order row and the saved `201`
//! commit together: a retry with the same key gets the same `201` back (marked
//! `Idempotent-Replayed: true`) and never creates a second order.
//!
//! ```text
//! cargo run --example orders                 # serves on 127.0.0.1:3000, database ./orders.db
//! cargo run --example orders -- --demo       # runs the retry lab against itself and exits
//! cargo run --example orders -- --database-url postgres://postgres@127.0.0.1/shop
//! cargo run --example orders -- --webhook http://127.0.0.1:3001/events   # with the relay
//! cargo run --example orders -- --help
//! ```
//!
//! Each new order also enqueues an `order_created` event in the same transaction (the
//! transactional outbox): the order, its saved `201` and its event commit together. With
//! `--webhook URL` a relay runs beside the server and POSTs each event there as
//! `{"id": event id, "topic": "order_created", "payload": {...}}` (the id also as
//! `Idempotency-Key`), until the receiver accepts it (`examples/inventory.rs` is one).
//!
//! ```text
//! curl -i http://127.0.0.1:3000/orders \
//!     -H 'Authorization: Bearer shop-a-token' \
//!     -H 'Idempotency-Key: key-1' \
//!     -H 'Content-Type: application/json' \
//!     -d '{"sku":"book","quantity":1}'
//! curl -i http://127.0.0.1:3000/orders/1 -H 'Authorization: Bearer shop-a-token'
//! ```
//!
//! Logs go to stderr; set `RUST_LOG` (default `warn`) to see more.
//!
//! The app (routes, handlers, the SQLite side) is `orders/app.rs`, which the tests serve too;
//! `orders/postgres.rs` puts it on PostgreSQL, and the rest of `orders/` is the command line,
//! `/metrics`, `/openapi.json`, the `--webhook` relay and the demo.

use std::process::ExitCode;

use command::{Command, FLAGS, USAGE};

/// The app: its routes, its handlers and the SQLite side (the tests serve it too).
#[path = "orders/app.rs"]
mod app;
/// Logging, flags and exit codes, as every example has them.
#[path = "common/cli.rs"]
mod cli;
/// The command line: usage, flags, and what each command runs.
#[path = "orders/command.rs"]
mod command;
/// The `--demo`: the retry lab, with an HTTP client.
#[path = "orders/demo.rs"]
mod demo;
/// The PostgreSQL variant of the app (`--database-url`).
#[path = "orders/postgres.rs"]
mod postgres;
/// Serving the app on SQLite or PostgreSQL, with `GET /metrics` and `GET /openapi.json`.
#[path = "orders/server.rs"]
mod server;
/// `--webhook URL`: the relay that delivers the outbox's events.
#[path = "orders/webhook.rs"]
mod webhook;

#[tokio::main]
async fn main() -> ExitCode {
    cli::main("orders", USAGE, FLAGS, Command::parse, Command::run).await
}
