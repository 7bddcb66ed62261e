//! Host helpers every layer may use on a backend's logits (host memory), without the kernels:
//! the argmax of greedy sampling.
//!
//! Invariant: [`argmax`] returns the first index of the largest value, NaN never winning, and 0
//! when nothing beats `-inf`; every path (scalar, AVX2, AVX-512) gives the same index, because
//! the maximum is exact and the index is found in a second pass.

/// Index of the first largest value, ignoring NaN (0 when nothing beats `-inf`): greedy
/// sampling over a vocabulary, on the widest vector unit the CPU has.
pub fn argmax(values: &[f32]) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F is available.
            return unsafe { x86::argmax_avx512(values) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is available.
            return unsafe { x86::argmax_avx2(values) };
        }
    }
    argmax_scalar(values)
}

/// The scalar reference of [`argmax`].
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

/// The vector variants, for callers that choose the path themselves.
#[cfg(target_arch = "x86_64")]
pub mod x86 {
    use std::arch::x86_64::*;

    /// Two passes: the maximum (exact; `max(v, acc)` keeps `acc` when `v` is NaN), then the
    /// first index holding it.
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
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
    ///
    /// # Safety
    /// The CPU must support AVX2.
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An argmax path.
    type Path = fn(&[f32]) -> usize;

    /// Every path the CPU has, by name.
    fn paths() -> Vec<(&'static str, Path)> {
        let mut paths: Vec<(&'static str, Path)> =
            vec![("scalar", argmax_scalar), ("dispatched", argmax)];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: AVX2 is available.
                paths.push(("avx2", |v| unsafe { x86::argmax_avx2(v) }));
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: AVX-512F is available.
                paths.push(("avx512", |v| unsafe { x86::argmax_avx512(v) }));
            }
        }
        paths
    }

    /// `n` values in `[-10, 10)` from a fixed linear congruential sequence.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 20.0 - 10.0
            })
            .collect()
    }

    #[test]
    fn every_path_equals_scalar_with_ties_nans_and_tails() {
        for (name, f) in paths() {
            for n in [1, 7, 9, 15, 16, 17, 100, 262_147] {
                let mut v = values(n, 7);
                assert_eq!(f(&v), argmax_scalar(&v), "{name} n={n}");
                // A tie: the first index wins.
                let m = argmax_scalar(&v);
                v[n - 1] = v[m];
                assert_eq!(f(&v), argmax_scalar(&v), "{name} tie n={n}");
                v[0] = f32::NAN;
                assert_eq!(f(&v), argmax_scalar(&v), "{name} nan n={n}");
            }
            assert_eq!(f(&[f32::NEG_INFINITY; 40]), 0);
            assert_eq!(f(&[f32::NAN; 40]), 0);
            let mut v = vec![f32::NEG_INFINITY; 40];
            v[37] = 1.0;
            assert_eq!(f(&v), 37, "{name}");
        }
    }
}
