//! A chat request's conversation turned into prompt tokens: messages checked (roles, content
//! parts, tool calls and tool results), rendered with the chat template together with the
//! request's tools and `chat_template_kwargs`, and tokenized with client text kept as text.

use std::sync::Arc;

use kiln_core::TokenId;
use serde_json::{Map, Value};

use crate::chat_template::{ChatMessage, RESERVED_VARIABLES, RenderOptions};
use crate::error::ApiError;
use crate::protocol::{ChatMessageIn, MessageContent};
use crate::state::Loaded;

/// Most messages in one conversation.
const MAX_MESSAGES: usize = 4096;
/// Most content parts over all messages of one request.
pub const MAX_CONTENT_PARTS: usize = 4096;
/// Roles a message may have (`developer`, OpenAI's successor of `system`, is rendered as
/// `system`).
const ROLES: [&str; 5] = ["system", "user", "assistant", "developer", "tool"];

fn bad_message(index: usize, message: impl Into<String>) -> ApiError {
    ApiError::bad_param("messages", format!("messages[{index}]: {}", message.into()))
}

/// Messages as the template sees them: roles checked, `null` content only on assistant
/// messages, at most [`MAX_CONTENT_PARTS`] text parts in all, an assistant's `tool_calls` with
/// their `arguments` parsed into JSON objects.
pub fn template_messages(messages: Vec<ChatMessageIn>) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_param("messages", "`messages` must not be empty"));
    }
    if messages.len() > MAX_MESSAGES {
        return Err(ApiError::bad_param("messages", format!("at most {MAX_MESSAGES} messages")));
    }
    let mut num_parts = 0usize;
    messages
        .into_iter()
        .enumerate()
        .map(|(index, m)| {
            if !ROLES.contains(&m.role.as_str()) {
                return Err(bad_message(
                    index,
                    format!(
                        "unsupported role {:?} (supported: system, user, assistant, developer, \
                         tool)",
                        m.role
                    ),
                ));
            }
            // A key set to null or an empty list asks for nothing (the SDKs' `model_dump()`
            // writes `refusal`, `annotations`, `audio`, `function_call`); `cache_control`
            // (prompt caching hints some proxies add) changes nothing: the prefix cache is on.
            let neutral = |k: &str, v: &Value| {
                v.is_null() || v.as_array().is_some_and(Vec::is_empty) || k == "cache_control"
            };
            if let Some((key, _)) = m.other.iter().find(|(k, v)| !neutral(k, v)) {
                let shown: String = key.chars().take(64).collect();
                return Err(bad_message(index, format!("unknown field `{shown}`")));
            }
            if m.reasoning_content.is_some() && m.role != "assistant" {
                return Err(bad_message(index, "only assistant messages carry `reasoning_content`"));
            }
            let role = if m.role == "developer" { "system".to_owned() } else { m.role };
            let content = match m.content {
                None if role == "assistant" => String::new(),
                None => {
                    return Err(bad_message(index, format!("`content` is required for role {role:?}")));
                }
                Some(MessageContent::Text(t)) => t,
                Some(MessageContent::Parts(parts)) => {
                    num_parts += parts.len();
                    if num_parts > MAX_CONTENT_PARTS {
                        return Err(ApiError::bad_param(
                            "messages",
                            format!("at most {MAX_CONTENT_PARTS} content parts per request"),
                        ));
                    }
                    let mut text = String::new();
                    for part in parts {
                        let extra = part.other.iter().find(|(k, v)| !neutral(k, v));
                        if let Some((key, _)) = extra {
                            let shown: String = key.chars().take(64).collect();
                            return Err(bad_message(
                                index,
                                format!("content parts: unknown field `{shown}`"),
                            ));
                        }
                        match (part.kind.as_str(), part.text) {
                            ("text", Some(t)) => text.push_str(&t),
                            ("text", None) => {
                                return Err(bad_message(index, "a `text` part needs `text`"));
                            }
                            (kind, _) => {
                                return Err(bad_message(
                                    index,
                                    format!("content parts of type {kind:?} are not supported (text only)"),
                                ));
                            }
                        }
                    }
                    text
                }
            };
            let tool_calls = match m.tool_calls {
                None | Some(Value::Null) => None,
                Some(_) if role != "assistant" => {
                    return Err(bad_message(index, "only assistant messages carry `tool_calls`"));
                }
                Some(calls) => Some(tool_calls(index, calls)?),
            };
            Ok(ChatMessage {
                role,
                content,
                reasoning_content: m.reasoning_content,
                tool_calls,
                tool_call_id: m.tool_call_id,
                name: m.name,
            })
        })
        .collect()
}

/// An assistant's `tool_calls`, each `{"id", "type": "function", "function": {"name",
/// "arguments"}}`, with `arguments` (a JSON string in the API) parsed into an object for the
/// template, as vLLM passes them.
fn tool_calls(index: usize, calls: Value) -> Result<Vec<Value>, ApiError> {
    let Value::Array(calls) = calls else {
        return Err(bad_message(index, "`tool_calls` must be a list"));
    };
    calls
        .into_iter()
        .enumerate()
        .map(|(i, mut call)| {
            let at = |m: &str| bad_message(index, format!("tool_calls[{i}]: {m}"));
            let function = call.get_mut("function").and_then(Value::as_object_mut);
            let Some(function) = function else {
                return Err(at("needs a `function` object"));
            };
            if !function.get("name").is_some_and(Value::is_string) {
                return Err(at("`function.name` must be a string"));
            }
            let arguments = match function.get("arguments") {
                None | Some(Value::Null) => Value::Object(Map::new()),
                Some(Value::String(s)) => serde_json::from_str::<Value>(s)
                    .ok()
                    .filter(Value::is_object)
                    .ok_or_else(|| at("`function.arguments` must be a JSON object's text"))?,
                Some(v @ Value::Object(_)) => v.clone(),
                Some(_) => return Err(at("`function.arguments` must be a JSON object's text")),
            };
            function.insert("arguments".into(), arguments);
            Ok(call)
        })
        .collect()
}

/// `chat_template_kwargs`: an object whose keys are not the server's own variables.
pub fn template_kwargs(kwargs: Option<Value>) -> Result<Map<String, Value>, ApiError> {
    const P: &str = "chat_template_kwargs";
    match kwargs {
        None | Some(Value::Null) => Ok(Map::new()),
        Some(Value::Object(map)) => {
            if let Some(key) = map.keys().find(|k| RESERVED_VARIABLES.contains(&k.as_str())) {
                return Err(ApiError::bad_param(
                    P,
                    format!("`{P}` may not set `{key}` (it has its own request field)"),
                ));
            }
            Ok(map)
        }
        Some(_) => Err(ApiError::bad_param(P, format!("`{P}` must be an object"))),
    }
}

/// The efforts `reasoning_effort` takes.
const EFFORTS: [&str; 3] = ["low", "medium", "high"];

/// `reasoning_effort` (`low`, `medium`, `high`) set as the template variable of that name in
/// `kwargs`; refused when the template does not read it (it would change nothing) or when
/// `chat_template_kwargs` sets it too.
pub fn set_reasoning_effort(
    effort: Option<Value>,
    template: &crate::chat_template::ChatTemplate,
    kwargs: &mut Map<String, Value>,
) -> Result<(), ApiError> {
    const P: &str = "reasoning_effort";
    let effort = match effort {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::String(e)) if EFFORTS.contains(&e.as_str()) => e,
        Some(_) => {
            return Err(ApiError::bad_param(
                P,
                format!("`{P}` must be one of {}", EFFORTS.join(", ")),
            ));
        }
    };
    if !template.reads_variable(P) {
        return Err(ApiError::bad_param(
            P,
            format!(
                "the model's chat template ({}) has no reasoning effort (it does not read \
                 `{P}`), so the field would change nothing",
                template.source_name()
            ),
        ));
    }
    if kwargs.contains_key(P) {
        return Err(ApiError::bad_param(
            P,
            format!("`{P}` is set twice: as a field and in `chat_template_kwargs`"),
        ));
    }
    kwargs.insert(P.into(), Value::String(effort));
    Ok(())
}

/// Whether any string of `value` (an object's keys included) satisfies `test`.
fn holds_text(value: &Value, test: &impl Fn(&str) -> bool) -> bool {
    match value {
        Value::String(s) => test(s),
        Value::Array(items) => items.iter().any(|v| holds_text(v, test)),
        Value::Object(map) => map.iter().any(|(k, v)| test(k) || holds_text(v, test)),
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}

/// Refuses control-token text where the template may print client text that cannot be kept
/// literal: `tools`, `chat_template_kwargs` (keys and values, at any depth), and a message's
/// `tool_calls`, `tool_call_id` and `name`. Message content is kept literal instead.
pub fn check_client_text(
    tokenizer: &kiln_tokenizer::Tokenizer,
    messages: &[ChatMessage],
    options: &RenderOptions,
) -> Result<(), ApiError> {
    let control = |text: &str| tokenizer.contains_control_text(text);
    if let Some(tools) = &options.tools
        && tools.iter().any(|t| holds_text(t, &control))
    {
        return Err(ApiError::bad_param("tools", "`tools` holds control-token text"));
    }
    if options.kwargs.iter().any(|(k, v)| control(k) || holds_text(v, &control)) {
        return Err(ApiError::bad_param(
            "chat_template_kwargs",
            "`chat_template_kwargs` holds control-token text (the template may print it)",
        ));
    }
    for (index, m) in messages.iter().enumerate() {
        let calls = m.tool_calls.iter().flatten().any(|c| holds_text(c, &control));
        let fields = [m.tool_call_id.as_deref(), m.name.as_deref()];
        if calls || fields.into_iter().flatten().any(control) {
            return Err(bad_message(
                index,
                "`tool_calls`, `tool_call_id` and `name` may not hold control-token text",
            ));
        }
    }
    Ok(())
}

/// Renders the conversation and tokenizes it on a blocking thread (templates are
/// fuel-bounded, not free). Message content is literal text: control-token text in it never
/// becomes a control token (`Tokenizer::encode_with_literals`); if the template transforms
/// content so that it cannot be located in the prompt, content holding control-token text is
/// refused (400, `messages`) rather than risk a forged turn. Tools, tool calls and message
/// names are JSON the template may reshape, so control-token text in them is refused too, and
/// so is control-token text in `chat_template_kwargs` (templates print some, as Llama 3.x
/// prints `date_string`).
pub async fn render_tokens(
    loaded: &Arc<Loaded>,
    messages: Vec<ChatMessage>,
    options: RenderOptions,
    add_special_tokens: bool,
) -> Result<Vec<TokenId>, ApiError> {
    let content_bytes: usize = messages.iter().map(|m| m.content.len()).sum();
    // The content alone is part of the prompt: refused before the template runs.
    loaded.tokenize_gate.check_fits(content_bytes, loaded.limits.max_model_len)?;
    let _permit = loaded.tokenize_gate.admit(content_bytes).await?;
    let loaded = Arc::clone(loaded);
    tokio::task::spawn_blocking(move || {
        let tokenizer = &loaded.tokenizer;
        check_client_text(tokenizer, &messages, &options)?;
        let marked = loaded
            .template
            .render_marked(&messages, &options)
            .map_err(|e| ApiError::bad_param("messages", format!("chat template: {e}")))?;
        loaded.tokenize_gate.check_fits(marked.text.len(), loaded.limits.max_model_len)?;
        // Printed kwargs strings are literal too where they can be located; where they cannot
        // (the template compared one), only their own control text was refused above.
        let kwargs_literals = marked.kwargs_ranges.unwrap_or_default();
        let mut literals = if let Some(ranges) = marked.content_ranges {
            ranges
        } else {
            let control = |m: &ChatMessage| {
                tokenizer.contains_control_text(&m.content)
                    || m.reasoning_content
                        .as_deref()
                        .is_some_and(|r| tokenizer.contains_control_text(r))
            };
            if let Some(index) = messages.iter().position(control) {
                return Err(bad_message(
                    index,
                    "the content holds control-token text and this chat template transforms \
                     content, so it cannot be kept as plain text",
                ));
            }
            Vec::new()
        };
        literals.extend(kwargs_literals);
        tokenizer
            .encode_with_literals(&marked.text, &literals, add_special_tokens)
            .map(|ids| ids.into_iter().map(TokenId).collect())
            .map_err(|e| ApiError::bad_param("messages", format!("could not tokenize: {e}")))
    })
    .await
    .map_err(|e| ApiError::internal(format!("template task failed: {e}")))?
}
