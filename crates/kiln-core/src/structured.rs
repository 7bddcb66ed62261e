//! Structured outputs as data: what a request's output must match. The engine compiles a
//! [`StructuredOutput`] into a token mask per step (llguidance); this crate only names it, so
//! the scheduler, the server and the engine can pass it around, compare it and use it as a
//! cache key.

/// The language a request's whole output must belong to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum StructuredOutput {
    /// JSON text valid against this JSON Schema (the schema as JSON text).
    JsonSchema(String),
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// Text matching this regular expression in full (Rust `regex` syntax, no look-around).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// Text of this context-free grammar, in Lark syntax (llguidance's dialect: regexes,
    /// `%json` and `%ignore` included).
    Grammar(String),
    /// A reasoning model's answer after its thinking, delimited as `reasoning` says.
    AfterReasoning { reasoning: ReasoningFormat, answer: Box<StructuredOutput> },
}

/// How a reasoning model's output is laid out before its answer.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ReasoningFormat {
    /// Free text up to and including the first `close` (`</think>`), a few newlines or
    /// spaces, then the answer. The reasoning is optional when the prompt did not open it: the
    /// output may then start with `open` or go straight to the answer. The reasoning is text:
    /// tokens that would break its UTF-8 are masked.
    Markers(ReasoningMarkers),
    /// gpt-oss's harmony messages: any number of `analysis` or `commentary` messages
    /// (`<|channel|>NAME<|message|>TEXT<|end|><|start|>assistant`), then
    /// `<|channel|>final<|message|>` and the answer. `in_body`: the prompt opened a message
    /// body, which the output first ends with `<|end|>`.
    Harmony { in_body: bool },
}

/// How a reasoning model's thinking is delimited in its output.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ReasoningMarkers {
    /// The text that opens the thinking (`<think>`).
    pub open: String,
    /// The text that closes it (`</think>`).
    pub close: String,
    /// The prompt has opened the thinking (or the model always thinks): the output starts
    /// inside it and must close it before the answer.
    pub required: bool,
}

impl StructuredOutput {
    /// The kind, as vLLM's `structured_outputs` key names it (`json`, `json_object`, `regex`,
    /// `choice`, `grammar`).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::JsonSchema(_) => "json",
            Self::JsonObject => "json_object",
            Self::Regex(_) => "regex",
            Self::Choice(_) => "choice",
            Self::Grammar(_) => "grammar",
            Self::AfterReasoning { answer, .. } => answer.kind(),
        }
    }
}
