//! `Admin<SqliteStore>`: the calls on a SQLite file.

use std::time::SystemTime;

use rusqlite::{params, OptionalExtension};

use super::{Admin, RawRecord, RecordCounts, RecordFilter, RecordInfo};
use crate::error::Error;
use crate::store::sqlite::SqliteStore;
use crate::store::to_unix_millis;

impl Admin<SqliteStore> {
    /// The record of `(tenant, operation, key)`, expired or not; the body only if `with_body`.
    pub async fn inspect(
        &self,
        tenant: &str,
        operation: &str,
        key: &str,
        with_body: bool,
    ) -> Result<Option<RecordInfo>, Error> {
        let scope = (tenant.to_owned(), operation.to_owned(), key.to_owned());
        let lookup = scope.clone();
        let raw = self
            .store
            .read(move |conn| {
                // The body is not even read unless asked for: it may be large or personal.
                let body_column = if with_body { "body" } else { "NULL" };
                conn.query_row(
                    &format!(
                        "SELECT fingerprint_version, fingerprint, status, headers, length(body), \
                         {body_column}, created_at, expires_at FROM idempotency_records \
                         WHERE tenant = ?1 AND operation = ?2 AND idempotency_key = ?3"
                    ),
                    params![lookup.0, lookup.1, lookup.2],
                    |row| {
                        Ok(RawRecord {
                            version: row.get(0)?,
                            digest: row.get(1)?,
                            status: row.get(2)?,
                            headers: row.get(3)?,
                            body_len: row.get(4)?,
                            body: row.get(5)?,
                            created_at: row.get(6)?,
                            expires_at: row.get(7)?,
                        })
                    },
                )
                .optional()
            })
            .await?;
        raw.map(|raw| raw.into_info(&scope.0, &scope.1, &scope.2))
            .transpose()
    }

    /// Deletes the record of `(tenant, operation, key)`: the next request with that key runs
    /// the handler again (the business rows it created stay). Returns whether one existed.
    ///
    /// A request holding that scope right now finishes first (the delete waits for the writer).
    pub async fn delete(&self, tenant: &str, operation: &str, key: &str) -> Result<bool, Error> {
        let scope = (tenant.to_owned(), operation.to_owned(), key.to_owned());
        let deleted = self
            .store
            .write(move |tx| {
                tx.execute(
                    "DELETE FROM idempotency_records \
                     WHERE tenant = ?1 AND operation = ?2 AND idempotency_key = ?3",
                    params![scope.0, scope.1, scope.2],
                )
            })
            .await?;
        Ok(deleted > 0)
    }

    /// Counts records by state.
    pub async fn counts(&self, filter: &RecordFilter) -> Result<RecordCounts, Error> {
        let filter = filter.clone();
        let now = to_unix_millis(SystemTime::now());
        let (live, expired) = self
            .store
            .read(move |conn| {
                conn.query_row(
                    "SELECT count(*) FILTER (WHERE expires_at > ?1), \
                     count(*) FILTER (WHERE expires_at <= ?1) \
                     FROM idempotency_records \
                     WHERE (?2 IS NULL OR tenant = ?2) AND (?3 IS NULL OR operation = ?3)",
                    params![now, filter.tenant, filter.operation],
                    |row| Ok((row.get::<_, i64>(0)?, row.get::<_, i64>(1)?)),
                )
            })
            .await?;
        Ok(RecordCounts {
            live: u64::try_from(live).unwrap_or(0),
            expired: u64::try_from(expired).unwrap_or(0),
        })
    }
}

#[cfg(feature = "outbox")]
mod outbox {
    use crate::admin::Admin;
    use crate::error::Error;
    use crate::outbox::sqlite::SqliteOutbox;
    use crate::outbox::{EventInfo, OutboxCounts};
    use crate::store::sqlite::SqliteStore;

    impl Admin<SqliteStore> {
        /// Outbox events by state (see [`SqliteOutbox::counts`]). Fails if the database has no
        /// outbox.
        pub async fn outbox_counts(&self) -> Result<OutboxCounts, Error> {
            self.outbox().counts().await
        }

        /// One outbox event, by id.
        pub async fn event(&self, id: &str) -> Result<Option<EventInfo>, Error> {
            self.outbox().event(id).await
        }

        /// Dead-lettered events, oldest first, at most `limit`.
        pub async fn dead_letters(&self, limit: usize) -> Result<Vec<EventInfo>, Error> {
            self.outbox().dead_letters(limit).await
        }

        /// Requeues one dead-lettered event: due at once, attempts reset. Returns `false` if
        /// no dead event has this id.
        pub async fn requeue(&self, id: &str) -> Result<bool, Error> {
            self.outbox().requeue(id).await
        }

        /// Requeues every dead-lettered event; returns how many.
        pub async fn requeue_all_dead(&self) -> Result<u64, Error> {
            self.outbox().requeue_dead().await
        }

        /// The outbox of this database, without creating its table.
        fn outbox(&self) -> SqliteOutbox {
            SqliteOutbox::existing(&self.store)
        }
    }
}
