//! Canonical JSON written straight to where it goes, with no copy of the document: into a `Vec`
//! for [`canonicalize_json`](super::canonicalize_json), into the hashers for a fingerprint.
//!
//! A digest covers the length of the canonical form before the form itself, so the document is
//! read in two passes:
//!
//! 1. **Measure**, in document order: every check of the parser, counting the canonical length
//!    instead of writing (a length does not depend on the order of members). This pass holds its
//!    stack of open arrays and objects, and the key positions of the document's own object if it
//!    is one (the second pass starts with them). Duplicate keys are not looked for here: when the
//!    measure fails, it runs again with the duplicate check on (see below), so that the error is
//!    the first fault in document order.
//! 2. **Write**, in canonical order: an object's members are found by skipping over their values,
//!    their key positions (one `usize` each, on one stack shared by all the open objects) are
//!    sorted by key, then each member is written, its value canonicalized from its place in the
//!    input, straight into the sink (for the hashers, through a small buffer on the stack).
//!    Arrays are written as they come. An object with the same key twice is found when its keys
//!    are sorted: since the measure found no other fault, [`FingerprintError::DuplicateKey`] is
//!    then the error.
//!
//! The heap cost is the key stack: one position per member of the objects being written (an
//! object and the objects around it), whatever the size of the values. The time is linear in the
//! input times the nesting depth of *objects*, which `max_depth` bounds: a value is measured once,
//! skipped over once by each object around it but the document's own, then written once.
//! Skipping looks for a few bytes only (quotes, brackets, backslashes), eight bytes at a time.

use sha2::{Digest, Sha256};

use super::FingerprintError;
use walker::{Order, Walker};

mod scan;
mod walker;

/// Feeds `hashers` the canonical form of the JSON document `input` as one field of a
/// fingerprint: its length (8 bytes, big-endian), then its bytes. Exactly what hashing the output
/// of [`canonical_bytes`] that way gives, and the same errors.
pub(super) fn hash_canonical_json(
    input: &[u8],
    max_depth: usize,
    hashers: &mut [Sha256],
) -> Result<(), FingerprintError> {
    let measured = measure(input, max_depth)?;
    for hasher in hashers.iter_mut() {
        hasher.update(measured.length.to_be_bytes());
    }
    let mut sink = HashSink {
        hashers,
        buffer: [0; HASH_BUFFER],
        filled: 0,
    };
    write_canonical(input, max_depth, measured.root_keys, &mut sink)?;
    sink.flush();
    Ok(())
}

/// What the first pass learns of a valid document.
pub(super) struct Measured {
    /// The length of the canonical form.
    pub(super) length: u64,
    /// When the document is an object, the positions of its keys, in document order (so the
    /// second pass need not find them again).
    pub(super) root_keys: Vec<usize>,
}

/// Validates `input` (every check, the first fault in document order is the error) and measures
/// its canonical form.
pub(super) fn measure(input: &[u8], max_depth: usize) -> Result<Measured, FingerprintError> {
    let text = std::str::from_utf8(input).map_err(|_| FingerprintError::InvalidUtf8)?;
    let mut counter = Counter(0);
    let mut walker = Walker::new(text.as_bytes(), max_depth, Order::Document);
    match walker.run(&mut counter) {
        Ok(()) => Ok(Measured {
            length: counter.0,
            root_keys: walker.keys,
        }),
        // Another fault, or a duplicate key in an object that closes before it?
        Err(error) => {
            let checked = Walker::new(text.as_bytes(), max_depth, Order::DocumentChecked)
                .run(&mut Counter(0));
            Err(checked.err().unwrap_or(error))
        }
    }
}

/// Writes the canonical form of `input` to `out`. `input` has passed [`measure`], which found
/// `root_keys`: the only error left to find is a duplicate key.
pub(super) fn write_canonical(
    input: &[u8],
    max_depth: usize,
    root_keys: Vec<usize>,
    out: &mut impl Sink,
) -> Result<(), FingerprintError> {
    let mut walker = Walker::new(input, max_depth, Order::Canonical);
    walker.keys = root_keys;
    walker.run(out)
}

/// The canonical form of `input`, as bytes: [`canonicalize_json`](super::canonicalize_json).
pub(super) fn canonical_bytes(input: &[u8], max_depth: usize) -> Result<Vec<u8>, FingerprintError> {
    let measured = measure(input, max_depth)?;
    let mut out = Vec::with_capacity(usize::try_from(measured.length).unwrap_or(input.len()));
    write_canonical(input, max_depth, measured.root_keys, &mut out)?;
    debug_assert_eq!(out.len() as u64, measured.length, "the measured length");
    Ok(out)
}

/// Where canonical bytes go.
pub(super) trait Sink {
    /// Appends `bytes`.
    fn put(&mut self, bytes: &[u8]);

    /// Appends one byte.
    fn byte(&mut self, byte: u8) {
        self.put(&[byte]);
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// Counts the bytes instead of keeping them.
struct Counter(u64);

impl Sink for Counter {
    fn put(&mut self, bytes: &[u8]) {
        self.0 += bytes.len() as u64;
    }
}

/// Large enough that a typical body is hashed in one or two calls per hasher, small enough that
/// zeroing it costs little (it is set up for every fingerprint).
const HASH_BUFFER: usize = 512;

/// Gathers the many small writes into blocks for the hashers.
struct HashSink<'h> {
    hashers: &'h mut [Sha256],
    buffer: [u8; HASH_BUFFER],
    filled: usize,
}

impl HashSink<'_> {
    fn flush(&mut self) {
        let pending = self.buffer.get(..self.filled).unwrap_or_default();
        for hasher in self.hashers.iter_mut() {
            hasher.update(pending);
        }
        self.filled = 0;
    }
}

impl HashSink<'_> {
    #[cold]
    fn put_after_flush(&mut self, bytes: &[u8]) {
        self.flush();
        match self.buffer.get_mut(..bytes.len()) {
            Some(free) => {
                free.copy_from_slice(bytes);
                self.filled = bytes.len();
            }
            None => {
                for hasher in self.hashers.iter_mut() {
                    hasher.update(bytes);
                }
            }
        }
    }
}

impl Sink for HashSink<'_> {
    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        if let Some(free) = self.buffer.get_mut(self.filled..self.filled + bytes.len()) {
            free.copy_from_slice(bytes);
            self.filled += bytes.len();
        } else {
            self.put_after_flush(bytes);
        }
    }

    #[inline]
    fn byte(&mut self, byte: u8) {
        if let Some(free) = self.buffer.get_mut(self.filled) {
            *free = byte;
            self.filled += 1;
        } else {
            self.put(&[byte]);
        }
    }
}

#[cfg(test)]
mod tests;
