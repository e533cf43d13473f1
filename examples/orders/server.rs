//! Serving the order app until Ctrl-C, with `GET /metrics` and `GET /openapi.json` beside its
//! routes: on SQLite here, on PostgreSQL in `postgres.rs`.

use std::path::Path;

use axum::Router;
use tokio::net::TcpListener;
use tower_idempotency::body::BoxError;
type SqliteOutbox =
    tower_idempotency::outbox::Outbox<tower_idempotency::store::sqlite::SqliteStore>;

use crate::app::{app, idempotency, open_store, order_table};
use crate::cli::{self, ctrl_c};
use crate::webhook;

/// `GET /metrics` in the Prometheus text format.
#[path = "metrics.rs"]
mod metrics;
/// `GET /openapi.json`, the API's OpenAPI document.
#[path = "openapi.rs"]
mod openapi;

/// Serves the order API on `addr`, with the SQLite file `db` for orders, records and events;
/// with `webhook`, a relay delivers the events there.
pub(crate) async fn sqlite(
    addr: &str,
    db: &Path,
    webhook: Option<&str>,
    ietf: bool,
) -> Result<(), BoxError> {
    let store = open_store(db).await?;
    if let Some(url) = webhook {
        webhook::spawn_relay(SqliteOutbox::existing(&store), url)?;
    }
    // The library never spawns background work; expired records are purged by this task.
    order_table::spawn_purge(&store);
    let (listener, local) = cli::listen(addr).await?;
    println!("{}", order_table::banner(local, db));
    serve(listener, app(store, ietf), webhook, ietf).await
}

/// Serves `app`, `GET /metrics` and `GET /openapi.json` on `listener` until Ctrl-C. Says where
/// the relay delivers (`--webhook`) after the first line, which scripts and tests read for the
/// address.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    webhook: Option<&str>,
    ietf: bool,
) -> Result<(), BoxError> {
    let app = app
        .merge(metrics::routes(metrics::install()?))
        // Documented from a layer configured as the route's (its store plays no part).
        .merge(openapi::routes(&idempotency((), ietf))?);
    if let Some(url) = webhook {
        println!("relaying outbox events to {url}");
    }
    axum::serve(listener, app)
        .with_graceful_shutdown(ctrl_c())
        .await?;
    Ok(())
}
