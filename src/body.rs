//! The body types the layer hands to the inner service and returns to the client.
//!
//! Both are our own types so that http-body-util's combinators stay out of the public API.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::BodyExt;
use pin_project_lite::pin_project;

/// A boxed error, as used by bodies passed through untouched.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The request body the inner service receives.
///
/// For requests the layer handles it is the buffered body (the exact bytes that were
/// fingerprinted); for requests passed through untouched (other methods, an optional key
/// that was not sent) it streams the original body.
pub struct RequestBody {
    kind: RequestKind,
}

enum RequestKind {
    Buffered(Option<Bytes>),
    Streaming(UnsyncBoxBody<Bytes, BoxError>),
}

impl RequestBody {
    pub(crate) fn buffered(bytes: Bytes) -> Self {
        let data = if bytes.is_empty() { None } else { Some(bytes) };
        RequestBody {
            kind: RequestKind::Buffered(data),
        }
    }

    pub(crate) fn streaming<B>(body: B) -> Self
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        RequestBody {
            kind: RequestKind::Streaming(body.map_err(Into::into).boxed_unsync()),
        }
    }

    /// An empty body.
    pub fn empty() -> Self {
        Self::buffered(Bytes::new())
    }
}

impl From<Bytes> for RequestBody {
    fn from(bytes: Bytes) -> Self {
        Self::buffered(bytes)
    }
}

impl fmt::Debug for RequestBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            RequestKind::Buffered(data) => f
                .debug_struct("RequestBody::Buffered")
                .field("len", &data.as_ref().map_or(0, Bytes::len))
                .finish(),
            RequestKind::Streaming(_) => f.write_str("RequestBody::Streaming"),
        }
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.get_mut().kind {
            RequestKind::Buffered(data) => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            RequestKind::Streaming(body) => Pin::new(body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            RequestKind::Buffered(data) => data.is_none(),
            RequestKind::Streaming(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            RequestKind::Buffered(data) => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            RequestKind::Streaming(body) => body.size_hint(),
        }
    }
}

pin_project! {
    /// The response body the layer returns: the inner service's own body, or bytes the
    /// layer holds (a response it saved, a replay, or an error it answered itself).
    pub struct ResponseBody<B> {
        #[pin]
        kind: ResponseKind<B>,
    }
}

pin_project! {
    #[project = ResponseKindProj]
    enum ResponseKind<B> {
        Inner { #[pin] body: B },
        Full { data: Option<Bytes>, trailers: Option<HeaderMap> },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        ResponseBody {
            kind: ResponseKind::Inner { body },
        }
    }

    pub(crate) fn full(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        let data = if data.is_empty() { None } else { Some(data) };
        ResponseBody {
            kind: ResponseKind::Full { data, trailers },
        }
    }
}

impl<B> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            ResponseKind::Inner { .. } => f.write_str("ResponseBody::Inner"),
            ResponseKind::Full { data, .. } => f
                .debug_struct("ResponseBody::Full")
                .field("len", &data.as_ref().map_or(0, Bytes::len))
                .finish(),
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            ResponseKindProj::Inner { body } => body.poll_frame(cx),
            ResponseKindProj::Full { data, trailers } => {
                if let Some(data) = data.take() {
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(t))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ResponseKind::Inner { body } => body.is_end_stream(),
            ResponseKind::Full { data, trailers } => data.is_none() && trailers.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ResponseKind::Inner { body } => body.size_hint(),
            ResponseKind::Full { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}
