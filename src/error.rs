//! Errors: what the store reports, and what the layer answers.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};

use crate::fingerprint::FingerprintError;
use crate::key::KeyError;

/// A failure of the store or of a transaction handle.
///
/// Store errors never reach the client as they are: the layer turns those for which
/// [`Error::is_busy`] is true ([`Error::Busy`], a conflict, an [unavailable](Error::is_unavailable)
/// database) into `503` with `Retry-After` and everything else into `500`, and logs the cause.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The write lock could not be taken within the lock timeout (another request or
    /// another process holds it). Retryable with the same key.
    #[error("the store is busy: the write lock was not acquired in time")]
    Busy,
    /// Another transaction (another instance's request with the same key) held the key's row
    /// past the bound of the layer's [in-flight policy](crate::InFlight): the layer answers
    /// `409` with `Retry-After`, as for a duplicate running in the same process. Retryable
    /// with the same key.
    #[error("the key is held by a request still running (another instance)")]
    InFlight,
    /// The transaction was already committed or rolled back; the handle can no longer be used.
    #[error("the idempotency transaction has already finished")]
    TransactionFinished,
    /// The transaction was ended by the database itself (for example a full disk rolls it
    /// back), or by a statement the handler ran (`COMMIT`, `ROLLBACK`).
    #[error("the idempotency transaction was aborted: {0}")]
    TransactionAborted(&'static str),
    /// A transaction handle refused a statement that would end or start a transaction
    /// (`COMMIT`, `ROLLBACK`, `BEGIN`..., and on SQLite any statement on the request's
    /// savepoint; the statement is named). Nothing of it ran, and the transaction goes on: the
    /// layer commits it with the response, so a handler runs no transaction control of its own
    /// (ending or splitting the transaction behind the layer's back would keep rows without a
    /// record).
    #[error("{0} refused: the layer commits; run no transaction control in a handler")]
    TransactionControl(&'static str),
    /// A statement run through a transaction handle failed with a serialization failure or a
    /// deadlock (PostgreSQL `40001`, `40P01`) and the database rolled the transaction back:
    /// what the store reports for it at commit or rollback, so that the layer runs the
    /// request again (the handler itself got the database's error). Retryable.
    #[error("a statement in the transaction conflicted with a concurrent one: {0}")]
    StatementConflict(String),
    /// The database went away or cannot take writes: the connection was lost, the server is
    /// shutting down or starting (`57P01`, `57P02`, `57P03`), it is read-only (`25006`: a
    /// standby, or an old primary after a failover), or no host accepted the connection. It is
    /// what a store reports when one of the handler's statements got such an error: the
    /// transaction is gone, whatever the handler answered. Nothing of the request was kept;
    /// retryable with the same key (a failover usually ends within seconds).
    #[error("the database is unavailable (a failover?): {0}")]
    Unavailable(String),
    /// A statement run through a transaction handle waited for a lock past the layer's lock
    /// timeout (MySQL and MariaDB `1205`: a row lock, or a metadata lock such as another
    /// session's `LOCK TABLES`), and the handler then failed: what the store reports at
    /// rollback, so that the layer answers `503` with `Retry-After` rather than the handler's
    /// own error. Nothing of the request was kept; retryable with the same key.
    #[error("a statement in the transaction waited for a lock past the lock timeout: {0}")]
    LockTimeout(String),
    /// The connection was lost after `COMMIT` was sent: the transaction may or may not have
    /// committed. Retryable with the same key, and only that way: the next attempt replays
    /// the saved response if it committed and runs afresh if it did not, so the layer answers
    /// `503` with `Retry-After`, never a final failure.
    #[error(
        "the outcome of the commit is unknown (the connection was lost after COMMIT was sent): {0}"
    )]
    CommitOutcomeUnknown(String),
    /// The commit failed (for example, the disk is full); nothing of the request was kept.
    #[error("the commit failed: {0}")]
    CommitFailed(String),
    /// Another request of the same SQLite commit group ended the transaction the group shared
    /// (its statement rolled the transaction back, or the group's `COMMIT` failed on what one
    /// member left behind): nothing of this request was kept, through no fault of its own. The
    /// layer runs the request again, on its own, without the client seeing it.
    #[error("the commit group was rolled back by another request: {0}")]
    GroupRolledBack(String),
    /// A call that needs the store's writer to itself, made from inside a request that holds
    /// the writer: it would wait for the request to end, and the request for it. Run the
    /// statements in the request's transaction instead (its handle's `run`, such as
    /// `SqliteHandle::run`).
    #[error("{0} was called inside a request's transaction on the same store; it would wait for that request to end: use SqliteHandle::run (the request's handle) instead")]
    InsideRequest(&'static str),
    /// A closure run on the store's connection panicked.
    #[error("a closure run on the store connection panicked")]
    Panicked,
    /// The store's background connection is gone (the store was shut down).
    #[error("the store is closed")]
    Closed,
    /// A step-by-step request's commit was refused: its lease passed and another request
    /// (or the completer) took the key over. Nothing was written; the layer answers `503` with
    /// `Retry-After`.
    #[error("the key's lease was lost: another request took it over")]
    LeaseLost,
    /// A step was to be written at a position where the key saved another step (another
    /// name or kind), or a result over a saved one: the handler's steps differ from the
    /// saved ones. Nothing was written.
    #[error("the steps changed: at position {position} the key saved {saved}")]
    StepsChanged {
        /// The position.
        position: u32,
        /// The step saved there (`kind name`, with `(done)` when it has its result).
        saved: String,
    },
    /// A step's result could not be written as JSON (or read back into the handler's type).
    #[error("a step's result could not be encoded or decoded: {0}")]
    StepResult(String),
    /// A saved record could not be decoded.
    #[error("corrupt idempotency record: {0}")]
    Corrupt(String),
    /// An error from SQLite.
    #[cfg(feature = "sqlite")]
    #[error(transparent)]
    Sqlite(#[from] rusqlite::Error),
    /// An error from tokio-postgres (the `tokio-postgres` store, or its pool's connection);
    /// the sqlx stores' PostgreSQL errors are [`Sqlx`](Self::Sqlx).
    #[cfg(feature = "tokio-postgres")]
    #[error("PostgreSQL: {}", DriverError::detail(.0))]
    TokioPostgres(#[from] tokio_postgres::Error),
    /// An error from sqlx (the `sqlx-postgres`, `sqlx-mysql` or `sqlx-sqlite` store, or its
    /// pool).
    #[cfg(any(
        feature = "sqlx-postgres",
        feature = "sqlx-mysql",
        feature = "sqlx-sqlite"
    ))]
    #[error("sqlx: {0}")]
    Sqlx(#[from] sqlx::Error),
    /// An I/O error (opening the database, for example).
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// The few kinds of database failure the layer acts on. Each driver sorts its own errors into
/// them ([`DriverError`]); the `is_*` methods of [`Error`] read them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ErrorKind {
    /// Retry later: a lock not taken in time, no free connection, a full disk.
    Busy,
    /// The database rolled the transaction back because it conflicted with a concurrent one
    /// (a serialization failure or a deadlock).
    Conflict,
    /// The database went away or cannot take writes (a failover, a restart).
    Unavailable,
    /// A lock wait timed out (PostgreSQL `55P03`, MySQL and MariaDB `1205`).
    LockTimeout,
    /// Anything else: not retryable as such.
    Other,
}

/// A driver's error, as the driver classifies it: each driver implements it for its error type
/// in its own folder (`src/sqlite/error.rs`, `src/tokio_postgres/error.rs`, `src/sqlx/error.rs`),
/// so that this file names the drivers' error types (its variants) but none of their modules.
#[cfg(feature = "_sql-store")]
pub(crate) trait DriverError: std::error::Error {
    /// Which of the layer's kinds of failure this is.
    fn classify(&self) -> ErrorKind;

    /// What [`Error`]'s `Display` shows of it: by default its own `Display` (only
    /// tokio-postgres's says more: its own names the kind of error alone).
    #[cfg_attr(not(feature = "tokio-postgres"), allow(dead_code))]
    fn detail(&self) -> String {
        self.to_string()
    }
}

impl Error {
    /// The kind of failure this is, as its driver classifies it.
    fn kind(&self) -> ErrorKind {
        match self {
            Error::Unavailable(_) | Error::CommitOutcomeUnknown(_) => ErrorKind::Unavailable,
            Error::StatementConflict(_) => ErrorKind::Conflict,
            Error::Busy | Error::InFlight | Error::LeaseLost => ErrorKind::Busy,
            Error::LockTimeout(_) => ErrorKind::LockTimeout,
            #[cfg(feature = "sqlite")]
            Error::Sqlite(e) => e.classify(),
            #[cfg(feature = "tokio-postgres")]
            Error::TokioPostgres(e) => e.classify(),
            #[cfg(feature = "_sqlx-store")]
            Error::Sqlx(e) => e.classify(),
            _ => ErrorKind::Other,
        }
    }

    /// Whether the database rolled the transaction back because it conflicted with a
    /// concurrent one (a serialization failure or a deadlock): running it again may commit.
    pub fn is_serialization_conflict(&self) -> bool {
        self.kind() == ErrorKind::Conflict
    }

    /// Whether the database went away or cannot take writes (a failover, a restart): the
    /// connection was lost (before or after `COMMIT`), the server refused it or is
    /// shutting down or starting (`57P01`, `57P02`, `57P03`, class `08`), or it is read-only
    /// (`25006`). Retryable with the same key; [`is_busy`](Self::is_busy) is true for these too.
    pub fn is_unavailable(&self) -> bool {
        self.kind() == ErrorKind::Unavailable
    }

    /// Whether the request may simply be retried later with the same key: the store was busy,
    /// or [unavailable](Self::is_unavailable).
    pub fn is_busy(&self) -> bool {
        self.kind() != ErrorKind::Other
    }

    /// Whether a lock wait timed out (PostgreSQL `55P03`, MySQL and MariaDB `1205`).
    #[cfg(feature = "_row-lock-store")]
    pub(crate) fn is_lock_wait_timeout(&self) -> bool {
        self.kind() == ErrorKind::LockTimeout
    }
}

/// Everything the layer answers on its own instead of (or after) calling the inner service.
///
/// Each has a status and a short stable `code` used in the default JSON error body
/// `{"error":"<code>"}`. Replace the body with
/// [`IdempotencyLayer::with_error_responder`](crate::IdempotencyLayer::with_error_responder).
#[derive(Debug)]
#[non_exhaustive]
pub enum Rejection {
    /// The route requires an `Idempotency-Key` and the request has none. `400`.
    MissingKey,
    /// The `Idempotency-Key` header was sent more than once. `400`.
    DuplicateKeyHeader,
    /// The `Idempotency-Key` is empty, too long or malformed. `400`.
    InvalidKey(KeyError),
    /// No tenant could be found for the request (unauthenticated). `401`.
    MissingTenant,
    /// The request body is larger than the limit. `413`.
    BodyTooLarge,
    /// The layer has no [operation name](crate::IdempotencyLayer::with_operation), and the
    /// request's path, which names the operation then, is longer than
    /// [`MAX_OPERATION_LEN`](crate::MAX_OPERATION_LEN) bytes: no store's records could hold it.
    /// `414`; nothing stored, handler not run.
    OperationTooLong,
    /// The request body did not arrive within the body timeout. `408`.
    BodyTimeout,
    /// The request body could not be read (the client went away or sent a broken stream). `400`.
    BodyRead,
    /// The body could not be canonicalized (invalid JSON, invalid UTF-8, too deep...). `400`.
    InvalidPayload(FingerprintError),
    /// The key was already used in this scope with a different payload. `409` by default.
    KeyReused,
    /// A request with the same key is still running, and the layer's
    /// [in-flight policy](crate::InFlight) answers at once (or after its bound) rather than
    /// wait for it. `409` with `Retry-After`; retry later with the same key.
    InFlight,
    /// The store is busy; retry later with the same key. `503` with `Retry-After`.
    Busy,
    /// A step-by-step request's call to another service has an unknown outcome that its
    /// policy leaves to an operator: the key is in doubt until resolved. `409`.
    InDoubt,
    /// The handler panicked; everything was rolled back. `500`.
    HandlerPanicked,
    /// The handler's response was too large to save; everything was rolled back. `500`.
    ResponseTooLarge,
    /// The handler's response body failed; everything was rolled back. `500`.
    ResponseBody,
    /// The store failed; everything was rolled back. `500`.
    Store(Arc<Error>),
}

impl Rejection {
    /// The default HTTP status of this rejection (before any per-layer override).
    pub fn status(&self) -> StatusCode {
        match self {
            Rejection::MissingKey
            | Rejection::DuplicateKeyHeader
            | Rejection::InvalidKey(_)
            | Rejection::BodyRead
            | Rejection::InvalidPayload(_) => StatusCode::BAD_REQUEST,
            Rejection::MissingTenant => StatusCode::UNAUTHORIZED,
            Rejection::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Rejection::OperationTooLong => StatusCode::URI_TOO_LONG,
            Rejection::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            Rejection::KeyReused | Rejection::InFlight | Rejection::InDoubt => StatusCode::CONFLICT,
            Rejection::Busy => StatusCode::SERVICE_UNAVAILABLE,
            Rejection::HandlerPanicked
            | Rejection::ResponseTooLarge
            | Rejection::ResponseBody
            | Rejection::Store(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The short stable code used in the default error body.
    pub fn code(&self) -> &'static str {
        match self {
            Rejection::MissingKey => "missing_idempotency_key",
            Rejection::DuplicateKeyHeader => "duplicate_idempotency_key_header",
            Rejection::InvalidKey(KeyError::TooLong { .. }) => "idempotency_key_too_long",
            Rejection::InvalidKey(_) => "invalid_idempotency_key",
            Rejection::MissingTenant => "unauthenticated",
            Rejection::BodyTooLarge => "payload_too_large",
            Rejection::OperationTooLong => "operation_too_long",
            Rejection::BodyTimeout => "request_body_timeout",
            Rejection::BodyRead => "request_body_unreadable",
            Rejection::InvalidPayload(e) => e.code(),
            Rejection::KeyReused => "key_reused_with_different_payload",
            Rejection::InFlight => "request_in_flight",
            Rejection::InDoubt => "outcome_in_doubt",
            Rejection::Busy => "busy_retry_later",
            Rejection::HandlerPanicked => "internal_error",
            Rejection::ResponseTooLarge => "response_too_large_to_save",
            Rejection::ResponseBody => "internal_error",
            Rejection::Store(_) => "internal_error",
        }
    }

    /// The gRPC status code this rejection is answered with when the request is gRPC
    /// (`content-type: application/grpc`).
    pub fn grpc_code(&self) -> i32 {
        // https://grpc.github.io/grpc/core/md_doc_statuscodes.html
        const INVALID_ARGUMENT: i32 = 3;
        const DEADLINE_EXCEEDED: i32 = 4;
        const RESOURCE_EXHAUSTED: i32 = 8;
        const FAILED_PRECONDITION: i32 = 9;
        const ABORTED: i32 = 10;
        const INTERNAL: i32 = 13;
        const UNAVAILABLE: i32 = 14;
        const UNAUTHENTICATED: i32 = 16;
        match self {
            Rejection::MissingKey
            | Rejection::DuplicateKeyHeader
            | Rejection::InvalidKey(_)
            | Rejection::BodyRead
            | Rejection::InvalidPayload(_)
            | Rejection::OperationTooLong => INVALID_ARGUMENT,
            Rejection::MissingTenant => UNAUTHENTICATED,
            Rejection::BodyTooLarge => RESOURCE_EXHAUSTED,
            Rejection::BodyTimeout => DEADLINE_EXCEEDED,
            Rejection::KeyReused | Rejection::InDoubt => FAILED_PRECONDITION,
            Rejection::InFlight => ABORTED,
            Rejection::Busy => UNAVAILABLE,
            Rejection::HandlerPanicked
            | Rejection::ResponseTooLarge
            | Rejection::ResponseBody
            | Rejection::Store(_) => INTERNAL,
        }
    }

    /// Whether the client may retry with the same key and the same payload.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Rejection::Busy
                | Rejection::InFlight
                | Rejection::BodyTimeout
                | Rejection::BodyRead
                | Rejection::HandlerPanicked
                | Rejection::ResponseBody
                | Rejection::Store(_)
        )
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

/// The default error body: `{"error":"<code>"}` with `Content-Type: application/json`.
pub(crate) fn default_error_response(rejection: &Rejection, status: StatusCode) -> Response<Bytes> {
    let body = Bytes::from(format!("{{\"error\":\"{}\"}}", rejection.code()));
    let mut response = Response::new(body);
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

#[cfg(all(test, feature = "_sqlx-store"))]
mod tests {
    use super::Error;

    /// A connection that broke (before or after `COMMIT`) is unavailable, a `503`. The check
    /// is outside any one driver's cfg, so a build with only `sqlx-mysql` has it too (tests
    /// cannot build that set alone: the crate's own dev-dependency enables every store).
    #[test]
    fn a_lost_sqlx_connection_is_unavailable() {
        let lost = Error::Sqlx(sqlx::Error::Io(std::io::Error::from(
            std::io::ErrorKind::ConnectionReset,
        )));
        assert!(lost.is_unavailable());
        assert!(lost.is_busy());
        assert!(Error::Sqlx(sqlx::Error::WorkerCrashed).is_unavailable());
        assert!(!Error::Sqlx(sqlx::Error::RowNotFound).is_unavailable());
    }
}
