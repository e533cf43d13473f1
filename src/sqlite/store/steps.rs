//! Step-by-step requests on the SQLite store ([`StepStore`]): tables `idempotency_progress`
//! and `idempotency_steps` in the same file as the records. Every call is one `BEGIN
//! IMMEDIATE` transaction on the writer ([`SqliteStore::write`]); a local step's closure runs
//! in it, on the writer thread.

use std::time::SystemTime;

use bytes::Bytes;
use rusqlite::{params, OptionalExtension, Transaction};

use super::records::{check_existing, insert_record};
use super::SqliteStore;
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::steps::{
    Acquired, Claim, Lease, Progress, ProgressStatus, Resolution, SavedRequest, SavedStep,
    StepKind, StepOutcome, StepRow, StepStore, Stored,
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
    PRIMARY KEY (tenant, operation, idempotency_key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idempotency_progress_idle ON idempotency_progress (status, updated_at);
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

/// Runs `f` in a write transaction of its own; an `Err` rolls back.
async fn write<T, F>(store: &SqliteStore, f: F) -> Result<T, Error>
where
    F: FnOnce(&Transaction<'_>) -> Result<T, Error> + Send + 'static,
    T: Send + 'static,
{
    store
        .write(move |tx| f(tx).map_err(carry))
        .await
        .map_err(unwrap_error)
}

/// Checks that the key is still under `lease`'s generation and moves its lease's end.
fn check_lease(tx: &Transaction<'_>, lease: &Lease) -> Result<(), Error> {
    let scope = &lease.scope;
    let changed = tx
        .prepare_cached(&format!(
            "UPDATE idempotency_progress SET lease_until = ?4, updated_at = ?5 \
             WHERE {KEY} AND generation = ?6 AND status = 'running'"
        ))?
        .execute(params![
            &*scope.tenant,
            &*scope.operation,
            scope.key.as_str(),
            to_unix_millis(lease.until),
            to_unix_millis(lease.now),
            lease.generation,
        ])?;
    if changed == 1 {
        Ok(())
    } else {
        Err(Error::LeaseLost)
    }
}

fn insert_step(tx: &Transaction<'_>, lease: &Lease, step: &StepRow) -> Result<(), Error> {
    let scope = &lease.scope;
    let now = to_unix_millis(lease.now);
    tx.prepare_cached(
        "INSERT INTO idempotency_steps (tenant, operation, idempotency_key, seq, name, kind, \
         result, created_at, updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?8) \
         ON CONFLICT (tenant, operation, idempotency_key, seq) DO UPDATE SET \
         result = excluded.result, updated_at = excluded.updated_at \
         WHERE idempotency_steps.result IS NULL",
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
            "SELECT fingerprint_version, fingerprint, status, lease_owner, lease_until, attempts \
             FROM idempotency_progress WHERE {KEY}"
        ))?
        .query_row(scope_params(scope), |row| {
            Ok((
                row.get::<_, i64>(0)?,
                row.get::<_, Vec<u8>>(1)?,
                row.get::<_, String>(2)?,
                row.get::<_, Option<String>>(3)?,
                row.get::<_, i64>(4)?,
                row.get::<_, i64>(5)?,
            ))
        })
        .optional()?;
    let Some((version, digest, status, owner, lease_until, attempts)) = row else {
        if let Some(record) = check_existing(tx, scope, now)? {
            return Ok(Acquired::Completed(record));
        }
        let Some(request) = &claim.request else {
            return Ok(Acquired::Gone);
        };
        tx.prepare_cached(
            "INSERT INTO idempotency_progress (tenant, operation, idempotency_key, fingerprint, \
             fingerprint_version, status, generation, lease_owner, lease_until, attempts, \
             method, uri, headers, body, created_at, updated_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, 'running', 1, ?6, ?7, 0, ?8, ?9, ?10, ?11, ?12, ?12)",
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
        ])?;
        return Ok(Acquired::Owned {
            generation: 1,
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
            tx.prepare_cached(&format!(
                "UPDATE idempotency_progress SET status = 'dead', lease_owner = NULL, \
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
             lease_owner = ?4, lease_until = ?5, attempts = attempts + ?6, updated_at = ?7 \
             WHERE {KEY} RETURNING generation"
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
            ],
            |row| row.get(0),
        )?;
    Ok(Acquired::Owned {
        generation,
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

fn list(
    conn: &rusqlite::Connection,
    status: ProgressStatus,
    idle_since: Option<SystemTime>,
    now: SystemTime,
    limit: usize,
) -> Result<Vec<Progress>, Error> {
    let idle = idle_since.is_some();
    let mut statement = conn.prepare_cached(
        "SELECT p.tenant, p.operation, p.idempotency_key, p.fingerprint_version, p.fingerprint, \
         p.status, p.generation, p.attempts, p.lease_until, p.last_error, p.method, p.uri, \
         p.headers, p.body, p.created_at, p.updated_at, \
         (SELECT count(*) FROM idempotency_steps AS s WHERE s.tenant = p.tenant \
          AND s.operation = p.operation AND s.idempotency_key = p.idempotency_key) \
         FROM idempotency_progress AS p WHERE p.status = ?1 \
         AND (?2 = 0 OR (p.lease_until <= ?3 AND p.updated_at <= ?4)) \
         ORDER BY p.updated_at LIMIT ?5",
    )?;
    let mut rows = statement.query(params![
        status.as_str(),
        idle,
        to_unix_millis(now),
        idle_since.map_or(0, to_unix_millis),
        i64::try_from(limit).unwrap_or(i64::MAX),
    ])?;
    let mut listed = Vec::new();
    while let Some(row) = rows.next()? {
        let key: String = row.get(2)?;
        let key = IdempotencyKey::parse(key.as_bytes(), usize::MAX)
            .map_err(|e| Error::Corrupt(format!("idempotency key: {e}")))?;
        let tenant: String = row.get(0)?;
        let operation: String = row.get(1)?;
        let version: i64 = row.get(3)?;
        let digest: Vec<u8> = row.get(4)?;
        let status: String = row.get(5)?;
        let attempts: i64 = row.get(7)?;
        let body: Vec<u8> = row.get(13)?;
        let steps: i64 = row.get(16)?;
        let mut progress = Progress::new(
            Scope::new(tenant, operation, key),
            fingerprint(version, &digest)?,
            ProgressStatus::parse(&status)?,
            SavedRequest::new(row.get(10)?, row.get(11)?, row.get(12)?, Bytes::from(body)),
        );
        progress.generation = row.get(6)?;
        progress.attempts = u32::try_from(attempts).unwrap_or(u32::MAX);
        progress.lease_until = from_unix_millis(row.get(8)?);
        progress.last_error = row.get(9)?;
        progress.created_at = from_unix_millis(row.get(14)?);
        progress.updated_at = from_unix_millis(row.get(15)?);
        progress.steps = u32::try_from(steps).unwrap_or(u32::MAX);
        listed.push(progress);
    }
    Ok(listed)
}

/// A SQLite local step's closure returns a `rusqlite::Result<T>`.
impl<T: Send + 'static> StepOutcome<SqliteStore> for rusqlite::Result<T> {
    type Value = T;

    fn into_resolved(self) -> rusqlite::Result<T> {
        self
    }
}

impl crate::steps::sealed::Sealed for SqliteStore {}

impl StepStore for SqliteStore {
    type Work<'a> = &'a Transaction<'a>;
    type Resolved<T: Send + 'static> = rusqlite::Result<T>;

    async fn install_steps(&self) -> Result<(), Error> {
        self.write(|tx| tx.execute_batch(SCHEMA)).await
    }

    async fn acquire(&self, claim: &Claim) -> Result<Acquired, Error> {
        let claim = claim.clone();
        write(self, move |tx| acquire(tx, &claim)).await
    }

    async fn save_step(&self, lease: &Lease, step: &StepRow) -> Result<(), Error> {
        let (lease, step) = (lease.clone(), step.clone());
        write(self, move |tx| {
            check_lease(tx, &lease)?;
            insert_step(tx, &lease, &step)
        })
        .await
    }

    async fn forget_intent(&self, lease: &Lease, seq: u32) -> Result<(), Error> {
        let lease = lease.clone();
        write(self, move |tx| {
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
        write(self, move |tx| {
            check_lease(tx, &lease)?;
            let value = work(tx).into_resolved()?;
            step.result = Some(encode(&value)?);
            insert_step(tx, &lease, &step)?;
            Ok(value)
        })
        .await
    }

    async fn release(&self, lease: &Lease) -> Result<(), Error> {
        let lease = lease.clone();
        write(self, move |tx| {
            let scope = &lease.scope;
            let deleted = tx
                .prepare_cached(&format!(
                    "DELETE FROM idempotency_progress WHERE {KEY} AND generation = ?4 \
                     AND status = 'running' AND NOT EXISTS (SELECT 1 FROM idempotency_steps \
                     AS s WHERE s.tenant = ?1 AND s.operation = ?2 AND s.idempotency_key = ?3)"
                ))?
                .execute(params![
                    &*scope.tenant,
                    &*scope.operation,
                    scope.key.as_str(),
                    lease.generation
                ])?;
            if deleted == 0 {
                let ended = tx
                    .prepare_cached(&format!(
                        "UPDATE idempotency_progress SET lease_owner = NULL, lease_until = ?5, \
                         updated_at = ?5 WHERE {KEY} AND generation = ?4"
                    ))?
                    .execute(params![
                        &*scope.tenant,
                        &*scope.operation,
                        scope.key.as_str(),
                        lease.generation,
                        to_unix_millis(lease.now),
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
        write(self, move |tx| {
            check_lease(tx, &lease)?;
            let scope = &lease.scope;
            tx.prepare_cached(&format!(
                "UPDATE idempotency_progress SET status = ?4, last_error = ?5, \
                 lease_owner = NULL, lease_until = ?6 WHERE {KEY}"
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
        write(self, move |tx| {
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

    async fn progress(
        &self,
        status: ProgressStatus,
        idle_since: Option<SystemTime>,
        now: SystemTime,
        limit: usize,
    ) -> Result<Vec<Progress>, Error> {
        self.read(move |conn| Ok(list(conn, status, idle_since, now, limit)))
            .await?
    }

    async fn resolve(
        &self,
        scope: &Scope,
        seq: Option<u32>,
        resolution: &Resolution,
        now: SystemTime,
    ) -> Result<bool, Error> {
        let (scope, resolution) = (scope.clone(), resolution.clone());
        write(self, move |tx| {
            if let Some(seq) = seq {
                let key = params![&*scope.tenant, &*scope.operation, scope.key.as_str(), seq];
                match &resolution {
                    Resolution::CallAgain => tx.execute(
                        &format!(
                            "DELETE FROM idempotency_steps WHERE {KEY} AND seq = ?4 \
                             AND result IS NULL"
                        ),
                        key,
                    )?,
                    Resolution::Done(value) => {
                        let result = Stored::Value(value.clone()).encode()?;
                        tx.execute(
                            &format!(
                                "UPDATE idempotency_steps SET result = ?5 WHERE {KEY} \
                                 AND seq = ?4 AND result IS NULL"
                            ),
                            params![
                                &*scope.tenant,
                                &*scope.operation,
                                scope.key.as_str(),
                                seq,
                                result
                            ],
                        )?
                    }
                };
            }
            let changed = tx.execute(
                &format!(
                    "UPDATE idempotency_progress SET status = 'running', attempts = 0, \
                     last_error = NULL, lease_owner = NULL, lease_until = ?4, updated_at = ?4 \
                     WHERE {KEY}"
                ),
                params![
                    &*scope.tenant,
                    &*scope.operation,
                    scope.key.as_str(),
                    to_unix_millis(now)
                ],
            )?;
            Ok(changed == 1)
        })
        .await
    }
}
