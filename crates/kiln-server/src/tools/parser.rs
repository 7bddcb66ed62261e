//! Tool-call parsers (`--tool-call-parser`, vLLM's names): where a model's free text turns
//! into tool calls, and the calls in it.
//!
//! | name | models | format |
//! |---|---|---|
//! | `hermes` | Qwen 2.5 / 3, Hermes | `<tool_call>{"name": .., "arguments": {..}}</tool_call>`, repeated |
//! | `llama3_json` | Llama 3.1 / 3.2 | `{"name": .., "parameters": {..}}` at the start (after an optional `<|python_tag|>`), several joined by `;` |
//! | `mistral` | Mistral | `[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]`, or `[TOOL_CALLS]name[ARGS]{..}` |
//! | `pythonic` (also `gemma3`) | Gemma 3, Llama 4 | `[f(a=1), g(b="x")]`, see [`super::pythonic`] |
//! | `openai` | gpt-oss | harmony messages to `functions.NAME`, see [`crate::harmony`] |
//!
//! Invariants:
//! - one function, [`ToolCallParser::split`], says where the tool-call section of a text
//!   starts; [`ToolCallParser::parse`] and the streaming path both use it, so a streamed answer
//!   carries the same content and calls as the whole one;
//! - text before the section is content; the section parses wholly into calls, or the whole
//!   text is content (as vLLM falls back), never a partial set of calls;
//! - never panics on any input.

use serde_json::Value;

use super::ToolCall;
use super::pythonic;

/// A tool-call format (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolCallParser {
    Hermes,
    Llama3Json,
    Mistral,
    Pythonic,
    OpenAi,
}

/// Where the tool-call section of a text starts, as far as the text tells yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// No section starts in the first `n` bytes: they are content for good; what follows
    /// them may still start one.
    Content(usize),
    /// The section starts at this byte.
    Tools(usize),
}

/// A text split into content and tool calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parsed {
    /// The text before the calls (`None` when it is only whitespace).
    pub content: Option<String>,
    pub calls: Vec<ToolCall>,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";
const FENCE: &str = "```tool_code";

impl ToolCallParser {
    /// The parsers' names, for help and errors.
    pub const NAMES: &'static str = "hermes, llama3_json, mistral, pythonic, gemma3, openai";

    /// The parser of a `--tool-call-parser` name.
    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "hermes" => Self::Hermes,
            "llama3_json" => Self::Llama3Json,
            "mistral" => Self::Mistral,
            "pythonic" | "gemma3" => Self::Pythonic,
            "openai" => Self::OpenAi,
            _ => return None,
        })
    }

    /// Whether the format's markers are special tokens, so the text must be decoded with
    /// them (`skip_special_tokens: false`).
    pub fn needs_special_tokens(self) -> bool {
        matches!(self, Self::Llama3Json | Self::Mistral | Self::OpenAi)
    }

    /// Where the tool-call section of `text` starts; `finished` says no more text follows.
    pub fn split(self, text: &str, finished: bool) -> Split {
        match self {
            Self::Hermes => marker(text, HERMES_OPEN, finished),
            Self::Mistral => marker(text, MISTRAL_CALLS, finished),
            Self::Llama3Json => leading(text, finished, &["{", PYTHON_TAG]),
            Self::Pythonic => leading(text, finished, &["[", FENCE, "print("]),
            Self::OpenAi => crate::harmony::tool_split(text, finished),
        }
    }

    /// The content and calls of a whole answer.
    pub fn parse(self, text: &str) -> Parsed {
        let all_content = || Parsed { content: non_blank(text), calls: Vec::new() };
        let Split::Tools(at) = self.split(text, true) else {
            return all_content();
        };
        let section = &text[at..];
        let calls = match self {
            Self::Hermes => hermes(section),
            Self::Llama3Json => llama3_json(section),
            Self::Mistral => mistral(section),
            Self::Pythonic => pythonic::parse_calls(section),
            Self::OpenAi => crate::harmony::parse_calls(section),
        };
        match calls {
            Some(calls) if !calls.is_empty() => Parsed { content: non_blank(&text[..at]), calls },
            _ => all_content(),
        }
    }
}

fn non_blank(text: &str) -> Option<String> {
    (!text.trim().is_empty()).then(|| text.to_owned())
}

/// The section starts at the first `open`; until it shows, a tail that may be its beginning
/// is held back.
fn marker(text: &str, open: &str, finished: bool) -> Split {
    if let Some(at) = text.find(open) {
        return Split::Tools(at);
    }
    if finished {
        return Split::Content(text.len());
    }
    let held = (1..open.len())
        .rev()
        .find(|&n| {
            text.len() >= n
                && text.is_char_boundary(text.len() - n)
                && open.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0);
    Split::Content(text.len() - held)
}

/// The section is the whole text when it opens (after whitespace) with one of `openers`;
/// otherwise it is all content.
fn leading(text: &str, finished: bool, openers: &[&str]) -> Split {
    let start = text.len() - text.trim_start().len();
    let rest = &text[start..];
    if openers.iter().any(|o| rest.starts_with(o)) {
        return Split::Tools(start);
    }
    if !finished && (rest.is_empty() || openers.iter().any(|o| o.starts_with(rest))) {
        return Split::Content(0);
    }
    Split::Content(text.len())
}

/// A JSON object `{"name": .., <args_key>: {..}}` (arguments also as a JSON string) as a call.
fn json_call(value: &Value, args_keys: &[&str]) -> Option<ToolCall> {
    let obj = value.as_object()?;
    let name = obj.get("name")?.as_str()?.to_owned();
    let args = args_keys.iter().find_map(|k| obj.get(*k));
    let arguments = match args {
        None => "{}".to_owned(),
        Some(Value::String(s)) => {
            serde_json::from_str::<Value>(s).ok().filter(Value::is_object)?;
            s.clone()
        }
        Some(v @ Value::Object(_)) => v.to_string(),
        Some(_) => return None,
    };
    Some(ToolCall { name, arguments })
}

/// JSON values one after another, each followed by `sep` or whitespace.
fn json_values(mut text: &str, sep: char) -> Option<Vec<Value>> {
    let mut values = Vec::new();
    loop {
        text = text.trim_start();
        if text.is_empty() {
            return Some(values);
        }
        let mut stream = serde_json::Deserializer::from_str(text).into_iter::<Value>();
        values.push(stream.next()?.ok()?);
        text = text[stream.byte_offset()..].trim_start();
        text = text.strip_prefix(sep).unwrap_or(text);
    }
}

fn hermes(section: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = section;
    while let Some(after) = rest.trim_start().strip_prefix(HERMES_OPEN) {
        let (body, next) = after.split_once(HERMES_CLOSE).unwrap_or((after, ""));
        let value: Value = serde_json::from_str(body.trim()).ok()?;
        calls.push(json_call(&value, &["arguments", "parameters"])?);
        rest = next;
    }
    rest.trim().is_empty().then_some(calls)
}

fn llama3_json(section: &str) -> Option<Vec<ToolCall>> {
    let body = section.trim_start();
    let body = body.strip_prefix(PYTHON_TAG).unwrap_or(body);
    json_values(body, ';')?.iter().map(|v| json_call(v, &["parameters", "arguments"])).collect()
}

fn mistral(section: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    for part in section.split(MISTRAL_CALLS).skip(1) {
        let part = part.trim();
        if part.starts_with('[') || part.starts_with('{') {
            for value in json_values(part, ',')? {
                match value {
                    Value::Array(items) => {
                        for item in &items {
                            calls.push(json_call(item, &["arguments", "parameters"])?);
                        }
                    }
                    v => calls.push(json_call(&v, &["arguments", "parameters"])?),
                }
            }
        } else {
            let (name, args) = part.split_once(MISTRAL_ARGS)?;
            let value: Value = serde_json::from_str(args.trim()).ok().filter(Value::is_object)?;
            calls.push(ToolCall { name: name.trim().to_owned(), arguments: value.to_string() });
        }
    }
    Some(calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: &str) -> ToolCall {
        ToolCall { name: name.into(), arguments: arguments.into() }
    }

    #[test]
    fn hermes_calls_and_content_before_them() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let parsed = ToolCallParser::Hermes.parse(text);
        assert_eq!(parsed.content.as_deref(), Some("Let me check.\n"));
        assert_eq!(
            parsed.calls,
            vec![call("get_weather", r#"{"city":"Paris"}"#), call("now", "{}")]
        );
        // An unclosed last call (generation stopped on `</tool_call>`) still parses.
        let parsed =
            ToolCallParser::Hermes.parse("<tool_call>{\"name\": \"f\", \"arguments\": {}}");
        assert_eq!((parsed.content, parsed.calls), (None, vec![call("f", "{}")]));
    }

    #[test]
    fn llama3_mistral_and_pythonic_formats() {
        let parsed = ToolCallParser::Llama3Json
            .parse("<|python_tag|>{\"name\": \"f\", \"parameters\": {\"a\": 1}}; {\"name\": \"g\", \"parameters\": {}}");
        assert_eq!(parsed.calls, vec![call("f", r#"{"a":1}"#), call("g", "{}")]);
        let parsed = ToolCallParser::Mistral
            .parse("Sure. [TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"a\": \"x\"}}, {\"name\": \"g\", \"arguments\": \"{}\"}]");
        assert_eq!(parsed.content.as_deref(), Some("Sure. "));
        assert_eq!(parsed.calls, vec![call("f", r#"{"a":"x"}"#), call("g", "{}")]);
        let parsed =
            ToolCallParser::Mistral.parse("[TOOL_CALLS]f[ARGS]{\"a\": 2}[TOOL_CALLS]g[ARGS]{}");
        assert_eq!(parsed.calls, vec![call("f", r#"{"a":2}"#), call("g", "{}")]);
        let parsed = ToolCallParser::Pythonic.parse("[f(a=1)]");
        assert_eq!(parsed.calls, vec![call("f", r#"{"a":1}"#)]);
    }

    #[test]
    fn text_that_is_not_a_call_stays_content() {
        for (parser, text) in [
            (ToolCallParser::Hermes, "No tools needed."),
            (ToolCallParser::Hermes, "<tool_call>{\"name\": broken</tool_call>"),
            (ToolCallParser::Hermes, "<tool_call>{\"arguments\": {}}</tool_call>"),
            (ToolCallParser::Llama3Json, "{\"not\": \"a call\"}"),
            (ToolCallParser::Llama3Json, "The answer is {\"name\": \"f\"}"),
            (ToolCallParser::Mistral, "[TOOL_CALLS] not json"),
            (ToolCallParser::Pythonic, "[1, 2, 3]"),
            (ToolCallParser::Pythonic, "Sure: [f(a=1)]"),
        ] {
            let parsed = parser.parse(text);
            assert_eq!((parsed.content.as_deref(), parsed.calls.len()), (Some(text), 0), "{text}");
        }
    }

    #[test]
    fn split_holds_back_what_may_open_a_section() {
        let p = ToolCallParser::Hermes;
        assert_eq!(p.split("Hello <tool", false), Split::Content(6));
        assert_eq!(p.split("Hello <tool", true), Split::Content(11));
        assert_eq!(p.split("Hello <b>", false), Split::Content(9));
        assert_eq!(p.split("Hi <tool_call>{", false), Split::Tools(3));
        let p = ToolCallParser::Pythonic;
        assert_eq!(p.split("  ", false), Split::Content(0));
        assert_eq!(p.split(" ``", false), Split::Content(0));
        assert_eq!(p.split(" [f(", false), Split::Tools(1));
        assert_eq!(p.split("Sure", false), Split::Content(4));
        assert_eq!(ToolCallParser::Llama3Json.split("<|python", false), Split::Content(0));
    }

    #[test]
    fn hostile_text_never_panics() {
        let parsers = [
            ToolCallParser::Hermes,
            ToolCallParser::Llama3Json,
            ToolCallParser::Mistral,
            ToolCallParser::Pythonic,
        ];
        let texts = [
            "é<tool_ca",
            "<tool_call>",
            "[TOOL_CALLS]",
            "[TOOL_CALLS]x[ARGS]",
            "{",
            "[",
            "``",
            "ü",
        ];
        for parser in parsers {
            for text in texts {
                let _ = parser.parse(text);
                for cut in 0..=text.len() {
                    if text.is_char_boundary(cut) {
                        let _ = parser.split(&text[..cut], false);
                    }
                }
            }
        }
    }
}
