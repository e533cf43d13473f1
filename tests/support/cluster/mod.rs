//! A PostgreSQL primary with a streaming standby, built on this machine for the failover
//! tests from the server programs already installed (`initdb`, `pg_basebackup`, `pg_ctl`):
//! temporary directories, free ports on 127.0.0.1, run as the `postgres` user when the tests
//! run as root (PostgreSQL refuses to run as root). Dropping a [`Cluster`] stops both servers
//! (immediate shutdown) and removes their directories, on a panic too.
//!
//! The tests that use it are registered with `pg_cluster` (`test! { name, pg_cluster }`): the test
//! harness looks for the programs when the test binary starts ([`Cluster::bindir`]), so a
//! machine without them reports the tests as ignored, with the reason.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::Command;
use tower_idempotency::store::tokio_postgres::tokio_postgres::{self, NoTls};

/// The reason shown for the cluster tests where the programs are missing.
pub const MISSING: &str =
    "needs the PostgreSQL server programs (initdb, pg_ctl, pg_basebackup): install them or set PG_BINDIR";

/// How long starting, promoting or catching up may take: reached only when a test fails.
const PATIENCE: Duration = Duration::from_secs(60);

/// `synchronous_commit` on the primary, and whether the standby is synchronous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replication {
    /// A synchronous standby (`synchronous_standby_names = '*'`), `synchronous_commit = on`: a
    /// commit returns once the standby has flushed its WAL.
    Sync,
    /// The same with `synchronous_commit = remote_apply`: once the standby has applied it (a
    /// read on the standby then sees it).
    RemoteApply,
    /// An asynchronous standby, `synchronous_commit = off`: a commit returns before its WAL is
    /// even flushed locally, and the standby follows when it can.
    Async,
}

impl Replication {
    fn settings(self) -> &'static str {
        match self {
            Replication::Sync => "synchronous_standby_names = '*'\nsynchronous_commit = on\n",
            Replication::RemoteApply => {
                "synchronous_standby_names = '*'\nsynchronous_commit = remote_apply\n"
            }
            Replication::Async => "synchronous_standby_names = ''\nsynchronous_commit = off\n",
        }
    }
}

/// A primary and a streaming standby, stopped and removed when dropped.
pub struct Cluster {
    bindir: PathBuf,
    /// Holds `primary/`, `standby/` and their logs; removed last.
    dir: tempfile::TempDir,
    pub primary_port: u16,
    pub standby_port: u16,
    /// Root runs the servers as `postgres`.
    as_postgres: bool,
    primary_running: bool,
    standby_running: bool,
}

impl Cluster {
    /// The directory of the server programs (`initdb`, `pg_ctl`, `pg_basebackup`,
    /// `postgres`): `PG_BINDIR`, else the newest `/usr/lib/postgresql/<version>/bin` (the
    /// layout of Debian and Ubuntu packages); `None` if it lacks one of them.
    pub fn bindir() -> Option<PathBuf> {
        let complete = |dir: &Path| {
            ["initdb", "pg_ctl", "pg_basebackup", "postgres"]
                .iter()
                .all(|program| dir.join(program).is_file())
        };
        if let Some(dir) = std::env::var_os("PG_BINDIR") {
            return Some(PathBuf::from(dir)).filter(|dir| complete(dir));
        }
        let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
            .ok()?
            .filter_map(|entry| {
                let entry = entry.ok()?;
                let version = entry.file_name().to_str()?.parse().ok()?;
                Some((version, entry.path().join("bin")))
            })
            .filter(|(_, dir)| complete(dir))
            .collect();
        versions.sort();
        versions.pop().map(|(_, dir)| dir)
    }

    /// Builds and starts a primary and a standby streaming from it, and waits until the
    /// standby streams (and, for a synchronous one, is the synchronous standby).
    pub async fn start(replication: Replication) -> Cluster {
        let bindir = Self::bindir().unwrap_or_else(|| panic!("{MISSING}"));
        let as_postgres = is_root();
        let dir = tempfile::Builder::new()
            .prefix("tidem-cluster-")
            .tempdir()
            .expect("a temporary directory");
        if as_postgres {
            run_checked(
                std::process::Command::new("chown")
                    .args(["postgres:", dir.path().to_str().expect("UTF-8 temp path")]),
            );
        }
        let (primary_port, standby_port) = free_ports();
        let mut cluster = Cluster {
            bindir,
            dir,
            primary_port,
            standby_port,
            as_postgres,
            primary_running: false,
            standby_running: false,
        };
        let primary = cluster.primary_dir();
        cluster
            .run(
                "initdb",
                &[
                    "-D",
                    path(&primary),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "--no-sync",
                    "--encoding=UTF8",
                    "--locale=C",
                ],
            )
            .await;
        let socket_dir = cluster.dir.path().to_str().expect("UTF-8").to_owned();
        append(
            &primary.join("postgresql.conf"),
            &format!(
                "listen_addresses = '127.0.0.1'\nport = {primary_port}\n\
                 unix_socket_directories = '{socket_dir}'\n\
                 wal_level = replica\nmax_wal_senders = 4\n\
                 shared_buffers = 32MB\nmax_connections = 100\n\
                 # The tests kill processes, not the machine: the page cache keeps what\n\
                 # fsync would, and the shared disk is spared.\n\
                 fsync = off\n{}",
                replication.settings()
            ),
        );
        cluster.start_server(&primary).await;
        cluster.primary_running = true;

        let standby = cluster.standby_dir();
        cluster
            .run(
                "pg_basebackup",
                &[
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &primary_port.to_string(),
                    "-U",
                    "postgres",
                    "-D",
                    path(&standby),
                    "-R",
                    "-X",
                    "stream",
                    "-c",
                    "fast",
                    "--no-sync",
                ],
            )
            .await;
        // The copy carries the primary's settings: its own port, and once promoted no standby
        // of its own to wait for (a synchronous one would make every commit wait forever).
        append(
            &standby.join("postgresql.conf"),
            &format!("port = {standby_port}\nhot_standby = on\nsynchronous_standby_names = ''\n"),
        );
        cluster.start_server(&standby).await;
        cluster.standby_running = true;
        cluster.wait_for_standby(replication).await;
        cluster
    }

    /// The multi-host URL an application uses: both servers, the one taking writes wins.
    pub fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write&connect_timeout=2",
            self.primary_port, self.standby_port
        )
    }

    /// The key-value form of the same settings.
    pub fn config(&self) -> tokio_postgres::Config {
        self.url().parse().expect("a valid URL")
    }

    /// Settings for the standby alone (any session: it is read-only until promoted).
    pub fn standby_config(&self) -> tokio_postgres::Config {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres connect_timeout=2",
            self.standby_port
        )
        .parse()
        .expect("valid settings")
    }

    /// A connection of its own to the primary.
    pub async fn primary(&self) -> tokio_postgres::Client {
        connect(self.primary_port).await
    }

    /// A connection of its own to the standby (or the promoted standby).
    pub async fn standby(&self) -> tokio_postgres::Client {
        connect(self.standby_port).await
    }

    /// SIGKILL to the primary's postmaster: no shutdown, no goodbye to its clients or its
    /// standby. Its backends notice the death and exit on their own.
    pub async fn kill_primary(&mut self) {
        let pid_file = std::fs::read_to_string(self.primary_dir().join("postmaster.pid"))
            .expect("the primary's postmaster.pid");
        let pid = pid_file.lines().next().expect("a pid").trim().to_owned();
        let status = Command::new("kill")
            .args(["-KILL", &pid])
            .status()
            .await
            .expect("run kill");
        assert!(status.success(), "kill -KILL {pid}");
        self.primary_running = false;
    }

    /// `pg_ctl promote`: the standby ends recovery and takes writes; waits until it does.
    pub async fn promote_standby(&self) {
        let standby = self.standby_dir();
        self.run(
            "pg_ctl",
            &["-D", path(&standby), "-w", "-t", "60", "promote"],
        )
        .await;
    }

    /// Stops the standby (fast shutdown): a synchronous primary's commits then wait.
    pub async fn stop_standby(&mut self) {
        let standby = self.standby_dir();
        self.run(
            "pg_ctl",
            &["-D", path(&standby), "-w", "-m", "fast", "stop"],
        )
        .await;
        self.standby_running = false;
    }

    /// Starts the standby again (it reconnects to the primary if the primary is alive).
    pub async fn start_standby(&mut self) {
        let standby = self.standby_dir();
        self.start_server(&standby).await;
        self.standby_running = true;
    }

    /// Waits until the standby streams from the primary (as its synchronous standby unless
    /// the replication is asynchronous) and has replayed everything the primary wrote.
    pub async fn wait_for_standby(&self, replication: Replication) {
        let primary = self.primary().await;
        let state = match replication {
            Replication::Async => "async",
            Replication::Sync | Replication::RemoteApply => "sync",
        };
        let deadline = Instant::now() + PATIENCE;
        loop {
            let caught_up: i64 = primary
                .query_one(
                    "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming' \
                     AND sync_state = $1 AND replay_lsn >= pg_current_wal_lsn()",
                    &[&state],
                )
                .await
                .expect("read pg_stat_replication")
                .get(0);
            if caught_up == 1 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the standby did not catch up in time"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn primary_dir(&self) -> PathBuf {
        self.dir.path().join("primary")
    }

    fn standby_dir(&self) -> PathBuf {
        self.dir.path().join("standby")
    }

    async fn start_server(&self, data: &Path) {
        let log = data.with_extension("log");
        self.run(
            "pg_ctl",
            &[
                "-D",
                path(data),
                "-l",
                path(&log),
                "-w",
                "-t",
                "60",
                "start",
            ],
        )
        .await;
    }

    /// Runs one of the server programs (as `postgres` when root) and panics with its output
    /// if it fails.
    async fn run(&self, program: &str, args: &[&str]) {
        let binary = self.bindir.join(program);
        let mut command = if self.as_postgres {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(&binary);
            command
        } else {
            Command::new(&binary)
        };
        let output = tokio::time::timeout(
            PATIENCE,
            command
                .args(args)
                .current_dir(self.dir.path())
                .stdin(Stdio::null())
                .output(),
        )
        .await
        .unwrap_or_else(|_| panic!("{program} did not finish in {PATIENCE:?}"))
        .unwrap_or_else(|error| panic!("run {program}: {error}"));
        assert!(
            output.status.success(),
            "{program} {args:?} failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// The blocking form of [`run`](Self::run) for `Drop`; failures are ignored.
    fn run_quietly(&self, program: &str, args: &[&str]) {
        let binary = self.bindir.join(program);
        let mut command = if self.as_postgres {
            let mut command = std::process::Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(&binary);
            command
        } else {
            std::process::Command::new(&binary)
        };
        let _ = command
            .args(args)
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (running, data) in [
            (self.primary_running, self.primary_dir()),
            (self.standby_running, self.standby_dir()),
        ] {
            if running {
                self.run_quietly(
                    "pg_ctl",
                    &["-D", path(&data), "-m", "immediate", "-w", "stop"],
                );
            }
        }
        // The temporary directory goes with `self.dir`.
    }
}

/// A connection of its own to the server on `port`.
async fn connect(port: u16) -> tokio_postgres::Client {
    let settings = format!("host=127.0.0.1 port={port} user=postgres dbname=postgres");
    let (client, connection) = tokio_postgres::connect(&settings, NoTls)
        .await
        .unwrap_or_else(|error| panic!("connect to 127.0.0.1:{port}: {error}"));
    tokio::spawn(connection);
    client
}

fn is_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|output| String::from_utf8_lossy(&output.stdout).trim() == "0")
}

/// Two ports nobody listens on now (the kernel's choice; both held until both are chosen).
fn free_ports() -> (u16, u16) {
    let bind = || TcpListener::bind("127.0.0.1:0").expect("a free port");
    let (first, second) = (bind(), bind());
    let port = |listener: &TcpListener| listener.local_addr().expect("its address").port();
    (port(&first), port(&second))
}

fn append(file: &Path, text: &str) {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(file)
        .unwrap_or_else(|error| panic!("open {}: {error}", file.display()));
    file.write_all(format!("\n{text}\n").as_bytes())
        .expect("write the settings");
}

fn path(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

fn run_checked(command: &mut std::process::Command) {
    let status = command.status().expect("run a setup command");
    assert!(status.success(), "{command:?} failed");
}
