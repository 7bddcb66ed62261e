//! Gemma 3: sliding-window layers (5 of every 6 unless the config says otherwise) with their own
//! RoPE base, sandwich norms (four per layer), GeLU-tanh, embeddings scaled by
//! `sqrt(hidden_size)`, q/k RMSNorm, `(1 + w)` norms (HF checkpoints store `w`; GGUF files the
//! sum), attention scaled by `query_pre_attn_scalar`, tied embeddings by default.
//!
//! The 4B, 12B and 27B checkpoints are `Gemma3ForConditionalGeneration`: a vision tower and
//! projector beside the same text model, whose settings are `text_config` (with transformers'
//! `Gemma3TextConfig` defaults for the keys it leaves out, [`conditional_text_config`]) and
//! whose weights sit under `language_model.model.` (the Hub's files) or
//! `model.language_model.` (transformers 5's), the head under `language_model.lm_head.` or
//! `lm_head.` when not tied. kiln runs the text model; the vision weights are not read.

use kiln_backend::GateActivation;
use serde_json::Value;

use super::HfContext;
use crate::config::Fields;
use crate::config::gguf::Keys;
use crate::names::LayerTensor;
use crate::{LoadError, ModelConfig};

/// The keys of transformers' `Gemma3TextConfig` with their defaults (what a
/// `Gemma3ForConditionalGeneration` checkpoint's `text_config` leaves out means these).
const TEXT_CONFIG_DEFAULTS: &[(&str, f64)] = &[
    ("vocab_size", 262_208.0),
    ("hidden_size", 2304.0),
    ("intermediate_size", 9216.0),
    ("num_hidden_layers", 26.0),
    ("num_attention_heads", 8.0),
    ("num_key_value_heads", 4.0),
    ("head_dim", 256.0),
    ("max_position_embeddings", 131_072.0),
    ("rms_norm_eps", 1e-6),
    ("rope_theta", 1_000_000.0),
    ("query_pre_attn_scalar", 256.0),
    ("sliding_window", 4096.0),
    ("rope_local_base_freq", 10_000.0),
];

/// The `Gemma3ForCausalLM` config of a `Gemma3ForConditionalGeneration` one: its
/// `text_config`, the keys it lacks at transformers' defaults; `None` without a `text_config`.
pub(crate) fn conditional_text_config(json: &Value) -> Option<Value> {
    let mut text = json.get("text_config")?.as_object()?.clone();
    for (key, value) in TEXT_CONFIG_DEFAULTS {
        if text.get(*key).is_none_or(Value::is_null) {
            let number = if value.fract() == 0.0 {
                Value::from(*value as u64)
            } else {
                serde_json::Number::from_f64(*value).map_or(Value::Null, Value::Number)
            };
            text.insert((*key).to_owned(), number);
        }
    }
    text.entry("hidden_activation").or_insert_with(|| Value::from("gelu_pytorch_tanh"));
    // The top level ties the head for the whole model (default true, as the text config's).
    if let Some(tie) = json.get("tie_word_embeddings").filter(|t| t.is_boolean()) {
        text.insert("tie_word_embeddings".into(), tie.clone());
    }
    text.insert("architectures".into(), Value::from(vec!["Gemma3ForCausalLM"]));
    Some(Value::Object(text))
}

/// Every 6th layer (5, 11, ...) attends globally, unless the model says otherwise.
const SWA_PATTERN: usize = 6;
/// RoPE base of the sliding layers when the model does not give one.
const LOCAL_ROPE_BASE: f32 = 10_000.0;

/// The settings GGUF and HF files share.
fn apply_common(c: &mut ModelConfig) {
    c.sandwich_norms = true;
    c.embedding_scale = Some((c.hidden_size as f32).sqrt());
}

pub(super) fn apply_hf(
    f: &Fields<'_>,
    ctx: &HfContext,
    c: &mut ModelConfig,
) -> Result<(), LoadError> {
    apply_common(c);
    c.qk_norm = true;
    c.layer_windows = layer_windows(f, c.num_layers, ctx.window)?;
    c.hidden_act = f.hidden_act(GateActivation::GeluTanh)?;
    let query_scalar = f.opt_f32("query_pre_attn_scalar")?.unwrap_or(c.head_dim as f32);
    if query_scalar <= 0.0 {
        return Err(f.err("query_pre_attn_scalar must be positive".into()));
    }
    c.attention_scale = 1.0 / query_scalar.sqrt();
    let local = ctx.keyed_local_theta.or(f.opt_f32("rope_local_base_freq")?);
    c.rope_local_theta = Some(local.unwrap_or(LOCAL_ROPE_BASE));
    c.norm_weight_offset = 1.0;
    c.tie_word_embeddings = f.opt_bool("tie_word_embeddings")?.unwrap_or(true);
    Ok(())
}

pub(super) fn apply_gguf(keys: &Keys<'_>, c: &mut ModelConfig) -> Result<(), LoadError> {
    apply_common(c);
    let window = keys
        .opt_dim("attention.sliding_window")?
        .ok_or_else(|| keys.err("gemma3 needs `attention.sliding_window`".into()))?;
    let sliding = keys.sliding_layers(c.num_layers, SWA_PATTERN)?;
    c.layer_windows = sliding.into_iter().map(|s| s.then_some(window)).collect();
    c.rope_local_theta = Some(LOCAL_ROPE_BASE);
    c.hidden_act = GateActivation::GeluTanh;
    Ok(())
}

/// Gemma's four norms per layer: `post_attention_layernorm` is the attention-output norm, and
/// the MLP's input norm is `pre_feedforward_layernorm`.
pub(super) fn hf_layer_leaf(t: LayerTensor) -> Option<&'static str> {
    match t {
        LayerTensor::MlpNorm => Some("pre_feedforward_layernorm.weight"),
        LayerTensor::AttnOutNorm => Some("post_attention_layernorm.weight"),
        LayerTensor::MlpOutNorm => Some("post_feedforward_layernorm.weight"),
        _ => None,
    }
}

/// Per-layer windows: `layer_types`, else every `sliding_window_pattern`-th layer (default 6)
/// is global.
pub(super) fn layer_windows(
    f: &Fields<'_>,
    num_layers: usize,
    window: Option<usize>,
) -> Result<Vec<Option<usize>>, LoadError> {
    let window = window.ok_or_else(|| f.err("a positive `sliding_window` is needed".into()))?;
    if let Some(types) = f.json.get("layer_types").and_then(Value::as_array) {
        if types.len() != num_layers {
            return Err(f.err(format!(
                "`layer_types` has {} entries for {num_layers} layers",
                types.len()
            )));
        }
        return types
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(Some(window)),
                Some("full_attention") => Ok(None),
                _ => Err(f.err(format!("unknown layer type {t}"))),
            })
            .collect();
    }
    let pattern = f.opt_usize("sliding_window_pattern")?.unwrap_or(SWA_PATTERN).max(1);
    Ok((0..num_layers).map(|l| ((l + 1) % pattern != 0).then_some(window)).collect())
}
