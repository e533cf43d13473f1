//! One fixture per backend, so that a suite is written once as generic functions and run
//! against each: SQLite in a temp dir, PostgreSQL in a schema of its own (only when
//! `TEST_DATABASE_URL` is set; the PostgreSQL tests are reported as ignored otherwise).
//!
//! A suite declares `mod common; mod pg_common; mod backends;` and instantiates its generic
//! tests with [`backend_tests!`] once per backend module.

#![allow(dead_code)] // each suite uses what it needs

use std::net::SocketAddr;
use std::path::PathBuf;

use serde_json::Value;
use tempfile::TempDir;
use tower_idempotency::admin::AdminBackend;
use tower_idempotency::outbox::{EventId, Inbox, InboxBackend, OutboxBackend, Processed};
use tower_idempotency::store::postgres::PostgresStore;
use tower_idempotency::store::sqlite::SqliteStore;

use crate::common::TestServer;
use crate::pg_common::{PgServer, TestDb};

/// A database of one backend, with a store on it.
pub trait Backend: Sized {
    /// The store: it holds an outbox and inboxes.
    type Store: OutboxBackend + InboxBackend + AdminBackend;

    /// A fresh database, or `None` when this backend is not available.
    async fn open() -> Option<Self>;

    /// The store on it.
    fn store(&self) -> &Self::Store;

    /// Another store on the same database (another app instance, with a pool of its own).
    async fn another_store(&self) -> Self::Store;

    /// Enqueues an event outside any request (in a transaction of its own).
    async fn enqueue_now(&self, topic: &str, payload: Value) -> EventId;

    /// Rows in `outbox_events`.
    async fn event_count(&self) -> i64;

    /// The order app (`common`'s or `pg_common`'s) serving on this database.
    async fn serve(&self) -> Served;

    /// Runs SQL on the database, outside any request.
    async fn execute(&self, sql: &'static str);

    /// Rows in `idempotency_records`.
    async fn record_count(&self) -> i64;

    /// Rows in the order app's `orders`.
    async fn order_count(&self) -> i64;

    /// How the admin tool names this database: `--db PATH` or `--database-url URL`.
    fn tool_args(&self) -> Vec<String>;

    /// Processes `event_id` with `inbox`, applying it as `apply` says (the closure is the
    /// backend's: a `rusqlite` one on SQLite, a future on PostgreSQL).
    async fn process(
        inbox: &Inbox<Self::Store>,
        event_id: &str,
        apply: Apply,
    ) -> Result<Processed<i64>, tower_idempotency::Error>;

    /// Applies `event_id` through a request's transaction handle: one [`EFFECTS`] row.
    async fn apply_in(tx: &<Self::Store as InboxBackend>::Transaction, event_id: &str);

    /// Committed [`EFFECTS`] rows of `event_id`.
    async fn effects(&self, event_id: &str) -> i64;
}

/// The receiver's effect in the inbox suites: one row per application of an event.
pub const EFFECTS: &str = "CREATE TABLE effects (event_id TEXT NOT NULL, note TEXT NOT NULL)";

/// What an inbox suite's closure does.
#[derive(Clone, Copy, Debug)]
pub enum Apply {
    /// Nothing (`Ok(0)`).
    Nothing,
    /// Inserts the event's [`EFFECTS`] row; returns the event's rows as the transaction sees
    /// them.
    Effect,
    /// Inserts the row, then fails.
    EffectThenFail,
    /// Runs a statement on a table that does not exist.
    BrokenStatement,
}

/// The SQL of [`Apply::Effect`]'s insert, and what [`Apply::EffectThenFail`] fails with.
const INSERT_EFFECT: &str = "INSERT INTO effects (event_id, note) VALUES ($1, 'applied')";
pub const FAILURE: &str = "the receiver failed";

/// The order app serving on a backend's database.
pub enum Served {
    Sqlite(TestServer),
    Postgres(PgServer),
}

impl Served {
    pub fn addr(&self) -> SocketAddr {
        match self {
            Served::Sqlite(server) => server.addr,
            Served::Postgres(server) => server.addr,
        }
    }

    pub async fn shutdown(self) {
        match self {
            Served::Sqlite(server) => drop(server),
            Served::Postgres(server) => server.shutdown().await,
        }
    }
}

/// A SQLite file in a temp dir.
pub struct Sqlite {
    store: SqliteStore,
    dir: TempDir,
}

impl Sqlite {
    fn path(&self) -> PathBuf {
        self.dir.path().join("orders.db")
    }
}

impl Backend for Sqlite {
    type Store = SqliteStore;

    async fn open() -> Option<Self> {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = SqliteStore::open(dir.path().join("orders.db"))
            .await
            .expect("open");
        Some(Sqlite { store, dir })
    }

    async fn serve(&self) -> Served {
        Served::Sqlite(TestServer::builder().db_path(self.path()).spawn().await)
    }

    async fn execute(&self, sql: &'static str) {
        crate::common::execute(&self.store, sql).await;
    }

    async fn record_count(&self) -> i64 {
        crate::common::record_count(&self.store).await
    }

    async fn order_count(&self) -> i64 {
        crate::common::order_count(&self.store).await
    }

    fn tool_args(&self) -> Vec<String> {
        vec!["--db".into(), self.path().display().to_string()]
    }

    async fn process(
        inbox: &Inbox<SqliteStore>,
        event_id: &str,
        apply: Apply,
    ) -> Result<Processed<i64>, tower_idempotency::Error> {
        let id = event_id.to_owned();
        inbox
            .process(event_id, move |tx| {
                let insert = INSERT_EFFECT.replace('$', "?");
                match apply {
                    Apply::Nothing => return Ok(0),
                    Apply::BrokenStatement => {
                        tx.execute("INSERT INTO no_such_table VALUES (1)", [])?;
                        return Ok(0);
                    }
                    Apply::Effect | Apply::EffectThenFail => tx.execute(&insert, [&id])?,
                };
                if let Apply::EffectThenFail = apply {
                    // Any `rusqlite` error that carries the message will do.
                    return Err(rusqlite::Error::InvalidParameterName(FAILURE.into()));
                }
                tx.query_row(
                    "SELECT count(*) FROM effects WHERE event_id = ?1",
                    [&id],
                    |row| row.get(0),
                )
            })
            .await
    }

    async fn apply_in(tx: &tower_idempotency::store::sqlite::SqliteTransaction, event_id: &str) {
        let id = event_id.to_owned();
        let insert = INSERT_EFFECT.replace('$', "?");
        tx.run(move |conn| conn.execute(&insert, [id]))
            .await
            .expect("apply");
    }

    async fn effects(&self, event_id: &str) -> i64 {
        let id = event_id.to_owned();
        self.store
            .read(move |conn| {
                conn.query_row(
                    "SELECT count(*) FROM effects WHERE event_id = ?1",
                    [id],
                    |row| row.get(0),
                )
            })
            .await
            .expect("count effects")
    }

    fn store(&self) -> &SqliteStore {
        &self.store
    }

    async fn another_store(&self) -> SqliteStore {
        SqliteStore::open(self.dir.path().join("orders.db"))
            .await
            .expect("open")
    }

    async fn enqueue_now(&self, topic: &str, payload: Value) -> EventId {
        let topic = topic.to_owned();
        self.store
            .write(move |tx| tower_idempotency::outbox::sqlite::enqueue(tx, &topic, &payload))
            .await
            .expect("enqueue")
    }

    async fn event_count(&self) -> i64 {
        self.store
            .read(|conn| conn.query_row("SELECT count(*) FROM outbox_events", [], |row| row.get(0)))
            .await
            .expect("count events")
    }
}

/// A PostgreSQL schema of its own, dropped at the end.
pub struct Postgres {
    store: PostgresStore,
    pub db: TestDb,
}

impl Backend for Postgres {
    type Store = PostgresStore;

    async fn open() -> Option<Self> {
        let db = TestDb::create().await?;
        let store = db
            .store_with(|o| o.max_connections(4).max_read_connections(2))
            .await;
        Some(Postgres { store, db })
    }

    fn store(&self) -> &PostgresStore {
        &self.store
    }

    async fn serve(&self) -> Served {
        Served::Postgres(PgServer::spawn(&self.db).await)
    }

    async fn execute(&self, sql: &'static str) {
        self.db.execute(sql).await;
    }

    async fn record_count(&self) -> i64 {
        self.db.record_count().await
    }

    async fn order_count(&self) -> i64 {
        self.db.order_count().await
    }

    fn tool_args(&self) -> Vec<String> {
        vec!["--database-url".into(), self.db.url()]
    }

    async fn process(
        inbox: &Inbox<PostgresStore>,
        event_id: &str,
        apply: Apply,
    ) -> Result<Processed<i64>, tower_idempotency::Error> {
        let id = event_id.to_owned();
        inbox
            .process(event_id, move |tx| async move {
                let client = tx.client().await?;
                match apply {
                    Apply::Nothing => return Ok(0),
                    Apply::BrokenStatement => {
                        client
                            .execute("INSERT INTO no_such_table VALUES (1)", &[])
                            .await?;
                        return Ok(0);
                    }
                    Apply::Effect | Apply::EffectThenFail => {
                        client.execute(INSERT_EFFECT, &[&id]).await?
                    }
                };
                if let Apply::EffectThenFail = apply {
                    return Err(tower_idempotency::Error::Corrupt(FAILURE.into()));
                }
                let row = client
                    .query_one("SELECT count(*) FROM effects WHERE event_id = $1", &[&id])
                    .await?;
                Ok(row.try_get(0)?)
            })
            .await
    }

    async fn apply_in(
        tx: &tower_idempotency::store::postgres::PostgresTransaction,
        event_id: &str,
    ) {
        let client = tx.client().await.expect("client");
        client
            .execute(INSERT_EFFECT, &[&event_id])
            .await
            .expect("apply");
    }

    async fn effects(&self, event_id: &str) -> i64 {
        self.db
            .client()
            .await
            .query_one(
                "SELECT count(*) FROM effects WHERE event_id = $1",
                &[&event_id],
            )
            .await
            .expect("count effects")
            .get(0)
    }

    async fn another_store(&self) -> PostgresStore {
        self.db
            .store_with(|o| o.max_connections(4).max_read_connections(2))
            .await
    }

    /// Autocommit, on a pooled connection.
    async fn enqueue_now(&self, topic: &str, payload: Value) -> EventId {
        let client = self.store.client().await.expect("client");
        tower_idempotency::outbox::postgres::enqueue(&**client, topic, &payload)
            .await
            .expect("enqueue")
    }

    async fn event_count(&self) -> i64 {
        self.db
            .client()
            .await
            .query_one("SELECT count(*) FROM outbox_events", &[])
            .await
            .expect("count events")
            .get(0)
    }
}

/// `backend_tests!(#[attributes] Backend => test, test, ...)`: one `#[tokio::test]` per name,
/// calling the generic `super::name::<Backend>(backend)` on a fresh database (and passing if
/// the backend is not available, which the attributes then report as ignored).
#[macro_export]
macro_rules! backend_tests {
    ($(#[$attribute:meta])* $backend:ty => $($name:ident),+ $(,)?) => {
        $crate::backend_tests!(@names [$(#[$attribute])*] $backend; $($name),+);
    };
    (@names $attributes:tt $backend:ty; $($name:ident),+) => {
        $($crate::backend_tests!(@one $attributes $backend, $name);)+
    };
    (@one [$($attribute:tt)*] $backend:ty, $name:ident) => {
        $($attribute)*
        #[tokio::test]
        async fn $name() {
            let Some(backend) = <$backend as $crate::backends::Backend>::open().await else {
                return;
            };
            super::$name(backend).await;
        }
    };
}
