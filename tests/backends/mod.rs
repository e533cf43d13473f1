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
use tower_idempotency::outbox::{EventId, InboxBackend, OutboxBackend};
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
}

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
