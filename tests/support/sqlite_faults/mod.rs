//! Faults on a SQLite database file for the tests that need them: another process holding
//! the file's write lock, and a trigger that makes saving an idempotency record fail after the
//! handler's own rows were written.

use std::path::PathBuf;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use tower_idempotency::store::sqlite::{rusqlite, SqliteStore};

/// Another process's connection to the file (a thread with a connection of its own), holding
/// SQLite's write lock (`BEGIN IMMEDIATE`) until it is released or `hold` has passed.
pub struct OtherProcessLock {
    release: mpsc::Sender<()>,
    holder: JoinHandle<()>,
}

impl OtherProcessLock {
    /// Takes the write lock of the file at `path`; returns once it is held.
    pub async fn take(path: impl Into<PathBuf>, hold: Duration) -> OtherProcessLock {
        let path = path.into();
        let (locked_tx, locked_rx) = tokio::sync::oneshot::channel::<()>();
        let (release, released) = mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let conn = rusqlite::Connection::open(path).expect("open");
            conn.execute_batch("BEGIN IMMEDIATE")
                .expect("take the write lock");
            let _ = locked_tx.send(());
            let _ = released.recv_timeout(hold);
            conn.execute_batch("COMMIT").expect("commit");
        });
        locked_rx.await.expect("the other process holds the lock");
        OtherProcessLock { release, holder }
    }

    /// Releases the lock now, and waits until it is released.
    pub fn release(self) {
        let _ = self.release.send(());
        self.holder.join().expect("other process");
    }

    /// Waits until the lock is released after its `hold`.
    pub fn join(self) {
        // `release` stays alive until the holder is done: a dropped sender would end the hold.
        let OtherProcessLock { release, holder } = self;
        holder.join().expect("other process");
        drop(release);
    }
}

/// Makes every insert of an idempotency record fail (`RAISE(ABORT)`): the handler's rows are
/// written, then saving the response fails and the transaction must roll back.
pub async fn fail_saving_records(store: &SqliteStore) {
    store
        .write(|tx| {
            tx.execute_batch(
                "CREATE TRIGGER fail_save BEFORE INSERT ON idempotency_records \
                 BEGIN SELECT RAISE(ABORT, 'injected save failure'); END;",
            )
        })
        .await
        .expect("trigger");
}

/// Undoes [`fail_saving_records`].
pub async fn stop_failing_saves(store: &SqliteStore) {
    store
        .write(|tx| tx.execute_batch("DROP TRIGGER fail_save"))
        .await
        .expect("drop trigger");
}
