//! A chat output as Anthropic content blocks: whole (`{"type": "message", "content": [..]}`)
//! or as the Messages event stream (`message_start`, then per block `content_block_start`,
//! `content_block_delta`s and `content_block_stop`, then `message_delta` with the stop reason
//! and `message_stop`; an `error` event if the generation fails).
//!
//! Blocks come in the output's order: the thinking (with `--reasoning-parser`), the text, then
//! one `tool_use` block per call. `usage.input_tokens` counts the prompt tokens not read from
//! the prefix cache, `cache_read_input_tokens` those that were (Anthropic's split).

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::error_body;
use crate::generate::{ChoiceResult, Usage};
use crate::reasoning::{ReasoningSplit, Start};
use crate::sequence::{Delta, Sequence};
use crate::state::ServerState;
use crate::tools::{self, ToolCallParser, ToolOutput, ToolStream};

/// What every form of the message shares.
pub struct Head {
    pub id: String,
    pub model: String,
}

/// How the output is read into blocks.
pub struct Reader {
    state: Arc<ServerState>,
    output: ToolOutput,
    reasoning: Option<(Start, bool)>,
    parser: Option<ToolCallParser>,
}

impl Reader {
    pub fn new(
        state: &Arc<ServerState>,
        output: ToolOutput,
        reasoning: Option<(Start, bool)>,
    ) -> Self {
        let parser = state.config.tools.parser;
        Self { state: Arc::clone(state), output, reasoning, parser }
    }

    /// A fresh `tool_use` id (`toolu_…`; a Mistral template needs its own 9-character ids).
    fn new_id(&self) -> String {
        let unique = self.state.unique();
        if self.parser == Some(ToolCallParser::Mistral) {
            return tools::call_id(unique, self.parser);
        }
        format!("toolu_{unique:016x}")
    }
}

/// Anthropic's `stop_reason` for an engine finish reason.
fn stop_reason(finish: Option<&str>, stop_string: Option<&str>) -> &'static str {
    match (finish, stop_string) {
        (Some("tool_calls"), _) => "tool_use",
        (Some("length"), _) => "max_tokens",
        (_, Some(_)) => "stop_sequence",
        _ => "end_turn",
    }
}

fn usage_json(usage: &Usage) -> Value {
    let prompt: usize = usage.prompt_tokens.iter().sum();
    let cached: usize = usage.cached_tokens.iter().sum();
    json!({
        "input_tokens": prompt - cached.min(prompt),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": usage.completion_tokens,
    })
}

/// A call's arguments as the `input` object (`None`: not a JSON object, e.g. cut short).
fn input_object(arguments: &str) -> Option<Value> {
    serde_json::from_str::<Value>(arguments).ok().filter(Value::is_object)
}

/// The whole message of one finished output.
pub fn whole(head: &Head, reader: &Reader, r: ChoiceResult, usage: &Usage) -> Value {
    let mut content = Vec::new();
    let text = match reader.reasoning {
        Some((start, include)) => {
            let split = ReasoningSplit::whole(start, &r.text);
            if include && !split.reasoning.is_empty() {
                content.push(
                    json!({"type": "thinking", "thinking": split.reasoning, "signature": ""}),
                );
            }
            split.answer
        }
        None => r.text,
    };
    let answer = tools::answer(&reader.output, text, r.finish_reason);
    if let Some(text) = answer.content.filter(|t| !t.is_empty()) {
        content.push(json!({"type": "text", "text": text}));
    }
    for call in &answer.calls {
        match input_object(&call.arguments) {
            Some(input) => content.push(json!({
                "type": "tool_use", "id": reader.new_id(), "name": call.name, "input": input,
            })),
            // Arguments cut short (`max_tokens`) stay visible as text.
            None => content.push(json!({"type": "text", "text": call.arguments})),
        }
    }
    json!({
        "id": head.id,
        "type": "message",
        "role": "assistant",
        "model": head.model,
        "content": content,
        "stop_reason": stop_reason(answer.finish_reason, r.stop_string.as_deref()),
        "stop_sequence": r.stop_string,
        "usage": usage_json(usage),
    })
}

/// The kind of the block being streamed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Thinking,
    Text,
    ToolUse,
}

/// Content blocks turned into events as their pieces come.
#[derive(Default)]
struct Blocks {
    open: Option<Kind>,
    /// Index of the open block (or of the next one when none is).
    index: usize,
    events: Vec<Event>,
}

fn event(name: &str, mut data: Value) -> Event {
    data["type"] = json!(name);
    Event::default().event(name).data(data.to_string())
}

impl Blocks {
    fn close(&mut self) {
        if self.open.take().is_some() {
            self.events.push(event("content_block_stop", json!({"index": self.index})));
            self.index += 1;
        }
    }

    fn start(&mut self, kind: Kind, block: &Value) {
        self.close();
        self.open = Some(kind);
        let start = json!({"index": self.index, "content_block": block});
        self.events.push(event("content_block_start", start));
    }

    fn delta(&mut self, delta: &Value) {
        self.events
            .push(event("content_block_delta", json!({"index": self.index, "delta": delta})));
    }

    fn thinking(&mut self, text: &str) {
        if self.open != Some(Kind::Thinking) {
            self.start(
                Kind::Thinking,
                &json!({"type": "thinking", "thinking": "", "signature": ""}),
            );
        }
        self.delta(&json!({"type": "thinking_delta", "thinking": text}));
    }

    fn text(&mut self, text: &str) {
        if self.open != Some(Kind::Text) {
            self.start(Kind::Text, &json!({"type": "text", "text": ""}));
        }
        self.delta(&json!({"type": "text_delta", "text": text}));
    }

    /// One `delta.tool_calls` entry of [`ToolStream`]: a call's start (with `id`) or more of
    /// its arguments.
    fn tool_call(&mut self, call: &Value, reader: &Reader) {
        let arguments = call["function"]["arguments"].as_str().unwrap_or_default();
        if call.get("id").is_some() {
            let name = call["function"]["name"].clone();
            let block =
                json!({"type": "tool_use", "id": reader.new_id(), "name": name, "input": {}});
            self.start(Kind::ToolUse, &block);
        }
        if !arguments.is_empty() {
            self.delta(&json!({"type": "input_json_delta", "partial_json": arguments}));
        }
    }
}

/// The state of one streamed message.
struct Streamed {
    reader: Reader,
    split: Option<ReasoningSplit>,
    tools: ToolStream,
    blocks: Blocks,
}

impl Streamed {
    /// The events of one delta; `output_tokens` so far, this one's included.
    fn push(&mut self, delta: &Delta, output_tokens: usize) -> Vec<Event> {
        let last = delta.finish_reason.is_some();
        let (thinking, text) = match &mut self.split {
            Some(split) => {
                let s = split.push(&delta.text, last);
                let include = self.reader.reasoning.is_some_and(|(_, include)| include);
                (if include { s.reasoning } else { String::new() }, s.answer)
            }
            None => (String::new(), delta.text.clone()),
        };
        if !thinking.is_empty() {
            self.blocks.thinking(&thinking);
        }
        let reader = &self.reader;
        let mut new_id = || reader.new_id();
        let step = self.tools.push(&text, delta.finish_reason, &mut new_id);
        if !step.content.is_empty() {
            self.blocks.text(&step.content);
        }
        for call in &step.tool_calls {
            self.blocks.tool_call(call, &self.reader);
        }
        if last {
            self.blocks.close();
            let reason = stop_reason(step.finish_reason, delta.stop_string.as_deref());
            let stop = json!({"stop_reason": reason, "stop_sequence": delta.stop_string});
            let usage = json!({"output_tokens": output_tokens});
            self.blocks.events.push(event("message_delta", json!({"delta": stop, "usage": usage})));
            self.blocks.events.push(event("message_stop", json!({})));
        }
        std::mem::take(&mut self.blocks.events)
    }
}

/// The message as Server-Sent Events. `message_start` goes out with the first token (when the
/// prompt's cached part is known); the stream stops, dropping (so aborting) the sequence, as
/// soon as the client is gone.
pub fn stream(
    mut seq: Sequence,
    state: &Arc<ServerState>,
    head: Head,
    reader: Reader,
    num_prompt_tokens: usize,
) -> Response {
    let (tx, rx) = mpsc::channel::<Event>(64);
    let aborted = state.aborted();
    let keep_alive = state.config.keep_alive;
    let split = reader.reasoning.map(|(start, _)| ReasoningSplit::new(start));
    let tools = ToolStream::new(reader.output.clone());
    let mut streamed = Streamed { reader, split, tools, blocks: Blocks::default() };
    tokio::spawn(async move {
        let mut usage = Usage::new(&[num_prompt_tokens]);
        let mut aborted = std::pin::pin!(aborted);
        let mut started = false;
        loop {
            let next = tokio::select! {
                () = tx.closed() => return,
                () = &mut aborted => {
                    let e = error_body(
                        axum::http::StatusCode::SERVICE_UNAVAILABLE,
                        "The server shut down before the message finished.",
                    );
                    let _ = tx.send(event("error", e)).await;
                    return;
                }
                next = seq.next() => next,
            };
            let delta = match next {
                None => return,
                Some(Err(e)) => {
                    let _ = tx.send(event("error", error_body(e.status, &e.message))).await;
                    return;
                }
                Some(Ok(delta)) => delta,
            };
            if let Some(cached) = delta.num_cached_tokens {
                usage.cached_tokens[0] = cached;
            }
            usage.completion_tokens += 1;
            let mut events = Vec::new();
            if !started {
                started = true;
                let mut first = usage_json(&usage);
                first["output_tokens"] = json!(0);
                let message = json!({
                    "id": head.id, "type": "message", "role": "assistant", "model": head.model,
                    "content": [], "stop_reason": null, "stop_sequence": null, "usage": first,
                });
                events.push(event("message_start", json!({"message": message})));
            }
            let last = delta.finish_reason.is_some();
            events.extend(streamed.push(&delta, usage.completion_tokens));
            for e in events {
                if tx.send(e).await.is_err() {
                    return;
                }
            }
            if last {
                return;
            }
        }
    });
    let events = stream::unfold(rx, |mut rx| async move {
        let event = rx.recv().await?;
        Some((Ok::<_, Infallible>(event), rx))
    });
    Sse::new(events).keep_alive(KeepAlive::new().interval(keep_alive)).into_response()
}
