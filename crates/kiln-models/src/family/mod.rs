//! What each model family decides for itself, one module per family: which names it goes by
//! (in `config.json` and in GGUF metadata), the switches it sets on [`ModelConfig`] beyond the
//! shape every decoder shares, and the tensor names it uses where they differ from the common
//! ones. `config.rs` parses the shared shape; the decoder reads only the resulting
//! [`ModelConfig`], so a new family adds a module here and, if it brings a new block kind (a
//! mixture-of-experts MLP), a variant of the decoder's `Mlp`.
//!
//! Families: [`llama`] (Llama 2/3, Mistral), [`qwen`] (Qwen2, Qwen3, Qwen3-MoE), [`gemma3`].

mod gemma3;
mod llama;
mod qwen;

use crate::LoadError;
use crate::ModelConfig;
use crate::config::Fields;
use crate::config::gguf::Keys;
use crate::names::LayerTensor;

/// Model families kiln runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    /// Qwen3's attention with a mixture-of-experts MLP.
    Qwen3Moe,
    Gemma3,
}

/// What the shared `config.json` parse found that families refine.
pub(crate) struct HfContext {
    /// `sliding_window` when positive.
    pub window: Option<usize>,
    /// The sliding layers' RoPE base from a `rope_parameters` keyed by layer type.
    pub keyed_local_theta: Option<f32>,
}

impl Architecture {
    pub const SUPPORTED: &'static str = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, \
         Qwen3ForCausalLM, Qwen3MoeForCausalLM, Gemma3ForCausalLM";

    /// GGUF `general.architecture` values kiln runs.
    pub const GGUF_SUPPORTED: &'static str = "llama, qwen2, qwen3, qwen3moe, gemma3";

    /// The family of a `config.json` `architectures` entry.
    pub(crate) fn from_hf(name: &str) -> Option<Self> {
        Some(match name {
            "LlamaForCausalLM" => Self::Llama,
            "MistralForCausalLM" => Self::Mistral,
            "Qwen2ForCausalLM" => Self::Qwen2,
            "Qwen3ForCausalLM" => Self::Qwen3,
            "Qwen3MoeForCausalLM" => Self::Qwen3Moe,
            "Gemma3ForCausalLM" => Self::Gemma3,
            _ => return None,
        })
    }

    /// The family of a GGUF `general.architecture`.
    pub(crate) fn from_gguf(name: &str) -> Option<Self> {
        Some(match name {
            "llama" => Self::Llama,
            "qwen2" => Self::Qwen2,
            "qwen3" => Self::Qwen3,
            "qwen3moe" => Self::Qwen3Moe,
            "gemma3" => Self::Gemma3,
            _ => return None,
        })
    }

    /// Sets the family's switches from `config.json` on `c` (which holds the shared shape).
    pub(crate) fn apply_hf(
        self,
        f: &Fields<'_>,
        ctx: &HfContext,
        c: &mut ModelConfig,
    ) -> Result<(), LoadError> {
        match self {
            Self::Llama | Self::Mistral => {
                llama::apply_hf(self, ctx, c);
                Ok(())
            }
            Self::Qwen2 | Self::Qwen3 | Self::Qwen3Moe => qwen::apply_hf(self, f, c),
            Self::Gemma3 => gemma3::apply_hf(f, ctx, c),
        }
    }

    /// Sets the family's switches from GGUF metadata on `c` (which holds the shared shape).
    pub(crate) fn apply_gguf(self, keys: &Keys<'_>, c: &mut ModelConfig) -> Result<(), LoadError> {
        match self {
            Self::Llama | Self::Mistral => {
                llama::apply_gguf(c);
                Ok(())
            }
            Self::Qwen2 | Self::Qwen3 => Ok(()),
            Self::Qwen3Moe => qwen::apply_gguf_moe(keys, c),
            Self::Gemma3 => gemma3::apply_gguf(keys, c),
        }
    }

    /// The family's Hugging Face name for a layer tensor where it differs from the common one.
    pub(crate) fn hf_layer_leaf(self, t: LayerTensor) -> Option<&'static str> {
        match self {
            Self::Gemma3 => gemma3::hf_layer_leaf(t),
            _ => None,
        }
    }
}
