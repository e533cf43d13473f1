//! SQLite on sqlx (feature `sqlx-sqlite`): the store (public as `store::sqlx_sqlite`), its
//! driver seam ([`driver`]), how its result codes are classified ([`error`]) and the
//! statements a handler may not run ([`guard`]).

pub mod store;

pub(crate) mod driver;
pub(crate) mod error;
pub(crate) mod guard;
