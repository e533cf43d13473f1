//! MySQL and MariaDB, the dialect of the sqlx MySQL store (`src/sqlx/mysql/`): all of its SQL
//! (the store's, the outbox's and the admin's) and its guard rules. Its error numbers are
//! read by the driver (`src/sqlx/mysql/error.rs`).

pub(crate) mod admin_sql;
pub(crate) mod guard;
#[cfg(feature = "outbox")]
pub(crate) mod outbox_sql;
pub(crate) mod steps_sql;
pub(crate) mod store_sql;
