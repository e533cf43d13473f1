//! The one test harness of the test groups (`tests/<group>/main.rs`, each built with
//! `harness = false`): a registry of the tests, what each needs, and the `main` that runs them
//! with [`libtest_mimic`], which reads the usual arguments (filters, `--exact`, `--skip`,
//! `--ignored`, `--include-ignored`, `--test-threads`, `--list`) and prints what libtest prints.
//!
//! A test is an ordinary `fn` or `async fn` without arguments, registered by a line above it
//! (braces, so that rustfmt keeps it on one line; the fns of a `proptest!` block, after the
//! block):
//!
//! ```ignore
//! test! { a_new_key_runs_the_handler }                 // async, on a current-thread runtime
//! test! { two_instances_share_one_key, multi_thread = 2, postgres }
//! test! { canonical_form_is_stable, sync }             // a plain fn (`sync` comes first)
//! test! { fingerprint_cost, sync, ignore = "a timing, not a check" }
//! ```
//!
//! Its name is its module path within the group and the fn's name, as libtest named it
//! (`contract::sqlite::...` for the module `sqlite` of `tests/contract/contract.rs`), so that
//! `cargo test --test contract contract::sqlite::` selects what it did. What a test
//! needs is `postgres` (`TEST_DATABASE_URL`), `mysql` (`TEST_MYSQL_URL`), `pg_cluster` (the
//! PostgreSQL server programs, see [`Cluster::bindir`]), `pgbouncer` (`TEST_DATABASE_URL` and
//! the `pgbouncer` program, see [`PgBouncer::binary`](crate::pgbouncer::PgBouncer::binary)) or
//! `galera` (MariaDB with Galera, see [`Galera::available`](crate::galera::Galera::available));
//! `multi_thread = N` runs it on a multi-thread runtime of `N` workers (as
//! `#[tokio::test(flavor = "multi_thread", worker_threads = N)]` did).
//!
//! What the machine has is decided when the binary starts, from its environment: a test whose
//! server is missing is reported as ignored (never as passed), and the group says once, on
//! stderr, how many were ignored and why. Setting or unsetting the variables rebuilds nothing.
//! `--ignored` runs them anyway: those on a server then return early, after saying that it is
//! missing.
//!
//! A panicking test fails with its message: libtest-mimic runs each test under
//! `catch_unwind`. libtest-mimic does not capture a test's output: what a test prints shows as
//! it runs, as under `--nocapture`.

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::pin::Pin;

use libtest_mimic::{Arguments, Trial};

use crate::cluster::Cluster;

pub use inventory;

/// Registers the test fn `$name` of the current module; see the [module docs](crate::harness).
#[macro_export]
macro_rules! test {
    ($name:ident, sync $(, $($options:tt)*)?) => {
        $crate::harness::inventory::submit! {
            $crate::test!(@options
                $crate::harness::Test::new(
                    module_path!(),
                    stringify!($name),
                    $crate::harness::Body::Sync($name),
                );
                $($($options)*)?)
        }
    };
    ($name:ident $(, $($options:tt)*)?) => {
        $crate::harness::inventory::submit! {
            $crate::test!(@options
                $crate::harness::Test::new(
                    module_path!(),
                    stringify!($name),
                    $crate::harness::Body::Async(|| Box::pin($name())),
                );
                $($($options)*)?)
        }
    };
    (@options $test:expr;) => { $test };
    (@options $test:expr; postgres $(, $($rest:tt)*)?) => {
        $crate::test!(@options $test.needs($crate::harness::Needs::Postgres); $($($rest)*)?)
    };
    (@options $test:expr; mysql $(, $($rest:tt)*)?) => {
        $crate::test!(@options $test.needs($crate::harness::Needs::MySql); $($($rest)*)?)
    };
    (@options $test:expr; pg_cluster $(, $($rest:tt)*)?) => {
        $crate::test!(@options $test.needs($crate::harness::Needs::PgCluster); $($($rest)*)?)
    };
    (@options $test:expr; galera $(, $($rest:tt)*)?) => {
        $crate::test!(@options $test.needs($crate::harness::Needs::Galera); $($($rest)*)?)
    };
    (@options $test:expr; pgbouncer $(, $($rest:tt)*)?) => {
        $crate::test!(@options $test.needs($crate::harness::Needs::PgBouncer); $($($rest)*)?)
    };
    (@options $test:expr; multi_thread = $workers:literal $(, $($rest:tt)*)?) => {
        $crate::test!(@options $test.multi_thread($workers); $($($rest)*)?)
    };
    (@options $test:expr; ignore = $why:literal $(, $($rest:tt)*)?) => {
        $crate::test!(@options $test.ignore($why); $($($rest)*)?)
    };
}

/// What a test needs besides this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Needs {
    Nothing,
    /// A PostgreSQL server: `TEST_DATABASE_URL`.
    Postgres,
    /// A MySQL or MariaDB server: `TEST_MYSQL_URL`.
    MySql,
    /// The PostgreSQL server programs, to build a primary and a standby ([`Cluster`]).
    PgCluster,
    /// PgBouncer and a PostgreSQL server: `TEST_DATABASE_URL` and the `pgbouncer` program
    /// ([`PgBouncer`](crate::pgbouncer::PgBouncer)).
    PgBouncer,
    /// MariaDB with Galera, to build a three-node cluster ([`Galera`](crate::galera::Galera)).
    Galera,
}

impl Needs {
    /// Why a test that needs this is ignored where it is missing.
    fn missing(self) -> &'static str {
        match self {
            Needs::Nothing => "",
            Needs::Postgres => "needs PostgreSQL: set TEST_DATABASE_URL",
            Needs::MySql => "needs MySQL or MariaDB: set TEST_MYSQL_URL",
            Needs::PgCluster => crate::cluster::MISSING,
            Needs::PgBouncer => crate::pgbouncer::MISSING,
            Needs::Galera => crate::galera::MISSING,
        }
    }
}

/// A test's body: a plain fn, or an async fn run to completion on a runtime of its own.
#[derive(Clone, Copy)]
pub enum Body {
    Sync(fn()),
    Async(fn() -> Pin<Box<dyn Future<Output = ()>>>),
}

/// A registered test (`test!`).
pub struct Test {
    /// `module_path!()` where it was registered: the group's crate name first.
    module: &'static str,
    name: &'static str,
    body: Body,
    needs: Needs,
    /// Workers of a multi-thread runtime; 0 for a current-thread runtime.
    workers: usize,
    /// Ignored wherever it runs, for this reason (`--ignored` runs it).
    ignore: Option<&'static str>,
}

impl Test {
    pub const fn new(module: &'static str, name: &'static str, body: Body) -> Test {
        Test {
            module,
            name,
            body,
            needs: Needs::Nothing,
            workers: 0,
            ignore: None,
        }
    }

    pub const fn needs(self, needs: Needs) -> Test {
        Test { needs, ..self }
    }

    pub const fn multi_thread(self, workers: usize) -> Test {
        Test { workers, ..self }
    }

    pub const fn ignore(self, why: &'static str) -> Test {
        Test {
            ignore: Some(why),
            ..self
        }
    }

    /// The name libtest gave it: the module path within the group, then the fn.
    fn full_name(&self) -> String {
        match self.module.split_once("::") {
            Some((_group, path)) => format!("{path}::{}", self.name),
            None => self.name.to_owned(),
        }
    }

    fn run(&self) {
        match self.body {
            Body::Sync(body) => body(),
            Body::Async(body) => {
                let runtime = if self.workers == 0 {
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                } else {
                    tokio::runtime::Builder::new_multi_thread()
                        .worker_threads(self.workers)
                        .enable_all()
                        .build()
                };
                runtime.expect("the test's runtime").block_on(body());
            }
        }
    }
}

inventory::collect!(Test);

/// What this machine has, from the environment of this run.
struct Available {
    postgres: bool,
    mysql: bool,
    pg_cluster: bool,
    pgbouncer: bool,
    galera: bool,
}

impl Available {
    fn from_env() -> Available {
        let set = |variable: &str| std::env::var(variable).is_ok_and(|url| !url.trim().is_empty());
        Available {
            postgres: set("TEST_DATABASE_URL"),
            mysql: set("TEST_MYSQL_URL"),
            pg_cluster: Cluster::bindir().is_some(),
            pgbouncer: crate::pgbouncer::PgBouncer::available(),
            galera: crate::galera::Galera::available(),
        }
    }

    /// Why `test` is ignored here, if it is.
    fn ignored(&self, test: &Test) -> Option<&'static str> {
        let has = match test.needs {
            Needs::Nothing => true,
            Needs::Postgres => self.postgres,
            Needs::MySql => self.mysql,
            Needs::PgCluster => self.pg_cluster,
            Needs::PgBouncer => self.pgbouncer,
            Needs::Galera => self.galera,
        };
        test.ignore.or((!has).then(|| test.needs.missing()))
    }
}

/// Runs the group's registered tests as the command line asks, and exits.
pub fn main() {
    let mut args = Arguments::from_args();
    // libtest reads it; libtest-mimic only reads `--test-threads`.
    if args.test_threads.is_none() {
        args.test_threads = std::env::var("RUST_TEST_THREADS")
            .ok()
            .and_then(|threads| threads.parse().ok());
    }
    if !args.nocapture {
        quiet_panics();
    }
    let available = Available::from_env();
    let mut tests: Vec<(String, &'static Test)> = inventory::iter::<Test>
        .into_iter()
        .map(|test| (test.full_name(), test))
        .collect();
    tests.sort_by(|a, b| a.0.cmp(&b.0));
    let mut names = HashSet::new();
    for (name, _) in &tests {
        assert!(names.insert(name.as_str()), "{name} is registered twice");
    }
    // The group's crate: the first part of its tests' module paths.
    let group = tests
        .first()
        .and_then(|(_, test)| test.module.split("::").next())
        .unwrap_or("tests");

    let mut ignored: BTreeMap<&'static str, usize> = BTreeMap::new();
    let trials: Vec<Trial> = tests
        .into_iter()
        .map(|(name, test)| {
            let why = available.ignored(test);
            let trial = Trial::test(name, move || {
                test.run();
                Ok(())
            })
            .with_ignored_flag(why.is_some());
            if let Some(why) = why {
                if !args.is_filtered_out(&trial) && args.is_ignored(&trial) {
                    *ignored.entry(why).or_default() += 1;
                }
            }
            trial
        })
        .collect();
    if !args.list {
        for (why, count) in &ignored {
            let tests = if *count == 1 { "test" } else { "tests" };
            eprintln!("{group}: {count} {tests} ignored: {why}");
        }
    }
    libtest_mimic::run(&args, trials).exit();
}

/// libtest hides a passing test's output; libtest-mimic cannot, and many tests panic on purpose
/// (a handler, a sink) to show that the layer survives it. So a panic prints one line, where
/// and why, without the backtrace `RUST_BACKTRACE` asks for: a failing test's own panic is
/// reported with its message anyway. `--nocapture` keeps the standard hook, backtraces and all.
fn quiet_panics() {
    std::panic::set_hook(Box::new(|info| {
        let thread = std::thread::current();
        let message = info
            .payload()
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| info.payload().downcast_ref::<String>().map(String::as_str))
            .unwrap_or("(a value that is not a string)");
        let at = info
            .location()
            .map(|at| format!(" at {}:{}", at.file(), at.line()))
            .unwrap_or_default();
        eprintln!(
            "thread '{}' panicked{at}: {message}",
            thread.name().unwrap_or("<unnamed>")
        );
    }));
}
