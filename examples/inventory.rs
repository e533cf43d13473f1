//! The receiving end of the orders example's outbox: reserves stock for each `order_created`
//! event, exactly once in effect however often the event is delivered.
//!
//! The orders example (`cargo run --example orders -- --webhook http://127.0.0.1:3001/events`)
//! enqueues an `order_created` event in the same transaction as each order, and its relay
//! POSTs the event here as `{"id": "<event id>", "topic": "order_created", "payload": {...}}`
//! ([`HttpSink::with_event_envelope`](tower_idempotency::outbox::HttpSink::with_event_envelope)).
//! Delivery is at least once: a relay that dies after this service answered, or an answer lost
//! on the way, means the same event arrives again.
//!
//! `POST /events` is behind [`IdempotencyLayer`] keyed on the event's own id, taken from the
//! body ([`KeyExtractor::json_pointer("/id")`](KeyExtractor::json_pointer)), as a webhook
//! receiver keys on a Stripe event's `id`: a redelivery (the same body, whatever its headers)
//! gets the first answer replayed, and the handler does not run again. The handler also
//! records the id in an inbox ([`SqliteInbox`], or [`PostgresInbox`] with `--database-url`)
//! in the same transaction as the reservation and the saved answer, so a redelivery that comes
//! after the saved answer expired (24 hours) is still acknowledged as a `duplicate` and
//! changes nothing.
//!
//! ```text
//! cargo run --example inventory                  # serves on 127.0.0.1:3001, database ./inventory.db
//! cargo run --example inventory -- --database-url postgres://postgres@127.0.0.1/inventory
//! cargo run --example inventory -- --reject-sku broken   # refuses events for one sku (422)
//! curl -s http://127.0.0.1:3001/stock
//! ```
//!
//! Every delivery the handler applied or acknowledged is printed on stdout once its answer has
//! committed (`reserved` or `duplicate`; a replayed one is answered by the layer and not
//! printed); logs go to stderr (set `RUST_LOG`, default `warn`).
//!
//! The app (its tables, the inbox on either database, the routes) is `inventory/app.rs`, which
//! the tests serve too; this file is the command line.

use std::path::PathBuf;
use std::process::ExitCode;

use axum::middleware;
use tower_idempotency::body::BoxError;

use app::{app, print_applied, Inventory};
use cli::{Flag, Flags};

/// The app: its tables, its inbox and its routes (the tests serve it too).
#[path = "inventory/app.rs"]
mod app;
/// Logging, flags and exit codes, as every example has them.
#[path = "common/cli.rs"]
mod cli;

const USAGE: &str = "\
usage: inventory [--addr ADDR] [--db PATH | --database-url URL] [--reject-sku SKU]

  --addr ADDR       address to listen on (default 127.0.0.1:3001)
  --db PATH         SQLite database for reservations and processed event ids
                    (default ./inventory.db)
  --database-url URL
                    PostgreSQL instead (postgres://user@host:5432/db): the tables go in the
                    first schema of the connection's search_path
  --reject-sku SKU  answer 422 to events for this sku (a poison event, to see the sender's
                    relay retry it and then dead-letter it)
  -h, --help        show this help";

#[tokio::main]
async fn main() -> ExitCode {
    let flags = [
        Flag::Value("--addr"),
        Flag::Value("--db"),
        Flag::Value("--database-url"),
        Flag::Value("--reject-sku"),
    ];
    cli::main("inventory", USAGE, &flags, Options::parse, serve).await
}

/// Where the reservations and the inbox live.
enum Database {
    /// `--db PATH` (the default).
    Sqlite(PathBuf),
    /// `--database-url URL`.
    Postgres(String),
}

struct Options {
    addr: String,
    database: Database,
    reject_sku: Option<String>,
}

impl Options {
    fn parse(mut flags: Flags) -> Result<Self, String> {
        let addr = flags.value("--addr");
        let db = flags.value("--db").map(PathBuf::from);
        let database_url = flags.value("--database-url");
        let reject_sku = flags.value("--reject-sku");
        let database = match (db, database_url) {
            (Some(_), Some(_)) => {
                return Err("--db and --database-url are two different stores: pick one".into())
            }
            (_, Some(url)) => Database::Postgres(url),
            (db, None) => Database::Sqlite(db.unwrap_or_else(|| "inventory.db".into())),
        };
        Ok(Options {
            addr: addr.unwrap_or_else(|| "127.0.0.1:3001".into()),
            database,
            reject_sku,
        })
    }
}

async fn serve(options: Options) -> Result<(), BoxError> {
    let (inventory, described) = match &options.database {
        Database::Sqlite(db) => (
            Inventory::open(db, options.reject_sku).await?,
            db.display().to_string(),
        ),
        #[cfg(feature = "tokio-postgres")]
        Database::Postgres(url) => (
            Inventory::connect(url, options.reject_sku).await?,
            // The URL is not printed: it may carry a password.
            "PostgreSQL".to_owned(),
        ),
        #[cfg(not(feature = "tokio-postgres"))]
        Database::Postgres(_) => {
            return Err("--database-url needs the `tokio-postgres` feature".into())
        }
    };
    let (listener, local) = cli::listen(&options.addr).await?;
    println!(
        "listening on http://{local} (database {described}); events go to POST /events, stock \
         is at GET /stock"
    );
    // Outside the layer: the answer has committed by then.
    let app = app(inventory).layer(middleware::map_response(print_applied));
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
