//! The reader connections: the replay fast path and
//! [`SqliteStore::read`](super::SqliteStore::read).
//!
//! Read-only connections to the same file, kept in a small pool on the store's [`Shared`]
//! state and used under `spawn_blocking`; in WAL mode they never wait for the writer. For a
//! request's first attempt (`executor`), the reader thread that finds no live record queues
//! the request's begin for the writer itself ([`Shared::look_up_then_queue`]), so that the
//! request is woken once, by its answer. Rows are decoded by `records`.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rusqlite::{Connection, OpenFlags};

use super::records::read_record;
use super::reservation::TxShared;
use super::writer::{Step, NESTED_REQUEST};
use super::Shared;
use crate::error::Error;
use crate::store::{Scope, StoredRecord};

impl Shared {
    /// Runs `f` on an idle reader connection (a new one if none is idle).
    pub(super) fn with_reader<T>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let idle = self.readers.lock().ok().and_then(|mut pool| pool.pop());
        let conn = match idle {
            Some(conn) => conn,
            None => {
                let conn = Connection::open_with_flags(
                    &self.path,
                    OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
                )?;
                conn.busy_timeout(Duration::from_secs(5))?;
                conn
            }
        };
        let result = f(&conn);
        if let Ok(mut pool) = self.readers.lock() {
            if pool.len() < self.max_idle_readers {
                pool.push(conn);
            }
        }
        result
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

    /// On a reader thread, not awaited: reads the live record of `scope` and gives it to
    /// `start`, then queues the begin `start` returns (given no record) for the writer, on
    /// behalf of `request`. A failing read is only logged: the begin reads again,
    /// authoritatively.
    pub(super) fn look_up_then_queue(
        self: &Arc<Self>,
        scope: Scope,
        now: SystemTime,
        request: Arc<TxShared>,
        start: impl FnOnce(Option<StoredRecord>) -> Option<Step> + Send + 'static,
    ) {
        let shared = self.clone();
        // Not awaited: `start` answers the request, or the begin it returns does.
        drop(tokio::task::spawn_blocking(move || {
            let found = match shared.read_live_record(&scope, now) {
                Ok(record) => record,
                // The begin reads again, authoritatively.
                Err(error) => {
                    tracing::warn!(%error, "idempotency fast-path lookup failed");
                    None
                }
            };
            if let Some(begin) = start(found) {
                // If the store is gone, dropping the begin drops its reply: the
                // request hears of it.
                let _ = shared.send_exclusive(begin, Some(request), NESTED_REQUEST);
            }
        }));
    }
}
