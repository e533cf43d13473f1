//! The sqlx driver: the store written once over sqlx's databases ([`store`], public as
//! `store::sqlx_postgres`, `store::sqlx_mysql` and `store::sqlx_sqlite`), the calls that take a sqlx executor
//! ([`outbox`]), the driver seam of the shared engine ([`driver`]), how sqlx errors are classified
//! ([`error`]), and each database's part: [`postgres`] (feature `sqlx-postgres`), [`mysql`]
//! (feature `sqlx-mysql`) and [`sqlite`] (feature `sqlx-sqlite`).

pub(crate) mod store;

pub(crate) mod driver;
pub(crate) mod error;
#[cfg(feature = "sqlx-mysql")]
pub(crate) mod mysql;
#[cfg(feature = "outbox")]
pub(crate) mod outbox;
#[cfg(feature = "sqlx-postgres")]
pub(crate) mod postgres;
#[cfg(feature = "sqlx-sqlite")]
pub(crate) mod sqlite;
