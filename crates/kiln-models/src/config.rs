//! `config.json` of a Hugging Face model directory, parsed into one typed [`ModelConfig`].
//!
//! Both spellings of the RoPE settings are accepted: the classic `rope_theta` + `rope_scaling`
//! and transformers 5's `rope_parameters` (flat, or keyed by layer type for Gemma 3).

use std::path::Path;

use kiln_kernels::rope::RopeScaling;
use serde_json::Value;

use crate::LoadError;

/// Model families kiln runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl Architecture {
    pub const SUPPORTED: &'static str =
        "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM";

    fn from_hf(name: &str) -> Option<Self> {
        Some(match name {
            "LlamaForCausalLM" => Self::Llama,
            "MistralForCausalLM" => Self::Mistral,
            "Qwen2ForCausalLM" => Self::Qwen2,
            "Qwen3ForCausalLM" => Self::Qwen3,
            _ => return None,
        })
    }
}

/// Everything the forward pass needs to know about a model's shape.
// Independent per-architecture switches, each mirroring a config.json flag.
#[allow(clippy::struct_excessive_bools)]
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Attention window of every layer (Mistral); `None` is full causal attention.
    pub sliding_window: Option<usize>,
    /// Bias on the q/k/v projections (Qwen2, or Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama's `attention_bias`).
    pub o_bias: bool,
    /// Bias on the MLP projections (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// RMSNorm over each head of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
}

/// Limits that keep a hostile config from requesting absurd allocations.
const MAX_DIM: usize = 1 << 20;
const MAX_LAYERS: usize = 1024;

struct Fields<'a> {
    json: &'a Value,
    path: &'a Path,
}

impl Fields<'_> {
    fn err(&self, message: String) -> LoadError {
        LoadError::config(self.path, message)
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>, LoadError> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .filter(|n| *n <= MAX_DIM.max(1 << 31))
                .map(Some)
                .ok_or_else(|| self.err(format!("`{key}` must be a non-negative integer"))),
        }
    }

    fn dim(&self, key: &str) -> Result<usize, LoadError> {
        let v = self.opt_usize(key)?.ok_or_else(|| self.err(format!("missing `{key}`")))?;
        if v == 0 || v > MAX_DIM {
            return Err(self.err(format!("`{key}` = {v} is out of range 1..={MAX_DIM}")));
        }
        Ok(v)
    }

    fn opt_f32(&self, key: &str) -> Result<Option<f32>, LoadError> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|f| f as f32)
                .filter(|f| f.is_finite())
                .map(Some)
                .ok_or_else(|| self.err(format!("`{key}` must be a finite number"))),
        }
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>, LoadError> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => {
                v.as_bool().map(Some).ok_or_else(|| self.err(format!("`{key}` must be a boolean")))
            }
        }
    }
}

impl ModelConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self, LoadError> {
        let text = std::fs::read_to_string(path).map_err(|e| LoadError::io(path, e))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| LoadError::config(path, format!("not valid JSON: {e}")))?;
        Self::from_json(&json, path)
    }

    pub fn from_json(json: &Value, path: &Path) -> Result<Self, LoadError> {
        let f = Fields { json, path };
        let arch_name = json
            .get("architectures")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_str)
            .ok_or_else(|| f.err("missing `architectures`".into()))?;
        let architecture =
            Architecture::from_hf(arch_name).ok_or_else(|| LoadError::UnsupportedArchitecture {
                path: path.to_path_buf(),
                name: arch_name.to_string(),
                supported: Architecture::SUPPORTED,
            })?;
        let hidden_size = f.dim("hidden_size")?;
        let num_heads = f.dim("num_attention_heads")?;
        let num_kv_heads = f.opt_usize("num_key_value_heads")?.unwrap_or(num_heads);
        let head_dim = match f.opt_usize("head_dim")? {
            Some(d) => d,
            None if hidden_size.is_multiple_of(num_heads) => hidden_size / num_heads,
            None => {
                return Err(f.err("hidden_size is not a multiple of num_attention_heads".into()));
            }
        };
        let num_layers = f.dim("num_hidden_layers")?;
        if num_layers > MAX_LAYERS {
            return Err(f.err(format!("num_hidden_layers = {num_layers} exceeds {MAX_LAYERS}")));
        }
        if num_kv_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
            return Err(f.err(format!(
                "num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads \
                 ({num_kv_heads})"
            )));
        }
        if head_dim == 0 || !head_dim.is_multiple_of(2) || head_dim > 1024 {
            return Err(f.err(format!("head_dim = {head_dim} must be even and at most 1024")));
        }
        let (rope_theta, rope_scaling) = rope_settings(&f)?;
        let attention_bias = f.opt_bool("attention_bias")?.unwrap_or(false);
        let sliding_window = match architecture {
            Architecture::Mistral => f.opt_usize("sliding_window")?,
            Architecture::Qwen2 | Architecture::Qwen3 => {
                if f.opt_bool("use_sliding_window")?.unwrap_or(false) {
                    return Err(f.err("use_sliding_window = true is not supported".into()));
                }
                None
            }
            Architecture::Llama => None,
        }
        .filter(|w| *w > 0);
        Ok(Self {
            architecture,
            vocab_size: f.dim("vocab_size")?,
            hidden_size,
            intermediate_size: f.dim("intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: f.opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: f.opt_usize("max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            sliding_window,
            qkv_bias: architecture == Architecture::Qwen2 || attention_bias,
            o_bias: attention_bias,
            mlp_bias: f.opt_bool("mlp_bias")?.unwrap_or(false),
            qk_norm: architecture == Architecture::Qwen3,
        })
    }
}

/// `(rope_theta, scaling)` from either config spelling.
fn rope_settings(f: &Fields<'_>) -> Result<(f32, RopeScaling), LoadError> {
    let params = f.json.get("rope_parameters").filter(|v| v.is_object());
    let scaling = f.json.get("rope_scaling").filter(|v| v.is_object()).or(params);
    let theta = match params.and_then(|p| p.get("rope_theta")) {
        Some(v) => v.as_f64().map(|t| t as f32),
        None => f.opt_f32("rope_theta")?,
    }
    .unwrap_or(10_000.0);
    if !(theta.is_finite() && theta > 1.0) {
        return Err(f.err(format!("rope_theta = {theta} must be > 1")));
    }
    let Some(s) = scaling else { return Ok((theta, RopeScaling::None)) };
    let kind = s.get("rope_type").or_else(|| s.get("type")).and_then(Value::as_str);
    let num = |key: &str| -> Result<f32, LoadError> {
        s.get(key)
            .and_then(Value::as_f64)
            .map(|v| v as f32)
            .filter(|v| v.is_finite() && *v > 0.0)
            .ok_or_else(|| f.err(format!("rope scaling needs a positive `{key}`")))
    };
    let scaling = match kind {
        None | Some("default") => RopeScaling::None,
        Some("linear") => RopeScaling::Linear { factor: num("factor")? },
        Some("llama3") => {
            let low = num("low_freq_factor")?;
            let high = num("high_freq_factor")?;
            if high <= low {
                return Err(
                    f.err("llama3 rope scaling needs high_freq_factor > low_freq_factor".into())
                );
            }
            RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position: num("original_max_position_embeddings")?,
            }
        }
        Some(other) => return Err(f.err(format!("rope scaling type `{other}` is not supported"))),
    };
    Ok((theta, scaling))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 100, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0
        })
    }

    #[test]
    fn parses_classic_and_v5_rope_spellings() {
        let p = Path::new("config.json");
        let mut classic = base();
        classic["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64});
        let a = ModelConfig::from_json(&classic, p).unwrap();
        let mut v5 = base();
        v5.as_object_mut().unwrap().remove("rope_theta");
        v5["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500_000.0,
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64});
        let b = ModelConfig::from_json(&v5, p).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.head_dim, 16);
        assert!(matches!(a.rope_scaling, RopeScaling::Llama3 { .. }));
    }

    #[test]
    fn rejects_bad_configs_with_a_message_naming_the_field() {
        let p = Path::new("dir/config.json");
        let cases = [
            ("architectures", json!(["GPTNeoXForCausalLM"]), "unsupported architecture"),
            ("hidden_size", json!(0), "hidden_size"),
            ("num_key_value_heads", json!(3), "multiple of num_key_value_heads"),
            ("num_hidden_layers", json!(-1), "num_hidden_layers"),
            ("rope_scaling", json!({"rope_type": "yarn", "factor": 4.0}), "yarn"),
            ("vocab_size", json!("many"), "vocab_size"),
        ];
        for (key, value, needle) in cases {
            let mut cfg = base();
            cfg[key] = value;
            let msg = ModelConfig::from_json(&cfg, p).unwrap_err().to_string();
            assert!(msg.contains(needle) && msg.contains("dir/config.json"), "{key}: {msg}");
        }
    }
}
