//! Tool calling on `/v1/chat/completions`: the request's tools ([`request`]), the model's text
//! turned into OpenAI's `message.tool_calls` ([`parser`], [`answer`]) or streamed as
//! `delta.tool_calls` ([`ToolStream`]).
//!
//! Invariants: a streamed answer carries the same content and calls as the whole one (both go
//! through [`ToolOutput`] and the parser's one `split`); `finish_reason` is `"tool_calls"`
//! exactly when calls were made by `auto` or `required` (a named choice keeps the engine's
//! reason, as OpenAI does); `arguments` is always a JSON object's text.

pub mod parser;
mod pythonic;
pub mod request;

use serde_json::{Value, json};

pub use parser::ToolCallParser;
pub use request::{ToolOutput, ToolPlan, ToolSettings, plan};

/// One call a model made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as JSON text (an object).
    pub arguments: String,
}

/// A choice's answer: content, calls, and the finish reason the client sees.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    pub content: Option<String>,
    pub calls: Vec<ToolCall>,
    pub finish_reason: Option<&'static str>,
}

/// The answer of a whole output `text` that ended with `finish_reason`.
pub fn answer(output: &ToolOutput, text: String, finish_reason: Option<&'static str>) -> Answer {
    let content = |text: String| Answer { content: Some(text), calls: Vec::new(), finish_reason };
    match output {
        ToolOutput::Text => content(text),
        ToolOutput::Parsed { parser, parallel } => {
            let mut parsed = parser.parse(&text);
            if parsed.calls.is_empty() {
                return content(text);
            }
            if !parallel {
                parsed.calls.truncate(1);
            }
            Answer {
                content: parsed.content,
                calls: parsed.calls,
                finish_reason: Some("tool_calls"),
            }
        }
        ToolOutput::Required => match required_calls(&text) {
            Some(calls) => Answer { content: None, calls, finish_reason: Some("tool_calls") },
            None => content(text),
        },
        ToolOutput::Named(name) => Answer {
            content: None,
            calls: vec![ToolCall { name: name.clone(), arguments: text }],
            finish_reason,
        },
    }
}

/// The calls of a `required` output, `[{"name", "parameters"}]`; `None` when it does not
/// parse (cut short by `max_tokens`).
fn required_calls(text: &str) -> Option<Vec<ToolCall>> {
    let Ok(Value::Array(items)) = serde_json::from_str::<Value>(text) else {
        return None;
    };
    items
        .iter()
        .map(|item| {
            let name = item.get("name")?.as_str()?.to_owned();
            let arguments = item.get("parameters").filter(|p| p.is_object())?.to_string();
            Some(ToolCall { name, arguments })
        })
        .collect::<Option<Vec<_>>>()
        .filter(|calls| !calls.is_empty())
}

/// `message.tool_calls`: each call with an id from `new_id`.
pub fn wire_calls(calls: &[ToolCall], new_id: &mut dyn FnMut() -> String) -> Value {
    calls
        .iter()
        .map(|c| {
            json!({
                "id": new_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            })
        })
        .collect()
}

/// What one streamed step adds to a choice's `delta`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StreamStep {
    pub content: String,
    /// `delta.tool_calls` entries (with their `index`).
    pub tool_calls: Vec<Value>,
    pub finish_reason: Option<&'static str>,
}

/// The streaming side of [`answer`] for one choice: content is sent as soon as it is known
/// not to open a tool-call section; the section is held until the end and sent as whole calls
/// (a named choice streams its arguments as they come).
#[derive(Debug)]
pub struct ToolStream {
    output: ToolOutput,
    /// Everything generated so far.
    text: String,
    /// Bytes of `text` already sent as content.
    sent: usize,
    /// The tool-call section has started (auto), or the named call has been opened.
    in_tools: bool,
}

impl ToolStream {
    pub fn new(output: ToolOutput) -> Self {
        Self { output, text: String::new(), sent: 0, in_tools: false }
    }

    /// Takes the text of one delta (and the finish reason on the last); returns what to send.
    pub fn push(
        &mut self,
        text: &str,
        finish_reason: Option<&'static str>,
        new_id: &mut dyn FnMut() -> String,
    ) -> StreamStep {
        let finished = finish_reason.is_some();
        match &self.output {
            ToolOutput::Text => {
                StreamStep { content: text.to_owned(), tool_calls: Vec::new(), finish_reason }
            }
            ToolOutput::Named(name) => {
                let mut step = StreamStep { finish_reason, ..StreamStep::default() };
                if !self.in_tools {
                    self.in_tools = true;
                    step.tool_calls.push(json!({
                        "index": 0, "id": new_id(), "type": "function",
                        "function": {"name": name, "arguments": text},
                    }));
                } else if !text.is_empty() {
                    step.tool_calls.push(json!({"index": 0, "function": {"arguments": text}}));
                }
                step
            }
            ToolOutput::Required => {
                self.text.push_str(text);
                if !finished {
                    return StreamStep::default();
                }
                let whole = std::mem::take(&mut self.text);
                Self::final_step(answer(&self.output, whole, finish_reason), new_id)
            }
            ToolOutput::Parsed { parser, .. } => {
                let parser = *parser;
                self.text.push_str(text);
                let mut step = StreamStep { finish_reason, ..StreamStep::default() };
                if !self.in_tools {
                    let until = match parser.split(&self.text, finished) {
                        parser::Split::Content(n) => n,
                        parser::Split::Tools(at) => {
                            self.in_tools = true;
                            at
                        }
                    };
                    self.text[self.sent..until].clone_into(&mut step.content);
                    self.sent = until;
                }
                if !finished || !self.in_tools {
                    return step;
                }
                let a = answer(&self.output, self.text.clone(), finish_reason);
                if a.calls.is_empty() {
                    step.content.push_str(&self.text[self.sent..]);
                    return step;
                }
                let mut last = Self::final_step(a, new_id);
                last.content = step.content;
                last
            }
        }
    }

    /// The last step of a held answer: its calls as `delta.tool_calls`, or its content.
    fn final_step(a: Answer, new_id: &mut dyn FnMut() -> String) -> StreamStep {
        let tool_calls = match wire_calls(&a.calls, new_id) {
            Value::Array(calls) => calls
                .into_iter()
                .enumerate()
                .map(|(index, mut call)| {
                    call["index"] = json!(index);
                    call
                })
                .collect(),
            _ => Vec::new(),
        };
        let content =
            if a.calls.is_empty() { a.content.unwrap_or_default() } else { String::new() };
        StreamStep { content, tool_calls, finish_reason: a.finish_reason }
    }
}

/// A fresh tool-call id: `chatcmpl-tool-<hex>` as vLLM, or 9 letters and digits for
/// `mistral`, whose template refuses other ids when the calls come back in the history.
pub fn call_id(unique: u64, parser: Option<ToolCallParser>) -> String {
    if parser == Some(ToolCallParser::Mistral) {
        const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
        let mut x = unique.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (unique >> 29);
        return (0..9)
            .map(|_| {
                let c = ALPHABET[(x % 62) as usize] as char;
                x /= 62;
                c
            })
            .collect();
    }
    format!("chatcmpl-tool-{unique:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids() -> impl FnMut() -> String {
        let mut n = 0;
        move || {
            n += 1;
            format!("id{n}")
        }
    }

    /// Streams `text` in pieces of `piece` bytes (on char boundaries) and joins what was sent.
    fn stream(
        output: &ToolOutput,
        text: &str,
        piece: usize,
    ) -> (String, Vec<Value>, Option<&'static str>) {
        let mut s = ToolStream::new(output.clone());
        let mut new_id = ids();
        let (mut content, mut calls, mut finish) = (String::new(), Vec::new(), None);
        let chars: Vec<char> = text.chars().collect();
        let pieces: Vec<String> = chars.chunks(piece).map(|c| c.iter().collect()).collect();
        for (i, p) in pieces.iter().enumerate() {
            let last = i + 1 == pieces.len();
            let step = s.push(p, last.then_some("stop"), &mut new_id);
            content.push_str(&step.content);
            calls.extend(step.tool_calls);
            finish = finish.or(step.finish_reason);
        }
        (content, calls, finish)
    }

    #[test]
    fn streamed_answers_equal_whole_ones() {
        let hermes = ToolOutput::Parsed { parser: ToolCallParser::Hermes, parallel: true };
        let pythonic = ToolOutput::Parsed { parser: ToolCallParser::Pythonic, parallel: false };
        for (output, text) in [
            (
                &hermes,
                "Checking.<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call><tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>",
            ),
            (&hermes, "Plain text with a < sign and <tool at the end <tool"),
            (&hermes, "<tool_call>{\"name\": broken"),
            (&pythonic, " [f(a='x'), g()]"),
            (&pythonic, "Not a call: [f(a=1)]"),
            (&ToolOutput::Required, "[{\"name\":\"f\",\"parameters\":{\"a\":1}}]"),
            (&ToolOutput::Required, "[{\"name\":\"f\",\"param"),
        ] {
            let whole = answer(output, text.to_owned(), Some("stop"));
            let mut new_id = ids();
            let want_calls = wire_calls(&whole.calls, &mut new_id);
            for piece in [1, 3, 7, 1000] {
                let (content, calls, finish) = stream(output, text, piece);
                assert_eq!(
                    content.trim(),
                    whole.content.clone().unwrap_or_default().trim(),
                    "{text} / {piece}"
                );
                let calls: Vec<Value> = calls
                    .into_iter()
                    .map(|mut c| {
                        c.as_object_mut().unwrap().remove("index");
                        c
                    })
                    .collect();
                assert_eq!(Value::Array(calls), want_calls, "{text} / {piece}");
                assert_eq!(finish, whole.finish_reason, "{text} / {piece}");
            }
        }
    }

    #[test]
    fn named_choice_streams_its_arguments() {
        let output = ToolOutput::Named("f".into());
        let (content, calls, finish) = stream(&output, "{\"a\":1}", 2);
        assert_eq!((content.as_str(), finish), ("", Some("stop")));
        assert_eq!(
            calls[0],
            json!({"index": 0, "id": "id1", "type": "function", "function": {"name": "f", "arguments": "{\""}})
        );
        let args: String =
            calls.iter().map(|c| c["function"]["arguments"].as_str().unwrap()).collect();
        assert_eq!(args, "{\"a\":1}");
        let whole = answer(&output, "{\"a\":1}".into(), Some("stop"));
        assert_eq!(whole.calls, vec![ToolCall { name: "f".into(), arguments: "{\"a\":1}".into() }]);
    }

    #[test]
    fn parallel_false_keeps_the_first_call_and_ids_fit_the_parser() {
        let output = ToolOutput::Parsed { parser: ToolCallParser::Pythonic, parallel: false };
        let a = answer(&output, "[f(), g()]".into(), Some("stop"));
        assert_eq!((a.calls.len(), a.finish_reason), (1, Some("tool_calls")));
        let id = call_id(42, Some(ToolCallParser::Mistral));
        assert!(id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric()), "{id}");
        assert_ne!(id, call_id(43, Some(ToolCallParser::Mistral)));
        assert!(call_id(42, None).starts_with("chatcmpl-tool-"));
    }
}
