//! The steps mode on every store: the step store's contract, steps over real HTTP, and random
//! step programs and stops against a model.

#[macro_use]
extern crate support;

mod steps_http;
mod steps_model;
mod steps_store;

fn main() {
    support::harness::main();
}
