//! Activation rows quantized to 8 bits for the integer-dot kernels.
//!
//! Row `i` of `x[m, k]` is cut into blocks of `block` elements (32 for Q4_0/Q5_0/Q8_0 weights,
//! 256 for K-quant weights); each block gets `d = max|x| / 127` and `q = round(x / d)` in
//! `-127..=127`, plus the integer sums of `q` per 16 and per 32 elements that the kernels use
//! for the weight offsets and K-quant mins. Each row is quantized independently, so a row's
//! values never depend on the other rows of the batch.

use std::ops::Range;

use crate::ThreadPool;
use crate::thread_pool::SharedMut;

/// Rows quantized per pool task.
const ROWS_PER_TASK: usize = 8;

/// Quantized activations `[m, k]`, reused across calls (buffers only grow).
#[derive(Default)]
pub(crate) struct QuantActs {
    pub m: usize,
    pub k: usize,
    pub block: usize,
    /// `[m, k]`
    pub qs: Vec<i8>,
    /// `[m, k / block]`
    pub d: Vec<f32>,
    /// `[m, k / 16]`
    pub s16: Vec<i32>,
    /// `[m, k / 32]`
    pub s32: Vec<i32>,
    /// `[m, k / 64]`: `(s32[2p], s32[2p + 1])` as the low and high i16.
    pub pairs: Vec<i32>,
}

impl QuantActs {
    /// Quantizes `x[m, k]` with blocks of `block` (`k % block == 0`, `block % 64 == 0` or 32).
    pub fn quantize(&mut self, pool: &ThreadPool, x: &[f32], m: usize, k: usize, block: usize) {
        assert!(k.is_multiple_of(block) && x.len() == m * k);
        self.m = m;
        self.k = k;
        self.block = block;
        grow(&mut self.qs, m * k);
        grow(&mut self.d, m * k / block);
        grow(&mut self.s16, m * k / 16);
        grow(&mut self.s32, m * k / 32);
        grow(&mut self.pairs, (m * k).div_ceil(64));
        let ptrs = (
            SharedMut::new(&mut self.qs),
            SharedMut::new(&mut self.d),
            SharedMut::new(&mut self.s16),
            SharedMut::new(&mut self.s32),
            SharedMut::new(&mut self.pairs),
        );
        let run = |rows: Range<usize>| {
            for i in rows {
                // SAFETY: each task writes only its own rows' ranges of the buffers grown above.
                let (qs, d, s16, s32, pairs) = unsafe {
                    (
                        ptrs.0.slice(i * k, k),
                        ptrs.1.slice(i * k / block, k / block),
                        ptrs.2.slice(i * k / 16, k / 16),
                        ptrs.3.slice(i * k / 32, k / 32),
                        ptrs.4.slice(i * (k / 64), k / 64),
                    )
                };
                quantize_row(&x[i * k..(i + 1) * k], block, qs, d, s16, s32, pairs);
            }
        };
        if m * k >= 1 << 15 {
            pool.run(m.div_ceil(ROWS_PER_TASK), |t| {
                run(t * ROWS_PER_TASK..((t + 1) * ROWS_PER_TASK).min(m));
            });
        } else {
            run(0..m);
        }
    }
}

fn grow<T: Default + Clone>(v: &mut Vec<T>, len: usize) {
    if v.len() < len {
        v.resize(len, T::default());
    }
}

/// Quantizes one row (see the module docs).
fn quantize_row(
    x: &[f32],
    block: usize,
    qs: &mut [i8],
    d: &mut [f32],
    s16: &mut [i32],
    s32: &mut [i32],
    pairs: &mut [i32],
) {
    for ((xb, qb), db) in x.chunks_exact(block).zip(qs.chunks_exact_mut(block)).zip(d.iter_mut()) {
        let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let scale = amax / 127.0;
        let inv = if scale > 0.0 { 127.0 / amax } else { 0.0 };
        *db = scale;
        for (q, v) in qb.iter_mut().zip(xb) {
            *q = (v * inv).round() as i8;
        }
    }
    for (s, q) in s16.iter_mut().zip(qs.chunks_exact(16)) {
        *s = q.iter().map(|v| i32::from(*v)).sum();
    }
    for (j, s) in s32.iter_mut().enumerate() {
        *s = s16[2 * j] + s16[2 * j + 1];
    }
    for (p, v) in pairs.iter_mut().enumerate() {
        *v = (s32[2 * p] & 0xFFFF) | (s32[2 * p + 1] << 16);
    }
}
