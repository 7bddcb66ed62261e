//! A Responses request (`POST /v1/responses`) checked and turned into the chat request kiln
//! already serves: `instructions` as the system message, the conversation of
//! `previous_response_id` then the `input` items as chat messages (`function_call` items
//! become an assistant's `tool_calls`, each `function_call_output` a `tool` message),
//! function tools and `tool_choice` as chat's, `text.format` as `response_format`.
//!
//! A reasoning item's text becomes the `reasoning_content` of the assistant turn after it (its
//! message or calls), as vLLM passes it; the template decides which turns print it.
//!
//! Invariants: every field and every item key is carried over, a documented no-op (`user`,
//! `metadata`, `safety_identifier`, `prompt_cache_key`, `service_tier`, `max_tool_calls`,
//! which counts built-in tools only, `stream_options.include_obfuscation`,
//! `reasoning.summary: "auto"`, keys set to `null`, a reasoning item no assistant turn
//! follows), or refused with a 400 naming it.

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::items::{chat_messages, input_items};
use crate::error::ApiError;
use crate::protocol::{ChatMessageIn, ChatRequest, SamplingFields};
use crate::tools::request::MAX_TOOLS;

/// `POST /v1/responses`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    /// A string (one user message) or a list of items.
    pub input: Option<Value>,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// vLLM's extra sampling fields.
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    pub repetition_penalty: Option<f64>,
    pub priority: Option<i64>,
    pub top_logprobs: Option<i64>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// Counts calls of built-in tools, which kiln has none of: no effect.
    pub max_tool_calls: Option<i64>,
    /// `{"format": {...}, "verbosity": ...}`.
    pub text: Option<Value>,
    /// `{"effort", "summary"}`.
    pub reasoning: Option<Value>,
    pub stream: Option<bool>,
    pub stream_options: Option<Value>,
    /// Default true: the response is kept for `GET` and `previous_response_id`.
    pub store: Option<bool>,
    pub background: Option<bool>,
    pub previous_response_id: Option<String>,
    pub include: Option<Vec<String>>,
    pub truncation: Option<String>,
    pub metadata: Option<Value>,
    pub user: Option<String>,
    pub safety_identifier: Option<String>,
    pub prompt_cache_key: Option<String>,
    pub service_tier: Option<String>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// Fields of the Responses API kiln does not implement, and why.
const REFUSED: &[(&str, &str)] = &[
    ("prompt", "stored prompt templates are not supported (send `input` and `instructions`)"),
    ("conversation", "conversations are not supported (use `previous_response_id`)"),
    ("context_management", "context management is not supported"),
    ("prompt_cache_retention", "the prefix cache is managed by the server"),
];

/// How a response is delivered and kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Delivery {
    pub stream: bool,
    /// Kept for `GET` and `previous_response_id` (asked, and the store is on).
    pub store: bool,
    /// Answered at once, computed in the background.
    pub background: bool,
}

/// A request translated: the chat request and what stays the Responses API's.
pub struct Translated {
    pub chat: ChatRequest,
    /// This request's own input items (after the previous response's conversation), as a
    /// response continuing this one reads them.
    pub input_items: Vec<Value>,
    /// `include: ["message.output_text.logprobs"]` (or `top_logprobs` > 0).
    pub logprobs: bool,
    pub delivery: Delivery,
    /// The request's fields a response object repeats.
    pub echo: Map<String, Value>,
}

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::bad_param(param, message)
}

impl ResponsesRequest {
    /// The chat request this asks for, continuing `previous` (the items of the response
    /// named by `previous_response_id`); `store_enabled`: whether the server keeps responses.
    pub fn translate(
        mut self,
        previous: Option<&[Value]>,
        store_enabled: bool,
    ) -> Result<Translated, ApiError> {
        self.check_plain_fields()?;
        let logprobs =
            includes_logprobs(self.include.as_deref())? || self.top_logprobs.is_some_and(|k| k > 0);
        let delivery = self.delivery(store_enabled)?;
        let reasoning = reasoning(self.reasoning.as_ref())?;
        let (response_format, text) = text_format(self.text.as_ref())?;
        let input_items = input_items(self.input.take())?;
        let mut messages = Vec::new();
        if let Some(instructions) = &self.instructions {
            messages.push(ChatMessageIn::text("system", instructions.clone()));
        }
        let mut names = HashMap::new();
        if let Some(previous) = previous {
            chat_messages(previous, "previous_response_id", &mut names, &mut messages)?;
        }
        chat_messages(&input_items, "input", &mut names, &mut messages)?;
        if !messages.iter().any(|m| m.role != "system") {
            return Err(bad("input", "`input` needs at least one message or item"));
        }
        let (tools, echo_tools) = tools(self.tools.take())?;
        let tool_choice = tool_choice(self.tool_choice.clone(), tools.is_some())?;
        let sampling = SamplingFields {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            seed: self.seed,
            repetition_penalty: self.repetition_penalty,
            priority: self.priority,
            max_tokens: self.max_output_tokens,
            stream: Some(delivery.stream),
            response_format,
            ..SamplingFields::default()
        };
        let top_logprobs = logprobs.then_some(self.top_logprobs.unwrap_or(0));
        let kwargs = reasoning.disabled.then(|| json!({"enable_thinking": false}));
        let chat = ChatRequest {
            model: self.model.take(),
            messages,
            logprobs: Some(logprobs),
            top_logprobs,
            max_completion_tokens: None,
            add_generation_prompt: None,
            tools,
            tool_choice,
            parallel_tool_calls: self.parallel_tool_calls.map(Value::Bool),
            chat_template_kwargs: kwargs,
            include_reasoning: None,
            reasoning_effort: reasoning.effort.clone().map(Value::String),
            sampling,
        };
        let echo = self.echo(delivery, (reasoning.effort, reasoning.summary), text, echo_tools);
        Ok(Translated { chat, input_items, logprobs, delivery, echo })
    }

    /// Refuses unknown fields and values out of range.
    fn check_plain_fields(&self) -> Result<(), ApiError> {
        if let Some((name, _)) = self.other.iter().find(|(_, v)| !v.is_null()) {
            let shown: String = name.chars().take(64).collect();
            let why = REFUSED
                .iter()
                .find(|(f, _)| *f == shown)
                .map_or("unknown field: kiln does not support it (leave it out)", |(_, why)| why);
            return Err(bad(&shown, format!("`{shown}`: {why}")));
        }
        if let Some(max) = self.max_output_tokens
            && max < 1
        {
            return Err(bad(
                "max_output_tokens",
                format!("`max_output_tokens` must be at least 1, got {max}"),
            ));
        }
        if let Some(max) = self.max_tool_calls
            && max < 0
        {
            return Err(bad("max_tool_calls", "`max_tool_calls` must be at least 0"));
        }
        if self.metadata.as_ref().is_some_and(|m| !m.is_object() && !m.is_null()) {
            return Err(bad("metadata", "`metadata` must be an object"));
        }
        match self.truncation.as_deref() {
            None | Some("disabled") => {}
            Some("auto") => {
                return Err(bad(
                    "truncation",
                    "`truncation: \"auto\"` is not supported: an input longer than the \
                     context is refused (the default, \"disabled\")",
                ));
            }
            Some(other) => {
                return Err(bad(
                    "truncation",
                    format!("`truncation` {other:?} is not \"disabled\""),
                ));
            }
        }
        check_stream_options(self.stream_options.as_ref())
    }

    /// `stream`, `store` and `background`, checked together.
    fn delivery(&self, store_enabled: bool) -> Result<Delivery, ApiError> {
        let stream = self.stream.unwrap_or(false);
        let background = self.background.unwrap_or(false);
        let store = self.store.unwrap_or(true) && store_enabled;
        if background && !store {
            let why = if store_enabled {
                "`background: true` needs `store: true`"
            } else {
                "`background: true` needs the response store, which this server has turned off \
                 (--max-stored-responses 0)"
            };
            return Err(bad("background", why));
        }
        if background && stream {
            return Err(bad(
                "background",
                "streaming a background response is not supported: send `stream: false` and \
                 poll GET /v1/responses/{id}",
            ));
        }
        Ok(Delivery { stream, store, background })
    }

    /// The request's fields a response object repeats.
    fn echo(
        self,
        delivery: Delivery,
        (effort, summary): (Option<String>, Value),
        text: Value,
        tools: Vec<Value>,
    ) -> Map<String, Value> {
        Map::from_iter([
            ("instructions".into(), json!(self.instructions)),
            ("max_output_tokens".into(), json!(self.max_output_tokens)),
            ("max_tool_calls".into(), json!(self.max_tool_calls)),
            ("metadata".into(), self.metadata.filter(|m| !m.is_null()).unwrap_or(json!({}))),
            ("parallel_tool_calls".into(), json!(self.parallel_tool_calls.unwrap_or(true))),
            ("previous_response_id".into(), json!(self.previous_response_id)),
            (
                "reasoning".into(),
                Value::Object(Map::from_iter([
                    ("effort".into(), json!(effort)),
                    ("summary".into(), summary),
                ])),
            ),
            ("service_tier".into(), json!(self.service_tier.as_deref().unwrap_or("default"))),
            ("store".into(), json!(delivery.store)),
            ("background".into(), json!(delivery.background)),
            ("temperature".into(), json!(self.temperature)),
            ("text".into(), text),
            ("tool_choice".into(), self.tool_choice.unwrap_or(json!("auto"))),
            ("tools".into(), Value::Array(tools)),
            ("top_logprobs".into(), json!(self.top_logprobs)),
            ("top_p".into(), json!(self.top_p)),
            ("truncation".into(), json!("disabled")),
            ("user".into(), json!(self.user)),
            ("safety_identifier".into(), json!(self.safety_identifier)),
            ("prompt_cache_key".into(), json!(self.prompt_cache_key)),
        ])
    }
}

/// `stream_options`: only `include_obfuscation`, which changes no text (kiln never pads
/// events).
fn check_stream_options(options: Option<&Value>) -> Result<(), ApiError> {
    let Some(options) = options.filter(|o| !o.is_null()) else { return Ok(()) };
    let Some(obj) = options.as_object() else {
        return Err(bad("stream_options", "`stream_options` must be an object"));
    };
    for (key, value) in obj {
        match (key.as_str(), value) {
            ("include_obfuscation", Value::Bool(_) | Value::Null) => {}
            _ => {
                return Err(bad(
                    "stream_options",
                    format!("`stream_options.{key}` is not supported (only include_obfuscation)"),
                ));
            }
        }
    }
    Ok(())
}

/// Whether `include` asks for the output's log-probabilities; anything else it names is
/// refused.
fn includes_logprobs(include: Option<&[String]>) -> Result<bool, ApiError> {
    let mut logprobs = false;
    for item in include.unwrap_or_default() {
        match item.as_str() {
            "message.output_text.logprobs" => logprobs = true,
            "reasoning.encrypted_content" => {
                return Err(bad(
                    "include",
                    "`include`: reasoning.encrypted_content is not supported: kiln returns the \
                     reasoning as plain text in the reasoning item's `content`",
                ));
            }
            other => {
                let shown: String = other.chars().take(64).collect();
                return Err(bad(
                    "include",
                    format!(
                        "`include`: {shown:?} is not supported (only message.output_text.logprobs)"
                    ),
                ));
            }
        }
    }
    Ok(logprobs)
}

/// What `reasoning` asked for.
struct Reasoning {
    /// `effort: "none"`: the template's thinking is turned off.
    disabled: bool,
    /// `effort` `low`, `medium` or `high`: chat's `reasoning_effort`.
    effort: Option<String>,
    /// The `summary` echoed (`"auto"` or null).
    summary: Value,
}

/// `reasoning`: `effort` `"none"` turns thinking off (the template's `enable_thinking`, as
/// Anthropic's `thinking: disabled`); `low`, `medium` and `high` become chat's
/// `reasoning_effort`, the template's variable (gpt-oss's). `summary` `"auto"` asks for whatever summary there is: kiln writes none (the
/// reasoning text itself is in the item's `content`); a specific summary style is refused.
fn reasoning(value: Option<&Value>) -> Result<Reasoning, ApiError> {
    const P: &str = "reasoning";
    let mut out = Reasoning { disabled: false, effort: None, summary: Value::Null };
    let Some(value) = value.filter(|v| !v.is_null()) else { return Ok(out) };
    let Some(obj) = value.as_object() else {
        return Err(bad(P, "`reasoning` must be an object"));
    };
    for (key, value) in obj {
        match (key.as_str(), value) {
            (_, Value::Null) => {}
            ("effort", Value::String(e)) if e == "none" => out.disabled = true,
            ("effort", Value::String(e)) if ["low", "medium", "high"].contains(&e.as_str()) => {
                out.effort = Some(e.clone());
            }
            ("effort", _) => {
                return Err(bad(
                    P,
                    "`reasoning.effort` must be \"none\" (thinking off), or \"low\", \
                     \"medium\" or \"high\" for a chat template that reads `reasoning_effort` \
                     (gpt-oss's)",
                ));
            }
            ("summary" | "generate_summary", Value::String(s)) if s == "auto" => {
                out.summary = json!("auto");
            }
            ("summary" | "generate_summary", _) => {
                return Err(bad(
                    P,
                    format!(
                        "`reasoning.{key}`: reasoning summaries are not written (only \"auto\", \
                         which returns the reasoning text itself)"
                    ),
                ));
            }
            _ => return Err(bad(P, format!("`reasoning.{key}` is not supported"))),
        }
    }
    Ok(out)
}

/// `text`: its `format` as chat's `response_format`, and the `text` a response repeats.
fn text_format(text: Option<&Value>) -> Result<(Option<Value>, Value), ApiError> {
    const P: &str = "text";
    let plain = json!({"format": {"type": "text"}});
    let Some(text) = text.filter(|t| !t.is_null()) else { return Ok((None, plain)) };
    let Some(obj) = text.as_object() else {
        return Err(bad(P, "`text` must be an object"));
    };
    for (key, value) in obj {
        match key.as_str() {
            "format" => {}
            "verbosity" if value.is_null() || value == "medium" => {}
            "verbosity" => {
                return Err(bad(P, "`text.verbosity` is not supported (only \"medium\")"));
            }
            _ => return Err(bad(P, format!("`text.{key}` is not supported"))),
        }
    }
    let Some(format) = obj.get("format").filter(|f| !f.is_null()) else {
        return Ok((None, plain));
    };
    let Some(f) = format.as_object() else {
        return Err(bad(P, "`text.format` must be an object"));
    };
    let allowed: &[&str] = match f.get("type").and_then(Value::as_str) {
        Some("text" | "json_object") => &["type"],
        Some("json_schema") => &["type", "name", "schema", "strict", "description"],
        _ => {
            return Err(bad(
                P,
                "`text.format.type` must be \"text\", \"json_object\" or \"json_schema\"",
            ));
        }
    };
    if let Some(key) = f.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(bad(P, format!("`text.format.{key}` is not supported")));
    }
    let echo = json!({"format": format});
    let response_format = match f["type"].as_str() {
        Some("json_object") => Some(json!({"type": "json_object"})),
        Some("json_schema") => {
            let mut schema = Map::new();
            for key in ["name", "schema", "strict", "description"] {
                if let Some(v) = f.get(key) {
                    schema.insert(key.into(), v.clone());
                }
            }
            if !schema.contains_key("schema") {
                return Err(bad(P, "`text.format.schema` is required for json_schema"));
            }
            Some(json!({"type": "json_schema", "json_schema": schema}))
        }
        _ => None,
    };
    Ok((response_format, echo))
}

/// Responses' function tools (`{"type": "function", "name", "description", "parameters",
/// "strict"}`) as chat's; and the tools a response repeats.
fn tools(tools: Option<Vec<Value>>) -> Result<(Option<Value>, Vec<Value>), ApiError> {
    let tools = tools.unwrap_or_default();
    if tools.len() > MAX_TOOLS {
        return Err(bad("tools", format!("at most {MAX_TOOLS} tools per request")));
    }
    let mut echo = Vec::with_capacity(tools.len());
    let functions = tools
        .into_iter()
        .enumerate()
        .map(|(i, tool)| {
            let at = |m: &str| bad("tools", format!("tools.{i}: {m}"));
            let Value::Object(obj) = tool else { return Err(at("a tool must be an object")) };
            match obj.get("type").and_then(Value::as_str) {
                Some("function") => {}
                Some(kind) => {
                    return Err(at(&format!(
                        "tools of type {kind:?} are not supported (only \"function\")"
                    )));
                }
                None => return Err(at("`type` must be \"function\"")),
            }
            let allowed = ["type", "name", "description", "parameters", "strict"];
            if let Some(key) = obj.keys().find(|k| !allowed.contains(&k.as_str())) {
                return Err(at(&format!("`{key}` is not supported")));
            }
            let mut function = Map::new();
            for key in ["name", "description", "parameters", "strict"] {
                if let Some(v) = obj.get(key).filter(|v| !v.is_null()) {
                    function.insert(key.into(), v.clone());
                }
            }
            let mut shown = obj;
            shown.entry("strict").or_insert(json!(true));
            shown.entry("description").or_insert(Value::Null);
            echo.push(Value::Object(shown));
            Ok(json!({"type": "function", "function": function}))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(((!functions.is_empty()).then_some(Value::Array(functions)), echo))
}

/// Responses' `tool_choice` (`"auto"`, `"none"`, `"required"` or `{"type": "function",
/// "name"}`) as chat's.
fn tool_choice(choice: Option<Value>, has_tools: bool) -> Result<Option<Value>, ApiError> {
    const P: &str = "tool_choice";
    match choice {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if ["auto", "none", "required"].contains(&s.as_str()) => {
            // Without tools, "auto" asks for nothing (chat's plan refuses it then).
            Ok((has_tools || s != "auto").then_some(Value::String(s)))
        }
        Some(Value::Object(obj)) => {
            match obj.get("type").and_then(Value::as_str) {
                Some("function") => {}
                _ => {
                    return Err(bad(
                        P,
                        "`tool_choice` objects other than {\"type\": \"function\", \"name\"} \
                         are not supported",
                    ));
                }
            }
            if let Some(key) = obj.keys().find(|k| !["type", "name"].contains(&k.as_str())) {
                return Err(bad(P, format!("`tool_choice.{key}` is not supported")));
            }
            let name = obj.get("name").and_then(Value::as_str);
            let name = name.ok_or_else(|| bad(P, "`tool_choice.name` is required"))?;
            Ok(Some(json!({"type": "function", "function": {"name": name}})))
        }
        Some(_) => {
            Err(bad(P, "`tool_choice` must be \"auto\", \"none\", \"required\" or an object"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::MessageContent;

    fn translate(body: Value) -> Result<Translated, ApiError> {
        serde_json::from_value::<ResponsesRequest>(body).unwrap().translate(None, true)
    }

    fn text(m: &ChatMessageIn) -> &str {
        match &m.content {
            Some(MessageContent::Text(s)) => s,
            _ => panic!("no text"),
        }
    }

    #[test]
    fn a_tool_round_trip_becomes_chat_messages() {
        let t = translate(json!({
            "model": "m", "instructions": "be brief",
            "input": [
                {"role": "user", "content": "weather?"},
                {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "hm"}]},
                {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                 "content": [{"type": "output_text", "text": "checking", "annotations": []}]},
                {"type": "function_call", "call_id": "c1", "name": "get",
                 "arguments": "{\"city\":\"Oslo\"}", "id": "fc_1", "status": "completed"},
                {"type": "function_call_output", "call_id": "c1", "output": "cold"},
                {"role": "developer", "content": [{"type": "input_text", "text": "and tomorrow?"}]},
            ],
            "tools": [{"type": "function", "name": "get", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "get"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
            "max_output_tokens": 9, "top_logprobs": 2,
        }))
        .unwrap();
        let m = &t.chat.messages;
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "developer"]);
        assert_eq!((text(&m[0]), text(&m[2]), text(&m[3])), ("be brief", "checking", "cold"));
        assert_eq!(m[2].reasoning_content.as_deref(), Some("hm"));
        let calls = m[2].tool_calls.as_ref().unwrap();
        assert_eq!(calls[0]["function"]["arguments"], json!("{\"city\":\"Oslo\"}"));
        assert_eq!((m[3].tool_call_id.as_deref(), m[3].name.as_deref()), (Some("c1"), Some("get")));
        assert_eq!(
            t.chat.tool_choice,
            Some(json!({"type": "function", "function": {"name": "get"}}))
        );
        assert_eq!(t.chat.tools.as_ref().unwrap()[0]["function"]["name"], json!("get"));
        assert_eq!(t.chat.sampling.max_tokens, Some(9));
        assert_eq!(t.chat.sampling.response_format.as_ref().unwrap()["json_schema"]["name"], "w");
        assert!(t.logprobs && t.chat.top_logprobs == Some(2));
        assert_eq!(t.input_items.len(), 6);
        assert_eq!(t.delivery, Delivery { stream: false, store: true, background: false });
    }

    #[test]
    fn previous_items_come_before_the_input_and_after_the_instructions() {
        let previous = [
            json!({"type": "message", "role": "user", "content": "one"}),
            json!({"type": "message", "role": "assistant",
                   "content": [{"type": "output_text", "text": "two", "annotations": []}]}),
        ];
        let body = json!({"input": "three", "instructions": "sys"});
        let t = serde_json::from_value::<ResponsesRequest>(body)
            .unwrap()
            .translate(Some(&previous), true)
            .unwrap();
        let texts: Vec<&str> = t.chat.messages.iter().map(text).collect();
        assert_eq!(texts, ["sys", "one", "two", "three"]);
        assert_eq!(t.input_items, [json!({"type": "message", "role": "user", "content": "three"})]);
    }

    #[test]
    fn effort_none_turns_thinking_off_and_auto_summaries_pass() {
        let t =
            translate(json!({"input": "q", "reasoning": {"effort": "none", "summary": "auto"}}));
        let t = t.unwrap();
        assert_eq!(t.chat.chat_template_kwargs, Some(json!({"enable_thinking": false})));
        assert_eq!(t.echo["reasoning"], json!({"effort": null, "summary": "auto"}));
        let t = translate(json!({"input": "q", "reasoning": {"effort": "high"}})).unwrap();
        assert_eq!(t.chat.reasoning_effort, Some(json!("high")));
        assert_eq!(t.echo["reasoning"], json!({"effort": "high", "summary": null}));
    }

    #[test]
    fn what_kiln_cannot_honour_is_refused_by_name() {
        for (body, param) in [
            (json!({"input": "q", "max_output_tokens": 0}), "max_output_tokens"),
            (json!({"input": 3}), "input"),
            (json!({}), "input"),
            (json!({"instructions": "only a system message"}), "input"),
            (json!({"input": [{"type": "item_reference", "id": "x"}]}), "input"),
            (json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}), "input"),
            (json!({"input": [{"role": "tool", "content": "x"}]}), "input"),
            (json!({"input": [{"role": "user", "content": "x", "extra": 1}]}), "input"),
            (json!({"input": [{"type": "function_call", "name": "f"}]}), "input"),
            (json!({"input": "q", "tools": [{"type": "web_search"}]}), "tools"),
            (json!({"input": "q", "tools": [{"type": "function", "name": "f", "x": 1}]}), "tools"),
            (json!({"input": "q", "tool_choice": {"type": "allowed_tools"}}), "tool_choice"),
            (json!({"input": "q", "text": {"format": {"type": "json_schema"}}}), "text"),
            (json!({"input": "q", "text": {"verbosity": "low"}}), "text"),
            (json!({"input": "q", "reasoning": {"effort": "extreme"}}), "reasoning"),
            (json!({"input": "q", "reasoning": {"summary": "detailed"}}), "reasoning"),
            (json!({"input": "q", "include": ["reasoning.encrypted_content"]}), "include"),
            (json!({"input": "q", "include": ["file_search_call.results"]}), "include"),
            (json!({"input": "q", "truncation": "auto"}), "truncation"),
            (json!({"input": "q", "stream_options": {"include_usage": true}}), "stream_options"),
            (json!({"input": "q", "background": true, "stream": true}), "background"),
            (json!({"input": "q", "background": true, "store": false}), "background"),
            (json!({"input": "q", "prompt": {"id": "p"}}), "prompt"),
            (json!({"input": "q", "max_tokens": 5}), "max_tokens"),
        ] {
            let e = translate(body.clone()).err().unwrap_or_else(|| panic!("{body}"));
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
    }

    #[test]
    fn documented_no_ops_pass() {
        let t = translate(json!({
            "input": "q", "user": "u", "metadata": {"k": "v"}, "safety_identifier": "s",
            "prompt_cache_key": "p", "service_tier": "auto", "max_tool_calls": 3,
            "stream_options": {"include_obfuscation": false}, "truncation": "disabled",
            "text": {"format": {"type": "text"}, "verbosity": "medium"}, "some_null": null,
        }));
        let t = t.unwrap();
        assert_eq!(t.echo["metadata"], json!({"k": "v"}));
        assert!(t.chat.sampling.response_format.is_none());
    }
}
