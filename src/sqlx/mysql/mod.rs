//! MySQL and MariaDB on sqlx (feature `sqlx-mysql`): the store (public as
//! `store::sqlx_mysql`), its driver seam and how
//! its error numbers are classified ([`error`]).

pub mod store;

pub(crate) mod driver;
pub(crate) mod error;
