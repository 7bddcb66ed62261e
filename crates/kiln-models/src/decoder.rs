//! The decoder-only transformer of every supported family: Llama 2/3, Mistral (sliding
//! window), Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), Qwen3-MoE (Qwen3 with a mixture of experts
//! as the MLP, `moe`), Gemma 3 (q/k RMSNorm, sandwich norms, GeLU-tanh MLP, scaled embeddings,
//! sliding-window layers with their own RoPE base), Phi-3, DeepSeek V2/V3 (multi-head latent
//! attention, `mla`, and experts with shared ones) and gpt-oss (attention sinks, biased
//! experts), with grouped-query (`gqa`) or latent attention and optionally tied embeddings,
//! from safetensors or GGUF weights.
//!
//! Per layer: `h += [norm](o_proj(attn(rope(q), rope(k), v)))` over `rmsnorm(h)`, then
//! `h += [norm](down(act(gate(x)) * up(x)))` over `rmsnorm(h)`, where the bracketed output
//! norms exist only with sandwich norms. Only rows that need logits go through the final norm
//! and the LM head, and the last layer already carries only those rows past its K/V: its
//! attention, output projection and MLP run for them alone (a prefill chunk that needs no
//! logits stops at the last layer's K/V). Each of those rows is computed exactly as in the
//! full step (attention of a row depends on its position and the cache only), so the logits
//! are bit for bit the same.
//!
//! Everything but attention works on each token's row alone, so a step runs it in slices of
//! at most 512 tokens (attention sees the whole step) and fuses each residual add with the
//! norms around it; neither changes a bit of any row. The rotary angles are computed once per
//! step and shared by every layer.

use std::sync::Arc;

use kiln_backend::{
    AttentionShape, Backend, ExpertRouting, ForwardBatch, ForwardError, KvLayout, LinearJob,
    Logits, RopeConfig, RopeScaling, SeqSpan, TreeMask, Workspace,
};

use crate::model::Model;
use crate::names::{LayerTensor as L, Tensor};
use crate::weights::Weights;
use crate::{LoadError, ModelConfig};

mod gqa;
mod input_order;
mod lora;
mod mla;
mod mlp;
mod moe;

use gqa::GqaLayer;
use input_order::InputOrders;
use lora::{AdapterRuns, BoundAdapter, SliceLora};
use mla::MlaLayer;
use mlp::{Mlp, MlpIo};

use crate::lora::{LoraAdapter, LoraTarget};

/// A layer's attention projections.
enum Attn<B: Backend> {
    /// Grouped-query attention: q/k/v projections.
    Gqa(GqaLayer<B>),
    /// Multi-head latent attention (DeepSeek).
    Latent(MlaLayer<B>),
}

struct Layer<B: Backend> {
    attn_norm: B::Vector,
    attn: Attn<B>,
    o_proj: B::Weight,
    o_bias: Option<B::Vector>,
    attn_out_norm: Option<B::Vector>,
    mlp_norm: B::Vector,
    mlp_out_norm: Option<B::Vector>,
    mlp: Mlp<B>,
    /// Sliding-window layers use the local RoPE when the model has one.
    local_rope: bool,
    /// The input order of o ([`input_order`]).
    o_order: InputOrders<1>,
}

pub struct DecoderModel<B: Backend> {
    backend: Arc<B>,
    config: ModelConfig,
    embed_tokens: B::Weight,
    layers: Vec<Layer<B>>,
    final_norm: B::Vector,
    /// `None` when tied to `embed_tokens` or not loaded.
    lm_head: Option<B::Weight>,
    /// Whether logits can be computed: `false` for a model loaded for pooling (its steps hand
    /// back final hidden states; no LM head is read).
    has_head: bool,
    rope: B::Rope,
    /// RoPE of sliding-window layers when their base differs (Gemma 3).
    local_rope: Option<B::Rope>,
    /// The widest permuted input of any matrix (0 without act-order matrices).
    permuted_width: usize,
    /// LoRA adapters by slot: `adapters[s - 1]` is slot `s`'s (slot 0 is the base alone).
    adapters: Vec<Option<BoundAdapter<B>>>,
}

/// The step's buffers, each at least as long as the step needs.
struct StepBuffers<'a, B: Backend> {
    /// `[t, h]` the residual stream, `[t, h]` its normed form.
    hidden: &'a mut B::Buffer,
    normed: &'a mut B::Buffer,
    /// `[t, q_dim]`, `[t, kv_dim]`, `[t, kv_dim]`, `[t, q_dim]` attention output.
    q: &'a mut B::Buffer,
    k: &'a mut B::Buffer,
    v: &'a mut B::Buffer,
    attn: &'a mut B::Buffer,
    /// `[t, h]` a sublayer's output.
    proj: &'a mut B::Buffer,
    /// `[min(t, SLICE_TOKENS), intermediate]` each; with experts, at least
    /// `[min(t, SLICE_TOKENS) · k, expert intermediate]` and `[min(t, SLICE_TOKENS), shared
    /// expert intermediate]`.
    gate: &'a mut B::Buffer,
    up: &'a mut B::Buffer,
    /// `[min(t, SLICE_TOKENS) · k, h]` each with experts (else empty): the picked rows, and
    /// their experts' outputs (`k + 1` rows a token with a shared expert).
    picked: &'a mut B::Buffer,
    picked_out: &'a mut B::Buffer,
    /// `[min(t, SLICE_TOKENS), permuted_width]` a permuted input (empty without one).
    permuted: &'a mut B::Buffer,
    /// The experts' host routing, taken from the workspace for the step.
    routing: ExpertRouting,
    /// `[num_rows, h]` the logits rows, gathered and normed.
    rows: &'a mut B::Buffer,
    rows_normed: &'a mut B::Buffer,
    /// `[t, rotary_dim]` the step's angles, and the same for the local RoPE (empty without one).
    angles: &'a mut B::Buffer,
    local_angles: &'a mut B::Buffer,
}

impl<B: Backend> DecoderModel<B> {
    pub(crate) fn load(
        config: ModelConfig,
        w: &Weights<'_, B>,
        backend: Arc<B>,
        with_head: bool,
    ) -> Result<Self, LoadError> {
        let c = &config;
        if !with_head && !backend.supports_pooling() {
            return Err(LoadError::Backend {
                name: "pooling".into(),
                message: format!("the {} backend does not hand hidden states back", backend.name()),
            });
        }
        let h = c.hidden_size;
        // RMSNorm weights, with the offset of (1 + w) norms folded in.
        let norm = |t: Tensor, len: usize| -> Result<B::Vector, LoadError> {
            let mut v = w.source.vector(&w.naming.name(t), len)?;
            if c.norm_weight_offset != 0.0 {
                for x in &mut v {
                    *x += c.norm_weight_offset;
                }
            }
            w.load_vector(t, &v)
        };
        let opt_norm = |t: Tensor, len: usize, present: bool| {
            if present { norm(t, len).map(Some) } else { Ok(None) }
        };
        if c.mla.is_some() && !backend.supports_latent_attention() {
            return Err(LoadError::Backend {
                name: "latent attention".into(),
                message: format!("the {} backend does not run latent attention", backend.name()),
            });
        }
        if c.attention_sinks && !backend.supports_attention_sinks() {
            return Err(LoadError::Backend {
                name: "attention sinks".into(),
                message: format!("the {} backend does not run attention sinks", backend.name()),
            });
        }
        if c.moe.is_some() && !backend.supports_experts() {
            return Err(LoadError::Backend {
                name: "mixture of experts".into(),
                message: format!("the {} backend does not run expert layers", backend.name()),
            });
        }
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let t = |x: L| Tensor::Layer(l, x);
            let sandwich = c.sandwich_norms;
            let (attn, o_width) = if let Some(mla) = c.mla {
                let width = c.num_heads * mla.v_head_dim;
                (Attn::Latent(MlaLayer::load(w, l, h, mla, c.num_heads)?), width)
            } else {
                (Attn::Gqa(GqaLayer::load(w, l, c, &opt_norm)?), c.num_heads * c.head_dim)
            };
            let (o_proj, o_order) = w.ordered_matrix(t(L::O), h, o_width)?;
            layers.push(Layer {
                attn_norm: norm(t(L::AttnNorm), h)?,
                attn,
                o_proj,
                o_order: InputOrders::new([o_order]),
                o_bias: w.optional_vector(t(L::OBias), h, c.o_bias)?,
                attn_out_norm: opt_norm(t(L::AttnOutNorm), h, sandwich)?,
                mlp_norm: norm(t(L::MlpNorm), h)?,
                mlp_out_norm: opt_norm(t(L::MlpOutNorm), h, sandwich)?,
                mlp: match c.layer_experts(l) {
                    Some(moe) => Mlp::load_moe(w, l, h, moe, c.hidden_act)?,
                    None => {
                        Mlp::load_dense(w, l, (h, c.intermediate_size), c.mlp_bias, c.hidden_act)?
                    }
                },
                local_rope: c.layer_window(l).is_some() && c.rope_local_theta.is_some(),
            });
        }
        let embed_tokens = w.matrix(Tensor::Embed, c.vocab_size, h)?;
        let lm_head = if !with_head || (c.tie_word_embeddings && !w.contains(Tensor::LmHead)) {
            None
        } else {
            Some(w.matrix(Tensor::LmHead, c.vocab_size, h)?)
        };
        let (rope, local_rope) = Self::load_ropes(c, &backend)?;
        let permuted_width = layers
            .iter()
            .map(|l| {
                let qkv = match &l.attn {
                    Attn::Gqa(g) => g.permuted_width(),
                    Attn::Latent(_) => 0,
                };
                qkv.max(l.o_order.width()).max(l.mlp.permuted_width())
            })
            .max()
            .unwrap_or(0);
        Ok(Self {
            permuted_width,
            adapters: Vec::new(),
            embed_tokens,
            layers,
            final_norm: norm(Tensor::FinalNorm, h)?,
            lm_head,
            has_head: with_head,
            rope,
            local_rope,
            config,
            backend,
        })
    }

    /// The RoPE tables: the model's, and sliding-window layers' when their base differs.
    fn load_ropes(c: &ModelConfig, backend: &B) -> Result<(B::Rope, Option<B::Rope>), LoadError> {
        let rope_err = |e: kiln_backend::LoadTensorError| LoadError::Backend {
            name: "rotary embeddings".into(),
            message: e.to_string(),
        };
        let global = RopeConfig {
            base: c.rope_theta,
            rotary_dim: c.rotary_dim,
            scaling: c.rope_scaling,
            style: c.rope_style,
            freq_factors: c.rope_freq_factors.clone(),
            mscale: c.rope_mscale,
        };
        let rope = backend.load_rope(&global).map_err(rope_err)?;
        let local_rope = match c.rope_local_theta {
            Some(base) => {
                let local = RopeConfig {
                    base,
                    scaling: RopeScaling::None,
                    freq_factors: None,
                    mscale: 1.0,
                    ..global
                };
                Some(backend.load_rope(&local).map_err(rope_err)?)
            }
            None => None,
        };
        Ok((rope, local_rope))
    }

    /// The cache must match the model, the batch must be valid for both.
    fn check_batch(&self, batch: &ForwardBatch, kv: &B::KvStore) -> Result<(), ForwardError> {
        let c = &self.config;
        crate::model::check_cache_and_batch(self, batch, kv)?;
        if !batch.hidden_output() && !self.has_head {
            return Err(ForwardError::Batch(
                "the model was loaded for pooling (no LM head): its steps give hidden states"
                    .into(),
            ));
        }
        if batch.tree_mask().is_some() && !self.backend.supports_token_trees() {
            return Err(ForwardError::Batch(format!(
                "the {} backend does not run token trees",
                self.backend.name()
            )));
        }
        for l in 0..c.num_layers {
            self.attention_shape(batch.block_size(), l)
                .validate()
                .map_err(ForwardError::KvLayout)?;
        }
        Ok(())
    }

    /// Rows `r` of `n`-wide buffers as a range of elements.
    fn rows(r: &std::ops::Range<usize>, n: usize) -> std::ops::Range<usize> {
        r.start * n..r.end * n
    }

    /// The rest of layer `l` for token rows `r` once attention is done: `hidden += [norm](o_proj
    /// (attn))`, then `hidden += [norm](mlp(rmsnorm(hidden)))`, leaving the next layer's input
    /// norm of `hidden` in `normed`.
    fn attn_out_and_mlp(
        &self,
        l: usize,
        b: &mut StepBuffers<'_, B>,
        r: &std::ops::Range<usize>,
        lora: Option<&SliceLora<'_, B>>,
    ) {
        let c = &self.config;
        let be = &*self.backend;
        let (h, eps, layer) = (c.hidden_size, c.rms_norm_eps, &self.layers[l]);
        let (n, hr) = (r.len(), Self::rows(r, h));
        // The output projection's input: the attention rows, or latent attention's values.
        let (src, width): (&B::Buffer, usize) = match &layer.attn {
            Attn::Gqa(_) => (&*b.attn, c.num_heads * c.head_dim),
            Attn::Latent(mla) => {
                mla.values(be, b, r);
                (&*b.q, c.num_heads * c.mla.map_or(0, |m| m.v_head_dim))
            }
        };
        let o = LinearJob {
            weight: &layer.o_proj,
            bias: layer.o_bias.as_ref(),
            out: B::view_mut(b.proj, hr.clone()),
        };
        let x = B::view(src, Self::rows(r, width));
        layer.o_order.linear(be, (x, n), b.permuted, &mut [o]);
        if let Some(lora) = lora {
            lora.apply(be, LoraTarget::O, (x, width), (B::view_mut(b.proj, hr.clone()), h));
        }
        be.residual_norm(
            h,
            B::view_mut(b.proj, hr.clone()),
            layer.attn_out_norm.as_ref(),
            B::view_mut(b.hidden, hr.clone()),
            Some((&layer.mlp_norm, B::view_mut(b.normed, hr.clone()))),
            eps,
        );
        let io = MlpIo {
            n,
            input: B::view(b.normed, hr.clone()),
            out: B::view_mut(b.proj, hr.clone()),
            gate: &mut *b.gate,
            up: &mut *b.up,
            picked: &mut *b.picked,
            picked_out: &mut *b.picked_out,
            permuted: &mut *b.permuted,
            routing: &mut b.routing,
            lora,
        };
        layer.mlp.forward(be, io);
        let next =
            self.layers.get(l + 1).map(|next| (&next.attn_norm, B::view_mut(b.normed, hr.clone())));
        be.residual_norm(
            h,
            B::view_mut(b.proj, hr.clone()),
            layer.mlp_out_norm.as_ref(),
            B::view_mut(b.hidden, hr),
            next,
            eps,
        );
    }

    /// The logits of the rows that need them: rows `gather` of `hidden`, or (`None`) its first
    /// `num_rows` rows, already compacted. Final norm, LM head, final soft cap; with `hidden`,
    /// the normed rows themselves (a pooling step).
    fn logits(
        &self,
        b: &mut StepBuffers<'_, B>,
        (t, num_rows): (usize, usize),
        gather: Option<&[usize]>,
        hidden: bool,
        logits: &mut Logits,
    ) {
        let c = &self.config;
        let be = &*self.backend;
        let h = c.hidden_size;
        let rows = 0..num_rows * h;
        let src: &B::Buffer = match gather {
            Some(gather) => {
                be.gather_rows(
                    B::view(b.hidden, 0..t * h),
                    h,
                    gather,
                    B::view_mut(b.rows, rows.clone()),
                );
                &*b.rows
            }
            None => &*b.hidden,
        };
        be.rms_norm(
            B::view(src, rows.clone()),
            &self.final_norm,
            c.rms_norm_eps,
            B::view_mut(b.rows_normed, rows.clone()),
        );
        if hidden {
            be.rows_to_host(B::view(b.rows_normed, rows), num_rows, h, logits);
            return;
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        be.logits(B::view(b.rows_normed, rows), num_rows, head, c.final_logit_softcap, logits);
    }

    fn attention_shape(&self, block_size: usize, layer: usize) -> AttentionShape {
        let c = &self.config;
        AttentionShape {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size,
            scale: c.attention_scale,
            sliding_window: c.layer_window(layer),
            causal: true,
            softcap: c.attn_logit_softcap,
        }
    }
}

/// Most tokens a layer's per-token work (norms, projections, MLP) takes at once. A big step
/// (a prefill of 2,048 tokens) goes through each layer in slices, so that each slice's
/// intermediates (the MLP's `[n, intermediate]` pair above all) stay in cache between one
/// operation and the next; attention still sees the whole step. Every one of those operations
/// computes each token's row on its own, so slicing never changes a bit of the output.
const SLICE_TOKENS: usize = 512;

/// `0..t` cut into the fewest slices of at most [`SLICE_TOKENS`], of nearly equal sizes
/// (multiples of 16, the AMX tile height, except the last).
fn token_slices(t: usize) -> impl Iterator<Item = std::ops::Range<usize>> + Clone {
    let n = t.div_ceil(SLICE_TOKENS).max(1);
    let size = t.div_ceil(n).next_multiple_of(16).min(SLICE_TOKENS);
    (0..t).step_by(size.max(1)).map(move |s| s..(s + size).min(t))
}

impl<B: Backend> Model<B> for DecoderModel<B> {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn backend(&self) -> &B {
        &self.backend
    }

    fn kv_layout(&self) -> KvLayout {
        KvLayout {
            num_layers: self.config.num_layers,
            num_kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            values_from_keys: self.config.mla.is_some(),
        }
    }

    fn weight_bytes(&self) -> usize {
        self.matrix_bytes(Mlp::matrices)
    }

    fn active_weight_bytes(&self) -> usize {
        self.matrix_bytes(Mlp::active_matrices)
    }

    fn set_adapter(&mut self, slot: u32, adapter: Option<&LoraAdapter>) -> Result<(), LoadError> {
        let index = (slot as usize).checked_sub(1).ok_or_else(|| LoadError::Backend {
            name: "LoRA adapter".into(),
            message: "slot 0 is the base model and holds no adapter".into(),
        })?;
        let bound = match adapter {
            None => None,
            Some(adapter) => {
                if !self.backend.supports_lora() {
                    return Err(LoadError::Backend {
                        name: "LoRA adapter".into(),
                        message: format!(
                            "the {} backend does not run LoRA adapters",
                            self.backend.name()
                        ),
                    });
                }
                if self.config.mla.is_some() {
                    return Err(LoadError::Backend {
                        name: "LoRA adapter".into(),
                        message: "LoRA adapters on latent attention (DeepSeek) are not supported"
                            .into(),
                    });
                }
                if adapter.num_layers() != self.config.num_layers {
                    return Err(LoadError::Backend {
                        name: "LoRA adapter".into(),
                        message: format!(
                            "the adapter has {} layers, the model {}",
                            adapter.num_layers(),
                            self.config.num_layers
                        ),
                    });
                }
                Some(BoundAdapter::bind(&*self.backend, adapter)?)
            }
        };
        if self.adapters.len() <= index {
            self.adapters.resize_with(index + 1, || None);
        }
        self.adapters[index] = bound;
        Ok(())
    }

    fn forward(
        &self,
        batch: &ForwardBatch,
        kv: &mut B::KvStore,
        workspace: &mut Workspace<B>,
        logits: &mut Logits,
    ) -> Result<(), ForwardError> {
        self.check_batch(batch, kv)?;
        let runs = AdapterRuns::of(batch, &self.adapters)?;
        let mut row_seqs = std::mem::take(&mut workspace.row_seqs);
        let mut row_trees = std::mem::take(&mut workspace.row_trees);
        let mut b = self.step_buffers(workspace, batch);
        self.embed_and_angles(batch, &mut b);
        // Whether the last layer carries only the logits rows (compacted to rows 0..num_rows
        // of `q` and `hidden`) past its K/V.
        let (t, num_rows) = (batch.num_tokens(), batch.logits_rows().len());
        let prune = num_rows < t;
        let tree = batch.tree_mask();
        if prune {
            single_query_seqs(batch, &mut row_seqs);
            row_trees.clear();
            if let Some(tree) = tree {
                row_trees.extend(batch.logits_rows().iter().map(|&r| tree.rows[r]));
            }
        }
        for l in 0..self.layers.len() {
            let last_pruned = prune && l + 1 == self.layers.len();
            let pruned = last_pruned.then(|| {
                let tree = tree.map(|t| TreeMask { rows: &row_trees, slots: t.slots });
                (&row_seqs[..], tree)
            });
            self.layer(l, batch, kv, &mut b, pruned, &runs);
        }
        let gather = (!prune).then_some(batch.logits_rows());
        self.logits(&mut b, (t, num_rows), gather, batch.hidden_output(), logits);
        let routing = std::mem::take(&mut b.routing);
        workspace.routing = routing;
        workspace.row_seqs = row_seqs;
        workspace.row_trees = row_trees;
        Ok(())
    }
}

impl<B: Backend> DecoderModel<B> {
    /// Bytes of the layers' matrices, with `mlp` choosing each MLP's, and of the LM head.
    fn matrix_bytes(&self, mlp: fn(&Mlp<B>) -> Vec<&B::Weight>) -> usize {
        let be = &*self.backend;
        let layer_bytes: usize = self
            .layers
            .iter()
            .map(|l| {
                let attn = match &l.attn {
                    Attn::Gqa(g) => g.matrices().to_vec(),
                    Attn::Latent(m) => m.matrices(),
                };
                let o = std::iter::once(&l.o_proj);
                attn.into_iter()
                    .chain(o)
                    .chain(mlp(&l.mlp))
                    .map(|w| be.weight_bytes(w))
                    .sum::<usize>()
            })
            .sum();
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        layer_bytes + if self.has_head { be.weight_bytes(head) } else { 0 }
    }

    /// The step's buffers, grown to its token count.
    fn step_buffers<'w>(
        &self,
        workspace: &'w mut Workspace<B>,
        batch: &ForwardBatch,
    ) -> StepBuffers<'w, B> {
        let c = &self.config;
        let (t, num_rows) = (batch.num_tokens(), batch.logits_rows().len());
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let q_dim = c.num_heads * c.head_dim;
        let kv_dim = c.num_kv_heads * c.head_dim;
        let local_rot = self.local_rope.as_ref().map_or(0, |_| c.rotary_dim);
        let slice = t.min(SLICE_TOKENS);
        // The picked rows, the gate/up rows the experts need (the shared expert's too), and
        // the picks' outputs (plus the shared expert's rows).
        let (picks, expert_gate, outs) = c.moe.as_ref().map_or((0, 0, 0), |m| {
            let picks = slice * m.experts_per_token;
            let shared = m.shared_expert_intermediate_size.map_or(0, |si| slice * si);
            let outs = picks + if shared > 0 { slice } else { 0 };
            (picks, (picks * m.expert_intermediate_size).max(shared), outs)
        });
        // Latent attention's per-slice scratch ([`mla::scratch_widths`]), and its values
        // (`[t, heads · v_head]`) written over `q`.
        let [raw_q, low_q, head_in, head_out] =
            c.mla.map_or([0; 4], |m| mla::scratch_widths(&m, c.num_heads).map(|w| w * slice));
        let q_len = t * q_dim.max(c.mla.map_or(0, |m| c.num_heads * m.v_head_dim));
        let lens = [
            t * h,
            t * h,
            q_len,
            t * kv_dim,
            t * kv_dim,
            t * q_dim,
            t * h,
            (slice * i).max(expert_gate).max(raw_q),
            (slice * i).max(expert_gate).max(low_q),
            (picks * h).max(head_in),
            (outs * h).max(head_out),
            num_rows * h,
            num_rows * h,
            t * c.rotary_dim,
            t * local_rot,
            slice * self.permuted_width,
        ];
        let routing = std::mem::take(&mut workspace.routing);
        let [
            hidden,
            normed,
            q,
            k,
            v,
            attn,
            proj,
            gate,
            up,
            picked,
            picked_out,
            rows,
            rows_normed,
            angles,
            local,
            permuted,
        ] = workspace.take(&*self.backend, lens);
        StepBuffers {
            hidden,
            normed,
            q,
            k,
            v,
            attn,
            proj,
            gate,
            up,
            picked,
            picked_out,
            permuted,
            routing,
            rows,
            rows_normed,
            angles,
            local_angles: local,
        }
    }

    /// The step's rotary angles (shared by every layer), the embeddings, and the first layer's
    /// input norm (later layers' come with the previous layer's last residual add).
    fn embed_and_angles(&self, batch: &ForwardBatch, b: &mut StepBuffers<'_, B>) {
        let c = &self.config;
        let be = &*self.backend;
        let (t, h, rot) = (batch.num_tokens(), c.hidden_size, c.rotary_dim);
        be.rope_table(&self.rope, batch.positions(), B::view_mut(b.angles, 0..t * rot));
        if let Some(local) = &self.local_rope {
            be.rope_table(local, batch.positions(), B::view_mut(b.local_angles, 0..t * rot));
        }
        let hidden = B::view_mut(b.hidden, 0..t * h);
        be.embed(&self.embed_tokens, batch.token_ids(), c.embedding_scale, hidden);
        if let Some(first) = self.layers.first() {
            let (x, out) = (B::view(b.hidden, 0..t * h), B::view_mut(b.normed, 0..t * h));
            be.rms_norm(x, &first.attn_norm, c.rms_norm_eps, out);
        }
    }

    /// Layer `l` over the step: q/k/v per slice, the K/V write, attention over the whole step,
    /// then per slice the rest. With `pruned` (the last layer, when not every row needs
    /// logits), attention and everything after it run for the logits rows only, compacted to
    /// the first rows, as single-query sequences `pruned` (with their tree keys, if any).
    fn layer(
        &self,
        l: usize,
        batch: &ForwardBatch,
        kv: &mut B::KvStore,
        b: &mut StepBuffers<'_, B>,
        pruned: Option<(&[SeqSpan], Option<TreeMask<'_>>)>,
        runs: &AdapterRuns,
    ) {
        let c = &self.config;
        let be = &*self.backend;
        let layer = &self.layers[l];
        let lora = |is_pruned: bool, r: &std::ops::Range<usize>| {
            if runs.is_empty() { None } else { runs.slice(is_pruned, r, &self.adapters, l) }
        };
        let t = batch.num_tokens();
        let (h, q_dim) = (c.hidden_size, c.num_heads * c.head_dim);
        let kv_dim = c.num_kv_heads * c.head_dim;
        let rope = match (&self.local_rope, layer.local_rope) {
            (Some(local), true) => (local, true),
            _ => (&self.rope, false),
        };
        for r in token_slices(t) {
            match &layer.attn {
                Attn::Gqa(gqa) => gqa.qkv(be, c, b, &r, rope, lora(false, &r).as_ref()),
                Attn::Latent(mla) => mla.query_and_key(be, b, &r, (rope.0, h)),
            }
        }
        // Latent attention's cache has no values: its keys go for both.
        let values = if matches!(layer.attn, Attn::Latent(_)) { &*b.k } else { &*b.v };
        let (k, v) = (B::view(b.k, 0..t * kv_dim), B::view(values, 0..t * kv_dim));
        be.write_kv(kv, l, k, v, batch.slot_mapping());
        let (seqs, tree, rows_on) = match pruned {
            Some((row_seqs, row_tree)) => {
                let rows = batch.logits_rows();
                be.compact_rows(B::view_mut(b.q, 0..t * q_dim), q_dim, rows);
                be.compact_rows(B::view_mut(b.hidden, 0..t * h), h, rows);
                (row_seqs, row_tree, rows.len())
            }
            None => (batch.seqs(), batch.tree_mask(), t),
        };
        if !seqs.is_empty() {
            let shape = self.attention_shape(batch.block_size(), l);
            let q = B::view(b.q, 0..rows_on * q_dim);
            let out = B::view_mut(b.attn, 0..rows_on * q_dim);
            let sinks = match &layer.attn {
                Attn::Gqa(g) => g.sinks(),
                Attn::Latent(_) => None,
            };
            be.paged_attention(kv, l, q, seqs, batch.block_tables(), (tree, sinks), &shape, out);
        }
        for r in token_slices(rows_on) {
            self.attn_out_and_mlp(l, b, &r, lora(pruned.is_some(), &r).as_ref());
        }
    }
}

/// One attention sequence per logits row of `batch`, in row order: query `i` is the row's
/// token alone at its position, over its sequence's cache (context up to and including it).
fn single_query_seqs(batch: &ForwardBatch, out: &mut Vec<SeqSpan>) {
    out.clear();
    let mut seqs = batch.seqs().iter().peekable();
    for (i, &row) in batch.logits_rows().iter().enumerate() {
        while seqs.peek().is_some_and(|s| s.query_start + s.query_len <= row) {
            seqs.next();
        }
        let Some(seq) = seqs.peek() else { break };
        let first_pos = seq.context_len - seq.query_len;
        out.push(SeqSpan {
            query_start: i,
            query_len: 1,
            context_len: first_pos + (row - seq.query_start) + 1,
            block_table_start: seq.block_table_start,
        });
    }
}
