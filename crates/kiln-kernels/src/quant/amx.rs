//! AMX-INT8 tiles for the quantized kernels, 16 activation rows at a time.
//!
//! One `tdpbssd` computes, for 16 activation rows and the 16 weight rows of a group, the exact
//! i32 dot products over one block (32 elements) or one Q6_K sub-block (16): the A tile is 16
//! activation rows of `acts.qs` (row stride `k`), the B tile is the block's quads, which are
//! already AMX's B layout (`[K/4][16 lanes][4]`). The weights must be signed, so the kernel
//! first writes the unit's levels minus their offset (`repack::signed_quads`): `Σ (q − off)·x` is
//! then exactly the `t` of the other kernels and no per-row offset correction is needed.
//!
//! The tile results go through a small buffer and are then scaled with the same [`Isa`]
//! operations, in the same order, as in `kernel` (the batch-invariance invariant of that
//! module): AMX only changes how the exact integers are obtained. Blocks are software
//! pipelined over four sets of result tiles: the tiles of the next three blocks are computed
//! while a block is scaled. For Q4_0/Q5_0/Q8_0 the block loop is unrolled by the four sets, so
//! every set is a constant: the loop with a dispatch on `b % 4`, in which the compiler also
//! moved the 16 accumulators between registers at every block, was 10–20 % slower. The
//! K-quant loop keeps the dispatch: unrolled, it measured about 10 % slower.
//!
//! Tiles (one configuration per call, [`configure`]): `tmm0`–`tmm3` the results of the four
//! sets (16 × 16 i32); `tmm4`/`tmm5` the A/B pair of sets 0 and 2, `tmm6`/`tmm7` that of sets 1
//! and 3 (K = 32, or 16 for Q6_K).
//!
//! Q4_K takes a different route ([`rows_q4k`], K = 64): its sub-block scales `sc` (0..63) are
//! split as `sc = 8·hi + lo` (both 0..7) and folded into two copies of the unit's quads,
//! `q·hi` and `q·lo` (at most 105, so still signed bytes; [`ScaledQuads::fill`]). The tiles
//! then accumulate a whole 256-element unit in two results, and `t = 8·Σ q·hi·x + Σ q·lo·x`
//! is the same exact integer as `Σ_s sc_s · Σ q·x`, with one scaling step per unit instead of
//! one per sub-block.

use std::arch::asm;
use std::sync::OnceLock;

use super::act::QuantActs;
use super::formats::QK;
use super::isa::Isa;
use super::kernel::{Acc, TILE_M, finish_k45};
use super::repack::{LANES, Unpacked};

/// Whether AMX-INT8 is usable: CPUID reports AMX-TILE and AMX-INT8 and the OS granted this
/// process the tile state (Linux `ARCH_REQ_XCOMP_PERM`). Checked once.
pub(crate) fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        // SAFETY: CPUID leaf 7 exists on every x86-64 CPU that reports AVX-512 or AVX2; on
        // older ones it returns zeros.
        #[allow(unused_unsafe)]
        let c = unsafe { std::arch::x86_64::__cpuid_count(7, 0) };
        let amx = (1 << 24) | (1 << 25);
        c.edx & amx == amx && std::arch::is_x86_feature_detected!("avx512vnni") && request_tiles()
    })
}

#[cfg(target_os = "linux")]
fn request_tiles() -> bool {
    unsafe extern "C" {
        fn syscall(n: std::ffi::c_long, ...) -> std::ffi::c_long;
    }
    const SYS_ARCH_PRCTL: std::ffi::c_long = 158;
    const ARCH_REQ_XCOMP_PERM: std::ffi::c_long = 0x1023;
    const XFEATURE_XTILEDATA: std::ffi::c_long = 18;
    // SAFETY: `arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)` only changes this process's
    // permission to use the AMX tile state; it returns 0 when granted.
    unsafe { syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn request_tiles() -> bool {
    false
}

/// The 64-byte `ldtilecfg` operand.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// Loads this thread's tile configuration for dot products over `kb` (32 or 16) elements.
///
/// # Safety
/// [`available`] must have returned true; the thread must call [`release`] before it returns
/// to code that does not expect tile state.
pub(crate) unsafe fn configure(kb: usize) {
    let mut c =
        TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
    for t in 0..SETS {
        (c.colsb[t], c.rows[t]) = (64, 16);
    }
    for t in [4, 6] {
        (c.colsb[t], c.rows[t]) = (kb as u16, 16);
        (c.colsb[t + 1], c.rows[t + 1]) = (64, (kb / 4) as u8);
    }
    // SAFETY: a valid palette-1 configuration (AMX availability is the caller's).
    unsafe { asm!("ldtilecfg [{0}]", in(reg) &raw const c, options(nostack, readonly)) };
}

/// Releases the tile state.
///
/// # Safety
/// [`available`] must have returned true.
pub(crate) unsafe fn release() {
    // SAFETY: AMX is available (the caller's); `tilerelease` has no operands.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// Result tiles (and buffers) in flight.
const SETS: usize = 4;
/// Blocks whose tiles are computed ahead of the one being scaled.
const AHEAD: usize = SETS - 1;

/// `SETS` `[16 rows][16 lanes]` i32 tile results.
#[repr(C, align(64))]
pub(crate) struct TileBuf([[[i32; LANES]; TILE_M]; SETS]);

impl TileBuf {
    pub fn new() -> Box<Self> {
        Box::new(Self([[[0; LANES]; TILE_M]; SETS]))
    }
}

/// Whether a call with `m` activation rows takes [`rows_q4k`] (tiles configured with K = 64):
/// Q4_K with at least two tiles of rows, so that folding the scales into the levels, once per
/// unit, is shared; with one tile it costs what it saves, and [`rows_k45`] runs instead.
pub(crate) fn folds_scales(ty: super::formats::GgmlType, m: usize) -> bool {
    ty == super::formats::GgmlType::Q4K && m >= 2 * TILE_M
}

/// A Q4_K unit's quads with the sub-block scales folded in (module docs): `hi` then `lo`,
/// each `[64 quads][16 lanes][4]`.
#[repr(C, align(64))]
pub(crate) struct ScaledQuads([[[u8; 64]; 64]; 2]);

impl ScaledQuads {
    pub fn new() -> Box<Self> {
        Box::new(Self([[[0; 64]; 64]; 2]))
    }

    /// Fills both copies from the unit's unpacked quads (levels 0..15) and its scales
    /// (`un.iscale[s]`, 0..63, for the 8 sub-blocks of 32 elements, i.e. 8 quads each).
    ///
    /// # Safety
    /// AVX-512 BW must be available (AMX implies it); `un.quads` holds a whole Q4_K unit.
    #[inline(always)] // must inline into the `#[target_feature]` entry points
    #[allow(clippy::inline_always)]
    pub(crate) unsafe fn fill(&mut self, un: &Unpacked) {
        use std::arch::x86_64::{
            _mm512_and_si512, _mm512_load_si512, _mm512_loadu_si512, _mm512_maddubs_epi16,
            _mm512_mullo_epi32, _mm512_or_si512, _mm512_set1_epi32, _mm512_slli_epi16,
            _mm512_srli_epi32, _mm512_storeu_si512,
        };
        // SAFETY (whole body): AVX-512 BW is the caller's; every pointer stays inside
        // `un.quads`, `un.iscale` or `self`, each 64 bytes per vector.
        unsafe {
            let (even, odd) = (_mm512_set1_epi32(0x00FF_00FF), _mm512_set1_epi32(!0x00FF_00FF));
            let (spread, seven) = (_mm512_set1_epi32(0x0101_0101), _mm512_set1_epi32(7));
            // `q·sc` per byte for `sc` 0..7 in every byte: two byte-pair products whose high
            // bytes are 0, the odd one moved up. (A macro, not a closure: a closure does not
            // inherit the caller's target features, so its intrinsics could become calls.)
            macro_rules! times {
                ($q:expr, $sc:expr) => {{
                    let lo = _mm512_maddubs_epi16($q, _mm512_and_si512($sc, even));
                    let hi = _mm512_maddubs_epi16($q, _mm512_and_si512($sc, odd));
                    _mm512_or_si512(lo, _mm512_slli_epi16::<8>(hi))
                }};
            }
            for sub in 0..8 {
                let sc = _mm512_load_si512(un.iscale[sub].as_ptr().cast());
                let lo = _mm512_mullo_epi32(_mm512_and_si512(sc, seven), spread);
                let hi = _mm512_mullo_epi32(_mm512_srli_epi32::<3>(sc), spread);
                for v in sub * 8..sub * 8 + 8 {
                    let q = _mm512_loadu_si512(un.quads[v].as_ptr().cast());
                    _mm512_storeu_si512(self.0[0][v].as_mut_ptr().cast(), times!(q, hi));
                    _mm512_storeu_si512(self.0[1][v].as_mut_ptr().cast(), times!(q, lo));
                }
            }
        }
    }
}

/// Rows `i..i + 16` against one Q4_K unit whose scales were folded by [`ScaledQuads::fill`].
///
/// # Safety
/// As `kernel::row_k45`, plus tiles configured with K = 64.
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always, clippy::too_many_arguments)]
pub(crate) unsafe fn rows_q4k<S: Isa>(
    scaled: &ScaledQuads,
    un: &Unpacked,
    acts: &QuantActs,
    i: usize,
    u: usize,
    acc: Acc,
    buf: &mut TileBuf,
) {
    let k = acts.k;
    // SAFETY (whole body): block `u` of rows `i..i + 16` is inside `acts` (256 bytes a row at
    // stride `k`); each copy of `scaled` holds 16 quads per 64 columns; `acc` has 16 rows.
    unsafe {
        let x = acts.qs.as_ptr().add(i * k + u * 256);
        let (hi, lo) = (scaled.0[0].as_ptr().cast::<u8>(), scaled.0[1].as_ptr().cast::<u8>());
        // Two accumulator pairs (even and odd 64-column chunks), so that consecutive
        // `tdpbssd` do not wait on each other's results.
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "2:",
            "tileloadd tmm4, [{x} + {k} * 1]",
            "tileloadd tmm5, [{hi} + {s} * 1]",
            "tileloadd tmm6, [{lo} + {s} * 1]",
            "tdpbssd tmm0, tmm4, tmm5",
            "tdpbssd tmm1, tmm4, tmm6",
            "tileloadd tmm7, [{x} + {k} * 1 + 64]",
            "tileloadd tmm5, [{hi} + {s} * 1 + 1024]",
            "tileloadd tmm6, [{lo} + {s} * 1 + 1024]",
            "tdpbssd tmm2, tmm7, tmm5",
            "tdpbssd tmm3, tmm7, tmm6",
            "add {x}, 128",
            "add {hi}, 2048",
            "add {lo}, 2048",
            "dec {n}",
            "jnz 2b",
            "tilestored [{o} + {s} * 1], tmm0",
            "tilestored [{o} + {s} * 1 + 1024], tmm1",
            "tilestored [{o} + {s} * 1 + 2048], tmm2",
            "tilestored [{o} + {s} * 1 + 3072], tmm3",
            x = inout(reg) x => _,
            hi = inout(reg) hi => _,
            lo = inout(reg) lo => _,
            n = inout(reg) 2usize => _,
            k = in(reg) k,
            s = in(reg) 64usize,
            o = in(reg) buf.0.as_mut_ptr(),
            options(nostack),
        );
        // A loop, not `from_fn`: a closure does not inherit the caller's target features.
        let mut t = [S::zero(); TILE_M];
        for (r, tr) in t.iter_mut().enumerate() {
            let set = |j: usize| buf.0[j][r].as_ptr().cast::<u8>();
            let hi = S::add32(S::load(set(0)), S::load(set(2)));
            let lo = S::add32(S::load(set(1)), S::load(set(3)));
            let hi2 = S::add32(hi, hi);
            let hi4 = S::add32(hi2, hi2);
            *tr = S::add32(S::add32(hi4, hi4), lo);
        }
        finish_k45::<S, TILE_M>(&t, un, acts, i, u, acc);
    }
}

/// Tile set `SET` (0 or 1): `buf[SET] = A · B` for A = 16 rows at `x` (stride `k` bytes) and
/// B = the quads at `w`.
///
/// # Safety
/// Tiles configured by [`configure`]; `x` readable for 16 rows of `kb` bytes at stride `k`,
/// `w` for `kb / 4` quads.
#[inline(always)] // a few instructions, inlined into the kernels
#[allow(clippy::inline_always)]
unsafe fn dot<const SET: usize>(x: *const i8, k: usize, w: *const u8, buf: &mut TileBuf) {
    let out = buf.0[SET].as_mut_ptr();
    // SAFETY: guaranteed by the caller; the tile numbers follow `configure`.
    unsafe {
        asm!(
            "tilezero tmm{c}",
            "tileloadd tmm{a}, [{x} + {k} * 1]",
            "tileloadd tmm{b}, [{w} + {s} * 1]",
            "tdpbssd tmm{c}, tmm{a}, tmm{b}",
            "tilestored [{o} + {s} * 1], tmm{c}",
            c = const SET,
            a = const 4 + 2 * (SET % 2),
            b = const 5 + 2 * (SET % 2),
            x = in(reg) x,
            k = in(reg) k,
            w = in(reg) w,
            s = in(reg) 64usize,
            o = in(reg) out,
            options(nostack),
        );
    }
}

/// `dot` into tile set `j % SETS`.
#[inline(always)]
#[allow(clippy::inline_always)]
unsafe fn dot_set(j: usize, x: *const i8, k: usize, w: *const u8, buf: &mut TileBuf) {
    // SAFETY: forwarded.
    unsafe {
        match j % SETS {
            0 => dot::<0>(x, k, w, buf),
            1 => dot::<1>(x, k, w, buf),
            2 => dot::<2>(x, k, w, buf),
            _ => dot::<3>(x, k, w, buf),
        }
    }
}

/// Rows `i..i + 16` against one unit of Q4_0/Q5_0/Q8_0 blocks; `sq` holds the signed quads.
///
/// # Safety
/// As `kernel::row_a`, plus tiles configured with K = 32.
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always, clippy::too_many_arguments)]
pub(crate) unsafe fn rows_a<S: Isa>(
    nb: usize,
    sq: *const u8,
    un: &Unpacked,
    acts: &QuantActs,
    i: usize,
    u: usize,
    acc: Acc,
    buf: &mut TileBuf,
) {
    let k = acts.k;
    let nbk = k / QK;
    // SAFETY (whole body): blocks `u·8 + b` of rows `i..i + 16` are inside `acts`, the unit
    // holds `nb` blocks of 8 quads, and `acc` has at least 16 rows.
    unsafe {
        let x = acts.qs.as_ptr().add(i * k + u * 8 * QK);
        let mut a: [S::F; TILE_M] = std::array::from_fn(|r| acc.get::<S>(r));
        for b in 0..AHEAD.min(nb) {
            dot_set(b, x.add(b * QK), k, sq.add(b * 8 * 64), buf);
        }
        // Block `b` uses tile set `b % 4`: unrolled by four so that every set is a constant.
        let dxs = acts.d.as_ptr().add(i * nbk + u * 8);
        macro_rules! block {
            ($set:literal, $b:expr) => {{
                let b = $b;
                if b + AHEAD < nb {
                    let j = b + AHEAD;
                    dot::<{ ($set + AHEAD) % SETS }>(x.add(j * QK), k, sq.add(j * 8 * 64), buf);
                }
                let fs = S::loadf(un.fscale[b].as_ptr());
                let t = &buf.0[$set];
                let dx = dxs.add(b);
                for r in 0..TILE_M {
                    let tv = S::load(t[r].as_ptr().cast());
                    a[r] = S::fmadd(S::cvt(tv), S::mulf(fs, S::splatf(*dx.add(r * nbk))), a[r]);
                }
            }};
        }
        for b in (0..nb).step_by(SETS) {
            block!(0, b);
            if b + 1 < nb {
                block!(1, b + 1);
            }
            if b + 2 < nb {
                block!(2, b + 2);
            }
            if b + 3 < nb {
                block!(3, b + 3);
            }
        }
        for (r, &ar) in a.iter().enumerate() {
            acc.put::<S>(r, ar);
        }
    }
}

/// `t[r] = Σ_s sc_s · (A_s · B_s)[r]` over `subs` sub-blocks of `kb` elements of the unit.
///
/// # Safety
/// As the callers.
#[inline(always)]
#[allow(clippy::inline_always)]
unsafe fn scaled_subs<S: Isa>(
    subs: usize,
    kb: usize,
    x: *const i8,
    k: usize,
    sq: *const u8,
    un: &Unpacked,
    buf: &mut TileBuf,
) -> [S::V; TILE_M] {
    // SAFETY: forwarded from the callers: `subs` sub-blocks of `kb` elements lie in the unit.
    unsafe {
        let mut t = [S::zero(); TILE_M];
        for s in 0..AHEAD.min(subs) {
            dot_set(s, x.add(s * kb), k, sq.add(s * kb / 4 * 64), buf);
        }
        for s in 0..subs {
            if s + AHEAD < subs {
                let j = s + AHEAD;
                dot_set(j, x.add(j * kb), k, sq.add(j * kb / 4 * 64), buf);
            }
            let sc = S::load(un.iscale[s].as_ptr().cast());
            let p = &buf.0[s % SETS];
            for r in 0..TILE_M {
                t[r] = S::add32(t[r], S::mullo32(S::load(p[r].as_ptr().cast()), sc));
            }
        }
        t
    }
}

/// Rows `i..i + 16` against one Q4_K/Q5_K block (`sq`: the unpacked quads, already signed).
///
/// # Safety
/// As `kernel::row_k45`, plus tiles configured with K = 32.
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always, clippy::too_many_arguments)]
pub(crate) unsafe fn rows_k45<S: Isa>(
    sq: *const u8,
    un: &Unpacked,
    acts: &QuantActs,
    i: usize,
    u: usize,
    acc: Acc,
    buf: &mut TileBuf,
) {
    let k = acts.k;
    // SAFETY (whole body): block `u` of rows `i..i + 16` is inside `acts`; the unit holds 64
    // quads; `acc` has at least 16 rows.
    unsafe {
        let x = acts.qs.as_ptr().add(i * k + u * 256);
        let t = scaled_subs::<S>(8, 32, x, k, sq, un, buf);
        finish_k45::<S, TILE_M>(&t, un, acts, i, u, acc);
    }
}

/// Rows `i..i + 16` against one Q6_K block (`sq`: signed quads).
///
/// # Safety
/// As `kernel::row_k16`, plus tiles configured with K = 16.
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always, clippy::too_many_arguments)]
pub(crate) unsafe fn rows_q6k<S: Isa>(
    sq: *const u8,
    un: &Unpacked,
    acts: &QuantActs,
    i: usize,
    u: usize,
    acc: Acc,
    buf: &mut TileBuf,
) {
    let k = acts.k;
    // SAFETY (whole body): block `u` of rows `i..i + 16` is inside `acts`; the unit holds 64
    // quads; `acc` has at least 16 rows.
    unsafe {
        let x = acts.qs.as_ptr().add(i * k + u * 256);
        let t = scaled_subs::<S>(16, 16, x, k, sq, un, buf);
        let d = S::loadf(un.fscale[0].as_ptr());
        for (r, &tr) in t.iter().enumerate() {
            let dx = S::splatf(*acts.d.get_unchecked((i + r) * (k / 256) + u));
            let a = S::fmadd(S::cvt(tr), S::mulf(d, dx), acc.get::<S>(r));
            acc.put::<S>(r, a);
        }
    }
}
