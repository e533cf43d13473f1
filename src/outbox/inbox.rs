//! The receiver's inbox, written once over [`InboxBackend`]; its docs are on [`Inbox`].

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::SystemTime;

use super::{Processed, Receipt};
use crate::error::Error;
use crate::metrics::outbox as record;

pub(crate) mod sealed {
    /// Only this crate's stores are [`InboxBackend`](super::InboxBackend)s.
    #[allow(unreachable_pub)]
    pub trait InboxBackend {}
}

/// What a database implements to hold inboxes (table `inbox_events`): recording an id in a
/// request's transaction, the processing primitive on a transaction of its own, lookups and
/// purges. [`Inbox`] is written once over it.
///
/// Sealed: implemented by this crate's stores only.
pub trait InboxBackend: Clone + Send + Sync + 'static + sealed::InboxBackend {
    /// A request's transaction handle (the one the layer puts in the request extensions).
    type Handle: Send + Sync;

    /// What [`Inbox::process`]'s closure gets: the inbox's own transaction.
    type Work<'a>;

    /// What `InboxOutcome::into_resolved` turns the closure's return into: the value, or a
    /// future of it.
    type Resolved<T: Send + 'static>;

    /// Creates `inbox_events` if needed. Idempotent.
    fn install_inbox(&self) -> impl Future<Output = Result<(), Error>> + Send;

    /// Records `event_id` for `consumer` in the request's transaction `tx`.
    fn record_in(
        &self,
        tx: &Self::Handle,
        consumer: &str,
        event_id: &str,
    ) -> impl Future<Output = Result<Receipt, Error>> + Send;

    /// In one transaction of the backend's own: records `event_id` for `consumer` and, if it
    /// was new, runs `work` and commits both; if it was not, runs nothing. An error from
    /// `work` rolls back both.
    fn process_once<F, R>(
        &self,
        consumer: &str,
        event_id: &str,
        work: F,
    ) -> impl Future<Output = Result<Processed<R::Value>, Error>> + Send
    where
        F: for<'a> FnOnce(Self::Work<'a>) -> R + Send + 'static,
        R: InboxOutcome<Self>;

    /// Whether `consumer` has `event_id` (committed).
    fn inbox_contains(
        &self,
        consumer: &str,
        event_id: &str,
    ) -> impl Future<Output = Result<bool, Error>> + Send;

    /// Deletes up to `batch` ids of `consumer` processed before `before`; returns how many.
    fn purge_inbox(
        &self,
        consumer: &str,
        before: SystemTime,
        batch: usize,
    ) -> impl Future<Output = Result<u64, Error>> + Send;
}

/// What an [`Inbox::process`] closure may return on backend `S`: on SQLite a
/// `rusqlite::Result<T>`, on PostgreSQL a future of `Result<T, Error>`.
pub trait InboxOutcome<S: InboxBackend> {
    /// The value the closure produced (`T`).
    type Value: Send + 'static;

    /// The outcome as the backend consumes it.
    fn into_resolved(self) -> S::Resolved<Self::Value>;
}

/// The processed event ids of one consumer (table `inbox_events`): the same calls on every
/// backend (`Inbox<SqliteStore>`, `Inbox<PostgresStore>`...). Cheap to clone.
///
/// Receivers in several processes (or instances) may share one inbox: a redelivery that
/// arrives while the first delivery is still being applied waits for it, then is a duplicate
/// if it committed, or applies the event if it rolled back.
///
/// The receiver's side: an inbox of processed event ids, written in the receiver's own
/// transaction, so a redelivered event is acknowledged without being applied twice.
///
/// The relay delivers at least once: after a crash, a timeout or a lost acknowledgement the
/// same event (same [`EventId`](super::EventId)) arrives again. The receiver records the id in
/// the **same transaction** as the effect (reserving stock, say): either both commit or
/// neither does, so an id in the inbox always means "already applied", and an id missing
/// always means "not applied".
///
/// [`Inbox`] is written once over [`InboxBackend`]; it has the same calls on every backend:
///
/// - [`Inbox::process`] applies an event once, in a transaction of the inbox's own. What the
///   closure gets is the backend's: on SQLite a `&rusqlite::Transaction` (it runs on the
///   writer thread and returns a `rusqlite::Result`), on PostgreSQL the same
///   `PostgresHandle` handle a request's
///   handler gets (it returns a future).
/// - [`Inbox::process_in`] records the id in an idempotent request's transaction (the handle
///   the layer put in the request extensions) and returns a [`Receipt`]: the handler applies
///   the event through the same handle, so that the id, the effect and the saved response
///   commit together.
///
/// ```no_run
/// # async fn run() -> Result<(), tower_idempotency::Error> {
/// use tower_idempotency::outbox::{Inbox, Processed};
/// use tower_idempotency::store::sqlite::SqliteStore;
///
/// let store = SqliteStore::open("inventory.db").await?;
/// let inbox = Inbox::install(&store, "inventory").await?;
///
/// // For each delivery (the event id comes from the `Idempotency-Key` header):
/// let event_id = "0190c1c2-8d5e-7a1b-9c3d-4e5f60718293";
/// match inbox
///     .process(event_id, |tx| {
///         tx.execute("UPDATE stock SET reserved = reserved + 1 WHERE sku = 'book'", [])?;
///         Ok(())
///     })
///     .await?
/// {
///     Processed::First(()) => println!("reserved"),
///     Processed::Duplicate => println!("already reserved: acknowledged, nothing done"),
/// }
/// # Ok(()) }
/// ```
///
/// On PostgreSQL the closure returns a future:
///
/// ```no_run
/// # #[cfg(feature = "tokio-postgres")]
/// # async fn run() -> Result<(), tower_idempotency::Error> {
/// use tower_idempotency::outbox::{Inbox, Processed};
/// use tower_idempotency::store::tokio_postgres::PostgresStore;
///
/// let store = PostgresStore::connect("postgres://app@127.0.0.1/inventory").await?;
/// let inbox = Inbox::install(&store, "inventory").await?;
/// let event_id = "0190c1c2-8d5e-7a1b-9c3d-4e5f60718293";
/// let processed = inbox
///     .process(event_id, |tx| async move {
///         // The same handle a request's handler gets: one connection, one transaction.
///         let client = tx.client().await?;
///         let row = client
///             .query_one(
///                 "UPDATE stock SET reserved = reserved + 1 WHERE sku = $1 RETURNING reserved",
///                 &[&"book"],
///             )
///             .await?;
///         Ok(row.try_get::<_, i64>(0)?)
///     })
///     .await?;
/// if let Processed::First(reserved) = processed {
///     println!("reserved (now {reserved})");
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Inbox<S> {
    store: S,
    consumer: Arc<str>,
}

impl<S: fmt::Debug> fmt::Debug for Inbox<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inbox")
            .field("consumer", &self.consumer)
            .field("store", &self.store)
            .finish()
    }
}

impl<S: InboxBackend> Inbox<S> {
    /// Creates `inbox_events` if needed and returns the inbox of `consumer` (a name for the
    /// receiving component: several consumers may share one database, each with its own ids).
    /// Idempotent, and safe for instances starting at the same time.
    pub async fn install(store: &S, consumer: impl Into<Arc<str>>) -> Result<Self, Error> {
        store.install_inbox().await?;
        Ok(Inbox {
            store: store.clone(),
            consumer: consumer.into(),
        })
    }

    /// The consumer's name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Applies an event once: in one transaction of the inbox's own, records `event_id` and
    /// runs `f`, then commits; or, if the id was recorded before, does nothing and returns
    /// [`Processed::Duplicate`] without calling `f`. An error from `f` (or, on PostgreSQL, a
    /// panic or this future being dropped) rolls back both the id and the effect, so the
    /// redelivery runs `f` again.
    ///
    /// `f` is `Send + 'static` on every backend (SQLite runs it on the writer thread): move
    /// owned values into it (`String` rather than a borrowed `&str`; even a captured
    /// `&'static str` trips the compiler on PostgreSQL's future, so own that too).
    ///
    /// Two deliveries of one event at once apply it once: the second waits for the first
    /// transaction to end. On PostgreSQL under `REPEATABLE READ` or `SERIALIZABLE` that wait
    /// ends in a serialization failure, which is retried here
    /// (`serialization_retries` times, a setting of the PostgreSQL stores) before `f` is called.
    pub async fn process<F, R>(&self, event_id: &str, f: F) -> Result<Processed<R::Value>, Error>
    where
        F: for<'a> FnOnce(S::Work<'a>) -> R + Send + 'static,
        R: InboxOutcome<S>,
    {
        let processed = self.store.process_once(&self.consumer, event_id, f).await?;
        record::inbox(&self.consumer, matches!(processed, Processed::First(_)));
        Ok(processed)
    }

    /// Records `event_id` in an idempotent request's transaction (the handle the layer put in
    /// the request extensions): [`Receipt::First`] if it is new, and the handler then applies
    /// the event through the same handle, so that the id, the effect and the saved response
    /// commit together (or roll back together: the redelivery then applies it);
    /// [`Receipt::Duplicate`] if it was applied before, and the handler only acknowledges it.
    ///
    /// While another open transaction holds the same id (PostgreSQL), this waits for it to
    /// end, within the layer's lock timeout; past it the error [`is_busy`](Error::is_busy)
    /// (answer `503`, the sender retries). Under `REPEATABLE READ` or `SERIALIZABLE` a wait
    /// that ends with the other transaction committing is a serialization failure, also
    /// `is_busy`, and is not retried here (the request's transaction is not this call's to
    /// restart): answer `503`, and the sender's retry finds the id.
    ///
    /// ```no_run
    /// # async fn handler(
    /// #     inbox: tower_idempotency::outbox::Inbox<tower_idempotency::store::sqlite::SqliteStore>,
    /// #     tx: tower_idempotency::store::sqlite::SqliteHandle,
    /// #     event_id: &str,
    /// # ) -> Result<&'static str, tower_idempotency::Error> {
    /// use tower_idempotency::outbox::Receipt;
    ///
    /// if inbox.process_in(&tx, event_id).await? == Receipt::Duplicate {
    ///     return Ok("duplicate"); // applied before: acknowledge, change nothing
    /// }
    /// tx.run(|conn| conn.execute("UPDATE stock SET reserved = reserved + 1", []))
    ///     .await?;
    /// Ok("reserved")
    /// # }
    /// ```
    pub async fn process_in(&self, tx: &S::Handle, event_id: &str) -> Result<Receipt, Error> {
        let receipt = self.store.record_in(tx, &self.consumer, event_id).await?;
        record::inbox(&self.consumer, receipt == Receipt::First);
        Ok(receipt)
    }

    /// Whether `event_id` was processed (committed).
    pub async fn contains(&self, event_id: &str) -> Result<bool, Error> {
        self.store.inbox_contains(&self.consumer, event_id).await
    }

    /// Deletes up to `batch` ids of this consumer processed before `before`; returns how many.
    /// Keep ids longer than the sender may redeliver (its relay's whole retry schedule): an id
    /// purged too early lets a late redelivery apply again. Several instances may purge at
    /// once.
    pub async fn purge_processed_before(
        &self,
        before: SystemTime,
        batch: usize,
    ) -> Result<u64, Error> {
        self.store.purge_inbox(&self.consumer, before, batch).await
    }
}

/// [`Receipt::First`] if the insert added the id, [`Receipt::Duplicate`] if it was there.
pub(crate) fn receipt(inserted: u64) -> Receipt {
    if inserted == 1 {
        Receipt::First
    } else {
        Receipt::Duplicate
    }
}
