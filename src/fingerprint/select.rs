//! JSON fingerprints over chosen members ([`Fingerprinter::json_only`]) or over all members but
//! some ([`Fingerprinter::json_except`]), named by JSON pointer.
//!
//! The body is checked whole first (the same errors as [`canonicalize_json`]: duplicate keys,
//! depth...), then the chosen members are cut out of it as they were written (numbers keep
//! every digit) and canonicalized. The digest covers which members were chosen (the scheme's
//! tag and its pointers), so a route that changes its choice never matches a record of the
//! old one.
//!
//! [`Fingerprinter::json_only`]: super::Fingerprinter::json_only
//! [`Fingerprinter::json_except`]: super::Fingerprinter::json_except
//! [`canonicalize_json`]: super::canonicalize_json

use std::collections::BTreeMap;

use serde_json::value::RawValue;

use super::{canonicalize_json, FingerprintError};

/// Which members count.
#[derive(Clone, Debug)]
pub(super) struct Selection {
    keep_only: bool,
    /// Each pointer as its unescaped reference tokens (`/a~1b/c` is `["a/b", "c"]`).
    pointers: Vec<Vec<String>>,
    /// The pointers as given, for the digest.
    spec: String,
}

impl Selection {
    pub(super) fn new<I, S>(keep_only: bool, pointers: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut given: Vec<String> = pointers
            .into_iter()
            .map(|p| normalize(p.as_ref()))
            .collect();
        given.sort();
        given.dedup();
        let spec = given.join("\n");
        let pointers = given.iter().map(|p| tokens(p)).collect();
        Selection {
            keep_only,
            pointers,
            spec,
        }
    }

    /// The scheme's tag in the digest.
    pub(super) fn tag(&self) -> &'static str {
        if self.keep_only {
            "json-only"
        } else {
            "json-except"
        }
    }

    /// The choice, as digested.
    pub(super) fn spec(&self) -> &[u8] {
        self.spec.as_bytes()
    }

    /// The canonical bytes of the chosen part of `body`.
    pub(super) fn canonical(
        &self,
        body: &[u8],
        max_depth: usize,
    ) -> Result<Vec<u8>, FingerprintError> {
        // Checks the whole document: invalid JSON, duplicate keys and depth are refused as for
        // the whole-body scheme, whatever is chosen.
        canonicalize_json(body, max_depth)?;
        let text = std::str::from_utf8(body).map_err(|_| FingerprintError::InvalidUtf8)?;
        let root: &RawValue = serde_json::from_str(text).map_err(not_json)?;
        let paths: Vec<&[String]> = self.pointers.iter().map(Vec::as_slice).collect();
        let chosen = if self.keep_only {
            keep(root, &paths)?.unwrap_or_else(|| "{}".to_owned())
        } else {
            drop_members(root, &paths)?.unwrap_or_else(|| "null".to_owned())
        };
        canonicalize_json(chosen.as_bytes(), max_depth)
    }
}

/// A pointer as RFC 6901 writes it; a name without the leading `/` is a top-level member.
fn normalize(pointer: &str) -> String {
    if pointer.is_empty() || pointer.starts_with('/') {
        pointer.to_owned()
    } else {
        format!("/{pointer}")
    }
}

fn tokens(pointer: &str) -> Vec<String> {
    pointer
        .split('/')
        .skip(1)
        .map(|token| token.replace("~1", "/").replace("~0", "~"))
        .collect()
}

fn not_json(error: serde_json::Error) -> FingerprintError {
    FingerprintError::Custom(format!("the body is not JSON: {error}"))
}

/// The members of an object, or `None` for any other value. The document was checked for
/// duplicate keys already.
fn members(value: &RawValue) -> Result<Option<BTreeMap<String, &RawValue>>, FingerprintError> {
    if !value.get().trim_start().starts_with('{') {
        return Ok(None);
    }
    serde_json::from_str(value.get())
        .map(Some)
        .map_err(not_json)
}

/// The object of these members, written as JSON.
fn object(members: Vec<(String, String)>) -> String {
    let members: Vec<String> = members
        .into_iter()
        .map(|(name, value)| format!("{}:{value}", serde_json::Value::from(name)))
        .collect();
    format!("{{{}}}", members.join(","))
}

/// The paths that go on under member `name`, without it.
fn under<'p>(paths: &[&'p [String]], name: &str) -> Vec<&'p [String]> {
    paths
        .iter()
        .filter_map(|path| path.split_first())
        .filter(|(first, _)| first.as_str() == name)
        .map(|(_, rest)| rest)
        .collect()
}

/// Only what `paths` point to; `None` when none of them is there.
fn keep(value: &RawValue, paths: &[&[String]]) -> Result<Option<String>, FingerprintError> {
    if paths.iter().any(|path| path.is_empty()) {
        return Ok(Some(value.get().to_owned()));
    }
    let Some(members) = members(value)? else {
        return Ok(None);
    };
    let mut kept = Vec::new();
    for (name, member) in members {
        let rest = under(paths, &name);
        if rest.is_empty() {
            continue;
        }
        if let Some(text) = keep(member, &rest)? {
            kept.push((name, text));
        }
    }
    Ok((!kept.is_empty()).then(|| object(kept)))
}

/// Everything but what `paths` point to; `None` when the value itself is dropped.
fn drop_members(value: &RawValue, paths: &[&[String]]) -> Result<Option<String>, FingerprintError> {
    if paths.iter().any(|path| path.is_empty()) {
        return Ok(None);
    }
    let Some(members) = members(value)? else {
        return Ok(Some(value.get().to_owned()));
    };
    let mut kept = Vec::new();
    for (name, member) in members {
        let rest = under(paths, &name);
        if rest.is_empty() {
            kept.push((name, member.get().to_owned()));
        } else if let Some(text) = drop_members(member, &rest)? {
            kept.push((name, text));
        }
    }
    Ok(Some(object(kept)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canonical(keep_only: bool, pointers: &[&str], body: &str) -> String {
        let selection = Selection::new(keep_only, pointers);
        String::from_utf8(selection.canonical(body.as_bytes(), 128).unwrap()).unwrap()
    }

    #[test]
    fn only_the_chosen_members_count_with_every_digit() {
        let body =
            r#"{"sku":"book","quantity":1,"price":0.10000000000000001,"meta":{"ts":1,"id":"a"}}"#;
        assert_eq!(
            canonical(true, &["/sku", "price", "/meta/id", "/absent"], body),
            r#"{"meta":{"id":"a"},"price":0.10000000000000001,"sku":"book"}"#
        );
        assert_eq!(canonical(true, &["/absent"], body), "{}");
    }

    #[test]
    fn all_members_but_the_excluded_count() {
        let body = r#"{"a/b":1,"meta":{"ts":1,"id":"a"},"list":[{"ts":2}]}"#;
        assert_eq!(
            canonical(false, &["/meta/ts", "/a~1b", "/list/0/ts"], body),
            r#"{"list":[{"ts":2}],"meta":{"id":"a"}}"#
        );
        assert_eq!(canonical(false, &[""], body), "null");
    }

    #[test]
    fn the_whole_body_is_checked_whatever_is_chosen() {
        let selection = Selection::new(true, ["/sku"]);
        let duplicate = br#"{"sku":"a","other":1,"other":2}"#;
        assert_eq!(
            selection.canonical(duplicate, 128),
            Err(FingerprintError::DuplicateKey)
        );
        assert!(selection.canonical(b"[1,", 128).is_err());
    }
}
