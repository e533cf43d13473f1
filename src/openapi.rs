//! Documents an operation wrapped by the layer in a [utoipa] OpenAPI document (feature
//! `utoipa`): [`IdempotencyLayer::document`].

use http::StatusCode;
use utoipa::openapi::content::Content;
use utoipa::openapi::header::Header;
use utoipa::openapi::path::{Operation, Parameter, ParameterIn};
use utoipa::openapi::response::Response;
use utoipa::openapi::schema::{
    AnyOf, Object, ObjectBuilder, Schema, SchemaFormat, SchemaType, Type,
};
use utoipa::openapi::{RefOr, Required};

use crate::error::Rejection;
use crate::fingerprint::FingerprintError;
use crate::in_flight::InFlight;
use crate::key::KeyError;
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
    /// - the layer's own answers (`400`, `401`, `408`, `413`, `414` without an
    ///   [operation name](Self::with_operation), the reused-key status, `409` for a request in
    ///   flight when the [policy](Self::with_in_flight) answers it or a step's outcome in doubt
    ///   under [steps](Self::with_steps), `500`, `503` with `Retry-After`), with their bodies:
    ///   `{"error": code}` with the codes each status may carry, or problem details after
    ///   [`with_problem_details`](Self::with_problem_details); no body schema after a
    ///   [responder of your own](Self::with_error_responder).
    ///
    /// A status the operation already documents keeps its own bodies, and every answer the
    /// layer sends with that status stays valid against the document: the layer's cause is
    /// added to the description, and its body to the content. Where the response documents
    /// JSON `{"error": ...}` with an enum of codes, the layer's codes widen the enum; where it
    /// documents another schema for the layer's media type, the schema becomes `anyOf` its own
    /// and the layer's; a media type it lacks (problem details beside its JSON) is added. A
    /// response given as a `$ref` is left as it is: the layer cannot see what it refers to, so
    /// document those statuses inline, or merge the layer's bodies into the referenced
    /// response yourself. Calling it again on the same operation adds nothing.
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
        for answer in answers(config) {
            let key = answer.status.as_str().to_owned();
            match operation.responses.responses.get_mut(&key) {
                Some(RefOr::T(existing)) => merge(config, &answer, existing),
                Some(RefOr::Ref(_)) => {}
                None => {
                    let mut response = Response::new(answer.cause.clone());
                    merge(config, &answer, &mut response);
                    operation
                        .responses
                        .responses
                        .insert(key, RefOr::T(response));
                }
            }
        }
    }
}

/// One status the layer answers with.
struct Answer {
    status: StatusCode,
    /// Why, for the description.
    cause: String,
    /// The codes of the bodies it sends with this status.
    codes: Vec<&'static str>,
    /// Whether it carries `Retry-After`.
    retry_after: bool,
}

/// The layer's own answers, one per status, from the rejections it can send as configured.
fn answers(config: &Config) -> Vec<Answer> {
    let header_key = config.key_extractor.header_name().is_some();
    let mut key_and_body = Vec::new();
    // Without a header, the key is looked for in the body: missing there, whatever
    // `with_key_required` says.
    if config.key_required || !header_key {
        key_and_body.push(Rejection::MissingKey);
    }
    if header_key {
        key_and_body.push(Rejection::DuplicateKeyHeader);
    }
    key_and_body.extend([
        Rejection::InvalidKey(KeyError::Malformed),
        Rejection::InvalidKey(KeyError::TooLong { max: 0 }),
        Rejection::BodyRead,
    ]);
    key_and_body.extend(
        [
            FingerprintError::InvalidUtf8,
            FingerprintError::InvalidJson {
                offset: 0,
                reason: "",
            },
            FingerprintError::TooDeep { max: 0 },
            FingerprintError::DuplicateKey,
            FingerprintError::NumberOutOfRange,
            FingerprintError::Custom(String::new()),
        ]
        .map(Rejection::InvalidPayload),
    );
    let mut groups = vec![
        (
            key_and_body,
            format!(
                "The Idempotency-Key is {}malformed, longer than {} characters or sent twice, or \
                 the body is malformed. Nothing was stored.",
                if config.key_required { "missing, " } else { "" },
                config.max_key_len
            ),
        ),
        (
            vec![Rejection::MissingTenant],
            "No tenant: the request is not authenticated.".to_owned(),
        ),
        (
            vec![Rejection::BodyTimeout],
            "The body did not arrive in time; retry with the same key.".to_owned(),
        ),
        (
            vec![Rejection::BodyTooLarge],
            format!("The body is larger than {} bytes.", config.body_limit),
        ),
        (
            vec![Rejection::KeyReused],
            "The Idempotency-Key was already used with another payload; the first request's \
             result stands."
                .to_owned(),
        ),
        (
            vec![
                Rejection::HandlerPanicked,
                Rejection::ResponseTooLarge,
                Rejection::ResponseBody,
            ],
            "Nothing of the request was kept; retry with the same key.".to_owned(),
        ),
        (
            vec![Rejection::Busy],
            "The store stayed busy; retry with the same key after Retry-After.".to_owned(),
        ),
    ];
    if config.operation.is_none() {
        groups.push((
            vec![Rejection::OperationTooLong],
            format!(
                "The path, which names the operation, is longer than {} bytes. Nothing was \
                 stored.",
                crate::MAX_OPERATION_LEN
            ),
        ));
    }
    if config.in_flight != InFlight::Wait {
        groups.push((
            vec![Rejection::InFlight],
            "A request with the same Idempotency-Key is still being processed; retry with the \
             same key after Retry-After."
                .to_owned(),
        ));
    }
    if config.steps.is_some() {
        groups.push((
            vec![Rejection::InDoubt],
            "A call this request made to another service has an unknown outcome: the key is in \
             doubt until an operator resolves it."
                .to_owned(),
        ));
    }
    // One answer per status (the reused-key status may be 409 too).
    let mut merged: Vec<Answer> = Vec::new();
    for (rejections, cause) in groups {
        for rejection in &rejections {
            let status = config.status_of(rejection);
            let retry_after = matches!(rejection, Rejection::Busy | Rejection::InFlight);
            let answer = match merged.iter().position(|a| a.status == status) {
                Some(at) => &mut merged[at],
                None => {
                    merged.push(Answer {
                        status,
                        cause: String::new(),
                        codes: Vec::new(),
                        retry_after: false,
                    });
                    merged.last_mut().expect("just pushed")
                }
            };
            if !answer.cause.contains(&cause) {
                answer.cause = match answer.cause.is_empty() {
                    true => cause.clone(),
                    false => format!("{} Or: {cause}", answer.cause),
                };
            }
            if !answer.codes.contains(&rejection.code()) {
                answer.codes.push(rejection.code());
            }
            answer.retry_after |= retry_after;
        }
    }
    merged
}

/// Adds `answer` to `response`: its cause, its headers and its body (see
/// [`IdempotencyLayer::document`]).
fn merge(config: &Config, answer: &Answer, response: &mut Response) {
    if response.description.is_empty() {
        response.description = answer.cause.clone();
    } else if !response.description.contains(&answer.cause) {
        response.description = format!("{} Also: {}", response.description, answer.cause);
    }
    if answer.retry_after && !response.headers.contains_key("Retry-After") {
        let mut header = Header::new(ObjectBuilder::new().schema_type(Type::Integer));
        header.description = Some("Seconds to wait before retrying with the same key.".into());
        response.headers.insert("Retry-After".to_owned(), header);
    }
    let (media_type, body) = match &config.error_format {
        ErrorFormat::Json => ("application/json", json_body(&answer.codes)),
        ErrorFormat::Problem => {
            if !response.headers.contains_key("Link") {
                let link = string().description(Some("The documentation (rel=\"describedby\")"));
                response
                    .headers
                    .insert("Link".to_owned(), Header::new(link));
            }
            (PROBLEM_JSON, problem_body(&answer.codes))
        }
        ErrorFormat::Custom => return,
    };
    match response.content.get_mut(media_type) {
        None => {
            response
                .content
                .insert(media_type.to_owned(), Content::new(Some(body)));
        }
        Some(content) => {
            // No schema: any body, the layer's included.
            if let Some(schema) = content.schema.take() {
                let json = config.error_format == ErrorFormat::Json;
                content.schema = Some(merged_schema(schema, body, json.then_some(&answer.codes)));
            }
        }
    }
}

/// A schema that `existing`'s bodies and the layer's `body` both satisfy: `existing`'s enum of
/// `error` codes widened by `codes` where that suffices (JSON bodies), else `anyOf` both.
fn merged_schema(
    existing: RefOr<Schema>,
    body: Schema,
    codes: Option<&Vec<&'static str>>,
) -> RefOr<Schema> {
    match existing {
        RefOr::T(Schema::AnyOf(mut any)) => {
            let body = RefOr::T(body);
            if !any.items.contains(&body) {
                any.items.push(body);
            }
            RefOr::T(Schema::AnyOf(any))
        }
        RefOr::T(Schema::Object(mut object)) => {
            if codes.is_some_and(|codes| widen(&mut object, codes)) {
                RefOr::T(Schema::Object(object))
            } else {
                any_of(RefOr::T(Schema::Object(object)), body)
            }
        }
        existing => any_of(existing, body),
    }
}

/// `anyOf` `existing` and `body`.
fn any_of(existing: RefOr<Schema>, body: Schema) -> RefOr<Schema> {
    let mut any = AnyOf::new();
    any.items = vec![existing, RefOr::T(body)];
    RefOr::T(Schema::AnyOf(any))
}

/// Adds `codes` to the enum of `object`'s `error` when `object` is `{"error": one of an enum
/// of strings}` and nothing else of it refuses the layer's `{"error": code}`; whether it did.
fn widen(object: &mut Object, codes: &[&'static str]) -> bool {
    let any_or = |schema_type: &SchemaType, of: Type| match schema_type {
        SchemaType::AnyValue => true,
        SchemaType::Type(one) => *one == of,
        SchemaType::Array(types) => types.contains(&of),
    };
    let fits = any_or(&object.schema_type, Type::Object)
        && object.enum_values.is_none()
        && object.required.iter().all(|name| name == "error")
        && object.min_properties.is_none_or(|min| min <= 1)
        && object.max_properties.is_none_or(|max| max >= 1)
        && object.property_names.is_none();
    if !fits {
        return false;
    }
    let Some(RefOr::T(Schema::Object(error))) = object.properties.get_mut("error") else {
        return false;
    };
    let Some(values) = error.enum_values.as_mut() else {
        return false;
    };
    let fits = any_or(&error.schema_type, Type::String)
        && values.iter().all(serde_json::Value::is_string)
        && error.pattern.is_none()
        && error.min_length.is_none()
        && error.max_length.is_none();
    if !fits {
        return false;
    }
    for code in codes {
        let code = serde_json::Value::from(*code);
        if !values.contains(&code) {
            values.push(code);
        }
    }
    true
}

/// `{"error": code}`, one of `codes`.
fn json_body(codes: &[&'static str]) -> Schema {
    ObjectBuilder::new()
        .property(
            "error",
            string()
                .description(Some("A stable code"))
                .enum_values(Some(codes.iter().copied())),
        )
        .required("error")
        .into()
}

/// RFC 9457 problem details, `code` one of `codes`.
fn problem_body(codes: &[&'static str]) -> Schema {
    ObjectBuilder::new()
        .description(Some("RFC 9457 problem details"))
        .property("type", string().format(Some(uri())))
        .property("title", string())
        .property("status", ObjectBuilder::new().schema_type(Type::Integer))
        .property("detail", string())
        .property(
            "code",
            string()
                .description(Some("A stable code"))
                .enum_values(Some(codes.iter().copied())),
        )
        .required("type")
        .required("status")
        .into()
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

/// `format: uri` (utoipa names it only with its `url` feature).
fn uri() -> SchemaFormat {
    SchemaFormat::Custom("uri".to_owned())
}
