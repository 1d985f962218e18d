//! crabd's API as `api/openapi.json` describes it, for tests: check a
//! message against its component schema, find which schema a route takes
//! and answers. Here, in the test harness, so that no client of crab-api
//! links a JSON Schema validator.
//!
//! OpenAPI 3.0 schemas are not quite JSON Schema: they are converted (see
//! [`to_json_schema`]) and then checked by the `jsonschema` crate as
//! draft 2020-12.

use std::sync::OnceLock;

use serde_json::{json, Map, Value};

/// The spec's text.
pub const SPEC_TEXT: &str = include_str!("../../api/openapi.json");

/// The parsed spec.
pub fn spec() -> &'static Value {
    static SPEC: OnceLock<Value> = OnceLock::new();
    SPEC.get_or_init(|| serde_json::from_str(SPEC_TEXT).expect("openapi.json is JSON"))
}

/// The spec's component schemas, converted to JSON Schema.
fn json_schemas() -> &'static Value {
    static SCHEMAS: OnceLock<Value> = OnceLock::new();
    SCHEMAS.get_or_init(|| {
        let schemas = spec()["components"]["schemas"]
            .as_object()
            .expect("components/schemas");
        Value::Object(
            schemas
                .iter()
                .map(|(name, s)| (name.clone(), to_json_schema(s)))
                .collect(),
        )
    })
}

/// An OpenAPI 3.0 schema as draft 2020-12 JSON Schema:
/// `nullable: true` adds `"null"` to `type` (it means nothing without a
/// `type`, as OpenAPI 3.0.3 says), `format: int32` bounds an integer, and
/// the keywords JSON Schema lacks (`discriminator`, `example`) go. `$ref`s
/// stay: they point into `#/components/schemas`, kept at the same place in
/// the document [`validate`] builds.
pub fn to_json_schema(schema: &Value) -> Value {
    match schema {
        Value::Object(map) => {
            let mut out = Map::new();
            for (key, value) in map {
                let converted = match key.as_str() {
                    "nullable" | "discriminator" | "example" => continue,
                    // Values, not schemas.
                    "enum" | "default" | "required" => value.clone(),
                    // Names, each with a schema.
                    "properties" => Value::Object(
                        value
                            .as_object()
                            .into_iter()
                            .flatten()
                            .map(|(name, s)| (name.clone(), to_json_schema(s)))
                            .collect(),
                    ),
                    _ => to_json_schema(value),
                };
                out.insert(key.clone(), converted);
            }
            if map.get("nullable") == Some(&Value::Bool(true)) {
                if let Some(Value::String(t)) = map.get("type") {
                    out.insert("type".into(), json!([t, "null"]));
                }
            }
            if map.get("type") == Some(&json!("integer")) && map.get("format") == Some(&json!("int32")) {
                let min = map.get("minimum").and_then(Value::as_i64).unwrap_or(i64::MIN);
                let max = map.get("maximum").and_then(Value::as_i64).unwrap_or(i64::MAX);
                out.insert("minimum".into(), json!(min.max(i32::MIN.into())));
                out.insert("maximum".into(), json!(max.min(i32::MAX.into())));
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(items.iter().map(to_json_schema).collect()),
        other => other.clone(),
    }
}

/// Checks `value` against component schema `schema_name`, as the spec
/// means it: objects open to fields it does not name.
///
/// # Errors
/// Each way `value` breaks the schema, one per line (or that no such schema
/// exists).
pub fn validate(schema_name: &str, value: &Value) -> Result<(), String> {
    check(schema_name, value, false)
}

/// [`validate`], and refuses fields the schema does not name on the
/// outermost object (nested objects stay open: check their types on their
/// own). Catches a field added to a message type and not to the spec.
///
/// # Errors
/// As [`validate`].
pub fn validate_strict(schema_name: &str, value: &Value) -> Result<(), String> {
    check(schema_name, value, true)
}

fn check(schema_name: &str, value: &Value, strict: bool) -> Result<(), String> {
    if json_schemas().get(schema_name).is_none() {
        return Err(format!("openapi.json has no schema {schema_name:?}"));
    }
    let mut root = json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$ref": format!("#/components/schemas/{schema_name}"),
        "components": { "schemas": json_schemas() },
    });
    if strict {
        root["unevaluatedProperties"] = json!(false);
    }
    let validator = jsonschema::draft202012::options()
        .should_validate_formats(false)
        .build(&root)
        .map_err(|e| format!("schema {schema_name}: {e}"))?;
    let errors: Vec<String> = validator
        .iter_errors(value)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect();
    match errors.is_empty() {
        true => Ok(()),
        false => Err(format!("{schema_name}: {}", errors.join("\n"))),
    }
}

/// `$ref` `value` resolved once, if it is one (`#/components/…` only).
pub fn resolve(value: &Value) -> &Value {
    match value.get("$ref").and_then(Value::as_str) {
        Some(r) => {
            let pointer = r.strip_prefix('#').expect("a local $ref");
            spec().pointer(pointer).unwrap_or_else(|| panic!("{r} resolves"))
        }
        None => value,
    }
}

/// The component schema's name in `#/components/schemas/NAME`.
pub fn schema_name_of(schema: &Value) -> Option<&'static str> {
    let r = schema.get("$ref")?.as_str()?;
    let name = r.strip_prefix("#/components/schemas/")?;
    // The spec is 'static: find the same name there.
    spec()["components"]["schemas"]
        .as_object()?
        .keys()
        .find(|k| k.as_str() == name)
        .map(String::as_str)
}

/// The operation `method` on `pattern` (a [`crab_api::routes`] pattern).
pub fn operation(method: &str, pattern: &str) -> Option<&'static Value> {
    spec()["paths"].get(pattern)?.get(method.to_ascii_lowercase())
}

/// The name of the component schema of the body that `method` on
/// `pattern` (a [`crab_api::routes`] pattern) answers with `status` (`"200"`,
/// `"404"`, …): the JSON body's, or a JSON-lines stream's one line's.
/// `None` when the spec has no such answer or its body is not described by
/// a component (an archive).
pub fn response_schema(method: &str, pattern: &str, status: &str) -> Option<&'static str> {
    let response = resolve(operation(method, pattern)?["responses"].get(status)?);
    let content = response.get("content")?;
    let media = content
        .get("application/json")
        .or_else(|| content.get("application/x-ndjson"))?;
    schema_name_of(&media["schema"])
}

/// The name of the component schema of `method` on `pattern`'s JSON request
/// body, if it takes one described by a component.
pub fn request_schema(method: &str, pattern: &str) -> Option<&'static str> {
    let body = resolve(operation(method, pattern)?.get("requestBody")?);
    schema_name_of(&body["content"].get("application/json")?["schema"])
}

/// The [`crab_api::routes`] pattern that concrete `path` (query left out)
/// matches, if any: `{…}` segments match any one segment.
pub fn pattern_of(path: &str) -> Option<&'static str> {
    let path = path.split('?').next().unwrap_or_default();
    let segments: Vec<&str> = path.split('/').collect();
    crab_api::routes::ALL.iter().map(|(p, _)| *p).find(|pattern| {
        let parts: Vec<&str> = pattern.split('/').collect();
        parts.len() == segments.len()
            && parts
                .iter()
                .zip(&segments)
                .all(|(p, s)| (p.starts_with('{') && !s.is_empty()) || p == s)
    })
}

/// Checks crabd's answer `body` with `status` to `method path` against
/// the spec: the route and the status must be described, and the body
/// must validate against the answer's schema, naming no field it does not
/// ([`validate_strict`]).
///
/// # Errors
/// What the spec does not describe, or how the body breaks it.
pub fn check_answer(method: &str, path: &str, status: u16, body: &Value) -> Result<(), String> {
    let pattern = pattern_of(path).ok_or_else(|| format!("{path} is no route of openapi.json"))?;
    let schema = response_schema(method, pattern, &status.to_string()).ok_or_else(|| {
        format!("openapi.json has no {status} answer with a JSON body for {method} {pattern}")
    })?;
    validate_strict(schema, body)
}

/// Checks a request `body` for `method path` against the spec.
///
/// # Errors
/// What the spec does not describe, or how the body breaks it.
pub fn check_request(method: &str, path: &str, body: &Value) -> Result<(), String> {
    let pattern = pattern_of(path).ok_or_else(|| format!("{path} is no route of openapi.json"))?;
    match request_schema(method, pattern) {
        Some(schema) => validate(schema, body),
        None if body.is_null() => Ok(()),
        None => Err(format!("{method} {pattern} takes no JSON body")),
    }
}
