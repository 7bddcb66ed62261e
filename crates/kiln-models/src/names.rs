//! Tensor names of one model across file formats: the decoder asks for a role, the naming of
//! its file answers with the stored name.

use crate::family::Architecture;

/// A tensor of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LayerTensor {
    /// RMSNorm before attention.
    AttnNorm,
    Q,
    K,
    V,
    O,
    QBias,
    KBias,
    VBias,
    OBias,
    QNorm,
    KNorm,
    /// RMSNorm on the attention output (sandwich norms only).
    AttnOutNorm,
    /// RMSNorm before the MLP.
    MlpNorm,
    /// RMSNorm on the MLP output (sandwich norms only).
    MlpOutNorm,
    Gate,
    Up,
    Down,
    GateBias,
    UpBias,
    DownBias,
    /// The mixture-of-experts router, `[num_experts, hidden]`.
    Router,
    /// The shared expert's gated MLP (Qwen2-MoE).
    SharedGate,
    SharedUp,
    SharedDown,
    /// `[1, hidden]` the shared expert's gate: its output is scaled by the sigmoid of this.
    SharedExpertGate,
    /// `[num_experts]` the router's correction bias, added to the scores that choose the
    /// experts (DeepSeek-V3).
    RouterBias,
    /// `[num_experts]` the router's bias, added to its logits (gpt-oss).
    RouterLogitBias,
    /// `[num_heads]` the attention sinks (gpt-oss).
    Sinks,
    /// Latent attention (DeepSeek): `[q_lora_rank, hidden]` the query's down projection, its
    /// RMSNorm, and `[heads · qk_head_dim, q_lora_rank]` its up projection.
    QA,
    QANorm,
    QB,
    /// `[kv_lora_rank + qk_rope_head_dim, hidden]`: the latent and the RoPE key.
    KvA,
    /// RMSNorm of the latent.
    KvANorm,
    /// `[heads · (qk_nope_head_dim + v_head_dim), kv_lora_rank]`: per head, the key's and the
    /// value's up projections of the latent (Hugging Face, older GGUF files).
    KvB,
    /// The same split per head as llama.cpp now writes it: `[heads, kv_lora_rank,
    /// qk_nope_head_dim]` the keys' projections transposed, `[heads, v_head_dim,
    /// kv_lora_rank]` the values'.
    KB,
    VB,
}

/// One of an expert's three matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExpertMatrix {
    Gate,
    Up,
    Down,
}

/// Where an expert's matrix is stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ExpertName {
    /// A tensor of its own (Hugging Face: `mlp.experts.{e}.gate_proj.weight`).
    Own(String),
    /// Slice `e` of one tensor stacking every expert of the layer (`[num_experts, rows, cols]`;
    /// GGUF: `ffn_gate_exps.weight`).
    Stacked(String),
    /// Slice `e` of a stacked tensor holding each expert's matrix transposed (`[num_experts,
    /// cols, rows']`, applied as `x · W`); with `part: Some(p)`, the matrix is every second
    /// column from `p` (gpt-oss's alternating gate and up).
    StackedTransposed { name: String, part: Option<usize> },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tensor {
    Embed,
    FinalNorm,
    LmHead,
    Layer(usize, LayerTensor),
}

/// How a file names its tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Naming {
    /// Hugging Face transformers, with the family's own names where they differ
    /// ([`Architecture::hf_layer_leaf`]).
    Hf(Architecture),
    /// llama.cpp's GGUF names.
    Gguf,
}

impl Naming {
    pub(crate) fn name(self, t: Tensor) -> String {
        use LayerTensor as L;
        match (self, t) {
            (Self::Hf(_), Tensor::Embed) => "model.embed_tokens.weight".into(),
            (Self::Hf(_), Tensor::FinalNorm) => "model.norm.weight".into(),
            (Self::Hf(_), Tensor::LmHead) => "lm_head.weight".into(),
            (Self::Gguf, Tensor::Embed) => "token_embd.weight".into(),
            (Self::Gguf, Tensor::FinalNorm) => "output_norm.weight".into(),
            (Self::Gguf, Tensor::LmHead) => "output.weight".into(),
            (Self::Hf(arch), Tensor::Layer(l, t)) => {
                let leaf = arch.hf_layer_leaf(t).unwrap_or(match t {
                    L::AttnNorm => "input_layernorm.weight",
                    L::Q => "self_attn.q_proj.weight",
                    L::K => "self_attn.k_proj.weight",
                    L::V => "self_attn.v_proj.weight",
                    L::O => "self_attn.o_proj.weight",
                    L::QBias => "self_attn.q_proj.bias",
                    L::KBias => "self_attn.k_proj.bias",
                    L::VBias => "self_attn.v_proj.bias",
                    L::OBias => "self_attn.o_proj.bias",
                    L::QNorm => "self_attn.q_norm.weight",
                    L::KNorm => "self_attn.k_norm.weight",
                    L::AttnOutNorm | L::MlpNorm => "post_attention_layernorm.weight",
                    L::MlpOutNorm => "post_feedforward_layernorm.weight",
                    L::Gate => "mlp.gate_proj.weight",
                    L::Up => "mlp.up_proj.weight",
                    L::Down => "mlp.down_proj.weight",
                    L::GateBias => "mlp.gate_proj.bias",
                    L::UpBias => "mlp.up_proj.bias",
                    L::DownBias => "mlp.down_proj.bias",
                    L::Router => "mlp.gate.weight",
                    L::SharedGate => "mlp.shared_expert.gate_proj.weight",
                    L::SharedUp => "mlp.shared_expert.up_proj.weight",
                    L::SharedDown => "mlp.shared_expert.down_proj.weight",
                    L::SharedExpertGate => "mlp.shared_expert_gate.weight",
                    L::RouterBias => "mlp.gate.e_score_correction_bias",
                    L::RouterLogitBias => "mlp.gate.bias",
                    L::Sinks => "self_attn.sinks",
                    L::QA => "self_attn.q_a_proj.weight",
                    L::QANorm => "self_attn.q_a_layernorm.weight",
                    L::QB => "self_attn.q_b_proj.weight",
                    L::KvA => "self_attn.kv_a_proj_with_mqa.weight",
                    L::KvANorm => "self_attn.kv_a_layernorm.weight",
                    L::KvB => "self_attn.kv_b_proj.weight",
                    L::KB => "self_attn.k_b_proj.weight",
                    L::VB => "self_attn.v_b_proj.weight",
                });
                format!("model.layers.{l}.{leaf}")
            }
            (Self::Gguf, Tensor::Layer(l, t)) => {
                let leaf = match t {
                    L::AttnNorm => "attn_norm.weight",
                    L::Q => "attn_q.weight",
                    L::K => "attn_k.weight",
                    L::V => "attn_v.weight",
                    L::O => "attn_output.weight",
                    L::QBias => "attn_q.bias",
                    L::KBias => "attn_k.bias",
                    L::VBias => "attn_v.bias",
                    L::OBias => "attn_output.bias",
                    L::QNorm => "attn_q_norm.weight",
                    L::KNorm => "attn_k_norm.weight",
                    L::AttnOutNorm => "post_attention_norm.weight",
                    L::MlpNorm => "ffn_norm.weight",
                    L::MlpOutNorm => "post_ffw_norm.weight",
                    L::Gate => "ffn_gate.weight",
                    L::Up => "ffn_up.weight",
                    L::Down => "ffn_down.weight",
                    L::GateBias => "ffn_gate.bias",
                    L::UpBias => "ffn_up.bias",
                    L::DownBias => "ffn_down.bias",
                    L::Router => "ffn_gate_inp.weight",
                    L::SharedGate => "ffn_gate_shexp.weight",
                    L::SharedUp => "ffn_up_shexp.weight",
                    L::SharedDown => "ffn_down_shexp.weight",
                    L::SharedExpertGate => "ffn_gate_inp_shexp.weight",
                    L::RouterBias => "exp_probs_b.bias",
                    L::RouterLogitBias => "ffn_gate_inp.bias",
                    L::Sinks => "attn_sinks.weight",
                    L::QA => "attn_q_a.weight",
                    L::QANorm => "attn_q_a_norm.weight",
                    L::QB => "attn_q_b.weight",
                    L::KvA => "attn_kv_a_mqa.weight",
                    L::KvANorm => "attn_kv_a_norm.weight",
                    L::KvB => "attn_kv_b.weight",
                    L::KB => "attn_k_b.weight",
                    L::VB => "attn_v_b.weight",
                };
                format!("blk.{l}.{leaf}")
            }
        }
    }

    /// Where expert `e`'s `m` of layer `l` is stored.
    pub(crate) fn expert(self, l: usize, m: ExpertMatrix, e: usize) -> ExpertName {
        let (hf, gguf) = match m {
            ExpertMatrix::Gate => ("gate_proj", "ffn_gate_exps"),
            ExpertMatrix::Up => ("up_proj", "ffn_up_exps"),
            ExpertMatrix::Down => ("down_proj", "ffn_down_exps"),
        };
        match self {
            Self::Hf(Architecture::GptOss) => crate::family::gpt_oss::hf_expert(l, m),
            Self::Hf(arch) => ExpertName::Own(
                arch.hf_expert(l, m, e)
                    .unwrap_or_else(|| format!("model.layers.{l}.mlp.experts.{e}.{hf}.weight")),
            ),
            Self::Gguf => ExpertName::Stacked(format!("blk.{l}.{gguf}.weight")),
        }
    }

    /// Where the biases of every expert's `m` of layer `l` lie (gpt-oss): a `[num_experts,
    /// width]` tensor, and with `Some(p)` every second column from `p` of it.
    pub(crate) fn expert_bias(self, l: usize, m: ExpertMatrix) -> (String, Option<usize>) {
        match self {
            Self::Hf(_) => crate::family::gpt_oss::hf_expert_bias(l, m),
            Self::Gguf => {
                let gguf = match m {
                    ExpertMatrix::Gate => "ffn_gate_exps",
                    ExpertMatrix::Up => "ffn_up_exps",
                    ExpertMatrix::Down => "ffn_down_exps",
                };
                (format!("blk.{l}.{gguf}.bias"), None)
            }
        }
    }
}
