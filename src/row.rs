//! A stored row, read the same way on every backend: [`Columns`] is what the
//! shared readers of `outbox_events` rows (`outbox/columns.rs`) and of idempotency records
//! (`admin`) need from a row, implemented by rusqlite's, tokio-postgres' and sqlx' rows. So a
//! `NULL` where none belongs, or an integer of the other width, reads the same everywhere.

/// A row's columns by position, each read as nullable (`None` for SQL `NULL`); a column of
/// another type is the driver's error, never a panic.
pub(crate) trait Columns {
    /// The driver's error.
    type Error;

    /// A 64-bit integer (`BIGINT`, `BIGSERIAL`, `count(*)`; any integer on SQLite).
    fn big_int(&self, index: usize) -> Result<Option<i64>, Self::Error>;

    /// An `INTEGER` (32 bits on PostgreSQL, widened).
    fn int(&self, index: usize) -> Result<Option<i64>, Self::Error>;

    /// A `TEXT`.
    fn text(&self, index: usize) -> Result<Option<String>, Self::Error>;

    /// A `BOOLEAN` (an integer on SQLite).
    #[cfg_attr(
        not(all(feature = "outbox", feature = "_row-lock-store")),
        allow(dead_code)
    )]
    fn boolean(&self, index: usize) -> Result<Option<bool>, Self::Error>;

    /// A `BYTEA` (a `BLOB` on SQLite).
    fn bytes(&self, index: usize) -> Result<Option<Vec<u8>>, Self::Error>;

    /// The error for a `NULL` in the column `what` (at `index`), which must hold a value.
    fn null(index: usize, what: &str) -> Self::Error;

    /// [`big_int`](Self::big_int) of a column that must hold a value.
    fn required_big_int(&self, index: usize, what: &str) -> Result<i64, Self::Error> {
        self.big_int(index)?.ok_or_else(|| Self::null(index, what))
    }

    /// [`int`](Self::int) of a column that must hold a value.
    fn required_int(&self, index: usize, what: &str) -> Result<i64, Self::Error> {
        self.int(index)?.ok_or_else(|| Self::null(index, what))
    }

    /// [`text`](Self::text) of a column that must hold a value.
    fn required_text(&self, index: usize, what: &str) -> Result<String, Self::Error> {
        self.text(index)?.ok_or_else(|| Self::null(index, what))
    }

    /// [`boolean`](Self::boolean) of a column that must hold a value.
    #[cfg_attr(
        not(all(feature = "outbox", feature = "_row-lock-store")),
        allow(dead_code)
    )]
    fn required_boolean(&self, index: usize, what: &str) -> Result<bool, Self::Error> {
        self.boolean(index)?.ok_or_else(|| Self::null(index, what))
    }

    /// [`bytes`](Self::bytes) of a column that must hold a value.
    fn required_bytes(&self, index: usize, what: &str) -> Result<Vec<u8>, Self::Error> {
        self.bytes(index)?.ok_or_else(|| Self::null(index, what))
    }
}

/// The crate's error for a `NULL` where a value belongs.
pub(crate) fn missing(what: &str) -> crate::error::Error {
    crate::error::Error::Corrupt(format!("{what} missing"))
}

#[cfg(feature = "sqlite")]
impl Columns for rusqlite::Row<'_> {
    type Error = rusqlite::Error;

    fn big_int(&self, index: usize) -> rusqlite::Result<Option<i64>> {
        self.get(index)
    }

    fn int(&self, index: usize) -> rusqlite::Result<Option<i64>> {
        self.get(index)
    }

    fn text(&self, index: usize) -> rusqlite::Result<Option<String>> {
        self.get(index)
    }

    fn boolean(&self, index: usize) -> rusqlite::Result<Option<bool>> {
        self.get(index)
    }

    fn bytes(&self, index: usize) -> rusqlite::Result<Option<Vec<u8>>> {
        self.get(index)
    }

    fn null(index: usize, what: &str) -> rusqlite::Error {
        rusqlite::Error::FromSqlConversionFailure(
            index,
            rusqlite::types::Type::Null,
            Box::new(missing(what)),
        )
    }
}
