//! Reading `outbox_events` rows back, the same on every backend: the backends' SQL selects
//! the columns, these turn them into events, states and counts.

use super::{Claimed, EventId, EventInfo, EventStatus, OutboxCounts, OutboxEvent};
use crate::error::Error;
use crate::row::Columns;
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

/// The columns [`RawEvent::read`] reads, in order (the PostgreSQL statements spell them out,
/// checked by a test of `row_lock/outbox_sql.rs`).
#[cfg(feature = "sqlite")]
pub(crate) const EVENT_COLUMNS: &str = "event_id, topic, payload, status, attempts, created_at, \
     available_at, delivered_at, last_error, lease_owner";

impl RawEvent {
    /// An `outbox_events` row, in [`EVENT_COLUMNS`] order.
    pub(crate) fn read<R: Columns + ?Sized>(row: &R) -> Result<RawEvent, R::Error> {
        Ok(RawEvent {
            id: row.required_text(0, "event_id")?,
            topic: row.required_text(1, "topic")?,
            payload: row.required_text(2, "payload")?,
            status: row.required_text(3, "status")?,
            attempts: row.required_int(4, "attempts")?,
            created_at: row.required_big_int(5, "created_at")?,
            available_at: row.required_big_int(6, "available_at")?,
            delivered_at: row.big_int(7)?,
            last_error: row.text(8)?,
            leased: row.text(9)?.is_some(),
        })
    }

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

/// A row returned by a claim (`RETURNING seq, event_id, topic, payload, attempts,
/// created_at`): `(seq, event)`.
pub(crate) fn claimed_row<R: Columns + ?Sized>(row: &R) -> Result<(i64, OutboxEvent), R::Error> {
    Ok((
        row.required_big_int(0, "seq")?,
        OutboxEvent::new(
            EventId::from(row.required_text(1, "event_id")?),
            row.required_text(2, "topic")?,
            row.required_text(3, "payload")?,
            attempts_from_column(row.required_int(4, "attempts")?),
            from_unix_millis(row.required_big_int(5, "created_at")?),
        ),
    ))
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
