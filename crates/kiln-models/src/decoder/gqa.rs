//! Grouped-query attention's projections: `q`, `k`, `v` of each token's normed row, with the
//! biases (Qwen2), per-head RMSNorms (Qwen3, Gemma 3) and rotary embeddings the family has.

use kiln_backend::{Backend, LinearJob};

use super::input_order::InputOrders;
use super::lora::SliceLora;
use super::{DecoderModel, StepBuffers};
use crate::lora::LoraTarget;
use crate::names::{LayerTensor as L, Tensor};
use crate::weights::Weights;
use crate::{LoadError, ModelConfig};

pub(super) struct GqaLayer<B: Backend> {
    /// `[heads · head_dim, hidden]`, `[kv_heads · head_dim, hidden]` twice.
    q_proj: B::Weight,
    k_proj: B::Weight,
    v_proj: B::Weight,
    q_bias: Option<B::Vector>,
    k_bias: Option<B::Vector>,
    v_bias: Option<B::Vector>,
    /// `[head_dim]` each.
    q_norm: Option<B::Vector>,
    k_norm: Option<B::Vector>,
    /// The input orders of q, k and v ([`super::input_order`]).
    orders: InputOrders<3>,
    /// `[num_heads]` the attention sinks (gpt-oss).
    sinks: Option<B::Vector>,
}

/// A norm weight loader: the tensor when `present` (offset folded in), else `None`.
type OptNorm<'f, B> =
    dyn Fn(Tensor, usize, bool) -> Result<Option<<B as Backend>::Vector>, LoadError> + 'f;

impl<B: Backend> GqaLayer<B> {
    pub(super) fn load(
        w: &Weights<'_, B>,
        l: usize,
        c: &ModelConfig,
        opt_norm: &OptNorm<'_, B>,
    ) -> Result<Self, LoadError> {
        let t = |x: L| Tensor::Layer(l, x);
        let h = c.hidden_size;
        let (q_dim, kv_dim) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let (q_proj, q_order) = w.ordered_matrix(t(L::Q), q_dim, h)?;
        let (k_proj, k_order) = w.ordered_matrix(t(L::K), kv_dim, h)?;
        let (v_proj, v_order) = w.ordered_matrix(t(L::V), kv_dim, h)?;
        Ok(Self {
            q_proj,
            k_proj,
            v_proj,
            orders: InputOrders::new([q_order, k_order, v_order]),
            q_bias: w.optional_vector(t(L::QBias), q_dim, c.qkv_bias)?,
            k_bias: w.optional_vector(t(L::KBias), kv_dim, c.qkv_bias)?,
            v_bias: w.optional_vector(t(L::VBias), kv_dim, c.qkv_bias)?,
            q_norm: opt_norm(t(L::QNorm), c.head_dim, c.qk_norm)?,
            k_norm: opt_norm(t(L::KNorm), c.head_dim, c.qk_norm)?,
            sinks: w.optional_vector(t(L::Sinks), c.num_heads, c.attention_sinks)?,
        })
    }

    /// The attention sinks, if the layer has them.
    pub(super) fn sinks(&self) -> Option<&B::Vector> {
        self.sinks.as_ref()
    }

    /// The widest permuted input of q, k and v (0 without act-order matrices).
    pub(super) fn permuted_width(&self) -> usize {
        self.orders.width()
    }

    /// q, k and v.
    pub(super) fn matrices(&self) -> [&B::Weight; 3] {
        [&self.q_proj, &self.k_proj, &self.v_proj]
    }

    /// `q, k, v` of token rows `r` of `normed`: projections, the per-head norms and rotary
    /// embeddings by `rope` with the tokens' angles (`[t, rot]`, the local table when `local`).
    pub(super) fn qkv(
        &self,
        be: &B,
        c: &ModelConfig,
        b: &mut StepBuffers<'_, B>,
        r: &std::ops::Range<usize>,
        (rope, local): (&B::Rope, bool),
        lora: Option<&SliceLora<'_, B>>,
    ) {
        let rows = DecoderModel::<B>::rows;
        let (h, q_dim, kv_dim) =
            (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let (qr, kr) = (rows(r, q_dim), rows(r, kv_dim));
        let x = B::view(b.normed, rows(r, h));
        self.orders.linear(
            be,
            (x, r.len()),
            b.permuted,
            &mut [
                LinearJob {
                    weight: &self.q_proj,
                    bias: self.q_bias.as_ref(),
                    out: B::view_mut(b.q, qr.clone()),
                },
                LinearJob {
                    weight: &self.k_proj,
                    bias: self.k_bias.as_ref(),
                    out: B::view_mut(b.k, kr.clone()),
                },
                LinearJob {
                    weight: &self.v_proj,
                    bias: self.v_bias.as_ref(),
                    out: B::view_mut(b.v, kr.clone()),
                },
            ],
        );
        if let Some(lora) = lora {
            let x = (B::view(b.normed, rows(r, h)), h);
            lora.apply(be, LoraTarget::Q, x, (B::view_mut(b.q, qr.clone()), q_dim));
            lora.apply(be, LoraTarget::K, x, (B::view_mut(b.k, kr.clone()), kv_dim));
            lora.apply(be, LoraTarget::V, x, (B::view_mut(b.v, kr.clone()), kv_dim));
        }
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            be.rms_norm_inplace(B::view_mut(b.q, qr.clone()), qn, c.rms_norm_eps);
            be.rms_norm_inplace(B::view_mut(b.k, kr.clone()), kn, c.rms_norm_eps);
        }
        let table = if local { &*b.local_angles } else { &*b.angles };
        let angles = B::view(table, rows(r, c.rotary_dim));
        be.rope_apply(rope, B::view_mut(b.q, qr), c.num_heads, angles);
        be.rope_apply(rope, B::view_mut(b.k, kr), c.num_kv_heads, angles);
    }
}
