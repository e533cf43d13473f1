//! The command line: which cases, modes and concurrencies to run, for how long, and where the
//! files go.

use std::path::PathBuf;
use std::time::Duration;

use tower_idempotency::store::sqlite::Synchronous;

pub(crate) const USAGE: &str = "\
usage: cargo bench --bench orders -- [--quick] [--duration SECS] [--rounds N]
             [--cases A,B,C,D,H,R,QA,QH,E,hold,alloc,wal,instr] [--concurrency 1,16,64]
             [--modes full,normal] [--database-url URL] [--client-threads N] [--out DIR]
             [--scale [--scale-rows 0,1000000,10000000] [--scale-parts LIST]
              [--scale-purge-rows N]] [--topology]
       cargo bench --bench orders -- --serve [--modes full|normal|pg] [--database-url URL]
       cargo bench --bench orders -- --table [DIR]
       cargo bench --bench orders -- --galera [--concurrency 1,64] [--duration SECS]

  (no flags)           the full run: every case, both SQLite modes, 3 rounds of 2 s

  --quick              short rounds (smoke run, under a minute for SQLite)
  --duration SECS      length of one round (default 2; --quick 0.4)
  --rounds N           rounds per case, interleaved with the other cases' rounds;
                       throughput is their median (default 3; --quick 2)
  --cases LIST         what to run (default all but AR, SA, SH, QA and QH): A B C D H R
                       AR SA SH QA QH E,
                       hold (replays while a handler holds the write transaction), alloc
                       (bytes allocated per request), wal (WAL frames per new key:
                       A, H and a minimal handler, SQLite FULL), instr (instructions
                       per request under callgrind: the orders example against `peer
                       --minimal`, and with a URL against H on PostgreSQL; not in the
                       default run: it needs valgrind). AR (PostgreSQL,
                       ReplayCheck::FavorNewKeys) runs when asked, e.g. `--modes pg --cases
                       a,ar,h`; SA, SH (sqlx) in a pass of their own, `--modes pg --cases
                       sa,sh` (refused beside other PostgreSQL cases): more pools of 32 beside
                       A's and H's would exceed PostgreSQL's default max_connections (100).
                       QA, QH (the sqlx SQLite store, and H on sqlx; SQLite modes) run when
                       asked, beside A and H: `--cases a,h,qa,qh`
  --concurrency LIST   connections, one request in flight each (default 1,16,64)
  --modes LIST         full, normal (SQLite's durability), pg (default all three, pg
                       only with a URL)
  --database-url URL   run A, B, H, R, AR, SA and SH on PostgreSQL too (tables in a fresh
                       schema)
  --client-threads N   threads of the load generator's runtime (default 1)
  --out DIR            where results.csv, goals.csv, extras.csv, scale.csv and
                       throughput.svg go (default benches/orders/results: the run the docs
                       quote)
  --scale              the slow measurements of how cost grows (scale.rs; alone unless
                       --cases is given too): records already stored, purging while
                       serving, body size, concurrency up to 1024; on SQLite (FULL, or
                       NORMAL with --modes normal) and PostgreSQL (with a URL); the load
                       generator gets 2 threads unless --client-threads says otherwise
  --scale-rows LIST    records in the table for `records` (default 0,1000000,10000000)
  --scale-parts LIST   which of records, purge, body, concurrency (default all four)
  --scale-purge-rows N expired records the `purge` part purges (default 1000000)
  --topology           PostgreSQL where production runs it (topology.rs; alone unless
                       --cases is given too; needs --database-url): A and B on the
                       tokio-postgres store reached directly, behind PgBouncer
                       (pool_mode = transaction) and at SERIALIZABLE, in topology.csv
  --serve              measure nothing: start the server of one mode (default full) with
                       its routes and the rows case R reads, print how to call it, and run
                       until Ctrl-C (for a profiler: perf, strace, valgrind)
  --table [DIR]        measure nothing: print a run's results.csv and goals.csv (in DIR,
                       default benches/orders/results) as the Markdown tables the docs quote
  --galera             measure only the MySQL store on one MariaDB server (TEST_MYSQL_URL)
                       and on a three-node Galera cluster it starts (galera.rs): new keys
                       and replays; prints a table
  -h, --help           show this help

Temp databases go to the system temp dir (TMPDIR): keep it on a real disk.";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Case {
    A,
    B,
    C,
    D,
    H,
    R,
    /// Case A on the tokio-postgres store with `ReplayCheck::FavorNewKeys`.
    ReservationA,
    /// Case A on the sqlx store.
    SqlxA,
    /// Case H written with sqlx.
    SqlxH,
    /// Case A on the sqlx SQLite store.
    SqlxSqliteA,
    /// Case H written with sqlx on SQLite.
    SqlxSqliteH,
    E,
}

impl Case {
    pub(crate) const HTTP: [Case; 11] = [
        Case::A,
        Case::B,
        Case::C,
        Case::D,
        Case::H,
        Case::R,
        Case::ReservationA,
        Case::SqlxA,
        Case::SqlxH,
        Case::SqlxSqliteA,
        Case::SqlxSqliteH,
    ];
    /// The cases that run on PostgreSQL (C, D, QA and QH are SQLite-only).
    const POSTGRES: [Case; 7] = [
        Case::A,
        Case::B,
        Case::H,
        Case::R,
        Case::ReservationA,
        Case::SqlxA,
        Case::SqlxH,
    ];
    /// The cases that run only on PostgreSQL (the reservation's replay check, the sqlx store).
    const POSTGRES_ONLY: [Case; 3] = [Case::ReservationA, Case::SqlxA, Case::SqlxH];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Case::A => "A",
            Case::B => "B",
            Case::C => "C",
            Case::D => "D",
            Case::H => "H",
            Case::R => "R",
            Case::ReservationA => "AR",
            Case::SqlxA => "SA",
            Case::SqlxH => "SH",
            Case::SqlxSqliteA => "QA",
            Case::SqlxSqliteH => "QH",
            Case::E => "E",
        }
    }

    pub(crate) fn describe(self) -> &'static str {
        match self {
            Case::A => "layer, new keys",
            Case::B => "layer, replays",
            Case::C => "layer, 90% new / 10% retries",
            Case::D => "hand-written, spawn_blocking (old)",
            Case::H => "hand-written (baseline)",
            Case::R => "GET /orders/{id} (baseline)",
            Case::ReservationA => "layer, new keys, ReplayCheck::FavorNewKeys",
            Case::SqlxA => "sqlx store, layer, new keys",
            Case::SqlxH => "hand-written on sqlx (baseline)",
            Case::SqlxSqliteA => "sqlx SQLite store, layer, new keys",
            Case::SqlxSqliteH => "by hand on sqlx SQLite (baseline)",
            Case::E => "rusqlite loop, no HTTP (ceiling)",
        }
    }

    /// The baseline a case is compared with in the table's ratio column.
    pub(crate) fn baseline(self) -> Option<Case> {
        match self {
            Case::A | Case::C | Case::D | Case::ReservationA => Some(Case::H),
            Case::B => Some(Case::R),
            Case::SqlxA => Some(Case::SqlxH),
            Case::SqlxSqliteA => Some(Case::SqlxSqliteH),
            Case::H | Case::R | Case::SqlxH | Case::SqlxSqliteH | Case::E => None,
        }
    }

    /// Whether the case runs on the sqlx SQLite store's file (a server of its own kind).
    pub(crate) fn is_sqlx_sqlite(self) -> bool {
        matches!(self, Case::SqlxSqliteA | Case::SqlxSqliteH)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Mode {
    Full,
    Normal,
    /// PostgreSQL, with its server's `synchronous_commit`.
    Postgres,
}

impl Mode {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Mode::Full => "FULL",
            Mode::Normal => "NORMAL",
            Mode::Postgres => "PG",
        }
    }

    pub(crate) fn title(self) -> &'static str {
        match self {
            Mode::Full => "SQLite, synchronous=FULL",
            Mode::Normal => "SQLite, synchronous=NORMAL",
            Mode::Postgres => "PostgreSQL",
        }
    }

    /// SQLite's `synchronous` for the mode (PostgreSQL has none of its own here).
    pub(crate) fn synchronous(self) -> Synchronous {
        match self {
            Mode::Full | Mode::Postgres => Synchronous::Full,
            Mode::Normal => Synchronous::Normal,
        }
    }

    pub(crate) fn cases(self, selected: &[Case]) -> Vec<Case> {
        selected
            .iter()
            .copied()
            .filter(|case| match self {
                Mode::Postgres => Case::POSTGRES.contains(case),
                Mode::Full | Mode::Normal => !Case::POSTGRES_ONLY.contains(case),
            })
            .collect()
    }
}

#[derive(Clone, Debug)]
pub(crate) struct Options {
    pub(crate) duration: Duration,
    pub(crate) warmup: Duration,
    pub(crate) rounds: usize,
    pub(crate) cases: Vec<Case>,
    pub(crate) hold: bool,
    pub(crate) alloc: bool,
    /// `wal`: count the WAL frames of a new key (`wal.rs`).
    pub(crate) wal: bool,
    /// `instr`: instructions per request under callgrind (`instr.rs`).
    pub(crate) instr: bool,
    pub(crate) concurrency: Vec<usize>,
    pub(crate) modes: Vec<Mode>,
    pub(crate) out: PathBuf,
    pub(crate) quick: bool,
    /// PostgreSQL runs its cases when given.
    pub(crate) database_url: Option<String>,
    pub(crate) client_threads: usize,
    /// `--scale`: the measurements of how cost grows (`scale.rs`).
    pub(crate) scale: Option<Box<crate::scale::ScaleOptions>>,
    /// `--topology`: PostgreSQL behind PgBouncer and at SERIALIZABLE (`topology.rs`).
    pub(crate) topology: bool,
}

pub(crate) enum Command {
    Help,
    Run(Options),
    /// `--serve`: one mode's server, left running (`serve.rs`).
    Serve {
        mode: Mode,
        database_url: Option<String>,
    },
    /// `--table`: a run's CSV files printed as the docs' tables (`table.rs`).
    Table(PathBuf),
    /// `--galera`: the MySQL store on one server and on a Galera cluster (`galera.rs`).
    Galera(Options),
}

/// Where a run's files go, and where `--table` reads them, unless told otherwise.
const RESULTS: &str = "benches/orders/results";

impl Command {
    /// Hand-parsed, like the orders example: a few flags do not justify a dependency.
    pub(crate) fn parse(mut args: impl Iterator<Item = String>) -> Result<Self, String> {
        let mut quick = false;
        let mut duration = None;
        let mut rounds = None;
        let mut selected: Option<Vec<String>> = None;
        let mut concurrency = vec![1, 16, 64];
        let mut modes = None;
        let mut out = PathBuf::from(RESULTS);
        let mut database_url = None;
        let mut client_threads = None;
        let mut serve = false;
        let mut galera = false;
        let mut scale = None::<Box<crate::scale::ScaleOptions>>;
        let mut topology = false;
        while let Some(arg) = args.next() {
            let (flag, inline) = match arg.split_once('=') {
                Some((flag, value)) if flag.starts_with("--") => (flag, Some(value.to_owned())),
                _ => (arg.as_str(), None),
            };
            let mut value = || {
                inline
                    .clone()
                    .or_else(|| args.next())
                    .ok_or_else(|| format!("{flag} needs a value"))
            };
            match flag {
                "-h" | "--help" => return Ok(Command::Help),
                "--quick" if inline.is_none() => quick = true,
                "--serve" if inline.is_none() => serve = true,
                "--galera" if inline.is_none() => galera = true,
                "--table" => {
                    let dir = inline.clone().or_else(|| args.next());
                    return Ok(Command::Table(PathBuf::from(
                        dir.as_deref().unwrap_or(RESULTS),
                    )));
                }
                "--duration" => {
                    let secs: f64 = value()?
                        .parse()
                        .map_err(|_| "--duration takes seconds, such as 2 or 0.5")?;
                    if !(0.05..=3600.0).contains(&secs) {
                        return Err("--duration must be between 0.05 and 3600 seconds".into());
                    }
                    duration = Some(Duration::from_secs_f64(secs));
                }
                "--rounds" => {
                    let n: usize = value()?
                        .parse()
                        .map_err(|_| "--rounds takes a positive integer")?;
                    if n == 0 {
                        return Err("--rounds must be at least 1".into());
                    }
                    rounds = Some(n);
                }
                "--cases" => selected = Some(list(&value()?)),
                "--concurrency" => {
                    concurrency = list(&value()?)
                        .iter()
                        .map(|c| c.parse::<usize>().ok().filter(|c| (1..=1024).contains(c)))
                        .collect::<Option<Vec<_>>>()
                        .ok_or("--concurrency takes integers from 1 to 1024, such as 1,16,64")?;
                    concurrency.sort_unstable();
                    concurrency.dedup();
                }
                "--modes" => {
                    let mut chosen = list(&value()?)
                        .iter()
                        .map(|m| match m.to_ascii_lowercase().as_str() {
                            "full" => Ok(Mode::Full),
                            "normal" => Ok(Mode::Normal),
                            "pg" | "postgres" => Ok(Mode::Postgres),
                            other => Err(format!("unknown mode `{other}` (full, normal, pg)")),
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    chosen.sort_unstable();
                    chosen.dedup();
                    modes = Some(chosen);
                }
                "--out" => out = PathBuf::from(value()?),
                "--database-url" => database_url = Some(value()?),
                "--client-threads" => {
                    client_threads = Some(
                        value()?
                            .parse::<usize>()
                            .ok()
                            .filter(|n| (1..=64).contains(n))
                            .ok_or("--client-threads takes an integer from 1 to 64")?,
                    );
                }
                "--topology" if inline.is_none() => topology = true,
                "--scale" if inline.is_none() => {
                    scale.get_or_insert_with(Default::default);
                }
                "--scale-rows" | "--scale-parts" | "--scale-purge-rows" => {
                    scale
                        .get_or_insert_with(Default::default)
                        .parse(flag, &value()?)?;
                }
                _ => return Err(format!("unknown argument `{arg}`")),
            }
        }

        let (mut cases, mut hold, mut alloc, mut wal) = (Vec::new(), false, false, false);
        let mut instr = false;
        match selected {
            // `--scale` or `--topology` alone runs their measurements only.
            None if scale.is_some() || topology => {}
            None => {
                cases = vec![
                    Case::A,
                    Case::B,
                    Case::C,
                    Case::D,
                    Case::H,
                    Case::R,
                    Case::E,
                ];
                (hold, alloc, wal) = (true, true, true);
            }
            Some(names) => {
                for name in names {
                    match name.to_ascii_lowercase().as_str() {
                        "a" => cases.push(Case::A),
                        "b" => cases.push(Case::B),
                        "c" => cases.push(Case::C),
                        "d" => cases.push(Case::D),
                        "h" => cases.push(Case::H),
                        "r" => cases.push(Case::R),
                        "ar" => cases.push(Case::ReservationA),
                        "sa" => cases.push(Case::SqlxA),
                        "sh" => cases.push(Case::SqlxH),
                        "qa" => cases.push(Case::SqlxSqliteA),
                        "qh" => cases.push(Case::SqlxSqliteH),
                        "e" => cases.push(Case::E),
                        "hold" => hold = true,
                        "alloc" => alloc = true,
                        "wal" => wal = true,
                        "instr" => instr = true,
                        _ => return Err(format!("unknown case `{name}`")),
                    }
                }
                cases.sort_unstable();
                cases.dedup();
            }
        }
        if serve {
            let mode = match modes.as_deref() {
                None => Mode::Full,
                Some([mode]) => *mode,
                Some(_) => return Err("--serve starts one mode: --modes full, normal or pg".into()),
            };
            // `serve::run` refuses pg without a URL.
            return Ok(Command::Serve { mode, database_url });
        }
        // PostgreSQL runs by default when there is a URL to run it on.
        let modes = modes.unwrap_or_else(|| {
            let mut modes = vec![Mode::Full, Mode::Normal];
            if database_url.is_some() {
                modes.push(Mode::Postgres);
            }
            modes
        });
        if topology && database_url.is_none() {
            return Err("--topology needs --database-url".into());
        }
        if modes.contains(&Mode::Postgres) && database_url.is_none() {
            return Err("--modes pg needs --database-url".into());
        }
        if modes.is_empty() || concurrency.is_empty() {
            return Err("--modes and --concurrency need at least one value".into());
        }
        if modes.contains(&Mode::Postgres) {
            check_postgres_passes(&cases)?;
        }
        let duration = duration.unwrap_or(if quick {
            Duration::from_millis(400)
        } else {
            Duration::from_secs(2)
        });
        let options = Options {
            duration,
            warmup: (duration / 4).clamp(Duration::from_millis(100), Duration::from_millis(500)),
            rounds: rounds.unwrap_or(if quick { 2 } else { 3 }),
            cases,
            hold,
            alloc,
            wal,
            instr,
            concurrency,
            modes,
            out,
            quick,
            database_url,
            // The scale cases open up to 1024 connections: two client threads unless told.
            client_threads: client_threads.unwrap_or(if scale.is_some() { 2 } else { 1 }),
            scale,
            topology,
        };
        Ok(if galera {
            Command::Galera(options)
        } else {
            Command::Run(options)
        })
    }
}

/// SA and SH run on PostgreSQL in a pass of their own (see `--cases`): their two pools of 32
/// connections beside A's and H's (and the read pools) would exceed PostgreSQL's default
/// `max_connections` (100), and a case would wait for connections until its pool timed out.
fn check_postgres_passes(cases: &[Case]) -> Result<(), String> {
    let sqlx = |case: &Case| matches!(case, Case::SqlxA | Case::SqlxH);
    if cases.iter().any(sqlx) && !cases.iter().all(sqlx) {
        return Err(
            "on PostgreSQL, SA and SH run in a pass of their own (`--modes pg --cases \
             sa,sh`): their pools of 32 beside the other cases' would exceed PostgreSQL's \
             default max_connections (100)"
                .into(),
        );
    }
    Ok(())
}

impl Options {
    /// How long the run takes at least: the measured rounds and warm-ups of every case, the
    /// pause before each group's rounds, the ceiling E and the hold measurement. The setup
    /// (keys to replay, orders to read, PostgreSQL schemas) and the alloc run come on top.
    pub(crate) fn estimate(&self) -> Duration {
        let http: Vec<Case> = self
            .cases
            .iter()
            .copied()
            .filter(|&c| c != Case::E)
            .collect();
        let measured = self.duration * self.rounds as u32;
        let per_case = measured + self.warmup;
        let sqlite_modes = self.modes.iter().filter(|&&m| m != Mode::Postgres).count();
        let (mut pairs, mut groups) = (0, 0);
        for &mode in &self.modes {
            pairs += mode.cases(&http).len() * self.concurrency.len();
        }
        if sqlite_modes > 0 && !http.is_empty() {
            groups += self.concurrency.len();
        }
        if self.modes.contains(&Mode::Postgres) && !Mode::Postgres.cases(&http).is_empty() {
            groups += self.concurrency.len();
        }
        let mut total = per_case * pairs as u32 + Duration::from_millis(1100) * groups as u32;
        if self.cases.contains(&Case::E) {
            total += per_case * sqlite_modes as u32;
        }
        if self.hold {
            total += self.warmup + measured.max(Duration::from_millis(800)) * 3;
        }
        if let Some(scale) = &self.scale {
            total += scale.estimate(self);
        }
        if self.topology {
            total += crate::topology::estimate(self);
        }
        total
    }
}

/// `4 min 30 s`, `40 s`.
pub(crate) fn describe_duration(duration: Duration) -> String {
    let secs = duration.as_secs();
    match (secs / 60, secs % 60) {
        (0, s) => format!("{s} s"),
        (m, s) => format!("{m} min {s} s"),
    }
}

fn list(value: &str) -> Vec<String> {
    value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}
