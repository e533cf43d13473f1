//! Failures: rollbacks on every store, the example SIGKILLed under load, store faults under a
//! running server, several processes on one SQLite file, a PostgreSQL primary failover, and
//! the handler's own serialization failures and deadlocks on PostgreSQL, and a SERIALIZABLE
//! store under load with handlers whose reads and writes conflict.

#[macro_use]
extern crate support;

mod crash;
mod multi_process;
mod postgres_failover;
mod postgres_handler_conflicts;
mod rollback;
mod serializable_load;
mod store_faults;

fn main() {
    support::harness::main();
}
