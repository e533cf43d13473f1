//! SQLite on sqlx (feature `sqlx-sqlite`), in this one folder: the store (public as
//! `store::sqlx_sqlite`, with its SQL), its driver seam and the engine's steps, outbox, inbox
//! and admin calls on it ([`driver`], with their SQL in [`steps_sql`], `outbox_sql` and
//! [`admin_sql`], and their migrations in `migrations/`), how its result codes are classified
//! ([`error`]) and the statements a handler may not run ([`guard`]).

pub mod store;

pub(crate) mod admin_sql;
pub(crate) mod driver;
pub(crate) mod error;
pub(crate) mod guard;
#[cfg(feature = "outbox")]
pub(crate) mod outbox_sql;
pub(crate) mod steps_sql;
