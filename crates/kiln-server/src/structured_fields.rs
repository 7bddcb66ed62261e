//! The structured-output fields of a request, in OpenAI's and vLLM's spellings, turned into one
//! [`StructuredOutput`] and the name of the parameter that asked for it (errors name it):
//!
//! - `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`,
//!   `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`;
//! - `structured_outputs` (vLLM): exactly one of `json` (a schema, as an object or a string),
//!   `regex`, `choice`, `grammar` (Lark, or GBNF as llama.cpp and xgrammar write it),
//!   `json_object: true`;
//! - vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
//! - llama-server's `json_schema` (a schema object) and `grammar` (GBNF).
//!
//! JSON schemas are strict ([`crate::closed_schema`]): an object's undeclared keys are refused
//! unless the schema admits them; `response_format.json_schema.strict: false` or
//! `structured_outputs.disable_additional_properties: false` keep JSON Schema's permissive
//! reading for that request.
//!
//! JSON may carry whitespace between tokens (as vLLM's default; the engine bounds each run);
//! `structured_outputs.disable_any_whitespace: true` makes it compact, also the JSON of
//! `response_format` or `guided_json` when `structured_outputs` holds only such options. At
//! most one constraint may be given; anything else in them (an unknown `type` or key, a
//! `structural_tag`, a `whitespace_pattern`) is refused, never ignored.

use std::sync::Arc;

use kiln_core::StructuredOutput;
use kiln_engine::{CompiledOutput, PrepareError};
use serde_json::Value;

use crate::error::ApiError;
use crate::protocol::SamplingFields;
use crate::state::Loaded;
use crate::validate::GenerationSpec;

/// Longest schema, regex or grammar text accepted, in bytes (compilation is bounded too).
pub const MAX_GRAMMAR_BYTES: usize = 256 * 1024;

/// The request's structured output, with the parameter it came from; `None` without one.
pub fn structured_output(
    f: &mut SamplingFields,
) -> Result<Option<(StructuredOutput, &'static str)>, ApiError> {
    // `structured_outputs` holding only options (`{"disable_any_whitespace": true}`) applies
    // them to the JSON another field asks for.
    let option = |name: &str| {
        f.structured_outputs.as_ref().and_then(|s| s.get(name)).and_then(Value::as_bool)
    };
    let compact = option("disable_any_whitespace").unwrap_or(false);
    let strict = option("disable_additional_properties").unwrap_or(true);
    let given: Vec<(&'static str, Value)> = [
        ("response_format", f.response_format.take()),
        ("structured_outputs", f.structured_outputs.take()),
        ("guided_json", f.guided_json.take()),
        ("guided_regex", f.guided_regex.take()),
        ("guided_choice", f.guided_choice.take()),
        ("guided_grammar", f.guided_grammar.take()),
        ("json_schema", f.json_schema.take()),
        ("grammar", f.grammar.take()),
    ]
    .into_iter()
    .filter_map(|(param, v)| v.filter(|v| !v.is_null()).map(|v| (param, v)))
    .collect();
    let parsed: Vec<(StructuredOutput, &'static str)> = given
        .into_iter()
        .map(|(param, value)| Ok(parse(param, value, strict)?.map(|s| (s, param))))
        .filter_map(Result::transpose)
        .collect::<Result<_, ApiError>>()?;
    match parsed.as_slice() {
        [] => Ok(None),
        [_] if compact => {
            Ok(parsed.into_iter().next().map(|(s, p)| (without_free_whitespace(s), p)))
        }
        [_] => Ok(parsed.into_iter().next()),
        [(_, a), (_, b), ..] => Err(ApiError::bad_param(
            b,
            format!("`{a}` and `{b}` both constrain the output: give only one"),
        )),
    }
}

/// Compiles `spec`'s structured output, if any, on a blocking thread, once for all the
/// request's samples: a schema, regex or grammar that does not compile is a 400 naming its
/// parameter before anything is queued. The engine admits the compiled output as it is.
pub async fn compile(
    loaded: &Arc<Loaded>,
    spec: &GenerationSpec,
) -> Result<Option<CompiledOutput>, ApiError> {
    let (Some(output), Some(param)) = (spec.params.structured.clone(), spec.structured_param)
    else {
        return Ok(None);
    };
    let pending = loaded.grammar.clone();
    // Waits (off the async runtime) for the compiler's background build if it is still running.
    let compiled =
        tokio::task::spawn_blocking(move || CompiledOutput::compile(&output, Some(&pending)))
            .await
            .map_err(|e| ApiError::internal(format!("grammar compilation failed: {e}")))?;
    match compiled {
        Ok(compiled) => Ok(Some(compiled)),
        Err(PrepareError::Grammar { error, .. }) => {
            Err(bad(param, format!("`{param}` ({}): {error}", output_kind(spec))))
        }
        Err(e) => Err(bad(param, e.to_string())),
    }
}

fn output_kind(spec: &GenerationSpec) -> &'static str {
    spec.params.structured.as_ref().map_or("", StructuredOutput::kind)
}

fn parse(
    param: &'static str,
    value: Value,
    strict: bool,
) -> Result<Option<StructuredOutput>, ApiError> {
    let spec = match param {
        "response_format" => return response_format(value, strict),
        "structured_outputs" => return structured_outputs(value, strict),
        "guided_json" | "json_schema" => schema(param, value, strict)?,
        "guided_regex" => StructuredOutput::Regex(text(param, value)?),
        "guided_choice" => choice(param, value)?,
        _ => StructuredOutput::Grammar(text(param, value)?),
    };
    Ok(Some(spec))
}

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::bad_param(param, message)
}

fn response_format(value: Value, strict: bool) -> Result<Option<StructuredOutput>, ApiError> {
    const P: &str = "response_format";
    let Value::Object(mut obj) = value else {
        return Err(bad(P, "`response_format` must be an object with a `type`"));
    };
    let kind = obj.remove("type");
    let kind = kind.as_ref().and_then(Value::as_str).unwrap_or_default();
    let spec = match kind {
        "text" => None,
        // llama-server's `{"type": "json_object", "schema": {...}}` constrains to the schema.
        "json_object" => match obj.remove("schema").filter(|s| !s.is_null()) {
            Some(s) => Some(schema("response_format.schema", s, strict)?),
            None => Some(StructuredOutput::JsonObject),
        },
        "json_schema" => {
            let Some(Value::Object(mut js)) = obj.remove("json_schema") else {
                return Err(bad(
                    "response_format.json_schema",
                    "`response_format` of type `json_schema` needs a `json_schema` object",
                ));
            };
            // `name` and `description` describe the schema; `strict: false` reads it as
            // JSON Schema does (undeclared keys allowed); the schema is enforced either way.
            let strict = match js.remove("strict") {
                None | Some(Value::Null) => strict,
                Some(Value::Bool(b)) => b,
                Some(_) => {
                    return Err(bad(
                        "response_format.json_schema.strict",
                        "`strict` must be a boolean",
                    ));
                }
            };
            js.remove("name");
            js.remove("description");
            if let Some(key) = js.keys().find(|k| *k != "schema") {
                return Err(bad(
                    "response_format.json_schema",
                    format!(
                        "`response_format.json_schema.{key}` is not supported (supported: name, \
                         description, schema, strict)"
                    ),
                ));
            }
            match js.remove("schema") {
                Some(schema) => {
                    Some(self::schema("response_format.json_schema.schema", schema, strict)?)
                }
                None => {
                    return Err(bad(
                        "response_format.json_schema.schema",
                        "`response_format.json_schema` needs a `schema`",
                    ));
                }
            }
        }
        "" => {
            return Err(bad(
                P,
                "`response_format` needs a `type` (text, json_object or json_schema)",
            ));
        }
        other => {
            return Err(bad(
                "response_format.type",
                format!(
                    "`response_format` type {other:?} is not supported (supported: text, \
                     json_object, json_schema)"
                ),
            ));
        }
    };
    if let Some((key, _)) = obj.iter().find(|(_, v)| !v.is_null()) {
        let shown: String = key.chars().take(64).collect();
        return Err(bad(
            P,
            format!("`response_format.{shown}` is not supported with type {kind:?}"),
        ));
    }
    Ok(spec)
}

fn structured_outputs(value: Value, strict: bool) -> Result<Option<StructuredOutput>, ApiError> {
    const P: &str = "structured_outputs";
    let Value::Object(obj) = value else {
        return Err(bad(P, "`structured_outputs` must be an object"));
    };
    let mut found = Vec::new();
    for (key, v) in obj {
        let param: &'static str = match key.as_str() {
            "json" => "structured_outputs.json",
            "regex" => "structured_outputs.regex",
            "choice" => "structured_outputs.choice",
            "grammar" => "structured_outputs.grammar",
            "json_object" => "structured_outputs.json_object",
            // Read above (`compact`), or only about vLLM's fallback between backends.
            "disable_fallback" | "disable_any_whitespace" if v.is_boolean() || v.is_null() => {
                continue;
            }
            // Read above (`strict`).
            "disable_additional_properties" if v.is_boolean() || v.is_null() => continue,
            _ if v.is_null() => continue,
            other => {
                return Err(bad(
                    P,
                    format!(
                        "`structured_outputs.{other}` is not supported (supported: json, regex, \
                         choice, grammar, json_object)"
                    ),
                ));
            }
        };
        let spec = match key.as_str() {
            "json" => schema(param, v, strict)?,
            "regex" => StructuredOutput::Regex(text(param, v)?),
            "choice" => choice(param, v)?,
            "grammar" => StructuredOutput::Grammar(text(param, v)?),
            _ => match v {
                Value::Bool(true) => StructuredOutput::JsonObject,
                Value::Bool(false) => continue,
                _ => return Err(bad(param, "`structured_outputs.json_object` must be a boolean")),
            },
        };
        found.push(spec);
    }
    if found.len() > 1 {
        return Err(bad(
            P,
            "`structured_outputs` must name exactly one of json, regex, choice, grammar, \
             json_object",
        ));
    }
    Ok(found.pop())
}

/// `disable_any_whitespace`: JSON with no whitespace between tokens (llguidance's
/// `x-guidance` options inside the schema); other kinds are unchanged.
fn without_free_whitespace(spec: StructuredOutput) -> StructuredOutput {
    let schema = match &spec {
        StructuredOutput::JsonObject => serde_json::json!({"type": "object"}),
        StructuredOutput::JsonSchema(text) => match serde_json::from_str::<Value>(text) {
            Ok(v @ Value::Object(_)) => v,
            _ => return spec,
        },
        _ => return spec,
    };
    let mut schema = schema;
    if let Some(obj) = schema.as_object_mut() {
        obj.insert("x-guidance".into(), serde_json::json!({"whitespace_flexible": false}));
    }
    StructuredOutput::JsonSchema(schema.to_string())
}

/// A JSON schema given as an object (or `true`/`false`) or as JSON text; `strict`: closed
/// ([`crate::closed_schema`]).
fn schema(param: &str, value: Value, strict: bool) -> Result<StructuredOutput, ApiError> {
    let text = match value {
        Value::String(s) => s,
        v @ (Value::Object(_) | Value::Bool(_)) => v.to_string(),
        _ => return Err(bad(param, format!("`{param}` must be a JSON schema object"))),
    };
    check_len(param, &text)?;
    let mut parsed: Value = serde_json::from_str(&text)
        .map_err(|e| bad(param, format!("`{param}` is not valid JSON: {e}")))?;
    if !(parsed.is_object() || parsed.is_boolean()) {
        return Err(bad(param, format!("`{param}` must be a JSON schema object")));
    }
    if !strict {
        return Ok(StructuredOutput::JsonSchema(text));
    }
    crate::closed_schema::close(&mut parsed);
    Ok(StructuredOutput::JsonSchema(parsed.to_string()))
}

fn text(param: &str, value: Value) -> Result<String, ApiError> {
    match value {
        Value::String(s) if s.is_empty() => Err(bad(param, format!("`{param}` is empty"))),
        Value::String(s) => {
            check_len(param, &s)?;
            Ok(s)
        }
        _ => Err(bad(param, format!("`{param}` must be a string"))),
    }
}

fn choice(param: &str, value: Value) -> Result<StructuredOutput, ApiError> {
    let Value::Array(items) = value else {
        return Err(bad(param, format!("`{param}` must be a list of strings")));
    };
    if items.is_empty() {
        return Err(bad(param, format!("`{param}` must not be empty")));
    }
    let choices = items
        .into_iter()
        .map(|v| match v {
            Value::String(s) if !s.is_empty() => Ok(s),
            _ => Err(bad(param, format!("`{param}` must be a list of non-empty strings"))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    check_len(param, &choices.concat())?;
    Ok(StructuredOutput::Choice(choices))
}

fn check_len(param: &str, text: &str) -> Result<(), ApiError> {
    if text.len() > MAX_GRAMMAR_BYTES {
        return Err(bad(param, format!("`{param}` is longer than {MAX_GRAMMAR_BYTES} bytes")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn fields(body: Value) -> SamplingFields {
        serde_json::from_value(body).unwrap()
    }

    fn parse_body(body: Value) -> Result<Option<(StructuredOutput, &'static str)>, ApiError> {
        structured_output(&mut fields(body))
    }

    #[test]
    fn every_spelling_gives_its_constraint() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let closed = json!({"type": "object", "properties": {"a": {"type": "integer"}},
                            "additionalProperties": false});
        let cases = [
            (json!({"response_format": {"type": "text"}}), None),
            (
                json!({"response_format": {"type": "json_object"}}),
                Some((StructuredOutput::JsonObject, "response_format")),
            ),
            (
                json!({"response_format": {"type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
                Some((StructuredOutput::JsonSchema(closed.to_string()), "response_format")),
            ),
            (
                json!({"response_format": {"type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema, "strict": false}}}),
                Some((StructuredOutput::JsonSchema(schema.to_string()), "response_format")),
            ),
            (
                json!({"guided_json": schema,
                       "structured_outputs": {"disable_additional_properties": false}}),
                Some((StructuredOutput::JsonSchema(schema.to_string()), "guided_json")),
            ),
            (
                json!({"structured_outputs": {"regex": "[0-9]+"}}),
                Some((StructuredOutput::Regex("[0-9]+".into()), "structured_outputs")),
            ),
            (
                json!({"structured_outputs": {"json": schema.to_string()}}),
                Some((StructuredOutput::JsonSchema(closed.to_string()), "structured_outputs")),
            ),
            (
                json!({"guided_choice": ["yes", "no"]}),
                Some((StructuredOutput::Choice(vec!["yes".into(), "no".into()]), "guided_choice")),
            ),
            (
                json!({"guided_grammar": "start: /a+/"}),
                Some((StructuredOutput::Grammar("start: /a+/".into()), "guided_grammar")),
            ),
            (
                json!({"guided_json": schema}),
                Some((StructuredOutput::JsonSchema(closed.to_string()), "guided_json")),
            ),
            // llama-server's spellings.
            (
                json!({"response_format": {"type": "json_object", "schema": schema}}),
                Some((StructuredOutput::JsonSchema(closed.to_string()), "response_format")),
            ),
            (
                json!({"json_schema": schema}),
                Some((StructuredOutput::JsonSchema(closed.to_string()), "json_schema")),
            ),
            (
                json!({"grammar": "root ::= \"a\""}),
                Some((StructuredOutput::Grammar("root ::= \"a\"".into()), "grammar")),
            ),
        ];
        for (body, want) in cases {
            assert_eq!(parse_body(body.clone()).unwrap(), want, "{body}");
        }
    }

    #[test]
    fn malformed_fields_are_refused_naming_the_parameter() {
        let cases = [
            (json!({"response_format": {"type": "xml"}}), "response_format.type"),
            (json!({"response_format": "json"}), "response_format"),
            (json!({"response_format": {"type": "json_schema"}}), "response_format.json_schema"),
            (
                json!({"response_format": {"type": "json_schema",
                    "json_schema": {"schema": {}, "strictness": "high"}}}),
                "response_format.json_schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
                "response_format.json_schema.schema",
            ),
            (json!({"structured_outputs": {"structural_tag": "x"}}), "structured_outputs"),
            (json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs"),
            (json!({"guided_json": "{not json"}), "guided_json"),
            (json!({"guided_json": 3}), "guided_json"),
            (json!({"guided_choice": []}), "guided_choice"),
            (json!({"guided_choice": ["a", 1]}), "guided_choice"),
            (json!({"guided_regex": ""}), "guided_regex"),
            (json!({"response_format": {"type": "text", "schema": {}}}), "response_format"),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}},
                    "strict": true}}),
                "response_format",
            ),
            (json!({"json_schema": "not a schema"}), "json_schema"),
            (
                json!({"guided_regex": "a", "response_format": {"type": "json_object"}}),
                "guided_regex",
            ),
        ];
        for (body, param) in cases {
            let e = parse_body(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
        }
    }
}
