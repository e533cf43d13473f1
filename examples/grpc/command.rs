//! The command line of `examples/grpc_orders.rs`: its usage text, its flags, and what each
//! command runs.

use std::path::PathBuf;

use tower_idempotency::body::BoxError;

use crate::cli::{Flag, Flags};

pub(crate) const USAGE: &str = "\
usage: grpc_orders [--addr ADDR] [--db PATH]
       grpc_orders --demo

  --addr ADDR   address to listen on (default 127.0.0.1:50051)
  --db PATH     SQLite database for orders and idempotency records (default ./grpc_orders.db)
  --demo        serve on an ephemeral loopback port with a fresh database, run the retry
                lab against it with a tonic client, print its six lines and exit
  -h, --help    show this help";

pub(crate) const FLAGS: &[Flag] = &[
    Flag::Value("--addr"),
    Flag::Value("--db"),
    Flag::Switch("--demo"),
];

pub(crate) enum Command {
    Serve { addr: String, db: PathBuf },
    Demo,
}

impl Command {
    pub(crate) fn parse(mut flags: Flags) -> Result<Self, String> {
        let addr = flags.value("--addr");
        let db = flags.value("--db").map(PathBuf::from);
        match (flags.switch("--demo"), addr.is_some() || db.is_some()) {
            (true, true) => Err("--demo picks its own address and database".into()),
            (true, false) => Ok(Command::Demo),
            (false, _) => Ok(Command::Serve {
                addr: addr.unwrap_or_else(|| "127.0.0.1:50051".into()),
                db: db.unwrap_or_else(|| "grpc_orders.db".into()),
            }),
        }
    }

    pub(crate) async fn run(self) -> Result<(), BoxError> {
        match self {
            Command::Serve { addr, db } => crate::serve(&addr, &db).await,
            Command::Demo => crate::demo::run().await,
        }
    }
}
