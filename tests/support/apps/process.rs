//! The example programs as child processes, for the tests that check an example as a user runs
//! it: built once per test binary, started on `127.0.0.1:0`, their stdout readable line by line.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

/// How long an example may take to start, or to print a line the test waits for: reached only
/// when the test fails.
const PATIENCE: Duration = Duration::from_secs(10);

/// The directory of the crate whose examples these are: two up from this library's own.
const REPOSITORY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");

/// How long building an example may take (a cold build on a small machine).
const BUILD_PATIENCE: Duration = Duration::from_secs(900);

/// The example `name`'s binary, up to date: built once per test binary (see [`build_example`]).
pub fn example_binary(name: &str) -> PathBuf {
    static BUILT: Mutex<Option<HashMap<String, PathBuf>>> = Mutex::new(None);
    let mut built = BUILT
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    built
        .get_or_insert_with(HashMap::new)
        .entry(name.to_owned())
        .or_insert_with(|| build_example(name))
        .clone()
}

/// Runs `cargo build --examples` and returns the path cargo reports for example `name`'s
/// executable.
///
/// `cargo test` builds examples, but `cargo test --test NAME` does not, and a binary left in
/// `target/` may be stale. So this runs the cargo that runs the tests, with the same profile and
/// target directory (a no-op when `cargo test` has just built it); cargo holds no build lock
/// while tests run. It builds every example, as `cargo test` does, not only `name`: the quick
/// start (`orders`) is in a package of its own (`examples/quickstart`), and built alone it would
/// get its own features of the shared dependencies, so its whole tree would be compiled a second
/// time. A build that takes longer than `BUILD_PATIENCE` is killed.
pub fn build_example(name: &str) -> PathBuf {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = std::process::Command::new(cargo);
    command
        .current_dir(REPOSITORY)
        .args(["build", "--examples", "--message-format=json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if !cfg!(debug_assertions) {
        command.arg("--release");
    }
    let mut child = command.spawn().expect("run cargo build");
    let mut stdout = child.stdout.take().expect("piped stdout");
    // Read on a thread so that the wait below can give up on a wedged build.
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut text);
        text
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for cargo") {
            break status;
        }
        if started.elapsed() > BUILD_PATIENCE {
            let _ = child.kill();
            panic!("`cargo build --examples` did not finish in {BUILD_PATIENCE:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let messages = reader.join().expect("cargo output");
    assert!(status.success(), "`cargo build --examples` failed");
    messages
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|message| message["reason"] == "compiler-artifact")
        .filter(|message| message["target"]["name"] == name)
        .find_map(|message| message["executable"].as_str().map(PathBuf::from))
        .unwrap_or_else(|| panic!("cargo reported no executable for example {name}"))
}

/// `NAME --addr 127.0.0.1:0 ARGS...`, a child process killed when dropped.
pub struct ExampleProcess {
    /// The address it printed on its first line.
    pub addr: SocketAddr,
    /// That first line: `listening on http://ADDR (database ...); ...`.
    pub banner: String,
    lines: mpsc::UnboundedReceiver<String>,
    child: Child,
}

impl ExampleProcess {
    /// Starts the example with these arguments and waits until it listens.
    pub async fn start(name: &str, args: &[&str]) -> ExampleProcess {
        Self::start_with_env(name, args, &[]).await
    }

    /// [`start`](Self::start), with these environment variables set too.
    pub async fn start_with_env(name: &str, args: &[&str], env: &[(&str, &str)]) -> ExampleProcess {
        let mut child = Command::new(example_binary(name))
            .args(["--addr", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", "error")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|error| panic!("start the {name} example: {error}"));
        let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        let banner = tokio::time::timeout(PATIENCE, stdout.next_line())
            .await
            .expect("the example starts in time")
            .expect("read its stdout")
            .expect("the example printed its address");
        let addr = banner
            .strip_prefix("listening on http://")
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|addr| addr.parse().ok())
            .unwrap_or_else(|| panic!("unexpected first line: {banner}"));
        // Keep draining stdout, so that the child never blocks on a full pipe.
        let (sender, lines) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok(Some(line)) = stdout.next_line().await {
                let _ = sender.send(line);
            }
        });
        ExampleProcess {
            addr,
            banner,
            lines,
            child,
        }
    }

    /// Sends `signal` (`STOP`, `CONT`...) with `kill(1)`.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.id().expect("the example is running");
        let status = std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} {pid}");
    }

    /// SIGKILL (nothing in flight gets to finish), and waits until it is gone.
    pub async fn kill(mut self) {
        self.child.start_kill().expect("kill the example");
        let _ = tokio::time::timeout(PATIENCE, self.child.wait()).await;
    }

    /// The next line the example printed after its first.
    pub async fn next_line(&mut self) -> String {
        tokio::time::timeout(PATIENCE, self.lines.recv())
            .await
            .expect("the example printed a line in time")
            .expect("the example is still running")
    }
}

/// Runs the example with these arguments to its end (at most `patience`): for the command
/// lines that exit by themselves, such as `--demo`.
pub async fn run_example(name: &str, args: &[&str], patience: Duration) -> Output {
    let run = Command::new(example_binary(name))
        .args(args)
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(patience, run)
        .await
        .unwrap_or_else(|_| panic!("the {name} example exits within {patience:?}"))
        .unwrap_or_else(|error| panic!("run the {name} example: {error}"))
}

/// A path as an argument.
pub fn arg(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}
