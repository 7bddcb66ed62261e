//! BERT-style encoders (`crate::encoder`): BERT (`BertModel`, GGUF `bert`) and RoBERTa /
//! XLM-RoBERTa (`RobertaModel`, `XLMRobertaModel`: BERT's blocks, positions offset by
//! `pad_token_id + 1`). Refused by name: relative position embeddings, a decoder config
//! (`is_decoder`), activations other than GeLU, and a GGUF file that says its attention is
//! causal.

use kiln_backend::GateActivation;
use serde_json::Value;

use super::Architecture;
use crate::config::gguf::Keys;
use crate::config::{EncoderConfig, Fields};
use crate::{LoadError, ModelConfig};

/// transformers' default `layer_norm_eps` of BERT (RoBERTa's configs state theirs).
const DEFAULT_EPS: f32 = 1e-12;

pub(super) fn apply_hf(
    arch: Architecture,
    f: &Fields<'_>,
    c: &mut ModelConfig,
) -> Result<(), LoadError> {
    if f.opt_bool("is_decoder")?.unwrap_or(false) {
        return Err(f.err("is_decoder = true: kiln runs BERT-style models as encoders".into()));
    }
    match f.json.get("position_embedding_type").and_then(Value::as_str) {
        None | Some("absolute") => {}
        Some(other) => {
            return Err(f.err(format!("position_embedding_type `{other}` is not supported")));
        }
    }
    c.hidden_act = match f.json.get("hidden_act").and_then(Value::as_str) {
        None | Some("gelu") => GateActivation::Gelu,
        Some("gelu_new" | "gelu_pytorch_tanh") => GateActivation::GeluTanh,
        Some(other) => {
            return Err(f.err(format!("hidden activation `{other}` is not supported")));
        }
    };
    let position_offset = match arch {
        Architecture::XlmRoberta => f.opt_usize("pad_token_id")?.unwrap_or(1) + 1,
        _ => 0,
    };
    let positions = f.dim("max_position_embeddings")?;
    c.max_position_embeddings =
        positions.checked_sub(position_offset).filter(|p| *p > 0).ok_or_else(|| {
            f.err(format!(
                "max_position_embeddings = {positions} leaves no position past RoBERTa's offset \
                 of {position_offset}"
            ))
        })?;
    let type_vocab_size = f.opt_usize("type_vocab_size")?.unwrap_or(2);
    if type_vocab_size > 1 << 16 {
        return Err(f.err(format!("type_vocab_size = {type_vocab_size} exceeds 65536")));
    }
    let layer_norm_eps = f.opt_positive("layer_norm_eps")?.unwrap_or(DEFAULT_EPS);
    set_encoder(
        c,
        EncoderConfig { layer_norm_eps, type_vocab_size, position_offset, segment_separator: None },
    );
    Ok(())
}

/// llama.cpp's `bert` files: positions from 0 (the converter drops RoBERTa's offset rows), the
/// token types as `token_types.weight` rows.
pub(super) fn apply_gguf(keys: &Keys<'_>, c: &mut ModelConfig) -> Result<(), LoadError> {
    if keys.opt_bool("attention.causal")? == Some(true) {
        return Err(keys.err("attention.causal = true: a `bert` file is an encoder".into()));
    }
    let layer_norm_eps = keys.opt_positive("attention.layer_norm_epsilon")?.unwrap_or(DEFAULT_EPS);
    let type_vocab_size = keys.rows("token_types.weight").unwrap_or(0);
    c.hidden_act = GateActivation::Gelu;
    set_encoder(
        c,
        EncoderConfig {
            layer_norm_eps,
            type_vocab_size,
            position_offset: 0,
            segment_separator: None,
        },
    );
    Ok(())
}

/// What every encoder shares: biases everywhere, no LM head.
fn set_encoder(c: &mut ModelConfig, encoder: EncoderConfig) {
    c.encoder = Some(encoder);
    c.qkv_bias = true;
    c.o_bias = true;
    c.mlp_bias = true;
    c.tie_word_embeddings = false;
    if c.head == crate::config::OutputHead::Lm {
        c.head = crate::config::OutputHead::None;
    }
}
