//! The transactional outbox, its relay and the receiver's inbox: in-process on every store, and
//! end to end over real HTTP on SQLite and on PostgreSQL.

#[macro_use]
extern crate support;

mod inbox;
mod outbox;
mod outbox_end_to_end;
mod outbox_postgres_end_to_end;

fn main() {
    support::harness::main();
}
