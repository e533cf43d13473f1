//! PgBouncer in transaction pooling mode in front of the test database, started by the tests
//! that use it ([`PgBouncer`]), and a database of a test behind it ([`Bounced`]): a role and a
//! schema of its own, the order app's `orders` table, and the stores of both drivers connected
//! through the pooler.
//!
//! Each [`Bounced`] starts a PgBouncer of its own (a configuration in a temporary directory,
//! listening on a free port on 127.0.0.1, `pool_mode = transaction`, a small
//! `default_pool_size` so that the clients share a few server connections, `auth_type = trust`
//! with a userlist of the test's role), pointing at the server of `TEST_DATABASE_URL`. Its
//! tests are registered with `pgbouncer` (`test! { name, pgbouncer }`): the harness looks for
//! the program and the variable when the test binary starts ([`PgBouncer::binary`]), and a
//! machine without them reports the tests as ignored, with the reason ([`MISSING`]).
//!
//! **Selecting the schema.** The other PostgreSQL suites put each test in a schema of its own
//! with `search_path` in the connection's startup `options`. PgBouncer refuses a startup
//! parameter it does not know (`unsupported startup parameter: options`), and with
//! `ignore_startup_parameters = options` it drops it silently, so the tables would land in
//! `public`. So here each test has a role of its own whose `search_path` is its schema
//! (`ALTER ROLE ... SET search_path`): the server applies it to every session of the role,
//! whichever server connection PgBouncer hands a transaction to. (`extra_float_digits`, which
//! sqlx sends at startup, is in `ignore_startup_parameters`, as most PgBouncer setups have it.)

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use tower_idempotency::store::sqlx_postgres::SqlxPostgresStore;
use tower_idempotency::store::tokio_postgres::tokio_postgres::types::{FromSql, ToSql};
use tower_idempotency::store::tokio_postgres::tokio_postgres::{self, NoTls};
use tower_idempotency::store::tokio_postgres::{PostgresOptions, PostgresStore};

use crate::common::server_backed::{run_on_a_thread_of_its_own, FreshName};
use crate::pg_common::ORDERS_SCHEMA;

/// The reason shown for the PgBouncer tests where the program or the server is missing.
pub const MISSING: &str = "needs PgBouncer (the pgbouncer program on PATH, in /usr/sbin, or \
     PGBOUNCER=<path>) and PostgreSQL (TEST_DATABASE_URL)";

/// How long PgBouncer may take to listen, or to exit: reached only when a test fails.
const PATIENCE: Duration = Duration::from_secs(10);

/// Roles and schemas of this suite are named `tidem_pgb_<unix seconds>_<pid>_<n>`.
const PREFIX: &str = "tidem_pgb_";

/// A PgBouncer process in transaction pooling mode, stopped (and its directory removed) when
/// dropped.
pub struct PgBouncer {
    binary: PathBuf,
    /// Holds `pgbouncer.ini`, `userlist.txt` and `pgbouncer.log`.
    dir: tempfile::TempDir,
    /// Where it listens, on 127.0.0.1 (the same after a restart).
    pub port: u16,
    child: Option<Child>,
}

impl PgBouncer {
    /// The program: `PGBOUNCER`, else `pgbouncer` on `PATH`, else `/usr/sbin/pgbouncer` (where
    /// Debian and Ubuntu install it); `None` if there is none.
    pub fn binary() -> Option<PathBuf> {
        if let Some(path) = std::env::var_os("PGBOUNCER") {
            return Some(PathBuf::from(path)).filter(|path| path.is_file());
        }
        let on_path = std::env::var_os("PATH")
            .map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
            .unwrap_or_default();
        on_path
            .into_iter()
            .chain(["/usr/sbin".into(), "/usr/local/sbin".into()])
            .map(|dir| dir.join("pgbouncer"))
            .find(|path| path.is_file())
    }

    /// Whether the PgBouncer tests can run here: the program, and `TEST_DATABASE_URL`.
    pub fn available() -> bool {
        let url = std::env::var("TEST_DATABASE_URL").is_ok_and(|url| !url.trim().is_empty());
        url && Self::binary().is_some()
    }

    /// Starts PgBouncer in front of `upstream` (host and port) with `pool_size` server
    /// connections per role and database, letting in `users` (name, password: the password
    /// PgBouncer logs in to the server with, empty for none), and waits until it listens.
    pub async fn start(upstream: (&str, u16), pool_size: usize, users: &[(&str, &str)]) -> Self {
        let binary = Self::binary().unwrap_or_else(|| panic!("{MISSING}"));
        let dir = tempfile::Builder::new()
            .prefix("tidem-pgbouncer-")
            .tempdir()
            .expect("a temporary directory");
        // Readable by the `postgres` user it runs as when the tests run as root.
        set_mode(dir.path(), 0o755);
        let port = free_port();
        let userlist = users
            .iter()
            .map(|(user, password)| format!("\"{user}\" \"{password}\"\n"))
            .collect::<String>();
        write(&dir.path().join("userlist.txt"), &userlist);
        let (host, upstream_port) = upstream;
        let config = format!(
            "[databases]\n\
             * = host={host} port={upstream_port}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {userlist}\n\
             pool_mode = transaction\n\
             default_pool_size = {pool_size}\n\
             max_client_conn = 500\n\
             ignore_startup_parameters = extra_float_digits\n\
             server_login_retry = 1\n\
             query_wait_timeout = 30\n",
            userlist = dir.path().join("userlist.txt").display(),
        );
        write(&dir.path().join("pgbouncer.ini"), &config);
        let mut bouncer = PgBouncer {
            binary,
            dir,
            port,
            child: None,
        };
        bouncer.launch().await;
        bouncer
    }

    /// Starts the process and waits until it accepts connections.
    async fn launch(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("pgbouncer.log"))
            .expect("open the log");
        let mut command = Command::new(&self.binary);
        // PgBouncer refuses to run as root: it switches to `postgres` itself.
        if is_root() {
            command.args(["-u", "postgres"]);
        }
        let child = command
            .arg(self.dir.path().join("pgbouncer.ini"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("the log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|error| panic!("start {}: {error}", self.binary.display()));
        self.child = Some(child);
        let started = Instant::now();
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            let exited = self
                .child
                .as_mut()
                .and_then(|child| child.try_wait().ok().flatten());
            if exited.is_some() || started.elapsed() > PATIENCE {
                panic!("PgBouncer did not start ({exited:?}):\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the process (`SIGTERM`: PgBouncer's immediate shutdown, which closes every client
    /// and server connection), and waits until it is gone.
    pub async fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let started = Instant::now();
        while child.try_wait().ok().flatten().is_none() {
            if started.elapsed() > PATIENCE {
                let _ = child.kill();
                let _ = child.wait();
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the process and starts it again on the same port: every client and server
    /// connection is cut, and new ones are taken.
    pub async fn restart(&mut self) {
        self.stop().await;
        self.launch().await;
    }

    /// What it logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Creates role `name` (LOGIN, with the password of `server`'s settings, if any) and a schema
/// of the same name it owns and finds its tables in (`ALTER ROLE ... SET search_path`), so
/// that its sessions need no startup `options`, which PgBouncer refuses. Returns the password
/// (empty without one). `admin` is connected to `server` as a role that may create roles.
pub async fn create_role_with_schema(
    admin: &tokio_postgres::Client,
    server: &tokio_postgres::Config,
    name: &str,
) -> Result<String, tokio_postgres::Error> {
    let password = server
        .get_password()
        .map(|password| String::from_utf8_lossy(password).into_owned())
        .unwrap_or_default();
    let with_password = if password.is_empty() {
        String::new()
    } else {
        format!(" PASSWORD '{}'", password.replace('\'', "''"))
    };
    admin
        .batch_execute(&format!(
            "CREATE ROLE {name} LOGIN{with_password}; \
             CREATE SCHEMA {name} AUTHORIZATION {name}; \
             ALTER ROLE {name} SET search_path = {name}"
        ))
        .await?;
    Ok(password)
}

/// A test's own role and schema in the database of `TEST_DATABASE_URL`, with the `orders`
/// table, and a PgBouncer of its own in front of the server: the stores connect through it,
/// the test reads the tables directly. Dropped with its connections at the end.
pub struct Bounced {
    /// The role and its schema.
    pub name: String,
    /// `TEST_DATABASE_URL`.
    url: String,
    password: String,
    pub bouncer: PgBouncer,
}

impl Bounced {
    /// A fresh role and schema and a PgBouncer with `pool_size` server connections for them,
    /// or `None` (after saying so) when `TEST_DATABASE_URL` is not set.
    pub async fn create(pool_size: usize) -> Option<Bounced> {
        let FreshName {
            url,
            name,
            now,
            first,
        } = FreshName::new("TEST_DATABASE_URL", "PostgreSQL", PREFIX)?;
        let server: tokio_postgres::Config = url.parse().expect("TEST_DATABASE_URL is a valid URL");
        let admin = connect(&server).await;
        if first {
            sweep_stale(&admin, now).await;
        }
        let password = create_role_with_schema(&admin, &server, &name)
            .await
            .expect("create the test role and schema");
        let upstream = upstream(&server);
        let bouncer =
            PgBouncer::start((&upstream.0, upstream.1), pool_size, &[(&name, &password)]).await;
        let db = Bounced {
            name,
            url,
            password,
            bouncer,
        };
        db.execute(ORDERS_SCHEMA).await;
        Some(db)
    }

    /// The database's name on the server (the same through PgBouncer).
    fn dbname(&self) -> String {
        let server: tokio_postgres::Config = self.url.parse().expect("a valid URL");
        server
            .get_dbname()
            .map(str::to_owned)
            .or_else(|| server.get_user().map(str::to_owned))
            .unwrap_or_else(|| "postgres".to_owned())
    }

    /// Connection settings through PgBouncer, as the test's role.
    pub fn config(&self) -> tokio_postgres::Config {
        let mut config = tokio_postgres::Config::new();
        config
            .host("127.0.0.1")
            .port(self.bouncer.port)
            .user(&self.name)
            .dbname(self.dbname())
            .application_name(&self.name)
            .connect_timeout(Duration::from_secs(5));
        if !self.password.is_empty() {
            config.password(&self.password);
        }
        config
    }

    /// The same as a URL.
    pub fn url(&self) -> String {
        let password = if self.password.is_empty() {
            String::new()
        } else {
            format!(":{}", percent_encoded(&self.password))
        };
        format!(
            "postgres://{name}{password}@127.0.0.1:{port}/{db}?application_name={name}",
            name = self.name,
            port = self.bouncer.port,
            db = self.dbname(),
        )
    }

    /// Connection settings straight to the server, as the test's role: for the test's own
    /// reads, past PgBouncer.
    pub fn direct_config(&self) -> tokio_postgres::Config {
        let mut config: tokio_postgres::Config = self.url.parse().expect("a valid URL");
        config.user(&self.name).application_name(&self.name);
        config
    }

    /// sqlx connection settings through PgBouncer, as the test's role (sqlx's defaults
    /// otherwise: it sends `extra_float_digits`, which PgBouncer is told to ignore).
    pub fn sqlx_options(&self) -> PgConnectOptions {
        let options = PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.bouncer.port)
            .username(&self.name)
            .database(&self.dbname())
            .application_name(&self.name);
        if self.password.is_empty() {
            options
        } else {
            options.password(&self.password)
        }
    }

    /// A sqlx pool of at most `max` connections through PgBouncer.
    pub async fn sqlx_pool(&self, max: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(self.sqlx_options())
            .await
            .expect("connect the sqlx pool through PgBouncer")
    }

    /// A tokio-postgres store through PgBouncer, with unnamed statements and the tests' small
    /// pools (8 transaction connections, 4 read connections), customised by `customise`.
    pub async fn store_with(
        &self,
        customise: impl FnOnce(PostgresOptions) -> PostgresOptions,
    ) -> PostgresStore {
        let options = PostgresStore::builder(self.config())
            .with_unnamed_statements(true)
            .with_max_connections(8)
            .with_max_read_connections(4);
        customise(options)
            .build()
            .await
            .expect("open the PostgreSQL store through PgBouncer")
    }

    /// A sqlx store through PgBouncer (a pool of `max` connections, a read pool of `reads`),
    /// with unnamed statements, its table created.
    pub async fn sqlx_store(&self, max: u32, reads: u32) -> SqlxPostgresStore {
        let store = SqlxPostgresStore::builder(self.sqlx_pool(max).await)
            .with_max_read_connections(reads)
            .with_unnamed_statements(true)
            .build();
        store
            .migrate()
            .await
            .expect("create the table through PgBouncer");
        store
    }

    /// A connection of the test's own, straight to the server.
    pub async fn client(&self) -> tokio_postgres::Client {
        connect(&self.direct_config()).await
    }

    /// Runs `sql` straight on the server.
    pub async fn execute(&self, sql: &str) {
        self.client()
            .await
            .batch_execute(sql)
            .await
            .unwrap_or_else(|error| panic!("{sql}: {error}"));
    }

    /// The first column of the one row that `sql` returns, read straight from the server.
    pub async fn value<T: for<'a> FromSql<'a>>(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> T {
        self.client()
            .await
            .query_one(sql, params)
            .await
            .unwrap_or_else(|error| panic!("{sql}: {error}"))
            .get(0)
    }

    /// The orders as `(id, tenant_id, sku, quantity)`, by id.
    pub async fn orders(&self) -> Vec<(i64, String, String, i64)> {
        self.client()
            .await
            .query(
                "SELECT id, tenant_id, sku, quantity FROM orders ORDER BY id",
                &[],
            )
            .await
            .expect("orders")
            .iter()
            .map(|row| (row.get(0), row.get(1), row.get(2), row.get(3)))
            .collect()
    }

    /// The completed records of `create_order` as `(tenant, key, saved order id)`, by tenant
    /// and key.
    pub async fn recorded_orders(&self) -> Vec<(String, String, i64)> {
        self.client()
            .await
            .query(
                "SELECT tenant, idempotency_key, \
                 (convert_from(body, 'UTF8')::json ->> 'order_id')::bigint \
                 FROM idempotency_records \
                 WHERE state = 'completed' AND operation = 'create_order' ORDER BY 1, 2",
                &[],
            )
            .await
            .expect("records")
            .iter()
            .map(|row| (row.get(0), row.get(1), row.get(2)))
            .collect()
    }

    /// Records in any state.
    pub async fn row_count(&self) -> i64 {
        self.value("SELECT count(*) FROM idempotency_records", &[])
            .await
    }
}

impl Drop for Bounced {
    /// Stops PgBouncer, closes the role's sessions and drops its schema and the role. `Drop`
    /// cannot await, so this runs on a thread of its own; a failure only leaves them behind
    /// (swept by a later run).
    fn drop(&mut self) {
        if let Some(mut child) = self.bouncer.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let (url, name) = (self.url.clone(), self.name.clone());
        run_on_a_thread_of_its_own(move || async move {
            let Ok(config) = url.parse::<tokio_postgres::Config>() else {
                return;
            };
            let Ok((client, connection)) = config.connect(NoTls).await else {
                return;
            };
            tokio::spawn(connection);
            drop_role(&client, &name).await;
        });
    }
}

/// Closes the sessions of the role `name`, drops its schema, what it owns, and the role.
async fn drop_role(admin: &tokio_postgres::Client, name: &str) {
    let _ = admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE usename = $1 AND pid <> pg_backend_pid()",
            &[&name],
        )
        .await;
    let _ = admin
        .batch_execute(&format!(
            "SET lock_timeout = '5s'; DROP SCHEMA IF EXISTS {name} CASCADE; \
             DROP OWNED BY {name}; DROP ROLE IF EXISTS {name}"
        ))
        .await;
}

/// Drops the roles (and schemas) that earlier runs left behind, once an hour has passed.
async fn sweep_stale(admin: &tokio_postgres::Client, now: u64) {
    let Ok(rows) = admin
        .query(
            "SELECT rolname::text FROM pg_roles WHERE starts_with(rolname, $1)",
            &[&PREFIX],
        )
        .await
    else {
        return;
    };
    for row in rows {
        let name: String = row.get(0);
        if FreshName::is_stale(&name, PREFIX, now) {
            drop_role(admin, &name).await;
        }
    }
}

/// The first host and port of `config` (the server PgBouncer connects to).
fn upstream(config: &tokio_postgres::Config) -> (String, u16) {
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(host)) => host.clone(),
        _ => "127.0.0.1".to_owned(),
    };
    (host, config.get_ports().first().copied().unwrap_or(5432))
}

async fn connect(config: &tokio_postgres::Config) -> tokio_postgres::Client {
    let (client, connection) = config.connect(NoTls).await.expect("connect to PostgreSQL");
    tokio::spawn(connection);
    client
}

/// A port nobody listens on now (the kernel's choice).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

/// `text` with every byte but ASCII letters and digits percent-encoded (for a URL).
fn percent_encoded(text: &str) -> String {
    text.bytes()
        .map(|byte| {
            if byte.is_ascii_alphanumeric() {
                char::from(byte).to_string()
            } else {
                format!("%{byte:02X}")
            }
        })
        .collect()
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|output| String::from_utf8_lossy(&output.stdout).trim() == "0")
}

fn write(file: &Path, text: &str) {
    std::fs::write(file, text).unwrap_or_else(|error| panic!("write {}: {error}", file.display()));
    set_mode(file, 0o644);
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode));
}

// ----- an app instance as a child process (the SIGKILL test) -----

/// An app instance in a child process: this test binary run again, with only the test
/// `test` (registered as ignored: it serves only when started this way) and `env`, which
/// tells it what to serve. It prints `listening on http://ADDR` when it serves. Killed when
/// dropped.
pub struct ChildApp {
    pub addr: SocketAddr,
    child: tokio::process::Child,
}

impl ChildApp {
    /// Starts it and waits until it listens.
    pub async fn start(test: &str, env: &[(&str, String)]) -> ChildApp {
        use tokio::io::AsyncBufReadExt;
        let binary = std::env::current_exe().expect("the test binary");
        let mut child = tokio::process::Command::new(binary)
            .args([
                test,
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .envs(env.iter().map(|(name, value)| (*name, value)))
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("start the app instance");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let addr = tokio::time::timeout(Duration::from_secs(30), async {
            while let Ok(Some(line)) = lines.next_line().await {
                // After the harness's `test NAME ... `, on the same line.
                if let Some(addr) = line
                    .split_once("listening on http://")
                    .and_then(|(_, addr)| addr.trim().parse().ok())
                {
                    return Some(addr);
                }
            }
            None
        })
        .await
        .ok()
        .flatten()
        .expect("the app instance printed its address");
        // Keep draining stdout, so that the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        ChildApp { addr, child }
    }

    /// SIGKILL: nothing in flight gets to finish (its transactions end with its connections).
    pub async fn kill(mut self) {
        let _ = self.child.start_kill();
        let _ = tokio::time::timeout(PATIENCE, self.child.wait()).await;
    }
}
