//! The reader connections: the replay fast path and
//! [`SqliteStore::read`](super::SqliteStore::read).
//!
//! Read-only connections to the same file, kept in a small pool on the store's [`Shared`]
//! state; in WAL mode they never wait for the writer. A record lookup runs **in place**, on
//! the request's own thread, when it cannot wait: an idle connection is at hand and SQLite
//! answers without a busy wait (a point read of a cached page takes microseconds, less than
//! handing the read to another thread and back). Otherwise, or with
//! [`SqliteOptions::with_read_in_place(false)`](super::SqliteOptions::with_read_in_place), it runs under
//! `spawn_blocking`. For a request's first attempt (`executor`), the side that finds no live
//! record queues the request's begin for the writer itself ([`Shared::look_up_then_queue`]),
//! so that the request is woken once, by its answer. Rows are decoded by `records`.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rusqlite::{Connection, OpenFlags};

use super::records::read_record;
use super::reservation::TxShared;
use super::writer::{Step, NESTED_REQUEST};
use super::Shared;
use super::READER_BUSY_TIMEOUT;
use crate::error::Error;
use crate::store::{Scope, StoredRecord};

impl Shared {
    /// Runs `f` on an idle reader connection (a new one if none is idle), with a busy wait of
    /// [`READER_BUSY_TIMEOUT`]: off the executor only.
    pub(super) fn with_reader<T>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let idle = self.readers.lock().ok().and_then(|mut pool| pool.pop());
        let conn = match idle {
            Some(conn) => conn,
            None => open_reader(&self.path)?,
        };
        conn.busy_timeout(READER_BUSY_TIMEOUT)?;
        let result = f(&conn);
        // Idle connections wait for no lock (the in-place reads take them as they are); one
        // whose busy timeout cannot be cleared is not kept.
        if conn.busy_timeout(Duration::ZERO).is_ok() {
            self.return_reader(conn);
        }
        result
    }

    /// Keeps `conn` (with no busy wait) for the next read, unless enough are idle.
    fn return_reader(&self, conn: Connection) {
        if let Ok(mut pool) = self.readers.lock() {
            if pool.len() < self.max_idle_readers {
                pool.push(conn);
            }
        }
    }

    /// The live record of `scope`, read on the calling thread if that cannot wait: on an idle
    /// reader connection, with no busy wait (idle connections have none). `None` when it would
    /// have to wait (the option is off, no connection is idle, or SQLite answered busy): read
    /// under `spawn_blocking` then.
    pub(super) fn try_read_live_record_in_place(
        &self,
        scope: &Scope,
        now: SystemTime,
    ) -> Option<Result<Option<StoredRecord>, Error>> {
        if !self.read_in_place {
            return None;
        }
        let conn = self.readers.lock().ok()?.pop()?;
        let read = read_record(&conn, scope);
        self.return_reader(conn);
        match read {
            Err(error) if error.is_busy() => None,
            read => Some(read.map(|record| record.filter(|record| record.expires_at > now))),
        }
    }

    /// The live (unexpired at `now`) record of `scope`, read on a reader connection. Blocking.
    pub(super) fn read_live_record(
        &self,
        scope: &Scope,
        now: SystemTime,
    ) -> Result<Option<StoredRecord>, Error> {
        let record = self.with_reader(|conn| read_record(conn, scope))?;
        Ok(record.filter(|record| record.expires_at > now))
    }

    /// In place if it cannot wait, else on a reader thread, not awaited: reads the live record
    /// of `scope` and gives it to `start`, then queues the begin `start` returns (given no
    /// record) for the writer, on behalf of `request`. A failing read is only logged: the
    /// begin reads again, authoritatively.
    pub(super) fn look_up_then_queue(
        self: &Arc<Self>,
        scope: Scope,
        now: SystemTime,
        request: Arc<TxShared>,
        start: impl FnOnce(Option<StoredRecord>) -> Option<Step> + Send + 'static,
    ) {
        let answer = move |shared: &Shared, found: Result<Option<StoredRecord>, Error>| {
            let found = found.unwrap_or_else(|error| {
                // The begin reads again, authoritatively.
                tracing::warn!(%error, "idempotency fast-path lookup failed");
                None
            });
            if let Some(begin) = start(found) {
                // If the store is gone, dropping the begin drops its reply: the request hears
                // of it.
                let _ = shared.send_exclusive(begin, Some(request), NESTED_REQUEST);
            }
        };
        if let Some(found) = self.try_read_live_record_in_place(&scope, now) {
            answer(self, found);
            return;
        }
        let shared = self.clone();
        // Not awaited: `start` answers the request, or the begin it returns does.
        drop(tokio::task::spawn_blocking(move || {
            let found = shared.read_live_record(&scope, now);
            answer(&shared, found);
        }));
    }
}

/// A new read-only connection to the database at `path`, with no busy wait (as idle
/// connections are kept).
pub(super) fn open_reader(path: &Path) -> Result<Connection, Error> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.busy_timeout(Duration::ZERO)?;
    Ok(conn)
}

/// [`open_reader`], having read the records' table once (waiting up to `busy_wait` for a
/// process that is setting the file up): its view of the file (the schema, the WAL index) is
/// then set up, and it goes on reading should the file be deleted or become unreadable later.
pub(super) fn open_warm_reader(path: &Path, busy_wait: Duration) -> Result<Connection, Error> {
    let conn = open_reader(path)?;
    conn.busy_timeout(busy_wait)?;
    conn.execute_batch("SELECT 1 FROM idempotency_records LIMIT 0")?;
    conn.busy_timeout(Duration::ZERO)?;
    Ok(conn)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::IdempotencyKey;
    use crate::store::sqlite::SqliteStore;

    fn busy_timeout_ms(conn: &Connection) -> rusqlite::Result<i64> {
        conn.query_row("PRAGMA busy_timeout", [], |row| row.get(0))
    }

    #[tokio::test]
    async fn idle_readers_wait_for_no_lock_and_reads_off_the_executor_do() {
        let dir = tempfile::tempdir().expect("dir");
        let store = SqliteStore::open(dir.path().join("store.db"))
            .await
            .expect("open");
        // Off the executor, a read waits for locks up to the readers' busy timeout.
        let during = store.read(busy_timeout_ms).await.expect("read");
        assert_eq!(during, READER_BUSY_TIMEOUT.as_millis() as i64);
        // The connection it used is idle now, with no busy wait, and the in-place read uses it.
        let idle = store.shared.with_reader_unchanged(busy_timeout_ms);
        assert_eq!(idle, Some(0));
        let key = IdempotencyKey::parse(b"k1", 255).expect("key");
        let scope = Scope::new("shop-a", "create_order", key);
        assert!(matches!(
            store
                .shared
                .try_read_live_record_in_place(&scope, SystemTime::now()),
            Some(Ok(None))
        ));
        assert_eq!(store.shared.readers.lock().expect("pool").len(), 1);
        assert_eq!(store.shared.with_reader_unchanged(busy_timeout_ms), Some(0));
    }

    impl Shared {
        /// `f` on the idle reader connection as it is, if one is idle.
        fn with_reader_unchanged<T>(
            &self,
            f: impl FnOnce(&Connection) -> rusqlite::Result<T>,
        ) -> Option<T> {
            let conn = self.readers.lock().ok()?.pop()?;
            let value = f(&conn).ok();
            self.return_reader(conn);
            value
        }
    }
}
