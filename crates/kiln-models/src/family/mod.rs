//! What each model family decides for itself, one module per family: which names it goes by
//! (in `config.json` and in GGUF metadata), the switches it sets on [`ModelConfig`] beyond the
//! shape every decoder shares, and the tensor names it uses where they differ from the common
//! ones. `config.rs` parses the shared shape; the decoder reads only the resulting
//! [`ModelConfig`], so a new family adds a module here and, if it brings a new block kind (a
//! mixture-of-experts MLP), a variant of the decoder's `Mlp`.
//!
//! Families: [`llama`] (Llama 2/3, Mistral, Mixtral), [`qwen`] (Qwen2, Qwen3, Qwen2-MoE,
//! Qwen3-MoE), [`gemma3`], [`phi3`] (Phi-3, Phi-4), [`deepseek`] (DeepSeek V2/V3: latent
//! attention), and the encoders of [`bert`] (BERT, RoBERTa, XLM-RoBERTa), which run as
//! `crate::encoder` rather than the decoder.

pub(crate) mod bert;
pub(crate) mod deepseek;
pub(crate) mod gemma3;
pub(crate) mod gpt_oss;
mod llama;
pub(crate) mod phi3;
mod qwen;

use crate::LoadError;
use crate::ModelConfig;
use crate::config::Fields;
use crate::config::gguf::Keys;
use crate::names::{ExpertMatrix, LayerTensor};

/// Model families kiln runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    /// Mistral's attention with a mixture-of-experts MLP in every layer.
    Mixtral,
    Qwen2,
    Qwen3,
    /// Qwen2's attention with a mixture-of-experts MLP and a gated shared expert.
    Qwen2Moe,
    /// Qwen3's attention with a mixture-of-experts MLP.
    Qwen3Moe,
    Gemma3,
    /// Llama's decoder with fused `qkv_proj` and `gate_up_proj` (Phi-3, Phi-4).
    Phi3,
    /// Multi-head latent attention and experts with shared experts, softmax routing.
    DeepseekV2,
    /// DeepSeek-V2's blocks with sigmoid routing and its correction bias.
    DeepseekV3,
    /// Attention sinks, alternating sliding windows, biased experts with a clamped SwiGLU.
    GptOss,
    /// A BERT encoder (`BertModel`; GGUF `bert`, which also holds converted XLM-RoBERTa).
    Bert,
    /// BERT's encoder with RoBERTa's position offset and classifier head (`RobertaModel`,
    /// `XLMRobertaModel`).
    XlmRoberta,
}

/// What the shared `config.json` parse found that families refine.
pub(crate) struct HfContext {
    /// `sliding_window` when positive.
    pub window: Option<usize>,
    /// The sliding layers' RoPE base from a `rope_parameters` keyed by layer type.
    pub keyed_local_theta: Option<f32>,
    /// LongRoPE's settings (`rope_scaling` of type `longrope`), for the families that have it.
    pub longrope: Option<serde_json::Value>,
}

impl Architecture {
    pub const SUPPORTED: &'static str = "LlamaForCausalLM, MistralForCausalLM, \
         MixtralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen2MoeForCausalLM, \
         Qwen3MoeForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration (its text \
         model), Phi3ForCausalLM, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, GptOssForCausalLM; for pooling also the base models LlamaModel, MistralModel, \
         Qwen2Model, Qwen3Model and the sequence classifiers LlamaForSequenceClassification, \
         MistralForSequenceClassification, Qwen2ForSequenceClassification, \
         Qwen3ForSequenceClassification; encoders BertModel, RobertaModel, XLMRobertaModel and \
         their *ForSequenceClassification";

    /// GGUF `general.architecture` values kiln runs (`llama` with experts is Mixtral).
    pub const GGUF_SUPPORTED: &'static str =
        "llama, qwen2, qwen3, qwen2moe, qwen3moe, gemma3, phi3, deepseek2, gpt-oss, bert";

    /// The family of a `config.json` `architectures` entry.
    pub(crate) fn from_hf(name: &str) -> Option<Self> {
        Some(match name {
            "LlamaForCausalLM" => Self::Llama,
            "MistralForCausalLM" => Self::Mistral,
            "MixtralForCausalLM" => Self::Mixtral,
            "Qwen2ForCausalLM" => Self::Qwen2,
            "Qwen3ForCausalLM" => Self::Qwen3,
            "Qwen2MoeForCausalLM" => Self::Qwen2Moe,
            "Qwen3MoeForCausalLM" => Self::Qwen3Moe,
            "Gemma3ForCausalLM" | "Gemma3ForConditionalGeneration" => Self::Gemma3,
            "Phi3ForCausalLM" => Self::Phi3,
            "DeepseekV2ForCausalLM" => Self::DeepseekV2,
            "DeepseekV3ForCausalLM" => Self::DeepseekV3,
            "GptOssForCausalLM" => Self::GptOss,
            "BertModel" => Self::Bert,
            "RobertaModel" | "XLMRobertaModel" => Self::XlmRoberta,
            _ => return None,
        })
    }

    /// The causal LM whose decoder a base-model `architectures` entry names (`Qwen3Model` →
    /// `Qwen3ForCausalLM`): the layout sentence-transformers saves embedding models in.
    pub(crate) fn base_model_of(name: &str) -> Option<&'static str> {
        Some(match name {
            "LlamaModel" => "LlamaForCausalLM",
            "MistralModel" => "MistralForCausalLM",
            "Qwen2Model" => "Qwen2ForCausalLM",
            "Qwen3Model" => "Qwen3ForCausalLM",
            // An encoder has no causal LM: its base model is its family's own name.
            "BertModel" => "BertModel",
            "RobertaModel" => "RobertaModel",
            "XLMRobertaModel" => "XLMRobertaModel",
            _ => return None,
        })
    }

    /// The causal LM whose decoder a sequence-classification `architectures` entry names
    /// (`Qwen3ForSequenceClassification` → `Qwen3ForCausalLM`; an encoder's, its base model):
    /// a cross-encoder reranker.
    pub(crate) fn classifier_of(name: &str) -> Option<&'static str> {
        Some(match name {
            "LlamaForSequenceClassification" => "LlamaForCausalLM",
            "MistralForSequenceClassification" => "MistralForCausalLM",
            "Qwen2ForSequenceClassification" => "Qwen2ForCausalLM",
            "Qwen3ForSequenceClassification" => "Qwen3ForCausalLM",
            "BertForSequenceClassification" => "BertModel",
            "RobertaForSequenceClassification" => "RobertaModel",
            "XLMRobertaForSequenceClassification" => "XLMRobertaModel",
            _ => return None,
        })
    }

    /// The family of a GGUF `general.architecture`.
    pub(crate) fn from_gguf(name: &str) -> Option<Self> {
        Some(match name {
            "llama" => Self::Llama,
            "qwen2" => Self::Qwen2,
            "qwen3" => Self::Qwen3,
            "qwen2moe" => Self::Qwen2Moe,
            "qwen3moe" => Self::Qwen3Moe,
            "gemma3" => Self::Gemma3,
            "phi3" => Self::Phi3,
            "deepseek2" => Self::DeepseekV2,
            "gpt-oss" => Self::GptOss,
            "bert" => Self::Bert,
            _ => return None,
        })
    }

    /// The `general.architecture` llama.cpp's converter writes for it (Mistral and Mixtral
    /// are `llama`).
    pub fn gguf_name(self) -> &'static str {
        match self {
            Self::Llama | Self::Mistral | Self::Mixtral => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Qwen2Moe => "qwen2moe",
            Self::Qwen3Moe => "qwen3moe",
            Self::Gemma3 => "gemma3",
            Self::Phi3 => "phi3",
            Self::DeepseekV2 | Self::DeepseekV3 => "deepseek2",
            Self::GptOss => "gpt-oss",
            Self::Bert | Self::XlmRoberta => "bert",
        }
    }

    /// Sets the family's switches from `config.json` on `c` (which holds the shared shape).
    pub(crate) fn apply_hf(
        self,
        f: &Fields<'_>,
        ctx: &HfContext,
        c: &mut ModelConfig,
    ) -> Result<(), LoadError> {
        match self {
            Self::Llama | Self::Mistral | Self::Mixtral => llama::apply_hf(self, f, ctx, c),
            Self::Qwen2 | Self::Qwen3 | Self::Qwen2Moe | Self::Qwen3Moe => {
                qwen::apply_hf(self, f, c)
            }
            Self::Gemma3 => gemma3::apply_hf(f, ctx, c),
            Self::Phi3 => phi3::apply_hf(f, ctx, c),
            Self::DeepseekV2 | Self::DeepseekV3 => deepseek::apply_hf(self, f, c),
            Self::GptOss => gpt_oss::apply_hf(f, ctx, c),
            Self::Bert | Self::XlmRoberta => bert::apply_hf(self, f, c),
        }
    }

    /// Sets the family's switches from GGUF metadata on `c` (which holds the shared shape).
    pub(crate) fn apply_gguf(self, keys: &Keys<'_>, c: &mut ModelConfig) -> Result<(), LoadError> {
        match self {
            Self::Llama | Self::Mistral | Self::Mixtral => llama::apply_gguf(keys, c),
            Self::Qwen2 | Self::Qwen3 => Ok(()),
            Self::Qwen2Moe | Self::Qwen3Moe => qwen::apply_gguf_moe(self, keys, c),
            Self::Gemma3 => gemma3::apply_gguf(keys, c),
            Self::Phi3 => phi3::apply_gguf(keys, c),
            Self::DeepseekV2 | Self::DeepseekV3 => deepseek::apply_gguf(keys, c),
            Self::GptOss => gpt_oss::apply_gguf(keys, c),
            Self::Bert | Self::XlmRoberta => bert::apply_gguf(keys, c),
        }
    }

    /// The family's Hugging Face name for a layer tensor where it differs from the common one.
    pub(crate) fn hf_layer_leaf(self, t: LayerTensor) -> Option<&'static str> {
        match self {
            Self::Gemma3 => gemma3::hf_layer_leaf(t),
            Self::Mixtral => llama::mixtral_layer_leaf(t),
            Self::DeepseekV2 | Self::DeepseekV3 => deepseek::hf_layer_leaf(t),
            Self::GptOss => gpt_oss::hf_layer_leaf(t),
            _ => None,
        }
    }

    /// The family's Hugging Face name for expert `e`'s `m` of layer `l`, where it differs from
    /// the common `mlp.experts.{e}.{gate,up,down}_proj.weight`.
    pub(crate) fn hf_expert(self, l: usize, m: ExpertMatrix, e: usize) -> Option<String> {
        match self {
            Self::Mixtral => Some(llama::mixtral_expert(l, m, e)),
            _ => None,
        }
    }
}
