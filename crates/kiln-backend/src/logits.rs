//! Logits in host memory: what every backend hands back for sampling.

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
    pub fn as_slice(&self) -> &[f32] {
        &self.data[self.start..][..self.num_rows * self.vocab_size]
    }

    /// All rows, `[num_rows, vocab_size]`, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.data[self.start..][..self.num_rows * self.vocab_size]
    }
}
