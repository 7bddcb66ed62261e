//! The AVX-512 VNNI kernel for calls with [`MIN_ROWS`] or more activation rows: a register
//! tile of 2 weight groups (32 weight rows) × 4 activation rows. Q4_0 / Q5_0 / Q8_0 tiles are
//! here, the K-quant ones in `pairs_k`.
//!
//! The arithmetic is the general kernel's (`kernel::row_a`): unsigned stored levels `w + o`
//! against signed activations, `t = Σ (w + o)·x − o·Σx` per block. What changes is the order
//! of the work. Each activation quad, broadcast as the memory operand of `vpdpbusd`, feeds
//! both groups, and each weight vector feeds 4 rows: eight independent `vpdpbusd` chains,
//! enough to hide the instruction's latency at two per cycle. The correction `−o·Σx` depends on
//! the row and block only, so it is the start value of both groups' integer accumulators
//! instead of a subtraction per group. On a CPU that issues two `vpdpbusd` per cycle (AMD Zen
//! 5) that doubles the work each load and broadcast serves, and the tile runs at about 75 % of
//! the `vpdpbusd` peak against the general kernel's 50–60 %.
//! As in the general kernel, K-quant calls of decode size take their levels straight from the
//! records (`levels`); larger ones unpack each unit once for all their row tiles.
//!
//! Bitwise contract: a block's `t` is an exact integer whichever way it is summed, and the f32
//! steps, `acc = fma(t, d_w·d_x, acc)` per block in column order, are the general kernel's, so
//! outputs equal the scalar reference bit for bit (tested with the other ISAs).

use std::arch::x86_64::*;
use std::ops::Range;

use super::QuantMatrix;
use super::act::QuantActs;
use super::formats::{GgmlType, QK};
use super::isa::Isa;
use super::kernel::{Acc, PREFETCH_GROUPS, PREFETCH_MAX_ROWS, ROW_CHUNK, stream_output};
use super::levels::{Q4Record, Q5Record, Q6Record, Quads, from_record};
use super::pairs_k;
use super::prefetch::Prefetch;
use super::repack::{LANES, UNIT, Unpacked, unpack, unpack_scales};
use super::x86::Vnni;
use crate::thread_pool::SharedMut;

/// Activation rows from which a call takes this kernel (one full tile). Below it the general
/// kernel's one weight group per broadcast does as well. With the spread prefetch of
/// [`super::prefetch`] this kernel is also the faster one at 4–7 rows (the 262k × 640 Q8_0
/// LM head at 4 rows: 4.9–6.2 ms against 5.5–7.6, alternating runs).
pub(crate) const MIN_ROWS: usize = 4;

/// Activation rows of the register tile.
const TILE_ROWS: usize = 4;

/// Whether [`kernel`] serves `ty` at `m` activation rows.
pub(crate) fn applies(ty: GgmlType, m: usize) -> bool {
    ty.is_quantized() && m >= MIN_ROWS
}

/// Per-thread buffers of the two groups in flight.
pub(crate) struct PairScratch {
    /// The records unpacked (Q8_0: only the scales; its levels are read from the record).
    un: [Box<Unpacked>; 2],
    /// `[group][ROW_CHUNK][16]`: accumulators between units.
    acc: [[[f32; LANES]; ROW_CHUNK]; 2],
}

impl PairScratch {
    pub(crate) fn new() -> Box<Self> {
        Box::new(Self {
            un: [Unpacked::new(), Unpacked::new()],
            acc: [[[0.0; LANES]; ROW_CHUNK]; 2],
        })
    }
}

/// Writes columns `16·groups.start .. min(16·groups.end, n)` of `out[m, n]`, as
/// `kernel::qgemm_groups` does.
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI must be available; [`applies`] holds for `w.ty` and `acts.m`;
/// `acts` quantized with blocks of `w.act_block()`; `out` as for `qgemm_groups`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
pub(crate) unsafe fn kernel(
    acts: &QuantActs,
    w: &QuantMatrix,
    groups: Range<usize>,
    out: SharedMut<f32>,
    s: &mut PairScratch,
) {
    debug_assert!(applies(w.ty, acts.m) && acts.block == w.act_block());
    let m = acts.m;
    for r0 in (0..m).step_by(ROW_CHUNK) {
        let rows = r0..(r0 + ROW_CHUNK).min(m);
        let mut g = groups.start;
        while g < groups.end {
            // SAFETY: forwarded from the caller; `g` (and `g + 1` for a pair) are in `groups`.
            unsafe {
                if g + 1 < groups.end {
                    group_tile::<2>(acts, w, g, groups.end, rows.clone(), out, s);
                    g += 2;
                } else {
                    group_tile::<1>(acts, w, g, groups.end, rows.clone(), out, s);
                    g += 1;
                }
            }
        }
    }
}

/// Groups `g..g + G` against activation rows `rows` (at most [`ROW_CHUNK`]), every unit.
///
/// # Safety
/// As [`kernel`].
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always)]
unsafe fn group_tile<const G: usize>(
    acts: &QuantActs,
    w: &QuantMatrix,
    g: usize,
    end: usize,
    rows: Range<usize>,
    out: SharedMut<f32>,
    s: &mut PairScratch,
) {
    let (m, n, ty) = (acts.m, w.rows, w.ty);
    let stream = stream_output(m, n);
    let prefetch = m <= PREFETCH_MAX_ROWS;
    let lanes: [usize; G] = std::array::from_fn(|j| (n - (g + j) * LANES).min(LANES));
    let scratch: [*mut f32; G] = std::array::from_fn(|j| s.acc[j].as_mut_ptr().cast::<f32>());
    for u in 0..w.units {
        let nb = w.unit_blocks(u);
        let acc: [Acc; G] = std::array::from_fn(|j| {
            // SAFETY: row `rows.start` of `out` is in bounds (the caller's).
            let dst = unsafe { out.ptr().add(rows.start * n + (g + j) * LANES) };
            let direct = (lanes[j] == LANES).then_some(dst);
            Acc::for_unit(u, w.units, scratch[j], direct, n, stream)
        });
        // Decode-sized chunks build K-quant levels from the record (`levels`).
        let fused = from_record::<Vnni>(ty, rows.len());
        let recs: [*const u8; G] = std::array::from_fn(|j| w.record(g + j, u));
        let mut quads = [std::ptr::null(); G];
        for (j, q) in quads.iter_mut().enumerate() {
            // SAFETY: `recs[j]` is a whole record of `nb` blocks.
            unsafe {
                if fused {
                    unpack_scales::<Vnni>(ty, nb, recs[j], &mut s.un[j]);
                } else {
                    unpack::<Vnni>(ty, nb, recs[j], &mut s.un[j]);
                }
            }
            *q = if ty == GgmlType::Q8_0 { recs[j] } else { s.un[j].quads.as_ptr().cast() };
        }
        let s = &*s;
        // This unit's share of the groups `PREFETCH_GROUPS` ahead, spread over its row tiles.
        let ahead = if prefetch {
            unit_share_ahead(w, g..(g + G).min(end), end, u)
        } else {
            Prefetch::NONE
        };
        let num_tiles = rows.len() / TILE_ROWS + rows.len() % TILE_ROWS;
        let mut i = rows.start;
        let mut t = 0;
        while i < rows.end {
            let pf = ahead.part(t, num_tiles);
            t += 1;
            // SAFETY: rows `i..` are inside the chunk's scratch and `out` rows; blocks of unit
            // `u` are inside `acts` (`k` columns); the features are the caller's.
            unsafe {
                let acc = acc.map(|a| a.rows_from(i - rows.start));
                let lv = UnitLevels { ty, nb, quads, recs, fused };
                if rows.end - i >= TILE_ROWS {
                    tile_any::<G, TILE_ROWS>(lv, s, acts, i, u, acc, pf);
                    i += TILE_ROWS;
                } else {
                    tile_any::<G, 1>(lv, s, acts, i, u, acc, pf);
                    i += 1;
                }
            }
        }
    }
    for j in 0..G {
        if lanes[j] < LANES {
            for (i, a) in rows.clone().zip(s.acc[j].iter()) {
                // SAFETY: the caller's task owns these columns of every output row.
                let o = unsafe { out.slice(i * n + (g + j) * LANES, lanes[j]) };
                o.copy_from_slice(&a[..lanes[j]]);
            }
        }
    }
}

/// The weight bytes to request while unit `u` of `groups` computes: the same share of the
/// groups [`PREFETCH_GROUPS`] further on (up to `end`) as unit `u` is of a row, so that a pass
/// over all units requests those groups whole, each line once.
pub(crate) fn unit_share_ahead(
    w: &QuantMatrix,
    groups: Range<usize>,
    end: usize,
    u: usize,
) -> Prefetch {
    let (first, last) = (groups.start + PREFETCH_GROUPS, (groups.end + PREFETCH_GROUPS).min(end));
    if first >= last {
        return Prefetch::NONE;
    }
    let span = (last - first) * w.group_bytes;
    let (c0, c1) = (u * UNIT, ((u + 1) * UNIT).min(w.cols));
    let base = first * w.group_bytes;
    Prefetch::bytes(w, base + span * c0 / w.cols, base + span * c1 / w.cols)
}

/// Where [`tile_any`] reads one unit of `G` groups.
#[derive(Clone, Copy)]
struct UnitLevels<const G: usize> {
    ty: GgmlType,
    /// Blocks in the unit.
    nb: usize,
    /// Each group's unpacked quads (Q8_0: its record); unused when `fused`.
    quads: [*const u8; G],
    /// Each group's record.
    recs: [*const u8; G],
    /// K-quant levels come from `recs` ([`from_record`]); the scratch holds only the scales.
    fused: bool,
}

/// Activation rows `i..i + R` against unit `u` of groups `0..G`, by weight type; `pf` is
/// requested along the way.
///
/// # Safety
/// As [`tile`]; when `lv.fused`, `lv.recs` are the groups' K-quant records.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always)]
unsafe fn tile_any<const G: usize, const R: usize>(
    lv: UnitLevels<G>,
    s: &PairScratch,
    acts: &QuantActs,
    i: usize,
    u: usize,
    acc: [Acc; G],
    pf: Prefetch,
) {
    let UnitLevels { ty, nb, quads, recs, fused } = lv;
    let un: [&Unpacked; G] = std::array::from_fn(|j| &*s.un[j]);
    // SAFETY: forwarded from the caller.
    unsafe {
        match ty {
            GgmlType::Q4K if fused => {
                pairs_k::tile_k45::<G, R, _>(recs.map(Q4Record::new), un, acts, i, u, acc, pf);
            }
            GgmlType::Q5K if fused => {
                pairs_k::tile_k45::<G, R, _>(recs.map(Q5Record::new), un, acts, i, u, acc, pf);
            }
            GgmlType::Q4K | GgmlType::Q5K => {
                pairs_k::tile_k45::<G, R, _>(quads.map(Quads), un, acts, i, u, acc, pf);
            }
            GgmlType::Q6K if fused => {
                pairs_k::tile_q6k::<G, R, _>(recs.map(Q6Record::new), un, acts, i, u, acc, pf);
            }
            GgmlType::Q6K => {
                pairs_k::tile_q6k::<G, R, _>(quads.map(Quads), un, acts, i, u, acc, pf);
            }
            _ => tile::<G, R>(ty, nb, quads, un, acts, i, u, acc, pf),
        }
    }
}

/// Activation rows `i..i + R` against groups `0..G` of Q4_0 / Q5_0 / Q8_0 (levels at
/// `quads[j]`, scales in `un[j]`) for the `nb` blocks of unit `u`; a part of `pf` per block.
///
/// # Safety
/// As [`kernel`]; rows `i..i + R` inside `acts` and inside every `acc`; `quads[j]` holds the
/// unit's `nb` blocks of 8 quads.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always, clippy::too_many_arguments)]
unsafe fn tile<const G: usize, const R: usize>(
    ty: GgmlType,
    nb: usize,
    quads: [*const u8; G],
    un: [&Unpacked; G],
    acts: &QuantActs,
    i: usize,
    u: usize,
    acc: [Acc; G],
    pf: Prefetch,
) {
    let mut pf = pf.steps(nb);
    let k = acts.k;
    let nbk = k / QK;
    // The level offset `o` as a shift: 128, 8 or 16.
    let shift = match ty {
        GgmlType::Q8_0 => 7,
        GgmlType::Q4_0 => 3,
        _ => 4,
    };
    // SAFETY (whole body): block `u·8 + b` of rows `i..i + R` is inside `acts` (`k` columns);
    // `quads[j]` and the scales hold `nb` blocks; `acc` has `R` rows.
    unsafe {
        let x: [*const i8; R] = acts.unit_rows(i, u);
        let mut a: [[__m512; G]; R] =
            std::array::from_fn(|r| std::array::from_fn(|j| acc[j].get::<Vnni>(r)));
        for b in 0..nb {
            pf.step();
            let bg = u * 8 + b;
            let mut t: [[__m512i; G]; R] = std::array::from_fn(|r| {
                let sx = *acts.s32.get_unchecked((i + r) * nbk + bg);
                [_mm512_set1_epi32(-(sx << shift)); G]
            });
            dots(&mut t, quads, &x, b * 8, 8);
            let fs: [__m512; G] =
                std::array::from_fn(|j| _mm512_loadu_ps(un[j].fscale[b].as_ptr()));
            for r in 0..R {
                let dx = _mm512_set1_ps(*acts.d.get_unchecked((i + r) * nbk + bg));
                for j in 0..G {
                    let scale = _mm512_mul_ps(fs[j], dx);
                    a[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[r][j]), scale, a[r][j]);
                }
            }
        }
        for (r, ar) in a.iter().enumerate() {
            for (j, &v) in ar.iter().enumerate() {
                acc[j].put::<Vnni>(r, v);
            }
        }
    }
}

/// `p[r][j] += Σ_q w_j(q) · x_r(q)` for the `n` quads from quad `q0` of the unit (activations
/// from element `4·q0` of each row): every broadcast quad feeds all `G` groups, read at each
/// use so that the broadcast folds into `vpdpbusd`'s memory operand.
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI available; quads `q0..q0 + n` inside every `quads[j]`, and their
/// activations inside every row of `x`.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always)]
unsafe fn dots<const G: usize, const R: usize>(
    p: &mut [[__m512i; G]; R],
    quads: [*const u8; G],
    x: &[*const i8; R],
    q0: usize,
    n: usize,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        for q in q0..q0 + n {
            let wv: [__m512i; G] = std::array::from_fn(|j| Vnni::load(quads[j].add(q * 64)));
            for (pr, xr) in p.iter_mut().zip(x) {
                for (pj, wj) in pr.iter_mut().zip(&wv) {
                    *pj = Vnni::dot(*pj, *wj, xr.add(4 * q));
                }
            }
        }
    }
}
