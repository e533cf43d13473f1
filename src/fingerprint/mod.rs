//! Request fingerprints: a canonical form of the payload, digested with SHA-256.
//!
//! A retry with the same key must carry the same payload; a different payload under a used key is
//! a client bug and gets a conflict. "Same" means the same *value*, not the same bytes: for JSON,
//! members are sorted, whitespace is dropped, and strings and numbers are written one way, with
//! [RFC 8785] (JCS) as the reference. So these two bodies have one fingerprint:
//!
//! ```
//! use tower_idempotency::fingerprint::{canonicalize_json, DEFAULT_MAX_JSON_DEPTH};
//!
//! let a = canonicalize_json(br#"{ "quantity":1,  "sku":"book"}"#, DEFAULT_MAX_JSON_DEPTH)?;
//! let b = canonicalize_json(br#"{"sku":"\u0062ook","quantity":1.0}"#, DEFAULT_MAX_JSON_DEPTH)?;
//! assert_eq!(a, b);
//! assert_eq!(a, br#"{"quantity":1,"sku":"book"}"#);
//! # Ok::<(), tower_idempotency::fingerprint::FingerprintError>(())
//! ```
//!
//! Only the digest is kept, never the body (payloads may hold personal data), together with the
//! version of the canonicalization that produced it. A [`Fingerprinter`] does not even build the
//! canonical form: it hashes it as it is produced (see [`Fingerprinter::fingerprint`]).
//!
//! # The query string
//!
//! `POST /orders?dry_run=true` is not the request `POST /orders`: the built-in schemes digest the
//! query too (since canonicalization version 2). It is canonicalized the way
//! `application/x-www-form-urlencoded` is parsed (the [WHATWG URL] parser, which axum's `Query`
//! and `serde_urlencoded` follow), so that two spellings a handler cannot tell apart share a
//! fingerprint:
//!
//! - split on `&`, empty pieces dropped; each piece split on its first `=` into name and value
//!   (`a` is `a=`);
//! - in names and values `+` is a space and `%XX` is the byte `XX` (`%4a`, `%4A` and `J` agree;
//!   `a+b` is `a%20b`, and `%2B` is `+`), while a `%` not followed by two hex digits stays as it
//!   is; the decoded bytes are kept as they are, UTF-8 or not;
//! - **the pairs keep their order**: `?a=1&b=2` and `?b=2&a=1` are different requests. A handler
//!   that reads the pairs as a list, or takes the first (or last) of repeated names, tells them
//!   apart, and a client retrying sends the same URL anyway: sorting would only risk replaying a
//!   response to a request that means something else.
//!
//! No query, `?` and `?&` are all the empty query.
//!
//! Records saved under version 1 (method, path and body, whatever the query) are compared as
//! version 1 compared them: a fresh [`Fingerprint`] of a built-in scheme also carries the digest
//! version 1 gives the request, and [`Fingerprint::matches`] uses it against a version-1
//! fingerprint: a version-1 record still replays to a retry whatever its query, as it always did.
//! Such records last at most the retention after an upgrade. Without a query, a request is
//! digested exactly as version 1 digested it (so nothing is hashed twice for it).
//!
//! ```
//! use tower_idempotency::fingerprint::Fingerprinter;
//!
//! let parts = |uri: &str| http::Request::post(uri).body(()).unwrap().into_parts().0;
//! let raw = Fingerprinter::raw();
//! let order = raw.fingerprint(&parts("/orders"), b"book")?;
//! let dry_run = raw.fingerprint(&parts("/orders?dry_run=true"), b"book")?;
//! assert!(!order.matches(&dry_run));
//!
//! let spelled = raw.fingerprint(&parts("/orders?note=gift+wrap"), b"book")?;
//! let encoded = raw.fingerprint(&parts("/orders?note=gift%20wrap&"), b"book")?;
//! assert!(spelled.matches(&encoded));
//! # Ok::<(), tower_idempotency::fingerprint::FingerprintError>(())
//! ```
//!
//! A [custom](Fingerprinter::custom) scheme digests the method and path with what its function
//! returns, and not the query: its version belongs to the route, so the layer cannot change its
//! digests without breaking the records saved before. Its function gets the request head: return
//! what matters of `parts.uri.query()` with the payload.
//!
//! # Deviations from JCS
//!
//! - Numbers are kept exactly instead of being rounded to IEEE-754 doubles: JCS would give
//!   `9007199254740993` and `9007199254740992` one spelling, and two different values must never
//!   share a fingerprint. Each numeric value has one spelling, chosen like ECMAScript's
//!   `Number.prototype.toString` (plain decimal when 1e-7 < |x| < 1e21, else `d.ddde+N`), with
//!   all significant digits kept: `1.0`, `10e-1` and `1` are all `1`; `1E30` is `1e+30`; `-0` is
//!   `0`.
//! - Duplicate object keys are rejected ([`FingerprintError::DuplicateKey`]): such a payload means
//!   different things to different parsers.
//!
//! # Choosing a scheme per route
//!
//! ```
//! use tower_idempotency::fingerprint::{Fingerprinter, FingerprintError};
//!
//! // The default: canonical JSON for JSON content types, the exact bytes otherwise.
//! let auto = Fingerprinter::auto();
//!
//! // Only the business fields count: a client may change `note` on a retry.
//! let custom = Fingerprinter::custom(1, |_parts, body| {
//!     let value: serde_json::Value = serde_json::from_slice(body)
//!         .map_err(|_| FingerprintError::Custom("body is not JSON".into()))?;
//!     Ok(format!("{}|{}", value["sku"], value["quantity"]).into_bytes())
//! });
//!
//! let (parts, ()) = http::Request::post("/orders").body(()).unwrap().into_parts();
//! let first = custom.fingerprint(&parts, br#"{"sku":"book","quantity":1,"note":"a"}"#)?;
//! let retry = custom.fingerprint(&parts, br#"{"sku":"book","quantity":1,"note":"b"}"#)?;
//! assert!(first.matches(&retry));
//! # let _ = auto;
//! # Ok::<(), FingerprintError>(())
//! ```
//!
//! [RFC 8785]: https://www.rfc-editor.org/rfc/rfc8785
//! [WHATWG URL]: https://url.spec.whatwg.org/#urlencoded-parsing

use std::fmt;
use std::sync::{Arc, OnceLock};

use http::header::CONTENT_TYPE;
use http::HeaderMap;
use sha2::{Digest, Sha256};

/// Version of the built-in canonicalization (JSON and raw schemes).
///
/// Stored with every fingerprint; it changes whenever a change to this module would give an
/// existing payload a different digest. Version 2 added the query string (see
/// [the module docs](self#the-query-string)); version-1 records still compare as they did.
pub(crate) const CANONICALIZATION_VERSION: u16 = 2;

/// The built-in canonicalization before the query string counted: method, path and body.
const PATH_ONLY_VERSION: u16 = 1;

/// The default maximum nesting depth of JSON arrays and objects.
pub const DEFAULT_MAX_JSON_DEPTH: usize = 128;

/// Why a request could not be fingerprinted. Each is the client's fault (a 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FingerprintError {
    /// The body is not valid UTF-8.
    #[error("the request body is not valid UTF-8")]
    InvalidUtf8,
    /// The body is not one valid JSON value.
    #[error("invalid JSON at byte {offset}: {reason}")]
    InvalidJson {
        /// Byte offset in the body where the problem was found.
        offset: usize,
        /// What was wrong there.
        reason: &'static str,
    },
    /// Arrays and objects are nested deeper than allowed.
    #[error("JSON arrays and objects are nested deeper than {max} levels")]
    TooDeep {
        /// The maximum depth.
        max: usize,
    },
    /// An object has the same key twice (after unescaping).
    #[error("a JSON object has the same key twice")]
    DuplicateKey,
    /// A number's exponent is too large to be represented.
    #[error("a JSON number's exponent is out of range")]
    NumberOutOfRange,
    /// A route-supplied fingerprint function rejected the request.
    #[error("{0}")]
    Custom(String),
}

impl FingerprintError {
    /// A short, stable code for error bodies: `invalid_utf8`, `invalid_json`, `json_too_deep`,
    /// `duplicate_json_key`, `number_out_of_range` or `invalid_payload`.
    pub fn code(&self) -> &'static str {
        match self {
            FingerprintError::InvalidUtf8 => "invalid_utf8",
            FingerprintError::InvalidJson { .. } => "invalid_json",
            FingerprintError::TooDeep { .. } => "json_too_deep",
            FingerprintError::DuplicateKey => "duplicate_json_key",
            FingerprintError::NumberOutOfRange => "number_out_of_range",
            FingerprintError::Custom(_) => "invalid_payload",
        }
    }
}

// `canonicalize_json`: the canonical JSON in a `Vec`.
mod canonical;
// The parser and writer of canonical JSON, into a `Vec` or hashed as it is produced.
mod streaming;
// Canonical JSON over chosen members only (`json_only`, `json_except`).
mod select;

pub use canonical::canonicalize_json;

/// SHA-256 digest of a request's canonical form, with the canonicalization version that produced
/// it.
///
/// Compare a fresh fingerprint with a stored one with [`matches`](Fingerprint::matches) (constant
/// time), not `==`: `==` compares the version and the digest only.
#[derive(Clone, Copy)]
pub struct Fingerprint {
    version: u16,
    digest: [u8; 32],
    /// The digest version 1 gave the same request (no query), to compare with records saved
    /// before version 2. Only on fresh fingerprints of the built-in schemes; never stored.
    path_only: Option<[u8; 32]>,
}

impl PartialEq for Fingerprint {
    fn eq(&self, other: &Self) -> bool {
        self.version == other.version && self.digest == other.digest
    }
}

impl Eq for Fingerprint {}

impl std::hash::Hash for Fingerprint {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.version.hash(state);
        self.digest.hash(state);
    }
}

impl Fingerprint {
    /// A fingerprint from its parts, e.g. as read back from a store.
    pub fn new(version: u16, digest: [u8; 32]) -> Self {
        Fingerprint {
            version,
            digest,
            path_only: None,
        }
    }

    /// The version of the scheme that produced the digest: 2 (the current canonical form) for the
    /// built-in schemes, the route's own number for [`Fingerprinter::custom`].
    pub fn version(&self) -> u16 {
        self.version
    }

    /// The SHA-256 digest.
    pub fn digest(&self) -> &[u8; 32] {
        &self.digest
    }

    /// Whether both fingerprints are of the same request: the same version and digest, or, when
    /// one of them is a version-1 record (saved before the query counted) and the other a fresh
    /// fingerprint of a built-in scheme, the digest version 1 gives the fresh one's request. The
    /// digests are compared in constant time.
    pub fn matches(&self, other: &Fingerprint) -> bool {
        let (mine, theirs) = if self.version == other.version {
            (&self.digest, &other.digest)
        } else if let (PATH_ONLY_VERSION, Some(path_only)) = (other.version, &self.path_only) {
            (path_only, &other.digest)
        } else if let (PATH_ONLY_VERSION, Some(path_only)) = (self.version, &other.path_only) {
            (&self.digest, path_only)
        } else {
            return false;
        };
        let difference = mine
            .iter()
            .zip(theirs.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        // Keep the optimizer from turning the fold into an early-exit comparison.
        std::hint::black_box(difference) == 0
    }

    /// The digest as 64 lowercase hex characters.
    pub fn to_hex(&self) -> String {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut hex = String::with_capacity(64);
        for byte in self.digest {
            hex.push(char::from(HEX[usize::from(byte >> 4)]));
            hex.push(char::from(HEX[usize::from(byte & 0x0f)]));
        }
        hex
    }
}

/// `Fingerprint(v1:ab12cd34…)`: the version and the first 8 hex characters of the digest.
impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hex = self.to_hex();
        write!(
            f,
            "Fingerprint(v{}:{}…)",
            self.version,
            hex.get(..8).unwrap_or_default()
        )
    }
}

type CustomFn =
    dyn Fn(&http::request::Parts, &[u8]) -> Result<Vec<u8>, FingerprintError> + Send + Sync;

#[derive(Clone)]
enum Scheme {
    Auto,
    Json,
    Raw,
    Custom { version: u16, f: Arc<CustomFn> },
    Select(Arc<select::Selection>),
}

/// How a route turns a request into a [`Fingerprint`]. Cheap to clone.
///
/// The digest covers a domain-separated encoding of the scheme, the method, the URI path, the
/// canonical query (built-in schemes; see [the module docs](self#the-query-string)) and the
/// canonical body, each field length-prefixed, so a payload sent to another route, with another
/// query or with another method never matches.
#[derive(Clone)]
pub struct Fingerprinter {
    scheme: Scheme,
    max_depth: usize,
}

/// Starts the hashed encoding, so these digests cannot be confused with digests of anything else.
const DOMAIN: &[u8] = b"tower-idempotency/request-fingerprint";

impl Fingerprinter {
    fn with_scheme(scheme: Scheme) -> Self {
        Fingerprinter {
            scheme,
            max_depth: DEFAULT_MAX_JSON_DEPTH,
        }
    }

    /// The default: canonical JSON when `Content-Type` is `application/json` or
    /// `application/*+json` (case-insensitive, parameters such as `charset` ignored), the exact
    /// body bytes otherwise.
    pub fn auto() -> Self {
        Self::with_scheme(Scheme::Auto)
    }

    /// Always canonical JSON, whatever the `Content-Type`: a body that is not JSON is an error.
    pub fn json() -> Self {
        Self::with_scheme(Scheme::Json)
    }

    /// The exact body bytes.
    pub fn raw() -> Self {
        Self::with_scheme(Scheme::Raw)
    }

    /// A route-supplied function returning the canonical bytes to digest (for example only the
    /// business fields), with the version number the route assigns to its scheme. Change the
    /// version whenever the function changes what it returns for a payload.
    ///
    /// The method and path are digested with the returned bytes; the query is not: return what
    /// matters of `parts.uri.query()` too (see [the module docs](self#the-query-string)).
    ///
    /// An error from the function rejects the request (a 400).
    pub fn custom<F>(version: u16, f: F) -> Self
    where
        F: Fn(&http::request::Parts, &[u8]) -> Result<Vec<u8>, FingerprintError>
            + Send
            + Sync
            + 'static,
    {
        Self::with_scheme(Scheme::Custom {
            version,
            f: Arc::new(f),
        })
    }

    /// Canonical JSON over the members these JSON pointers name (RFC 6901: `/sku`,
    /// `/shipping/address`; `sku` is `/sku`), whatever the `Content-Type`; the other members do
    /// not count. A pointer to a missing member selects nothing. Pointers go through objects
    /// only (an array is chosen or left out whole).
    ///
    /// The whole body must still be valid JSON (the same checks as [`json`](Self::json)). The
    /// digest covers the choice of pointers: changing them changes every fingerprint of the
    /// route (records saved before then answer as a reused key until they expire).
    ///
    /// ```
    /// use tower_idempotency::fingerprint::Fingerprinter;
    ///
    /// let business = Fingerprinter::json_only(["/sku", "/quantity"]);
    /// let (parts, ()) = http::Request::post("/orders").body(()).unwrap().into_parts();
    /// let first = business.fingerprint(&parts, br#"{"sku":"book","quantity":1,"note":"a"}"#)?;
    /// let retry = business.fingerprint(&parts, br#"{"quantity":1,"sku":"book","note":"b"}"#)?;
    /// assert!(first.matches(&retry));
    /// # Ok::<(), tower_idempotency::fingerprint::FingerprintError>(())
    /// ```
    pub fn json_only<I, S>(pointers: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self::with_scheme(Scheme::Select(Arc::new(select::Selection::new(
            true, pointers,
        ))))
    }

    /// Canonical JSON over every member but those these JSON pointers name (a rotating
    /// credential, a client timestamp); otherwise as [`json_only`](Self::json_only).
    ///
    /// ```
    /// use tower_idempotency::fingerprint::Fingerprinter;
    ///
    /// let fingerprinter = Fingerprinter::json_except(["/sent_at", "/auth/token"]);
    /// let (parts, ()) = http::Request::post("/events").body(()).unwrap().into_parts();
    /// let first = fingerprinter.fingerprint(&parts, br#"{"id":1,"sent_at":"10:00"}"#)?;
    /// let retry = fingerprinter.fingerprint(&parts, br#"{"id":1,"sent_at":"10:05"}"#)?;
    /// let other = fingerprinter.fingerprint(&parts, br#"{"id":2,"sent_at":"10:00"}"#)?;
    /// assert!(first.matches(&retry));
    /// assert!(!first.matches(&other));
    /// # Ok::<(), tower_idempotency::fingerprint::FingerprintError>(())
    /// ```
    pub fn json_except<I, S>(pointers: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self::with_scheme(Scheme::Select(Arc::new(select::Selection::new(
            false, pointers,
        ))))
    }

    /// Maximum JSON nesting depth (default [`DEFAULT_MAX_JSON_DEPTH`]). Has no effect on raw and
    /// custom schemes.
    ///
    /// ```
    /// use tower_idempotency::fingerprint::Fingerprinter;
    ///
    /// let fingerprinter = Fingerprinter::json().with_max_depth(16);
    /// ```
    pub fn with_max_depth(mut self, max_depth: usize) -> Self {
        self.max_depth = max_depth;
        self
    }

    /// The fingerprint of a buffered request.
    ///
    /// SHA-256 over a domain-separated encoding of: a tag for the scheme (`json`, `raw` or
    /// `custom`), the canonicalization version, the method, the URI path, the canonical query
    /// (built-in schemes, when it is not empty) and the canonical bytes, each field
    /// length-prefixed so fields cannot run into one another. A request of a built-in scheme
    /// without a query is digested exactly as version 1 digested it, version field included.
    ///
    /// The canonical JSON is hashed as it is produced, the bytes [`canonicalize_json`] returns
    /// without building them: the body is read twice (once to check it and measure the canonical
    /// form, whose length is hashed first, once to hash it) and the only memory it takes is four
    /// bytes per member of the objects being written, to sort their keys.
    pub fn fingerprint(
        &self,
        parts: &http::request::Parts,
        body: &[u8],
    ) -> Result<Fingerprint, FingerprintError> {
        let (tag, json) = match &self.scheme {
            Scheme::Auto if is_json_content_type(&parts.headers) => ("json", true),
            Scheme::Json => ("json", true),
            Scheme::Auto | Scheme::Raw => ("raw", false),
            Scheme::Select(selection) => {
                let canonical = selection.canonical(body, self.max_depth)?;
                let query = canonical_query(parts.uri.query());
                let version = CANONICALIZATION_VERSION;
                let mut hasher = fields(selection.tag(), version, parts, Some(&query));
                field(&mut hasher, selection.spec());
                field(&mut hasher, &canonical);
                return Ok(Fingerprint::new(version, hasher.finalize().into()));
            }
            Scheme::Custom { version, f } => {
                let canonical = f(parts, body)?;
                let mut hasher = fields("custom", *version, parts, None);
                field(&mut hasher, &canonical);
                return Ok(Fingerprint::new(*version, hasher.finalize().into()));
            }
        };
        // The fields before the body are hashed first; the body then goes to the digest version 1
        // gives the request (no query) and, with a query only, to the current one as well.
        let hash_body = |hashers: &mut [Sha256]| {
            if json {
                streaming::hash_canonical_json(body, self.max_depth, hashers)
            } else {
                for hasher in hashers {
                    field(hasher, body);
                }
                Ok(())
            }
        };
        let path_only = fields(tag, PATH_ONLY_VERSION, parts, None);
        let query = canonical_query(parts.uri.query());
        if query.is_empty() {
            let mut hashers = [path_only];
            hash_body(&mut hashers)?;
            let [path_only] = hashers;
            let digest: [u8; 32] = path_only.finalize().into();
            return Ok(Fingerprint {
                version: CANONICALIZATION_VERSION,
                digest,
                path_only: Some(digest),
            });
        }
        let with_query = fields(tag, CANONICALIZATION_VERSION, parts, Some(&query));
        let mut hashers = [path_only, with_query];
        hash_body(&mut hashers)?;
        let [path_only, with_query] = hashers;
        Ok(Fingerprint {
            version: CANONICALIZATION_VERSION,
            digest: with_query.finalize().into(),
            path_only: Some(path_only.finalize().into()),
        })
    }
}

/// A hasher fed the fields of a fingerprint before the canonical bytes, in order, each
/// prefixed with its length (8 bytes, big-endian); `query` only where the version has one. The
/// canonical bytes are the last field (see [`field`]).
fn fields(tag: &str, version: u16, parts: &http::request::Parts, query: Option<&[u8]>) -> Sha256 {
    let mut hasher = started(tag, version);
    field(&mut hasher, parts.method.as_str().as_bytes());
    field(&mut hasher, parts.uri.path().as_bytes());
    if let Some(query) = query {
        field(&mut hasher, query);
    }
    hasher
}

/// The tags of the built-in schemes, whose [`started`] hashers are kept.
const BUILT_IN_TAGS: [&str; 4] = ["json", "raw", "json-only", "json-except"];

/// A hasher fed the fields that every request of a scheme and version shares: the domain, the
/// tag and the version (67 bytes: SHA-256 has compressed its first block). The built-in
/// schemes' are computed once and cloned: the digest is the same, one block fewer to hash per
/// request.
fn started(tag: &str, version: u16) -> Sha256 {
    fn start(tag: &str, version: u16) -> Sha256 {
        let mut hasher = Sha256::new();
        field(&mut hasher, DOMAIN);
        field(&mut hasher, tag.as_bytes());
        field(&mut hasher, &version.to_be_bytes());
        hasher
    }
    type Started = Vec<(&'static str, u16, Sha256)>;
    static STARTED: OnceLock<Started> = OnceLock::new();
    let built_in = STARTED.get_or_init(|| {
        BUILT_IN_TAGS
            .iter()
            .flat_map(|&tag| {
                [PATH_ONLY_VERSION, CANONICALIZATION_VERSION]
                    .map(|version| (tag, version, start(tag, version)))
            })
            .collect()
    });
    built_in
        .iter()
        .find(|(built_in, v, _)| *built_in == tag && *v == version)
        .map_or_else(|| start(tag, version), |(_, _, hasher)| hasher.clone())
}

/// One field of a fingerprint: its length (8 bytes, big-endian), then its bytes.
fn field(hasher: &mut Sha256, bytes: &[u8]) {
    hasher.update((bytes.len() as u64).to_be_bytes());
    hasher.update(bytes);
}

/// The canonical query: its `application/x-www-form-urlencoded` pairs in order, each name and
/// value decoded and length-prefixed (8 bytes, big-endian). Empty when there are no pairs.
fn canonical_query(query: Option<&str>) -> Vec<u8> {
    let mut out = Vec::new();
    for pair in query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
    {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        for part in [name, value] {
            let decoded = form_decode(part);
            out.extend_from_slice(&(decoded.len() as u64).to_be_bytes());
            out.extend_from_slice(&decoded);
        }
    }
    out
}

/// A form-encoded name or value as bytes: `+` is a space, `%XX` the byte `XX`; a `%` without
/// two hex digits after it is kept.
fn form_decode(input: &str) -> Vec<u8> {
    let bytes = input.as_bytes();
    let hex = |at: usize| {
        bytes
            .get(at)
            .and_then(|b| char::from(*b).to_digit(16))
            .and_then(|d| u8::try_from(d).ok())
    };
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while let Some(&byte) = bytes.get(at) {
        match (byte, hex(at + 1), hex(at + 2)) {
            (b'%', Some(high), Some(low)) => {
                out.push(high << 4 | low);
                at += 3;
            }
            (b'+', _, _) => {
                out.push(b' ');
                at += 1;
            }
            (other, _, _) => {
                out.push(other);
                at += 1;
            }
        }
    }
    out
}

impl Default for Fingerprinter {
    /// [`Fingerprinter::auto`].
    fn default() -> Self {
        Self::auto()
    }
}

impl fmt::Debug for Fingerprinter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("Fingerprinter");
        match &self.scheme {
            Scheme::Auto => debug.field("scheme", &"auto"),
            Scheme::Json => debug.field("scheme", &"json"),
            Scheme::Raw => debug.field("scheme", &"raw"),
            Scheme::Custom { version, .. } => {
                debug.field("scheme", &"custom").field("version", version)
            }
            Scheme::Select(selection) => debug
                .field("scheme", &selection.tag())
                .field("pointers", &String::from_utf8_lossy(selection.spec())),
        };
        debug.field("max_depth", &self.max_depth).finish()
    }
}

/// `application/json` or `application/*+json`, ignoring parameters and case.
fn is_json_content_type(headers: &HeaderMap) -> bool {
    let Some(value) = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or_default().trim();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    let subtype = subtype.to_ascii_lowercase();
    kind.eq_ignore_ascii_case("application")
        && (subtype == "json" || (subtype.ends_with("+json") && subtype.len() > "+json".len()))
}

#[cfg(test)]
mod tests;
