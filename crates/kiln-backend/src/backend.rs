//! The [`Backend`] trait: device memory and the coarse operations of a decoder step.
//!
//! The cut follows candle's storage/device split at the granularity of vLLM's custom ops: a
//! backend owns weights, vectors, rotary tables, the KV store and activation buffers, and runs
//! whole operations on them (several linear layers sharing one input, residual + norm, RoPE, KV
//! write, paged attention, gated activation, embedding gather, logits). Model code composes
//! these and never indexes device memory: it reaches an activation buffer only through
//! [`Backend::view`] / [`Backend::view_mut`] ranges handed back to the backend's own ops.
//!
//! Contracts every implementation keeps:
//! - activations are f32, row-major; every op states its shapes, and views cover exactly them;
//! - each output row depends only on its own input row (and, for attention, on its sequence's
//!   cache), never on what else is in the batch: batched == alone, chunked == one shot;
//! - ops run in call order; a backend may queue them (a device stream) as long as
//!   [`Backend::logits`] returns with the host logits complete;
//! - the integer step metadata (token ids, positions, slots, block tables) comes as host slices
//!   of the step's [`crate::ForwardBatch`]; they are the same for every layer of a step, so a
//!   device backend uploads them once per step.

use std::ops::Range;

use crate::{
    AttentionShape, ForwardBatch, ForwardError, GateActivation, GgmlType, HostTensor, KvCacheSpec,
    LoadTensorError, Logits, RopeConfig, SeqSpan, Strides, TreeKeys, TreeMask,
};

/// One matrix of a [`Backend::linear`] call: `out[m, n] = x[m, k] · weightᵀ + bias`.
pub struct LinearJob<'a, B: Backend> {
    /// `[n, k]`
    pub weight: &'a B::Weight,
    /// `[n]`
    pub bias: Option<&'a B::Vector>,
    /// `[m, n]`
    pub out: B::ViewMut<'a>,
}

/// The precision LoRA matrices are kept in (vLLM's `--lora-dtype`). The arithmetic is f32
/// either way; f16 halves an adapter's memory and rounds each value once (on the CPU it is
/// also faster: the kernels widen each vector as they load it, and read half the bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LoraDtype {
    #[default]
    F32,
    F16,
}

/// One adapter's rows of a [`Backend::lora_add`] call: `out[t] += (x[t] · aᵀ) · b_t` for rows
/// `t` in `rows`.
pub struct LoraJob<'a, B: Backend> {
    /// Rows of `x` and `out` this adapter applies to.
    pub rows: Range<usize>,
    pub rank: usize,
    /// `[rank, k]` the down projection (PEFT's `lora_A`).
    pub a: &'a B::LoraMatrix,
    /// `[rank, n]` the up projection transposed, the adapter's scale folded in (PEFT's
    /// `lora_B`ᵀ · `lora_alpha / r`, or `/ sqrt(r)` with rsLoRA).
    pub b_t: &'a B::LoraMatrix,
}

/// One matrix per expert of a [`Backend::linear_experts`] call.
pub struct ExpertLinearJob<'a, B: Backend> {
    /// One `[n, k]` matrix per expert, all of one shape.
    pub weights: &'a [B::Weight],
    /// `n`
    pub width: usize,
    /// One `[n]` bias per expert, added to its rows (gpt-oss), or none.
    pub biases: Option<&'a [B::Vector]>,
    /// `[rows, n]`
    pub out: &'a mut B::Buffer,
}

/// The most matrices one [`Backend::linear`] call takes (q/k/v; gate/up).
pub const MAX_LINEAR_JOBS: usize = 4;

/// A device that runs decoder steps. See the module docs for the contracts.
pub trait Backend: Send + Sync + Sized + 'static {
    /// A `[rows, cols]` weight matrix in the backend's layout.
    type Weight: Send + Sync;
    /// An f32 vector (norm weights, biases).
    type Vector: Send + Sync;
    /// A LoRA adapter matrix (`a` or `b_t` of a [`LoraJob`]), in the backend's precision.
    type LoraMatrix: Send + Sync;
    /// Precomputed rotary frequencies of one kind of layer.
    type Rope: Send + Sync;
    /// K and V of every layer, `[num_blocks, block_size, num_kv_heads, head_dim]` each.
    type KvStore: Send;
    /// A growable f32 activation buffer.
    type Buffer: Send;
    /// Read access to a range of a buffer.
    type View<'a>: Copy
    where
        Self: 'a;
    /// Write access to a range of a buffer.
    type ViewMut<'a>
    where
        Self: 'a;

    /// A short name for logs ("cpu", "reference").
    fn name(&self) -> &'static str;

    // ---- memory ----

    /// Moves a loaded tensor onto the device, converted to `convert` first when given
    /// (quantize-on-load, or dequantize to a float type).
    fn load_weight(
        &self,
        tensor: HostTensor,
        convert: Option<GgmlType>,
    ) -> Result<Self::Weight, LoadTensorError>;
    /// Bytes one full read of `weight` costs (decode is bound by their sum).
    fn weight_bytes(&self, weight: &Self::Weight) -> usize;
    fn load_vector(&self, values: &[f32]) -> Result<Self::Vector, LoadTensorError>;
    /// A LoRA matrix of `values`, row-major, kept in `dtype` (a value beyond its range is
    /// refused). Only called on a backend that [`Backend::supports_lora`].
    fn load_lora_matrix(
        &self,
        values: &[f32],
        dtype: LoraDtype,
    ) -> Result<Self::LoraMatrix, LoadTensorError>;
    fn load_rope(&self, config: &RopeConfig) -> Result<Self::Rope, LoadTensorError>;
    fn alloc_kv(&self, spec: KvCacheSpec) -> Result<Self::KvStore, ForwardError>;
    fn kv_spec(&self, kv: &Self::KvStore) -> KvCacheSpec;
    /// Bytes of one block of `kv` over every layer (K, V and any scales) as
    /// [`Backend::read_kv_block`] writes them: the unit in which blocks leave the cache and come
    /// back (a saved prefix cache). The layout is the backend's own, stable across processes.
    fn kv_block_bytes(&self, kv: &Self::KvStore) -> usize;
    /// Copies block `block` of every layer out of `kv` into `out` (`kv_block_bytes` long).
    fn read_kv_block(&self, kv: &Self::KvStore, block: usize, out: &mut [u8]);
    /// Overwrites block `block` of every layer of `kv` with `data`, as
    /// [`Backend::read_kv_block`] produced it: reading it back gives the same bytes.
    fn write_kv_block(&self, kv: &mut Self::KvStore, block: usize, data: &[u8]);
    fn new_buffer(&self) -> Self::Buffer;
    /// Grows `buf` to at least `len` elements (contents unspecified).
    fn reserve(&self, buf: &mut Self::Buffer, len: usize);
    fn view(buf: &Self::Buffer, range: Range<usize>) -> Self::View<'_>;
    fn view_mut(buf: &mut Self::Buffer, range: Range<usize>) -> Self::ViewMut<'_>;

    // ---- operations ----

    /// `out[t] = table[token_ids[t]] * scale` (`out`: `[num_tokens, hidden]`).
    fn embed(
        &self,
        table: &Self::Weight,
        token_ids: &[u32],
        scale: Option<f32>,
        out: Self::ViewMut<'_>,
    );
    /// Every job's `out = x · Wᵀ + bias` over the same `x` (`[m, k]`), in one dispatch; at most
    /// [`MAX_LINEAR_JOBS`] jobs.
    fn linear(&self, x: Self::View<'_>, m: usize, jobs: &mut [LinearJob<'_, Self>]);
    /// `out[rows, d] = rmsnorm(x[rows, d]) * weight[d]`.
    fn rms_norm(&self, x: Self::View<'_>, weight: &Self::Vector, eps: f32, out: Self::ViewMut<'_>);
    /// [`Backend::rms_norm`] in place; with `d = head_dim` it normalises each head.
    fn rms_norm_inplace(&self, x: Self::ViewMut<'_>, weight: &Self::Vector, eps: f32);
    /// The residual step between sublayers over rows of `d`: `branch` is normalised in place by
    /// `post` when given, added into `x`, and with `next`, `out = rmsnorm(x) * next`.
    fn residual_norm(
        &self,
        d: usize,
        branch: Self::ViewMut<'_>,
        post: Option<&Self::Vector>,
        x: Self::ViewMut<'_>,
        next: Option<(&Self::Vector, Self::ViewMut<'_>)>,
        eps: f32,
    );
    /// The step's rotary angles, `[num_tokens, rotary_dim]`, one row per position.
    fn rope_table(&self, rope: &Self::Rope, positions: &[u32], table: Self::ViewMut<'_>);
    /// Rotates `x[num_tokens, num_heads, head_dim]` in place by the angles of `table`.
    fn rope_apply(
        &self,
        rope: &Self::Rope,
        x: Self::ViewMut<'_>,
        num_heads: usize,
        table: Self::View<'_>,
    );
    /// `gate = act(gate) * up`, element-wise.
    fn gated_act(&self, act: GateActivation, gate: Self::ViewMut<'_>, up: Self::View<'_>);
    /// Writes `k, v` (`[num_tokens, num_kv_heads, head_dim]`) into `layer` of the cache at
    /// `slot_mapping[t]`.
    fn write_kv(
        &self,
        kv: &mut Self::KvStore,
        layer: usize,
        k: Self::View<'_>,
        v: Self::View<'_>,
        slot_mapping: &[u32],
    );
    /// `out[rows, num_heads * head_dim]` = attention of the queries `q` (rows of `seqs`) over
    /// `layer` of the cache, causal (and windowed when the shape says so). With `tree`, a row
    /// `r` with `tree.rows[r].len > 0` is a token-tree node and sees the keys [`crate::TreeKeys`]
    /// describes; only backends that [`Backend::supports_token_trees`] are given one. With
    /// `sinks` (`[num_heads]`, gpt-oss), head `h`'s softmax has one more logit `sinks[h]`
    /// whose value is zero; only backends that [`Backend::supports_attention_sinks`] are given
    /// them.
    #[allow(clippy::too_many_arguments)]
    fn paged_attention(
        &self,
        kv: &Self::KvStore,
        layer: usize,
        q: Self::View<'_>,
        seqs: &[SeqSpan],
        block_tables: &[u32],
        masks: (Option<TreeMask<'_>>, Option<&Self::Vector>),
        shape: &AttentionShape,
        out: Self::ViewMut<'_>,
    );
    /// Whether [`Backend::paged_attention`] takes attention sinks (a model with them is
    /// refused at load on a backend without).
    fn supports_attention_sinks(&self) -> bool {
        false
    }
    /// Whether [`Backend::paged_attention`] takes token trees and [`Backend::copy_kv_slots`]
    /// works (speculative decoding with token trees needs both).
    fn supports_token_trees(&self) -> bool {
        false
    }
    /// Copies the K/V of cache slot `src` to slot `dst` in every layer, for each pair in order
    /// (a verified token-tree path moved to the slots of its positions). Only called on a
    /// backend that [`Backend::supports_token_trees`].
    fn copy_kv_slots(&self, kv: &mut Self::KvStore, pairs: &[(u32, u32)]) {
        let _ = (kv, pairs);
        unreachable!("{} does not support token trees", self.name());
    }
    /// Whether [`Backend::combine_rows`] works (mixture-of-experts layers need it; a model
    /// with experts is refused at load on a backend without it).
    fn supports_experts(&self) -> bool {
        false
    }
    /// The weighted sum of each token's expert outputs: `out[t] = Σ_j weights[t·k + j] ·
    /// src[rows[t·k + j]]` over rows of `width`, summed in `j` order from zero, so a row's
    /// result depends on its own `k` picks alone. `src`: `[_, width]`, `out`: `[rows.len() / k,
    /// width]`. Only called on a backend that [`Backend::supports_experts`].
    fn combine_rows(
        &self,
        src: Self::View<'_>,
        width: usize,
        k: usize,
        rows: &[usize],
        weights: &[f32],
        out: Self::ViewMut<'_>,
    ) {
        let _ = (src, width, k, rows, weights, out);
        unreachable!("{} does not run mixture-of-experts layers", self.name());
    }
    /// Expert-grouped matmuls: for every job, rows `offsets[e]..offsets[e + 1]` of `out` are
    /// the same rows of `x` (`[offsets[E], k]`) times `weights[e]ᵀ`, each row's result the one
    /// [`Backend::linear`] gives it (so bitwise independent of the other experts' rows). At
    /// most [`MAX_LINEAR_JOBS`] jobs. The default runs one `linear` per expert with rows.
    fn linear_experts(
        &self,
        x: &Self::Buffer,
        k: usize,
        offsets: &[usize],
        jobs: &mut [ExpertLinearJob<'_, Self>],
    ) {
        for e in 0..offsets.len().saturating_sub(1) {
            let rows = offsets[e]..offsets[e + 1];
            if rows.is_empty() {
                continue;
            }
            let xs = Self::view(x, rows.start * k..rows.end * k);
            let mut linear: Vec<LinearJob<'_, Self>> = jobs
                .iter_mut()
                .map(|j| LinearJob {
                    weight: &j.weights[e],
                    bias: j.biases.map(|b| &b[e]),
                    out: Self::view_mut(j.out, rows.start * j.width..rows.end * j.width),
                })
                .collect();
            self.linear(xs, rows.len(), &mut linear);
        }
    }
    /// Whether [`Backend::lora_add`] works (a model refuses LoRA adapters on a backend
    /// without it).
    fn supports_lora(&self) -> bool {
        false
    }
    /// Low-rank adapter updates on the rows of a linear layer's output: for every job and row
    /// `t` of its `rows`, `out[t, :] += Σ_j (x[t, :] · a[j, :]) · b_t[j, :]`, the `rank` dot
    /// products first, then the sum in `j` order. `x`: `[m, k]`, `out`: `[m, n]`; the jobs'
    /// rows are disjoint. A row's result depends on its own input and adapter alone (never on
    /// which other rows or adapters share the call). Only called on a backend that
    /// [`Backend::supports_lora`].
    fn lora_add(
        &self,
        x: Self::View<'_>,
        k: usize,
        n: usize,
        jobs: &[LoraJob<'_, Self>],
        out: Self::ViewMut<'_>,
    ) {
        let _ = (x, k, n, jobs, out);
        unreachable!("{} does not run LoRA adapters", self.name());
    }
    /// Whether [`Backend::permute_cols`] works (act-order GPTQ matrices need it; a model with
    /// them is refused at load on a backend without it).
    fn supports_permuted_inputs(&self) -> bool {
        false
    }
    /// `out[t, j] = x[t, order[j]]` over `m` rows of `order.len()`: the input of a matrix whose
    /// columns are stored in `order` (act-order GPTQ). Only called on a backend that
    /// [`Backend::supports_permuted_inputs`].
    fn permute_cols(&self, x: Self::View<'_>, m: usize, order: &[usize], out: Self::ViewMut<'_>) {
        let _ = (x, m, order, out);
        unreachable!("{} does not permute inputs", self.name());
    }
    /// Whether [`Backend::copy_strided`] works and caches whose values are read from their
    /// keys are stored ([`crate::KvLayout::values_from_keys`]): latent attention (DeepSeek)
    /// needs both; such a model is refused at load on a backend without them.
    fn supports_latent_attention(&self) -> bool {
        false
    }
    /// Segment copies: `dst[d.at(i, j)..][..len] = src[s.at(i, j)..][..len]` for every `i <
    /// outer`, `j < inner` (the destinations disjoint): the moves between token-major and
    /// head-major layouts, and in and out of a row's column range, that latent attention
    /// makes. Only called on a backend that [`Backend::supports_latent_attention`].
    fn copy_strided(
        &self,
        src: Self::View<'_>,
        s: Strides,
        dst: Self::ViewMut<'_>,
        d: Strides,
        (outer, inner, len): (usize, usize, usize),
    ) {
        let _ = (src, s, dst, d, outer, inner, len);
        unreachable!("{} does not run latent attention", self.name());
    }
    /// Moves rows `rows[i]` (ascending) of `buf` (`[_, width]`) to rows `i`.
    fn compact_rows(&self, buf: Self::ViewMut<'_>, width: usize, rows: &[usize]);
    /// `dst[i] = src[rows[i]]` over rows of `width`.
    fn gather_rows(
        &self,
        src: Self::View<'_>,
        width: usize,
        rows: &[usize],
        dst: Self::ViewMut<'_>,
    );
    /// `out = x · headᵀ` (`x`: `[m, hidden]`), then `cap * tanh(out / cap)` with a soft cap,
    /// into host memory.
    fn logits(
        &self,
        x: Self::View<'_>,
        m: usize,
        head: &Self::Weight,
        softcap: Option<f32>,
        out: &mut Logits,
    );

    /// Whether the encoder ops work: [`Backend::layer_norm`], [`Backend::activation`] and
    /// non-causal [`Backend::paged_attention`] (an encoder model, BERT or XLM-RoBERTa, is
    /// refused at load on a backend without them).
    fn supports_encoders(&self) -> bool {
        false
    }
    /// `x = layernorm(x + branch) * weight + bias` over rows of `d` (`x`, `branch`: `[rows,
    /// d]`; without `branch`, of `x` alone): each row centred on its mean and scaled by
    /// `1 / sqrt(variance + eps)`. Only called on a backend that
    /// [`Backend::supports_encoders`].
    fn layer_norm(
        &self,
        d: usize,
        x: Self::ViewMut<'_>,
        branch: Option<Self::View<'_>>,
        (weight, bias): (&Self::Vector, &Self::Vector),
        eps: f32,
    ) {
        let _ = (d, x, branch, weight, bias, eps);
        unreachable!("{} does not run encoder layers", self.name());
    }
    /// `x = act(x)`, element-wise (an ungated MLP's activation). Only called on a backend that
    /// [`Backend::supports_encoders`].
    fn activation(&self, act: GateActivation, x: Self::ViewMut<'_>) {
        let _ = (act, x);
        unreachable!("{} does not run encoder layers", self.name());
    }

    /// Whether [`Backend::rows_to_host`] works (a pooling model, which hands back hidden
    /// states instead of logits, is refused at load on a backend without it).
    fn supports_pooling(&self) -> bool {
        false
    }
    /// Copies `m` rows of `width` of `x` into host memory (`out` reset to `[m, width]`): the
    /// final hidden states of a pooling step. Only called on a backend that
    /// [`Backend::supports_pooling`].
    fn rows_to_host(&self, x: Self::View<'_>, m: usize, width: usize, out: &mut Logits) {
        let _ = (x, m, width, out);
        unreachable!("{} does not hand hidden states back", self.name());
    }

    /// Runs one forward step: `forward` issues the step's ops for `batch` and fills `logits`.
    /// The default runs it once. A backend may call `forward` more than once in modes of its
    /// own (to record the step, or to check it against a recording) and replay a recording
    /// instead of running it, provided the step's effects, the KV cache and `logits`, are
    /// exactly those of one run (the CUDA backend's graphs).
    fn run_step(
        &self,
        batch: &ForwardBatch,
        logits: &mut Logits,
        forward: &mut dyn FnMut(&mut Logits) -> Result<(), ForwardError>,
    ) -> Result<(), ForwardError> {
        let _ = batch;
        forward(logits)
    }
}

/// Activation buffers of a forward pass on backend `B`: they grow to the largest step seen and
/// are reused, so a warm step allocates nothing.
pub struct Workspace<B: Backend> {
    buffers: Vec<B::Buffer>,
    /// Host-side sequence spans a step builds (the last layer's single-query sequences).
    pub row_seqs: Vec<SeqSpan>,
    /// The tree keys of those rows, when the step holds a token tree.
    pub row_trees: Vec<TreeKeys>,
    /// Host side of a mixture-of-experts layer's routing, reused by every layer.
    pub routing: ExpertRouting,
    /// Table rows a step gathers per token beyond its token ids (an encoder's position and
    /// token-type rows).
    pub row_ids: Vec<u32>,
    pub row_types: Vec<u32>,
}

/// Which experts a mixture-of-experts layer sends each of its `n` tokens to, with `k` picks per
/// token, laid out for the expert-grouped matmuls: the picks sorted by expert (then token), so
/// each expert's rows are one contiguous segment.
#[derive(Clone, Debug, Default)]
pub struct ExpertRouting {
    /// `[n, num_experts]` the router's logits.
    pub logits: Logits,
    /// `[n, 1]` the shared expert's gate logits, when the layer has a shared expert.
    pub shared_logits: Logits,
    /// `[n · k]` the token of each pick, in expert-sorted order (the rows to gather).
    pub tokens: Vec<usize>,
    /// `[n · k']` for token `t`'s `j`-th pick (its picks in ascending expert order), the row
    /// of that pick in the expert-sorted order; with a shared expert `k' = k + 1` and token
    /// `t`'s last pick is row `n·k + t`, the shared expert's output for it.
    pub rows: Vec<usize>,
    /// `[n · k']` the weight of token `t`'s `j`-th pick, in the order of `rows` (the shared
    /// expert's: the sigmoid of its gate).
    pub weights: Vec<f32>,
    /// `[num_experts + 1]` expert `e`'s picks are sorted rows `offsets[e]..offsets[e + 1]`.
    pub offsets: Vec<usize>,
}

impl<B: Backend> Default for Workspace<B> {
    fn default() -> Self {
        Self {
            buffers: Vec::new(),
            row_seqs: Vec::new(),
            row_trees: Vec::new(),
            routing: ExpertRouting::default(),
            row_ids: Vec::new(),
            row_types: Vec::new(),
        }
    }
}

impl<B: Backend> Workspace<B> {
    pub fn new() -> Self {
        Self::default()
    }

    /// `N` distinct buffers of at least the requested lengths.
    pub fn take<const N: usize>(&mut self, backend: &B, lens: [usize; N]) -> [&mut B::Buffer; N] {
        while self.buffers.len() < N {
            self.buffers.push(backend.new_buffer());
        }
        for (buf, &len) in self.buffers.iter_mut().zip(&lens) {
            backend.reserve(buf, len);
        }
        let mut iter = self.buffers.iter_mut();
        lens.map(|_| match iter.next() {
            Some(buf) => buf,
            None => unreachable!("buffers were grown to at least N"),
        })
    }
}
