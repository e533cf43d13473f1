//! The purge of expired records: a walk along the records' primary key, without an index on
//! `expires_at`.
//!
//! Each call goes on from the walk's cursor (kept in memory on the store's [`Shared`] state:
//! the last key looked at) and looks at [`examined_per_call`] records at most, in key order,
//! on a reader connection (no write lock): it gathers the keys of the expired ones, up to its
//! batch. Then it deletes those on the writer, in one transaction, each by its full key and
//! only if still expired: a record created again under the same key since it was read is kept.
//! The cursor moves to the last key looked at. A call that reaches the end of the table puts
//! the cursor back at the start and is done ([`PurgeStep::done`]): a pass has looked at every
//! record. So a paced purge looks at each record once, whatever its size, and no call looks at
//! more than a bounded number, however many live records lie between the expired ones.
//!
//! A purge ([`IdempotencyStore::purge_expired_step`]) that finds the walk in the middle of a
//! pass begun with an earlier `now` (an earlier purge stopped by an error, or dropped) starts
//! a pass of its own from the start of the table: records it did not look at may have expired
//! since. [`IdempotencyStore::purge_expired`] alone goes on with the pass in progress.
//!
//! [`IdempotencyStore::purge_expired_step`]: crate::store::IdempotencyStore::purge_expired_step
//! [`IdempotencyStore::purge_expired`]: crate::store::IdempotencyStore::purge_expired

use std::sync::{MutexGuard, PoisonError};
use std::time::SystemTime;

use rusqlite::{Transaction, TransactionBehavior};

use super::authorizer::ControlAllowed;
use super::file::STANDALONE_BUSY_TIMEOUT;
use super::records::{self, RecordKey, Scanned};
use super::writer::inside_request;
use super::{Shared, SqliteStore};
use crate::error::Error;
use crate::store::{to_unix_millis, PurgeStep};

/// What a purge call that is refused inside a request is called: `step`, a call of
/// `purge_expired_step`.
fn called(step: bool) -> &'static str {
    if step {
        "IdempotencyStore::purge_expired_step"
    } else {
        "IdempotencyStore::purge_expired"
    }
}

/// How many records a call looks at per record of its batch, at most.
const EXAMINED_PER_BATCH_RECORD: usize = 16;

/// How many records a call may look at, whatever its batch: a small batch does not make a pass
/// over many live records take many more calls.
const MIN_EXAMINED: usize = 1024;

/// How many records a call with a batch of `batch` looks at, at most.
fn examined_per_call(batch: usize) -> usize {
    batch
        .saturating_mul(EXAMINED_PER_BATCH_RECORD)
        .max(MIN_EXAMINED)
}

/// Where the purge's walk is: the store's part of [`Shared`].
#[derive(Debug, Default)]
pub(super) struct PurgeWalk {
    /// The last key looked at; `None`: the next call starts a pass at the start of the table.
    after: Option<RecordKey>,
    /// The `now` of the call that began the pass in progress (Unix milliseconds).
    pass_now: i64,
}

impl Shared {
    fn purge_walk(&self) -> MutexGuard<'_, PurgeWalk> {
        self.purge.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl SqliteStore {
    /// One call of the purge (see the module's comment); `purge`: a call of
    /// [`IdempotencyStore::purge_expired_step`](crate::store::IdempotencyStore::purge_expired_step),
    /// which starts a pass of its own when the one in progress began with an earlier `now`.
    pub(super) async fn purge_step(
        &self,
        now: SystemTime,
        batch: usize,
        purge: bool,
    ) -> Result<PurgeStep, Error> {
        if inside_request(self.shared.id) {
            return Err(Error::InsideRequest(called(purge)));
        }
        if batch == 0 {
            return Ok(PurgeStep {
                deleted: 0,
                done: false,
            });
        }
        let now = to_unix_millis(now);
        let after = {
            let mut walk = self.shared.purge_walk();
            if purge && walk.after.is_some() && walk.pass_now < now {
                walk.after = None;
            }
            if walk.after.is_none() {
                walk.pass_now = now;
            }
            walk.after.clone()
        };
        let scanned = self.scan_expired(after, now, batch).await?;
        let deleted = self
            .delete_expired(scanned.expired, now, called(purge))
            .await?;
        self.shared.purge_walk().after = scanned.last;
        Ok(PurgeStep {
            deleted,
            done: scanned.at_end,
        })
    }

    /// The walk from `after` ([`records::scan_expired`]), on a reader connection, off the
    /// executor (in place without a tokio runtime).
    async fn scan_expired(
        &self,
        after: Option<RecordKey>,
        now: i64,
        batch: usize,
    ) -> Result<Scanned, Error> {
        let limit = examined_per_call(batch);
        let scan = move |shared: &Shared| {
            shared.with_reader(|conn| {
                Ok(records::scan_expired(
                    conn,
                    after.as_ref(),
                    now,
                    batch,
                    limit,
                )?)
            })
        };
        if tokio::runtime::Handle::try_current().is_err() {
            return scan(&self.shared);
        }
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || scan(&shared))
            .await
            .map_err(|_| Error::Panicked)?
    }

    /// Deletes the records of `keys` still expired at `now`, in one transaction on the writer
    /// ([`records::delete_expired`]); returns how many. `called`: the purge call's name.
    async fn delete_expired(
        &self,
        keys: Vec<RecordKey>,
        now: i64,
        called: &'static str,
    ) -> Result<u64, Error> {
        if keys.is_empty() {
            return Ok(0);
        }
        self.shared
            .call_exclusive(called, move |writer| {
                writer.settle();
                writer.set_busy_wait(STANDALONE_BUSY_TIMEOUT);
                let control = writer.control.clone();
                let _allowed = ControlAllowed::new(&control);
                let tx = Transaction::new_unchecked(&writer.conn, TransactionBehavior::Immediate)?;
                let deleted = records::delete_expired(&tx, &keys, now)?;
                tx.commit()?;
                Ok(deleted as u64)
            })
            .await
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use http::StatusCode;
    use rusqlite::{params, Connection};

    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::key::IdempotencyKey;
    use crate::response::SavedResponse;
    use crate::store::{
        from_unix_millis, purge_expired_paced, Begin, IdempotencyStore, NewRecord, Reservation,
        Scope,
    };

    /// When the tests' records were created (Unix milliseconds).
    const CREATED: i64 = 1_000;
    /// When the tests' expired records expired.
    const EXPIRED: i64 = 2_000;
    /// When the tests' live records expire.
    const LIVE: i64 = 1_000_000_000_000;
    /// The tests' `now`.
    const NOW: i64 = 10_000;

    fn now() -> SystemTime {
        from_unix_millis(NOW)
    }

    fn key(n: usize) -> String {
        format!("key-{n:06}")
    }

    async fn open(dir: &tempfile::TempDir) -> SqliteStore {
        SqliteStore::open(dir.path().join("store.db"))
            .await
            .expect("open")
    }

    /// Writes records `key(0) .. key(count)` of shop-a's create_order, in one transaction:
    /// `expires_at(n)` says when each expires.
    async fn fill(store: &SqliteStore, count: usize, expires_at: impl Fn(usize) -> i64) {
        let expiries: Vec<i64> = (0..count).map(expires_at).collect();
        store
            .write(move |tx| {
                let mut insert = tx.prepare(
                    "INSERT INTO idempotency_records (tenant, operation, idempotency_key, \
                     fingerprint, fingerprint_version, status, headers, body, trailers, \
                     created_at, expires_at) \
                     VALUES ('shop-a', 'create_order', ?1, zeroblob(32), 1, 201, '[]', X'', NULL, ?2, ?3)",
                )?;
                for (n, expires_at) in expiries.into_iter().enumerate() {
                    insert.execute(params![key(n), CREATED, expires_at])?;
                }
                Ok(())
            })
            .await
            .expect("fill");
    }

    /// The keys of the records left, in key order, with when each expires.
    async fn left(store: &SqliteStore) -> Vec<(String, i64)> {
        store
            .read(|conn| {
                let mut select = conn.prepare(
                    "SELECT idempotency_key, expires_at FROM idempotency_records \
                     ORDER BY tenant, operation, idempotency_key",
                )?;
                let rows = select.query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?;
                rows.collect()
            })
            .await
            .expect("read")
    }

    /// The records of `count` whose `expires_at` is live, as [`left`] lists them.
    fn live_of(count: usize, expires_at: impl Fn(usize) -> i64) -> Vec<(String, i64)> {
        (0..count)
            .map(|n| (key(n), expires_at(n)))
            .filter(|(_, expires_at)| *expires_at > NOW)
            .collect()
    }

    /// Calls `purge_expired_step` until it is done: what each call deleted.
    async fn steps_until_done(store: &SqliteStore, batch: usize) -> Vec<u64> {
        let mut deleted = Vec::new();
        loop {
            let step = store.purge_expired_step(now(), batch).await.expect("purge");
            deleted.push(step.deleted);
            if step.done {
                return deleted;
            }
            assert!(deleted.len() < 10_000, "the purge never ends");
        }
    }

    #[tokio::test]
    async fn a_pass_deletes_expired_records_far_apart_and_no_live_one() {
        let dir = tempfile::tempdir().expect("dir");
        let store = open(&dir).await;
        // Expired records with runs of up to 19,999 live ones between them: many times what
        // a call looks at (1,024 with a batch of 10).
        const COUNT: usize = 40_000;
        let expired = [0, 1, 7_001, 19_999, 20_000, 39_999];
        let expires_at = |n| if expired.contains(&n) { EXPIRED } else { LIVE };
        fill(&store, COUNT, expires_at).await;

        let deleted = steps_until_done(&store, 10).await;
        assert_eq!(deleted.iter().sum::<u64>(), expired.len() as u64);
        assert_eq!(left(&store).await, live_of(COUNT, expires_at));
        // One look at each record: a call looks at 1,024 at most, and no call starts over.
        let calls = deleted.len();
        assert!(
            (COUNT / 1024..=COUNT / 1024 + 1).contains(&calls),
            "{calls} calls"
        );
        // The pass ended at the end of the table: the next starts over, and finds nothing.
        assert_eq!(steps_until_done(&store, 10).await.iter().sum::<u64>(), 0);
    }

    #[tokio::test]
    async fn a_paced_purge_deletes_every_expired_record_of_a_table_far_larger_than_a_batch() {
        let dir = tempfile::tempdir().expect("dir");
        let store = open(&dir).await;
        // Expired records alone, in runs, and among live ones.
        const COUNT: usize = 30_000;
        let expires_at = |n: usize| match n {
            0..5_000 => EXPIRED,
            _ if n.is_multiple_of(3) || n % 1_000 < 10 => EXPIRED,
            _ => LIVE,
        };
        fill(&store, COUNT, expires_at).await;
        let live = live_of(COUNT, expires_at);
        let expired = (COUNT - live.len()) as u64;

        let purged = purge_expired_paced(&store, now(), 50).await.expect("purge");
        assert_eq!(purged, expired);
        assert_eq!(left(&store).await, live);
    }

    #[tokio::test]
    async fn a_call_deletes_up_to_its_batch_and_goes_on_where_it_stopped() {
        let dir = tempfile::tempdir().expect("dir");
        let store = open(&dir).await;
        fill(&store, 5, |n| if n == 3 { LIVE } else { EXPIRED }).await;
        let mut deleted = Vec::new();
        for _ in 0..4 {
            deleted.push(store.purge_expired(now(), 2).await.expect("purge"));
        }
        // 0 and 1; 2 and 4 (3 is live); the end of the table; a pass that finds nothing.
        assert_eq!(deleted, vec![2, 2, 0, 0]);
        assert_eq!(left(&store).await, vec![(key(3), LIVE)]);
    }

    #[tokio::test]
    async fn a_record_created_again_after_the_walk_read_it_is_kept() {
        let dir = tempfile::tempdir().expect("dir");
        let store = open(&dir).await;
        fill(&store, 3, |_| EXPIRED).await;

        let scanned = store.scan_expired(None, NOW, 10).await.expect("scan");
        assert_eq!(scanned.expired.len(), 3);
        // A request for key 1 arrives between the walk's read and its deletes: the expired
        // record is deleted and a new one saved under the same key.
        let scope = Scope::new(
            "shop-a",
            "create_order",
            IdempotencyKey::parse(key(1).as_bytes(), 255).expect("key"),
        );
        let Begin::Reserved(reservation) = store
            .begin(&scope, Duration::from_secs(5), now())
            .await
            .expect("begin")
        else {
            panic!("the expired record is no record");
        };
        let response = SavedResponse::new(StatusCode::CREATED, vec![], Bytes::from_static(b"{}"));
        let record = NewRecord::new(
            Fingerprint::new(1, [7; 32]),
            response,
            now(),
            from_unix_millis(LIVE),
        );
        reservation.commit(record).await.expect("commit");

        let deleted = store
            .delete_expired(scanned.expired, NOW, called(true))
            .await
            .expect("delete");
        assert_eq!(deleted, 2);
        assert_eq!(left(&store).await, vec![(key(1), LIVE)]);
        assert!(store.lookup(&scope, now()).await.expect("lookup").is_some());
    }

    #[tokio::test]
    async fn a_purge_finding_an_older_pass_in_progress_starts_its_own() {
        let dir = tempfile::tempdir().expect("dir");
        let store = open(&dir).await;
        // Record 0 expires at 5,000, record 3,000 expired at 2,000; the rest live.
        let expires_at = |n| match n {
            0 => 5_000,
            3_000 => EXPIRED,
            _ => LIVE,
        };
        fill(&store, 4_000, expires_at).await;
        // A purge at 4,000 stops after its first call, past record 0 (still live then).
        let first = store
            .purge_expired_step(from_unix_millis(4_000), 1)
            .await
            .expect("purge");
        assert_eq!((first.deleted, first.done), (0, false));
        // `purge_expired` goes on with that pass: record 0 stays.
        assert_eq!(store.purge_expired(now(), 10).await.expect("purge"), 0);
        assert_eq!(left(&store).await.len(), 4_000);
        // A purge at `NOW` starts its own pass, from the start: both go.
        let purged = purge_expired_paced(&store, now(), 10).await.expect("purge");
        assert_eq!(purged, 2);
        assert_eq!(left(&store).await, live_of(4_000, expires_at));
    }

    /// The indexes on the records table of the store's file, by name.
    async fn indexes(store: &SqliteStore) -> Vec<String> {
        store
            .read(|conn| {
                let mut select = conn.prepare(
                    "SELECT name FROM sqlite_schema WHERE type = 'index' \
                     AND tbl_name = 'idempotency_records' ORDER BY name",
                )?;
                let names = select.query_map([], |row| row.get(0))?;
                names.collect()
            })
            .await
            .expect("schema")
    }

    #[tokio::test]
    async fn a_new_file_has_no_index_on_expires_at() {
        let dir = tempfile::tempdir().expect("dir");
        let store = open(&dir).await;
        // WITHOUT ROWID: the primary key is the table's own B-tree, no index.
        assert_eq!(indexes(&store).await, Vec::<String>::new());
    }

    /// The records table as a file created before had it: with an index on `expires_at`, and
    /// (`rowid`) as a rowid table.
    fn old_schema(rowid: bool) -> String {
        let mut schema = format!(
            "{}CREATE INDEX IF NOT EXISTS idempotency_records_expires_at \
             ON idempotency_records (expires_at);",
            records::SCHEMA
        );
        if rowid {
            schema = schema.replace(") WITHOUT ROWID;", ");");
        }
        schema
    }

    /// The plan SQLite chooses for `sql` on `conn`, its lines joined.
    fn plan(conn: &Connection, sql: &str) -> String {
        let mut explain = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
            .expect("explain");
        // Its parameters unbound: the plan does not depend on their values.
        let mut rows = explain.raw_query();
        let mut lines = Vec::new();
        while let Some(row) = rows.next().expect("plan") {
            lines.push(row.get::<_, String>(3).expect("detail"));
        }
        lines.join("; ")
    }

    #[tokio::test]
    async fn a_file_created_with_the_expires_at_index_keeps_it_and_purges() {
        for rowid in [false, true] {
            let dir = tempfile::tempdir().expect("dir");
            let path = dir.path().join("store.db");
            Connection::open(&path)
                .expect("file")
                .execute_batch(&old_schema(rowid))
                .expect("old schema");
            let store = SqliteStore::open(&path).await.expect("open");
            assert!(
                indexes(&store)
                    .await
                    .contains(&"idempotency_records_expires_at".to_owned()),
                "the index is kept"
            );

            const COUNT: usize = 5_000;
            let expires_at = |n: usize| if n.is_multiple_of(7) { EXPIRED } else { LIVE };
            fill(&store, COUNT, expires_at).await;
            let live = live_of(COUNT, expires_at);
            let purged = purge_expired_paced(&store, now(), 20).await.expect("purge");
            assert_eq!(purged, (COUNT - live.len()) as u64, "rowid: {rowid}");
            assert_eq!(left(&store).await, live, "rowid: {rowid}");
        }
    }

    #[test]
    fn the_walk_and_its_deletes_use_the_primary_key_with_the_index_or_without() {
        let delete = "DELETE FROM idempotency_records WHERE tenant = ?1 AND operation = ?2 \
                      AND idempotency_key = ?3 AND expires_at <= ?4";
        for (schema, key) in [
            (records::SCHEMA.to_owned(), "PRIMARY KEY"),
            (old_schema(false), "PRIMARY KEY"),
            (old_schema(true), "sqlite_autoindex_idempotency_records_1"),
        ] {
            let conn = Connection::open_in_memory().expect("db");
            conn.execute_batch(&schema).expect("schema");
            // In key order without a sort, and never by `expires_at`.
            for sql in [records::SCAN_FROM_START, records::SCAN_AFTER, delete] {
                let plan = plan(&conn, sql);
                assert!(!plan.contains("TEMP B-TREE"), "{sql}: {plan}");
                assert!(!plan.contains("expires_at"), "{sql}: {plan}");
            }
            // From the cursor, and each delete, a search of the key's B-tree.
            for sql in [records::SCAN_AFTER, delete] {
                let plan = plan(&conn, sql);
                assert!(plan.starts_with("SEARCH"), "{sql}: {plan}");
                assert!(plan.contains(key), "{sql}: {plan}");
            }
        }
    }
}
