//! The SQL of the admin calls on SQLite, with the parameters of `postgres/admin_sql.rs` in the
//! same `$n` numbering.

/// A completed record of `($1, $2, $3)`, expired or not, in
/// [`RawRecord`](crate::admin::RawRecord) order; its body only `with_body` (it is not even read
/// otherwise).
pub(crate) fn inspect_record(with_body: bool) -> String {
    let body_column = if with_body { "body" } else { "NULL" };
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
/// `NULL`.
pub(crate) const COUNT_RECORDS: &str = "SELECT \
     coalesce(sum(state = 'completed' AND expires_at > $1), 0), \
     coalesce(sum(NOT (state = 'completed' AND expires_at > $1)), 0) \
     FROM idempotency_records \
     WHERE ($2 IS NULL OR tenant = $2) AND ($3 IS NULL OR operation = $3)";
