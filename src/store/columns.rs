//! The checks every backend makes on a saved record's columns as read back: the fingerprint's
//! version and length, the status code and the encoded headers (and, for a whole record, the
//! trailers). One function, so that the stores and the admin calls refuse the same corrupt
//! rows with the same errors. The SQL stores with row locks (tokio-postgres, sqlx) read a
//! record row once, over [`record_row::RecordColumns`].

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};

use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::response::SavedResponse;
use crate::store::{from_unix_millis, StoredRecord};

/// A record's checked columns.
pub(crate) struct SavedColumns {
    pub(crate) fingerprint: Fingerprint,
    pub(crate) status: StatusCode,
    pub(crate) headers: Vec<(HeaderName, HeaderValue)>,
}

impl SavedColumns {
    /// Checks the columns as stored: `fingerprint_version`, `fingerprint` (32 bytes), `status`
    /// and `headers` (the encoded header list). Anything out of range is [`Error::Corrupt`].
    pub(crate) fn decode(
        version: i64,
        digest: &[u8],
        status: i64,
        headers: &str,
    ) -> Result<Self, Error> {
        let version =
            u16::try_from(version).map_err(|_| Error::Corrupt("fingerprint version".into()))?;
        let digest: [u8; 32] = digest
            .try_into()
            .map_err(|_| Error::Corrupt("fingerprint length".into()))?;
        let status = u16::try_from(status)
            .ok()
            .and_then(|s| StatusCode::from_u16(s).ok())
            .ok_or_else(|| Error::Corrupt("status".into()))?;
        let headers = SavedResponse::decode_headers(headers).map_err(Error::Corrupt)?;
        Ok(SavedColumns {
            fingerprint: Fingerprint::new(version, digest),
            status,
            headers,
        })
    }

    /// The record of a row with these columns, its body, its encoded `trailers` (if any) and
    /// its times (Unix milliseconds). Trailers that do not decode are [`Error::Corrupt`].
    pub(crate) fn into_record(
        self,
        body: Bytes,
        trailers: Option<&str>,
        created_at: i64,
        expires_at: i64,
    ) -> Result<StoredRecord, Error> {
        let trailers = trailers
            .map(SavedResponse::decode_headers)
            .transpose()
            .map_err(Error::Corrupt)?;
        Ok(StoredRecord {
            fingerprint: self.fingerprint,
            response: SavedResponse {
                status: self.status,
                headers: self.headers,
                body,
                trailers,
            },
            created_at: from_unix_millis(created_at),
            expires_at: from_unix_millis(expires_at),
        })
    }
}

/// A whole record row as the SQL stores with row locks read it.
#[cfg(feature = "_row-lock-store")]
pub(crate) mod record_row {
    use bytes::Bytes;

    use crate::error::Error;
    use crate::store::{SavedColumns, StoredRecord};

    /// A record row's columns by position, borrowed from the row (reading a record copies only
    /// its body): what [`decode_record`] needs from a tokio-postgres or sqlx row. A column of
    /// another type is the driver's error, never a panic.
    pub(crate) trait RecordColumns {
        /// An `INTEGER`, nullable.
        fn int(&self, index: usize) -> Result<Option<i32>, Error>;

        /// A `BIGINT` that holds a value.
        fn big_int(&self, index: usize) -> Result<i64, Error>;

        /// A `TEXT` that holds a value.
        fn required_text(&self, index: usize) -> Result<&str, Error>;

        /// A `TEXT`, nullable.
        fn text(&self, index: usize) -> Result<Option<&str>, Error>;

        /// A `BYTEA` (`BLOB`), nullable.
        fn bytes(&self, index: usize) -> Result<Option<&[u8]>, Error>;
    }

    /// Implements [`RecordColumns`] for a driver's row type with its `try_get`, which
    /// tokio-postgres and sqlx spell the same way.
    macro_rules! record_columns_by_try_get {
        ($row:ty) => {
            impl $crate::store::columns::record_row::RecordColumns for $row {
                fn int(&self, index: usize) -> Result<Option<i32>, $crate::error::Error> {
                    Ok(self.try_get(index)?)
                }

                fn big_int(&self, index: usize) -> Result<i64, $crate::error::Error> {
                    Ok(self.try_get(index)?)
                }

                fn required_text(&self, index: usize) -> Result<&str, $crate::error::Error> {
                    Ok(self.try_get(index)?)
                }

                fn text(&self, index: usize) -> Result<Option<&str>, $crate::error::Error> {
                    Ok(self.try_get(index)?)
                }

                fn bytes(&self, index: usize) -> Result<Option<&[u8]>, $crate::error::Error> {
                    Ok(self.try_get(index)?)
                }
            }
        };
    }

    /// Each driver invokes it for its row type, in its folder (its `driver.rs`).
    pub(crate) use record_columns_by_try_get;

    /// Reads a record row (state, fingerprint version, fingerprint, status, headers, body,
    /// trailers, created and expiry times) as a completed record, checked by [`SavedColumns`].
    pub(crate) fn decode_record(row: &impl RecordColumns) -> Result<StoredRecord, Error> {
        let corrupt = |what: &str| Error::Corrupt(what.to_owned());
        let version = row
            .int(1)?
            .ok_or_else(|| corrupt("fingerprint version missing"))?;
        let digest = row
            .bytes(2)?
            .ok_or_else(|| corrupt("fingerprint missing"))?;
        let status = row.int(3)?.ok_or_else(|| corrupt("status"))?;
        let headers = row.text(4)?.ok_or_else(|| corrupt("headers missing"))?;
        let columns = SavedColumns::decode(i64::from(version), digest, i64::from(status), headers)?;
        let body = row.bytes(5)?.ok_or_else(|| corrupt("body missing"))?;
        columns.into_record(
            Bytes::copy_from_slice(body),
            row.text(6)?,
            row.big_int(7)?,
            row.big_int(8)?,
        )
    }

    /// A record row as the reservation's re-check reads it: the record if it is completed and
    /// live at `now`, `None` if it is expired or a reservation.
    pub(crate) fn live_record(
        row: &impl RecordColumns,
        now: i64,
    ) -> Result<Option<StoredRecord>, Error> {
        let state = row.required_text(0)?;
        let expires_at = row.big_int(8)?;
        if state == "completed" && expires_at > now {
            decode_record(row).map(Some)
        } else {
            Ok(None)
        }
    }
}
