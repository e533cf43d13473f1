//! The steps mode against a model, on every store: random step programs (1 to 5 steps, each
//! local or foreign) for one or two keys, one per operation (`a` and `b`, each its own route,
//! layer and completer on the one store), and a random schedule of events. An event is an
//! attempt on one key, stopping part-way in one of the ways a request stops (the client goes
//! away between steps, during a local step's transaction or during a foreign call; the handler
//! panics; the provider refuses the call or its outcome is unknown, after it charged or
//! before; the owner stalls past its lease, and goes on a few events later: refused if a
//! claim or a purge took the key from it meanwhile, to the end otherwise), by a client's retry
//! or by the key's operation's completer; or an operator's action: the key's record deleted
//! (`Admin::delete`) or expired (its `expires_at` put in the past, then `purge_expired` or
//! not), the progress left running purged (`purge_progress` with a clock days ahead: deleted
//! if it saved local steps only, a new life for the next request; a dead letter if it saved a
//! foreign step), or `resolve` (refused while the key is running, changing nothing; in doubt
//! or dead, settled as the provider says: done with its charge, or call again). The client
//! reuses its key after such an action: a new life (a new run id, new step keys) and, once it
//! had its answer, a new order (a new payload). Then a last attempt on each key runs to the
//! end.
//!
//! The foreign steps' policies for an unknown outcome are `CallAgain`, `Ask` and
//! `LeaveInDoubt`; the provider deduplicates by its idempotency key in some cases and charges
//! every call in the others (then no step is `CallAgain`, which needs a provider that
//! deduplicates). Some local steps fail once after their insert (a statement on a table that
//! does not exist): the handler calls them again, and they take the same place. Client keys
//! are plain, or spelled as sf-strings, or hold quotes, backslashes and SQL wildcards (stored
//! unquoted: `"\"x\""` is the key `"x"`); the two operations' keys are the same key half the
//! time.
//!
//! After every event the store, the business rows and the provider are compared with a model
//! of what the events so far must have done: a local step's row exists once it committed and
//! never twice in a life; the provider was called for each foreign step's key as often as the
//! model says and charged as the model says; a call after one that charged is only ever a
//! `CallAgain` step's; each life has a run id of its own, the one the listing gives; the key's
//! progress, saved steps, listing (status, steps, completer attempts, saved payload) and record
//! (live, expired or gone) are what the model says; and each handler only ever ran its own
//! key. At the end the answer is the one the model predicts (the list of step results, or the
//! declined step's `402`), every retry replays it byte for byte, nothing is left in progress,
//! and money taken is orders paid: every charge the provider took is listed by exactly one
//! order's final answer, under its step's key in that order's life.
//!
//! The generic part is written once over [`Backend`]; each store gives its local step (its
//! closure differs: the SQLite store's runs on its writer thread, the others' are futures) and
//! its tables. Requests go through the layer in-process (`tower::ServiceExt::oneshot` on an axum
//! `Router`): real HTTP is covered by tests/steps/steps_http.rs and the examples' crash
//! matrix. Each case starts on an empty store.
//! SQLite (both stores) needs no server. PostgreSQL (both drivers) runs when
//! `TEST_DATABASE_URL` is set and MySQL or MariaDB when `TEST_MYSQL_URL` is; they are reported
//! as ignored otherwise. `PROPTEST_CASES` sets the
//! cases per store and `STEPS_MODEL_SEED` (32 hex digits, printed on a failure) replays a run;
//! `STEPS_MODEL_STATS=1` prints what the cases exercised.

use crate::listing;
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, SystemTime};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use bytes::Bytes;
use http_body_util::BodyExt;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use serde_json::{json, Value};
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_idempotency::admin::{Admin, AdminBackend, RecordState};
use tower_idempotency::key::IdempotencyKey;
use tower_idempotency::steps::{
    step_key, Ask, CallAgain, CompleterReport, Foreign, LeaveInDoubt, Progress, ProgressStatus,
    Resolution, Settled, StepError, StepStore, Steps,
};
use tower_idempotency::store::{IdempotencyStore, Scope};
use tower_idempotency::{IdempotencyLayer, Tenant};

const TENANT: &str = "model";
/// The operations of the two keys, and their routes.
const OPERATIONS: [&str; 2] = ["a", "b"];
const PATHS: [&str; 2] = ["/a", "/b"];
/// What the handler panics with (kept out of the test's output).
const PANIC: &str = "the model's handler panics here";
/// The lease of a key with a stalled owner (the shortest the layer takes), and of the others.
const SHORT_LEASE: Duration = Duration::from_secs(1);
const LEASE: Duration = Duration::from_secs(30);
/// How long any one wait of the test may take before it counts as hung.
const HUNG: Duration = Duration::from_secs(30);
/// How far ahead of now an operator's purge of progress looks: past the layer's retention (a
/// day, the default), so every key left running is past its expiry then.
const PURGE_AHEAD: Duration = Duration::from_secs(3 * 24 * 60 * 60);

/// A store under test: its local step and how to read what the test checks.
trait Backend: Send + Sync + 'static {
    type Store: StepStore + AdminBackend;

    fn store(&self) -> &Self::Store;

    /// The local step `name` of the request `steps` runs: inserts the row (operation, key,
    /// run id, `name`) into `model_rows` on the step's transaction and returns how many rows
    /// that life of the key has then. With `fail`, a statement on a table that does not exist
    /// fails after the insert: the step rolls back. When `reached` is given, notifies it after
    /// the insert, before the transaction ends (the test drops the request there).
    fn local(
        steps: Steps<Self::Store>,
        name: String,
        fail: bool,
        reached: Option<Arc<Reached>>,
    ) -> impl Future<Output = Result<i64, StepError>> + Send;

    /// The key's rows in `model_rows`, counted by run id and step.
    async fn rows(&self, scope: &Scope) -> BTreeMap<(String, String), i64>;

    /// How many rows the key has in `idempotency_progress` and in `idempotency_steps`.
    async fn leftovers(&self, scope: &Scope) -> (i64, i64);

    /// Puts the key's record's `expires_at` a minute in the past (what time does to it).
    async fn expire_record(&self, scope: &Scope);

    /// Empties the store and `model_rows`: each case starts on an empty store (a case that
    /// failed, and the shrinking after it, leave keys behind).
    async fn clear(&self);
}

/// What [`Backend::clear`] runs.
const CLEAR: &str = "DELETE FROM idempotency_steps; DELETE FROM idempotency_progress; \
                     DELETE FROM idempotency_records; DELETE FROM model_rows;";

/// When a record expired at the test's hand: a minute ago, in the stores' milliseconds.
fn a_minute_ago() -> i64 {
    let ago = SystemTime::now() - Duration::from_secs(60);
    let millis = ago
        .duration_since(SystemTime::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis();
    i64::try_from(millis).expect("millis")
}

// ---------------------------------------------------------------------------------------------
// The cases.

/// What a foreign step does when a retry finds its intent without a result.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Policy {
    /// Calls again with the same key: for a provider that deduplicates.
    CallAgain,
    /// Asks the provider whether its key was charged.
    Ask,
    /// Leaves the key in doubt for an operator.
    LeaveInDoubt,
}

/// A foreign step's traits.
#[derive(Clone, Copy, Debug, PartialEq)]
struct ForeignStep {
    policy: Policy,
    /// The provider declines it (`402`, terminal).
    declines: bool,
}

#[derive(Clone, Debug)]
struct Step {
    name: String,
    /// `None`: a local step.
    foreign: Option<ForeignStep>,
    /// A local step whose closure fails once in each request that runs it (after its insert):
    /// the handler calls it again.
    flaky: bool,
}

/// Where and how an attempt stops. Positions count the program's steps from 0; a boundary
/// `k` is before step `k` (after `k` steps), the program's length is after the last one.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Stop {
    /// Runs to the end.
    Full,
    /// The client goes away at boundary `k`: the request future is dropped.
    Gone(usize),
    /// The handler panics at boundary `k`.
    Panic(usize),
    /// The handler stalls at boundary `k` past its lease, until a later [`Event::Resume`]: it
    /// must then be refused if anything took the key from it meanwhile (a client's or the
    /// completer's claim, a purge), and else goes on to the end.
    Stall(usize),
    /// The provider refuses step `k`'s call before charging ([`Foreign::unavailable`]).
    Unavailable(usize),
    /// Step `k`'s call ends in [`Foreign::unknown`], after the provider charged or before.
    Unknown { step: usize, charged: bool },
    /// The client goes away during step `k`'s call, after the provider charged or before.
    GoneInCall { step: usize, charged: bool },
    /// The client goes away during the local step `k`'s transaction, after its insert.
    GoneInLocal(usize),
    /// Step `k`'s call hangs, after the provider charged or before, until the layer cuts it
    /// off at the lease's end (an unknown outcome). Meanwhile an operator tries to resolve the
    /// key: refused, it is running (its owner is in the middle of a call).
    SlowCall { step: usize, charged: bool },
}

impl Stop {
    fn at_boundary(self, i: usize) -> bool {
        matches!(self, Stop::Gone(k) | Stop::Panic(k) | Stop::Stall(k) if k == i)
    }

    /// The fault planned for the call of step `i`.
    fn fault_at(self, i: usize) -> Option<Stop> {
        match self {
            Stop::Unavailable(k)
            | Stop::Unknown { step: k, .. }
            | Stop::GoneInCall { step: k, .. }
            | Stop::SlowCall { step: k, .. }
                if k == i =>
            {
                Some(self)
            }
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Attempt {
    /// By the completer (of the key's operation) instead of a client's retry.
    completer: bool,
    stop: Stop,
}

/// An operator's action on a key.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Operator {
    /// `Admin::delete` of the key's record.
    Delete,
    /// The key's record expires (its `expires_at` in the past); then `purge_expired` deletes
    /// every expired record of the store, when `purge`.
    Expire { purge: bool },
    /// `purge_progress` with a clock days ahead: every key of the store left running (its
    /// lease ended) is past its expiry, and is deleted with its steps.
    PurgeProgress,
    /// `resolve`: refused while the key is running (nothing changes), not found when it is not
    /// in progress; in doubt, the step is settled as the provider says: done with its charge
    /// if it charged the step's key, else to be called again (first, a step with its result
    /// is refused as no intent).
    Resolve,
}

#[derive(Clone, Copy, Debug)]
enum Event {
    Attempt {
        lane: usize,
        attempt: Attempt,
    },
    Operator {
        lane: usize,
        action: Operator,
    },
    /// The key's stalled request goes on.
    Resume {
        lane: usize,
    },
}

/// How a client spells its key.
#[derive(Clone, Copy, Debug, PartialEq)]
enum KeyForm {
    /// A plain token, sent as it is.
    Plain,
    /// A plain token sent as an sf-string (`"k"` is the key `k`).
    Quoted,
    /// A key starting with a quote (`"evil`), sent as the sf-string `"\"evil"`.
    LeadingQuote,
    /// A key in quotes (`"x"`), sent as the sf-string `"\"x\""`.
    InQuotes,
    /// A raw token with quotes, a backslash, an apostrophe and SQL's wildcards.
    Punctuation,
}

/// A key of the case: its operation's program and how its client spells the key.
#[derive(Clone, Debug)]
struct LaneCase {
    program: Vec<Step>,
    key: KeyForm,
}

#[derive(Clone, Debug)]
struct Case {
    /// The keys: one of operation `a`, and one of operation `b` in some cases.
    lanes: Vec<LaneCase>,
    /// The provider deduplicates by its idempotency key; else every call that charges takes
    /// money (and no step is [`Policy::CallAgain`]).
    dedup: bool,
    /// The second key is the first one's key (spelled as an sf-string), on the other
    /// operation.
    same_key: bool,
    /// The events before the last attempts (a client's on each key, to the end).
    events: Vec<Event>,
}

impl Case {
    /// One plain key of operation `a`, a provider that deduplicates, and these events.
    fn one(program: Vec<Step>, events: Vec<Event>) -> Case {
        Case {
            lanes: vec![LaneCase {
                program,
                key: KeyForm::Plain,
            }],
            dedup: true,
            same_key: false,
            events,
        }
    }

    /// Whether the key has a stalled owner or a call cut off at its lease's end: its lease
    /// is then the shortest the layer takes.
    fn stalls(&self, lane: usize) -> bool {
        self.events.iter().any(|event| {
            matches!(event, Event::Attempt { lane: l, attempt } if *l == lane
                && matches!(attempt.stop, Stop::Stall(_) | Stop::SlowCall { .. }))
        })
    }
}

/// The kinds of [`Stop`], before they are fitted to a program.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Full,
    Gone,
    Panic,
    Stall,
    Unavailable,
    Unknown,
    GoneInCall,
    GoneInLocal,
    SlowCall,
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        2 => Just(Kind::Full),
        3 => Just(Kind::Gone),
        2 => Just(Kind::Panic),
        2 => Just(Kind::Stall),
        3 => Just(Kind::Unavailable),
        3 => Just(Kind::Unknown),
        3 => Just(Kind::GoneInCall),
        1 => Just(Kind::SlowCall),
        2 => Just(Kind::GoneInLocal),
    ]
}

/// An event before it is fitted to the case.
#[derive(Clone, Copy, Debug)]
enum Draft {
    Attempt {
        completer: bool,
        kind: Kind,
        k: usize,
        charged: bool,
    },
    Operator(Operator),
    /// A client's attempt to the end, then the operator's action (delete or expire): the key
    /// had its answer, and its next request is a new order.
    Renew(Operator),
    /// A client's attempt on the other key that stops as `kind` says (often leaving it in
    /// progress), then this key's completer: it must not touch the other operation's key.
    Beside {
        kind: Kind,
        k: usize,
        charged: bool,
    },
    /// A client's attempt stalls at boundary `k`; once its lease is over, a purge (when
    /// `purge`) and a client's attempt that stops as `kind` says take the key (in a new life
    /// if the purge deleted it), then the stalled owner goes on: it must write nothing.
    Overtaken {
        kind: Kind,
        k: usize,
        charged: bool,
        purge: bool,
    },
}

fn operator() -> impl Strategy<Value = Operator> {
    prop_oneof![
        1 => Just(Operator::Delete),
        1 => any::<bool>().prop_map(|purge| Operator::Expire { purge }),
        2 => Just(Operator::PurgeProgress),
        2 => Just(Operator::Resolve),
    ]
}

fn draft() -> impl Strategy<Value = Draft> {
    let attempt = (prop::bool::weighted(0.3), kind(), 0usize..7, any::<bool>()).prop_map(
        |(completer, kind, k, charged)| Draft::Attempt {
            completer,
            kind,
            k,
            charged,
        },
    );
    let renew = prop_oneof![
        Just(Operator::Delete),
        any::<bool>().prop_map(|purge| Operator::Expire { purge }),
    ];
    let beside = (kind(), 0usize..7, any::<bool>()).prop_map(|(kind, k, charged)| Draft::Beside {
        kind,
        k,
        charged,
    });
    let overtaken =
        (kind(), 0usize..7, any::<bool>(), any::<bool>()).prop_map(|(kind, k, charged, purge)| {
            Draft::Overtaken {
                kind,
                k,
                charged,
                purge,
            }
        });
    prop_oneof![
        10 => attempt,
        5 => operator().prop_map(Draft::Operator),
        2 => renew.prop_map(Draft::Renew),
        2 => beside,
        1 => overtaken,
    ]
}

fn key_form() -> impl Strategy<Value = KeyForm> {
    prop_oneof![
        3 => Just(KeyForm::Plain),
        1 => Just(KeyForm::Quoted),
        1 => Just(KeyForm::LeadingQuote),
        1 => Just(KeyForm::InQuotes),
        1 => Just(KeyForm::Punctuation),
    ]
}

/// A program's steps, before the provider's mode is known: (foreign, policy, declines, flaky).
type Drafted = Vec<(bool, u8, bool, bool)>;

fn program(steps: Drafted, dedup: bool) -> Vec<Step> {
    steps
        .into_iter()
        .enumerate()
        .map(|(i, (foreign, policy, declines, flaky))| {
            let policy = match policy {
                0 if dedup => Policy::CallAgain,
                // A provider that charges every call is never called again blindly.
                0 | 1 => Policy::Ask,
                _ => Policy::LeaveInDoubt,
            };
            Step {
                name: format!("{}{i}", if foreign { "call" } else { "write" }),
                foreign: foreign.then_some(ForeignStep { policy, declines }),
                flaky: !foreign && flaky,
            }
        })
        .collect()
}

fn arb_case() -> impl Strategy<Value = Case> {
    let step = (
        any::<bool>(),
        0u8..3,
        prop::bool::weighted(0.1),
        prop::bool::weighted(0.3),
    );
    let lane = || (vec(step.clone(), 1..=5), key_form());
    (
        lane(),
        lane(),
        prop::bool::weighted(0.6),
        any::<bool>(),
        prop::bool::weighted(0.5),
        vec((any::<bool>(), draft()), 0..=8),
    )
        .prop_map(|(first, second, two, dedup, same_key, drafts)| {
            let mut lanes = vec![LaneCase {
                program: program(first.0, dedup),
                key: first.1,
            }];
            if two {
                lanes.push(LaneCase {
                    program: program(second.0, dedup),
                    key: second.1,
                });
            }
            let events = fit_events(&lanes, drafts);
            Case {
                lanes,
                dedup,
                same_key: two && same_key,
                events,
            }
        })
}

/// The events of `drafts` on `lanes`. One stalled owner per case at most (each costs a
/// lease), a client's: it goes on (`Event::Resume`) one to four drafts later, or after the
/// last one.
fn fit_events(lanes: &[LaneCase], drafts: Vec<(bool, Draft)>) -> Vec<Event> {
    let fitters: Vec<_> = lanes.iter().map(|lane| fitter(&lane.program)).collect();
    let mut events = Vec::new();
    let mut stalled_once = false;
    // The stalled key, and how many drafts before it goes on.
    let mut stalled: Option<(usize, usize)> = None;
    for (second, draft) in drafts {
        let lane = usize::from(second && lanes.len() > 1);
        match draft {
            Draft::Attempt {
                completer,
                kind,
                k,
                charged,
            } => {
                let fit = &fitters[lane];
                let mut stop = fit(kind, k, charged);
                if matches!(stop, Stop::Stall(_)) {
                    if stalled_once || completer {
                        stop = fit(Kind::Gone, k, charged);
                    } else {
                        stalled_once = true;
                        events.push(Event::Attempt {
                            lane,
                            attempt: Attempt {
                                completer: false,
                                stop,
                            },
                        });
                        stalled = Some((lane, 1 + k % 4));
                        continue;
                    }
                }
                events.push(Event::Attempt {
                    lane,
                    attempt: Attempt { completer, stop },
                });
            }
            Draft::Beside { kind, k, charged } => {
                // Neither stalls: a completer never does, and the other key's attempt is
                // followed by this one's completer.
                let fit = |lane: usize, k: usize| match fitters[lane](kind, k, charged) {
                    Stop::Stall(_) => Stop::Full,
                    stop => stop,
                };
                if lanes.len() > 1 {
                    events.push(Event::Attempt {
                        lane: 1 - lane,
                        attempt: Attempt {
                            completer: false,
                            stop: fit(1 - lane, k),
                        },
                    });
                }
                events.push(Event::Attempt {
                    lane,
                    attempt: Attempt {
                        completer: true,
                        stop: fit(lane, k + 1),
                    },
                });
            }
            Draft::Overtaken {
                kind,
                k,
                charged,
                purge,
            } => {
                let fit = &fitters[lane];
                let stop = match fit(kind, k + 1, charged) {
                    Stop::Stall(_) => Stop::Full,
                    stop => stop,
                };
                if !stalled_once {
                    stalled_once = true;
                    events.push(Event::Attempt {
                        lane,
                        attempt: Attempt {
                            completer: false,
                            stop: fit(Kind::Stall, k, charged),
                        },
                    });
                }
                if purge {
                    events.push(Event::Operator {
                        lane,
                        action: Operator::PurgeProgress,
                    });
                }
                events.push(Event::Attempt {
                    lane,
                    attempt: Attempt {
                        completer: false,
                        stop,
                    },
                });
                events.push(Event::Resume { lane });
            }
            Draft::Operator(action) => events.push(Event::Operator { lane, action }),
            Draft::Renew(action) => {
                events.push(full(lane));
                events.push(Event::Operator { lane, action });
            }
        }
        if let Some((lane, left)) = &mut stalled {
            *left -= 1;
            if *left == 0 {
                events.push(Event::Resume { lane: *lane });
                stalled = None;
            }
        }
    }
    if let Some((lane, _)) = stalled {
        events.push(Event::Resume { lane });
    }
    events
}

/// A client's attempt on `lane` that runs to the end.
fn full(lane: usize) -> Event {
    Event::Attempt {
        lane,
        attempt: Attempt {
            completer: false,
            stop: Stop::Full,
        },
    }
}

/// Fits a kind of stop to `program`: a boundary in `0..=len`, a foreign or local step (the
/// client goes away at a boundary instead when the program has no such step).
fn fitter(program: &[Step]) -> impl Fn(Kind, usize, bool) -> Stop {
    let n = program.len();
    let foreign: Vec<usize> = (0..n).filter(|&i| program[i].foreign.is_some()).collect();
    let local: Vec<usize> = (0..n).filter(|&i| program[i].foreign.is_none()).collect();
    move |kind, k, charged| {
        let boundary = k % (n + 1);
        let pick = |of: &[usize]| (!of.is_empty()).then(|| of[k % of.len()]);
        match kind {
            Kind::Full => Stop::Full,
            Kind::Gone => Stop::Gone(boundary),
            Kind::Panic => Stop::Panic(boundary),
            Kind::Stall => Stop::Stall(boundary),
            Kind::Unavailable => pick(&foreign).map_or(Stop::Gone(boundary), Stop::Unavailable),
            Kind::Unknown => {
                pick(&foreign).map_or(Stop::Gone(boundary), |step| Stop::Unknown { step, charged })
            }
            Kind::GoneInCall => pick(&foreign).map_or(Stop::Gone(boundary), |step| {
                Stop::GoneInCall { step, charged }
            }),
            Kind::SlowCall => pick(&foreign).map_or(Stop::Gone(boundary), |step| Stop::SlowCall {
                step,
                charged,
            }),
            Kind::GoneInLocal => pick(&local).map_or(Stop::Gone(boundary), Stop::GoneInLocal),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The model.

/// What an attempt must have answered.
#[derive(Clone, Debug, PartialEq)]
enum Expect {
    /// A client's answer: the status, the body (when the model knows it) and whether replayed.
    Reply {
        status: StatusCode,
        body: Option<Value>,
        replayed: bool,
    },
    /// The request was dropped (the client went away).
    Dropped,
    /// The handler stalled (it goes on at a later [`Event::Resume`]).
    Stalled,
    /// The completer's round.
    Report { completed: usize, failed: usize },
}

/// The key's record.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Record {
    None,
    Live,
    /// Past its `expires_at`, not purged yet: treated as absent.
    Expired,
}

/// One life of a key: from the claim that creates its progress until the progress is deleted
/// (finished, released with nothing saved, purged). Its run id is the test's (`Lane::runs`).
#[derive(Debug, Default)]
struct Life {
    /// The order (the payload) its requests carry.
    order: usize,
    /// The provider's calls of each foreign step's key.
    calls: BTreeMap<usize, usize>,
    /// The charges of each foreign step's key, in the order taken.
    charges: BTreeMap<usize, Vec<String>>,
    /// The local steps that committed their row.
    rows: BTreeSet<usize>,
    /// It ended in its final answer.
    finished: bool,
    /// An operator's purge deleted its progress (it had no foreign step).
    purged: bool,
}

/// A key's state as the events so far must have left it.
#[derive(Debug)]
struct Model {
    program: Vec<Step>,
    /// The provider deduplicates by its idempotency key.
    dedup: bool,
    /// The order the client sends now: a new one once it had its answer and the record was
    /// deleted or expired.
    order: usize,
    /// The key's lives so far: the current one last.
    lives: Vec<Life>,
    /// How many steps of the current life have their result saved (a prefix of the program).
    committed: usize,
    /// The foreign step at `committed` has its intent saved, without a result.
    intent: bool,
    /// The key has a progress row.
    progress: bool,
    /// Running, in doubt (waiting for an operator) or dead (an operator's purge found it
    /// expired with a foreign step); meaningful while the key has progress.
    status: ProgressStatus,
    /// The completer's claims of the key's progress since it was created or resolved.
    attempts: u32,
    /// The final answer, while the record is live.
    done: Option<(StatusCode, Value)>,
    record: Record,
    /// The client went away during this local step's transaction: whether it committed is
    /// read from the store.
    uncertain: Option<usize>,
    /// The charges the provider issued (its ids count them).
    issued: usize,
    /// A request stalled on the key, and whether the key was taken from it since (a claim, a
    /// purge): it is refused when it goes on, else it runs to the end.
    stall: Option<bool>,
}

impl Model {
    fn new(program: &[Step], dedup: bool) -> Self {
        Model {
            program: program.to_vec(),
            dedup,
            order: 1,
            lives: Vec::new(),
            committed: 0,
            intent: false,
            progress: false,
            status: ProgressStatus::Running,
            attempts: 0,
            done: None,
            record: Record::None,
            uncertain: None,
            issued: 0,
            stall: None,
        }
    }

    fn life(&mut self) -> &mut Life {
        self.lives.last_mut().expect("a life")
    }

    /// The charge of step `i` in the current life (the last one, if it was charged twice).
    fn charge_of(&self, i: usize) -> Option<&String> {
        self.lives.last()?.charges.get(&i)?.last()
    }

    /// The provider charges step `i`'s key: a new charge, unless it deduplicates and has one.
    fn charge(&mut self, i: usize) {
        if self.dedup && self.charge_of(i).is_some() {
            return;
        }
        self.issued += 1;
        let id = format!("ch_{}", self.issued);
        self.life().charges.entry(i).or_default().push(id);
    }

    /// The answer of the current life run to the end: the order and the steps' results (the
    /// `n`th local step of the life returns `n`, a foreign step its charge), or the first
    /// declined step's `402` with the results before it.
    fn final_answer(&self) -> (StatusCode, Value) {
        let life = self.lives.last().expect("a life");
        let (mut locals, mut results) = (0, Vec::new());
        for (i, step) in self.program.iter().enumerate() {
            match step.foreign {
                None => {
                    locals += 1;
                    results.push(json!(locals));
                }
                Some(f) if f.declines => {
                    return (
                        StatusCode::PAYMENT_REQUIRED,
                        json!({ "declined": step.name, "order": life.order, "results": results }),
                    );
                }
                Some(_) => results.push(json!(self.charge_of(i).expect("charged"))),
            }
        }
        (
            StatusCode::CREATED,
            json!({ "order": life.order, "results": results }),
        )
    }

    /// Runs `attempt` on the model: what it answers, and the key's state after it.
    fn attempt(&mut self, attempt: Attempt) -> Expect {
        let completer = attempt.completer;
        if let Some((status, body)) = &self.done {
            return if completer {
                Expect::Report {
                    completed: 0,
                    failed: 0,
                }
            } else {
                Expect::Reply {
                    status: *status,
                    body: Some(body.clone()),
                    replayed: true,
                }
            };
        }
        // A key in doubt is answered `409` and is not the completer's.
        if self.progress && self.status == ProgressStatus::InDoubt {
            return if completer {
                Expect::Report {
                    completed: 0,
                    failed: 0,
                }
            } else {
                Expect::Reply {
                    status: StatusCode::CONFLICT,
                    body: None,
                    replayed: false,
                }
            };
        }
        // The completer only resumes a key in progress, running (a dead letter is left to a
        // client's retry or an operator).
        if completer && (!self.progress || self.status == ProgressStatus::Dead) {
            return Expect::Report {
                completed: 0,
                failed: 0,
            };
        }
        // The key is claimed: a stalled owner's lease is lost.
        if let Some(taken) = &mut self.stall {
            *taken = true;
        }
        if !self.progress {
            // A new life.
            self.lives.push(Life {
                order: self.order,
                ..Life::default()
            });
            self.committed = 0;
            self.intent = false;
            self.attempts = 0;
        }
        self.progress = true;
        self.status = ProgressStatus::Running;
        if completer {
            self.attempts += 1;
        }
        let stop = attempt.stop;
        for i in 0..self.program.len() {
            if stop.at_boundary(i) {
                return self.stopped(stop, completer);
            }
            if i < self.committed {
                continue;
            }
            let Some(foreign) = self.program[i].foreign else {
                if stop == Stop::GoneInLocal(i) {
                    self.uncertain = Some(i);
                    return Expect::Dropped;
                }
                self.committed += 1;
                self.life().rows.insert(i);
                continue;
            };
            if self.intent {
                match foreign.policy {
                    // `Ask` finds the charge an unknown outcome made.
                    Policy::Ask if self.charge_of(i).is_some() => {
                        self.intent = false;
                        self.committed += 1;
                        continue;
                    }
                    Policy::LeaveInDoubt => {
                        self.status = ProgressStatus::InDoubt;
                        return failed(completer, StatusCode::CONFLICT);
                    }
                    Policy::Ask | Policy::CallAgain => {}
                }
            }
            // The intent was saved by an earlier attempt, whose call may have taken effect.
            let earlier = self.intent;
            self.intent = true;
            *self.life().calls.entry(i).or_default() += 1;
            match stop.fault_at(i) {
                None => {
                    self.intent = false;
                    self.committed += 1;
                    if foreign.declines {
                        return self.finish(completer);
                    }
                    self.charge(i);
                }
                Some(Stop::Unavailable(_)) => {
                    // This call did nothing: only an intent it wrote itself is forgotten.
                    self.intent = earlier;
                    self.release();
                    return failed(completer, StatusCode::SERVICE_UNAVAILABLE);
                }
                Some(
                    Stop::Unknown { charged, .. }
                    | Stop::GoneInCall { charged, .. }
                    | Stop::SlowCall { charged, .. },
                ) => {
                    if charged && !foreign.declines {
                        self.charge(i);
                    }
                    self.release();
                    if matches!(stop, Stop::GoneInCall { .. }) {
                        return Expect::Dropped;
                    }
                    return failed(completer, StatusCode::SERVICE_UNAVAILABLE);
                }
                Some(other) => unreachable!("{other:?}"),
            }
        }
        if stop.at_boundary(self.program.len()) {
            return self.stopped(stop, completer);
        }
        self.finish(completer)
    }

    fn stopped(&mut self, stop: Stop, completer: bool) -> Expect {
        match stop {
            Stop::Gone(_) => {
                self.release();
                Expect::Dropped
            }
            Stop::Panic(_) => {
                self.release();
                failed(completer, StatusCode::INTERNAL_SERVER_ERROR)
            }
            // Held until it goes on: not released.
            Stop::Stall(_) => {
                self.stall = Some(false);
                Expect::Stalled
            }
            other => unreachable!("{other:?}"),
        }
    }

    /// The key is let go: its progress is deleted unless a step (or an intent) is saved (the
    /// life ends then: the next claim starts another).
    fn release(&mut self) {
        self.progress = self.committed > 0 || self.intent;
    }

    fn finish(&mut self, completer: bool) -> Expect {
        let (status, body) = self.final_answer();
        self.done = Some((status, body.clone()));
        self.record = Record::Live;
        self.progress = false;
        self.intent = false;
        self.life().finished = true;
        if completer {
            Expect::Report {
                completed: 1,
                failed: 0,
            }
        } else {
            Expect::Reply {
                status,
                body: Some(body),
                replayed: false,
            }
        }
    }

    /// The saved steps the key should have.
    fn saved_steps(&self) -> i64 {
        if self.progress {
            (self.committed + usize::from(self.intent)) as i64
        } else {
            0
        }
    }

    /// The client had its answer: its next request with the key is a new order.
    fn answer_forgotten(&mut self) {
        if self.done.take().is_some() {
            self.order += 1;
        }
    }

    /// `Admin::delete` of the record: whether there was one (live or expired).
    fn delete(&mut self) -> bool {
        let existed = self.record != Record::None;
        self.record = Record::None;
        self.answer_forgotten();
        existed
    }

    fn expire(&mut self) {
        if self.record == Record::Live {
            self.record = Record::Expired;
            self.answer_forgotten();
        }
    }

    /// `purge_expired`: how many of the key's records it deletes.
    fn purge_expired(&mut self) -> u64 {
        if self.record == Record::Expired {
            self.record = Record::None;
            1
        } else {
            0
        }
    }

    /// The current life saved a foreign step (its intent or result): money may have been
    /// taken.
    fn foreign_saved(&self) -> bool {
        self.intent
            || self.program[..self.committed]
                .iter()
                .any(|step| step.foreign.is_some())
    }

    /// `purge_progress` days ahead: how many of the key's progress rows it ends (one left
    /// running, never one in doubt or dead): deleted with its steps, or marked dead when it
    /// saved a foreign step.
    fn purge_progress(&mut self) -> u64 {
        if !self.progress || self.status != ProgressStatus::Running {
            return 0;
        }
        if let Some(taken) = &mut self.stall {
            *taken = true;
        }
        if self.foreign_saved() {
            self.status = ProgressStatus::Dead;
            return 1;
        }
        self.life().purged = true;
        self.progress = false;
        self.committed = 0;
        self.intent = false;
        self.attempts = 0;
        1
    }

    /// An operator's `resolve` (as the provider says, when in doubt): what it answers.
    fn resolve(&mut self) -> Settled {
        if !self.progress {
            return Settled::NotFound;
        }
        if self.status == ProgressStatus::Running {
            return Settled::Running;
        }
        self.status = ProgressStatus::Running;
        self.attempts = 0;
        // The intent (there is one in doubt; a dead letter may have none) is settled.
        if std::mem::take(&mut self.intent) && self.charge_of(self.committed).is_some() {
            self.committed += 1;
        }
        Settled::Resolved
    }
}

/// An attempt that ended part-way with `status` (the client's) or a failed completer round.
fn failed(completer: bool, status: StatusCode) -> Expect {
    if completer {
        Expect::Report {
            completed: 0,
            failed: 1,
        }
    } else {
        Expect::Reply {
            status,
            body: None,
            replayed: false,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The application: a handler that runs the program, and a stand-in provider.

/// The charges the provider took for one idempotency key (a step key).
#[derive(Debug)]
struct Charge {
    step: String,
    /// The charges' ids, in the order taken: one, unless the provider does not deduplicate
    /// and the key was charged again.
    ids: Vec<String>,
}

/// The payment provider: charges by its idempotency key (the step key), once per key when it
/// deduplicates (as a provider must for [`CallAgain`]), at every call otherwise.
#[derive(Debug, Default)]
struct Provider {
    deduplicates: bool,
    charges: BTreeMap<String, Charge>,
    /// Every call by key: its step, and whether each call charged (or, deduplicated, found
    /// the charge).
    calls: BTreeMap<String, (String, Vec<bool>)>,
    issued: usize,
}

impl Provider {
    fn called(&mut self, step: &str, key: &str, charged: bool) {
        let (_, calls) = self
            .calls
            .entry(key.to_owned())
            .or_insert_with(|| (step.to_owned(), Vec::new()));
        calls.push(charged);
    }

    fn charge(&mut self, step: &str, key: &str) -> String {
        if self.deduplicates {
            if let Some(charge) = self.charges.get(key) {
                return charge.ids.last().expect("a charge").clone();
            }
        }
        self.issued += 1;
        let id = format!("ch_{}", self.issued);
        let charge = self.charges.entry(key.to_owned()).or_insert(Charge {
            step: step.to_owned(),
            ids: Vec::new(),
        });
        charge.ids.push(id.clone());
        id
    }

    /// What the provider answers when asked about `key`: its (last) charge.
    fn lookup(&self, key: &str) -> Option<String> {
        self.charges.get(key).and_then(|c| c.ids.last().cloned())
    }
}

/// A local step's closure ran (and the test is told, to drop the request there).
struct Reached {
    notify: Arc<Notify>,
    ran: AtomicBool,
}

impl Reached {
    fn new(notify: Arc<Notify>) -> Self {
        Reached {
            notify,
            ran: AtomicBool::new(false),
        }
    }

    fn hit(&self) {
        self.ran.store(true, Ordering::SeqCst);
        self.notify.notify_one();
    }

    fn ran(&self) -> bool {
        self.ran.load(Ordering::SeqCst)
    }
}

/// What the handler does on its next call.
#[derive(Clone)]
struct Plan {
    stop: Stop,
    /// Notified where the attempt stops (gone, stalled).
    reached: Arc<Notify>,
    /// Notified to let a stalled handler go on.
    resume: Arc<Notify>,
}

impl Plan {
    fn new(stop: Stop) -> Self {
        Plan {
            stop,
            reached: Arc::default(),
            resume: Arc::default(),
        }
    }

    /// At boundary `i`: stops there if planned.
    async fn boundary(&self, i: usize) {
        if !self.stop.at_boundary(i) {
            return;
        }
        match self.stop {
            Stop::Gone(_) => {
                self.reached.notify_one();
                std::future::pending::<()>().await;
            }
            Stop::Panic(_) => std::panic::panic_any(PANIC),
            Stop::Stall(_) => {
                self.reached.notify_one();
                self.resume.notified().await;
            }
            _ => {}
        }
    }
}

/// What the test counts of what the cases exercised (`STEPS_MODEL_STATS=1` prints it).
#[derive(Debug, Default)]
struct Stats {
    cases: AtomicUsize,
    events: AtomicUsize,
    two_keys: AtomicUsize,
    hostile_keys: AtomicUsize,
    charging_provider: AtomicUsize,
    injected_failures: AtomicUsize,
    new_orders: AtomicUsize,
    new_lives: AtomicUsize,
    completer_runs_with_other_key_in_progress: AtomicUsize,
    in_doubt: AtomicUsize,
    resolved_done: AtomicUsize,
    resolved_call_again: AtomicUsize,
    resolve_refused_running: AtomicUsize,
    records_deleted: AtomicUsize,
    records_purged: AtomicUsize,
    progress_purged: AtomicUsize,
    purged_dead: AtomicUsize,
    dead_taken_by_client: AtomicUsize,
    stalls_refused: AtomicUsize,
    stalls_gone_on: AtomicUsize,
    resolve_refused_mid_call: AtomicUsize,
}

static STATS: Stats = Stats {
    cases: AtomicUsize::new(0),
    events: AtomicUsize::new(0),
    two_keys: AtomicUsize::new(0),
    hostile_keys: AtomicUsize::new(0),
    charging_provider: AtomicUsize::new(0),
    injected_failures: AtomicUsize::new(0),
    new_orders: AtomicUsize::new(0),
    new_lives: AtomicUsize::new(0),
    completer_runs_with_other_key_in_progress: AtomicUsize::new(0),
    in_doubt: AtomicUsize::new(0),
    resolved_done: AtomicUsize::new(0),
    resolved_call_again: AtomicUsize::new(0),
    resolve_refused_running: AtomicUsize::new(0),
    records_deleted: AtomicUsize::new(0),
    records_purged: AtomicUsize::new(0),
    progress_purged: AtomicUsize::new(0),
    purged_dead: AtomicUsize::new(0),
    dead_taken_by_client: AtomicUsize::new(0),
    stalls_refused: AtomicUsize::new(0),
    stalls_gone_on: AtomicUsize::new(0),
    resolve_refused_mid_call: AtomicUsize::new(0),
};

fn count(counter: &AtomicUsize, n: usize) {
    counter.fetch_add(n, Ordering::Relaxed);
}

/// One key's application: its program, provider and plan.
struct Shared<B> {
    /// The key, as the layer scopes it.
    scope: Scope,
    program: Vec<Step>,
    provider: Mutex<Provider>,
    plan: Mutex<Option<Plan>>,
    /// The run id each call of the handler saw, in order (taken by the test after each
    /// event).
    seen: Mutex<Vec<String>>,
    /// Calls of this handler with another key than its own (another operation's): none.
    strays: AtomicUsize,
    _backend: std::marker::PhantomData<fn() -> B>,
}

struct App<B>(Arc<Shared<B>>);

impl<B> Clone for App<B> {
    fn clone(&self) -> Self {
        App(self.0.clone())
    }
}

impl<B: Backend> App<B> {
    fn provider(&self) -> std::sync::MutexGuard<'_, Provider> {
        self.0.provider.lock().unwrap()
    }

    /// The provider's side of step `name`'s call with `fault`; a declined step's answer
    /// carries the order and the results before it.
    async fn call(
        &self,
        name: &str,
        key: &str,
        declines: bool,
        fault: Option<Stop>,
        reached: Arc<Notify>,
        declined: Value,
    ) -> Result<String, Foreign> {
        let charges = match fault {
            None => !declines,
            Some(Stop::Unavailable(_)) => {
                self.provider().called(name, key, false);
                return Err(Foreign::unavailable("provider down"));
            }
            Some(
                Stop::Unknown { charged, .. }
                | Stop::GoneInCall { charged, .. }
                | Stop::SlowCall { charged, .. },
            ) => charged && !declines,
            Some(other) => unreachable!("{other:?}"),
        };
        let id = {
            let mut provider = self.provider();
            provider.called(name, key, charges);
            charges.then(|| provider.charge(name, key))
        };
        match fault {
            None => id.ok_or_else(|| Foreign::terminal(StatusCode::PAYMENT_REQUIRED, declined)),
            // Hangs: the client goes away, or the layer cuts the call off at the lease's end.
            Some(Stop::GoneInCall { .. } | Stop::SlowCall { .. }) => {
                reached.notify_one();
                std::future::pending().await
            }
            _ => Err(Foreign::unknown("the connection dropped")),
        }
    }

    async fn foreign(
        &self,
        steps: &Steps<B::Store>,
        step: &Step,
        foreign: ForeignStep,
        fault: Option<Stop>,
        reached: Arc<Notify>,
        declined: Value,
    ) -> Result<String, StepError> {
        let name = step.name.as_str();
        let call = |key: String| async move {
            self.call(name, &key, foreign.declines, fault, reached, declined)
                .await
        };
        match foreign.policy {
            Policy::Ask => {
                let lookup = |key: String| async move { Ok(self.provider().lookup(&key)) };
                steps.foreign(name, Ask(lookup), call).await
            }
            Policy::CallAgain => steps.foreign(name, CallAgain, call).await,
            Policy::LeaveInDoubt => steps.foreign(name, LeaveInDoubt, call).await,
        }
    }
}

/// Runs the program for the order in the request's body, stopping where the plan says.
async fn handler<B: Backend>(
    State(app): State<App<B>>,
    steps: Steps<B::Store>,
    body: Bytes,
) -> Response {
    if *steps.scope() != app.0.scope {
        // Another operation's key: this handler must never run it.
        app.0.strays.fetch_add(1, Ordering::SeqCst);
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    }
    let order = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|body| body["order"].as_u64());
    let plan = app.0.plan.lock().unwrap().take();
    let plan = plan.unwrap_or_else(|| Plan::new(Stop::Full));
    app.0.seen.lock().unwrap().push(steps.run_id().to_owned());
    let mut results = Vec::new();
    for (i, step) in app.0.program.iter().enumerate() {
        plan.boundary(i).await;
        let result = match step.foreign {
            None => {
                let reached = (plan.stop == Stop::GoneInLocal(i))
                    .then(|| Arc::new(Reached::new(plan.reached.clone())));
                let local =
                    |fail| B::local(steps.clone(), step.name.clone(), fail, reached.clone());
                let mut result = local(step.flaky).await;
                if step.flaky && matches!(result, Err(StepError::Store(_))) {
                    // The injected failure rolled the step back: called again, it takes the
                    // same place.
                    count(&STATS.injected_failures, 1);
                    result = local(false).await;
                }
                if reached.is_some_and(|reached| reached.ran()) {
                    // The client went away inside this step: nothing after it runs. (Else the
                    // handler may queue its next step before the test's abort reaches it, and
                    // SQLite's writer thread commits what was queued.)
                    std::future::pending::<()>().await;
                }
                result.map(Value::from)
            }
            Some(foreign) => {
                let fault = plan.stop.fault_at(i);
                let declined = json!({ "declined": step.name, "order": order, "results": results });
                app.foreign(&steps, step, foreign, fault, plan.reached.clone(), declined)
                    .await
                    .map(Value::from)
            }
        };
        match result {
            Ok(value) => results.push(value),
            Err(StepError::Terminal(answer)) => return answer.into_response(),
            Err(error) => return error.into_response(),
        }
    }
    plan.boundary(app.0.program.len()).await;
    (
        StatusCode::CREATED,
        Json(json!({ "order": order, "results": results })),
    )
        .into_response()
}

// ---------------------------------------------------------------------------------------------
// Running a case.

#[derive(Clone, Debug, PartialEq)]
struct Reply {
    status: StatusCode,
    replayed: bool,
    body: Bytes,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

/// How an attempt ended, as seen by the test.
#[derive(Debug)]
enum Ended {
    Reply(Reply),
    Report(CompleterReport),
    Dropped,
    Stalled,
}

/// A key of the case: its operation's layer, its application and its model.
struct Lane<B: Backend> {
    operation: &'static str,
    path: &'static str,
    /// The key as the client sends it.
    header: String,
    app: App<B>,
    layer: IdempotencyLayer<B::Store>,
    scope: Scope,
    model: Model,
    /// A stalled request, waiting for its [`Event::Resume`], and when its lease is over.
    stalled: Option<(tokio::task::JoinHandle<Reply>, Plan, std::time::Instant)>,
    /// The run id of each life of the key, as its handler saw it.
    runs: Vec<String>,
    /// The final answer of each order, as the client got it first.
    answers: BTreeMap<usize, Reply>,
}

struct Run<B: Backend> {
    backend: Arc<B>,
    router: Router,
    lanes: Vec<Lane<B>>,
    /// What happened so far, for the failure message.
    log: Vec<String>,
}

/// A key never used before, as stored (unquoted) and as its client spells it.
fn fresh_key(form: KeyForm) -> (String, String) {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = format!(
        "{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    match form {
        KeyForm::Plain => (format!("model-{n}"), format!("model-{n}")),
        KeyForm::Quoted => (format!("model-{n}"), sf_string(&format!("model-{n}"))),
        KeyForm::LeadingQuote => {
            let key = format!("\"evil-{n}");
            (key.clone(), sf_string(&key))
        }
        KeyForm::InQuotes => {
            let key = format!("\"x-{n}\"");
            (key.clone(), sf_string(&key))
        }
        KeyForm::Punctuation => {
            let key = format!("k'%_\"\\;-{n}");
            (key.clone(), key)
        }
    }
}

/// `key` as an RFC 8941 sf-string.
fn sf_string(key: &str) -> String {
    format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The body of the client's request for `order`.
fn payload(order: usize) -> String {
    json!({ "order": order }).to_string()
}

async fn send(router: Router, path: &str, key: String, order: usize) -> Reply {
    let request = http::Request::post(path)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(payload(order)))
        .unwrap();
    let response = router.oneshot(request).await.unwrap();
    let status = response.status();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    Reply {
        status,
        replayed,
        body,
    }
}

async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(HUNG, future)
        .await
        .unwrap_or_else(|_| panic!("{what} hung"))
}

/// What an operator sees of a key in progress, to tell whether anything changed.
type Snapshot = Vec<(
    ProgressStatus,
    i64,
    u32,
    SystemTime,
    SystemTime,
    u32,
    String,
)>;

fn snapshot(listed: &[Progress]) -> Snapshot {
    listed
        .iter()
        .map(|p| {
            (
                p.status,
                p.generation,
                p.attempts,
                p.lease_until,
                p.updated_at,
                p.steps,
                p.run.clone(),
            )
        })
        .collect()
}

impl<B: Backend> Run<B> {
    fn new(backend: Arc<B>, case: &Case) -> Self {
        let mut lanes = Vec::new();
        let mut router = Router::new();
        let mut first_key = None;
        for (index, lane) in case.lanes.iter().enumerate() {
            let (key, header) = match &first_key {
                Some(key) if case.same_key => (String::clone(key), sf_string(key)),
                _ => fresh_key(lane.key),
            };
            first_key.get_or_insert_with(|| key.clone());
            let scope = Scope::new(
                TENANT,
                OPERATIONS[index],
                IdempotencyKey::parse(header.as_bytes(), 128).unwrap(),
            );
            assert_eq!(scope.key.as_str(), key, "the key is stored unquoted");
            let app = App(Arc::new(Shared {
                scope: scope.clone(),
                program: lane.program.clone(),
                provider: Mutex::new(Provider {
                    deduplicates: case.dedup,
                    ..Provider::default()
                }),
                plan: Mutex::new(None),
                seen: Mutex::new(Vec::new()),
                strays: AtomicUsize::new(0),
                _backend: std::marker::PhantomData,
            }));
            let lease = if case.stalls(index) {
                SHORT_LEASE
            } else {
                LEASE
            };
            let layer = IdempotencyLayer::new(backend.store().clone())
                .with_operation(OPERATIONS[index])
                .with_lock_timeout(Duration::from_secs(10))
                .with_step_lease(lease);
            router = router.route(
                PATHS[index],
                post(handler::<B>)
                    .with_state(app.clone())
                    .layer(layer.clone()),
            );
            lanes.push(Lane {
                operation: OPERATIONS[index],
                path: PATHS[index],
                header,
                app,
                layer,
                scope,
                model: Model::new(&lane.program, case.dedup),
                stalled: None,
                runs: Vec::new(),
                answers: BTreeMap::new(),
            });
        }
        let router = router.layer(Extension(Tenant::new(TENANT)));
        Run {
            backend,
            router,
            lanes,
            log: Vec::new(),
        }
    }

    fn admin(&self) -> Admin<B::Store> {
        Admin::new(self.backend.store().clone())
    }

    /// Sends the client's request for its current order on `lane`.
    fn send(&self, lane: usize) -> impl Future<Output = Reply> + Send + 'static {
        let lane = &self.lanes[lane];
        send(
            self.router.clone(),
            lane.path,
            lane.header.clone(),
            lane.model.order,
        )
    }

    fn assert(&self, holds: bool, what: &str) {
        if holds {
            return;
        }
        let lanes: Vec<String> = self
            .lanes
            .iter()
            .map(|lane| {
                format!(
                    "key {:?} of {} (sent as {:?}), runs {:?}: {:?}",
                    lane.scope.key.as_str(),
                    lane.operation,
                    lane.header,
                    lane.runs,
                    lane.model
                )
            })
            .collect();
        panic!(
            "{what}\nthe keys:\n  {}\nthe events:\n  {}",
            lanes.join("\n  "),
            self.log.join("\n  ")
        );
    }

    /// Runs `attempt` on `l` and checks it against the model.
    async fn attempt(&mut self, l: usize, attempt: Attempt) {
        count(&STATS.events, 1);
        if attempt.completer
            && self
                .lanes
                .iter()
                .enumerate()
                .any(|(other, lane)| other != l && lane.model.progress)
        {
            count(&STATS.completer_runs_with_other_key_in_progress, 1);
        }
        let lives = self.lanes[l].model.lives.len();
        let model = &self.lanes[l].model;
        if !attempt.completer && model.progress && model.status == ProgressStatus::Dead {
            count(&STATS.dead_taken_by_client, 1);
        }
        let in_doubt = |model: &Model| model.progress && model.status == ProgressStatus::InDoubt;
        let was_in_doubt = in_doubt(&self.lanes[l].model);
        let expected = self.lanes[l].model.attempt(attempt);
        if self.lanes[l].model.lives.len() > lives {
            count(&STATS.new_lives, 1);
        }
        if in_doubt(&self.lanes[l].model) && !was_in_doubt {
            count(&STATS.in_doubt, 1);
        }
        let started = std::time::Instant::now();
        let ended = self.run(l, attempt).await;
        self.log.push(format!(
            "{} {attempt:?}: expected {expected:?}, got {ended:?} in {:?}",
            self.lanes[l].operation,
            started.elapsed()
        ));
        if matches!(ended, Ended::Dropped) {
            let started = std::time::Instant::now();
            self.settle(l).await;
            self.log.push(format!("settled in {:?}", started.elapsed()));
        }
        self.observe_runs(l);
        if self.lanes[l].model.lives.len() > lives && self.lanes[l].model.record == Record::Expired
        {
            // A new life of a key whose record expired: the claim may delete the record
            // (SQLite does), or leave it to the finish or a purge (the SQL servers do).
            let lane = &self.lanes[l];
            let record = self
                .admin()
                .inspect(TENANT, lane.operation, lane.scope.key.as_str(), false)
                .await
                .expect("inspect");
            if record.is_none() {
                self.log.push("the claim deleted the expired record".into());
                self.lanes[l].model.record = Record::None;
            }
        }
        if let Some(step) = self.lanes[l].model.uncertain.take() {
            // The client went away inside the step's transaction: it committed or not, and
            // its row and its result with it.
            let lane = &self.lanes[l];
            let run = lane.runs.last().expect("the life's run").clone();
            let name = lane.model.program[step].name.clone();
            let rows = self.backend.rows(&lane.scope).await;
            let model = &mut self.lanes[l].model;
            if rows.get(&(run, name)) == Some(&1) {
                model.committed += 1;
                model.life().rows.insert(step);
            }
            model.release();
        }
        self.check(&expected, &ended);
        if let Ended::Reply(reply) = &ended {
            self.answered(l, reply);
        }
        // The completer finished the key: the client's next retry gets the answer.
        if matches!(ended, Ended::Report(report) if report.completed > 0) {
            let reply = within("a retry", self.send(l)).await;
            self.log.push(format!("the client's retry: {reply:?}"));
            let (status, body) = self.lanes[l].model.done.clone().expect("done");
            self.assert(
                reply.replayed && reply.status == status && reply.json() == body,
                "the client's retry replays what the completer saved",
            );
            self.answered(l, &reply);
        }
        self.check_state().await;
    }

    /// The key's stalled request goes on: refused if the key was taken from it meanwhile, else
    /// to the end.
    async fn resume(&mut self, l: usize) {
        count(&STATS.events, 1);
        let taken = self.lanes[l].model.stall.take();
        let stalled = self.lanes[l].stalled.take();
        self.assert(
            taken.is_some() == stalled.is_some(),
            "a request stalled as the model says",
        );
        // The planned stall was not reached (the attempt ended before it, or was a replay).
        let (Some(taken), Some((task, plan, _))) = (taken, stalled) else {
            return;
        };
        count(
            if taken {
                &STATS.stalls_refused
            } else {
                &STATS.stalls_gone_on
            },
            1,
        );
        let expected = if taken {
            Expect::Reply {
                status: StatusCode::SERVICE_UNAVAILABLE,
                body: None,
                replayed: false,
            }
        } else {
            self.lanes[l].model.attempt(Attempt {
                completer: false,
                stop: Stop::Full,
            })
        };
        plan.resume.notify_one();
        let reply = within("the stalled request", task)
            .await
            .expect("the stalled request");
        let ended = Ended::Reply(reply.clone());
        self.log.push(format!(
            "{} the stalled request goes on (the key {}): expected {expected:?}, got {ended:?}",
            self.lanes[l].operation,
            if taken { "was taken" } else { "is still its" },
        ));
        self.observe_runs(l);
        self.check(&expected, &ended);
        self.answered(l, &reply);
        self.check_state().await;
    }

    /// Waits until the leases of the stalled requests on `lanes` are over: the key is left
    /// alone then (a purge may end it, a client or the completer takes it at once).
    async fn lease_over(&self, lanes: &[usize]) {
        for &l in lanes {
            if let Some((_, _, over)) = &self.lanes[l].stalled {
                tokio::time::sleep_until((*over).into()).await;
            }
        }
    }

    /// Keeps the first final answer of the lane's current order.
    fn answered(&mut self, l: usize, reply: &Reply) {
        let lane = &mut self.lanes[l];
        if lane.model.done.is_some() {
            lane.answers
                .entry(lane.model.order)
                .or_insert_with(|| reply.clone());
        }
    }

    /// Takes the run ids the lane's handler saw: a new life's is one never seen before, and
    /// every other call of the handler sees its life's.
    fn observe_runs(&mut self, l: usize) {
        let seen = std::mem::take(&mut *self.lanes[l].app.0.seen.lock().unwrap());
        for run in seen {
            let lane = &self.lanes[l];
            if lane.runs.len() < lane.model.lives.len() {
                let fresh = !self.lanes.iter().any(|lane| lane.runs.contains(&run));
                self.assert(fresh, &format!("a new life has a new run id: {run}"));
                self.lanes[l].runs.push(run);
            } else {
                self.assert(
                    lane.runs.last() == Some(&run),
                    &format!("the handler runs in the key's life: {run}"),
                );
            }
        }
        let lane = &self.lanes[l];
        self.assert(
            lane.runs.len() == lane.model.lives.len(),
            "each life's handler ran",
        );
    }

    async fn run(&mut self, l: usize, attempt: Attempt) -> Ended {
        let plan = Plan::new(attempt.stop);
        let slow = matches!(attempt.stop, Stop::SlowCall { .. });
        let lane = &self.lanes[l];
        *lane.app.0.plan.lock().unwrap() = Some(plan.clone());
        let ended = if attempt.completer {
            let handler = post(handler::<B>).with_state(lane.app.clone());
            let mut completer = lane
                .layer
                .completer(handler)
                .with_idle(Duration::ZERO)
                .with_max_attempts(1000);
            let round = completer.run_once();
            tokio::pin!(round);
            let ended = within("the completer", async {
                tokio::select! {
                    report = &mut round => {
                        Ended::Report(report.expect("the completer's round"))
                    }
                    // The completer's process went away: its round is dropped.
                    () = plan.reached.notified() => Ended::Dropped,
                }
            })
            .await;
            if slow && matches!(ended, Ended::Dropped) {
                // The call hangs until the layer cuts it off.
                self.mid_call(l).await;
                let report = within("the completer", round).await;
                Ended::Report(report.expect("the completer's round"))
            } else {
                ended
            }
        } else {
            let mut task = tokio::spawn(self.send(l));
            let stall = matches!(attempt.stop, Stop::Stall(_));
            let ended = within("the request", async {
                tokio::select! {
                    reply = &mut task => Ended::Reply(reply.expect("the request")),
                    () = plan.reached.notified() => {
                        if stall { Ended::Stalled } else { Ended::Dropped }
                    }
                }
            })
            .await;
            match ended {
                // Still running: kept until it goes on.
                Ended::Stalled => {
                    let over = std::time::Instant::now() + SHORT_LEASE + Duration::from_millis(100);
                    self.lanes[l].stalled = Some((task, plan.clone(), over));
                }
                // The call hangs until the layer cuts it off.
                Ended::Dropped if slow => {
                    self.mid_call(l).await;
                    let reply = within("the request", task).await;
                    return self.ran(l, Ended::Reply(reply.expect("the request")));
                }
                // The client went away: the request future is dropped.
                Ended::Dropped => {
                    task.abort();
                    let _ = task.await;
                }
                _ => {}
            }
            ended
        };
        self.ran(l, ended)
    }

    /// The attempt on `l` ended: its plan is done.
    fn ran(&mut self, l: usize, ended: Ended) -> Ended {
        self.lanes[l].app.0.plan.lock().unwrap().take();
        ended
    }

    /// An operator's resolve while the key's owner is in the middle of a call: refused (the
    /// key is running), and nothing changes.
    async fn mid_call(&mut self, l: usize) {
        // What a resolve would change (the call may be cut off meanwhile: a release ends the
        // lease, and changes nothing else).
        let owner = |listed: &[Progress]| -> Vec<_> {
            listed
                .iter()
                .map(|p| (p.status, p.generation, p.attempts, p.steps, p.run.clone()))
                .collect()
        };
        let before = owner(&self.listed(l).await);
        let lane = &self.lanes[l];
        let seq = lane.model.committed as u32;
        let settled = self
            .admin()
            .resolve_steps(
                TENANT,
                lane.operation,
                lane.scope.key.as_str(),
                Some(seq),
                &Resolution::CallAgain,
            )
            .await
            .expect("resolve");
        self.log.push(format!(
            "{} operator Resolve during the call of step {seq}: {settled:?}",
            lane.operation
        ));
        count(&STATS.resolve_refused_mid_call, 1);
        self.assert(
            settled == Settled::Running,
            "a key whose owner is in the middle of a call cannot be resolved",
        );
        self.assert(
            owner(&self.listed(l).await) == before,
            "a resolve refused mid-call changes nothing",
        );
    }

    /// Waits until a dropped request's key is let go (released in the background).
    async fn settle(&self, l: usize) {
        let scope = &self.lanes[l].scope;
        within("the release of a dropped request", async {
            loop {
                let now = SystemTime::now();
                let idle = self
                    .backend
                    .store()
                    .progress(&listing(ProgressStatus::Running, Some(now), now, 1000))
                    .await
                    .expect("progress")
                    .keys;
                if idle.iter().any(|p| p.scope == *scope)
                    || self.backend.leftovers(scope).await.0 == 0
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
    }

    fn check(&self, expected: &Expect, ended: &Ended) {
        let holds = match (expected, ended) {
            (
                Expect::Reply {
                    status,
                    body,
                    replayed,
                },
                Ended::Reply(reply),
            ) => {
                reply.status == *status
                    && reply.replayed == *replayed
                    && body.as_ref().is_none_or(|body| reply.json() == *body)
            }
            (Expect::Dropped, Ended::Dropped) | (Expect::Stalled, Ended::Stalled) => true,
            (Expect::Report { completed, failed }, Ended::Report(report)) => {
                report.completed == *completed
                    && report.failed == *failed
                    && report.dead == 0
                    && report.skipped == 0
            }
            _ => false,
        };
        self.assert(holds, "the attempt ended as the model says");
    }

    /// The key's progress rows as listed for its operation (running, in doubt and dead).
    async fn listed(&self, l: usize) -> Vec<Progress> {
        let lane = &self.lanes[l];
        let mut listed = Vec::new();
        for status in [
            ProgressStatus::Running,
            ProgressStatus::InDoubt,
            ProgressStatus::Dead,
        ] {
            let now = SystemTime::now();
            let page = self
                .backend
                .store()
                .progress(&listing(status, None, now, 1000).operation(lane.operation))
                .await
                .expect("progress");
            self.assert(page.skipped == 0, "every row of the listing reads back");
            listed.extend(
                page.keys
                    .into_iter()
                    .filter(|p| p.scope.key == lane.scope.key),
            );
        }
        listed
    }

    /// Every key's rows, charges, calls, progress, listing and record against its model.
    async fn check_state(&self) {
        for l in 0..self.lanes.len() {
            self.check_lane(l).await;
        }
    }

    async fn check_lane(&self, l: usize) {
        let lane = &self.lanes[l];
        let model = &lane.model;
        let name = |i: usize| model.program[i].name.clone();
        self.assert(
            lane.app.0.strays.load(Ordering::SeqCst) == 0,
            "each completer and route only ran its own operation's key",
        );
        let lives: Vec<(&Life, &String)> = model.lives.iter().zip(&lane.runs).collect();
        let rows = self.backend.rows(&lane.scope).await;
        let expected: BTreeMap<(String, String), i64> = lives
            .iter()
            .flat_map(|(life, run)| life.rows.iter().map(|&i| (((*run).clone(), name(i)), 1)))
            .collect();
        self.assert(
            rows == expected,
            &format!("each committed local step wrote its row once in its life: {rows:?}"),
        );
        let (charges, calls, policy_held) = {
            let provider = lane.app.provider();
            let charges: BTreeMap<String, (String, Vec<String>)> = provider
                .charges
                .iter()
                .map(|(key, c)| (key.clone(), (c.step.clone(), c.ids.clone())))
                .collect();
            let calls: BTreeMap<String, usize> = provider
                .calls
                .iter()
                .map(|(key, (_, calls))| (key.clone(), calls.len()))
                .collect();
            // A call after one that charged (or found the charge) is only ever a `CallAgain`
            // step's, whatever the model says.
            let policy_held = provider.calls.values().all(|(step, calls)| {
                let again = calls
                    .iter()
                    .position(|&charged| charged)
                    .map_or(0, |first| calls.len() - first - 1);
                again == 0 || policy_of(&model.program, step) == Some(Policy::CallAgain)
            });
            (charges, calls, policy_held)
        };
        self.assert(
            policy_held,
            &format!("a step is called again after a charge only if it is CallAgain: {calls:?}"),
        );
        let key = |run: &str, i: usize| step_key(run, &lane.scope, &name(i));
        let expected: BTreeMap<String, (String, Vec<String>)> = lives
            .iter()
            .flat_map(|(life, run)| {
                life.charges
                    .iter()
                    .map(|(&i, ids)| (key(run, i), (name(i), ids.clone())))
            })
            .collect();
        self.assert(
            charges == expected,
            &format!("the provider charged each step key as the model says: {charges:?}"),
        );
        let expected: BTreeMap<String, usize> = lives
            .iter()
            .flat_map(|(life, run)| life.calls.iter().map(|(&i, &n)| (key(run, i), n)))
            .collect();
        self.assert(
            calls == expected,
            &format!("the provider was called as the model says: {calls:?}"),
        );
        let leftovers = self.backend.leftovers(&lane.scope).await;
        self.assert(
            leftovers == (i64::from(model.progress), model.saved_steps()),
            &format!("the key's progress and saved steps (rows: {leftovers:?})"),
        );
        let listed = self.listed(l).await;
        if model.progress {
            let status = model.status;
            let holds = match listed.as_slice() {
                [p] => {
                    p.scope == lane.scope
                        && p.status == status
                        && Some(&p.run) == lane.runs.last()
                        && i64::from(p.steps) == model.saved_steps()
                        && p.attempts == model.attempts
                        && p.request.uri == lane.path
                        && p.request.body == payload(model.lives.last().expect("a life").order)
                }
                _ => false,
            };
            self.assert(
                holds,
                &format!("the key is listed as the model says: {listed:?}"),
            );
        } else {
            self.assert(
                listed.is_empty(),
                &format!("the key is not listed: {listed:?}"),
            );
        }
        let record = self
            .admin()
            .inspect(TENANT, lane.operation, lane.scope.key.as_str(), false)
            .await
            .expect("inspect");
        let state = record.map(|record| record.state);
        let expected = match model.record {
            Record::None => None,
            Record::Live => Some(RecordState::Live),
            Record::Expired => Some(RecordState::Expired),
        };
        self.assert(
            state == expected,
            &format!("the key's record is {expected:?}: {state:?}"),
        );
    }

    /// Runs an operator's `action` on `l` and checks it against the model.
    async fn operator(&mut self, l: usize, action: Operator) {
        count(&STATS.events, 1);
        let lane = &self.lanes[l];
        let (operation, key) = (lane.operation, lane.scope.key.as_str().to_owned());
        let listed = self.listed(l).await;
        let leftovers = self.backend.leftovers(&lane.scope).await;
        let mut unchanged = false;
        let outcome = match action {
            Operator::Delete => {
                let deleted = self
                    .admin()
                    .delete(TENANT, operation, &key)
                    .await
                    .expect("delete");
                let expected = self.lanes[l].model.delete();
                count(&STATS.records_deleted, usize::from(deleted));
                self.assert(
                    deleted == expected,
                    &format!("delete finds a record as the model says: {deleted}"),
                );
                // A key's progress is not its record's.
                unchanged = true;
                format!("deleted {deleted}")
            }
            Operator::Expire { purge } => {
                self.backend.expire_record(&self.lanes[l].scope).await;
                self.lanes[l].model.expire();
                if purge {
                    let purged = self
                        .backend
                        .store()
                        .purge_expired(SystemTime::now(), 1000)
                        .await
                        .expect("purge expired");
                    let expected: u64 = self
                        .lanes
                        .iter_mut()
                        .map(|lane| lane.model.purge_expired())
                        .sum();
                    count(&STATS.records_purged, purged as usize);
                    self.assert(
                        purged == expected,
                        &format!("purge_expired deletes the expired records: {purged}"),
                    );
                    format!("purged {purged}")
                } else {
                    String::new()
                }
            }
            Operator::PurgeProgress => {
                let dead = self
                    .lanes
                    .iter()
                    .filter(|lane| {
                        lane.model.progress
                            && lane.model.status == ProgressStatus::Running
                            && lane.model.foreign_saved()
                    })
                    .count();
                let purged = self
                    .backend
                    .store()
                    .purge_progress(SystemTime::now() + PURGE_AHEAD, 1000)
                    .await
                    .expect("purge progress");
                let expected: u64 = self
                    .lanes
                    .iter_mut()
                    .map(|lane| lane.model.purge_progress())
                    .sum();
                count(&STATS.progress_purged, purged as usize);
                count(&STATS.purged_dead, dead);
                self.assert(
                    purged == expected,
                    &format!("purge_progress ends the keys left running: {purged}"),
                );
                format!("purged {purged}")
            }
            Operator::Resolve => {
                let model = &self.lanes[l].model;
                let seq = model.committed;
                if model.progress && model.status != ProgressStatus::Running {
                    let progress = listed.first().expect("listed in doubt or dead").clone();
                    // The key as listed (exactly as stored).
                    let listed_key = progress.scope.key.as_str().to_owned();
                    if seq > 0 {
                        let settled = self
                            .admin()
                            .resolve_steps(
                                TENANT,
                                operation,
                                &listed_key,
                                Some(seq as u32 - 1),
                                &Resolution::CallAgain,
                            )
                            .await
                            .expect("resolve");
                        self.assert(
                            settled == Settled::NoIntent,
                            &format!("a step with its result is no intent: {settled:?}"),
                        );
                        self.assert(
                            snapshot(&self.listed(l).await) == snapshot(&listed),
                            "a refused resolve changes nothing",
                        );
                    }
                    // The intent's step: the operator asks the provider about its key, from the
                    // listing. A dead letter without one is only made running again.
                    let model = &self.lanes[l].model;
                    let (at, resolution) = if model.intent {
                        let name = &model.program[seq].name;
                        let step = step_key(&progress.run, &progress.scope, name);
                        let found = self.lanes[l].app.provider().lookup(&step);
                        count(
                            if found.is_some() {
                                &STATS.resolved_done
                            } else {
                                &STATS.resolved_call_again
                            },
                            1,
                        );
                        let resolution = found.map_or(Resolution::CallAgain, |id| {
                            Resolution::Done(Value::from(id))
                        });
                        (Some(seq as u32), resolution)
                    } else {
                        (None, Resolution::CallAgain)
                    };
                    let settled = self
                        .admin()
                        .resolve_steps(TENANT, operation, &listed_key, at, &resolution)
                        .await
                        .expect("resolve");
                    let expected = self.lanes[l].model.resolve();
                    self.assert(
                        settled == expected,
                        &format!("resolve of a key in doubt or dead: {settled:?} ({resolution:?})"),
                    );
                    format!("{settled:?} at {at:?} ({resolution:?})")
                } else {
                    let settled = self
                        .admin()
                        .resolve_steps(
                            TENANT,
                            operation,
                            &key,
                            Some(seq as u32),
                            &Resolution::CallAgain,
                        )
                        .await
                        .expect("resolve");
                    let expected = self.lanes[l].model.resolve();
                    if settled == Settled::Running {
                        count(&STATS.resolve_refused_running, 1);
                    }
                    self.assert(
                        settled == expected,
                        &format!("resolve of a key not in doubt: {settled:?}"),
                    );
                    unchanged = true;
                    format!("{settled:?}")
                }
            }
        };
        self.log.push(format!(
            "{} operator {action:?}: {outcome}",
            self.lanes[l].operation
        ));
        if unchanged {
            self.assert(
                snapshot(&self.listed(l).await) == snapshot(&listed)
                    && self.backend.leftovers(&self.lanes[l].scope).await == leftovers,
                "the key's progress and steps did not change",
            );
        }
        self.check_state().await;
    }

    /// The case: its events, then on each key an operator's resolve if it is in doubt and a
    /// client's attempt to the end, the replays, and the money.
    async fn case(mut self, case: &Case) {
        count(&STATS.cases, 1);
        count(&STATS.two_keys, usize::from(case.lanes.len() > 1));
        count(&STATS.charging_provider, usize::from(!case.dedup));
        count(
            &STATS.hostile_keys,
            case.lanes
                .iter()
                .filter(|lane| !matches!(lane.key, KeyForm::Plain | KeyForm::Quoted))
                .count(),
        );
        let every: Vec<usize> = (0..self.lanes.len()).collect();
        for &event in &case.events {
            match event {
                Event::Attempt { lane, attempt } => {
                    self.lease_over(&[lane]).await;
                    self.attempt(lane, attempt).await;
                }
                Event::Operator { lane, action } => {
                    // A purge of progress acts on every key of the store, and only on keys
                    // left alone. The others may find a stalled owner holding the key (a
                    // resolve is then refused: the key is running).
                    if action == Operator::PurgeProgress {
                        self.lease_over(&every).await;
                    }
                    self.operator(lane, action).await;
                }
                Event::Resume { lane } => self.resume(lane).await,
            }
        }
        for l in 0..self.lanes.len() {
            // The last attempt may find an intent its step's policy leaves in doubt: it is
            // resolved, and the client retries.
            for _ in 0..2 {
                let model = &self.lanes[l].model;
                if model.progress && model.status == ProgressStatus::InDoubt {
                    self.operator(l, Operator::Resolve).await;
                }
                self.attempt(
                    l,
                    Attempt {
                        completer: false,
                        stop: Stop::Full,
                    },
                )
                .await;
                if self.lanes[l].model.done.is_some() {
                    break;
                }
            }
            let model = &self.lanes[l].model;
            self.assert(model.done.is_some(), "the last attempt finished the key");
            let (status, body) = model.final_answer();
            let first = within("a replay", self.send(l)).await;
            for _ in 0..2 {
                let again = within("a replay", self.send(l)).await;
                self.assert(
                    again == first && again.replayed,
                    &format!("every retry replays the answer byte for byte: {again:?} {first:?}"),
                );
            }
            self.assert(
                first.status == status && first.json() == body,
                &format!("the answer is the model's: {first:?}"),
            );
            self.assert(
                self.backend.leftovers(&self.lanes[l].scope).await == (0, 0),
                "nothing is left in progress",
            );
        }
        let orders: usize = self.lanes.iter().map(|lane| lane.model.order - 1).sum();
        count(&STATS.new_orders, orders);
        for l in 0..self.lanes.len() {
            self.money(l);
        }
    }

    /// Money taken is orders paid: every charge the provider took is in exactly one order's
    /// final answer (each charge id once, under the key of its step in the life that
    /// answered).
    fn money(&self, l: usize) {
        let lane = &self.lanes[l];
        let model = &lane.model;
        // Every charge: its id, and the step key it was taken for.
        let mut taken: BTreeMap<String, String> = BTreeMap::new();
        for (key, charge) in &lane.app.provider().charges {
            for id in &charge.ids {
                self.assert(
                    taken.insert(id.clone(), key.clone()).is_none(),
                    "a charge id is issued once",
                );
            }
        }
        let mut accounted: BTreeMap<String, String> = BTreeMap::new();
        let mut account = |id: &str, key: String, what: String| {
            self.assert(
                taken.get(id) == Some(&key),
                &format!("{what}: the charge {id} was taken for its step's key"),
            );
            self.assert(
                accounted.insert(id.to_owned(), what.clone()).is_none(),
                &format!("{what}: the charge {id} is accounted for once"),
            );
        };
        self.assert(
            lane.answers.len() == model.order,
            &format!("every order got its final answer: {:?}", lane.answers),
        );
        for (&order, reply) in &lane.answers {
            let finished = model
                .lives
                .iter()
                .position(|life| life.order == order && life.finished);
            let Some(life) = finished else {
                self.assert(false, &format!("order {order} finished in a life"));
                return;
            };
            let run = &lane.runs[life];
            let body = reply.json();
            self.assert(
                body["order"] == json!(order),
                &format!("order {order}'s answer is its own: {body}"),
            );
            let results = body["results"].as_array().cloned().unwrap_or_default();
            for (i, result) in results.iter().enumerate() {
                if model.program[i].foreign.is_none() {
                    continue;
                }
                let id = result.as_str().unwrap_or_default();
                let key = step_key(run, &lane.scope, &model.program[i].name);
                account(id, key, format!("order {order} ({})", reply.status));
            }
        }
        // A life that ended without an answer (released with nothing saved, or purged with
        // local steps only: a purge never forgets a key with a foreign step) took no money.
        self.assert(
            model
                .lives
                .iter()
                .all(|life| life.finished || life.charges.is_empty()),
            "a life without an answer took no money",
        );
        let taken: BTreeSet<&String> = taken.keys().collect();
        let paid: BTreeSet<&String> = accounted.keys().collect();
        self.assert(
            taken == paid,
            &format!("money taken is orders paid: taken {taken:?}, accounted {accounted:?}"),
        );
    }
}

/// The policy of the step named `name`, if it is foreign.
fn policy_of(program: &[Step], name: &str) -> Option<Policy> {
    program
        .iter()
        .find(|step| step.name == name)
        .and_then(|step| step.foreign)
        .map(|foreign| foreign.policy)
}

/// Keeps the handler's planned panics out of the output (the layer catches them).
fn quiet_planned_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if info.payload().downcast_ref::<&str>() != Some(&PANIC) {
                default(info);
            }
        }));
    });
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// The seed of a run: `STEPS_MODEL_SEED` (32 hexadecimal digits) to replay one, else a new
/// one.
fn seed() -> [u8; 16] {
    if let Ok(hex) = std::env::var("STEPS_MODEL_SEED") {
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("STEPS_MODEL_SEED is hex"))
            .collect();
        return bytes
            .try_into()
            .expect("STEPS_MODEL_SEED has 32 hex digits");
    }
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .expect("after 1970")
        .as_nanos();
    // Spread over the 16 bytes (an odd multiplier is a bijection).
    let mixed = (nanos ^ (u128::from(std::process::id()) << 64))
        .wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
    mixed.to_le_bytes()
}

/// Runs `cases` random cases on the backend `make` gives (none when it is not available),
/// all on one runtime and one store, fresh keys each.
fn run_cases<B: Backend>(make: impl Future<Output = Option<B>>, cases: u32) {
    quiet_planned_panics();
    let runtime = runtime();
    let Some(backend) = runtime.block_on(make) else {
        return;
    };
    let backend = Arc::new(backend);
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(cases);
    let seed = seed();
    let mut runner = TestRunner::new_with_rng(
        Config {
            cases,
            failure_persistence: None,
            max_shrink_iters: 256,
            ..Config::default()
        },
        TestRng::from_seed(RngAlgorithm::XorShift, &seed),
    );
    let outcome = runner.run(&arb_case(), |case| {
        runtime.block_on(async {
            backend.clear().await;
            Run::new(backend.clone(), &case).case(&case).await;
        });
        Ok(())
    });
    if std::env::var_os("STEPS_MODEL_STATS").is_some() {
        eprintln!("{STATS:#?}");
    }
    if let Err(error) = outcome {
        let seed: String = seed.iter().map(|b| format!("{b:02x}")).collect();
        panic!("{error}\n(replay with STEPS_MODEL_SEED={seed} PROPTEST_CASES={cases})");
    }
}

/// The cases per store; fewer than the property needs to be thorough, but each run draws new
/// ones.
const CASES: u32 = 48;

mod sqlite {
    use tower_idempotency::store::sqlite::{rusqlite, SqliteStore};

    use super::*;

    pub(super) struct Sqlite {
        store: SqliteStore,
        _dir: tempfile::TempDir,
    }

    pub(super) async fn backend() -> Option<Sqlite> {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = SqliteStore::open(dir.path().join("model.db"))
            .await
            .expect("open");
        store.install_steps().await.expect("install steps");
        store
            .write(|tx| {
                tx.execute_batch(
                    "CREATE TABLE model_rows (op TEXT NOT NULL, k TEXT NOT NULL, \
                     run TEXT NOT NULL, step TEXT NOT NULL)",
                )
            })
            .await
            .expect("model_rows");
        Some(Sqlite { store, _dir: dir })
    }

    impl Backend for Sqlite {
        type Store = SqliteStore;

        fn store(&self) -> &SqliteStore {
            &self.store
        }

        async fn local(
            steps: Steps<SqliteStore>,
            name: String,
            fail: bool,
            reached: Option<Arc<Reached>>,
        ) -> Result<i64, StepError> {
            let step = name.clone();
            let op = steps.scope().operation.to_string();
            let key = steps.scope().key.as_str().to_owned();
            let run = steps.run_id().to_owned();
            steps
                .local(&step, move |tx: &rusqlite::Transaction<'_>| {
                    tx.execute(
                        "INSERT INTO model_rows (op, k, run, step) VALUES (?1, ?2, ?3, ?4)",
                        [&op, &key, &run, &name],
                    )?;
                    if fail {
                        tx.execute("INSERT INTO model_missing (k) VALUES (?1)", [&key])?;
                    }
                    if let Some(reached) = reached {
                        reached.hit();
                    }
                    tx.query_row(
                        "SELECT count(*) FROM model_rows WHERE op = ?1 AND k = ?2 AND run = ?3",
                        [&op, &key, &run],
                        |row| row.get(0),
                    )
                })
                .await
        }

        async fn rows(&self, scope: &Scope) -> BTreeMap<(String, String), i64> {
            let (op, key) = (scope.operation.to_string(), scope.key.as_str().to_owned());
            self.store
                .read(move |conn| {
                    let mut statement = conn.prepare(
                        "SELECT run, step, count(*) FROM model_rows WHERE op = ?1 AND k = ?2 \
                         GROUP BY run, step",
                    )?;
                    let rows = statement.query_map([op, key], |row| {
                        Ok(((row.get(0)?, row.get(1)?), row.get(2)?))
                    })?;
                    rows.collect()
                })
                .await
                .expect("rows")
        }

        async fn leftovers(&self, scope: &Scope) -> (i64, i64) {
            let (op, key) = (scope.operation.to_string(), scope.key.as_str().to_owned());
            self.store
                .read(move |conn| {
                    conn.query_row(
                        "SELECT (SELECT count(*) FROM idempotency_progress \
                         WHERE operation = ?1 AND idempotency_key = ?2), \
                         (SELECT count(*) FROM idempotency_steps \
                         WHERE operation = ?1 AND idempotency_key = ?2)",
                        [op, key],
                        |row| Ok((row.get(0)?, row.get(1)?)),
                    )
                })
                .await
                .expect("leftovers")
        }

        async fn expire_record(&self, scope: &Scope) {
            let (op, key) = (scope.operation.to_string(), scope.key.as_str().to_owned());
            self.store
                .write(move |tx| {
                    tx.execute(
                        "UPDATE idempotency_records SET expires_at = ?1 \
                         WHERE tenant = ?2 AND operation = ?3 AND idempotency_key = ?4",
                        rusqlite::params![a_minute_ago(), TENANT, op, key],
                    )
                })
                .await
                .expect("expire");
        }

        async fn clear(&self) {
            self.store
                .write(|tx| tx.execute_batch(CLEAR))
                .await
                .expect("clear");
        }
    }
}

/// The reads of both PostgreSQL backends, on a connection of the test's.
mod pg_reads {
    use tower_idempotency::store::tokio_postgres::tokio_postgres;

    use super::*;
    use support::pg_common::TestDb;

    pub(super) struct PgReads {
        pub(super) db: TestDb,
        client: tokio_postgres::Client,
    }

    impl PgReads {
        pub(super) async fn new() -> Option<PgReads> {
            let db = TestDb::create().await?;
            db.execute(
                "CREATE TABLE model_rows (op TEXT NOT NULL, k TEXT NOT NULL, run TEXT NOT NULL, \
                 step TEXT NOT NULL)",
            )
            .await;
            let client = db.client().await;
            Some(PgReads { db, client })
        }

        pub(super) async fn rows(&self, scope: &Scope) -> BTreeMap<(String, String), i64> {
            self.client
                .query(
                    "SELECT run, step, count(*) FROM model_rows WHERE op = $1 AND k = $2 \
                     GROUP BY run, step",
                    &[&&*scope.operation, &scope.key.as_str()],
                )
                .await
                .expect("rows")
                .iter()
                .map(|row| ((row.get(0), row.get(1)), row.get(2)))
                .collect()
        }

        pub(super) async fn leftovers(&self, scope: &Scope) -> (i64, i64) {
            let row = self
                .client
                .query_one(
                    "SELECT (SELECT count(*) FROM idempotency_progress \
                     WHERE operation = $1 AND idempotency_key = $2), \
                     (SELECT count(*) FROM idempotency_steps \
                     WHERE operation = $1 AND idempotency_key = $2)",
                    &[&&*scope.operation, &scope.key.as_str()],
                )
                .await
                .expect("leftovers");
            (row.get(0), row.get(1))
        }

        pub(super) async fn expire_record(&self, scope: &Scope) {
            self.client
                .execute(
                    "UPDATE idempotency_records SET expires_at = $1 \
                     WHERE tenant = $2 AND operation = $3 AND idempotency_key = $4",
                    &[
                        &a_minute_ago(),
                        &TENANT,
                        &&*scope.operation,
                        &scope.key.as_str(),
                    ],
                )
                .await
                .expect("expire");
        }

        pub(super) async fn clear(&self) {
            self.client.batch_execute(CLEAR).await.expect("clear");
        }
    }
}

mod postgres {
    use tower_idempotency::store::tokio_postgres::{PostgresHandle, PostgresStore};

    use super::pg_reads::PgReads;
    use super::*;

    pub(super) struct Pg {
        store: PostgresStore,
        reads: PgReads,
    }

    pub(super) async fn backend() -> Option<Pg> {
        let reads = PgReads::new().await?;
        let store = reads.db.store().await;
        store.install_steps().await.expect("install steps");
        Some(Pg { store, reads })
    }

    impl Backend for Pg {
        type Store = PostgresStore;

        fn store(&self) -> &PostgresStore {
            &self.store
        }

        async fn local(
            steps: Steps<PostgresStore>,
            name: String,
            fail: bool,
            reached: Option<Arc<Reached>>,
        ) -> Result<i64, StepError> {
            let step = name.clone();
            let op = steps.scope().operation.to_string();
            let key = steps.scope().key.as_str().to_owned();
            let run = steps.run_id().to_owned();
            steps
                .local(&step, move |tx: PostgresHandle| async move {
                    let client = tx.client().await?;
                    client
                        .execute(
                            "INSERT INTO model_rows (op, k, run, step) VALUES ($1, $2, $3, $4)",
                            &[&op, &key, &run, &name],
                        )
                        .await?;
                    if fail {
                        client
                            .execute("INSERT INTO model_missing (k) VALUES ($1)", &[&key])
                            .await?;
                    }
                    if let Some(reached) = reached {
                        reached.hit();
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    let row = client
                        .query_one(
                            "SELECT count(*) FROM model_rows WHERE op = $1 AND k = $2 \
                             AND run = $3",
                            &[&op, &key, &run],
                        )
                        .await?;
                    Ok(row.get::<_, i64>(0))
                })
                .await
        }

        async fn rows(&self, scope: &Scope) -> BTreeMap<(String, String), i64> {
            self.reads.rows(scope).await
        }

        async fn leftovers(&self, scope: &Scope) -> (i64, i64) {
            self.reads.leftovers(scope).await
        }

        async fn expire_record(&self, scope: &Scope) {
            self.reads.expire_record(scope).await;
        }

        async fn clear(&self) {
            self.reads.clear().await;
        }
    }
}

/// The `local` of a sqlx backend's [`Backend`]: the model's local step as ordinary sqlx code
/// on the step's handle, with the database's statements (each in its own placeholders): insert
/// a row, insert into the missing table (the failure), count the key's rows of this life.
macro_rules! sqlx_local {
    ($store:ty, $handle:ty, $insert_row:literal, $insert_missing:literal, $count_rows:literal) => {
        async fn local(
            steps: Steps<$store>,
            name: String,
            fail: bool,
            reached: Option<Arc<Reached>>,
        ) -> Result<i64, StepError> {
            let step = name.clone();
            let op = steps.scope().operation.to_string();
            let key = steps.scope().key.as_str().to_owned();
            let run = steps.run_id().to_owned();
            steps
                .local(&step, move |tx: $handle| async move {
                    let mut conn = tx.acquire().await?;
                    sqlx::query($insert_row)
                        .bind(&op)
                        .bind(&key)
                        .bind(&run)
                        .bind(&name)
                        .execute(&mut *conn)
                        .await?;
                    if fail {
                        sqlx::query($insert_missing)
                            .bind(&key)
                            .execute(&mut *conn)
                            .await?;
                    }
                    if let Some(reached) = reached {
                        reached.hit();
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    let rows: i64 = sqlx::query_scalar($count_rows)
                        .bind(&op)
                        .bind(&key)
                        .bind(&run)
                        .fetch_one(&mut *conn)
                        .await?;
                    Ok(rows)
                })
                .await
        }
    };
}

mod sqlx_postgres {
    use tower_idempotency::store::sqlx_postgres::{SqlxPostgresHandle, SqlxPostgresStore};

    use super::pg_reads::PgReads;
    use super::*;

    pub(super) struct SqlxPg {
        store: SqlxPostgresStore,
        reads: PgReads,
    }

    pub(super) async fn backend() -> Option<SqlxPg> {
        let reads = PgReads::new().await?;
        let store = reads.db.sqlx_store(4, 2).await;
        store.install_steps().await.expect("install steps");
        Some(SqlxPg { store, reads })
    }

    impl Backend for SqlxPg {
        type Store = SqlxPostgresStore;

        fn store(&self) -> &SqlxPostgresStore {
            &self.store
        }

        sqlx_local!(
            SqlxPostgresStore,
            SqlxPostgresHandle,
            "INSERT INTO model_rows (op, k, run, step) VALUES ($1, $2, $3, $4)",
            "INSERT INTO model_missing (k) VALUES ($1)",
            "SELECT count(*) FROM model_rows WHERE op = $1 AND k = $2 AND run = $3"
        );

        async fn rows(&self, scope: &Scope) -> BTreeMap<(String, String), i64> {
            self.reads.rows(scope).await
        }

        async fn leftovers(&self, scope: &Scope) -> (i64, i64) {
            self.reads.leftovers(scope).await
        }

        async fn expire_record(&self, scope: &Scope) {
            self.reads.expire_record(scope).await;
        }

        async fn clear(&self) {
            self.reads.clear().await;
        }
    }
}

mod sqlx_mysql {
    use sqlx::mysql::MySqlPool;
    use tower_idempotency::store::sqlx_mysql::{SqlxMySqlHandle, SqlxMySqlStore};

    use super::*;
    use support::mysql_common::TestDb;

    pub(super) struct MySql {
        store: SqlxMySqlStore,
        reads: MySqlPool,
        _db: TestDb,
    }

    pub(super) async fn backend() -> Option<MySql> {
        let db = TestDb::create().await?;
        db.execute(
            "CREATE TABLE model_rows (op VARCHAR(255) NOT NULL, k VARCHAR(255) NOT NULL, \
             run VARCHAR(64) NOT NULL, step VARCHAR(255) NOT NULL) \
             ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin",
        )
        .await;
        let store = db.store(4).await;
        store.install_steps().await.expect("install steps");
        let reads = db.pool(1).await;
        Some(MySql {
            store,
            reads,
            _db: db,
        })
    }

    impl Backend for MySql {
        type Store = SqlxMySqlStore;

        fn store(&self) -> &SqlxMySqlStore {
            &self.store
        }

        sqlx_local!(
            SqlxMySqlStore,
            SqlxMySqlHandle,
            "INSERT INTO model_rows (op, k, run, step) VALUES (?, ?, ?, ?)",
            "INSERT INTO model_missing (k) VALUES (?)",
            "SELECT count(*) FROM model_rows WHERE op = ? AND k = ? AND run = ?"
        );

        async fn rows(&self, scope: &Scope) -> BTreeMap<(String, String), i64> {
            // Binary strings (the table's collation is `utf8mb4_bin`).
            let text = |bytes: Vec<u8>| String::from_utf8(bytes).expect("UTF-8");
            sqlx::query_as::<_, (Vec<u8>, Vec<u8>, i64)>(
                "SELECT run, step, count(*) FROM model_rows WHERE op = ? AND k = ? \
                 GROUP BY run, step",
            )
            .bind(&*scope.operation)
            .bind(scope.key.as_str())
            .fetch_all(&self.reads)
            .await
            .expect("rows")
            .into_iter()
            .map(|(run, step, n)| ((text(run), text(step)), n))
            .collect()
        }

        async fn leftovers(&self, scope: &Scope) -> (i64, i64) {
            sqlx::query_as(
                "SELECT (SELECT count(*) FROM idempotency_progress \
                 WHERE operation = ? AND idempotency_key = ?), \
                 (SELECT count(*) FROM idempotency_steps \
                 WHERE operation = ? AND idempotency_key = ?)",
            )
            .bind(&*scope.operation)
            .bind(scope.key.as_str())
            .bind(&*scope.operation)
            .bind(scope.key.as_str())
            .fetch_one(&self.reads)
            .await
            .expect("leftovers")
        }

        async fn expire_record(&self, scope: &Scope) {
            sqlx::query(
                "UPDATE idempotency_records SET expires_at = ? \
                 WHERE tenant = ? AND operation = ? AND idempotency_key = ?",
            )
            .bind(a_minute_ago())
            .bind(TENANT)
            .bind(&*scope.operation)
            .bind(scope.key.as_str())
            .execute(&self.reads)
            .await
            .expect("expire");
        }

        async fn clear(&self) {
            for statement in CLEAR.split(';').filter(|s| !s.trim().is_empty()) {
                sqlx::query(statement)
                    .execute(&self.reads)
                    .await
                    .expect("clear");
            }
        }
    }
}

mod sqlx_sqlite {
    use sqlx::sqlite::SqlitePool;
    use tower_idempotency::store::sqlx_sqlite::{SqlxSqliteHandle, SqlxSqliteStore};

    use super::*;
    use support::sqlx_sqlite_common::TestDb;

    pub(super) struct SqlxSqlite {
        store: SqlxSqliteStore,
        /// The test's reads and writes, on a pool of its own.
        reads: SqlitePool,
        _db: TestDb,
    }

    pub(super) async fn backend() -> Option<SqlxSqlite> {
        let db = TestDb::create().await?;
        let store = db.store(4).await;
        store.install_steps().await.expect("install steps");
        db.execute(
            "CREATE TABLE model_rows (op TEXT NOT NULL, k TEXT NOT NULL, run TEXT NOT NULL, \
             step TEXT NOT NULL)",
        )
        .await;
        let reads = db.pool(2).await;
        Some(SqlxSqlite {
            store,
            reads,
            _db: db,
        })
    }

    impl Backend for SqlxSqlite {
        type Store = SqlxSqliteStore;

        fn store(&self) -> &SqlxSqliteStore {
            &self.store
        }

        sqlx_local!(
            SqlxSqliteStore,
            SqlxSqliteHandle,
            "INSERT INTO model_rows (op, k, run, step) VALUES (?1, ?2, ?3, ?4)",
            "INSERT INTO model_missing (k) VALUES (?1)",
            "SELECT count(*) FROM model_rows WHERE op = ?1 AND k = ?2 AND run = ?3"
        );

        async fn rows(&self, scope: &Scope) -> BTreeMap<(String, String), i64> {
            sqlx::query_as::<_, (String, String, i64)>(
                "SELECT run, step, count(*) FROM model_rows WHERE op = ?1 AND k = ?2 \
                 GROUP BY run, step",
            )
            .bind(&*scope.operation)
            .bind(scope.key.as_str())
            .fetch_all(&self.reads)
            .await
            .expect("rows")
            .into_iter()
            .map(|(run, step, n)| ((run, step), n))
            .collect()
        }

        async fn leftovers(&self, scope: &Scope) -> (i64, i64) {
            sqlx::query_as(
                "SELECT (SELECT count(*) FROM idempotency_progress \
                 WHERE operation = ?1 AND idempotency_key = ?2), \
                 (SELECT count(*) FROM idempotency_steps \
                 WHERE operation = ?1 AND idempotency_key = ?2)",
            )
            .bind(&*scope.operation)
            .bind(scope.key.as_str())
            .fetch_one(&self.reads)
            .await
            .expect("leftovers")
        }

        async fn expire_record(&self, scope: &Scope) {
            sqlx::query(
                "UPDATE idempotency_records SET expires_at = ?1 \
                 WHERE tenant = ?2 AND operation = ?3 AND idempotency_key = ?4",
            )
            .bind(a_minute_ago())
            .bind(TENANT)
            .bind(&*scope.operation)
            .bind(scope.key.as_str())
            .execute(&self.reads)
            .await
            .expect("expire");
        }

        async fn clear(&self) {
            sqlx::raw_sql(CLEAR)
                .execute(&self.reads)
                .await
                .expect("clear");
        }
    }
}

test! { random_programs_stops_and_operators_match_the_model_on_sqlite, sync }
fn random_programs_stops_and_operators_match_the_model_on_sqlite() {
    run_cases(sqlite::backend(), CASES);
}

test! { random_programs_stops_and_operators_match_the_model_on_postgres, sync, postgres }
fn random_programs_stops_and_operators_match_the_model_on_postgres() {
    run_cases(postgres::backend(), CASES);
}

test! { random_programs_stops_and_operators_match_the_model_on_sqlx_postgres, sync, postgres }
fn random_programs_stops_and_operators_match_the_model_on_sqlx_postgres() {
    run_cases(sqlx_postgres::backend(), CASES);
}

test! { random_programs_stops_and_operators_match_the_model_on_mysql, sync, mysql }
fn random_programs_stops_and_operators_match_the_model_on_mysql() {
    run_cases(sqlx_mysql::backend(), CASES);
}

test! { random_programs_stops_and_operators_match_the_model_on_sqlx_sqlite, sync }
fn random_programs_stops_and_operators_match_the_model_on_sqlx_sqlite() {
    run_cases(sqlx_sqlite::backend(), CASES);
}

/// Runs one given case on SQLite.
fn run_one(case: Case) {
    quiet_planned_panics();
    runtime().block_on(async {
        let backend = Arc::new(sqlite::backend().await.expect("SQLite"));
        Run::new(backend, &case).case(&case).await;
    });
}

fn call_again(name: &str) -> Step {
    Step {
        name: name.to_owned(),
        foreign: Some(ForeignStep {
            policy: Policy::CallAgain,
            declines: false,
        }),
        flaky: false,
    }
}

/// A client's attempt on the first key.
fn client(stop: Stop) -> Event {
    Event::Attempt {
        lane: 0,
        attempt: Attempt {
            completer: false,
            stop,
        },
    }
}

test! { a_stalled_owner_does_not_call_again_after_a_take_over, sync }
/// A request resumes a key whose foreign step has its intent saved (the outcome was unknown)
/// and stalls past its lease before the call; a retry takes the key over and goes away before
/// the call. The stalled request then goes on: it must not call the provider (its lease is
/// gone), as a fresh intent's commit would have stopped it.
fn a_stalled_owner_does_not_call_again_after_a_take_over() {
    run_one(Case::one(
        vec![call_again("call0")],
        vec![
            client(Stop::Unknown {
                step: 0,
                charged: false,
            }),
            client(Stop::Stall(0)),
            client(Stop::Gone(0)),
            Event::Resume { lane: 0 },
        ],
    ));
}

fn step(name: &str, foreign: Option<Policy>) -> Step {
    Step {
        name: name.to_owned(),
        foreign: foreign.map(|policy| ForeignStep {
            policy,
            declines: false,
        }),
        flaky: false,
    }
}

fn operator_on_first_key(action: Operator) -> Event {
    Event::Operator { lane: 0, action }
}

test! { a_stalled_owner_of_a_purged_life_writes_nothing_in_the_next, sync }
/// A request commits its local step and stalls before its foreign step; once its lease is
/// over an operator purges the key (local steps only: deleted), and the client's retry starts
/// a new life (generation 1 again), commits the local step and goes away. The stalled request
/// then goes on: it must be refused (the run id is not its own), writing no intent into the
/// new life and calling the provider with no step key of its ended life. (The model found a
/// lease check on the generation alone letting it through.)
fn a_stalled_owner_of_a_purged_life_writes_nothing_in_the_next() {
    run_one(Case::one(
        vec![step("write0", None), step("call1", Some(Policy::Ask))],
        vec![
            client(Stop::Stall(1)),
            operator_on_first_key(Operator::PurgeProgress),
            client(Stop::Gone(1)),
            Event::Resume { lane: 0 },
        ],
    ));
}

test! { a_key_reused_after_its_record_expired_takes_new_charges_for_a_new_order, sync }
/// A provider that charges every call. Order 1 is paid and answered; its record expires; the
/// client's next request with the key is order 2, a new life: its call is charged with a new
/// step key and its answer lost, the retry leaves the key in doubt, the operator settles it
/// with the provider's charge, and the last retry answers order 2 with it. Money taken is
/// orders paid: two charges, one per order.
fn a_key_reused_after_its_record_expired_takes_new_charges_for_a_new_order() {
    let mut case = Case::one(
        vec![step("call0", Some(Policy::LeaveInDoubt))],
        vec![
            client(Stop::Full),
            operator_on_first_key(Operator::Expire { purge: false }),
            client(Stop::Unknown {
                step: 0,
                charged: true,
            }),
            client(Stop::Full),
            operator_on_first_key(Operator::Resolve),
        ],
    );
    case.dedup = false;
    run_one(case);
}
