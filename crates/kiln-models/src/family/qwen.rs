//! Qwen2 (bias on q/k/v), Qwen3 (RMSNorm over each head of q and k before RoPE), Qwen2-MoE
//! (Qwen2's attention; experts plus a shared expert scaled by its sigmoid gate) and Qwen3-MoE
//! (Qwen3's attention). The MoE families put experts in the MLP of every layer but
//! `mlp_only_layers`. None slides its window in the checkpoints kiln runs; a config that asks
//! for it is refused.

use super::Architecture;
use crate::config::Fields;
use crate::config::gguf::Keys;
use crate::{LoadError, ModelConfig, MoeConfig};

pub(super) fn apply_hf(
    arch: Architecture,
    f: &Fields<'_>,
    c: &mut ModelConfig,
) -> Result<(), LoadError> {
    if f.opt_bool("use_sliding_window")?.unwrap_or(false) {
        return Err(f.err("use_sliding_window = true is not supported".into()));
    }
    match arch {
        Architecture::Qwen2 => c.qkv_bias = true,
        Architecture::Qwen2Moe => {
            c.qkv_bias = f.opt_bool("qkv_bias")?.unwrap_or(true);
            let shared = f.dim("shared_expert_intermediate_size")?;
            c.moe = Some(hf_moe(f, c.num_layers, Some(shared))?);
        }
        Architecture::Qwen3Moe => {
            c.qk_norm = true;
            c.moe = Some(hf_moe(f, c.num_layers, None)?);
        }
        _ => c.qk_norm = true,
    }
    Ok(())
}

/// Qwen2/3-MoE's experts from `config.json`, as transformers reads them (with a `shared`
/// expert of that width): layer `l` has experts unless it is in `mlp_only_layers`, when
/// `(l + 1)` is a multiple of `decoder_sparse_step`.
fn hf_moe(
    f: &Fields<'_>,
    num_layers: usize,
    shared: Option<usize>,
) -> Result<MoeConfig, LoadError> {
    let num_experts = match f.opt_usize("num_experts")? {
        Some(e) => e,
        None => f.dim("num_local_experts")?,
    };
    let step = f.opt_usize("decoder_sparse_step")?.unwrap_or(1);
    if step == 0 {
        return Err(f.err("`decoder_sparse_step` must be at least 1".into()));
    }
    let mut dense = vec![false; num_layers];
    if let Some(v) = f.json.get("mlp_only_layers").filter(|v| !v.is_null()) {
        let bad = || f.err(format!("`mlp_only_layers` must list layer indices below {num_layers}"));
        for l in v.as_array().ok_or_else(bad)? {
            let l = l.as_u64().and_then(|l| usize::try_from(l).ok()).filter(|l| *l < num_layers);
            dense[l.ok_or_else(bad)?] = true;
        }
    }
    let moe = MoeConfig {
        num_experts,
        experts_per_token: f.dim("num_experts_per_tok")?,
        expert_intermediate_size: f.dim("moe_intermediate_size")?,
        norm_topk_prob: f.opt_bool("norm_topk_prob")?.unwrap_or(false),
        shared_expert_intermediate_size: shared,
        shared_expert_gate: true,
        routing: crate::Routing::Softmax,
        routed_scaling_factor: 1.0,
        router_bias: false,
        expert_bias: false,
        sparse_layers: (0..num_layers).map(|l| !dense[l] && (l + 1) % step == 0).collect(),
    };
    moe.validate(|m| f.err(m))?;
    Ok(moe)
}

/// Qwen2/3-MoE from GGUF. llama.cpp renormalises Qwen3-MoE's picked weights and not
/// Qwen2-MoE's unless the file says otherwise; a Qwen2-MoE's shared expert is as wide as the
/// dense FFN unless `expert_shared_feed_forward_length` says otherwise.
pub(super) fn apply_gguf_moe(
    arch: Architecture,
    keys: &Keys<'_>,
    c: &mut ModelConfig,
) -> Result<(), LoadError> {
    let qwen3 = arch == Architecture::Qwen3Moe;
    c.qk_norm |= qwen3;
    let mut moe = keys.moe(c.num_layers, qwen3)?;
    if !qwen3 {
        moe.shared_expert_intermediate_size.get_or_insert(c.intermediate_size);
    }
    c.moe = Some(moe);
    Ok(())
}
