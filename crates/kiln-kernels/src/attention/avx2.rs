//! The AVX2/FMA versions of attention's two inner loops (`micro`), for 1 to 4 query rows that
//! share the keys, with the scalar reference's arithmetic:
//! - [`scores`]: 16 lane sums per (row, key) as two 8-lane vectors, reduced by `micro`'s fixed
//!   tree (`l + 8`, `+ 4`, `+ 2`, `+ 1`) with the same additions ([`reduce`]);
//! - [`accumulate`]: `acc[d] = fma(p[j], v_j[d], acc[d])` for keys `j` in order.
//!
//! A fused multiply-add has a latency of 4 cycles and two issue every cycle, so a loop needs 8
//! independent accumulators to keep the units busy: [`scores`] takes `⌈8 / R⌉` keys per pass,
//! one half of the lanes at a time (at least 8 lane vectors for any `R`), [`accumulate`] `8 / R`
//! vectors of 8 elements per pass over the keys; and every K or V load (and f16 widening) serves
//! all `R` rows, every query load all the pass's keys. Each row still gets exactly its lone-row
//! operations in its lone-row order, so results equal the scalar reference bit for bit whatever
//! `R`, key count or head size (tested in `micro`).

use std::arch::x86_64::*;

use super::KvElem;

/// 8 elements at `p` widened to f32 (f16 exactly, by `vcvtph2ps`).
///
/// # Safety
/// 8 elements readable at `p`; AVX2 and F16C available.
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always)]
unsafe fn load8<E: KvElem>(p: *const E) -> __m256 {
    // SAFETY: forwarded from the caller; `E` is f16 (2 bytes) or f32 (4 bytes) per `IS_F16`.
    unsafe {
        if E::IS_F16 {
            _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
        } else {
            _mm256_loadu_ps(p.cast())
        }
    }
}

/// `micro::reduce16` of the lane sums `lo` (lanes 0..8) and `hi` (8..16), with the same
/// additions on the same pairs: `h = lo + hi`, its halves, then `[0] + [2]`, `[1] + [3]`, and
/// their sum.
///
/// # Safety
/// AVX available.
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always)]
unsafe fn reduce(lo: __m256, hi: __m256) -> f32 {
    // SAFETY: register arithmetic only; AVX is the caller's.
    unsafe {
        let h = _mm256_add_ps(lo, hi);
        let q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        let p = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)))
    }
}

/// Most keys a pass of [`scores`] takes (for one row).
const MAX_KEYS: usize = 8;

/// `out[r][j] = q[r] · k_j` for `j < n`, `k_j` at `keys + j * stride`, as `micro::scores`
/// computes each: lane `l` of 16 adds elements `l, l + 16, ...` by fused multiply-adds in
/// order, the elements past the last full 16 one by one into lanes `0, 1, ...`, then the tree.
///
/// A pass takes `⌈8 / R⌉` keys and runs over the head twice, lanes 0..8 then lanes 8..16
/// ([`half_sums`]), so that each of its `R·⌈8 / R⌉` accumulators is one register and every
/// 8-element load of a query row serves all the pass's keys: `R + ⌈8 / R⌉` loads per
/// `R·⌈8 / R⌉` multiply-adds (both halves in one pass need twice the accumulators: 4 rows then
/// take one key and load 10 vectors per 8 multiply-adds, and prefill attention ran 18 % slower,
/// docs/BENCHMARKS.md).
///
/// # Safety
/// AVX2, FMA and F16C available; `hd` floats readable at every `q[r]` and every key row; `n`
/// floats writable at every `out[r]`. `R` is 1 to 4 (checked at compile time).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn scores<E: KvElem, const R: usize>(
    q: [*const f32; R],
    hd: usize,
    keys: *const E,
    stride: usize,
    n: usize,
    out: [*mut f32; R],
) {
    const { assert!(R >= 1 && R <= 4, "1 to 4 rows") };
    let per_pass = MAX_KEYS.div_ceil(R);
    let full = hd / 16 * 16;
    let mut j = 0;
    while j < n {
        let cnt = (n - j).min(per_pass);
        // Keys `j + c`; past `n`, key `j` is read again and its sums dropped.
        // SAFETY: every key index is below `n`.
        let k: [*const E; MAX_KEYS] = std::array::from_fn(|c| unsafe {
            keys.add((j + if c < cnt { c } else { 0 }) * stride)
        });
        // SAFETY: the halves stay below `full <= hd`.
        let (lo, hi) = unsafe {
            (
                half_sums::<E, R>(q, &k, per_pass, 0, full),
                half_sums::<E, R>(q, &k, per_pass, 8, full),
            )
        };
        for r in 0..R {
            for c in 0..cnt {
                let s = if full == hd {
                    // SAFETY: AVX is this function's.
                    unsafe { reduce(lo[r][c], hi[r][c]) }
                } else {
                    let mut lanes = [0.0f32; 16];
                    // SAFETY: 8 + 8 floats; the tail elements `full..hd` are readable.
                    unsafe {
                        _mm256_storeu_ps(lanes.as_mut_ptr(), lo[r][c]);
                        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), hi[r][c]);
                        for (l, e) in (full..hd).enumerate() {
                            lanes[l] = (*q[r].add(e)).mul_add((*k[c].add(e)).to_f32(), lanes[l]);
                        }
                    }
                    super::micro::reduce16(&lanes)
                };
                // SAFETY: `j + c < n`.
                unsafe { *out[r].add(j + c) = s };
            }
        }
        j += per_pass;
    }
}

/// Lanes `off..off + 8` (`off` 0 or 8) of the 16 lane sums of rows `q[r]` against keys
/// `k[c]`, `c < keys`: `s[r][c] = fma(q[r][i + l], k[c][i + l], s[r][c])` for `i = off, off +
/// 16, ...` below `full`, in order.
///
/// # Safety
/// As [`scores`]; `full` a multiple of 16 at most the head size; `keys <= MAX_KEYS`.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always, clippy::needless_range_loop)] // key `c` of every row
unsafe fn half_sums<E: KvElem, const R: usize>(
    q: [*const f32; R],
    k: &[*const E; MAX_KEYS],
    keys: usize,
    off: usize,
    full: usize,
) -> [[__m256; MAX_KEYS]; R] {
    // SAFETY: AVX is the caller's.
    let mut s = [[unsafe { _mm256_setzero_ps() }; MAX_KEYS]; R];
    let mut i = off;
    while i < full {
        // SAFETY: `i + 8 <= full` for the query and key rows, as the caller guarantees.
        unsafe {
            let qi: [__m256; R] = std::array::from_fn(|r| _mm256_loadu_ps(q[r].add(i)));
            for c in 0..keys {
                let kc = load8(k[c].add(i));
                for r in 0..R {
                    s[r][c] = _mm256_fmadd_ps(qi[r], kc, s[r][c]);
                }
            }
        }
        i += 16;
    }
    s
}

/// `acc[r][d] = fma(p[r][j], v_j[d], acc[r][d])` for `j < n` in order, `v_j` at
/// `rows + j * stride`, as `micro::accumulate` computes each element.
///
/// # Safety
/// AVX2, FMA and F16C available; `hd` floats readable and writable at every `acc[r]` and
/// readable at every V row; `n` floats readable at every `p[r]`. `R` is 1 to 4 (checked at
/// compile time).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn accumulate<E: KvElem, const R: usize>(
    acc: [*mut f32; R],
    hd: usize,
    p: [*const f32; R],
    n: usize,
    rows: *const E,
    stride: usize,
) {
    const { assert!(R >= 1 && R <= 4, "1 to 4 rows") };
    let full = hd / 8 * 8;
    // SAFETY: the passes stay below `full <= hd`; the rest is the caller's.
    unsafe {
        let d = match R {
            1 => passes::<E, R, 8>(acc, 0, full, p, n, rows, stride),
            2 => passes::<E, R, 4>(acc, 0, full, p, n, rows, stride),
            _ => passes::<E, R, 2>(acc, 0, full, p, n, rows, stride),
        };
        passes::<E, R, 1>(acc, d, full, p, n, rows, stride);
    }
    for r in 0..R {
        for e in full..hd {
            // SAFETY: `e < hd`, `j < n`, as the caller guarantees.
            unsafe {
                let a = acc[r].add(e);
                for j in 0..n {
                    *a = (*p[r].add(j)).mul_add((*rows.add(j * stride + e)).to_f32(), *a);
                }
            }
        }
    }
}

/// [`accumulate`] of elements `d..d + 8·C` of every row, then of the next `8·C`, while they
/// end by `full`; returns where it stopped. `C·R` independent accumulators, each V vector loaded
/// once for the `R` rows.
///
/// # Safety
/// As [`accumulate`], with `full <= hd`.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always, clippy::needless_range_loop)] // element chunk `c` of every row
unsafe fn passes<E: KvElem, const R: usize, const C: usize>(
    acc: [*mut f32; R],
    mut d: usize,
    full: usize,
    p: [*const f32; R],
    n: usize,
    rows: *const E,
    stride: usize,
) -> usize {
    while d + 8 * C <= full {
        // SAFETY (all loads and stores): elements `d..d + 8·C` of the accumulators and V rows,
        // keys `j < n`, as the caller guarantees.
        unsafe {
            let mut a: [[__m256; C]; R] = std::array::from_fn(|r| {
                std::array::from_fn(|c| _mm256_loadu_ps(acc[r].add(d + 8 * c)))
            });
            for j in 0..n {
                let pj: [__m256; R] = std::array::from_fn(|r| _mm256_set1_ps(*p[r].add(j)));
                let v = rows.add(j * stride + d);
                for c in 0..C {
                    let vc = load8(v.add(8 * c));
                    for r in 0..R {
                        a[r][c] = _mm256_fmadd_ps(pj[r], vc, a[r][c]);
                    }
                }
            }
            for r in 0..R {
                for c in 0..C {
                    _mm256_storeu_ps(acc[r].add(d + 8 * c), a[r][c]);
                }
            }
        }
        d += 8 * C;
    }
    d
}
