//! The records table: its schema, the statements that read, save and delete records, and
//! the reading of a row into a [`StoredRecord`] (checked by [`SavedColumns`]).
//!
//! Plain functions on a [`Connection`]: the writer runs them inside a request's savepoint
//! (`check_existing`, `insert_record`) or alone (`purge_expired`), the reader connections of
//! the fast path run `read_record`.

use bytes::Bytes;
use rusqlite::types::ValueRef;
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
pub(super) const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS idempotency_records (
    tenant              TEXT    NOT NULL,
    operation           TEXT    NOT NULL,
    idempotency_key     TEXT    NOT NULL,
    fingerprint         BLOB    NOT NULL,
    fingerprint_version INTEGER NOT NULL,
    status              INTEGER NOT NULL,
    headers             TEXT    NOT NULL,
    body                BLOB    NOT NULL,
    trailers            TEXT,
    created_at          INTEGER NOT NULL,
    expires_at          INTEGER NOT NULL,
    PRIMARY KEY (tenant, operation, idempotency_key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at
    ON idempotency_records (expires_at);
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

/// Deletes up to `batch` records that expired at `now_millis` or before; returns how many.
pub(super) fn purge_expired(
    conn: &Connection,
    now_millis: i64,
    batch: i64,
) -> rusqlite::Result<usize> {
    conn.execute(
        "DELETE FROM idempotency_records WHERE (tenant, operation, idempotency_key) IN \
         (SELECT tenant, operation, idempotency_key FROM idempotency_records \
         WHERE expires_at <= ?1 LIMIT ?2)",
        params![now_millis, batch],
    )
}
