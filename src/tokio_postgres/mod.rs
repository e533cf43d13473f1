//! The tokio-postgres driver (feature `tokio-postgres`): the PostgreSQL store on a deadpool pool, its
//! outbox and inbox, the driver seam of the shared engine ([`driver`]) and how its errors are
//! classified ([`error`]). The public path is `store::tokio_postgres`.

#[cfg(feature = "outbox")]
pub(crate) mod outbox;
pub mod store;

pub(crate) mod driver;
pub(crate) mod error;
