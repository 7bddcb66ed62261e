//! Phi-3 and Phi-4 (`Phi3ForCausalLM`): Llama's decoder whose checkpoints fuse the attention
//! projections into `qkv_proj` (`[q; k; v]` rows) and the MLP's into `gate_up_proj` (`[gate;
//! up]` rows), read as their parts by [`fused_parts`]; every layer slides its window when the
//! config sets one (`sliding_window`, as transformers applies it). LongRoPE (`rope_scaling`
//! `longrope`, the 128k variants) and a partial rotary factor (Phi-4-mini) are refused by name.

use std::collections::HashMap;

use super::HfContext;
use crate::config::Fields;
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

/// The parts of Phi-3's fused matrices: each part's Hugging Face name, with the fused
/// tensor's name, the part's first row and the fused tensor's rows.
pub(crate) fn fused_parts(c: &ModelConfig) -> HashMap<String, (String, usize, usize)> {
    let (q, kv) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    let i = c.intermediate_size;
    let mut parts = HashMap::new();
    for l in 0..c.num_layers {
        let qkv = format!("model.layers.{l}.self_attn.qkv_proj.weight");
        let gate_up = format!("model.layers.{l}.mlp.gate_up_proj.weight");
        for (name, fused, first, total) in [
            ("self_attn.q_proj", &qkv, 0, q + 2 * kv),
            ("self_attn.k_proj", &qkv, q, q + 2 * kv),
            ("self_attn.v_proj", &qkv, q + kv, q + 2 * kv),
            ("mlp.gate_proj", &gate_up, 0, 2 * i),
            ("mlp.up_proj", &gate_up, i, 2 * i),
        ] {
            parts.insert(format!("model.layers.{l}.{name}.weight"), (fused.clone(), first, total));
        }
    }
    parts
}
