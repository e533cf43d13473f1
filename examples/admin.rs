//! Operations on an orders database: idempotency records and the outbox's dead letters.
//!
//! A command-line tool over [`tower_idempotency::admin::Admin`], on a SQLite file (`--db`) or
//! a PostgreSQL database (`--database-url`), while the servers run. On SQLite (WAL) reads
//! never wait and writes queue for a few seconds at most; on PostgreSQL every command runs
//! short autocommit statements. It never creates a database, and on PostgreSQL no table either.
//!
//! ```text
//! cargo run --example admin -- --db orders.db inspect --tenant shop-a --operation create_order --key k1
//! cargo run --example admin -- --db orders.db inspect --tenant shop-a --operation create_order --key k1 --body
//! cargo run --example admin -- --db orders.db delete --tenant shop-a --operation create_order --key k1
//! cargo run --example admin -- --db orders.db count [--tenant shop-a] [--operation create_order]
//! cargo run --example admin -- --db orders.db purge [--batch 1000]
//! cargo run --example admin -- --db orders.db outbox
//! cargo run --example admin -- --db orders.db event --id EVENT_ID
//! cargo run --example admin -- --db orders.db dead-letters [--limit 50]
//! cargo run --example admin -- --db orders.db requeue --id EVENT_ID
//! cargo run --example admin -- --db orders.db requeue --all
//! cargo run --example admin -- --db checkout.db steps --status in_doubt
//! cargo run --example admin -- --db checkout.db resolve --tenant shop-a --operation checkout --key k1 --step 1 --done '"ch_1"'
//! cargo run --example admin -- --db checkout.db resolve --tenant shop-a --operation checkout --key k1 --step 1 --call-again
//! cargo run --example admin -- --database-url postgres://postgres@127.0.0.1:5432/shop count
//! cargo run --example admin -- --database-url postgres://postgres@127.0.0.1:5432/shop dead-letters
//! ```
//!
//! Every command works with either store.
//!
//! Exit status: 0 done, 1 not found or failed, 2 usage error.
//!
//! The commands are written once, over `Admin<S>`: [`Admin`] has the same calls on every store.

use std::error::Error;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use tower_idempotency::admin::{Admin, AdminBackend, RecordFilter, RecordInfo};
use tower_idempotency::outbox::{EventInfo, OutboxBackend};
use tower_idempotency::steps::{Progress, ProgressStatus, Resolution, Settled, StepStore};
use tower_idempotency::store::sqlite::SqliteStore;
#[cfg(feature = "tokio-postgres")]
use tower_idempotency::store::tokio_postgres::PostgresStore;

type BoxError = Box<dyn Error + Send + Sync>;

const USAGE: &str = "\
usage: admin (--db PATH | --database-url URL) COMMAND [OPTIONS]

  --db PATH                a SQLite database file (never created)
  --database-url URL       a PostgreSQL database (postgres://user@host:5432/db; the tables
                           of the connection's search_path, never created or migrated)

records (scope: --tenant T --operation O --key K):
  inspect SCOPE [--body]   show a record: state, status, times, fingerprint, headers
                           (the body only with --body)
  delete SCOPE             delete one record: the next request with that key runs afresh
  count [--tenant T] [--operation O]
                           records by state (live, expired)
  purge [--batch N]        delete expired records, N per transaction (default 1000), and
                           step-by-step keys left running past their expiry

outbox:
  outbox                   events by state (pending, in_flight, delivered, dead)
  event --id ID            show one event
  dead-letters [--limit N] list dead-lettered events, oldest first (default 50)
  requeue --id ID          make a dead-lettered event due again, attempts reset
  requeue --all            requeue every dead-lettered event

step-by-step keys (the layer's steps mode):
  steps [--status S] [--limit N]
                           keys in progress with status S: running, in_doubt (default:
                           waiting for an operator) or dead (the completer gave up)
  resolve SCOPE [--step N] (--call-again | --done JSON)
                           settle a key in doubt: its step N (as `steps` shows) was not done
                           and may be called again, or was done with result JSON; the key
                           is then resumed by the next retry or the completer. Without
                           --step (a dead letter), makes the key running again. Refused
                           (exit status 1) for a key that is running: its owner may be in
                           the middle of a call

exit status: 0 done, 1 not found or failed, 2 usage error";

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();

    let mut stdout = std::io::stdout();
    match run(std::env::args().skip(1), &mut stdout).await {
        Ok(Exit::Done) => ExitCode::SUCCESS,
        Ok(Exit::NotFound) => ExitCode::FAILURE,
        Err(Failure::Usage(message)) => {
            eprintln!("admin: {message}\n\n{USAGE}");
            ExitCode::from(2)
        }
        Err(Failure::Failed(error)) => {
            eprintln!("admin: {error}");
            ExitCode::FAILURE
        }
    }
}

/// How a command ended, short of a failure.
#[derive(Debug, PartialEq, Eq)]
enum Exit {
    Done,
    /// The record or event asked for does not exist (exit status 1).
    NotFound,
}

/// Why a command did not run (exit status 2) or failed (1).
#[derive(Debug)]
enum Failure {
    Usage(String),
    Failed(BoxError),
}

impl<E: Into<BoxError>> From<E> for Failure {
    fn from(error: E) -> Self {
        Failure::Failed(error.into())
    }
}

/// The parsed command line.
#[derive(Debug, Default)]
struct Args {
    db: Option<PathBuf>,
    database_url: Option<String>,
    command: Option<String>,
    tenant: Option<String>,
    operation: Option<String>,
    key: Option<String>,
    id: Option<String>,
    batch: Option<usize>,
    limit: Option<usize>,
    body: bool,
    all: bool,
    help: bool,
    status: Option<String>,
    step: Option<u32>,
    done: Option<String>,
    call_again: bool,
}

impl Args {
    /// Hand-parsed: flags may come before or after the command, as `--flag VALUE` or
    /// `--flag=VALUE`.
    fn parse(args: impl IntoIterator<Item = String>) -> Result<Self, String> {
        let mut parsed = Args::default();
        let mut args = args.into_iter();
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
            let number = |text: String| {
                text.parse::<usize>()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| format!("{flag} needs a positive number, not `{text}`"))
            };
            match flag {
                "-h" | "--help" => parsed.help = true,
                "--db" => parsed.db = Some(PathBuf::from(value()?)),
                "--database-url" => parsed.database_url = Some(value()?),
                "--tenant" => parsed.tenant = Some(value()?),
                "--operation" => parsed.operation = Some(value()?),
                "--key" => parsed.key = Some(value()?),
                "--id" => parsed.id = Some(value()?),
                "--batch" => parsed.batch = Some(number(value()?)?),
                "--limit" => parsed.limit = Some(number(value()?)?),
                "--status" => parsed.status = Some(value()?),
                "--step" => {
                    let text = value()?;
                    let step = text
                        .parse()
                        .map_err(|_| format!("--step needs a step position, not `{text}`"))?;
                    parsed.step = Some(step);
                }
                "--done" => parsed.done = Some(value()?),
                "--call-again" if inline.is_none() => parsed.call_again = true,
                "--body" if inline.is_none() => parsed.body = true,
                "--all" if inline.is_none() => parsed.all = true,
                _ if !flag.starts_with('-') && parsed.command.is_none() => {
                    parsed.command = Some(arg.clone());
                }
                _ => return Err(format!("unknown argument `{arg}`")),
            }
        }
        Ok(parsed)
    }

    /// `(tenant, operation, key)`, all three required.
    fn scope(&self) -> Result<(&str, &str, &str), Failure> {
        match (&self.tenant, &self.operation, &self.key) {
            (Some(tenant), Some(operation), Some(key)) => Ok((tenant, operation, key)),
            _ => Err(Failure::Usage(
                "this command needs --tenant, --operation and --key".into(),
            )),
        }
    }

    fn id(&self) -> Result<&str, Failure> {
        self.id
            .as_deref()
            .ok_or_else(|| Failure::Usage("this command needs --id EVENT_ID".into()))
    }
}

/// The store the commands run on.
enum Store {
    Sqlite(Admin<SqliteStore>),
    #[cfg(feature = "tokio-postgres")]
    Postgres(Admin<PostgresStore>),
}

/// Opens the store named by `--db` or `--database-url` (exactly one), creating nothing.
async fn open(args: &Args) -> Result<Store, Failure> {
    match (&args.db, &args.database_url) {
        (Some(_), Some(_)) => Err(Failure::Usage(
            "--db and --database-url are two different stores: pick one".into(),
        )),
        (None, None) => Err(Failure::Usage(
            "a store is required: --db PATH or --database-url URL".into(),
        )),
        (Some(db), None) => {
            // Opening a missing path would create an empty database: an admin tool must not.
            if !db.is_file() {
                return Err(Failure::Failed(
                    format!("no database at {}", db.display()).into(),
                ));
            }
            let store = SqliteStore::open(db)
                .await
                .map_err(|error| format!("cannot open {}: {error}", db.display()))?;
            Ok(Store::Sqlite(Admin::new(store)))
        }
        #[cfg(feature = "tokio-postgres")]
        (None, Some(url)) => {
            let config = url
                .parse()
                .map_err(|error| Failure::Usage(format!("--database-url: {error}")))?;
            // No schema creation or migration; two connections are plenty for one command.
            // The URL is not repeated in errors: it may carry a password.
            let store = PostgresStore::builder(config)
                .with_create_schema(false)
                .with_max_connections(2)
                .with_max_read_connections(1)
                .build()
                .await
                .map_err(|error| format!("cannot connect: {error}"))?;
            Ok(Store::Postgres(Admin::new(store)))
        }
        #[cfg(not(feature = "tokio-postgres"))]
        (None, Some(_)) => Err(Failure::Usage(
            "--database-url needs the `tokio-postgres` feature".into(),
        )),
    }
}

/// Runs one command line (without the program name), writing its report to `out`.
async fn run(
    args: impl IntoIterator<Item = String>,
    out: &mut impl Write,
) -> Result<Exit, Failure> {
    let args = Args::parse(args).map_err(Failure::Usage)?;
    if args.help {
        writeln!(out, "{USAGE}")?;
        return Ok(Exit::Done);
    }
    let command = args
        .command
        .clone()
        .ok_or_else(|| Failure::Usage("no command".into()))?;
    match open(&args).await? {
        Store::Sqlite(admin) => execute(&admin, &command, &args, out).await,
        #[cfg(feature = "tokio-postgres")]
        Store::Postgres(admin) => execute(&admin, &command, &args, out).await,
    }
}

/// Runs `command` on any store: the same calls on each.
async fn execute<S: AdminBackend + OutboxBackend + StepStore>(
    admin: &Admin<S>,
    command: &str,
    args: &Args,
    out: &mut impl Write,
) -> Result<Exit, Failure> {
    match command {
        "inspect" => {
            let (tenant, operation, key) = args.scope()?;
            match admin
                .inspect(tenant, operation, key, args.body)
                .await
                .map_err(no_records)?
            {
                Some(record) => print_record(out, &record, args.body)?,
                None => {
                    writeln!(out, "no record for ({tenant}, {operation}, {key})")?;
                    return Ok(Exit::NotFound);
                }
            }
        }
        "delete" => {
            let (tenant, operation, key) = args.scope()?;
            if admin
                .delete(tenant, operation, key)
                .await
                .map_err(no_records)?
            {
                writeln!(out, "deleted the record for ({tenant}, {operation}, {key})")?;
            } else {
                writeln!(out, "no record for ({tenant}, {operation}, {key})")?;
                return Ok(Exit::NotFound);
            }
        }
        "count" => {
            let mut filter = RecordFilter::default();
            if let Some(tenant) = &args.tenant {
                filter = filter.tenant(tenant);
            }
            if let Some(operation) = &args.operation {
                filter = filter.operation(operation);
            }
            let counts = admin.counts(&filter).await.map_err(no_records)?;
            writeln!(out, "live: {}", counts.live)?;
            writeln!(out, "expired: {}", counts.expired)?;
        }
        "purge" => {
            let batch = args.batch.unwrap_or(1000);
            let purged = admin.purge_expired(batch).await.map_err(no_records)?;
            writeln!(out, "purged {purged} expired record(s)")?;
        }
        "outbox" => {
            let counts = admin.outbox().counts().await.map_err(no_outbox)?;
            writeln!(out, "pending: {}", counts.pending)?;
            writeln!(out, "in_flight: {}", counts.in_flight)?;
            writeln!(out, "delivered: {}", counts.delivered)?;
            writeln!(out, "dead: {}", counts.dead)?;
        }
        "event" => {
            let id = args.id()?;
            match admin.outbox().event(id).await.map_err(no_outbox)? {
                Some(event) => print_event(out, &event)?,
                None => {
                    writeln!(out, "no event {id}")?;
                    return Ok(Exit::NotFound);
                }
            }
        }
        "dead-letters" => {
            let limit = args.limit.unwrap_or(50);
            let events = admin
                .outbox()
                .dead_letters(limit)
                .await
                .map_err(no_outbox)?;
            if events.is_empty() {
                writeln!(out, "no dead-lettered events")?;
            }
            for (index, event) in events.iter().enumerate() {
                if index > 0 {
                    writeln!(out)?;
                }
                print_event(out, event)?;
            }
        }
        "requeue" if args.all => {
            let requeued = admin.outbox().requeue_all_dead().await.map_err(no_outbox)?;
            writeln!(out, "requeued {requeued} event(s)")?;
        }
        "requeue" => {
            let id = args.id()?;
            if admin.outbox().requeue(id).await.map_err(no_outbox)? {
                writeln!(out, "requeued {id}")?;
            } else {
                writeln!(out, "no dead-lettered event {id}")?;
                return Ok(Exit::NotFound);
            }
        }
        "steps" => {
            let status = match args.status.as_deref().unwrap_or("in_doubt") {
                "running" => ProgressStatus::Running,
                "in_doubt" => ProgressStatus::InDoubt,
                "dead" => ProgressStatus::Dead,
                other => {
                    return Err(Failure::Usage(format!(
                        "--status is running, in_doubt or dead, not `{other}`"
                    )))
                }
            };
            let keys = admin
                .keys_in_progress(status, args.limit.unwrap_or(50))
                .await
                .map_err(no_steps)?;
            if keys.is_empty() {
                writeln!(out, "no keys {}", status.as_str())?;
            }
            for (index, progress) in keys.iter().enumerate() {
                if index > 0 {
                    writeln!(out)?;
                }
                print_progress(out, progress)?;
            }
        }
        "resolve" => {
            let (tenant, operation, key) = args.scope()?;
            let resolution = match (&args.done, args.call_again) {
                (Some(json), false) => {
                    Resolution::Done(serde_json::from_str(json).map_err(|e| {
                        Failure::Usage(format!("--done needs the step's result as JSON: {e}"))
                    })?)
                }
                (None, true) => Resolution::CallAgain,
                (None, false) if args.step.is_none() => Resolution::CallAgain,
                _ => {
                    return Err(Failure::Usage(
                        "resolve needs exactly one of --call-again and --done JSON".into(),
                    ))
                }
            };
            match admin
                .resolve_steps(tenant, operation, key, args.step, &resolution)
                .await
                .map_err(no_steps)?
            {
                Settled::Resolved => writeln!(out, "resolved ({tenant}, {operation}, {key}): it resumes on the next retry or completer round")?,
                Settled::NotFound => {
                    writeln!(out, "no key in progress for ({tenant}, {operation}, {key})")?;
                    return Ok(Exit::NotFound);
                }
                Settled::Running => {
                    return Err(Failure::Failed(format!(
                        "refused: ({tenant}, {operation}, {key}) is running, not in doubt or dead; \
                         its owner may be in the middle of a call. Only a key in doubt or dead \
                         can be resolved"
                    ).into()))
                }
                Settled::NoIntent => {
                    return Err(Failure::Failed(format!(
                        "refused: step {} of ({tenant}, {operation}, {key}) is not a foreign \
                         step's intent (it has its result, or there is no such step)",
                        args.step.unwrap_or_default()
                    ).into()))
                }
                other => return Err(Failure::Failed(format!("refused: {other:?}").into())),
            }
        }
        other => return Err(Failure::Usage(format!("unknown command `{other}`"))),
    }
    Ok(Exit::Done)
}

/// Says plainly when the database has no step-by-step keys at all.
fn no_steps(error: tower_idempotency::Error) -> Failure {
    if is_missing_table(&error) {
        Failure::Failed(
            "this database has no step-by-step keys (no idempotency_progress table)".into(),
        )
    } else {
        Failure::Failed(error.into())
    }
}

fn print_progress(out: &mut impl Write, progress: &Progress) -> std::io::Result<()> {
    writeln!(out, "tenant:      {}", progress.scope.tenant)?;
    writeln!(out, "operation:   {}", progress.scope.operation)?;
    writeln!(out, "key:         {}", progress.scope.key.as_str())?;
    writeln!(out, "run:         {}", progress.run)?;
    writeln!(out, "status:      {}", progress.status.as_str())?;
    writeln!(out, "steps saved: {}", progress.steps)?;
    writeln!(out, "attempts:    {}", progress.attempts)?;
    writeln!(
        out,
        "request:     {} {}",
        progress.request.method, progress.request.uri
    )?;
    writeln!(out, "created_at:  {}", rfc3339(progress.created_at))?;
    writeln!(out, "updated_at:  {}", rfc3339(progress.updated_at))?;
    if let Some(reason) = &progress.last_error {
        writeln!(out, "reason:      {reason}")?;
    }
    Ok(())
}

/// Whether the store said that a table does not exist (SQLite: "no such table"; PostgreSQL:
/// SQLSTATE 42P01).
fn is_missing_table(error: &tower_idempotency::Error) -> bool {
    match error {
        #[cfg(feature = "tokio-postgres")]
        tower_idempotency::Error::TokioPostgres(error) => {
            use tower_idempotency::store::tokio_postgres::tokio_postgres::error::SqlState;
            error.code() == Some(&SqlState::UNDEFINED_TABLE)
        }
        other => other.to_string().contains("no such table"),
    }
}

/// Says plainly when the database has no outbox at all.
fn no_outbox(error: tower_idempotency::Error) -> Failure {
    if is_missing_table(&error) {
        Failure::Failed("this database has no outbox (no outbox_events table)".into())
    } else {
        Failure::Failed(error.into())
    }
}

/// Says plainly when the database has no idempotency records at all.
fn no_records(error: tower_idempotency::Error) -> Failure {
    if is_missing_table(&error) {
        Failure::Failed(
            "this database has no idempotency records (no idempotency_records table)".into(),
        )
    } else {
        Failure::Failed(error.into())
    }
}

fn print_record(out: &mut impl Write, record: &RecordInfo, with_body: bool) -> std::io::Result<()> {
    writeln!(out, "tenant:      {}", record.tenant)?;
    writeln!(out, "operation:   {}", record.operation)?;
    writeln!(out, "key:         {}", record.key)?;
    writeln!(out, "state:       {}", record.state)?;
    writeln!(out, "status:      {}", record.status.as_u16())?;
    writeln!(out, "created_at:  {}", rfc3339(record.created_at))?;
    writeln!(out, "expires_at:  {}", rfc3339(record.expires_at))?;
    writeln!(
        out,
        "fingerprint: v{} sha256:{}",
        record.fingerprint.version(),
        record.fingerprint.to_hex()
    )?;
    for (index, (name, value)) in record.headers.iter().enumerate() {
        let label = if index == 0 { "headers:" } else { "" };
        writeln!(
            out,
            "{label:<13}{name}: {}",
            String::from_utf8_lossy(value.as_bytes())
        )?;
    }
    match (&record.body, with_body) {
        (Some(body), true) => writeln!(out, "body:        {}", String::from_utf8_lossy(body))?,
        _ => writeln!(
            out,
            "body:        {} bytes (add --body to show it)",
            record.body_len
        )?,
    }
    Ok(())
}

fn print_event(out: &mut impl Write, event: &EventInfo) -> std::io::Result<()> {
    writeln!(out, "id:           {}", event.id)?;
    writeln!(out, "topic:        {}", event.topic)?;
    writeln!(out, "status:       {}", event.status)?;
    writeln!(out, "attempts:     {}", event.attempts)?;
    writeln!(out, "created_at:   {}", rfc3339(event.created_at))?;
    match event.delivered_at {
        Some(at) => writeln!(out, "delivered_at: {}", rfc3339(at))?,
        None => writeln!(out, "due_at:       {}", rfc3339(event.available_at))?,
    }
    if let Some(error) = &event.last_error {
        writeln!(out, "last_error:   {error}")?;
    }
    writeln!(out, "payload:      {}", event.payload)
}

/// `2026-05-01T12:00:00.123Z`: UTC, without a date crate (days to civil date, per Howard
/// Hinnant's algorithm).
fn rfc3339(time: SystemTime) -> String {
    let since_epoch = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since_epoch.as_secs();
    let millis = since_epoch.subsec_millis();
    let days = i64::try_from(secs / 86_400).unwrap_or(i64::MAX / 2);
    let rem = secs % 86_400;
    let (hour, minute, second) = (rem / 3600, rem % 3600 / 60, rem % 60);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}.{millis:03}Z")
}
