//! The CPU backend: today's SIMD kernels (AMX / AVX-512 VNNI / AVX2 / scalar, chosen at run
//! time) on a persistent [`ThreadPool`], behind [`kiln_backend::Backend`].
//!
//! Memory is host memory: weights are [`WeightMatrix`] values (float tensors viewed in place in
//! their memory-mapped files when aligned, block-quantized ones repacked for the int8 kernels),
//! activation buffers are `Vec<f32>` and views are plain slices, the KV store is
//! [`CpuKvStore`]. [`FloatMatmul`] says how float matrices multiply (`--dtype`): in f32, or
//! bf16 ones on the CPU's bf16 units with activations rounded to bf16. Every op is the kernel
//! the model called before the seam existed, so results are bitwise those of the kernels
//! (tested in the kernels' own modules).

mod kv_store;

use std::ops::Range;
use std::sync::Arc;

use kiln_backend::{
    AttentionShape, Backend, ExpertLinearJob, ForwardError, GateActivation, GgmlType, HostTensor,
    KvCacheSpec, LinearJob, LoadTensorError, Logits, LoraJob, RopeConfig, SeqSpan, Strides,
    TreeMask,
};

pub use kv_store::{CpuKvStore, KvLayer, KvLayerMut};

use crate::activation::{act_inplace, gated_act_inplace};
use crate::attention::{
    QuantKv, paged_attention_quant_with_sinks, paged_attention_with_sinks, write_kv, write_kv_quant,
};
use crate::host_rows;
use crate::norm::{layer_norm, residual_norm, rms_norm, rms_norm_inplace};
use crate::rope::Rope;
use crate::{SharedMut, ThreadPool, WeightData, WeightMatrix, linear_multi};

/// How float (f32 / f16 / bf16) weight matrices are multiplied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FloatMatmul {
    /// Every float matrix in f32: 16-bit weights widened exactly, activations kept in f32
    /// (`--dtype float32`).
    #[default]
    F32,
    /// bf16 matrices as bf16 dot products of activations rounded to bf16, summed in f32
    /// ([`crate::WeightMatrix::with_bf16_dots`]); f32 and f16 matrices in f32 (`--dtype auto`,
    /// as vLLM runs a bf16 checkpoint in bf16).
    Bf16Stored,
    /// Every float matrix converted to bf16 as it loads, then as [`FloatMatmul::Bf16Stored`]
    /// (`--dtype bfloat16`).
    Bf16,
}

/// The CPU backend; cheap to clone (the pool is shared).
#[derive(Clone)]
pub struct Cpu {
    pool: Arc<ThreadPool>,
    float_matmul: FloatMatmul,
}

impl Cpu {
    /// A backend with its own pool of `num_threads` threads (0 = all cores).
    pub fn new(num_threads: usize) -> Self {
        Self::with_pool(Arc::new(ThreadPool::new(num_threads)))
    }

    pub fn with_pool(pool: Arc<ThreadPool>) -> Self {
        Self { pool, float_matmul: FloatMatmul::F32 }
    }

    /// This backend with float matrices loaded for `mode` from now on. bf16 dot products run on
    /// AVX-512 BF16 where [`crate::bf16_dot_supported`], else in scalar code with the same
    /// result (slow: choose [`FloatMatmul::F32`] there).
    #[must_use]
    pub fn with_float_matmul(mut self, mode: FloatMatmul) -> Self {
        self.float_matmul = mode;
        self
    }

    pub fn float_matmul(&self) -> FloatMatmul {
        self.float_matmul
    }

    /// The pool, shared (the engine samples on the kernels' threads).
    pub fn shared_pool(&self) -> Arc<ThreadPool> {
        Arc::clone(&self.pool)
    }

    pub fn pool(&self) -> &ThreadPool {
        &self.pool
    }
}

/// A kernel job borrowing a backend job.
fn kernel_job<'a>(job: &'a mut LinearJob<'_, Cpu>) -> crate::LinearJob<'a> {
    crate::LinearJob { weight: job.weight, bias: job.bias.map(Vec::as_slice), out: &mut *job.out }
}

fn expert_job<'a>(job: &'a mut ExpertLinearJob<'_, Cpu>) -> crate::ExpertJob<'a> {
    crate::ExpertJob { weights: job.weights, out: &mut job.out[..] }
}

impl Backend for Cpu {
    type Weight = WeightMatrix;
    type Vector = Vec<f32>;
    type LoraMatrix = crate::lora::LoraValues;
    type Rope = Rope;
    type KvStore = CpuKvStore;
    type Buffer = Vec<f32>;
    type View<'a> = &'a [f32];
    type ViewMut<'a> = &'a mut [f32];

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn load_weight(
        &self,
        tensor: HostTensor,
        convert: Option<GgmlType>,
    ) -> Result<WeightMatrix, LoadTensorError> {
        let (ty, rows, cols) = (tensor.ty(), tensor.rows(), tensor.cols());
        let bytes = tensor.into_bytes();
        let size = LoadTensorError::Size { rows, cols, ty, bytes: bytes.len() };
        let m = WeightMatrix::from_quantized(rows, cols, ty, bytes).ok_or(size)?;
        let to_bf16 = self.float_matmul == FloatMatmul::Bf16
            && matches!(m.data(), WeightData::F32(_) | WeightData::F16(_));
        let convert = if to_bf16 && convert.is_none() { Some(GgmlType::Bf16) } else { convert };
        let m = match convert {
            None => m,
            Some(to) => m.quantize(to).map_err(|e| LoadTensorError::Convert {
                ty: e.ty,
                cols: e.cols,
                block: e.block,
            })?,
        };
        Ok(match self.float_matmul {
            FloatMatmul::F32 => m,
            FloatMatmul::Bf16Stored | FloatMatmul::Bf16 => m.with_bf16_dots(),
        })
    }

    fn weight_bytes(&self, weight: &WeightMatrix) -> usize {
        weight.data().num_bytes()
    }

    fn load_vector(&self, values: &[f32]) -> Result<Vec<f32>, LoadTensorError> {
        Ok(values.to_vec())
    }

    fn load_lora_matrix(
        &self,
        values: &[f32],
        dtype: kiln_backend::LoraDtype,
    ) -> Result<Self::LoraMatrix, LoadTensorError> {
        crate::lora::LoraValues::load(values, dtype)
    }

    fn load_rope(&self, config: &RopeConfig) -> Result<Rope, LoadTensorError> {
        let max = crate::rope::MAX_ROTARY_DIM;
        let d = config.rotary_dim;
        if d == 0 || !d.is_multiple_of(2) || d > max {
            return Err(LoadTensorError::Unsupported(format!(
                "rotary dimension {d} (must be even, 2..={max})"
            )));
        }
        if config.freq_factors.as_ref().is_some_and(|f| f.len() != d / 2) {
            return Err(LoadTensorError::Unsupported("one RoPE frequency factor per pair".into()));
        }
        Ok(Rope::from_config(config))
    }

    fn alloc_kv(&self, spec: KvCacheSpec) -> Result<CpuKvStore, ForwardError> {
        kiln_backend::check_block_size(spec.block_size)
            .map_err(|e| ForwardError::KvLayout(format!("block size {e}")))?;
        Ok(CpuKvStore::new(spec))
    }

    fn kv_spec(&self, kv: &CpuKvStore) -> KvCacheSpec {
        kv.spec()
    }

    fn kv_block_bytes(&self, kv: &CpuKvStore) -> usize {
        kv.block_bytes()
    }

    fn read_kv_block(&self, kv: &CpuKvStore, block: usize, out: &mut [u8]) {
        kv.read_block(block, out);
    }

    fn write_kv_block(&self, kv: &mut CpuKvStore, block: usize, data: &[u8]) {
        kv.write_block(block, data);
    }

    fn new_buffer(&self) -> Vec<f32> {
        Vec::new()
    }

    fn reserve(&self, buf: &mut Vec<f32>, len: usize) {
        host_rows::reserve(buf, len);
    }

    fn view(buf: &Vec<f32>, range: Range<usize>) -> &[f32] {
        &buf[range]
    }

    fn view_mut(buf: &mut Vec<f32>, range: Range<usize>) -> &mut [f32] {
        &mut buf[range]
    }

    fn embed(&self, table: &WeightMatrix, token_ids: &[u32], scale: Option<f32>, out: &mut [f32]) {
        let h = table.cols();
        for (row, &token) in out.chunks_exact_mut(h).zip(token_ids) {
            table.row_to_f32(token as usize, row);
            if let Some(scale) = scale {
                for x in row.iter_mut() {
                    *x *= scale;
                }
            }
        }
    }

    fn linear(&self, x: &[f32], m: usize, jobs: &mut [LinearJob<'_, Self>]) {
        let pool = &self.pool;
        match jobs {
            [] => {}
            [a] => linear_multi(pool, x, m, &mut [kernel_job(a)]),
            [a, b] => linear_multi(pool, x, m, &mut [kernel_job(a), kernel_job(b)]),
            [a, b, c] => {
                linear_multi(pool, x, m, &mut [kernel_job(a), kernel_job(b), kernel_job(c)]);
            }
            [a, b, c, d] => linear_multi(
                pool,
                x,
                m,
                &mut [kernel_job(a), kernel_job(b), kernel_job(c), kernel_job(d)],
            ),
            _ => panic!("linear: at most {} matrices", kiln_backend::MAX_LINEAR_JOBS),
        }
    }

    fn rms_norm(&self, x: &[f32], weight: &Vec<f32>, eps: f32, out: &mut [f32]) {
        rms_norm(&self.pool, x, weight, eps, out);
    }

    fn rms_norm_inplace(&self, x: &mut [f32], weight: &Vec<f32>, eps: f32) {
        rms_norm_inplace(&self.pool, x, weight, eps);
    }

    fn residual_norm(
        &self,
        d: usize,
        branch: &mut [f32],
        post: Option<&Vec<f32>>,
        x: &mut [f32],
        next: Option<(&Vec<f32>, &mut [f32])>,
        eps: f32,
    ) {
        let next = next.map(|(w, out)| (w.as_slice(), out));
        residual_norm(&self.pool, d, branch, post.map(Vec::as_slice), x, next, eps);
    }

    fn rope_table(&self, rope: &Rope, positions: &[u32], table: &mut [f32]) {
        rope.table(positions, table);
    }

    fn rope_apply(&self, rope: &Rope, x: &mut [f32], num_heads: usize, table: &[f32]) {
        rope.apply_table(&self.pool, x, num_heads, table);
    }

    fn gated_act(&self, act: GateActivation, gate: &mut [f32], up: &[f32]) {
        gated_act_inplace(&self.pool, act, gate, up);
    }

    fn write_kv(
        &self,
        kv: &mut CpuKvStore,
        layer: usize,
        k: &[f32],
        v: &[f32],
        slot_mapping: &[u32],
    ) {
        match kv.layer_mut(layer) {
            KvLayerMut::F32(kc, vc) => write_kv(k, v, slot_mapping, kc, vc),
            KvLayerMut::F16(kc, vc) => write_kv(k, v, slot_mapping, kc, vc),
            KvLayerMut::Q8(codec, kc, vc) => write_kv_quant(codec, k, v, slot_mapping, kc, vc),
        }
    }

    fn paged_attention(
        &self,
        kv: &CpuKvStore,
        layer: usize,
        q: &[f32],
        seqs: &[SeqSpan],
        block_tables: &[u32],
        (tree, sinks): (Option<TreeMask<'_>>, Option<&Vec<f32>>),
        shape: &AttentionShape,
        out: &mut [f32],
    ) {
        if seqs.is_empty() {
            return;
        }
        let pool = &self.pool;
        let masks = (tree, sinks.map(Vec::as_slice));
        match kv.layer(layer) {
            KvLayer::F32(kc, vc) => {
                paged_attention_with_sinks(
                    pool,
                    q,
                    (kc, vc),
                    seqs,
                    block_tables,
                    masks,
                    shape,
                    out,
                );
            }
            KvLayer::F16(kc, vc) => {
                paged_attention_with_sinks(
                    pool,
                    q,
                    (kc, vc),
                    seqs,
                    block_tables,
                    masks,
                    shape,
                    out,
                );
            }
            KvLayer::Q8(codec, k, v) => {
                let kv = QuantKv { codec, k, v };
                paged_attention_quant_with_sinks(
                    pool,
                    q,
                    kv,
                    seqs,
                    block_tables,
                    masks,
                    shape,
                    out,
                );
            }
        }
    }

    fn supports_attention_sinks(&self) -> bool {
        true
    }

    fn supports_token_trees(&self) -> bool {
        true
    }

    fn copy_kv_slots(&self, kv: &mut CpuKvStore, pairs: &[(u32, u32)]) {
        kv.copy_slots(pairs);
    }

    fn supports_latent_attention(&self) -> bool {
        true
    }

    fn copy_strided(
        &self,
        src: &[f32],
        s: Strides,
        dst: &mut [f32],
        d: Strides,
        counts: (usize, usize, usize),
    ) {
        host_rows::copy_strided(src, s, dst, d, counts);
    }

    fn compact_rows(&self, buf: &mut [f32], width: usize, rows: &[usize]) {
        host_rows::compact_rows(buf, width, rows);
    }

    fn gather_rows(&self, src: &[f32], width: usize, rows: &[usize], dst: &mut [f32]) {
        host_rows::gather_rows(src, width, rows, dst);
    }

    fn supports_lora(&self) -> bool {
        true
    }

    fn supports_pooling(&self) -> bool {
        true
    }

    fn supports_encoders(&self) -> bool {
        true
    }

    fn layer_norm(
        &self,
        d: usize,
        x: &mut [f32],
        branch: Option<&[f32]>,
        (weight, bias): (&Vec<f32>, &Vec<f32>),
        eps: f32,
    ) {
        assert_eq!(weight.len(), d, "layer norm width");
        layer_norm(&self.pool, x, branch, (weight, bias), eps);
    }

    fn activation(&self, act: GateActivation, x: &mut [f32]) {
        if let Err(message) = act_inplace(&self.pool, act, x) {
            unreachable!("{message}: encoders are loaded with ungated activations only");
        }
    }

    fn rows_to_host(&self, x: &[f32], m: usize, width: usize, out: &mut Logits) {
        out.reset(m, width);
        out.as_mut_slice().copy_from_slice(&x[..m * width]);
    }

    fn lora_add(&self, x: &[f32], k: usize, n: usize, jobs: &[LoraJob<'_, Self>], out: &mut [f32]) {
        crate::lora::lora_add(&self.pool, x, k, n, jobs, out);
    }

    fn supports_permuted_inputs(&self) -> bool {
        true
    }

    fn permute_cols(&self, x: &[f32], m: usize, order: &[usize], out: &mut [f32]) {
        let len = m * order.len();
        host_rows::permute_cols(&x[..len], order, &mut out[..len]);
    }

    fn supports_experts(&self) -> bool {
        true
    }

    fn linear_experts(
        &self,
        x: &Vec<f32>,
        k: usize,
        offsets: &[usize],
        jobs: &mut [ExpertLinearJob<'_, Self>],
    ) {
        let run = |jobs: &mut [crate::ExpertJob<'_>]| {
            crate::linear_experts(&self.pool, x, k, offsets, jobs);
        };
        match jobs {
            [] => {}
            [a] => run(&mut [expert_job(a)]),
            [a, b] => run(&mut [expert_job(a), expert_job(b)]),
            [a, b, c] => run(&mut [expert_job(a), expert_job(b), expert_job(c)]),
            [a, b, c, d] => run(&mut [expert_job(a), expert_job(b), expert_job(c), expert_job(d)]),
            _ => panic!("linear_experts: at most {} matrices", kiln_backend::MAX_LINEAR_JOBS),
        }
        // Each expert's bias on its own rows: one addition per element after the matmul.
        for job in jobs.iter_mut() {
            let Some(biases) = job.biases else { continue };
            for (e, bias) in biases.iter().enumerate() {
                let rows = offsets[e] * job.width..offsets[e + 1] * job.width;
                for row in job.out[rows].chunks_exact_mut(job.width) {
                    for (o, b) in row.iter_mut().zip(bias) {
                        *o += b;
                    }
                }
            }
        }
    }

    fn combine_rows(
        &self,
        src: &[f32],
        width: usize,
        k: usize,
        rows: &[usize],
        weights: &[f32],
        out: &mut [f32],
    ) {
        /// Tokens per task: enough work to pay for a dispatch.
        const TOKENS: usize = 8;
        let n = rows.len() / k;
        let shared = SharedMut::new(&mut out[..n * width]);
        self.pool.run(n.div_ceil(TOKENS), |task| {
            let t = task * TOKENS..((task + 1) * TOKENS).min(n);
            // SAFETY: each task owns output rows `t`, inside `out[..n * width]`.
            let o = unsafe { shared.slice(t.start * width, t.len() * width) };
            let picks = t.start * k..t.end * k;
            host_rows::combine_rows(src, width, k, &rows[picks.clone()], &weights[picks], o);
        });
    }

    fn logits(
        &self,
        x: &[f32],
        m: usize,
        head: &WeightMatrix,
        softcap: Option<f32>,
        out: &mut Logits,
    ) {
        out.reset(m, head.rows());
        crate::linear(&self.pool, x, m, head, None, out.as_mut_slice());
        if let Some(cap) = softcap {
            out.as_mut_slice().iter_mut().for_each(|x| *x = cap * (*x / cap).tanh());
        }
    }
}
