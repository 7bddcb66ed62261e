//! The K-quant tiles of the AVX2 kernel (`avx2`): Q4_K / Q5_K / Q6_K, one 256-element block
//! per unit, half a group (8 weight rows) against up to 4 activation rows.
//!
//! Where the general kernel widens every `vpmaddubsw` at once and multiplies each sub-block's
//! sum by its scale with `vpmulld`, these tiles sum `vpmaddubsw` results in 16-bit lanes for a
//! whole sub-block (Q4_K: 8 quads, levels at most 15; Q5_K: 4 quads, at most 31; Q6_K: 2
//! quads, at most 63 — never past `i16::MAX`) and then let one `vpmaddwd` by the sub-block's
//! scale (copied into both 16-bit halves of its lane) widen, scale and pair-sum in one step.
//! Q6_K's offset, `−32·Σ_s sc_s·Σx_s`, is summed over pairs of sub-blocks with `vpmaddwd` too,
//! instead of a subtraction per sub-block.
//!
//! Bitwise contract: `t` (and Q4_K/Q5_K's `u`) are the same exact integers as the general
//! kernel's, and the f32 steps are its own (`kernel.rs`), so outputs equal the scalar reference
//! bit for bit.

use std::arch::x86_64::*;

use super::act::QuantActs;
use super::avx2::{K4, bcast, load_half, store_half};
use super::kernel::Acc;
use super::prefetch::PrefetchSteps;
use super::repack::Unpacked;

/// Each i32 lane's low 16 bits copied into its high 16 bits: a lane's scale as the operand of
/// `vpmaddwd` that multiplies both halves of a 16-bit pair by it.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always)]
unsafe fn both_halves(v: __m256i) -> __m256i {
    // SAFETY: AVX2 is the caller's.
    unsafe { _mm256_blend_epi16::<0xAA>(v, _mm256_slli_epi32::<16>(v)) }
}

/// Q4_K / Q5_K (`KIND` = `K4` / `K5`): half `h` of one unit against rows `i..i + R`.
///
/// # Safety
/// AVX2/FMA available; `quads` holds the unit's 64 quads and `un` its scales; block `u` of rows
/// `i..i + R` inside `acts`; `acc` has `R` rows; `pf` as in `avx2`.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always, clippy::too_many_arguments, clippy::needless_range_loop)]
pub(super) unsafe fn tile_k45<const KIND: u8, const R: usize>(
    quads: *const u8,
    un: &Unpacked,
    acts: &QuantActs,
    i: usize,
    u: usize,
    acc: Acc,
    h: usize,
    pf: &mut PrefetchSteps,
) {
    let k = acts.k;
    let split = if KIND == K4 { 8 } else { 4 };
    // SAFETY (whole body): as the caller guarantees; every offset stays in the unit's quads,
    // scales and activations.
    unsafe {
        let x: [*const i8; R] = acts.unit_rows(i, u);
        let mut t = [_mm256_setzero_si256(); R];
        for s in 0..8 {
            pf.step();
            let sc = both_halves(_mm256_loadu_si256(un.iscale[s].as_ptr().add(8 * h).cast()));
            let w = quads.add(s * 8 * 64 + 32 * h);
            let mut s16 = [_mm256_setzero_si256(); R];
            for q in 0..8 {
                let wv = _mm256_loadu_si256(w.add(q * 64).cast());
                for r in 0..R {
                    let p = _mm256_maddubs_epi16(wv, bcast(x[r].add(s * 32 + 4 * q)));
                    s16[r] = _mm256_add_epi16(s16[r], p);
                }
                if q % split == split - 1 {
                    for r in 0..R {
                        t[r] = _mm256_add_epi32(t[r], _mm256_madd_epi16(s16[r], sc));
                        s16[r] = _mm256_setzero_si256();
                    }
                }
            }
        }
        let d = _mm256_loadu_ps(un.fscale[0].as_ptr().add(8 * h));
        let dmin = _mm256_loadu_ps(un.fscale[1].as_ptr().add(8 * h));
        for r in 0..R {
            let pairs = acts.pairs.as_ptr().add((i + r) * (k / 64) + u * 4);
            let mut mn = _mm256_setzero_si256();
            for p in 0..4 {
                let mins = _mm256_loadu_si256(un.mins[p].as_ptr().add(8 * h).cast());
                mn =
                    _mm256_add_epi32(mn, _mm256_madd_epi16(mins, _mm256_set1_epi32(*pairs.add(p))));
            }
            let dx = _mm256_set1_ps(*acts.d.get_unchecked((i + r) * (k / 256) + u));
            let mut a = load_half(acc, r, h);
            a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[r]), _mm256_mul_ps(d, dx), a);
            a = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mn), _mm256_mul_ps(dmin, dx), a);
            store_half(acc, r, h, a);
        }
    }
}

/// Q6_K: half `h` of one unit against rows `i..i + R`.
///
/// # Safety
/// As [`tile_k45`].
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always, clippy::too_many_arguments, clippy::needless_range_loop)]
pub(super) unsafe fn tile_q6k<const R: usize>(
    quads: *const u8,
    un: &Unpacked,
    acts: &QuantActs,
    i: usize,
    u: usize,
    acc: Acc,
    h: usize,
    pf: &mut PrefetchSteps,
) {
    let k = acts.k;
    // SAFETY (whole body): as the caller guarantees.
    unsafe {
        let x: [*const i8; R] = acts.unit_rows(i, u);
        let sx: [*const i32; R] = acts.unit_sums16(i, u);
        let scale = |s: usize| _mm256_loadu_si256(un.iscale[s].as_ptr().add(8 * h).cast());
        let mut t = [_mm256_setzero_si256(); R];
        for s in 0..16 {
            if s % 2 == 0 {
                pf.step();
            }
            let sc = both_halves(scale(s));
            let w = quads.add(s * 4 * 64 + 32 * h);
            for pair in 0..2 {
                let w0 = _mm256_loadu_si256(w.add(2 * pair * 64).cast());
                let w1 = _mm256_loadu_si256(w.add((2 * pair + 1) * 64).cast());
                for r in 0..R {
                    let xs = x[r].add(s * 16 + 8 * pair);
                    let p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(w0, bcast(xs)),
                        _mm256_maddubs_epi16(w1, bcast(xs.add(4))),
                    );
                    t[r] = _mm256_add_epi32(t[r], _mm256_madd_epi16(p, sc));
                }
            }
        }
        // The offset: Σ_s sc_s · Σx_s over sub-block pairs (scales and sums both fit i16).
        let mut off = [_mm256_setzero_si256(); R];
        for p in 0..8 {
            let sc =
                _mm256_blend_epi16::<0xAA>(scale(2 * p), _mm256_slli_epi32::<16>(scale(2 * p + 1)));
            for r in 0..R {
                let pair = (*sx[r].add(2 * p) & 0xFFFF) | (*sx[r].add(2 * p + 1) << 16);
                off[r] = _mm256_add_epi32(off[r], _mm256_madd_epi16(sc, _mm256_set1_epi32(pair)));
            }
        }
        let d = _mm256_loadu_ps(un.fscale[0].as_ptr().add(8 * h));
        for r in 0..R {
            let tr = _mm256_sub_epi32(t[r], _mm256_slli_epi32::<5>(off[r]));
            let dx = _mm256_set1_ps(*acts.d.get_unchecked((i + r) * (k / 256) + u));
            let a =
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(tr), _mm256_mul_ps(d, dx), load_half(acc, r, h));
            store_half(acc, r, h, a);
        }
    }
}
