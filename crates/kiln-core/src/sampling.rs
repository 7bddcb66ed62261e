//! Sampling parameters of one request, validated once at the edge.
//!
//! Semantics follow vLLM: `temperature == 0` means greedy; `top_k == 0` and `top_p == 1`
//! disable those filters; `min_p == 0` disables min-p; penalties of 1.0 (repetition) and 0.0
//! (presence, frequency) are neutral.

use crate::{StructuredOutput, TokenId};

/// Why a sequence stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// An end-of-sequence or stop token (or stop string) was produced.
    Stop,
    /// `max_tokens` or the model's context length was reached.
    Length,
    /// The request was aborted (client gone, shutdown).
    Abort,
}

impl FinishReason {
    /// The OpenAI wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
        }
    }
}

/// Per-request sampling configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    /// Multiplicative penalty on logits of tokens seen in prompt or output (1.0 = off).
    pub repetition_penalty: f32,
    /// Subtracted once from logits of tokens present in the output (0.0 = off).
    pub presence_penalty: f32,
    /// Subtracted per occurrence in the output (0.0 = off).
    pub frequency_penalty: f32,
    pub max_tokens: usize,
    /// Extra token ids that end the sequence (the model's EOS ids are added by the engine).
    pub stop_token_ids: Vec<TokenId>,
    /// Keep generating past EOS (benchmarks).
    pub ignore_eos: bool,
    /// Per-request RNG seed; `None` draws one from the engine's seed sequence.
    pub seed: Option<u64>,
    /// Output tokens before EOS / `stop_token_ids` may end the sequence (they are masked until
    /// then).
    pub min_tokens: usize,
    /// Added to the logit of each listed token before anything else (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(TokenId, f32)>,
    /// Log-probabilities to return per output token: `Some(k)` gives the sampled token's and the
    /// `k` most likely ones; computed on the model's raw logits (vLLM's `raw_logprobs`).
    pub logprobs: Option<usize>,
    /// Like `logprobs`, for every prompt position after the first. Such requests skip the prefix
    /// cache (every prompt position must be computed).
    pub prompt_logprobs: Option<usize>,
    /// The language the output must belong to (structured outputs); the engine masks every
    /// token that would leave it, and the output ends (an end-of-sequence token) when the
    /// grammar is complete and allows nothing more.
    pub structured: Option<StructuredOutput>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            max_tokens: 16,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            seed: None,
            min_tokens: 0,
            logit_bias: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            structured: None,
        }
    }
}

/// A sampling parameter outside its domain.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid sampling parameter `{param}`: {message}")]
pub struct SamplingError {
    pub param: &'static str,
    pub message: String,
}

fn bad(param: &'static str, message: impl Into<String>) -> SamplingError {
    SamplingError { param, message: message.into() }
}

impl SamplingParams {
    /// Greedy decoding with `max_tokens` new tokens.
    pub fn greedy(max_tokens: usize) -> Self {
        Self { temperature: 0.0, max_tokens, ..Self::default() }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Checks every field's domain; the error names the offending parameter.
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(bad("temperature", format!("must be >= 0, got {}", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(bad("top_p", format!("must be in (0, 1], got {}", self.top_p)));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(bad("min_p", format!("must be in [0, 1], got {}", self.min_p)));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return Err(bad(
                "repetition_penalty",
                format!("must be > 0, got {}", self.repetition_penalty),
            ));
        }
        for (param, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&value) {
                return Err(bad(param, format!("must be in [-2, 2], got {value}")));
            }
        }
        if self.max_tokens == 0 {
            return Err(bad("max_tokens", "must be at least 1"));
        }
        if self.min_tokens > self.max_tokens {
            return Err(bad(
                "min_tokens",
                format!(
                    "must be at most max_tokens ({}), got {}",
                    self.max_tokens, self.min_tokens
                ),
            ));
        }
        if self.ignore_eos && self.structured.is_some() {
            return Err(bad(
                "ignore_eos",
                "cannot be combined with a structured output: the output ends with an \
                 end-of-sequence token when its grammar is complete",
            ));
        }
        for &(token, bias) in &self.logit_bias {
            if !(-100.0..=100.0).contains(&bias) {
                return Err(bad(
                    "logit_bias",
                    format!("bias of token {} must be in [-100, 100], got {bias}", token.0),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_out_of_domain_values_name_the_param() {
        assert!(SamplingParams::default().validate().is_ok());
        let cases: [(&str, SamplingParams); 7] = [
            ("temperature", SamplingParams { temperature: -1.0, ..Default::default() }),
            ("top_p", SamplingParams { top_p: 0.0, ..Default::default() }),
            ("min_p", SamplingParams { min_p: 1.5, ..Default::default() }),
            ("frequency_penalty", SamplingParams { frequency_penalty: 3.0, ..Default::default() }),
            ("max_tokens", SamplingParams { max_tokens: 0, ..Default::default() }),
            ("min_tokens", SamplingParams { min_tokens: 17, ..Default::default() }),
            (
                "logit_bias",
                SamplingParams { logit_bias: vec![(TokenId(3), 101.0)], ..Default::default() },
            ),
        ];
        for (param, params) in cases {
            assert_eq!(params.validate().unwrap_err().param, param);
        }
        let nan = SamplingParams { temperature: f32::NAN, ..Default::default() };
        assert_eq!(nan.validate().unwrap_err().param, "temperature");
    }
}
