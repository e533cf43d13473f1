//! The SQL of the admin calls on PostgreSQL, shared by the tokio-postgres store
//! (`src/tokio_postgres/`) and the sqlx store (`src/sqlx/postgres/`).

/// A completed record of `($1, $2, $3)`, expired or not, in [`RawRecord`](crate::admin::RawRecord)
/// order; its body only `with_body` (it is not even read otherwise).
pub(crate) fn inspect_record(with_body: bool) -> String {
    let body_column = if with_body { "body" } else { "NULL::bytea" };
    format!(
        "SELECT fingerprint_version, fingerprint, status, headers, length(body), \
         {body_column}, created_at, expires_at FROM idempotency_records \
         WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 \
         AND state = 'completed'"
    )
}

/// Deletes the record of `($1, $2, $3)`, in any state.
pub(crate) const DELETE_RECORD: &str = "DELETE FROM idempotency_records \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3";

/// `(live, expired)` records at `$1`, of tenant `$2` and operation `$3` when they are not
/// `NULL`. A stray reservation counts as expired.
pub(crate) const COUNT_RECORDS: &str =
    "SELECT count(*) FILTER (WHERE state = 'completed' AND expires_at > $1), \
     count(*) FILTER (WHERE NOT (state = 'completed' AND expires_at > $1)) \
     FROM idempotency_records \
     WHERE ($2::text IS NULL OR tenant = $2) AND ($3::text IS NULL OR operation = $3)";
