//! The decoder-only transformer of every supported family: Llama 2/3, Mistral (sliding
//! window), Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm) and Gemma 3 (q/k RMSNorm, sandwich norms,
//! GeLU-tanh MLP, scaled embeddings, sliding-window layers with their own RoPE base), with
//! grouped-query attention and optionally tied embeddings, from safetensors or GGUF weights.
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

use kiln_kernels::activation::gated_act_inplace;
use kiln_kernels::attention::{AttentionSeq, AttentionShape, KvElem, paged_attention, write_kv};
use kiln_kernels::norm::{residual_norm, rms_norm, rms_norm_inplace};
use kiln_kernels::rope::{Rope, RopeScaling};
use kiln_kernels::{LinearJob, ThreadPool, WeightMatrix, linear, linear_multi};

use crate::model::{ForwardScratch, Logits, Model};
use crate::names::{LayerTensor as L, Tensor};
use crate::weights::Weights;
use crate::{
    ForwardBatch, ForwardError, KvLayerMut, KvLayout, LoadError, ModelConfig, PagedKvCache,
};

struct Layer {
    attn_norm: Vec<f32>,
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
    attn_out_norm: Option<Vec<f32>>,
    mlp_norm: Vec<f32>,
    mlp_out_norm: Option<Vec<f32>>,
    gate_proj: WeightMatrix,
    up_proj: WeightMatrix,
    down_proj: WeightMatrix,
    gate_bias: Option<Vec<f32>>,
    up_bias: Option<Vec<f32>>,
    down_bias: Option<Vec<f32>>,
    /// Sliding-window layers use the local RoPE when the model has one.
    local_rope: bool,
}

pub struct DecoderModel {
    config: ModelConfig,
    embed_tokens: WeightMatrix,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    /// `None` when tied to `embed_tokens`.
    lm_head: Option<WeightMatrix>,
    rope: Rope,
    /// RoPE of sliding-window layers when their base differs (Gemma 3).
    local_rope: Option<Rope>,
}

impl DecoderModel {
    pub(crate) fn load(config: ModelConfig, w: &Weights<'_>) -> Result<Self, LoadError> {
        let c = &config;
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let q_dim = c.num_heads * c.head_dim;
        let kv_dim = c.num_kv_heads * c.head_dim;
        // RMSNorm weights, with the offset of (1 + w) norms folded in.
        let norm = |t: Tensor, len: usize| -> Result<Vec<f32>, LoadError> {
            let mut v = w.vector(t, len)?;
            if c.norm_weight_offset != 0.0 {
                for x in &mut v {
                    *x += c.norm_weight_offset;
                }
            }
            Ok(v)
        };
        let opt_norm = |t: Tensor, len: usize, present: bool| {
            if present { norm(t, len).map(Some) } else { Ok(None) }
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let t = |x: L| Tensor::Layer(l, x);
            let sandwich = c.sandwich_norms;
            layers.push(Layer {
                attn_norm: norm(t(L::AttnNorm), h)?,
                q_proj: w.matrix(t(L::Q), q_dim, h)?,
                k_proj: w.matrix(t(L::K), kv_dim, h)?,
                v_proj: w.matrix(t(L::V), kv_dim, h)?,
                o_proj: w.matrix(t(L::O), h, q_dim)?,
                q_bias: w.optional_vector(t(L::QBias), q_dim, c.qkv_bias)?,
                k_bias: w.optional_vector(t(L::KBias), kv_dim, c.qkv_bias)?,
                v_bias: w.optional_vector(t(L::VBias), kv_dim, c.qkv_bias)?,
                o_bias: w.optional_vector(t(L::OBias), h, c.o_bias)?,
                q_norm: opt_norm(t(L::QNorm), c.head_dim, c.qk_norm)?,
                k_norm: opt_norm(t(L::KNorm), c.head_dim, c.qk_norm)?,
                attn_out_norm: opt_norm(t(L::AttnOutNorm), h, sandwich)?,
                mlp_norm: norm(t(L::MlpNorm), h)?,
                mlp_out_norm: opt_norm(t(L::MlpOutNorm), h, sandwich)?,
                gate_proj: w.matrix(t(L::Gate), i, h)?,
                up_proj: w.matrix(t(L::Up), i, h)?,
                down_proj: w.matrix(t(L::Down), h, i)?,
                gate_bias: w.optional_vector(t(L::GateBias), i, c.mlp_bias)?,
                up_bias: w.optional_vector(t(L::UpBias), i, c.mlp_bias)?,
                down_bias: w.optional_vector(t(L::DownBias), h, c.mlp_bias)?,
                local_rope: c.layer_window(l).is_some() && c.rope_local_theta.is_some(),
            });
        }
        let embed_tokens = w.matrix(Tensor::Embed, c.vocab_size, h)?;
        let lm_head = if c.tie_word_embeddings && !w.contains(Tensor::LmHead) {
            None
        } else {
            Some(w.matrix(Tensor::LmHead, c.vocab_size, h)?)
        };
        let mut rope = Rope::new(c.rope_theta, c.head_dim, c.rope_scaling, c.rope_style);
        if let Some(factors) = &c.rope_freq_factors {
            rope = rope.with_freq_factors(factors);
        }
        let local_rope =
            c.rope_local_theta.map(|b| Rope::new(b, c.head_dim, RopeScaling::None, c.rope_style));
        Ok(Self {
            embed_tokens,
            layers,
            final_norm: norm(Tensor::FinalNorm, h)?,
            lm_head,
            rope,
            local_rope,
            config,
        })
    }

    /// The cache must match the model, the batch must be valid for both.
    fn check_batch(&self, batch: &ForwardBatch, kv: &PagedKvCache) -> Result<(), ForwardError> {
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
        for l in 0..c.num_layers {
            self.attention_shape(batch.block_size(), l)
                .validate()
                .map_err(ForwardError::KvLayout)?;
        }
        Ok(())
    }

    /// `proj[t, h] = down(act(gate(x)) * up(x))` over `normed[t, h]`, through `gate`/`up`
    /// (`[t, intermediate]`).
    fn mlp(
        &self,
        pool: &ThreadPool,
        layer: &Layer,
        t: usize,
        normed: &[f32],
        gate: &mut [f32],
        up: &mut [f32],
        proj: &mut [f32],
    ) {
        linear_multi(
            pool,
            normed,
            t,
            &mut [
                LinearJob { weight: &layer.gate_proj, bias: layer.gate_bias.as_deref(), out: gate },
                LinearJob { weight: &layer.up_proj, bias: layer.up_bias.as_deref(), out: up },
            ],
        );
        gated_act_inplace(pool, self.config.hidden_act, gate, up);
        linear(pool, gate, t, &layer.down_proj, layer.down_bias.as_deref(), proj);
    }

    /// The rest of layer `l` for `n` rows once attention is done (`attn`, `[n, q_dim]`):
    /// `hidden += [norm](o_proj(attn))`, then `hidden += [norm](mlp(rmsnorm(hidden)))`, leaving
    /// the next layer's input norm of `hidden` in `normed` (`[n, h]`). `proj` (`[n, h]`) and
    /// `gate`, `up` (`[n, intermediate]`) are scratch.
    fn attn_out_and_mlp(
        &self,
        pool: &ThreadPool,
        l: usize,
        attn: &[f32],
        hidden: &mut [f32],
        normed: &mut [f32],
        [proj, gate, up]: [&mut [f32]; 3],
    ) {
        let c = &self.config;
        let (h, eps, layer) = (c.hidden_size, c.rms_norm_eps, &self.layers[l]);
        let n = hidden.len() / h;
        linear(pool, attn, n, &layer.o_proj, layer.o_bias.as_deref(), proj);
        let post = layer.attn_out_norm.as_deref();
        residual_norm(pool, h, proj, post, hidden, Some((&layer.mlp_norm, normed)), eps);
        self.mlp(pool, layer, n, normed, gate, up, proj);
        let next = self.layers.get(l + 1).map(|next| (&next.attn_norm[..], normed));
        residual_norm(pool, h, proj, layer.mlp_out_norm.as_deref(), hidden, next, eps);
    }

    /// `q, k, v` of the tokens of `normed` (`[n, h]`): projections, the per-head norms
    /// (Gemma 3) and rotary embeddings by `rope` with the tokens' angles (`[n, rotary_dim]`,
    /// [`Rope::table`]).
    #[allow(clippy::too_many_arguments)]
    fn qkv(
        &self,
        pool: &ThreadPool,
        layer: &Layer,
        normed: &[f32],
        rope: &Rope,
        angles: &[f32],
        q: &mut [f32],
        k: &mut [f32],
        v: &mut [f32],
    ) {
        let c = &self.config;
        linear_multi(
            pool,
            normed,
            normed.len() / c.hidden_size,
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
        rope.apply_table(pool, q, c.num_heads, angles);
        rope.apply_table(pool, k, c.num_kv_heads, angles);
    }

    /// `hidden[t] = embedding(token_ids[t])`, scaled where the model says so (Gemma).
    fn embed(&self, token_ids: &[u32], hidden: &mut [f32]) {
        let h = self.config.hidden_size;
        for (row, &token) in hidden.chunks_exact_mut(h).zip(token_ids) {
            self.embed_tokens.row_to_f32(token as usize, row);
            if let Some(scale) = self.config.embedding_scale {
                for x in row.iter_mut() {
                    *x *= scale;
                }
            }
        }
    }

    /// The logits of the rows that need them: rows `gather` of `hidden`, or (`None`) its first
    /// rows, already compacted. Final norm (through the `rows` / `rows_normed` scratch,
    /// `[num_rows, h]`) and LM head, then the final soft cap.
    fn logits(
        &self,
        pool: &ThreadPool,
        hidden: &[f32],
        gather: Option<&[usize]>,
        rows: &mut [f32],
        rows_normed: &mut [f32],
        logits: &mut Logits,
    ) {
        let c = &self.config;
        let h = c.hidden_size;
        let num_rows = rows_normed.len() / h;
        let rows: &[f32] = match gather {
            Some(gather) => {
                for (dst, &r) in rows.chunks_exact_mut(h).zip(gather) {
                    dst.copy_from_slice(&hidden[r * h..(r + 1) * h]);
                }
                rows
            }
            None => &hidden[..num_rows * h],
        };
        rms_norm(pool, rows, &self.final_norm, c.rms_norm_eps, rows_normed);
        logits.reset(num_rows, c.vocab_size);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        linear(pool, rows_normed, num_rows, head, None, logits.as_mut_slice());
        if let Some(cap) = c.final_logit_softcap {
            logits.as_mut_slice().iter_mut().for_each(|x| *x = cap * (*x / cap).tanh());
        }
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

impl Model for DecoderModel {
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
        self.check_batch(batch, kv)?;
        let t = batch.num_tokens();
        let num_rows = batch.logits_rows.len();
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let q_dim = c.num_heads * c.head_dim;
        let kv_dim = c.num_kv_heads * c.head_dim;
        let rot = self.rope.rotary_dim();
        let local_rot = self.local_rope.as_ref().map_or(0, Rope::rotary_dim);
        let mut row_seqs = std::mem::take(&mut scratch.row_seqs);
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
            rows,
            rows_normed,
            angles,
            local_angles,
        ] = scratch.take([
            t * h,
            t * h,
            t * q_dim,
            t * kv_dim,
            t * kv_dim,
            t * q_dim,
            t * h,
            t.min(SLICE_TOKENS) * i,
            t.min(SLICE_TOKENS) * i,
            num_rows * h,
            num_rows * h,
            t * rot,
            t * local_rot,
        ]);
        // The step's rotary angles, shared by every layer.
        self.rope.table(&batch.positions, angles);
        if let Some(local) = &self.local_rope {
            local.table(&batch.positions, local_angles);
        }

        self.embed(&batch.token_ids, hidden);
        let slices = token_slices(t);
        // Later layers' input norms come with the previous layer's last residual add.
        if let Some(first) = self.layers.first() {
            rms_norm(pool, hidden, &first.attn_norm, c.rms_norm_eps, normed);
        }
        // Whether the last layer carries only the logits rows (compacted to rows 0..num_rows
        // of `q` and `hidden`) past its K/V.
        let prune = num_rows < t;
        if prune {
            single_query_seqs(batch, &mut row_seqs);
        }
        let last = self.layers.len().saturating_sub(1);
        for (l, layer) in self.layers.iter().enumerate() {
            let (rope, table, rot) = match (&self.local_rope, layer.local_rope) {
                (Some(local), true) => (local, &*local_angles, local_rot),
                _ => (&self.rope, &*angles, rot),
            };
            for r in slices.clone() {
                self.qkv(
                    pool,
                    layer,
                    &normed[r.start * h..r.end * h],
                    rope,
                    &table[r.start * rot..r.end * rot],
                    &mut q[r.start * q_dim..r.end * q_dim],
                    &mut k[r.start * kv_dim..r.end * kv_dim],
                    &mut v[r.start * kv_dim..r.end * kv_dim],
                );
            }
            let shape = self.attention_shape(batch.block_size(), l);
            let (seqs, rows_on) = if prune && l == last {
                compact_rows(q, q_dim, &batch.logits_rows);
                compact_rows(hidden, h, &batch.logits_rows);
                (&row_seqs[..], num_rows)
            } else {
                (&batch.seqs[..], t)
            };
            let inputs = AttnInputs { batch, seqs, q, k, v, shape: &shape };
            match kv.layer_mut(l) {
                KvLayerMut::F32(kc, vc) => attend(pool, &inputs, kc, vc, attn),
                KvLayerMut::F16(kc, vc) => attend(pool, &inputs, kc, vc, attn),
            }
            for r in token_slices(rows_on) {
                let n = r.len();
                self.attn_out_and_mlp(
                    pool,
                    l,
                    &attn[r.start * q_dim..r.end * q_dim],
                    &mut hidden[r.start * h..r.end * h],
                    &mut normed[r.start * h..r.end * h],
                    [&mut proj[r.start * h..r.end * h], &mut gate[..n * i], &mut up[..n * i]],
                );
            }
        }

        let gather = (!prune).then_some(&batch.logits_rows[..]);
        self.logits(pool, hidden, gather, rows, rows_normed, logits);
        scratch.row_seqs = row_seqs;
        Ok(())
    }
}

/// One layer's attention inputs: the step's `k, v` (`[num_tokens, kv_dim]`) and the queries
/// `q` of the rows of `seqs` (the batch's sequences, or [`single_query_seqs`] over the
/// compacted logits rows).
struct AttnInputs<'a> {
    batch: &'a ForwardBatch,
    seqs: &'a [AttentionSeq],
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    shape: &'a AttentionShape,
}

/// Writes the step's `k, v` into one layer's cache and runs paged attention of the rows of
/// `inputs.seqs` over it into `out` (`[rows, q_dim]`).
fn attend<E: KvElem>(
    pool: &ThreadPool,
    inputs: &AttnInputs<'_>,
    k_cache: &mut [E],
    v_cache: &mut [E],
    out: &mut [f32],
) {
    write_kv(inputs.k, inputs.v, &inputs.batch.slot_mapping, k_cache, v_cache);
    if inputs.seqs.is_empty() {
        return;
    }
    let tables = &inputs.batch.block_tables;
    paged_attention(pool, inputs.q, k_cache, v_cache, inputs.seqs, tables, inputs.shape, out);
}

/// One attention sequence per logits row of `batch`, in row order: query `i` is the row's
/// token alone at its position, over its sequence's cache (context up to and including it).
fn single_query_seqs(batch: &ForwardBatch, out: &mut Vec<AttentionSeq>) {
    out.clear();
    let mut seqs = batch.seqs.iter().peekable();
    for (i, &row) in batch.logits_rows.iter().enumerate() {
        while seqs.peek().is_some_and(|s| s.query_start + s.query_len <= row) {
            seqs.next();
        }
        let Some(seq) = seqs.peek() else { break };
        let first_pos = seq.context_len - seq.query_len;
        out.push(AttentionSeq {
            query_start: i,
            query_len: 1,
            context_len: first_pos + (row - seq.query_start) + 1,
            block_table_start: seq.block_table_start,
        });
    }
}

/// Moves rows `rows[i]` (ascending) of `buf` (`[_, width]`) to rows `i`.
fn compact_rows(buf: &mut [f32], width: usize, rows: &[usize]) {
    for (i, &r) in rows.iter().enumerate() {
        debug_assert!(r >= i && (i == 0 || r > rows[i - 1]), "rows ascend");
        buf.copy_within(r * width..(r + 1) * width, i * width);
    }
}
