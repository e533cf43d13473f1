//! The contract of [`StepStore`], written once as generic functions and run against every
//! backend by `steps_store_tests!`: SQLite in a temp dir (the SQLite store and the sqlx store),
//! PostgreSQL (the tokio-postgres store and the sqlx store) in a schema of its own when
//! `TEST_DATABASE_URL` is set, and MySQL or MariaDB (the sqlx store) in a database of its own
//! when `TEST_MYSQL_URL` is set (reported as ignored otherwise).
//!
//! Time is given to every call (`now`), so leases run out without waiting.

use crate::listing;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header;
use http::{HeaderValue, StatusCode};
use serde_json::json;
use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::response::SavedResponse;
use tower_idempotency::steps::__private::{
    Acquired, Claim, Lease, SavedRequest, StepKind, StepProtocol, StepRow,
};
use tower_idempotency::steps::{ProgressStatus, Resolution, Settled, StepStore};
use tower_idempotency::store::{Begin, IdempotencyStore, NewRecord, Reservation, Scope};
use tower_idempotency::{key::IdempotencyKey, Error};

const LEASE: Duration = Duration::from_secs(30);
const HOUR: Duration = Duration::from_secs(3600);
const LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// A store under test, with what the suite needs beside the trait: a local step that writes a
/// business row (an order with `sku` = `tag`) and a count of those rows.
trait Harness {
    type Store: StepStore + tower_idempotency::admin::AdminBackend;

    fn store(&self) -> &Self::Store;

    /// `run_local` of a closure that inserts an order with `sku` `tag` on the step's own
    /// transaction, then returns `tag`, or fails after the insert when `fail`.
    async fn local_order(
        &self,
        lease: &Lease,
        step: &StepRow,
        tag: &'static str,
        fail: bool,
    ) -> Result<String, Error>;

    /// How many orders have `sku` `tag` (committed).
    async fn orders(&self, tag: &str) -> i64;

    /// Runs `sql` on a connection of its own (an operator's or a fault's statement).
    async fn execute(&self, sql: &str);

    /// Runs the statements `sql` (`;`-separated) in a transaction of its own on a connection
    /// of its own, and returns once they ran, their locks held; the transaction commits
    /// `hold` later, in the task returned. `None` on SQLite, whose one writer runs one
    /// transaction at a time.
    async fn hold_open(&self, sql: &str, hold: Duration) -> Option<tokio::task::JoinHandle<()>>;
}

fn scope(key: &str) -> Scope {
    Scope::new(
        "shop-a",
        "checkout",
        IdempotencyKey::parse(key.as_bytes(), 128).expect("valid key"),
    )
}

fn fingerprint(seed: u8) -> Fingerprint {
    Fingerprint::new(1, [seed; 32])
}

fn request(body: &'static str) -> SavedRequest {
    SavedRequest::new(
        "POST".to_owned(),
        "/checkout?x=1".to_owned(),
        "content-type: application/json\r\n".to_owned(),
        Bytes::from_static(body.as_bytes()),
    )
}

/// A client's claim of `key` with the payload of `seed` by `owner` at `now`.
fn claim(key: &str, seed: u8, owner: &str, now: SystemTime) -> Claim {
    let mut claim = Claim::new(
        scope(key),
        fingerprint(seed),
        Arc::from(owner),
        now + LEASE,
        now,
    );
    claim.request = Some(request("{\"sku\":\"book\"}"));
    claim
}

/// The completer's claim of `key` at `now`, at most `max` attempts.
fn completer_claim(key: &str, seed: u8, owner: &str, now: SystemTime, max: u32) -> Claim {
    let mut claim = Claim::new(
        scope(key),
        fingerprint(seed),
        Arc::from(owner),
        now + LEASE,
        now,
    );
    claim.max_attempts = Some(max);
    claim
}

/// The lease of `generation` on `key` at `now`, in the key's life as stored (its run id; none
/// when the key has no progress).
async fn lease<H: Harness>(h: &H, key: &str, generation: i64, now: SystemTime) -> Lease {
    let mut run = String::new();
    for status in [
        ProgressStatus::Running,
        ProgressStatus::InDoubt,
        ProgressStatus::Dead,
    ] {
        let page = h
            .store()
            .progress(&listing(status, None, now, 1000).operation("checkout"))
            .await
            .expect("progress");
        if let Some(progress) = page.keys.iter().find(|p| p.scope.key.as_str() == key) {
            run = progress.run.clone();
        }
    }
    Lease::new(scope(key), run, generation, now + LEASE, now)
}

fn foreign(seq: u32, name: &str, result: Option<&str>) -> StepRow {
    StepRow::new(
        seq,
        name.to_owned(),
        StepKind::Foreign,
        result.map(str::to_owned),
    )
}

fn local(seq: u32, name: &str) -> StepRow {
    StepRow::new(seq, name.to_owned(), StepKind::Local, None)
}

fn record(now: SystemTime, seed: u8) -> NewRecord {
    let response = SavedResponse::new(
        StatusCode::CREATED,
        vec![(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        Bytes::from(format!("{{\"order_id\":{seed}}}")),
    );
    NewRecord::new(fingerprint(seed), response, now, now + HOUR)
}

/// The generation of an `Owned` outcome, and its steps as `(seq, name, result)`.
fn owned(acquired: Acquired) -> (i64, Vec<(u32, String, Option<String>)>) {
    match acquired {
        Acquired::Owned {
            generation, steps, ..
        } => (
            generation,
            steps
                .into_iter()
                .map(|s| (s.seq, s.name, s.result))
                .collect(),
        ),
        other => panic!("expected Owned, got {other:?}"),
    }
}

async fn acquire<H: Harness>(h: &H, claim: &Claim) -> Acquired {
    h.store().acquire(claim).await.expect("acquire")
}

fn assert_lease_lost<T: std::fmt::Debug>(result: Result<T, Error>, what: &str) {
    match result {
        Err(Error::LeaseLost) => {}
        other => panic!("{what}: expected LeaseLost, got {other:?}"),
    }
}

/// A new key is taken under generation 1; while its lease runs another claim is told it is
/// held; once the lease has passed another claim takes it over under generation 2, with the
/// steps saved so far.
async fn acquire_new_held_and_taken_over<H: Harness>(h: H) {
    let now = SystemTime::now();
    let (generation, steps) = owned(acquire(&h, &claim("k", 1, "a", now)).await);
    assert_eq!((generation, steps.len()), (1, 0));
    match acquire(&h, &claim("k", 1, "b", now + Duration::from_secs(1))).await {
        Acquired::Held { until } => {
            let millis = |t: SystemTime| {
                t.duration_since(SystemTime::UNIX_EPOCH)
                    .unwrap()
                    .as_millis()
            };
            assert_eq!(millis(until), millis(now + LEASE));
        }
        other => panic!("expected Held, got {other:?}"),
    }
    h.store()
        .save_step(
            &lease(&h, "k", 1, now).await,
            &foreign(0, "charge", Some("\"ch_1\"")),
        )
        .await
        .expect("save a step");
    let later = now + LEASE + Duration::from_secs(1);
    let (generation, steps) = owned(acquire(&h, &claim("k", 1, "b", later)).await);
    assert_eq!(generation, 2);
    assert_eq!(
        steps,
        [(0, "charge".to_owned(), Some("\"ch_1\"".to_owned()))]
    );
    // Each take-over bumps the generation again.
    let much_later = later + LEASE + Duration::from_secs(1);
    let (generation, _) = owned(acquire(&h, &claim("k", 1, "c", much_later)).await);
    assert_eq!(generation, 3);
}

/// Another payload for a key in progress is a mismatch, held or not.
async fn another_payload_is_a_mismatch<H: Harness>(h: H) {
    let now = SystemTime::now();
    owned(acquire(&h, &claim("k", 1, "a", now)).await);
    assert!(matches!(
        acquire(&h, &claim("k", 2, "b", now)).await,
        Acquired::Mismatch
    ));
    let later = now + LEASE + Duration::from_secs(1);
    assert!(matches!(
        acquire(&h, &claim("k", 2, "b", later)).await,
        Acquired::Mismatch
    ));
}

/// `finish` saves the final record and deletes the progress: the key is completed for a
/// client's claim and the completer's, and replayed by the record store.
async fn finish_completes_the_key<H: Harness>(h: H) {
    let now = SystemTime::now();
    owned(acquire(&h, &claim("k", 7, "a", now)).await);
    let l = lease(&h, "k", 1, now).await;
    h.store()
        .save_step(&l, &foreign(0, "charge", Some("1")))
        .await
        .expect("save");
    let saved = record(now, 7);
    h.store().finish(&l, &saved).await.expect("finish");

    let later = now + Duration::from_secs(1);
    match acquire(&h, &claim("k", 7, "b", later)).await {
        Acquired::Completed(found) => {
            assert!(found.fingerprint.matches(&saved.fingerprint));
            assert_eq!(found.response, saved.response);
        }
        other => panic!("expected Completed, got {other:?}"),
    }
    assert!(matches!(
        acquire(&h, &completer_claim("k", 7, "c", later, 3)).await,
        Acquired::Completed(_)
    ));
    let found = h.store().lookup(&scope("k"), later).await.expect("lookup");
    assert_eq!(found.expect("the record").response, saved.response);
    let listed = h
        .store()
        .progress(&listing(ProgressStatus::Running, None, later, 10))
        .await
        .expect("progress")
        .keys;
    assert!(listed.is_empty(), "the progress is gone: {listed:?}");
    // The completer's claim of a key that never existed: nothing to resume.
    assert!(matches!(
        acquire(&h, &completer_claim("other", 7, "c", later, 3)).await,
        Acquired::Gone
    ));
}

/// A live record of the key answers a new claim (nothing is taken); an expired one gives way
/// to the key's final record.
async fn records_live_and_expired<H: Harness>(h: H) {
    let now = SystemTime::now();
    // A live record of "live", saved by the plain (one transaction) flow.
    let Begin::Reserved(tx) = h
        .store()
        .begin(&scope("live"), LOCK_TIMEOUT, now)
        .await
        .expect("begin")
    else {
        panic!("expected a reservation");
    };
    tx.commit(record(now, 3)).await.expect("commit");
    assert!(matches!(
        acquire(&h, &claim("live", 3, "a", now)).await,
        Acquired::Completed(_)
    ));
    assert!(h
        .store()
        .progress(&listing(ProgressStatus::Running, None, now, 10))
        .await
        .expect("progress")
        .keys
        .is_empty());

    // An expired record of "old", from two hours ago.
    let past = now - 2 * HOUR;
    let Begin::Reserved(tx) = h
        .store()
        .begin(&scope("old"), LOCK_TIMEOUT, past)
        .await
        .expect("begin")
    else {
        panic!("expected a reservation");
    };
    tx.commit(record(past, 4)).await.expect("commit");
    owned(acquire(&h, &claim("old", 5, "a", now)).await);
    h.store()
        .finish(&lease(&h, "old", 1, now).await, &record(now, 5))
        .await
        .expect("finish over an expired record");
    let found = h.store().lookup(&scope("old"), now).await.expect("lookup");
    assert!(found
        .expect("the new record")
        .fingerprint
        .matches(&fingerprint(5)));
}

/// Every write under a lease whose key another claim took over is refused, and changes
/// nothing of the new holder's.
async fn a_stale_generation_loses_the_lease<H: Harness>(h: H) {
    let now = SystemTime::now();
    owned(acquire(&h, &claim("k", 1, "a", now)).await);
    let later = now + LEASE + Duration::from_secs(1);
    let (generation, _) = owned(acquire(&h, &claim("k", 1, "b", later)).await);
    assert_eq!(generation, 2);
    let stale = lease(&h, "k", 1, later).await;

    assert_lease_lost(
        h.store()
            .save_step(&stale, &foreign(0, "charge", None))
            .await,
        "save_step",
    );
    assert_lease_lost(
        h.local_order(&stale, &local(0, "insert"), "stale", false)
            .await,
        "run_local",
    );
    assert_lease_lost(h.store().forget_intent(&stale, 0).await, "forget_intent");
    assert_lease_lost(
        h.store()
            .set_status(&stale, ProgressStatus::InDoubt, "stale")
            .await,
        "set_status",
    );
    assert_lease_lost(h.store().finish(&stale, &record(later, 1)).await, "finish");
    assert_lease_lost(h.store().release(&stale).await, "release");

    // Nothing was written: no order, no step, no record, and the key still held by "b".
    assert_eq!(h.orders("stale").await, 0);
    assert!(h
        .store()
        .lookup(&scope("k"), later)
        .await
        .expect("lookup")
        .is_none());
    assert!(matches!(
        acquire(&h, &claim("k", 1, "c", later)).await,
        Acquired::Held { .. }
    ));
    let listed = h
        .store()
        .progress(&listing(ProgressStatus::Running, None, later, 10))
        .await
        .expect("progress")
        .keys;
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].generation, listed[0].steps), (2, 0));
    // The new holder's lease still works.
    h.store()
        .save_step(&lease(&h, "k", 2, later).await, &foreign(0, "charge", None))
        .await
        .expect("the holder saves");
}

/// A local step's rows and its result commit together; an error rolls both back.
async fn run_local_commits_or_rolls_back<H: Harness>(h: H) {
    let now = SystemTime::now();
    owned(acquire(&h, &claim("k", 1, "a", now)).await);
    let l = lease(&h, "k", 1, now).await;

    let failed = h.local_order(&l, &local(0, "insert"), "failed", true).await;
    assert!(failed.is_err(), "the closure's error is returned");
    assert_eq!(h.orders("failed").await, 0, "its row rolled back");
    let listed = h
        .store()
        .progress(&listing(ProgressStatus::Running, None, now, 10))
        .await
        .expect("progress")
        .keys;
    assert_eq!(listed[0].steps, 0, "no step saved");

    let value = h
        .local_order(&l, &local(0, "insert"), "ok", false)
        .await
        .expect("run_local");
    assert_eq!(value, "ok");
    assert_eq!(h.orders("ok").await, 1);
    // A retry resumes with the step's result.
    let later = now + LEASE + Duration::from_secs(1);
    let (_, steps) = owned(acquire(&h, &claim("k", 1, "b", later)).await);
    assert_eq!(steps.len(), 1);
    assert_eq!((steps[0].0, steps[0].1.as_str()), (0, "insert"));
    assert!(
        steps[0].2.as_deref().is_some_and(|r| r.contains("ok")),
        "{steps:?}"
    );
}

/// An intent is saved, settled by its result (which is never overwritten), or forgotten.
async fn intents_are_settled_or_forgotten<H: Harness>(h: H) {
    let now = SystemTime::now();
    owned(acquire(&h, &claim("k", 1, "a", now)).await);
    let l = lease(&h, "k", 1, now).await;
    let store = h.store();
    store
        .save_step(&l, &foreign(0, "charge", None))
        .await
        .expect("intent");
    store
        .save_step(&l, &foreign(1, "ship", None))
        .await
        .expect("intent");
    store
        .save_step(&l, &foreign(0, "charge", Some("\"ch_1\"")))
        .await
        .expect("result");
    // A result stays: writing another over it is refused, and so is another step at its
    // position.
    assert!(matches!(
        store
            .save_step(&l, &foreign(0, "charge", Some("\"ch_2\"")))
            .await,
        Err(Error::StepsChanged { position: 0, .. })
    ));
    assert!(matches!(
        store.save_step(&l, &foreign(1, "refund", None)).await,
        Err(Error::StepsChanged { position: 1, .. })
    ));
    store
        .forget_intent(&l, 0)
        .await
        .expect("forget a result (no-op)");
    store.forget_intent(&l, 1).await.expect("forget the intent");

    let later = now + LEASE + Duration::from_secs(1);
    let (_, steps) = owned(acquire(&h, &claim("k", 1, "b", later)).await);
    assert_eq!(
        steps,
        [(0, "charge".to_owned(), Some("\"ch_1\"".to_owned()))]
    );
}

/// `release` deletes a key without steps (a retry starts afresh, with any payload) and ends
/// the lease of one with steps (a retry resumes it at once).
async fn release_deletes_or_frees<H: Harness>(h: H) {
    let now = SystemTime::now();
    owned(acquire(&h, &claim("empty", 1, "a", now)).await);
    h.store()
        .release(&lease(&h, "empty", 1, now).await)
        .await
        .expect("release");
    let (generation, _) = owned(acquire(&h, &claim("empty", 2, "b", now)).await);
    assert_eq!(generation, 1, "a new key, with another payload");

    owned(acquire(&h, &claim("begun", 1, "a", now)).await);
    let l = lease(&h, "begun", 1, now).await;
    h.store()
        .save_step(&l, &foreign(0, "charge", None))
        .await
        .expect("intent");
    h.store().release(&l).await.expect("release");
    let (generation, steps) = owned(acquire(&h, &claim("begun", 1, "b", now)).await);
    assert_eq!(generation, 2, "taken at once: the lease ended");
    assert_eq!(steps, [(0, "charge".to_owned(), None)]);
}

/// A key in doubt answers `InDoubt` to every claim until an operator resolves it: called
/// again (the intent dropped) or done (the intent settled with the result).
async fn in_doubt_until_resolved<H: Harness>(h: H) {
    let now = SystemTime::now();
    owned(acquire(&h, &claim("k", 1, "a", now)).await);
    let l = lease(&h, "k", 1, now).await;
    h.store()
        .save_step(&l, &foreign(0, "charge", None))
        .await
        .expect("intent");
    h.store()
        .set_status(&l, ProgressStatus::InDoubt, "charge: timed out")
        .await
        .expect("in doubt");
    let later = now + LEASE + Duration::from_secs(1);
    assert!(matches!(
        acquire(&h, &claim("k", 1, "b", now)).await,
        Acquired::InDoubt
    ));
    assert!(matches!(
        acquire(&h, &completer_claim("k", 1, "c", later, 3)).await,
        Acquired::InDoubt
    ));
    let listed = h
        .store()
        .progress(&listing(ProgressStatus::InDoubt, None, later, 10))
        .await
        .expect("progress")
        .keys;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].last_error.as_deref(), Some("charge: timed out"));
    assert_eq!(listed[0].steps, 1);
    assert_eq!(
        listed[0].request.body,
        Bytes::from_static(b"{\"sku\":\"book\"}")
    );
    assert_eq!(listed[0].request.uri, "/checkout?x=1");

    // The owner that marked it is out of it: marking gave the key a new generation.
    assert!(matches!(
        h.store().save_step(&l, &foreign(1, "ship", None)).await,
        Err(Error::LeaseLost)
    ));
    // Only a foreign step's intent can be settled.
    assert_eq!(
        h.store()
            .resolve(&scope("k"), Some(1), &Resolution::CallAgain, later)
            .await
            .expect("resolve"),
        Settled::NoIntent
    );

    // Called again: the intent goes, the key runs again, under a new generation.
    assert!(
        h.store()
            .resolve(&scope("k"), Some(0), &Resolution::CallAgain, later)
            .await
            .expect("resolve")
            == Settled::Resolved
    );
    // A running key cannot be resolved: its owner may be in the middle of a call.
    assert_eq!(
        h.store()
            .resolve(&scope("k"), None, &Resolution::CallAgain, later)
            .await
            .expect("resolve"),
        Settled::Running
    );
    let (generation, steps) = owned(acquire(&h, &claim("k", 1, "b", later)).await);
    assert_eq!((generation, steps.len()), (4, 0));
    assert_eq!(
        h.store()
            .resolve(&scope("k"), None, &Resolution::CallAgain, later)
            .await
            .expect("resolve"),
        Settled::Running,
        "refused while a claim holds it"
    );

    // In doubt again, then done with a result.
    let l = lease(&h, "k", 4, later).await;
    h.store()
        .save_step(&l, &foreign(0, "charge", None))
        .await
        .expect("intent");
    h.store()
        .set_status(&l, ProgressStatus::InDoubt, "again")
        .await
        .expect("in doubt");
    assert!(
        h.store()
            .resolve(
                &scope("k"),
                Some(0),
                &Resolution::Done(json!({ "charge_id": "ch_9" })),
                later,
            )
            .await
            .expect("resolve")
            == Settled::Resolved
    );
    let (generation, steps) = owned(acquire(&h, &claim("k", 1, "c", later)).await);
    assert_eq!(generation, 7);
    assert_eq!(steps.len(), 1);
    assert!(
        steps[0].2.as_deref().is_some_and(|r| r.contains("ch_9")),
        "{steps:?}"
    );
    // A key that is not there.
    assert_eq!(
        h.store()
            .resolve(&scope("missing"), None, &Resolution::CallAgain, later)
            .await
            .expect("resolve"),
        Settled::NotFound
    );
}

/// The completer's claims count attempts; past the bound the key is dead (a client's claim
/// may still take it); an operator's resolution resets the attempts.
async fn completer_attempts_end_dead<H: Harness>(h: H) {
    let now = SystemTime::now();
    owned(acquire(&h, &claim("k", 1, "client", now)).await);
    let mut at = now;
    for attempt in 1..=2 {
        at += LEASE + Duration::from_secs(1);
        let (generation, _) =
            owned(acquire(&h, &completer_claim("k", 1, "completer", at, 2)).await);
        assert_eq!(generation, 1 + attempt);
    }
    at += LEASE + Duration::from_secs(1);
    assert!(matches!(
        acquire(&h, &completer_claim("k", 1, "completer", at, 2)).await,
        Acquired::Dead
    ));
    assert!(matches!(
        acquire(&h, &completer_claim("k", 1, "completer", at, 2)).await,
        Acquired::Dead
    ));
    let dead = h
        .store()
        .progress(&listing(ProgressStatus::Dead, None, at, 10))
        .await
        .expect("progress")
        .keys;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].attempts, 2);
    assert!(dead[0].last_error.is_some());

    assert!(
        h.store()
            .resolve(&scope("k"), None, &Resolution::CallAgain, at)
            .await
            .expect("resolve")
            == Settled::Resolved
    );
    let running = h
        .store()
        .progress(&listing(ProgressStatus::Running, None, at, 10))
        .await
        .expect("progress")
        .keys;
    assert_eq!(running[0].attempts, 0);
    // 1, two completer claims, dead (a change of owner), resolved (another), this claim.
    let (generation, _) = owned(acquire(&h, &completer_claim("k", 1, "completer", at, 2)).await);
    assert_eq!(generation, 6);

    // A dead key is taken by a client's claim (a retry of the request).
    owned(acquire(&h, &claim("d", 1, "client", now)).await);
    let late = now + LEASE + Duration::from_secs(1);
    assert!(matches!(
        acquire(&h, &completer_claim("d", 1, "completer", late, 0)).await,
        Acquired::Dead
    ));
    let (generation, _) = owned(acquire(&h, &claim("d", 1, "client", late)).await);
    assert_eq!(
        generation, 3,
        "1, dead (out of every owner's hands), this claim"
    );
}

/// `progress` lists by status, oldest change first, at most `limit`; idle only lists running
/// keys whose lease has passed and that have not changed since.
async fn progress_lists_idle_keys<H: Harness>(h: H) {
    let t0 = SystemTime::now();
    let second = Duration::from_secs(1);
    owned(acquire(&h, &claim("a", 1, "o", t0)).await);
    owned(acquire(&h, &claim("b", 1, "o", t0 + second)).await);
    owned(acquire(&h, &claim("c", 1, "o", t0 + 2 * second)).await);
    // "b" changes later (a step saved at t0 + 10 s moves its lease on).
    let l = lease(&h, "b", 1, t0 + 10 * second).await;
    h.store()
        .save_step(&l, &foreign(0, "charge", None))
        .await
        .expect("save");

    let names = |listed: &[tower_idempotency::steps::Progress]| {
        listed
            .iter()
            .map(|p| p.scope.key.as_str().to_owned())
            .collect::<Vec<_>>()
    };
    let all = h
        .store()
        .progress(&listing(ProgressStatus::Running, None, t0, 10))
        .await
        .expect("progress")
        .keys;
    assert_eq!(names(&all), ["a", "c", "b"]);
    assert_eq!(all[2].steps, 1);
    let two = h
        .store()
        .progress(&listing(ProgressStatus::Running, None, t0, 2))
        .await
        .expect("progress")
        .keys;
    assert_eq!(names(&two), ["a", "c"]);

    // Before any lease has passed, nothing is idle.
    let idle = h
        .store()
        .progress(&listing(
            ProgressStatus::Running,
            Some(t0 + 5 * second),
            t0 + 5 * second,
            10,
        ))
        .await
        .expect("progress")
        .keys;
    assert!(idle.is_empty(), "{:?}", names(&idle));
    // "a" and "c" have passed their leases and not changed since t0 + 5 s; "b" changed later.
    let now = t0 + LEASE + 5 * second;
    let idle = h
        .store()
        .progress(&listing(
            ProgressStatus::Running,
            Some(t0 + 5 * second),
            now,
            10,
        ))
        .await
        .expect("progress")
        .keys;
    assert_eq!(names(&idle), ["a", "c"]);
    // Not a key in doubt.
    h.store()
        .set_status(
            &lease(&h, "a", 1, t0 + 3 * second).await,
            ProgressStatus::InDoubt,
            "x",
        )
        .await
        .expect("in doubt");
    let idle = h
        .store()
        .progress(&listing(
            ProgressStatus::Running,
            Some(t0 + 5 * second),
            now,
            10,
        ))
        .await
        .expect("progress")
        .keys;
    assert_eq!(names(&idle), ["c"]);
}

/// Two claims of a new key at the same time: exactly one owns it, the other finds it held.
async fn concurrent_claims_of_a_new_key<H: Harness>(h: H) {
    let now = SystemTime::now();
    let (a, b) = (claim("k", 1, "a", now), claim("k", 1, "b", now));
    let (first, second) = tokio::join!(h.store().acquire(&a), h.store().acquire(&b));
    let outcomes = [first.expect("acquire a"), second.expect("acquire b")];
    let owned = outcomes
        .iter()
        .filter(|o| matches!(o, Acquired::Owned { generation: 1, .. }))
        .count();
    let held = outcomes
        .iter()
        .filter(|o| matches!(o, Acquired::Held { .. }))
        .count();
    assert_eq!((owned, held), (1, 1), "{outcomes:?}");
}

/// A step's statement that waits for a lock another transaction holds gives up (bounded)
/// with a busy error: here `finish` waits for a request's uncommitted reservation of the same
/// key in `idempotency_records`. (Not on SQLite, where the reservation holds the writer and
/// `finish` queues behind it.)
async fn lock_waits_are_bounded<H: Harness>(h: H) {
    let now = SystemTime::now();
    owned(acquire(&h, &claim("k", 1, "a", now)).await);
    let Begin::Reserved(reservation) = h
        .store()
        .begin(&scope("k"), LOCK_TIMEOUT, now)
        .await
        .expect("begin")
    else {
        panic!("expected a reservation");
    };
    let started = std::time::Instant::now();
    let error = h
        .store()
        .finish(&lease(&h, "k", 1, now).await, &record(now, 1))
        .await
        .expect_err("finish waits for the reservation, then gives up");
    assert!(error.is_busy(), "{error:?}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    reservation.rollback().await.expect("rollback");
    // Nothing was written: the key is still in progress, and finishes now.
    h.store()
        .finish(&lease(&h, "k", 1, now).await, &record(now, 1))
        .await
        .expect("finish");
}

fn scope_in(operation: &str, key: &str) -> Scope {
    Scope::new(
        "shop-a",
        operation,
        IdempotencyKey::from_unquoted(key).expect("a key"),
    )
}

fn claim_in(operation: &str, key: &str, now: SystemTime) -> Claim {
    let mut claim = Claim::new(
        scope_in(operation, key),
        fingerprint(1),
        Arc::from("o"),
        now + LEASE,
        now,
    );
    claim.request = Some(request("{}"));
    claim
}

/// The run id of an `Owned` outcome.
fn run_of(acquired: &Acquired) -> String {
    match acquired {
        Acquired::Owned { run, .. } => run.clone(),
        other => panic!("expected the key owned: {other:?}"),
    }
}

/// One life of a key keeps one run id (resumes, take-overs); a key used again after its
/// record was deleted, or expired, or after its progress was purged, starts a new life: a new
/// run id, and no step of the old one.
async fn every_life_of_a_key_has_its_own_run_id<H: Harness>(h: H) {
    let now = SystemTime::now();
    let first = acquire(&h, &claim("k", 1, "a", now)).await;
    let run = run_of(&first);
    assert_eq!(run.len(), 32, "{run}");
    h.store()
        .save_step(
            &lease(&h, "k", 1, now).await,
            &foreign(0, "charge", Some("\"ch_1\"")),
        )
        .await
        .expect("result");
    let later = now + LEASE + Duration::from_secs(1);
    let resumed = acquire(&h, &claim("k", 1, "b", later)).await;
    assert_eq!(run_of(&resumed), run, "a take-over keeps the run");
    h.store()
        .finish(&lease(&h, "k", 2, later).await, &record(later, 1))
        .await
        .expect("finish");

    // Deleted by an operator: the next claim is a new life.
    let admin = tower_idempotency::admin::Admin::new(h.store().clone());
    assert!(admin
        .delete("shop-a", "checkout", "k")
        .await
        .expect("delete"));
    let second = acquire(&h, &claim("k", 1, "c", later)).await;
    let second_run = run_of(&second);
    assert_ne!(second_run, run);
    assert_eq!(owned(second).1, []);
    h.store()
        .finish(&lease(&h, "k", 1, later).await, &record(later, 1))
        .await
        .expect("finish");
    // Expired (the record lives an hour).
    let expired = later + 2 * HOUR;
    let third = acquire(&h, &claim("k", 1, "d", expired)).await;
    let third_run = run_of(&third);
    assert!(third_run != run && third_run != second_run);

    // Purged while running with a local step saved (its progress expired): the steps go with
    // it, and the next request is a new life.
    h.local_order(
        &lease(&h, "k", 1, expired).await,
        &local(0, "a"),
        "purged",
        false,
    )
    .await
    .expect("local step");
    let purged = h
        .store()
        .purge_progress(expired + 2 * LEASE + 2 * HOUR * 24, 10)
        .await
        .expect("purge");
    assert_eq!(purged, 1);
    let fourth = acquire(&h, &claim("k", 1, "e", expired + 2 * LEASE)).await;
    let fourth_run = run_of(&fourth);
    assert!(![&run, &second_run, &third_run].contains(&&fourth_run));
    assert_eq!(owned(fourth).1, [], "nothing of the purged life's steps");

    // A stale owner of an ended life can write nothing in the next one, though the next one
    // starts at generation 1 again.
    let stale = Lease::new(
        scope("k"),
        third_run,
        1,
        expired + 3 * LEASE,
        expired + 2 * LEASE,
    );
    assert_lease_lost(
        h.store()
            .save_step(&stale, &foreign(0, "charge", None))
            .await,
        "a step of the ended life",
    );
    assert_lease_lost(h.store().release(&stale).await, "its release");
    let fifth = acquire(
        &h,
        &claim("k", 1, "f", expired + 2 * LEASE + Duration::from_secs(1)),
    )
    .await;
    assert!(
        matches!(fifth, Acquired::Held { .. }),
        "the live owner keeps it: {fifth:?}"
    );
}

/// A step is never written where the key saved another: a local step at a position holding a
/// foreign step's intent is refused before its work runs.
async fn a_step_at_a_position_holding_another_is_refused<H: Harness>(h: H) {
    let now = SystemTime::now();
    owned(acquire(&h, &claim("k", 1, "a", now)).await);
    let l = lease(&h, "k", 1, now).await;
    h.store()
        .save_step(&l, &foreign(0, "charge", None))
        .await
        .expect("intent");
    let refused = h.local_order(&l, &local(0, "a"), "refused", false).await;
    assert!(
        matches!(refused, Err(Error::StepsChanged { position: 0, .. })),
        "{refused:?}"
    );
    assert_eq!(h.orders("refused").await, 0, "its work never ran");
    // The intent is still there, and settles.
    h.store()
        .save_step(&l, &foreign(0, "charge", Some("\"ch_1\"")))
        .await
        .expect("result");
    h.local_order(&l, &local(1, "a"), "placed", false)
        .await
        .expect("the next position");
    assert_eq!(h.orders("placed").await, 1);
}

/// Listing by operation, a page at a time after a cursor, every key exactly as it was scoped
/// (quoted forms included); a row that cannot be read is skipped and counted, never a failed
/// listing.
async fn listing_by_operation_pages_and_skips_what_it_cannot_read<H: Harness>(h: H) {
    let t0 = SystemTime::now();
    let second = Duration::from_secs(1);
    let keys = ["\"evil", "\"x\"", "bad", "plain", "zz"];
    for (i, key) in keys.iter().enumerate() {
        owned(acquire(&h, &claim_in("checkout", key, t0 + i as u32 * second)).await);
        owned(acquire(&h, &claim_in("refund", key, t0 + i as u32 * second)).await);
    }
    // A fingerprint version no reader understands.
    h.execute(
        "UPDATE idempotency_progress SET fingerprint_version = 70000 \
         WHERE idempotency_key = 'bad' AND operation = 'checkout'",
    )
    .await;
    let mut seen = Vec::new();
    let mut skipped = 0;
    let mut cursor = None;
    let mut pages = 0;
    loop {
        let query = listing(ProgressStatus::Running, None, t0, 2)
            .operation("checkout")
            .after(cursor.take());
        let page = h.store().progress(&query).await.expect("a page");
        pages += 1;
        skipped += page.skipped;
        for progress in &page.keys {
            assert_eq!(&*progress.scope.operation, "checkout");
            assert_eq!(progress.run.len(), 32);
            seen.push(progress.scope.key.as_str().to_owned());
        }
        match page.next {
            Some(next) => cursor = Some(next),
            None => break,
        }
        assert!(pages < 10, "the pages end");
    }
    assert_eq!(seen, ["\"evil", "\"x\"", "plain", "zz"]);
    assert_eq!(skipped, 1);
    // The other operation's keys, all of them readable.
    let refunds = h
        .store()
        .progress(&listing(ProgressStatus::Running, None, t0, 10).operation("refund"))
        .await
        .expect("refunds");
    assert_eq!((refunds.keys.len(), refunds.skipped), (5, 0));
    assert!(
        refunds.next.is_none(),
        "a page that is not full ends the listing"
    );
}

/// `purge_progress` deletes keys left running past their expiry with their steps, once their
/// lease has ended; never a key in doubt or dead, nor one whose lease still holds.
async fn expired_progress_is_purged_but_never_in_doubt_or_held<H: Harness>(h: H) {
    let now = SystemTime::now();
    // A key with local steps only is forgotten.
    let mut claim_local = claim("local", 1, "a", now);
    claim_local.expires_at = now + Duration::from_secs(1);
    owned(acquire(&h, &claim_local).await);
    h.local_order(
        &lease(&h, "local", 1, now).await,
        &local(0, "a"),
        "purge",
        false,
    )
    .await
    .expect("local step");
    for key in ["left", "doubt", "held"] {
        let mut claim = claim(key, 1, "a", now);
        claim.expires_at = now + Duration::from_secs(1);
        owned(acquire(&h, &claim).await);
        h.store()
            .save_step(&lease(&h, key, 1, now).await, &foreign(0, "charge", None))
            .await
            .expect("intent");
    }
    h.store()
        .set_status(
            &lease(&h, "doubt", 1, now).await,
            ProgressStatus::InDoubt,
            "unknown",
        )
        .await
        .expect("in doubt");
    let at = now + LEASE + Duration::from_secs(5);
    // "held" is taken over just before: its new lease still holds at `at`.
    let mut retake = claim("held", 1, "b", at - Duration::from_secs(1));
    retake.expires_at = now;
    owned(acquire(&h, &retake).await);
    assert_eq!(h.store().purge_progress(at, 10).await.expect("purge"), 2);
    let running = h
        .store()
        .progress(&listing(ProgressStatus::Running, None, at, 10))
        .await
        .expect("progress")
        .keys;
    let names: Vec<_> = running.iter().map(|p| p.scope.key.as_str()).collect();
    assert_eq!(names, ["held"]);
    // The key with a foreign step (money may have been taken) is a dead letter, never
    // forgotten; the one with local steps only is gone.
    let dead = h
        .store()
        .progress(&listing(ProgressStatus::Dead, None, at, 10))
        .await
        .expect("progress")
        .keys;
    let names: Vec<_> = dead.iter().map(|p| p.scope.key.as_str()).collect();
    assert_eq!(names, ["left"]);
    assert!(dead[0]
        .last_error
        .as_deref()
        .unwrap_or_default()
        .contains("foreign step"));
    assert!(matches!(
        acquire(&h, &claim("local", 1, "b", at)).await,
        Acquired::Owned { generation: 1, .. }
    ));
    let doubt = h
        .store()
        .progress(&listing(ProgressStatus::InDoubt, None, at, 10))
        .await
        .expect("progress")
        .keys;
    assert_eq!(doubt.len(), 1);
    // Through `purge_expired` too (with the records).
    let late = at + 2 * LEASE + 2 * HOUR * 24;
    assert!(h.store().purge_expired(late, 10).await.expect("purge") >= 1);
    let running = h
        .store()
        .progress(&listing(ProgressStatus::Running, None, late, 10))
        .await
        .expect("progress")
        .keys;
    assert!(running.is_empty(), "{running:?}");
}

/// A release (the client went away) that waits for the key's row while a step of the same
/// owner commits sees that step: the key is resumed by the next claim, not started afresh
/// without its steps. (A release that decided in one statement, `DELETE ... WHERE NOT EXISTS
/// (steps)`, did not see it at READ COMMITTED on PostgreSQL: its subquery kept the snapshot it
/// began with, and the key's progress was deleted.) Not on SQLite, whose one writer runs the
/// step's transaction and the release one after the other.
async fn a_release_sees_a_step_committed_while_it_waited<H: Harness>(h: H) {
    let now = SystemTime::now();
    owned(acquire(&h, &claim("k", 1, "a", now)).await);
    // The step's transaction: the lease check's update of the key's row, then the step.
    let Some(step) = h
        .hold_open(
            "UPDATE idempotency_progress SET updated_at = updated_at + 1 \
             WHERE idempotency_key = 'k'; \
             INSERT INTO idempotency_steps (tenant, operation, idempotency_key, seq, name, \
             kind, result, created_at, updated_at) \
             VALUES ('shop-a', 'checkout', 'k', 0, 'charge', 'foreign', NULL, 0, 0)",
            Duration::from_millis(700),
        )
        .await
    else {
        return;
    };
    let started = std::time::Instant::now();
    h.store()
        .release(&lease(&h, "k", 1, now).await)
        .await
        .expect("release");
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "the release waited for the step's transaction: {:?}",
        started.elapsed()
    );
    step.await.expect("committed");
    let (generation, steps) = owned(acquire(&h, &claim("k", 1, "b", now)).await);
    assert_eq!(generation, 2, "resumed, not started afresh");
    assert_eq!(steps, [(0, "charge".to_owned(), None)]);
}

macro_rules! steps_store_tests {
    ($backend:ident, $make:expr $(, $needs:ident)?) => {
        mod $backend {
            use super::*;

            steps_store_tests!(@tests $make; [$($needs)?];
                acquire_new_held_and_taken_over,
                another_payload_is_a_mismatch,
                finish_completes_the_key,
                records_live_and_expired,
                a_stale_generation_loses_the_lease,
                run_local_commits_or_rolls_back,
                intents_are_settled_or_forgotten,
                release_deletes_or_frees,
                in_doubt_until_resolved,
                completer_attempts_end_dead,
                progress_lists_idle_keys,
                concurrent_claims_of_a_new_key,
                every_life_of_a_key_has_its_own_run_id,
                a_step_at_a_position_holding_another_is_refused,
                listing_by_operation_pages_and_skips_what_it_cannot_read,
                expired_progress_is_purged_but_never_in_doubt_or_held,
            );
            // Only on the servers (the backends registered as needing one).
            $(steps_store_tests!(@tests $make; [$needs];
                lock_waits_are_bounded,
                a_release_sees_a_step_committed_while_it_waited,
            );)?
        }
    };
    (@tests $make:expr; [$($needs:ident)?]; $name:ident, $($rest:ident,)*) => {
        test! { $name $(, $needs)? }
        async fn $name() {
            // `None`: the backend is not available here.
            let Some(harness) = $make.await else {
                return;
            };
            super::$name(harness).await;
        }
        steps_store_tests!(@tests $make; [$($needs)?]; $($rest,)*);
    };
    (@tests $make:expr; [$($needs:ident)?];) => {};
}

mod sqlite {
    use tower_idempotency::store::sqlite::{rusqlite, SqliteStore};

    use super::*;

    pub(super) struct Sqlite {
        store: SqliteStore,
        _dir: tempfile::TempDir,
    }

    pub(super) async fn harness() -> Option<Sqlite> {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = SqliteStore::open(dir.path().join("store.db"))
            .await
            .expect("open");
        store.install_steps().await.expect("install steps");
        store
            .write(|tx| {
                tx.execute_batch("CREATE TABLE orders (id INTEGER PRIMARY KEY, sku TEXT NOT NULL)")
            })
            .await
            .expect("orders");
        Some(Sqlite { store, _dir: dir })
    }

    impl Harness for Sqlite {
        type Store = SqliteStore;

        fn store(&self) -> &SqliteStore {
            &self.store
        }

        async fn local_order(
            &self,
            lease: &Lease,
            step: &StepRow,
            tag: &'static str,
            fail: bool,
        ) -> Result<String, Error> {
            self.store
                .run_local(
                    lease,
                    step,
                    move |tx: &rusqlite::Transaction<'_>| {
                        tx.execute("INSERT INTO orders (sku) VALUES (?1)", [tag])?;
                        if fail {
                            return Err(rusqlite::Error::InvalidQuery);
                        }
                        Ok(tag.to_owned())
                    },
                    |value: &String| Ok(serde_json::to_string(value).expect("json")),
                )
                .await
        }

        async fn orders(&self, tag: &str) -> i64 {
            let tag = tag.to_owned();
            self.store
                .read(move |conn| {
                    conn.query_row("SELECT count(*) FROM orders WHERE sku = ?1", [tag], |row| {
                        row.get(0)
                    })
                })
                .await
                .expect("count")
        }

        async fn execute(&self, sql: &str) {
            let sql = sql.to_owned();
            self.store
                .write(move |tx| tx.execute_batch(&sql))
                .await
                .expect("execute");
        }

        async fn hold_open(&self, _: &str, _: Duration) -> Option<tokio::task::JoinHandle<()>> {
            None
        }
    }
}

mod postgres {
    use tower_idempotency::store::tokio_postgres::{PostgresHandle, PostgresStore};

    use super::*;
    use support::pg_common::TestDb;

    pub(super) struct Pg {
        store: PostgresStore,
        db: TestDb,
    }

    pub(super) async fn harness() -> Option<Pg> {
        let db = TestDb::create().await?;
        let store = db.store().await;
        store.install_steps().await.expect("install steps");
        Some(Pg { store, db })
    }

    impl Harness for Pg {
        type Store = PostgresStore;

        fn store(&self) -> &PostgresStore {
            &self.store
        }

        async fn local_order(
            &self,
            lease: &Lease,
            step: &StepRow,
            tag: &'static str,
            fail: bool,
        ) -> Result<String, Error> {
            self.store
                .run_local(
                    lease,
                    step,
                    move |tx: PostgresHandle| async move {
                        let client = tx.client().await?;
                        client
                            .execute(
                                "INSERT INTO orders (tenant_id, sku, quantity) \
                                 VALUES ('steps', $1, 1)",
                                &[&tag],
                            )
                            .await?;
                        if fail {
                            return Err(Error::Corrupt("the step failed".into()));
                        }
                        Ok(tag.to_owned())
                    },
                    |value: &String| Ok(serde_json::to_string(value).expect("json")),
                )
                .await
        }

        async fn orders(&self, tag: &str) -> i64 {
            self.db
                .value("SELECT count(*) FROM orders WHERE sku = $1", &[&tag])
                .await
        }

        async fn execute(&self, sql: &str) {
            self.db.execute(sql).await;
        }

        async fn hold_open(
            &self,
            sql: &str,
            hold: Duration,
        ) -> Option<tokio::task::JoinHandle<()>> {
            let client = self.db.client().await;
            client
                .batch_execute(&format!("BEGIN; {sql}"))
                .await
                .expect("the held transaction");
            Some(tokio::spawn(async move {
                tokio::time::sleep(hold).await;
                client.batch_execute("COMMIT").await.expect("commit");
            }))
        }
    }
}

mod sqlx_postgres {
    use tower_idempotency::store::sqlx_postgres::{SqlxPostgresHandle, SqlxPostgresStore};

    use super::*;
    use support::pg_common::TestDb;

    pub(super) struct SqlxPg {
        store: SqlxPostgresStore,
        db: TestDb,
    }

    pub(super) async fn harness() -> Option<SqlxPg> {
        let db = TestDb::create().await?;
        let store = db.sqlx_store(4, 2).await;
        store.install_steps().await.expect("install steps");
        Some(SqlxPg { store, db })
    }

    impl Harness for SqlxPg {
        type Store = SqlxPostgresStore;

        fn store(&self) -> &SqlxPostgresStore {
            &self.store
        }

        async fn local_order(
            &self,
            lease: &Lease,
            step: &StepRow,
            tag: &'static str,
            fail: bool,
        ) -> Result<String, Error> {
            self.store
                .run_local(
                    lease,
                    step,
                    move |tx: SqlxPostgresHandle| async move {
                        let mut conn = tx.acquire().await?;
                        sqlx::query(
                            "INSERT INTO orders (tenant_id, sku, quantity) \
                             VALUES ('steps', $1, 1)",
                        )
                        .bind(tag)
                        .execute(&mut *conn)
                        .await?;
                        if fail {
                            return Err(Error::Corrupt("the step failed".into()));
                        }
                        Ok(tag.to_owned())
                    },
                    |value: &String| Ok(serde_json::to_string(value).expect("json")),
                )
                .await
        }

        async fn orders(&self, tag: &str) -> i64 {
            self.db
                .value("SELECT count(*) FROM orders WHERE sku = $1", &[&tag])
                .await
        }

        async fn execute(&self, sql: &str) {
            self.db.execute(sql).await;
        }

        async fn hold_open(
            &self,
            sql: &str,
            hold: Duration,
        ) -> Option<tokio::task::JoinHandle<()>> {
            let client = self.db.client().await;
            client
                .batch_execute(&format!("BEGIN; {sql}"))
                .await
                .expect("the held transaction");
            Some(tokio::spawn(async move {
                tokio::time::sleep(hold).await;
                client.batch_execute("COMMIT").await.expect("commit");
            }))
        }
    }
}

mod sqlx_mysql {
    use tower_idempotency::store::sqlx_mysql::{SqlxMySqlHandle, SqlxMySqlStore};

    use super::*;
    use support::mysql_common::TestDb;

    pub(super) struct MySql {
        store: SqlxMySqlStore,
        db: TestDb,
    }

    pub(super) async fn harness() -> Option<MySql> {
        let db = TestDb::create().await?;
        let store = db.store(4).await;
        store.install_steps().await.expect("install steps");
        Some(MySql { store, db })
    }

    impl Harness for MySql {
        type Store = SqlxMySqlStore;

        fn store(&self) -> &SqlxMySqlStore {
            &self.store
        }

        async fn local_order(
            &self,
            lease: &Lease,
            step: &StepRow,
            tag: &'static str,
            fail: bool,
        ) -> Result<String, Error> {
            self.store
                .run_local(
                    lease,
                    step,
                    move |tx: SqlxMySqlHandle| async move {
                        let mut conn = tx.acquire().await?;
                        sqlx::query(
                            "INSERT INTO orders (tenant_id, sku, quantity) VALUES ('steps', ?, 1)",
                        )
                        .bind(tag)
                        .execute(&mut *conn)
                        .await?;
                        if fail {
                            return Err(Error::Corrupt("the step failed".into()));
                        }
                        Ok(tag.to_owned())
                    },
                    |value: &String| Ok(serde_json::to_string(value).expect("json")),
                )
                .await
        }

        async fn orders(&self, tag: &str) -> i64 {
            // Only a literal of the test's own is formatted in.
            self.db
                .count(&format!("SELECT count(*) FROM orders WHERE sku = '{tag}'"))
                .await
        }

        async fn execute(&self, sql: &str) {
            use sqlx::Executor as _;
            let mut conn = self.db.connection().await;
            // The test's own SQL.
            conn.execute(sqlx::AssertSqlSafe(sql))
                .await
                .expect("execute");
        }

        async fn hold_open(
            &self,
            sql: &str,
            hold: Duration,
        ) -> Option<tokio::task::JoinHandle<()>> {
            use sqlx::Executor as _;
            let mut conn = self.db.connection().await;
            conn.execute("BEGIN").await.expect("begin");
            for statement in sql.split(';').filter(|s| !s.trim().is_empty()) {
                conn.execute(sqlx::AssertSqlSafe(statement))
                    .await
                    .expect("the held transaction");
            }
            Some(tokio::spawn(async move {
                tokio::time::sleep(hold).await;
                conn.execute("COMMIT").await.expect("commit");
            }))
        }
    }
}

mod sqlx_sqlite {
    use tower_idempotency::store::sqlx_sqlite::{SqlxSqliteHandle, SqlxSqliteStore};

    use super::*;
    use support::sqlx_sqlite_common::TestDb;

    pub(super) struct SqlxSqlite {
        store: SqlxSqliteStore,
        db: TestDb,
    }

    pub(super) async fn harness() -> Option<SqlxSqlite> {
        let db = TestDb::with_orders().await?;
        let store = db.store(4).await;
        store.install_steps().await.expect("install steps");
        Some(SqlxSqlite { store, db })
    }

    impl Harness for SqlxSqlite {
        type Store = SqlxSqliteStore;

        fn store(&self) -> &SqlxSqliteStore {
            &self.store
        }

        async fn local_order(
            &self,
            lease: &Lease,
            step: &StepRow,
            tag: &'static str,
            fail: bool,
        ) -> Result<String, Error> {
            self.store
                .run_local(
                    lease,
                    step,
                    move |tx: SqlxSqliteHandle| async move {
                        let mut conn = tx.acquire().await?;
                        sqlx::query(
                            "INSERT INTO orders (tenant_id, sku, quantity) \
                             VALUES ('steps', ?1, 1)",
                        )
                        .bind(tag)
                        .execute(&mut *conn)
                        .await?;
                        if fail {
                            return Err(Error::Corrupt("the step failed".into()));
                        }
                        Ok(tag.to_owned())
                    },
                    |value: &String| Ok(serde_json::to_string(value).expect("json")),
                )
                .await
        }

        async fn orders(&self, tag: &str) -> i64 {
            sqlx::query_scalar("SELECT count(*) FROM orders WHERE sku = ?1")
                .bind(tag)
                .fetch_one(&mut self.db.connection().await)
                .await
                .expect("count")
        }

        async fn execute(&self, sql: &str) {
            self.db.execute(sql).await;
        }

        /// SQLite's one writer runs one transaction at a time, as in `sqlite`.
        async fn hold_open(&self, _: &str, _: Duration) -> Option<tokio::task::JoinHandle<()>> {
            None
        }
    }
}

steps_store_tests!(sqlite_store, sqlite::harness());
steps_store_tests!(postgres_store, postgres::harness(), postgres);
steps_store_tests!(sqlx_postgres_store, sqlx_postgres::harness(), postgres);
steps_store_tests!(sqlx_mysql_store, sqlx_mysql::harness(), mysql);
steps_store_tests!(sqlx_sqlite_store, sqlx_sqlite::harness());
