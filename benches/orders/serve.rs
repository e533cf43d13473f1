//! `--serve`: one of the benchmark's servers, measured by nothing here, left running so that a
//! profiler can look at it from outside (`perf record -p`, `strace -f -c -p`, or the whole
//! program under `valgrind --tool=callgrind` with `callgrind_control -z`/`-d` around a burst of
//! requests). It is the server the cases get: the same routes (`/orders` under the layer,
//! `/hand/orders`, `GET /orders/{id}`, ...), the same store settings, and the orders case R
//! reads.
//!
//! Unlike the cases, the routes share one file here: once the layer's writer sees a commit by
//! H's connection, it gives way to that "other writer" for a second, and requests to `/orders`
//! queue for the writer thread instead of running in place. Send `/orders` requests for a
//! second or more after the last `/hand/orders` one before measuring the layer's c=1 path.
//! Under callgrind, start with `--instr-atstart=no` and switch on with `callgrind_control -i on`
//! (with `--collect-atstart=no` nothing is collected).

use crate::cases::READ_ORDERS;
use crate::cli::Mode;
use crate::servers::Server;
use crate::BoxError;

/// Starts `mode`'s server, prints how to call it, and runs until Ctrl-C; on PostgreSQL its
/// schema is dropped then.
pub(crate) async fn run(mode: Mode, database_url: Option<&str>) -> Result<(), BoxError> {
    let server = match (mode, database_url) {
        (Mode::Postgres, Some(url)) => {
            Server::start_postgres(url, &format!("bench_serve_{}", std::process::id())).await?
        }
        (Mode::Postgres, None) => return Err("--serve --modes pg needs --database-url".into()),
        _ => Server::start(mode).await?,
    };
    let first = server.insert_orders("book-R", READ_ORDERS).await?;
    let addr = server.addr;
    let headers = "-H 'Authorization: Bearer shop-a-token' -H 'Content-Type: application/json'";
    println!(
        "serving {} on http://{addr} (pid {}); Ctrl-C stops it\n\
         \n\
         a new key (case A; /hand/orders for H):\n  \
         curl -si {headers} -H 'Idempotency-Key: k-1' -d '{{\"sku\":\"book-A\",\"quantity\":1}}' \
         http://{addr}/orders\n\
         the same again is a replay (case B); many on one connection: list the URL many times\n\
         a read (case R), orders {first} to {}:\n  \
         curl -si -H 'Authorization: Bearer shop-a-token' http://{addr}/orders/{first}",
        mode.title(),
        std::process::id(),
        first + READ_ORDERS - 1,
    );
    tokio::signal::ctrl_c().await?;
    server.shut_down().await
}
