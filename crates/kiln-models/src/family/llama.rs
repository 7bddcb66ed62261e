//! Llama 2/3 and Mistral: the plain decoder. Mistral slides every layer's window; Llama's GGUF
//! files have their q/k rows permuted for interleaved RoPE (and carry Llama 3's frequency
//! scaling as a `rope_freqs` tensor, read for every GGUF in `config/gguf.rs`).

use kiln_backend::RopeStyle;

use super::{Architecture, HfContext};
use crate::ModelConfig;

pub(super) fn apply_hf(arch: Architecture, ctx: &HfContext, c: &mut ModelConfig) {
    if arch == Architecture::Mistral {
        c.layer_windows = vec![ctx.window; c.num_layers];
    }
}

pub(super) fn apply_gguf(c: &mut ModelConfig) {
    // llama.cpp's converter permutes Llama q/k rows to the interleaved RoPE layout.
    c.rope_style = RopeStyle::Interleaved;
}
