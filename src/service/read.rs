//! Reading bodies: the request body buffered within the layer's limits and deadline (the body
//! and the head then given memory of their own), and the response body captured to be saved.

use super::*;

/// Buffers the request body under the limit and the timeout.
///
/// An oversized body is drained (read and discarded) up to the drain limit so that the client,
/// still sending, gets to read the `413` rather than a reset connection.
pub(super) async fn read_body<B>(
    body: B,
    headers: &HeaderMap,
    config: &Config,
) -> Result<Bytes, Rejection>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let deadline = config.body_deadline();
    let mut body = std::pin::pin!(body);
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(length) = declared {
        if length > config.body_limit as u64 {
            if length <= config.drain_limit as u64 {
                drain(body.as_mut(), 0, config.drain_limit, deadline).await;
            }
            return Err(Rejection::BodyTooLarge);
        }
    }

    let expected = declared.map_or(0, |length| length as usize);
    let mut joined = Joined::default();
    let mut total = 0usize;
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.as_mut().frame()).await {
            Err(_) => return Err(Rejection::BodyTimeout),
            Ok(None) => break,
            Ok(Some(Err(_))) => return Err(Rejection::BodyRead),
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue; // request trailers are not part of the payload
        };
        total = total.saturating_add(data.len());
        if total > config.body_limit {
            drain(body.as_mut(), total, config.drain_limit, deadline).await;
            return Err(Rejection::BodyTooLarge);
        }
        joined.push(data, expected);
    }
    Ok(joined.into_owned_bytes())
}

/// Gives the request head memory of its own, so that a request waiting for the store holds
/// its head and body and nothing more (the body: [`Joined::into_owned_bytes`]).
///
/// A server parses the URI and the header values as views into the connection's read buffer
/// (hyper does), which holds the body as well when it came in the same read. A request that
/// keeps a view keeps the whole buffer, 8 KiB and up to several hundred as the server's reads
/// grow, and the connection allocates another for its next read (hyper reads on while a
/// request runs). The header values are copied into one allocation, the URI into another;
/// axum's `OriginalUri`, which its router adds before any route layer, gets the copied URI
/// too. Another extension that keeps a view into the buffer (one a server or middleware adds
/// before the layer) still keeps it: the layer cannot copy what it cannot name.
pub(super) fn detach_head(parts: &mut request::Parts) {
    let total: usize = parts.headers.values().map(HeaderValue::len).sum();
    if total > 0 {
        let mut all = BytesMut::with_capacity(total);
        for value in parts.headers.values() {
            all.extend_from_slice(value.as_bytes());
        }
        let all = all.freeze();
        let mut at = 0;
        for value in parts.headers.values_mut() {
            let len = value.len();
            // The bytes were a valid value: their copy is too (else the view is kept).
            if let Ok(mut copy) = HeaderValue::from_maybe_shared(all.slice(at..at + len)) {
                copy.set_sensitive(value.is_sensitive());
                *value = copy;
            }
            at += len;
        }
    }
    let uri = detached_uri(&parts.uri);
    #[cfg(feature = "axum")]
    if let Some(original) = parts.extensions.get_mut::<axum::extract::OriginalUri>() {
        let copy = match &uri {
            Some(uri) if original.0 == parts.uri => Some(uri.clone()),
            _ => detached_uri(&original.0),
        };
        if let Some(copy) = copy {
            original.0 = copy;
        }
    }
    if let Some(uri) = uri {
        parts.uri = uri;
    }
}

/// `uri` in memory of its own, if it reads back the same.
fn detached_uri(uri: &http::Uri) -> Option<http::Uri> {
    let copy = http::Uri::from_maybe_shared(Bytes::from(uri.to_string())).ok()?;
    (copy == *uri).then_some(copy)
}

/// A body's chunks joined as they arrive. The first is kept as it came (the common case: the
/// whole body, without a copy or an allocation until it is whole, see
/// [`Joined::into_owned_bytes`]); later ones are copied into one buffer.
/// Keeping every chunk would let a client that sends one-byte chunks make the server hold a
/// `Bytes` (and the read buffer behind it) per byte: about 30 times the body limit.
#[derive(Default)]
pub(super) struct Joined {
    first: Option<Bytes>,
    joined: BytesMut,
}

impl Joined {
    /// Adds `data`; `expected` is the whole body's length if known (0 if not), reserved at
    /// the first copy.
    pub(super) fn push(&mut self, data: Bytes, expected: usize) {
        if data.is_empty() {
            return;
        }
        match self.first.take() {
            None if self.joined.is_empty() => self.first = Some(data),
            earlier => {
                if let Some(earlier) = earlier {
                    self.joined
                        .reserve(expected.max(earlier.len() + data.len()));
                    self.joined.extend_from_slice(&earlier);
                }
                self.joined.extend_from_slice(&data);
            }
        }
    }

    /// The joined body.
    pub(super) fn into_bytes(self) -> Bytes {
        self.first.unwrap_or_else(|| self.joined.freeze())
    }

    /// The joined body in memory of its own: a body that came in one chunk is copied (once
    /// it is whole, so the copy is the body's exact size), as that chunk is most likely a
    /// view into the connection's read buffer (see [`detach_head`]).
    pub(super) fn into_owned_bytes(self) -> Bytes {
        match self.first {
            Some(first) => Bytes::copy_from_slice(&first),
            None => self.joined.freeze(),
        }
    }
}

/// Reads and discards the body until it ends, `limit` bytes have been seen in all, or the
/// deadline (capped at a few seconds) passes.
pub(super) async fn drain<B>(
    mut body: Pin<&mut B>,
    mut seen: usize,
    limit: usize,
    deadline: Instant,
) where
    B: Body<Data = Bytes>,
{
    let deadline = deadline.min(Instant::now() + Duration::from_secs(5));
    while seen <= limit {
        match tokio::time::timeout_at(deadline, body.as_mut().frame()).await {
            Ok(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    seen = seen.saturating_add(data.len());
                }
            }
            _ => return,
        }
    }
}

/// Buffers the handler's response body (and trailers) so it can be saved.
pub(super) async fn collect_response<B>(
    body: B,
    limit: usize,
) -> Result<(Bytes, Option<HeaderMap>), Rejection>
where
    B: Body<Data = Bytes>,
{
    // What the body says it holds, reserved if it comes in several chunks.
    let expected = usize::try_from(body.size_hint().lower()).map_or(limit, |n| n.min(limit));
    let mut body = std::pin::pin!(body);
    let mut joined = Joined::default();
    let mut total = 0usize;
    let mut trailers: Option<HeaderMap> = None;
    while let Some(frame) = body.as_mut().frame().await {
        let frame = frame.map_err(|_| Rejection::ResponseBody)?;
        match frame.into_data() {
            Ok(data) => {
                total = total.saturating_add(data.len());
                if total > limit {
                    return Err(Rejection::ResponseTooLarge);
                }
                joined.push(data, expected);
            }
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    trailers.get_or_insert_with(HeaderMap::new).extend(t);
                }
            }
        }
    }
    Ok((joined.into_bytes(), trailers))
}
