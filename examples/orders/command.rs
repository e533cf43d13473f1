//! The command line of `examples/orders.rs`: its usage text, its flags, and what each command
//! runs.

use std::path::PathBuf;

use tower_idempotency::body::BoxError;

use crate::cli::{Flag, Flags};

pub(crate) const USAGE: &str = "\
usage: orders [--addr ADDR] [--db PATH | --database-url URL] [--webhook URL] [--ietf]
       orders --demo

  --addr ADDR   address to listen on (default 127.0.0.1:3000)
  --db PATH     SQLite database for orders and idempotency records (default ./orders.db)
  --database-url URL
                PostgreSQL instead (postgres://user@host:5432/db): several instances may
                share it
  --webhook URL deliver the outbox's events (`order_created`) to this URL: a relay POSTs
                each one with its event id as `Idempotency-Key` until it is accepted
  --ietf        answer the IETF draft's way: problem+json bodies, 422 for a reused key,
                409 with Retry-After at once for a duplicate still running
  --demo        serve on an ephemeral loopback port with a fresh database, run the retry
                lab against it over HTTP, print its six lines and exit
  -h, --help    show this help";

pub(crate) const FLAGS: &[Flag] = &[
    Flag::Value("--addr"),
    Flag::Value("--db"),
    Flag::Value("--database-url"),
    Flag::Value("--webhook"),
    Flag::Switch("--ietf"),
    Flag::Switch("--demo"),
];

pub(crate) enum Command {
    Serve {
        addr: String,
        db: PathBuf,
        database_url: Option<String>,
        webhook: Option<String>,
        ietf: bool,
    },
    Demo,
}

impl Command {
    pub(crate) fn parse(mut flags: Flags) -> Result<Self, String> {
        let addr = flags.value("--addr");
        let db = flags.value("--db").map(PathBuf::from);
        let database_url = flags.value("--database-url");
        let webhook = flags.value("--webhook");
        let ietf = flags.switch("--ietf");
        if db.is_some() && database_url.is_some() {
            return Err("--db and --database-url are two different stores: pick one".into());
        }
        match (
            flags.switch("--demo"),
            addr.is_some() || db.is_some() || database_url.is_some() || webhook.is_some() || ietf,
        ) {
            (true, true) => {
                Err("--demo picks its own address and database, and has no options".into())
            }
            (true, false) => Ok(Command::Demo),
            (false, _) => Ok(Command::Serve {
                addr: addr.unwrap_or_else(|| "127.0.0.1:3000".into()),
                db: db.unwrap_or_else(|| "orders.db".into()),
                database_url,
                webhook,
                ietf,
            }),
        }
    }

    pub(crate) async fn run(self) -> Result<(), BoxError> {
        match self {
            Command::Serve {
                addr,
                database_url: Some(url),
                webhook,
                ietf,
                ..
            } => crate::postgres::serve(&addr, &url, webhook.as_deref(), ietf).await,
            Command::Serve {
                addr,
                db,
                webhook,
                ietf,
                ..
            } => crate::server::sqlite(&addr, &db, webhook.as_deref(), ietf).await,
            Command::Demo => crate::demo::run().await,
        }
    }
}
