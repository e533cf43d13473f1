//! How a [`SqliteStore`] is opened: [`SqliteOptions`] (from [`SqliteStore::builder`]), the
//! durability of commits ([`Synchronous`]) and the limits of group commit ([`GroupLimits`],
//! which the writer reads, see `group`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::SqliteStore;
use crate::error::Error;

/// How hard SQLite works to make a commit durable (`PRAGMA synchronous`, in WAL mode).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Synchronous {
    /// `FULL`: every commit is on disk before it returns, so a client that received a `201`
    /// gets it back after a power cut. The default.
    #[default]
    Full,
    /// `NORMAL`: commits survive a crash of the process but the last ones may be lost on
    /// power loss or an OS crash. Several times faster.
    Normal,
}

impl Synchronous {
    /// The value of `PRAGMA synchronous`.
    pub(super) fn pragma(self) -> &'static str {
        match self {
            Synchronous::Full => "FULL",
            Synchronous::Normal => "NORMAL",
        }
    }
}

/// Options for opening a [`SqliteStore`]; see [`SqliteStore::builder`].
#[derive(Clone, Debug)]
pub struct SqliteOptions {
    pub(super) path: PathBuf,
    pub(super) synchronous: Synchronous,
    pub(super) max_idle_readers: usize,
    pub(super) read_in_place: bool,
    pub(super) write_in_place: bool,
    pub(super) inline_limit: Duration,
    pub(super) group: GroupLimits,
}

/// [`SqliteOptions::with_inline_limit`]'s default (why this value: see there).
const DEFAULT_INLINE_LIMIT: Duration = Duration::from_millis(1);

/// When an open group of requests is committed.
#[derive(Clone, Copy, Debug)]
pub(super) struct GroupLimits {
    pub(super) max_requests: usize,
    pub(super) max_delay: Duration,
}

impl SqliteOptions {
    /// The defaults for the database at `path` (what [`SqliteStore::builder`] returns).
    pub(super) fn new(path: &Path) -> Self {
        SqliteOptions {
            path: path.to_path_buf(),
            synchronous: Synchronous::default(),
            max_idle_readers: 8,
            read_in_place: true,
            write_in_place: true,
            inline_limit: DEFAULT_INLINE_LIMIT,
            group: GroupLimits {
                max_requests: 64,
                max_delay: Duration::from_millis(5),
            },
        }
    }

    /// The durability of commits. Default: [`Synchronous::Full`].
    pub fn with_synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// How many idle reader connections to keep for the replay fast path. Default: 8.
    pub fn with_max_idle_readers(mut self, readers: usize) -> Self {
        self.max_idle_readers = readers;
        self
    }

    /// Whether a record lookup (the replay fast path) may run on the request's own thread.
    /// Default: `true`.
    ///
    /// It does only when it cannot wait: an idle reader connection is at hand and SQLite
    /// answers without a busy wait. A point read of a page in the cache takes microseconds,
    /// less than the two thread hand-overs of a read on a blocking thread; a page that is not
    /// cached is read from disk on that thread. With `false`, every lookup runs under
    /// `spawn_blocking`.
    pub fn with_read_in_place(mut self, in_place: bool) -> Self {
        self.read_in_place = in_place;
        self
    }

    /// Whether a request may run its whole write transaction in place, on its own task,
    /// when the writer is idle. Default: `true`.
    ///
    /// It does only when that cannot wait: the writer thread has nothing open and nothing
    /// queued, and SQLite's write lock is free (no busy wait; no other process seen writing
    /// to the file lately). The request then begins, runs the handler (whose
    /// [`SqliteHandle::run`](super::SqliteHandle::run) statements run inline, as in a
    /// hand-written handler) and commits on its own task, saving the two hand-overs to the
    /// writer thread and back: a lone request's latency and CPU time. Its statements and
    /// its commit (with `synchronous=FULL`, an fsync) then run on the runtime worker
    /// thread: under `tokio::task::block_in_place`, so that the worker's other tasks (new
    /// connections, a duplicate's `409`) go on on another thread however long a statement
    /// takes, or inline where they have been fast lately
    /// ([`with_inline_limit`](Self::with_inline_limit)). Only on a multi-thread runtime: on
    /// a current-thread runtime every request's transaction runs on the writer thread,
    /// which keeps the runtime's one thread free. Requests that arrive meanwhile queue for
    /// the writer thread and join a group commit, as always. With `false`, every request's
    /// transaction runs on the writer thread.
    ///
    /// While retries are rare among recent requests (fewer than one in eight had a record), a
    /// request that finds the writer idle also skips the record lookup before its
    /// transaction: the reservation finds a completed record itself, and the request is
    /// answered with it without a commit. Should the reservation fail (the file cannot take
    /// writes), the lookup is made after all, so a completed key still replays.
    pub fn with_write_in_place(mut self, in_place: bool) -> Self {
        self.write_in_place = in_place;
        self
    }

    /// How fast a call site of a request running in place must have been lately for its
    /// next call to block the worker thread inline. Default: 1 ms. `Duration::ZERO`: every
    /// call runs under `tokio::task::block_in_place`.
    ///
    /// A request that runs in place ([`with_write_in_place`](Self::with_write_in_place))
    /// runs its handler's [`SqliteHandle::run`](super::SqliteHandle::run) statements and
    /// its commit on the runtime worker thread. `block_in_place` first hands the worker's
    /// other tasks (new connections, a duplicate's `409`) to another thread, so that they
    /// go on however long the call takes; that hand-over, once per call, is most of the CPU
    /// time the store adds to a lone request. So the store learns, per call site, which
    /// calls are short enough to make the hand-over not worth it: a site is the type of the
    /// closure passed to `SqliteHandle::run` (one place in the handler's code; every call
    /// made through one helper's closure, or through one `fn` pointer type, is one site),
    /// and the commit and the rollback are sites of their own. Every call is timed. A site
    /// runs inline once it has run before and its recent duration (the larger of its last
    /// call and a moving average) is under `limit`; a site never seen, or one whose last
    /// call or recent average reached `limit`, runs under `block_in_place`, and runs inline
    /// again only after a run of fast calls.
    ///
    /// The trade-off: a site that has been fast and turns slow (a query that meets a large
    /// table, a page read from a slow disk, a commit's fsync that stalls) blocks its worker
    /// once, for that one call, and the tasks queued on that worker wait for it; its next
    /// call is handed off. A handler whose statements at one site take unpredictable time
    /// (a user's ad hoc query, say) is safest with a separate closure for the slow case, or
    /// with `Duration::ZERO` here.
    ///
    /// Why 1 ms rather than tokio's rule of thumb of 100 µs between awaits: a point insert
    /// from a cached page takes tens of microseconds, but the commit, the one call every
    /// new key makes, waits for an fsync with `synchronous=FULL`: from under 0.1 ms on an
    /// idle machine's fast disk to a few tenths of a millisecond (with spikes of
    /// milliseconds) on a busy virtual machine's, so at 100 µs it would be handed off on
    /// many of them, or go back and forth at the limit, keeping half the hand-overs' cost
    /// of a request with one statement. Under 1 ms a commit runs inline, as a hand-written
    /// handler's would; a disk whose fsyncs take milliseconds keeps its commits under
    /// `block_in_place`. Requests run in place only while the writer is idle (a light
    /// load), when a worker blocked for less than a millisecond holds up few tasks.
    pub fn with_inline_limit(mut self, limit: Duration) -> Self {
        self.inline_limit = limit;
        self
    }

    /// Group commit: at most `max_requests` requests share one commit, and a group is never
    /// held open longer than `max_delay` waiting for more. A group also commits as soon as no
    /// request is waiting for the writer. Default: 64 requests, 5 ms. `max_requests = 1` turns
    /// grouping off (one commit per request).
    pub fn with_group_commit(mut self, max_requests: usize, max_delay: Duration) -> Self {
        self.group = GroupLimits {
            max_requests: max_requests.max(1),
            max_delay,
        };
        self
    }

    /// Opens (creating if needed) the database, switches it to WAL, creates the schema and
    /// starts the writer thread.
    pub async fn build(self) -> Result<SqliteStore, Error> {
        let options = self;
        tokio::task::spawn_blocking(move || SqliteStore::open_blocking(options))
            .await
            .map_err(|_| Error::Panicked)?
    }
}
