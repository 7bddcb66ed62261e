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
//! At one row tile (decode, up to 4 rows) the tiles take their levels straight from the record
//! (`FUSED`: the nibbles, Q5_K's bit plane and Q6_K's high-bit pairs combined in registers,
//! right before their `vpmaddubsw`), as Q4_0 / Q5_0 do (`avx2`), instead of from the scratch
//! the unit was unpacked into: unpacking stored 4 KiB per unit (and Q6_K read it back once
//! more to add its high bits) that one row tile then loaded once.
//!
//! Bitwise contract: `t` (and Q4_K/Q5_K's `u`) are the same exact integers as the general
//! kernel's, and the f32 steps are its own (`kernel.rs`), so outputs equal the scalar reference
//! bit for bit.

use std::arch::x86_64::*;

use super::avx2::{K4, K5, Q4, Q5, Tile, bcast, load_half, record_levels, store_half};
use super::prefetch::PrefetchSteps;

/// Each i32 lane's low 16 bits copied into its high 16 bits: a lane's scale as the operand of
/// `vpmaddwd` that multiplies both halves of a 16-bit pair by it.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always)]
unsafe fn both_halves(v: __m256i) -> __m256i {
    // SAFETY: AVX2 is the caller's.
    unsafe { _mm256_blend_epi16::<0xAA>(v, _mm256_slli_epi32::<16>(v)) }
}

/// Q4_K / Q5_K (`KIND` = `K4` / `K5`): half `h` of one unit against rows `tl.i..tl.i + R`;
/// levels from the record when `FUSED`.
///
/// # Safety
/// AVX2/FMA available; `tl.quads` is the unit's 64 unpacked quads, or when `FUSED` the
/// unit's record (packed as `tl.lay` says); `tl.un` holds this unit's scales; block `tl.u` of
/// rows `tl.i..tl.i + R` inside `tl.acts`; `tl.acc` has `R` rows; `pf` as in `avx2`.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always, clippy::needless_range_loop)]
pub(super) unsafe fn tile_k45<const KIND: u8, const R: usize, const FUSED: bool>(
    tl: &Tile<'_>,
    h: usize,
    pf: &mut PrefetchSteps,
) {
    let Tile { quads, un, acts, i, u, acc, lay, .. } = *tl;
    let k = acts.k;
    let split = if KIND == K4 { 8 } else { 4 };
    // SAFETY (whole body): as the caller guarantees; every offset stays in the unit's quads
    // (or record), scales and activations.
    unsafe {
        let x: [*const i8; R] = acts.unit_rows(i, u);
        let mut t = [_mm256_setzero_si256(); R];
        for s in 0..8 {
            pf.step();
            let sc = both_halves(_mm256_loadu_si256(un.iscale[s].as_ptr().add(8 * h).cast()));
            // Fused Q5_K: sub-block `s`'s bit plane (quads `8s..8s + 8`), this half.
            let plane = if FUSED && KIND == K5 {
                _mm256_loadu_si256(quads.add(lay.hi + s * 64 + 32 * h).cast())
            } else {
                _mm256_setzero_si256()
            };
            let mut s16 = [_mm256_setzero_si256(); R];
            for p in 0..4 {
                // Quads `8s + 2p` and `8s + 2p + 1`: nibble vector `4s + p` of the record.
                let (lo, hi) = if !FUSED {
                    // Unpacked quad `8s + q`, this half (only the scratch holds 64 quads, so
                    // this offset is never taken from the record).
                    let quad =
                        |q: usize| _mm256_loadu_si256(quads.add((8 * s + q) * 64 + 32 * h).cast());
                    (quad(2 * p), quad(2 * p + 1))
                } else if KIND == K5 {
                    record_levels::<Q5>(quads.add((4 * s + p) * 64 + 32 * h), plane, p)
                } else {
                    record_levels::<Q4>(quads.add((4 * s + p) * 64 + 32 * h), plane, p)
                };
                for (q, wv) in [(2 * p, lo), (2 * p + 1, hi)] {
                    for r in 0..R {
                        let d = _mm256_maddubs_epi16(wv, bcast(x[r].add(s * 32 + 4 * q)));
                        s16[r] = _mm256_add_epi16(s16[r], d);
                    }
                    if q % split == split - 1 {
                        for r in 0..R {
                            t[r] = _mm256_add_epi32(t[r], _mm256_madd_epi16(s16[r], sc));
                            s16[r] = _mm256_setzero_si256();
                        }
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

/// Q6_K: half `h` of one unit against rows `tl.i..tl.i + R`; levels from the record when
/// `FUSED`.
///
/// # Safety
/// As [`tile_k45`].
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always, clippy::needless_range_loop)]
pub(super) unsafe fn tile_q6k<const R: usize, const FUSED: bool>(
    tl: &Tile<'_>,
    h: usize,
    pf: &mut PrefetchSteps,
) {
    let Tile { quads, un, acts, i, u, acc, lay, .. } = *tl;
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
            // Fused: sub-block `s`'s high-bit pairs (quads `4s..4s + 4`), this half.
            let high = if FUSED {
                _mm256_loadu_si256(quads.add(lay.hi + s * 64 + 32 * h).cast())
            } else {
                _mm256_setzero_si256()
            };
            for pair in 0..2 {
                let (w0, w1) = if FUSED {
                    q6k_record_levels(quads.add((2 * s + pair) * 64 + 32 * h), high, pair)
                } else {
                    // Unpacked quads `4s + 2·pair`, `+ 1` (scratch offsets only, as in
                    // `tile_k45`).
                    let quad =
                        |q: usize| _mm256_loadu_si256(quads.add((4 * s + q) * 64 + 32 * h).cast());
                    (quad(2 * pair), quad(2 * pair + 1))
                };
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

/// Quads `4s + 2·pair` and `4s + 2·pair + 1` of a Q6_K record, one half, as the 6-bit levels
/// `repack::unpack` stores: the low and high nibbles of the 32 bytes at `nibbles` (vector
/// `2s + pair`), each with its bit pair `2·pair`, `2·pair + 1` of `high` (sub-block `s`'s
/// high-bit vector) moved to bits 4..5. A 16-bit shift moves each byte's pair within its
/// byte; the mask drops what crossed over.
///
/// # Safety
/// AVX2 available; 32 readable bytes at `nibbles`.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always)]
unsafe fn q6k_record_levels(nibbles: *const u8, high: __m256i, pair: usize) -> (__m256i, __m256i) {
    // SAFETY: as the caller guarantees.
    unsafe {
        let (m4, m3) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
        let x = _mm256_loadu_si256(nibbles.cast());
        let lo = _mm256_and_si256(x, m4);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(x), m4);
        let (h_lo, h_hi) = if pair == 0 {
            (_mm256_slli_epi16::<4>(high), _mm256_slli_epi16::<2>(high))
        } else {
            (high, _mm256_srli_epi16::<2>(high))
        };
        (
            _mm256_or_si256(lo, _mm256_and_si256(h_lo, m3)),
            _mm256_or_si256(hi, _mm256_and_si256(h_hi, m3)),
        )
    }
}
