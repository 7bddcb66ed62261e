//! Phi-3 and Phi-4 (`Phi3ForCausalLM`, GGUF `phi3`): Llama's decoder whose checkpoints fuse the
//! attention projections into `qkv_proj` (GGUF `attn_qkv`, `[q; k; v]` rows) and the MLP's into
//! `gate_up_proj` (GGUF `ffn_up`, `[gate; up]` rows), read as their parts by [`fused_parts`];
//! every layer slides its window when the config sets one (`sliding_window`, as transformers
//! applies it). LongRoPE (`rope_scaling` `longrope`, GGUF `rope_factors_long`: the 128k
//! variants) and a partial rotary factor (Phi-4-mini) are refused by name.

use std::collections::HashMap;

use super::HfContext;
use crate::config::Fields;
use crate::config::gguf::Keys;
use crate::names::Naming;
use crate::{LoadError, ModelConfig};

pub(super) fn apply_hf(
    f: &Fields<'_>,
    ctx: &HfContext,
    c: &mut ModelConfig,
) -> Result<(), LoadError> {
    let partial = f.opt_f32("partial_rotary_factor")?.unwrap_or(1.0);
    if partial != 1.0 {
        return Err(f.err(format!(
            "partial_rotary_factor {partial} is not supported (RoPE on part of each head)"
        )));
    }
    c.layer_windows = vec![ctx.window; c.num_layers];
    Ok(())
}

pub(super) fn apply_gguf(keys: &Keys<'_>, c: &mut ModelConfig) -> Result<(), LoadError> {
    if keys.has_tensor("rope_factors_long.weight") {
        return Err(keys.err(
            "LongRoPE (`rope_factors_long`, the 128k-context Phi-3 variants) is not supported"
                .into(),
        ));
    }
    if let Some(dims) = keys.opt_dim("rope.dimension_count")?
        && dims != c.head_dim
    {
        return Err(keys.err(format!(
            "RoPE on {dims} of each head's {} dimensions (a partial rotary factor) is not \
             supported",
            c.head_dim
        )));
    }
    if let Some(window) = keys.opt_dim("attention.sliding_window")?.filter(|w| *w > 0) {
        c.layer_windows = vec![Some(window); c.num_layers];
    }
    Ok(())
}

/// The parts of Phi-3's fused matrices under `naming`: each part's name, with the fused
/// tensor's name, the part's first row and the fused tensor's rows.
pub(crate) fn fused_parts(
    c: &ModelConfig,
    naming: Naming,
) -> HashMap<String, (String, usize, usize)> {
    let (q, kv) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    let i = c.intermediate_size;
    let mut parts = HashMap::new();
    for l in 0..c.num_layers {
        let (prefix, [q_name, k_name, v_name, gate_name, up_name], qkv, gate_up) = match naming {
            Naming::Hf(_) => (
                format!("model.layers.{l}."),
                [
                    "self_attn.q_proj",
                    "self_attn.k_proj",
                    "self_attn.v_proj",
                    "mlp.gate_proj",
                    "mlp.up_proj",
                ],
                "self_attn.qkv_proj",
                "mlp.gate_up_proj",
            ),
            Naming::Gguf => (
                format!("blk.{l}."),
                ["attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"],
                "attn_qkv",
                "ffn_up",
            ),
        };
        let qkv = format!("{prefix}{qkv}.weight");
        let gate_up = format!("{prefix}{gate_up}.weight");
        for (name, fused, first, total) in [
            (q_name, &qkv, 0, q + 2 * kv),
            (k_name, &qkv, q, q + 2 * kv),
            (v_name, &qkv, q + kv, q + 2 * kv),
            (gate_name, &gate_up, 0, 2 * i),
            (up_name, &gate_up, i, 2 * i),
        ] {
            parts.insert(format!("{prefix}{name}.weight"), (fused.clone(), first, total));
        }
    }
    parts
}
