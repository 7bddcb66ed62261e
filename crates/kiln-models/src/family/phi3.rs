//! Phi-3 and Phi-4 (`Phi3ForCausalLM`, GGUF `phi3`): Llama's decoder whose checkpoints fuse the
//! attention projections into `qkv_proj` (GGUF `attn_qkv`, `[q; k; v]` rows) and the MLP's into
//! `gate_up_proj` (GGUF `ffn_up`, `[gate; up]` rows), read as their parts by [`fused_parts`];
//! every layer slides its window when the config sets one (`sliding_window`, as transformers
//! applies it). A partial rotary factor (Phi-4-mini's 0.75; GGUF `rope.dimension_count` below
//! the head dimension) rotates the leading `int(head_dim · factor)` dimensions of each head, as
//! transformers does, the LongRoPE factors then listing one per rotated pair.
//!
//! LongRoPE (the 128k variants: `rope_scaling` `longrope`, GGUF `rope_factors_long` /
//! `rope_factors_short`) divides each RoPE frequency by a factor and scales attention by
//! `attention_factor²` (transformers multiplies both cos and sin by it, which scales q·k by its
//! square as every dimension rotates; with a partial rotary factor only the rotated dimensions
//! are scaled, so the factor multiplies the RoPE table's cos and sin instead, `rope_mscale`). transformers picks the short factors for a forward pass
//! no longer than `original_max_position_embeddings` and the long ones beyond, recomputing all
//! positions; a KV cache cannot, so kiln picks once per model: the long factors when its context
//! (`max_position_embeddings`) exceeds the original, the short ones otherwise. Sequences longer
//! than the original then match transformers exactly; shorter ones see the long factors.

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
    // Top level (transformers 4), or among transformers 5's `rope_parameters`.
    let in_rope = f.json.get("rope_parameters").and_then(|r| r.get("partial_rotary_factor"));
    let partial = match (f.opt_f32("partial_rotary_factor")?, in_rope) {
        (Some(p), _) => p,
        (None, Some(v)) => v
            .as_f64()
            .map(|p| p as f32)
            .ok_or_else(|| f.err(format!("rope_parameters.partial_rotary_factor is {v}")))?,
        (None, None) => 1.0,
    };
    set_rotary_dim(c, (c.head_dim as f64 * f64::from(partial)) as usize)
        .map_err(|e| f.err(format!("partial_rotary_factor {partial}: {e}")))?;
    c.layer_windows = vec![ctx.window; c.num_layers];
    if let Some(s) = &ctx.longrope {
        let pairs = c.rotary_dim / 2;
        let factors = |key: &str| -> Result<Vec<f32>, LoadError> {
            let list = s.get(key).and_then(serde_json::Value::as_array);
            let list = list
                .filter(|l| l.len() == pairs)
                .ok_or_else(|| f.err(format!("longrope `{key}` must list {pairs} factors")))?;
            list.iter()
                .map(|v| {
                    v.as_f64()
                        .map(|x| x as f32)
                        .filter(|x| x.is_finite() && *x > 0.0)
                        .ok_or_else(|| f.err(format!("longrope `{key}` holds {v}")))
                })
                .collect()
        };
        let original = s
            .get("original_max_position_embeddings")
            .and_then(serde_json::Value::as_u64)
            .map(|o| o as usize)
            .or(f.opt_usize("original_max_position_embeddings")?)
            .unwrap_or(c.max_position_embeddings);
        let number = |key: &str| s.get(key).and_then(serde_json::Value::as_f64);
        let factor =
            number("factor").unwrap_or(c.max_position_embeddings as f64 / original.max(1) as f64);
        let attention_factor = number("attention_factor").unwrap_or(if factor <= 1.0 {
            1.0
        } else {
            (1.0 + factor.ln() / (original.max(2) as f64).ln()).sqrt()
        });
        long_rope(
            c,
            (factors("short_factor")?, factors("long_factor")?),
            original,
            attention_factor,
        );
    }
    Ok(())
}

/// Sets LongRoPE's divisors (the long ones when the model's context exceeds `original`) and
/// attention factor on `c` (module docs).
fn long_rope(
    c: &mut ModelConfig,
    (short, long): (Vec<f32>, Vec<f32>),
    original: usize,
    attention_factor: f64,
) {
    let factors = if c.max_position_embeddings > original { long } else { short };
    c.rope_freq_factors = Some(factors);
    if c.rotary_dim == c.head_dim {
        c.attention_scale *= (attention_factor * attention_factor) as f32;
    } else {
        // Only the rotated dimensions of q and k are scaled (transformers multiplies cos and
        // sin), so the factor cannot fold into the attention scale.
        c.rope_mscale = attention_factor as f32;
    }
}

/// Rotates the leading `dims` of each head: even, positive and at most the head dimension.
fn set_rotary_dim(c: &mut ModelConfig, dims: usize) -> Result<(), String> {
    if dims == 0 || !dims.is_multiple_of(2) || dims > c.head_dim {
        return Err(format!(
            "RoPE on {dims} of each head's {} dimensions (must be even, 2..={})",
            c.head_dim, c.head_dim
        ));
    }
    c.rotary_dim = dims;
    Ok(())
}

pub(super) fn apply_gguf(keys: &Keys<'_>, c: &mut ModelConfig) -> Result<(), LoadError> {
    if let Some(long) = keys.factors("rope_factors_long.weight", c.rotary_dim)? {
        let short = keys.factors("rope_factors_short.weight", c.rotary_dim)?;
        let short =
            short.ok_or_else(|| keys.err("rope_factors_long without rope_factors_short".into()))?;
        let original = keys
            .opt_dim("rope.scaling.original_context_length")?
            .unwrap_or(c.max_position_embeddings);
        let factor = c.max_position_embeddings as f64 / original.max(1) as f64;
        let attention_factor = match keys.opt_positive("rope.scaling.attn_factor")? {
            Some(a) => f64::from(a),
            None if factor <= 1.0 => 1.0,
            None => (1.0 + factor.ln() / (original.max(2) as f64).ln()).sqrt(),
        };
        long_rope(c, (short, long), original, attention_factor);
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
