//! Group commit: the requests queued for the writer share one SQLite transaction.
//!
//! Each request runs in its own savepoint inside the open [`Group`] (see
//! `Writer::open_request_savepoint`; the request that opens the group's transaction needs none),
//! keeps its rows there when it commits (`release_request`) or undoes only them
//! (`rollback_request`), and waits as a [`Member`] for the group's `COMMIT`
//! (`flush`), which the writer thread (`writer`) runs when the group is due. A failure that
//! ends the whole transaction tells each member how it ended (`tell_members`, `abort_group`):
//! the culprit gets its error, the others [`Error::GroupRolledBack`]. The layer runs each of
//! those again through [`IdempotencyStore::begin_and_run`](crate::store::IdempotencyStore),
//! which the store turns into a group of its own (`alone`): committed alone, so nothing another
//! request does can undo it a second time. A request that finds a committed record joins no
//! group at all (`on_commit`). The statements of transaction control come from `authorizer`; the checks
//! against other processes from `file`.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::file::{is_busy, MIN_BUSY_WAIT};
use super::records::check_existing;
use super::writer::Writer;
use crate::error::Error;
use crate::store::{Scope, StoredRecord};

/// Told when the group a request belongs to has committed, or why it did not.
type CommitWaiter = Box<dyn FnOnce(Result<(), Error>) + Send>;

/// A request waiting for its group's commit.
pub(super) struct Member {
    pub(super) scope: Scope,
    /// It saved its record in the group (rather than found one of the group's records).
    pub(super) saved: bool,
    pub(super) notify: CommitWaiter,
}

/// The SQLite transaction shared by a group of requests.
pub(super) struct Group {
    /// Requests whose records (or whose duplicates' records) are in the group.
    members: Vec<Member>,
    opened: Instant,
    /// Opened for a request that runs again after another member rolled its group back:
    /// it commits alone, so nothing another request does can undo it a second time.
    solo: bool,
}

impl Writer {
    /// Opens the group transaction if needed and the request's savepoint in it; `alone` in a
    /// group of its own (the open one commits first).
    ///
    /// The request that opens the transaction gets no savepoint: the transaction holds nothing
    /// but its own work until it ends (others join only after that), so rolling the whole
    /// transaction back undoes its rows and only them, and its commit has nothing to release.
    /// That spares a lone request two statements and SQLite's copy of every page it changes
    /// into the savepoint's journal. A request that joins an open group gets a savepoint, as
    /// the group holds other requests' rows.
    fn open_request_savepoint(
        &mut self,
        generation: u64,
        busy_wait: Duration,
        alone: bool,
    ) -> Result<(), Error> {
        if self.active.is_some() {
            self.rollback_request();
        }
        if self.group.as_ref().is_some_and(|group| alone || group.solo) {
            self.flush();
        }
        if self.group.is_none() || self.conn.is_autocommit() {
            self.abort_group("the group transaction ended unexpectedly");
            self.file.check_before_begin()?;
            self.give_way();
            self.set_busy_wait(busy_wait);
            let begun = self.control(|conn| {
                conn.prepare_cached(&self.sql.begin)
                    .and_then(|mut begin| begin.execute([]))
            });
            self.note_other_writers();
            if let Err(error) = begun {
                return Err(if is_busy(&error) {
                    Error::Busy
                } else {
                    error.into()
                });
            }
            self.group = Some(Group {
                members: Vec::new(),
                opened: Instant::now(),
                solo: alone,
            });
            self.savepoint = false;
        } else {
            // Cached: prepared once per connection rather than once per request.
            self.control(|conn| {
                conn.prepare_cached(&self.sql.savepoint)
                    .and_then(|mut savepoint| savepoint.execute([]))
            })?;
            self.savepoint = true;
        }
        self.active = Some(generation);
        self.request_started = Some(Instant::now());
        Ok(())
    }

    /// Opens the request's savepoint and checks for a live record: `Some` (with the savepoint
    /// rolled back already) if there is one. Refuses once `deadline` has passed. `alone`: in a
    /// group of its own (a request another member's failure rolled back once already).
    pub(super) fn reserve_scope(
        &mut self,
        generation: u64,
        deadline: Instant,
        scope: &Scope,
        now_millis: i64,
        alone: bool,
    ) -> Result<Option<StoredRecord>, Error> {
        // Other processes may hold SQLite's own write lock: wait for it as long as the lock
        // timeout allows, no longer.
        let busy_wait = deadline
            .checked_duration_since(Instant::now())
            .filter(|left| !left.is_zero())
            .ok_or(Error::Busy)?;
        self.reserve_with_busy_wait(
            generation,
            busy_wait.max(MIN_BUSY_WAIT),
            scope,
            now_millis,
            alone,
        )
    }

    /// [`reserve_scope`](Self::reserve_scope) for a request that runs in place (see
    /// `in_place`): never waits for another process's lock ([`Error::Busy`] at once, and the
    /// request queues for the writer thread instead).
    pub(super) fn reserve_scope_in_place(
        &mut self,
        generation: u64,
        scope: &Scope,
        now_millis: i64,
        alone: bool,
    ) -> Result<Option<StoredRecord>, Error> {
        if self.other_writers_seen() {
            return Err(Error::Busy);
        }
        self.reserve_with_busy_wait(generation, Duration::ZERO, scope, now_millis, alone)
    }

    fn reserve_with_busy_wait(
        &mut self,
        generation: u64,
        busy_wait: Duration,
        scope: &Scope,
        now_millis: i64,
        alone: bool,
    ) -> Result<Option<StoredRecord>, Error> {
        self.open_request_savepoint(generation, busy_wait, alone)?;
        match check_existing(&self.conn, scope, now_millis) {
            Ok(None) => Ok(None),
            Ok(Some(record)) => {
                self.rollback_request();
                Ok(Some(record))
            }
            Err(error) => {
                self.rollback_request();
                Err(error)
            }
        }
    }

    /// Folds the ending request's hold time into the moving average.
    fn end_request(&mut self) {
        self.active = None;
        if let Some(started) = self.request_started.take() {
            self.typical_hold = (self.typical_hold * 7 + started.elapsed()) / 8;
        }
    }

    /// Undoes the active request's rows, and only them: its savepoint, or, for the request
    /// that opened the transaction (no savepoint, nothing else in it), the transaction.
    pub(super) fn rollback_request(&mut self) {
        let was_active = self.active.is_some();
        self.end_request();
        if !was_active || self.conn.is_autocommit() {
            return;
        }
        if !self.savepoint {
            // No member can have joined while the request was active: the group ends empty.
            self.abort_group("the request that opened the group transaction rolled back");
            return;
        }
        let undone = self.control(|conn| conn.execute_batch(&self.sql.rollback_request));
        if let Err(error) = undone {
            tracing::error!(%error, "rolling back a request's savepoint failed");
            self.abort_group("rolling back a request's savepoint failed");
        }
    }

    /// Keeps the active request's rows in the group (to commit with it).
    pub(super) fn release_request(&mut self) -> Result<(), Error> {
        if self.savepoint {
            self.control(|conn| {
                conn.prepare_cached(&self.sql.release)
                    .and_then(|mut release| release.execute([]))
            })?;
        }
        self.end_request();
        Ok(())
    }

    /// Tells `member` when the open group commits (at once if there is none). A request that
    /// found a record (`saved: false`) waits only if a member of the open group saved that
    /// record: otherwise the record is committed already, and the open group's fate is not
    /// its own.
    pub(super) fn on_commit(&mut self, member: Member) {
        match &mut self.group {
            Some(group)
                if member.saved
                    || group
                        .members
                        .iter()
                        .any(|other| other.saved && other.scope == member.scope) =>
            {
                group.members.push(member);
            }
            _ => (member.notify)(Ok(())),
        }
    }

    /// Tells a group's members how it ended.
    ///
    /// When it failed, a member whose failure it was (the group's only saved record, or a
    /// request that ran alone) gets the error; every other member gets
    /// [`Error::GroupRolledBack`]: the layer runs it again at once, alone, and the client
    /// never sees the difference.
    fn tell_members(&mut self, group: Group, outcome: Result<(), Error>) {
        let error = match outcome {
            Ok(()) => {
                for member in group.members {
                    (member.notify)(Ok(()));
                }
                return;
            }
            Err(error) => error,
        };
        let saved = group.members.iter().filter(|member| member.saved).count();
        let its_own = group.solo || saved <= 1;
        let reason = error.to_string();
        let mut error = Some(error);
        for member in group.members {
            if its_own && member.saved {
                let error = error
                    .take()
                    .unwrap_or_else(|| Error::CommitFailed(reason.clone()));
                (member.notify)(Err(error));
            } else {
                (member.notify)(Err(Error::GroupRolledBack(reason.clone())));
            }
        }
    }
    /// Commits the open group and tells its requests. Only between requests.
    pub(super) fn flush(&mut self) {
        debug_assert!(self.active.is_none());
        let Some(group) = self.group.take() else {
            return;
        };
        let requests = group.members.len();
        let outcome = if self.conn.is_autocommit() {
            Err(Error::TransactionAborted(
                "the group transaction ended unexpectedly",
            ))
        } else if let Err(error) = self.file.check() {
            tracing::error!(%error, requests, "group not committed");
            self.roll_back_all();
            Err(error)
        } else {
            let committed = self.control(|conn| {
                conn.prepare_cached(&self.sql.commit)
                    .and_then(|mut commit| commit.execute([]))
            });
            committed.map(drop).map_err(|error| {
                // A deferred foreign key (or constraint trigger) a member left violated
                // fails here, with the transaction still open; a full disk or an I/O error
                // may have ended it already.
                tracing::warn!(%error, requests, "group commit failed");
                self.roll_back_all();
                Error::from(error)
            })
        };
        if outcome.is_ok() {
            self.other_writers.committed = Some(Instant::now());
        }
        self.tell_members(group, outcome);
    }

    /// Rolls back whatever transaction is open on the connection.
    fn roll_back_all(&mut self) {
        if !self.conn.is_autocommit() {
            if let Err(error) = self.control(|conn| conn.execute_batch("ROLLBACK")) {
                tracing::error!(%error, "rollback failed");
            }
        }
    }

    /// Throws the open group away: the active request (if any) ended it, so every member
    /// waiting for its commit runs again alone.
    fn abort_group(&mut self, reason: &'static str) {
        self.end_request();
        self.roll_back_all();
        if let Some(group) = self.group.take() {
            if !group.members.is_empty() {
                tracing::info!(
                    reason,
                    requests = group.members.len(),
                    "group rolled back; its requests run again"
                );
            }
            for member in group.members {
                (member.notify)(Err(Error::GroupRolledBack(reason.to_owned())));
            }
        }
    }

    /// Commits the group if it is due; run after every job.
    pub(super) fn after_job(&mut self) {
        if self.group.is_some() && self.conn.is_autocommit() {
            // A statement ended the transaction (or SQLite rolled it back on a full disk):
            // the group's work is gone, and its requests must not report success.
            self.abort_group("the group transaction ended unexpectedly");
            return;
        }
        if self.active.is_none() && self.group.as_ref().is_some_and(|g| self.is_due(g)) {
            self.flush();
        }
    }

    /// Whether the group should commit now rather than wait for the next queued request.
    fn is_due(&self, group: &Group) -> bool {
        // The members already in the group wait for the next request's handler too: only
        // worth it while that is expected to fit in the group delay.
        group.solo
            || self.queued.load(Ordering::Acquire) == 0
            || group.members.len() >= self.limits.max_requests
            || group.opened.elapsed() + self.typical_hold >= self.limits.max_delay
    }

    /// How long the thread may wait for the next job before the open group must commit.
    pub(super) fn flush_deadline(&self) -> Option<Duration> {
        match (&self.group, self.active) {
            (Some(group), None) => {
                Some(self.limits.max_delay.saturating_sub(group.opened.elapsed()))
            }
            _ => None,
        }
    }

    /// Ends whatever is open before a standalone statement or transaction.
    pub(super) fn settle(&mut self) {
        self.rollback_request();
        self.flush();
    }
}
