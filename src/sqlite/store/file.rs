//! The database file, and the other processes that write to it.
//!
//! [`DatabaseFile`] notices when the path stops naming the file the store opened (the writer
//! then refuses to begin or commit). [`BusyWait`] is the writer connection's busy handler:
//! it waits for another process's write lock in short steps, up to the budget the writer
//! sets (`Writer::set_busy_wait`: a request's lock timeout, or [`STANDALONE_BUSY_TIMEOUT`]).
//! [`OtherWriters`] remembers signs of another process writing, so that the writer gives way
//! after its commits (`Writer::give_way`) instead of starving it. `group` calls these around
//! each `BEGIN IMMEDIATE` and `COMMIT`.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::writer::Writer;
use crate::error::Error;

/// How long standalone writes (`write`, purges) wait for another process's write lock.
pub(super) const STANDALONE_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// The shortest wait for another process's lock a request's begin gets, however little of its
/// lock timeout is left.
pub(super) const MIN_BUSY_WAIT: Duration = Duration::from_millis(1);

/// How often the writer tries again while another process holds SQLite's write lock.
/// SQLite's own busy handler backs off to 100 ms between tries, while a process with a steady
/// queue frees the lock only for moments between its groups: a waiter that slow starves.
const BUSY_POLL: Duration = Duration::from_millis(1);

/// While another process writes to the same file, how long the writer leaves the lock free
/// after a commit before it takes it again (longer than [`BUSY_POLL`], so the other's next
/// try finds it free): the two take turns instead of one starving the other.
const GIVE_WAY: Duration = Duration::from_millis(2);

/// How long after the last sign of another writing process the writer keeps giving way.
const OTHER_WRITER_WINDOW: Duration = Duration::from_secs(1);

/// The writer connection's busy handler: `busy_timeout`'s semantics (one statement waits at
/// most `budget`), but trying every [`BUSY_POLL`], and noting that it had to wait.
pub(super) struct BusyWait {
    budget: Duration,
    /// When the current wait began.
    started: Option<Instant>,
    /// Whether a statement waited for another process's lock since the writer last looked.
    waited: bool,
}

impl BusyWait {
    /// A handler that lets one statement wait at most `budget`.
    pub(super) fn new(budget: Duration) -> Self {
        BusyWait {
            budget,
            started: None,
            waited: false,
        }
    }

    /// Called by SQLite while a lock is held elsewhere; `attempt` counts from 0 per wait.
    pub(super) fn on_busy(state: &Mutex<BusyWait>, attempt: i32) -> bool {
        let Ok(mut state) = state.lock() else {
            return false;
        };
        let now = Instant::now();
        if attempt == 0 {
            state.started = Some(now);
        }
        state.waited = true;
        let waited = state
            .started
            .map_or(Duration::ZERO, |started| now - started);
        if waited >= state.budget {
            return false;
        }
        let nap = BUSY_POLL.min(state.budget - waited);
        drop(state);
        std::thread::sleep(nap);
        true
    }
}

/// Signs that another process writes to the same database file.
#[derive(Default)]
pub(super) struct OtherWriters {
    /// `PRAGMA data_version` when last read: it changes when another connection commits.
    data_version: Option<i64>,
    /// When another process was last seen writing (its commit, or its lock in the way).
    seen: Option<Instant>,
    /// When this writer last committed.
    pub(super) committed: Option<Instant>,
}

impl Writer {
    /// How long each following statement may wait for another process's lock.
    pub(super) fn set_busy_wait(&self, wait: Duration) {
        if let Ok(mut busy) = self.busy.lock() {
            busy.budget = wait;
        }
    }

    /// Before taking SQLite's write lock: while another process writes too, leaves the lock
    /// free for [`GIVE_WAY`] after this writer's last commit, so that the other one gets its
    /// turn (a writer with a steady queue would otherwise take the lock again at once).
    pub(super) fn give_way(&self) {
        if let Some(wait) = self.give_way_for() {
            std::thread::sleep(wait);
        }
    }

    /// How long [`give_way`](Self::give_way) would sleep now, if at all.
    pub(super) fn give_way_for(&self) -> Option<Duration> {
        let others = &self.other_writers;
        if others
            .seen
            .is_none_or(|seen| seen.elapsed() >= OTHER_WRITER_WINDOW)
        {
            return None;
        }
        let since = others.committed.map(|committed| committed.elapsed())?;
        GIVE_WAY.checked_sub(since).filter(|wait| !wait.is_zero())
    }

    /// Whether another process was seen writing to the file lately: a request then does not
    /// run in place, since its begin may have to wait (or give way) for that process.
    pub(super) fn other_writers_seen(&self) -> bool {
        self.other_writers
            .seen
            .is_some_and(|seen| seen.elapsed() < OTHER_WRITER_WINDOW)
    }

    /// After `BEGIN IMMEDIATE`: notes whether another process held the lock, or committed
    /// since this writer last looked.
    pub(super) fn note_other_writers(&mut self) {
        let waited = self
            .busy
            .lock()
            .map(|mut busy| std::mem::take(&mut busy.waited))
            .unwrap_or(false);
        let version = self
            .conn
            .prepare_cached("PRAGMA data_version")
            .and_then(|mut pragma| pragma.query_row([], |row| row.get::<_, i64>(0)))
            .ok();
        let others = &mut self.other_writers;
        let committed_elsewhere = others.data_version.is_some() && others.data_version != version;
        if waited || committed_elsewhere {
            others.seen = Some(Instant::now());
        }
        others.data_version = version;
    }
}
/// The file the store opened, to notice when its path stops naming it.
///
/// SQLite keeps writing to a database file that was deleted (or renamed over) while open, and
/// its commits succeed: every answer from then on would promise what no restart will ever read
/// again. So the writer refuses to commit while the path names another file, or none
/// ([`check`](Self::check), before every `COMMIT`), and refuses to begin as well
/// ([`check_before_begin`](Self::check_before_begin)), so that no handler runs for a commit
/// bound to fail; that early refusal is skipped within [`BEGIN_CHECK_SPARED`] of a check that
/// passed.
pub(super) struct DatabaseFile {
    /// The absolute path (so a later change of the working directory does not matter).
    path: PathBuf,
    /// `None` where the file cannot be identified (`:memory:`, URIs, non-Unix systems): not
    /// checked.
    identity: Option<(u64, u64)>,
    /// When the path last named the file.
    confirmed: Option<Instant>,
}

/// How long after a check that passed a `BEGIN` goes without one of its own.
///
/// The check before `COMMIT` is what keeps a deleted file from being answered for; the one
/// before `BEGIN` only spares the work of a transaction that could not commit. A request that
/// runs alone begins right after the previous one committed: checking again then would cost
/// each request a second look-up of the path (a `stat`, several microseconds) and tell nothing
/// new. A file deleted in that moment is refused at the commit, as one deleted while a
/// transaction is open always is.
const BEGIN_CHECK_SPARED: Duration = Duration::from_millis(100);

impl DatabaseFile {
    pub(super) fn opened(path: &Path) -> Self {
        let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        let identity = Self::identity_of(&path);
        DatabaseFile {
            path,
            identity,
            confirmed: None,
        }
    }

    /// Device and inode.
    #[cfg(unix)]
    fn identity_of(path: &Path) -> Option<(u64, u64)> {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(path)
            .ok()
            .map(|metadata| (metadata.dev(), metadata.ino()))
    }

    #[cfg(not(unix))]
    fn identity_of(_path: &Path) -> Option<(u64, u64)> {
        None
    }

    /// Before `BEGIN`: [`check`](Self::check), unless one passed within
    /// [`BEGIN_CHECK_SPARED`].
    pub(super) fn check_before_begin(&mut self) -> Result<(), Error> {
        match self.confirmed {
            Some(at) if at.elapsed() < BEGIN_CHECK_SPARED => Ok(()),
            _ => self.check(),
        }
    }

    /// Whether the path still names the file the store opened: an error if it names another
    /// file, or none.
    pub(super) fn check(&mut self) -> Result<(), Error> {
        match self.identity {
            Some(opened) if Self::identity_of(&self.path) != Some(opened) => {
                self.confirmed = None;
                Err(Error::Io(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!(
                        "the database file {} was deleted or replaced while open: \
                         refusing to write to it",
                        self.path.display()
                    ),
                )))
            }
            _ => {
                self.confirmed = Some(Instant::now());
                Ok(())
            }
        }
    }
}

/// Whether `error` is another connection's lock in the way.
pub(super) fn is_busy(error: &rusqlite::Error) -> bool {
    matches!(
        error.sqlite_error_code(),
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
    )
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    /// A file in a temporary folder (kept while the folder is), opened as the store opens its
    /// database, and checked once.
    fn checked_file() -> (tempfile::TempDir, PathBuf, DatabaseFile) {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("store.db");
        std::fs::write(&path, b"").expect("create the file");
        let mut file = DatabaseFile::opened(&path);
        assert!(file.check_before_begin().is_ok(), "never checked: checks");
        assert!(file.check().is_ok());
        (dir, path, file)
    }

    #[test]
    fn just_after_a_pass_a_begin_goes_unchecked_and_the_commit_refuses() {
        let (_dir, path, mut file) = checked_file();
        std::fs::remove_file(&path).expect("delete the file");
        // Just after a check that passed, the begin goes without one: the commit refuses.
        assert!(file.check_before_begin().is_ok());
        assert!(file.check().is_err());
        // A failed check is no pass: the next begin looks again.
        assert!(file.check_before_begin().is_err());
    }

    #[test]
    fn a_begin_long_after_the_last_pass_checks_again() {
        let (_dir, path, mut file) = checked_file();
        // Another file renamed over it (made while the first exists: another inode).
        let other = path.with_extension("other");
        std::fs::write(&other, b"").expect("another file");
        std::fs::rename(&other, &path).expect("rename it over the first");
        file.confirmed = Instant::now().checked_sub(BEGIN_CHECK_SPARED);
        assert!(file.check_before_begin().is_err());
    }
}
