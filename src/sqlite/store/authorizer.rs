//! Transaction control on the writer connection is the store's alone.
//!
//! The writer connection's authorizer (installed when the store opens) refuses `BEGIN`,
//! `COMMIT`, `ROLLBACK`, `END` and any statement on the request's savepoint unless the store
//! itself runs it, through [`Writer::control`] ([`ControlAllowed`] lets it through while it
//! lives). [`ControlSql`] holds the store's own statements, which `group` runs;
//! [`ControlGuard::error`] turns a refusal met by a handler's statement (`handle`) or a
//! `SqliteStore::write` closure into [`Error::TransactionControl`].

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;

use rusqlite::Connection;

use super::writer::Writer;
use crate::error::Error;

/// The name of the savepoint that isolates one request inside a group.
const REQUEST_SAVEPOINT: &str = "tower_idempotency_request";

/// The store's own transaction-control statements.
///
/// Only the store may run transaction control on the writer: the connection's authorizer
/// refuses it to every other statement (see [`Writer::control`]). The cached ones carry a
/// comment unique to the store, so that a handler's `prepare_cached` of the same words cannot
/// fetch one of these (authorized) statements from the connection's statement cache.
pub(super) struct ControlSql {
    pub(super) begin: String,
    pub(super) savepoint: String,
    pub(super) release: String,
    pub(super) commit: String,
    pub(super) rollback_request: String,
}

impl ControlSql {
    pub(super) fn new() -> Self {
        use std::hash::{BuildHasher, Hasher};
        // Random per process and store (the standard library seeds it from the OS).
        let nonce = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        let tag = format!("/* tower-idempotency {nonce:016x} */");
        ControlSql {
            begin: format!("BEGIN IMMEDIATE {tag}"),
            savepoint: format!("SAVEPOINT {REQUEST_SAVEPOINT} {tag}"),
            release: format!("RELEASE {REQUEST_SAVEPOINT} {tag}"),
            commit: format!("COMMIT {tag}"),
            rollback_request: format!(
                "ROLLBACK TO {REQUEST_SAVEPOINT}; RELEASE {REQUEST_SAVEPOINT}"
            ),
        }
    }
}

/// What the writer connection's authorizer reads and writes.
#[derive(Default)]
pub(super) struct ControlGuard {
    /// Set while the store runs its own transaction control.
    allowed: AtomicBool,
    /// The statement last refused, as an index into [`REFUSED`].
    refused: AtomicU8,
}

/// The statements the authorizer refuses, by name.
const REFUSED: [&str; 6] = [
    "BEGIN",
    "COMMIT",
    "ROLLBACK",
    "SAVEPOINT of the request's savepoint",
    "RELEASE of the request's savepoint",
    "ROLLBACK TO the request's savepoint",
];

impl ControlGuard {
    /// `error` from a statement of a handler (or a `write` closure): the authorizer's refusal
    /// becomes [`Error::TransactionControl`], naming the statement.
    pub(super) fn error(&self, error: rusqlite::Error) -> Error {
        if error.sqlite_error_code() != Some(rusqlite::ErrorCode::AuthorizationForStatementDenied) {
            return Error::from(error);
        }
        let refused = REFUSED
            .get(usize::from(self.refused.load(Ordering::Relaxed)))
            .copied()
            .unwrap_or("transaction control");
        Error::TransactionControl(refused)
    }
}

/// Lets the store's own transaction control through the authorizer while it lives.
pub(super) struct ControlAllowed<'a>(&'a ControlGuard);

impl<'a> ControlAllowed<'a> {
    pub(super) fn new(guard: &'a ControlGuard) -> Self {
        guard.allowed.store(true, Ordering::Relaxed);
        ControlAllowed(guard)
    }
}

impl Drop for ControlAllowed<'_> {
    fn drop(&mut self) {
        self.0.allowed.store(false, Ordering::Relaxed);
    }
}

/// Installs the writer connection's authorizer: transaction control (`BEGIN`, `COMMIT`,
/// `ROLLBACK`, `END`) and any statement on the request's savepoint are refused unless the
/// store itself runs them. A handler's own savepoints (other names) are allowed: they nest
/// inside the request's and end with it.
pub(super) fn refuse_foreign_transaction_control(
    conn: &mut Connection,
    guard: Arc<ControlGuard>,
) -> rusqlite::Result<()> {
    use rusqlite::hooks::{AuthAction, AuthContext, Authorization, TransactionOperation};
    conn.authorizer(Some(move |context: AuthContext<'_>| {
        let refused = match context.action {
            AuthAction::Transaction { operation } => Some(match operation {
                TransactionOperation::Begin => 0,
                TransactionOperation::Rollback => 2,
                // `COMMIT` and `END`, which SQLite reports as an operation of their own.
                _ => 1,
            }),
            AuthAction::Savepoint {
                operation,
                savepoint_name,
            } if savepoint_name.eq_ignore_ascii_case(REQUEST_SAVEPOINT) => Some(match operation {
                TransactionOperation::Release => 4,
                TransactionOperation::Rollback => 5,
                _ => 3,
            }),
            _ => None,
        };
        match refused {
            Some(statement) if !guard.allowed.load(Ordering::Relaxed) => {
                guard.refused.store(statement, Ordering::Relaxed);
                Authorization::Deny
            }
            _ => Authorization::Allow,
        }
    }))
}

impl Writer {
    /// Runs the store's own transaction control: the authorizer refuses it to everyone else.
    pub(super) fn control<T>(&self, f: impl FnOnce(&Connection) -> T) -> T {
        let _allowed = ControlAllowed::new(&self.control);
        f(&self.conn)
    }
}
