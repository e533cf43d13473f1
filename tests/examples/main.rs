//! The example programs as a user runs them (processes on loopback: orders, payments, checkout,
//! hyper, the order examples on the SQL servers and on SQLite through sqlx, the admin tool) and
//! the gRPC example's app.

#[macro_use]
extern crate support;

mod admin_cli;
mod checkout_example;
mod example_processes;
mod grpc;
mod hyper_example;
mod orders_example;
mod payments_example;
mod steps_operator;
mod wal_frames;

fn main() {
    support::harness::main();
}
