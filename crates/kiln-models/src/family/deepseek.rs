//! DeepSeek V2 and V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`; GGUF `deepseek2`):
//! multi-head latent attention ([`MlaConfig`]) and a mixture of experts with shared experts in
//! every layer from `first_k_dense_replace` on (every `moe_layer_freq`-th), the first layers
//! dense.
//!
//! - RoPE rotates only each head's `qk_rope_head_dim` part, interleaved pairs (V2 always; V3
//!   unless `rope_interleave` is false); the attention scale is `qk_head_dim^-0.5`, times
//!   `m²` under YaRN with `mscale_all_dim`, where `m = 0.1 · mscale_all_dim · ln(factor) + 1`.
//! - V2 routes by softmax (`greedy`, or `group_limited_greedy` over `n_group` groups ranked by
//!   their best expert); V3 by sigmoid scores with the correction bias (`noaux_tc`, groups
//!   ranked by their two best). Picks are renormalised when `norm_topk_prob`, then scaled by
//!   `routed_scaling_factor`; the `n_shared_experts` shared experts are one MLP of that many
//!   times the expert width, added whole.
//! - The query and latent norms (`q_a_layernorm`, `kv_a_layernorm`) use eps 1e-6 whatever
//!   `rms_norm_eps` says, as the reference code constructs them.

use kiln_backend::RopeStyle;

use super::Architecture;
use crate::config::Fields;
use crate::config::gguf::Keys;
use crate::names::LayerTensor;
use crate::{LoadError, MlaConfig, ModelConfig, MoeConfig, Routing};

/// The widest cache row latent attention may ask for (DeepSeek's is 576).
const MAX_LATENT_ROW: usize = 4096;

/// The eps of the latent attention's inner norms.
pub(crate) const LATENT_NORM_EPS: f32 = 1e-6;

pub(super) fn apply_hf(
    arch: Architecture,
    f: &Fields<'_>,
    c: &mut ModelConfig,
) -> Result<(), LoadError> {
    if f.opt_bool("attention_bias")?.unwrap_or(false) {
        return Err(f.err("attention_bias = true is not supported for DeepSeek".into()));
    }
    let mla = MlaConfig {
        q_lora_rank: f.opt_usize("q_lora_rank")?.filter(|r| *r > 0),
        kv_lora_rank: f.dim("kv_lora_rank")?,
        qk_nope_head_dim: f.dim("qk_nope_head_dim")?,
        qk_rope_head_dim: f.dim("qk_rope_head_dim")?,
        v_head_dim: f.dim("v_head_dim")?,
    };
    let v3 = arch == Architecture::DeepseekV3;
    let interleaved = !v3 || f.opt_bool("rope_interleave")?.unwrap_or(true);
    let mut scale = (mla.qk_head_dim() as f32).powf(-0.5);
    if let Some(m) = yarn_mscale_all_dim(f, c) {
        scale *= m * m;
    }
    set_mla(c, mla, interleaved, scale).map_err(|m| f.err(m))?;
    let num_experts = ["n_routed_experts", "num_experts", "num_local_experts"]
        .into_iter()
        .map(|k| f.opt_usize(k))
        .find_map(Result::transpose)
        .transpose()?;
    let Some(num_experts) = num_experts else { return Ok(()) };
    let first_dense = f.opt_usize("first_k_dense_replace")?.unwrap_or(if v3 { 3 } else { 0 });
    let freq = f.opt_usize("moe_layer_freq")?.unwrap_or(1);
    if freq == 0 {
        return Err(f.err("`moe_layer_freq` must be at least 1".into()));
    }
    let width = f.dim("moe_intermediate_size")?;
    let shared = f.opt_usize("n_shared_experts")?.unwrap_or(if v3 { 1 } else { 2 });
    let groups = |default: usize| -> Result<(usize, usize), LoadError> {
        Ok((
            f.opt_usize("n_group")?.unwrap_or(default),
            f.opt_usize("topk_group")?.unwrap_or(default),
        ))
    };
    let routing = if v3 {
        let scoring = f.json.get("scoring_func").and_then(|v| v.as_str()).unwrap_or("sigmoid");
        let method = f.json.get("topk_method").and_then(|v| v.as_str()).unwrap_or("noaux_tc");
        if scoring != "sigmoid" || method != "noaux_tc" {
            return Err(f.err(format!(
                "DeepSeek-V3 routing `{method}` with `{scoring}` scores is not supported \
                 (noaux_tc with sigmoid is)"
            )));
        }
        let (groups, topk_groups) = groups(1)?;
        Routing::SigmoidBiased { groups, topk_groups }
    } else {
        let scoring = f.json.get("scoring_func").and_then(|v| v.as_str()).unwrap_or("softmax");
        if scoring != "softmax" {
            return Err(f.err(format!("DeepSeek-V2 scoring `{scoring}` is not supported")));
        }
        match f.json.get("topk_method").and_then(|v| v.as_str()).unwrap_or("greedy") {
            "greedy" => Routing::Softmax,
            "group_limited_greedy" => {
                let (groups, topk_groups) = groups(1)?;
                Routing::SoftmaxGroupLimited { groups, topk_groups }
            }
            other => {
                return Err(f.err(format!("DeepSeek-V2 topk_method `{other}` is not supported")));
            }
        }
    };
    let moe = MoeConfig {
        num_experts,
        experts_per_token: f.dim("num_experts_per_tok")?,
        expert_intermediate_size: width,
        norm_topk_prob: f.opt_bool("norm_topk_prob")?.unwrap_or(v3),
        shared_expert_intermediate_size: (shared > 0).then(|| shared.saturating_mul(width)),
        shared_expert_gate: false,
        routing,
        routed_scaling_factor: f.opt_f32("routed_scaling_factor")?.unwrap_or(if v3 {
            2.5
        } else {
            1.0
        }),
        router_bias: false,
        expert_bias: false,
        sparse_layers: (0..c.num_layers).map(|l| l >= first_dense && l % freq == 0).collect(),
    };
    moe.validate(|m| f.err(m))?;
    c.moe = Some(moe);
    Ok(())
}

/// `0.1 · mscale_all_dim · ln(factor) + 1` under YaRN scaling with a nonzero `mscale_all_dim`
/// (transformers' `yarn_apply_mscale`).
fn yarn_mscale_all_dim(f: &Fields<'_>, c: &ModelConfig) -> Option<f32> {
    let kiln_backend::RopeScaling::Yarn { factor, .. } = c.rope_scaling else { return None };
    let s = crate::config::rope_scaling_object(f)?;
    let all = s.get("mscale_all_dim").and_then(serde_json::Value::as_f64)? as f32;
    (all != 0.0).then(|| if factor <= 1.0 { 1.0 } else { 0.1 * all * factor.ln() + 1.0 })
}

/// The shape latent attention gives the shared fields: one KV head whose row is the latent and
/// the RoPE key, the RoPE part of each head rotated.
fn set_mla(
    c: &mut ModelConfig,
    mla: MlaConfig,
    interleaved: bool,
    scale: f32,
) -> Result<(), String> {
    let row = mla.kv_lora_rank + mla.qk_rope_head_dim;
    if !mla.qk_rope_head_dim.is_multiple_of(2) || row > MAX_LATENT_ROW {
        return Err(format!(
            "latent attention: qk_rope_head_dim {} must be even and the cache row {row} at most \
             {MAX_LATENT_ROW}",
            mla.qk_rope_head_dim
        ));
    }
    c.num_kv_heads = 1;
    c.head_dim = row;
    c.rotary_dim = mla.qk_rope_head_dim;
    c.rope_style = if interleaved { RopeStyle::Interleaved } else { RopeStyle::Neox };
    c.attention_scale = scale;
    c.qkv_bias = false;
    c.o_bias = false;
    c.mla = Some(mla);
    Ok(())
}

/// DeepSeek from GGUF (`deepseek2`), as llama.cpp's converter writes it: the latent sizes in
/// `attention.kv_lora_rank` / `q_lora_rank`, each head's query width in `key_length_mla` (older
/// files: `key_length`), YaRN's `mscale_all_dim` as `rope.scaling.yarn_log_multiplier`
/// (`0.1 · mscale_all_dim`), the router's scoring in `expert_gating_func` (1 softmax, 2
/// sigmoid) with `expert_group_count` / `expert_group_used_count`.
pub(super) fn apply_gguf(keys: &Keys<'_>, c: &mut ModelConfig) -> Result<(), LoadError> {
    let rope = keys.opt_dim("rope.dimension_count")?.ok_or_else(|| {
        keys.err("deepseek2 needs `rope.dimension_count` (qk_rope_head_dim)".into())
    })?;
    let kv_lora_rank = keys
        .opt_dim("attention.kv_lora_rank")?
        .ok_or_else(|| keys.err("deepseek2 needs `attention.kv_lora_rank`".into()))?;
    let qk_head = match keys.opt_dim("attention.key_length_mla")? {
        Some(k) => k,
        None => keys.required_dim("attention.key_length")?,
    };
    let v_head_dim = match keys.opt_dim("attention.value_length_mla")? {
        Some(v) => v,
        None => keys.required_dim("attention.value_length")?,
    };
    let qk_nope_head_dim = qk_head.checked_sub(rope).filter(|d| *d > 0).ok_or_else(|| {
        keys.err(format!("query width {qk_head} must exceed the RoPE width {rope}"))
    })?;
    let mla = MlaConfig {
        q_lora_rank: keys.opt_dim("attention.q_lora_rank")?,
        kv_lora_rank,
        qk_nope_head_dim,
        qk_rope_head_dim: rope,
        v_head_dim,
    };
    let mut scale = (mla.qk_head_dim() as f32).powf(-0.5);
    if let kiln_backend::RopeScaling::Yarn { factor, .. } = c.rope_scaling {
        // llama.cpp cancels YaRN's own cos/sin factor for this family and scales attention by
        // `m²` instead, `m = 1 + yarn_log_multiplier · ln(factor)`.
        c.rope_mscale = 1.0;
        if let Some(log_mul) = keys.opt_positive("rope.scaling.yarn_log_multiplier")? {
            let m = 1.0 + log_mul * factor.ln();
            scale *= m * m;
        }
    }
    set_mla(c, mla, true, scale).map_err(|m| keys.err(m))?;
    if keys.opt_dim("expert_count")?.is_none() {
        return Ok(());
    }
    let mut moe = keys.moe(c.num_layers, false)?;
    let shared = keys.opt_dim("expert_shared_count")?.unwrap_or(0);
    moe.shared_expert_intermediate_size =
        (shared > 0).then(|| shared.saturating_mul(moe.expert_intermediate_size));
    moe.shared_expert_gate = false;
    moe.routed_scaling_factor = keys.opt_positive("expert_weights_scale")?.unwrap_or(1.0);
    let groups = keys.opt_dim("expert_group_count")?.unwrap_or(1);
    let topk_groups = keys.opt_dim("expert_group_used_count")?.unwrap_or(groups);
    moe.routing = match keys.opt_u64("expert_gating_func")?.unwrap_or(1) {
        1 if groups <= 1 => Routing::Softmax,
        1 => Routing::SoftmaxGroupLimited { groups, topk_groups },
        2 => Routing::SigmoidBiased { groups, topk_groups },
        other => return Err(keys.err(format!("expert_gating_func {other} is not supported"))),
    };
    moe.validate(|m| keys.err(m))?;
    c.moe = Some(moe);
    Ok(())
}

/// DeepSeek's shared experts (`mlp.shared_experts`, plural).
pub(super) fn hf_layer_leaf(t: LayerTensor) -> Option<&'static str> {
    Some(match t {
        LayerTensor::SharedGate => "mlp.shared_experts.gate_proj.weight",
        LayerTensor::SharedUp => "mlp.shared_experts.up_proj.weight",
        LayerTensor::SharedDown => "mlp.shared_experts.down_proj.weight",
        _ => return None,
    })
}
