//! `--speculative-config`: vLLM's JSON spelling, validated once with errors naming the field.
//!
//! Accepted keys (vLLM's names): `method` (`"ngram"` or `"draft_model"`; a config with `model`
//! and no `method` is a draft model, as in vLLM), `num_speculative_tokens`
//! (1..=[`MAX_SPEC_TOKENS`], required), `prompt_lookup_min` / `prompt_lookup_max` (n-gram sizes;
//! either alone sets both, neither means 5 and 5, as vLLM), `disable_by_batch_size` (no drafting
//! in steps with at least this many running requests) and `model` (the draft: a path or a model
//! name as `--model` takes it; required with `draft_model`) and `speculative_token_tree` (with
//! `ngram`: the shape of a token tree of candidates verified together, see [`TokenTree`];
//! `num_speculative_tokens` may then be left out, and must equal its node count if given; a
//! chain-shaped tree is plain drafting). Any other key is refused, so a misspelled knob never
//! passes silently.
//!
//! The object is read by serde into [`RawConfig`] (the keys as written, each with its type;
//! a wrong type is refused naming its key), then validated into a [`SpeculativeConfig`].

use serde::Deserialize;
use serde_json::Value;

use super::tree::TokenTree;

/// Most draft tokens per request and step (the per-position acceptance counters have this many
/// slots).
pub const MAX_SPEC_TOKENS: usize = 32;

/// Longest n-gram the prompt-lookup proposer matches.
pub const MAX_PROMPT_LOOKUP: usize = 64;

/// Running requests from which drafting stops when the config does not say: at this batch the
/// default model's decode step on a 2-core CPU is compute-bound, so verifying drafts costs about
/// what it saves (measured in docs/BENCHMARKS.md, "Speculative decoding").
pub const DEFAULT_DISABLE_BY_BATCH_SIZE: usize = 9;

/// How drafts are proposed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SpecMethod {
    /// Prompt lookup: the continuation of the latest earlier occurrence of the sequence's last
    /// `n` tokens, for the largest `n` in `min..=max` that occurs.
    Ngram { min: usize, max: usize },
    /// A smaller model sharing the target's vocabulary proposes a continuation, drawn as each
    /// request samples (`model` is what the caller loads it from; the engine is handed the
    /// loaded model).
    DraftModel { model: String },
}

/// A validated speculative-decoding configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpeculativeConfig {
    pub method: SpecMethod,
    /// Draft tokens proposed per request and step (`k`): a step verifies up to `k` and yields up
    /// to `k + 1` tokens.
    pub num_speculative_tokens: usize,
    /// No drafting in a step that starts with at least this many running requests.
    pub disable_by_batch_size: usize,
    /// With `ngram`: drafts are a token tree of this shape (`num_speculative_tokens` is its node
    /// count); `None`: a chain.
    pub token_tree: Option<TokenTree>,
}

/// An invalid `--speculative-config`, naming the field.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("--speculative-config: `{field}` {message}")]
pub struct SpecConfigError {
    pub field: String,
    pub message: String,
}

fn err(field: &str, message: impl Into<String>) -> SpecConfigError {
    SpecConfigError { field: field.to_owned(), message: message.into() }
}

/// The JSON object as written: vLLM's keys, typed, before validation.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    method: Option<String>,
    model: Option<String>,
    num_speculative_tokens: Option<usize>,
    prompt_lookup_min: Option<usize>,
    prompt_lookup_max: Option<usize>,
    disable_by_batch_size: Option<usize>,
    /// A string as vLLM takes it, or the same list as a JSON array.
    speculative_token_tree: Option<Value>,
}

const KNOWN_KEYS: [&str; 7] = [
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
    "model",
    "speculative_token_tree",
];

impl SpeculativeConfig {
    /// Prompt lookup with `k` drafts and n-grams of `min..=max` tokens.
    pub fn ngram(k: usize, min: usize, max: usize) -> Self {
        Self {
            method: SpecMethod::Ngram { min, max },
            num_speculative_tokens: k,
            disable_by_batch_size: DEFAULT_DISABLE_BY_BATCH_SIZE,
            token_tree: None,
        }
    }

    /// Prompt lookup drafting token trees of shape `tree` (whose node count is `k`).
    pub fn ngram_tree(tree: TokenTree, min: usize, max: usize) -> Self {
        let k = tree.num_nodes();
        Self { token_tree: Some(tree), ..Self::ngram(k, min, max) }
    }

    /// A draft model (loaded by the caller from `model`) proposing `k` tokens.
    pub fn draft_model(k: usize, model: &str) -> Self {
        Self {
            method: SpecMethod::DraftModel { model: model.to_owned() },
            num_speculative_tokens: k,
            disable_by_batch_size: DEFAULT_DISABLE_BY_BATCH_SIZE,
            token_tree: None,
        }
    }

    /// The draft model's path or name, with method `draft_model`.
    pub fn draft_model_name(&self) -> Option<&str> {
        match &self.method {
            SpecMethod::DraftModel { model } => Some(model),
            SpecMethod::Ngram { .. } => None,
        }
    }

    /// Parses vLLM's JSON object.
    pub fn from_json(text: &str) -> Result<Self, SpecConfigError> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| err("(json)", format!("is not valid JSON: {e}")))?;
        let Value::Object(map) = &value else {
            return Err(err("(json)", "must be a JSON object, e.g. {\"method\": \"ngram\", ...}"));
        };
        if let Some(key) = map.keys().find(|k| !KNOWN_KEYS.contains(&k.as_str())) {
            return Err(err(
                key,
                format!("is not supported (known keys: {})", KNOWN_KEYS.join(", ")),
            ));
        }
        let raw: RawConfig = serde_path_to_error::deserialize(value).map_err(|e| {
            let field = e.path().to_string();
            err(&field, format!("has the wrong type: {}", e.into_inner()))
        })?;
        raw.validate()
    }
}

impl RawConfig {
    /// The validated configuration, or the first field that is wrong.
    fn validate(self) -> Result<SpeculativeConfig, SpecConfigError> {
        let model = self.model.as_deref();
        let method = match self.method.as_deref() {
            Some(m) => m,
            None if model.is_some() => "draft_model",
            None => return Err(err("method", "is required (\"ngram\")")),
        };
        let (k, token_tree) = self.count_and_tree(method)?;
        if !(1..=MAX_SPEC_TOKENS).contains(&k) {
            return Err(err(
                "num_speculative_tokens",
                format!("must be 1 to {MAX_SPEC_TOKENS}, got {k}"),
            ));
        }
        let disable_by_batch_size = match self.disable_by_batch_size {
            Some(0) => return Err(err("disable_by_batch_size", "must be at least 1")),
            Some(n) => n,
            None => DEFAULT_DISABLE_BY_BATCH_SIZE,
        };
        let method = match method {
            "ngram" | "[ngram]" => {
                if model.is_some() {
                    return Err(err("model", "is for method \"draft_model\", not \"ngram\""));
                }
                let (min, max) = match (self.prompt_lookup_min, self.prompt_lookup_max) {
                    (None, None) => (5, 5),
                    (Some(n), None) | (None, Some(n)) => (n, n),
                    (Some(a), Some(b)) => (a, b),
                };
                if min == 0 {
                    return Err(err("prompt_lookup_min", "must be at least 1"));
                }
                if max > MAX_PROMPT_LOOKUP {
                    return Err(err(
                        "prompt_lookup_max",
                        format!("must be at most {MAX_PROMPT_LOOKUP}, got {max}"),
                    ));
                }
                if min > max {
                    return Err(err(
                        "prompt_lookup_min",
                        format!("({min}) must not exceed prompt_lookup_max ({max})"),
                    ));
                }
                SpecMethod::Ngram { min, max }
            }
            "draft_model" => {
                if self.prompt_lookup_min.is_some() {
                    return Err(err(
                        "prompt_lookup_min",
                        "is for method \"ngram\", not \"draft_model\"",
                    ));
                }
                if self.prompt_lookup_max.is_some() {
                    return Err(err(
                        "prompt_lookup_max",
                        "is for method \"ngram\", not \"draft_model\"",
                    ));
                }
                match model {
                    Some(m) if !m.trim().is_empty() => SpecMethod::DraftModel { model: m.into() },
                    _ => return Err(err("model", "is required with \"draft_model\"")),
                }
            }
            other => {
                return Err(err(
                    "method",
                    format!(
                        "\"{other}\" is not supported; kiln speculates with \"ngram\" or \
                         \"draft_model\""
                    ),
                ));
            }
        };
        Ok(SpeculativeConfig {
            method,
            num_speculative_tokens: k,
            disable_by_batch_size,
            token_tree,
        })
    }

    /// `num_speculative_tokens` and `speculative_token_tree` (module docs).
    fn count_and_tree(&self, method: &str) -> Result<(usize, Option<TokenTree>), SpecConfigError> {
        let token_tree = self.tree()?;
        let k = match (self.num_speculative_tokens, &token_tree) {
            (Some(k), Some(tree)) if k != tree.num_nodes() => {
                return Err(err(
                    "num_speculative_tokens",
                    format!(
                        "({k}) must equal the node count of speculative_token_tree ({})",
                        tree.num_nodes()
                    ),
                ));
            }
            (Some(k), _) => k,
            (None, Some(tree)) => tree.num_nodes(),
            (None, None) => return Err(err("num_speculative_tokens", "is required")),
        };
        // (Other methods are refused with `method` named.)
        if token_tree.is_some() && method == "draft_model" {
            return Err(err(
                "speculative_token_tree",
                "is drafted by method \"ngram\" only (kiln's draft models propose chains)",
            ));
        }
        // A chain-shaped tree is plain drafting.
        Ok((k, token_tree.filter(|t| !t.is_chain())))
    }

    /// `speculative_token_tree`: a string as vLLM takes it, or the same list as a JSON array.
    fn tree(&self) -> Result<Option<TokenTree>, SpecConfigError> {
        const KEY: &str = "speculative_token_tree";
        let text = match &self.speculative_token_tree {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::String(s)) => s.clone(),
            Some(v @ Value::Array(_)) => v.to_string(),
            Some(other) => {
                return Err(err(
                    KEY,
                    format!("must be a string like \"[(0,), (1,)]\", got {other}"),
                ));
            }
        };
        TokenTree::parse(&text, MAX_SPEC_TOKENS).map(Some).map_err(|e| err(KEY, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(text: &str) -> String {
        SpeculativeConfig::from_json(text).unwrap_err().field
    }

    #[test]
    fn parses_vllm_ngram_configs() {
        let c = SpeculativeConfig::from_json(
            r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}"#,
        )
        .unwrap();
        assert_eq!(c.method, SpecMethod::Ngram { min: 2, max: 4 });
        assert_eq!(c.num_speculative_tokens, 4);
        assert_eq!(c.disable_by_batch_size, DEFAULT_DISABLE_BY_BATCH_SIZE);
        let c = SpeculativeConfig::from_json(r#"{"method":"ngram","num_speculative_tokens":3}"#)
            .unwrap();
        assert_eq!(c.method, SpecMethod::Ngram { min: 5, max: 5 });
        let c = SpeculativeConfig::from_json(
            r#"{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":7,"disable_by_batch_size":4}"#,
        )
        .unwrap();
        assert_eq!((c.method, c.disable_by_batch_size), (SpecMethod::Ngram { min: 7, max: 7 }, 4));
    }

    #[test]
    fn errors_name_the_field() {
        assert_eq!(field("[1]"), "(json)");
        assert_eq!(field("{"), "(json)");
        assert_eq!(field(r#"{"num_speculative_tokens": 3}"#), "method");
        assert_eq!(field(r#"{"method": "ngram"}"#), "num_speculative_tokens");
        assert_eq!(
            field(r#"{"method": "ngram", "num_speculative_tokens": 0}"#),
            "num_speculative_tokens"
        );
        assert_eq!(
            field(r#"{"method": "ngram", "num_speculative_tokens": 33}"#),
            "num_speculative_tokens"
        );
        assert_eq!(
            field(r#"{"method": "ngram", "num_speculative_tokens": -1}"#),
            "num_speculative_tokens"
        );
        assert_eq!(
            field(r#"{"method": "ngram", "num_speculative_tokens": "3"}"#),
            "num_speculative_tokens"
        );
        assert_eq!(field(r#"{"method": "eagle", "num_speculative_tokens": 3}"#), "method");
        assert_eq!(field(r#"{"method": 3, "num_speculative_tokens": 3}"#), "method");
        assert_eq!(
            field(
                r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2}"#
            ),
            "prompt_lookup_min"
        );
        assert_eq!(
            field(r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}"#),
            "prompt_lookup_min"
        );
        assert_eq!(
            field(r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 65}"#),
            "prompt_lookup_max"
        );
        assert_eq!(
            field(
                r#"{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}"#
            ),
            "disable_by_batch_size"
        );
        assert_eq!(
            field(r#"{"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}"#),
            "lookahead"
        );
        assert_eq!(
            field(r#"{"method": "ngram", "num_speculative_tokens": 3, "model": "x.gguf"}"#),
            "model"
        );
        assert_eq!(field(r#"{"method": "draft_model", "num_speculative_tokens": 3}"#), "model");
        assert_eq!(
            field(r#"{"method": "draft_model", "model": " ", "num_speculative_tokens": 3}"#),
            "model"
        );
        assert_eq!(
            field(r#"{"model": "d.gguf", "num_speculative_tokens": 3, "prompt_lookup_max": 2}"#),
            "prompt_lookup_max"
        );
    }

    #[test]
    fn parses_token_trees() {
        let c = SpeculativeConfig::from_json(
            r#"{"method": "ngram", "speculative_token_tree": "[(0,), (1,), (0, 0)]", "prompt_lookup_min": 2, "prompt_lookup_max": 4}"#,
        )
        .unwrap();
        assert_eq!(c.num_speculative_tokens, 3);
        assert_eq!(c.token_tree.as_ref().unwrap().parents, [u32::MAX, u32::MAX, 0]);
        let c = SpeculativeConfig::from_json(
            r#"{"method": "ngram", "num_speculative_tokens": 2, "speculative_token_tree": [[0], [1]]}"#,
        )
        .unwrap();
        assert_eq!(c.token_tree.unwrap().ranks, [0, 1]);
        // A chain is plain drafting.
        let c = SpeculativeConfig::from_json(
            r#"{"method": "ngram", "speculative_token_tree": "[(0,), (0, 0)]"}"#,
        )
        .unwrap();
        assert_eq!((c.num_speculative_tokens, c.token_tree), (2, None));
        let tree =
            |extra: &str| format!(r#"{{"speculative_token_tree": "[(0,), (1,)]", {extra}}}"#);
        assert_eq!(
            field(&tree(r#""method": "ngram", "num_speculative_tokens": 3"#)),
            "num_speculative_tokens"
        );
        assert_eq!(field(&tree(r#""model": "d.gguf""#)), "speculative_token_tree");
        assert_eq!(field(&tree(r#""method": "eagle""#)), "method");
        assert_eq!(
            field(r#"{"method": "ngram", "speculative_token_tree": "[(1, 0)]"}"#),
            "speculative_token_tree"
        );
        assert_eq!(
            field(r#"{"method": "ngram", "speculative_token_tree": 3}"#),
            "speculative_token_tree"
        );
    }

    #[test]
    fn parses_vllm_draft_model_configs() {
        // vLLM infers the method from `model`.
        let c =
            SpeculativeConfig::from_json(r#"{"model": "draft.gguf", "num_speculative_tokens": 3}"#)
                .unwrap();
        assert_eq!(c.method, SpecMethod::DraftModel { model: "draft.gguf".into() });
        assert_eq!(c.num_speculative_tokens, 3);
        let c = SpeculativeConfig::from_json(
            r#"{"method": "draft_model", "model": "org/small", "num_speculative_tokens": 5, "disable_by_batch_size": 4}"#,
        )
        .unwrap();
        assert_eq!(c.method, SpecMethod::DraftModel { model: "org/small".into() });
        assert_eq!(c.disable_by_batch_size, 4);
    }
}
