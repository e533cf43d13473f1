//! Step-by-step requests: a handler that calls another service (charges a card) between its
//! writes is safe to retry too.
//!
//! One transaction cannot hold a call to another service: if the request fails after the
//! call, or the server is killed, or the client times out and retries, the retry would call
//! again. With [`IdempotencyLayer::with_steps`](crate::IdempotencyLayer::with_steps) the
//! handler gets a [`Steps`] handle instead of a transaction, and runs its work as named steps:
//!
//! - [`Steps::local`]: a closure in a transaction of its own; its rows, its result and the
//!   key's progress commit together. On a retry a finished step returns its saved result and
//!   does not run: exactly once.
//! - [`Steps::foreign`]: a call to another service with a key derived from the request's
//!   (stable across retries: [`Steps::step_key`]) as that service's idempotency key. The
//!   intent commits before the call, the result after it. When a retry finds an intent without
//!   a result, the step's policy decides: [`CallAgain`] (the service deduplicates), [`Ask`]
//!   the service, or [`LeaveInDoubt`] for an operator. There is no default.
//! - A final answer from a step ([`Foreign::terminal`]: a declined card, `402`) is saved as the
//!   key's response; a transient failure ([`Foreign::unavailable`], [`Foreign::unknown`]) is
//!   not: the key is released, the client gets `503` with `Retry-After`, and the retry resumes
//!   where this request stopped.
//! - The steps are checked on resume: a handler whose steps no longer match the saved ones
//!   (renamed, reordered) gets [`StepError::Changed`], never a silent mix.
//! - A request holds its key under a lease with a generation number: a request that stalled
//!   past its lease, while a retry took the key over, has its commits refused
//!   ([`StepError::LeaseLost`]), so two processes never both advance one key.
//! - A [`Completer`] you spawn drives keys left part-way to their end without the client, with
//!   bounded attempts, then a dead letter. Retention never purges a key in progress or in
//!   doubt: they live in their own tables until they finish.
//!
//! The final response is saved like any other record (a `2xx` by default, or any answer but a
//! `5xx` after a terminal step), and replayed to every retry.
//!
//! ```no_run
//! # #[cfg(all(feature = "sqlite", feature = "axum"))]
//! # mod example {
//! use axum::{http::StatusCode, Json};
//! use serde_json::{json, Value};
//! use tower_idempotency::steps::{CallAgain, Foreign, StepError, Steps};
//! use tower_idempotency::store::sqlite::SqliteStore;
//!
//! async fn checkout(
//!     steps: Steps<SqliteStore>,
//!     Json(order): Json<Value>,
//! ) -> Result<(StatusCode, Json<Value>), StepError> {
//!     let sku = order["sku"].as_str().unwrap_or_default().to_owned();
//!     // 1. A local step: its own transaction.
//!     let order_id: i64 = steps
//!         .local("insert_order", move |tx| {
//!             tx.execute("INSERT INTO orders (sku, status) VALUES (?1, 'pending')", [sku])?;
//!             Ok(tx.last_insert_rowid())
//!         })
//!         .await?;
//!     // 2. A foreign step: the payment provider deduplicates by the step key.
//!     let charge_id: String = steps
//!         .foreign("charge", CallAgain, |key| async move {
//!             charge_card(&key, order_id).await
//!         })
//!         .await?;
//!     // 3. Another local step.
//!     let charge = charge_id.clone();
//!     steps
//!         .local("mark_paid", move |tx| {
//!             tx.execute(
//!                 "UPDATE orders SET status = 'paid', charge_id = ?1 WHERE id = ?2",
//!                 tower_idempotency::store::sqlite::rusqlite::params![charge, order_id],
//!             )
//!         })
//!         .await?;
//!     Ok((StatusCode::CREATED, Json(json!({ "order_id": order_id, "charge_id": charge_id }))))
//! }
//!
//! async fn charge_card(key: &str, order_id: i64) -> Result<String, Foreign> {
//!     // POST to the provider with `Idempotency-Key: {key}`; map its answers:
//!     // 2xx -> Ok(charge id); 402 -> Foreign::terminal(..); 503 before charging ->
//!     // Foreign::unavailable(..); a timeout -> Foreign::unknown(..).
//!     # let _ = (key, order_id);
//!     Ok("ch_1".to_owned())
//! }
//! # }
//! ```
//!
//! The route: `post(checkout).layer(IdempotencyLayer::new(store).with_operation("checkout").with_steps())`,
//! after `store.install_steps()` once at start-up. The `checkout` example is a whole
//! application with a payment provider (`payments`), a completer and a kill in the middle.

mod backend;
mod completer;
mod handle;
pub(crate) mod mode;
mod outcome;

#[allow(unused_imports)] // what each backend needs of them differs by feature
pub(crate) use backend::{
    Acquired, Claim, Lease, SavedRequest, SavedStep, StepKind, StepOutcome, StepRow,
};
pub use backend::{Progress, ProgressStatus, Resolution, StepStore};

/// The rows a [`StepStore`] reads and writes. Not part of the API (no semver promise): only this
/// crate's backends implement [`StepStore`]; the crate's own tests drive them through this path.
#[doc(hidden)]
pub mod __private {
    pub use super::backend::{
        Acquired, Claim, Lease, SavedRequest, SavedStep, StepKind, StepOutcome, StepRow,
    };
}
pub use completer::{Completer, CompleterReport};
pub use handle::{step_key, Steps};
pub use outcome::{Answer, Ask, CallAgain, Foreign, LeaveInDoubt, OnUnknown, Recovery, StepError};

#[cfg(sql_store)]
#[cfg_attr(not(feature = "sqlite"), allow(unused_imports))]
pub(crate) use outcome::Stored;

#[cfg(feature = "axum")]
impl<St: StepStore, S: Send + Sync> axum_core::extract::FromRequestParts<S> for Steps<St> {
    type Rejection = crate::extract::MissingTransaction;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Steps<St>>()
            .cloned()
            .ok_or(crate::extract::MissingTransaction)
    }
}
