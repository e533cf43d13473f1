//! The records table: its schema, the statements that read, save and delete records, and
//! the reading of a row into a [`StoredRecord`] (checked by [`SavedColumns`]).
//!
//! Plain functions on a [`Connection`]: the writer runs them inside a request's savepoint
//! (`check_existing`, `insert_record`) or in a purge's transaction (`delete_expired`), the
//! reader connections run `read_record` (the fast path) and `scan_expired` (the purge's walk).

use bytes::Bytes;
use rusqlite::types::{Value, ValueRef};
use rusqlite::{params, Connection};

use crate::error::Error;
use crate::response::SavedResponse;
use crate::store::{to_unix_millis, NewRecord, SavedColumns, Scope, StoredRecord};

/// The records table, created when the store opens.
///
/// `WITHOUT ROWID`: the rows live in their primary key's B-tree, so a new key changes one
/// B-tree where a rowid table and its key index changed two (a page, so a WAL frame, each), and
/// a lookup descends one tree. A file created before keeps its rowid table: every statement
/// here names the key, none the rowid, so both work.
///
/// No index on `expires_at`: it would cost every new key a page of its own. The purge walks the
/// primary key instead (`scan_expired`), and `expires_at` comes right after the key, so the
/// walk reads it from the row's first bytes: a large body, which spills past the row's page
/// into overflow pages, is not read. A file created before (with `expires_at` after the body,
/// and the index `idempotency_records_expires_at`) keeps its table; every statement here names
/// its columns, none needs the index or is hindered by it.
pub(super) const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS idempotency_records (
    tenant              TEXT    NOT NULL,
    operation           TEXT    NOT NULL,
    idempotency_key     TEXT    NOT NULL,
    expires_at          INTEGER NOT NULL,
    created_at          INTEGER NOT NULL,
    fingerprint         BLOB    NOT NULL,
    fingerprint_version INTEGER NOT NULL,
    status              INTEGER NOT NULL,
    headers             TEXT    NOT NULL,
    body                BLOB    NOT NULL,
    trailers            TEXT,
    PRIMARY KEY (tenant, operation, idempotency_key)
) WITHOUT ROWID;
";

const SELECT_RECORD: &str = "SELECT fingerprint_version, fingerprint, status, headers, body, \
     trailers, created_at, expires_at FROM idempotency_records \
     WHERE tenant = ?1 AND operation = ?2 AND idempotency_key = ?3";

/// The record of `scope`, live or expired.
///
/// Decoded from the row in place: the digest, the headers and the trailers are read as borrowed
/// slices of SQLite's row, and only the body is copied out (into the record's `Bytes`).
pub(super) fn read_record(conn: &Connection, scope: &Scope) -> Result<Option<StoredRecord>, Error> {
    let mut statement = conn.prepare_cached(SELECT_RECORD)?;
    let mut rows = statement.query(params![
        &*scope.tenant,
        &*scope.operation,
        scope.key.as_str()
    ])?;
    let Some(row) = rows.next()? else {
        return Ok(None);
    };
    let blob = |index: usize| -> rusqlite::Result<&[u8]> { Ok(row.get_ref(index)?.as_blob()?) };
    let text = |index: usize| -> rusqlite::Result<&str> { Ok(row.get_ref(index)?.as_str()?) };
    let trailers = match row.get_ref(5)? {
        ValueRef::Null => None,
        _ => Some(text(5)?),
    };
    SavedColumns::decode(row.get(0)?, blob(1)?, row.get(2)?, text(3)?)?
        .into_record(
            Bytes::copy_from_slice(blob(4)?),
            trailers,
            row.get(6)?,
            row.get(7)?,
        )
        .map(Some)
}

/// Saves the idempotency record (in the request's savepoint).
pub(super) fn insert_record(
    conn: &Connection,
    scope: &Scope,
    record: &NewRecord,
) -> Result<(), Error> {
    let response = &record.response;
    conn.prepare_cached(
        "INSERT INTO idempotency_records (tenant, operation, idempotency_key, fingerprint, \
         fingerprint_version, status, headers, body, trailers, created_at, expires_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
    )?
    .execute(params![
        &*scope.tenant,
        &*scope.operation,
        scope.key.as_str(),
        &record.fingerprint.digest()[..],
        record.fingerprint.version(),
        response.status.as_u16(),
        SavedResponse::encode_headers(&response.headers),
        &response.body[..],
        response
            .trailers
            .as_ref()
            .map(|t| SavedResponse::encode_headers(t)),
        to_unix_millis(record.created_at),
        to_unix_millis(record.expires_at),
    ])?;
    Ok(())
}

/// The live record of `scope`, read on the writer inside the request's savepoint; an expired
/// one is deleted (in the savepoint) so that the key can be used again.
pub(super) fn check_existing(
    conn: &Connection,
    scope: &Scope,
    now_millis: i64,
) -> Result<Option<StoredRecord>, Error> {
    match read_record(conn, scope)? {
        Some(record) if to_unix_millis(record.expires_at) > now_millis => Ok(Some(record)),
        Some(_) => {
            conn.prepare_cached(
                "DELETE FROM idempotency_records WHERE tenant = ?1 \
                 AND operation = ?2 AND idempotency_key = ?3",
            )?
            .execute(params![
                &*scope.tenant,
                &*scope.operation,
                scope.key.as_str()
            ])?;
            Ok(None)
        }
        None => Ok(None),
    }
}

/// A record's primary key, `(tenant, operation, idempotency_key)`, as the purge's walk reads
/// it: the values as stored, to be bound again as they were read.
#[derive(Clone, Debug)]
pub(super) struct RecordKey([Value; 3]);

impl RecordKey {
    fn read(row: &rusqlite::Row<'_>) -> rusqlite::Result<Self> {
        Ok(RecordKey([row.get(0)?, row.get(1)?, row.get(2)?]))
    }
}

/// What [`scan_expired`] met along the primary key.
#[derive(Debug)]
pub(super) struct Scanned {
    /// The keys of the records expired at `now`, in key order.
    pub(super) expired: Vec<RecordKey>,
    /// The last key it looked at, where the walk goes on from; `None` once it reached the end.
    pub(super) last: Option<RecordKey>,
    /// Whether it reached the end of the table: no record after `last`.
    pub(super) at_end: bool,
}

pub(super) const SCAN_FROM_START: &str =
    "SELECT tenant, operation, idempotency_key, expires_at <= ?1 \
     FROM idempotency_records ORDER BY tenant, operation, idempotency_key LIMIT ?2";

pub(super) const SCAN_AFTER: &str = "SELECT tenant, operation, idempotency_key, expires_at <= ?1 \
     FROM idempotency_records WHERE (tenant, operation, idempotency_key) > (?3, ?4, ?5) \
     ORDER BY tenant, operation, idempotency_key LIMIT ?2";

/// Walks the records in primary-key order from the first after `after` (from the first of the
/// table without it), looking at `limit` of them at most, and gathers the keys of those
/// expired at `now_millis`, stopping at the `want`th. A range of the primary key's B-tree: no
/// other index is needed, and no write lock (a reader connection runs it).
pub(super) fn scan_expired(
    conn: &Connection,
    after: Option<&RecordKey>,
    now_millis: i64,
    want: usize,
    limit: usize,
) -> rusqlite::Result<Scanned> {
    let limit_sql = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut statement = conn.prepare_cached(match after {
        None => SCAN_FROM_START,
        Some(_) => SCAN_AFTER,
    })?;
    let mut rows = match after {
        None => statement.query(params![now_millis, limit_sql])?,
        Some(RecordKey([tenant, operation, key])) => {
            statement.query(params![now_millis, limit_sql, tenant, operation, key])?
        }
    };
    let mut expired = Vec::new();
    let mut looked_at = 0;
    let mut last = None;
    while let Some(row) = rows.next()? {
        looked_at += 1;
        let key = RecordKey::read(row)?;
        if row.get::<_, bool>(3)? {
            expired.push(key.clone());
            if expired.len() >= want {
                return Ok(Scanned {
                    expired,
                    last: Some(key),
                    at_end: false,
                });
            }
        }
        last = Some(key);
    }
    let at_end = looked_at < limit;
    Ok(Scanned {
        expired,
        last: if at_end { None } else { last },
        at_end,
    })
}

/// Deletes the records of `keys` that are expired at `now_millis`, each by its full key: one
/// created again under the same key since it was read is kept. Returns how many it deleted.
pub(super) fn delete_expired(
    conn: &Connection,
    keys: &[RecordKey],
    now_millis: i64,
) -> rusqlite::Result<usize> {
    let mut statement = conn.prepare_cached(
        "DELETE FROM idempotency_records WHERE tenant = ?1 AND operation = ?2 \
         AND idempotency_key = ?3 AND expires_at <= ?4",
    )?;
    let mut deleted = 0;
    for RecordKey([tenant, operation, key]) in keys {
        deleted += statement.execute(params![tenant, operation, key, now_millis])?;
    }
    Ok(deleted)
}
