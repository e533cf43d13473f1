//! SQLite: the store (one database file, one writer thread), its outbox and inbox, its admin
//! calls and its steps, all on the same file. The public path is `store::sqlite`
//! (the outbox and inbox are `Outbox<SqliteStore>` and `Inbox<SqliteStore>`).

#[cfg(feature = "outbox")]
pub(crate) mod outbox;
pub mod store;

mod admin;
pub(crate) mod error;
