//! Small vector primitives used inside other kernels: the dot product (norms). It has a
//! scalar reference and AVX-512 (and AVX2) variants. (Greedy sampling's argmax is in
//! `kiln_core::host_ops`, where the engine reaches it without the kernels.)

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

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

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
}
