//! gpt-oss (`GptOssForCausalLM`; GGUF `gpt-oss`): grouped-query attention with q/k/v/o biases
//! and a learned sink logit per head, sliding-window layers alternating with full ones
//! (`layer_types`; the first slides), YaRN RoPE on rotated halves, and a mixture of experts in
//! every layer: a biased router whose `k` best logits are softmaxed (the renormalised top-k of
//! its softmax), experts with biases on gate, up and down, and the clamped SwiGLU
//! ([`GateActivation::ClampedSwiglu`]).
//!
//! Hugging Face stores each layer's experts as two stacked tensors, `gate_up_proj` `[experts,
//! hidden, 2 · intermediate]` (its columns alternating gate and up, applied as `x · W`) and
//! `down_proj` `[experts, intermediate, hidden]`, with `gate_up_proj_bias` alternating the
//! same way; they are transposed and split per expert at load ([`hf_expert`]).

use kiln_backend::{GateActivation, RopeScaling};

use super::HfContext;
use crate::config::Fields;
use crate::config::gguf::Keys;
use crate::names::{ExpertMatrix, ExpertName, LayerTensor};
use crate::{LoadError, ModelConfig, MoeConfig, Routing};

pub(super) fn apply_hf(
    f: &Fields<'_>,
    ctx: &HfContext,
    c: &mut ModelConfig,
) -> Result<(), LoadError> {
    c.layer_windows = super::gemma3::layer_windows(f, c.num_layers, ctx.window)?;
    c.attention_sinks = true;
    c.hidden_act = GateActivation::ClampedSwiglu {
        alpha: f.opt_f32("swiglu_alpha")?.unwrap_or(1.702),
        limit: f.opt_positive("swiglu_limit")?.unwrap_or(7.0),
    };
    let moe = MoeConfig {
        num_experts: f.dim("num_local_experts")?,
        experts_per_token: match f.opt_usize("num_experts_per_tok")? {
            Some(k) => k,
            None => f.dim("experts_per_token")?,
        },
        expert_intermediate_size: c.intermediate_size,
        norm_topk_prob: true,
        shared_expert_intermediate_size: None,
        shared_expert_gate: false,
        routing: Routing::Softmax,
        routed_scaling_factor: 1.0,
        router_bias: true,
        expert_bias: true,
        sparse_layers: vec![true; c.num_layers],
    };
    moe.validate(|m| f.err(m))?;
    c.moe = Some(moe);
    Ok(())
}

/// gpt-oss from GGUF: every other layer slides its window (the first does), as llama.cpp
/// runs it; the clamped SwiGLU's alpha and limit are the checkpoints' (1.702, 7), which the
/// file does not store; YaRN without truncating its ramp, as the model's reference code and
/// its `config.json` (`truncate: false`) have it (llama.cpp truncates).
pub(super) fn apply_gguf(keys: &Keys<'_>, c: &mut ModelConfig) -> Result<(), LoadError> {
    if let RopeScaling::Yarn { truncate, .. } = &mut c.rope_scaling {
        *truncate = false;
    }
    let window = keys.required_dim("attention.sliding_window")?;
    c.layer_windows = (0..c.num_layers).map(|l| (l % 2 == 0).then_some(window)).collect();
    c.attention_sinks = true;
    c.qkv_bias = true;
    c.o_bias = true;
    c.hidden_act = GateActivation::ClampedSwiglu { alpha: 1.702, limit: 7.0 };
    let mut moe = keys.moe(c.num_layers, true)?;
    moe.router_bias = true;
    moe.expert_bias = true;
    moe.validate(|m| keys.err(m))?;
    c.moe = Some(moe);
    Ok(())
}

/// gpt-oss's GGUF name of tensor `name`: the common one but for the pre-MLP norm, which is
/// `post_attention_norm`.
pub(crate) fn gguf_name(name: &str) -> String {
    let layer = name.strip_prefix("blk.").and_then(|n| n.strip_suffix(".ffn_norm.weight"));
    match layer {
        Some(layer) => format!("blk.{layer}.post_attention_norm.weight"),
        None => name.to_owned(),
    }
}

/// gpt-oss's names: the router is `mlp.router`.
pub(super) fn hf_layer_leaf(t: LayerTensor) -> Option<&'static str> {
    Some(match t {
        LayerTensor::Router => "mlp.router.weight",
        LayerTensor::RouterLogitBias => "mlp.router.bias",
        _ => return None,
    })
}

/// Where expert `m` of layer `l` lies: in the stacked, transposed `gate_up_proj` (gate the
/// even columns, up the odd) or `down_proj`.
pub(crate) fn hf_expert(l: usize, m: ExpertMatrix) -> ExpertName {
    let (tensor, part) = match m {
        ExpertMatrix::Gate => ("gate_up_proj", Some(0)),
        ExpertMatrix::Up => ("gate_up_proj", Some(1)),
        ExpertMatrix::Down => ("down_proj", None),
    };
    ExpertName::StackedTransposed { name: format!("model.layers.{l}.mlp.experts.{tensor}"), part }
}

/// Expert `m`'s bias tensor of layer `l` and which of its alternating columns are `m`'s.
pub(crate) fn hf_expert_bias(l: usize, m: ExpertMatrix) -> (String, Option<usize>) {
    let (tensor, part) = match m {
        ExpertMatrix::Gate => ("gate_up_proj_bias", Some(0)),
        ExpertMatrix::Up => ("gate_up_proj_bias", Some(1)),
        ExpertMatrix::Down => ("down_proj_bias", None),
    };
    (format!("model.layers.{l}.mlp.experts.{tensor}"), part)
}
