//! The PostgreSQL app: the layer's route as in `examples/orders/postgres.rs`, the
//! hand-written baseline and a plain `GET /orders/{id}`, on one server whose tables live in a
//! schema of their own (created fresh for each concurrency level, dropped after it).

use std::str::FromStr;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::header::LOCATION;
use axum::http::StatusCode;
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde_json::{json, Value};
use tower_idempotency::extract::Tx;
use tower_idempotency::fingerprint::Fingerprinter;
type PostgresOutbox =
    tower_idempotency::outbox::Outbox<tower_idempotency::store::tokio_postgres::PostgresStore>;

use tower_idempotency::store::sqlx_postgres::sqlx::postgres::{
    PgConnectOptions, PgPool, PgPoolOptions,
};
use tower_idempotency::store::sqlx_postgres::sqlx::{self, Executor as _, Row as _};
use tower_idempotency::store::sqlx_postgres::{SqlxPostgresHandle, SqlxPostgresStore};
use tower_idempotency::store::tokio_postgres::deadpool_postgres::{
    Manager, ManagerConfig, Pool, RecyclingMethod,
};
use tower_idempotency::store::tokio_postgres::tokio_postgres::{self, NoTls};
use tower_idempotency::store::tokio_postgres::{PostgresHandle, PostgresStore};
use tower_idempotency::store::ReplayCheck;
use tower_idempotency::{IdempotencyLayer, Tenant};

use crate::hand::{postgres_transaction, sqlx_transaction, HandRequest, OPERATION};
use crate::servers::{authenticate, ApiError, NewOrder};
use crate::BoxError;

/// The `application_name` of every connection this benchmark opens for serving, so that the
/// CPU time of their backends can be found.
pub(crate) const APPLICATION_NAME: &str = "tower-idempotency-bench";

/// Connections of the layer's transaction pool and of the hand-written handler's pool.
pub(crate) const POOL_SIZE: usize = 32;

const ORDERS_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS orders (
    id        BIGSERIAL PRIMARY KEY,
    tenant_id TEXT   NOT NULL,
    sku       TEXT   NOT NULL,
    quantity  BIGINT NOT NULL
);";

#[derive(Clone)]
pub(crate) struct PgState {
    pub(crate) store: PostgresStore,
    /// Case AR: the same, with the replay check in the reservation (its pools are made
    /// lazily, so they open connections only when AR runs).
    pub(crate) reservation_store: PostgresStore,
    /// The hand-written handler's own pool (deadpool, as a user would set it up).
    pub(crate) hand: Pool,
    /// The sqlx store (case SA), on a `PgPool` of its own.
    pub(crate) sqlx_store: SqlxPostgresStore,
    /// The sqlx hand-written handler's pool (case SH).
    pub(crate) sqlx_hand: PgPool,
}

/// The database side of a PostgreSQL server: its state, and the schema to drop at the end.
pub(crate) struct PgDatabase {
    pub(crate) state: PgState,
    admin: tokio_postgres::Client,
    schema: String,
}

impl PgDatabase {
    /// Creates schema `schema` with the crate's tables (records, outbox) and `orders`.
    pub(crate) async fn create(url: &str, schema: &str) -> Result<Self, BoxError> {
        let (admin, connection) = tokio_postgres::connect(url, NoTls).await?;
        tokio::spawn(connection);
        admin
            .batch_execute(&format!(
                "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
            ))
            .await?;
        let mut config: tokio_postgres::Config = url.parse()?;
        config.options(format!("-c search_path={schema}"));
        config.application_name(APPLICATION_NAME);
        let store = PostgresStore::builder(config.clone())
            .with_max_connections(POOL_SIZE)
            .build()
            .await?;
        store.client().await?.batch_execute(ORDERS_SCHEMA).await?;
        let reservation_store = PostgresStore::builder(config.clone())
            .with_max_connections(POOL_SIZE)
            .with_max_read_connections(1)
            .with_replay_check(ReplayCheck::FavorNewKeys)
            .with_create_schema(false)
            .build()
            .await?;
        PostgresOutbox::install(&store).await?;
        let manager = Manager::from_config(
            config,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let hand = Pool::builder(manager).max_size(POOL_SIZE).build()?;
        let sqlx_options = PgConnectOptions::from_str(url)?
            .options([("search_path", schema)])
            .application_name(APPLICATION_NAME);
        let sqlx_pool = || {
            PgPoolOptions::new()
                .max_connections(POOL_SIZE as u32)
                .connect_lazy_with(sqlx_options.clone())
        };
        let sqlx_store = SqlxPostgresStore::builder(sqlx_pool()).build();
        let sqlx_hand = sqlx_pool();
        Ok(PgDatabase {
            state: PgState {
                store,
                reservation_store,
                hand,
                sqlx_store,
                sqlx_hand,
            },
            admin,
            schema: schema.to_owned(),
        })
    }

    /// The schema the tables live in.
    pub(crate) fn schema(&self) -> &str {
        &self.schema
    }

    /// The process ids of the backends serving this benchmark's connections.
    pub(crate) async fn backends(&self) -> Result<Vec<i32>, BoxError> {
        let rows = self
            .admin
            .query(
                "SELECT pid FROM pg_stat_activity WHERE application_name = $1",
                &[&APPLICATION_NAME],
            )
            .await?;
        Ok(rows.iter().filter_map(|row| row.try_get(0).ok()).collect())
    }

    /// Orders with `sku`, as committed now.
    pub(crate) async fn count_orders(&self, sku: &str) -> Result<i64, BoxError> {
        let table = format!("{}.orders", self.schema);
        let row = self
            .admin
            .query_one(
                &format!("SELECT count(*) FROM {table} WHERE sku = $1"),
                &[&sku],
            )
            .await?;
        Ok(row.try_get(0)?)
    }

    /// Inserts `count` orders with `sku` (what the GET baseline reads); returns the first id.
    pub(crate) async fn insert_orders(&self, sku: &str, count: u64) -> Result<i64, BoxError> {
        let table = format!("{}.orders", self.schema);
        let row = self
            .admin
            .query_one(
                &format!(
                    "WITH inserted AS (INSERT INTO {table} (tenant_id, sku, quantity) \
                     SELECT 'shop-a', $1, 1 FROM generate_series(1, $2::bigint) RETURNING id) \
                     SELECT min(id) FROM inserted"
                ),
                &[&sku, &(count as i64)],
            )
            .await?;
        Ok(row.try_get(0)?)
    }

    /// Closes the pools and drops the schema.
    pub(crate) async fn drop_schema(self) -> Result<(), BoxError> {
        let PgDatabase {
            state,
            admin,
            schema,
        } = self;
        state.hand.close();
        state.sqlx_store.pool().close().await;
        state.sqlx_store.read_pool().close().await;
        state.sqlx_hand.close().await;
        drop(state);
        // Closed pools end their connections in the background: give them a moment.
        tokio::time::sleep(Duration::from_millis(100)).await;
        admin
            .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
            .await?;
        Ok(())
    }
}

pub(crate) fn app(state: PgState) -> Router {
    let idempotency = IdempotencyLayer::new(state.store.clone())
        .with_operation(OPERATION)
        .with_fingerprinter(Fingerprinter::json());
    let reservation_idempotency = IdempotencyLayer::new(state.reservation_store.clone())
        .with_operation(OPERATION)
        .with_fingerprinter(Fingerprinter::json());
    let sqlx_idempotency = IdempotencyLayer::new(state.sqlx_store.clone())
        .with_operation(OPERATION)
        .with_fingerprinter(Fingerprinter::json());
    Router::new()
        .route("/orders", post(create_order).layer(idempotency))
        .route("/orders/{id}", get(get_order))
        .route(
            "/reservation/orders",
            post(create_order).layer(reservation_idempotency),
        )
        .route("/hand/orders", post(create_order_hand))
        .route(
            "/sqlx/orders",
            post(create_order_sqlx).layer(sqlx_idempotency),
        )
        .route("/sqlx/hand/orders", post(create_order_sqlx_hand))
        .layer(middleware::from_fn(authenticate))
        .with_state(state)
}

/// `POST /orders` under the layer: the handler of `examples/orders/postgres.rs`.
pub(crate) async fn create_order(
    Extension(tenant): Extension<Tenant>,
    Tx(tx): Tx<PostgresHandle>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let order = NewOrder::parse(&body)?;
    let client = tx.client().await.map_err(internal)?;
    let insert = client
        .prepare_cached(
            "INSERT INTO orders (tenant_id, sku, quantity) VALUES ($1, $2, $3) RETURNING id",
        )
        .await
        .map_err(internal)?;
    let order_id: i64 = client
        .query_one(&insert, &[&tenant.as_str(), &order.sku, &order.quantity])
        .await
        .map_err(internal)?
        .try_get(0)
        .map_err(internal)?;
    let event = json!({
        "order_id": order_id,
        "tenant": tenant.as_str(),
        "sku": order.sku,
        "quantity": order.quantity,
    });
    PostgresOutbox::enqueue_in(&client, "order_created", &event)
        .await
        .map_err(internal)?;
    let response = (
        StatusCode::CREATED,
        [(LOCATION, format!("/orders/{order_id}"))],
        Json(json!({ "order_id": order_id })),
    );
    Ok(response.into_response())
}

/// Baseline H: the hand-written transaction, no layer.
async fn create_order_hand(
    State(state): State<PgState>,
    request: Request,
) -> Result<Response, ApiError> {
    let request = HandRequest::read(request).await?;
    let outcome = postgres_transaction(&state.hand, &request)
        .await
        .map_err(internal)?;
    Ok(outcome.into_response())
}

/// Case SA: `POST /orders` under the layer on the sqlx store, the handler of
/// `examples/orders_sqlx.rs` plus the outbox event, as [`create_order`].
async fn create_order_sqlx(
    Extension(tenant): Extension<Tenant>,
    Tx(tx): Tx<SqlxPostgresHandle>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let order = NewOrder::parse(&body)?;
    let mut conn = tx.acquire().await.map_err(internal)?;
    let insert = sqlx::query(
        "INSERT INTO orders (tenant_id, sku, quantity) VALUES ($1, $2, $3) RETURNING id",
    )
    .bind(tenant.as_str())
    .bind(&order.sku)
    .bind(order.quantity);
    let order_id: i64 = (&mut *conn)
        .fetch_one(insert)
        .await
        .map_err(internal)?
        .try_get(0)
        .map_err(internal)?;
    let event = json!({
        "order_id": order_id,
        "tenant": tenant.as_str(),
        "sku": order.sku,
        "quantity": order.quantity,
    });
    tower_idempotency::outbox::Outbox::<SqlxPostgresStore>::enqueue_in(
        &mut *conn,
        "order_created",
        &event,
    )
    .await
    .map_err(internal)?;
    let response = (
        StatusCode::CREATED,
        [(LOCATION, format!("/orders/{order_id}"))],
        Json(json!({ "order_id": order_id })),
    );
    Ok(response.into_response())
}

/// Baseline SH: the hand-written transaction on sqlx, no layer.
async fn create_order_sqlx_hand(
    State(state): State<PgState>,
    request: Request,
) -> Result<Response, ApiError> {
    let request = HandRequest::read(request).await?;
    let outcome = sqlx_transaction(&state.sqlx_hand, &request)
        .await
        .map_err(internal)?;
    Ok(outcome.into_response())
}

/// Baseline R: a plain `GET /orders/{id}` (a pooled connection, a prepared statement).
async fn get_order(
    State(state): State<PgState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let order_id: i64 = id.parse().map_err(|_| ApiError::NotFound)?;
    let client = state.hand.get().await.map_err(internal)?;
    let select = client
        .prepare_cached("SELECT sku, quantity FROM orders WHERE id = $1 AND tenant_id = $2")
        .await
        .map_err(internal)?;
    let row = client
        .query_opt(&select, &[&order_id, &tenant.as_str()])
        .await
        .map_err(internal)?
        .ok_or(ApiError::NotFound)?;
    let sku: String = row.try_get(0).map_err(internal)?;
    let quantity: i64 = row.try_get(1).map_err(internal)?;
    Ok(Json(
        json!({ "order_id": order_id, "sku": sku, "quantity": quantity }),
    ))
}

fn internal(error: impl std::fmt::Display) -> ApiError {
    tracing::error!(%error, "request failed");
    ApiError::Internal
}
