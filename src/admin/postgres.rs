//! `Admin<PostgresStore>`: the same calls on a PostgreSQL database.
//!
//! Statements run in autocommit on pooled connections of the store. A request's reservation
//! is never visible to them (it is committed only as a completed record); a reservation that
//! a handler committed itself (a stray `in_progress` row, written already expired) is not a
//! record: [`Admin::inspect`] does not show it, [`Admin::counts`] counts it as expired and
//! [`Admin::purge_expired`] removes it.

use std::time::SystemTime;

use tokio_postgres::row::Row;

use super::{Admin, RawRecord, RecordCounts, RecordFilter, RecordInfo};
use crate::error::Error;
use crate::store::postgres::PostgresStore;
use crate::store::to_unix_millis;

impl Admin<PostgresStore> {
    /// The record of `(tenant, operation, key)`, expired or not; the body only if `with_body`.
    pub async fn inspect(
        &self,
        tenant: &str,
        operation: &str,
        key: &str,
        with_body: bool,
    ) -> Result<Option<RecordInfo>, Error> {
        // The body is not even read unless asked for: it may be large or personal.
        let body_column = if with_body { "body" } else { "NULL::bytea" };
        let client = self.store.client().await?;
        let row = client
            .query_opt(
                &format!(
                    "SELECT fingerprint_version, fingerprint, status, headers, length(body), \
                     {body_column}, created_at, expires_at FROM idempotency_records \
                     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 \
                     AND state = 'completed'"
                ),
                &[&tenant, &operation, &key],
            )
            .await?;
        row.map(|row| raw_record(&row)?.into_info(tenant, operation, key))
            .transpose()
    }

    /// Deletes the record of `(tenant, operation, key)`: the next request with that key runs
    /// the handler again (the business rows it created stay). Returns whether one existed.
    ///
    /// A request taking over that record right now (its previous one expired) finishes first:
    /// the delete waits for its row lock, then deletes the fresh record. The first request for
    /// a key is not seen while it runs (its reservation is not committed): nothing is deleted,
    /// and its record appears when it commits.
    pub async fn delete(&self, tenant: &str, operation: &str, key: &str) -> Result<bool, Error> {
        let client = self.store.client().await?;
        let deleted = client
            .execute(
                "DELETE FROM idempotency_records \
                 WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3",
                &[&tenant, &operation, &key],
            )
            .await?;
        Ok(deleted > 0)
    }

    /// Counts records by state.
    pub async fn counts(&self, filter: &RecordFilter) -> Result<RecordCounts, Error> {
        let now = to_unix_millis(SystemTime::now());
        let client = self.store.client().await?;
        let row = client
            .query_one(
                "SELECT count(*) FILTER (WHERE state = 'completed' AND expires_at > $1), \
                 count(*) FILTER (WHERE NOT (state = 'completed' AND expires_at > $1)) \
                 FROM idempotency_records \
                 WHERE ($2::text IS NULL OR tenant = $2) AND ($3::text IS NULL OR operation = $3)",
                &[
                    &now,
                    &filter.tenant.as_deref(),
                    &filter.operation.as_deref(),
                ],
            )
            .await?;
        Ok(RecordCounts {
            live: u64::try_from(row.try_get::<_, i64>(0)?).unwrap_or(0),
            expired: u64::try_from(row.try_get::<_, i64>(1)?).unwrap_or(0),
        })
    }
}

/// A completed record's columns, in the order `inspect` selects them.
fn raw_record(row: &Row) -> Result<RawRecord, Error> {
    let missing = |what: &str| Error::Corrupt(format!("{what} missing"));
    Ok(RawRecord {
        version: row
            .try_get::<_, Option<i32>>(0)?
            .ok_or_else(|| missing("fingerprint version"))?
            .into(),
        digest: row
            .try_get::<_, Option<Vec<u8>>>(1)?
            .ok_or_else(|| missing("fingerprint"))?,
        status: row
            .try_get::<_, Option<i32>>(2)?
            .ok_or_else(|| missing("status"))?
            .into(),
        headers: row
            .try_get::<_, Option<String>>(3)?
            .ok_or_else(|| missing("headers"))?,
        body_len: row
            .try_get::<_, Option<i32>>(4)?
            .ok_or_else(|| missing("body"))?
            .into(),
        body: row.try_get(5)?,
        created_at: row.try_get(6)?,
        expires_at: row.try_get(7)?,
    })
}

#[cfg(feature = "outbox")]
mod outbox {
    use crate::admin::Admin;
    use crate::error::Error;
    use crate::outbox::postgres::PostgresOutbox;
    use crate::outbox::{EventInfo, OutboxCounts};
    use crate::store::postgres::PostgresStore;

    impl Admin<PostgresStore> {
        /// Outbox events by state (see [`PostgresOutbox::counts`]). Fails if the database has
        /// no outbox.
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
        fn outbox(&self) -> PostgresOutbox {
            PostgresOutbox::existing(&self.store)
        }
    }
}
