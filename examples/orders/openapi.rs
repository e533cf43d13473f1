//! `GET /openapi.json`: the API's OpenAPI document, built with utoipa; the idempotency layer
//! documents what it adds to `POST /orders` with one call (feature `utoipa`).
//!
//! ```text
//! curl -s http://127.0.0.1:3000/openapi.json
//! ```

use axum::http::header::CONTENT_TYPE;
use axum::routing::get;
use axum::Router;
use serde_json::json;
use tower_idempotency::IdempotencyLayer;
use utoipa::openapi::content::Content;
use utoipa::openapi::header::Header;
use utoipa::openapi::path::{
    HttpMethod, Operation, OperationBuilder, ParameterBuilder, ParameterIn, PathItem,
};
use utoipa::openapi::request_body::RequestBodyBuilder;
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::schema::{ObjectBuilder, Type};
use utoipa::openapi::{InfoBuilder, OpenApi, OpenApiBuilder, PathsBuilder, Required};

use super::BoxError;

/// The `/openapi.json` route, its document built once from `layer` (the layer of
/// `POST /orders`, as configured). Outside the authentication layer: the document is public.
pub(crate) fn routes<St>(layer: &IdempotencyLayer<St>) -> Result<Router, BoxError> {
    let document = document(layer).to_pretty_json()?;
    Ok(Router::new().route(
        "/openapi.json",
        get(move || {
            let document = document.clone();
            async move { ([(CONTENT_TYPE, "application/json")], document) }
        }),
    ))
}

/// The whole API: `POST /orders` as the handler answers it, plus what the layer adds.
pub(crate) fn document<St>(layer: &IdempotencyLayer<St>) -> OpenApi {
    let mut create_order = create_order();
    layer.document(&mut create_order);
    OpenApiBuilder::new()
        .info(InfoBuilder::new().title("orders").version("1"))
        .paths(
            PathsBuilder::new()
                .path("/orders", PathItem::new(HttpMethod::Post, create_order))
                .path("/orders/{id}", PathItem::new(HttpMethod::Get, get_order())),
        )
        .build()
}

fn integer() -> ObjectBuilder {
    ObjectBuilder::new().schema_type(Type::Integer)
}

fn string() -> ObjectBuilder {
    ObjectBuilder::new().schema_type(Type::String)
}

/// `POST /orders` as the handler alone answers it.
fn create_order() -> Operation {
    let order = ObjectBuilder::new()
        .property("sku", string().min_length(Some(1)).max_length(Some(100)))
        .property("quantity", integer().minimum(Some(1)).maximum(Some(100)))
        .required("sku")
        .required("quantity");
    let created = ObjectBuilder::new()
        .property("order_id", integer())
        .required("order_id");
    // Every code the handler sends; `invalid_json` is the body the layer's JSON fingerprinter
    // refuses before the handler runs.
    let invalid = ObjectBuilder::new().property(
        "error",
        string().enum_values(Some([
            "invalid_key_or_sku",
            "invalid_quantity",
            "invalid_json",
        ])),
    );
    OperationBuilder::new()
        .operation_id(Some("create_order"))
        .summary(Some(
            "Create an order; safe to retry with the same Idempotency-Key",
        ))
        .request_body(Some(
            RequestBodyBuilder::new()
                .content("application/json", Content::new(Some(order)))
                .required(Some(Required::True))
                .build(),
        ))
        .response(
            "201",
            ResponseBuilder::new()
                .description("The order was created")
                .header("Location", Header::new(string()))
                .content("application/json", Content::new(Some(created))),
        )
        .response(
            "400",
            ResponseBuilder::new()
                .description("The sku or the quantity is invalid")
                .content("application/json", Content::new(Some(invalid))),
        )
        .response("401", unauthenticated())
        .build()
}

/// `401` from the app's authentication, in front of every route.
fn unauthenticated() -> ResponseBuilder {
    let body = ObjectBuilder::new()
        .property("error", string().enum_values(Some(["unauthenticated"])))
        .required("error");
    ResponseBuilder::new()
        .description("No tenant: the request is not authenticated.")
        .content("application/json", Content::new(Some(body)))
}

/// `GET /orders/{id}`.
fn get_order() -> Operation {
    let order = ObjectBuilder::new()
        .property("order_id", integer())
        .property("sku", string())
        .property("quantity", integer())
        .examples([json!({"order_id": 1, "sku": "book", "quantity": 1})]);
    let not_found = ObjectBuilder::new()
        .property("error", string().enum_values(Some(["not_found"])))
        .required("error");
    OperationBuilder::new()
        .operation_id(Some("get_order"))
        .parameter(
            ParameterBuilder::new()
                .name("id")
                .parameter_in(ParameterIn::Path)
                .required(Required::True)
                .description(Some("The order_id of a 201; anything else is answered 404"))
                .schema(Some(string())),
        )
        .response(
            "200",
            ResponseBuilder::new()
                .description("The caller's own order")
                .content("application/json", Content::new(Some(order))),
        )
        .response(
            "404",
            ResponseBuilder::new()
                .description("No such order of the caller's")
                .content("application/json", Content::new(Some(not_found))),
        )
        .response("401", unauthenticated())
        .build()
}
