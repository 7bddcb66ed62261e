//! The two inner loops of attention with one fixed arithmetic on every ISA:
//! - [`scores`]: `q · k_j` for the keys of a block, each as 16 lane sums (lane `l` accumulates
//!   elements `l, l + 16, ...` with fused multiply-adds, in order) reduced by a fixed tree
//!   (`l + 8`, `+ 4`, `+ 2`, `+ 1`);
//! - [`accumulate`]: `acc[d] = fma(p[j], v_j[d], acc[d])` for keys `j` in order.
//!
//! [`scores_rows`] and [`accumulate_rows`] do the same for up to [`MAX_ROWS`] rows against the
//! same keys; on AVX-512 and AVX2 every K/V load then serves all of them (AVX-512 scores:
//! 4 rows × 4 keys of lane sums per pass over the head; accumulation: 4 rows × 64 elements per
//! pass over the keys; AVX2 in `super::avx2`). Each row still gets exactly its lone-row
//! operations, so the row count of a call never changes a bit (tested).
//!
//! K and V elements are f32 or f16 ([`KvElem`]); f16 ones are widened to f32 exactly as they
//! are loaded, so a kernel over an f16 cache gives bitwise the result of the f32 kernel over
//! the same values widened (tested), and every property above holds for both.
//!
//! Keys of a block sit at a fixed stride in the cache (`num_kv_heads * head_dim`). The scalar
//! versions are the reference; the AVX-512 and AVX2 ones perform the same IEEE operations on
//! the same operands (AVX-512 reduces 16 keys at once with a shuffle network that adds exactly
//! the tree's pairs), so results are bitwise equal across ISAs and across block fill levels
//! (tested). With the per-row independence of the loops, that keeps attention outputs
//! independent of batching and chunking.

use super::KvElem;
#[cfg(target_arch = "x86_64")]
use super::avx2;
use crate::SimdLevel;

/// `out[j] = q · k_j` where `k_j = keys[j * stride..][..q.len()]`, for `j < out.len()`.
#[inline]
pub(crate) fn scores<E: KvElem>(
    level: SimdLevel,
    q: &[f32],
    keys: &[E],
    stride: usize,
    out: &mut [f32],
) {
    let hd = q.len();
    if let Some(last) = out.len().checked_sub(1) {
        assert!(keys.len() >= last * stride + hd, "keys out of bounds");
    }
    #[cfg(target_arch = "x86_64")]
    {
        if level == SimdLevel::Avx512 {
            let (q, o) = ([q.as_ptr()], [out.as_mut_ptr()]);
            // SAFETY: `level` is at most the detected level; bounds checked above.
            return unsafe {
                x86::scores_avx512::<E, 1>(q, hd, keys.as_ptr(), stride, out.len(), o);
            };
        }
        if level == SimdLevel::Avx2 {
            let (q, o) = ([q.as_ptr()], [out.as_mut_ptr()]);
            // SAFETY: as above.
            return unsafe { avx2::scores::<E, 1>(q, hd, keys.as_ptr(), stride, out.len(), o) };
        }
    }
    scores_scalar(q, keys, stride, out);
}

pub(crate) fn scores_scalar<E: KvElem>(q: &[f32], keys: &[E], stride: usize, out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        let k = &keys[j * stride..][..q.len()];
        let mut lanes = [0.0f32; 16];
        for (i, (a, b)) in q.iter().zip(k).enumerate() {
            lanes[i % 16] = a.mul_add(b.to_f32(), lanes[i % 16]);
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
pub(crate) fn accumulate<E: KvElem>(
    level: SimdLevel,
    acc: &mut [f32],
    p: &[f32],
    rows: &[E],
    stride: usize,
) {
    if let Some(last) = p.len().checked_sub(1) {
        assert!(rows.len() >= last * stride + acc.len(), "rows out of bounds");
    }
    #[cfg(target_arch = "x86_64")]
    {
        if level == SimdLevel::Avx512 {
            let (hd, n) = (acc.len(), p.len());
            let (a, p) = ([acc.as_mut_ptr()], [p.as_ptr()]);
            // SAFETY: `level` is at most the detected level; bounds checked above.
            return unsafe { x86::accumulate_avx512::<E, 1>(a, hd, p, n, rows.as_ptr(), stride) };
        }
        if level == SimdLevel::Avx2 {
            let (hd, n) = (acc.len(), p.len());
            let (a, p) = ([acc.as_mut_ptr()], [p.as_ptr()]);
            // SAFETY: as above.
            return unsafe { avx2::accumulate::<E, 1>(a, hd, p, n, rows.as_ptr(), stride) };
        }
    }
    accumulate_scalar(acc, p, rows, stride);
}

pub(crate) fn accumulate_scalar<E: KvElem>(acc: &mut [f32], p: &[f32], rows: &[E], stride: usize) {
    for (j, &pj) in p.iter().enumerate() {
        for (a, v) in acc.iter_mut().zip(&rows[j * stride..]) {
            *a = pj.mul_add(v.to_f32(), *a);
        }
    }
}

/// Rows of one tile that share a key range are computed together, up to this many.
pub(crate) const MAX_ROWS: usize = 4;

/// [`scores`] for `R` query rows against the same keys: `out[r][j] = q[r] · k_j`. Each result
/// is computed exactly as by [`scores`]; AVX-512 and AVX2 load every K row once for all `R`
/// rows.
#[inline]
pub(crate) fn scores_rows<E: KvElem, const R: usize>(
    level: SimdLevel,
    q: [&[f32]; R],
    keys: &[E],
    stride: usize,
    out: [&mut [f32]; R],
) {
    let (hd, n) = (q[0].len(), out[0].len());
    assert!(q.iter().all(|r| r.len() == hd) && out.iter().all(|o| o.len() == n));
    if let Some(last) = n.checked_sub(1) {
        assert!(keys.len() >= last * stride + hd, "keys out of bounds");
    }
    #[cfg(target_arch = "x86_64")]
    if level >= SimdLevel::Avx2 {
        let q = q.map(<[f32]>::as_ptr);
        let out = out.map(<[f32]>::as_mut_ptr);
        // SAFETY: `level` is at most the detected level; bounds checked above.
        return unsafe {
            if level == SimdLevel::Avx512 {
                x86::scores_avx512::<E, R>(q, hd, keys.as_ptr(), stride, n, out);
            } else {
                avx2::scores::<E, R>(q, hd, keys.as_ptr(), stride, n, out);
            }
        };
    }
    for (qr, o) in q.into_iter().zip(out) {
        scores(level, qr, keys, stride, o);
    }
}

/// [`accumulate`] for `R` output rows over the same V rows (`acc[r]` with weights `p[r]`).
/// Each result is computed exactly as by [`accumulate`]; AVX-512 and AVX2 load every V row once
/// for all `R` rows.
#[inline]
pub(crate) fn accumulate_rows<E: KvElem, const R: usize>(
    level: SimdLevel,
    acc: [&mut [f32]; R],
    p: [&[f32]; R],
    rows: &[E],
    stride: usize,
) {
    let (hd, n) = (acc[0].len(), p[0].len());
    assert!(acc.iter().all(|a| a.len() == hd) && p.iter().all(|r| r.len() == n));
    if let Some(last) = n.checked_sub(1) {
        assert!(rows.len() >= last * stride + hd, "rows out of bounds");
    }
    #[cfg(target_arch = "x86_64")]
    if level >= SimdLevel::Avx2 {
        let acc = acc.map(<[f32]>::as_mut_ptr);
        let p = p.map(<[f32]>::as_ptr);
        // SAFETY: `level` is at most the detected level; bounds checked above.
        return unsafe {
            if level == SimdLevel::Avx512 {
                x86::accumulate_avx512::<E, R>(acc, hd, p, n, rows.as_ptr(), stride);
            } else {
                avx2::accumulate::<E, R>(acc, hd, p, n, rows.as_ptr(), stride);
            }
        };
    }
    for (a, pr) in acc.into_iter().zip(p) {
        accumulate(level, a, pr, rows, stride);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::KvElem;

    /// 16 elements at `p` widened to f32 (lanes outside `mask` are zero and read nothing).
    ///
    /// # Safety
    /// The masked elements are readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load16<E: KvElem>(p: *const E, mask: __mmask16) -> __m512 {
        // SAFETY: forwarded from the caller; `E` is f16 (2 bytes) or f32 (4 bytes) per `IS_F16`.
        unsafe {
            if E::IS_F16 {
                _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p.cast()))
            } else {
                _mm512_maskz_loadu_ps(mask, p.cast())
            }
        }
    }

    /// Keys whose lane sums one pass over `q` computes (sharing every load of `q`).
    const KEYS: usize = 4;

    /// The 16 lane sums of `q_r · k_c` for `R` query rows and [`KEYS`] keys: lane `l` adds
    /// elements `l, l + 16, ...` with fused multiply-adds, in order (tail lanes masked).
    ///
    /// # Safety
    /// `hd` floats readable at every `q[r]` and `k[c]`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn lanes<E: KvElem, const R: usize>(
        q: [*const f32; R],
        k: [*const E; KEYS],
        hd: usize,
    ) -> [[__m512; KEYS]; R] {
        let mut acc = [[_mm512_setzero_ps(); KEYS]; R];
        let mut i = 0;
        // SAFETY (all loads): `i + 16 <= hd`, or the mask covers only the `hd - i` tail lanes.
        while i + 16 <= hd {
            let kv: [__m512; KEYS] =
                std::array::from_fn(|c| unsafe { load16(k[c].add(i), u16::MAX) });
            for r in 0..R {
                let qv = unsafe { _mm512_loadu_ps(q[r].add(i)) };
                for c in 0..KEYS {
                    acc[r][c] = _mm512_fmadd_ps(qv, kv[c], acc[r][c]);
                }
            }
            i += 16;
        }
        if i < hd {
            let mask: __mmask16 = (1u16 << (hd - i)) - 1;
            let kv: [__m512; KEYS] = std::array::from_fn(|c| unsafe { load16(k[c].add(i), mask) });
            for r in 0..R {
                let qv = unsafe { _mm512_maskz_loadu_ps(mask, q[r].add(i)) };
                for c in 0..KEYS {
                    // Masked-off lanes keep their sum, like the scalar loop that never visits them.
                    acc[r][c] = _mm512_mask3_fmadd_ps(qv, kv[c], acc[r][c], mask);
                }
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

    /// `out[r][j] = q[r] · k_j` for `j < n`, `k_j` at `keys + j * stride`: 16 keys at a time,
    /// [`KEYS`] keys per pass over the rows; each key's 16 lane vectors go to the position
    /// [`reduce16x16`] expects. Positions of keys past `n` stay zero and their output lanes are
    /// not stored (every output lane depends on its own key only).
    ///
    /// # Safety
    /// `hd` floats readable at every `q[r]` and at every key row, `n` writable at every
    /// `out[r]`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn scores_avx512<E: KvElem, const R: usize>(
        q: [*const f32; R],
        hd: usize,
        keys: *const E,
        stride: usize,
        n: usize,
        out: [*mut f32; R],
    ) {
        let mut j = 0;
        while j < n {
            let cnt = (n - j).min(16);
            let mut a = [[_mm512_setzero_ps(); 16]; R];
            for g in 0..cnt.div_ceil(KEYS) {
                // Keys `j + 4g + c`; past `n`, key `j` is read again and its sums dropped.
                let k: [*const E; KEYS] = std::array::from_fn(|c| {
                    let key = if KEYS * g + c < cnt { j + KEYS * g + c } else { j };
                    // SAFETY: `key < n`.
                    unsafe { keys.add(key * stride) }
                });
                // SAFETY: forwarded from the caller.
                let l = unsafe { lanes::<E, R>(q, k, hd) };
                for r in 0..R {
                    for c in 0..KEYS.min(cnt - KEYS * g) {
                        // Key `4g + c` of the 16 sits at position `4c + g`.
                        a[r][4 * c + g] = l[r][c];
                    }
                }
            }
            let mask: __mmask16 = if cnt == 16 { u16::MAX } else { (1u16 << cnt) - 1 };
            for r in 0..R {
                // SAFETY: `cnt` floats at `out[r] + j` are below `n`.
                unsafe { _mm512_mask_storeu_ps(out[r].add(j), mask, reduce16x16(&a[r])) };
            }
            j += 16;
        }
    }

    /// Vectors of 16 accumulators per row one pass over the V rows updates.
    const CHUNKS: usize = 4;

    /// `acc[r][d] = fma(p[r][j], v_j[d], acc[r][d])` for `j < n` in order, `v_j` at
    /// `rows + j * stride`: 64 elements of every row per pass, each V load shared by the `R`
    /// rows (tail lanes masked).
    ///
    /// # Safety
    /// `hd` floats readable and writable at every `acc[r]`, readable at every V row; `n`
    /// readable at every `p[r]`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn accumulate_avx512<E: KvElem, const R: usize>(
        acc: [*mut f32; R],
        hd: usize,
        p: [*const f32; R],
        n: usize,
        rows: *const E,
        stride: usize,
    ) {
        let mut d = 0;
        while d < hd {
            let mask: [__mmask16; CHUNKS] = std::array::from_fn(|c| {
                let start = d + 16 * c;
                if start + 16 <= hd {
                    u16::MAX
                } else if start < hd {
                    (1u16 << (hd - start)) - 1
                } else {
                    0
                }
            });
            // SAFETY (all loads and stores): the masks cover only elements `d..hd` of the
            // accumulators and of each V row (a chunk past `hd` has mask 0 and touches no
            // memory, hence the wrapping pointer arithmetic).
            let mut a: [[__m512; CHUNKS]; R] = std::array::from_fn(|r| {
                std::array::from_fn(|c| unsafe {
                    _mm512_maskz_loadu_ps(mask[c], acc[r].wrapping_add(d + 16 * c))
                })
            });
            for j in 0..n {
                let v = rows.wrapping_add(j * stride + d);
                let v: [__m512; CHUNKS] =
                    std::array::from_fn(|c| unsafe { load16(v.wrapping_add(16 * c), mask[c]) });
                for r in 0..R {
                    // SAFETY: `j < n`.
                    let pj = _mm512_set1_ps(unsafe { *p[r].add(j) });
                    for c in 0..CHUNKS {
                        a[r][c] = _mm512_fmadd_ps(pj, v[c], a[r][c]);
                    }
                }
            }
            for r in 0..R {
                for c in 0..CHUNKS {
                    let dst = acc[r].wrapping_add(d + 16 * c);
                    unsafe { _mm512_mask_storeu_ps(dst, mask[c], a[r][c]) };
                }
            }
            d += 16 * CHUNKS;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::values;

    #[test]
    fn simd_equals_scalar_bitwise() {
        for hd in [1, 5, 16, 20, 33, 48, 64, 100, 256] {
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
                    rows_equal_one_row::<2>(level, hd, n_keys, stride, &keys);
                    rows_equal_one_row::<3>(level, hd, n_keys, stride, &keys);
                    rows_equal_one_row::<4>(level, hd, n_keys, stride, &keys);
                }
            }
        }
    }

    #[test]
    fn f16_elements_equal_their_widened_f32_values_bitwise() {
        for hd in [5, 16, 33, 256] {
            for n_keys in [1, 15, 16, 17, 40] {
                let stride = hd + 3;
                let q = values(hd, 1, 2.0);
                let keys16: Vec<half::f16> =
                    values(n_keys * stride, 2, 2.0).into_iter().map(half::f16::from_f32).collect();
                let keys32: Vec<f32> = keys16.iter().map(|x| x.to_f32()).collect();
                let p = values(n_keys, 3, 1.0);
                let mut want_s = vec![0.0; n_keys];
                scores_scalar(&q, &keys32, stride, &mut want_s);
                let mut want_acc = values(hd, 4, 1.0);
                accumulate_scalar(&mut want_acc, &p, &keys32, stride);
                for level in SimdLevel::available() {
                    let mut s = vec![0.0; n_keys];
                    scores(level, &q, &keys16, stride, &mut s);
                    assert_eq!(bits(&s), bits(&want_s), "scores {level:?} hd={hd} keys={n_keys}");
                    let mut acc = values(hd, 4, 1.0);
                    accumulate(level, &mut acc, &p, &keys16, stride);
                    assert_eq!(bits(&acc), bits(&want_acc), "accumulate {level:?} hd={hd}");
                    let qs = [q.as_slice(); 3];
                    let mut outs = [vec![0.0; n_keys], vec![0.0; n_keys], vec![0.0; n_keys]];
                    scores_rows(level, qs, &keys16, stride, outs.each_mut().map(Vec::as_mut_slice));
                    assert!(outs.iter().all(|o| bits(o) == bits(&want_s)), "scores_rows {level:?}");
                    let mut accs: [Vec<f32>; 3] = std::array::from_fn(|_| values(hd, 4, 1.0));
                    let ps = [p.as_slice(); 3];
                    accumulate_rows(
                        level,
                        accs.each_mut().map(Vec::as_mut_slice),
                        ps,
                        &keys16,
                        stride,
                    );
                    assert!(accs.iter().all(|a| bits(a) == bits(&want_acc)), "acc_rows {level:?}");
                }
            }
        }
    }

    /// `R` rows at once give each row's single-row results bitwise.
    fn rows_equal_one_row<const R: usize>(
        level: SimdLevel,
        hd: usize,
        n_keys: usize,
        stride: usize,
        keys: &[f32],
    ) {
        let qs: [Vec<f32>; R] = std::array::from_fn(|r| values(hd, 10 + r as u64, 2.0));
        let ps: [Vec<f32>; R] = std::array::from_fn(|r| values(n_keys, 20 + r as u64, 1.0));
        let mut s: [Vec<f32>; R] = std::array::from_fn(|_| vec![0.0; n_keys]);
        let (q, out) = (qs.each_ref().map(Vec::as_slice), s.each_mut().map(Vec::as_mut_slice));
        scores_rows(level, q, keys, stride, out);
        let mut acc: [Vec<f32>; R] = std::array::from_fn(|r| values(hd, 30 + r as u64, 1.0));
        let p = ps.each_ref().map(Vec::as_slice);
        accumulate_rows(level, acc.each_mut().map(Vec::as_mut_slice), p, keys, stride);
        for r in 0..R {
            let mut want = vec![0.0; n_keys];
            scores_scalar(&qs[r], keys, stride, &mut want);
            assert_eq!(bits(&s[r]), bits(&want), "scores_rows {level:?} R={R} r={r} hd={hd}");
            let mut want = values(hd, 30 + r as u64, 1.0);
            accumulate_scalar(&mut want, &ps[r], keys, stride);
            assert_eq!(bits(&acc[r]), bits(&want), "accumulate_rows {level:?} R={R} r={r}");
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }
}
