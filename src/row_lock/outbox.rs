//! The outbox and the inbox on the SQL servers, written once for every driver: the statements
//! of the server's SQL module (`postgres/outbox_sql.rs` on PostgreSQL, `mysql/outbox_sql.rs` on
//! MySQL and MariaDB, `sqlx/sqlite/outbox_sql.rs` on SQLite, each over the shared
//! `outbox_sql.rs`), run through [`SqlDriver`](crate::row_lock::driver::SqlDriver) (tokio-postgres'
//! [`PostgresStore`], sqlx' [`SqlxPostgresStore`], [`SqlxMySqlStore`] and [`SqlxSqliteStore`]
//! implement it), so every
//! store claims, settles, counts, records and retries the same way. Only the claim differs:
//! PostgreSQL's updates return their rows (`RETURNING`, [`claim_returning`]); MySQL selects
//! the rows with a locking read first, then updates them (the MySQL driver's `claim`); SQLite's
//! updates return their rows in a transaction that holds the write lock (its driver's
//! `claim`). Each store expands [`sql_outbox_and_inbox!`] in its folder.
//!
//! [`PostgresStore`]: crate::store::tokio_postgres::PostgresStore
//! [`SqlxPostgresStore`]: crate::store::sqlx_postgres::SqlxPostgresStore
//! [`SqlxMySqlStore`]: crate::store::sqlx_mysql::SqlxMySqlStore
//! [`SqlxSqliteStore`]: crate::store::sqlx_sqlite::SqlxSqliteStore

use std::time::{Duration, SystemTime};

use crate::error::Error;
use crate::outbox::inbox::receipt;
use crate::outbox::{EventId, Receipt};
#[cfg(feature = "_postgres-dialect")]
use crate::postgres::outbox_sql as pg_sql;
use crate::row::Columns;
use crate::row_lock::driver::{SqlHandle, SqlParam};
use crate::store::to_unix_millis;

/// How many times a claim that met a deadlock or a serialization failure runs again, and
/// within how long.
pub(crate) const CLAIM_CONFLICT_RETRIES: u32 = 3;
pub(crate) const CLAIM_RETRY_WINDOW: Duration = Duration::from_secs(1);

/// A new event, as [`INSERT_EVENT`] writes it.
pub(crate) struct NewEvent {
    /// Its id, generated here.
    pub(crate) id: EventId,
    payload: String,
    now: i64,
}

impl NewEvent {
    /// An event with this payload, enqueued now.
    pub(crate) fn new(payload: &serde_json::Value) -> Self {
        NewEvent {
            id: EventId::generate(),
            payload: payload.to_string(),
            now: to_unix_millis(SystemTime::now()),
        }
    }

    /// The parameters of [`INSERT_EVENT`].
    pub(crate) fn params<'a>(&'a self, topic: &'a str) -> [SqlParam<'a>; 4] {
        [
            self.id.as_str().into(),
            topic.into(),
            self.payload.as_str().into(),
            self.now.into(),
        ]
    }
}

/// A count or a limit as a `BIGINT` (saturating).
pub(crate) fn big_int(value: usize) -> SqlParam<'static> {
    SqlParam::BigInt(i64::try_from(value).unwrap_or(i64::MAX))
}

/// The `EXISTS (...)` of a statement's only row.
pub(crate) fn exists(rows: &[impl Columns<Error = Error>]) -> Result<bool, Error> {
    one_row(rows, "exists")?.required_boolean(0, "exists")
}

/// The only row a statement returns.
pub(crate) fn one_row<'a, R>(rows: &'a [R], what: &str) -> Result<&'a R, Error> {
    rows.first()
        .ok_or_else(|| Error::Corrupt(format!("{what}: no row")))
}

/// How a server records an inbox id: its `INSERT_ID`, and its `check_inbox_ids`.
type Recording = (&'static str, fn(&str, &str) -> Result<(), Error>);

/// Records `event_id` for `consumer` in the transaction of `tx`, as the server's `recording`
/// says (a consumer or an id that does not fit its table is refused first).
pub(crate) async fn record<H: SqlHandle>(
    tx: &H,
    (insert_id, check): Recording,
    consumer: &str,
    event_id: &str,
) -> Result<Receipt, Error> {
    check(consumer, event_id)?;
    let inserted = tx
        .execute_in(insert_id, &record_params(consumer, event_id))
        .await?;
    Ok(receipt(inserted))
}

/// The claim on PostgreSQL: both updates, each `RETURNING` its rows, in one transaction.
#[cfg(feature = "_postgres-dialect")]
pub(crate) async fn claim_returning<D: crate::row_lock::driver::SqlDriver>(
    driver: &D,
    dead_letter: &[SqlParam<'_>],
    claim: &[SqlParam<'_>],
) -> Result<[Vec<D::Row>; 2], Error> {
    let statements = [
        (pg_sql::DEAD_LETTER_ABANDONED, dead_letter),
        (pg_sql::CLAIM, claim),
    ];
    let results = driver.fetch_in_transaction(&statements).await?;
    <[Vec<D::Row>; 2]>::try_from(results)
        .map_err(|_| Error::Corrupt("a claim returned no rows".into()))
}

/// The parameters of an `INSERT_ID` recording `event_id` for `consumer` now (for the inboxes'
/// `record` on an executor of the caller's).
pub(crate) fn record_params<'a>(consumer: &'a str, event_id: &'a str) -> [SqlParam<'a>; 3] {
    let now = to_unix_millis(SystemTime::now());
    [consumer.into(), event_id.into(), now.into()]
}

/// The outbox's, the inbox's and `Enqueue`'s traits on a store and its transaction handle,
/// through [`SqlDriver`], with the statements of the server's SQL module `$sql` and its claim
/// `$claim` (written once; expanded in each store's folder, as concrete impls, so that the
/// driver traits stay private).
macro_rules! sql_outbox_and_inbox {
    ($store:ty, $handle:ty, $sql:ident, $claim:path) => {
        const _: () = {
        use $crate::row_lock::outbox::engine::*;

        /// Enqueues in the request's transaction, on either driver.
        ///
        /// ```no_run
        /// # async fn handler(tx: tower_idempotency::store::tokio_postgres::PostgresHandle)
        /// #     -> Result<(), tower_idempotency::Error> {
        /// use serde_json::json;
        /// use tower_idempotency::outbox::Enqueue;
        ///
        /// let event_id = tx.enqueue("order_created", json!({ "order_id": 7 })).await?;
        /// # let _ = event_id; Ok(()) }
        /// ```
        impl Enqueue for $handle {
            async fn enqueue(&self, topic: &str, payload: serde_json::Value) -> Result<EventId, Error> {
                let event = NewEvent::new(&payload);
                self.execute_in($sql::INSERT_EVENT, &event.params(topic)).await?;
                Ok(event.id)
            }
        }

        impl crate::outbox::sealed::OutboxStore for $store {
            async fn claim(&self, request: ClaimRequest) -> Result<Claimed, Error> {
                let now = to_unix_millis(request.now);
                let lease_until = to_unix_millis(request.now + request.lease.max(Duration::from_millis(1)));
                let max_attempts = SqlParam::Int(i32::try_from(request.max_attempts).unwrap_or(i32::MAX));
                // An idle relay polls often: a plain read first, so that polling opens no write
                // transaction and locks nothing.
                if !exists(&self.fetch_rows($sql::SELECT_DUE, &[now.into()]).await?)? {
                    return Ok(Claimed::default());
                }
                let token = request.token.as_str();
                // First, the events whose last allowed attempt was abandoned: retrying them would
                // exceed the attempts (and an event that crashes its relay would be retried forever).
                let dead_letter: &[SqlParam<'_>] = &[now.into(), max_attempts];
                let claim: &[SqlParam<'_>] = &[
                    token.into(),
                    lease_until.into(),
                    now.into(),
                    big_int(request.batch),
                ];
                // Two relays claiming at once can deadlock (InnoDB's gap locks): the claim's
                // transaction rolled back whole, so it runs again, a few times at most.
                let deadline = tokio::time::Instant::now() + CLAIM_RETRY_WINDOW;
                let [abandoned, claimed] = retry_conflicts(CLAIM_CONFLICT_RETRIES, deadline, || {
                    $claim(self, dead_letter, claim)
                })
                .await?;
                let events = |rows: Vec<<$store as SqlDriver>::Row>| rows.iter().map(claimed_row).collect::<Result<_, _>>();
                Ok(claimed_oldest_first(events(claimed)?, events(abandoned)?))
            }

            async fn settle(&self, settlements: Vec<Settlement>) -> Result<(), Error> {
                if settlements.is_empty() {
                    return Ok(());
                }
                let now = to_unix_millis(SystemTime::now());
                let params: Vec<(&str, Vec<SqlParam<'_>>)> = settlements
                    .iter()
                    .map(|settlement| match settlement {
                        // Recorded whoever holds the claim now: the sink accepted the event, and that
                        // stays true.
                        Settlement::Delivered { id } => {
                            ($sql::SETTLE_DELIVERED, vec![id.as_str().into(), now.into()])
                        }
                        // Only under our own claim: if it ran out and another relay claimed the event,
                        // that relay decides what happens next.
                        Settlement::Retry {
                            id,
                            token,
                            at,
                            error,
                        } => (
                            $sql::SETTLE_RETRY,
                            vec![
                                id.as_str().into(),
                                token.as_str().into(),
                                to_unix_millis(*at).into(),
                                error.as_str().into(),
                            ],
                        ),
                        Settlement::Dead { id, token, error } => (
                            $sql::SETTLE_DEAD,
                            vec![
                                id.as_str().into(),
                                token.as_str().into(),
                                error.as_str().into(),
                            ],
                        ),
                    })
                    .collect();
                let statements: Vec<(&str, &[SqlParam<'_>])> = params
                    .iter()
                    .map(|(sql, params)| (*sql, params.as_slice()))
                    .collect();
                self.fetch_in_transaction(&statements).await?;
                Ok(())
            }
        }

        impl OutboxStore for $store {
            async fn backlog(&self) -> Result<Backlog, Error> {
                let rows = self.fetch_rows($sql::BACKLOG, &[]).await?;
                let row = one_row(&rows, "backlog")?;
                Ok(Backlog {
                    pending: count_from_column(row.required_big_int(0, "pending count")?),
                    dead: count_from_column(row.required_big_int(1, "dead count")?),
                })
            }
        }

        impl OutboxBackend for $store {
            async fn install_outbox(&self) -> Result<(), Error> {
                self.install_tables($sql::OUTBOX_INSTALL_LOCK, $sql::SCHEMA).await
            }

            async fn event(&self, id: &str) -> Result<Option<EventInfo>, Error> {
                let now = to_unix_millis(SystemTime::now());
                let rows = self.fetch_rows($sql::SELECT_EVENT, &[id.into()]).await?;
                rows.first()
                    .map(|row| RawEvent::read(row)?.into_info(now))
                    .transpose()
            }

            async fn outbox_counts(&self) -> Result<OutboxCounts, Error> {
                let now = to_unix_millis(SystemTime::now());
                let rows = self.fetch_rows($sql::COUNT_BY_STATE, &[now.into()]).await?;
                let mut counts = OutboxCounts::default();
                for row in &rows {
                    let status = row.required_text(0, "status")?;
                    let leased = row.required_boolean(1, "leased")?;
                    let count = row.required_big_int(2, "count")?;
                    counts.add(event_status(&status, leased)?, count_from_column(count));
                }
                Ok(counts)
            }

            async fn dead_letters(&self, limit: usize) -> Result<Vec<EventInfo>, Error> {
                let now = to_unix_millis(SystemTime::now());
                let rows = self.fetch_rows($sql::DEAD_LETTERS, &[big_int(limit)]).await?;
                rows.iter()
                    .map(|row| RawEvent::read(row)?.into_info(now))
                    .collect()
            }

            async fn requeue(&self, id: &str) -> Result<bool, Error> {
                let now = to_unix_millis(SystemTime::now());
                let changed = self.execute_counted($sql::REQUEUE, &[id.into(), now.into()]).await?;
                Ok(changed > 0)
            }

            async fn requeue_all_dead(&self) -> Result<u64, Error> {
                let now = to_unix_millis(SystemTime::now());
                self.execute_counted($sql::REQUEUE_ALL_DEAD, &[now.into()]).await
            }

            /// Several instances may purge at once (SKIP LOCKED).
            async fn purge_delivered(&self, before: SystemTime, batch: usize) -> Result<u64, Error> {
                let before = to_unix_millis(before);
                self.execute_counted($sql::PURGE_DELIVERED, &[before.into(), big_int(batch)])
                    .await
            }
        }

        /// A PostgreSQL [`Inbox::process`](crate::outbox::Inbox::process) closure returns a future of
        /// `Result<T, Error>`, as an `async move` block or an `async fn(PostgresHandle) ->
        /// Result<T, Error>` does.
        impl<T, Fut> InboxOutcome<$store> for Fut
        where
            T: Send + 'static,
            Fut: Future<Output = Result<T, Error>> + Send + 'static,
        {
            type Value = T;

            fn into_resolved(self) -> Pin<Box<dyn Future<Output = Result<T, Error>> + Send>> {
                Box::pin(self)
            }
        }

        impl crate::outbox::inbox::sealed::InboxBackend for $store {}

        impl InboxBackend for $store {
            type Handle = $handle;
            type Work<'a> = $handle;
            type Resolved<T: Send + 'static> = Pin<Box<dyn Future<Output = Result<T, Error>> + Send>>;

            async fn install_inbox(&self) -> Result<(), Error> {
                self.install_tables($sql::INBOX_INSTALL_LOCK, $sql::INBOX_SCHEMA).await
            }

            async fn record_in(
                &self,
                tx: &$handle,
                consumer: &str,
                event_id: &str,
            ) -> Result<Receipt, Error> {
                record(tx, ($sql::INSERT_ID, $sql::check_inbox_ids), consumer, event_id).await
            }

            /// On a transaction of the store's own, with its isolation level. A panic in `work` or
            /// this future being dropped rolls back. Under `REPEATABLE READ` or `SERIALIZABLE`, a
            /// wait on the id's primary key that ends in a serialization failure is retried (the
            /// store's `with_serialization_retries` times:
            /// [`PostgresOptions::with_serialization_retries`],
            /// `SqlxPostgresOptions::with_serialization_retries`) before `work` is called.
            ///
            /// [`PostgresOptions::with_serialization_retries`]: crate::store::tokio_postgres::PostgresOptions::with_serialization_retries
            async fn process_once<F, R>(
                &self,
                consumer: &str,
                event_id: &str,
                work: F,
            ) -> Result<Processed<R::Value>, Error>
            where
                F: for<'a> FnOnce($handle) -> R + Send + 'static,
                R: InboxOutcome<Self>,
            {
                let mut work = Some(work);
                let mut retries = 0;
                loop {
                    let pending = &mut work;
                    let attempt = self
                        .in_own_transaction(Own::Work, |tx| async move {
                            match record(&tx, ($sql::INSERT_ID, $sql::check_inbox_ids), consumer, event_id).await? {
                                Receipt::Duplicate => Ok((Processed::Duplicate, Finish::Rollback)),
                                Receipt::First => match pending.take() {
                                    Some(work) => {
                                        let value = work(tx).into_resolved().await?;
                                        Ok((Processed::First(value), Finish::Commit))
                                    }
                                    None => Err(Error::Corrupt("inbox work already ran".into())),
                                },
                            }
                        })
                        .await;
                    match attempt {
                        // Only the recording may be retried: `work` has not run yet.
                        Err(error)
                            if work.is_some()
                                && error.is_serialization_conflict()
                                && retries < self.conflict_retries() =>
                        {
                            retries += 1;
                            tracing::debug!(%error, retries, "recording an inbox id conflicted; retrying");
                            // A short pause, growing with each retry, lets the other transaction end.
                            tokio::time::sleep(Duration::from_millis(2u64 << retries.min(6))).await;
                        }
                        outcome => return outcome,
                    }
                }
            }

            async fn inbox_contains(&self, consumer: &str, event_id: &str) -> Result<bool, Error> {
                let params = [consumer.into(), event_id.into()];
                exists(&self.fetch_rows($sql::INBOX_CONTAINS, &params).await?)
            }

            /// Several instances may purge at once (SKIP LOCKED).
            async fn purge_inbox(
                &self,
                consumer: &str,
                before: SystemTime,
                batch: usize,
            ) -> Result<u64, Error> {
                let before = to_unix_millis(before);
                let params = [consumer.into(), before.into(), big_int(batch)];
                self.execute_counted($sql::PURGE_INBOX, &params).await
            }
        }
        };
    };
}

/// Each store invokes it in its folder (its `driver.rs`).
pub(crate) use sql_outbox_and_inbox;

/// What [`sql_outbox_and_inbox!`]'s expansion names: it imports them all, wherever it is
/// invoked.
pub(crate) mod engine {
    pub(crate) use std::future::Future;
    pub(crate) use std::pin::Pin;
    pub(crate) use std::time::{Duration, SystemTime};

    pub(crate) use super::{
        big_int, exists, one_row, record, NewEvent, CLAIM_CONFLICT_RETRIES, CLAIM_RETRY_WINDOW,
    };
    pub(crate) use crate::error::Error;
    pub(crate) use crate::outbox::columns::{
        claimed_oldest_first, claimed_row, count_from_column, event_status, RawEvent,
    };
    pub(crate) use crate::outbox::{
        Backlog, ClaimRequest, Claimed, Enqueue, EventId, EventInfo, InboxBackend, InboxOutcome,
        OutboxBackend, OutboxCounts, OutboxStore, Processed, Receipt, Settlement,
    };
    pub(crate) use crate::row::Columns;
    pub(crate) use crate::row_lock::driver::{
        Finish, Own, SqlDriver, SqlHandle, SqlParam, SqlTransactions,
    };
    pub(crate) use crate::row_lock::reserve::retry_conflicts;
    pub(crate) use crate::store::to_unix_millis;
}
