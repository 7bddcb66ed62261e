//! The K-quant register tiles of [`super::pairs`]: `G` weight groups × `R` activation rows
//! against one 256-element unit (one Q4_K / Q5_K / Q6_K block per row).
//!
//! Each is the general kernel's `row_k45` / `row_k16` with the loops reordered so that every
//! broadcast activation quad feeds all `G` groups. A sub-block's integer dot product is summed
//! in one accumulator instead of two halves, and Q6_K's `−32·Σx` correction is its start value
//! (shared by the groups) instead of a subtraction: all exact integer arithmetic, so `t`, `u`
//! and every f32 step are those of the general kernel, bit for bit.

use super::act::QuantActs;
use super::isa::Isa;
use super::kernel::Acc;
use super::levels::Levels;
use super::prefetch::Prefetch;
use super::repack::Unpacked;
use super::x86::Vnni;

type V = <Vnni as Isa>::V;

/// Rows `i..i + R` against one Q4_K / Q5_K unit `u` of groups `0..G` (levels from `levels[j]`,
/// scales and mins in `un[j]`); a part of `pf` per sub-block.
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI available; block `u` of rows `i..i + R` inside `acts` (quantized
/// with blocks of 256); `levels[j]` reads a whole unit (64 quads); `acc[j]` has `R` rows.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always)]
pub(super) unsafe fn tile_k45<const G: usize, const R: usize, L: Levels<Vnni>>(
    levels: [L; G],
    un: [&Unpacked; G],
    acts: &QuantActs,
    i: usize,
    u: usize,
    acc: [Acc; G],
    pf: Prefetch,
) {
    let mut pf = pf.steps(8);
    let k = acts.k;
    // SAFETY (whole body): as the caller guarantees; offsets stay inside the unit's 256
    // activations per row, its 64 quads, and `acts`' per-64 and per-256 arrays.
    unsafe {
        let x: [*const i8; R] = acts.unit_rows(i, u);
        let mut t: [[V; G]; R] = [[Vnni::zero(); G]; R];
        for s in 0..8 {
            pf.step();
            let mut p: [[V; G]; R] = [[Vnni::zero(); G]; R];
            level_dots(&mut p, levels, &x, s * 4, 4);
            add_scaled(&mut t, &p, un, s);
        }
        for (r, tr) in t.iter().enumerate() {
            let pairs = acts.pairs.as_ptr().add((i + r) * (k / 64) + u * 4);
            let dx = Vnni::splatf(*acts.d.get_unchecked((i + r) * (k / 256) + u));
            for (j, &tj) in tr.iter().enumerate() {
                let mut mn = Vnni::zero();
                for pi in 0..4 {
                    mn = Vnni::madd16(
                        mn,
                        Vnni::load(un[j].mins[pi].as_ptr().cast()),
                        *pairs.add(pi),
                    );
                }
                let d = Vnni::loadf(un[j].fscale[0].as_ptr());
                let dmin = Vnni::loadf(un[j].fscale[1].as_ptr());
                let mut a = acc[j].get::<Vnni>(r);
                a = Vnni::fmadd(Vnni::cvt(tj), Vnni::mulf(d, dx), a);
                a = Vnni::fnmadd(Vnni::cvt(mn), Vnni::mulf(dmin, dx), a);
                acc[j].put::<Vnni>(r, a);
            }
        }
    }
}

/// Rows `i..i + R` against one Q6_K unit `u` of groups `0..G`.
///
/// # Safety
/// As [`tile_k45`].
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always)]
pub(super) unsafe fn tile_q6k<const G: usize, const R: usize, L: Levels<Vnni>>(
    levels: [L; G],
    un: [&Unpacked; G],
    acts: &QuantActs,
    i: usize,
    u: usize,
    acc: [Acc; G],
    pf: Prefetch,
) {
    let mut pf = pf.steps(16);
    let k = acts.k;
    // SAFETY (whole body): as in `tile_k45`, with `acts.s16`'s 16 sums per row and unit.
    unsafe {
        let x: [*const i8; R] = acts.unit_rows(i, u);
        let s16: [*const i32; R] = acts.unit_sums16(i, u);
        let mut t: [[V; G]; R] = [[Vnni::zero(); G]; R];
        for s in 0..16 {
            pf.step();
            // `Σ (q − 32)·x = Σ q·x − 32·Σx`: the correction starts the sum.
            let mut p: [[V; G]; R] =
                std::array::from_fn(|r| [Vnni::splat32(-(*s16[r].add(s) << 5)); G]);
            level_dots(&mut p, levels, &x, s * 2, 2);
            add_scaled(&mut t, &p, un, s);
        }
        for (r, tr) in t.iter().enumerate() {
            let dx = Vnni::splatf(*acts.d.get_unchecked((i + r) * (k / 256) + u));
            for (j, &tj) in tr.iter().enumerate() {
                let d = Vnni::loadf(un[j].fscale[0].as_ptr());
                let a = Vnni::fmadd(Vnni::cvt(tj), Vnni::mulf(d, dx), acc[j].get::<Vnni>(r));
                acc[j].put::<Vnni>(r, a);
            }
        }
    }
}

/// `p[r][j] += Σ_q w_j(q) · x_r(q)` over the quads of the `n` pairs from pair `v0` of the unit
/// (activations from element `8·v0` of each row), every broadcast quad feeding all `G` groups.
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI available; pairs `v0..v0 + n` inside every unit of `levels`, and
/// their activations inside every row of `x`.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always)]
unsafe fn level_dots<L: Levels<Vnni>, const G: usize, const R: usize>(
    p: &mut [[V; G]; R],
    levels: [L; G],
    x: &[*const i8; R],
    v0: usize,
    n: usize,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        for v in v0..v0 + n {
            // A loop, not `array::from_fn`: its closure is not always inlined into the
            // `#[target_feature]` caller, and then neither are the vector operations.
            let mut wv = [(Vnni::zero(), Vnni::zero()); G];
            for (wj, lj) in wv.iter_mut().zip(&levels) {
                *wj = lj.pair(v);
            }
            for (pr, xr) in p.iter_mut().zip(x) {
                for (pj, (w0, w1)) in pr.iter_mut().zip(&wv) {
                    *pj = Vnni::dot(*pj, *w0, xr.add(8 * v));
                    *pj = Vnni::dot(*pj, *w1, xr.add(8 * v + 4));
                }
            }
        }
    }
}

/// `t[r][j] += p[r][j] · sc_j`, the sub-block scales `sc_j` being row `s` of `un[j].iscale`.
///
/// # Safety
/// AVX-512 F available.
#[inline(always)] // must inline into the `#[target_feature]` entry point
#[allow(clippy::inline_always)]
unsafe fn add_scaled<const G: usize, const R: usize>(
    t: &mut [[V; G]; R],
    p: &[[V; G]; R],
    un: [&Unpacked; G],
    s: usize,
) {
    // SAFETY: the features are the caller's; an `iscale` row is 64 bytes.
    unsafe {
        let sc: [V; G] = std::array::from_fn(|j| Vnni::load(un[j].iscale[s].as_ptr().cast()));
        for (tr, pr) in t.iter_mut().zip(p) {
            for j in 0..G {
                tr[j] = Vnni::add32(tr[j], Vnni::mullo32(pr[j], sc[j]));
            }
        }
    }
}
