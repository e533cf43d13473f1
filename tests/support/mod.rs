//! What the integration tests share: a library of its own (`tests/support/Cargo.toml`), built
//! once and linked by every test group (`tests/<group>/main.rs`, which brings its macros with
//! `#[macro_use] extern crate support;`) and by `tests/overload.rs`:
//!
//! - the groups' test harness ([`harness`]): each test registered with [`test!`] beside its fn,
//!   and the `main` that runs them, reporting a test whose server is missing as ignored;
//! - the order app per store, served over real HTTP on loopback ([`common`] for SQLite,
//!   [`pg_common`] for PostgreSQL on tokio-postgres and sqlx, [`mysql_common`] for MySQL and
//!   MariaDB), and the suites written once over every store ([`backend`], [`backend_tests!`]);
//! - a database file for the sqlx SQLite store's tests, and what they read from it
//!   ([`sqlx_sqlite_common`]);
//! - the example programs as child processes ([`apps::process`], [`admin_tool`]) and the
//!   example apps served in-process, each the module its example program serves, never a copy
//!   ([`apps::grpc_orders`]; [`apps::inventory`], which [`pg_common::inventory`] serves on a
//!   PostgreSQL schema);
//! - faults ([`sqlite_faults`]), a PostgreSQL primary with a standby ([`cluster`]), PgBouncer in
//!   transaction pooling mode in front of the test database ([`pgbouncer`]), a three-node MariaDB
//!   Galera cluster ([`galera`]), the outbox's relay
//!   scenarios ([`relay_scenarios`]), the client's scripted servers ([`client_common`]), and
//!   random data ([`splitmix`], [`json_bodies`]).

pub mod harness;

pub mod admin_tool;
pub mod apps;
pub mod backend;
pub mod client_common;
pub mod cluster;
pub mod common;
pub mod galera;
pub mod json_bodies;
pub mod mysql_common;
pub mod pg_common;
pub mod pgbouncer;
pub mod relay_scenarios;
pub mod splitmix;
pub mod sqlite_faults;
pub mod sqlite_orders;
pub mod sqlx_sqlite_common;
