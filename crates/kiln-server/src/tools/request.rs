//! A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked and turned into a
//! [`ToolPlan`]: what the template sees, which grammar (if any) the output gets, and how the
//! output becomes `tool_calls`.
//!
//! `tool_choice` as OpenAI and vLLM define it:
//! - `none`: the tools reach the template, the output is text;
//! - `auto` (the default when `tools` is given): free text, parsed by the server's
//!   `--tool-call-parser`; like vLLM, this needs `--enable-auto-tool-choice`, else a 400;
//! - `required`: the output is forced (by a JSON-schema grammar) to a list of at least one call
//!   `[{"name": .., "parameters": {..}}]` of the given tools (at most one without
//!   `parallel_tool_calls`), arguments valid against each tool's `parameters` schema;
//! - `{"type": "function", "function": {"name": N}}`: the output is forced to the arguments
//!   of tool N.
//!
//! Forced JSON is compact (no free whitespace), as OpenAI's `arguments` are, and closed: an
//! object schema that lists `properties` admits no other key unless it says so
//! (`additionalProperties`), as vLLM's default grammar backend and OpenAI's strict tools do.

use serde_json::{Map, Value, json};

use kiln_core::StructuredOutput;

use super::parser::ToolCallParser;
use crate::error::ApiError;

/// Most tools one request may declare.
pub const MAX_TOOLS: usize = 128;

/// What a request asked of tools.
#[derive(Clone, Debug, Default)]
pub struct ToolPlan {
    /// The tools as given (`{"type": "function", "function": {..}}` each), for the template;
    /// `None` without tools.
    pub tools: Option<Vec<Value>>,
    pub output: ToolOutput,
}

/// How a choice's output becomes the answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ToolOutput {
    /// The output is the message's content.
    #[default]
    Text,
    /// Tool calls are parsed out of free text (`tool_choice: auto`); with `parallel: false`
    /// only the first is kept.
    Parsed { parser: ToolCallParser, parallel: bool },
    /// The output is a JSON list of `{"name", "parameters"}` (`tool_choice: required`).
    Required,
    /// The output is the JSON arguments of this function (a named `tool_choice`).
    Named(String),
}

/// The server's tool settings (`--tool-call-parser`, `--enable-auto-tool-choice`).
#[derive(Clone, Copy, Debug, Default)]
pub struct ToolSettings {
    pub parser: Option<ToolCallParser>,
    pub auto_tool_choice: bool,
}

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::bad_param(param, message)
}

/// Checks the fields; returns the plan and the grammar the output must follow (`required` and
/// named choices). `structured_param` names a structured output the request also asked for,
/// which cannot be combined with a forced tool call.
pub fn plan(
    tools: Option<Value>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<&Value>,
    settings: ToolSettings,
    structured_param: Option<&str>,
) -> Result<(ToolPlan, Option<StructuredOutput>), ApiError> {
    let tools = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(bad("tools", "`tools` must be a list of tools")),
    };
    if tools.len() > MAX_TOOLS {
        return Err(bad("tools", format!("at most {MAX_TOOLS} tools per request")));
    }
    let functions = tools.iter().enumerate().map(function).collect::<Result<Vec<_>, _>>()?;
    let parallel = match parallel_tool_calls {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(bad("parallel_tool_calls", "`parallel_tool_calls` must be a boolean"));
        }
    };
    let choice = match tool_choice {
        None | Some(Value::Null) if functions.is_empty() => Choice::None,
        None | Some(Value::Null) => Choice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => Choice::None,
            "auto" => Choice::Auto,
            "required" => Choice::Required,
            other => {
                return Err(bad(
                    "tool_choice",
                    format!(
                        "`tool_choice` {other:?} is not one of none, auto, required, or a named function"
                    ),
                ));
            }
        },
        Some(Value::Object(obj)) => Choice::Named(named_choice(&obj)?),
        Some(_) => return Err(bad("tool_choice", "`tool_choice` must be a string or an object")),
    };
    if functions.is_empty() && !matches!(choice, Choice::None) {
        return Err(bad("tool_choice", "`tool_choice` other than \"none\" needs `tools`"));
    }
    if structured_param.is_some() && matches!(choice, Choice::Required | Choice::Named(_)) {
        let param = structured_param.unwrap_or_default();
        return Err(bad(
            param,
            format!("`{param}` cannot be combined with a `tool_choice` that forces a call"),
        ));
    }
    let (output, grammar) = match choice {
        Choice::None => (ToolOutput::Text, None),
        Choice::Auto => match (settings.auto_tool_choice, settings.parser) {
            (true, Some(parser)) => (ToolOutput::Parsed { parser, parallel }, None),
            _ => {
                return Err(bad(
                    "tool_choice",
                    "\"auto\" tool choice requires --enable-auto-tool-choice and \
                     --tool-call-parser to be set",
                ));
            }
        },
        Choice::Required => (ToolOutput::Required, Some(required_schema(&functions, parallel))),
        Choice::Named(name) => {
            let Some(f) = functions.iter().find(|f| f.name == name) else {
                return Err(bad(
                    "tool_choice",
                    format!("`tool_choice` names function {name:?}, which is not in `tools`"),
                ));
            };
            (ToolOutput::Named(name), Some(compact(f.parameters.clone())))
        }
    };
    let tools = (!tools.is_empty()).then_some(tools);
    Ok((ToolPlan { tools, output }, grammar.map(|s| StructuredOutput::JsonSchema(s.to_string()))))
}

enum Choice {
    None,
    Auto,
    Required,
    Named(String),
}

struct Function {
    name: String,
    /// The `parameters` schema (`{"type": "object"}` when absent).
    parameters: Value,
}

fn function((index, tool): (usize, &Value)) -> Result<Function, ApiError> {
    let at = |m: &str| bad("tools", format!("tools[{index}]: {m}"));
    let Some(tool) = tool.as_object() else {
        return Err(at("a tool must be an object"));
    };
    match tool.get("type").and_then(Value::as_str) {
        Some("function") => {}
        Some(other) => {
            return Err(at(&format!(
                "tools of type {other:?} are not supported (only \"function\")"
            )));
        }
        None => return Err(at("`type` must be \"function\"")),
    }
    let Some(f) = tool.get("function").and_then(Value::as_object) else {
        return Err(at("`function` must be an object"));
    };
    let name = match f.get("name").and_then(Value::as_str) {
        Some(n) if valid_name(n) => n.to_owned(),
        _ => {
            return Err(at("`function.name` must be 1 to 64 letters, digits, `_`, `-` or `.`"));
        }
    };
    let mut parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => return Err(at("`function.parameters` must be a JSON schema object")),
    };
    // A forced call's arguments have no keys the schema does not declare (vLLM's default).
    crate::closed_schema::close(&mut parameters);
    Ok(Function { name, parameters })
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

fn named_choice(obj: &Map<String, Value>) -> Result<String, ApiError> {
    if obj.get("type").and_then(Value::as_str) != Some("function") {
        return Err(bad("tool_choice", "a named `tool_choice` needs `\"type\": \"function\"`"));
    }
    obj.get("function")
        .and_then(|f| f.get("name"))
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| bad("tool_choice", "a named `tool_choice` needs `function.name`"))
}

/// `[{"name": N, "parameters": {..}}, ..]` over the tools, at least one item (exactly one
/// without `parallel`).
fn required_schema(functions: &[Function], parallel: bool) -> Value {
    let items: Vec<Value> = functions
        .iter()
        .map(|f| {
            json!({
                "type": "object",
                "properties": {"name": {"const": f.name}, "parameters": f.parameters},
                "required": ["name", "parameters"],
                "additionalProperties": false,
            })
        })
        .collect();
    let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": items}});
    if !parallel {
        schema["maxItems"] = json!(1);
    }
    compact(schema)
}

/// `schema` with free whitespace off (llguidance's `x-guidance` option).
fn compact(mut schema: Value) -> Value {
    if let Some(obj) = schema.as_object_mut() {
        obj.insert("x-guidance".into(), json!({"whitespace_flexible": false}));
    }
    schema
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    fn auto() -> ToolSettings {
        ToolSettings { parser: Some(ToolCallParser::Hermes), auto_tool_choice: true }
    }

    fn err(tools: Value, choice: Option<Value>, settings: ToolSettings) -> (String, String) {
        let e = plan(Some(tools), choice, None, settings, None).unwrap_err();
        (e.param.unwrap_or_default(), e.message)
    }

    #[test]
    fn choices_become_plans_and_grammars() {
        let (p, g) = plan(Some(json!([weather()])), None, None, auto(), None).unwrap();
        assert_eq!(p.output, ToolOutput::Parsed { parser: ToolCallParser::Hermes, parallel: true });
        assert!(g.is_none() && p.tools.is_some());
        let (p, g) = plan(
            Some(json!([weather()])),
            Some(json!("none")),
            None,
            ToolSettings::default(),
            None,
        )
        .unwrap();
        assert_eq!((p.output, g), (ToolOutput::Text, None));
        let (p, g) = plan(
            Some(json!([weather()])),
            Some(json!("required")),
            Some(&json!(false)),
            ToolSettings::default(),
            None,
        )
        .unwrap();
        assert_eq!(p.output, ToolOutput::Required);
        let Some(StructuredOutput::JsonSchema(s)) = g else { panic!() };
        let s: Value = serde_json::from_str(&s).unwrap();
        assert_eq!((s["minItems"].clone(), s["maxItems"].clone()), (json!(1), json!(1)));
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let (p, g) =
            plan(Some(json!([weather()])), Some(named), None, ToolSettings::default(), None)
                .unwrap();
        assert_eq!(p.output, ToolOutput::Named("get_weather".into()));
        let Some(StructuredOutput::JsonSchema(s)) = g else { panic!() };
        assert!(s.contains("\"required\":[\"city\"]"), "{s}");
    }

    #[test]
    fn bad_fields_are_400s_naming_them() {
        let off = ToolSettings::default();
        assert_eq!(err(json!([weather()]), None, off).0, "tool_choice");
        assert!(
            err(json!([weather()]), Some(json!("auto")), off)
                .1
                .contains("--enable-auto-tool-choice")
        );
        assert_eq!(err(json!([{"type": "retrieval"}]), None, auto()).0, "tools");
        assert_eq!(
            err(json!([{"type": "function", "function": {"name": "a b"}}]), None, auto()).0,
            "tools"
        );
        assert_eq!(err(json!({"a": 1}), None, auto()).0, "tools");
        assert_eq!(err(json!([weather()]), Some(json!("sometimes")), auto()).0, "tool_choice");
        let other = json!({"type": "function", "function": {"name": "other"}});
        assert!(err(json!([weather()]), Some(other), auto()).1.contains("not in `tools`"));
        assert_eq!(err(json!([]), Some(json!("required")), auto()).0, "tool_choice");
        let e = plan(
            Some(json!([weather()])),
            Some(json!("required")),
            None,
            off,
            Some("response_format"),
        );
        assert_eq!(e.unwrap_err().param.as_deref(), Some("response_format"));
        let e = plan(None, None, Some(&json!("yes")), off, None);
        assert_eq!(e.unwrap_err().param.as_deref(), Some("parallel_tool_calls"));
    }
}
