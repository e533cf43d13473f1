//! The canonical bytes of a JSON document ([`canonicalize_json`]): members sorted in UTF-16
//! order, whitespace dropped, strings and numbers written one way (see
//! [the module docs](super#deviations-from-jcs)). The parser and writer are `streaming`'s, which
//! the fingerprints use to hash the same bytes without building them.

use super::FingerprintError;

/// The canonical bytes of a JSON document.
///
/// `input` must be valid UTF-8 holding exactly one JSON value ([RFC 8259], strictly: no comments,
/// trailing commas, leading zeros, `NaN` or byte order mark), with optional surrounding whitespace.
/// `max_depth` bounds the nesting of arrays and objects (`0` allows only scalars).
///
/// The parser is iterative (an explicit stack, no recursion), so hostile nesting returns
/// [`FingerprintError::TooDeep`] instead of overflowing the stack. The document is read twice
/// (validated and measured, then written in canonical order), and each object's members are
/// found by skipping over their values, so the work is bounded by the input length times the
/// nesting depth of objects: keep `max_depth` modest ([`DEFAULT_MAX_JSON_DEPTH`] is).
///
/// A [`Fingerprinter`] does not build this `Vec`: it hashes the same bytes as they are produced,
/// and fails with the same errors.
///
/// [`DEFAULT_MAX_JSON_DEPTH`]: super::DEFAULT_MAX_JSON_DEPTH
/// [`Fingerprinter`]: super::Fingerprinter
/// [RFC 8259]: https://www.rfc-editor.org/rfc/rfc8259
pub fn canonicalize_json(input: &[u8], max_depth: usize) -> Result<Vec<u8>, FingerprintError> {
    super::streaming::canonical_bytes(input, max_depth)
}

#[cfg(test)]
mod tests;
