//! The axum extractor for the transaction handle (feature `axum`).

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum_core::extract::{FromRequestParts, OptionalFromRequestParts};
use axum_core::response::{IntoResponse, Response};
use http::request::Parts;
use http::{header, HeaderValue, Request, StatusCode};

use crate::layer::Config;

/// Extracts the transaction handle the [`IdempotencyLayer`](crate::IdempotencyLayer) put in
/// the request extensions, such as
/// [`SqliteHandle`](crate::store::sqlite::SqliteHandle).
///
/// ```no_run
/// use tower_idempotency::{extract::Tx, store::sqlite::SqliteHandle};
///
/// async fn create_order(Tx(tx): Tx<SqliteHandle>) -> String {
///     let id = tx
///         .run(|conn| {
///             conn.execute("INSERT INTO orders (sku) VALUES ('book')", [])?;
///             Ok(conn.last_insert_rowid())
///         })
///         .await;
///     format!("{id:?}")
/// }
/// ```
///
/// Only a request the layer handles has a transaction. Without one the extractor fails and
/// the request is answered `500` `{"error":"idempotency_layer_missing"}`, a server-side
/// configuration error, logged at error level:
///
/// - the route is not wrapped by the layer (logged on every request);
/// - the layer passed the request through: no key on a route with
///   [`with_key_required(false)`](crate::IdempotencyLayer::with_key_required), or a method or
///   request the layer does not handle ([`with_methods`](crate::IdempotencyLayer::with_methods),
///   [`with_filter`](crate::IdempotencyLayer::with_filter)). Logged once per layer and cause,
///   with the fix: take `Option<Tx<H>>`.
///
/// `Option<Tx<H>>` is `Some` when the layer handled the request and `None` when it passed it
/// through, so one handler serves both (without a key, write outside any idempotency
/// transaction, through your own pool or connection):
///
/// ```no_run
/// use tower_idempotency::{extract::Tx, store::sqlite::SqliteHandle};
///
/// async fn create_order(tx: Option<Tx<SqliteHandle>>) -> &'static str {
///     match tx {
///         Some(Tx(tx)) => "idempotent: written through the request's transaction",
///         None => "no Idempotency-Key: written without idempotency",
///     }
/// }
/// ```
///
/// On a route that the layer does not wrap at all, `Option<Tx<H>>` fails as `Tx<H>` does
/// (`500`): a missing layer is never mistaken for a request without a key.
#[derive(Clone, Debug)]
pub struct Tx<H>(pub H);

/// Left by the layer in the extensions of a request it passes through to the inner service
/// untouched, so that the extractor can tell that request from one on a route the layer does
/// not wrap.
#[derive(Clone)]
pub(crate) struct PassedThrough {
    /// No key where none is required (else: a method or request the layer does not handle).
    keyless: bool,
    config: Arc<Config>,
}

impl PassedThrough {
    /// Marks `request` as passed through by the layer configured as `config`.
    pub(crate) fn mark<B>(
        mut request: Request<B>,
        keyless: bool,
        config: &Arc<Config>,
    ) -> Request<B> {
        let config = config.clone();
        request
            .extensions_mut()
            .insert(PassedThrough { keyless, config });
        request
    }

    /// Logs, once per layer and cause, that a handler took a plain `Tx<H>` on a request this
    /// layer passed through, and what to do about it.
    fn log_once<H>(&self, parts: &Parts) {
        if !self.config.passed_through_logged.first(self.keyless) {
            tracing::debug!("a request passed through by the layer has no transaction: 500");
            return;
        }
        let handle = std::any::type_name::<H>();
        let operation = self.config.operation.as_deref().unwrap_or("(the path)");
        if self.keyless {
            let key = (self.config.key_extractor.header_name()).map_or("key", |name| name.as_str());
            tracing::error!(
                operation,
                method = %parts.method,
                path = parts.uri.path(),
                "a request without its {key} reached a handler that takes Tx<{handle}>, on a \
                 route whose IdempotencyLayer has with_key_required(false): the layer passes \
                 such a request through without a transaction, and it was answered 500. Fix: \
                 take Option<Tx<{handle}>> (None without a key), or require the key. Logged \
                 once for this layer."
            );
        } else {
            tracing::error!(
                operation,
                method = %parts.method,
                path = parts.uri.path(),
                "a request that the IdempotencyLayer does not handle (its method is not one of \
                 with_methods, or with_filter left it out) reached a handler that takes \
                 Tx<{handle}>: the layer passes it through without a transaction, and it was \
                 answered 500. Fix: take Option<Tx<{handle}>> (None for such a request), or \
                 have the layer handle it. Logged once for this layer."
            );
        }
    }
}

/// Whether a layer has logged a handler's plain `Tx` on a request it passed through
/// ([`PassedThrough`]), for each cause: without a key, or not handled. A changed
/// configuration is another layer: its clone starts afresh.
#[derive(Default)]
pub(crate) struct LoggedOnce([AtomicBool; 2]);

impl LoggedOnce {
    /// Whether this is the first time for this cause (it is logged from now on).
    fn first(&self, keyless: bool) -> bool {
        !self.0[usize::from(keyless)].swap(true, Ordering::Relaxed)
    }
}

impl Clone for LoggedOnce {
    fn clone(&self) -> Self {
        LoggedOnce::default()
    }
}

/// The rejections of [`Tx`], answered `500` with `{"error":"idempotency_layer_missing"}` (see
/// [`Tx`]); nothing to name, hence not exported.
mod rejection {
    use super::*;

    /// The body of every rejection here.
    fn internal_error() -> Response {
        let mut response = Response::new(axum_core::body::Body::from(
            "{\"error\":\"idempotency_layer_missing\"}",
        ));
        *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        response
    }

    /// No transaction: the route is not wrapped by the layer. A server-side configuration
    /// error, answered `500`.
    #[derive(Debug)]
    pub struct MissingTransaction;

    impl fmt::Display for MissingTransaction {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(
                "no idempotency handle of the type the handler takes in the request \
                 extensions: wrap this route with IdempotencyLayer, on the store of that handle \
                 (Tx without with_steps, Steps with it)",
            )
        }
    }

    impl std::error::Error for MissingTransaction {}

    impl IntoResponse for MissingTransaction {
        fn into_response(self) -> Response {
            tracing::error!("{self}");
            internal_error()
        }
    }

    /// The rejection of [`Tx`]: the route is not wrapped, or (for `Tx` but not `Option<Tx>`)
    /// the layer passed the request through. Answered `500`.
    #[derive(Debug)]
    pub enum TxRejection {
        /// The route is not wrapped by the layer: logged on every request.
        NotWrapped(MissingTransaction),
        /// The layer passed the request through: logged once per layer by the extractor.
        PassedThrough,
    }

    impl fmt::Display for TxRejection {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            match self {
                TxRejection::NotWrapped(missing) => missing.fmt(f),
                TxRejection::PassedThrough => f.write_str(
                    "the idempotency layer passed this request through without a transaction \
                     (no key where none is required, or a request it does not handle): take \
                     Option<Tx<..>>",
                ),
            }
        }
    }

    impl std::error::Error for TxRejection {}

    impl IntoResponse for TxRejection {
        fn into_response(self) -> Response {
            match self {
                TxRejection::NotWrapped(missing) => missing.into_response(),
                TxRejection::PassedThrough => internal_error(),
            }
        }
    }
}
pub(crate) use rejection::MissingTransaction;
use rejection::TxRejection;

impl<H, S> FromRequestParts<S> for Tx<H>
where
    H: Clone + Send + Sync + 'static,
    S: Send + Sync,
{
    type Rejection = TxRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        if let Some(handle) = parts.extensions.get::<H>() {
            return Ok(Tx(handle.clone()));
        }
        match parts.extensions.get::<PassedThrough>() {
            Some(passed) => {
                passed.log_once::<H>(parts);
                Err(TxRejection::PassedThrough)
            }
            None => Err(TxRejection::NotWrapped(MissingTransaction)),
        }
    }
}

/// `Option<Tx<H>>`: `None` for a request the layer passed through (see [`Tx`]).
impl<H, S> OptionalFromRequestParts<S> for Tx<H>
where
    H: Clone + Send + Sync + 'static,
    S: Send + Sync,
{
    type Rejection = TxRejection;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        if let Some(handle) = parts.extensions.get::<H>() {
            return Ok(Some(Tx(handle.clone())));
        }
        match parts.extensions.get::<PassedThrough>() {
            Some(_) => Ok(None),
            None => Err(TxRejection::NotWrapped(MissingTransaction)),
        }
    }
}
