//! Activation rows quantized to 8 bits for the integer-dot kernels.
//!
//! Row `i` of `x[m, k]` is cut into blocks of `block` elements (32 for Q4_0/Q5_0/Q8_0 weights,
//! 256 for K-quant weights); each block gets `d = max|x| / 127` and `q = round(x / d)` (to
//! nearest, ties to even: the SIMD and scalar paths agree bit for bit) in
//! `-127..=127`, plus the integer sums of `q` per 16 and per 32 elements that the kernels use
//! for the weight offsets and K-quant mins (and, with blocks of 32, the AVX2 kernel's offset
//! shares [`QuantActs::neg16_halves`]). Each row is quantized independently, so a row's values
//! never depend on the other rows of the batch.

use std::ops::Range;

use super::repack::UNIT;
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
    /// `[m, k / 32]`, blocks of 32 only: `−16·Σ q_j` over the block's `j` with `j % 4 < 2` as
    /// the low i16 and over `j % 4 ≥ 2` as the high one (each at most `16·16·127` in size).
    /// These are the elements that the low and high 16-bit half of a `vpmaddubsw` lane sum
    /// (4 consecutive bytes per 32-bit lane), so the AVX2 kernel starts its 16-bit sums from
    /// them and gets Q4_0 / Q5_0's offset correction without a step of its own.
    pub neg16_halves: Vec<i32>,
}

impl QuantActs {
    /// The quantized activations of unit `u` (columns `256·u..`) of rows `i..i + R`.
    ///
    /// # Safety
    /// Rows `i..i + R` are below `m` and unit `u` starts below `k`.
    #[inline(always)] // inlines into the `#[target_feature]` kernels
    #[allow(clippy::inline_always)]
    pub unsafe fn unit_rows<const R: usize>(&self, i: usize, u: usize) -> [*const i8; R] {
        // SAFETY: the offsets stay inside `qs` (`[m, k]`), as the caller guarantees.
        std::array::from_fn(|r| unsafe { self.qs.as_ptr().add((i + r) * self.k + u * UNIT) })
    }

    /// The 16 sums of 16 activations of unit `u` of rows `i..i + R` (in `s16`).
    ///
    /// # Safety
    /// As [`Self::unit_rows`].
    #[inline(always)] // inlines into the `#[target_feature]` kernels
    #[allow(clippy::inline_always)]
    pub unsafe fn unit_sums16<const R: usize>(&self, i: usize, u: usize) -> [*const i32; R] {
        let per_row = self.k / 16;
        // SAFETY: the offsets stay inside `s16` (`[m, k / 16]`), as the caller guarantees.
        std::array::from_fn(|r| unsafe { self.s16.as_ptr().add((i + r) * per_row + u * 16) })
    }

    /// Quantizes `x[m, k]` with blocks of `block` (`k % block == 0`, `block % 64 == 0` or 32).
    pub fn quantize(&mut self, pool: &ThreadPool, x: &[f32], m: usize, k: usize, block: usize) {
        self.quantize_on(Some(pool), x, m, k, block);
    }

    /// [`Self::quantize`] on the calling thread alone (inside a pool task).
    pub fn quantize_here(&mut self, x: &[f32], m: usize, k: usize, block: usize) {
        self.quantize_on(None, x, m, k, block);
    }

    fn quantize_on(
        &mut self,
        pool: Option<&ThreadPool>,
        x: &[f32],
        m: usize,
        k: usize,
        block: usize,
    ) {
        assert!(k.is_multiple_of(block) && x.len() == m * k);
        self.m = m;
        self.k = k;
        self.block = block;
        grow(&mut self.qs, m * k);
        grow(&mut self.d, m * k / block);
        grow(&mut self.s16, m * k / 16);
        grow(&mut self.s32, m * k / 32);
        grow(&mut self.pairs, (m * k).div_ceil(64));
        let halves = if block == 32 { k / 32 } else { 0 };
        grow(&mut self.neg16_halves, m * halves);
        let ptrs = (
            SharedMut::new(&mut self.qs),
            SharedMut::new(&mut self.d),
            SharedMut::new(&mut self.s16),
            SharedMut::new(&mut self.s32),
            SharedMut::new(&mut self.pairs),
            SharedMut::new(&mut self.neg16_halves),
        );
        let run = |rows: Range<usize>| {
            for i in rows {
                // SAFETY: each task writes only its own rows' ranges of the buffers grown above.
                let (qs, d, s16, s32, pairs, neg16) = unsafe {
                    (
                        ptrs.0.slice(i * k, k),
                        ptrs.1.slice(i * k / block, k / block),
                        ptrs.2.slice(i * k / 16, k / 16),
                        ptrs.3.slice(i * k / 32, k / 32),
                        ptrs.4.slice(i * (k / 64), k / 64),
                        ptrs.5.slice(i * halves, halves),
                    )
                };
                let sums = Sums { s16, s32, pairs, neg16_halves: neg16 };
                quantize_row(&x[i * k..(i + 1) * k], block, qs, d, sums);
            }
        };
        if let Some(pool) = pool.filter(|_| m * k >= 1 << 15) {
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

/// One row's slices of the sums [`QuantActs`] keeps (`neg16_halves` empty unless blocks of 32).
struct Sums<'a> {
    s16: &'a mut [i32],
    s32: &'a mut [i32],
    pairs: &'a mut [i32],
    neg16_halves: &'a mut [i32],
}

/// Quantizes one row (see the module docs).
fn quantize_row(x: &[f32], block: usize, qs: &mut [i8], d: &mut [f32], sums: Sums<'_>) {
    let Sums { s16, s32, pairs, neg16_halves } = sums;
    let level = crate::SimdLevel::detect();
    for ((xb, qb), db) in x.chunks_exact(block).zip(qs.chunks_exact_mut(block)).zip(d.iter_mut()) {
        let amax = abs_max(level, xb);
        let scale = amax / 127.0;
        let inv = if scale > 0.0 { 127.0 / amax } else { 0.0 };
        *db = scale;
        round_to_i8(level, xb, inv, qb);
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
    for (v, q) in neg16_halves.iter_mut().zip(qs.chunks_exact(32)) {
        let (mut lo, mut hi) = (0i32, 0i32);
        for four in q.chunks_exact(4) {
            lo += i32::from(four[0]) + i32::from(four[1]);
            hi += i32::from(four[2]) + i32::from(four[3]);
        }
        *v = ((-16 * lo) & 0xFFFF) | ((-16 * hi) << 16);
    }
}

/// `max |x|` (a maximum is exact, so every path gives the same value).
fn abs_max(level: crate::SimdLevel, x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if level == crate::SimdLevel::Avx512 && x.len().is_multiple_of(16) {
        // SAFETY: AVX-512F is available (`level` comes from detection); whole vectors only.
        return unsafe { x86::abs_max_avx512(x) };
    }
    #[cfg(target_arch = "x86_64")]
    if level >= crate::SimdLevel::Avx2 && x.len().is_multiple_of(8) {
        // SAFETY: AVX2 is available (`level` comes from detection); whole vectors only.
        return unsafe { x86::abs_max_avx2(x) };
    }
    let _ = level;
    x.iter().fold(0.0f32, |a, v| a.max(v.abs()))
}

/// `q[i] = round_ties_even(x[i] * inv)` (values within `-127..=127`).
fn round_to_i8(level: crate::SimdLevel, x: &[f32], inv: f32, q: &mut [i8]) {
    #[cfg(target_arch = "x86_64")]
    if level == crate::SimdLevel::Avx512 && x.len().is_multiple_of(16) {
        // SAFETY: AVX-512F is available; `q` has `x.len()` elements (checked by the caller's
        // equal chunking); whole vectors only.
        return unsafe { x86::round_to_i8_avx512(x, inv, q) };
    }
    #[cfg(target_arch = "x86_64")]
    if level >= crate::SimdLevel::Avx2 && x.len().is_multiple_of(32) {
        // SAFETY: AVX2 is available; `q` has `x.len()` elements; whole 32-float groups only.
        return unsafe { x86::round_to_i8_avx2(x, inv, q) };
    }
    let _ = level;
    for (q, v) in q.iter_mut().zip(x) {
        *q = (v * inv).round_ties_even() as i8;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn abs_max_avx512(x: &[f32]) -> f32 {
        let mut m = _mm512_setzero_ps();
        for c in x.chunks_exact(16) {
            // SAFETY: `c` holds 16 floats.
            m = _mm512_max_ps(m, _mm512_abs_ps(unsafe { _mm512_loadu_ps(c.as_ptr()) }));
        }
        _mm512_reduce_max_ps(m)
    }

    #[target_feature(enable = "avx2")]
    pub unsafe fn abs_max_avx2(x: &[f32]) -> f32 {
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_setzero_ps();
        for c in x.chunks_exact(8) {
            // SAFETY: `c` holds 8 floats.
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, unsafe { _mm256_loadu_ps(c.as_ptr()) }));
        }
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m) };
        lanes.into_iter().fold(0.0f32, f32::max)
    }

    /// 32 floats at a time: four conversions (to nearest, ties to even, as the default MXCSR
    /// mode rounds), packed to bytes with saturation, lanes put back in order.
    #[target_feature(enable = "avx2")]
    pub unsafe fn round_to_i8_avx2(x: &[f32], inv: f32, q: &mut [i8]) {
        assert_eq!(x.len(), q.len());
        let inv = _mm256_set1_ps(inv);
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (c, out) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)) {
            // SAFETY: `c` holds 32 floats and `out` 32 bytes.
            unsafe {
                let cvt = |j: usize| {
                    _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(c.as_ptr().add(8 * j)), inv))
                };
                // Lanes after the packs: [a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7].
                let ab = _mm256_packs_epi32(cvt(0), cvt(1));
                let cd = _mm256_packs_epi32(cvt(2), cvt(3));
                let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), order);
                _mm256_storeu_si256(out.as_mut_ptr().cast(), bytes);
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn round_to_i8_avx512(x: &[f32], inv: f32, q: &mut [i8]) {
        assert_eq!(x.len(), q.len());
        let inv = _mm512_set1_ps(inv);
        for (c, out) in x.chunks_exact(16).zip(q.chunks_exact_mut(16)) {
            // SAFETY: `c` holds 16 floats and `out` 16 bytes. The conversion rounds to nearest,
            // ties to even (the default MXCSR mode), like `round_ties_even`.
            unsafe {
                let v = _mm512_mul_ps(_mm512_loadu_ps(c.as_ptr()), inv);
                let i = _mm512_cvtps_epi32(v);
                _mm_storeu_si128(out.as_mut_ptr().cast(), _mm512_cvtsepi32_epi8(i));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SimdLevel;
    use crate::testing::values;

    #[test]
    fn simd_rounding_equals_scalar_including_ties() {
        let mut x = values(256, 9, 10.0);
        // Exact halves: ties must go to even on every path.
        for (i, v) in x.iter_mut().take(32).enumerate() {
            *v = i as f32 - 15.5;
        }
        for level in SimdLevel::available() {
            assert_eq!(abs_max(level, &x), abs_max(SimdLevel::Scalar, &x), "{level:?}");
            let (mut got, mut want) = (vec![0i8; 256], vec![0i8; 256]);
            round_to_i8(level, &x, 3.0, &mut got);
            round_to_i8(SimdLevel::Scalar, &x, 3.0, &mut want);
            assert_eq!(got, want, "{level:?}");
            round_to_i8(level, &x, 1.0, &mut got);
            assert_eq!(got[0], -16, "-15.5 rounds to even");
            assert_eq!(got[1], -14, "-14.5 rounds to even");
        }
    }
}
