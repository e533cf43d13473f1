//! The steps mode: the step store's contract on every store, and steps over real HTTP on SQLite.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod steps_sqlite;
mod steps_store;
