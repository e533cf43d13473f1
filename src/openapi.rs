//! Documents an operation wrapped by the layer in a [utoipa] OpenAPI document (feature
//! `utoipa`): [`IdempotencyLayer::document`].

use http::StatusCode;
use utoipa::openapi::content::Content;
use utoipa::openapi::header::Header;
use utoipa::openapi::path::{Operation, Parameter, ParameterIn};
use utoipa::openapi::response::Response;
use utoipa::openapi::schema::{ObjectBuilder, SchemaFormat, Type};
use utoipa::openapi::{RefOr, Required};

use crate::in_flight::InFlight;
use crate::layer::{Config, ErrorFormat, IdempotencyLayer};
use crate::problem::PROBLEM_JSON;
use crate::response::IDEMPOTENT_REPLAYED;
use crate::service::IDEMPOTENCY_KEY;

impl<St> IdempotencyLayer<St> {
    /// Documents what this layer adds to `operation` (an operation it wraps), as configured:
    ///
    /// - the `Idempotency-Key` header parameter: required or optional, 1 to
    ///   [max](Self::with_max_key_len) visible ASCII characters;
    /// - the `Idempotent-Replayed` header on each 2xx response the operation already documents
    ///   (document your own responses first);
    /// - the layer's own answers (`400`, `401`, `408`, `413`, the reused-key status, `409` for a
    ///   request in flight when the [policy](Self::with_in_flight) answers it, `500`, `503` with
    ///   `Retry-After`), with their bodies: `{"error": code}`, or problem details after
    ///   [`with_problem_details`](Self::with_problem_details); no body schema after a
    ///   [responder of your own](Self::with_error_responder). A status the operation already
    ///   documents keeps its content; the layer's cause is added to its description.
    ///
    /// ```
    /// use utoipa::openapi::path::{HttpMethod, OperationBuilder, PathItem};
    /// use utoipa::openapi::response::ResponseBuilder;
    /// use utoipa::openapi::{OpenApiBuilder, PathsBuilder};
    /// # fn example(layer: tower_idempotency::IdempotencyLayer<()>) {
    ///
    /// let mut create_order = OperationBuilder::new()
    ///     .response("201", ResponseBuilder::new().description("The order"))
    ///     .build();
    /// layer.document(&mut create_order);
    /// let api = OpenApiBuilder::new()
    ///     .paths(PathsBuilder::new().path("/orders", PathItem::new(HttpMethod::Post, create_order)))
    ///     .build();
    /// # let _ = api; }
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "utoipa")))]
    pub fn document(&self, operation: &mut Operation) {
        let config = self.config();
        // A key taken from the body is the body's business: documented with it.
        if let Some(name) = config.key_extractor.header_name() {
            let parameters = operation.parameters.get_or_insert_with(Vec::new);
            parameters.retain(|p| {
                !(p.parameter_in == ParameterIn::Header
                    && p.name.eq_ignore_ascii_case(name.as_str()))
            });
            parameters.push(key_parameter(config, name));
        }

        for (status, response) in operation.responses.responses.iter_mut() {
            if let (true, RefOr::T(response)) = (status.starts_with('2'), response) {
                response
                    .headers
                    .insert("Idempotent-Replayed".to_owned(), replayed_header());
            }
        }
        for (status, cause, retry_after) in answers(config) {
            let key = status.as_str().to_owned();
            match operation.responses.responses.get_mut(&key) {
                Some(RefOr::T(existing)) => {
                    existing.description = format!("{} Also: {cause}", existing.description);
                }
                Some(RefOr::Ref(_)) => {}
                None => {
                    let response = error_response(config, cause, retry_after);
                    operation
                        .responses
                        .responses
                        .insert(key, RefOr::T(response));
                }
            }
        }
    }
}

/// The layer's own answers: status, cause, whether it carries `Retry-After`.
fn answers(config: &Config) -> Vec<(StatusCode, String, bool)> {
    let mut answers = vec![
        (
            StatusCode::BAD_REQUEST,
            format!(
                "The Idempotency-Key is {}malformed, longer than {} characters or sent twice, or \
                 the body is malformed. Nothing was stored.",
                if config.key_required { "missing, " } else { "" },
                config.max_key_len
            ),
            false,
        ),
        (
            StatusCode::UNAUTHORIZED,
            "No tenant: the request is not authenticated.".to_owned(),
            false,
        ),
        (
            StatusCode::REQUEST_TIMEOUT,
            "The body did not arrive in time; retry with the same key.".to_owned(),
            false,
        ),
        (
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("The body is larger than {} bytes.", config.body_limit),
            false,
        ),
        (
            config.conflict_status,
            "The Idempotency-Key was already used with another payload; the first request's \
             result stands."
                .to_owned(),
            false,
        ),
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            "Nothing of the request was kept; retry with the same key.".to_owned(),
            false,
        ),
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "The store stayed busy; retry with the same key after Retry-After.".to_owned(),
            true,
        ),
    ];
    if config.in_flight != InFlight::Wait {
        answers.push((
            StatusCode::CONFLICT,
            "A request with the same Idempotency-Key is still being processed; retry with the \
             same key after Retry-After."
                .to_owned(),
            true,
        ));
    }
    // One entry per status (the reused-key status may be 409 too).
    let mut merged: Vec<(StatusCode, String, bool)> = Vec::new();
    for (status, cause, retry_after) in answers {
        match merged.iter_mut().find(|(s, _, _)| *s == status) {
            Some(entry) => {
                entry.1 = format!("{} Or: {cause}", entry.1);
                entry.2 |= retry_after;
            }
            None => merged.push((status, cause, retry_after)),
        }
    }
    merged
}

fn string() -> ObjectBuilder {
    ObjectBuilder::new().schema_type(Type::String)
}

fn key_parameter(config: &Config, name: &http::HeaderName) -> Parameter {
    // The canonical spelling for the default header, the configured name otherwise.
    let name = if *name == IDEMPOTENCY_KEY {
        "Idempotency-Key"
    } else {
        name.as_str()
    };
    let mut parameter = Parameter::new(name);
    parameter.parameter_in = ParameterIn::Header;
    parameter.required = if config.key_required {
        Required::True
    } else {
        Required::False
    };
    parameter.description = Some(format!(
        "A key the client picks for this operation (a UUID, say) and sends again, unchanged, \
         with every retry of it: the first request runs, retries get its saved response. \
         1 to {} visible ASCII characters, bare or as a quoted string.{}",
        config.max_key_len,
        if config.key_required {
            ""
        } else {
            " Without it, the request runs without idempotency."
        }
    ));
    let schema = string()
        .min_length(Some(1))
        .max_length(Some(config.max_key_len))
        .pattern(Some("^[!-~]+$"));
    parameter.schema = Some(schema.into());
    parameter
}

fn replayed_header() -> Header {
    let schema = string().enum_values(Some(["true"]));
    let mut header = Header::new(schema);
    header.description = Some(format!(
        "`true` when this is the saved response of an earlier request with the same key \
         ({}); absent on the first.",
        IDEMPOTENT_REPLAYED.as_str()
    ));
    header
}

fn error_response(config: &Config, cause: String, retry_after: bool) -> Response {
    let mut response = Response::new(cause);
    if retry_after {
        let mut header = Header::new(ObjectBuilder::new().schema_type(Type::Integer));
        header.description = Some("Seconds to wait before retrying with the same key.".into());
        response.headers.insert("Retry-After".to_owned(), header);
    }
    match &config.error_format {
        ErrorFormat::Json => {
            let body = ObjectBuilder::new()
                .property("error", string().description(Some("A stable code")))
                .required("error");
            response
                .content
                .insert("application/json".to_owned(), Content::new(Some(body)));
        }
        ErrorFormat::Problem => {
            let body = ObjectBuilder::new()
                .description(Some("RFC 9457 problem details"))
                .property("type", string().format(Some(uri())))
                .property("title", string())
                .property("status", ObjectBuilder::new().schema_type(Type::Integer))
                .property("detail", string())
                .property("code", string().description(Some("A stable code")))
                .required("type")
                .required("status");
            response
                .content
                .insert(PROBLEM_JSON.to_owned(), Content::new(Some(body)));
            let link = string().description(Some("The documentation (rel=\"describedby\")"));
            response
                .headers
                .insert("Link".to_owned(), Header::new(link));
        }
        ErrorFormat::Custom => {}
    }
    response
}

/// `format: uri` (utoipa names it only with its `url` feature).
fn uri() -> SchemaFormat {
    SchemaFormat::Custom("uri".to_owned())
}
