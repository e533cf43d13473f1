//! The steps mode on every store: the step store's contract, steps over real HTTP, random
//! step programs and stops against a model, and PostgreSQL at SERIALIZABLE under load.

#[macro_use]
extern crate support;

mod steps_http;
mod steps_model;
mod steps_serializable;
mod steps_store;

fn main() {
    support::harness::main();
}

/// The listing of keys in progress with `status` (of every operation, from the first), idle
/// since `idle_since` when given, at `now`, at most `limit`.
fn listing(
    status: tower_idempotency::steps::ProgressStatus,
    idle_since: Option<std::time::SystemTime>,
    now: std::time::SystemTime,
    limit: usize,
) -> tower_idempotency::steps::ProgressQuery {
    let mut query = tower_idempotency::steps::ProgressQuery::new(status, limit);
    query.idle_since = idle_since;
    query.now = now;
    query
}
