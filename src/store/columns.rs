//! The checks every backend makes on a saved record's columns as read back: the fingerprint's
//! version and length, the status code and the encoded headers (and, for a whole record, the
//! trailers). One function, so that the stores and the admin calls refuse the same corrupt
//! rows with the same errors.

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
