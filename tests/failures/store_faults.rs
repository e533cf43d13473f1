//! Store faults under a running server: the database turned read-only, the disk full (a size
//! cap on the writer connection, `PRAGMA max_page_count`), and the database file deleted.
//! Each gives clear 5xx answers, leaves nothing half-written (an order without its record or
//! a record without its order), and the server recovers when the fault goes away.

use support::common;

use std::sync::Arc;

use common::{post, Reply, TestServer, SHOP_A};
use http::StatusCode;
use tokio::sync::Barrier;
use tower_idempotency::store::sqlite::SqliteStore;

const BOOK: &str = r#"{"sku":"book","quantity":1}"#;

/// Every order has its record and every record its order.
async fn assert_nothing_half_written(server: &TestServer) {
    let store = server.store.clone();
    let (orphan_orders, orphan_records) = store
        .read(|conn| {
            // The test app's order bodies are `{"order_id":N}`.
            let orphan_orders: i64 = conn.query_row(
                "SELECT COUNT(*) FROM orders WHERE id NOT IN (SELECT \
                 json_extract(body, '$.order_id') FROM idempotency_records)",
                [],
                |row| row.get(0),
            )?;
            let orphan_records: i64 = conn.query_row(
                "SELECT COUNT(*) FROM idempotency_records WHERE \
                 json_extract(body, '$.order_id') NOT IN (SELECT id FROM orders)",
                [],
                |row| row.get(0),
            )?;
            Ok((orphan_orders, orphan_records))
        })
        .await
        .expect("consistency query");
    assert_eq!(orphan_orders, 0, "orders without a record");
    assert_eq!(orphan_records, 0, "records without an order");
    assert_eq!(server.order_count().await, server.record_count().await);
}

fn assert_server_error(reply: &Reply, what: &str) {
    assert!(
        reply.status.is_server_error(),
        "{what}: a 5xx, got {reply:?}"
    );
    assert!(
        reply.header("idempotent-replayed").is_none(),
        "{what}: {reply:?}"
    );
}

/// Runs `sql` on the writer connection, in a transaction of its own.
async fn on_writer(store: &SqliteStore, sql: String) {
    store
        .write(move |tx| tx.execute_batch(&sql))
        .await
        .expect("run on the writer connection");
}

/// Makes files immutable (`chattr +i`: even root cannot write them) until dropped.
struct Immutable(Vec<std::path::PathBuf>);

impl Immutable {
    /// `None` where `chattr` is missing or not permitted (another file system, no
    /// `CAP_LINUX_IMMUTABLE`).
    fn set(paths: &[std::path::PathBuf]) -> Option<Immutable> {
        let guard = Immutable(Vec::new());
        let mut guard = guard;
        for path in paths {
            let done = std::process::Command::new("chattr")
                .arg("+i")
                .arg(path)
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|status| status.success());
            if !done {
                return None; // the guard clears what was set
            }
            guard.0.push(path.clone());
        }
        Some(guard)
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::process::Command::new("chattr")
                .arg("-i")
                .arg(path)
                .status();
        }
    }
}

test! { read_only_database_file_is_5xx_and_recovers, multi_thread = 2 }
/// The database file and its WAL become read-only under the running server (the shared-memory
/// index stays writable: SQLite maps it). Commits fail; the server answers 5xx and keeps
/// nothing; replays still work; once the files are writable again the same keys run afresh.
async fn read_only_database_file_is_5xx_and_recovers() {
    let server = TestServer::spawn().await;
    let before = post(server.addr, Some(SHOP_A), Some("before"), BOOK, &[]).await;
    assert_eq!(before.status, StatusCode::CREATED);

    let wal = server.db_path.with_extension("db-wal");
    let Some(read_only) = Immutable::set(&[server.db_path.clone(), wal]) else {
        eprintln!("skipped: `chattr +i` is not available here");
        return;
    };
    // Several at once, so that some share a group commit.
    let keys: Vec<String> = (0..8).map(|i| format!("ro-{i}")).collect();
    let tasks: Vec<_> = keys
        .iter()
        .cloned()
        .map(|key| {
            let addr = server.addr;
            tokio::spawn(async move { post(addr, Some(SHOP_A), Some(&key), BOOK, &[]).await })
        })
        .collect();
    for (key, task) in keys.iter().zip(tasks) {
        assert_server_error(&task.await.expect("request"), key);
    }
    let note = common::Post::order("ro-note", r#"{"text":"hi"}"#)
        .path("/notes")
        .send(server.addr)
        .await;
    assert_server_error(&note, "a handler that writes nothing");
    let replay = post(server.addr, Some(SHOP_A), Some("before"), BOOK, &[]).await;
    assert!(replay.replayed(), "replays only read: {replay:?}");
    assert_eq!(server.order_count().await, 1);
    assert_eq!(server.record_count().await, 1);

    drop(read_only);
    for key in &keys {
        let reply = post(server.addr, Some(SHOP_A), Some(key), BOOK, &[]).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{key}: {reply:?}");
        assert!(
            !reply.replayed(),
            "{key}: nothing was kept from the failed attempt"
        );
    }
    assert_eq!(server.order_count().await, keys.len() as i64 + 1);
    assert_nothing_half_written(&server).await;
}

test! { read_only_connection_is_500_then_a_restart_recovers }
/// A writer connection that SQLite treats as read-only (`PRAGMA query_only`, the same
/// SQLITE_READONLY a read-only open gives): new keys are a 500 at once, replays still work,
/// nothing is kept; a server started again on the file (the fault gone) runs the same keys.
async fn read_only_connection_is_500_then_a_restart_recovers() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db_path = dir.path().join("orders.db");
    let server = TestServer::builder().db_path(&db_path).spawn().await;
    let before = post(server.addr, Some(SHOP_A), Some("before"), BOOK, &[]).await;
    assert_eq!(before.status, StatusCode::CREATED);
    on_writer(&server.store, "PRAGMA query_only = ON".into()).await;

    let order = post(server.addr, Some(SHOP_A), Some("ro-order"), BOOK, &[]).await;
    assert_server_error(&order, "begin on a read-only connection");
    assert_eq!(order.error_code(), "internal_error");
    let replay = post(server.addr, Some(SHOP_A), Some("before"), BOOK, &[]).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(
        server.app.handler_calls(),
        1,
        "the handler never ran read-only"
    );
    assert_eq!(server.order_count().await, 1);
    assert_eq!(server.record_count().await, 1);

    server.shutdown().await;
    let server = TestServer::builder().db_path(&db_path).spawn().await;
    let order = post(server.addr, Some(SHOP_A), Some("ro-order"), BOOK, &[]).await;
    assert_eq!(order.status, StatusCode::CREATED, "{order:?}");
    assert!(!order.replayed());
    let replay = post(server.addr, Some(SHOP_A), Some("before"), BOOK, &[]).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_nothing_half_written(&server).await;
}

test! { full_disk_is_5xx_nothing_half_written_and_recovers, multi_thread = 2 }
/// The database cannot grow while concurrent requests write (some of them in the same group
/// commit): every request gets its order and record or a 5xx with neither; once the cap is
/// lifted, the failed keys run afresh and the others replay.
async fn full_disk_is_5xx_nothing_half_written_and_recovers() {
    const REQUESTS: usize = 120;
    let server = TestServer::spawn().await;
    let first = post(server.addr, Some(SHOP_A), Some("first"), BOOK, &[]).await;
    assert_eq!(first.status, StatusCode::CREATED);

    // Full: not one page more than the database has now.
    server
        .store
        .write(|tx| {
            let pages: i64 = tx.query_row("PRAGMA page_count", [], |row| row.get(0))?;
            tx.execute_batch(&format!("PRAGMA max_page_count = {pages}"))
        })
        .await
        .expect("cap the size");

    let barrier = Arc::new(Barrier::new(REQUESTS));
    let tasks: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let (barrier, addr) = (barrier.clone(), server.addr);
            tokio::spawn(async move {
                barrier.wait().await;
                let key = format!("full-{i}");
                // Long rows, so the few free bytes left in the pages run out quickly.
                let body = format!(r#"{{"sku":"{}","quantity":1}}"#, "s".repeat(100));
                (
                    key.clone(),
                    body.clone(),
                    post(addr, Some(SHOP_A), Some(&key), &body, &[]).await,
                )
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.expect("request"));
    }
    let mut failed = 0;
    for (key, _, reply) in &outcomes {
        let stored = common::record_exists(&server.store, "shop-a", "create_order", key).await;
        match reply.status {
            StatusCode::CREATED => assert!(stored, "{key}: a 201 is stored"),
            _ => {
                assert_server_error(reply, key);
                assert!(!stored, "{key}: a failure is not stored");
                failed += 1;
            }
        }
    }
    eprintln!("full disk: {failed} of {REQUESTS} requests failed");
    assert!(failed > 0, "the disk filled up");
    assert_nothing_half_written(&server).await;

    // The disk has room again.
    on_writer(&server.store, "PRAGMA max_page_count = 1073741823".into()).await;
    let before = server.order_count().await;
    for (key, body, reply) in &outcomes {
        let again = post(server.addr, Some(SHOP_A), Some(key), body, &[]).await;
        assert_eq!(again.status, StatusCode::CREATED, "{key}: {again:?}");
        if reply.status == StatusCode::CREATED {
            assert!(again.replayed(), "{key}");
            assert_eq!(again.body, reply.body, "{key}");
        } else {
            assert!(!again.replayed(), "{key}: runs afresh");
        }
    }
    assert_eq!(server.order_count().await, before + failed);
    assert_eq!(server.order_count().await, REQUESTS as i64 + 1);
    assert_nothing_half_written(&server).await;
}

test! { database_file_deleted_under_the_server_is_refused_until_it_is_back }
/// The database file is deleted under the running server. SQLite would go on writing to the
/// unlinked file, which no restart will ever read again: every `201` from then on would be a
/// promise kept nowhere. So writes are refused (a 5xx, nothing kept) until the file is back.
#[cfg(unix)]
async fn database_file_deleted_under_the_server_is_refused_until_it_is_back() {
    let server = TestServer::spawn().await;
    let before = post(server.addr, Some(SHOP_A), Some("before"), BOOK, &[]).await;
    assert_eq!(before.status, StatusCode::CREATED);

    // Deleted, with a second name kept aside so it can be put back.
    let aside = server.db_path.with_extension("aside");
    std::fs::hard_link(&server.db_path, &aside).expect("link aside");
    std::fs::remove_file(&server.db_path).expect("delete the database");

    for key in ["during-1", "during-2"] {
        let reply = post(server.addr, Some(SHOP_A), Some(key), BOOK, &[]).await;
        assert_server_error(&reply, key);
    }
    // A completed key still replays from the open readers.
    let replay = post(server.addr, Some(SHOP_A), Some("before"), BOOK, &[]).await;
    assert!(replay.replayed(), "{replay:?}");

    // Back in place: the same keys now run, once.
    std::fs::hard_link(&aside, &server.db_path).expect("put the database back");
    std::fs::remove_file(&aside).expect("drop the second name");
    for key in ["during-1", "during-2"] {
        let reply = post(server.addr, Some(SHOP_A), Some(key), BOOK, &[]).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{key}: {reply:?}");
        assert!(!reply.replayed(), "{key}: nothing was kept while deleted");
    }
    assert_nothing_half_written(&server).await;

    // What a restart would see: the file on disk has every order that was answered 201.
    let orders = common::process::saved_orders(&server.db_path);
    assert_eq!(orders.len(), 3, "{orders:?}");
}
