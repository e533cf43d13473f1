//! Step-by-step requests ([`StepStore`]) on the SQL servers, written once for every driver: the
//! statements of the server's SQL module (`postgres/steps_sql.rs`, `mysql/steps_sql.rs`, both
//! over `steps_sql.rs` here), run through [`PgTransactions`] (tokio-postgres'
//! [`PostgresStore`], sqlx' [`SqlxPostgresStore`] and [`SqlxMySqlStore`] implement it). The
//! semantics are those of the SQLite store's.
//!
//! Every call is one transaction of the store's own ([`PgTransactions::in_own_transaction`],
//! at the store's isolation level) whose lock waits are bounded (`BOUND_LOCK_WAIT`: past it the
//! call fails with an error [`Error::is_busy`] is true of). Every write under a lease first
//! runs [`CHECK_LEASE`], and fails with [`Error::LeaseLost`] (rolling back) when it changes no
//! row. A claim locks the key's progress row (`SELECT ... FOR UPDATE`) before it decides, and
//! checks the key's record after locking (or inserting) it, so that a concurrent `finish`
//! cannot slip between.
//!
//! [`PostgresStore`]: crate::store::tokio_postgres::PostgresStore
//! [`SqlxPostgresStore`]: crate::store::sqlx_postgres::SqlxPostgresStore
//! [`SqlxMySqlStore`]: crate::store::sqlx_mysql::SqlxMySqlStore

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures_util::future::BoxFuture;

use super::steps_sql::{
    CHECK_LEASE, DELETE_IF_NO_STEPS, DELETE_PROGRESS, DELETE_STALE_RECORD, DELETE_STEPS, END_LEASE,
    FORGET_INTENT, INSERT_RECORD, MARK_DEAD, RESUME, SELECT_PROGRESS, SELECT_RECORD, SELECT_STEPS,
    SETTLE_INTENT, SET_STATUS, TAKE_KEY,
};
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
#[cfg(feature = "sqlx-mysql")]
use crate::mysql::steps_sql as mysql_sql;
#[cfg(any(feature = "tokio-postgres", feature = "sqlx-postgres"))]
use crate::postgres::steps_sql as pg_sql;
use crate::response::SavedResponse;
use crate::row::Columns;
use crate::row_lock::driver::{Finish, PgDriver, PgHandle, PgParam, PgTransactions};
use crate::row_lock::reserve::retry_conflicts;
use crate::steps::{
    Acquired, Claim, Lease, Progress, ProgressStatus, Resolution, SavedRequest, SavedStep,
    StepKind, StepOutcome, StepRow, StepStore, Stored,
};
use crate::store::record_row::live_record;
use crate::store::{from_unix_millis, to_unix_millis, NewRecord, Scope, StoredRecord};

/// The statements that differ between the servers (from the server's SQL module).
pub(crate) struct Dialect {
    /// The tables, `CREATE ... IF NOT EXISTS`.
    pub(crate) schema: &'static str,
    /// The advisory lock `install_steps` takes.
    pub(crate) install_lock: i64,
    /// Bounds the lock waits of the transaction.
    pub(crate) bound_lock_wait: &'static str,
    /// Adds a new key's progress unless it has one.
    pub(crate) insert_progress: &'static str,
    /// Saves a step (an intent or a result).
    pub(crate) upsert_step: &'static str,
    /// The keys in progress with a status.
    pub(crate) list_progress: &'static str,
    /// The idle running keys.
    pub(crate) list_idle_progress: &'static str,
    /// Refuses a scope that does not fit the tables.
    pub(crate) check_scope: fn(&Scope) -> Result<(), Error>,
}

/// What a local step's closure returns, boxed.
pub(crate) type BoxedWork<T> = Pin<Box<dyn Future<Output = Result<T, Error>> + Send>>;

/// The key's parameters, `$1` to `$3`.
fn key(scope: &Scope) -> [PgParam<'_>; 3] {
    [
        PgParam::Text(&scope.tenant),
        PgParam::Text(&scope.operation),
        PgParam::Text(scope.key.as_str()),
    ]
}

/// The key's parameters followed by `rest` (`$4` on).
fn with_key<'a>(scope: &'a Scope, rest: &[PgParam<'a>]) -> Vec<PgParam<'a>> {
    let mut params = key(scope).to_vec();
    params.extend_from_slice(rest);
    params
}

/// A step's position as an `INTEGER`.
fn seq_param(seq: u32) -> Result<PgParam<'static>, Error> {
    i32::try_from(seq)
        .map(PgParam::Int)
        .map_err(|_| Error::Corrupt(format!("step position {seq} out of range")))
}

/// A count or a position read back, saturating.
fn count(value: i64) -> u32 {
    u32::try_from(value.max(0)).unwrap_or(u32::MAX)
}

/// Bounds the lock waits of the transaction of `tx` (the first statement of each).
async fn bound_lock_wait<H: PgHandle>(tx: &H, dialect: &Dialect) -> Result<(), Error> {
    tx.execute_in(dialect.bound_lock_wait, &[]).await?;
    Ok(())
}

/// Checks that the key is still under `lease`'s generation and moves its lease's end.
async fn check_lease<H: PgHandle>(tx: &H, lease: &Lease) -> Result<(), Error> {
    let params = with_key(
        &lease.scope,
        &[
            to_unix_millis(lease.until).into(),
            to_unix_millis(lease.now).into(),
            lease.generation.into(),
        ],
    );
    match tx.execute_in(CHECK_LEASE, &params).await? {
        0 => Err(Error::LeaseLost),
        _ => Ok(()),
    }
}

/// Writes `step` (its intent, or its result) under the lease checked before.
async fn upsert_step<H: PgHandle>(
    tx: &H,
    dialect: &Dialect,
    lease: &Lease,
    step: &StepRow,
) -> Result<(), Error> {
    let params = with_key(
        &lease.scope,
        &[
            seq_param(step.seq)?,
            step.name.as_str().into(),
            step.kind.as_str().into(),
            PgParam::OptionalText(step.result.as_deref()),
            to_unix_millis(lease.now).into(),
        ],
    );
    tx.execute_in(dialect.upsert_step, &params).await?;
    Ok(())
}

/// The key's live record at `now` (locked), if it has one.
async fn live<H: PgHandle>(tx: &H, scope: &Scope, now: i64) -> Result<Option<StoredRecord>, Error> {
    match tx.fetch_in(SELECT_RECORD, &key(scope)).await?.first() {
        Some(row) => live_record(row, now),
        None => Ok(None),
    }
}

/// The key's steps, in order.
async fn read_steps<H: PgHandle>(tx: &H, scope: &Scope) -> Result<Vec<SavedStep>, Error> {
    let rows = tx.fetch_in(SELECT_STEPS, &key(scope)).await?;
    rows.iter()
        .map(|row| {
            Ok(SavedStep::new(
                count(row.required_int(0, "step seq")?),
                row.required_text(1, "step name")?,
                StepKind::parse(&row.required_text(2, "step kind")?)?,
                row.text(3)?,
            ))
        })
        .collect()
}

fn fingerprint(version: i64, digest: &[u8]) -> Result<Fingerprint, Error> {
    let version =
        u16::try_from(version).map_err(|_| Error::Corrupt("fingerprint version".into()))?;
    let digest: [u8; 32] = digest
        .try_into()
        .map_err(|_| Error::Corrupt("fingerprint length".into()))?;
    Ok(Fingerprint::new(version, digest))
}

pub(crate) async fn install<S: PgDriver>(store: &S, dialect: &Dialect) -> Result<(), Error> {
    store
        .install_tables(dialect.install_lock, dialect.schema)
        .await
}

/// How many times a claim runs again after a deadlock or a serialization failure.
const CLAIM_RETRIES: u32 = 8;
/// How long a claim may spend on those retries before it answers busy.
const CLAIM_RETRY_WINDOW: Duration = Duration::from_secs(3);

pub(crate) fn acquire<'a, S>(
    store: &'a S,
    dialect: &'a Dialect,
    claim: &'a Claim,
) -> BoxFuture<'a, Result<Acquired, Error>>
where
    S: PgTransactions,
{
    Box::pin(async move {
        (dialect.check_scope)(&claim.scope)?;
        // Concurrent first claims of a key may deadlock on MySQL (each one's read locks the
        // gap the key's row goes into, then each inserts there): the database rolls one back,
        // and it claims again, as a reservation does.
        let deadline = tokio::time::Instant::now() + CLAIM_RETRY_WINDOW;
        retry_conflicts(CLAIM_RETRIES, deadline, || {
            store.in_own_transaction(|tx| async move {
                bound_lock_wait(&tx, dialect).await?;
                let scope = &claim.scope;
                let now = to_unix_millis(claim.now);
                // A new key's row is added, unless a concurrent claim added it first: then it
                // is read again (a few times, should it come and go meanwhile).
                for _ in 0..3 {
                    let rows = tx.fetch_in(SELECT_PROGRESS, &key(scope)).await?;
                    let Some(row) = rows.first() else {
                        let Some(request) = &claim.request else {
                            let found = live(&tx, scope, now).await?;
                            return Ok((
                                found.map_or(Acquired::Gone, Acquired::Completed),
                                Finish::Commit,
                            ));
                        };
                        let params = with_key(
                            scope,
                            &[
                                PgParam::Bytes(&claim.fingerprint.digest()[..]),
                                PgParam::Int(i32::from(claim.fingerprint.version())),
                                PgParam::Text(&claim.owner),
                                to_unix_millis(claim.lease_until).into(),
                                request.method.as_str().into(),
                                request.uri.as_str().into(),
                                request.headers.as_str().into(),
                                PgParam::Bytes(&request.body),
                                now.into(),
                            ],
                        );
                        if tx.execute_in(dialect.insert_progress, &params).await? == 0 {
                            // A concurrent claim added it first: read it.
                            continue;
                        }
                        // Checked once the key's row is this transaction's: a record committed
                        // before is seen here, and a `finish` cannot commit one meanwhile.
                        if let Some(record) = live(&tx, scope, now).await? {
                            return Ok((Acquired::Completed(record), Finish::Rollback));
                        }
                        let owned = Acquired::Owned {
                            generation: 1,
                            steps: Vec::new(),
                        };
                        return Ok((owned, Finish::Commit));
                    };
                    let owner = row.text(3)?;
                    let saved = fingerprint(
                        row.required_int(0, "fingerprint version")?,
                        &row.required_bytes(1, "fingerprint")?,
                    )?;
                    if !saved.matches(&claim.fingerprint) {
                        return Ok((Acquired::Mismatch, Finish::Commit));
                    }
                    match ProgressStatus::parse(&row.required_text(2, "progress status")?)? {
                        ProgressStatus::InDoubt => return Ok((Acquired::InDoubt, Finish::Commit)),
                        ProgressStatus::Dead if claim.max_attempts.is_some() => {
                            return Ok((Acquired::Dead, Finish::Commit))
                        }
                        ProgressStatus::Dead | ProgressStatus::Running => {}
                    }
                    let lease_until = row.required_big_int(4, "lease end")?;
                    if owner.is_some() && lease_until > now {
                        let held = Acquired::Held {
                            until: from_unix_millis(lease_until),
                        };
                        return Ok((held, Finish::Commit));
                    }
                    let attempts = row.required_int(5, "attempts")?;
                    let generation = row.required_big_int(6, "generation")?;
                    if let Some(max) = claim.max_attempts {
                        if attempts >= i64::from(max) {
                            tx.execute_in(MARK_DEAD, &with_key(scope, &[now.into()]))
                                .await?;
                            return Ok((Acquired::Dead, Finish::Commit));
                        }
                    }
                    let counted = PgParam::Int(i32::from(claim.max_attempts.is_some()));
                    let params = with_key(
                        scope,
                        &[
                            PgParam::Text(&claim.owner),
                            to_unix_millis(claim.lease_until).into(),
                            counted,
                            now.into(),
                        ],
                    );
                    // The row is locked since the read: the generation goes up by exactly one.
                    tx.execute_in(TAKE_KEY, &params).await?;
                    let owned = Acquired::Owned {
                        generation: generation + 1,
                        steps: read_steps(&tx, scope).await?,
                    };
                    return Ok((owned, Finish::Commit));
                }
                // The key's row came and went between reads: another claim is busy with it.
                Err(Error::Busy)
            })
        })
        .await
    })
}

pub(crate) fn save_step<'a, S: PgTransactions>(
    store: &'a S,
    dialect: &'a Dialect,
    lease: &'a Lease,
    step: &'a StepRow,
) -> BoxFuture<'a, Result<(), Error>> {
    Box::pin(async move {
        store
            .in_own_transaction(|tx| async move {
                bound_lock_wait(&tx, dialect).await?;
                check_lease(&tx, lease).await?;
                upsert_step(&tx, dialect, lease, step).await?;
                Ok(((), Finish::Commit))
            })
            .await
    })
}

pub(crate) fn forget_intent<'a, S: PgTransactions>(
    store: &'a S,
    dialect: &'a Dialect,
    lease: &'a Lease,
    seq: u32,
) -> BoxFuture<'a, Result<(), Error>> {
    Box::pin(async move {
        store
            .in_own_transaction(|tx| async move {
                bound_lock_wait(&tx, dialect).await?;
                check_lease(&tx, lease).await?;
                tx.execute_in(FORGET_INTENT, &with_key(&lease.scope, &[seq_param(seq)?]))
                    .await?;
                Ok(((), Finish::Commit))
            })
            .await
    })
}

/// Runs `work` on the transaction's handle after the lease is checked, then saves `step` with
/// the JSON of its value; an error from either rolls everything back.
pub(crate) fn run_local<'a, S, T, W>(
    store: &'a S,
    dialect: &'a Dialect,
    lease: &'a Lease,
    step: &'a StepRow,
    work: W,
    encode: fn(&T) -> Result<String, Error>,
) -> BoxFuture<'a, Result<T, Error>>
where
    S: PgTransactions,
    S::Handle: Clone,
    T: Send + 'static,
    W: FnOnce(S::Handle) -> BoxedWork<T> + Send + 'a,
{
    Box::pin(async move {
        store
            .in_own_transaction(|tx| async move {
                bound_lock_wait(&tx, dialect).await?;
                check_lease(&tx, lease).await?;
                let value = work(tx.clone()).await?;
                let mut step = step.clone();
                step.result = Some(encode(&value)?);
                upsert_step(&tx, dialect, lease, &step).await?;
                Ok((value, Finish::Commit))
            })
            .await
    })
}

pub(crate) fn release<'a, S: PgTransactions>(
    store: &'a S,
    dialect: &'a Dialect,
    lease: &'a Lease,
) -> BoxFuture<'a, Result<(), Error>> {
    Box::pin(async move {
        store
            .in_own_transaction(|tx| async move {
                bound_lock_wait(&tx, dialect).await?;
                let scope = &lease.scope;
                let generation = PgParam::BigInt(lease.generation);
                if tx
                    .execute_in(DELETE_IF_NO_STEPS, &with_key(scope, &[generation]))
                    .await?
                    == 0
                {
                    let now = to_unix_millis(lease.now).into();
                    let ended = tx
                        .execute_in(END_LEASE, &with_key(scope, &[generation, now]))
                        .await?;
                    if ended == 0 {
                        return Err(Error::LeaseLost);
                    }
                }
                Ok(((), Finish::Commit))
            })
            .await
    })
}

pub(crate) fn set_status<'a, S: PgTransactions>(
    store: &'a S,
    dialect: &'a Dialect,
    lease: &'a Lease,
    status: ProgressStatus,
    reason: &'a str,
) -> BoxFuture<'a, Result<(), Error>> {
    Box::pin(async move {
        store
            .in_own_transaction(|tx| async move {
                bound_lock_wait(&tx, dialect).await?;
                check_lease(&tx, lease).await?;
                let params = with_key(
                    &lease.scope,
                    &[
                        status.as_str().into(),
                        reason.into(),
                        to_unix_millis(lease.now).into(),
                    ],
                );
                tx.execute_in(SET_STATUS, &params).await?;
                Ok(((), Finish::Commit))
            })
            .await
    })
}

pub(crate) fn finish<'a, S: PgTransactions>(
    store: &'a S,
    dialect: &'a Dialect,
    lease: &'a Lease,
    record: &'a NewRecord,
) -> BoxFuture<'a, Result<(), Error>> {
    Box::pin(async move {
        let response = &record.response;
        let headers = SavedResponse::encode_headers(&response.headers);
        let trailers = response
            .trailers
            .as_ref()
            .map(|t| SavedResponse::encode_headers(t));
        store
            .in_own_transaction(|tx| async move {
                bound_lock_wait(&tx, dialect).await?;
                check_lease(&tx, lease).await?;
                let scope = &lease.scope;
                let now = to_unix_millis(lease.now);
                // An expired record of an earlier use of the key (or a reservation left behind)
                // gives way; a live one is an error.
                tx.execute_in(DELETE_STALE_RECORD, &with_key(scope, &[now.into()]))
                    .await?;
                if !tx.fetch_in(SELECT_RECORD, &key(scope)).await?.is_empty() {
                    return Err(Error::Corrupt(
                        "a live record exists for a key in progress".into(),
                    ));
                }
                let params = with_key(
                    scope,
                    &[
                        PgParam::Bytes(&record.fingerprint.digest()[..]),
                        PgParam::Int(i32::from(record.fingerprint.version())),
                        PgParam::Int(i32::from(response.status.as_u16())),
                        headers.as_str().into(),
                        PgParam::Bytes(&response.body),
                        PgParam::OptionalText(trailers.as_deref()),
                        to_unix_millis(record.created_at).into(),
                        to_unix_millis(record.expires_at).into(),
                    ],
                );
                tx.execute_in(INSERT_RECORD, &params).await?;
                tx.execute_in(DELETE_STEPS, &key(scope)).await?;
                tx.execute_in(DELETE_PROGRESS, &key(scope)).await?;
                Ok(((), Finish::Commit))
            })
            .await
    })
}

pub(crate) async fn progress<S: PgDriver>(
    store: &S,
    dialect: &Dialect,
    status: ProgressStatus,
    idle_since: Option<SystemTime>,
    now: SystemTime,
    limit: usize,
) -> Result<Vec<Progress>, Error> {
    let limit = PgParam::BigInt(i64::try_from(limit).unwrap_or(i64::MAX));
    let rows = match idle_since {
        None => {
            let params = [status.as_str().into(), limit];
            store.fetch_rows(dialect.list_progress, &params).await?
        }
        Some(since) => {
            let params = [
                status.as_str().into(),
                to_unix_millis(now).into(),
                to_unix_millis(since).into(),
                limit,
            ];
            store
                .fetch_rows(dialect.list_idle_progress, &params)
                .await?
        }
    };
    rows.iter().map(progress_row).collect()
}

/// A listed key in progress (the columns of `progress_columns!` after the scope's).
fn progress_row(row: &impl Columns<Error = Error>) -> Result<Progress, Error> {
    let key = row.required_text(2, "idempotency key")?;
    let key = IdempotencyKey::parse(key.as_bytes(), usize::MAX)
        .map_err(|e| Error::Corrupt(format!("idempotency key: {e}")))?;
    let scope = Scope::new(
        row.required_text(0, "tenant")?,
        row.required_text(1, "operation")?,
        key,
    );
    let request = SavedRequest::new(
        row.required_text(10, "method")?,
        row.required_text(11, "uri")?,
        row.required_text(12, "headers")?,
        Bytes::from(row.required_bytes(13, "body")?),
    );
    let mut progress = Progress::new(
        scope,
        fingerprint(
            row.required_int(3, "fingerprint version")?,
            &row.required_bytes(4, "fingerprint")?,
        )?,
        ProgressStatus::parse(&row.required_text(5, "progress status")?)?,
        request,
    );
    progress.generation = row.required_big_int(6, "generation")?;
    progress.attempts = count(row.required_int(7, "attempts")?);
    progress.lease_until = from_unix_millis(row.required_big_int(8, "lease end")?);
    progress.last_error = row.text(9)?;
    progress.created_at = from_unix_millis(row.required_big_int(14, "created_at")?);
    progress.updated_at = from_unix_millis(row.required_big_int(15, "updated_at")?);
    progress.steps = count(row.required_big_int(16, "step count")?);
    Ok(progress)
}

pub(crate) fn resolve<'a, S: PgTransactions>(
    store: &'a S,
    dialect: &'a Dialect,
    scope: &'a Scope,
    seq: Option<u32>,
    resolution: &'a Resolution,
    now: SystemTime,
) -> BoxFuture<'a, Result<bool, Error>> {
    Box::pin(async move {
        (dialect.check_scope)(scope)?;
        let result = match resolution {
            Resolution::CallAgain => None,
            Resolution::Done(value) => Some(Stored::Value(value.clone()).encode()?),
        };
        store
            .in_own_transaction(|tx| async move {
                bound_lock_wait(&tx, dialect).await?;
                if let Some(seq) = seq {
                    let seq = seq_param(seq)?;
                    match &result {
                        None => {
                            tx.execute_in(FORGET_INTENT, &with_key(scope, &[seq]))
                                .await?
                        }
                        Some(result) => {
                            let params = with_key(scope, &[seq, result.as_str().into()]);
                            tx.execute_in(SETTLE_INTENT, &params).await?
                        }
                    };
                }
                let now = to_unix_millis(now).into();
                let changed = tx.execute_in(RESUME, &with_key(scope, &[now])).await?;
                Ok((changed == 1, Finish::Commit))
            })
            .await
    })
}

/// [`StepStore`] on a store and its transaction handle, with the statements of the server's
/// SQL module `$sql` (written once above; expanded for each driver below, as concrete impls,
/// so that the driver traits stay private).
macro_rules! sql_steps {
    ($store:ty, $transaction:ty, $sql:ident) => {
        const _: () = {
            const DIALECT: Dialect = Dialect {
                schema: $sql::SCHEMA,
                install_lock: $sql::STEPS_INSTALL_LOCK,
                bound_lock_wait: $sql::BOUND_LOCK_WAIT,
                insert_progress: $sql::INSERT_PROGRESS,
                upsert_step: $sql::UPSERT_STEP,
                list_progress: $sql::LIST_PROGRESS,
                list_idle_progress: $sql::LIST_IDLE_PROGRESS,
                check_scope: $sql::check_scope,
            };

            /// A local step's closure on this store returns a future of `Result<T, Error>`,
            /// as an `async move` block does; it runs on the step's own transaction.
            impl<T, Fut> StepOutcome<$store> for Fut
            where
                T: Send + 'static,
                Fut: Future<Output = Result<T, Error>> + Send + 'static,
            {
                type Value = T;

                fn into_resolved(self) -> BoxedWork<T> {
                    Box::pin(self)
                }
            }

            impl crate::steps::sealed::Sealed for $store {}

            /// Transactions of the store's own, at its isolation level, their lock waits
            /// bounded to 5 seconds; a local step's closure gets the same handle a request's
            /// handler gets.
            impl StepStore for $store {
                type Work<'a> = $transaction;
                type Resolved<T: Send + 'static> = BoxedWork<T>;

                async fn install_steps(&self) -> Result<(), Error> {
                    install(self, &DIALECT).await
                }

                async fn acquire(&self, claim: &Claim) -> Result<Acquired, Error> {
                    acquire(self, &DIALECT, claim).await
                }

                async fn save_step(&self, lease: &Lease, step: &StepRow) -> Result<(), Error> {
                    save_step(self, &DIALECT, lease, step).await
                }

                async fn forget_intent(&self, lease: &Lease, seq: u32) -> Result<(), Error> {
                    forget_intent(self, &DIALECT, lease, seq).await
                }

                async fn run_local<F, R>(
                    &self,
                    lease: &Lease,
                    step: &StepRow,
                    work: F,
                    encode: fn(&R::Value) -> Result<String, Error>,
                ) -> Result<R::Value, Error>
                where
                    F: for<'a> FnOnce($transaction) -> R + Send + 'static,
                    R: StepOutcome<Self>,
                {
                    let work = move |tx: $transaction| work(tx).into_resolved();
                    run_local(self, &DIALECT, lease, step, work, encode).await
                }

                async fn release(&self, lease: &Lease) -> Result<(), Error> {
                    release(self, &DIALECT, lease).await
                }

                async fn set_status(
                    &self,
                    lease: &Lease,
                    status: ProgressStatus,
                    reason: &str,
                ) -> Result<(), Error> {
                    set_status(self, &DIALECT, lease, status, reason).await
                }

                async fn finish(&self, lease: &Lease, record: &NewRecord) -> Result<(), Error> {
                    finish(self, &DIALECT, lease, record).await
                }

                async fn progress(
                    &self,
                    status: ProgressStatus,
                    idle_since: Option<SystemTime>,
                    now: SystemTime,
                    limit: usize,
                ) -> Result<Vec<Progress>, Error> {
                    progress(self, &DIALECT, status, idle_since, now, limit).await
                }

                async fn resolve(
                    &self,
                    scope: &Scope,
                    seq: Option<u32>,
                    resolution: &Resolution,
                    now: SystemTime,
                ) -> Result<bool, Error> {
                    resolve(self, &DIALECT, scope, seq, resolution, now).await
                }
            }
        };
    };
}

#[cfg(feature = "tokio-postgres")]
sql_steps!(
    crate::store::tokio_postgres::PostgresStore,
    crate::store::tokio_postgres::PostgresHandle,
    pg_sql
);
#[cfg(feature = "sqlx-postgres")]
sql_steps!(
    crate::store::sqlx_postgres::SqlxPostgresStore,
    crate::store::sqlx_postgres::SqlxHandle,
    pg_sql
);
#[cfg(feature = "sqlx-mysql")]
sql_steps!(
    crate::store::sqlx_mysql::SqlxMySqlStore,
    crate::store::sqlx_mysql::SqlxHandle,
    mysql_sql
);
