//! The outbox's and the inbox's statements that every SQL server of the crate runs as
//! written (PostgreSQL on both drivers, MySQL and MariaDB; SQLite through its driver's `sqlite_text`), re-exported by each server's SQL
//! module (`postgres/outbox_sql.rs`, `mysql/outbox_sql.rs`) next to its own. Parameters are numbered `$n`, as
//! PostgreSQL takes them; the MySQL driver sends each as a `?` bound to the n-th value.

/// Adds a pending event, due at once: `(event_id, topic, payload, now)`.
pub(crate) const INSERT_EVENT: &str = "INSERT INTO outbox_events (event_id, topic, payload, \
     status, \
     attempts, available_at, created_at) VALUES ($1, $2, $3, 'pending', 0, $4, $4)";

/// Whether any event is due: an idle relay's poll, a plain read that locks nothing.
pub(crate) const SELECT_DUE: &str = "SELECT EXISTS (SELECT 1 FROM outbox_events \
     WHERE status = 'pending' AND available_at <= $1)";

/// Marks an event delivered, whoever holds the claim now: the sink accepted it, and that stays
/// true.
pub(crate) const SETTLE_DELIVERED: &str = "UPDATE outbox_events SET status = 'delivered', \
     delivered_at = $2, \
     lease_owner = NULL, last_error = NULL \
     WHERE event_id = $1 AND status = 'pending'";

/// Schedules a failed event again, only under the claim `$2`: if it ran out and another relay
/// claimed the event, that relay decides what happens next.
pub(crate) const SETTLE_RETRY: &str = "UPDATE outbox_events SET available_at = $3, lease_owner \
     = NULL, \
     last_error = $4 \
     WHERE event_id = $1 AND lease_owner = $2 AND status = 'pending'";

/// Dead-letters an event, only under the claim `$2`.
pub(crate) const SETTLE_DEAD: &str = "UPDATE outbox_events SET status = 'dead', lease_owner = \
     NULL, \
     last_error = $3 \
     WHERE event_id = $1 AND lease_owner = $2 AND status = 'pending'";

/// `(pending, dead)` counts, for the backlog gauges.
pub(crate) const BACKLOG: &str = "SELECT (SELECT count(*) FROM outbox_events WHERE status = \
     'pending'), \
     (SELECT count(*) FROM outbox_events WHERE status = 'dead')";

/// Moves the dead event `$1` back to pending, due at `$2`, attempts reset.
pub(crate) const REQUEUE: &str = "UPDATE outbox_events SET status = 'pending', attempts = 0, \
     available_at = $2, lease_owner = NULL \
     WHERE event_id = $1 AND status = 'dead'";

/// [`REQUEUE`] for every dead event.
pub(crate) const REQUEUE_ALL_DEAD: &str = "UPDATE outbox_events SET status = 'pending', \
     attempts = 0, \
     available_at = $1, lease_owner = NULL WHERE status = 'dead'";

/// Whether `$1` has processed the event `$2` (committed).
pub(crate) const INBOX_CONTAINS: &str = "SELECT EXISTS (SELECT 1 FROM inbox_events \
     WHERE consumer = $1 AND event_id = $2)";

/// One event by id, in [`EVENT_COLUMNS`](crate::outbox::columns::EVENT_COLUMNS) order.
pub(crate) const SELECT_EVENT: &str = "SELECT event_id, topic, payload, status, attempts, \
     created_at, available_at, delivered_at, last_error, lease_owner \
     FROM outbox_events WHERE event_id = $1";

/// Dead-lettered events, oldest first, at most `$1`, in `EVENT_COLUMNS` order.
pub(crate) const DEAD_LETTERS: &str = "SELECT event_id, topic, payload, status, attempts, \
     created_at, available_at, delivered_at, last_error, lease_owner \
     FROM outbox_events WHERE status = 'dead' ORDER BY seq LIMIT $1";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::columns::EVENT_COLUMNS;

    #[test]
    fn event_reads_select_the_columns_raw_event_expects() {
        for sql in [SELECT_EVENT, DEAD_LETTERS] {
            assert!(
                sql.contains(&format!("SELECT {EVENT_COLUMNS} FROM")),
                "{sql}"
            );
        }
    }
}
