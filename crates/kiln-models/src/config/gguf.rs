//! [`ModelConfig`] from GGUF metadata (`{arch}.*` keys, as llama.cpp writes them).
//!
//! What the metadata does not say is fixed per architecture the way llama.cpp fixes it:
//! Gemma 3's sliding layers are 5 of every 6 with a local RoPE base of 10 000, its attention
//! scale is `1/sqrt(key_length)`, and its norm weights are stored with the `+1` already added.

use kiln_kernels::activation::GateActivation;
use kiln_kernels::rope::{RopeScaling, RopeStyle};

use super::{Architecture, MAX_DIM, MAX_LAYERS, ModelConfig};
use crate::LoadError;
use crate::gguf::GgufFile;

/// GGUF `general.architecture` values kiln runs.
pub const GGUF_SUPPORTED: &str = "llama, qwen2, qwen3, gemma3";

/// Gemma 3: every 6th layer (5, 11, ...) attends globally.
const GEMMA3_SWA_PATTERN: usize = 6;
const GEMMA3_LOCAL_ROPE_BASE: f32 = 10_000.0;

impl ModelConfig {
    pub fn from_gguf(file: &GgufFile) -> Result<Self, LoadError> {
        let err = |m: String| LoadError::config(file.path(), m);
        let arch_name = file
            .str("general.architecture")?
            .ok_or_else(|| err("missing `general.architecture`".into()))?;
        let architecture = match arch_name {
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
        let key = |k: &str| format!("{arch_name}.{k}");
        let dim = |k: &str| -> Result<usize, LoadError> {
            let v = file.require_usize(&key(k))?;
            if v == 0 || v > MAX_DIM {
                return Err(err(format!("`{}` = {v} is out of range 1..={MAX_DIM}", key(k))));
            }
            Ok(v)
        };
        let opt_dim = |k: &str| -> Result<Option<usize>, LoadError> {
            file.u64(&key(k))?.map(|_| dim(k)).transpose()
        };
        let hidden_size = dim("embedding_length")?;
        let num_layers = dim("block_count")?;
        if num_layers > MAX_LAYERS {
            return Err(err(format!("block_count = {num_layers} exceeds {MAX_LAYERS}")));
        }
        let num_heads = dim("attention.head_count")?;
        let num_kv_heads = opt_dim("attention.head_count_kv")?.unwrap_or(num_heads);
        let head_dim = match opt_dim("attention.key_length")? {
            Some(d) => d,
            None if hidden_size.is_multiple_of(num_heads) => hidden_size / num_heads,
            None => return Err(err("embedding_length is not a multiple of head_count".into())),
        };
        if let Some(v) = opt_dim("attention.value_length")?
            && v != head_dim
        {
            return Err(err(format!("value_length {v} differs from key_length {head_dim}")));
        }
        if !num_heads.is_multiple_of(num_kv_heads) {
            return Err(err(format!(
                "head_count ({num_heads}) must be a multiple of head_count_kv ({num_kv_heads})"
            )));
        }
        if !head_dim.is_multiple_of(2) || head_dim > 1024 {
            return Err(err(format!("head dim {head_dim} must be even and at most 1024")));
        }
        let vocab_size = match file.tensor("token_embd.weight") {
            Some(t) if t.dims.len() == 2 => usize::try_from(t.dims[1])
                .ok()
                .filter(|v| (1..=(1 << 24)).contains(v))
                .ok_or_else(|| err("token_embd.weight has an absurd vocabulary size".into()))?,
            _ => return Err(err("missing 2-D tensor `token_embd.weight`".into())),
        };
        let rope_theta = file.f32(&key("rope.freq_base"))?.unwrap_or(10_000.0);
        if !(rope_theta.is_finite() && rope_theta > 1.0) {
            return Err(err(format!("rope.freq_base = {rope_theta} must be > 1")));
        }
        let rope_scaling = match file.str(&key("rope.scaling.type"))? {
            None | Some("none") => RopeScaling::None,
            Some("linear") => {
                let factor = file.f32(&key("rope.scaling.factor"))?.unwrap_or(1.0);
                if !(factor.is_finite() && factor > 0.0) {
                    return Err(err(format!("rope.scaling.factor = {factor} must be positive")));
                }
                if factor == 1.0 { RopeScaling::None } else { RopeScaling::Linear { factor } }
            }
            Some(other) => return Err(err(format!("rope scaling `{other}` is not supported"))),
        };
        let gemma = architecture == Architecture::Gemma3;
        let window = opt_dim("attention.sliding_window")?;
        let layer_windows = if gemma {
            let window =
                window.ok_or_else(|| err("gemma3 needs `attention.sliding_window`".into()))?;
            (0..num_layers).map(|l| ((l + 1) % GEMMA3_SWA_PATTERN != 0).then_some(window)).collect()
        } else {
            vec![None; num_layers]
        };
        let softcap = |k: &str| -> Result<Option<f32>, LoadError> {
            match file.f32(&key(k))? {
                Some(c) if !(c.is_finite() && c > 0.0) => {
                    Err(err(format!("`{}` must be positive", key(k))))
                }
                c => Ok(c),
            }
        };
        Ok(Self {
            architecture,
            vocab_size,
            hidden_size,
            intermediate_size: dim("feed_forward_length")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: file.f32(&key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: opt_dim("context_length")?.unwrap_or(4096),
            tie_word_embeddings: file.tensor("output.weight").is_none(),
            layer_windows,
            rope_local_theta: gemma.then_some(GEMMA3_LOCAL_ROPE_BASE),
            // llama.cpp's converter permutes Llama q/k rows to the interleaved RoPE layout.
            rope_style: if architecture == Architecture::Llama {
                RopeStyle::Interleaved
            } else {
                RopeStyle::Neox
            },
            hidden_act: if gemma { GateActivation::GeluTanh } else { GateActivation::Silu },
            attention_scale: 1.0 / (head_dim as f32).sqrt(),
            embedding_scale: gemma.then(|| (hidden_size as f32).sqrt()),
            sandwich_norms: gemma,
            norm_weight_offset: 0.0,
            attn_logit_softcap: softcap("attn_logit_softcapping")?,
            final_logit_softcap: softcap("final_logit_softcapping")?,
            qkv_bias: file.tensor("blk.0.attn_q.bias").is_some(),
            o_bias: file.tensor("blk.0.attn_output.bias").is_some(),
            mlp_bias: file.tensor("blk.0.ffn_up.bias").is_some(),
            qk_norm: file.tensor("blk.0.attn_q_norm.weight").is_some(),
        })
    }
}
