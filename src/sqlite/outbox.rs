//! The outbox and the inbox on the SQLite store (the SQL only: [`Outbox`] and [`Inbox`] are
//! written once over [`OutboxBackend`] and [`InboxBackend`]). `outbox_events` lives in the same
//! database file as the handler's rows and the idempotency records, so an event commits in
//! their transaction; `inbox_events` holds the receiver's processed event ids.
//!
//! Everything goes through the store's public API: events are enqueued with
//! [`SqliteHandle::run`], relays claim and settle with [`SqliteStore::write`] (one
//! `BEGIN IMMEDIATE` transaction each, queued behind requests on the single writer), and counts
//! and listings read with [`SqliteStore::read`]. Relays in other processes on the same file are
//! serialized by SQLite's own write lock, so a claim is atomic across processes too.

use std::time::{Duration, SystemTime};

use rusqlite::{params, Connection, OptionalExtension};

use crate::error::Error;
use crate::outbox::columns::{
    claimed_oldest_first, claimed_row, count_from_column, event_status, RawEvent, EVENT_COLUMNS,
};
use crate::outbox::inbox::receipt;
use crate::outbox::{
    Backlog, ClaimRequest, Claimed, Enqueue, EventId, EventInfo, Inbox, InboxBackend, InboxOutcome,
    Outbox, OutboxBackend, OutboxCounts, OutboxStore, Processed, Receipt, Settlement,
};
use crate::store::sqlite::{SqliteHandle, SqliteStore};
use crate::store::to_unix_millis;

/// `available_at` is when the event is next due. A new event is due at once: `enqueue_in`
/// writes its creation time there, and nothing else ever writes `available_at = created_at`
/// (a claim moves it to the end of the lease, a retry to the next attempt, a requeue to now,
/// each at least a millisecond past the creation). That equality tells the two kinds apart,
/// and it is what keeps the indexes off the enqueue:
/// - an event claimed at least once is in both partial indexes (`available_at <>
///   created_at`): `outbox_events_due` finds the ones due again (a retry, a lease run out), the
///   dead and the delivered, by status and time; `outbox_events_claimed` gives the largest
///   `seq` of all of them;
/// - a new event is in neither. Claims take new events oldest first, in `seq` order, so the
///   new events are exactly those above the largest claimed `seq`: a claim reads them from
///   there along the table itself.
///
/// An insert writes the table's B-tree only (a full index on `(status, available_at)` would
/// cost every event a second page); the claim writes the index entries.
///
/// `seq` is the rowid without `AUTOINCREMENT`: a new event takes the largest `seq` in the
/// table plus one, so its `seq` is above every event still stored, and "oldest first" (claims,
/// dead letters) holds. Skipping `sqlite_sequence` saves a page (a WAL frame) per event.
///
/// An event's id carries its `seq` ([`EventId::numbered`]), and the store finds an event by
/// that number, comparing the id too: `event_id` needs no index of its own, which saves
/// another page per event. A largest `seq` freed by a rollback or a purge may be taken again,
/// by an event whose id differs in its time (and its random bits): the old id finds nothing.
/// A table holds numbers below 2^44 over its life; an enqueue past that fails.
///
/// An event inserted otherwise (by a trigger, say) is found by its id all the same, by reading
/// the table (see `event_seq`). A file created before keeps its table, with a unique index on
/// `event_id` (and `AUTOINCREMENT` in an older one): new events get numbered ids, and an id
/// from before, which carries no number, is found through that index. Its `outbox_events_due`
/// is a full index, which serves the same queries (and costs its enqueues a page).
///
/// The status check is written as comparisons, not `status IN ('pending', 'delivered',
/// 'dead')`: SQLite checks an `IN` list of more than two values against a temporary table
/// that every insert fills again (a tenth of a new key's instructions in the `orders`
/// example). A file created before keeps the `IN` list, which allows the same values.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS outbox_events (
    seq          INTEGER PRIMARY KEY,
    event_id     TEXT    NOT NULL,
    topic        TEXT    NOT NULL,
    payload      TEXT    NOT NULL,
    status       TEXT    NOT NULL DEFAULT 'pending'
                         CHECK (status = 'pending' OR status = 'delivered'
                                OR status = 'dead'),
    attempts     INTEGER NOT NULL DEFAULT 0,
    available_at INTEGER NOT NULL,
    lease_owner  TEXT,
    last_error   TEXT,
    created_at   INTEGER NOT NULL,
    delivered_at INTEGER
);
CREATE INDEX IF NOT EXISTS outbox_events_due ON outbox_events (status, available_at)
    WHERE available_at <> created_at;
";

/// The index the claim reads the largest claimed `seq` from, named in its query (`INDEXED
/// BY`: read along the table instead, the same answer costs a row per new event). Installed
/// with [`SCHEMA`], and created by a claim too if the file's outbox was installed before it
/// existed.
const CLAIMED_INDEX: &str = "CREATE INDEX IF NOT EXISTS outbox_events_claimed \
     ON outbox_events (seq) WHERE available_at <> created_at";

const INBOX_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS inbox_events (
    consumer     TEXT    NOT NULL,
    event_id     TEXT    NOT NULL,
    processed_at INTEGER NOT NULL,
    PRIMARY KEY (consumer, event_id)
);
CREATE INDEX IF NOT EXISTS inbox_events_processed_at ON inbox_events (processed_at);
";

/// The outbox of a [`SqliteStore`].
impl Outbox<SqliteStore> {
    /// Adds an event to the outbox on `conn`: inside [`SqliteHandle::run`], it belongs to the
    /// request's transaction. Returns its id.
    ///
    /// Use it to write an order and its event in one closure; [`Enqueue::enqueue`] on the handle
    /// does the same in a call of its own.
    ///
    /// It reads the outbox's largest event number before it writes (the new event's id
    /// carries the next one), so on a connection of your own call it in a write transaction
    /// (`BEGIN IMMEDIATE`, as the store's own are): in a deferred one, another writer's event
    /// committed in between fails the insert with `SQLITE_BUSY`, and the transaction must
    /// begin again.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), tower_idempotency::Error> {
    /// use serde_json::json;
    /// use tower_idempotency::outbox::Outbox;
    /// use tower_idempotency::store::sqlite::{SqliteHandle, SqliteStore};
    ///
    /// let store = SqliteStore::open("orders.db").await?;
    /// Outbox::install(&store).await?;
    ///
    /// // In a handler: the order row and its event in one hop to the writer thread.
    /// async fn create_order(tx: SqliteHandle) -> Result<i64, tower_idempotency::Error> {
    ///     tx.run(|conn| {
    ///         conn.execute("INSERT INTO orders (sku) VALUES ('book')", [])?;
    ///         let order_id = conn.last_insert_rowid();
    ///         Outbox::<SqliteStore>::enqueue_in(conn, "order_created", &json!({ "order_id": order_id }))?;
    ///         Ok(order_id)
    ///     })
    ///     .await
    /// }
    /// # Ok(()) }
    /// ```
    pub fn enqueue_in(
        conn: &Connection,
        topic: &str,
        payload: &serde_json::Value,
    ) -> rusqlite::Result<EventId> {
        let seq: i64 = conn
            .prepare_cached("SELECT coalesce(max(seq), 0) + 1 FROM outbox_events")?
            .query_row([], |row| row.get(0))?;
        let id = u64::try_from(seq)
            .ok()
            .and_then(EventId::numbered)
            .ok_or_else(|| {
                rusqlite::Error::ToSqlConversionFailure(
                    format!("outbox_events: no event number left (the next would be {seq})").into(),
                )
            })?;
        let now = to_unix_millis(SystemTime::now());
        // The text `Display` gives, written straight into a `String` (`Display` goes through
        // the formatter, about twice the instructions).
        let payload = serde_json::to_string(payload)
            .map_err(|error| rusqlite::Error::ToSqlConversionFailure(error.into()))?;
        conn.prepare_cached(
            "INSERT INTO outbox_events (seq, event_id, topic, payload, status, attempts, \
             available_at, created_at) VALUES (?1, ?2, ?3, ?4, 'pending', 0, ?5, ?5)",
        )?
        .execute(params![seq, id.as_str(), topic, payload, now])?;
        Ok(id)
    }
}

impl Enqueue for SqliteHandle {
    /// ```no_run
    /// # async fn handler(tx: tower_idempotency::store::sqlite::SqliteHandle)
    /// #     -> Result<(), tower_idempotency::Error> {
    /// use serde_json::json;
    /// use tower_idempotency::outbox::Enqueue;
    ///
    /// let event_id = tx.enqueue("order_created", json!({ "order_id": 7 })).await?;
    /// # let _ = event_id; Ok(()) }
    /// ```
    async fn enqueue(&self, topic: &str, payload: serde_json::Value) -> Result<EventId, Error> {
        let topic = topic.to_owned();
        self.run(move |conn| Outbox::<SqliteStore>::enqueue_in(conn, &topic, &payload))
            .await
    }
}

impl crate::outbox::sealed::OutboxStore for SqliteStore {
    async fn claim(&self, request: ClaimRequest) -> Result<Claimed, Error> {
        let now = to_unix_millis(request.now);
        let lease_until = to_unix_millis(request.now + request.lease.max(Duration::from_millis(1)));
        let batch = limit(request.batch);
        let token = request.token.as_str().to_owned();
        let max_attempts = i64::from(request.max_attempts);
        // An idle relay polls often: look on a reader first (WAL: no lock), so that polling
        // never takes the write lock away from requests, in this process or another. New
        // events are those above the largest claimed `seq` (see `SCHEMA`), so if there are any,
        // the last row is one.
        let due = self
            .read(move |conn| {
                conn.query_row(
                    "SELECT EXISTS (SELECT 1 FROM outbox_events \
                     WHERE status = 'pending' AND available_at <> created_at \
                     AND available_at <= ?1) \
                     OR coalesce((SELECT available_at = created_at FROM outbox_events \
                     ORDER BY seq DESC LIMIT 1), 0)",
                    [now],
                    |row| row.get::<_, bool>(0),
                )
            })
            .await?;
        if !due {
            return Ok(Claimed::default());
        }
        let (abandoned, claimed) = self
            .write(move |tx| {
                // Prepared once per connection: on a file that has the index (every file after
                // the first claim) the statement does nothing, and is not parsed again.
                tx.prepare_cached(CLAIMED_INDEX)?.execute([])?;
                // First, the events whose last allowed attempt was abandoned: retrying them
                // would exceed the attempts (and an event that crashes its relay would be
                // retried forever).
                let abandoned = tx
                    .prepare_cached(
                        "UPDATE outbox_events SET status = 'dead', lease_owner = NULL, \
                         last_error = 'abandoned: the lease of its last attempt ran out' \
                         WHERE status = 'pending' AND available_at <> created_at \
                         AND lease_owner IS NOT NULL AND available_at <= ?1 \
                         AND attempts >= ?2 \
                         RETURNING seq, event_id, topic, payload, attempts, created_at",
                    )?
                    .query_map(params![now, max_attempts], |row| claimed_row(row))?
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                let chosen = due_first(
                    &due_again(tx, now, batch)?,
                    &new_events(tx, batch)?,
                    now,
                    batch,
                );
                let mut claim = tx.prepare_cached(
                    "UPDATE outbox_events SET lease_owner = ?1, \
                     available_at = max(?2, created_at + 1), attempts = attempts + 1 \
                     WHERE seq = ?3 \
                     RETURNING seq, event_id, topic, payload, attempts, created_at",
                )?;
                let claimed = chosen
                    .into_iter()
                    .map(|seq| {
                        claim.query_row(params![token, lease_until, seq], |row| claimed_row(row))
                    })
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                Ok((abandoned, claimed))
            })
            .await?;
        Ok(claimed_oldest_first(claimed, abandoned))
    }

    async fn settle(&self, settlements: Vec<Settlement>) -> Result<(), Error> {
        if settlements.is_empty() {
            return Ok(());
        }
        let now = to_unix_millis(SystemTime::now());
        self.write(move |tx| {
            for settlement in &settlements {
                let (Settlement::Delivered { id }
                | Settlement::Retry { id, .. }
                | Settlement::Dead { id, .. }) = settlement;
                let Some(seq) = event_seq(tx, id.as_str())? else {
                    continue;
                };
                match settlement {
                    // Recorded whoever holds the claim now: the sink accepted the event,
                    // and that stays true.
                    Settlement::Delivered { .. } => tx
                        .prepare_cached(
                            "UPDATE outbox_events SET status = 'delivered', \
                                 delivered_at = ?2, lease_owner = NULL, last_error = NULL \
                                 WHERE seq = ?1 AND status = 'pending'",
                        )?
                        .execute(params![seq, now])?,
                    // Only under our own claim: if it ran out and another relay claimed
                    // the event, that relay decides what happens next.
                    Settlement::Retry {
                        token, at, error, ..
                    } => tx
                        .prepare_cached(
                            "UPDATE outbox_events SET available_at = max(?3, created_at + 1), \
                                 lease_owner = NULL, last_error = ?4 \
                                 WHERE seq = ?1 AND lease_owner = ?2 \
                                 AND status = 'pending'",
                        )?
                        .execute(params![seq, token.as_str(), to_unix_millis(*at), error])?,
                    Settlement::Dead { token, error, .. } => tx
                        .prepare_cached(
                            "UPDATE outbox_events SET status = 'dead', \
                                 lease_owner = NULL, last_error = ?3 \
                                 WHERE seq = ?1 AND lease_owner = ?2 \
                                 AND status = 'pending'",
                        )?
                        .execute(params![seq, token.as_str(), error])?,
                };
            }
            Ok(())
        })
        .await
    }
}

impl OutboxStore for SqliteStore {
    async fn backlog(&self) -> Result<Backlog, Error> {
        let (pending, dead) = self
            .read(|conn| {
                conn.query_row(
                    // Pending: the claimed ones by the due index, the new ones above the
                    // largest claimed `seq` (see `SCHEMA`).
                    "SELECT (SELECT count(*) FROM outbox_events \
                     WHERE status = 'pending' AND available_at <> created_at) \
                     + (SELECT count(*) FROM outbox_events WHERE seq > \
                     (SELECT coalesce(max(seq), 0) FROM outbox_events \
                     WHERE available_at <> created_at) \
                     AND status = 'pending' AND available_at = created_at), \
                     (SELECT count(*) FROM outbox_events \
                     WHERE status = 'dead' AND available_at <> created_at)",
                    [],
                    |row| Ok((row.get::<_, i64>(0)?, row.get::<_, i64>(1)?)),
                )
            })
            .await?;
        Ok(Backlog {
            pending: count_from_column(pending),
            dead: count_from_column(dead),
        })
    }
}

impl OutboxBackend for SqliteStore {
    async fn install_outbox(&self) -> Result<(), Error> {
        self.write(|tx| {
            tx.execute_batch(SCHEMA)?;
            tx.execute_batch(CLAIMED_INDEX)
        })
        .await
    }

    async fn event(&self, id: &str) -> Result<Option<EventInfo>, Error> {
        let id = id.to_owned();
        let now = to_unix_millis(SystemTime::now());
        let raw = self
            .read(move |conn| {
                let Some(seq) = event_seq(conn, &id)? else {
                    return Ok(None);
                };
                conn.query_row(
                    &format!("SELECT {EVENT_COLUMNS} FROM outbox_events WHERE seq = ?1"),
                    [seq],
                    |row| RawEvent::read(row),
                )
                .optional()
            })
            .await?;
        raw.map(|raw| raw.into_info(now)).transpose()
    }

    async fn outbox_counts(&self) -> Result<OutboxCounts, Error> {
        let now = to_unix_millis(SystemTime::now());
        let rows = self
            .read(move |conn| {
                let mut statement = conn.prepare(
                    "SELECT status, lease_owner IS NOT NULL AND available_at > ?1, count(*) \
                     FROM outbox_events GROUP BY 1, 2",
                )?;
                let rows = statement
                    .query_map([now], |row| {
                        Ok((
                            row.get::<_, String>(0)?,
                            row.get::<_, bool>(1)?,
                            row.get::<_, i64>(2)?,
                        ))
                    })?
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                Ok(rows)
            })
            .await?;
        let mut counts = OutboxCounts::default();
        for (status, leased, count) in rows {
            counts.add(event_status(&status, leased)?, count_from_column(count));
        }
        Ok(counts)
    }

    async fn dead_letters(&self, limit: usize) -> Result<Vec<EventInfo>, Error> {
        let limit = self::limit(limit);
        let now = to_unix_millis(SystemTime::now());
        let raws = self
            .read(move |conn| {
                let mut statement = conn.prepare(&format!(
                    "SELECT {EVENT_COLUMNS} FROM outbox_events WHERE status = 'dead' \
                     AND available_at <> created_at ORDER BY seq LIMIT ?1"
                ))?;
                let rows = statement
                    .query_map([limit], |row| RawEvent::read(row))?
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                Ok(rows)
            })
            .await?;
        raws.into_iter().map(|raw| raw.into_info(now)).collect()
    }

    async fn requeue(&self, id: &str) -> Result<bool, Error> {
        let now = to_unix_millis(SystemTime::now());
        let id = id.to_owned();
        let changed = self
            .write(move |tx| match event_seq(tx, &id)? {
                Some(seq) => tx.execute(
                    "UPDATE outbox_events SET status = 'pending', attempts = 0, \
                     available_at = max(?2, created_at + 1), lease_owner = NULL \
                     WHERE seq = ?1 AND status = 'dead'",
                    params![seq, now],
                ),
                None => Ok(0),
            })
            .await?;
        Ok(changed > 0)
    }

    async fn requeue_all_dead(&self) -> Result<u64, Error> {
        let now = to_unix_millis(SystemTime::now());
        write_counted(
            self,
            "UPDATE outbox_events SET status = 'pending', attempts = 0, \
             available_at = max(?1, created_at + 1), lease_owner = NULL \
             WHERE status = 'dead' AND available_at <> created_at",
            (now,),
        )
        .await
    }

    async fn purge_delivered(&self, before: SystemTime, batch: usize) -> Result<u64, Error> {
        write_counted(
            self,
            "DELETE FROM outbox_events WHERE seq IN (SELECT seq FROM outbox_events \
             WHERE status = 'delivered' AND available_at <> created_at \
             AND delivered_at <= ?1 LIMIT ?2)",
            (to_unix_millis(before), limit(batch)),
        )
        .await
    }
}

/// The inbox of a [`SqliteStore`].
impl Inbox<SqliteStore> {
    /// Records `event_id` on `conn`, which must be inside the transaction that applies the
    /// event (a [`SqliteHandle::run`] or [`SqliteStore::write`] closure):
    /// [`Receipt::First`] if it was new (apply the event in the same transaction),
    /// [`Receipt::Duplicate`] if it was there already (do nothing).
    pub fn record(&self, conn: &Connection, event_id: &str) -> rusqlite::Result<Receipt> {
        record_id(conn, self.consumer(), event_id)
    }
}

/// A SQLite [`Inbox::process`] closure returns a `rusqlite::Result`.
impl<T: Send + 'static> InboxOutcome<SqliteStore> for rusqlite::Result<T> {
    type Value = T;

    fn into_resolved(self) -> rusqlite::Result<T> {
        self
    }
}

impl crate::outbox::inbox::sealed::InboxBackend for SqliteStore {}

impl InboxBackend for SqliteStore {
    type Handle = SqliteHandle;
    type Work<'a> = &'a rusqlite::Transaction<'a>;
    type Resolved<T: Send + 'static> = rusqlite::Result<T>;

    async fn install_inbox(&self) -> Result<(), Error> {
        self.write(|tx| tx.execute_batch(INBOX_SCHEMA)).await
    }

    async fn record_in(
        &self,
        tx: &SqliteHandle,
        consumer: &str,
        event_id: &str,
    ) -> Result<Receipt, Error> {
        let (consumer, event_id) = (consumer.to_owned(), event_id.to_owned());
        tx.run(move |conn| record_id(conn, &consumer, &event_id))
            .await
    }

    /// One write transaction on the writer thread: `work` runs there, synchronously.
    async fn process_once<F, R>(
        &self,
        consumer: &str,
        event_id: &str,
        work: F,
    ) -> Result<Processed<R::Value>, Error>
    where
        F: for<'a> FnOnce(&'a rusqlite::Transaction<'a>) -> R + Send + 'static,
        R: InboxOutcome<Self>,
    {
        let (consumer, event_id) = (consumer.to_owned(), event_id.to_owned());
        self.write(move |tx| match record_id(tx, &consumer, &event_id)? {
            Receipt::First => work(tx).into_resolved().map(Processed::First),
            Receipt::Duplicate => Ok(Processed::Duplicate),
        })
        .await
    }

    async fn inbox_contains(&self, consumer: &str, event_id: &str) -> Result<bool, Error> {
        let (consumer, event_id) = (consumer.to_owned(), event_id.to_owned());
        self.read(move |conn| {
            conn.query_row(
                "SELECT EXISTS (SELECT 1 FROM inbox_events \
                 WHERE consumer = ?1 AND event_id = ?2)",
                params![consumer, event_id],
                |row| row.get(0),
            )
        })
        .await
    }

    async fn purge_inbox(
        &self,
        consumer: &str,
        before: SystemTime,
        batch: usize,
    ) -> Result<u64, Error> {
        write_counted(
            self,
            "DELETE FROM inbox_events WHERE rowid IN (SELECT rowid FROM inbox_events \
             WHERE consumer = ?1 AND processed_at <= ?2 LIMIT ?3)",
            (consumer.to_owned(), to_unix_millis(before), limit(batch)),
        )
        .await
    }
}

/// The `seq` of the event named `id`, if it is stored: the row its number names, if that row
/// has this id (see [`SCHEMA`]); failing that, the row with this id, however its id was made
/// (an event from before numbered ids, or one a trigger or a migration inserted itself). That
/// second look-up uses the unique index on `event_id` of a table created before; in a table
/// created since it reads the table, which only an id that names no event (or an event not
/// enqueued through the store) costs.
fn event_seq(conn: &Connection, id: &str) -> rusqlite::Result<Option<i64>> {
    if let Some(number) = EventId::number_of(id).and_then(|number| i64::try_from(number).ok()) {
        let found = conn
            .prepare_cached("SELECT seq FROM outbox_events WHERE seq = ?1 AND event_id = ?2")?
            .query_row(params![number, id], |row| row.get(0))
            .optional()?;
        if found.is_some() {
            return Ok(found);
        }
    }
    conn.prepare_cached("SELECT seq FROM outbox_events WHERE event_id = ?1")?
        .query_row([id], |row| row.get(0))
        .optional()
}

/// The claimed events due again at `?1`, the earliest due first (by `outbox_events_due`).
const DUE_AGAIN: &str = "SELECT seq, available_at FROM outbox_events \
     WHERE status = 'pending' AND available_at <> created_at AND available_at <= ?1 \
     ORDER BY available_at, seq LIMIT ?2";

/// The largest `seq` ever claimed (of the events still stored), from the end of
/// `outbox_events_claimed`.
const LAST_CLAIMED: &str = "SELECT coalesce(max(seq), 0) \
     FROM outbox_events INDEXED BY outbox_events_claimed WHERE available_at <> created_at";

/// The new events above `seq` `?1`, oldest first (along the table's rowid).
const NEW_EVENTS: &str = "SELECT seq, available_at FROM outbox_events WHERE seq > ?1 \
     AND status = 'pending' AND available_at = created_at ORDER BY seq LIMIT ?2";

/// An event a claim may take: its `seq` and when it is due.
type Candidate = (i64, i64);

/// Up to `batch` claimed events due again at `now` (a retry's time come, a lease run out, a
/// requeue), the earliest due first.
fn due_again(conn: &Connection, now: i64, batch: i64) -> rusqlite::Result<Vec<Candidate>> {
    conn.prepare_cached(DUE_AGAIN)?
        .query_map(params![now, batch], |row| Ok((row.get(0)?, row.get(1)?)))?
        .collect()
}

/// The first `batch` new events, oldest first: the pending events above the largest `seq`
/// ever claimed that are still unclaimed (see [`SCHEMA`]).
fn new_events(conn: &Connection, batch: i64) -> rusqlite::Result<Vec<Candidate>> {
    let claimed_up_to: i64 = conn
        .prepare_cached(LAST_CLAIMED)?
        .query_row([], |row| row.get(0))?;
    conn.prepare_cached(NEW_EVENTS)?
        .query_map(params![claimed_up_to, batch], |row| {
            Ok((row.get(0)?, row.get(1)?))
        })?
        .collect()
}

/// The `seq`s a claim takes: up to `batch` of both lists, merged earliest due first. Each list
/// is taken from its front only, and new events stop at the first not yet due (a clock set
/// back since it was written): a new event claimed before an older new one would put the
/// older one below the largest claimed `seq`, where no claim looks for new events.
fn due_first(again: &[Candidate], new: &[Candidate], now: i64, batch: i64) -> Vec<i64> {
    let new_due = new.iter().take_while(|(_, at)| *at <= now).count();
    let (mut again, mut new) = (again.iter().peekable(), new[..new_due].iter().peekable());
    let mut chosen = Vec::new();
    while i64::try_from(chosen.len()).unwrap_or(i64::MAX) < batch {
        let next = match (again.peek(), new.peek()) {
            (Some(a), Some(n)) if (a.1, a.0) <= (n.1, n.0) => again.next(),
            (Some(_), Some(_)) | (None, Some(_)) => new.next(),
            (Some(_), None) => again.next(),
            (None, None) => None,
        };
        match next {
            Some((seq, _)) => chosen.push(*seq),
            None => break,
        }
    }
    chosen
}

/// A count or a limit as SQLite's integer (saturating).
fn limit(value: usize) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// Runs `sql` on the writer, in a transaction of its own; how many rows it changed.
async fn write_counted<P>(store: &SqliteStore, sql: &'static str, params: P) -> Result<u64, Error>
where
    P: rusqlite::Params + Send + 'static,
{
    let changed = store.write(move |tx| tx.execute(sql, params)).await?;
    Ok(changed as u64)
}

fn record_id(conn: &Connection, consumer: &str, event_id: &str) -> rusqlite::Result<Receipt> {
    let inserted = conn
        .prepare_cached(
            "INSERT INTO inbox_events (consumer, event_id, processed_at) VALUES (?1, ?2, ?3) \
             ON CONFLICT (consumer, event_id) DO NOTHING",
        )?
        .execute(params![
            consumer,
            event_id,
            to_unix_millis(SystemTime::now())
        ])?;
    Ok(receipt(inserted as u64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::sealed::OutboxStore as _;
    use crate::outbox::{EventStatus, LeaseToken};

    /// `outbox_events` as created before: a unique index on `event_id`, and `AUTOINCREMENT`
    /// (the other columns are as today's), and a full due index.
    fn old_schema() -> String {
        let old = SCHEMA
            .replace(
                "seq          INTEGER PRIMARY KEY,",
                "seq INTEGER PRIMARY KEY AUTOINCREMENT,",
            )
            .replace(
                "event_id     TEXT    NOT NULL,",
                "event_id TEXT NOT NULL UNIQUE,",
            )
            .replace(
                "(status, available_at)\n    WHERE available_at <> created_at;",
                "(status, available_at);",
            );
        assert_ne!(
            old, SCHEMA,
            "the columns to change are where the old schema expects"
        );
        old
    }

    async fn store(old: bool) -> (tempfile::TempDir, SqliteStore, Outbox<SqliteStore>) {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = SqliteStore::open(dir.path().join("outbox.db"))
            .await
            .expect("open");
        if old {
            store
                .write(|tx| tx.execute_batch(&old_schema()))
                .await
                .expect("old schema");
        }
        let outbox = Outbox::install(&store).await.expect("install");
        (dir, store, outbox)
    }

    async fn enqueue(store: &SqliteStore, n: i64) -> EventId {
        store
            .write(move |tx| {
                Outbox::<SqliteStore>::enqueue_in(tx, "t", &serde_json::json!({ "n": n }))
            })
            .await
            .expect("enqueue")
    }

    /// Claims everything due under `token`: the ids claimed, oldest first.
    async fn claim_all(store: &SqliteStore, token: &LeaseToken) -> Vec<EventId> {
        claim_at(store, token, 10, SystemTime::now()).await
    }

    /// Claims up to `batch` events due at `now` under `token`, for a lease of 30 s: the ids
    /// claimed, oldest first.
    async fn claim_at(
        store: &SqliteStore,
        token: &LeaseToken,
        batch: usize,
        now: SystemTime,
    ) -> Vec<EventId> {
        let claimed = store
            .claim(ClaimRequest {
                token: token.clone(),
                batch,
                lease: Duration::from_secs(30),
                max_attempts: 5,
                now,
            })
            .await
            .expect("claim");
        claimed.events.iter().map(|e| e.id().clone()).collect()
    }

    /// The entries of `index` (one of the two partial indexes), counted through it.
    async fn entries(store: &SqliteStore, index: &'static str) -> i64 {
        store
            .read(move |conn| {
                conn.query_row(
                    &format!(
                        "SELECT count(*) FROM outbox_events INDEXED BY {index} \
                         WHERE available_at <> created_at"
                    ),
                    [],
                    |row| row.get(0),
                )
            })
            .await
            .expect("count")
    }

    /// Claims everything due, then settles the first event delivered and the second dead.
    async fn claim_and_settle(store: &SqliteStore) -> Vec<EventId> {
        let token = LeaseToken::new("relay");
        let ids = claim_all(store, &token).await;
        store
            .settle(vec![
                Settlement::Delivered { id: ids[0].clone() },
                Settlement::Dead {
                    id: ids[1].clone(),
                    token,
                    error: "no".into(),
                },
            ])
            .await
            .expect("settle");
        ids
    }

    /// An enqueue's insert runs no temporary table (as an `IN` list in the status check
    /// would, filled again for every event), and the check still refuses any other status.
    #[tokio::test]
    async fn an_enqueue_checks_the_status_without_a_temporary_table() {
        let (_dir, store, _outbox) = store(false).await;
        let opcodes: Vec<String> = store
            .read(|conn| {
                let mut explain = conn.prepare(
                    "EXPLAIN INSERT INTO outbox_events (seq, event_id, topic, payload, status, \
                     attempts, available_at, created_at) VALUES (1, 'e', 't', '{}', 'pending', \
                     0, 0, 0)",
                )?;
                let opcodes = explain.query_map([], |row| row.get::<_, String>(1))?;
                opcodes.collect()
            })
            .await
            .expect("explain");
        assert!(opcodes.iter().any(|op| op == "Insert"), "{opcodes:?}");
        assert!(
            !opcodes.iter().any(|op| op == "OpenEphemeral"),
            "{opcodes:?}"
        );
        enqueue(&store, 1).await;
        for status in ["delivered", "dead", "pending"] {
            store
                .write(move |tx| tx.execute("UPDATE outbox_events SET status = ?1", [status]))
                .await
                .expect("a status the check allows");
        }
        let refused = store
            .write(|tx| tx.execute("UPDATE outbox_events SET status = 'lost'", []))
            .await;
        assert!(refused.is_err(), "{refused:?}");
    }

    #[tokio::test]
    async fn events_are_found_by_the_number_their_id_carries_without_an_index_on_it() {
        let (_dir, store, outbox) = store(false).await;
        let indexed: bool = store
            .read(|conn| {
                conn.query_row(
                    "SELECT EXISTS (SELECT 1 FROM pragma_index_list('outbox_events') AS list, \
                     pragma_index_info(list.name) AS info WHERE info.name = 'event_id')",
                    [],
                    |row| row.get(0),
                )
            })
            .await
            .expect("index list");
        assert!(!indexed, "no index holds event_id");
        let first = enqueue(&store, 1).await;
        let second = enqueue(&store, 2).await;
        assert_eq!(EventId::number_of(first.as_str()), Some(1));
        assert_eq!(EventId::number_of(second.as_str()), Some(2));
        assert_eq!(
            claim_and_settle(&store).await,
            vec![first.clone(), second.clone()]
        );
        let info = outbox.event(first.as_str()).await.expect("event");
        assert_eq!(info.map(|e| e.status), Some(EventStatus::Delivered));
        assert!(outbox.requeue(second.as_str()).await.expect("requeue"));
        let info = outbox.event(second.as_str()).await.expect("event");
        assert_eq!(info.map(|e| e.status), Some(EventStatus::Pending));

        // An id with a stored event's number but another time names nothing; nor does text
        // that is no id.
        let other = EventId::numbered(1).expect("a number");
        assert_ne!(other, first);
        assert!(outbox.event(other.as_str()).await.expect("event").is_none());
        assert!(!outbox.requeue(other.as_str()).await.expect("requeue"));
        assert!(outbox.event("no such id").await.expect("event").is_none());

        // An event a trigger or a migration inserted itself, with an id that carries no
        // number (or another event's), is found, settled and requeued by its id all the same.
        let by_hand = EventId::generate();
        let row = by_hand.clone();
        store
            .write(move |tx| {
                tx.execute(
                    "INSERT INTO outbox_events (event_id, topic, payload, available_at, \
                     created_at) VALUES (?1, 't', '{}', 0, 0)",
                    [row.as_str()],
                )
            })
            .await
            .expect("an event inserted by hand");
        let token = LeaseToken::new("relay");
        let ids = claim_all(&store, &token).await;
        assert!(ids.contains(&by_hand), "{ids:?}");
        store
            .settle(vec![Settlement::Dead {
                id: by_hand.clone(),
                token,
                error: "no".into(),
            }])
            .await
            .expect("settle");
        let info = outbox.event(by_hand.as_str()).await.expect("event");
        assert_eq!(info.map(|e| e.status), Some(EventStatus::Dead));
        assert!(outbox.requeue(by_hand.as_str()).await.expect("requeue"));
        store
            .write(|tx| tx.execute("DELETE FROM outbox_events WHERE seq > 2", []))
            .await
            .expect("delete the event inserted by hand");

        // The largest number, freed by a purge, is taken again under a new id.
        store
            .write(move |tx| tx.execute("DELETE FROM outbox_events WHERE seq = 2", []))
            .await
            .expect("delete");
        let third = enqueue(&store, 3).await;
        assert_eq!(EventId::number_of(third.as_str()), Some(2));
        assert_ne!(third, second);
        assert!(outbox
            .event(second.as_str())
            .await
            .expect("event")
            .is_none());
        assert!(outbox.event(third.as_str()).await.expect("event").is_some());
    }

    #[tokio::test]
    async fn a_table_from_before_finds_its_old_ids_by_their_index_and_numbers_new_ones() {
        let (_dir, store, outbox) = store(true).await;
        // Two events written as before: random UUIDv7 ids, numbered by AUTOINCREMENT.
        let old: Vec<EventId> = (0..2).map(|_| EventId::generate()).collect();
        let rows = old.clone();
        store
            .write(move |tx| {
                for id in &rows {
                    tx.execute(
                        "INSERT INTO outbox_events (event_id, topic, payload, available_at, \
                         created_at) VALUES (?1, 't', '{}', 0, 0)",
                        [id.as_str()],
                    )?;
                }
                Ok(())
            })
            .await
            .expect("old events");
        let new = enqueue(&store, 3).await;
        assert_eq!(EventId::number_of(new.as_str()), Some(3));
        assert_eq!(claim_and_settle(&store).await[..2], old[..]);
        let status = |id: EventId| {
            let outbox = outbox.clone();
            async move {
                outbox
                    .event(id.as_str())
                    .await
                    .expect("event")
                    .map(|e| e.status)
            }
        };
        assert_eq!(status(old[0].clone()).await, Some(EventStatus::Delivered));
        assert_eq!(status(old[1].clone()).await, Some(EventStatus::Dead));
        assert_eq!(status(new.clone()).await, Some(EventStatus::InFlight));
        assert!(outbox.requeue(old[1].as_str()).await.expect("requeue"));
        assert_eq!(status(old[1].clone()).await, Some(EventStatus::Pending));
    }

    #[tokio::test]
    async fn a_new_event_is_in_no_index_until_a_claim_takes_it() {
        let (_dir, store, _outbox) = store(false).await;
        let ids = [
            enqueue(&store, 1).await,
            enqueue(&store, 2).await,
            enqueue(&store, 3).await,
        ];
        for index in ["outbox_events_due", "outbox_events_claimed"] {
            assert_eq!(entries(&store, index).await, 0, "{index} after enqueues");
        }
        let relay = LeaseToken::new("relay");
        let now = SystemTime::now();
        assert_eq!(claim_at(&store, &relay, 2, now).await, ids[..2].to_vec());
        for index in ["outbox_events_due", "outbox_events_claimed"] {
            assert_eq!(
                entries(&store, index).await,
                2,
                "{index} after a claim of two"
            );
        }
        assert_eq!(claim_at(&store, &relay, 2, now).await, ids[2..].to_vec());
        assert!(claim_at(&store, &relay, 2, now).await.is_empty());
        let backlog = store.backlog().await.expect("backlog");
        assert_eq!(
            (backlog.pending, backlog.dead),
            (3, 0),
            "claimed is still pending"
        );
    }

    #[tokio::test]
    async fn a_claim_takes_retries_and_new_events_earliest_due_first() {
        let (_dir, store, _outbox) = store(false).await;
        let relay = LeaseToken::new("relay");
        let (first, second) = (enqueue(&store, 1).await, enqueue(&store, 2).await);
        let start = SystemTime::now();
        assert_eq!(
            claim_at(&store, &relay, 10, start).await,
            vec![first.clone(), second.clone()]
        );
        // The first fails and is due again at once; the second stays leased.
        store
            .settle(vec![Settlement::Retry {
                id: first.clone(),
                token: relay.clone(),
                at: start,
                error: "503".into(),
            }])
            .await
            .expect("settle");
        let (third, fourth) = (enqueue(&store, 3).await, enqueue(&store, 4).await);
        let later = SystemTime::now() + Duration::from_secs(1);
        assert_eq!(
            claim_at(&store, &relay, 2, later).await,
            vec![first.clone(), third.clone()],
            "the retry, due before the new events were written, then the oldest new one"
        );
        assert_eq!(
            claim_at(&store, &relay, 10, later).await,
            vec![fourth.clone()]
        );
        assert_eq!(
            claim_at(&store, &relay, 10, later + Duration::from_secs(31)).await,
            vec![first, second, third, fourth],
            "leases run out: claimed again, oldest first"
        );
    }

    #[tokio::test]
    async fn a_requeued_event_below_new_ones_and_a_new_one_after_a_purge_are_claimed() {
        let (_dir, store, outbox) = store(false).await;
        let relay = LeaseToken::new("relay");
        let ids = claim_and_settle_pair(&store).await;
        let third = enqueue(&store, 3).await;
        assert_eq!(claim_all(&store, &relay).await, vec![third.clone()]);
        // The dead one, below the new one just claimed, is requeued.
        assert!(outbox.requeue(ids[1].as_str()).await.expect("requeue"));
        assert_eq!(claim_all(&store, &relay).await, vec![ids[1].clone()]);
        // Every event delivered, then purged: the table is empty, numbers start again.
        store
            .settle(
                [ids[1].clone(), third]
                    .into_iter()
                    .map(|id| Settlement::Delivered { id })
                    .collect(),
            )
            .await
            .expect("settle");
        let purged = store
            .purge_delivered(SystemTime::now() + Duration::from_secs(1), 100)
            .await
            .expect("purge");
        assert_eq!(purged, 3);
        let fresh = enqueue(&store, 4).await;
        assert_eq!(EventId::number_of(fresh.as_str()), Some(1));
        assert_eq!(claim_all(&store, &relay).await, vec![fresh]);
    }

    /// Two events, claimed and settled: the first delivered, the second dead.
    async fn claim_and_settle_pair(store: &SqliteStore) -> Vec<EventId> {
        enqueue(store, 1).await;
        enqueue(store, 2).await;
        claim_and_settle(store).await
    }

    #[tokio::test]
    async fn a_file_whose_outbox_predates_the_claimed_index_gets_it_from_a_claim() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = SqliteStore::open(dir.path().join("outbox.db"))
            .await
            .expect("open");
        store
            .write(|tx| tx.execute_batch(&old_schema()))
            .await
            .expect("old schema");
        let id = enqueue(&store, 1).await;
        let relay = LeaseToken::new("relay");
        assert_eq!(claim_all(&store, &relay).await, vec![id]);
        assert_eq!(entries(&store, "outbox_events_claimed").await, 1);
    }

    #[tokio::test]
    async fn the_claims_reads_go_through_their_indexes() {
        let (_dir, store, _outbox) = store(false).await;
        let plans = store
            .read(|conn| {
                [DUE_AGAIN, LAST_CLAIMED, NEW_EVENTS]
                    .into_iter()
                    .map(|sql| {
                        let mut statement = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}"))?;
                        let arguments = vec![0; statement.parameter_count()];
                        let details = statement
                            .query_map(rusqlite::params_from_iter(arguments), |row| {
                                row.get::<_, String>(3)
                            })?
                            .collect::<rusqlite::Result<Vec<_>>>()?;
                        Ok(details.join("; "))
                    })
                    .collect::<rusqlite::Result<Vec<_>>>()
            })
            .await
            .expect("plans");
        assert!(plans[0].contains("outbox_events_due"), "{}", plans[0]);
        assert!(plans[1].contains("outbox_events_claimed"), "{}", plans[1]);
        assert!(plans[2].contains("INTEGER PRIMARY KEY"), "{}", plans[2]);
    }

    #[test]
    fn new_events_are_taken_from_the_front_and_stop_at_one_not_yet_due() {
        // (seq, due): the retries by due time; the new events by seq, the second written
        // after the clock was set back.
        let again = [(1, 60), (2, 150)];
        let new = [(5, 100), (6, 50), (7, 120)];
        assert_eq!(due_first(&again, &new, 200, 10), vec![1, 5, 6, 7, 2]);
        assert_eq!(due_first(&again, &new, 200, 2), vec![1, 5]);
        let later = [(5, 300), (6, 100)];
        assert_eq!(due_first(&again, &later, 200, 10), vec![1, 2]);
        assert_eq!(due_first(&[], &new, 200, 10), vec![5, 6, 7]);
    }
}
