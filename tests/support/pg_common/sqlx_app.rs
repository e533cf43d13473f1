//! The order app of the PostgreSQL tests on the sqlx store ([`SqlxPostgresStore`], built from
//! a `PgPool` of the test's schema): the same routes, hooks and handler as the tokio-postgres
//! app of this module's parent, only the store and the handle differ.

use std::str::FromStr;

use tower_idempotency::store::sqlx_postgres::sqlx::postgres::{
    PgConnectOptions, PgPool, PgPoolOptions,
};
use tower_idempotency::store::sqlx_postgres::{SqlxPostgresHandle, SqlxPostgresStore};
use tower_idempotency::Tenant;

use super::{HookOutcome, TestDb};
use crate::common::server_backed::OrderServer;
use crate::common::{AppBuilder, HookFor, InsertOrder, OrderCallOf};

impl TestDb {
    /// The sqlx connection settings of this schema, marked with its name (the schema's cleanup
    /// closes their connections).
    pub fn sqlx_options(&self) -> PgConnectOptions {
        PgConnectOptions::from_str(&self.url)
            .expect("TEST_DATABASE_URL is a valid URL")
            .options([("search_path", self.schema.as_str())])
            .application_name(&self.schema)
    }

    /// A sqlx pool of at most `max` connections on this schema, marked with its name (the
    /// schema's cleanup closes them).
    pub async fn sqlx_pool(&self, max: u32) -> PgPool {
        let options = self.sqlx_options();
        PgPoolOptions::new()
            .max_connections(max)
            .connect_with(options)
            .await
            .expect("connect the sqlx pool")
    }

    /// A sqlx pool of at most `max` connections on this schema through the proxy listening
    /// on 127.0.0.1:`port`.
    pub async fn sqlx_pool_via(&self, max: u32, port: u16) -> PgPool {
        let options = self.sqlx_options().host("127.0.0.1").port(port);
        PgPoolOptions::new()
            .max_connections(max)
            .connect_with(options)
            .await
            .expect("connect the sqlx pool")
    }

    /// A sqlx store on this schema (a pool of `max` connections, a read pool of `reads`),
    /// with its table created.
    pub async fn sqlx_store(&self, max: u32, reads: u32) -> SqlxPostgresStore {
        let store = SqlxPostgresStore::builder(self.sqlx_pool(max).await)
            .with_max_read_connections(reads)
            .build();
        store.migrate().await.expect("create the table");
        store
    }
}

impl InsertOrder for SqlxPostgresHandle {
    async fn insert_order(
        &self,
        tenant: &Tenant,
        sku: &str,
        quantity: i64,
    ) -> Result<i64, tower_idempotency::Error> {
        let mut conn = self.acquire().await?;
        // The `query!` family on the layer's connection, as an application writes it: checked
        // at build time against `tests/support/.sqlx/` (`.cargo/config.toml` says how to check
        // it again). Under the `query-macros` feature (CI), else the same query's function form.
        #[cfg(feature = "query-macros")]
        let insert = sqlx::query_scalar!(
            "INSERT INTO orders (tenant_id, sku, quantity) VALUES ($1, $2, $3) RETURNING id",
            tenant.as_str(),
            sku,
            quantity
        );
        #[cfg(not(feature = "query-macros"))]
        let insert = sqlx::query_scalar::<_, i64>(
            "INSERT INTO orders (tenant_id, sku, quantity) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(tenant.as_str())
        .bind(sku)
        .bind(quantity);
        Ok(insert.fetch_one(&mut *conn).await?)
    }
}

/// What the sqlx app's handler tells its hook.
pub type SqlxOrderCall = OrderCallOf<SqlxPostgresHandle>;
pub type SqlxHook = HookFor<SqlxOrderCall, HookOutcome>;

/// What only the sqlx app takes: nothing yet (the tests' pool sizes are fixed).
#[derive(Default)]
pub struct SqlxPgApp;

pub type SqlxServerBuilder = AppBuilder<SqlxPostgresStore, SqlxHook, SqlxPgApp>;

impl SqlxServerBuilder {
    /// Serves the app on a store of its own (its own pools) over `db`'s schema: 8 transaction
    /// connections and 4 read connections, as the tokio-postgres app.
    pub async fn spawn(self, db: &TestDb) -> SqlxServer {
        self.serve_on(db.sqlx_store(8, 4).await).await
    }
}

/// A running sqlx order app on 127.0.0.1 and its store.
pub type SqlxServer = OrderServer<SqlxPostgresStore, SqlxPostgresHandle, HookOutcome>;
