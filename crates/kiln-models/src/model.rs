//! The model interface: a stateless forward pass over a caller-owned paged KV cache.

use kiln_kernels::ThreadPool;

use crate::{ForwardBatch, ForwardError, KvLayout, ModelConfig, PagedKvCache};

/// Logits of the batch's `logits_rows`, `[num_rows, vocab_size]`; reused across steps.
///
/// The rows start on a 64-byte boundary (`start` floats into `data`), so the matmul can write
/// them with whole-line non-temporal stores.
#[derive(Clone, Debug, Default)]
pub struct Logits {
    data: Vec<f32>,
    start: usize,
    vocab_size: usize,
    num_rows: usize,
}

/// Floats in 64 bytes.
const LINE_FLOATS: usize = 16;

impl Logits {
    /// Resizes for `num_rows` rows (grows the buffer only when needed).
    pub fn reset(&mut self, num_rows: usize, vocab_size: usize) {
        self.num_rows = num_rows;
        self.vocab_size = vocab_size;
        let len = num_rows * vocab_size + LINE_FLOATS - 1;
        if self.data.len() < len {
            self.data.resize(len, 0.0);
        }
        // f32 is 4-aligned, so the offset to a 64-byte boundary is at most 15 floats.
        self.start = self.data.as_ptr().align_offset(64).min(LINE_FLOATS - 1);
    }

    pub fn num_rows(&self) -> usize {
        self.num_rows
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// `[vocab_size]` logits of row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[self.start + i * self.vocab_size..][..self.vocab_size]
    }

    pub fn row_mut(&mut self, i: usize) -> &mut [f32] {
        &mut self.data[self.start + i * self.vocab_size..][..self.vocab_size]
    }

    /// All rows, `[num_rows, vocab_size]`.
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.data[self.start..][..self.num_rows * self.vocab_size]
    }
}

/// Activation buffers of a forward pass; they grow to the largest batch seen and are reused.
#[derive(Default)]
pub struct ForwardScratch {
    pub(crate) buffers: Vec<Vec<f32>>,
    /// The last layer's attention sequences: one single-query sequence per logits row.
    pub(crate) row_seqs: Vec<kiln_kernels::attention::AttentionSeq>,
}

impl ForwardScratch {
    pub fn new() -> Self {
        Self::default()
    }

    /// Mutable slices of the requested lengths, one per buffer.
    pub(crate) fn take<const N: usize>(&mut self, lens: [usize; N]) -> [&mut [f32]; N] {
        if self.buffers.len() < N {
            self.buffers.resize_with(N, Vec::new);
        }
        for (buf, &len) in self.buffers.iter_mut().zip(&lens) {
            if buf.len() < len {
                buf.resize(len, 0.0);
            }
        }
        let mut iter = self.buffers.iter_mut();
        lens.map(|len| match iter.next() {
            Some(buf) => &mut buf[..len],
            None => unreachable!("buffers were resized to at least N"),
        })
    }
}

/// A causal language model. Implementations are stateless: all per-sequence state lives in the
/// KV cache and the batch.
pub trait Model: Send + Sync {
    fn config(&self) -> &ModelConfig;

    /// The KV cache shape this model writes.
    fn kv_layout(&self) -> KvLayout;

    /// Bytes of weights read by one full forward step (what decode costs in bandwidth).
    fn weight_bytes(&self) -> usize;

    /// Runs the batch: writes this step's K/V into `kv` at the batch's slots and fills `logits`
    /// with one row per entry of `batch.logits_rows()`.
    fn forward(
        &self,
        pool: &ThreadPool,
        batch: &ForwardBatch,
        kv: &mut PagedKvCache,
        scratch: &mut ForwardScratch,
        logits: &mut Logits,
    ) -> Result<(), ForwardError>;
}
