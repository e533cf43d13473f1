#![doc = include_str!("../docs/outbox.md")]

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::body::BoxError;
use crate::error::Error;

#[cfg(feature = "_sql-store")]
pub(crate) mod columns;
#[cfg(feature = "_sql-store")]
pub(crate) mod inbox;
mod relay;
mod sink;

// Each backend's outbox lives in its folder (`src/sqlite/`, `src/tokio_postgres/`,
// `src/sqlx/`, over `src/row_lock/outbox.rs` on the SQL servers): `Outbox<Store>` and
// `Inbox<Store>` are its public names.

#[cfg(feature = "_sql-store")]
pub(crate) use inbox::InboxOutcome;
#[cfg(any(
    feature = "sqlite",
    feature = "tokio-postgres",
    feature = "sqlx-postgres",
    feature = "sqlx-mysql",
    feature = "sqlx-sqlite"
))]
pub use inbox::{Inbox, InboxBackend};
pub use relay::{Relay, RoundReport};
pub use sink::{sink_fn, HttpSink, Permanent, SinkFn, EVENT_TOPIC};

/// The id of an outbox event: a UUID v7 (time-ordered), unique across processes and databases.
/// The SQLite store's ids carry the event's row number in the bits after the time (and 30
/// random bits), which is how it finds an event without an index on the id.
///
/// It travels with every delivery (as `Idempotency-Key` over HTTP) and stays the same across
/// redeliveries, which is what lets a receiver drop duplicates.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventId(Arc<str>);

impl EventId {
    /// A new, unique id (the SQL servers' events; SQLite's are [`numbered`](Self::numbered)).
    #[cfg(feature = "_row-lock-store")]
    pub(crate) fn generate() -> Self {
        EventId(Arc::from(uuid::Uuid::now_v7().to_string()))
    }

    /// A new id that carries `number`, the event's row in a store that finds events by it
    /// (SQLite's `seq`); `None` from [`MAX_EVENT_NUMBER`] (2^44) on.
    ///
    /// A UUIDv7 still: the 74 bits after its time hold the number in their first 44 and random
    /// bits in the other 30, so one store's ids are ordered by their creation (the time, then
    /// the number), and two ids are alike only if their time, number and random bits are (a
    /// chance of one in 2^30 for two events given the same number in the same millisecond,
    /// in two stores).
    #[cfg(feature = "sqlite")]
    pub(crate) fn numbered(number: u64) -> Option<Self> {
        if number >= MAX_EVENT_NUMBER {
            return None;
        }
        let time_and_random = uuid::Uuid::now_v7().as_u128();
        let bits = (time_and_random & !((1u128 << 80) - 1))
            | (0x7 << 76)
            | (u128::from(number >> NUMBER_LOW_BITS) << 64)
            | (0b10 << 62)
            | (u128::from(number & ((1 << NUMBER_LOW_BITS) - 1)) << NUMBER_RANDOM_BITS)
            | (time_and_random & ((1 << NUMBER_RANDOM_BITS) - 1));
        Some(EventId(Arc::from(uuid::Uuid::from_u128(bits).to_string())))
    }

    /// The number a [`numbered`](Self::numbered) id carries; `None` for text that is not a
    /// UUIDv7. Any other UUIDv7 gives a number too (its bits), which names no event or another
    /// one: a store that finds events by number compares the id as well.
    #[cfg(feature = "sqlite")]
    pub(crate) fn number_of(id: &str) -> Option<u64> {
        let uuid = uuid::Uuid::try_parse(id).ok()?;
        if uuid.get_version_num() != 7 || uuid.get_variant() != uuid::Variant::RFC4122 {
            return None;
        }
        let bits = uuid.as_u128();
        let high = ((bits >> 64) & 0xfff) as u64;
        let low = ((bits >> NUMBER_RANDOM_BITS) & ((1 << NUMBER_LOW_BITS) - 1)) as u64;
        Some((high << NUMBER_LOW_BITS) | low)
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The numbers a [`EventId::numbered`] id can carry: below 2^44.
#[cfg(feature = "sqlite")]
pub(crate) const MAX_EVENT_NUMBER: u64 = 1 << 44;
/// The bits of a number in the UUID's `rand_b` (its top 12 are `rand_a`).
#[cfg(feature = "sqlite")]
const NUMBER_LOW_BITS: u32 = 32;
/// The random bits below them.
#[cfg(feature = "sqlite")]
const NUMBER_RANDOM_BITS: u32 = 30;

impl From<String> for EventId {
    /// An id given as text: read back from a store, or received with a delivery.
    fn from(id: String) -> Self {
        EventId(Arc::from(id))
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EventId({})", self.0)
    }
}

/// One event as the sink receives it.
#[derive(Clone, Debug)]
pub struct OutboxEvent {
    id: EventId,
    topic: Arc<str>,
    payload: Arc<str>,
    attempt: u32,
    created_at: SystemTime,
}

impl OutboxEvent {
    /// An event read back from a store (for [`OutboxStore`] implementations). `payload` is
    /// JSON text; `attempt` counts this delivery (1 for the first).
    pub fn new(
        id: EventId,
        topic: impl Into<Arc<str>>,
        payload: impl Into<Arc<str>>,
        attempt: u32,
        created_at: SystemTime,
    ) -> Self {
        OutboxEvent {
            id,
            topic: topic.into(),
            payload: payload.into(),
            attempt,
            created_at,
        }
    }

    /// The event's id: the same on every delivery of this event.
    pub fn id(&self) -> &EventId {
        &self.id
    }

    /// The topic given to [`Enqueue::enqueue`] (`order_created`).
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The payload, as JSON text.
    pub fn payload(&self) -> &str {
        &self.payload
    }

    /// The payload, parsed.
    pub fn payload_json(&self) -> serde_json::Result<serde_json::Value> {
        serde_json::from_str(&self.payload)
    }

    /// Which delivery attempt this is: 1 for the first, more after failures or after a relay
    /// died while delivering it.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// When the event was enqueued.
    pub fn created_at(&self) -> SystemTime {
        self.created_at
    }
}

/// Enqueues an event in the transaction of the handle it is called on.
///
/// Implemented by the transaction handles of the stores with an outbox
/// ([`SqliteHandle`](crate::store::sqlite::SqliteHandle)). The event commits or rolls
/// back with everything else the handler wrote: a handler that fails after enqueueing leaves no
/// event behind.
pub trait Enqueue {
    /// Adds an event with this topic and JSON payload to the outbox, in this transaction, and
    /// returns its id. Fails if the transaction has ended or the outbox table does not exist
    /// (see the store's `install`).
    fn enqueue(
        &self,
        topic: &str,
        payload: serde_json::Value,
    ) -> impl Future<Output = Result<EventId, Error>> + Send;
}

/// Whether an event id was new to an inbox (see [`Inbox::process_in`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Receipt {
    /// First time: the id is now recorded (in the caller's transaction); apply the event.
    First,
    /// Seen before: the event was already applied; acknowledge it and do nothing.
    Duplicate,
}

/// What an inbox's `process` did (see [`Inbox::process`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Processed<T> {
    /// The event was new: the closure ran and its result committed with the id.
    First(T),
    /// The event had been processed already: the closure did not run.
    Duplicate,
}

/// The rows the relay and a backend exchange: sealed (public in a module this crate does not
/// export), since only this crate's backends implement [`OutboxStore`].
mod seam {
    use super::*;

    /// A relay's claim on an event: only the claim's holder may reschedule or dead-letter it.
    #[derive(Clone, Debug, PartialEq, Eq)]
    pub struct LeaseToken(Arc<str>);

    impl LeaseToken {
        /// A token; unique per claim (the relay builds it from its own id and a round counter).
        pub fn new(token: impl Into<Arc<str>>) -> Self {
            LeaseToken(token.into())
        }

        /// The token as text (what a store saves as the lease's owner).
        pub fn as_str(&self) -> &str {
            &self.0
        }
    }

    /// What [`OutboxStore::claim`] is asked for.
    #[derive(Clone, Debug)]
    pub struct ClaimRequest {
        /// Who claims: saved with each claimed event.
        pub token: LeaseToken,
        /// At most this many events.
        pub batch: usize,
        /// How long the claim holds: until then no other relay may claim these events.
        pub lease: Duration,
        /// An event whose lease ran out after this many attempts (its relay died delivering it)
        /// is dead-lettered instead of claimed again.
        pub max_attempts: u32,
        /// The relay's clock.
        pub now: SystemTime,
    }

    /// What [`OutboxStore::claim`] returns.
    #[derive(Debug, Default)]
    pub struct Claimed {
        /// The claimed events, oldest first, with their attempt number already counted.
        pub events: Vec<OutboxEvent>,
        /// Events dead-lettered during the claim because their last allowed attempt was abandoned
        /// (its lease ran out).
        pub abandoned: Vec<OutboxEvent>,
    }

    /// What happened to a claimed event, for [`OutboxStore::settle`].
    #[derive(Clone, Debug)]
    #[non_exhaustive]
    pub enum Settlement {
        /// The sink accepted it: never deliver it again.
        Delivered {
            /// The event.
            id: EventId,
        },
        /// It failed: deliver it again from `at` on, if the claim is still `token`'s.
        Retry {
            /// The event.
            id: EventId,
            /// The claim it was delivered under.
            token: LeaseToken,
            /// When it becomes due again.
            at: SystemTime,
            /// Why it failed (kept as the event's last error).
            error: String,
        },
        /// It failed for good: move it to the dead-letter state, if the claim is still `token`'s.
        Dead {
            /// The event.
            id: EventId,
            /// The claim it was delivered under.
            token: LeaseToken,
            /// Why it failed (kept as the event's last error).
            error: String,
        },
    }

    /// How many events wait: sampled for the backlog gauges.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct Backlog {
        /// Not yet delivered and not dead (due, waiting for a retry, or in flight).
        pub pending: u64,
        /// Dead-lettered.
        pub dead: u64,
    }
}
pub use seam::Backlog;
pub(crate) use seam::{ClaimRequest, Claimed, LeaseToken, Settlement};

pub(crate) mod sealed {
    use std::future::Future;

    use super::{ClaimRequest, Claimed, Settlement};
    use crate::error::Error;

    /// What the [`Relay`](super::Relay) does with an [`OutboxStore`](super::OutboxStore),
    /// with the rows they exchange: a trait no other crate can name, so that only this crate's
    /// stores, and [`Outbox`](super::Outbox) over them, are `OutboxStore`s. Each makes
    /// [`claim`](Self::claim) atomic: an event claimed by one caller is not returned to
    /// another until its lease has run out or it was settled for retry.
    #[allow(unreachable_pub)]
    pub trait OutboxStore {
        /// Claims up to `request.batch` due events for `request.lease`, counting an attempt on
        /// each.
        fn claim(
            &self,
            request: ClaimRequest,
        ) -> impl Future<Output = Result<Claimed, Error>> + Send;

        /// Records what happened to claimed events (in one transaction where the backend
        /// allows).
        fn settle(
            &self,
            settlements: Vec<Settlement>,
        ) -> impl Future<Output = Result<(), Error>> + Send;
    }
}

/// The storage side of the outbox, as the [`Relay`] uses it: it claims due events atomically
/// (an event claimed by one relay is not returned to another until its lease has run out or it
/// was settled for retry) and settles them.
///
/// Sealed: implemented by this crate's stores and by [`Outbox`] over them; the claim and the
/// settlements are the crate's own.
pub trait OutboxStore: Clone + Send + Sync + 'static + sealed::OutboxStore {
    /// Counts waiting and dead-lettered events.
    fn backlog(&self) -> impl Future<Output = Result<Backlog, Error>> + Send;
}

/// The state of an event in the outbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EventStatus {
    /// Waiting to be delivered: due, or waiting for its next retry.
    Pending,
    /// Claimed by a relay right now (its lease has not run out).
    InFlight,
    /// The sink accepted it.
    Delivered,
    /// It failed too often (or for good); a person should look at it, then requeue it.
    Dead,
}

impl EventStatus {
    /// A short lowercase name (`pending`, `in_flight`, `delivered`, `dead`).
    pub fn as_str(self) -> &'static str {
        match self {
            EventStatus::Pending => "pending",
            EventStatus::InFlight => "in_flight",
            EventStatus::Delivered => "delivered",
            EventStatus::Dead => "dead",
        }
    }
}

impl fmt::Display for EventStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An event as stored, for inspection (dead letters, admin tools).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct EventInfo {
    /// The event's id.
    pub id: EventId,
    /// Its topic.
    pub topic: String,
    /// Its JSON payload, as text.
    pub payload: String,
    /// Where it stands.
    pub status: EventStatus,
    /// Delivery attempts so far.
    pub attempts: u32,
    /// When it was enqueued.
    pub created_at: SystemTime,
    /// When it is (or was) next due.
    pub available_at: SystemTime,
    /// When the sink accepted it.
    pub delivered_at: Option<SystemTime>,
    /// The last failure's message.
    pub last_error: Option<String>,
}

/// Counts of events by state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxCounts {
    /// Waiting for delivery or for a retry.
    pub pending: u64,
    /// Claimed by a relay right now.
    pub in_flight: u64,
    /// Delivered.
    pub delivered: u64,
    /// Dead-lettered.
    pub dead: u64,
}

/// What a database implements to hold an outbox: the relay's [`OutboxStore`] plus creating
/// the table and the maintenance queries. [`Outbox`] and [`Admin`](crate::admin::Admin) are
/// written once over it; every store of the crate implements it (each in its module, with only
/// its SQL). Sealed, as [`OutboxStore`] is.
pub trait OutboxBackend: OutboxStore {
    /// Creates the `outbox_events` table if needed. Idempotent.
    fn install_outbox(&self) -> impl Future<Output = Result<(), Error>> + Send;

    /// One event, by id.
    fn event(&self, id: &str) -> impl Future<Output = Result<Option<EventInfo>, Error>> + Send;

    /// How many events are in each state.
    fn outbox_counts(&self) -> impl Future<Output = Result<OutboxCounts, Error>> + Send;

    /// Dead-lettered events, oldest first, at most `limit`.
    fn dead_letters(
        &self,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<EventInfo>, Error>> + Send;

    /// Moves the dead-lettered event `id` back to pending, due now, attempts reset; `false`
    /// if no dead event has this id.
    fn requeue(&self, id: &str) -> impl Future<Output = Result<bool, Error>> + Send;

    /// [`requeue`](Self::requeue) for every dead-lettered event; returns how many.
    fn requeue_all_dead(&self) -> impl Future<Output = Result<u64, Error>> + Send;

    /// Deletes up to `batch` events delivered before `before`; returns how many.
    fn purge_delivered(
        &self,
        before: SystemTime,
        batch: usize,
    ) -> impl Future<Output = Result<u64, Error>> + Send;
}

/// The outbox of a database: what a [`Relay`] delivers from (it is an [`OutboxStore`]) and the
/// operations on `outbox_events` (counts, dead letters, requeue, purge), the same on every
/// backend: `Outbox<SqliteStore>`, `Outbox<PostgresStore>`... Cheap to clone. Events are
/// enqueued with [`Enqueue`] on a request's handle, or with the store's `Outbox::enqueue_in` on
/// a connection of your own.
#[derive(Clone)]
pub struct Outbox<S> {
    store: S,
}

impl<S: fmt::Debug> fmt::Debug for Outbox<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbox")
            .field("store", &self.store)
            .finish()
    }
}

impl<S: OutboxBackend> Outbox<S> {
    /// Creates `outbox_events` if needed and returns the outbox. Idempotent (and safe for
    /// instances starting at once): call it at start-up, before serving requests that enqueue.
    pub async fn install(store: &S) -> Result<Self, Error> {
        store.install_outbox().await?;
        Ok(Outbox::existing(store))
    }

    /// The outbox of a database whose `outbox_events` table already exists (an admin tool
    /// should not create tables); calls on it fail if the table is missing.
    pub fn existing(store: &S) -> Self {
        Outbox {
            store: store.clone(),
        }
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// One event, by id.
    pub async fn event(&self, id: &str) -> Result<Option<EventInfo>, Error> {
        self.store.event(id).await
    }

    /// How many events are in each state.
    pub async fn counts(&self) -> Result<OutboxCounts, Error> {
        self.store.outbox_counts().await
    }

    /// Dead-lettered events, oldest first, at most `limit`.
    pub async fn dead_letters(&self, limit: usize) -> Result<Vec<EventInfo>, Error> {
        self.store.dead_letters(limit).await
    }

    /// Moves a dead-lettered event back to pending, due now, with its attempts reset (its last
    /// error is kept until the next attempt). Returns `false` if no dead event has this id.
    pub async fn requeue(&self, id: &str) -> Result<bool, Error> {
        self.store.requeue(id).await
    }

    /// Requeues every dead-lettered event (see [`requeue`](Self::requeue)); returns how many.
    pub async fn requeue_all_dead(&self) -> Result<u64, Error> {
        self.store.requeue_all_dead().await
    }

    /// Deletes up to `batch` events delivered before `before`; returns how many. Delivered
    /// events are kept until then only for inspection: nothing reads them again. Several
    /// instances may purge at once.
    pub async fn purge_delivered(&self, before: SystemTime, batch: usize) -> Result<u64, Error> {
        self.store.purge_delivered(before, batch).await
    }
}

impl<S: OutboxBackend> sealed::OutboxStore for Outbox<S> {
    fn claim(&self, request: ClaimRequest) -> impl Future<Output = Result<Claimed, Error>> + Send {
        self.store.claim(request)
    }

    fn settle(
        &self,
        settlements: Vec<Settlement>,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        self.store.settle(settlements)
    }
}

impl<S: OutboxBackend> OutboxStore for Outbox<S> {
    fn backlog(&self) -> impl Future<Output = Result<Backlog, Error>> + Send {
        self.store.backlog()
    }
}

/// How long to wait before attempt `attempt + 1`, after attempt `attempt` failed:
/// exponential from `initial`, capped at `max`, with "equal jitter" (a random point in the
/// upper half) so that relays retrying the same failure spread out but never retry at once.
pub(crate) fn backoff(attempt: u32, initial: Duration, max: Duration) -> Duration {
    let exponent = attempt.saturating_sub(1).min(30);
    let full = initial.saturating_mul(1u32 << exponent).min(max);
    let half = full / 2;
    let jitter_nanos = u64::try_from(half.as_nanos()).unwrap_or(u64::MAX);
    half + Duration::from_nanos(fastrand::u64(0..=jitter_nanos))
}

/// Whether a sink error asks for the event to be dead-lettered at once.
pub(crate) fn is_permanent(error: &BoxError) -> bool {
    error.downcast_ref::<Permanent>().is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_within_jitter_and_caps() {
        let initial = Duration::from_millis(100);
        let max = Duration::from_secs(10);
        for attempt in 1..=12u32 {
            let full = (initial * 2u32.pow(attempt - 1)).min(max);
            for _ in 0..50 {
                let delay = backoff(attempt, initial, max);
                assert!(delay >= full / 2 && delay <= full, "{attempt}: {delay:?}");
            }
        }
        // Huge attempt counts neither overflow nor exceed the cap.
        assert!(backoff(u32::MAX, initial, max) <= max);
    }

    #[test]
    fn event_ids_are_unique_and_time_ordered() {
        let first = EventId::generate();
        let second = EventId::generate();
        assert_ne!(first, second);
        assert!(first < second, "{first} then {second}");
        assert_eq!(
            uuid::Uuid::parse_str(first.as_str()).map(|u| u.get_version_num()),
            Ok(7)
        );
    }

    #[test]
    fn a_numbered_id_is_a_uuid_v7_that_gives_its_number_back() {
        for number in [
            0,
            1,
            4095,
            4096,
            (1 << 32) - 1,
            1 << 32,
            MAX_EVENT_NUMBER - 1,
        ] {
            let id = EventId::numbered(number).expect("a number below the maximum");
            let uuid = uuid::Uuid::parse_str(id.as_str()).expect("a UUID");
            assert_eq!(uuid.get_version_num(), 7, "{id}");
            assert_eq!(uuid.get_variant(), uuid::Variant::RFC4122, "{id}");
            assert_eq!(EventId::number_of(id.as_str()), Some(number), "{id}");
        }
        assert!(EventId::numbered(MAX_EVENT_NUMBER).is_none());
        assert_eq!(EventId::number_of("not a uuid"), None);
        let v4 = uuid::Uuid::from_u128(0x1234_5678_9abc_4def_8123_4567_89ab_cdef);
        assert_eq!(EventId::number_of(&v4.to_string()), None);
    }

    #[test]
    fn numbered_ids_are_ordered_by_their_creation_and_unique() {
        let ids: Vec<EventId> = (1..=1000)
            .map(|n| EventId::numbered(n).expect("a small number"))
            .collect();
        assert!(ids.windows(2).all(|pair| pair[0] < pair[1]));
        // The same number twice: told apart by the time or the random bits.
        let again: Vec<EventId> = (0..100)
            .map(|_| EventId::numbered(7).expect("a small number"))
            .collect();
        let distinct: std::collections::HashSet<&EventId> = again.iter().collect();
        assert_eq!(distinct.len(), again.len());
    }

    #[test]
    fn permanent_errors_are_recognised_through_the_box() {
        let permanent: BoxError = Box::new(Permanent::new("no such sku"));
        let transient: BoxError = "connection refused".into();
        assert!(is_permanent(&permanent));
        assert!(!is_permanent(&transient));
    }
}
