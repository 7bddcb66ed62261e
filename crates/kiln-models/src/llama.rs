//! The Llama family: Llama 2/3, Mistral (sliding window), Qwen2 (q/k/v bias) and Qwen3 (q/k
//! RMSNorm), with grouped-query attention and optionally tied embeddings.
//!
//! Per layer: `h += o_proj(attn(rope(q), rope(k), v))` over `rmsnorm(h)`, then
//! `h += down(act(gate(x)) * up(x))` over `rmsnorm(h)`. Only rows that need logits go through
//! the final norm and the LM head.

use kiln_kernels::activation::{GateActivation, gated_act_inplace};
use kiln_kernels::attention::{AttentionShape, paged_attention, write_kv};
use kiln_kernels::norm::{rms_norm, rms_norm_inplace};
use kiln_kernels::rope::{Rope, RopeStyle};
use kiln_kernels::{LinearJob, ThreadPool, WeightMatrix, linear, linear_multi};

use crate::model::{ForwardScratch, Logits, Model};
use crate::{
    ForwardBatch, ForwardError, KvLayout, LoadError, ModelConfig, PagedKvCache, WeightStore,
};

struct Layer {
    input_norm: Vec<f32>,
    q_proj: WeightMatrix,
    k_proj: WeightMatrix,
    v_proj: WeightMatrix,
    o_proj: WeightMatrix,
    q_bias: Option<Vec<f32>>,
    k_bias: Option<Vec<f32>>,
    v_bias: Option<Vec<f32>>,
    o_bias: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    post_attention_norm: Vec<f32>,
    gate_proj: WeightMatrix,
    up_proj: WeightMatrix,
    down_proj: WeightMatrix,
    gate_bias: Option<Vec<f32>>,
    up_bias: Option<Vec<f32>>,
    down_bias: Option<Vec<f32>>,
}

pub struct LlamaModel {
    config: ModelConfig,
    embed_tokens: WeightMatrix,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    /// `None` when tied to `embed_tokens`.
    lm_head: Option<WeightMatrix>,
    rope: Rope,
}

impl LlamaModel {
    pub fn load(config: ModelConfig, store: &WeightStore) -> Result<Self, LoadError> {
        let c = &config;
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let q_dim = c.num_heads * c.head_dim;
        let kv_dim = c.num_kv_heads * c.head_dim;
        let opt =
            |name: String, len: usize, present: bool| -> Result<Option<Vec<f32>>, LoadError> {
                if present { store.vector(&name, len).map(Some) } else { Ok(None) }
            };
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let p = format!("model.layers.{l}");
            layers.push(Layer {
                input_norm: store.vector(&format!("{p}.input_layernorm.weight"), h)?,
                q_proj: store.matrix(&format!("{p}.self_attn.q_proj.weight"), q_dim, h)?,
                k_proj: store.matrix(&format!("{p}.self_attn.k_proj.weight"), kv_dim, h)?,
                v_proj: store.matrix(&format!("{p}.self_attn.v_proj.weight"), kv_dim, h)?,
                o_proj: store.matrix(&format!("{p}.self_attn.o_proj.weight"), h, q_dim)?,
                q_bias: opt(format!("{p}.self_attn.q_proj.bias"), q_dim, c.qkv_bias)?,
                k_bias: opt(format!("{p}.self_attn.k_proj.bias"), kv_dim, c.qkv_bias)?,
                v_bias: opt(format!("{p}.self_attn.v_proj.bias"), kv_dim, c.qkv_bias)?,
                o_bias: opt(format!("{p}.self_attn.o_proj.bias"), h, c.o_bias)?,
                q_norm: opt(format!("{p}.self_attn.q_norm.weight"), c.head_dim, c.qk_norm)?,
                k_norm: opt(format!("{p}.self_attn.k_norm.weight"), c.head_dim, c.qk_norm)?,
                post_attention_norm: store
                    .vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
                gate_proj: store.matrix(&format!("{p}.mlp.gate_proj.weight"), i, h)?,
                up_proj: store.matrix(&format!("{p}.mlp.up_proj.weight"), i, h)?,
                down_proj: store.matrix(&format!("{p}.mlp.down_proj.weight"), h, i)?,
                gate_bias: opt(format!("{p}.mlp.gate_proj.bias"), i, c.mlp_bias)?,
                up_bias: opt(format!("{p}.mlp.up_proj.bias"), i, c.mlp_bias)?,
                down_bias: opt(format!("{p}.mlp.down_proj.bias"), h, c.mlp_bias)?,
            });
        }
        let embed_tokens = store.matrix("model.embed_tokens.weight", c.vocab_size, h)?;
        let lm_head = if c.tie_word_embeddings && !store.contains("lm_head.weight") {
            None
        } else {
            Some(store.matrix("lm_head.weight", c.vocab_size, h)?)
        };
        let rope = Rope::new(c.rope_theta, c.head_dim, c.rope_scaling, RopeStyle::Neox);
        Ok(Self {
            embed_tokens,
            layers,
            final_norm: store.vector("model.norm.weight", h)?,
            lm_head,
            rope,
            config,
        })
    }

    fn attention_shape(&self, block_size: usize) -> AttentionShape {
        let c = &self.config;
        AttentionShape {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            sliding_window: c.sliding_window,
            softcap: None,
        }
    }
}

fn add_inplace(acc: &mut [f32], x: &[f32]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}

impl Model for LlamaModel {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn kv_layout(&self) -> KvLayout {
        KvLayout {
            num_layers: self.config.num_layers,
            num_kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
        }
    }

    fn weight_bytes(&self) -> usize {
        let layer_bytes: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.gate_proj, &l.up_proj, &l.down_proj]
                    .iter()
                    .map(|w| w.data().num_bytes())
                    .sum::<usize>()
            })
            .sum();
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        layer_bytes + head.data().num_bytes()
    }

    fn forward(
        &self,
        pool: &ThreadPool,
        batch: &ForwardBatch,
        kv: &mut PagedKvCache,
        scratch: &mut ForwardScratch,
        logits: &mut Logits,
    ) -> Result<(), ForwardError> {
        let c = &self.config;
        if kv.layout() != self.kv_layout() || kv.block_size() != batch.block_size() {
            return Err(ForwardError::KvLayout(format!(
                "cache {:?} with block size {}, model needs {:?} with block size {}",
                kv.layout(),
                kv.block_size(),
                self.kv_layout(),
                batch.block_size()
            )));
        }
        batch.validate(c.vocab_size, kv.num_blocks())?;
        let shape = self.attention_shape(batch.block_size());
        shape.validate().map_err(ForwardError::KvLayout)?;
        let t = batch.num_tokens();
        let num_rows = batch.logits_rows.len();
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let q_dim = c.num_heads * c.head_dim;
        let kv_dim = c.num_kv_heads * c.head_dim;
        let [hidden, normed, q, k, v, attn, proj, gate, up, rows, rows_normed] = scratch.take([
            t * h,
            t * h,
            t * q_dim,
            t * kv_dim,
            t * kv_dim,
            t * q_dim,
            t * h,
            t * i,
            t * i,
            num_rows * h,
            num_rows * h,
        ]);

        for (row, &token) in hidden.chunks_exact_mut(h).zip(&batch.token_ids) {
            self.embed_tokens.row_to_f32(token as usize, row);
        }
        for (l, layer) in self.layers.iter().enumerate() {
            rms_norm(pool, hidden, &layer.input_norm, c.rms_norm_eps, normed);
            linear_multi(
                pool,
                normed,
                t,
                &mut [
                    LinearJob { weight: &layer.q_proj, bias: layer.q_bias.as_deref(), out: q },
                    LinearJob { weight: &layer.k_proj, bias: layer.k_bias.as_deref(), out: k },
                    LinearJob { weight: &layer.v_proj, bias: layer.v_bias.as_deref(), out: v },
                ],
            );
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                rms_norm_inplace(pool, q, qn, c.rms_norm_eps);
                rms_norm_inplace(pool, k, kn, c.rms_norm_eps);
            }
            self.rope.apply(pool, q, c.num_heads, &batch.positions);
            self.rope.apply(pool, k, c.num_kv_heads, &batch.positions);
            let (k_cache, v_cache) = kv.layer_mut(l);
            write_kv(k, v, &batch.slot_mapping, k_cache, v_cache);
            paged_attention(
                pool,
                q,
                k_cache,
                v_cache,
                &batch.seqs,
                &batch.block_tables,
                &shape,
                attn,
            );
            linear(pool, attn, t, &layer.o_proj, layer.o_bias.as_deref(), proj);
            add_inplace(hidden, proj);

            rms_norm(pool, hidden, &layer.post_attention_norm, c.rms_norm_eps, normed);
            linear_multi(
                pool,
                normed,
                t,
                &mut [
                    LinearJob {
                        weight: &layer.gate_proj,
                        bias: layer.gate_bias.as_deref(),
                        out: gate,
                    },
                    LinearJob { weight: &layer.up_proj, bias: layer.up_bias.as_deref(), out: up },
                ],
            );
            gated_act_inplace(pool, GateActivation::Silu, gate, up);
            linear(pool, gate, t, &layer.down_proj, layer.down_bias.as_deref(), proj);
            add_inplace(hidden, proj);
        }

        for (dst, &r) in rows.chunks_exact_mut(h).zip(&batch.logits_rows) {
            dst.copy_from_slice(&hidden[r * h..(r + 1) * h]);
        }
        rms_norm(pool, rows, &self.final_norm, c.rms_norm_eps, rows_normed);
        logits.reset(num_rows, c.vocab_size);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        linear(pool, rows_normed, num_rows, head, None, logits.as_mut_slice());
        Ok(())
    }
}
