//! Step-by-step requests ([`StepStore`]) on the SQL servers, written once for every driver: the
//! statements of the server's SQL module (`postgres/steps_sql.rs`, `mysql/steps_sql.rs`,
//! `sqlx/sqlite/steps_sql.rs`, each over `steps_sql.rs` here), run through [`SqlTransactions`]
//! (tokio-postgres' [`PostgresStore`], sqlx' [`SqlxPostgresStore`], [`SqlxMySqlStore`] and
//! [`SqlxSqliteStore`] implement it). The semantics are those of the SQLite store's.
//!
//! Every call is one transaction of the store's own ([`SqlTransactions::in_own_transaction`]):
//! at `READ COMMITTED`, but a local step's at the store's isolation level. One that the
//! database throws away (`40001`, `40P01`) runs again, but for a local step's, whose closure
//! runs once (the layer runs the handler again instead). Lock waits are bounded by the lease's
//! (or claim's) `wait`, the layer's lock timeout (`BOUND_LOCK_WAIT`: past it the call fails
//! with an error [`Error::is_busy`] is true of). Every write under a lease first runs
//! [`CHECK_LEASE`], and fails with [`Error::LeaseLost`] (rolling back) when it changes no row.
//! A claim locks the key's progress row (`SELECT ... FOR UPDATE`) before it decides, and checks
//! the key's record after locking (or inserting) it, so that a concurrent `finish` cannot slip
//! between.
//!
//! [`PostgresStore`]: crate::store::tokio_postgres::PostgresStore
//! [`SqlxPostgresStore`]: crate::store::sqlx_postgres::SqlxPostgresStore
//! [`SqlxMySqlStore`]: crate::store::sqlx_mysql::SqlxMySqlStore
//! [`SqlxSqliteStore`]: crate::store::sqlx_sqlite::SqlxSqliteStore

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures_util::future::BoxFuture;

use super::steps_sql::{
    ANY_STEP, CHECK_LEASE, DELETE_EXPIRED_PROGRESS, DELETE_PROGRESS, DELETE_RELEASED,
    DELETE_STALE_RECORD, DELETE_STEPS, DELETE_STEPS_OF_KEY, END_LEASE, FORGET_INTENT,
    INSERT_RECORD, INSERT_STEP, MARK_DEAD, MARK_EXPIRED_DEAD, RESUME, SELECT_PROGRESS,
    SELECT_RECORD, SELECT_STATUS, SELECT_STEPS, SELECT_STEP_AT, SETTLE_INTENT, SETTLE_STEP,
    SET_STATUS, TAKE_KEY,
};
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::response::SavedResponse;
use crate::row::Columns;
use crate::row_lock::driver::{Finish, Own, SqlDriver, SqlHandle, SqlParam, SqlTransactions};
use crate::row_lock::reserve::retry_conflicts;
use crate::steps::{
    check_saved_step, new_run_id, Acquired, Claim, Lease, Progress, ProgressCursor, ProgressPage,
    ProgressQuery, ProgressStatus, Resolution, SavedRequest, SavedStep, Settled, StepKind, StepRow,
    Stored,
};
use crate::store::record_row::live_record;
use crate::store::{from_unix_millis, to_unix_millis, NewRecord, Scope, StoredRecord};

/// The statements that differ between the servers (from the server's SQL module).
pub(crate) struct Dialect {
    /// The tables, `CREATE ... IF NOT EXISTS`.
    pub(crate) schema: &'static str,
    /// The advisory lock `install_steps` takes.
    pub(crate) install_lock: i64,
    /// Bounds the lock waits of the transaction to `$1`.
    pub(crate) bound_lock_wait: &'static str,
    /// `$1` of `bound_lock_wait` for a wait.
    pub(crate) wait_param: fn(Duration) -> i64,
    /// A row if the steps' tables exist.
    pub(crate) steps_installed: &'static str,
    /// Adds a new key's progress unless it has one.
    pub(crate) insert_progress: &'static str,
    /// A page of keys in progress.
    pub(crate) list_progress: &'static str,
    /// Keys whose progress expired.
    pub(crate) expired_progress: &'static str,
    /// Refuses a scope that does not fit the tables.
    pub(crate) check_scope: fn(&Scope) -> Result<(), Error>,
}

/// What a local step's closure returns, boxed.
pub(crate) type BoxedWork<T> = Pin<Box<dyn Future<Output = Result<T, Error>> + Send>>;

/// The key's parameters, `$1` to `$3`.
fn key(scope: &Scope) -> [SqlParam<'_>; 3] {
    [
        SqlParam::Text(&scope.tenant),
        SqlParam::Text(&scope.operation),
        SqlParam::Text(scope.key.as_str()),
    ]
}

/// The key's parameters followed by `rest` (`$4` on).
fn with_key<'a>(scope: &'a Scope, rest: &[SqlParam<'a>]) -> Vec<SqlParam<'a>> {
    let mut params = key(scope).to_vec();
    params.extend_from_slice(rest);
    params
}

/// A step's position as an `INTEGER`.
fn seq_param(seq: u32) -> Result<SqlParam<'static>, Error> {
    i32::try_from(seq)
        .map(SqlParam::Int)
        .map_err(|_| Error::Corrupt(format!("step position {seq} out of range")))
}

/// A count or a position read back, saturating.
fn count(value: i64) -> u32 {
    u32::try_from(value.max(0)).unwrap_or(u32::MAX)
}

/// Bounds the lock waits of the transaction of `tx` to `wait` (the first statement of each).
async fn bound_lock_wait<H: SqlHandle>(
    tx: &H,
    dialect: &Dialect,
    wait: Duration,
) -> Result<(), Error> {
    let wait = SqlParam::BigInt((dialect.wait_param)(wait));
    tx.execute_in(dialect.bound_lock_wait, &[wait]).await?;
    Ok(())
}

/// Checks that the key is still under `lease`'s generation and moves its lease's end.
async fn check_lease<H: SqlHandle>(tx: &H, lease: &Lease) -> Result<(), Error> {
    let params = with_key(
        &lease.scope,
        &[
            to_unix_millis(lease.until).into(),
            to_unix_millis(lease.now).into(),
            lease.generation.into(),
            lease.run.as_str().into(),
        ],
    );
    match tx.execute_in(CHECK_LEASE, &params).await? {
        0 => Err(Error::LeaseLost),
        _ => Ok(()),
    }
}

/// Checks `step` against the step saved at its position, if any (see `check_saved_step`):
/// whether one is saved there (its intent).
async fn check_position<H: SqlHandle>(
    tx: &H,
    lease: &Lease,
    step: &StepRow,
) -> Result<bool, Error> {
    let rows = tx
        .fetch_in(
            SELECT_STEP_AT,
            &with_key(&lease.scope, &[seq_param(step.seq)?]),
        )
        .await?;
    let Some(row) = rows.first() else {
        return Ok(false);
    };
    let name = row.required_text(0, "step name")?;
    let kind = row.required_text(1, "step kind")?;
    check_saved_step(step, &name, &kind, row.text(2)?.is_some())?;
    Ok(true)
}

/// Writes `step` (its intent, or its result) under the lease checked before: a new row, or the
/// result of the intent saved at its position; refused with [`Error::StepsChanged`] when the
/// key saved another step there, or that step's result already.
async fn save_step_row<H: SqlHandle>(tx: &H, lease: &Lease, step: &StepRow) -> Result<(), Error> {
    let saved = check_position(tx, lease, step).await?;
    write_step(tx, lease, step, saved).await
}

/// Writes `step` at its position, checked before (`saved`: its intent is there).
async fn write_step<H: SqlHandle>(
    tx: &H,
    lease: &Lease,
    step: &StepRow,
    saved: bool,
) -> Result<(), Error> {
    let now = to_unix_millis(lease.now);
    if !saved {
        let params = with_key(
            &lease.scope,
            &[
                seq_param(step.seq)?,
                step.name.as_str().into(),
                step.kind.as_str().into(),
                SqlParam::OptionalText(step.result.as_deref()),
                now.into(),
            ],
        );
        tx.execute_in(INSERT_STEP, &params).await?;
    } else if let Some(result) = &step.result {
        let params = with_key(
            &lease.scope,
            &[seq_param(step.seq)?, result.as_str().into(), now.into()],
        );
        tx.execute_in(SETTLE_STEP, &params).await?;
    }
    Ok(())
}

/// The key's live record at `now` (locked), if it has one.
async fn live<H: SqlHandle>(
    tx: &H,
    scope: &Scope,
    now: i64,
) -> Result<Option<StoredRecord>, Error> {
    match tx.fetch_in(SELECT_RECORD, &key(scope)).await?.first() {
        Some(row) => live_record(row, now),
        None => Ok(None),
    }
}

/// The key's steps, in order.
async fn read_steps<H: SqlHandle>(tx: &H, scope: &Scope) -> Result<Vec<SavedStep>, Error> {
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

pub(crate) async fn install<S: SqlDriver>(store: &S, dialect: &Dialect) -> Result<(), Error> {
    store
        .install_tables(dialect.install_lock, dialect.schema)
        .await
}

/// How many times a claim, or a commit of the store's own under a lease (a step's intent or
/// result, a release, a status, the final record: statements of the store's only, none of the
/// application's), runs again after a deadlock or a serialization failure (`SERIALIZABLE`
/// aborts them too).
const CLAIM_RETRIES: u32 = 8;
/// How long a claim may spend on those retries before it answers busy.
const CLAIM_RETRY_WINDOW: Duration = Duration::from_secs(3);

/// The deadline of a commit's retries under `lease`: its lock wait, at least.
fn retry_deadline(lease: &Lease) -> tokio::time::Instant {
    tokio::time::Instant::now() + lease.wait.max(Duration::from_millis(100))
}

pub(crate) fn acquire<'a, S>(
    store: &'a S,
    dialect: &'a Dialect,
    claim: &'a Claim,
) -> BoxFuture<'a, Result<Acquired, Error>>
where
    S: SqlTransactions,
{
    Box::pin(async move {
        (dialect.check_scope)(&claim.scope)?;
        // Concurrent first claims of a key may deadlock on MySQL (each one's read locks the
        // gap the key's row goes into, then each inserts there): the database rolls one back,
        // and it claims again, as a reservation does.
        let deadline = tokio::time::Instant::now() + CLAIM_RETRY_WINDOW;
        retry_conflicts(CLAIM_RETRIES, deadline, || {
            store.in_own_transaction(Own::Bookkeeping, |tx| async move {
                bound_lock_wait(&tx, dialect, claim.wait).await?;
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
                        // A new life of the key: a new run id.
                        let run = new_run_id();
                        let params = with_key(
                            scope,
                            &[
                                SqlParam::Bytes(&claim.fingerprint.digest()[..]),
                                SqlParam::Int(i32::from(claim.fingerprint.version())),
                                SqlParam::Text(&claim.owner),
                                to_unix_millis(claim.lease_until).into(),
                                request.method.as_str().into(),
                                request.uri.as_str().into(),
                                request.headers.as_str().into(),
                                SqlParam::Bytes(&request.body),
                                now.into(),
                                run.as_str().into(),
                                to_unix_millis(claim.expires_at).into(),
                            ],
                        );
                        if tx.execute_in(dialect.insert_progress, &params).await? == 0 {
                            // A concurrent claim added it first: read it.
                            continue;
                        }
                        // Nothing of an earlier life's steps (the new row is this
                        // transaction's: no step of this life can be written meanwhile).
                        tx.execute_in(DELETE_STEPS_OF_KEY, &key(scope)).await?;
                        // Checked once the key's row is this transaction's: a record committed
                        // before is seen here, and a `finish` cannot commit one meanwhile.
                        if let Some(record) = live(&tx, scope, now).await? {
                            return Ok((Acquired::Completed(record), Finish::Rollback));
                        }
                        let owned = Acquired::Owned {
                            generation: 1,
                            run,
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
                    let run = row.required_text(7, "run id")?;
                    if let Some(max) = claim.max_attempts {
                        if attempts >= i64::from(max) {
                            tx.execute_in(MARK_DEAD, &with_key(scope, &[now.into()]))
                                .await?;
                            return Ok((Acquired::Dead, Finish::Commit));
                        }
                    }
                    let counted = SqlParam::Int(i32::from(claim.max_attempts.is_some()));
                    let params = with_key(
                        scope,
                        &[
                            SqlParam::Text(&claim.owner),
                            to_unix_millis(claim.lease_until).into(),
                            counted,
                            now.into(),
                            to_unix_millis(claim.expires_at).into(),
                        ],
                    );
                    // The row is locked since the read: the generation goes up by exactly one.
                    tx.execute_in(TAKE_KEY, &params).await?;
                    let owned = Acquired::Owned {
                        generation: generation + 1,
                        run,
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

pub(crate) fn save_step<'a, S: SqlTransactions>(
    store: &'a S,
    dialect: &'a Dialect,
    lease: &'a Lease,
    step: &'a StepRow,
) -> BoxFuture<'a, Result<(), Error>> {
    Box::pin(async move {
        retry_conflicts(CLAIM_RETRIES, retry_deadline(lease), || {
            store.in_own_transaction(Own::Bookkeeping, |tx| async move {
                bound_lock_wait(&tx, dialect, lease.wait).await?;
                check_lease(&tx, lease).await?;
                save_step_row(&tx, lease, step).await?;
                Ok(((), Finish::Commit))
            })
        })
        .await
    })
}

pub(crate) fn forget_intent<'a, S: SqlTransactions>(
    store: &'a S,
    dialect: &'a Dialect,
    lease: &'a Lease,
    seq: u32,
) -> BoxFuture<'a, Result<(), Error>> {
    Box::pin(async move {
        retry_conflicts(CLAIM_RETRIES, retry_deadline(lease), || {
            store.in_own_transaction(Own::Bookkeeping, |tx| async move {
                bound_lock_wait(&tx, dialect, lease.wait).await?;
                check_lease(&tx, lease).await?;
                tx.execute_in(FORGET_INTENT, &with_key(&lease.scope, &[seq_param(seq)?]))
                    .await?;
                Ok(((), Finish::Commit))
            })
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
    S: SqlTransactions,
    S::Handle: Clone,
    T: Send + 'static,
    W: FnOnce(S::Handle) -> BoxedWork<T> + Send + 'a,
{
    Box::pin(async move {
        store
            .in_own_transaction(Own::Work, |tx| async move {
                bound_lock_wait(&tx, dialect, lease.wait).await?;
                check_lease(&tx, lease).await?;
                // A step that differs from the one saved at its position must not run at all.
                let mut intent = step.clone();
                intent.result = None;
                let saved = check_position(&tx, lease, &intent).await?;
                let value = work(tx.clone()).await?;
                let mut step = step.clone();
                step.result = Some(encode(&value)?);
                write_step(&tx, lease, &step, saved).await?;
                Ok((value, Finish::Commit))
            })
            .await
    })
}

pub(crate) fn release<'a, S: SqlTransactions>(
    store: &'a S,
    dialect: &'a Dialect,
    lease: &'a Lease,
) -> BoxFuture<'a, Result<(), Error>> {
    Box::pin(async move {
        retry_conflicts(CLAIM_RETRIES, retry_deadline(lease), || {
            store.in_own_transaction(Own::Bookkeeping, |tx| async move {
                bound_lock_wait(&tx, dialect, lease.wait).await?;
                let scope = &lease.scope;
                let generation = SqlParam::BigInt(lease.generation);
                // The key's row first: once it is locked no step of this generation can commit,
                // and the locking read below sees every step that did (a single statement's
                // `NOT EXISTS` would not see one that committed while it waited for the row).
                let now = to_unix_millis(lease.now).into();
                let run = SqlParam::Text(&lease.run);
                let ended = tx
                    .execute_in(END_LEASE, &with_key(scope, &[generation, now, run]))
                    .await?;
                if ended == 0 {
                    // Another claim took the key over (or it finished): not ours to let go.
                    return Err(Error::LeaseLost);
                }
                if tx.fetch_in(ANY_STEP, &key(scope)).await?.is_empty() {
                    tx.execute_in(DELETE_RELEASED, &with_key(scope, &[generation, run]))
                        .await?;
                }
                Ok(((), Finish::Commit))
            })
        })
        .await
    })
}

pub(crate) fn set_status<'a, S: SqlTransactions>(
    store: &'a S,
    dialect: &'a Dialect,
    lease: &'a Lease,
    status: ProgressStatus,
    reason: &'a str,
) -> BoxFuture<'a, Result<(), Error>> {
    Box::pin(async move {
        retry_conflicts(CLAIM_RETRIES, retry_deadline(lease), || {
            store.in_own_transaction(Own::Bookkeeping, |tx| async move {
                bound_lock_wait(&tx, dialect, lease.wait).await?;
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
        })
        .await
    })
}

pub(crate) fn finish<'a, S: SqlTransactions>(
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
        let (headers, trailers) = (&headers, &trailers);
        retry_conflicts(CLAIM_RETRIES, retry_deadline(lease), || {
            store.in_own_transaction(Own::Bookkeeping, |tx| async move {
                bound_lock_wait(&tx, dialect, lease.wait).await?;
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
                        SqlParam::Bytes(&record.fingerprint.digest()[..]),
                        SqlParam::Int(i32::from(record.fingerprint.version())),
                        SqlParam::Int(i32::from(response.status.as_u16())),
                        headers.as_str().into(),
                        SqlParam::Bytes(&response.body),
                        SqlParam::OptionalText(trailers.as_deref()),
                        to_unix_millis(record.created_at).into(),
                        to_unix_millis(record.expires_at).into(),
                    ],
                );
                tx.execute_in(INSERT_RECORD, &params).await?;
                tx.execute_in(DELETE_STEPS, &key(scope)).await?;
                tx.execute_in(DELETE_PROGRESS, &key(scope)).await?;
                Ok(((), Finish::Commit))
            })
        })
        .await
    })
}

pub(crate) async fn progress<S: SqlDriver>(
    store: &S,
    dialect: &Dialect,
    query: &ProgressQuery,
) -> Result<ProgressPage, Error> {
    let after = query.after.as_ref();
    let params = [
        query.status.as_str().into(),
        SqlParam::OptionalText(query.operation.as_deref()),
        SqlParam::Int(i32::from(query.idle_since.is_some())),
        to_unix_millis(query.now).into(),
        query.idle_since.map_or(0, to_unix_millis).into(),
        after.map_or(-1, |c| c.updated_at).into(),
        after.map_or("", |c| c.tenant.as_str()).into(),
        after.map_or("", |c| c.operation.as_str()).into(),
        after.map_or("", |c| c.key.as_str()).into(),
        SqlParam::BigInt(i64::try_from(query.limit).unwrap_or(i64::MAX)),
    ];
    let rows = store.fetch_rows(dialect.list_progress, &params).await?;
    let mut page = ProgressPage::default();
    for row in &rows {
        let cursor = ProgressCursor {
            updated_at: row.required_big_int(15, "updated_at")?,
            tenant: row.required_text(0, "tenant")?,
            operation: row.required_text(1, "operation")?,
            key: row.required_text(2, "idempotency key")?,
        };
        let read = progress_row(row, &cursor);
        page.add(cursor, read);
    }
    Ok(page.ended(rows.len(), query.limit))
}

/// A listed key in progress (the columns of `progress_columns!` after the scope's).
fn progress_row(
    row: &impl Columns<Error = Error>,
    cursor: &ProgressCursor,
) -> Result<Progress, Error> {
    // The key as stored: exactly what the layer scoped the record with.
    let key = IdempotencyKey::from_unquoted(&cursor.key)
        .map_err(|e| Error::Corrupt(format!("idempotency key: {e}")))?;
    let scope = Scope::new(cursor.tenant.clone(), cursor.operation.clone(), key);
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
    progress.updated_at = from_unix_millis(cursor.updated_at);
    progress.steps = count(row.required_big_int(16, "step count")?);
    progress.run = row.required_text(17, "run id")?;
    Ok(progress)
}

pub(crate) fn resolve<'a, S: SqlTransactions>(
    store: &'a S,
    dialect: &'a Dialect,
    scope: &'a Scope,
    seq: Option<u32>,
    resolution: &'a Resolution,
    now: SystemTime,
) -> BoxFuture<'a, Result<Settled, Error>> {
    Box::pin(async move {
        (dialect.check_scope)(scope)?;
        let result = match resolution {
            Resolution::CallAgain => None,
            Resolution::Done(value) => Some(Stored::Value(value.clone()).encode()?),
        };
        store
            .in_own_transaction(Own::Bookkeeping, |tx| async move {
                bound_lock_wait(&tx, dialect, crate::steps::ADMIN_WAIT).await?;
                let rows = tx.fetch_in(SELECT_STATUS, &key(scope)).await?;
                let Some(row) = rows.first() else {
                    return Ok((Settled::NotFound, Finish::Rollback));
                };
                let status = ProgressStatus::parse(&row.required_text(0, "progress status")?)?;
                if status == ProgressStatus::Running {
                    return Ok((Settled::Running, Finish::Rollback));
                }
                if let Some(seq) = seq {
                    let seq = seq_param(seq)?;
                    let settled = match &result {
                        None => {
                            tx.execute_in(FORGET_INTENT, &with_key(scope, &[seq]))
                                .await?
                        }
                        Some(result) => {
                            let params = with_key(scope, &[seq, result.as_str().into()]);
                            tx.execute_in(SETTLE_INTENT, &params).await?
                        }
                    };
                    if settled == 0 {
                        return Ok((Settled::NoIntent, Finish::Rollback));
                    }
                }
                let now = to_unix_millis(now).into();
                tx.execute_in(RESUME, &with_key(scope, &[now])).await?;
                Ok((Settled::Resolved, Finish::Commit))
            })
            .await
    })
}

pub(crate) fn purge_progress<'a, S: SqlTransactions>(
    store: &'a S,
    dialect: &'a Dialect,
    now: SystemTime,
    batch: usize,
) -> BoxFuture<'a, Result<u64, Error>> {
    Box::pin(async move {
        let now = to_unix_millis(now);
        store
            .in_own_transaction(Own::Bookkeeping, |tx| async move {
                bound_lock_wait(&tx, dialect, crate::steps::ADMIN_WAIT).await?;
                if tx.fetch_in(dialect.steps_installed, &[]).await?.is_empty() {
                    return Ok((0, Finish::Commit));
                }
                let limit = SqlParam::BigInt(i64::try_from(batch).unwrap_or(i64::MAX));
                let expired = tx
                    .fetch_in(dialect.expired_progress, &[now.into(), limit])
                    .await?
                    .iter()
                    .map(|row| {
                        Ok((
                            row.required_text(0, "tenant")?,
                            row.required_text(1, "operation")?,
                            row.required_text(2, "idempotency key")?,
                        ))
                    })
                    .collect::<Result<Vec<_>, Error>>()?;
                let mut purged = 0;
                for (tenant, operation, key) in &expired {
                    let scope = [
                        SqlParam::Text(tenant),
                        SqlParam::Text(operation),
                        SqlParam::Text(key),
                    ];
                    let mut params = scope.to_vec();
                    params.push(now.into());
                    // Checked again under the row's lock: a claim may have taken it meanwhile.
                    if tx.execute_in(DELETE_EXPIRED_PROGRESS, &params).await? == 1 {
                        tx.execute_in(DELETE_STEPS, &scope).await?;
                        purged += 1;
                    } else if tx.execute_in(MARK_EXPIRED_DEAD, &params).await? == 1 {
                        purged += 1;
                    }
                }
                Ok((purged, Finish::Commit))
            })
            .await
    })
}

/// [`StepStore`] on a store and its transaction handle, with the statements of the server's
/// SQL module `$sql` (written once above; expanded in each store's folder, as concrete impls,
/// so that the driver traits stay private).
macro_rules! sql_steps {
    ($store:ty, $transaction:ty, $sql:ident) => {
        const _: () = {
            use $crate::row_lock::steps::engine::*;

            const DIALECT: Dialect = Dialect {
                schema: $sql::SCHEMA,
                install_lock: $sql::STEPS_INSTALL_LOCK,
                bound_lock_wait: $sql::BOUND_LOCK_WAIT,
                wait_param: $sql::wait_param,
                steps_installed: $sql::STEPS_INSTALLED,
                insert_progress: $sql::INSERT_PROGRESS,
                list_progress: $sql::LIST_PROGRESS,
                expired_progress: $sql::EXPIRED_PROGRESS,
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
            impl StepProtocol for $store {
                type Work<'a> = $transaction;
                type Resolved<T: Send + 'static> = BoxedWork<T>;

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
            }

            impl StepStore for $store {
                async fn install_steps(&self) -> Result<(), Error> {
                    install(self, &DIALECT).await
                }

                async fn progress(&self, query: &ProgressQuery) -> Result<ProgressPage, Error> {
                    progress(self, &DIALECT, query).await
                }

                async fn resolve(
                    &self,
                    scope: &Scope,
                    seq: Option<u32>,
                    resolution: &Resolution,
                    now: SystemTime,
                ) -> Result<Settled, Error> {
                    resolve(self, &DIALECT, scope, seq, resolution, now).await
                }

                async fn purge_progress(
                    &self,
                    now: SystemTime,
                    batch: usize,
                ) -> Result<u64, Error> {
                    purge_progress(self, &DIALECT, now, batch).await
                }
            }
        };
    };
}

/// Each store invokes it in its folder (its `driver.rs`).
pub(crate) use sql_steps;

/// What [`sql_steps!`]'s expansion names: it imports them all, wherever it is invoked.
pub(crate) mod engine {
    pub(crate) use std::future::Future;
    pub(crate) use std::time::SystemTime;

    pub(crate) use super::{
        acquire, finish, forget_intent, install, progress, purge_progress, release, resolve,
        run_local, save_step, set_status, BoxedWork, Dialect,
    };
    pub(crate) use crate::error::Error;
    pub(crate) use crate::steps::sealed::StepProtocol;
    pub(crate) use crate::steps::{
        Acquired, Claim, Lease, ProgressPage, ProgressQuery, ProgressStatus, Resolution, Settled,
        StepOutcome, StepRow, StepStore,
    };
    pub(crate) use crate::store::{NewRecord, Scope};
}
