//! The replay checks, batched under load.
//!
//! Each new request asks the read pool whether its key has a completed record. One check at a
//! time costs a round trip and a backend's wake-up for a single-row answer; under load most of
//! the server's and the database's work for it is that round trip, not the lookup. So at most
//! [`IN_FLIGHT`] checks run at once, each on its own read connection: a request that finds a
//! free place runs its check alone, as before; one that arrives while they are all taken
//! queues, and when a running check ends, everything queued meanwhile goes in one statement
//! ([`SELECT_LIVE_RECORDS`]: the keys as arrays, each with its own `now`). A lone request
//! (concurrency 1) never waits for another one; a queued one waits for at most one other
//! check, then shares a round trip with every other queued one.
//!
//! A queued check is answered by a task spawned for its batch; if that task or its runtime
//! goes away, the check ends with [`Error::Busy`], and the request takes the write path, which
//! reads authoritatively (as for any failed check). The whole wait, queue included, stays
//! within the store's `read_wait`.

use std::sync::{Arc, Mutex};

use deadpool_postgres::Pool;
use tokio::sync::oneshot;
use tokio_postgres::types::Type;

use super::statements::{Preparation, Typed};
use super::store::pool_error;
use super::SELECT_LIVE_RECORD;
use crate::error::Error;
use crate::postgres::store_sql::SELECT_LIVE_RECORDS;
use crate::store::columns::record_row::decode_record;
use crate::store::{Scope, StoredRecord};

/// How many checks run at once (single or batched), each on a read connection of its own.
const IN_FLIGHT: usize = 2;
/// The most checks in one statement.
const MAX_BATCH: usize = 128;

type Answer = Result<Option<StoredRecord>, Error>;

/// The replay checks of one store (shared by its clones).
#[derive(Default)]
pub(super) struct Lookups {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Checks running now.
    in_flight: usize,
    /// Checks waiting for a place, in arrival order.
    queued: Vec<Queued>,
}

struct Queued {
    scope: Scope,
    now: i64,
    answer: oneshot::Sender<Answer>,
}

/// A place among the checks in flight; giving it up hands it to what queued meanwhile.
struct Place<'a> {
    lookups: &'a Arc<Lookups>,
    reads: &'a Pool,
    preparation: Preparation,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.lookups.hand_over(self.reads, self.preparation);
    }
}

impl Lookups {
    /// The live record of `scope` at `now` (unix milliseconds), read on `reads`.
    pub(super) async fn check(
        self: &Arc<Self>,
        reads: &Pool,
        preparation: Preparation,
        scope: &Scope,
        now: i64,
    ) -> Answer {
        let queued = {
            let Ok(mut state) = self.state.lock() else {
                return Err(Error::Busy);
            };
            if state.in_flight < IN_FLIGHT {
                state.in_flight += 1;
                None
            } else {
                let (answer, answered) = oneshot::channel();
                state.queued.push(Queued {
                    scope: scope.clone(),
                    now,
                    answer,
                });
                Some(answered)
            }
        };
        match queued {
            // The batch's task went away without answering.
            Some(answered) => answered.await.unwrap_or(Err(Error::Busy)),
            None => {
                let _place = Place {
                    lookups: self,
                    reads,
                    preparation,
                };
                read_one(reads, preparation, scope, now).await
            }
        }
    }

    /// A check ended: its place goes to a batch of what queued meanwhile, or is free.
    fn hand_over(self: &Arc<Self>, reads: &Pool, preparation: Preparation) {
        let batch = {
            let Ok(mut state) = self.state.lock() else {
                return;
            };
            if state.queued.is_empty() {
                state.in_flight -= 1;
                return;
            }
            if state.queued.len() <= MAX_BATCH {
                std::mem::take(&mut state.queued)
            } else {
                state.queued.drain(..MAX_BATCH).collect()
            }
        };
        let lookups = self.clone();
        let reads = reads.clone();
        let serve = async move {
            let place = Place {
                lookups: &lookups,
                reads: &reads,
                preparation,
            };
            read_batch(place.reads, preparation, batch).await;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(serve)),
            // No runtime to run the batch on: dropping it drops its answers (the checks end
            // with `Busy`), and the place is free.
            Err(_) => {
                drop(serve);
                if let Ok(mut state) = self.state.lock() {
                    state.in_flight -= 1;
                }
            }
        }
    }
}

/// One check, alone: the statement the batch is a multiple of.
async fn read_one(reads: &Pool, preparation: Preparation, scope: &Scope, now: i64) -> Answer {
    let client = reads.get().await.map_err(pool_error)?;
    let params: [Typed<'_>; 4] = [
        (&&*scope.tenant, Type::TEXT),
        (&&*scope.operation, Type::TEXT),
        (&scope.key.as_str(), Type::TEXT),
        (&now, Type::INT8),
    ];
    let row = preparation
        .query_opt(&client, SELECT_LIVE_RECORD, &params)
        .await?;
    row.as_ref().map(decode_record).transpose()
}

/// The checks of `batch` in one statement; each gets its own answer. A failed statement is
/// logged once and answers none of them with a record (each request then reads again on the
/// write path, as after a failed single check).
async fn read_batch(reads: &Pool, preparation: Preparation, batch: Vec<Queued>) {
    let tenants: Vec<&str> = batch.iter().map(|q| &*q.scope.tenant).collect();
    let operations: Vec<&str> = batch.iter().map(|q| &*q.scope.operation).collect();
    let keys: Vec<&str> = batch.iter().map(|q| q.scope.key.as_str()).collect();
    let nows: Vec<i64> = batch.iter().map(|q| q.now).collect();
    let params: [Typed<'_>; 4] = [
        (&tenants, Type::TEXT_ARRAY),
        (&operations, Type::TEXT_ARRAY),
        (&keys, Type::TEXT_ARRAY),
        (&nows, Type::INT8_ARRAY),
    ];
    let rows = async {
        let client = reads.get().await.map_err(pool_error)?;
        let rows = preparation
            .query(&client, SELECT_LIVE_RECORDS, &params)
            .await?;
        Ok::<_, Error>(rows)
    }
    .await;
    let mut answers: Vec<Option<Answer>> = Vec::new();
    answers.resize_with(batch.len(), || None);
    match rows {
        Ok(rows) => {
            for row in &rows {
                let position = row
                    .try_get::<_, i64>(9)
                    .ok()
                    .and_then(|position| usize::try_from(position).ok())
                    .and_then(|position| position.checked_sub(1));
                if let Some(answer) = position.and_then(|position| answers.get_mut(position)) {
                    *answer = Some(decode_record(row).map(Some));
                }
            }
        }
        Err(error) => {
            tracing::warn!(%error, checks = batch.len(), "idempotency fast-path batch lookup failed");
        }
    }
    for (queued, answer) in batch.into_iter().zip(answers) {
        // A check whose request went away is not waited for.
        let _ = queued.answer.send(answer.unwrap_or(Ok(None)));
    }
}
