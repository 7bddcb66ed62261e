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
        }
    }
}
