//! Llama 2/3, Mistral and Mixtral: the plain decoder. Mistral and Mixtral slide every layer's
//! window when the config sets one; Mixtral's MLP is a mixture of experts in every layer
//! (`block_sparse_moe`: a router, experts `w1` gate, `w3` up, `w2` down, the picked weights
//! always renormalised). Llama's GGUF files have their q/k rows permuted for interleaved RoPE
//! (and carry Llama 3's frequency scaling as a `rope_freqs` tensor, read for every GGUF in
//! `config/gguf.rs`); a `llama` GGUF with `expert_count` is a Mixtral.

use kiln_backend::RopeStyle;

use super::{Architecture, HfContext};
use crate::config::Fields;
use crate::config::gguf::Keys;
use crate::names::{ExpertMatrix, LayerTensor};
use crate::{LoadError, ModelConfig, MoeConfig};

pub(super) fn apply_hf(
    arch: Architecture,
    f: &Fields<'_>,
    ctx: &HfContext,
    c: &mut ModelConfig,
) -> Result<(), LoadError> {
    if matches!(arch, Architecture::Mistral | Architecture::Mixtral) {
        c.layer_windows = vec![ctx.window; c.num_layers];
    }
    if arch == Architecture::Mixtral {
        let moe = MoeConfig {
            num_experts: f.dim("num_local_experts")?,
            experts_per_token: f.dim("num_experts_per_tok")?,
            expert_intermediate_size: c.intermediate_size,
            norm_topk_prob: true,
            shared_expert_intermediate_size: None,
            shared_expert_gate: true,
            routing: crate::Routing::Softmax,
            routed_scaling_factor: 1.0,
            router_bias: false,
            expert_bias: false,
            sparse_layers: vec![true; c.num_layers],
        };
        moe.validate(|m| f.err(m))?;
        c.moe = Some(moe);
    }
    Ok(())
}

pub(super) fn apply_gguf(keys: &Keys<'_>, c: &mut ModelConfig) -> Result<(), LoadError> {
    // llama.cpp's converter permutes Llama q/k rows to the interleaved RoPE layout.
    c.rope_style = RopeStyle::Interleaved;
    if keys.opt_dim("expert_count")?.is_some_and(|e| e > 0) {
        // llama.cpp renormalises a Mixtral's picked weights.
        c.architecture = Architecture::Mixtral;
        c.moe = Some(keys.moe(c.num_layers, true)?);
    }
    Ok(())
}

/// Mixtral's router.
pub(super) fn mixtral_layer_leaf(t: LayerTensor) -> Option<&'static str> {
    (t == LayerTensor::Router).then_some("block_sparse_moe.gate.weight")
}

/// Mixtral's experts: `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down).
pub(super) fn mixtral_expert(l: usize, m: ExpertMatrix, e: usize) -> String {
    let w = match m {
        ExpertMatrix::Gate => "w1",
        ExpertMatrix::Up => "w3",
        ExpertMatrix::Down => "w2",
    };
    format!("model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight")
}
