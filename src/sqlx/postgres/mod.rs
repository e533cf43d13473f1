//! PostgreSQL on sqlx (feature `sqlx-postgres`): the store (public as `store::sqlx_postgres`),
//! its outbox and inbox (`outbox::sqlx_postgres`) and its driver seam.

#[cfg(feature = "outbox")]
pub mod outbox;
pub mod store;

pub(crate) mod driver;
