//! A chat output as Responses output items, built token by token by one [`Assembler`] for
//! both forms of a response: whole (the items only) and streamed (the items plus the
//! Responses event sequence: `response.output_item.added`, `response.content_part.added`,
//! `response.reasoning_text.delta` / `response.output_text.delta` /
//! `response.function_call_arguments.delta`, their `.done` events, `response.output_item.done`;
//! the driver adds `response.created`, `response.in_progress` and `response.completed` or
//! `response.incomplete` or `response.failed`).
//!
//! Invariants: a streamed response's items equal the whole response's (one code path reads
//! the deltas); items come in the output's order: the reasoning (with `--reasoning-parser`),
//! the message, then one `function_call` item per call; every item that is added is done
//! before the next is added and before the response ends; `sequence_number` counts every
//! event of a stream from 0; a response that produced nothing still has one (empty)
//! message, so `output_text` is defined.

use std::sync::Arc;

use serde_json::{Map, Value, json};

use crate::reasoning::{ReasoningSplit, Start};
use crate::routes::format::chat_logprobs;
use crate::sequence::Delta;
use crate::state::ServerState;
use crate::tools::{self, ToolCallParser, ToolOutput, ToolStream};

/// What every form of the response object shares.
pub struct Head {
    pub id: String,
    pub created_at: u64,
    pub model: String,
    /// The request's fields the object repeats.
    pub echo: Map<String, Value>,
}

impl Head {
    /// The response object with `status` and `output`; `usage` null until it is known.
    pub fn object(&self, status: &str, output: Vec<Value>, usage: Value) -> Value {
        let mut r = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": null,
            "incomplete_details": null,
            "model": self.model,
        });
        r["output"] = Value::Array(output);
        r["usage"] = usage;
        for (key, value) in &self.echo {
            r[key] = value.clone();
        }
        r
    }
}

/// The kind of the item being built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Reasoning,
    Message,
    Call,
}

/// The item being built.
struct Open {
    kind: Kind,
    id: String,
    /// The reasoning text, the message text or the call's arguments.
    text: String,
    /// The message's log-probabilities (entries of chat's `logprobs.content`).
    logprobs: Vec<Value>,
    call_id: String,
    name: String,
}

/// How a response ended, for its status.
pub struct Finished {
    pub items: Vec<Value>,
    /// Whether `max_output_tokens` (or the context) cut it short.
    pub incomplete: bool,
    pub output_tokens: usize,
    pub reasoning_tokens: usize,
    pub cached_tokens: usize,
}

impl Finished {
    /// The response's `usage` for a prompt of `input_tokens`.
    pub fn usage(&self, input_tokens: usize) -> Value {
        json!({
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": input_tokens + self.output_tokens,
        })
    }

    /// The response object of `head` once finished.
    pub fn object(&self, head: &Head, input_tokens: usize) -> Value {
        let status = if self.incomplete { "incomplete" } else { "completed" };
        let mut r = head.object(status, self.items.clone(), self.usage(input_tokens));
        if self.incomplete {
            r["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        r
    }
}

/// Reads one output's deltas into items (and, for a stream, events).
pub struct Assembler {
    state: Arc<ServerState>,
    /// With log-probabilities asked for: the tokenizer that spells their tokens.
    logprobs: Option<Arc<kiln_tokenizer::Tokenizer>>,
    parser: Option<ToolCallParser>,
    split: Option<ReasoningSplit>,
    include_reasoning: bool,
    tools: ToolStream,
    items: Vec<Value>,
    open: Option<Open>,
    events: Vec<Value>,
    sequence_number: u64,
    /// Log-probabilities of answer tokens not yet sent with a text delta.
    pending_logprobs: Vec<Value>,
    output_tokens: usize,
    reasoning_tokens: usize,
    saw_reasoning: bool,
    cached_tokens: usize,
    finished: Option<bool>,
}

impl Assembler {
    /// `logprobs`: the tokenizer, when the message's log-probabilities are asked for.
    pub fn new(
        state: &Arc<ServerState>,
        logprobs: Option<Arc<kiln_tokenizer::Tokenizer>>,
        output: ToolOutput,
        reasoning: Option<(Start, bool)>,
    ) -> Self {
        Self {
            state: Arc::clone(state),
            logprobs,
            parser: state.config.tools.parser,
            split: reasoning.map(|(start, _)| ReasoningSplit::new(start)),
            include_reasoning: reasoning.is_some_and(|(_, include)| include),
            tools: ToolStream::new(output),
            items: Vec::new(),
            open: None,
            events: Vec::new(),
            sequence_number: 0,
            pending_logprobs: Vec::new(),
            output_tokens: 0,
            reasoning_tokens: 0,
            saw_reasoning: false,
            cached_tokens: 0,
            finished: None,
        }
    }

    /// An event of type `kind` with the next sequence number (taken by [`Self::take_events`]).
    pub fn event(&mut self, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence_number);
        self.sequence_number += 1;
        self.events.push(data);
    }

    /// The events produced since the last call.
    pub fn take_events(&mut self) -> Vec<Value> {
        std::mem::take(&mut self.events)
    }

    fn item_id(&self, prefix: &str) -> String {
        format!("{prefix}_{:016x}", self.state.unique())
    }

    /// Takes one delta of the output.
    pub fn push(&mut self, delta: &Delta) {
        self.output_tokens += 1;
        if let Some(cached) = delta.num_cached_tokens {
            self.cached_tokens = cached;
        }
        let last = delta.finish_reason.is_some();
        let (reasoning, answer, in_reasoning) = match &mut self.split {
            Some(split) => {
                let s = split.push(&delta.text, last);
                let in_reasoning =
                    !s.reasoning.is_empty() || (self.saw_reasoning && !split.in_answer());
                (s.reasoning, s.answer, in_reasoning)
            }
            None => (String::new(), delta.text.clone(), false),
        };
        if in_reasoning {
            self.reasoning_tokens += 1;
            self.saw_reasoning = true;
        }
        if let (Some(lp), Some(tokenizer)) = (&delta.logprobs, &self.logprobs) {
            // A token of the thinking has no place in the message's log-probabilities.
            if reasoning.is_empty() || !answer.is_empty() {
                let entries = chat_logprobs(tokenizer, std::slice::from_ref(lp));
                self.pending_logprobs
                    .extend(entries["content"].as_array().cloned().unwrap_or_default());
            }
        }
        if self.include_reasoning && !reasoning.is_empty() {
            self.reasoning_text(&reasoning);
        }
        let (state, parser) = (&self.state, self.parser);
        let mut new_id = || match parser {
            Some(ToolCallParser::Mistral) => tools::call_id(state.unique(), parser),
            _ => format!("call_{:016x}", state.unique()),
        };
        let step = self.tools.push(&answer, delta.finish_reason, &mut new_id);
        if !step.content.is_empty() {
            self.message_text(&step.content);
        }
        for call in &step.tool_calls {
            self.tool_call(call);
        }
        if last {
            let incomplete = step.finish_reason == Some("length");
            if self.items.is_empty() && self.open.is_none() {
                self.message_text("");
            }
            self.close(if incomplete { "incomplete" } else { "completed" });
            self.finished = Some(incomplete);
        }
    }

    /// The items and counts, once the last delta is in (`None` before).
    pub fn finished(&self) -> Option<Finished> {
        let incomplete = self.finished?;
        Some(Finished {
            items: self.items.clone(),
            incomplete,
            output_tokens: self.output_tokens,
            reasoning_tokens: self.reasoning_tokens,
            cached_tokens: self.cached_tokens,
        })
    }

    /// Opens an item of `kind` unless one is open; returns its output index.
    fn ensure_open(&mut self, kind: Kind, call: Option<(String, String)>) -> usize {
        if self.open.as_ref().is_some_and(|o| o.kind == kind && call.is_none()) {
            return self.items.len();
        }
        self.close("completed");
        // The item just closed (if any) took the index before this one.
        let index = self.items.len();
        let prefix = match kind {
            Kind::Reasoning => "rs",
            Kind::Message => "msg",
            Kind::Call => "fc",
        };
        let id = self.item_id(prefix);
        let (call_id, name) = call.unwrap_or_default();
        let item = match kind {
            Kind::Reasoning => json!({
                "id": id, "type": "reasoning", "summary": [], "content": [],
                "status": "in_progress",
            }),
            Kind::Message => json!({
                "id": id, "type": "message", "status": "in_progress", "role": "assistant",
                "content": [],
            }),
            Kind::Call => json!({
                "id": id, "type": "function_call", "status": "in_progress", "call_id": call_id,
                "name": name, "arguments": "",
            }),
        };
        self.event("response.output_item.added", json!({"output_index": index, "item": item}));
        let part = match kind {
            Kind::Reasoning => Some(json!({"type": "reasoning_text", "text": ""})),
            Kind::Message => {
                Some(json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
            }
            Kind::Call => None,
        };
        if let Some(part) = part {
            let added =
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": part});
            self.event("response.content_part.added", added);
        }
        self.open =
            Some(Open { kind, id, text: String::new(), logprobs: Vec::new(), call_id, name });
        index
    }

    fn reasoning_text(&mut self, text: &str) {
        let index = self.ensure_open(Kind::Reasoning, None);
        let Some(open) = self.open.as_mut() else { return };
        open.text.push_str(text);
        let id = open.id.clone();
        self.event(
            "response.reasoning_text.delta",
            json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text}),
        );
    }

    fn message_text(&mut self, text: &str) {
        let index = self.ensure_open(Kind::Message, None);
        let logprobs = std::mem::take(&mut self.pending_logprobs);
        let Some(open) = self.open.as_mut() else { return };
        open.text.push_str(text);
        open.logprobs.extend(logprobs.iter().cloned());
        let id = open.id.clone();
        if text.is_empty() {
            return;
        }
        self.event(
            "response.output_text.delta",
            json!({
                "item_id": id, "output_index": index, "content_index": 0, "delta": text,
                "logprobs": logprobs,
            }),
        );
    }

    /// One `delta.tool_calls` entry of [`ToolStream`]: a call's start (with `id`) or more of
    /// its arguments.
    fn tool_call(&mut self, call: &Value) {
        let function = &call["function"];
        let arguments = function["arguments"].as_str().unwrap_or_default();
        let index = match call["id"].as_str() {
            Some(call_id) => {
                let name = function["name"].as_str().unwrap_or_default().to_owned();
                self.ensure_open(Kind::Call, Some((call_id.to_owned(), name)))
            }
            None => self.ensure_open(Kind::Call, None),
        };
        if arguments.is_empty() {
            return;
        }
        let Some(open) = self.open.as_mut() else { return };
        open.text.push_str(arguments);
        let id = open.id.clone();
        self.event(
            "response.function_call_arguments.delta",
            json!({"item_id": id, "output_index": index, "delta": arguments}),
        );
    }

    /// Ends the open item (if any) with `status`.
    fn close(&mut self, status: &str) {
        let Some(open) = self.open.take() else { return };
        let index = self.items.len();
        let id = open.id;
        let item = match open.kind {
            Kind::Reasoning => {
                let text = open.text;
                let at = json!({"item_id": id, "output_index": index, "content_index": 0});
                let mut done = at.clone();
                done["text"] = json!(text);
                self.event("response.reasoning_text.done", done);
                let part = json!({"type": "reasoning_text", "text": text});
                let mut part_done = at;
                part_done["part"] = part.clone();
                self.event("response.content_part.done", part_done);
                json!({
                    "id": id, "type": "reasoning", "summary": [], "content": [part],
                    "status": status,
                })
            }
            Kind::Message => {
                let mut logprobs = open.logprobs;
                // Tokens after the last text (the end-of-sequence token) belong here too.
                logprobs.append(&mut self.pending_logprobs);
                let at = json!({"item_id": id, "output_index": index, "content_index": 0});
                let mut done = at.clone();
                done["text"] = json!(open.text);
                done["logprobs"] = json!(logprobs);
                self.event("response.output_text.done", done);
                let part = json!({
                    "type": "output_text", "text": open.text, "annotations": [],
                    "logprobs": logprobs,
                });
                let mut part_done = at;
                part_done["part"] = part.clone();
                self.event("response.content_part.done", part_done);
                json!({
                    "id": id, "type": "message", "status": status, "role": "assistant",
                    "content": [part],
                })
            }
            Kind::Call => {
                self.event(
                    "response.function_call_arguments.done",
                    json!({
                        "item_id": id, "output_index": index, "name": open.name,
                        "arguments": open.text,
                    }),
                );
                json!({
                    "id": id, "type": "function_call", "status": status, "call_id": open.call_id,
                    "name": open.name, "arguments": open.text,
                })
            }
        };
        self.event("response.output_item.done", json!({"output_index": index, "item": item}));
        self.items.push(item);
    }
}

#[cfg(test)]
mod tests {
    use kiln_core::TokenId;

    use super::*;
    use crate::config::ServerConfig;

    fn delta(text: &str, finish: Option<&'static str>) -> Delta {
        Delta {
            text: text.into(),
            token: TokenId(1),
            logprobs: None,
            finish_reason: finish,
            stop_string: None,
            prompt_logprobs: None,
            num_cached_tokens: None,
            pooled: None,
            kv_pin: None,
        }
    }

    /// Runs `pieces` (the last one finishes with `finish`) through an assembler; returns the
    /// finished items and every event.
    fn assemble(
        output: ToolOutput,
        reasoning: Option<(Start, bool)>,
        pieces: &[&str],
        finish: &'static str,
    ) -> (Finished, Vec<Value>) {
        let state = ServerState::new(ServerConfig::default());
        let mut asm = Assembler::new(&state, None, output, reasoning);
        let mut events = Vec::new();
        for (i, piece) in pieces.iter().enumerate() {
            let last = (i + 1 == pieces.len()).then_some(finish);
            asm.push(&delta(piece, last));
            events.extend(asm.take_events());
        }
        (asm.finished().unwrap(), events)
    }

    /// `output_index` of every item event, checked to open, fill and close each item in turn.
    fn check_order(events: &[Value]) {
        let mut open = None;
        let mut next = 0;
        for e in events {
            let index = e["output_index"].as_u64();
            match e["type"].as_str().unwrap() {
                "response.output_item.added" => {
                    assert_eq!((open, index), (None, Some(next)), "{events:?}");
                    open = index;
                }
                "response.output_item.done" => {
                    assert_eq!(index, open, "{events:?}");
                    open = None;
                    next += 1;
                }
                _ => assert_eq!(index, open, "{e}"),
            }
        }
        assert_eq!(open, None);
    }

    #[test]
    fn thinking_then_an_answer_are_two_items_in_order() {
        let reasoning = Some((Start::Reasoning, true));
        let pieces = ["Let me ", "see.</th", "ink>\n\nYes, ", "it is."];
        let (finished, events) = assemble(ToolOutput::Text, reasoning, &pieces, "stop");
        check_order(&events);
        let items = &finished.items;
        assert_eq!(items.len(), 2, "{items:?}");
        assert_eq!(items[0]["type"], "reasoning");
        assert_eq!(items[0]["content"][0]["text"], "Let me see.");
        assert_eq!(items[1]["type"], "message");
        assert_eq!(items[1]["content"][0]["text"], "Yes, it is.");
        assert!(!finished.incomplete);
        assert_eq!((finished.output_tokens, finished.reasoning_tokens), (4, 2));
    }

    #[test]
    fn a_named_call_is_one_function_call_item_and_a_cut_one_is_incomplete() {
        let named = ToolOutput::Named("get".into());
        let (finished, events) = assemble(named.clone(), None, &["{\"a\":", "1}"], "stop");
        check_order(&events);
        let item = &finished.items[0];
        assert_eq!(
            (item["type"].as_str(), item["name"].as_str()),
            (Some("function_call"), Some("get"))
        );
        assert_eq!(
            (item["arguments"].as_str(), item["status"].as_str()),
            (Some("{\"a\":1}"), Some("completed"))
        );
        let deltas: String = events
            .iter()
            .filter(|e| e["type"] == "response.function_call_arguments.delta")
            .map(|e| e["delta"].as_str().unwrap())
            .collect();
        assert_eq!(deltas, "{\"a\":1}");
        let (cut, _) = assemble(named, None, &["{\"a\":"], "length");
        assert!(cut.incomplete);
        assert_eq!(cut.items[0]["status"], "incomplete");
    }

    #[test]
    fn an_empty_output_is_one_empty_message() {
        let (finished, events) = assemble(ToolOutput::Text, None, &[""], "stop");
        check_order(&events);
        assert_eq!(finished.items.len(), 1);
        assert_eq!(finished.items[0]["content"][0]["text"], "");
        let numbers: Vec<u64> =
            events.iter().map(|e| e["sequence_number"].as_u64().unwrap()).collect();
        assert_eq!(numbers, (0..events.len() as u64).collect::<Vec<_>>());
    }
}
