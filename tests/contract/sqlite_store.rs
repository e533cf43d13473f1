//! SQLite-specific behaviour of the store: when another process shares the database file, when
//! the file is deleted under a write, and its purge of expired records (a walk along the
//! records' key, with or without the index on `expires_at` that files created before have).

use support::common;
use support::sqlite_faults;

use std::time::{Duration, SystemTime};

use common::{post, TestServer, PATIENCE, SHOP_A};
use http::StatusCode;
use sqlite_faults::OtherProcessLock;
use tower_idempotency::admin::Admin;
use tower_idempotency::store::sqlite::{rusqlite, SqliteStore};
use tower_idempotency::store::IdempotencyStore;

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

test! { short_request_lock_timeout_does_not_leak_into_purge_and_write }
/// A request's short lock timeout must not leak into later work on the writer connection:
/// `purge_expired` and `write` keep waiting for another process's lock as long as the
/// store's own busy timeout allows (5 s when opened), not the last request's remainder.
async fn short_request_lock_timeout_does_not_leak_into_purge_and_write() {
    let server =
        TestServer::with_layer(|layer| layer.with_lock_timeout(Duration::from_millis(50))).await;
    let reply = post(server.addr, Some(SHOP_A), Some("key-1"), BOOK, &[]).await;
    assert_eq!(reply.status, StatusCode::CREATED);

    // Held well past the request's 50 ms, well within the store's 5 s.
    let hold = Duration::from_millis(400);
    let other = OtherProcessLock::take(&server.db_path, hold).await;
    let purged = tokio::time::timeout(PATIENCE, server.store.purge_expired(SystemTime::now(), 100))
        .await
        .expect("purge in time");
    other.join();
    assert_eq!(
        purged.expect("purge waits for the other process's lock, then succeeds"),
        0
    );

    let other = OtherProcessLock::take(&server.db_path, hold).await;
    let written = server
        .store
        .write(|tx| tx.execute_batch("CREATE TABLE IF NOT EXISTS audit (line TEXT)"))
        .await;
    other.join();
    written.expect("write waits for the other process's lock, then succeeds");
}

test! { a_write_whose_file_is_deleted_before_its_commit_is_refused }
/// `write` checks the path again before `COMMIT`, as a request's commit does: a file deleted
/// while its closure runs gets nothing committed (SQLite would commit into the unlinked file),
/// and the write fails with the error that says so.
#[cfg(unix)]
async fn a_write_whose_file_is_deleted_before_its_commit_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("orders.db");
    let store = SqliteStore::open(&path).await.expect("open");
    store
        .write(|tx| tx.execute_batch("CREATE TABLE audit (line TEXT)"))
        .await
        .expect("create the table");

    let aside = path.with_extension("aside");
    std::fs::hard_link(&path, &aside).expect("link aside");
    let deleted = path.clone();
    let written = store
        .write(move |tx| {
            tx.execute("INSERT INTO audit (line) VALUES ('during')", [])?;
            std::fs::remove_file(&deleted).expect("delete the database");
            Ok(())
        })
        .await;
    let error = written.expect_err("the commit is refused");
    assert!(error.to_string().contains("deleted or replaced"), "{error}");

    // Back in place: nothing of that write is in the file, and writes work again.
    std::fs::hard_link(&aside, &path).expect("put the database back");
    std::fs::remove_file(&aside).expect("drop the second name");
    store
        .write(|tx| tx.execute("INSERT INTO audit (line) VALUES ('after')", []))
        .await
        .expect("a write after the file is back");
    drop(store);
    let conn = rusqlite::Connection::open(&path).expect("open the file");
    let mut lines = conn.prepare("SELECT line FROM audit").expect("prepare");
    let lines: Vec<String> = lines
        .query_map([], |row| row.get(0))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    assert_eq!(lines, ["after"]);
}

test! { stores_opening_one_new_file_at_once_all_open_it, multi_thread = 4 }
/// Several stores setting up the same new file at the same moment (as two processes started
/// together do) all open it: a busy answer while another switches it to WAL is waited out.
async fn stores_opening_one_new_file_at_once_all_open_it() {
    for _ in 0..20 {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("orders.db");
        let opens: Vec<_> = (0..8)
            .map(|_| {
                let path = path.clone();
                tokio::spawn(async move {
                    tower_idempotency::store::sqlite::SqliteStore::open(path).await
                })
            })
            .collect();
        for open in opens {
            open.await.expect("join").expect("open the new file");
        }
    }
}

/// Now in Unix milliseconds, as the store keeps its times.
fn now_millis() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as i64
}

/// Writes `count` records of shop-a's `create_order` with keys `key-000000` onwards, in key
/// order; the `n`th expired an hour ago if `expired_sql` (SQL over `n`) is true, else expires
/// in an hour. Returns how many expired.
async fn fill(store: &SqliteStore, count: i64, expired_sql: &'static str) -> i64 {
    store
        .write(move |tx| {
            tx.execute(
                &format!(
                    "WITH RECURSIVE s(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM s WHERE n + 1 < ?1) \
                     INSERT INTO idempotency_records (tenant, operation, idempotency_key, \
                     fingerprint, fingerprint_version, status, headers, body, trailers, \
                     created_at, expires_at) \
                     SELECT 'shop-a', 'create_order', printf('key-%06d', n), zeroblob(32), 1, \
                     201, '[]', X'7b7d', NULL, ?2 - 7200000, \
                     CASE WHEN {expired_sql} THEN ?2 - 3600000 ELSE ?2 + 3600000 END FROM s"
                ),
                (count, now_millis()),
            )?;
            tx.query_row(
                "SELECT count(*) FROM idempotency_records WHERE expires_at <= ?1",
                [now_millis()],
                |row| row.get(0),
            )
        })
        .await
        .expect("fill")
}

/// How many records are left, and how many of them are expired.
async fn left(store: &SqliteStore) -> (i64, i64) {
    store
        .read(|conn| {
            conn.query_row(
                "SELECT count(*), count(*) FILTER (WHERE expires_at <= ?1) \
                 FROM idempotency_records",
                [now_millis()],
                |row| Ok((row.get(0)?, row.get(1)?)),
            )
        })
        .await
        .expect("count")
}

test! { the_admin_purge_deletes_expired_records_scattered_among_many_live_ones }
/// The admin's purge, in batches of 100, of a table of 60,000 records where expired ones lie
/// alone or in runs between runs of up to 10,000 live ones (many calls' worth): every expired
/// record goes, every live one stays.
async fn the_admin_purge_deletes_expired_records_scattered_among_many_live_ones() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("store.db"))
        .await
        .expect("open");
    let expired = fill(
        &store,
        60_000,
        "n % 9973 = 0 OR n BETWEEN 30000 AND 30999 OR n >= 59990",
    )
    .await;
    assert!(expired > 1_000, "{expired}");

    let purged = Admin::new(store.clone())
        .purge_expired(100)
        .await
        .expect("purge");
    assert_eq!(purged, expired as u64);
    assert_eq!(left(&store).await, (60_000 - expired, 0));
}

test! { a_file_created_with_the_expires_at_index_keeps_it_and_purges }
/// A file whose records table was created before: a rowid table with an index on
/// `expires_at`. The store keeps the index, and its purge works on that table.
async fn a_file_created_with_the_expires_at_index_keeps_it_and_purges() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.db");
    rusqlite::Connection::open(&path)
        .expect("create the file")
        .execute_batch(
            "CREATE TABLE idempotency_records (
                tenant              TEXT    NOT NULL,
                operation           TEXT    NOT NULL,
                idempotency_key     TEXT    NOT NULL,
                fingerprint         BLOB    NOT NULL,
                fingerprint_version INTEGER NOT NULL,
                status              INTEGER NOT NULL,
                headers             TEXT    NOT NULL,
                body                BLOB    NOT NULL,
                trailers            TEXT,
                created_at          INTEGER NOT NULL,
                expires_at          INTEGER NOT NULL,
                PRIMARY KEY (tenant, operation, idempotency_key)
            );
            CREATE INDEX idempotency_records_expires_at ON idempotency_records (expires_at);",
        )
        .expect("the table as created before");
    let store = SqliteStore::open(&path).await.expect("open");
    let expired = fill(&store, 5_000, "n % 3 = 0").await;

    let purged = Admin::new(store.clone())
        .purge_expired(50)
        .await
        .expect("purge");
    assert_eq!(purged, expired as u64);
    assert_eq!(left(&store).await, (5_000 - expired, 0));
    let index: i64 = store
        .read(|conn| {
            conn.query_row(
                "SELECT count(*) FROM sqlite_schema \
                 WHERE name = 'idempotency_records_expires_at'",
                [],
                |row| row.get(0),
            )
        })
        .await
        .expect("schema");
    assert_eq!(index, 1, "the index is kept");
}
