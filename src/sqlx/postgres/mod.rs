//! PostgreSQL on sqlx (feature `sqlx-postgres`): the store (public as `store::sqlx_postgres`)
//! and its driver seam.

pub mod store;

pub(crate) mod driver;
