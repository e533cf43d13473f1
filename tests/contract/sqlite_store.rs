//! SQLite-specific behaviour of the store when another process shares the database file.

use support::common;
use support::sqlite_faults;

use std::time::{Duration, SystemTime};

use common::{post, TestServer, PATIENCE, SHOP_A};
use http::StatusCode;
use sqlite_faults::OtherProcessLock;
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
