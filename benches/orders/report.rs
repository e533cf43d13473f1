//! What the run prints and writes: the table, the ratios, the goals block, and the CSV files.

use std::fmt::Write as _;
use std::path::Path as FsPath;

use crate::cases::Row;
use crate::cli::{Case, Mode, Options};
use crate::extras::Extra;

pub(crate) fn find(rows: &[Row], case: Case, mode: Mode, concurrency: usize) -> Option<&Row> {
    rows.iter()
        .find(|r| r.case == case && r.mode == mode && r.concurrency == concurrency)
}

/// The row's ratio to its baseline at the same mode and concurrency.
fn ratio(rows: &[Row], row: &Row) -> Option<(Case, f64)> {
    let baseline = row.case.baseline()?;
    let base = find(rows, baseline, row.mode, row.concurrency)?;
    Some((baseline, row.median() / base.median()))
}

pub(crate) fn print_table(rows: &[Row], options: &Options) {
    println!();
    println!(
        "requests/s: median of {} interleaved rounds of {:.1} s; latency p50/p99 over all rounds; \
         cpu: microseconds per request of the server's threads (srv), the load generator's \
         (cli) and the PostgreSQL backends' (db)",
        options.rounds,
        options.duration.as_secs_f64()
    );
    let mut modes: Vec<Mode> = rows.iter().map(|row| row.mode).collect();
    modes.dedup();
    for mode in modes {
        println!();
        println!("{}", mode.title());
        println!(
            "{:<4} {:<35} {:>4} {:>9} {:>15} {:>8} {:>8} {:>7} {:>7} {:>7} {:>9} {:>6} {:>8}",
            "case",
            "",
            "c",
            "req/s",
            "rounds min-max",
            "p50 ms",
            "p99 ms",
            "srv us",
            "cli us",
            "db us",
            "requests",
            "errors",
            "ratio"
        );
        let cpu = |value: Option<f64>| value.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"));
        for row in rows.iter().filter(|row| row.mode == mode) {
            let (min, max) = row
                .rounds
                .iter()
                .fold((f64::MAX, 0.0f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
            let ratio = ratio(rows, row)
                .map(|(base, r)| format!("{r:.2}x {}", base.name()))
                .unwrap_or_default();
            println!(
                "{:<4} {:<35} {:>4} {:>9.0} {:>15} {:>8.3} {:>8.3} {:>7} {:>7} {:>7} {:>9} {:>6} {:>8}",
                row.case.name(),
                row.case.describe(),
                row.concurrency,
                row.median(),
                format!("{min:.0}-{max:.0}"),
                row.p50_ms,
                row.p99_ms,
                cpu(row.cpu_us),
                cpu(row.client_cpu_us),
                cpu(row.db_cpu_us),
                row.requests,
                row.errors,
                ratio
            );
        }
    }
    let failed: Vec<&Row> = rows.iter().filter(|r| r.integrity.is_some()).collect();
    if failed.is_empty() && rows.iter().any(|r| r.case != Case::E) {
        println!(
            "order check: every fresh 201 had exactly one committed order when its client had it"
        );
    }
    for row in failed {
        println!(
            "order check FAILED for {} {} c={}: {}",
            row.case.name(),
            row.mode.name(),
            row.concurrency,
            row.integrity.as_deref().unwrap_or_default()
        );
    }
}

/// One goal of the performance issue, as measured.
pub(crate) struct Goal {
    what: String,
    value: f64,
    /// The bound, and whether the value must be at least (`true`) or at most it.
    goal: f64,
    at_least: bool,
    detail: String,
}

impl Goal {
    /// A goal that `value` be at most `goal` (the WAL count's, `wal.rs`).
    pub(crate) fn at_most(what: String, value: f64, goal: f64, detail: String) -> Self {
        Self::new(what, value, goal, false, detail)
    }

    /// A goal measured elsewhere (`scale.rs`): `value` must be at least (`at_least`) or at
    /// most `goal`.
    pub(crate) fn new(what: String, value: f64, goal: f64, at_least: bool, detail: String) -> Self {
        Goal {
            what,
            value,
            goal,
            at_least,
            detail,
        }
    }

    fn met(&self) -> bool {
        if self.at_least {
            self.value >= self.goal
        } else {
            self.value <= self.goal
        }
    }
}

/// The ratios the performance issue sets goals for, from the rows of this run.
pub(crate) fn goals(rows: &[Row]) -> Vec<Goal> {
    let mut goals = Vec::new();
    let micros = |ms: f64| ms * 1000.0;
    // Throughput of the layer over the hand-written handler (at c1, the inverse of their
    // latency ratio).
    let mut throughput = |what: String, layer: Option<&Row>, hand: Option<&Row>, goal: f64| {
        if let (Some(layer), Some(hand)) = (layer, hand) {
            goals.push(Goal {
                what,
                value: layer.median() / hand.median(),
                goal,
                at_least: true,
                detail: format!(
                    "{:.0} vs {:.0} req/s, p50 {:.0} vs {:.0} us",
                    layer.median(),
                    hand.median(),
                    micros(layer.p50_ms),
                    micros(hand.p50_ms)
                ),
            });
        }
    };
    let (full, normal, pg) = (Mode::Full, Mode::Normal, Mode::Postgres);
    for (c, goal) in [(1, 0.85), (16, 2.0)] {
        throughput(
            format!("SQLite FULL c{c}: layer / hand-written"),
            find(rows, Case::A, full, c),
            find(rows, Case::H, full, c),
            goal,
        );
    }
    throughput(
        "SQLite FULL c64: layer / hand-written in NORMAL".into(),
        find(rows, Case::A, full, 64),
        find(rows, Case::H, normal, 64),
        1.0,
    );
    for (c, goal) in [(1, 0.85), (16, 1.0), (64, 1.0)] {
        throughput(
            format!("SQLite NORMAL c{c}: layer / hand-written"),
            find(rows, Case::A, normal, c),
            find(rows, Case::H, normal, c),
            goal,
        );
    }
    // Parity within a run's spread: at least 1.0 at c1, 0.95 at c64.
    let parity = |c: usize| if c == 1 { 1.0 } else { 0.95 };
    for c in [1, 64] {
        throughput(
            format!("PostgreSQL c{c}: layer / hand-written"),
            find(rows, Case::A, pg, c),
            find(rows, Case::H, pg, c),
            parity(c),
        );
    }
    for c in [1, 64] {
        throughput(
            format!("PostgreSQL c{c}, ReplayCheck::FavorNewKeys: layer / hand-written"),
            find(rows, Case::ReservationA, pg, c),
            find(rows, Case::H, pg, c),
            parity(c),
        );
    }
    for c in [1, 64] {
        throughput(
            format!("PostgreSQL on sqlx c{c}: layer / hand-written"),
            find(rows, Case::SqlxA, pg, c),
            find(rows, Case::SqlxH, pg, c),
            parity(c),
        );
    }
    for (c, goal) in [(1, 1.2), (64, 1.0)] {
        if let (Some(layer), Some(hand)) =
            (find(rows, Case::A, full, c), find(rows, Case::H, full, c))
        {
            if let (Some(a), Some(h)) = (layer.cpu_us, hand.cpu_us) {
                goals.push(Goal {
                    what: format!("server CPU per request, SQLite FULL c{c}: layer / hand-written"),
                    value: a / h,
                    goal,
                    at_least: false,
                    detail: format!("{a:.0} vs {h:.0} us"),
                });
            }
        }
    }
    for mode in [full, normal, pg] {
        for c in [1, 64] {
            if let (Some(replay), Some(read)) =
                (find(rows, Case::B, mode, c), find(rows, Case::R, mode, c))
            {
                goals.push(Goal {
                    what: format!("replays / GET /orders/{{id}}, {} c{c}", mode.name()),
                    value: replay.median() / read.median(),
                    goal: if c == 1 { 0.9 } else { 0.8 },
                    at_least: true,
                    detail: format!(
                        "{:.0} vs {:.0} req/s, p50 {:.0} vs {:.0} us",
                        replay.median(),
                        read.median(),
                        micros(replay.p50_ms),
                        micros(read.p50_ms)
                    ),
                });
            }
        }
    }
    goals
}

pub(crate) fn print_goals(goals: &[Goal]) {
    print_goals_titled("Goals (this run)", goals);
}

pub(crate) fn print_goals_titled(title: &str, goals: &[Goal]) {
    if goals.is_empty() {
        return;
    }
    println!();
    println!("{title}");
    for goal in goals {
        println!(
            "  {:<66} {:>6.2}  goal {} {:<4} {:<8} ({})",
            goal.what,
            goal.value,
            if goal.at_least { ">=" } else { "<=" },
            goal.goal,
            if goal.met() { "met" } else { "NOT met" },
            goal.detail
        );
    }
    let met = goals.iter().filter(|goal| goal.met()).count();
    println!("  {met} of {} met", goals.len());
}

pub(crate) fn write_goals_csv(path: &FsPath, goals: &[Goal]) -> std::io::Result<()> {
    let mut csv = String::from("goal,value,bound,limit,met,detail\n");
    for goal in goals {
        let _ = writeln!(
            csv,
            "\"{}\",{:.3},{},{},{},\"{}\"",
            goal.what,
            goal.value,
            if goal.at_least { ">=" } else { "<=" },
            goal.goal,
            goal.met(),
            goal.detail
        );
    }
    std::fs::write(path, csv)
}

/// Ratios without a goal, for the record: the old baseline and the ceiling.
pub(crate) fn print_ratios(rows: &[Row]) {
    let mut lines = Vec::new();
    for mode in [Mode::Full, Mode::Normal] {
        for row in rows.iter().filter(|r| r.mode == mode && r.case == Case::D) {
            if let Some(h) = find(rows, Case::H, mode, row.concurrency) {
                lines.push(format!(
                    "D/H  {:<6} c={:<3} {:>6.2}  (spawn_blocking vs inline)",
                    mode.name(),
                    row.concurrency,
                    row.median() / h.median()
                ));
            }
        }
        // The layer on the sqlx SQLite store against the layer on the rusqlite store and
        // against H (QA's own baseline, QH, is in the table's ratio column).
        for row in rows
            .iter()
            .filter(|r| r.mode == mode && r.case == Case::SqlxSqliteA)
        {
            for (base, what) in [(Case::A, "rusqlite store"), (Case::H, "rusqlite by hand")] {
                if let Some(other) = find(rows, base, mode, row.concurrency) {
                    lines.push(format!(
                        "QA/{} {:<6} c={:<3} {:>6.2}  (sqlx SQLite store vs {what})",
                        base.name(),
                        mode.name(),
                        row.concurrency,
                        row.median() / other.median()
                    ));
                }
            }
        }
        let Some(e) = find(rows, Case::E, mode, 1) else {
            continue;
        };
        for case in [Case::A, Case::H] {
            let best = rows
                .iter()
                .filter(|r| r.mode == mode && r.case == case)
                .max_by(|x, y| x.median().total_cmp(&y.median()));
            if let Some(row) = best {
                lines.push(format!(
                    "{}/E  {:<6} best (c={}) {:>6.2}",
                    case.name(),
                    mode.name(),
                    row.concurrency,
                    row.median() / e.median()
                ));
            }
        }
    }
    if !lines.is_empty() {
        println!();
        println!("Other ratios (same run)");
        for line in lines {
            println!("  {line}");
        }
    }
}

pub(crate) fn write_results_csv(path: &FsPath, rows: &[Row]) -> std::io::Result<()> {
    let mut csv = String::from(
        "case,description,mode,concurrency,requests_per_s,rounds_min,rounds_max,rounds,\
         p50_ms,p99_ms,server_cpu_us_per_request,client_cpu_us_per_request,\
         db_cpu_us_per_request,requests,errors,baseline,ratio_to_baseline,order_check\n",
    );
    for row in rows {
        let (min, max) = row
            .rounds
            .iter()
            .fold((f64::MAX, 0.0f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        let (baseline, ratio) = ratio(rows, row)
            .map(|(base, r)| (base.name().to_owned(), format!("{r:.3}")))
            .unwrap_or_default();
        let _ = writeln!(
            csv,
            "{},\"{}\",{},{},{:.0},{min:.0},{max:.0},{},{:.3},{:.3},{},{},{},{},{},{baseline},{ratio},{}",
            row.case.name(),
            row.case.describe(),
            row.mode.name(),
            row.concurrency,
            row.median(),
            row.rounds.len(),
            row.p50_ms,
            row.p99_ms,
            row.cpu_us
                .map_or_else(String::new, |cpu| format!("{cpu:.1}")),
            row.client_cpu_us
                .map_or_else(String::new, |cpu| format!("{cpu:.1}")),
            row.db_cpu_us
                .map_or_else(String::new, |cpu| format!("{cpu:.1}")),
            row.requests,
            row.errors,
            match (&row.integrity, row.case) {
                (_, Case::E) => String::new(),
                (None, _) => "ok".to_owned(),
                (Some(problem), _) => format!("\"FAILED: {}\"", problem.replace('"', "'")),
            },
        );
    }
    std::fs::write(path, csv)
}

pub(crate) fn write_extras_csv(path: &FsPath, extras: &[Extra]) -> std::io::Result<()> {
    let mut csv = String::from("measure,variant,metric,value,unit\n");
    for extra in extras {
        let _ = writeln!(
            csv,
            "{},\"{}\",{},{:.3},{}",
            extra.measure, extra.variant, extra.metric, extra.value, extra.unit
        );
    }
    std::fs::write(path, csv)
}
