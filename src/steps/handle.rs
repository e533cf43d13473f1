//! [`Steps`]: the handle a step-by-step request's handler gets, and what it keeps of the
//! request's progress for the layer.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use serde::de::DeserializeOwned;
use serde::Serialize;
use sha2::{Digest, Sha256};

use super::backend::{Lease, ProgressStatus, SavedStep, StepKind, StepOutcome, StepRow, StepStore};
use super::outcome::{Answer, Foreign, OnUnknown, Recovery, StepError, Stored};
use crate::error::Error;
use crate::store::Scope;

/// The handle of a step-by-step request (the layer's [`with_steps`] mode): runs the request's
/// steps, each committed on its own, so that a retry (or the [`Completer`](super::Completer))
/// resumes after the last one that finished. Put in the request extensions by the layer;
/// with the `axum` feature it is an extractor.
///
/// Steps are matched by name and order: a retry must call the same steps in the same order
/// (it may stop earlier); a step called where the key saved another is refused with
/// [`StepError::Changed`]. A step that failed without saving anything (a local step rolled
/// back) takes the same place when it is called again. A step that finished returns its saved
/// result without running. Call them one after the other, not concurrently.
///
/// [`with_steps`]: crate::IdempotencyLayer::with_steps
pub struct Steps<St: StepStore> {
    shared: Arc<Shared<St>>,
}

impl<St: StepStore> Clone for Steps<St> {
    fn clone(&self) -> Self {
        Steps {
            shared: self.shared.clone(),
        }
    }
}

impl<St: StepStore> fmt::Debug for Steps<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Steps")
            .field("operation", &self.shared.scope.operation)
            .field("generation", &self.shared.generation)
            .field("resumed", &self.shared.resumed)
            .finish_non_exhaustive()
    }
}

pub(crate) struct Shared<St> {
    pub(crate) store: St,
    pub(crate) scope: Scope,
    pub(crate) generation: i64,
    /// The key's run id (part of every step key).
    pub(crate) run: String,
    pub(crate) lease: Duration,
    /// How long each commit may wait for a lock.
    pub(crate) wait: Duration,
    /// Whether the claim found steps saved.
    pub(crate) resumed: bool,
    pub(crate) state: Mutex<State>,
}

/// What the request's steps did, for the layer to act on when the handler returns.
#[derive(Debug, Default)]
pub(crate) struct State {
    /// The key's steps as the store has them: those the claim read back, then what this
    /// request committed (an intent, a result), in order.
    pub(crate) steps: Vec<SavedStep>,
    /// How many of them the handler's calls have gone past: the next call is matched
    /// against `steps[cursor]`, or is a new step after the last.
    pub(crate) cursor: usize,
    /// The lease's end as last extended.
    pub(crate) lease_until: Option<SystemTime>,
    /// A foreign service failed transiently, or a commit found the store busy: release the
    /// key and answer `503` (unless the request runs again, see [`rerun`](Self::rerun)).
    pub(crate) transient: bool,
    /// A commit was thrown away by the database (a serialization failure or a deadlock).
    pub(crate) conflicted: bool,
    /// A foreign call failed or its outcome is unknown: the request is not run again here.
    pub(crate) call_failed: bool,
    /// Another claim took the key over: this request's writes are refused.
    pub(crate) lease_lost: bool,
    /// A step's outcome is unknown and left to an operator (the key is marked in doubt).
    pub(crate) in_doubt: bool,
    /// A step gave a terminal answer: the handler's response is final.
    pub(crate) terminal: bool,
    /// The steps no longer match the saved ones.
    pub(crate) changed: bool,
}

/// A key as claimed, for [`Steps::new`].
pub(crate) struct Granted {
    pub(crate) scope: Scope,
    pub(crate) generation: i64,
    pub(crate) run: String,
    pub(crate) steps: Vec<SavedStep>,
    pub(crate) lease: Duration,
    pub(crate) lease_until: SystemTime,
    pub(crate) wait: Duration,
}

/// Where a step call stands against the saved steps.
struct Position {
    seq: u32,
    /// The step saved there, if any: its result (`None` for a foreign step's intent).
    saved: Option<Option<String>>,
}

impl<St: StepStore> Steps<St> {
    pub(crate) fn new(store: St, granted: Granted) -> Self {
        let mut steps = granted.steps;
        steps.sort_by_key(|step| step.seq);
        Steps {
            shared: Arc::new(Shared {
                store,
                scope: granted.scope,
                generation: granted.generation,
                run: granted.run,
                lease: granted.lease,
                wait: granted.wait,
                resumed: !steps.is_empty(),
                state: Mutex::new(State {
                    steps,
                    lease_until: Some(granted.lease_until),
                    ..State::default()
                }),
            }),
        }
    }

    /// A fresh handle on the same claim for running the handler again, if this one's request
    /// may run again: a commit of it was thrown away by the database (a local step's
    /// transaction that conflicted, which saved nothing), and nothing else stopped it. Every
    /// foreign step it called has its result saved, so the handler running again gets those
    /// results back without calling (a foreign step whose call failed, or whose result was not
    /// saved, stops it: its intent is left to its `OnUnknown` policy on the client's retry).
    /// The new handle starts at the first step, with the steps saved so far.
    pub(crate) fn rerun(&self) -> Option<Self> {
        let state = self.state();
        let settled = state
            .steps
            .iter()
            .all(|step| step.kind == StepKind::Local || step.result.is_some());
        let again = state.conflicted
            && settled
            && !state.call_failed
            && !state.lease_lost
            && !state.in_doubt
            && !state.terminal
            && !state.changed;
        if !again {
            return None;
        }
        let shared = &self.shared;
        Some(Steps {
            shared: Arc::new(Shared {
                store: shared.store.clone(),
                scope: shared.scope.clone(),
                generation: shared.generation,
                run: shared.run.clone(),
                lease: shared.lease,
                wait: shared.wait,
                resumed: shared.resumed || !state.steps.is_empty(),
                state: Mutex::new(State {
                    steps: state.steps.clone(),
                    lease_until: state.lease_until,
                    ..State::default()
                }),
            }),
        })
    }

    /// The key's scope: tenant, operation and client key.
    pub fn scope(&self) -> &Scope {
        &self.shared.scope
    }

    /// Whether this request resumes a key that earlier attempts began (some step was saved).
    pub fn is_resumed(&self) -> bool {
        self.shared.resumed
    }

    /// The key's run id: created when the key's progress is first created, the same on every
    /// retry and take-over of it, and new for each life of the key (a client key used again
    /// after its record was deleted or expired, or its progress purged, starts a new life).
    pub fn run_id(&self) -> &str {
        &self.shared.run
    }

    /// The key to send as the other service's own idempotency key for the step `name`:
    /// derived from the key's run id, the tenant, the operation, the client's key and the
    /// step's name, so it is the same on every retry and in every process for one life of
    /// the key, and differs between keys, steps and lives (a client key used again after its
    /// record was deleted or expired gets new step keys: the other service never answers a
    /// new order with an old charge). 32 hexadecimal digits.
    pub fn step_key(&self, name: &str) -> String {
        step_key(&self.shared.run, &self.shared.scope, name)
    }

    /// Runs the local step `name`: `work` in a transaction of its own, committed together
    /// with its result and the key's progress. On a retry after it committed, returns the
    /// saved result without running `work`. Exactly once.
    ///
    /// `work` is the store's: on SQLite it gets a `&rusqlite::Transaction` and returns a
    /// `rusqlite::Result` (it runs on the writer thread); on PostgreSQL and MySQL it gets the
    /// store's transaction handle and returns a future of `Result<T, Error>`. An error from it
    /// rolls the step back and is returned as [`StepError::Store`].
    pub async fn local<F, R>(&self, name: &str, work: F) -> Result<R::Value, StepError>
    where
        F: for<'a> FnOnce(St::Work<'a>) -> R + Send + 'static,
        R: StepOutcome<St>,
        R::Value: Serialize + DeserializeOwned,
    {
        let Position { seq, saved } = self.next(name, StepKind::Local)?;
        match saved {
            Some(Some(result)) => {
                let value = self.saved_result(Stored::decode(&result)?);
                self.advance();
                return value;
            }
            Some(None) => {
                return Err(StepError::Store(Error::Corrupt(format!(
                    "local step {name:?} saved without a result"
                ))))
            }
            None => {}
        }
        let lease = self.lease();
        let row = StepRow {
            seq,
            name: name.to_owned(),
            kind: StepKind::Local,
            result: None,
        };
        let outcome = self
            .shared
            .store
            .run_local(&lease, &row, work, Stored::encode_value::<R::Value>)
            .await;
        let value = self.committed(&lease, outcome)?;
        // The result's JSON as saved (the store encoded the same value): a run of the handler
        // again under this claim reads it back from here (see `rerun`).
        let json = Stored::encode_value(&value).unwrap_or_default();
        self.saved_new(seq, name, StepKind::Local, Some(json));
        self.advance();
        Ok(value)
    }

    /// Runs the foreign step `name`: `call` sends a request to another service with
    /// [`step_key`](Self::step_key) as that service's idempotency key. Its intent commits
    /// before the call and its result after it; on a retry after the result committed, returns
    /// the saved result without calling.
    ///
    /// When a retry finds the intent without a result (the process died during the call, or
    /// the call's outcome was [unknown](Foreign::unknown)), `on_unknown` decides what it may
    /// do: [`CallAgain`](super::CallAgain) with the same key (the service deduplicates),
    /// [`Ask`](super::Ask) the service what happened, or [`LeaveInDoubt`](super::LeaveInDoubt)
    /// for an operator. There is no default.
    ///
    /// `call` is cut off when the lease would run out (less a margin); that counts as an
    /// unknown outcome.
    pub async fn foreign<T, C, Fut, U>(
        &self,
        name: &str,
        on_unknown: U,
        call: C,
    ) -> Result<T, StepError>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        C: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<T, Foreign>>,
        U: OnUnknown<T>,
    {
        let Position { seq, saved } = self.next(name, StepKind::Foreign)?;
        let key = self.step_key(name);
        let known = saved.is_some();
        match saved {
            Some(Some(result)) => {
                let value = self.saved_result(Stored::decode(&result)?);
                self.advance();
                return value;
            }
            Some(None) => match on_unknown.recover(key.clone()).await {
                Ok(Recovery::CallAgain) => {}
                Ok(Recovery::Done(value)) => {
                    return self.save_foreign(seq, name, Ok(value)).await;
                }
                Ok(Recovery::InDoubt) => return self.in_doubt(seq, name).await,
                Err(failure) => return self.failed_call(seq, name, failure, true).await,
            },
            None => {}
        }
        // The intent commits before every call, a new one or one saved before (written
        // again): a request whose lease another claim took over is refused here, before it
        // calls, and the call's budget counts from a lease just extended.
        let lease = self.lease();
        let intent = StepRow {
            seq,
            name: name.to_owned(),
            kind: StepKind::Foreign,
            result: None,
        };
        let saved = self.shared.store.save_step(&lease, &intent).await;
        self.committed(&lease, saved)?;
        if !known {
            // From here the store has the intent: a second call of this step in this request
            // (after an unknown outcome) finds it, and its policy decides, as a retry's would.
            self.saved_new(seq, name, StepKind::Foreign, None);
        }
        let Some(budget) = self.call_budget() else {
            // The lease is about to end: a call now could reach the other service after a
            // retry took the key over. It is not made.
            tracing::warn!(
                step = name,
                "no time left in the lease for the call; not made"
            );
            return self
                .failed_call(
                    seq,
                    name,
                    Foreign::unavailable("no time left in the lease"),
                    known,
                )
                .await;
        };
        match tokio::time::timeout(budget, call(key)).await {
            Ok(Ok(value)) => self.save_foreign(seq, name, Ok(value)).await,
            Ok(Err(failure)) => self.failed_call(seq, name, failure, known).await,
            Err(_elapsed) => {
                tracing::warn!(step = name, ?budget, "foreign call cut off at its lease");
                let unknown = Foreign::unknown("the call outlived its lease");
                self.failed_call(seq, name, unknown, known).await
            }
        }
    }

    /// Where the step `name` stands: matched, by name and kind, against the step the key
    /// saved at the cursor (and its result, `None` for a foreign step's intent), or new after
    /// the last saved one. The cursor moves on only once the step has its result
    /// ([`advance`](Self::advance)): a step that failed without saving anything is called
    /// again at the same place.
    fn next(&self, name: &str, kind: StepKind) -> Result<Position, StepError> {
        let mut state = self.state();
        if state.lease_lost || state.in_doubt || state.changed {
            return Err(StepError::Stopped);
        }
        let Some(saved) = state.steps.get(state.cursor) else {
            let seq = state.steps.last().map_or(Ok(0), |last| {
                last.seq
                    .checked_add(1)
                    .ok_or(StepError::Store(Error::Corrupt(
                        "step position overflow".into(),
                    )))
            })?;
            return Ok(Position { seq, saved: None });
        };
        if saved.name != name || saved.kind != kind {
            let (position, saved) = (saved.seq, format!("{} {}", saved.kind.as_str(), saved.name));
            state.changed = true;
            return Err(StepError::Changed {
                position,
                saved,
                called: format!("{} {name}", kind.as_str()),
            });
        }
        Ok(Position {
            seq: saved.seq,
            saved: Some(saved.result.clone()),
        })
    }

    /// The step at the cursor has its result: the next call is matched against the one after.
    fn advance(&self) {
        self.state().cursor += 1;
    }

    /// Notes a step this request committed: a new one (appended), or the result of the one at
    /// the cursor.
    fn saved_new(&self, seq: u32, name: &str, kind: StepKind, result: Option<String>) {
        let mut state = self.state();
        let cursor = state.cursor;
        match state.steps.get_mut(cursor) {
            Some(step) if step.seq == seq => step.result = result,
            _ => state
                .steps
                .push(SavedStep::new(seq, name.to_owned(), kind, result)),
        }
    }

    /// Notes that the intent at the cursor was deleted (the call did not happen): the next
    /// call takes its place.
    fn forgot(&self, seq: u32) {
        let mut state = self.state();
        let cursor = state.cursor;
        if state.steps.get(cursor).is_some_and(|step| step.seq == seq) {
            state.steps.remove(cursor);
        }
    }

    fn saved_result<T: DeserializeOwned>(&self, stored: Stored) -> Result<T, StepError> {
        match stored {
            Stored::Value(value) => serde_json::from_value(value)
                .map_err(|e| StepError::Store(Error::StepResult(e.to_string()))),
            Stored::Terminal(answer) => {
                self.state().terminal = true;
                Err(StepError::Terminal(answer))
            }
        }
    }

    async fn save_foreign<T: Serialize>(
        &self,
        seq: u32,
        name: &str,
        result: Result<T, Answer>,
    ) -> Result<T, StepError> {
        let (stored, outcome) = match result {
            Ok(value) => {
                let json = Stored::encode_value(&value)?;
                (json, Ok(value))
            }
            Err(answer) => (
                Stored::Terminal(answer.clone()).encode()?,
                Err(StepError::Terminal(answer)),
            ),
        };
        let lease = self.lease();
        let row = StepRow {
            seq,
            name: name.to_owned(),
            kind: StepKind::Foreign,
            result: Some(stored),
        };
        let saved = self.shared.store.save_step(&lease, &row).await;
        self.committed(&lease, saved)?;
        self.saved_new(seq, name, StepKind::Foreign, row.result);
        self.advance();
        if outcome.is_err() {
            self.state().terminal = true;
        }
        outcome
    }

    /// A call that did not give a result. `earlier`: the intent was saved by an earlier
    /// attempt, whose call may have been made (and taken effect) whatever this one's says.
    async fn failed_call<T: Serialize>(
        &self,
        seq: u32,
        name: &str,
        failure: Foreign,
        earlier: bool,
    ) -> Result<T, StepError> {
        match failure {
            Foreign::Terminal(answer) => self.save_foreign(seq, name, Err(answer)).await,
            Foreign::Unavailable(error) => {
                tracing::info!(step = name, %error, "the foreign service refused the call");
                self.state().call_failed = true;
                // This call did not happen; an earlier attempt's may have: its intent stays.
                if !earlier {
                    let lease = self.lease();
                    let forgotten = self.shared.store.forget_intent(&lease, seq).await;
                    self.committed(&lease, forgotten)?;
                    self.forgot(seq);
                }
                self.state().transient = true;
                Err(StepError::Transient(error))
            }
            Foreign::Unknown(error) => {
                tracing::warn!(step = name, %error, "the foreign call's outcome is unknown");
                let mut state = self.state();
                state.call_failed = true;
                state.transient = true;
                drop(state);
                Err(StepError::Transient(error))
            }
        }
    }

    async fn in_doubt<T>(&self, seq: u32, name: &str) -> Result<T, StepError> {
        let lease = self.lease();
        let reason = format!("the outcome of step {seq} ({name:?}) is unknown");
        let marked = (self.shared.store)
            .set_status(&lease, ProgressStatus::InDoubt, &reason)
            .await;
        self.committed(&lease, marked)?;
        self.state().in_doubt = true;
        tracing::warn!(step = name, "key left in doubt for an operator");
        Err(StepError::InDoubt {
            step: name.to_owned(),
        })
    }

    /// Notes a commit's outcome under `lease`. A busy store (a lock not taken within the
    /// layer's lock timeout) makes the request transient: the layer releases the key and
    /// answers `503` with `Retry-After`, whatever the handler answers. A commit the database
    /// threw away (a serialization failure or a deadlock, most often a local step's under
    /// `SERIALIZABLE`) is transient too, and lets the layer run the handler again
    /// ([`rerun`](Self::rerun)). Steps that differ from the saved ones stop the request.
    fn committed<T>(&self, lease: &Lease, outcome: Result<T, Error>) -> Result<T, StepError> {
        match outcome {
            Ok(value) => {
                self.state().lease_until = Some(lease.until);
                Ok(value)
            }
            Err(Error::LeaseLost) => {
                self.state().lease_lost = true;
                Err(StepError::LeaseLost)
            }
            Err(Error::StepsChanged { position, saved }) => {
                self.state().changed = true;
                Err(StepError::Changed {
                    position,
                    saved,
                    called: "a step at the same position".into(),
                })
            }
            Err(error) => {
                if error.is_busy() {
                    let mut state = self.state();
                    state.transient = true;
                    state.conflicted |= error.is_serialization_conflict();
                }
                Err(StepError::Store(error))
            }
        }
    }

    /// How long a foreign call may take: until the lease ends, less a margin for the commit
    /// of its result; `None` when no more than the margin is left (the call is not made).
    fn call_budget(&self) -> Option<Duration> {
        let until = self.state().lease_until;
        let left = until
            .and_then(|until| until.duration_since(SystemTime::now()).ok())
            .unwrap_or_default();
        let margin = (self.shared.lease / 5).max(Duration::from_millis(200));
        left.checked_sub(margin).filter(|budget| !budget.is_zero())
    }

    pub(crate) fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding this lock leaves plain flags: still good to read.
        self.shared
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The lease a commit made now extends to.
    pub(crate) fn lease(&self) -> Lease {
        let now = SystemTime::now();
        Lease {
            scope: self.shared.scope.clone(),
            run: self.shared.run.clone(),
            generation: self.shared.generation,
            until: now + self.shared.lease,
            now,
            wait: self.shared.wait,
        }
    }

    pub(crate) fn store(&self) -> &St {
        &self.shared.store
    }
}

/// The key [`Steps::step_key`] gives the step `name` of `scope`'s request in the life `run`
/// (its [run id](Steps::run_id), as [`Progress::run`](super::Progress::run) lists it): for an
/// operator who looks up a step's call at the other service.
pub fn step_key(run: &str, scope: &Scope, name: &str) -> String {
    let mut hash = Sha256::new();
    hash.update(b"tower-idempotency/step-key/v2\0");
    for part in [
        run,
        &*scope.tenant,
        &*scope.operation,
        scope.key.as_str(),
        name,
    ] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    let digest = hash.finalize();
    digest[..16].iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, SystemTime};

    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::key::IdempotencyKey;
    use crate::steps::sealed::StepProtocol as _;
    use crate::steps::{Acquired, CallAgain, Claim, Foreign, SavedRequest};
    use crate::store::sqlite::{rusqlite, SqliteStore};

    async fn claim(store: &SqliteStore, now: SystemTime) -> Steps<SqliteStore> {
        let scope = Scope::new(
            "shop-a",
            "checkout",
            IdempotencyKey::parse(b"k", 8).unwrap(),
        );
        let mut claim = Claim::new(
            scope.clone(),
            Fingerprint::new(1, [7; 32]),
            Arc::from(format!("owner-{now:?}")),
            now + Duration::from_secs(30),
            now,
        );
        claim.request = Some(SavedRequest::new(
            "POST".into(),
            "/checkouts".into(),
            String::new(),
            bytes::Bytes::new(),
        ));
        let Acquired::Owned {
            generation,
            run,
            steps,
        } = store.acquire(&claim).await.unwrap()
        else {
            panic!("the key is free");
        };
        Steps::new(
            store.clone(),
            Granted {
                scope,
                generation,
                run,
                steps,
                lease: Duration::from_secs(30),
                lease_until: claim.lease_until,
                wait: Duration::from_secs(5),
            },
        )
    }

    fn insert(tx: &rusqlite::Transaction<'_>, name: &str) -> rusqlite::Result<()> {
        tx.execute("INSERT INTO business (name) VALUES (?1)", [name])?;
        Ok(())
    }

    /// A handler that calls a local step again after it failed (rolled back) leaves no gap:
    /// the step keeps its place, and on resume every step is matched to its own saved row.
    /// (With positions counted per call, the charge's result went into the wrong row: the
    /// charge id was lost and step "b" ran twice.)
    #[tokio::test(flavor = "multi_thread")]
    async fn a_local_step_called_again_after_a_failure_keeps_its_place() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("steps.db"))
            .await
            .unwrap();
        store.install_steps().await.unwrap();
        store
            .write(|tx| tx.execute_batch("CREATE TABLE business (name TEXT NOT NULL)"))
            .await
            .unwrap();
        let now = SystemTime::now();
        let first = claim(&store, now).await;
        let failed = first
            .local("a", |tx: &rusqlite::Transaction<'_>| {
                insert(tx, "a")?;
                Err::<i64, _>(rusqlite::Error::InvalidQuery)
            })
            .await;
        assert!(matches!(failed, Err(StepError::Store(_))), "{failed:?}");
        let a = first
            .local("a", |tx: &rusqlite::Transaction<'_>| {
                insert(tx, "a")?;
                Ok(1_i64)
            })
            .await
            .unwrap();
        assert_eq!(a, 1);
        // The provider charged, but the answer was lost: the request ends (503).
        let lost = first
            .foreign("charge", CallAgain, |_key| async {
                Err::<String, _>(Foreign::unknown("connection lost"))
            })
            .await;
        assert!(matches!(lost, Err(StepError::Transient(_))), "{lost:?}");
        store.release(&first.lease()).await.unwrap();

        // The retry resumes: "a" is saved, the charge is called again (same key), "b" runs.
        let retry = claim(&store, now + Duration::from_secs(1)).await;
        assert_eq!(retry.run_id(), first.run_id());
        let a = retry
            .local(
                "a",
                |_tx: &rusqlite::Transaction<'_>| -> rusqlite::Result<i64> {
                    panic!("step a ran again")
                },
            )
            .await
            .unwrap();
        assert_eq!(a, 1);
        let key = retry.step_key("charge");
        let charge: String = retry
            .foreign(
                "charge",
                CallAgain,
                |key| async move { Ok(format!("ch-{key}")) },
            )
            .await
            .unwrap();
        assert_eq!(charge, format!("ch-{key}"));
        retry
            .local("b", |tx: &rusqlite::Transaction<'_>| {
                insert(tx, "b")?;
                Ok("b-done".to_owned())
            })
            .await
            .unwrap();
        store.release(&retry.lease()).await.unwrap();

        // Read back: each step at its own position with its own result, each business row once.
        let again = claim(&store, now + Duration::from_secs(2)).await;
        let saved: Vec<(u32, String, Option<String>)> = again
            .state()
            .steps
            .iter()
            .map(|s| (s.seq, s.name.clone(), s.result.clone()))
            .collect();
        assert_eq!(
            saved,
            [
                (0, "a".to_owned(), Some(r#"{"value":1}"#.to_owned())),
                (
                    1,
                    "charge".to_owned(),
                    Some(format!(r#"{{"value":"ch-{key}"}}"#))
                ),
                (2, "b".to_owned(), Some(r#"{"value":"b-done"}"#.to_owned())),
            ]
        );
        let rows: Vec<String> = store
            .read(|conn| {
                let mut statement = conn.prepare("SELECT name FROM business ORDER BY rowid")?;
                let rows = statement.query_map([], |row| row.get(0))?;
                rows.collect()
            })
            .await
            .unwrap();
        assert_eq!(rows, ["a", "b"]);
    }
}
