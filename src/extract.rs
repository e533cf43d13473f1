//! The axum extractor for the transaction handle (feature `axum`).

use std::fmt;

use axum_core::extract::FromRequestParts;
use axum_core::response::{IntoResponse, Response};
use http::request::Parts;
use http::{header, HeaderValue, StatusCode};

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
/// Without the layer in front (the route is not wrapped, or the request was passed through
/// without a key) the extractor fails and the request is answered `500`: a server-side
/// configuration error.
#[derive(Clone, Debug)]
pub struct Tx<H>(pub H);

/// The rejection of [`Tx`], answered `500` with `{"error":"idempotency_layer_missing"}` (see
/// [`Tx`]); nothing to name, hence not exported.
mod rejection {
    use super::*;

    /// The rejection of [`Tx`]: the route is not wrapped by the layer, or the request was passed
    /// through without a key. A server-side configuration error, answered `500`.
    #[derive(Debug)]
    pub struct MissingTransaction;

    impl fmt::Display for MissingTransaction {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(
                "no idempotency transaction in the request extensions: wrap this route with \
                 IdempotencyLayer (and require the Idempotency-Key)",
            )
        }
    }

    impl std::error::Error for MissingTransaction {}

    impl IntoResponse for MissingTransaction {
        fn into_response(self) -> Response {
            tracing::error!("{self}");
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
    }
}
pub(crate) use rejection::MissingTransaction;

impl<H, S> FromRequestParts<S> for Tx<H>
where
    H: Clone + Send + Sync + 'static,
    S: Send + Sync,
{
    type Rejection = MissingTransaction;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<H>()
            .cloned()
            .map(Tx)
            .ok_or(MissingTransaction)
    }
}
