//! The contract of the README over real HTTP on every store, the stores' own contract, hostile
//! input, limits, the IETF draft's statuses, what the `metrics` feature records, requests the
//! layer passes through (`Option<Tx>`), the OpenAPI document against real answers, the layer
//! around a plain hyper service, SQLite's store beside another process, what each PostgreSQL
//! store adds (its pools, replay checks, round trips and SQL literals), and the property tests
//! of the canonical JSON and the key parser.

#[macro_use]
extern crate support;

mod canonical_props;
mod contract;
mod hostile;
mod hyper_service;
mod ietf_draft;
mod keyless;
mod limits;
mod metrics;
mod openapi;
mod postgres_store;
mod sqlite_store;
mod sqlx_postgres_store;
mod sqlx_sqlite_store;
mod store_contract;

fn main() {
    support::harness::main();
}
