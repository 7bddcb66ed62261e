//! The x86 kernel of [`super::block`] for 1 to 4 rows of one adapter, written once over
//! [`Vec16`] (16 f32 lanes: two AVX2 vectors, or one AVX-512 vector), with the scalar
//! reference's arithmetic:
//! - the dot products: per (row, rank) 16 lane sums by fused multiply-adds in index order, the
//!   elements past the last full 16 one by one into lanes `0, 1, ...`, then [`super::tree`];
//! - the update: `out[o] = fma(tmp[j], b_t[j, o], out[o])` for ranks `j` in order.
//!
//! A fused multiply-add has a latency of 4 cycles and two issue every cycle, so a loop needs
//! about 8 independent accumulators to keep the units busy: the dot products take `J` ranks
//! per pass over the input (`R · J` lane sets), the update `C` sets of 16 outputs per pass over
//! the ranks, `J` and `C` chosen per row count and width; every load of `a` or `b_t` (and its
//! f16 widening, by `vcvtph2ps`, exact) serves all `R` rows. Each row still gets exactly its
//! lone-row operations in its lone-row order, so results equal the scalar reference bit for bit
//! whatever `R` or width (tested in `super::tests`).

use std::arch::x86_64::*;

use half::f16;

use super::{LANES, LoraValues, RANK_CHUNK, tree};

/// An element a LoRA matrix is kept in.
trait Elem: Copy {
    const IS_F16: bool;
    fn widen(self) -> f32;
}

impl Elem for f32 {
    const IS_F16: bool = false;
    fn widen(self) -> f32 {
        self
    }
}

impl Elem for f16 {
    const IS_F16: bool = true;
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// 16 f32 lanes in registers (`LANES`).
///
/// # Safety
/// Every method needs the type's instruction set: AVX2, FMA and F16C for [`Avx2Pair`],
/// AVX-512 F for [`Avx512`]; loads and stores need 16 elements at `p`.
trait Vec16: Copy {
    unsafe fn zero() -> Self;
    unsafe fn splat(v: f32) -> Self;
    /// 16 elements at `p` widened to f32 (f16 exactly).
    unsafe fn load<E: Elem>(p: *const E) -> Self;
    /// `a · b + c`, one rounding per lane.
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
    unsafe fn store(self, p: *mut f32);
}

/// Lanes 0..8 and 8..16 as two AVX2 vectors.
#[derive(Clone, Copy)]
struct Avx2Pair(__m256, __m256);

/// One AVX-512 vector.
#[derive(Clone, Copy)]
struct Avx512(__m512);

// SAFETY (all methods): the caller's, per `Vec16`.
#[allow(clippy::inline_always)] // must inline into the `#[target_feature]` entry points
impl Vec16 for Avx2Pair {
    #[inline(always)]
    unsafe fn zero() -> Self {
        unsafe { Self(_mm256_setzero_ps(), _mm256_setzero_ps()) }
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        unsafe { Self(_mm256_set1_ps(v), _mm256_set1_ps(v)) }
    }
    #[inline(always)]
    unsafe fn load<E: Elem>(p: *const E) -> Self {
        unsafe {
            if E::IS_F16 {
                let lo = _mm256_cvtph_ps(_mm_loadu_si128(p.cast()));
                Self(lo, _mm256_cvtph_ps(_mm_loadu_si128(p.add(8).cast())))
            } else {
                Self(_mm256_loadu_ps(p.cast()), _mm256_loadu_ps(p.cast::<f32>().add(8)))
            }
        }
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        unsafe { Self(_mm256_fmadd_ps(a.0, b.0, c.0), _mm256_fmadd_ps(a.1, b.1, c.1)) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        unsafe {
            _mm256_storeu_ps(p, self.0);
            _mm256_storeu_ps(p.add(8), self.1);
        }
    }
}

// SAFETY (all methods): the caller's, per `Vec16`.
#[allow(clippy::inline_always)] // must inline into the `#[target_feature]` entry points
impl Vec16 for Avx512 {
    #[inline(always)]
    unsafe fn zero() -> Self {
        unsafe { Self(_mm512_setzero_ps()) }
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        unsafe { Self(_mm512_set1_ps(v)) }
    }
    #[inline(always)]
    unsafe fn load<E: Elem>(p: *const E) -> Self {
        unsafe {
            if E::IS_F16 {
                Self(_mm512_cvtph_ps(_mm256_loadu_si256(p.cast())))
            } else {
                Self(_mm512_loadu_ps(p.cast()))
            }
        }
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        unsafe { Self(_mm512_fmadd_ps(a.0, b.0, c.0)) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        unsafe { _mm512_storeu_ps(p, self.0) }
    }
}

/// `d[r][j] = xs[r] · a_j` for the `J` rows `a_j` of `a` (`[J, k]`), each as the scalar
/// reference's `dots`.
///
/// # Safety
/// `W`'s instruction set available; `xs[r].len() == k`, `a.len() >= J * k`.
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always)]
unsafe fn dots<W: Vec16, const R: usize, const J: usize, E: Elem>(
    xs: &[&[f32]; R],
    a: &[E],
    k: usize,
) -> [[f32; J]; R] {
    let full = k / LANES * LANES;
    let mut d = [[0f32; J]; R];
    // SAFETY: every load reads 16 elements below `full <= k` of a row of `x` or `a`, every
    // store 16 lanes into `lanes`.
    unsafe {
        let mut acc = [[W::zero(); J]; R];
        for c in (0..full).step_by(LANES) {
            for j in 0..J {
                let av = W::load(a.as_ptr().add(j * k + c));
                for (acc, x) in acc.iter_mut().zip(xs) {
                    acc[j] = W::fma(W::load(x.as_ptr().add(c)), av, acc[j]);
                }
            }
        }
        for ((d, acc), x) in d.iter_mut().zip(&acc).zip(xs) {
            for (j, (d, &acc)) in d.iter_mut().zip(acc).enumerate() {
                let mut lanes = [0f32; LANES];
                acc.store(lanes.as_mut_ptr());
                for i in full..k {
                    lanes[i - full] = x[i].mul_add(a[j * k + i].widen(), lanes[i - full]);
                }
                *d = tree(lanes);
            }
        }
    }
    d
}

/// `outs[r][o0 + i] = fma(tmp[r][j], b[j, o0 + i], ...)` over ranks `j < ranks` in order, for
/// `C` sets of 16 outputs from `o0` (`b`: `[ranks, n]`).
///
/// # Safety
/// `W`'s instruction set available; `o0 + 16 C <= n`, `outs[r].len() == n`,
/// `b.len() >= ranks * n`.
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always)]
unsafe fn update_chunk<W: Vec16, const R: usize, const C: usize, E: Elem>(
    outs: &mut [&mut [f32]; R],
    tmp: &[[f32; RANK_CHUNK]; R],
    (b, ranks, n): (&[E], usize, usize),
    o0: usize,
) {
    // SAFETY: every access is 16 elements below `o0 + 16 C <= n` of a row of `out` or `b`.
    unsafe {
        let mut acc = [[W::zero(); C]; R];
        for (acc, out) in acc.iter_mut().zip(outs.iter()) {
            for (c, acc) in acc.iter_mut().enumerate() {
                *acc = W::load(out.as_ptr().add(o0 + c * LANES));
            }
        }
        // `j` picks a column of every row's `tmp` and a row of `b`: no one slice to iterate.
        #[allow(clippy::needless_range_loop)]
        for j in 0..ranks {
            let scales: [W; R] = std::array::from_fn(|r| W::splat(tmp[r][j]));
            let row = b.as_ptr().add(j * n + o0);
            for c in 0..C {
                let bv = W::load(row.add(c * LANES));
                for (acc, &s) in acc.iter_mut().zip(&scales) {
                    acc[c] = W::fma(s, bv, acc[c]);
                }
            }
        }
        for (acc, out) in acc.iter().zip(outs.iter_mut()) {
            for (c, &acc) in acc.iter().enumerate() {
                acc.store(out.as_mut_ptr().add(o0 + c * LANES));
            }
        }
    }
}

/// The update of all `n` outputs: chunks of `C` sets of 16, then of one, then one by one.
///
/// # Safety
/// `W`'s instruction set available; `outs[r].len() == n`, `b.len() >= ranks * n`.
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always)]
unsafe fn update<W: Vec16, const R: usize, const C: usize, E: Elem>(
    outs: &mut [&mut [f32]; R],
    tmp: &[[f32; RANK_CHUNK]; R],
    (b, ranks, n): (&[E], usize, usize),
) {
    let mut o0 = 0;
    // SAFETY: each chunk ends at or before `n`; the rest is the caller's.
    unsafe {
        while o0 + C * LANES <= n {
            update_chunk::<W, R, C, E>(outs, tmp, (b, ranks, n), o0);
            o0 += C * LANES;
        }
        while o0 + LANES <= n {
            update_chunk::<W, R, 1, E>(outs, tmp, (b, ranks, n), o0);
            o0 += LANES;
        }
    }
    for (out, tmp) in outs.iter_mut().zip(tmp) {
        for o in o0..n {
            let mut acc = out[o];
            for (j, &s) in tmp[..ranks].iter().enumerate() {
                acc = s.mul_add(b[j * n + o].widen(), acc);
            }
            out[o] = acc;
        }
    }
}

/// [`super::block`] with `J` ranks per pass of the dot products and `C` sets of 16 outputs per
/// chunk of the update.
///
/// # Safety
/// `W`'s instruction set available; `a`: `[rank, k]`, `b`: `[rank, n]`, `xs[r]`: `[k]`,
/// `outs[r]`: `[n]`.
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always)]
unsafe fn typed<W: Vec16, const R: usize, const J: usize, const C: usize>(
    xs: [&[f32]; R],
    (a, b): (&[impl Elem], &[impl Elem]),
    rank: usize,
    mut outs: [&mut [f32]; R],
) {
    let k = xs[0].len();
    let n = outs[0].len();
    let mut tmp = [[0f32; RANK_CHUNK]; R];
    for j0 in (0..rank).step_by(RANK_CHUNK) {
        let j1 = (j0 + RANK_CHUNK).min(rank);
        let mut j = j0;
        // SAFETY: rows `j..j + J <= j1 <= rank` of `a`; the instruction set is the caller's.
        unsafe {
            while j + J <= j1 {
                let d = dots::<W, R, J, _>(&xs, &a[j * k..], k);
                for (tmp, d) in tmp.iter_mut().zip(d) {
                    tmp[j - j0..j - j0 + J].copy_from_slice(&d);
                }
                j += J;
            }
            while j < j1 {
                let d = dots::<W, R, 1, _>(&xs, &a[j * k..], k);
                for (tmp, d) in tmp.iter_mut().zip(d) {
                    tmp[j - j0] = d[0];
                }
                j += 1;
            }
            update::<W, R, C, _>(&mut outs, &tmp, (&b[j0 * n..], j1 - j0, n));
        }
    }
}

/// [`typed`] in the matrices' kept types.
///
/// # Safety
/// As [`typed`].
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always)]
unsafe fn kept<W: Vec16, const R: usize, const J: usize, const C: usize>(
    xs: [&[f32]; R],
    (a, b_t): (&LoraValues, &LoraValues),
    rank: usize,
    outs: [&mut [f32]; R],
) {
    use LoraValues::{F16, F32};
    // SAFETY: forwarded.
    unsafe {
        match (a, b_t) {
            (F16(a), F16(b)) => typed::<W, R, J, C>(xs, (a, b), rank, outs),
            (F32(a), F32(b)) => typed::<W, R, J, C>(xs, (a, b), rank, outs),
            (F16(a), F32(b)) => typed::<W, R, J, C>(xs, (a, b), rank, outs),
            (F32(a), F16(b)) => typed::<W, R, J, C>(xs, (a, b), rank, outs),
        }
    }
}

/// `out_r += (x_r · aᵀ) · b_t` for `R` rows, as [`super::block`] (the same bits), in AVX2
/// vectors: each lane set is two registers, so `J = C = 4 / R` (at least 1) for 8 chains.
///
/// # Safety
/// AVX2, FMA and F16C available; `a`: `[rank, k]`, `b_t`: `[rank, n]`, `xs[r]`: `[k]`,
/// `outs[r]`: `[n]`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn block_avx2<const R: usize>(
    xs: [&[f32]; R],
    ab: (&LoraValues, &LoraValues),
    rank: usize,
    outs: [&mut [f32]; R],
) {
    // SAFETY: forwarded.
    unsafe {
        match R {
            1 => kept::<Avx2Pair, R, 4, 4>(xs, ab, rank, outs),
            2 => kept::<Avx2Pair, R, 2, 2>(xs, ab, rank, outs),
            _ => kept::<Avx2Pair, R, 1, 1>(xs, ab, rank, outs),
        }
    }
}

/// [`block_avx2`] in AVX-512 vectors: one register per lane set, so `J = C = 8 / R`.
///
/// # Safety
/// AVX-512 F available; otherwise as [`block_avx2`].
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn block_avx512<const R: usize>(
    xs: [&[f32]; R],
    ab: (&LoraValues, &LoraValues),
    rank: usize,
    outs: [&mut [f32]; R],
) {
    // SAFETY: forwarded.
    unsafe {
        match R {
            1 => kept::<Avx512, R, 8, 8>(xs, ab, rank, outs),
            2 => kept::<Avx512, R, 4, 4>(xs, ab, rank, outs),
            _ => kept::<Avx512, R, 2, 2>(xs, ab, rank, outs),
        }
    }
}
