//! The SQL of the PostgreSQL stores, shared by the tokio-postgres store (`tokio_postgres`) and the
//! sqlx store (`sqlx_postgres`): one copy of the schema and of every statement, so that both
//! stores read and write the same table the same way.

/// The same columns as the SQLite store, plus `state`: a reservation is an `in_progress` row
/// whose response columns are still empty. Other transactions never see one (it is committed
/// only as `completed`). Should one ever be committed as it is (the handle refuses a handler's
/// transaction control, so only something outside the layer could), it is written already
/// expired, so the next request for its key takes it over.
///
/// The text is the migration shipped in `migrations/` (for `sqlx migrate run` or
/// `sqlx::migrate!`): one copy for the stores and for applications that run migrations
/// themselves.
pub(crate) const SCHEMA: &str =
    include_str!("../../migrations/20261201000000_idempotency_records.sql");

/// Brings a table created with the SQLite layout (no `state`, response columns `NOT NULL`) to
/// the layout above. Run only when `state` is missing, so that a normal start never takes the
/// `ACCESS EXCLUSIVE` lock of an `ALTER TABLE`.
pub(crate) const MIGRATE_ADD_STATE: &str = "
ALTER TABLE idempotency_records
    ADD COLUMN state TEXT NOT NULL DEFAULT 'completed',
    ALTER COLUMN fingerprint DROP NOT NULL,
    ALTER COLUMN fingerprint_version DROP NOT NULL,
    ALTER COLUMN status DROP NOT NULL,
    ALTER COLUMN headers DROP NOT NULL,
    ALTER COLUMN body DROP NOT NULL,
    ADD CONSTRAINT idempotency_records_state CHECK (state IN ('in_progress', 'completed')),
    ADD CONSTRAINT idempotency_records_completed CHECK (state = 'in_progress' OR (
        fingerprint IS NOT NULL AND fingerprint_version IS NOT NULL AND status IS NOT NULL
        AND headers IS NOT NULL AND body IS NOT NULL));
";

/// A change to a table of an older layout, made when an install finds `column` missing from
/// `table` (and only then, so that a normal start never takes the `ACCESS EXCLUSIVE` lock of
/// an `ALTER TABLE`).
pub(crate) struct Upgrade {
    pub(crate) table: &'static str,
    pub(crate) column: &'static str,
    pub(crate) statement: &'static str,
}

/// `idempotency_records` of the SQLite layout gets its `state` ([`MIGRATE_ADD_STATE`]).
pub(crate) const ADD_STATE: Upgrade = Upgrade {
    table: "idempotency_records",
    column: "state",
    statement: MIGRATE_ADD_STATE,
};

/// Whether the table `$1` has the column `$2`. `current_schemas(false)[1]` is where an
/// unqualified `CREATE TABLE` puts a table.
pub(crate) const HAS_COLUMN: &str = "SELECT EXISTS (SELECT 1 FROM information_schema.columns \
     WHERE table_schema = (current_schemas(false))[1] \
     AND table_name = $1::text AND column_name = $2::text)";

/// Serializes schema creation between instances starting at the same time: concurrent
/// `CREATE TABLE IF NOT EXISTS` of one table can fail on PostgreSQL's catalog index.
/// An arbitrary constant, the same in every instance.
pub(crate) const MIGRATION_LOCK: i64 = 0x7469_6465_6d70_0001;

/// Reads a record, for the re-check inside the transaction (any state).
pub(crate) const SELECT_RECORD: &str =
    "SELECT state, fingerprint_version, fingerprint, status, headers, \
     body, trailers, created_at, expires_at FROM idempotency_records \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3";

/// Reads a live completed record, for the fast path (the same columns as [`SELECT_RECORD`]).
pub(crate) const SELECT_LIVE_RECORD: &str =
    "SELECT state, fingerprint_version, fingerprint, status, \
     headers, body, trailers, created_at, expires_at FROM idempotency_records \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 \
     AND state = 'completed' AND expires_at > $4";

/// Reads the live completed records of several scopes at once, for the replay checks that
/// queued while others were in flight (the same columns as [`SELECT_LIVE_RECORD`], then the
/// 1-based position of the scope in the arrays). Binds: tenants, operations, keys and each
/// check's `now`, as arrays of one length; a scope with no live record has no row.
///
/// Each scope is looked up on its own, by the primary key: the `LATERAL` subquery with
/// `OFFSET 0` is not flattened into a join, whose plan, cached on the connection while the
/// table was still small, would read the whole table for every batch once it has grown.
#[cfg(feature = "tokio-postgres")]
pub(crate) const SELECT_LIVE_RECORDS: &str =
    "SELECT r.state, r.fingerprint_version, r.fingerprint, r.status, r.headers, r.body, \
     r.trailers, r.created_at, r.expires_at, k.position \
     FROM unnest($1::text[], $2::text[], $3::text[], $4::int8[]) WITH ORDINALITY \
     AS k(tenant, operation, idempotency_key, now, position) \
     CROSS JOIN LATERAL (SELECT * FROM idempotency_records AS i \
         WHERE i.tenant = k.tenant AND i.operation = k.operation \
         AND i.idempotency_key = k.idempotency_key \
         AND i.state = 'completed' AND i.expires_at > k.now OFFSET 0) AS r";

/// Reserves a scope: blocks on the primary key while another transaction holds it. Returns
/// the row's physical address, which `commit` updates it by (see [`COMPLETE_RECORD`]).
pub(crate) const INSERT_RESERVATION: &str = "INSERT INTO idempotency_records \
     (tenant, operation, idempotency_key, state, created_at, expires_at) \
     VALUES ($1, $2, $3, 'in_progress', $4, $4) \
     ON CONFLICT (tenant, operation, idempotency_key) DO NOTHING RETURNING ctid::text";

/// The names under which the sqlx store prepares its one-flight statements on each connection
/// (SQL-level `PREPARE`, run once per connection, then `EXECUTE` in a simple query with the
/// values as literals): [`INSERT_RESERVATION`], [`INSERT_RESERVATION_RESTORING`] and
/// [`COMPLETE_RECORD`].
#[cfg(feature = "sqlx-postgres")]
pub(crate) const PREPARED_NAMES: [&str; 3] = [
    "tower_idempotency_reserve",
    "tower_idempotency_reserve_restoring",
    "tower_idempotency_complete",
];

/// [`INSERT_RESERVATION`], and, if it reserved the key, `lock_timeout` set (for the transaction)
/// to `$5` milliseconds less the time since the query reached the server
/// (`clock_timestamp() - statement_timestamp()`, which counts the insert's wait), at least 1:
/// the reservation under an in-flight policy's bound, then the handler's lock waits bounded by
/// the deadline again. If the key had a row, no row comes back and the bound stays for the
/// re-check and the take-over.
#[cfg(feature = "sqlx-postgres")]
pub(crate) const INSERT_RESERVATION_RESTORING: &str = "WITH reserved AS ( \
     INSERT INTO idempotency_records \
     (tenant, operation, idempotency_key, state, created_at, expires_at) \
     VALUES ($1, $2, $3, 'in_progress', $4, $4) \
     ON CONFLICT (tenant, operation, idempotency_key) DO NOTHING RETURNING ctid::text AS address) \
     SELECT address, set_config('lock_timeout', greatest(1, $5::bigint - (extract(epoch FROM \
     clock_timestamp() - statement_timestamp()) * 1000)::bigint)::text, true) FROM reserved";

/// Takes over an expired record (or a stray reservation) as this transaction's reservation.
pub(crate) const TAKE_OVER: &str = "UPDATE idempotency_records SET state = 'in_progress', \
     fingerprint = NULL, fingerprint_version = NULL, status = NULL, headers = NULL, body = NULL, \
     trailers = NULL, created_at = $4, expires_at = $4 \
     WHERE tenant = $1 AND operation = $2 AND idempotency_key = $3 \
     AND (state = 'in_progress' OR expires_at <= $4) RETURNING ctid::text";

/// Turns this transaction's reservation into the completed record, and fails (division by
/// zero, which aborts the transaction) unless exactly that row was completed. The tokio-postgres
/// store's `commit` sends it and `COMMIT` in one flight: PostgreSQL answers the `COMMIT` of an
/// aborted transaction with a `ROLLBACK`, so a record that is not this transaction's own is never
/// committed. (The sqlx store, which cannot pipeline, sends both as one simple query with the
/// values written in, which runs nothing after a failed statement; or `COMMIT` only once this
/// succeeded.)
///
/// The last condition checks that the transaction is still the one `begin` opened: the
/// reservation row was written by it (`xmin`). After a `COMMIT` or `ROLLBACK` behind the layer's
/// back, the statement would run in a transaction of its own, whose id differs (or the row is
/// gone).
///
/// The row is found by the `ctid` its reservation returned rather than through the primary
/// key: under `SERIALIZABLE`, reading the key's index page would take a page-level predicate
/// lock, and concurrent requests for *different* keys on that page would then fail each other
/// with serialization errors. (The reservation's `ON CONFLICT` probe takes none.)
pub(crate) const COMPLETE_RECORD: &str = "WITH completed AS (UPDATE idempotency_records SET \
     state = 'completed', fingerprint = $4, fingerprint_version = $5, status = $6, headers = $7, \
     body = $8, trailers = $9, created_at = $10, expires_at = $11 \
     WHERE ctid = $12::text::tid \
     AND tenant = $1 AND operation = $2 AND idempotency_key = $3 AND state = 'in_progress' \
     AND xmin = pg_current_xact_id()::xid RETURNING 1) \
     SELECT 1 / count(*)::int FROM completed";

/// Deletes a batch of expired records. SKIP LOCKED: never wait for (or fight over) a record
/// that a request is taking over, and let several instances purge at once.
pub(crate) const PURGE_EXPIRED: &str = "DELETE FROM idempotency_records AS r USING ( \
         SELECT tenant, operation, idempotency_key FROM idempotency_records \
         WHERE expires_at <= $1 LIMIT $2 FOR UPDATE SKIP LOCKED) AS expired \
     WHERE r.tenant = expired.tenant AND r.operation = expired.operation \
     AND r.idempotency_key = expired.idempotency_key";

/// The `SET LOCAL` setting that marks a transaction a store opened for itself (the inbox's),
/// set to a token unique in the store; [`IS_OWN_TRANSACTION`] checks it before `COMMIT`, to
/// detect a transaction that the owner's code ended behind its back (or that a failed
/// statement aborted: the check then fails too). A request's transaction is recognized by its
/// reservation row instead (see [`COMPLETE_RECORD`]).
pub(crate) const OWN_TRANSACTION_SETTING: &str = "tower_idempotency.reservation";

/// Whether the transaction is still the one marked with the token `$1` (see
/// [`OWN_TRANSACTION_SETTING`]).
pub(crate) const IS_OWN_TRANSACTION: &str =
    "SELECT current_setting('tower_idempotency.reservation', true) IS NOT DISTINCT FROM $1";
