//! How many pages a new key writes: the order example (`examples/orders.rs`, durable default)
//! as a process, its WAL file measured from outside. Every page a commit changes is one frame
//! of the WAL (page size + a 24-byte frame header), written and checksummed before the commit's
//! sync, so the count is what a new key costs the disk; it depends only on the schema and the
//! statements, so it is pinned here (`cargo bench --bench orders -- --cases wal` prints the
//! same count for the benchmark's cases).

use support::common;

use std::path::Path;

use common::process::{arg, ExampleProcess};
use common::{post, SHOP_A};
use http::StatusCode;
use tower_idempotency::store::sqlite::rusqlite::Connection;

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

/// New keys before the count: the B-trees past their first pages.
const WARM_UP: usize = 200;
/// New keys counted.
const COUNTED: usize = 100;
/// The count pinned: 4.56 (100 new keys after 200). The order, its record (a `WITHOUT ROWID`
/// table, one B-tree, whose random keys split pages) and the event (an id that carries its row
/// number: no `AUTOINCREMENT`, no index on it) are three B-trees; no index is written for a new
/// key (the records' purge walks their key, the outbox's indexes hold claimed events only). The
/// goal is at most 5; a minimal handler without the crate writes about 4.6.
const MAX_FRAMES_PER_KEY: f64 = 5.0;

/// The WAL's frames, from its size: a 32-byte header, then frames of a page and 24 bytes.
fn wal_frames(db: &Path, page_size: u64) -> u64 {
    let mut wal = db.as_os_str().to_owned();
    wal.push("-wal");
    let len = std::fs::metadata(&wal).map_or(0, |m| m.len());
    let frames = len.saturating_sub(32) / (page_size + 24);
    assert_eq!(
        len,
        if frames == 0 && len == 0 {
            0
        } else {
            32 + frames * (page_size + 24)
        },
        "the WAL is a header and whole frames"
    );
    frames
}

test! { a_new_key_of_the_order_example_writes_at_most_five_wal_frames }
async fn a_new_key_of_the_order_example_writes_at_most_five_wal_frames() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("orders.db");
    let app = ExampleProcess::start("orders", &["--db", arg(&db)]).await;
    let send = |key: String| async move {
        let reply = post(app.addr, Some(SHOP_A), Some(&key), BOOK, &[]).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{key}: {reply:?}");
    };
    for n in 0..WARM_UP {
        send(format!("warm-{n}")).await;
    }

    // An empty WAL, then a read transaction that pins it: while it is open no checkpoint
    // (the store's automatic ones included) copies a frame back or restarts the WAL, so the
    // file only grows, by one frame per page written.
    let side = Connection::open(&db).expect("side connection");
    side.busy_timeout(std::time::Duration::from_secs(5))
        .expect("busy timeout");
    let page_size: i64 = side
        .query_row("PRAGMA page_size", [], |row| row.get(0))
        .expect("page size");
    let page_size = u64::try_from(page_size).expect("a page size");
    let (busy, _, _): (i64, i64, i64) = side
        .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |row| {
            Ok((row.get(0)?, row.get(1)?, row.get(2)?))
        })
        .expect("checkpoint");
    assert_eq!(busy, 0, "the checkpoint emptied the WAL");
    assert_eq!(wal_frames(&db, page_size), 0);
    side.execute_batch("BEGIN").expect("begin");
    let _: i64 = side
        .query_row("SELECT count(*) FROM sqlite_master", [], |row| row.get(0))
        .expect("read");

    for n in 0..COUNTED {
        send(format!("counted-{n}")).await;
    }
    let frames = wal_frames(&db, page_size);
    side.execute_batch("COMMIT").expect("end the read");
    let per_key = frames as f64 / COUNTED as f64;
    eprintln!("{frames} WAL frames for {COUNTED} new keys: {per_key:.2} per key");
    assert!(
        per_key <= MAX_FRAMES_PER_KEY,
        "a new key writes {per_key:.2} WAL frames (pinned: at most {MAX_FRAMES_PER_KEY})"
    );
    drop(app);
}
