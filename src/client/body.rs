//! [`BufferedBody`]: the request body each attempt sends.

use std::convert::Infallible;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};

/// The request body the inner client receives: the caller's body, read once into memory, so
/// that every attempt sends exactly the same bytes (and trailers, if the body had any).
///
/// Cloning is cheap (the bytes are reference-counted). `Debug` prints the length, never the
/// payload, which may hold personal data.
///
/// Build your inner client for this body type: `Client::builder(..).build_http::<BufferedBody>()`
/// for hyper-util's client; for a tonic `Channel`, map it with `tonic::body::Body::new`.
#[derive(Clone, Default)]
pub struct BufferedBody {
    // `None` once sent (or when empty), so that an empty body ends at once.
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl BufferedBody {
    /// A body holding these bytes and no trailers.
    pub fn new(data: impl Into<Bytes>) -> Self {
        Self::with_trailers(data.into(), None)
    }

    pub(crate) fn with_trailers(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        BufferedBody {
            data: (!data.is_empty()).then_some(data),
            trailers,
        }
    }

    /// The bytes this body still has to send (all of them, before it is polled).
    pub fn bytes(&self) -> &[u8] {
        self.data.as_deref().unwrap_or_default()
    }
}

impl From<Bytes> for BufferedBody {
    fn from(data: Bytes) -> Self {
        Self::new(data)
    }
}

impl fmt::Debug for BufferedBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufferedBody")
            .field("len", &self.bytes().len())
            .field("trailers", &self.trailers.is_some())
            .finish()
    }
}

impl Body for BufferedBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        if let Some(data) = this.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.bytes().len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    #[tokio::test]
    async fn sends_its_bytes_then_its_trailers_once() {
        let mut trailers = HeaderMap::new();
        trailers.insert("x-checksum", "abc".parse().expect("header value"));
        let body = BufferedBody::with_trailers(Bytes::from_static(b"hello"), Some(trailers));
        assert_eq!(body.size_hint().exact(), Some(5));
        assert!(!body.is_end_stream());

        let collected = body.clone().collect().await.expect("infallible");
        assert_eq!(
            collected.trailers().and_then(|t| t.get("x-checksum")),
            Some(&"abc".parse().expect("header value"))
        );
        assert_eq!(collected.to_bytes(), "hello");
        // The clone kept its own copy: every attempt sends the same bytes.
        assert_eq!(body.bytes(), b"hello");
    }

    #[test]
    fn an_empty_body_ends_at_once_and_debug_hides_the_payload() {
        let empty = BufferedBody::new(Bytes::new());
        assert!(empty.is_end_stream());
        assert_eq!(empty.size_hint().exact(), Some(0));

        let secret = BufferedBody::new("card=4111111111111111");
        let printed = format!("{secret:?}");
        assert!(!printed.contains("4111"), "{printed}");
        assert!(printed.contains("len: 21"), "{printed}");
    }
}
