//! Small vector primitives used inside other kernels: the dot product (norms) and the argmax
//! of greedy sampling. Each has a scalar reference and AVX-512 (and AVX2) variants.

use crate::SimdLevel;

/// `sum(a[i] * b[i])`; `a` and `b` have equal length.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_at(SimdLevel::detect(), a, b)
}

/// [`dot`] at a chosen SIMD level (falls back to scalar when the CPU lacks it).
pub fn dot_at(level: SimdLevel, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    {
        if level == SimdLevel::Avx512 && SimdLevel::detect() >= SimdLevel::Avx512 {
            // SAFETY: the CPU supports AVX-512F (checked above); lengths are equal.
            return unsafe { x86::dot_avx512(a, b) };
        }
        if level >= SimdLevel::Avx2 && SimdLevel::detect() >= SimdLevel::Avx2 {
            // SAFETY: the CPU supports AVX2 and FMA (checked above); lengths are equal.
            return unsafe { x86::dot_avx2(a, b) };
        }
    }
    let _ = level;
    dot_scalar(a, b)
}

pub fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Index of the first largest value, ignoring NaN (0 when nothing beats `-inf`): greedy
/// sampling over a vocabulary. The maximum is exact, so every path returns the same index.
pub fn argmax(values: &[f32]) -> usize {
    argmax_at(SimdLevel::detect(), values)
}

/// [`argmax`] at a chosen SIMD level (scalar if the CPU lacks it).
pub fn argmax_at(level: SimdLevel, values: &[f32]) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        if level == SimdLevel::Avx512 && SimdLevel::detect() >= SimdLevel::Avx512 {
            // SAFETY: AVX-512F is available.
            return unsafe { x86::argmax_avx512(values) };
        }
        if level >= SimdLevel::Avx2 && SimdLevel::detect() >= SimdLevel::Avx2 {
            // SAFETY: AVX2 is available.
            return unsafe { x86::argmax_avx2(values) };
        }
    }
    let _ = level;
    argmax_scalar(values)
}

pub fn argmax_scalar(values: &[f32]) -> usize {
    let mut best = 0usize;
    let mut best_val = f32::NEG_INFINITY;
    for (i, &v) in values.iter().enumerate() {
        if v > best_val {
            best = i;
            best_val = v;
        }
    }
    best
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Two passes: the maximum (exact; `max(v, acc)` keeps `acc` when `v` is NaN), then the
    /// first index holding it.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn argmax_avx512(values: &[f32]) -> usize {
        let chunks = values.chunks_exact(16);
        let tail = chunks.remainder();
        let mut acc = _mm512_set1_ps(f32::NEG_INFINITY);
        for c in chunks {
            // SAFETY: `c` holds 16 floats.
            acc = _mm512_max_ps(unsafe { _mm512_loadu_ps(c.as_ptr()) }, acc);
        }
        let mut max = _mm512_reduce_max_ps(acc);
        for &v in tail {
            if v > max {
                max = v;
            }
        }
        if max == f32::NEG_INFINITY {
            return 0;
        }
        let target = _mm512_set1_ps(max);
        for (i, c) in values.chunks_exact(16).enumerate() {
            // SAFETY: `c` holds 16 floats.
            let hits = _mm512_cmpeq_ps_mask(unsafe { _mm512_loadu_ps(c.as_ptr()) }, target);
            if hits != 0 {
                return i * 16 + hits.trailing_zeros() as usize;
            }
        }
        let start = values.len() - tail.len();
        start + tail.iter().position(|&v| v == max).unwrap_or(0)
    }

    /// [`argmax_avx512`] with 8 lanes.
    #[target_feature(enable = "avx2")]
    pub unsafe fn argmax_avx2(values: &[f32]) -> usize {
        let chunks = values.chunks_exact(8);
        let tail = chunks.remainder();
        let mut acc = _mm256_set1_ps(f32::NEG_INFINITY);
        for c in chunks {
            // SAFETY: `c` holds 8 floats.
            acc = _mm256_max_ps(unsafe { _mm256_loadu_ps(c.as_ptr()) }, acc);
        }
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
        let mut max = lanes.into_iter().fold(f32::NEG_INFINITY, f32::max);
        for &v in tail {
            if v > max {
                max = v;
            }
        }
        if max == f32::NEG_INFINITY {
            return 0;
        }
        let target = _mm256_set1_ps(max);
        for (i, c) in values.chunks_exact(8).enumerate() {
            // SAFETY: `c` holds 8 floats.
            let eq = _mm256_cmp_ps::<_CMP_EQ_OQ>(unsafe { _mm256_loadu_ps(c.as_ptr()) }, target);
            let hits = _mm256_movemask_ps(eq);
            if hits != 0 {
                return i * 8 + hits.trailing_zeros() as usize;
            }
        }
        let start = values.len() - tail.len();
        start + tail.iter().position(|&v| v == max).unwrap_or(0)
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc0 = _mm512_setzero_ps();
        let mut acc1 = _mm512_setzero_ps();
        let mut i = 0;
        // SAFETY (whole body): every load reads 16 floats at `i` with `i + 16 <= n` (or `+ 32`).
        unsafe {
            while i + 32 <= n {
                acc0 =
                    _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc0);
                acc1 = _mm512_fmadd_ps(
                    _mm512_loadu_ps(pa.add(i + 16)),
                    _mm512_loadu_ps(pb.add(i + 16)),
                    acc1,
                );
                i += 32;
            }
            if i + 16 <= n {
                acc0 =
                    _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc0);
                i += 16;
            }
            if i < n {
                let mask: __mmask16 = (1u16 << (n - i)) - 1;
                let x = _mm512_maskz_loadu_ps(mask, pa.add(i));
                let y = _mm512_maskz_loadu_ps(mask, pb.add(i));
                acc1 = _mm512_fmadd_ps(x, y, acc1);
            }
        }
        _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1))
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        // SAFETY (whole body): each load reads 8 floats at `i` with `i + 8 <= n` (or `+ 16`).
        unsafe {
            while i + 16 <= n {
                acc0 =
                    _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
                acc1 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(pa.add(i + 8)),
                    _mm256_loadu_ps(pb.add(i + 8)),
                    acc1,
                );
                i += 16;
            }
            if i + 8 <= n {
                acc0 =
                    _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
                i += 8;
            }
        }
        let mut sum = hsum256(_mm256_add_ps(acc0, acc1));
        while i < n {
            sum += a[i] * b[i];
            i += 1;
        }
        sum
    }

    #[target_feature(enable = "avx2")]
    pub fn hsum256(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::hsum256;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::values;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / 4e9 - 0.5).collect()
    }

    #[test]
    fn simd_variants_match_scalar_over_odd_lengths() {
        for level in SimdLevel::available() {
            for n in [0usize, 1, 3, 7, 8, 15, 16, 17, 31, 33, 64, 100, 257] {
                let (a, b) = (data(n, 1), data(n, 7));
                let want = dot_scalar(&a, &b);
                let got = dot_at(level, &a, &b);
                assert!((want - got).abs() <= 1e-5 * (1.0 + want.abs()), "{level:?} n={n}");
            }
        }
    }

    #[test]
    fn argmax_equals_scalar_with_ties_nans_and_tails() {
        for level in SimdLevel::available() {
            for n in [1, 7, 9, 15, 16, 17, 100, 262_147] {
                let mut v = values(n, 7, 10.0);
                assert_eq!(argmax_at(level, &v), argmax_scalar(&v), "{level:?} n={n}");
                // A tie: the first index wins.
                let m = argmax_scalar(&v);
                v[n - 1] = v[m];
                assert_eq!(argmax_at(level, &v), argmax_scalar(&v), "{level:?} tie n={n}");
                v[0] = f32::NAN;
                assert_eq!(argmax_at(level, &v), argmax_scalar(&v), "{level:?} nan n={n}");
            }
            assert_eq!(argmax_at(level, &[f32::NEG_INFINITY; 40]), 0);
            assert_eq!(argmax_at(level, &[f32::NAN; 40]), 0);
            let mut v = vec![f32::NEG_INFINITY; 40];
            v[37] = 1.0;
            assert_eq!(argmax_at(level, &v), 37);
        }
    }
}
