//! A Responses request's `input` items as chat messages: messages (any role, text parts),
//! `function_call` items joined to the assistant turn they belong to, `function_call_output`
//! items as `tool` messages, a `reasoning` item's text as the `reasoning_content` of the
//! assistant turn after it (a template decides which turns print it).
//!
//! Invariant: every item key is carried over, set to `null`, or refused with a 400 naming it
//! (`{param}.{index}: ...`).

use std::collections::HashMap;

use serde_json::{Map, Value, json};

use crate::error::ApiError;
use crate::protocol::ChatMessageIn;

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::bad_param(param, message)
}

/// `input` as a list of items (a string is one user message).
pub(super) fn input_items(input: Option<Value>) -> Result<Vec<Value>, ApiError> {
    match input {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(text)) => {
            Ok(vec![json!({"type": "message", "role": "user", "content": text})])
        }
        Some(Value::Array(items)) => Ok(items),
        Some(_) => Err(bad("input", "`input` must be a string or a list of items")),
    }
}

/// The keys each item type may have.
fn item_keys(kind: &str) -> &'static [&'static str] {
    match kind {
        "message" => &["type", "role", "content", "id", "status"],
        "function_call" => &["type", "call_id", "name", "arguments", "id", "status"],
        "function_call_output" => &["type", "call_id", "output", "id", "status"],
        "reasoning" => &["type", "id", "summary", "content", "encrypted_content", "status"],
        _ => &[],
    }
}

/// The text of a message item's `content` (a string or text parts).
fn content_text(content: &Value, role: &str) -> Result<String, String> {
    let parts = match content {
        Value::String(s) => return Ok(s.clone()),
        Value::Array(parts) => parts,
        _ => return Err("`content` must be a string or a list of parts".into()),
    };
    let texts = parts
        .iter()
        .enumerate()
        .map(|(p, part)| {
            let at = |m: &str| format!("content.{p}: {m}");
            let kind = part.get("type").and_then(Value::as_str).unwrap_or_default();
            let (key, allowed): (&str, &[&str]) = match (kind, role) {
                ("input_text", _) => ("text", &["type", "text"]),
                ("output_text", "assistant") => {
                    ("text", &["type", "text", "annotations", "logprobs"])
                }
                ("refusal", "assistant") => ("refusal", &["type", "refusal"]),
                ("input_image" | "input_file" | "input_audio", _) => {
                    return Err(at(&format!("{kind} parts are not supported (text only)")));
                }
                _ => return Err(at(&format!("a part of type {kind:?} in a {role} message"))),
            };
            let obj = part.as_object().ok_or_else(|| at("a part must be an object"))?;
            if let Some((k, _)) =
                obj.iter().find(|(k, v)| !v.is_null() && !allowed.contains(&k.as_str()))
            {
                return Err(at(&format!("`{k}` is not supported")));
            }
            obj.get(key)
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| at(&format!("`{key}` must be a string")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(texts.join("\n"))
}

/// Appends the chat messages of `items` to `out`; `param` names where they came from in
/// errors; `names` maps call ids to their function (a tool message's `name`).
pub(super) fn chat_messages(
    items: &[Value],
    param: &str,
    names: &mut HashMap<String, String>,
    out: &mut Vec<ChatMessageIn>,
) -> Result<(), ApiError> {
    // The text of reasoning items not yet given to the assistant turn they precede.
    let mut reasoning: Vec<String> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let at = |m: String| bad(param, format!("{param}.{i}: {m}"));
        let Some(obj) = item.as_object() else {
            return Err(at("an item must be an object".into()));
        };
        // A message may leave out its `type`.
        let kind = match obj.get("type") {
            None if obj.contains_key("role") => "message",
            Some(Value::String(kind)) => kind.as_str(),
            _ => return Err(at("an item needs a `type`".into())),
        };
        let allowed = item_keys(kind);
        if allowed.is_empty() {
            return Err(at(format!(
                "items of type {kind:?} are not supported (message, function_call, \
                 function_call_output and reasoning are)"
            )));
        }
        // A key set to null asks for nothing (the SDKs' `model_dump()` writes every field).
        let extra = obj.iter().find(|(k, v)| !v.is_null() && !allowed.contains(&k.as_str()));
        if let Some((key, _)) = extra {
            return Err(at(format!("`{key}` is not supported in a {kind} item")));
        }
        let string = |key: &str| {
            obj.get(key)
                .and_then(Value::as_str)
                .ok_or_else(|| at(format!("a {kind} item needs a string `{key}`")))
        };
        match kind {
            "message" => {
                let Some(role @ ("user" | "system" | "developer" | "assistant")) =
                    obj.get("role").and_then(Value::as_str)
                else {
                    return Err(at("`role` must be user, system, developer or assistant".into()));
                };
                let content = obj.get("content").unwrap_or(&Value::Null);
                let text = content_text(content, role).map_err(at)?;
                let mut m = ChatMessageIn::text(role, text);
                if role == "assistant" && !reasoning.is_empty() {
                    m.reasoning_content = Some(reasoning.join("\n"));
                }
                reasoning.clear();
                out.push(m);
            }
            "function_call" => {
                let (call_id, name) = (string("call_id")?, string("name")?);
                let arguments = string("arguments")?;
                names.insert(call_id.to_owned(), name.to_owned());
                let call = json!({
                    "id": call_id, "type": "function",
                    "function": {"name": name, "arguments": arguments},
                });
                push_call(out, call, &mut reasoning);
            }
            "function_call_output" => {
                let call_id = string("call_id")?;
                let output = match obj.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(parts @ Value::Array(_)) => content_text(parts, "user").map_err(at)?,
                    _ => return Err(at("`output` must be a string or text parts".into())),
                };
                let mut m = ChatMessageIn::text("tool", output);
                m.tool_call_id = Some(call_id.to_owned());
                m.name = names.get(call_id).cloned();
                out.push(m);
                reasoning.clear();
            }
            // The reasoning goes to the assistant turn that follows it, as that message's
            // `reasoning_content` (a thinking model's template decides which turns keep it).
            _ => reasoning.extend(reasoning_texts(obj)),
        }
    }
    Ok(())
}

/// Adds a call to the assistant turn at the end of `out` (calls after an assistant message,
/// or after each other, join its turn), or to a new one; the `reasoning` before it becomes
/// that turn's `reasoning_content`.
fn push_call(out: &mut Vec<ChatMessageIn>, call: Value, reasoning: &mut Vec<String>) {
    match out.last_mut() {
        Some(last) if last.role == "assistant" => match &mut last.tool_calls {
            Some(Value::Array(calls)) => calls.push(call),
            _ => last.tool_calls = Some(json!([call])),
        },
        _ => {
            let mut m = ChatMessageIn::text("assistant", String::new());
            m.tool_calls = Some(json!([call]));
            out.push(m);
        }
    }
    if let Some(last) = out.last_mut()
        && !reasoning.is_empty()
        && last.reasoning_content.is_none()
    {
        last.reasoning_content = Some(reasoning.join("\n"));
    }
    reasoning.clear();
}

/// A reasoning item's text: its `content` parts, else its `summary` parts.
fn reasoning_texts(item: &Map<String, Value>) -> Vec<String> {
    let texts = |key: &str| -> Vec<String> {
        let parts = item.get(key).and_then(Value::as_array).into_iter().flatten();
        parts.filter_map(|p| p.get("text").and_then(Value::as_str).map(str::to_owned)).collect()
    };
    let content = texts("content");
    if content.is_empty() { texts("summary") } else { content }
}
