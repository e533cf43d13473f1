//! The admin tool (`examples/admin.rs`) as a real process: built once per test binary with the
//! cargo that runs the tests, then run once per command line. What it printed on stdout and how
//! it ended (exit status, and stderr's `admin: ...` line) come back in the shape the tests
//! check.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::OnceLock;

use tower_idempotency::body::BoxError;

/// How a command ended, short of a failure.
#[derive(Debug, PartialEq, Eq)]
pub enum Exit {
    /// Exit status 0.
    Done,
    /// Exit status 1 with nothing on stderr: the record or event asked for does not exist.
    NotFound,
}

/// Why a command did not run (exit status 2) or failed (1, with a message on stderr).
#[derive(Debug)]
#[allow(dead_code)] // each suite reads what it checks
pub enum Failure {
    Usage(String),
    Failed(BoxError),
}

/// Runs `admin <argv>`, writes what it printed on stdout to `out`, and says how it ended.
pub async fn run(
    argv: impl IntoIterator<Item = String>,
    out: &mut impl std::io::Write,
) -> Result<Exit, Failure> {
    let output = tokio::process::Command::new(binary())
        .args(argv)
        .env("RUST_LOG", "off")
        .stdin(Stdio::null())
        .output()
        .await
        .expect("run the admin example");
    out.write_all(&output.stdout).expect("keep stdout");
    let stderr = String::from_utf8_lossy(&output.stderr);
    // `admin: MESSAGE`, then (for usage errors) the usage text.
    let message = stderr
        .lines()
        .find_map(|line| line.strip_prefix("admin: "))
        .map(str::to_owned);
    match (output.status.code(), message) {
        (Some(0), _) => Ok(Exit::Done),
        (Some(1), None) => Ok(Exit::NotFound),
        (Some(1), Some(message)) => Err(Failure::Failed(message.into())),
        (Some(2), Some(message)) => Err(Failure::Usage(message)),
        (status, _) => panic!("admin ended with {status:?}; stderr:\n{stderr}"),
    }
}

/// The `admin` example binary, up to date (see [`crate::common::process::build_example`]).
fn binary() -> PathBuf {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY
        .get_or_init(|| crate::common::process::build_example("admin"))
        .clone()
}
