//! What is captured from the handler's response, saved, and replayed.

use std::fmt::Write as _;
use std::io::Write as _;

use bytes::Bytes;
use http::header::{self, HeaderName};
use http::{HeaderMap, HeaderValue, Response, StatusCode};

use crate::body::ResponseBody;

/// The header added to every replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// A response as saved in the store and replayed to retries.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SavedResponse {
    /// The status code.
    pub status: StatusCode,
    /// The headers that are replayed (`Location`, `Content-Type` and the allow-list).
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The full body.
    pub body: Bytes,
    /// The trailers, if the response had any (gRPC answers in trailers).
    pub trailers: Option<Vec<(HeaderName, HeaderValue)>>,
}

impl SavedResponse {
    /// A saved response with no trailers (a store of your own builds one from its row).
    pub fn new(status: StatusCode, headers: Vec<(HeaderName, HeaderValue)>, body: Bytes) -> Self {
        SavedResponse {
            status,
            headers,
            body,
            trailers: None,
        }
    }

    /// With these trailers (gRPC answers in trailers).
    pub fn with_trailers(mut self, trailers: Vec<(HeaderName, HeaderValue)>) -> Self {
        self.trailers = Some(trailers);
        self
    }
}

impl SavedResponse {
    /// Builds the replayed response, marked with `Idempotent-Replayed: true`.
    #[cfg(test)]
    pub(crate) fn replay<B>(&self) -> Response<ResponseBody<B>> {
        self.clone().into_replay()
    }

    /// [`replay`](Self::replay), consuming the saved response: its headers and body move into
    /// the response rather than being copied (a record read back is replayed once).
    pub(crate) fn into_replay<B>(self) -> Response<ResponseBody<B>> {
        let trailers = self.trailers.map(to_header_map);
        let mut response = Response::new(ResponseBody::full(self.body, trailers));
        *response.status_mut() = self.status;
        // Sized once: the saved headers, the mark, and the `Content-Length` that the server (or
        // axum's router) adds for a body of known size, which would otherwise grow the map.
        let mut headers = HeaderMap::with_capacity(self.headers.len() + 2);
        for (name, value) in self.headers {
            headers.append(name, value);
        }
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        *response.headers_mut() = headers;
        response
    }

    /// Encodes a header list for storage, byte for byte: a JSON array of `[name, value]` pairs.
    ///
    /// The value is a JSON string when its bytes are UTF-8 (visible ASCII, as every record held
    /// before, or obs-text that is UTF-8, such as a raw `é` in a `Location`), and otherwise an
    /// array of its bytes (`[233]` for a Latin-1 `é`). Records written before byte arrays existed
    /// hold only strings, so they decode as they did. Characters outside ASCII are written as
    /// `\u` escapes, so the text is ASCII whatever the database's encoding.
    pub(crate) fn encode_headers(headers: &[(HeaderName, HeaderValue)]) -> String {
        // Written straight into one buffer (what `serde_json::Value` would print, without
        // building one): the record of every new key goes through here.
        let mut json = Vec::with_capacity(2 + headers.len() * 48);
        json.push(b'[');
        for (i, (name, value)) in headers.iter().enumerate() {
            if i > 0 {
                json.push(b',');
            }
            json.extend_from_slice(b"[\"");
            json.extend_from_slice(name.as_str().as_bytes()); // lowercase token characters
            json.extend_from_slice(b"\",");
            match std::str::from_utf8(value.as_bytes()) {
                Ok(text) => {
                    // Writing JSON into a Vec cannot fail.
                    let _ = serde_json::to_writer(&mut json, text);
                }
                Err(_) => {
                    json.push(b'[');
                    for (j, byte) in value.as_bytes().iter().enumerate() {
                        if j > 0 {
                            json.push(b',');
                        }
                        let _ = write!(json, "{byte}");
                    }
                    json.push(b']');
                }
            }
            json.push(b']');
        }
        json.push(b']');
        // Only JSON text went in (a header name is ASCII, serde_json writes valid UTF-8).
        let json = String::from_utf8(json).unwrap_or_default();
        if json.is_ascii() {
            json
        } else {
            ascii_json(&json)
        }
    }

    /// Decodes what [`SavedResponse::encode_headers`] wrote (in this version or an earlier one).
    pub(crate) fn decode_headers(text: &str) -> Result<Vec<(HeaderName, HeaderValue)>, String> {
        if let Some(headers) = decode_plain_headers(text) {
            return Ok(headers);
        }
        Self::decode_json_headers(text)
    }

    /// [`decode_headers`](Self::decode_headers) through a JSON parser: any valid encoding.
    fn decode_json_headers(text: &str) -> Result<Vec<(HeaderName, HeaderValue)>, String> {
        let pairs: Vec<(String, serde_json::Value)> =
            serde_json::from_str(text).map_err(|e| format!("saved headers: {e}"))?;
        pairs
            .into_iter()
            .map(|(name, value)| {
                let name = HeaderName::try_from(name).map_err(|e| e.to_string())?;
                let value = match value {
                    serde_json::Value::String(text) => HeaderValue::try_from(text),
                    bytes => {
                        let bytes: Vec<u8> = serde_json::from_value(bytes)
                            .map_err(|e| format!("saved header {name}: {e}"))?;
                        HeaderValue::from_bytes(&bytes)
                    }
                }
                .map_err(|e| format!("saved header {name}: {e}"))?;
                Ok((name, value))
            })
            .collect()
    }
}

/// The common case of [`SavedResponse::decode_headers`] without a JSON parser: a list whose
/// names and values are all strings of visible ASCII with nothing escaped
/// (`[["location","/orders/1"]]`), as every record of printable headers is saved. Anything
/// else (escapes, byte arrays, spaces between tokens, a header the `http` crate refuses) is
/// `None`, and goes through the JSON parser, which decides what it means or why it is corrupt.
fn decode_plain_headers(text: &str) -> Option<Vec<(HeaderName, HeaderValue)>> {
    /// The content of a JSON string at the start of `rest` (after its opening quote), if it
    /// is plain visible ASCII, and what follows its closing quote.
    fn plain_string(rest: &[u8]) -> Option<(&[u8], &[u8])> {
        let end = rest.iter().position(|&b| b == b'"')?;
        let (content, after) = rest.split_at(end);
        content
            .iter()
            .all(|&b| (0x20..0x7f).contains(&b) && b != b'\\')
            .then(|| (content, &after[1..]))
    }
    let mut rest = text.as_bytes().strip_prefix(b"[")?;
    let mut headers = Vec::new();
    if let Some(end) = rest.strip_prefix(b"]") {
        return end.is_empty().then_some(headers);
    }
    loop {
        let (name, after) = plain_string(rest.strip_prefix(b"[\"")?)?;
        let (value, after) = plain_string(after.strip_prefix(b",\"")?)?;
        let name = HeaderName::from_bytes(name).ok()?;
        let value = HeaderValue::from_bytes(value).ok()?;
        headers.push((name, value));
        rest = after.strip_prefix(b"]")?;
        match rest.split_first()? {
            (b',', after) => rest = after,
            (b']', []) => return Some(headers),
            _ => return None,
        }
    }
}

/// JSON text with every character outside ASCII escaped (`é` as `\u00e9`, beyond the BMP as a
/// surrogate pair): outside strings, JSON is ASCII already.
fn ascii_json(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            for unit in c.encode_utf16(&mut [0; 2]) {
                let _ = write!(out, "\\u{unit:04x}");
            }
        }
    }
    out
}

fn to_header_map(pairs: Vec<(HeaderName, HeaderValue)>) -> HeaderMap {
    let mut map = HeaderMap::with_capacity(pairs.len());
    for (name, value) in pairs {
        map.append(name, value);
    }
    map
}

/// Headers that are never saved or replayed, whatever the allow-list says: cookies belong to
/// one client session, hop-by-hop headers to one connection, and the length is recomputed.
pub(crate) fn is_never_replayed(name: &HeaderName) -> bool {
    const HOP_BY_HOP: [&str; 6] = [
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "proxy-authenticate",
    ];
    *name == header::SET_COOKIE
        || *name == header::CONTENT_LENGTH
        || *name == header::CONNECTION
        || *name == header::TRANSFER_ENCODING
        || *name == IDEMPOTENT_REPLAYED
        || HOP_BY_HOP.contains(&name.as_str())
}

/// Picks the headers to save from a response: those on the allow-list, minus the ones that
/// are never replayed.
pub(crate) fn select_headers(
    headers: &HeaderMap,
    allowed: &[HeaderName],
) -> Vec<(HeaderName, HeaderValue)> {
    headers
        .iter()
        .filter(|(name, _)| allowed.contains(name) && !is_never_replayed(name))
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_never_keep_cookies() {
        let mut headers = HeaderMap::new();
        headers.insert(header::LOCATION, HeaderValue::from_static("/orders/7"));
        headers.insert(header::SET_COOKIE, HeaderValue::from_static("s=1"));
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("12"));
        let allowed = vec![header::LOCATION, header::SET_COOKIE, header::CONTENT_LENGTH];
        let selected = select_headers(&headers, &allowed);
        assert_eq!(
            selected,
            vec![(header::LOCATION, HeaderValue::from_static("/orders/7"))]
        );
        let text = SavedResponse::encode_headers(&selected);
        assert_eq!(SavedResponse::decode_headers(&text).unwrap(), selected);
    }

    #[test]
    fn header_values_that_are_not_visible_ascii_round_trip_byte_for_byte() {
        let utf8 = HeaderValue::from_bytes("/commandes/été".as_bytes()).unwrap();
        let astral = HeaderValue::from_bytes("🦀 名前".as_bytes()).unwrap();
        let latin1 = HeaderValue::from_bytes(b"/commandes/\xe9t\xe9").unwrap();
        let mixed = HeaderValue::from_bytes(b"a\tb \x80\xff\"\\").unwrap();
        let headers = vec![
            (header::LOCATION, utf8.clone()),
            (HeaderName::from_static("x-latin1"), latin1.clone()),
            (HeaderName::from_static("x-mixed"), mixed.clone()),
            (header::CONTENT_TYPE, HeaderValue::from_static("text/plain")),
            (HeaderName::from_static("x-astral"), astral),
        ];
        let text = SavedResponse::encode_headers(&headers);
        assert_eq!(
            text,
            r#"[["location","/commandes/\u00e9t\u00e9"],["x-latin1",[47,99,111,109,109,97,110,100,101,115,47,233,116,233]],["x-mixed",[97,9,98,32,128,255,34,92]],["content-type","text/plain"],["x-astral","\ud83e\udd80 \u540d\u524d"]]"#
        );
        assert!(text.is_ascii());
        let decoded = SavedResponse::decode_headers(&text).unwrap();
        assert_eq!(decoded, headers);
        assert_eq!(decoded[0].1.as_bytes(), "/commandes/été".as_bytes());
        assert_eq!(decoded[1].1.as_bytes(), b"/commandes/\xe9t\xe9");
    }

    #[test]
    fn plain_values_are_encoded_as_serde_json_writes_them() {
        for value in [
            "/orders/7",
            "application/json",
            "a b",
            "say \"hi\"",
            "back\\slash",
            "tab\there",
            "",
        ] {
            let headers = vec![(header::LOCATION, HeaderValue::from_str(value).unwrap())];
            let expected = serde_json::to_string(&[["location", value]]).unwrap();
            assert_eq!(
                SavedResponse::encode_headers(&headers),
                expected,
                "{value:?}"
            );
            assert_eq!(SavedResponse::decode_headers(&expected).unwrap(), headers);
        }
    }

    #[test]
    fn headers_saved_by_earlier_versions_still_decode() {
        // What version 1 wrote: strings only (it dropped the values that were not visible ASCII).
        let text = r#"[["content-type","application/json"],["location","/orders/1"]]"#;
        assert_eq!(
            SavedResponse::decode_headers(text).unwrap(),
            vec![
                (
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json")
                ),
                (header::LOCATION, HeaderValue::from_static("/orders/1")),
            ]
        );
        assert_eq!(SavedResponse::decode_headers("[]").unwrap(), vec![]);
    }

    #[test]
    fn corrupt_saved_headers_are_errors_not_panics() {
        for text in [
            "",
            "{}",
            r#"[["location"]]"#,
            r#"[["location",1]]"#,
            r#"[["location",[256]]]"#,
            r#"[["location",[-1]]]"#,
            r#"[["location",[10]]]"#,
            r#"[["location","a\nb"]]"#,
            r#"[["bad name","x"]]"#,
        ] {
            assert!(SavedResponse::decode_headers(text).is_err(), "{text}");
        }
    }

    #[test]
    fn plain_headers_decode_as_the_json_parser_reads_them() {
        for text in [
            "[]",
            r#"[["location","/orders/7"]]"#,
            r#"[["content-type","application/json"],["location","/orders/1"],["x-a","a b"]]"#,
            r#"[["Location","/x"]]"#,
            r#"[["x-empty",""]]"#,
        ] {
            assert_eq!(
                decode_plain_headers(text),
                Some(SavedResponse::decode_json_headers(text).unwrap()),
                "{text}"
            );
        }
        // Escapes, byte arrays, spacing, trailing text and what `http` refuses go to the JSON
        // parser, which reads them or says why they are corrupt.
        for text in [
            r#"[["location","/a"b"]]"#,
            r#"[["location","é"]]"#,
            r#"[["x-latin1",[233]]]"#,
            r#"[ ["location","/x"]]"#,
            r#"[["location","/x"]] "#,
            r#"[["location","/x"],]"#,
            r#"[["bad name","x"]]"#,
            "[[\"location\",\"a\tb\"]]",
            "",
            "[",
        ] {
            assert_eq!(decode_plain_headers(text), None, "{text}");
        }
    }

    #[test]
    fn replay_marks_the_response() {
        let saved = SavedResponse {
            status: StatusCode::CREATED,
            headers: vec![(header::LOCATION, HeaderValue::from_static("/orders/1"))],
            body: Bytes::from_static(b"{\"order_id\":1}"),
            trailers: None,
        };
        let response = saved.replay::<http_body_util::Empty<Bytes>>();
        assert_eq!(response.status(), StatusCode::CREATED);
        assert_eq!(response.headers()[header::LOCATION], "/orders/1");
        assert_eq!(response.headers()[IDEMPOTENT_REPLAYED], "true");
    }

    /// A replay's header map has room for the `Content-Length` added after it (by the server,
    /// or by axum's router), for any number of saved headers: adding it does not grow the map.
    #[test]
    fn a_replay_has_room_for_its_content_length() {
        for count in 0..12 {
            let headers = (0..count)
                .map(|i| {
                    let name = HeaderName::try_from(format!("x-saved-{i}")).unwrap();
                    (name, HeaderValue::from_static("v"))
                })
                .collect();
            let saved = SavedResponse::new(StatusCode::CREATED, headers, Bytes::from_static(b"{}"));
            let mut response = saved.into_replay::<http_body_util::Empty<Bytes>>();
            let room = response.headers().capacity();
            response
                .headers_mut()
                .insert(header::CONTENT_LENGTH, HeaderValue::from(2));
            assert_eq!(response.headers().capacity(), room, "{count} saved headers");
        }
    }
}
