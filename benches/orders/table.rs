//! `--table DIR`: the Markdown tables the docs quote, read back from a run's `results.csv` and
//! `goals.csv`, so that the figures in `docs/performance.md` are the CSV's and nothing else.

use std::fmt::Write as _;
use std::path::Path;

/// One CSV line's fields; a field in double quotes may hold commas (`""` is a quote).
fn fields(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut field = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                field.push('"');
                chars.next();
            }
            '"' => quoted = !quoted,
            ',' if !quoted => out.push(std::mem::take(&mut field)),
            _ => field.push(c),
        }
    }
    out.push(field);
    out
}

/// The rows of a CSV file as maps from its header's names to the values.
fn read(path: &Path) -> Result<Vec<Vec<(String, String)>>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut lines = text.lines();
    let header = fields(lines.next().unwrap_or_default());
    Ok(lines
        .filter(|line| !line.trim().is_empty())
        .map(|line| header.iter().cloned().zip(fields(line)).collect())
        .collect())
}

fn get<'a>(row: &'a [(String, String)], name: &str) -> &'a str {
    row.iter()
        .find(|(key, _)| key == name)
        .map_or("", |(_, value)| value.as_str())
}

/// Thousands separated by commas: `12605` -> `12,605`.
fn thousands(value: &str) -> String {
    let digits = value.trim();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Prints the requests/s table (a row per case, a column per mode and concurrency) and the
/// goals table of the run whose files are in `dir`.
pub(crate) fn print(dir: &Path) -> Result<(), String> {
    let results = read(&dir.join("results.csv"))?;
    let mut columns: Vec<(String, String)> = Vec::new();
    let mut cases: Vec<(String, String)> = Vec::new();
    for row in &results {
        let column = (
            get(row, "mode").to_owned(),
            get(row, "concurrency").to_owned(),
        );
        if !columns.contains(&column) {
            columns.push(column);
        }
        let case = (
            get(row, "case").to_owned(),
            get(row, "description").to_owned(),
        );
        if !cases.contains(&case) {
            cases.push(case);
        }
    }
    let mut table = String::from("| requests/s |");
    for (mode, concurrency) in &columns {
        let _ = write!(table, " {mode} c={concurrency} |");
    }
    table.push_str("\n|---|");
    table.push_str(&"---:|".repeat(columns.len()));
    table.push('\n');
    for (case, description) in &cases {
        let _ = write!(table, "| {case} {description} |");
        for (mode, concurrency) in &columns {
            let value = results
                .iter()
                .find(|row| {
                    get(row, "case") == case
                        && get(row, "mode") == mode
                        && get(row, "concurrency") == concurrency
                })
                .map_or_else(
                    || "–".to_owned(),
                    |row| thousands(get(row, "requests_per_s")),
                );
            let _ = write!(table, " {value} |");
        }
        table.push('\n');
    }
    println!("{table}");
    if let Ok(goals) = read(&dir.join("goals.csv")) {
        let mut table =
            String::from("| goal | ratio | target | met | detail |\n|---|---:|---|---|---|\n");
        for goal in &goals {
            let _ = writeln!(
                table,
                "| {} | {} | {} {} | {} | {} |",
                get(goal, "goal"),
                get(goal, "value"),
                get(goal, "bound"),
                get(goal, "limit"),
                if get(goal, "met") == "true" {
                    "yes"
                } else {
                    "no"
                },
                get(goal, "detail"),
            );
        }
        println!("{table}");
    }
    Ok(())
}
