//! Reading `outbox_events` rows back, the same on every backend: the backends' SQL selects
//! the columns, these turn them into events, states and counts.

use super::{Claimed, EventId, EventInfo, EventStatus, OutboxCounts, OutboxEvent};
use crate::error::Error;
use crate::store::from_unix_millis;

/// A stored attempt count as a `u32`, the same on every backend: a negative count reads as 0
/// and one past `u32::MAX` as `u32::MAX` (saturating).
pub(crate) fn attempts_from_column(attempts: i64) -> u32 {
    u32::try_from(attempts.max(0)).unwrap_or(u32::MAX)
}

/// A stored count as a `u64` (a negative one, which `count(*)` never gives, as 0).
pub(crate) fn count_from_column(count: i64) -> u64 {
    u64::try_from(count).unwrap_or(0)
}

/// An event's state from its stored columns: `pending` is in flight while a lease holds it.
pub(crate) fn event_status(status: &str, leased: bool) -> Result<EventStatus, Error> {
    match (status, leased) {
        ("pending", false) => Ok(EventStatus::Pending),
        ("pending", true) => Ok(EventStatus::InFlight),
        ("delivered", _) => Ok(EventStatus::Delivered),
        ("dead", _) => Ok(EventStatus::Dead),
        (other, _) => Err(Error::Corrupt(format!("outbox status {other:?}"))),
    }
}

impl OutboxCounts {
    /// Adds `count` events in `status` (see [`event_status`]).
    pub(crate) fn add(&mut self, status: EventStatus, count: u64) {
        let slot = match status {
            EventStatus::Pending => &mut self.pending,
            EventStatus::InFlight => &mut self.in_flight,
            EventStatus::Delivered => &mut self.delivered,
            EventStatus::Dead => &mut self.dead,
        };
        *slot += count;
    }
}

/// An `outbox_events` row as read by either backend (in `EVENT_COLUMNS` order), before checks.
pub(crate) struct RawEvent {
    pub(crate) id: String,
    pub(crate) topic: String,
    pub(crate) payload: String,
    pub(crate) status: String,
    pub(crate) attempts: i64,
    pub(crate) created_at: i64,
    pub(crate) available_at: i64,
    pub(crate) delivered_at: Option<i64>,
    pub(crate) last_error: Option<String>,
    pub(crate) leased: bool,
}

/// The columns [`RawEvent`] is read from, in order (the PostgreSQL statements spell them out,
/// checked by a test of `pg_sql`).
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
pub(crate) const EVENT_COLUMNS: &str = "event_id, topic, payload, status, attempts, created_at, \
     available_at, delivered_at, last_error, lease_owner";

impl RawEvent {
    /// The event as shown, at `now` (Unix milliseconds: in flight while its lease runs).
    pub(crate) fn into_info(self, now: i64) -> Result<EventInfo, Error> {
        let status = event_status(&self.status, self.leased && self.available_at > now)?;
        Ok(EventInfo {
            id: EventId::from(self.id),
            topic: self.topic,
            payload: self.payload,
            status,
            attempts: attempts_from_column(self.attempts),
            created_at: from_unix_millis(self.created_at),
            available_at: from_unix_millis(self.available_at),
            delivered_at: self.delivered_at.map(from_unix_millis),
            last_error: self.last_error,
        })
    }
}

/// What a claim returns, from the rows its two updates returned as `(seq, event)`: RETURNING
/// gives no order, and events are delivered oldest first.
pub(crate) fn claimed_oldest_first(
    mut claimed: Vec<(i64, OutboxEvent)>,
    abandoned: Vec<(i64, OutboxEvent)>,
) -> Claimed {
    claimed.sort_by_key(|(seq, _)| *seq);
    Claimed {
        events: claimed.into_iter().map(|(_, event)| event).collect(),
        abandoned: abandoned.into_iter().map(|(_, event)| event).collect(),
    }
}
