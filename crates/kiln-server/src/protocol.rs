//! Request bodies of the OpenAI API (plus vLLM's extra sampling fields at the top level), as
//! serde types. Fields kiln does not know are collected (`SamplingFields::other`) and checked
//! by validation: refused with a 400 naming them when they would change the output, logged
//! when they change nothing (`user`, `metadata`, ...). Numbers are
//! typed wide (`f64`, `i64`, `u64`) so an absurd value reaches validation, which names the
//! parameter, instead of failing inside serde.

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::Value;

/// Sampling fields shared by completions and chat.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct SamplingFields {
    pub n: Option<i64>,
    pub best_of: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub max_tokens: Option<i64>,
    pub stop: Option<StopField>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub logit_bias: Option<HashMap<String, f64>>,
    pub ignore_eos: Option<bool>,
    pub min_tokens: Option<i64>,
    pub stop_token_ids: Option<Vec<i64>>,
    pub priority: Option<i64>,
    pub prompt_logprobs: Option<i64>,
    pub skip_special_tokens: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// OpenAI's `{"type": "text" | "json_object" | "json_schema", ...}`; parsed by validation
    /// (`structured_fields`), which names what is wrong.
    pub response_format: Option<Value>,
    /// vLLM's `{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`.
    pub structured_outputs: Option<Value>,
    /// vLLM's older top-level spellings of `structured_outputs`.
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
    /// llama-server's `/completion` spellings: `n_predict` (`max_tokens`; -1: no limit),
    /// `json_schema` (a schema object) and `grammar` (GBNF, or Lark).
    pub n_predict: Option<i64>,
    pub json_schema: Option<Value>,
    pub grammar: Option<Value>,
    /// vLLM's prefill/decode handoff (`kv_transfer::parse_params`).
    pub kv_transfer_params: Option<Value>,
    /// Every field no struct above names (checked by `request_fields`: refused when kiln does
    /// not implement it, logged when it is known to change nothing).
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

impl SamplingFields {
    /// `max_tokens`, or llama-server's `n_predict` (-1 or less: no limit); both given: 400.
    pub fn max_tokens_given(&self) -> Result<Option<i64>, crate::error::ApiError> {
        match (self.max_tokens, self.n_predict) {
            (Some(_), Some(_)) => Err(crate::error::ApiError::bad_param(
                "n_predict",
                "`n_predict` and `max_tokens` both limit the output: give only one",
            )),
            (_, Some(n)) if n < 0 => Ok(None),
            (m, n) => Ok(m.or(n)),
        }
    }
}

impl StopField {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

/// `stream_options`: any other key is refused (serde names it).
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
    /// vLLM's: every chunk carries the usage so far (with `include_usage`).
    pub continuous_usage_stats: Option<bool>,
    /// OpenAI's random padding of stream chunks against length side channels: no effect (kiln
    /// pads nothing, and the text is the same either way).
    pub include_obfuscation: Option<bool>,
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    /// A string, a list of strings, a list of token ids, or a list of such lists (parsed by
    /// validation, which names what is wrong).
    #[serde(default)]
    pub prompt: Value,
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(default)]
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub suffix: Option<String>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub messages: Vec<ChatMessageIn>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<i64>,
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    /// vLLM's extra: `false` renders the conversation without the assistant prefix.
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    /// `[{"type": "function", "function": {"name", "description", "parameters"}}]`, checked by
    /// `tools::plan` (as are the next two).
    #[serde(default)]
    pub tools: Option<Value>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub parallel_tool_calls: Option<Value>,
    /// Extra variables of the chat template's context (e.g. `enable_thinking`).
    #[serde(default)]
    pub chat_template_kwargs: Option<Value>,
    /// vLLM's extra: `false` leaves the parsed reasoning out of the response (needs
    /// `--reasoning-parser`).
    #[serde(default)]
    pub include_reasoning: Option<bool>,
    /// `low`, `medium` or `high`: the chat template's `reasoning_effort` (gpt-oss's system
    /// message states it), for a template that reads it.
    #[serde(default)]
    pub reasoning_effort: Option<Value>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

#[derive(Debug, Default, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// An assistant message's calls: `[{"id", "type", "function": {"name", "arguments"}}]`.
    #[serde(default)]
    pub tool_calls: Option<Value>,
    /// A tool message's answer to this call.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    /// An assistant message's thinking (vLLM's `reasoning_content`, or `reasoning`), for
    /// templates that print it.
    #[serde(default, alias = "reasoning")]
    pub reasoning_content: Option<String>,
    /// Any other key: refused unless neutral (`null`, an empty list), never dropped.
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

impl ChatMessageIn {
    /// A message with a role and text only.
    pub fn text(role: &str, text: String) -> Self {
        Self { role: role.to_owned(), content: Some(MessageContent::Text(text)), ..Self::default() }
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
    /// Any other key: refused unless `null`.
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

/// `POST /tokenize`: a prompt, or chat messages rendered with the template.
#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default)]
    pub messages: Option<Vec<ChatMessageIn>>,
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    /// As on chat: the tools the template renders.
    #[serde(default)]
    pub tools: Option<Value>,
    #[serde(default)]
    pub chat_template_kwargs: Option<Value>,
}

/// `POST /detokenize`.
#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub tokens: Vec<i64>,
}
