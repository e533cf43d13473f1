//! The receiver's inbox (`Inbox`) against real databases. Written once and run on SQLite
//! (through either store), PostgreSQL (either store) and MySQL/MariaDB: an event is applied once and its redeliveries are duplicates, per consumer; a
//! failed application leaves neither the id nor the effect; `process_in` records the id in a
//! request's transaction, which commits or rolls back with it; purging removes only old ids of
//! one consumer. On PostgreSQL only: anything that stops the transaction (an error, a panic, a
//! dropped future, a `ROLLBACK` through the handle) leaves no id, so the redelivery applies it;
//! deliveries of one event at once, on separate connections and separate instances, apply it
//! exactly once (the second waits on the id's primary key); and `process_in` behind the layer
//! over real HTTP.
//!
//! The PostgreSQL tests need `TEST_DATABASE_URL`; without it `cargo test` reports them as
//! ignored.

use support::backend;

use std::time::{Duration, SystemTime};

use backend::{Apply, Backend, EFFECTS, FAILURE};
use bytes::Bytes;
use http::StatusCode;
use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::key::IdempotencyKey;
use tower_idempotency::outbox::{Inbox, InboxBackend, Processed, Receipt};
use tower_idempotency::response::SavedResponse;
use tower_idempotency::store::{Begin, IdempotencyStore, NewRecord, Reservation, Scope};

async fn an_event_is_applied_once_and_redeliveries_are_duplicates<B: Backend>(db: B) {
    db.execute(EFFECTS).await;
    let inbox = Inbox::install(db.store().await, "inventory")
        .await
        .expect("install");
    // Installing again (another instance starting) is harmless.
    Inbox::install(db.store().await, "inventory")
        .await
        .expect("install again");
    assert_eq!(inbox.consumer(), "inventory");

    assert_eq!(
        B::process(&inbox, "e1", Apply::Effect)
            .await
            .expect("first"),
        Processed::First(1)
    );
    assert!(inbox.contains("e1").await.expect("contains"));
    for _ in 0..2 {
        assert_eq!(
            B::process(&inbox, "e1", Apply::Effect)
                .await
                .expect("again"),
            Processed::Duplicate
        );
    }
    assert_eq!(db.effects("e1").await, 1);

    // Ids are per consumer: another consumer of the same event applies it for itself.
    let billing = Inbox::install(db.store().await, "billing")
        .await
        .expect("install billing");
    assert!(!billing.contains("e1").await.expect("contains"));
    assert_eq!(
        B::process(&billing, "e1", Apply::Nothing)
            .await
            .expect("billing"),
        Processed::First(0)
    );
}

async fn a_failed_application_rolls_back_the_id_and_the_effect<B: Backend>(db: B) {
    db.execute(EFFECTS).await;
    let inbox = Inbox::install(db.store().await, "inventory")
        .await
        .expect("install");

    let failed = B::process(&inbox, "e1", Apply::EffectThenFail).await;
    assert!(
        failed
            .as_ref()
            .is_err_and(|e| e.to_string().contains(FAILURE)),
        "{failed:?}"
    );
    assert!(!inbox.contains("e1").await.expect("contains"));
    assert_eq!(db.effects("e1").await, 0);

    // A failing statement: the error comes back, nothing is kept.
    let failed = B::process(&inbox, "e1", Apply::BrokenStatement).await;
    assert!(
        failed
            .as_ref()
            .is_err_and(|e| e.to_string().contains("no_such_table")),
        "{failed:?}"
    );
    assert!(!inbox.contains("e1").await.expect("contains"));

    // The redelivery applies it.
    assert_eq!(
        B::process(&inbox, "e1", Apply::Effect)
            .await
            .expect("redelivery"),
        Processed::First(1)
    );
    assert_eq!(db.effects("e1").await, 1);
}

/// A reservation of the idempotency layer's kind: what `process_in` gets the handle of.
async fn reserve<S: IdempotencyStore>(store: &S, key: &str) -> S::Reservation {
    let scope = Scope::new(
        "shop-a",
        "receive_event",
        IdempotencyKey::parse(key.as_bytes(), 128).expect("valid key"),
    );
    match store
        .begin(&scope, Duration::from_secs(5), SystemTime::now())
        .await
        .expect("begin")
    {
        Begin::Reserved(tx) => tx,
        Begin::Existing(record) => panic!("expected a reservation, found {record:?}"),
    }
}

fn record() -> NewRecord {
    let now = SystemTime::now();
    NewRecord::new(
        Fingerprint::new(1, [7; 32]),
        SavedResponse::new(StatusCode::OK, vec![], Bytes::from_static(b"{}")),
        now,
        now + Duration::from_secs(3600),
    )
}

async fn process_in_records_the_id_with_the_request_transaction<B: Backend, T>(db: B)
where
    B::Store: IdempotencyStore<Reservation = T>,
    T: Reservation<Handle = <B::Store as InboxBackend>::Handle>,
{
    db.execute(EFFECTS).await;
    let inbox = Inbox::install(db.store().await, "inventory")
        .await
        .expect("install");

    // Rolled back with the request: neither the id nor the effect stays.
    let request = reserve(db.store().await, "k1").await;
    let handle = request.handle();
    assert_eq!(
        inbox.process_in(&handle, "e1").await.expect("record"),
        Receipt::First
    );
    B::apply_in(&handle, "e1").await;
    assert_eq!(
        inbox.process_in(&handle, "e1").await.expect("record"),
        Receipt::Duplicate,
        "the same transaction sees its own id"
    );
    drop(handle);
    request.rollback().await.expect("rollback");
    assert!(!inbox.contains("e1").await.expect("contains"));
    assert_eq!(db.effects("e1").await, 0);

    // Committed with the request's saved response: the redelivery is a duplicate.
    let request = reserve(db.store().await, "k2").await;
    let handle = request.handle();
    assert_eq!(
        inbox.process_in(&handle, "e1").await.expect("record"),
        Receipt::First
    );
    B::apply_in(&handle, "e1").await;
    drop(handle);
    request.commit(record()).await.expect("commit");
    assert!(inbox.contains("e1").await.expect("contains"));
    assert_eq!(db.effects("e1").await, 1);

    let request = reserve(db.store().await, "k3").await;
    assert_eq!(
        inbox
            .process_in(&request.handle(), "e1")
            .await
            .expect("record"),
        Receipt::Duplicate
    );
    request.rollback().await.expect("rollback");
}

async fn purge_removes_only_old_ids_of_its_consumer<B: Backend>(db: B) {
    let inbox = Inbox::install(db.store().await, "inventory")
        .await
        .expect("install");
    let billing = Inbox::install(db.store().await, "billing")
        .await
        .expect("install billing");
    for id in ["old1", "old2", "old3", "new"] {
        B::process(&inbox, id, Apply::Nothing)
            .await
            .expect("process");
    }
    B::process(&billing, "old1", Apply::Nothing)
        .await
        .expect("process");
    // Processed two days ago, for both consumers.
    db.execute(
        "UPDATE inbox_events SET processed_at = processed_at - 172800000 \
         WHERE event_id LIKE 'old%'",
    )
    .await;

    let a_day_ago = SystemTime::now() - Duration::from_secs(24 * 3600);
    assert_eq!(
        inbox
            .purge_processed_before(a_day_ago, 2)
            .await
            .expect("purge"),
        2
    );
    assert_eq!(
        inbox
            .purge_processed_before(a_day_ago, 2)
            .await
            .expect("purge"),
        1
    );
    assert_eq!(
        inbox
            .purge_processed_before(a_day_ago, 2)
            .await
            .expect("purge"),
        0
    );
    for id in ["old1", "old2", "old3"] {
        assert!(!inbox.contains(id).await.expect("contains"), "{id}");
    }
    assert!(inbox.contains("new").await.expect("contains"));
    assert!(
        billing.contains("old1").await.expect("contains"),
        "another consumer's ids stay"
    );
}

mod sqlite {
    //! On a SQLite file.

    backend_tests!(Sqlite;
        an_event_is_applied_once_and_redeliveries_are_duplicates,
        a_failed_application_rolls_back_the_id_and_the_effect,
        process_in_records_the_id_with_the_request_transaction,
        purge_removes_only_old_ids_of_its_consumer,
    );
}

mod postgres {
    //! On PostgreSQL: the suite, and what only PostgreSQL's own transactions and row locks do.

    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use http::StatusCode;
    use support::apps::inventory::FAIL_AFTER_RECORD;
    use support::backend::EFFECTS;
    use support::common::{Post, PATIENCE};
    use support::pg_common::inventory::{InventoryServer, Mode};
    use support::pg_common::TestDb;
    use tokio::sync::oneshot;
    type PostgresInbox =
        tower_idempotency::outbox::Inbox<tower_idempotency::store::tokio_postgres::PostgresStore>;
    use tower_idempotency::outbox::{Processed, Receipt};
    use tower_idempotency::store::tokio_postgres::{PostgresHandle, PostgresStore};
    use tower_idempotency::store::Isolation;
    use tower_idempotency::Error;

    backend_tests!(Postgres;
        an_event_is_applied_once_and_redeliveries_are_duplicates,
        a_failed_application_rolls_back_the_id_and_the_effect,
        process_in_records_the_id_with_the_request_transaction,
        purge_removes_only_old_ids_of_its_consumer,
        // The suite's test, under the name it had here before the suite was written.
        an_error_in_the_closure_rolls_back_the_id_and_the_effect =
            a_failed_application_rolls_back_the_id_and_the_effect,
    );

    /// A store of its own (an instance), with small pools.
    async fn instance(db: &TestDb) -> PostgresStore {
        db.store_with(|o| o.with_max_connections(8).with_max_read_connections(1))
            .await
    }

    /// A fresh database with the effects table, an instance and its inbox (`None` without
    /// PostgreSQL).
    async fn setup() -> Option<(TestDb, PostgresStore, PostgresInbox)> {
        let db = TestDb::create().await?;
        db.execute(EFFECTS).await;
        let store = instance(&db).await;
        let inbox = PostgresInbox::install(&store, "inventory")
            .await
            .expect("install");
        Some((db, store, inbox))
    }

    /// Applies an event: inserts its effect row through the handle; returns how many effect rows
    /// this event has now (as this transaction sees them).
    async fn apply(tx: PostgresHandle, event_id: String) -> Result<i64, Error> {
        apply_blind(tx.clone(), event_id.clone()).await?;
        let client = tx.client().await?;
        let row = client
            .query_one(
                "SELECT count(*) FROM effects WHERE event_id = $1",
                &[&event_id],
            )
            .await?;
        Ok(row.try_get(0)?)
    }

    /// Applies an event without reading anything (no predicate locks under `SERIALIZABLE`, so
    /// concurrent events never conflict with each other, only deliveries of the same event do).
    async fn apply_blind(tx: PostgresHandle, event_id: String) -> Result<i64, Error> {
        let client = tx.client().await?;
        client
            .execute(
                "INSERT INTO effects (event_id, note) VALUES ($1, 'applied')",
                &[&event_id],
            )
            .await?;
        Ok(1)
    }

    fn crash() -> Result<(), Error> {
        panic!("the receiver crashed")
    }

    /// Committed effect rows of `event_id`.
    async fn effects(db: &TestDb, event_id: &str) -> i64 {
        let sql = "SELECT count(*) FROM effects WHERE event_id = $1";
        db.value(sql, &[&event_id]).await
    }

    /// Waits until a connection of this test's schema waits on a lock (another transaction holds
    /// the row it wants); panics if none does in time.
    async fn wait_for_a_lock_wait(db: &TestDb) {
        let observer = db.client().await;
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let waiting: i64 = observer
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE application_name = $1 AND wait_event_type = 'Lock'",
                    &[&db.schema],
                )
                .await
                .expect("pg_stat_activity")
                .get(0);
            if waiting > 0 {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "nobody waited on the lock"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    test! { an_event_is_processed_once_and_its_redelivery_is_a_duplicate, postgres }
    async fn an_event_is_processed_once_and_its_redelivery_is_a_duplicate() {
        // What the suite (`an_event_is_applied_once_and_redeliveries_are_duplicates`) does not
        // show: the closure is not even called for a duplicate, an `async fn` is a closure, and
        // `record` takes a tokio-postgres transaction of one's own.
        let Some((db, store, inbox)) = setup().await else {
            return;
        };
        let calls = Arc::new(AtomicUsize::new(0));
        let deliver = || {
            let calls = calls.clone();
            inbox.process("e1", move |tx| {
                calls.fetch_add(1, Ordering::SeqCst);
                apply(tx, "e1".to_owned())
            })
        };
        assert_eq!(deliver().await.expect("first"), Processed::First(1));
        assert_eq!(deliver().await.expect("again"), Processed::Duplicate);
        assert_eq!(deliver().await.expect("again"), Processed::Duplicate);
        assert_eq!(calls.load(Ordering::SeqCst), 1, "the closure ran once");
        assert_eq!(effects(&db, "e1").await, 1);

        // An `async fn` works as well as a closure.
        async fn note(tx: PostgresHandle) -> Result<&'static str, Error> {
            let client = tx.client().await?;
            client
                .execute(
                    "INSERT INTO effects (event_id, note) VALUES ('e2', 'noted')",
                    &[],
                )
                .await?;
            Ok("noted")
        }
        assert_eq!(
            inbox.process("e2", note).await.expect("e2"),
            Processed::First("noted")
        );
        assert_eq!(
            inbox.process("e2", note).await.expect("e2"),
            Processed::Duplicate
        );

        // `record` in a transaction of one's own (tokio-postgres'): the id belongs to it.
        let mut client = store.client().await.expect("client");
        let own = client.transaction().await.expect("begin");
        assert_eq!(
            inbox.record(&*own, "e3").await.expect("record"),
            Receipt::First
        );
        assert_eq!(
            inbox.record(&*own, "e3").await.expect("record"),
            Receipt::Duplicate
        );
        assert_eq!(
            inbox.record(&*own, "e1").await.expect("record"),
            Receipt::Duplicate
        );
        own.rollback().await.expect("rollback");
        assert!(!inbox.contains("e3").await.expect("contains"));
    }

    test! { a_transaction_the_closure_ended_or_broke_is_not_committed, postgres }
    async fn a_transaction_the_closure_ended_or_broke_is_not_committed() {
        let Some((db, _store, inbox)) = setup().await else {
            return;
        };

        // A failed statement whose error the closure swallowed: PostgreSQL would answer the
        // COMMIT with a silent ROLLBACK; `process` reports it instead of `First`.
        let swallowed = inbox
            .process("e1", |tx| async move {
                apply(tx.clone(), "e1".to_owned()).await?;
                let client = tx.client().await?;
                let _ = client.execute("SELECT 1 / 0", &[]).await;
                Ok(())
            })
            .await;
        assert!(swallowed.is_err(), "{swallowed:?}");
        assert!(!inbox.contains("e1").await.expect("contains"));
        assert_eq!(effects(&db, "e1").await, 0);

        // A ROLLBACK through the handle is refused; the closure's error rolls back the id.
        let rolled_back = inbox
            .process("e1", |tx| async move {
                let client = tx.client().await?;
                client.batch_execute("ROLLBACK").await?;
                Ok(())
            })
            .await;
        assert!(
            matches!(rolled_back, Err(Error::TransactionControl("ROLLBACK"))),
            "{rolled_back:?}"
        );
        assert!(!inbox.contains("e1").await.expect("contains"));

        // A task that outlives the closure, still holding the transaction's connection: the
        // inbox does not commit under it.
        let (hold_tx, hold) = oneshot::channel::<()>();
        let (held_tx, held) = oneshot::channel::<()>();
        let escaped = inbox
            .process("e1", |tx| async move {
                tokio::spawn(async move {
                    let _client = tx.client().await.expect("client");
                    let _ = held_tx.send(());
                    let _ = hold.await;
                });
                held.await.expect("the task holds the connection");
                Ok(())
            })
            .await;
        assert!(
            matches!(escaped, Err(Error::TransactionAborted(_))),
            "{escaped:?}"
        );
        let _ = hold_tx.send(());
        assert!(!inbox.contains("e1").await.expect("contains"));

        // The handle refuses work once `process` has returned.
        let (keep_tx, kept) = oneshot::channel::<PostgresHandle>();
        inbox
            .process("e2", |tx| async move {
                let _ = keep_tx.send(tx);
                Ok(())
            })
            .await
            .expect("e2");
        let kept = kept.await.expect("the handle");
        assert!(kept.is_finished());
        assert!(matches!(
            kept.client().await,
            Err(Error::TransactionFinished)
        ));
    }

    test! { a_panic_or_a_dropped_delivery_leaves_no_id_and_the_redelivery_applies_it, postgres }
    async fn a_panic_or_a_dropped_delivery_leaves_no_id_and_the_redelivery_applies_it() {
        let Some((db, _store, inbox)) = setup().await else {
            return;
        };

        // A panic in the closure, after the effect was written.
        let panicking = inbox.clone();
        let outcome = tokio::spawn(async move {
            panicking
                .process("e1", |tx| async move {
                    apply(tx, "e1".to_owned()).await?;
                    crash()
                })
                .await
        })
        .await;
        assert!(outcome.is_err_and(|e| e.is_panic()));
        assert!(!inbox.contains("e1").await.expect("contains"));

        // A delivery dropped while its transaction is open (the sender hung up).
        let dropped = tokio::time::timeout(
            Duration::from_millis(300),
            inbox.process("e2", |tx| async move {
                apply(tx, "e2".to_owned()).await?;
                std::future::pending::<Result<(), Error>>().await
            }),
        )
        .await;
        assert!(dropped.is_err(), "it was still running");
        assert!(!inbox.contains("e2").await.expect("contains"));

        // Both redeliveries apply their event (once PostgreSQL has rolled back the closed
        // connections' transactions, which their inserts wait for).
        for id in ["e1", "e2"] {
            let redelivered =
                tokio::time::timeout(PATIENCE, inbox.process(id, |tx| apply(tx, id.to_owned())))
                    .await
                    .expect("in time")
                    .expect("redelivery");
            assert_eq!(redelivered, Processed::First(1), "{id}");
            assert_eq!(effects(&db, id).await, 1, "{id}");
        }
    }

    /// Two deliveries of one event on two instances: the first holds its transaction open until
    /// told to finish with `first_result`; the second starts meanwhile. Returns both outcomes and
    /// how often each closure ran.
    async fn two_deliveries_at_once(
        db: &TestDb,
        isolation: Isolation,
        first_result: Result<(), &'static str>,
    ) -> (
        Result<Processed<i64>, Error>,
        Result<Processed<i64>, Error>,
        usize,
    ) {
        db.execute(EFFECTS).await;
        let first_store = db
            .store_with(|o| o.with_max_connections(4).with_isolation(isolation))
            .await;
        let second_store = db
            .store_with(|o| o.with_max_connections(4).with_isolation(isolation))
            .await;
        let first_inbox = PostgresInbox::install(&first_store, "inventory")
            .await
            .expect("install");
        let second_inbox = PostgresInbox::install(&second_store, "inventory")
            .await
            .expect("install");

        let (entered_tx, entered) = oneshot::channel::<()>();
        let (release_tx, release) = oneshot::channel::<()>();
        // Owned: what the closure captures holds no reference, not even a `'static` one.
        let first_result = first_result.map_err(str::to_owned);
        let first = tokio::spawn(async move {
            first_inbox
                .process("e1", move |tx| async move {
                    let applied = apply(tx, "e1".to_owned()).await?;
                    let _ = entered_tx.send(());
                    let _ = release.await;
                    match first_result {
                        Ok(()) => Ok(applied),
                        Err(message) => Err(Error::Corrupt(message)),
                    }
                })
                .await
        });
        entered
            .await
            .expect("the first delivery is applying the event");

        let second_calls = Arc::new(AtomicUsize::new(0));
        let calls = second_calls.clone();
        let second = tokio::spawn(async move {
            second_inbox
                .process("e1", move |tx| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    apply(tx, "e1".to_owned())
                })
                .await
        });
        // The second waits on the id's primary key, held by the first's open transaction.
        wait_for_a_lock_wait(db).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!second.is_finished(), "the second did not wait");
        assert_eq!(second_calls.load(Ordering::SeqCst), 0);

        release_tx.send(()).expect("release the first");
        let first = first.await.expect("first task");
        let second = tokio::time::timeout(PATIENCE, second)
            .await
            .expect("the second finished in time")
            .expect("second task");
        (first, second, second_calls.load(Ordering::SeqCst))
    }

    /// [`two_deliveries_at_once`] on a fresh database, the first ending well or failing: the
    /// event is applied once, by the first, or by the second after the first rolled back.
    async fn two_deliveries_at_once_apply_it_once(isolation: Isolation, first_fails: bool) {
        let Some(db) = TestDb::create().await else {
            return;
        };
        let first_result = if first_fails {
            Err("the first failed")
        } else {
            Ok(())
        };
        let (first, second, second_calls) =
            two_deliveries_at_once(&db, isolation, first_result).await;
        if first_fails {
            assert!(matches!(first, Err(Error::Corrupt(_))), "{first:?}");
            // The first's effect rolled back: the second's is the only one.
            assert_eq!(second.expect("second"), Processed::First(1));
            assert_eq!(second_calls, 1);
        } else {
            assert_eq!(first.expect("first"), Processed::First(1));
            assert_eq!(second.expect("second"), Processed::Duplicate);
            assert_eq!(second_calls, 0);
        }
        assert_eq!(effects(&db, "e1").await, 1);
    }

    test! { a_duplicate_delivered_while_the_first_is_applied_waits_and_is_a_duplicate, multi_thread = 2, postgres }
    async fn a_duplicate_delivered_while_the_first_is_applied_waits_and_is_a_duplicate() {
        two_deliveries_at_once_apply_it_once(Isolation::ReadCommitted, false).await;
    }

    test! { a_waiting_duplicate_applies_the_event_when_the_first_rolls_back, multi_thread = 2, postgres }
    async fn a_waiting_duplicate_applies_the_event_when_the_first_rolls_back() {
        two_deliveries_at_once_apply_it_once(Isolation::ReadCommitted, true).await;
    }

    test! { under_serializable_the_waiting_duplicate_is_retried_into_a_duplicate, multi_thread = 2, postgres }
    async fn under_serializable_the_waiting_duplicate_is_retried_into_a_duplicate() {
        // The wait ends in a serialization failure (the committed id is not in the second's
        // snapshot); the inbox retries before running the closure.
        two_deliveries_at_once_apply_it_once(Isolation::Serializable, false).await;
    }

    /// Delivers each of `events` ids `copies` times at once, alternating between two instances;
    /// returns the outcomes per id.
    async fn deliver_all_at_once(
        db: &TestDb,
        isolation: Isolation,
        events: usize,
        copies: usize,
    ) -> HashMap<String, Vec<Processed<i64>>> {
        db.execute(EFFECTS).await;
        let mut inboxes = Vec::new();
        for _ in 0..2 {
            let store = db
                .store_with(|o| {
                    o.with_max_connections(8)
                        .with_max_read_connections(1)
                        .with_isolation(isolation)
                })
                .await;
            inboxes.push(
                PostgresInbox::install(&store, "inventory")
                    .await
                    .expect("install"),
            );
        }
        let mut tasks = Vec::new();
        for copy in 0..copies {
            for event in 0..events {
                let inbox = inboxes[(copy + event) % 2].clone();
                let id = format!("e{event}");
                tasks.push(tokio::spawn(async move {
                    let event_id = id.clone();
                    let outcome = inbox.process(&id, |tx| apply_blind(tx, event_id)).await;
                    (id, outcome)
                }));
            }
        }
        let mut outcomes: HashMap<String, Vec<Processed<i64>>> = HashMap::new();
        for task in tasks {
            let (id, outcome) = tokio::time::timeout(PATIENCE, task)
                .await
                .expect("in time")
                .expect("task");
            outcomes
                .entry(id.clone())
                .or_default()
                .push(outcome.unwrap_or_else(|e| panic!("{id}: {e}")));
        }
        outcomes
    }

    /// [`deliver_all_at_once`] on a fresh database: each event applied once, by one of its
    /// copies, and (`first_applies_once`) that copy saw the effect's first application.
    async fn deliveries_at_once_apply_each_event_once(
        isolation: Isolation,
        events: usize,
        copies: usize,
        first_applies_once: bool,
    ) {
        let Some(db) = TestDb::create().await else {
            return;
        };
        let outcomes = deliver_all_at_once(&db, isolation, events, copies).await;
        assert_eq!(outcomes.len(), events);
        for (id, outcomes) in &outcomes {
            let first = outcomes
                .iter()
                .filter(|o| matches!(o, Processed::First(_)))
                .count();
            assert_eq!((first, outcomes.len()), (1, copies), "{id}: {outcomes:?}");
            if first_applies_once {
                assert!(outcomes.contains(&Processed::First(1)), "{id}");
            }
            assert_eq!(effects(&db, id).await, 1, "{id}");
        }
    }

    test! { many_deliveries_at_once_on_two_instances_apply_each_event_once, multi_thread = 4, postgres }
    async fn many_deliveries_at_once_on_two_instances_apply_each_event_once() {
        deliveries_at_once_apply_each_event_once(Isolation::ReadCommitted, 12, 5, true).await;
    }

    test! { many_deliveries_at_once_under_serializable_apply_each_event_once, multi_thread = 4, postgres }
    async fn many_deliveries_at_once_under_serializable_apply_each_event_once() {
        deliveries_at_once_apply_each_event_once(Isolation::Serializable, 6, 4, false).await;
    }

    /// An event delivery to the inventory receiver, as the orders example's relay sends it:
    /// `POST /events` with the event in its envelope, the id also as `Idempotency-Key`.
    fn delivery(event_id: &str, sku: &str) -> Post {
        let payload = format!(r#"{{"order_id":1,"tenant":"shop-a","sku":"{sku}","quantity":2}}"#);
        let envelope =
            format!(r#"{{"id":"{event_id}","topic":"order_created","payload":{payload}}}"#);
        Post::order(event_id, &envelope)
            .path("/events")
            .token(None)
            .header("event-topic", "order_created")
    }

    /// A fresh database and the inventory receiver on it (`None` without PostgreSQL).
    async fn receiver(mode: Mode) -> Option<(TestDb, InventoryServer)> {
        let db = TestDb::create().await?;
        let inventory = InventoryServer::spawn(&db, mode).await;
        Some((db, inventory))
    }

    test! { process_in_records_the_id_with_the_request_and_a_forgotten_key_is_still_a_duplicate, postgres }
    async fn process_in_records_the_id_with_the_request_and_a_forgotten_key_is_still_a_duplicate() {
        let Some((db, inventory)) = receiver(Mode::Layered).await else {
            return;
        };

        let first = delivery("e1", "book").send(inventory.addr).await;
        assert_eq!(first.status, StatusCode::OK);
        assert_eq!(first.json()["status"], "reserved");
        assert!(!first.replayed());
        assert!(inventory.inbox.contains("e1").await.expect("contains"));
        assert_eq!(inventory.reservations().await, 1);

        // A redelivery with the same key: the layer replays the saved answer.
        let replay = delivery("e1", "book").send(inventory.addr).await;
        assert!(replay.replayed());
        assert_eq!(replay.json()["status"], "reserved");

        // The record is gone (purged early, deleted by an operator): the handler runs again, and
        // the inbox, which committed with the first request, says it is a duplicate.
        assert_eq!(
            inventory
                .store
                .client()
                .await
                .expect("client")
                .execute("DELETE FROM idempotency_records", &[])
                .await
                .expect("delete the records"),
            1
        );
        let again = delivery("e1", "book").send(inventory.addr).await;
        assert_eq!(again.status, StatusCode::OK);
        assert!(!again.replayed());
        assert_eq!(again.json()["status"], "duplicate");
        assert_eq!(inventory.reservations().await, 1);
        assert_eq!(inventory.reserved("book").await, 2);

        // A request that fails after recording the id rolls it back with everything else.
        let failed = delivery("e2", FAIL_AFTER_RECORD).send(inventory.addr).await;
        assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!inventory.inbox.contains("e2").await.expect("contains"));
        assert_eq!(inventory.reserved(FAIL_AFTER_RECORD).await, 0);
        assert_eq!(db.record_count().await, 1, "only e1's answer was saved");
        // So the redelivery runs the handler again (and here fails again, keeping nothing).
        let retried = delivery("e2", FAIL_AFTER_RECORD).send(inventory.addr).await;
        assert_eq!(retried.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!retried.replayed());
        assert_eq!(inventory.reservations().await, 1);
    }

    test! { a_receiver_on_its_own_transactions_acknowledges_redeliveries, postgres }
    async fn a_receiver_on_its_own_transactions_acknowledges_redeliveries() {
        let Some((_db, inventory)) = receiver(Mode::Inbox).await else {
            return;
        };
        let first = delivery("e1", "book").send(inventory.addr).await;
        assert_eq!(first.json()["status"], "reserved");
        let again = delivery("e1", "book").send(inventory.addr).await;
        assert_eq!(again.status, StatusCode::OK);
        assert_eq!(again.json()["status"], "duplicate");
        assert_eq!(inventory.reservations().await, 1);

        let failed = delivery("e2", FAIL_AFTER_RECORD).send(inventory.addr).await;
        assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!inventory.inbox.contains("e2").await.expect("contains"));
        assert_eq!(inventory.reservations().await, 1);
        let deliveries = inventory.deliveries();
        assert_eq!(deliveries.len(), 3);
        assert!(deliveries.iter().all(|d| !d.replayed));
    }
}

mod sqlx_postgres {
    //! The sqlx store: the suite. The tests of `postgres` that block on a held id or change
    //! the isolation use the tokio-postgres store's own options and inventory app.

    backend_tests!(SqlxPostgres;
        an_event_is_applied_once_and_redeliveries_are_duplicates,
        a_failed_application_rolls_back_the_id_and_the_effect,
        process_in_records_the_id_with_the_request_transaction,
        purge_removes_only_old_ids_of_its_consumer,
    );
}

mod mysql {
    //! On MySQL or MariaDB through the sqlx store: the suite. The tests of `postgres` that
    //! block on a held id or change the isolation use the tokio-postgres store's own options
    //! and inventory app.

    backend_tests!(MySql;
        an_event_is_applied_once_and_redeliveries_are_duplicates,
        a_failed_application_rolls_back_the_id_and_the_effect,
        process_in_records_the_id_with_the_request_transaction,
        purge_removes_only_old_ids_of_its_consumer,
    );
}

mod sqlx_sqlite {
    //! On a SQLite file through the sqlx store: the suite.

    backend_tests!(SqlxSqlite;
        an_event_is_applied_once_and_redeliveries_are_duplicates,
        a_failed_application_rolls_back_the_id_and_the_effect,
        process_in_records_the_id_with_the_request_transaction,
        purge_removes_only_old_ids_of_its_consumer,
    );
}
