//! The two inner loops of attention with one fixed arithmetic on every ISA:
//! - [`scores`]: `q · k_j` for the keys of a block, each as 16 lane sums (lane `l` accumulates
//!   elements `l, l + 16, ...` with fused multiply-adds, in order) reduced by a fixed tree
//!   (`l + 8`, `+ 4`, `+ 2`, `+ 1`);
//! - [`accumulate`]: `acc[d] = fma(p[j], v_j[d], acc[d])` for keys `j` in order.
//!
//! Keys of a block sit at a fixed stride in the cache (`num_kv_heads * head_dim`). The scalar
//! versions are the reference; the AVX-512 and AVX2 ones perform the same IEEE operations on
//! the same operands (AVX-512 reduces 16 keys at once with a shuffle network that adds exactly
//! the tree's pairs), so results are bitwise equal across ISAs and across block fill levels
//! (tested). With the per-row independence of the loops, that keeps attention outputs
//! independent of batching and chunking.

use crate::SimdLevel;

/// `out[j] = q · k_j` where `k_j = keys[j * stride..][..q.len()]`, for `j < out.len()`.
#[inline]
pub(crate) fn scores(level: SimdLevel, q: &[f32], keys: &[f32], stride: usize, out: &mut [f32]) {
    let hd = q.len();
    if let Some(last) = out.len().checked_sub(1) {
        assert!(keys.len() >= last * stride + hd, "keys out of bounds");
    }
    #[cfg(target_arch = "x86_64")]
    {
        if level == SimdLevel::Avx512 {
            // SAFETY: `level` is at most the detected level; bounds checked above.
            return unsafe { x86::scores_avx512(q, keys, stride, out) };
        }
        if level == SimdLevel::Avx2 {
            // SAFETY: as above.
            return unsafe { x86::scores_avx2(q, keys, stride, out) };
        }
    }
    scores_scalar(q, keys, stride, out);
}

pub(crate) fn scores_scalar(q: &[f32], keys: &[f32], stride: usize, out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        let k = &keys[j * stride..][..q.len()];
        let mut lanes = [0.0f32; 16];
        for (i, (a, b)) in q.iter().zip(k).enumerate() {
            lanes[i % 16] = a.mul_add(*b, lanes[i % 16]);
        }
        *o = reduce16(&lanes);
    }
}

/// The fixed reduction tree of 16 lane sums.
#[inline]
pub(crate) fn reduce16(l: &[f32; 16]) -> f32 {
    let h: [f32; 8] = std::array::from_fn(|i| l[i] + l[i + 8]);
    let q: [f32; 4] = std::array::from_fn(|i| h[i] + h[i + 4]);
    let p = [q[0] + q[2], q[1] + q[3]];
    p[0] + p[1]
}

/// `acc[d] = fma(p[j], v_j[d], acc[d])` for `j` in order, `v_j = rows[j * stride..][..acc.len()]`.
#[inline]
pub(crate) fn accumulate(
    level: SimdLevel,
    acc: &mut [f32],
    p: &[f32],
    rows: &[f32],
    stride: usize,
) {
    if let Some(last) = p.len().checked_sub(1) {
        assert!(rows.len() >= last * stride + acc.len(), "rows out of bounds");
    }
    #[cfg(target_arch = "x86_64")]
    {
        if level == SimdLevel::Avx512 {
            // SAFETY: `level` is at most the detected level; bounds checked above.
            return unsafe { x86::accumulate_avx512(acc, p, rows, stride) };
        }
        if level == SimdLevel::Avx2 {
            // SAFETY: as above.
            return unsafe { x86::accumulate_avx2(acc, p, rows, stride) };
        }
    }
    accumulate_scalar(acc, p, rows, stride);
}

pub(crate) fn accumulate_scalar(acc: &mut [f32], p: &[f32], rows: &[f32], stride: usize) {
    for (j, &pj) in p.iter().enumerate() {
        for (a, v) in acc.iter_mut().zip(&rows[j * stride..]) {
            *a = pj.mul_add(*v, *a);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::reduce16;

    /// 16 lane sums of `q · k` (tail lanes masked).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn lanes512(q: &[f32], k: *const f32) -> __m512 {
        let n = q.len();
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        // SAFETY (all loads): `i + 16 <= n`, or the mask covers only the `n - i` tail lanes;
        // the caller guarantees `n` readable floats at `k`.
        while i + 16 <= n {
            unsafe {
                acc = _mm512_fmadd_ps(
                    _mm512_loadu_ps(q.as_ptr().add(i)),
                    _mm512_loadu_ps(k.add(i)),
                    acc,
                );
            }
            i += 16;
        }
        if i < n {
            let mask: __mmask16 = (1u16 << (n - i)) - 1;
            unsafe {
                let a = _mm512_maskz_loadu_ps(mask, q.as_ptr().add(i));
                let b = _mm512_maskz_loadu_ps(mask, k.add(i));
                // Masked-off lanes keep their sum, like the scalar loop that never visits them.
                acc = _mm512_mask3_fmadd_ps(a, b, acc, mask);
            }
        }
        acc
    }

    /// Pairs of 128-bit quarters `(a.q[i0], a.q[i1], b.q[i0], b.q[i1])`.
    macro_rules! quarters {
        ($a:expr, $b:expr, $imm:literal) => {
            _mm512_shuffle_f32x4::<$imm>($a, $b)
        };
    }

    /// Reduces 16 lane-sum vectors to one vector of 16 results with exactly [`reduce16`]'s
    /// additions. Input position `p` must hold key `4 * (p % 4) + p / 4`; output lane `l` is
    /// key `l`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn reduce16x16(a: &[__m512; 16]) -> __m512 {
        // Step 1: lanes (l, l + 8) of each vector; S_i holds a[2i] in lanes 0..8, a[2i+1] in 8..16.
        let s: [__m512; 8] = std::array::from_fn(|i| {
            let (x, y) = (a[2 * i], a[2 * i + 1]);
            _mm512_add_ps(quarters!(x, y, 0b01_00_01_00), quarters!(x, y, 0b11_10_11_10))
        });
        // Step 2: (l, l + 4); T_t quarter k holds a[4t + k].
        let t: [__m512; 4] = std::array::from_fn(|i| {
            let (x, y) = (s[2 * i], s[2 * i + 1]);
            _mm512_add_ps(quarters!(x, y, 0b10_00_10_00), quarters!(x, y, 0b11_01_11_01))
        });
        // Step 3: (l, l + 2) inside quarters.
        let u: [__m512; 2] = std::array::from_fn(|i| {
            let (x, y) = (t[2 * i], t[2 * i + 1]);
            _mm512_add_ps(
                _mm512_shuffle_ps::<0b01_00_01_00>(x, y),
                _mm512_shuffle_ps::<0b11_10_11_10>(x, y),
            )
        });
        // Step 4: (l, l + 1); lane 4k + m holds T_m quarter k = a[4m + k].
        let (x, y) = (u[0], u[1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(x, y),
            _mm512_shuffle_ps::<0b11_01_11_01>(x, y),
        )
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn scores_avx512(q: &[f32], keys: &[f32], stride: usize, out: &mut [f32]) {
        let mut j = 0;
        while j + 16 <= out.len() {
            let a: [__m512; 16] = std::array::from_fn(|p| {
                let key = j + 4 * (p % 4) + p / 4;
                // SAFETY: the caller checked that every key row is in bounds.
                unsafe { lanes512(q, keys.as_ptr().add(key * stride)) }
            });
            // SAFETY: 16 floats at `out[j..]`.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(j), reduce16x16(&a)) };
            j += 16;
        }
        for (jj, o) in out.iter_mut().enumerate().skip(j) {
            let mut lanes = [0.0f32; 16];
            // SAFETY: as above; 16 floats to `lanes`.
            unsafe {
                let sums = lanes512(q, keys.as_ptr().add(jj * stride));
                _mm512_storeu_ps(lanes.as_mut_ptr(), sums);
            }
            *o = reduce16(&lanes);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scores_avx2(q: &[f32], keys: &[f32], stride: usize, out: &mut [f32]) {
        let n = q.len();
        for (j, o) in out.iter_mut().enumerate() {
            let k = &keys[j * stride..][..n];
            let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut i = 0;
            while i + 16 <= n {
                // SAFETY: `i + 16 <= n` for both slices.
                unsafe {
                    lo = _mm256_fmadd_ps(
                        _mm256_loadu_ps(q.as_ptr().add(i)),
                        _mm256_loadu_ps(k.as_ptr().add(i)),
                        lo,
                    );
                    hi = _mm256_fmadd_ps(
                        _mm256_loadu_ps(q.as_ptr().add(i + 8)),
                        _mm256_loadu_ps(k.as_ptr().add(i + 8)),
                        hi,
                    );
                }
                i += 16;
            }
            let mut lanes = [0.0f32; 16];
            // SAFETY: 8 + 8 floats.
            unsafe {
                _mm256_storeu_ps(lanes.as_mut_ptr(), lo);
                _mm256_storeu_ps(lanes.as_mut_ptr().add(8), hi);
            }
            for (l, (a, b)) in q[i..].iter().zip(&k[i..]).enumerate() {
                lanes[l] = a.mul_add(*b, lanes[l]);
            }
            *o = reduce16(&lanes);
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn accumulate_avx512(acc: &mut [f32], p: &[f32], rows: &[f32], stride: usize) {
        let n = acc.len();
        let mut d = 0;
        while d < n {
            let mask: __mmask16 = if d + 16 <= n { u16::MAX } else { (1u16 << (n - d)) - 1 };
            // SAFETY: the mask covers only elements `d..n` of `acc` and of each row, which the
            // caller checked to be in bounds.
            unsafe {
                let mut a = _mm512_maskz_loadu_ps(mask, acc.as_ptr().add(d));
                for (j, &pj) in p.iter().enumerate() {
                    let v = _mm512_maskz_loadu_ps(mask, rows.as_ptr().add(j * stride + d));
                    a = _mm512_fmadd_ps(_mm512_set1_ps(pj), v, a);
                }
                _mm512_mask_storeu_ps(acc.as_mut_ptr().add(d), mask, a);
            }
            d += 16;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn accumulate_avx2(acc: &mut [f32], p: &[f32], rows: &[f32], stride: usize) {
        let n = acc.len();
        let full = n / 8 * 8;
        let mut d = 0;
        while d < full {
            // SAFETY: `d + 8 <= n` for `acc` and every row (bounds checked by the caller).
            unsafe {
                let mut a = _mm256_loadu_ps(acc.as_ptr().add(d));
                for (j, &pj) in p.iter().enumerate() {
                    let v = _mm256_loadu_ps(rows.as_ptr().add(j * stride + d));
                    a = _mm256_fmadd_ps(_mm256_set1_ps(pj), v, a);
                }
                _mm256_storeu_ps(acc.as_mut_ptr().add(d), a);
            }
            d += 8;
        }
        for (j, &pj) in p.iter().enumerate() {
            for (a, v) in acc[full..].iter_mut().zip(&rows[j * stride + full..]) {
                *a = pj.mul_add(*v, *a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::values;

    #[test]
    fn simd_equals_scalar_bitwise() {
        for hd in [1, 5, 16, 20, 33, 64, 256] {
            for n_keys in [1, 7, 15, 16, 17, 32, 40] {
                let stride = hd + 3;
                let q = values(hd, 1, 2.0);
                let keys = values(n_keys * stride, 2, 2.0);
                let p = values(n_keys, 3, 1.0);
                let mut want_s = vec![0.0; n_keys];
                scores_scalar(&q, &keys, stride, &mut want_s);
                let mut want_acc = values(hd, 4, 1.0);
                accumulate_scalar(&mut want_acc, &p, &keys, stride);
                for level in SimdLevel::available() {
                    let mut s = vec![0.0; n_keys];
                    scores(level, &q, &keys, stride, &mut s);
                    let same = s.iter().zip(&want_s).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "scores {level:?} hd={hd} keys={n_keys}");
                    // A key's score does not depend on how many keys the block holds.
                    let mut one = [0.0];
                    scores(level, &q, &keys[(n_keys - 1) * stride..], stride, &mut one);
                    assert_eq!(one[0].to_bits(), want_s[n_keys - 1].to_bits());
                    let mut acc = values(hd, 4, 1.0);
                    accumulate(level, &mut acc, &p, &keys, stride);
                    let same = acc.iter().zip(&want_acc).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "accumulate {level:?} hd={hd} keys={n_keys}");
                }
            }
        }
    }
}
