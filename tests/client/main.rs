//! The client-side retry layer: its policy against a scripted server, and the article's
//! scenarios against the real order app through a lossy proxy.

#[macro_use]
extern crate support;

mod client_policy;
mod client_scenarios;

fn main() {
    support::harness::main();
}
