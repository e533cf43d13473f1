//! The checks every backend makes on a saved record's columns as read back: the fingerprint's
//! version and length, the status code and the encoded headers. One function, so that a store
//! and the admin calls refuse the same corrupt rows with the same errors.

use http::{HeaderName, HeaderValue, StatusCode};

use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::response::SavedResponse;

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
}
