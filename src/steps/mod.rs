#![doc = include_str!("../docs/steps.md")]

mod backend;
mod completer;
mod handle;
pub(crate) mod mode;
mod outcome;

#[cfg(feature = "_sql-store")]
pub(crate) use backend::sealed;
#[cfg(feature = "_sql-store")]
pub(crate) use backend::{check_saved_step, new_run_id, ADMIN_WAIT};
#[allow(unused_imports)] // what each backend needs of them differs by feature
pub(crate) use backend::{
    Acquired, Claim, Lease, SavedRequest, SavedStep, StepKind, StepOutcome, StepRow,
};
pub use backend::{
    Progress, ProgressCursor, ProgressPage, ProgressQuery, ProgressStatus, Resolution, Settled,
    StepStore,
};

/// The protocol a [`StepStore`] runs and the rows it reads and writes, for this repository's tests,
/// which drive the backends directly. Not part of the API: only with the undocumented
/// `_internal-tests` feature (no semver promise), which the crate's dev-dependency on itself turns
/// on.
#[cfg(feature = "_internal-tests")]
#[doc(hidden)]
pub mod __private {
    pub use super::backend::sealed::StepProtocol;
    pub use super::backend::{
        Acquired, Claim, Lease, SavedRequest, SavedStep, StepKind, StepOutcome, StepRow,
    };
}
pub use completer::{Completer, CompleterReport};
pub use handle::{step_key, Steps};
pub use outcome::{Answer, Ask, CallAgain, Foreign, LeaveInDoubt, OnUnknown, Recovery, StepError};

#[cfg(feature = "_sql-store")]
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
