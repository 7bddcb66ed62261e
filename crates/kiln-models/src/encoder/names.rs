//! An encoder's tensor names: Hugging Face's BERT layout (under the checkpoint's prefix: none
//! for a base model as sentence-transformers saves it, `bert.` / `roberta.` inside a
//! classifier) or llama.cpp's `bert` GGUF names.

use crate::weights::WeightSource;

/// Where an encoder's tensors are stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum EncoderNames {
    /// Hugging Face, every name after `prefix`.
    Hf {
        prefix: String,
    },
    Gguf,
}

/// A tensor of an encoder layer (a linear layer's or a LayerNorm's `.weight` and `.bias`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    Q,
    K,
    V,
    O,
    /// The LayerNorm after attention's residual add.
    AttnNorm,
    Up,
    Down,
    /// The LayerNorm after the MLP's residual add.
    OutNorm,
}

/// Prefixes a Hugging Face encoder's tensors are found under, tried in order.
const HF_PREFIXES: [&str; 3] = ["", "bert.", "roberta."];

impl EncoderNames {
    /// The Hugging Face layout of `source`, its prefix found by its word embeddings.
    pub(crate) fn of_hf(source: &dyn WeightSource) -> Self {
        let prefix = HF_PREFIXES
            .into_iter()
            .find(|p| source.contains(&format!("{p}embeddings.word_embeddings.weight")))
            .unwrap_or("");
        Self::Hf { prefix: prefix.to_string() }
    }

    pub(crate) fn word(&self) -> String {
        self.embedding("word_embeddings.weight", "token_embd.weight")
    }

    pub(crate) fn position(&self) -> String {
        self.embedding("position_embeddings.weight", "position_embd.weight")
    }

    pub(crate) fn token_types(&self) -> String {
        self.embedding("token_type_embeddings.weight", "token_types.weight")
    }

    /// The embeddings' LayerNorm, without `.weight` / `.bias`.
    pub(crate) fn embed_norm(&self) -> String {
        self.embedding("LayerNorm", "token_embd_norm")
    }

    fn embedding(&self, hf: &str, gguf: &str) -> String {
        match self {
            Self::Hf { prefix } => format!("{prefix}embeddings.{hf}"),
            Self::Gguf => gguf.to_string(),
        }
    }

    /// Layer `l`'s `role`, without `.weight` / `.bias`.
    pub(crate) fn layer(&self, l: usize, role: Role) -> String {
        let (hf, gguf) = match role {
            Role::Q => ("attention.self.query", "attn_q"),
            Role::K => ("attention.self.key", "attn_k"),
            Role::V => ("attention.self.value", "attn_v"),
            Role::O => ("attention.output.dense", "attn_output"),
            Role::AttnNorm => ("attention.output.LayerNorm", "attn_output_norm"),
            Role::Up => ("intermediate.dense", "ffn_up"),
            Role::Down => ("output.dense", "ffn_down"),
            Role::OutNorm => ("output.LayerNorm", "layer_output_norm"),
        };
        match self {
            Self::Hf { prefix } => format!("{prefix}encoder.layer.{l}.{hf}"),
            Self::Gguf => format!("blk.{l}.{gguf}"),
        }
    }
}
