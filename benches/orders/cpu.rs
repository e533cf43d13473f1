//! CPU time of the server alone, on Linux.
//!
//! The load generator runs in this process, on a tokio runtime of its own whose threads are
//! named [`CLIENT_THREAD`]. The server's CPU time is the process's (every thread, including
//! threads that have exited, such as idle blocking-pool threads) minus what the client's
//! threads used, read from `/proc/self/task/<tid>/stat`. The client's threads live as long
//! as the process, so none of their time is lost when a thread ends. With PostgreSQL, the
//! backends serving this process's connections (found by their `application_name`) are read
//! from `/proc/<pid>/stat` as well: the database's share of the work, reported apart.

use std::time::Duration;

/// The name of the load generator's threads.
pub(crate) const CLIENT_THREAD: &str = "bench-client";

/// CPU time used so far.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CpuSample {
    /// This process, every thread.
    pub(crate) process: Duration,
    /// The load generator's threads.
    pub(crate) client: Duration,
    /// The PostgreSQL backends of this process's connections (zero without PostgreSQL).
    pub(crate) database: Duration,
}

/// CPU time used between two samples, split by who used it.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CpuUsed {
    pub(crate) server: Duration,
    pub(crate) client: Duration,
    pub(crate) database: Duration,
}

impl CpuUsed {
    pub(crate) fn add(&mut self, other: CpuUsed) {
        self.server += other.server;
        self.client += other.client;
        self.database += other.database;
    }
}

impl CpuSample {
    /// Reads this process's and its client threads' CPU time, plus that of the `backends`
    /// (process ids). `None` where `/proc` cannot be read.
    pub(crate) fn now(backends: &[i32]) -> Option<CpuSample> {
        let process = stat_cpu(&std::fs::read_to_string("/proc/self/stat").ok()?)?;
        let mut client = Duration::ZERO;
        for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
            let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
                continue; // the thread ended meanwhile
            };
            if stat_name(&stat).is_some_and(|name| name.starts_with(CLIENT_THREAD)) {
                client += stat_cpu(&stat).unwrap_or_default();
            }
        }
        let database = backends
            .iter()
            .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
            .filter_map(|stat| stat_cpu(&stat))
            .sum();
        Some(CpuSample {
            process,
            client,
            database,
        })
    }

    /// What was used from `self` to `later`.
    pub(crate) fn until(&self, later: &CpuSample) -> CpuUsed {
        let client = later.client.saturating_sub(self.client);
        CpuUsed {
            server: later
                .process
                .saturating_sub(self.process)
                .saturating_sub(client),
            client,
            database: later.database.saturating_sub(self.database),
        }
    }
}

/// The command name (field 2) of a `stat` line.
fn stat_name(stat: &str) -> Option<&str> {
    stat.get(stat.find('(')? + 1..stat.rfind(')')?)
}

/// User plus system time of a `stat` line.
pub(crate) fn stat_cpu(stat: &str) -> Option<Duration> {
    // The command name may hold spaces: count fields after its closing parenthesis.
    let fields: Vec<&str> = stat.get(stat.rfind(')')? + 2..)?.split(' ').collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // The kernel reports in clock ticks of USER_HZ, 100 per second on Linux.
    Some(Duration::from_millis(ticks * 10))
}
