//! [`ModelConfig`] from GGUF metadata (`{arch}.*` keys, as llama.cpp writes them).
//!
//! The shared shape is read here; what the metadata does not say is fixed per family the way
//! llama.cpp fixes it (`crate::family`): Gemma 3's sliding layers and local RoPE base, Llama's
//! interleaved RoPE. The attention scale is `1/sqrt(key_length)`, norm weights are stored with
//! any `+1` already added, and Llama 3's frequency scaling comes as a `rope_freqs` tensor.

use kiln_backend::{GateActivation, RopeScaling, RopeStyle};

use super::{Architecture, MAX_DIM, MAX_LAYERS, ModelConfig};
use crate::LoadError;
use crate::gguf::{GgufFile, GgufValue};
use crate::weights::WeightSource;

/// The `{arch}.*` keys of one file.
pub(crate) struct Keys<'a> {
    file: &'a GgufFile,
    arch: &'a str,
}

impl Keys<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    pub(crate) fn err(&self, m: String) -> LoadError {
        LoadError::config(self.file.path(), m)
    }

    fn dim(&self, k: &str) -> Result<usize, LoadError> {
        let v = self.file.require_usize(&self.key(k))?;
        if v == 0 || v > MAX_DIM {
            return Err(self.err(format!("`{}` = {v} is out of range 1..={MAX_DIM}", self.key(k))));
        }
        Ok(v)
    }

    pub(crate) fn opt_dim(&self, k: &str) -> Result<Option<usize>, LoadError> {
        self.file.u64(&self.key(k))?.map(|_| self.dim(k)).transpose()
    }

    /// A dimension the file must have.
    pub(crate) fn required_dim(&self, k: &str) -> Result<usize, LoadError> {
        self.dim(k)
    }

    /// An optional unsigned integer `{arch}.{k}`.
    pub(crate) fn opt_u64(&self, k: &str) -> Result<Option<u64>, LoadError> {
        self.file.u64(&self.key(k))
    }

    fn positive(&self, k: &str) -> Result<Option<f32>, LoadError> {
        match self.file.f32(&self.key(k))? {
            Some(c) if !(c.is_finite() && c > 0.0) => {
                Err(self.err(format!("`{}` must be positive", self.key(k))))
            }
            c => Ok(c),
        }
    }

    pub(crate) fn opt_bool(&self, k: &str) -> Result<Option<bool>, LoadError> {
        self.file.bool(&self.key(k))
    }

    pub(crate) fn has_tensor(&self, name: &str) -> bool {
        self.file.tensor(name).is_some()
    }

    /// The rows of 2-D tensor `name` (its outer ggml dimension), when the file has it.
    pub(crate) fn rows(&self, name: &str) -> Option<usize> {
        match self.file.tensor(name)?.dims[..] {
            [_, rows] => usize::try_from(rows).ok(),
            _ => None,
        }
    }

    /// The `[head_dim / 2]` positive factors in tensor `name`, when the file has it.
    pub(crate) fn factors(
        &self,
        name: &str,
        head_dim: usize,
    ) -> Result<Option<Vec<f32>>, LoadError> {
        positive_factors(self.file, name, head_dim)
    }

    /// An optional positive number `{arch}.{k}`.
    pub(crate) fn opt_positive(&self, k: &str) -> Result<Option<f32>, LoadError> {
        self.positive(k)
    }

    /// The dense FFN width; a mixture-of-experts file without dense layers may give only the
    /// experts' (`expert_feed_forward_length`).
    fn ffn_length(&self) -> Result<usize, LoadError> {
        match self.opt_dim("feed_forward_length")? {
            Some(d) => Ok(d),
            None => self
                .opt_dim("expert_feed_forward_length")?
                .ok_or_else(|| self.err(format!("missing `{}`", self.key("feed_forward_length")))),
        }
    }

    /// The experts of a mixture-of-experts file (`expert_count`, `expert_used_count`,
    /// `expert_feed_forward_length`, else `feed_forward_length` as Mixtral's files have it,
    /// `expert_weights_norm`, default `norm_default`, and a shared expert's
    /// `expert_shared_feed_forward_length`); a layer has experts when it has a router
    /// (`blk.N.ffn_gate_inp.weight`).
    pub(crate) fn moe(
        &self,
        num_layers: usize,
        norm_default: bool,
    ) -> Result<super::MoeConfig, LoadError> {
        let width = match self.opt_dim("expert_feed_forward_length")? {
            Some(w) => w,
            None => self.dim("feed_forward_length")?,
        };
        let moe = super::MoeConfig {
            num_experts: self.dim("expert_count")?,
            experts_per_token: self.dim("expert_used_count")?,
            expert_intermediate_size: width,
            norm_topk_prob: self.opt_bool("expert_weights_norm")?.unwrap_or(norm_default),
            shared_expert_intermediate_size: self.opt_dim("expert_shared_feed_forward_length")?,
            shared_expert_gate: true,
            routing: super::Routing::Softmax,
            routed_scaling_factor: 1.0,
            router_bias: false,
            expert_bias: false,
            sparse_layers: (0..num_layers)
                .map(|l| self.has_tensor(&format!("blk.{l}.ffn_gate_inp.weight")))
                .collect(),
        };
        moe.validate(|m| self.err(m))?;
        Ok(moe)
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
        // Latent attention (`kv_lora_rank`) has values narrower than its keys.
        let latent = self.file.u64(&self.key("attention.kv_lora_rank"))?.is_some();
        if let Some(v) = self.opt_dim("attention.value_length")?
            && v != head_dim
            && !latent
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
            Some("yarn") => {
                let factor = self.positive("rope.scaling.factor")?.ok_or_else(|| {
                    self.err("yarn rope scaling needs `rope.scaling.factor`".into())
                })?;
                let original = self.dim("rope.scaling.original_context_length")? as f32;
                RopeScaling::Yarn {
                    factor,
                    original_max_position: original,
                    beta_fast: self.positive("rope.scaling.yarn_beta_fast")?.unwrap_or(32.0),
                    beta_slow: self.positive("rope.scaling.yarn_beta_slow")?.unwrap_or(1.0),
                    truncate: true,
                }
            }
            Some(other) => return Err(self.err(format!("rope scaling `{other}` is not supported"))),
        };
        Ok((theta, scaling))
    }

    /// Which layers use the sliding window: `attention.sliding_window_pattern` as a period `n`
    /// (every `n`-th layer is global) or one bool per layer; absent, `default_period`.
    pub(crate) fn sliding_layers(
        &self,
        num_layers: usize,
        default_period: usize,
    ) -> Result<Vec<bool>, LoadError> {
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
            None => default_period,
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
    let arch = Architecture::from_gguf(name).ok_or_else(|| LoadError::UnsupportedArchitecture {
        path: file.path().to_path_buf(),
        name: name.to_string(),
        supported: Architecture::GGUF_SUPPORTED,
    })?;
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

/// Llama 3's frequency divisors (`rope_freqs.weight`, `[rotary_dim / 2]`), when present.
fn rope_freq_factors(file: &GgufFile, rotary_dim: usize) -> Result<Option<Vec<f32>>, LoadError> {
    positive_factors(file, "rope_freqs.weight", rotary_dim)
}

/// A `[head_dim / 2]` tensor of positive RoPE frequency divisors, when present.
pub(crate) fn positive_factors(
    file: &GgufFile,
    name: &str,
    head_dim: usize,
) -> Result<Option<Vec<f32>>, LoadError> {
    if file.tensor(name).is_none() {
        return Ok(None);
    }
    let factors = file.vector(name, head_dim / 2)?;
    if factors.iter().any(|f| !(f.is_finite() && *f > 0.0)) {
        return Err(LoadError::config(file.path(), format!("{name} must be positive")));
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
        // `rope.dimension_count`: the leading dimensions of each head RoPE rotates (llama.cpp's
        // `n_rot`; below the head dimension with a partial rotary factor, as Phi-4-mini's).
        let rotary_dim = keys.opt_dim("rope.dimension_count")?.unwrap_or(head_dim);
        if !rotary_dim.is_multiple_of(2) || rotary_dim > head_dim {
            return Err(keys.err(format!(
                "rope.dimension_count {rotary_dim} must be even and at most the head dimension \
                 {head_dim}"
            )));
        }
        let mut config = Self {
            architecture,
            vocab_size: vocab_size(file)?,
            hidden_size,
            intermediate_size: keys.ffn_length()?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rotary_dim,
            rms_norm_eps: file.f32(&keys.key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: keys.opt_dim("context_length")?.unwrap_or(4096),
            tie_word_embeddings: file.tensor("output.weight").is_none(),
            layer_windows: vec![None; num_layers],
            rope_local_theta: None,
            rope_style: RopeStyle::Neox,
            rope_freq_factors: rope_freq_factors(file, rotary_dim)?,
            // llama.cpp's YaRN multiplies cos and sin by `0.1 · ln(factor) + 1`.
            rope_mscale: match rope_scaling {
                RopeScaling::Yarn { factor, .. } => {
                    kiln_backend::ops::yarn_attention_factor(factor, None, None)
                }
                _ => 1.0,
            },
            hidden_act: GateActivation::Silu,
            attention_scale: 1.0 / (head_dim as f32).sqrt(),
            embedding_scale: None,
            sandwich_norms: false,
            norm_weight_offset: 0.0,
            attn_logit_softcap: keys.positive("attn_logit_softcapping")?,
            final_logit_softcap: keys.positive("final_logit_softcapping")?,
            qkv_bias: file.tensor("blk.0.attn_q.bias").is_some(),
            o_bias: file.tensor("blk.0.attn_output.bias").is_some(),
            mlp_bias: file.tensor("blk.0.ffn_up.bias").is_some(),
            qk_norm: file.tensor("blk.0.attn_q_norm.weight").is_some(),
            moe: None,
            mla: None,
            attention_sinks: false,
            packed: None,
            head: crate::config::OutputHead::Lm,
            encoder: None,
        };
        architecture.apply_gguf(&keys, &mut config)?;
        Ok(config)
    }
}
