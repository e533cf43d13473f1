//! PostgreSQL, the dialect both of its drivers speak (tokio-postgres in `src/tokio_postgres/`,
//! sqlx in `src/sqlx/postgres/`): all of its SQL (the store's, the outbox's and the admin's),
//! how a request's transaction begins, its failover rules and its guard rules.

pub(crate) mod admin_sql;
pub(crate) mod failover;
pub(crate) mod guard;
#[cfg(feature = "outbox")]
pub(crate) mod outbox_sql;
pub(crate) mod reserve;
pub(crate) mod steps_sql;
pub(crate) mod store_sql;
