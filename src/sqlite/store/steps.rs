//! Step-by-step requests on the SQLite store ([`StepStore`]): tables `idempotency_progress`
//! and `idempotency_steps` in the same file as the records. Every call is one `BEGIN
//! IMMEDIATE` transaction on the writer ([`SqliteStore::write`]); a local step's closure runs
//! in it, on the writer thread. A call waits for the writer at most its lease's (or claim's)
//! `wait`, the layer's lock timeout: past it the call is dropped from the writer's queue before
//! it starts, and fails with [`Error::Busy`].

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use rusqlite::{params, OptionalExtension, Transaction};

use super::records::{check_existing, insert_record};
use super::SqliteStore;
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::steps::sealed::StepProtocol;
use crate::steps::{
    new_run_id, Acquired, Claim, Lease, Progress, ProgressCursor, ProgressPage, ProgressQuery,
    ProgressStatus, Resolution, SavedRequest, SavedStep, Settled, StepKind, StepOutcome, StepRow,
    StepStore, Stored,
};
use crate::store::{from_unix_millis, to_unix_millis, NewRecord, Scope};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS idempotency_progress (
    tenant              TEXT    NOT NULL,
    operation           TEXT    NOT NULL,
    idempotency_key     TEXT    NOT NULL,
    fingerprint         BLOB    NOT NULL,
    fingerprint_version INTEGER NOT NULL,
    status              TEXT    NOT NULL CHECK (status IN ('running', 'in_doubt', 'dead')),
    generation          INTEGER NOT NULL,
    lease_owner         TEXT,
    lease_until         INTEGER NOT NULL,
    attempts            INTEGER NOT NULL DEFAULT 0,
    last_error          TEXT,
    method              TEXT    NOT NULL,
    uri                 TEXT    NOT NULL,
    headers             TEXT    NOT NULL,
    body                BLOB    NOT NULL,
    created_at          INTEGER NOT NULL,
    updated_at          INTEGER NOT NULL,
    run_id              TEXT    NOT NULL,
    expires_at          INTEGER NOT NULL,
    PRIMARY KEY (tenant, operation, idempotency_key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idempotency_progress_idle ON idempotency_progress (status, updated_at);
CREATE INDEX IF NOT EXISTS idempotency_progress_expiry
    ON idempotency_progress (status, expires_at);
CREATE TABLE IF NOT EXISTS idempotency_steps (
    tenant          TEXT    NOT NULL,
    operation       TEXT    NOT NULL,
    idempotency_key TEXT    NOT NULL,
    seq             INTEGER NOT NULL,
    name            TEXT    NOT NULL,
    kind            TEXT    NOT NULL CHECK (kind IN ('local', 'foreign')),
    result          TEXT,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL,
    PRIMARY KEY (tenant, operation, idempotency_key, seq)
) WITHOUT ROWID;
";

const KEY: &str = "tenant = ?1 AND operation = ?2 AND idempotency_key = ?3";

/// A crate error carried through a `write` closure's `rusqlite::Result`, so that it rolls the
/// transaction back; [`unwrap_error`] takes it out again.
fn carry(error: Error) -> rusqlite::Error {
    rusqlite::Error::ToSqlConversionFailure(Box::new(error))
}

fn unwrap_error(error: Error) -> Error {
    match error {
        Error::Sqlite(rusqlite::Error::ToSqlConversionFailure(boxed)) => {
            match boxed.downcast::<Error>() {
                Ok(inner) => *inner,
                Err(other) => Error::Sqlite(rusqlite::Error::ToSqlConversionFailure(other)),
            }
        }
        other => other,
    }
}

/// A queued call's state: the writer starts it only if its caller still waits.
const QUEUED: u8 = 0;
const STARTED: u8 = 1;
const ABANDONED: u8 = 2;

/// Runs `f` in a write transaction of its own; an `Err` rolls back. Waits for the writer at
/// most `wait`: past it, a call the writer has not started is abandoned (it never runs) and
/// fails with [`Error::Busy`]; one already started runs to its end (its statements wait at
/// most SQLite's busy timeout; a local step's closure is the application's).
async fn write<T, F>(store: &SqliteStore, wait: Duration, f: F) -> Result<T, Error>
where
    F: FnOnce(&Transaction<'_>) -> Result<T, Error> + Send + 'static,
    T: Send + 'static,
{
    let state = Arc::new(AtomicU8::new(QUEUED));
    let start = state.clone();
    let call = store.write(move |tx| {
        if start
            .compare_exchange(QUEUED, STARTED, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(carry(Error::Busy));
        }
        f(tx).map_err(carry)
    });
    tokio::pin!(call);
    match tokio::time::timeout(wait, &mut call).await {
        Ok(done) => done.map_err(unwrap_error),
        Err(_elapsed) => {
            if state
                .compare_exchange(QUEUED, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Err(Error::Busy);
            }
            call.await.map_err(unwrap_error)
        }
    }
}

/// Checks that the key is still in `lease`'s life under its generation, and moves its
/// lease's end.
fn check_lease(tx: &Transaction<'_>, lease: &Lease) -> Result<(), Error> {
    let scope = &lease.scope;
    let changed = tx
        .prepare_cached(&format!(
            "UPDATE idempotency_progress SET lease_until = ?4, updated_at = ?5 \
             WHERE {KEY} AND generation = ?6 AND run_id = ?7 AND status = 'running'"
        ))?
        .execute(params![
            &*scope.tenant,
            &*scope.operation,
            scope.key.as_str(),
            to_unix_millis(lease.until),
            to_unix_millis(lease.now),
            lease.generation,
            lease.run,
        ])?;
    if changed == 1 {
        Ok(())
    } else {
        Err(Error::LeaseLost)
    }
}

/// Writes `step` (its intent, or its result) under the lease checked before: a new row, or
/// the result of the intent saved at its position. Refused with [`Error::StepsChanged`] when
/// the key saved another step there, or that step's result already; an intent written again
/// over its own intent changes nothing.
fn save_step_row(tx: &Transaction<'_>, lease: &Lease, step: &StepRow) -> Result<(), Error> {
    let saved = check_position(tx, &lease.scope, step)?;
    write_step(tx, lease, step, saved)
}

/// Writes `step` at its position, checked before (`saved`: its intent is there).
fn write_step(
    tx: &Transaction<'_>,
    lease: &Lease,
    step: &StepRow,
    saved: bool,
) -> Result<(), Error> {
    let scope = &lease.scope;
    let now = to_unix_millis(lease.now);
    if !saved {
        tx.prepare_cached(
            "INSERT INTO idempotency_steps (tenant, operation, idempotency_key, seq, name, kind, \
             result, created_at, updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?8)",
        )?
        .execute(params![
            &*scope.tenant,
            &*scope.operation,
            scope.key.as_str(),
            step.seq,
            step.name,
            step.kind.as_str(),
            step.result,
            now,
        ])?;
        return Ok(());
    }
    if let Some(result) = &step.result {
        tx.prepare_cached(&format!(
            "UPDATE idempotency_steps SET result = ?5, updated_at = ?6 \
             WHERE {KEY} AND seq = ?4 AND result IS NULL"
        ))?
        .execute(params![
            &*scope.tenant,
            &*scope.operation,
            scope.key.as_str(),
            step.seq,
            result,
            now,
        ])?;
    }
    Ok(())
}

fn scope_params(scope: &Scope) -> [&str; 3] {
    [&scope.tenant, &scope.operation, scope.key.as_str()]
}

fn read_steps(tx: &Transaction<'_>, scope: &Scope) -> Result<Vec<SavedStep>, Error> {
    let mut statement = tx.prepare_cached(&format!(
        "SELECT seq, name, kind, result FROM idempotency_steps WHERE {KEY} ORDER BY seq"
    ))?;
    let rows = statement.query_map(scope_params(scope), |row| {
        Ok((
            row.get::<_, u32>(0)?,
            row.get::<_, String>(1)?,
            row.get::<_, String>(2)?,
            row.get::<_, Option<String>>(3)?,
        ))
    })?;
    let mut steps = Vec::new();
    for row in rows {
        let (seq, name, kind, result) = row?;
        steps.push(SavedStep::new(seq, name, StepKind::parse(&kind)?, result));
    }
    Ok(steps)
}

fn acquire(tx: &Transaction<'_>, claim: &Claim) -> Result<Acquired, Error> {
    let scope = &claim.scope;
    let now = to_unix_millis(claim.now);
    let row = tx
        .prepare_cached(&format!(
            "SELECT fingerprint_version, fingerprint, status, lease_owner, lease_until, attempts, \
             run_id FROM idempotency_progress WHERE {KEY}"
        ))?
        .query_row(scope_params(scope), |row| {
            Ok((
                row.get::<_, i64>(0)?,
                row.get::<_, Vec<u8>>(1)?,
                row.get::<_, String>(2)?,
                row.get::<_, Option<String>>(3)?,
                row.get::<_, i64>(4)?,
                row.get::<_, i64>(5)?,
                row.get::<_, String>(6)?,
            ))
        })
        .optional()?;
    let Some((version, digest, status, owner, lease_until, attempts, run)) = row else {
        if let Some(record) = check_existing(tx, scope, now)? {
            return Ok(Acquired::Completed(record));
        }
        let Some(request) = &claim.request else {
            return Ok(Acquired::Gone);
        };
        // A new life of the key: a new run id, and nothing of an earlier life's steps.
        let run = new_run_id();
        tx.prepare_cached(&format!("DELETE FROM idempotency_steps WHERE {KEY}"))?
            .execute(scope_params(scope))?;
        tx.prepare_cached(
            "INSERT INTO idempotency_progress (tenant, operation, idempotency_key, fingerprint, \
             fingerprint_version, status, generation, lease_owner, lease_until, attempts, \
             method, uri, headers, body, created_at, updated_at, run_id, expires_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, 'running', 1, ?6, ?7, 0, ?8, ?9, ?10, ?11, ?12, ?12, \
             ?13, ?14)",
        )?
        .execute(params![
            &*scope.tenant,
            &*scope.operation,
            scope.key.as_str(),
            &claim.fingerprint.digest()[..],
            claim.fingerprint.version(),
            &*claim.owner,
            to_unix_millis(claim.lease_until),
            request.method,
            request.uri,
            request.headers,
            &request.body[..],
            now,
            run,
            to_unix_millis(claim.expires_at),
        ])?;
        return Ok(Acquired::Owned {
            generation: 1,
            run,
            steps: Vec::new(),
        });
    };
    if !fingerprint(version, &digest)?.matches(&claim.fingerprint) {
        return Ok(Acquired::Mismatch);
    }
    match ProgressStatus::parse(&status)? {
        ProgressStatus::InDoubt => return Ok(Acquired::InDoubt),
        ProgressStatus::Dead if claim.max_attempts.is_some() => return Ok(Acquired::Dead),
        ProgressStatus::Dead | ProgressStatus::Running => {}
    }
    if owner.is_some() && lease_until > now {
        return Ok(Acquired::Held {
            until: from_unix_millis(lease_until),
        });
    }
    let counted = i64::from(claim.max_attempts.is_some());
    if let Some(max) = claim.max_attempts {
        if attempts >= i64::from(max) {
            // A change of owner (to none): a new generation, so that nothing written under the
            // last one commits after it.
            tx.prepare_cached(&format!(
                "UPDATE idempotency_progress SET status = 'dead', lease_owner = NULL, \
                 generation = generation + 1, \
                 last_error = 'the completer ran out of attempts', updated_at = ?4 WHERE {KEY}"
            ))?
            .execute(params![
                &*scope.tenant,
                &*scope.operation,
                scope.key.as_str(),
                now
            ])?;
            return Ok(Acquired::Dead);
        }
    }
    let generation: i64 = tx
        .prepare_cached(&format!(
            "UPDATE idempotency_progress SET generation = generation + 1, status = 'running', \
             lease_owner = ?4, lease_until = ?5, attempts = attempts + ?6, updated_at = ?7, \
             expires_at = max(expires_at, ?8) WHERE {KEY} RETURNING generation"
        ))?
        .query_row(
            params![
                &*scope.tenant,
                &*scope.operation,
                scope.key.as_str(),
                &*claim.owner,
                to_unix_millis(claim.lease_until),
                counted,
                now,
                to_unix_millis(claim.expires_at),
            ],
            |row| row.get(0),
        )?;
    Ok(Acquired::Owned {
        generation,
        run,
        steps: read_steps(tx, scope)?,
    })
}

fn fingerprint(version: i64, digest: &[u8]) -> Result<Fingerprint, Error> {
    let version =
        u16::try_from(version).map_err(|_| Error::Corrupt("fingerprint version".into()))?;
    let digest: [u8; 32] = digest
        .try_into()
        .map_err(|_| Error::Corrupt("fingerprint length".into()))?;
    Ok(Fingerprint::new(version, digest))
}

/// A page of keys in progress (see [`StepStore::progress`]): ordered by their last change,
/// then their scope, after the query's cursor; an unreadable row is reported and skipped.
fn list(conn: &rusqlite::Connection, query: &ProgressQuery) -> Result<ProgressPage, Error> {
    let mut statement = conn.prepare_cached(
        "SELECT p.updated_at, p.tenant, p.operation, p.idempotency_key, p.fingerprint_version, \
         p.fingerprint, p.status, p.generation, p.attempts, p.lease_until, p.last_error, \
         p.method, p.uri, p.headers, p.body, p.created_at, p.run_id, \
         (SELECT count(*) FROM idempotency_steps AS s WHERE s.tenant = p.tenant \
          AND s.operation = p.operation AND s.idempotency_key = p.idempotency_key) \
         FROM idempotency_progress AS p WHERE p.status = ?1 \
         AND (?2 IS NULL OR p.operation = ?2) \
         AND (?3 = 0 OR (p.lease_until <= ?4 AND p.updated_at <= ?5)) \
         AND (p.updated_at, p.tenant, p.operation, p.idempotency_key) > (?6, ?7, ?8, ?9) \
         ORDER BY p.updated_at, p.tenant, p.operation, p.idempotency_key LIMIT ?10",
    )?;
    let after = query.after.as_ref();
    let mut rows = statement.query(params![
        query.status.as_str(),
        query.operation.as_deref(),
        query.idle_since.is_some(),
        to_unix_millis(query.now),
        query.idle_since.map_or(0, to_unix_millis),
        after.map_or(-1, |c| c.updated_at),
        after.map_or("", |c| c.tenant.as_str()),
        after.map_or("", |c| c.operation.as_str()),
        after.map_or("", |c| c.key.as_str()),
        i64::try_from(query.limit).unwrap_or(i64::MAX),
    ])?;
    let mut page = ProgressPage::default();
    let mut seen = 0;
    while let Some(row) = rows.next()? {
        seen += 1;
        let cursor = ProgressCursor {
            updated_at: row.get(0)?,
            tenant: lossy_text(row, 1)?,
            operation: lossy_text(row, 2)?,
            key: lossy_text(row, 3)?,
        };
        let read = progress_row(row, &cursor);
        page.add(cursor, read);
    }
    Ok(page.ended(seen, query.limit))
}

/// A text column as text, whatever was stored there.
fn lossy_text(row: &rusqlite::Row<'_>, index: usize) -> Result<String, Error> {
    Ok(match row.get_ref(index)? {
        rusqlite::types::ValueRef::Text(bytes) | rusqlite::types::ValueRef::Blob(bytes) => {
            String::from_utf8_lossy(bytes).into_owned()
        }
        other => format!("{other:?}"),
    })
}

/// A listed key in progress (the columns of [`list`]'s statement).
fn progress_row(row: &rusqlite::Row<'_>, cursor: &ProgressCursor) -> Result<Progress, Error> {
    // The key as stored: exactly what the layer scoped the record with.
    let key = IdempotencyKey::from_unquoted(&cursor.key)
        .map_err(|e| Error::Corrupt(format!("idempotency key: {e}")))?;
    let version: i64 = row.get(4)?;
    let digest: Vec<u8> = row.get(5)?;
    let status: String = row.get(6)?;
    let attempts: i64 = row.get(8)?;
    let body: Vec<u8> = row.get(14)?;
    let steps: i64 = row.get(17)?;
    let mut progress = Progress::new(
        Scope::new(cursor.tenant.clone(), cursor.operation.clone(), key),
        fingerprint(version, &digest)?,
        ProgressStatus::parse(&status)?,
        SavedRequest::new(row.get(11)?, row.get(12)?, row.get(13)?, Bytes::from(body)),
    );
    progress.generation = row.get(7)?;
    progress.attempts = u32::try_from(attempts).unwrap_or(u32::MAX);
    progress.lease_until = from_unix_millis(row.get(9)?);
    progress.last_error = row.get(10)?;
    progress.created_at = from_unix_millis(row.get(15)?);
    progress.updated_at = from_unix_millis(cursor.updated_at);
    progress.run = row.get(16)?;
    progress.steps = u32::try_from(steps).unwrap_or(u32::MAX);
    Ok(progress)
}

/// A SQLite local step's closure returns a `rusqlite::Result<T>`.
impl<T: Send + 'static> StepOutcome<SqliteStore> for rusqlite::Result<T> {
    type Value = T;

    fn into_resolved(self) -> rusqlite::Result<T> {
        self
    }
}

impl crate::steps::sealed::Sealed for SqliteStore {}

impl StepProtocol for SqliteStore {
    type Work<'a> = &'a Transaction<'a>;
    type Resolved<T: Send + 'static> = rusqlite::Result<T>;

    async fn acquire(&self, claim: &Claim) -> Result<Acquired, Error> {
        let claim = claim.clone();
        write(self, claim.wait, move |tx| acquire(tx, &claim)).await
    }

    async fn save_step(&self, lease: &Lease, step: &StepRow) -> Result<(), Error> {
        let (lease, step) = (lease.clone(), step.clone());
        write(self, lease.wait, move |tx| {
            check_lease(tx, &lease)?;
            save_step_row(tx, &lease, &step)
        })
        .await
    }

    async fn forget_intent(&self, lease: &Lease, seq: u32) -> Result<(), Error> {
        let lease = lease.clone();
        write(self, lease.wait, move |tx| {
            check_lease(tx, &lease)?;
            let scope = &lease.scope;
            tx.prepare_cached(&format!(
                "DELETE FROM idempotency_steps WHERE {KEY} AND seq = ?4 AND result IS NULL"
            ))?
            .execute(params![
                &*scope.tenant,
                &*scope.operation,
                scope.key.as_str(),
                seq
            ])?;
            Ok(())
        })
        .await
    }

    async fn run_local<F, R>(
        &self,
        lease: &Lease,
        step: &StepRow,
        work: F,
        encode: fn(&R::Value) -> Result<String, Error>,
    ) -> Result<R::Value, Error>
    where
        F: for<'a> FnOnce(&'a Transaction<'a>) -> R + Send + 'static,
        R: StepOutcome<Self>,
    {
        let (lease, mut step) = (lease.clone(), step.clone());
        write(self, lease.wait, move |tx| {
            check_lease(tx, &lease)?;
            // Checked before the work runs too: a step that differs from the saved one at its
            // position must not run at all.
            let mut intent = step.clone();
            intent.result = None;
            let saved = check_position(tx, &lease.scope, &intent)?;
            let value = work(tx).into_resolved()?;
            step.result = Some(encode(&value)?);
            write_step(tx, &lease, &step, saved)?;
            Ok(value)
        })
        .await
    }

    async fn release(&self, lease: &Lease) -> Result<(), Error> {
        let lease = lease.clone();
        write(self, lease.wait, move |tx| {
            let scope = &lease.scope;
            // One writer: no step commits while this runs, so one statement decides.
            let deleted = tx
                .prepare_cached(&format!(
                    "DELETE FROM idempotency_progress WHERE {KEY} AND generation = ?4 \
                     AND run_id = ?5 AND status = 'running' AND NOT EXISTS (SELECT 1 \
                     FROM idempotency_steps AS s WHERE s.tenant = ?1 AND s.operation = ?2 \
                     AND s.idempotency_key = ?3)"
                ))?
                .execute(params![
                    &*scope.tenant,
                    &*scope.operation,
                    scope.key.as_str(),
                    lease.generation,
                    lease.run,
                ])?;
            if deleted == 0 {
                let ended = tx
                    .prepare_cached(&format!(
                        "UPDATE idempotency_progress SET lease_owner = NULL, lease_until = ?5, \
                         updated_at = ?5 WHERE {KEY} AND generation = ?4 AND run_id = ?6 \
                         AND status = 'running'"
                    ))?
                    .execute(params![
                        &*scope.tenant,
                        &*scope.operation,
                        scope.key.as_str(),
                        lease.generation,
                        to_unix_millis(lease.now),
                        lease.run,
                    ])?;
                // Another claim took the key over (or it finished): not ours to let go.
                if ended == 0 {
                    return Err(Error::LeaseLost);
                }
            }
            Ok(())
        })
        .await
    }

    async fn set_status(
        &self,
        lease: &Lease,
        status: ProgressStatus,
        reason: &str,
    ) -> Result<(), Error> {
        let (lease, reason) = (lease.clone(), reason.to_owned());
        write(self, lease.wait, move |tx| {
            check_lease(tx, &lease)?;
            let scope = &lease.scope;
            // Out of the owner's hands: a new generation, so that nothing under the last one
            // commits after it.
            tx.prepare_cached(&format!(
                "UPDATE idempotency_progress SET status = ?4, last_error = ?5, \
                 lease_owner = NULL, lease_until = ?6, generation = generation + 1 WHERE {KEY}"
            ))?
            .execute(params![
                &*scope.tenant,
                &*scope.operation,
                scope.key.as_str(),
                status.as_str(),
                reason,
                to_unix_millis(lease.now),
            ])?;
            Ok(())
        })
        .await
    }

    async fn finish(&self, lease: &Lease, record: &NewRecord) -> Result<(), Error> {
        let (lease, record) = (lease.clone(), record.clone());
        write(self, lease.wait, move |tx| {
            check_lease(tx, &lease)?;
            let scope = &lease.scope;
            // An expired record of an earlier use of the key gives way.
            if check_existing(tx, scope, to_unix_millis(lease.now))?.is_some() {
                return Err(Error::Corrupt(
                    "a live record exists for a key in progress".into(),
                ));
            }
            insert_record(tx, scope, &record)?;
            for table in ["idempotency_steps", "idempotency_progress"] {
                tx.execute(
                    &format!("DELETE FROM {table} WHERE {KEY}"),
                    scope_params(scope),
                )?;
            }
            Ok(())
        })
        .await
    }
}

impl StepStore for SqliteStore {
    async fn install_steps(&self) -> Result<(), Error> {
        self.write(|tx| tx.execute_batch(SCHEMA)).await
    }

    async fn progress(&self, query: &ProgressQuery) -> Result<ProgressPage, Error> {
        let query = query.clone();
        self.read(move |conn| Ok(list(conn, &query))).await?
    }

    async fn resolve(
        &self,
        scope: &Scope,
        seq: Option<u32>,
        resolution: &Resolution,
        now: SystemTime,
    ) -> Result<Settled, Error> {
        let (scope, resolution) = (scope.clone(), resolution.clone());
        let result = match &resolution {
            Resolution::CallAgain => None,
            Resolution::Done(value) => Some(Stored::Value(value.clone()).encode()?),
        };
        write(self, crate::steps::ADMIN_WAIT, move |tx| {
            let status: Option<String> = tx
                .prepare_cached(&format!(
                    "SELECT status FROM idempotency_progress WHERE {KEY}"
                ))?
                .query_row(scope_params(&scope), |row| row.get(0))
                .optional()?;
            let Some(status) = status else {
                return Ok(Settled::NotFound);
            };
            if ProgressStatus::parse(&status)? == ProgressStatus::Running {
                return Ok(Settled::Running);
            }
            if let Some(seq) = seq {
                let key = params![&*scope.tenant, &*scope.operation, scope.key.as_str(), seq];
                let changed = match &result {
                    None => tx.execute(
                        &format!(
                            "DELETE FROM idempotency_steps WHERE {KEY} AND seq = ?4 \
                             AND result IS NULL AND kind = 'foreign'"
                        ),
                        key,
                    )?,
                    Some(result) => tx.execute(
                        &format!(
                            "UPDATE idempotency_steps SET result = ?5 WHERE {KEY} \
                             AND seq = ?4 AND result IS NULL AND kind = 'foreign'"
                        ),
                        params![
                            &*scope.tenant,
                            &*scope.operation,
                            scope.key.as_str(),
                            seq,
                            result
                        ],
                    )?,
                };
                if changed == 0 {
                    return Ok(Settled::NoIntent);
                }
            }
            tx.execute(
                &format!(
                    "UPDATE idempotency_progress SET status = 'running', attempts = 0, \
                     last_error = NULL, lease_owner = NULL, lease_until = ?4, updated_at = ?4, \
                     generation = generation + 1 WHERE {KEY}"
                ),
                params![
                    &*scope.tenant,
                    &*scope.operation,
                    scope.key.as_str(),
                    to_unix_millis(now)
                ],
            )?;
            Ok(Settled::Resolved)
        })
        .await
    }

    async fn purge_progress(&self, now: SystemTime, batch: usize) -> Result<u64, Error> {
        write(self, crate::steps::ADMIN_WAIT, move |tx| {
            let installed: bool = tx
                .prepare_cached(
                    "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' \
                     AND name = 'idempotency_progress')",
                )?
                .query_row([], |row| row.get(0))?;
            if !installed {
                return Ok(0);
            }
            let now = to_unix_millis(now);
            let expired = {
                let mut statement = tx.prepare_cached(
                    "SELECT tenant, operation, idempotency_key FROM idempotency_progress \
                     WHERE status = 'running' AND expires_at <= ?1 AND lease_until <= ?1 \
                     LIMIT ?2",
                )?;
                let rows = statement.query_map(
                    params![now, i64::try_from(batch).unwrap_or(i64::MAX)],
                    |row| {
                        Ok((
                            row.get::<_, rusqlite::types::Value>(0)?,
                            row.get::<_, rusqlite::types::Value>(1)?,
                            row.get::<_, rusqlite::types::Value>(2)?,
                        ))
                    },
                )?;
                rows.collect::<Result<Vec<_>, _>>()?
            };
            for (tenant, operation, key) in &expired {
                let scope = params![tenant, operation, key];
                let foreign: bool = tx
                    .prepare_cached(&format!(
                        "SELECT EXISTS (SELECT 1 FROM idempotency_steps WHERE {KEY} \
                         AND kind = 'foreign')"
                    ))?
                    .query_row(scope, |row| row.get(0))?;
                if foreign {
                    // Money may have been taken for an order never answered: never forgotten.
                    tx.prepare_cached(&format!(
                        "UPDATE idempotency_progress SET status = 'dead', lease_owner = NULL, \
                         generation = generation + 1, updated_at = ?4, last_error = \
                         'expired with a foreign step: money may have been taken; settle it' \
                         WHERE {KEY}"
                    ))?
                    .execute(params![tenant, operation, key, now])?;
                    continue;
                }
                for table in ["idempotency_steps", "idempotency_progress"] {
                    tx.execute(&format!("DELETE FROM {table} WHERE {KEY}"), scope)?;
                }
            }
            Ok(expired.len() as u64)
        })
        .await
    }
}

/// Checks `step` against the step saved at its position, if any (see `check_saved_step`):
/// whether one is saved there (its intent).
fn check_position(tx: &Transaction<'_>, scope: &Scope, step: &StepRow) -> Result<bool, Error> {
    let saved = tx
        .prepare_cached(&format!(
            "SELECT name, kind, result IS NOT NULL FROM idempotency_steps \
             WHERE {KEY} AND seq = ?4"
        ))?
        .query_row(
            params![
                &*scope.tenant,
                &*scope.operation,
                scope.key.as_str(),
                step.seq
            ],
            |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, String>(1)?,
                    row.get::<_, bool>(2)?,
                ))
            },
        )
        .optional()?;
    match saved {
        Some((name, kind, done)) => {
            crate::steps::check_saved_step(step, &name, &kind, done).map(|()| true)
        }
        None => Ok(false),
    }
}
