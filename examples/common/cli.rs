//! What the example programs share around their app: logging, the command line, exit codes and
//! Ctrl-C. Included by each example with `#[path = "common/cli.rs"] mod cli;`.

// Not every example uses every item.
#![allow(dead_code)]

use std::collections::HashMap;
use std::future::Future;
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::process::ExitCode;

use tokio::net::TcpListener;
use tower_idempotency::body::BoxError;

/// Runs an example: sets up logging, parses the command line with `parse` and runs the command
/// it returns with `run`.
///
/// `-h`/`--help` prints `usage`. A command line `parse` refuses exits with status 2 after the
/// usage; a command that fails exits with status 1 after its error, both on stderr.
pub async fn main<C, F>(
    program: &str,
    usage: &str,
    flags: &[Flag],
    parse: impl FnOnce(Flags) -> Result<C, String>,
    run: impl FnOnce(C) -> F,
) -> ExitCode
where
    F: Future<Output = Result<(), BoxError>>,
{
    init_logging();
    let command = match Flags::parse(std::env::args().skip(1), flags)
        .and_then(|flags| flags.map(parse).transpose())
    {
        Ok(Some(command)) => command,
        Ok(None) => {
            println!("{usage}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("{program}: {message}\n\n{usage}");
            return ExitCode::from(2);
        }
    };
    match run(command).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("{program}: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Logs on stderr, so that stdout carries only what the program is asked to print. `RUST_LOG`
/// sets the filter (default `warn`).
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

/// A flag an example accepts.
#[derive(Clone, Copy)]
pub enum Flag {
    /// `--flag VALUE` or `--flag=VALUE`.
    Value(&'static str),
    /// `--flag`, alone.
    Switch(&'static str),
}

/// The flags given, hand-parsed: a few flags do not justify an argument-parsing dependency.
pub struct Flags {
    values: HashMap<&'static str, String>,
    switches: Vec<&'static str>,
}

impl Flags {
    /// `Ok(None)` for `-h`/`--help`. A flag given twice keeps its last value.
    fn parse(
        mut args: impl Iterator<Item = String>,
        known: &[Flag],
    ) -> Result<Option<Self>, String> {
        let mut flags = Flags {
            values: HashMap::new(),
            switches: Vec::new(),
        };
        while let Some(arg) = args.next() {
            // Accept both `--addr VALUE` and `--addr=VALUE`.
            let (name, inline) = match arg.split_once('=') {
                Some((name, value)) if name.starts_with("--") => (name, Some(value.to_owned())),
                _ => (arg.as_str(), None),
            };
            if name == "-h" || name == "--help" {
                return Ok(None);
            }
            let flag = known.iter().copied().find(|flag| match flag {
                Flag::Value(known) => *known == name,
                Flag::Switch(known) => *known == name && inline.is_none(),
            });
            match flag {
                Some(Flag::Value(name)) => {
                    let value = inline
                        .or_else(|| args.next())
                        .ok_or_else(|| format!("{name} needs a value"))?;
                    flags.values.insert(name, value);
                }
                Some(Flag::Switch(name)) => flags.switches.push(name),
                None => return Err(format!("unknown argument `{arg}`")),
            }
        }
        Ok(Some(flags))
    }

    /// The value of `--flag VALUE`, if given.
    pub fn value(&mut self, flag: &str) -> Option<String> {
        self.values.remove(flag)
    }

    /// Whether the switch `--flag` was given.
    pub fn switch(&self, flag: &str) -> bool {
        self.switches.contains(&flag)
    }

    /// Whether any flag that takes a value is left (not taken with [`Flags::value`]).
    pub fn any_value_left(&self) -> bool {
        !self.values.is_empty()
    }
}

/// Listens on `addr` (the error names it); returns the listener and the address it got.
pub async fn listen(addr: &str) -> Result<(TcpListener, SocketAddr), BoxError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|error| format!("cannot listen on {addr}: {error}"))?;
    let local = listener.local_addr()?;
    Ok((listener, local))
}

/// Resolves on Ctrl-C. If the handler cannot be installed, never resolves (rather than
/// shutting the server down at once).
pub async fn ctrl_c() {
    match tokio::signal::ctrl_c().await {
        Ok(()) => eprintln!("shutting down: finishing requests in flight"),
        Err(error) => {
            tracing::error!(%error, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    }
}
