//! A Messages request (`POST /v1/messages`, `/v1/messages/count_tokens`) checked and turned
//! into the chat request kiln already serves: `system` first, each message's content blocks
//! flattened to chat messages (`tool_use` blocks become an assistant's `tool_calls`, each
//! `tool_result` block a `tool` message, `thinking` blocks the assistant's
//! `reasoning_content`), Anthropic's tools and `tool_choice` as OpenAI's, `thinking` as the
//! template's `enable_thinking`, `output_config.format` as a JSON-schema `response_format`.
//!
//! Invariants: every field and every block key is either carried over, a documented no-op
//! (`metadata`, `service_tier`, `cache_control` (top-level and on blocks), redacted thinking,
//! keys set to `null`), or refused with a 400 naming it; text blocks of one message are joined
//! with a newline.

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::error::ApiError;
use crate::protocol::{ChatMessageIn, ChatRequest, SamplingFields, StopField};
use crate::tools::request::MAX_TOOLS;

/// `POST /v1/messages` (and, without the sampling fields, `/v1/messages/count_tokens`).
#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub messages: Vec<Value>,
    #[serde(default)]
    pub system: Option<Value>,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub thinking: Option<Value>,
    /// `{"user_id"}`: changes nothing kiln returns.
    #[serde(default)]
    pub metadata: Option<Value>,
    /// Changes nothing: there is one tier.
    #[serde(default)]
    pub service_tier: Option<Value>,
    /// Automatic prompt caching: changes nothing (kiln's prefix cache is always on).
    #[serde(default)]
    pub cache_control: Option<Value>,
    /// `{"format": {"type": "json_schema", "schema"}}` (structured outputs), `effort`.
    #[serde(default)]
    pub output_config: Option<Value>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// What the request asked of thinking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Thinking {
    /// No `thinking` field: the template's default.
    Default,
    Disabled,
}

/// A request translated: the chat request and what stays Anthropic's.
pub struct Translated {
    pub chat: ChatRequest,
    pub thinking: Thinking,
}

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::bad_param(param, message)
}

fn bad_message(index: usize, message: impl Into<String>) -> ApiError {
    bad("messages", format!("messages.{index}: {}", message.into()))
}

/// Which request fields a count is allowed (the rest are generation's).
const COUNT_FIELDS: [&str; 4] = ["max_tokens", "stop_sequences", "stream", "temperature"];

impl MessagesRequest {
    /// The chat request this asks for; `counting`: for `count_tokens`, where `max_tokens` is
    /// not required and the sampling fields are refused.
    pub fn translate(self, counting: bool) -> Result<Translated, ApiError> {
        if let Some((name, _)) = self.other.iter().find(|(_, v)| !v.is_null()) {
            let shown: String = name.chars().take(64).collect();
            return Err(bad(&shown, format!("{shown}: Extra inputs are not permitted")));
        }
        if counting {
            let given = [
                self.max_tokens.is_some(),
                self.stop_sequences.is_some(),
                self.stream.is_some(),
                self.temperature.is_some() || self.top_p.is_some() || self.top_k.is_some(),
            ];
            if let Some(i) = given.iter().position(|g| *g) {
                let name = COUNT_FIELDS[i];
                return Err(bad(name, format!("{name}: not a field of count_tokens")));
            }
        } else if self.max_tokens.is_none() {
            return Err(bad("max_tokens", "max_tokens: Field required"));
        }
        if let Some(max) = self.max_tokens
            && max < 1
        {
            return Err(bad("max_tokens", format!("max_tokens: must be at least 1, got {max}")));
        }
        if self.cache_control.as_ref().is_some_and(|c| !c.is_object() && !c.is_null()) {
            return Err(bad("cache_control", "cache_control: must be an object"));
        }
        if self.metadata.as_ref().is_some_and(|m| !m.is_object() && !m.is_null()) {
            return Err(bad("metadata", "metadata: must be an object"));
        }
        let thinking = thinking(self.thinking.as_ref(), self.max_tokens)?;
        let mut messages = Vec::with_capacity(self.messages.len() + 1);
        if let Some(system) = self.system {
            let text = system_text(system)?;
            messages.push(ChatMessageIn::text("system", text));
        }
        if self.messages.is_empty() {
            return Err(bad("messages", "messages: at least one message is required"));
        }
        let mut tool_names = HashMap::new();
        let last = self.messages.len() - 1;
        if self.messages[last].get("role").and_then(Value::as_str) == Some("assistant") {
            return Err(bad_message(
                last,
                "a final assistant message (a prefill the answer continues) is not supported",
            ));
        }
        for (index, message) in self.messages.into_iter().enumerate() {
            chat_messages(index, message, &mut tool_names, &mut messages)?;
        }
        let (tools, tool_choice, parallel) = tools(self.tools, self.tool_choice)?;
        let kwargs = match thinking {
            Thinking::Default => None,
            Thinking::Disabled => Some(json!({"enable_thinking": false})),
        };
        let response_format = output_format(self.output_config.as_ref())?;
        let sampling = SamplingFields {
            response_format,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            max_tokens: self.max_tokens,
            stop: self.stop_sequences.map(StopField::Many),
            stream: self.stream,
            ..SamplingFields::default()
        };
        let chat = ChatRequest {
            model: self.model,
            messages,
            logprobs: None,
            top_logprobs: None,
            max_completion_tokens: None,
            add_generation_prompt: None,
            tools,
            tool_choice,
            parallel_tool_calls: parallel,
            chat_template_kwargs: kwargs,
            include_reasoning: None,
            reasoning_effort: None,
            sampling,
        };
        Ok(Translated { chat, thinking })
    }
}

/// `thinking`: `{"type": "disabled"}`; `{"type": "enabled", "budget_tokens": N}` is checked
/// as Anthropic checks it, then refused (a budget kiln does not enforce would be a field that
/// changes nothing).
fn thinking(value: Option<&Value>, max_tokens: Option<i64>) -> Result<Thinking, ApiError> {
    const P: &str = "thinking";
    let Some(value) = value.filter(|v| !v.is_null()) else { return Ok(Thinking::Default) };
    let Some(obj) = value.as_object() else {
        return Err(bad(P, "thinking: must be an object"));
    };
    if let Some(key) = obj.keys().find(|k| !["type", "budget_tokens"].contains(&k.as_str())) {
        return Err(bad(P, format!("thinking.{key}: Extra inputs are not permitted")));
    }
    match obj.get("type").and_then(Value::as_str) {
        Some("disabled") => Ok(Thinking::Disabled),
        Some("enabled") => {
            let budget = obj.get("budget_tokens").and_then(Value::as_i64);
            if budget.is_none_or(|b| b < 1) {
                return Err(bad(
                    P,
                    "thinking.budget_tokens: a whole number of at least 1 is required",
                ));
            }
            if let (Some(b), Some(max)) = (budget, max_tokens)
                && b >= max
            {
                return Err(bad(
                    P,
                    format!("thinking.budget_tokens ({b}) must be less than max_tokens ({max})"),
                ));
            }
            Err(bad(
                P,
                "thinking: a thinking budget is not enforced by kiln yet; leave `thinking` out \
                 (with --reasoning-parser, a model that thinks by default returns a thinking \
                 block) or send {\"type\": \"disabled\"}",
            ))
        }
        _ => Err(bad(P, "thinking.type: must be \"enabled\" or \"disabled\"")),
    }
}

/// `output_config`: its `format` (a JSON schema the text must follow) as chat's
/// `response_format`; an `effort` is refused (kiln does not bound effort).
fn output_format(config: Option<&Value>) -> Result<Option<Value>, ApiError> {
    const P: &str = "output_config";
    let Some(config) = config.filter(|c| !c.is_null()) else { return Ok(None) };
    let Some(obj) = config.as_object() else {
        return Err(bad(P, "output_config: must be an object"));
    };
    let mut format = None;
    for (key, value) in obj {
        match (key.as_str(), value) {
            (_, Value::Null) => {}
            ("format", Value::Object(f)) => format = Some(f),
            ("effort", _) => {
                return Err(bad(
                    P,
                    "output_config.effort: kiln does not bound effort; leave it out",
                ));
            }
            ("format", _) => return Err(bad(P, "output_config.format: must be an object")),
            _ => {
                return Err(bad(P, format!("output_config.{key}: Extra inputs are not permitted")));
            }
        }
    }
    let Some(format) = format else { return Ok(None) };
    if let Some(key) = format.keys().find(|k| !["type", "schema"].contains(&k.as_str())) {
        return Err(bad(P, format!("output_config.format.{key}: Extra inputs are not permitted")));
    }
    if format.get("type").and_then(Value::as_str) != Some("json_schema") {
        return Err(bad(P, "output_config.format.type: must be \"json_schema\""));
    }
    let schema = format.get("schema").filter(|s| s.is_object());
    let schema =
        schema.ok_or_else(|| bad(P, "output_config.format.schema: a JSON schema object"))?;
    Ok(Some(json!({
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": true},
    })))
}

/// `system`: a string or a list of text blocks.
fn system_text(system: Value) -> Result<String, ApiError> {
    match system {
        Value::String(s) => Ok(s),
        Value::Array(blocks) => {
            let texts = blocks
                .iter()
                .map(|b| text_block(b).map_err(|m| bad("system", format!("system: {m}"))))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(texts.join("\n"))
        }
        _ => Err(bad("system", "system: must be a string or a list of text blocks")),
    }
}

/// The keys each block type may have.
fn allowed_keys(kind: &str) -> &'static [&'static str] {
    match kind {
        "text" => &["type", "text", "cache_control", "citations"],
        "tool_use" => &["type", "id", "name", "input", "cache_control", "caller"],
        "tool_result" => &["type", "tool_use_id", "content", "is_error", "cache_control"],
        "thinking" => &["type", "thinking", "signature"],
        "redacted_thinking" => &["type", "data"],
        _ => &[],
    }
}

/// A block's type, after checking its keys.
fn block_kind(block: &Value) -> Result<&str, String> {
    let Some(obj) = block.as_object() else {
        return Err("a content block must be an object".into());
    };
    let kind = obj.get("type").and_then(Value::as_str).ok_or("a content block needs a `type`")?;
    let allowed = allowed_keys(kind);
    if allowed.is_empty() {
        return Err(format!(
            "content blocks of type {kind:?} are not supported (text, tool_use, tool_result and thinking are)"
        ));
    }
    // A key set to null asks for nothing (the SDKs' `model_dump()` writes every field).
    if let Some(key) = obj.iter().find(|(k, v)| !v.is_null() && !allowed.contains(&k.as_str())) {
        return Err(format!("{kind} block: `{}`: Extra inputs are not permitted", key.0));
    }
    // Who made a call: the model itself (`direct`), not a program kiln cannot run.
    if obj.get("caller").is_some_and(|c| !c.is_null() && c != &json!({"type": "direct"})) {
        return Err("tool_use.caller: only {\"type\": \"direct\"} calls are supported".into());
    }
    if obj.get("citations").is_some_and(|c| !c.is_null() && c != &json!([])) {
        return Err("citations are not supported".into());
    }
    Ok(kind)
}

/// The text of a `text` block.
fn text_block(block: &Value) -> Result<String, String> {
    match block_kind(block)? {
        "text" => block["text"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| "a text block needs `text`".into()),
        kind => Err(format!("expected a text block, got {kind:?}")),
    }
}

/// One Anthropic message as chat messages, appended to `out`; `tool_names` maps the ids of
/// the calls seen so far to their tool (a tool result's `name` for templates that print it).
fn chat_messages(
    index: usize,
    message: Value,
    tool_names: &mut HashMap<String, String>,
    out: &mut Vec<ChatMessageIn>,
) -> Result<(), ApiError> {
    let Value::Object(mut obj) = message else {
        return Err(bad_message(index, "a message must be an object"));
    };
    if let Some(key) = obj.keys().find(|k| !["role", "content"].contains(&k.as_str())) {
        return Err(bad_message(index, format!("`{key}`: Extra inputs are not permitted")));
    }
    let role = match obj.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r.to_owned(),
        _ => return Err(bad_message(index, "role: must be \"user\" or \"assistant\"")),
    };
    let plain = ChatMessageIn::text;
    let blocks = match obj.remove("content") {
        Some(Value::String(s)) => {
            out.push(plain(&role, s));
            return Ok(());
        }
        Some(Value::Array(blocks)) => blocks,
        _ => return Err(bad_message(index, "content: must be a string or a list of blocks")),
    };
    let mut texts = Vec::new();
    let mut thinking = Vec::new();
    let mut calls = Vec::new();
    let mut results = 0usize;
    for (b, block) in blocks.iter().enumerate() {
        let at = |m: String| bad_message(index, format!("content.{b}: {m}"));
        match (block_kind(block).map_err(at)?, role.as_str()) {
            ("text", _) => texts.push(text_block(block).map_err(at)?),
            ("tool_use", "assistant") => {
                let id = block["id"].as_str().ok_or_else(|| at("tool_use needs an `id`".into()))?;
                let name =
                    block["name"].as_str().ok_or_else(|| at("tool_use needs a `name`".into()))?;
                let input = match &block["input"] {
                    v @ Value::Object(_) => v.clone(),
                    _ => return Err(at("tool_use.input: must be an object".into())),
                };
                tool_names.insert(id.to_owned(), name.to_owned());
                calls.push(json!({
                    "id": id, "type": "function",
                    "function": {"name": name, "arguments": input},
                }));
            }
            ("tool_result", "user") => {
                let id = block["tool_use_id"]
                    .as_str()
                    .ok_or_else(|| at("tool_result needs a `tool_use_id`".into()))?;
                let mut text = match &block["content"] {
                    Value::Null => String::new(),
                    Value::String(s) => s.clone(),
                    Value::Array(parts) => parts
                        .iter()
                        .map(text_block)
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|m| at(format!("tool_result.content: {m}")))?
                        .join("\n"),
                    _ => return Err(at("tool_result.content: a string or text blocks".into())),
                };
                match &block["is_error"] {
                    Value::Null | Value::Bool(false) => {}
                    Value::Bool(true) => text.insert_str(0, "Error: "),
                    _ => return Err(at("tool_result.is_error: must be a boolean".into())),
                }
                results += 1;
                out.push(ChatMessageIn {
                    tool_call_id: Some(id.to_owned()),
                    name: tool_names.get(id).cloned(),
                    ..ChatMessageIn::text("tool", text)
                });
            }
            // The thinking goes to the template as the message's `reasoning_content` (a
            // thinking model's template decides which turns keep it); redacted thinking has
            // no text to show it.
            ("thinking", "assistant") => {
                let text = block["thinking"].as_str();
                thinking.push(text.ok_or_else(|| at("a thinking block needs `thinking`".into()))?);
            }
            ("redacted_thinking", "assistant") => {}
            (kind, role) => {
                return Err(at(format!("{kind} blocks are not allowed in {role} messages")));
            }
        }
    }
    // A user message of tool results only adds no empty user turn.
    if !texts.is_empty() || !calls.is_empty() || results == 0 {
        let mut m = plain(&role, texts.join("\n"));
        if !calls.is_empty() {
            m.tool_calls = Some(Value::Array(calls));
        }
        if !thinking.is_empty() {
            m.reasoning_content = Some(thinking.join("\n"));
        }
        out.push(m);
    }
    Ok(())
}

/// Anthropic's `tools` and `tool_choice` as chat's `tools`, `tool_choice` and
/// `parallel_tool_calls`.
type ChatTools = (Option<Value>, Option<Value>, Option<Value>);

fn tools(tools: Option<Vec<Value>>, choice: Option<Value>) -> Result<ChatTools, ApiError> {
    let tools = tools.unwrap_or_default();
    if tools.len() > MAX_TOOLS {
        return Err(bad("tools", format!("tools: at most {MAX_TOOLS} tools per request")));
    }
    let functions = tools
        .iter()
        .enumerate()
        .map(|(i, tool)| {
            let at = |m: &str| bad("tools", format!("tools.{i}: {m}"));
            let obj = tool.as_object().ok_or_else(|| at("must be an object"))?;
            match obj.get("type").and_then(Value::as_str) {
                None | Some("custom") => {}
                Some(kind) => {
                    return Err(at(&format!(
                        "server tools ({kind}) are not supported: declare a custom tool with \
                         `name` and `input_schema`"
                    )));
                }
            }
            let allowed = ["type", "name", "description", "input_schema", "cache_control"];
            if let Some(key) = obj.keys().find(|k| !allowed.contains(&k.as_str())) {
                return Err(at(&format!("`{key}`: Extra inputs are not permitted")));
            }
            let name =
                obj.get("name").and_then(Value::as_str).ok_or_else(|| at("needs a `name`"))?;
            let schema = obj.get("input_schema").filter(|s| s.is_object());
            let schema = schema.ok_or_else(|| at("needs an `input_schema` object"))?;
            let mut function = json!({"name": name, "parameters": schema});
            if let Some(d) = obj.get("description") {
                function["description"] = d.clone();
            }
            Ok(json!({"type": "function", "function": function}))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let choice = match choice {
        None | Some(Value::Null) => None,
        Some(Value::Object(c)) => Some(c),
        Some(_) => return Err(bad("tool_choice", "tool_choice: must be an object")),
    };
    let (chat_choice, parallel) = match &choice {
        None => (None, None),
        Some(c) => {
            let allowed = ["type", "name", "disable_parallel_tool_use"];
            if let Some(key) = c.keys().find(|k| !allowed.contains(&k.as_str())) {
                return Err(bad(
                    "tool_choice",
                    format!("tool_choice.{key}: Extra inputs are not permitted"),
                ));
            }
            let parallel = match c.get("disable_parallel_tool_use") {
                None | Some(Value::Null) => None,
                Some(Value::Bool(disable)) => Some(json!(!disable)),
                Some(_) => {
                    return Err(bad(
                        "tool_choice",
                        "tool_choice.disable_parallel_tool_use: a boolean",
                    ));
                }
            };
            let chat_choice = match c.get("type").and_then(Value::as_str) {
                Some("auto") => json!("auto"),
                Some("any") => json!("required"),
                Some("none") => json!("none"),
                Some("tool") => {
                    let name = c.get("name").and_then(Value::as_str);
                    let name = name.ok_or_else(|| {
                        bad("tool_choice", "tool_choice.name: required for type \"tool\"")
                    })?;
                    json!({"type": "function", "function": {"name": name}})
                }
                _ => {
                    return Err(bad(
                        "tool_choice",
                        "tool_choice.type: must be \"auto\", \"any\", \"tool\" or \"none\"",
                    ));
                }
            };
            (Some(chat_choice), parallel)
        }
    };
    if functions.is_empty() {
        if choice.is_some_and(|c| c.get("type").and_then(Value::as_str) != Some("none")) {
            return Err(bad("tool_choice", "tool_choice: needs `tools`"));
        }
        return Ok((None, None, None));
    }
    Ok((Some(Value::Array(functions)), chat_choice, parallel))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::MessageContent;

    fn translate(body: Value) -> Result<Translated, ApiError> {
        serde_json::from_value::<MessagesRequest>(body).unwrap().translate(false)
    }

    fn roles(t: &Translated) -> Vec<&str> {
        t.chat.messages.iter().map(|m| m.role.as_str()).collect()
    }

    #[test]
    fn a_tool_round_trip_becomes_chat_messages() {
        let t = translate(json!({
            "model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "be brief"}],
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": ""},
                    {"type": "text", "text": "checking"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get", "input": {"city": "Oslo"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "cold"},
                    {"type": "text", "text": "and tomorrow?"},
                ]},
            ],
            "tools": [{"name": "get", "description": "d", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "stop_sequences": ["END"], "top_k": 5,
        }))
        .unwrap();
        assert_eq!(roles(&t), ["system", "user", "assistant", "tool", "user"]);
        let m = &t.chat.messages;
        assert!(matches!(&m[0].content, Some(MessageContent::Text(s)) if s == "be brief"));
        assert!(matches!(&m[2].content, Some(MessageContent::Text(s)) if s == "checking"));
        assert_eq!(m[2].reasoning_content.as_deref(), Some("hm"));
        let calls = m[2].tool_calls.as_ref().unwrap();
        assert_eq!(calls[0]["function"]["arguments"], json!({"city": "Oslo"}));
        assert_eq!(
            (m[3].tool_call_id.as_deref(), m[3].name.as_deref()),
            (Some("toolu_1"), Some("get"))
        );
        assert_eq!(t.chat.tool_choice, Some(json!("required")));
        assert_eq!(t.chat.parallel_tool_calls, Some(json!(false)));
        assert_eq!(
            t.chat.tools.as_ref().unwrap()[0]["function"]["parameters"],
            json!({"type": "object"})
        );
        assert_eq!(t.chat.sampling.top_k, Some(5));
        assert!(matches!(&t.chat.sampling.stop, Some(StopField::Many(s)) if s == &["END"]));
    }

    #[test]
    fn a_message_of_only_tool_results_adds_no_empty_user_turn() {
        let t = translate(json!({"max_tokens": 8, "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "is_error": true}]},
        ]}))
        .unwrap();
        assert_eq!(roles(&t), ["user", "assistant", "tool"]);
        assert!(
            matches!(&t.chat.messages[2].content, Some(MessageContent::Text(s)) if s == "Error: ")
        );
    }

    #[test]
    fn thinking_disabled_reaches_the_template_and_budgets_are_refused() {
        let user = json!([{"role": "user", "content": "q"}]);
        let off = translate(
            json!({"max_tokens": 32, "thinking": {"type": "disabled"}, "messages": user}),
        );
        let off = off.unwrap();
        assert_eq!(off.thinking, Thinking::Disabled);
        assert_eq!(off.chat.chat_template_kwargs, Some(json!({"enable_thinking": false})));
        for thinking in [
            json!({"type": "enabled", "budget_tokens": 16}),
            json!({"type": "enabled", "budget_tokens": 32}),
            json!({"type": "enabled"}),
            json!({"type": "sometimes"}),
            json!({"type": "enabled", "budget_tokens": 4, "x": 1}),
        ] {
            let e = translate(json!({"max_tokens": 32, "thinking": thinking, "messages": user}));
            assert_eq!(e.err().unwrap().param.as_deref(), Some("thinking"), "{thinking}");
        }
    }

    #[test]
    fn what_kiln_cannot_honour_is_refused_by_name() {
        let user = json!([{"role": "user", "content": "q"}]);
        for (body, param) in [
            (json!({"messages": user}), "max_tokens"),
            (json!({"max_tokens": 0, "messages": user}), "max_tokens"),
            (json!({"max_tokens": 4, "messages": []}), "messages"),
            (json!({"max_tokens": 4, "messages": user, "container": "c"}), "container"),
            (
                json!({"max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {}}]}]}),
                "messages",
            ),
            (
                json!({"max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "a", "extra": 1}]}]}),
                "messages",
            ),
            (
                json!({"max_tokens": 4, "messages": [{"role": "system", "content": "a"}]}),
                "messages",
            ),
            (
                json!({"max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}),
                "messages",
            ),
            (
                json!({"max_tokens": 4, "messages": user,
                    "tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
                "tools",
            ),
            (json!({"max_tokens": 4, "messages": user, "tools": [{"name": "f"}]}), "tools"),
            (
                json!({"max_tokens": 4, "messages": user, "tool_choice": {"type": "any"}}),
                "tool_choice",
            ),
        ] {
            let e = translate(body.clone()).err().unwrap_or_else(|| panic!("{body}"));
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
    }

    #[test]
    fn output_config_format_is_a_json_schema_and_effort_is_refused() {
        let user = json!([{"role": "user", "content": "q"}]);
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let t = translate(
            json!({"max_tokens": 8, "messages": user, "cache_control": {"type": "ephemeral"},
            "output_config": {"format": {"type": "json_schema", "schema": schema}}}),
        )
        .unwrap();
        let format = t.chat.sampling.response_format.unwrap();
        assert_eq!(format["json_schema"]["schema"], schema);
        for config in [
            json!({"effort": "high"}),
            json!({"format": {"type": "text"}}),
            json!({"format": {"type": "json_schema"}}),
            json!({"format": {"type": "json_schema", "schema": {}, "x": 1}}),
            json!({"speed": "fast"}),
        ] {
            let e = translate(json!({"max_tokens": 8, "messages": user, "output_config": config}));
            assert_eq!(e.err().unwrap().param.as_deref(), Some("output_config"), "{config}");
        }
    }

    #[test]
    fn count_tokens_takes_no_generation_fields() {
        let user = json!([{"role": "user", "content": "q"}]);
        let count =
            |body: Value| serde_json::from_value::<MessagesRequest>(body).unwrap().translate(true);
        assert!(count(json!({"model": "m", "messages": user})).is_ok());
        let e = count(json!({"messages": user, "max_tokens": 4})).err().unwrap();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
    }
}
