//! Concurrency: duplicates in flight and waits bounded by the lock timeout on every store, the
//! in-flight policy across instances, SQLite's writer: group commit and the isolation of each
//! request in it, the writer thread, and transactions run in place; and the PostgreSQL stores
//! behind PgBouncer in transaction pooling mode (`pgbouncer`); the MySQL store on a three-node
//! MariaDB Galera cluster (`galera`).

#[macro_use]
extern crate support;

mod concurrency;
mod galera;
mod group_commit;
mod group_isolation;
mod in_flight_instances;
mod pgbouncer;
mod write_in_place;
mod writer_thread;

fn main() {
    support::harness::main();
}
