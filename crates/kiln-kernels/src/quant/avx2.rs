//! The AVX2 kernel for every quantized format, at every number of activation rows: the loop
//! over row chunks, groups and units, and the Q4_0 / Q5_0 / Q8_0 tiles (the default model's
//! attention and MLP projections and its 178 MB LM head); the K-quant tiles are in `avx2_k`.
//!
//! The general kernel's 16-lane vectors would be two 8-lane halves on AVX2 (`x86::Avx2`, which
//! still unpacks the records of calls above one row tile): every operation doubled, and with
//! 16 vector registers its 16-lane accumulators spill. Here the 16 weight rows of a group are
//! taken as two 8-lane halves one after the other, so a tile of up to 4 activation rows keeps
//! every accumulator in a register, and the arithmetic is the cheapest AVX2 has for each
//! format:
//! - Q4_0 / Q5_0 (unsigned stored levels `w + o`, at most 31, `o` 8 or 16): each 16-bit half
//!   of a lane sums the block's 16 elements it is given by `vpmaddubsw` (pair sums at most
//!   `2·31·127`, never saturated), starting from its share `−o·Σx` of the offset
//!   ([`QuantActs::neg16_halves`]), and one `vpmaddwd` per block widens the two halves:
//!   `t = Σ (w + o)·x − o·Σx = Σ w·x`. Each half ends at `|Σ w·x| ≤ 16·16·127 < 2^15` over its
//!   16 elements; 16-bit addition wraps, so partial sums out of range change nothing. (Adding
//!   the offset after widening took a `vpsubd` and a broadcast per block and row, and Q5_0,
//!   whose unsigned sums overflow past 4 quads, a second `vpmaddwd` and `vpaddd`.)
//! - Q8_0 (stored `w + 128`): levels flipped to signed `w`, then `|w| · sign(x, w)` through
//!   `vpmaddubsw` (pair sums at most `2·128·127`, so each is widened at once) — `Σ w·x` with no
//!   correction.
//!
//! At most one row tile (`m ≤ 4`, decode), Q4_0 / Q5_0 unpack each block's levels from the
//! record into registers right before their `vpmaddubsw` ([`record_levels`]) and widen the f16
//! scales in place, instead of storing the unit to the scratch (`repack::unpack`) and loading it
//! back for a single use: Q5_0 2048 × 640 at one row went 0.062 → 0.033 ms with this and the
//! bit-plane layout together (AMD Zen 3, medians of five). The K-quant tiles (`avx2_k`) do the
//! same with their levels; their scales, several kinds per unit, are still widened once per
//! unit into the scratch (`repack::unpack_scales`).
//!
//! Bitwise contract: a block's `t` is an exact integer whichever way it is summed, and the f32
//! steps, `acc = fma(t, d_w·d_x, acc)` per block in column order starting from `+0.0`, are the
//! general kernel's, so outputs equal the scalar reference bit for bit (tested with the other
//! ISAs in `tests`).
//!
//! Prefetch: while a unit computes, its share of the group `PREFETCH_GROUPS` ahead is requested a
//! few lines per block (`super::prefetch`) by the unit's first row tile, so that the next record's
//! loads (and, above one row tile, the long unpacking of Q5_0 and the K-quants) do not wait for
//! memory with nothing else in flight: a 2048 × 640 Q5_0 matrix read from memory at one row took
//! 0.042–0.055 ms with it against 0.091 without (AMD Zen 4, 2 threads). The other row tiles of Q4_0
//! / Q5_0 / Q8_0 compile without the prefetch step (`PF`): with it in every tile, even idle, Q5_0
//! at 16 and 64 rows ran 8–20 % slower (AMD Zen 5). And these three prefetch only at decode sizes
//! (`PREFETCH_MAX_ROWS` rows at most): from 256 rows on (prefill) the weights are reused from the
//! caches by every row chunk, and prefetching cost Q4_0 7 % and Q5_0 about 20 %. On the Zen 5 the
//! 178 MB Q8_0 LM head at one row went from 36–55 to 49–70 GB/s with prefetch (69–79 → 93–133
//! GOP/s; at 64 rows 312–315 → 321–328), a Q4_0 matrix at one row from 108–109 to 137–152 GOP/s.
//! (On the Zen 4, before prefetch was spread over the arithmetic, Q8_0 had been faster without.)
//! Prefetching is a hint: results never depend on it.

use std::arch::x86_64::*;
use std::ops::Range;

use super::QuantMatrix;
use super::act::QuantActs;
use super::avx2_k;
use super::formats::{GgmlType, QK};
use super::kernel::{Acc, PREFETCH_MAX_ROWS, ROW_CHUNK, stream_output};
use super::pairs::unit_share_ahead;
use super::prefetch::{Prefetch, PrefetchSteps};
use super::repack::{LANES, RecordLayout, Unpacked, record_layout, unpack, unpack_scales};
use super::x86::Avx2;
use crate::thread_pool::SharedMut;

/// Activation rows of the register tile: as many as fit AVX2's 16 registers without spills.
const fn tile_rows(kind: u8) -> usize {
    if kind == Q8 { 3 } else { 4 }
}

/// The format's arithmetic, as a const generic.
const Q8: u8 = 8;
pub(super) const Q5: u8 = 5;
pub(super) const Q4: u8 = 4;
/// Q4_K, Q5_K, Q6_K (in `avx2_k`).
pub(super) const K4: u8 = 14;
pub(super) const K5: u8 = 15;
pub(super) const K6: u8 = 16;

/// Writes columns `16·groups.start .. min(16·groups.end, n)` of `out[m, n]`, as
/// `kernel::qgemm_groups` does.
///
/// `un` is scratch for one unpacked record; `acc` scratch for [`ROW_CHUNK`] rows of 16
/// accumulators.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `w` quantized; `acts` quantized with blocks of
/// `w.act_block()`; `out` as for `qgemm_groups`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn kernel(
    acts: &QuantActs,
    w: &QuantMatrix,
    groups: Range<usize>,
    out: SharedMut<f32>,
    un: &mut Unpacked,
    acc: &mut [[f32; LANES]],
) {
    debug_assert!(acts.block == w.act_block() && acc.len() >= ROW_CHUNK);
    debug_assert!(acts.block != QK || acts.neg16_halves.len() >= acts.m * acts.k / QK);
    // SAFETY: forwarded from the caller.
    unsafe {
        // Q4_0 / Q5_0 / Q8_0 prefetch at decode sizes only (module docs); a const, so that the
        // tiles of a call without it carry no prefetch step at all.
        let decode = acts.m <= PREFETCH_MAX_ROWS;
        match w.ty {
            GgmlType::Q8_0 if decode => run::<Q8, true>(acts, w, groups, out, un, acc),
            GgmlType::Q8_0 => run::<Q8, false>(acts, w, groups, out, un, acc),
            GgmlType::Q4_0 if decode => run::<Q4, true>(acts, w, groups, out, un, acc),
            GgmlType::Q4_0 => run::<Q4, false>(acts, w, groups, out, un, acc),
            GgmlType::Q5_0 if decode => run::<Q5, true>(acts, w, groups, out, un, acc),
            GgmlType::Q5_0 => run::<Q5, false>(acts, w, groups, out, un, acc),
            GgmlType::Q4K => run::<K4, true>(acts, w, groups, out, un, acc),
            GgmlType::Q5K => run::<K5, true>(acts, w, groups, out, un, acc),
            GgmlType::Q6K => run::<K6, true>(acts, w, groups, out, un, acc),
            _ => unreachable!("{} takes the general kernel", w.ty),
        }
    }
}

/// [`kernel`] for one format, prefetching weights ahead when `PREFETCH`.
///
/// # Safety
/// As [`kernel`], with `KIND` the format of `w`.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always)]
unsafe fn run<const KIND: u8, const PREFETCH: bool>(
    acts: &QuantActs,
    w: &QuantMatrix,
    groups: Range<usize>,
    out: SharedMut<f32>,
    un: &mut Unpacked,
    acc_buf: &mut [[f32; LANES]],
) {
    let (m, n, ty) = (acts.m, w.rows, w.ty);
    let scratch = acc_buf.as_mut_ptr().cast::<f32>();
    let stream = stream_output(m, n);
    // One row tile (decode of up to 4 rows): every format but Q8_0 (whose quads are the
    // record's own anyway) takes its levels from the record into registers, as the unpacking
    // would, without storing them to the scratch and loading them back for a single use.
    let fused = KIND != Q8 && m <= tile_rows(KIND);
    for r0 in (0..m).step_by(ROW_CHUNK) {
        let r1 = (r0 + ROW_CHUNK).min(m);
        for g in groups.clone() {
            let lanes = (n - g * LANES).min(LANES);
            // Full groups: the last unit stores straight into `out`.
            let direct = lanes == LANES;
            for u in 0..w.units {
                // SAFETY: row `r0` of `out` is in bounds (the caller's).
                let dst = unsafe { out.ptr().add(r0 * n + g * LANES) };
                let acc = Acc::for_unit(u, w.units, scratch, direct.then_some(dst), n, stream);
                let nb = w.unit_blocks(u);
                let rec = w.record(g, u);
                let lay = record_layout(ty, nb);
                // SAFETY (block): `rec` is a whole record of `w`, laid out as `lay`; AVX2 is
                // the caller's. The unpacked quads (Q8_0, and every format when `fused`: the
                // record's own) hold the unit's `nb` blocks; when `fused`, the K-quant tiles
                // read this unit's scales from `un` (`unpack_scales` just above); rows
                // `i..i + R` are below `r1`, inside `acts`, `out` and the scratch.
                unsafe {
                    if !fused {
                        unpack::<Avx2>(ty, nb, rec, un);
                    } else if KIND >= K4 {
                        // Q4_0 / Q5_0 widen their f16 scales in the tile; the K-quants' are
                        // several kinds, widened once per unit.
                        unpack_scales::<Avx2>(ty, nb, rec, un);
                    }
                    let quads = if KIND == Q8 || fused { rec } else { un.quads.as_ptr().cast() };
                    // This unit's share of the group `PREFETCH_GROUPS` ahead, a few lines per
                    // block (K-quants: per sub-block pass) of the first row tile; Q4_0, Q5_0
                    // and Q8_0 at decode sizes only (module docs).
                    let ahead = if PREFETCH {
                        unit_share_ahead(w, g..g + 1, groups.end, u)
                    } else {
                        Prefetch::NONE
                    };
                    let mut pf = ahead.steps(2 * if KIND >= K4 { 8 } else { nb });
                    let mut i = r0;
                    while i < r1 {
                        let a = acc.rows_from(i - r0);
                        let rows = (r1 - i).min(tile_rows(KIND));
                        let t = Tile { nb, quads, un, acts, i, u, acc: a, fused, lay };
                        for h in 0..2 {
                            // Only the first row tile prefetches: the others carry no step.
                            if PREFETCH && i == r0 {
                                tile_rows_of::<KIND, true>(rows, &t, h, &mut pf);
                            } else {
                                tile_rows_of::<KIND, false>(rows, &t, h, &mut pf);
                            }
                        }
                        i += rows;
                    }
                }
            }
            if !direct {
                for (i, a) in (r0..r1).zip(acc_buf.iter()) {
                    // SAFETY: the caller's task owns these columns of every output row.
                    let o = unsafe { out.slice(i * n + g * LANES, lanes) };
                    o.copy_from_slice(&a[..lanes]);
                }
            }
        }
    }
}

/// 4 activation bytes at `p` in every i32 lane.
///
/// # Safety
/// 4 readable bytes at `p`; AVX available.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always)]
pub(super) unsafe fn bcast(p: *const i8) -> __m256i {
    // SAFETY: as the caller guarantees.
    unsafe { _mm256_set1_epi32(p.cast::<i32>().read_unaligned()) }
}

/// Lanes `8h..8h + 8` of row `r`'s accumulator before this unit (`+0.0` on the first unit).
///
/// # Safety
/// Row `r` inside `acc`'s buffers; AVX available.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always)]
pub(super) unsafe fn load_half(acc: Acc, r: usize, h: usize) -> __m256 {
    let (load, _) = acc.row_ptrs(r);
    // SAFETY: as the caller guarantees.
    unsafe { if load.is_null() { _mm256_setzero_ps() } else { _mm256_loadu_ps(load.add(8 * h)) } }
}

/// Stores lanes `8h..8h + 8` of row `r`'s accumulator after this unit, non-temporally into a
/// vocabulary-sized output (`kernel::stream_output`; the two halves fill one 64-byte line).
///
/// # Safety
/// As [`load_half`], and the caller's task owns the row's lanes.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always)]
pub(super) unsafe fn store_half(acc: Acc, r: usize, h: usize, v: __m256) {
    let (_, store) = acc.row_ptrs(r);
    // SAFETY: as the caller guarantees; the streaming store needs (and checks) 32 bytes of
    // alignment.
    unsafe {
        let p = store.add(8 * h);
        if acc.streams() && (p as usize).is_multiple_of(32) {
            _mm256_stream_ps(p, v);
        } else {
            _mm256_storeu_ps(p, v);
        }
    }
}

/// One unit's record and one row tile: `nb` blocks of `quads` (scales in `un`) against
/// activation rows `i..` of `acts`, accumulated in `acc`. When `fused` (every format but
/// Q8_0, at one row tile), `quads` is the record itself (laid out as `lay`) and levels are read
/// from it; Q4_0 / Q5_0 read their f16 scales from it too (`un` is not used), the K-quants
/// theirs from `un` (`repack::unpack_scales`).
pub(super) struct Tile<'a> {
    pub nb: usize,
    pub quads: *const u8,
    pub un: &'a Unpacked,
    pub acts: &'a QuantActs,
    pub i: usize,
    pub u: usize,
    pub acc: Acc,
    pub fused: bool,
    pub lay: RecordLayout,
}

/// Half `h` of `t` for its first `rows` rows (at most 4), by format; Q4_0 / Q5_0 / Q8_0 step
/// `pf` only when `PF` (the K-quants' steps are per sub-block pass and always taken).
///
/// # Safety
/// As [`tile`] (and `avx2_k`'s tiles), with `rows` rows.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always)]
unsafe fn tile_rows_of<const KIND: u8, const PF: bool>(
    rows: usize,
    t: &Tile<'_>,
    h: usize,
    pf: &mut PrefetchSteps,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match rows {
            1 => tile_any::<KIND, 1, PF>(t, h, pf),
            2 => tile_any::<KIND, 2, PF>(t, h, pf),
            3 => tile_any::<KIND, 3, PF>(t, h, pf),
            _ => tile_any::<KIND, 4, PF>(t, h, pf),
        }
    }
}

/// Half `h` of `t` against its activation rows `i..i + R`, by format.
///
/// # Safety
/// As [`tile`] (and `avx2_k`'s tiles).
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always)]
unsafe fn tile_any<const KIND: u8, const R: usize, const PF: bool>(
    t: &Tile<'_>,
    h: usize,
    pf: &mut PrefetchSteps,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match KIND {
            K4 | K5 if t.fused => avx2_k::tile_k45::<KIND, R, true>(t, h, pf),
            K4 | K5 => avx2_k::tile_k45::<KIND, R, false>(t, h, pf),
            K6 if t.fused => avx2_k::tile_q6k::<R, true>(t, h, pf),
            K6 => avx2_k::tile_q6k::<R, false>(t, h, pf),
            Q4 | Q5 if t.fused => tile::<KIND, R, PF, true>(t, h, pf),
            _ => tile::<KIND, R, PF, false>(t, h, pf),
        }
    }
}

/// Half `h` (lanes `8h..8h + 8`) of one unit against activation rows `tl.i..tl.i + R`.
///
/// `tl.quads`: the unit's `nb` blocks of 8 quads (`[16 lanes][4]` bytes each), with the f32
/// scales `[8][16]` of its blocks in `tl.un`; or, when `FUSED` (Q4_0 / Q5_0), the record, from
/// which each block's levels are unpacked into registers (as `repack::unpack` does) and its
/// f16 scales widened. `pf` is stepped once per block when `PF`.
///
/// # Safety
/// AVX2/FMA available; the pointers as described; rows `i..i + R` inside `acts` and `acc`.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always, clippy::needless_range_loop)]
unsafe fn tile<const KIND: u8, const R: usize, const PF: bool, const FUSED: bool>(
    tl: &Tile<'_>,
    h: usize,
    pf: &mut PrefetchSteps,
) {
    let Tile { nb, quads, un, acts, i, u, acc, lay, .. } = *tl;
    let fs = un.fscale.as_ptr().cast::<f32>();
    let k = acts.k;
    let nbk = k / QK;
    let offsets = acts.neg16_halves.as_ptr();
    // SAFETY (whole body): blocks `u·8 + b` of rows `i..i + R` are inside `acts` (and its
    // `neg16_halves`, which `QuantActs::quantize` fills for blocks of 32); the unit holds `nb`
    // blocks of 8 quads; `acc` has `R` rows; AVX2/FMA are the caller's.
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let flip = _mm256_set1_epi8(-128);
        let mut a: [__m256; R] = std::array::from_fn(|r| load_half(acc, r, h));
        for b in 0..nb {
            if PF {
                pf.step();
            }
            let bg = u * 8 + b;
            let x: [*const i8; R] =
                std::array::from_fn(|r| acts.qs.as_ptr().add((i + r) * k + bg * QK));
            // Unpacked quad `q` of the block, this half (Q8_0, or not `FUSED`).
            let quad = |q: usize| _mm256_loadu_si256(quads.add((8 * b + q) * 64 + 32 * h).cast());
            let bx = |r: usize, q: usize| bcast(x[r].add(4 * q));
            let mut t = [_mm256_setzero_si256(); R];
            if KIND == Q8 {
                for q in 0..8 {
                    let wq = _mm256_xor_si256(quad(q), flip);
                    let aw = _mm256_abs_epi8(wq);
                    for r in 0..R {
                        let p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bx(r, q), wq));
                        t[r] = _mm256_add_epi32(t[r], _mm256_madd_epi16(p, ones));
                    }
                }
            } else {
                // The 16-bit sums start from the offset's share (module docs); Q4_0's offset
                // is 8, half of the stored 16.
                let mut s16: [__m256i; R] = std::array::from_fn(|r| {
                    let start = _mm256_set1_epi32(*offsets.add((i + r) * nbk + bg));
                    if KIND == Q4 { _mm256_srai_epi16::<1>(start) } else { start }
                });
                // Fused: this half of the block's bit plane (Q5_0), for its 4 nibble vectors.
                let plane = if FUSED && KIND == Q5 {
                    _mm256_loadu_si256(quads.add(lay.hi + b * 64 + 32 * h).cast())
                } else {
                    _mm256_setzero_si256()
                };
                for p in 0..4 {
                    let (lo, hi) = if FUSED {
                        record_levels::<KIND>(quads.add((4 * b + p) * 64 + 32 * h), plane, p)
                    } else {
                        (quad(2 * p), quad(2 * p + 1))
                    };
                    for (q, wv) in [(2 * p, lo), (2 * p + 1, hi)] {
                        for r in 0..R {
                            let d = _mm256_maddubs_epi16(wv, bx(r, q));
                            s16[r] = _mm256_add_epi16(s16[r], d);
                        }
                    }
                }
                for r in 0..R {
                    t[r] = _mm256_madd_epi16(s16[r], ones);
                }
            }
            let fsv = if FUSED {
                _mm256_cvtph_ps(_mm_loadu_si128(quads.add(lay.d + b * 32 + 16 * h).cast()))
            } else {
                _mm256_loadu_ps(fs.add(b * LANES + 8 * h))
            };
            for r in 0..R {
                let dx = _mm256_set1_ps(*acts.d.get_unchecked((i + r) * nbk + bg));
                a[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[r]), _mm256_mul_ps(fsv, dx), a[r]);
            }
        }
        for (r, &ar) in a.iter().enumerate() {
            store_half(acc, r, h, ar);
        }
    }
}

/// Quads `8b + 2p` and `8b + 2p + 1` of a record's 8-quad block `b` (a Q4_0 / Q5_0 block, a
/// Q4_K / Q5_K sub-block), one half, as unsigned levels (what `repack::unpack` stores): the
/// low and high nibbles of the 32 bytes at `nibbles`, with (`KIND` = `Q5`, for Q5_0 and Q5_K)
/// bits `2p`, `2p + 1` of `plane` (the block's bit plane, same half).
///
/// # Safety
/// AVX2 available; 32 readable bytes at `nibbles`.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always)]
pub(super) unsafe fn record_levels<const KIND: u8>(
    nibbles: *const u8,
    plane: __m256i,
    p: usize,
) -> (__m256i, __m256i) {
    // SAFETY: as the caller guarantees.
    unsafe {
        let m4 = _mm256_set1_epi8(0x0F);
        let x = _mm256_loadu_si256(nibbles.cast());
        let lo = _mm256_and_si256(x, m4);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(x), m4);
        if KIND == Q5 {
            let lo = _mm256_or_si256(lo, bit4_half(plane, 2 * p));
            (lo, _mm256_or_si256(hi, bit4_half(plane, 2 * p + 1)))
        } else {
            (lo, hi)
        }
    }
}

/// `repack::bit4_of` on one half: bit `t` of every byte of a Q5 bit plane at bit 4 (levels
/// 16 or 0), the others cleared.
///
/// # Safety
/// AVX2 available.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always)]
unsafe fn bit4_half(plane: __m256i, t: usize) -> __m256i {
    // SAFETY: register operations; AVX2 is the caller's.
    unsafe {
        let moved = match t {
            0 => _mm256_slli_epi16::<4>(plane),
            1 => _mm256_slli_epi16::<3>(plane),
            2 => _mm256_slli_epi16::<2>(plane),
            3 => _mm256_slli_epi16::<1>(plane),
            4 => plane,
            5 => _mm256_srli_epi16::<1>(plane),
            6 => _mm256_srli_epi16::<2>(plane),
            _ => _mm256_srli_epi16::<3>(plane),
        };
        _mm256_and_si256(moved, _mm256_set1_epi8(0x10))
    }
}
