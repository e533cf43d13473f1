//! What steps return and how they fail: [`StepError`], a foreign call's [`Foreign`] failure,
//! a terminal [`Answer`], and the policies for a call whose outcome is unknown.

use std::fmt;
use std::future::Future;

use http::StatusCode;
use serde::Serialize;

use crate::body::BoxError;
use crate::error::Error;

/// A final answer given by a step (a declined card: `402`), saved as the step's result and
/// as the key's response: every retry gets it again, and nothing after it is called again.
#[derive(Clone, Debug, PartialEq)]
pub struct Answer {
    status: StatusCode,
    body: serde_json::Value,
}

impl Answer {
    /// An answer with `status` and a JSON `body`.
    pub fn new(status: StatusCode, body: serde_json::Value) -> Self {
        Answer { status, body }
    }

    /// Its status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// Its JSON body.
    pub fn body(&self) -> &serde_json::Value {
        &self.body
    }

    /// As an `http` response with a JSON body.
    pub fn to_response(&self) -> http::Response<String> {
        let mut response = http::Response::new(self.body.to_string());
        *response.status_mut() = self.status;
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        response
    }
}

/// How a foreign call failed.
#[derive(Debug)]
pub enum Foreign {
    /// The service did not do it and said so (it answered `503` before acting, the connection
    /// was refused): the intent is dropped, the key released, and the client answered `503`
    /// with `Retry-After`; the retry calls again.
    Unavailable(BoxError),
    /// It may or may not have happened (a timeout, a connection lost after sending): the
    /// intent stays, the key is released, the client is answered `503` with `Retry-After`, and
    /// the retry does what the step's [`OnUnknown`] policy says.
    Unknown(BoxError),
    /// A final answer (a declined card): saved as the step's result and as the key's response.
    Terminal(Answer),
}

impl Foreign {
    /// [`Foreign::Unavailable`].
    pub fn unavailable(error: impl Into<BoxError>) -> Self {
        Foreign::Unavailable(error.into())
    }

    /// [`Foreign::Unknown`].
    pub fn unknown(error: impl Into<BoxError>) -> Self {
        Foreign::Unknown(error.into())
    }

    /// [`Foreign::Terminal`] with `status` and a JSON `body`.
    pub fn terminal(status: StatusCode, body: serde_json::Value) -> Self {
        Foreign::Terminal(Answer::new(status, body))
    }
}

/// What a retry that finds a foreign step's intent without its result may do.
#[derive(Debug)]
pub enum Recovery<T> {
    /// Call again with the same step key.
    CallAgain,
    /// The call happened with this result: go on from there.
    Done(T),
    /// Leave the key in doubt for an operator.
    InDoubt,
}

/// A foreign step's policy for an unknown outcome: [`CallAgain`], [`Ask`] or
/// [`LeaveInDoubt`].
pub trait OnUnknown<T> {
    /// Decides, given the step's key.
    fn recover(self, step_key: String) -> impl Future<Output = Result<Recovery<T>, Foreign>>;
}

/// Call again with the same step key: for a service that deduplicates by its idempotency key.
#[derive(Clone, Copy, Debug)]
pub struct CallAgain;

impl<T> OnUnknown<T> for CallAgain {
    async fn recover(self, _: String) -> Result<Recovery<T>, Foreign> {
        Ok(Recovery::CallAgain)
    }
}

/// Never call again: leave the key in doubt, answered `409` `outcome_in_doubt` until an
/// operator resolves it (`Admin::resolve_steps`).
#[derive(Clone, Copy, Debug)]
pub struct LeaveInDoubt;

impl<T> OnUnknown<T> for LeaveInDoubt {
    async fn recover(self, _: String) -> Result<Recovery<T>, Foreign> {
        Ok(Recovery::InDoubt)
    }
}

/// Ask the service what happened: the closure gets the step key and returns the call's
/// result if it happened (`Some`), `None` if it did not (the step calls again), or a
/// [`Foreign`] failure (asking failed: [`Foreign::Unavailable`] and [`Foreign::Unknown`] both
/// answer `503` and leave the intent for the next retry; [`Foreign::Terminal`] is final).
pub struct Ask<F>(pub F);

impl<F> fmt::Debug for Ask<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Ask(..)")
    }
}

impl<T, F, Fut> OnUnknown<T> for Ask<F>
where
    F: FnOnce(String) -> Fut,
    Fut: Future<Output = Result<Option<T>, Foreign>>,
{
    async fn recover(self, step_key: String) -> Result<Recovery<T>, Foreign> {
        Ok(match (self.0)(step_key).await {
            Ok(Some(value)) => Recovery::Done(value),
            Ok(None) => Recovery::CallAgain,
            Err(Foreign::Unavailable(error) | Foreign::Unknown(error)) => {
                return Err(Foreign::Unknown(error))
            }
            Err(terminal) => return Err(terminal),
        })
    }
}

/// Why a step did not return its value. With the `axum` feature it is a response: return it
/// from the handler with `?`.
#[derive(Debug)]
#[non_exhaustive]
pub enum StepError {
    /// A step gave a final answer (saved): answer with it (`into_response`, or
    /// [`Answer::to_response`]). The layer saves the handler's response as the key's, unless
    /// it is a `5xx`.
    Terminal(Answer),
    /// A foreign service failed transiently: the layer releases the key and answers `503` with
    /// `Retry-After`; the retry resumes here.
    Transient(BoxError),
    /// The step's outcome is unknown and its policy leaves it to an operator: the key is in
    /// doubt (`409` `outcome_in_doubt` until resolved).
    InDoubt {
        /// The step.
        step: String,
    },
    /// The handler's steps no longer match the saved ones (renamed, reordered): `500`
    /// `steps_changed`; the key is released as it was.
    Changed {
        /// The position.
        position: u32,
        /// The step saved there.
        saved: String,
        /// The step called there.
        called: String,
    },
    /// Another request took the key over (this one stalled past its lease): nothing more is
    /// written. `503` with `Retry-After`.
    LeaseLost,
    /// An earlier step of this request stopped it (lease lost, in doubt, changed): no more
    /// steps run.
    Stopped,
    /// The store failed, or a local step's closure did: the step rolled back. `503` if the
    /// error [is busy](Error::is_busy), else `500`.
    Store(Error),
}

impl fmt::Display for StepError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StepError::Terminal(answer) => write!(f, "a step answered {}", answer.status),
            StepError::Transient(error) => write!(f, "a foreign service failed: {error}"),
            StepError::InDoubt { step } => write!(f, "the outcome of step {step:?} is unknown"),
            StepError::Changed {
                position,
                saved,
                called,
            } => write!(
                f,
                "the steps changed: at position {position} the key saved {saved}, the handler called {called}"
            ),
            StepError::LeaseLost => f.write_str("another request took the key over"),
            StepError::Stopped => f.write_str("an earlier step stopped this request"),
            StepError::Store(error) => write!(f, "{error}"),
        }
    }
}

impl std::error::Error for StepError {}

impl From<Error> for StepError {
    fn from(error: Error) -> Self {
        StepError::Store(error)
    }
}

impl StepError {
    /// The status and error code a handler answers this with.
    pub fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            StepError::Terminal(answer) => (answer.status, ""),
            StepError::Transient(_) | StepError::LeaseLost | StepError::Stopped => {
                (StatusCode::SERVICE_UNAVAILABLE, "busy_retry_later")
            }
            StepError::InDoubt { .. } => (StatusCode::CONFLICT, "outcome_in_doubt"),
            StepError::Changed { .. } => (StatusCode::INTERNAL_SERVER_ERROR, "steps_changed"),
            StepError::Store(error) if error.is_busy() => {
                (StatusCode::SERVICE_UNAVAILABLE, "busy_retry_later")
            }
            StepError::Store(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal_error"),
        }
    }

    /// As an `http` response with a JSON body (`Retry-After: 1` on a `503`).
    pub fn to_response(&self) -> http::Response<String> {
        if let StepError::Terminal(answer) = self {
            return answer.to_response();
        }
        let (status, code) = self.status_and_code();
        let mut response = Answer::new(status, serde_json::json!({ "error": code })).to_response();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            response.headers_mut().insert(
                http::header::RETRY_AFTER,
                http::HeaderValue::from_static("1"),
            );
        }
        response
    }
}

#[cfg(feature = "axum")]
impl axum_core::response::IntoResponse for StepError {
    fn into_response(self) -> axum_core::response::Response {
        match &self {
            // A busy store or a transaction the database threw away: the layer answers `503`
            // or runs the handler again.
            StepError::Store(error) if error.is_busy() => tracing::info!(%error, "a step failed"),
            StepError::Store(error) => tracing::error!(%error, "a step failed"),
            _ => {}
        }
        self.to_response().map(axum_core::body::Body::from)
    }
}

#[cfg(feature = "axum")]
impl axum_core::response::IntoResponse for Answer {
    fn into_response(self) -> axum_core::response::Response {
        self.to_response().map(axum_core::body::Body::from)
    }
}

/// A step's result as saved: `{"value": ...}` or `{"terminal": {"status": N, "body": ...}}`.
#[derive(Debug)]
pub(crate) enum Stored {
    Value(serde_json::Value),
    Terminal(Answer),
}

impl Stored {
    pub(crate) fn encode_value<T: Serialize>(value: &T) -> Result<String, Error> {
        let value = serde_json::to_value(value).map_err(|e| Error::StepResult(e.to_string()))?;
        Stored::Value(value).encode()
    }

    pub(crate) fn encode(&self) -> Result<String, Error> {
        let json = match self {
            Stored::Value(value) => serde_json::json!({ "value": value }),
            Stored::Terminal(answer) => serde_json::json!({
                "terminal": { "status": answer.status.as_u16(), "body": answer.body }
            }),
        };
        Ok(json.to_string())
    }

    pub(crate) fn decode(text: &str) -> Result<Self, Error> {
        let corrupt = || Error::Corrupt(format!("step result {text:?}"));
        let mut json: serde_json::Value = serde_json::from_str(text).map_err(|_| corrupt())?;
        if let Some(value) = json.get_mut("value") {
            return Ok(Stored::Value(value.take()));
        }
        let terminal = json.get_mut("terminal").ok_or_else(corrupt)?;
        let status = terminal
            .get("status")
            .and_then(|s| s.as_u64())
            .and_then(|s| u16::try_from(s).ok())
            .and_then(|s| StatusCode::from_u16(s).ok())
            .ok_or_else(corrupt)?;
        let body = terminal
            .get_mut("body")
            .map(|b| b.take())
            .unwrap_or_default();
        Ok(Stored::Terminal(Answer::new(status, body)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_result_reads_back_as_written() {
        let value = Stored::encode_value(&serde_json::json!({"charge_id": "ch_1"})).unwrap();
        assert!(
            matches!(Stored::decode(&value).unwrap(), Stored::Value(v) if v["charge_id"] == "ch_1")
        );
        let answer = Answer::new(
            StatusCode::PAYMENT_REQUIRED,
            serde_json::json!({"error": "card_declined"}),
        );
        let terminal = Stored::Terminal(answer.clone()).encode().unwrap();
        assert!(matches!(Stored::decode(&terminal).unwrap(), Stored::Terminal(a) if a == answer));
        assert!(Stored::decode("{}").is_err());
        assert!(Stored::decode("not json").is_err());
    }
}
