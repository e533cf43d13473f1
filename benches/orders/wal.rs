//! `wal`: the pages a new key writes, counted as WAL frames. Every page a commit changes is
//! one frame of the WAL (the page and a 24-byte header), written and checksummed before the
//! commit's sync; the count depends only on the schema and the statements, not on the
//! machine, so it is exact and the same in every run.
//!
//! Three writers, each on a fresh database (`synchronous=FULL`), one request at a time:
//! case A (the layer, `POST /orders` of the orders example), case H (the hand-written
//! transaction on the crate's tables) and M, the minimal handler a user writes without the
//! crate (`BEGIN IMMEDIATE`, look up `(tenant, key)`, insert the order, the event and a
//! `(tenant, key, payload, status, body)` row, `COMMIT`; called directly, no HTTP). Each
//! writes `warm-up` new keys, then the WAL is emptied (`wal_checkpoint(TRUNCATE)`) and pinned
//! by a read transaction on a side connection: while it is open no checkpoint (the store's
//! automatic ones included) copies a frame back or restarts the WAL, so the file only grows.
//! After `counted` new keys, its growth divided by (page size + 24) is the frames written.
//! Each frame's header names its page, and SQLite's `dbstat` table names the B-tree (a table
//! or an index) that owns the page: the count is also split by B-tree, which shows what each
//! table and index of the schema costs a new key.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::json;
use tower_idempotency::store::sqlite::rusqlite::{self, params, Connection, OptionalExtension};

use crate::cli::{Mode, Options};
use crate::extras::Extra;
use crate::load::{connect_all, run_load, Limit, Workload};
use crate::report::Goal;
use crate::servers::{open_connection, Server};
use crate::BoxError;

/// The goal of issue 35 for case A; the minimal handler writes about 4.6.
const GOAL: f64 = 5.0;

/// One writer's count.
struct Count {
    name: &'static str,
    describe: &'static str,
    frames: u64,
    bytes: u64,
    keys: u64,
    /// The frames by the B-tree their page belongs to (a table or an index), most first.
    by_tree: Vec<(String, u64)>,
}

impl Count {
    fn per_key(&self) -> f64 {
        self.frames as f64 / self.keys as f64
    }
}

/// Counts A, H and M; prints them, returns them as extras and A's goal.
pub(crate) async fn run_wal(options: &Options) -> Result<(Vec<Extra>, Vec<Goal>), BoxError> {
    let (warm, counted) = if options.quick {
        (200, 100)
    } else {
        (1000, 200)
    };
    let mut counts = Vec::new();
    for (name, describe, path) in [
        ("A", "layer, POST /orders", "/orders"),
        ("H", "hand-written, the crate's tables", "/hand/orders"),
    ] {
        counts.push(count_http(name, describe, path, warm, counted).await?);
    }
    counts.push(tokio::task::spawn_blocking(move || count_minimal(warm, counted)).await??);

    println!();
    println!(
        "WAL frames per new key (SQLite FULL, one request at a time, {counted} new keys after \
         {warm}; checkpoints held off)"
    );
    println!(
        "  {:<4} {:<40} {:>8} {:>10} {:>14}",
        "case", "writer", "frames", "per key", "bytes per key"
    );
    let mut extras = Vec::new();
    for count in &counts {
        println!(
            "  {:<4} {:<40} {:>8} {:>10.2} {:>14.0}",
            count.name,
            count.describe,
            count.frames,
            count.per_key(),
            count.bytes as f64 / count.keys as f64
        );
        for (tree, frames) in &count.by_tree {
            println!(
                "         {:<40} {:>8} {:>10.2}",
                tree,
                frames,
                *frames as f64 / count.keys as f64
            );
            extras.push(Extra {
                measure: "wal_per_new_key_by_btree",
                variant: format!("{}:{tree}", count.name),
                metric: "frames_per_key",
                value: *frames as f64 / count.keys as f64,
                unit: "frames",
            });
        }
        for (metric, value, unit) in [
            ("frames_per_key", count.per_key(), "frames"),
            (
                "bytes_per_key",
                count.bytes as f64 / count.keys as f64,
                "bytes",
            ),
        ] {
            extras.push(Extra {
                measure: "wal_per_new_key",
                variant: count.name.to_owned(),
                metric,
                value,
                unit,
            });
        }
    }
    let goals = counts
        .iter()
        .filter(|count| count.name == "A")
        .map(|count| {
            Goal::at_most(
                "WAL frames per new key, A (SQLite)".to_owned(),
                count.per_key(),
                GOAL,
                format!("{} frames over {} keys", count.frames, count.keys),
            )
        })
        .collect();
    Ok((extras, goals))
}

/// Case A or H over HTTP on a server of its own: `path` with new keys on one connection.
async fn count_http(
    name: &'static str,
    describe: &'static str,
    path: &'static str,
    warm: u64,
    counted: u64,
) -> Result<Count, BoxError> {
    let server = Server::start(Mode::Full).await?;
    let db = server
        .sqlite_path(path != "/orders")
        .ok_or("the WAL count needs a SQLite server")?;
    let workload = Arc::new(Workload::create(path, "wal-", "book"));
    let conns = connect_all(server.addr, 1).await?;
    let (conns, stats) = run_load(conns, &workload, Limit::Requests(warm)).await;
    check(name, &stats, warm)?;
    let pin = Pin::new(&db)?;
    let (conns, stats) = run_load(conns, &workload, Limit::Requests(counted)).await;
    check(name, &stats, counted)?;
    let count = pin.count(name, describe, counted)?;
    drop(conns);
    server.shut_down().await?;
    Ok(count)
}

fn check(name: &str, stats: &crate::load::LoadStats, expected: u64) -> Result<(), BoxError> {
    if stats.errors > 0 || stats.fresh != expected {
        return Err(format!(
            "WAL count, case {name}: {} fresh 201s of {expected}, {} errors ({})",
            stats.fresh,
            stats.errors,
            stats.first_error.as_deref().unwrap_or("no error text")
        )
        .into());
    }
    Ok(())
}

/// An emptied WAL, pinned by a read transaction on a side connection.
struct Pin {
    conn: Connection,
    wal: PathBuf,
    page_size: u64,
}

impl Pin {
    fn new(db: &Path) -> Result<Self, BoxError> {
        let conn = Connection::open(db)?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        let page_size: i64 = conn.query_row("PRAGMA page_size", [], |row| row.get(0))?;
        let (busy, _, _): (i64, i64, i64) =
            conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |row| {
                Ok((row.get(0)?, row.get(1)?, row.get(2)?))
            })?;
        let mut wal = db.as_os_str().to_owned();
        wal.push("-wal");
        let pin = Pin {
            conn,
            wal: PathBuf::from(wal),
            page_size: u64::try_from(page_size)?,
        };
        if busy != 0 || pin.wal_len()? != 0 {
            return Err("WAL count: the checkpoint could not empty the WAL".into());
        }
        // The read transaction starts on the empty WAL: it reads the database file only, and
        // while it lasts no checkpoint may write that file.
        pin.conn.execute_batch("BEGIN")?;
        let _: i64 = pin
            .conn
            .query_row("SELECT count(*) FROM sqlite_schema", [], |row| row.get(0))?;
        Ok(pin)
    }

    fn wal_len(&self) -> Result<u64, BoxError> {
        match std::fs::metadata(&self.wal) {
            Ok(meta) => Ok(meta.len()),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(0),
            Err(error) => Err(error.into()),
        }
    }

    /// The frames the WAL holds now (a 32-byte header, then whole frames); ends the pin.
    fn count(
        self,
        name: &'static str,
        describe: &'static str,
        keys: u64,
    ) -> Result<Count, BoxError> {
        // Read while the pin holds the WAL: every frame written since it began is there.
        let wal = std::fs::read(&self.wal).or_else(|error| match error.kind() {
            std::io::ErrorKind::NotFound => Ok(Vec::new()),
            _ => Err(error),
        })?;
        self.conn.execute_batch("COMMIT")?;
        let bytes = u64::try_from(wal.len())?;
        let frame = self.page_size + 24;
        let frames = bytes.saturating_sub(32) / frame;
        if bytes != 32 + frames * frame {
            return Err(
                format!("WAL count, case {name}: {bytes} bytes is not whole frames").into(),
            );
        }
        let by_tree = frames_by_tree(&self.conn, &wal, usize::try_from(frame)?)?;
        Ok(Count {
            name,
            describe,
            frames,
            bytes,
            keys,
            by_tree,
        })
    }
}

/// The WAL's frames by the B-tree that owns their page (SQLite's `dbstat` table): a frame's
/// header starts with its page number (4 bytes, big-endian), after the WAL's 32-byte header.
/// A page no B-tree owns (the free list) counts as `free list`.
fn frames_by_tree(
    conn: &Connection,
    wal: &[u8],
    frame: usize,
) -> Result<Vec<(String, u64)>, BoxError> {
    let mut owner = std::collections::HashMap::new();
    let mut statement = conn.prepare("SELECT pageno, name FROM dbstat")?;
    let mut rows = statement.query([])?;
    while let Some(row) = rows.next()? {
        owner.insert(row.get::<_, i64>(0)?, row.get::<_, String>(1)?);
    }
    let mut counts = std::collections::BTreeMap::<String, u64>::new();
    for header in wal.get(32..).unwrap_or_default().chunks_exact(frame) {
        let Some(number) = header.first_chunk::<4>() else {
            continue;
        };
        let page = i64::from(u32::from_be_bytes(*number));
        let tree = owner.get(&page).map_or("free list", String::as_str);
        *counts.entry(tree.to_owned()).or_default() += 1;
    }
    let mut by_tree: Vec<(String, u64)> = counts.into_iter().collect();
    by_tree.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok(by_tree)
}

/// M's tables, as a user writes them without the crate.
const MINIMAL_SCHEMA: &str = "
CREATE TABLE orders (
    id        INTEGER PRIMARY KEY,
    tenant_id TEXT    NOT NULL,
    sku       TEXT    NOT NULL,
    quantity  INTEGER NOT NULL
);
CREATE TABLE events (
    id      INTEGER PRIMARY KEY,
    topic   TEXT NOT NULL,
    payload TEXT NOT NULL
);";

/// M's answers, the table `peer --minimal` keeps them in too.
const MINIMAL_IDEMPOTENCY: &str = include_str!("../peer/minimal_idempotency.sql");

/// M: the minimal handler's transaction for one request; `true` if it created the order.
fn minimal_transaction(conn: &mut Connection, key: &str, payload: &[u8]) -> rusqlite::Result<bool> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let existing = tx
        .prepare_cached("SELECT status, body FROM idempotency WHERE tenant = ?1 AND key = ?2")?
        .query_row(params!["shop-a", key], |row| {
            Ok((row.get::<_, i64>(0)?, row.get::<_, Vec<u8>>(1)?))
        })
        .optional()?;
    if existing.is_some() {
        return Ok(false);
    }
    tx.prepare_cached("INSERT INTO orders (tenant_id, sku, quantity) VALUES (?1, ?2, ?3)")?
        .execute(params!["shop-a", "book", 1])?;
    let order_id = tx.last_insert_rowid();
    let event = json!({ "order_id": order_id, "tenant": "shop-a", "sku": "book", "quantity": 1 });
    tx.prepare_cached("INSERT INTO events (topic, payload) VALUES ('order_created', ?1)")?
        .execute([event.to_string()])?;
    let body = json!({ "order_id": order_id }).to_string();
    tx.prepare_cached(
        "INSERT INTO idempotency (tenant, key, payload, status, body) VALUES (?1, ?2, ?3, 201, ?4)",
    )?
    .execute(params!["shop-a", key, payload, body.as_bytes()])?;
    tx.commit()?;
    Ok(true)
}

/// M on a fresh database of its own.
fn count_minimal(warm: u64, counted: u64) -> Result<Count, BoxError> {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("minimal.db");
    let mut conn = open_connection(&db, Mode::Full)?;
    conn.execute_batch(MINIMAL_SCHEMA)?;
    conn.execute_batch(MINIMAL_IDEMPOTENCY)?;
    let payload = br#"{"sku":"book","quantity":1}"#;
    let mut write = |from: u64, to: u64| -> Result<(), BoxError> {
        for n in from..to {
            if !minimal_transaction(&mut conn, &format!("wal-{n}"), payload)? {
                return Err(format!("WAL count, case M: key wal-{n} was not new").into());
            }
        }
        Ok(())
    };
    write(0, warm)?;
    let pin = Pin::new(&db)?;
    write(warm, warm + counted)?;
    pin.count("M", "minimal handler (rusqlite, no crate)", counted)
}
