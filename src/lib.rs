//! Server-side `Idempotency-Key` support for tower services, with the handler's rows and the
//! saved response committed in **one database transaction**.
//!
//! A client creates an order, times out before it sees the `201`, and retries. Without care the
//! retry creates a second order. [`IdempotencyLayer`] makes the retry safe:
//!
//! 1. it checks the key and the tenant, buffers the body and fingerprints its canonical form;
//! 2. a completed record for `(tenant, operation, key)` is replayed at once (or answered `409`
//!    if the payload differs), without waiting for writers;
//! 3. otherwise it opens a write transaction, re-checks, and calls the inner service with a
//!    transaction handle in the request extensions: the handler writes its rows through it;
//! 4. a saveable response (2xx by default) is saved in the same transaction, which commits
//!    **before** the response is sent; anything else (an error status, an error, a panic, a
//!    client that went away) rolls everything back, so a retry runs afresh.
//!
//! Duplicates in flight at once queue on the write lock; the first runs the handler and the
//! others replay its response.
//!
//! # Example
//!
//! ```no_run
//! use axum::{routing::post, Router, Json};
//! use tower_idempotency::{extract::Tx, IdempotencyLayer, store::sqlite::{SqliteHandle, SqliteStore}};
//!
//! async fn create_order(Tx(tx): Tx<SqliteHandle>, Json(order): Json<serde_json::Value>)
//!     -> Result<(http::StatusCode, String), http::StatusCode>
//! {
//!     let sku = order["sku"].as_str().unwrap_or_default().to_owned();
//!     let id = tx
//!         .run(move |conn| {
//!             conn.execute("INSERT INTO orders (sku) VALUES (?1)", [sku])?;
//!             Ok(conn.last_insert_rowid())
//!         })
//!         .await
//!         .map_err(|_| http::StatusCode::INTERNAL_SERVER_ERROR)?;
//!     Ok((http::StatusCode::CREATED, format!("{{\"order_id\":{id}}}")))
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let store = SqliteStore::open("orders.db").await?;
//! store.write(|tx| tx.execute_batch("CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, sku TEXT)")).await?;
//! let app: Router = Router::new().route(
//!     "/orders",
//!     post(create_order).layer(IdempotencyLayer::new(store).with_operation("create_order")),
//! );
//! # Ok(()) }
//! ```
//!
//! The tenant comes from your authentication layer: put a [`Tenant`] in the request extensions
//! (or configure [`IdempotencyLayer::with_tenant_extractor`]).
//!
//! # Inside the handler
//!
//! Write through the handle, and only through it: [`SqliteHandle::run`][SqliteHandle::run] runs a closure
//! on the writer connection inside the request's transaction; on PostgreSQL and MySQL the
//! handle lends a connection inside it. The layer commits: a saveable response (2xx by
//! default) commits with the record; anything else, an error, a panic or a dropped request
//! rolls everything back. What a handler may and may not do, on each store:
//! [the guide](guide#writing-a-handler).
//!
//! Every setting is a `with_*` method of [`IdempotencyLayer`], documented with its default.
//! The [`guide`] has the contract in full, the limits, axum, hyper and tonic, the IETF draft,
//! the design and the example app; each store module, [`outbox`][outbox], [`client`][client],
//! [`steps`], [`admin`][admin] and [`metrics`] has its own.
//!
//! # Features
//!
//! - `sqlite` (default): [`store::sqlite::SqliteStore`][sqlite].
//! - `axum`: the [`extract::Tx`][Tx] extractor for the transaction handle (and axum's
//!   `OriginalUri` copied out of the connection's read buffer with the rest of the request head
//!   the layer keeps).
//! - `tokio-postgres`: [`store::tokio_postgres::PostgresStore`][postgres], for several app instances sharing one
//!   database (tokio-postgres with a deadpool pool).
//! - `sqlx-postgres`: [`store::sqlx_postgres::SqlxPostgresStore`][sqlx_postgres], the same
//!   store on sqlx, built from the application's own `sqlx::PgPool`; handlers run ordinary sqlx
//!   code on its `SqlxPostgresHandle`. The schema also ships as a sqlx migration
//!   (`migrations/`).
//! - `sqlx-mysql`: [`store::sqlx_mysql::SqlxMySqlStore`][sqlx_mysql], the same contract on
//!   MySQL or MariaDB (InnoDB), built from the application's own `sqlx::MySqlPool`; handlers run
//!   ordinary sqlx code on its `SqlxMySqlHandle` (migration in `migrations/mysql/`).
//! - `sqlx-sqlite`: [`store::sqlx_sqlite::SqlxSqliteStore`][sqlx_sqlite], the same contract on a
//!   SQLite file, built from the application's own `sqlx::SqlitePool`; handlers run ordinary
//!   sqlx code on its `SqlxSqliteHandle`.
//! - `client`: [`client::RetryLayer`][client], the client half: adds an `Idempotency-Key`, buffers the
//!   body and retries with the same key and bytes.
//! - `outbox`: [`outbox`][outbox], side effects that commit with the handler's rows: the handler
//!   enqueues events in its transaction, a relay you spawn delivers them at least once, and the
//!   receiver's inbox drops redeliveries.
//! - `utoipa`: [`IdempotencyLayer::document`][document] adds the `Idempotency-Key` parameter, the
//!   `Idempotent-Replayed` header and the layer's own answers to an operation of a utoipa
//!   OpenAPI document.
//! - `metrics`: requests by outcome, rollbacks, lock waits and the outbox's backlog and
//!   deliveries through the `metrics` facade; the names are in [`metrics`].
//!
//! A build for the client side alone compiles no database:
//! `tower-idempotency = { version = "0.1", default-features = false, features = ["client"] }`.
//! Without `sqlite`, `tokio-postgres`, `sqlx-postgres`, `sqlx-mysql` or `sqlx-sqlite` the layer is there with no store of this
//! crate's; bring an [`store::IdempotencyStore`] of your own.
//!
//! Operations on a store, any of the five (inspect or delete a record, counts, purge, dead
//! letters), are library calls in [`admin`][admin]; the repository's command-line tool
//! (`cargo run --example admin`) runs them on a SQLite file or a PostgreSQL database.

// Links to items of features that may be off: on docs.rs (every feature) they resolve; in a
// build without the feature they point to docs.rs, so that no build has a broken link. The
// build script writes them for this build's features (`DOC_LINKS` in build.rs); the guide
// includes the same file. (The empty line ends the paragraph before: rustdoc trims a doc
// string's leading blank lines.)
#![doc = ""]
#![doc = include_str!(concat!(env!("OUT_DIR"), "/doc_links.md"))]
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations)]
#![deny(unreachable_pub)]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(any(
    feature = "sqlite",
    feature = "tokio-postgres",
    feature = "sqlx-postgres",
    feature = "sqlx-mysql",
    feature = "sqlx-sqlite"
))]
pub mod admin;
pub mod body;
#[cfg(feature = "client")]
pub mod client;
mod error;
#[cfg(feature = "axum")]
pub mod extract;
pub mod fingerprint;
#[doc = include_str!("docs/guide.md")]
#[doc = ""]
#[doc = include_str!(concat!(env!("OUT_DIR"), "/doc_links.md"))]
pub mod guide {}
mod in_flight;
pub mod key;
mod key_source;
mod layer;
pub mod metrics;
#[cfg(feature = "sqlx-mysql")]
mod mysql;
#[cfg(feature = "utoipa")]
mod openapi;
#[cfg(feature = "outbox")]
pub mod outbox;
#[cfg(feature = "_postgres-dialect")]
mod postgres;
pub mod problem;
pub mod response;
#[cfg(feature = "_sql-store")]
mod row;
#[cfg(feature = "_row-lock-store")]
mod row_lock;
mod service;
#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(feature = "_sqlx-store")]
mod sqlx;
pub mod steps;
pub mod store;
#[cfg(feature = "tokio-postgres")]
mod tokio_postgres;

pub use crate::error::{Error, Rejection};
pub use crate::in_flight::InFlight;
pub use crate::layer::{IdempotencyLayer, Tenant, MAX_OPERATION_LEN};
pub use crate::service::{Idempotency, IDEMPOTENCY_KEY};

/// The README's examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
