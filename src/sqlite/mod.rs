//! SQLite: the store (one database file, one writer thread), its outbox and inbox, its admin
//! calls and its steps, all on the same file. The public paths are `store::sqlite` and
//! `outbox::sqlite`.

#[cfg(feature = "outbox")]
pub mod outbox;
pub mod store;

mod admin;
pub(crate) mod error;
