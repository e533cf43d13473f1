//! What the integration tests share, one module for every test group (`tests/<group>/main.rs`
//! declares it with `#[path = "../support/mod.rs"]`):
//!
//! - the groups' test harness ([`harness`]): each test registered with `test!` beside its fn,
//!   and the `main` that runs them, reporting a test whose server is missing as ignored;
//! - the order app per store, served over real HTTP on loopback ([`common`] for SQLite,
//!   [`pg_common`] for PostgreSQL on tokio-postgres and sqlx, [`mysql_common`] for MySQL and
//!   MariaDB), and the suites written once over every store ([`backend`], `backend_tests!`);
//! - the example programs as child processes ([`apps::process`], [`admin_tool`]) and the
//!   example apps served in-process, each the module its example program serves, never a copy
//!   ([`apps::grpc_orders`]; [`apps::inventory`], which [`pg_common::inventory`] serves on a
//!   PostgreSQL schema);
//! - faults ([`sqlite_faults`]), a PostgreSQL primary with a standby ([`cluster`]), the
//!   outbox's relay scenarios ([`relay_scenarios`]), the client's scripted servers
//!   ([`client_common`]), and random data ([`splitmix`], [`json_bodies`]).

// Every group's binary compiles all of this module and uses a part of it, so an item one group
// leaves unused is used by another: the allow is here once, not in each file. (The items that
// no group used were removed when the groups were formed.)
#![allow(dead_code)]

#[macro_use]
pub mod harness;

pub mod admin_tool;
pub mod apps;
#[macro_use]
pub mod backend;
pub mod client_common;
pub mod cluster;
pub mod common;
pub mod json_bodies;
pub mod mysql_common;
pub mod pg_common;
pub mod relay_scenarios;
pub mod splitmix;
pub mod sqlite_faults;
pub mod sqlite_orders;
