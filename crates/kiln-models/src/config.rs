//! `config.json` of a Hugging Face model directory, parsed into one typed [`ModelConfig`].
//!
//! Both spellings of the RoPE settings are accepted: the classic `rope_theta` + `rope_scaling`
//! and transformers 5's `rope_parameters` (flat, or keyed by layer type for Gemma 3).
//! GGUF files fill the same struct from their metadata (`gguf_config`).

use std::path::Path;

use kiln_backend::{GateActivation, RopeScaling, RopeStyle};
use serde_json::Value;

use crate::LoadError;
pub use crate::family::Architecture;
use crate::family::HfContext;
use crate::packed::PackedQuant;

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
    /// Leading dimensions of each head that RoPE rotates (`head_dim`, or less with a partial
    /// rotary factor: Phi-4-mini rotates 96 of 128); the rest pass through unrotated.
    pub rotary_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Attention window of each layer (`[num_layers]`): `Some(w)` lets a query see the `w`
    /// most recent positions, itself included (Mistral: every layer; Gemma 3: 5 of every 6);
    /// `None` is full causal attention.
    pub layer_windows: Vec<Option<usize>>,
    /// RoPE base of the sliding-window layers, when it differs from `rope_theta` (Gemma 3's
    /// local base; those layers then use no frequency scaling).
    pub rope_local_theta: Option<f32>,
    pub rope_style: RopeStyle,
    /// Per-pair divisors of the global RoPE frequencies (`[rotary_dim / 2]`; GGUF `rope_freqs`).
    pub rope_freq_factors: Option<Vec<f32>>,
    /// Multiplier of the global RoPE's cos and sin ([`kiln_backend::RopeConfig::mscale`]).
    pub rope_mscale: f32,
    pub hidden_act: GateActivation,
    /// Multiplier of attention scores (`1/sqrt(head_dim)`, Gemma: `1/sqrt(query_pre_attn_scalar)`).
    pub attention_scale: f32,
    /// Multiplier of the token embeddings (Gemma: `sqrt(hidden_size)`).
    pub embedding_scale: Option<f32>,
    /// RMSNorm on the outputs of attention and MLP before the residual add, with the MLP's
    /// input norm separate (Gemma 2/3's "sandwich" norms).
    pub sandwich_norms: bool,
    /// Added to every stored RMSNorm weight at load: Gemma's HF checkpoints store `w` for a
    /// `(1 + w)` norm; GGUF files store the sum already.
    pub norm_weight_offset: f32,
    /// `cap * tanh(x / cap)` on attention scores and on the final logits.
    pub attn_logit_softcap: Option<f32>,
    pub final_logit_softcap: Option<f32>,
    /// Bias on the q/k/v projections (Qwen2, or Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama's `attention_bias`).
    pub o_bias: bool,
    /// Bias on the MLP projections (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// RMSNorm over each head of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// The experts of a mixture-of-experts model (`None`: every layer's MLP is dense).
    pub moe: Option<MoeConfig>,
    /// Multi-head latent attention (DeepSeek V2/V3) in place of q/k/v projections. With it,
    /// `num_kv_heads` is 1 and `head_dim` is the cache row (`kv_lora_rank + qk_rope_head_dim`),
    /// `rotary_dim` the RoPE part of each head.
    pub mla: Option<MlaConfig>,
    /// Per-head attention sinks (gpt-oss): one more softmax logit per head, value zero.
    pub attention_sinks: bool,
    /// AWQ / GPTQ / compressed-tensors packed linear layers (`quantization_config`); `None`
    /// for float checkpoints and GGUF files.
    pub packed: Option<PackedQuant>,
    /// What sits on the last hidden state: an LM head, none (a base model saved alone, as
    /// sentence-transformers saves an embedding model), or a sequence classifier.
    pub head: OutputHead,
    /// A bidirectional encoder (BERT, XLM-RoBERTa) instead of a decoder: `None` for every
    /// causal model.
    pub encoder: Option<EncoderConfig>,
}

/// What a BERT-style encoder adds to the shared shape: post-LayerNorm blocks with biases
/// everywhere, an ungated GeLU MLP, learned absolute positions and token types, and attention
/// that sees the whole sequence (so a sequence runs whole, in one step, and nothing of it is
/// cached for later requests).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EncoderConfig {
    pub layer_norm_eps: f32,
    /// Rows of the token-type table (0: the file has none).
    pub type_vocab_size: usize,
    /// Added to a token's position before its row of the position table is read:
    /// RoBERTa's `pad_token_id + 1`; 0 for BERT and for GGUF files, whose converter drops
    /// those rows.
    pub position_offset: usize,
    /// With two or more token types, the token that ends the first segment (`[SEP]`): the
    /// tokens after the first one are type 1, as the tokenizer's pair template makes them
    /// (`[CLS] a [SEP] b [SEP]`); `None`: every token is type 0. Set by the loader from the
    /// tokenizer.
    pub segment_separator: Option<u32>,
}

/// What sits on the decoder's last hidden state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputHead {
    /// A language-model head (`*ForCausalLM`): logits over the vocabulary.
    Lm,
    /// None (`architectures: ["Qwen3Model"]`): the model serves pooling only.
    None,
    /// A sequence classifier (`*ForSequenceClassification`: `score.weight`, `num_labels`
    /// rows), applied to the last token's hidden state: the model serves scores (a
    /// one-label cross-encoder reranker) and labels (`/classify`) only.
    Classifier { num_labels: usize },
}

/// Multi-head latent attention (DeepSeek V2/V3): each token's keys and values come from one
/// compressed latent (`kv_a_proj_with_mqa` → RMSNorm → `kv_lora_rank` wide) and one RoPE key
/// shared by every head; queries are per head, a part without RoPE (`qk_nope_head_dim`) and a
/// rotated part (`qk_rope_head_dim`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaConfig {
    /// Width of the compressed query (`q_a_proj` → RMSNorm → `q_b_proj`); `None`: one
    /// `q_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
}

impl MlaConfig {
    /// Each head's query (and key) width: `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

/// How a router turns its logits into each token's picks and their weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Routing {
    /// The `k` best by softmax probability, weighted by it (Qwen, Mixtral, DeepSeek-V2's
    /// `greedy`).
    Softmax,
    /// DeepSeek-V2's `group_limited_greedy`: softmax probabilities; the experts split into
    /// `groups` equal groups, each ranked by its best probability; the `k` best among the
    /// experts of the `topk_groups` best groups.
    SoftmaxGroupLimited { groups: usize, topk_groups: usize },
    /// DeepSeek-V3's `noaux_tc`: sigmoid scores; the choice adds each expert's correction bias
    /// (the `e_score_correction_bias` vector); groups ranked by the sum of their two best
    /// choice scores; the `k` best choices among the `topk_groups` best groups, weighted by
    /// their sigmoid scores (without the bias).
    SigmoidBiased { groups: usize, topk_groups: usize },
}

/// The mixture-of-experts MLP of the sparse layers: a float router scores every expert, each
/// token goes to its `experts_per_token` best ([`Routing`]; ties to the lower index) with
/// their scores as weights, renormalised to sum to one when `norm_topk_prob`, then times
/// `routed_scaling_factor`. A shared expert, when there is one, sees every token and is added
/// to the picks' sum: scaled by the sigmoid of its own one-row gate (Qwen2-MoE), or whole
/// (DeepSeek).
// Independent switches, each mirroring a config.json setting.
#[allow(clippy::struct_excessive_bools)]
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub experts_per_token: usize,
    /// The FFN width of one expert.
    pub expert_intermediate_size: usize,
    pub norm_topk_prob: bool,
    /// The FFN width of the shared expert (`None`: no shared expert).
    pub shared_expert_intermediate_size: Option<usize>,
    /// Whether the shared expert's output is scaled by the sigmoid of its gate.
    pub shared_expert_gate: bool,
    pub routing: Routing,
    /// Multiplies every pick's weight (DeepSeek's `routed_scaling_factor`; 1 elsewhere).
    pub routed_scaling_factor: f32,
    /// Whether the router has a bias added to its logits (gpt-oss).
    pub router_bias: bool,
    /// Whether each expert's gate, up and down matrices have biases (gpt-oss).
    pub expert_bias: bool,
    /// `[num_layers]`: whether layer `l` has experts (else its MLP is dense, of
    /// `intermediate_size`).
    pub sparse_layers: Vec<bool>,
}

/// The most experts a layer may have (a hostile config asks for absurd counts).
pub(crate) const MAX_EXPERTS: usize = 4096;

impl MoeConfig {
    /// How many layers have experts.
    pub fn num_sparse_layers(&self) -> usize {
        self.sparse_layers.iter().filter(|s| **s).count()
    }

    /// Checks the counts against each other and the limits; `err` names the file.
    pub(crate) fn validate(&self, err: impl Fn(String) -> LoadError) -> Result<(), LoadError> {
        let (e, k) = (self.num_experts, self.experts_per_token);
        if !(1..=MAX_EXPERTS).contains(&e) {
            return Err(err(format!("{e} experts is out of range 1..={MAX_EXPERTS}")));
        }
        if !(1..=e).contains(&k) {
            return Err(err(format!("{k} experts per token is out of range 1..={e}")));
        }
        if !(1..=MAX_DIM).contains(&self.expert_intermediate_size) {
            return Err(err(format!(
                "expert FFN width {} is out of range 1..={MAX_DIM}",
                self.expert_intermediate_size
            )));
        }
        if let Some(w) = self.shared_expert_intermediate_size
            && !(1..=MAX_DIM).contains(&w)
        {
            return Err(err(format!("shared expert FFN width {w} is out of range 1..={MAX_DIM}")));
        }
        if let Routing::SoftmaxGroupLimited { groups, topk_groups }
        | Routing::SigmoidBiased { groups, topk_groups } = self.routing
        {
            if groups == 0 || !e.is_multiple_of(groups) || !(1..=groups).contains(&topk_groups) {
                return Err(err(format!(
                    "{e} experts in {groups} groups, {topk_groups} kept: the groups must divide \
                     the experts and keep 1 to all of them"
                )));
            }
            let kept = e / groups * topk_groups;
            if k > kept {
                return Err(err(format!(
                    "{k} experts per token exceeds the {kept} experts of the kept groups"
                )));
            }
            if matches!(self.routing, Routing::SigmoidBiased { .. }) && e / groups < 2 {
                return Err(err("sigmoid group routing ranks groups by their two best experts: groups need at least 2".into()));
            }
        }
        if !(self.routed_scaling_factor.is_finite() && self.routed_scaling_factor > 0.0) {
            return Err(err(format!(
                "routed_scaling_factor {} must be positive",
                self.routed_scaling_factor
            )));
        }
        Ok(())
    }
}

/// Limits that keep a hostile config from requesting absurd allocations.
pub(crate) const MAX_DIM: usize = 1 << 20;
pub(crate) const MAX_LAYERS: usize = 1024;

/// The fields of one `config.json`, read with checks that name the file and the key.
pub(crate) struct Fields<'a> {
    pub json: &'a Value,
    path: &'a Path,
}

impl Fields<'_> {
    pub(crate) fn err(&self, message: String) -> LoadError {
        LoadError::config(self.path, message)
    }

    pub(crate) fn opt_usize(&self, key: &str) -> Result<Option<usize>, LoadError> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => {
                let limit = MAX_DIM.max(1 << 31);
                let n = v.as_u64().ok_or_else(|| {
                    self.err(format!("`{key}` must be a non-negative integer, got {v}"))
                })?;
                usize::try_from(n)
                    .ok()
                    .filter(|n| *n <= limit)
                    .map(Some)
                    .ok_or_else(|| self.err(format!("`{key}` = {n} exceeds the limit of {limit}")))
            }
        }
    }

    pub(crate) fn dim(&self, key: &str) -> Result<usize, LoadError> {
        let v = self.opt_usize(key)?.ok_or_else(|| self.err(format!("missing `{key}`")))?;
        if v == 0 || v > MAX_DIM {
            return Err(self.err(format!("`{key}` = {v} is out of range 1..={MAX_DIM}")));
        }
        Ok(v)
    }

    pub(crate) fn opt_f32(&self, key: &str) -> Result<Option<f32>, LoadError> {
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

    pub(crate) fn opt_positive(&self, key: &str) -> Result<Option<f32>, LoadError> {
        match self.opt_f32(key)? {
            Some(c) if c <= 0.0 => Err(self.err(format!("`{key}` must be positive"))),
            c => Ok(c),
        }
    }

    /// The MLP's gate activation (`hidden_activation`, else `hidden_act`), `default` when the
    /// config names none.
    pub(crate) fn hidden_act(&self, default: GateActivation) -> Result<GateActivation, LoadError> {
        let name = self.json.get("hidden_activation").or_else(|| self.json.get("hidden_act"));
        match name.and_then(Value::as_str) {
            None => Ok(default),
            Some("silu" | "swish") => Ok(GateActivation::Silu),
            Some("gelu_pytorch_tanh" | "gelu_new" | "gelu") => Ok(GateActivation::GeluTanh),
            Some(other) => Err(self.err(format!("hidden activation `{other}` is not supported"))),
        }
    }

    pub(crate) fn opt_bool(&self, key: &str) -> Result<Option<bool>, LoadError> {
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
        let packed = packed_quant(&f, arch_name)?;
        if arch_name == "Gemma3ForConditionalGeneration" {
            let text = crate::family::gemma3::conditional_text_config(json).ok_or_else(|| {
                f.err("Gemma3ForConditionalGeneration needs a `text_config` object".into())
            })?;
            return Ok(Self { packed, ..Self::from_json(&text, path)? });
        }
        let (family_name, head) = output_head(&f, arch_name)?;
        let architecture = Architecture::from_hf(family_name).ok_or_else(|| {
            LoadError::UnsupportedArchitecture {
                path: path.to_path_buf(),
                name: arch_name.to_string(),
                supported: Architecture::SUPPORTED,
            }
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
        let (rope_theta, rope_scaling, keyed_local_theta) = rope_settings(&f)?;
        let longrope = long_rope_settings(&f);
        if longrope.is_some() && architecture != Architecture::Phi3 {
            return Err(
                f.err(format!("rope scaling type `longrope` is not supported for {arch_name}"))
            );
        }
        let attention_bias = f.opt_bool("attention_bias")?.unwrap_or(false);
        let window = f.opt_usize("sliding_window")?.filter(|w| *w > 0);
        let mut config = Self {
            architecture,
            vocab_size: f.dim("vocab_size")?,
            hidden_size,
            intermediate_size: f.dim("intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rotary_dim: head_dim,
            rms_norm_eps: f.opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: f.opt_usize("max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            layer_windows: vec![None; num_layers],
            rope_local_theta: None,
            rope_style: RopeStyle::Neox,
            rope_freq_factors: None,
            rope_mscale: yarn_mscale(&f, rope_scaling),
            hidden_act: f.hidden_act(GateActivation::Silu)?,
            attention_scale: 1.0 / (head_dim as f32).sqrt(),
            embedding_scale: None,
            sandwich_norms: false,
            norm_weight_offset: 0.0,
            attn_logit_softcap: f.opt_positive("attn_logit_softcapping")?,
            final_logit_softcap: f.opt_positive("final_logit_softcapping")?,
            qkv_bias: attention_bias,
            o_bias: attention_bias,
            mlp_bias: f.opt_bool("mlp_bias")?.unwrap_or(false),
            qk_norm: false,
            moe: None,
            mla: None,
            attention_sinks: false,
            packed,
            head,
            encoder: None,
        };
        let ctx = HfContext { window, keyed_local_theta, longrope };
        architecture.apply_hf(&f, &ctx, &mut config)?;
        Ok(config)
    }

    /// The expert settings when layer `l` has experts.
    pub fn layer_experts(&self, l: usize) -> Option<&MoeConfig> {
        self.moe.as_ref().filter(|m| m.sparse_layers.get(l).copied().unwrap_or(false))
    }

    /// The attention window of layer `l`.
    pub fn layer_window(&self, l: usize) -> Option<usize> {
        self.layer_windows.get(l).copied().flatten()
    }
}

/// The checkpoint's packed linear layers (`quantization_config` of AWQ, GPTQ or
/// compressed-tensors); `None` without one, or for gpt-oss's MXFP4 experts, which are read as
/// GGUF's MXFP4 blocks.
fn packed_quant(f: &Fields<'_>, arch_name: &str) -> Result<Option<PackedQuant>, LoadError> {
    let quantization = f.json.get("quantization_config").filter(|q| !q.is_null());
    let mxfp4 = quantization
        .and_then(|q| q.get("quant_method"))
        .is_some_and(|m| m.as_str() == Some("mxfp4"));
    if mxfp4 && arch_name != "GptOssForCausalLM" {
        return Err(f.err(format!(
            "quantization_config: MXFP4 checkpoints are read for gpt-oss only, not {arch_name}"
        )));
    }
    quantization
        .filter(|_| !mxfp4)
        .map(|q| PackedQuant::from_json(q).map_err(|m| f.err(format!("quantization_config: {m}"))))
        .transpose()
}

/// `(rope_theta, scaling, local theta)` from either config spelling; the local theta comes
/// from a `rope_parameters` keyed by layer type (`sliding_attention`).
fn rope_settings(f: &Fields<'_>) -> Result<(f32, RopeScaling, Option<f32>), LoadError> {
    let mut params = f.json.get("rope_parameters").filter(|v| v.is_object());
    let mut local_theta = None;
    if let Some(keyed) = params.and_then(|p| p.get("full_attention")) {
        local_theta = params
            .and_then(|p| p.get("sliding_attention"))
            .and_then(|p| p.get("rope_theta"))
            .and_then(Value::as_f64)
            .map(|t| t as f32);
        params = Some(keyed);
    }
    let scaling = f.json.get("rope_scaling").filter(|v| v.is_object()).or(params);
    let theta = match params.and_then(|p| p.get("rope_theta")) {
        Some(v) => v.as_f64().map(|t| t as f32),
        None => f.opt_f32("rope_theta")?,
    }
    .unwrap_or(10_000.0);
    if !(theta.is_finite() && theta > 1.0) {
        return Err(f.err(format!("rope_theta = {theta} must be > 1")));
    }
    let Some(s) = scaling else { return Ok((theta, RopeScaling::None, local_theta)) };
    let kind = s.get("rope_type").or_else(|| s.get("type")).and_then(Value::as_str);
    let num = |key: &str| -> Result<f32, LoadError> {
        s.get(key)
            .and_then(Value::as_f64)
            .map(|v| v as f32)
            .filter(|v| v.is_finite() && *v > 0.0)
            .ok_or_else(|| f.err(format!("rope scaling needs a positive `{key}`")))
    };
    let scaling = match kind {
        // LongRoPE: frequency divisors and an attention factor, set by the family
        // ([`long_rope_settings`]).
        None | Some("default" | "longrope" | "su") => RopeScaling::None,
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
        Some("yarn") => yarn_scaling(f, s)?,
        Some(other) => return Err(f.err(format!("rope scaling type `{other}` is not supported"))),
    };
    Ok((theta, scaling, local_theta))
}

/// YaRN's frequencies from a `rope_scaling` object, with transformers' defaults: `factor`
/// from `max_position_embeddings / original_max_position_embeddings` when absent, `beta_fast`
/// 32, `beta_slow` 1, `truncate` true.
fn yarn_scaling(f: &Fields<'_>, s: &Value) -> Result<RopeScaling, LoadError> {
    let opt = |key: &str| -> Result<Option<f32>, LoadError> {
        match s.get(key).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|v| v as f32)
                .filter(|v| v.is_finite() && *v > 0.0)
                .map(Some)
                .ok_or_else(|| f.err(format!("yarn rope scaling: `{key}` must be positive"))),
        }
    };
    let original = opt("original_max_position_embeddings")?.ok_or_else(|| {
        f.err("yarn rope scaling needs `original_max_position_embeddings`".into())
    })?;
    let factor = match opt("factor")? {
        Some(factor) => factor,
        None => f.dim("max_position_embeddings")? as f32 / original,
    };
    Ok(RopeScaling::Yarn {
        factor,
        original_max_position: original,
        beta_fast: opt("beta_fast")?.unwrap_or(32.0),
        beta_slow: opt("beta_slow")?.unwrap_or(1.0),
        truncate: s.get("truncate").and_then(Value::as_bool).unwrap_or(true),
    })
}

/// The cos/sin multiplier of a YaRN `rope_scaling` (`attention_factor`, else inferred from
/// `factor`, `mscale` and `mscale_all_dim` as transformers does); 1 for other scalings.
fn yarn_mscale(f: &Fields<'_>, scaling: RopeScaling) -> f32 {
    let RopeScaling::Yarn { factor, .. } = scaling else { return 1.0 };
    let s = rope_scaling_object(f);
    let get = |key: &str| {
        s.and_then(|s| s.get(key))
            .and_then(Value::as_f64)
            .map(|v| v as f32)
            .filter(|v| v.is_finite())
    };
    get("attention_factor").unwrap_or_else(|| {
        kiln_backend::ops::yarn_attention_factor(factor, get("mscale"), get("mscale_all_dim"))
    })
}

/// The `rope_scaling` object, else a flat `rope_parameters`.
pub(crate) fn rope_scaling_object<'a>(f: &Fields<'a>) -> Option<&'a Value> {
    f.json
        .get("rope_scaling")
        .filter(|v| v.is_object())
        .or_else(|| f.json.get("rope_parameters").filter(|v| v.is_object()))
}

/// The LongRoPE settings (`rope_type` `longrope`, formerly `su`), in either config spelling.
fn long_rope_settings(f: &Fields<'_>) -> Option<Value> {
    let scaling = f.json.get("rope_scaling").filter(|v| v.is_object());
    let scaling = scaling.or_else(|| f.json.get("rope_parameters").filter(|v| v.is_object()))?;
    let kind = scaling.get("rope_type").or_else(|| scaling.get("type")).and_then(Value::as_str);
    matches!(kind, Some("longrope" | "su")).then(|| scaling.clone())
}

pub(crate) mod gguf;
#[cfg(test)]
mod tests;

/// The causal LM an `architectures` entry's decoder is, and the head on it: a base model
/// (`Qwen3Model`) is its causal LM's decoder without the head, a sequence classifier the same
/// decoder with a `score` head.
fn output_head<'a>(f: &Fields<'_>, arch_name: &'a str) -> Result<(&'a str, OutputHead), LoadError> {
    Ok(if let Some(causal) = Architecture::base_model_of(arch_name) {
        (causal, OutputHead::None)
    } else if let Some(causal) = Architecture::classifier_of(arch_name) {
        (causal, OutputHead::Classifier { num_labels: num_labels(f)? })
    } else {
        (arch_name, OutputHead::Lm)
    })
}

/// A classifier's labels: `num_labels`, else the size of `id2label`, else transformers'
/// default of 2.
fn num_labels(f: &Fields<'_>) -> Result<usize, LoadError> {
    let n = match f.opt_usize("num_labels")? {
        Some(n) => n,
        None => f.json.get("id2label").and_then(Value::as_object).map_or(2, serde_json::Map::len),
    };
    if n == 0 || n > 1 << 16 {
        return Err(f.err(format!("num_labels = {n}: expected 1 to 65536")));
    }
    Ok(n)
}
