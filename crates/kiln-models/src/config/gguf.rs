//! [`ModelConfig`] from GGUF metadata (`{arch}.*` keys, as llama.cpp writes them).
//!
//! What the metadata does not say is fixed per architecture the way llama.cpp fixes it:
//! Gemma 3's sliding layers are 5 of every 6 (unless `gemma3.attention.sliding_window_pattern`
//! says otherwise) with a local RoPE base of 10 000, its attention scale is
//! `1/sqrt(key_length)`, and its norm weights are stored with the `+1` already added. Llama
//! GGUFs have their q/k rows permuted for interleaved RoPE, and carry Llama 3's frequency
//! scaling as a `rope_freqs` tensor.

use kiln_kernels::activation::GateActivation;
use kiln_kernels::rope::{RopeScaling, RopeStyle};

use super::{Architecture, MAX_DIM, MAX_LAYERS, ModelConfig};
use crate::LoadError;
use crate::gguf::{GgufFile, GgufValue};
use crate::weights::WeightSource;

/// GGUF `general.architecture` values kiln runs.
pub const GGUF_SUPPORTED: &str = "llama, qwen2, qwen3, gemma3";

/// Gemma 3: every 6th layer (5, 11, ...) attends globally, unless the file says otherwise.
const GEMMA3_SWA_PATTERN: usize = 6;
const GEMMA3_LOCAL_ROPE_BASE: f32 = 10_000.0;

/// The `{arch}.*` keys of one file.
struct Keys<'a> {
    file: &'a GgufFile,
    arch: &'a str,
}

impl Keys<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    fn err(&self, m: String) -> LoadError {
        LoadError::config(self.file.path(), m)
    }

    fn dim(&self, k: &str) -> Result<usize, LoadError> {
        let v = self.file.require_usize(&self.key(k))?;
        if v == 0 || v > MAX_DIM {
            return Err(self.err(format!("`{}` = {v} is out of range 1..={MAX_DIM}", self.key(k))));
        }
        Ok(v)
    }

    fn opt_dim(&self, k: &str) -> Result<Option<usize>, LoadError> {
        self.file.u64(&self.key(k))?.map(|_| self.dim(k)).transpose()
    }

    fn positive(&self, k: &str) -> Result<Option<f32>, LoadError> {
        match self.file.f32(&self.key(k))? {
            Some(c) if !(c.is_finite() && c > 0.0) => {
                Err(self.err(format!("`{}` must be positive", self.key(k))))
            }
            c => Ok(c),
        }
    }

    /// `(heads, kv heads, head dim)`, checked against each other.
    fn attention_dims(&self, hidden_size: usize) -> Result<(usize, usize, usize), LoadError> {
        let num_heads = self.dim("attention.head_count")?;
        let num_kv_heads = self.opt_dim("attention.head_count_kv")?.unwrap_or(num_heads);
        let head_dim = match self.opt_dim("attention.key_length")? {
            Some(d) => d,
            None if hidden_size.is_multiple_of(num_heads) => hidden_size / num_heads,
            None => return Err(self.err("embedding_length is not a multiple of head_count".into())),
        };
        if let Some(v) = self.opt_dim("attention.value_length")?
            && v != head_dim
        {
            return Err(self.err(format!("value_length {v} differs from key_length {head_dim}")));
        }
        if !num_heads.is_multiple_of(num_kv_heads) {
            return Err(self.err(format!(
                "head_count ({num_heads}) must be a multiple of head_count_kv ({num_kv_heads})"
            )));
        }
        if !head_dim.is_multiple_of(2) || head_dim > 1024 {
            return Err(self.err(format!("head dim {head_dim} must be even and at most 1024")));
        }
        Ok((num_heads, num_kv_heads, head_dim))
    }

    /// `(base, scaling)` of the global RoPE.
    fn rope(&self) -> Result<(f32, RopeScaling), LoadError> {
        let theta = self.file.f32(&self.key("rope.freq_base"))?.unwrap_or(10_000.0);
        if !(theta.is_finite() && theta > 1.0) {
            return Err(self.err(format!("rope.freq_base = {theta} must be > 1")));
        }
        let scaling = match self.file.str(&self.key("rope.scaling.type"))? {
            None | Some("none") => RopeScaling::None,
            Some("linear") => match self.positive("rope.scaling.factor")? {
                None | Some(1.0) => RopeScaling::None,
                Some(factor) => RopeScaling::Linear { factor },
            },
            Some(other) => return Err(self.err(format!("rope scaling `{other}` is not supported"))),
        };
        Ok((theta, scaling))
    }

    /// Which layers use the sliding window: `attention.sliding_window_pattern` as a period `n`
    /// (every `n`-th layer is global) or one bool per layer; absent, Gemma 3's period of 6.
    fn sliding_layers(&self, num_layers: usize) -> Result<Vec<bool>, LoadError> {
        let key = self.key("attention.sliding_window_pattern");
        let err = |m: &str| self.err(format!("`{key}` {m}"));
        if let Some(GgufValue::Array(_)) = self.file.get(&key) {
            let flags = self.file.array(&key, "a bool", GgufValue::as_bool)?.unwrap_or_default();
            if flags.len() != num_layers {
                return Err(err("must have one entry per layer"));
            }
            return Ok(flags);
        }
        let period = match self.file.u64(&key)? {
            None => GEMMA3_SWA_PATTERN,
            Some(p) => {
                usize::try_from(p).ok().filter(|p| *p > 0).ok_or_else(|| err("must be positive"))?
            }
        };
        Ok((0..num_layers).map(|l| (l + 1) % period != 0).collect())
    }
}

fn architecture(file: &GgufFile) -> Result<(&str, Architecture), LoadError> {
    let name = file.str("general.architecture")?.ok_or_else(|| {
        LoadError::config(file.path(), "missing `general.architecture`".to_string())
    })?;
    let arch = match name {
        "llama" => Architecture::Llama,
        "qwen2" => Architecture::Qwen2,
        "qwen3" => Architecture::Qwen3,
        "gemma3" => Architecture::Gemma3,
        other => {
            return Err(LoadError::UnsupportedArchitecture {
                path: file.path().to_path_buf(),
                name: other.to_string(),
                supported: GGUF_SUPPORTED,
            });
        }
    };
    Ok((name, arch))
}

/// The vocabulary size: the rows of `token_embd.weight`.
fn vocab_size(file: &GgufFile) -> Result<usize, LoadError> {
    let err = |m: &str| LoadError::config(file.path(), m.to_string());
    match file.tensor("token_embd.weight") {
        Some(t) if t.dims.len() == 2 => usize::try_from(t.dims[1])
            .ok()
            .filter(|v| (1..=(1 << 24)).contains(v))
            .ok_or_else(|| err("token_embd.weight has an absurd vocabulary size")),
        _ => Err(err("missing 2-D tensor `token_embd.weight`")),
    }
}

/// Llama 3's frequency divisors (`rope_freqs.weight`, `[head_dim / 2]`), when present.
fn rope_freq_factors(file: &GgufFile, head_dim: usize) -> Result<Option<Vec<f32>>, LoadError> {
    if file.tensor("rope_freqs.weight").is_none() {
        return Ok(None);
    }
    let factors = file.vector("rope_freqs.weight", head_dim / 2)?;
    if factors.iter().any(|f| !(f.is_finite() && *f > 0.0)) {
        return Err(LoadError::config(
            file.path(),
            "rope_freqs.weight must be positive".to_string(),
        ));
    }
    Ok(Some(factors))
}

impl ModelConfig {
    pub fn from_gguf(file: &GgufFile) -> Result<Self, LoadError> {
        let (arch_name, architecture) = architecture(file)?;
        let keys = Keys { file, arch: arch_name };
        let hidden_size = keys.dim("embedding_length")?;
        let num_layers = keys.dim("block_count")?;
        if num_layers > MAX_LAYERS {
            return Err(keys.err(format!("block_count = {num_layers} exceeds {MAX_LAYERS}")));
        }
        let (num_heads, num_kv_heads, head_dim) = keys.attention_dims(hidden_size)?;
        let (rope_theta, rope_scaling) = keys.rope()?;
        let gemma = architecture == Architecture::Gemma3;
        let layer_windows = if gemma {
            let window = keys
                .opt_dim("attention.sliding_window")?
                .ok_or_else(|| keys.err("gemma3 needs `attention.sliding_window`".into()))?;
            keys.sliding_layers(num_layers)?.into_iter().map(|s| s.then_some(window)).collect()
        } else {
            vec![None; num_layers]
        };
        Ok(Self {
            architecture,
            vocab_size: vocab_size(file)?,
            hidden_size,
            intermediate_size: keys.dim("feed_forward_length")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: file.f32(&keys.key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: keys.opt_dim("context_length")?.unwrap_or(4096),
            tie_word_embeddings: file.tensor("output.weight").is_none(),
            layer_windows,
            rope_local_theta: gemma.then_some(GEMMA3_LOCAL_ROPE_BASE),
            // llama.cpp's converter permutes Llama q/k rows to the interleaved RoPE layout.
            rope_style: if architecture == Architecture::Llama {
                RopeStyle::Interleaved
            } else {
                RopeStyle::Neox
            },
            rope_freq_factors: rope_freq_factors(file, head_dim)?,
            hidden_act: if gemma { GateActivation::GeluTanh } else { GateActivation::Silu },
            attention_scale: 1.0 / (head_dim as f32).sqrt(),
            embedding_scale: gemma.then(|| (hidden_size as f32).sqrt()),
            sandwich_norms: gemma,
            norm_weight_offset: 0.0,
            attn_logit_softcap: keys.positive("attn_logit_softcapping")?,
            final_logit_softcap: keys.positive("final_logit_softcapping")?,
            qkv_bias: file.tensor("blk.0.attn_q.bias").is_some(),
            o_bias: file.tensor("blk.0.attn_output.bias").is_some(),
            mlp_bias: file.tensor("blk.0.ffn_up.bias").is_some(),
            qk_norm: file.tensor("blk.0.attn_q_norm.weight").is_some(),
        })
    }
}
