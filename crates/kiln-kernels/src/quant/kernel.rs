//! The quantized matmul kernel: `out[m, n] = x[m, k] · Wᵀ` for a repacked [`QuantMatrix`] and
//! activations quantized to 8 bits ([`QuantActs`]).
//!
//! Weight-stationary: a task owns whole 16-row groups. Activation rows are processed in chunks
//! (64 rows, 256 with AMX); for each chunk the task walks its groups, and for every 256-element
//! unit of a group the record is unpacked once (into per-thread scratch) and dotted with the
//! chunk's rows, so a chunk's activations stay in cache while the task's weights stream past.
//! K-quant chunks of decode size (at most `levels::FROM_RECORD_MAX_ROWS` rows) unpack only
//! the scales and build each pair of quads from the record in registers (`levels`).
//! The 16 lanes of every vector are the 16 weight rows of the group, so no horizontal sums are
//! needed. Activation rows are taken 4 at a time, so each weight vector loaded from the unpacked
//! record feeds 4 `vpdpbusd`. With [`CpuIsa::Amx`], every full 16 activation rows go through
//! AMX tiles instead (`amx`), the remaining rows through the VNNI path. Without AMX, VNNI calls
//! with 4 or more rows take the 2-group register tiles of `pairs`.
//! Outputs of vocabulary-sized rows are written with non-temporal stores ([`stream_output`]).
//!
//! Fixed order (the batch-invariance invariant): output `(i, j)` is an f32 accumulator that
//! starts at 0 and, for every weight block in column order, takes
//! - Q4_0/Q5_0/Q8_0: `acc = fma(t, d_w·d_x, acc)`, `t = Σ (q − offset)·x_q` over the block;
//! - Q4_K/Q5_K: `acc = fma(t, d·d_x, acc)`, `acc = fma(−u, dmin·d_x, acc)`, with
//!   `t = Σ_s sc_s · Σ q·x_q` and `u = Σ_s m_s · Σ x_q` over the 8 sub-blocks `s`;
//! - Q6_K: `acc = fma(t, d·d_x, acc)`, `t = Σ_s sc_s · Σ (q − 32)·x_q` over 16 sub-blocks;
//!   Q3_K the same with `q − 4`;
//! - Q4_1/Q5_1: `acc = fma(t, d_w·d_x, acc)`, `acc = fma(Σ x_q, m·d_x, acc)`, `t = Σ q·x_q`;
//! - IQ4_NL/IQ4_XS/MXFP4: as Q8_0 with the table's level for `q` (IQ4_XS: a block per
//!   sub-block of 32, `d_w = d·(ls − 32)`);
//! - Q2_K: `acc = fma(t, d·d_x, acc)`, `acc = fma(−u, dmin·d_x, acc)`, with
//!   `t = Σ_s sc_s · Σ q·x_q` and `u = Σ_s m_s · Σ x_q` over the 16 sub-blocks;
//! - the codebook and ternary types (IQ1_*, IQ2_*, IQ3_*, TQ*): as Q6_K with the table's
//!   level for `q` (offset 64) and their own `d` and 16 scales (`iq`).
//!
//! Those types read from files only (all but Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) always
//! take this general kernel (on AVX2 through `x86::Avx2`), never the AMX tiles, `pairs` or the
//! AVX2 kernels of `avx2`.
//!
//! The `t`, `u` are exact integers (any summation order gives the same value), and the f32
//! steps are identical on every [`Isa`], so results are bitwise the same for every `m`, batch
//! composition and SIMD level.

use std::cell::RefCell;
use std::ops::Range;

use super::QuantMatrix;
use super::act::QuantActs;
use super::formats::{GgmlType, QK};
use super::iq::LEVEL_OFFSET;
use super::isa::{Isa, Scalar};
use super::levels::{Levels, Q4Record, Q5Record, Q6Record, Quads, from_record};
use super::repack::{LANES, Unpacked, signed_quads, unpack, unpack_scales};
use crate::prefetch_level::prefetch_line;
use crate::thread_pool::SharedMut;
use crate::{CpuIsa, SimdLevel};

/// Activation rows per pass over a group's weights.
pub(crate) const ROW_CHUNK: usize = 64;
/// The same with AMX tiles (whose work per row is smaller, so unpacking weighs more).
const AMX_CHUNK: usize = 256;
/// Activation rows per AMX tile.
pub(crate) const TILE_M: usize = 16;

struct Scratch {
    un: Box<Unpacked>,
    /// `[AMX_CHUNK][16]`
    acc: Vec<[f32; LANES]>,
    /// The unit's quads as signed levels, for the AMX tiles (only `quads` is used).
    sq: Box<Unpacked>,
    #[cfg(target_arch = "x86_64")]
    tiles: Box<super::amx::TileBuf>,
    /// A Q4_K unit's quads with its scales folded in, for the AMX tiles.
    #[cfg(target_arch = "x86_64")]
    scaled: Box<super::amx::ScaledQuads>,
    #[cfg(target_arch = "x86_64")]
    pairs: Box<super::pairs::PairScratch>,
}

thread_local! {
    static SCRATCH: RefCell<Option<Scratch>> = const { RefCell::new(None) };
}

/// Writes columns `16·groups.start .. min(16·groups.end, n)` of `out[m, n]`.
///
/// `acts` must hold `x[m, k]` quantized with blocks of `w.act_block()`; `out` must point to an
/// `[m, n]` buffer of which the caller's task owns those columns.
pub(crate) fn qgemm_groups(
    isa: CpuIsa,
    acts: &QuantActs,
    w: &QuantMatrix,
    groups: Range<usize>,
    out: SharedMut<f32>,
) {
    assert_eq!(acts.k, w.cols);
    assert_eq!(acts.block, w.act_block());
    assert!(groups.end <= w.rows.div_ceil(LANES));
    SCRATCH.with_borrow_mut(|s| {
        let s = s.get_or_insert_with(|| Scratch {
            un: Unpacked::new(),
            acc: vec![[0.0; LANES]; AMX_CHUNK],
            sq: Unpacked::new(),
            #[cfg(target_arch = "x86_64")]
            tiles: super::amx::TileBuf::new(),
            #[cfg(target_arch = "x86_64")]
            scaled: super::amx::ScaledQuads::new(),
            #[cfg(target_arch = "x86_64")]
            pairs: super::pairs::PairScratch::new(),
        });
        // SAFETY: the dispatched variant's CPU features are checked before each call; the
        // remaining preconditions were asserted above or are the caller's (`out`).
        unsafe {
            match isa {
                #[cfg(target_arch = "x86_64")]
                CpuIsa::Amx if acts.m >= TILE_M && super::amx::available() => {
                    x86_entry::amx(acts, w, groups, out, s);
                }
                // Fewer than 16 rows: AMX has nothing to do.
                #[cfg(target_arch = "x86_64")]
                CpuIsa::Amx | CpuIsa::Avx512Vnni
                    if std::arch::is_x86_feature_detected!("avx512vnni") =>
                {
                    x86_entry::vnni(acts, w, groups, out, s);
                }
                #[cfg(target_arch = "x86_64")]
                CpuIsa::Avx512 if SimdLevel::detect() >= SimdLevel::Avx512 => {
                    x86_entry::avx512(acts, w, groups, out, s);
                }
                #[cfg(target_arch = "x86_64")]
                CpuIsa::Avx2 if SimdLevel::detect() >= SimdLevel::Avx2 => {
                    x86_entry::avx2(acts, w, groups, out, s);
                }
                _ => kernel::<Scalar, false>(acts, w, groups, out, s),
            }
            // Non-temporal stores (`stream_output`) are weakly ordered: fence them before the
            // task reports completion to the threads that read the output.
            #[cfg(target_arch = "x86_64")]
            std::arch::x86_64::_mm_sfence();
        }
    });
}

#[cfg(target_arch = "x86_64")]
mod x86_entry {
    use std::ops::Range;

    use super::{QuantActs, QuantMatrix, Scratch, SharedMut, kernel};
    use crate::quant::formats::GgmlType;
    use crate::quant::x86::{Avx512, Vnni};
    use crate::quant::{amx, avx2, pairs};

    /// # Safety
    /// AMX must be available ([`amx::available`]), with AVX-512 VNNI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    pub(super) unsafe fn amx(
        a: &QuantActs,
        w: &QuantMatrix,
        g: Range<usize>,
        o: SharedMut<f32>,
        s: &mut Scratch,
    ) {
        // SAFETY: AMX is available (the caller's); the tiles are released before returning.
        unsafe {
            amx::configure(match w.ty {
                GgmlType::Q6K => 16,
                ty if amx::folds_scales(ty, a.m) => 64,
                _ => 32,
            });
            kernel::<Vnni, true>(a, w, g, o, s);
            amx::release();
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    pub(super) unsafe fn vnni(
        a: &QuantActs,
        w: &QuantMatrix,
        g: Range<usize>,
        o: SharedMut<f32>,
        s: &mut Scratch,
    ) {
        // SAFETY: forwarded; the features are enabled here; `pairs::applies` checked.
        unsafe {
            if super::has_fast_paths(w.ty) && pairs::applies(w.ty, a.m) {
                pairs::kernel(a, w, g, o, &mut s.pairs);
            } else {
                kernel::<Vnni, false>(a, w, g, o, s);
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    pub(super) unsafe fn avx512(
        a: &QuantActs,
        w: &QuantMatrix,
        g: Range<usize>,
        o: SharedMut<f32>,
        s: &mut Scratch,
    ) {
        // SAFETY: forwarded; the features are enabled here.
        unsafe { kernel::<Avx512, false>(a, w, g, o, s) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn avx2(
        a: &QuantActs,
        w: &QuantMatrix,
        g: Range<usize>,
        o: SharedMut<f32>,
        s: &mut Scratch,
    ) {
        // SAFETY: forwarded; the features are enabled here.
        unsafe {
            if super::has_fast_paths(w.ty) {
                avx2::kernel(a, w, g, o, &mut s.un, &mut s.acc);
            } else {
                kernel::<crate::quant::x86::Avx2, false>(a, w, g, o, s);
            }
        }
    }
}

/// Whether `ty` has the specialised kernels (AMX tiles, `pairs`, the AVX2 tiles); the types read
/// from files only run the general kernel on every ISA.
pub(crate) fn has_fast_paths(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0
            | GgmlType::Q5_0
            | GgmlType::Q8_0
            | GgmlType::Q4K
            | GgmlType::Q5K
            | GgmlType::Q6K
    )
}

/// `AMX`: full 16-row tiles of activation rows go through the AMX tiles, which must be
/// configured (K = 16 for Q6_K, else 32).
///
/// # Safety
/// `S`'s features must be available; see [`qgemm_groups`] for the rest.
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always)]
unsafe fn kernel<S: Isa, const AMX: bool>(
    acts: &QuantActs,
    w: &QuantMatrix,
    groups: Range<usize>,
    out: SharedMut<f32>,
    s: &mut Scratch,
) {
    let (m, n, ty) = (acts.m, w.rows, w.ty);
    let chunk = if AMX { AMX_CHUNK } else { ROW_CHUNK };
    let end = groups.end;
    // With many rows a group computes long enough for the hardware prefetchers to keep up.
    let prefetch = m <= PREFETCH_MAX_ROWS;
    let stream = stream_output(m, n);
    for r0 in (0..m).step_by(chunk) {
        let r1 = (r0 + chunk).min(m);
        for g in groups.clone() {
            let lanes = (n - g * LANES).min(LANES);
            let tiles = AMX && r1 - r0 >= TILE_M && has_fast_paths(ty);
            // Full groups: the last unit stores straight into `out`.
            let direct = lanes == LANES && w.units > 0;
            let scratch = s.acc.as_mut_ptr().cast::<f32>();
            if w.units == 0 {
                s.acc[..r1 - r0].fill([0.0; LANES]);
            }
            for u in 0..w.units {
                // SAFETY: row `r0` of `out` is in bounds (the caller's).
                let dst = unsafe { out.ptr().add(r0 * n + g * LANES) };
                let acc = Acc::for_unit(u, w.units, scratch, direct.then_some(dst), n, stream);
                let nb = w.unit_blocks(u);
                let rec = w.record(g, u);
                if prefetch && g + PREFETCH_GROUPS < end {
                    prefetch_record(w, g + PREFETCH_GROUPS, u);
                }
                // Decode-sized chunks build K-quant levels from the record (`levels`).
                let fused = !tiles && from_record::<S>(ty, r1 - r0);
                // SAFETY: `rec` is a whole record of `w`; features are the caller's.
                unsafe {
                    if fused {
                        unpack_scales::<S>(ty, nb, rec, &mut s.un);
                    } else {
                        unpack::<S>(ty, nb, rec, &mut s.un);
                    }
                }
                let quads = if ty == GgmlType::Q8_0 { rec } else { s.un.quads.as_ptr().cast() };
                let sq = if matches!(ty, GgmlType::Q4K | GgmlType::Q5K) {
                    quads
                } else {
                    s.sq.quads.as_ptr().cast()
                };
                if tiles && sq != quads {
                    let nquads = nb * ty.block_elems() / 4;
                    // SAFETY: `quads` holds the unit's `nquads` quads.
                    unsafe { signed_quads::<S>(ty, nquads, quads, &mut s.sq) };
                }
                #[cfg(target_arch = "x86_64")]
                let fold = tiles && super::amx::folds_scales(ty, acts.m);
                #[cfg(target_arch = "x86_64")]
                if fold && r1 - r0 >= TILE_M {
                    // SAFETY: AMX (so AVX-512 BW) is on with `tiles`; the unit is unpacked.
                    unsafe { s.scaled.fill(&s.un) };
                }
                let un = &*s.un;
                let mut i = r0;
                while i < r1 {
                    // SAFETY: row `i - r0` is below `r1 - r0` rows of `s.acc` and of `out`.
                    let a = unsafe { acc.rows_from(i - r0) };
                    #[cfg(target_arch = "x86_64")]
                    if tiles && r1 - i >= TILE_M {
                        // SAFETY: as below; the tiles are configured (`AMX`).
                        unsafe {
                            let scaled = fold.then_some(&*s.scaled);
                            tile_rows::<S>(ty, nb, sq, un, acts, i, u, a, (&mut s.tiles, scaled));
                        };
                        i += TILE_M;
                        continue;
                    }
                    let lv = Unit { ty, nb, quads, rec, fused };
                    // SAFETY: `quads` holds the unit's quads (unless `fused`: `rec` is its
                    // record); rows `i..i + R` are below `m`, `u` is a unit of `k`.
                    unsafe {
                        match r1 - i {
                            1 => rows::<S, 1>(lv, un, acts, i, u, a),
                            2 => rows::<S, 2>(lv, un, acts, i, u, a),
                            3 => rows::<S, 3>(lv, un, acts, i, u, a),
                            _ => rows::<S, TILE_ROWS>(lv, un, acts, i, u, a),
                        }
                    }
                    i += (r1 - i).min(TILE_ROWS);
                }
            }
            if !direct {
                for (i, a) in (r0..r1).zip(s.acc.iter()) {
                    // SAFETY: the caller's task owns these columns of every output row.
                    let o = unsafe { out.slice(i * n + g * LANES, lanes) };
                    o.copy_from_slice(&a[..lanes]);
                }
            }
        }
    }
}

/// Whether the output goes out with non-temporal stores: vocabulary-sized rows (at least
/// [`STREAM_MIN_ROW`] floats) and an output of at least [`STREAM_MIN_BYTES`]. Such an output
/// (the LM head's logits: 64 MiB at 64 rows for a 262k vocabulary) cannot stay in cache, and
/// every ordinary store of it first reads the line it overwrites; streaming saves that read
/// (the 262k × 640 Q8_0 LM head at 64 rows: 36 → 28 ms). Smaller outputs are read again soon
/// by the next operation and stay cached. Results never depend on it.
pub(crate) fn stream_output(m: usize, n: usize) -> bool {
    n >= STREAM_MIN_ROW && m * n * 4 >= STREAM_MIN_BYTES
}

const STREAM_MIN_ROW: usize = 1 << 16;
const STREAM_MIN_BYTES: usize = 16 << 20;

/// How many groups ahead [`prefetch_record`] asks for.
pub(crate) const PREFETCH_GROUPS: usize = 2;
/// Calls with more activation rows than this do not prefetch.
pub(crate) const PREFETCH_MAX_ROWS: usize = 64;

/// Asks the cache hierarchy for the record of group `g`, unit `u`, while an earlier group
/// computes, so that streaming the weights overlaps the arithmetic (the 178 MB Q8_0 LM head
/// of the default model: 7.2 → 5.7–6.2 ms at m = 1, 10.5 → 6.7–7.0 ms at m = 4,
/// 13.5 → 10.7–11.2 ms at m = 16). One record at a time keeps each burst of prefetches small
/// (the whole next group at once was slower). The lines go to the cache level of
/// [`crate::PrefetchLevel::selected`] (L1 on AMD, L2 on Intel). The general kernel uses it;
/// the register tiles of `pairs` spread their requests over the arithmetic instead
/// ([`super::prefetch`]). A hint only: results never depend on it.
#[inline(always)]
#[allow(clippy::inline_always)]
pub(crate) fn prefetch_record(w: &QuantMatrix, g: usize, u: usize) {
    let start = w.record(g, u);
    let len = if u + 1 == w.units { w.group_bytes - u * w.full_record } else { w.full_record };
    for off in (0..len).step_by(64) {
        // The addresses lie inside `w`'s data (record `u` of group `g`).
        prefetch_line(start.wrapping_add(off));
    }
}

/// Where one unit's pass reads and writes the accumulators of its rows (row `r` is 16 f32).
///
/// The first unit starts every accumulator at `+0.0` (`load` null), exactly the value the
/// accumulators held when they were zero-filled, so skipping the fill changes no bit; the last
/// unit of a full group stores into the output rows (`stride` = `n`) instead of the scratch.
#[derive(Clone, Copy)]
pub(crate) struct Acc {
    /// Row 0 of the scratch accumulators (row stride 16), or null: start at `+0.0`.
    load: *const f32,
    /// Row 0 of where the results go.
    store: *mut f32,
    /// Floats between rows of `store`.
    stride: usize,
    /// Store with non-temporal writes (outputs too large to stay in cache).
    stream: bool,
}

impl Acc {
    /// The accumulators of unit `u` of `units`: the first unit starts at zero, every unit
    /// but the last stores into `scratch` (row stride 16), and the last stores into `out`
    /// (row stride `n`, streamed when `stream`) when given, else into `scratch`.
    pub(crate) fn for_unit(
        u: usize,
        units: usize,
        scratch: *mut f32,
        out: Option<*mut f32>,
        n: usize,
        stream: bool,
    ) -> Self {
        let load = if u == 0 { std::ptr::null() } else { scratch.cast_const() };
        match out {
            Some(store) if u + 1 == units => Self { load, store, stride: n, stream },
            _ => Self { load, store: scratch, stride: LANES, stream: false },
        }
    }

    /// Row `r`'s accumulator: where it starts (null: at `+0.0`) and where it goes (for the
    /// AVX2 kernel, which stores 8 lanes at a time; see [`Self::streams`]).
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn row_ptrs(self, r: usize) -> (*const f32, *mut f32) {
        let load = if self.load.is_null() { self.load } else { self.load.wrapping_add(r * LANES) };
        (load, self.store.wrapping_add(r * self.stride))
    }

    /// Whether stores through [`Self::row_ptrs`] should bypass the caches.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn streams(self) -> bool {
        self.stream
    }

    /// The same rows from row `r` on.
    ///
    /// # Safety
    /// Row `r` must be inside both buffers.
    pub(crate) unsafe fn rows_from(self, r: usize) -> Self {
        // SAFETY: guaranteed by the caller; `load` stays null when null.
        unsafe {
            Self {
                load: if self.load.is_null() { self.load } else { self.load.add(r * LANES) },
                store: self.store.add(r * self.stride),
                stride: self.stride,
                stream: self.stream,
            }
        }
    }

    /// Row `r`'s accumulator before this unit.
    ///
    /// # Safety
    /// Row `r` must be inside the buffer; `S`'s features available.
    #[inline(always)] // must inline into the `#[target_feature]` entry points
    #[allow(clippy::inline_always)]
    pub(crate) unsafe fn get<S: Isa>(self, r: usize) -> S::F {
        // SAFETY: guaranteed by the caller.
        unsafe {
            if self.load.is_null() { S::splatf(0.0) } else { S::loadf(self.load.add(r * LANES)) }
        }
    }

    /// Stores row `r`'s accumulator after this unit.
    ///
    /// # Safety
    /// Row `r` must be inside the buffer and writable by this task; `S`'s features available.
    #[inline(always)] // must inline into the `#[target_feature]` entry points
    #[allow(clippy::inline_always)]
    pub(crate) unsafe fn put<S: Isa>(self, r: usize, v: S::F) {
        // SAFETY: guaranteed by the caller.
        unsafe {
            if self.stream {
                S::streamf(self.store.add(r * self.stride), v);
            } else {
                S::storef(self.store.add(r * self.stride), v);
            }
        }
    }
}

/// Activation rows one weight load serves.
const TILE_ROWS: usize = 4;

/// Rows `i..i + 16` against one unit through the AMX tiles (`sq`: signed quads).
///
/// # Safety
/// As [`rows`], plus configured tiles.
#[cfg(target_arch = "x86_64")]
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always, clippy::too_many_arguments)]
unsafe fn tile_rows<S: Isa>(
    ty: GgmlType,
    nb: usize,
    sq: *const u8,
    un: &Unpacked,
    acts: &QuantActs,
    i: usize,
    u: usize,
    acc: Acc,
    (buf, scaled): (&mut super::amx::TileBuf, Option<&super::amx::ScaledQuads>),
) {
    use super::amx;
    // SAFETY: forwarded from the caller.
    unsafe {
        match ty {
            GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => {
                amx::rows_a::<S>(nb, sq, un, acts, i, u, acc, buf);
            }
            GgmlType::Q4K | GgmlType::Q5K => match scaled {
                Some(scaled) => amx::rows_q4k::<S>(scaled, un, acts, i, u, acc, buf),
                None => amx::rows_k45::<S>(sq, un, acts, i, u, acc, buf),
            },
            GgmlType::Q6K => amx::rows_q6k::<S>(sq, un, acts, i, u, acc, buf),
            _ => unreachable!("no AMX tiles for {ty}"),
        }
    }
}

/// Where [`rows`] reads one unit's levels.
#[derive(Clone, Copy)]
struct Unit {
    ty: GgmlType,
    /// Blocks in the unit.
    nb: usize,
    /// The unit's unpacked quads (Q8_0: its record); unused when `fused`.
    quads: *const u8,
    /// The unit's record.
    rec: *const u8,
    /// K-quant levels come from `rec` ([`from_record`]); the scratch holds only the scales.
    fused: bool,
}

/// Activation rows `i..i + R` against one unit.
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always)]
unsafe fn rows<S: Isa, const R: usize>(
    lv: Unit,
    un: &Unpacked,
    acts: &QuantActs,
    i: usize,
    u: usize,
    acc: Acc,
) {
    let Unit { ty, nb, quads, rec, fused } = lv;
    // SAFETY: forwarded from the caller.
    unsafe {
        match ty {
            GgmlType::Q8_0 | GgmlType::Iq4Nl | GgmlType::Iq4Xs | GgmlType::Mxfp4 => {
                // IQ4_XS: 8 blocks of 32 per unit, one scale each.
                let nb = if ty == GgmlType::Iq4Xs { 8 * nb } else { nb };
                if S::SIGNED_Q8 {
                    row_a::<S, true, false, R>(0, nb, quads, un, acts, i, u, acc);
                } else {
                    row_a::<S, false, false, R>(7, nb, quads, un, acts, i, u, acc);
                }
            }
            GgmlType::Q4_0 => row_a::<S, false, false, R>(3, nb, quads, un, acts, i, u, acc),
            GgmlType::Q5_0 => row_a::<S, false, false, R>(4, nb, quads, un, acts, i, u, acc),
            GgmlType::Q4_1 | GgmlType::Q5_1 => {
                row_a::<S, false, true, R>(0, nb, quads, un, acts, i, u, acc);
            }
            GgmlType::Q2K => row_k16::<S, R, _, 0, true>(Quads(quads), un, acts, i, u, acc),
            GgmlType::Q3K => row_k16::<S, R, _, 4, false>(Quads(quads), un, acts, i, u, acc),
            GgmlType::Q4K if fused => row_k45::<S, R, _>(Q4Record::new(rec), un, acts, i, u, acc),
            GgmlType::Q5K if fused => row_k45::<S, R, _>(Q5Record::new(rec), un, acts, i, u, acc),
            GgmlType::Q4K | GgmlType::Q5K => {
                row_k45::<S, R, _>(Quads(quads), un, acts, i, u, acc);
            }
            GgmlType::Q6K if fused => {
                row_k16::<S, R, _, 32, false>(Q6Record::new(rec), un, acts, i, u, acc);
            }
            GgmlType::Q6K => row_k16::<S, R, _, 32, false>(Quads(quads), un, acts, i, u, acc),
            _ if ty.is_codebook() => {
                row_k16::<S, R, _, { LEVEL_OFFSET }, false>(Quads(quads), un, acts, i, u, acc);
            }
            _ => unreachable!("{ty} has no quantized kernel"),
        }
    }
}

/// Rows `i..i + R` against one unit of Q4_0/Q5_0/Q8_0-shaped blocks. `SIGNED`: the Q8_0 levels
/// go through [`Isa::dot_q8`]; `MIN` (Q4_1/Q5_1): `t = dot` and the block's min term follows;
/// otherwise `t = dot − (Σx << shift)`.
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always, clippy::too_many_arguments)]
unsafe fn row_a<S: Isa, const SIGNED: bool, const MIN: bool, const R: usize>(
    shift: u32,
    nb: usize,
    quads: *const u8,
    un: &Unpacked,
    acts: &QuantActs,
    i: usize,
    u: usize,
    acc: Acc,
) {
    let k = acts.k;
    let nbk = k / QK;
    // SAFETY (whole body): blocks `u·8 + b` of rows `i..i + R` are inside `acts` (`k` columns),
    // the unit holds `nb` blocks of 8 quads, and `acc` has at least `R` rows.
    unsafe {
        let mut a: [S::F; R] = std::array::from_fn(|r| acc.get::<S>(r));
        for b in 0..nb {
            let bg = u * 8 + b;
            let x: [*const i8; R] =
                std::array::from_fn(|r| acts.qs.as_ptr().add((i + r) * k + bg * QK));
            let w = quads.add(b * 8 * 64);
            let mut s0 = [S::zero(); R];
            let mut s1 = [S::zero(); R];
            for q in (0..8).step_by(2) {
                let (w0, w1) = (S::load(w.add(q * 64)), S::load(w.add(q * 64 + 64)));
                for r in 0..R {
                    if SIGNED {
                        s0[r] = S::dot_q8(s0[r], w0, x[r].add(4 * q));
                        s1[r] = S::dot_q8(s1[r], w1, x[r].add(4 * q + 4));
                    } else {
                        s0[r] = S::dot(s0[r], w0, x[r].add(4 * q));
                        s1[r] = S::dot(s1[r], w1, x[r].add(4 * q + 4));
                    }
                }
            }
            let fs = S::loadf(un.fscale[b].as_ptr());
            let m = if MIN { S::loadf(un.fmin[b].as_ptr()) } else { fs };
            for r in 0..R {
                let mut t = S::add32(s0[r], s1[r]);
                let sx = *acts.s32.get_unchecked((i + r) * nbk + bg);
                if !SIGNED && !MIN {
                    t = S::sub32(t, S::splat32(sx << shift));
                }
                let dx = S::splatf(*acts.d.get_unchecked((i + r) * nbk + bg));
                a[r] = S::fmadd(S::cvt(t), S::mulf(fs, dx), a[r]);
                if MIN {
                    a[r] = S::fmadd(S::cvt(S::splat32(sx)), S::mulf(m, dx), a[r]);
                }
            }
        }
        for (r, &ar) in a.iter().enumerate() {
            acc.put::<S>(r, ar);
        }
    }
}

/// Rows `i..i + R` against one Q4_K/Q5_K block.
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always)]
unsafe fn row_k45<S: Isa, const R: usize, L: Levels<S>>(
    levels: L,
    un: &Unpacked,
    acts: &QuantActs,
    i: usize,
    u: usize,
    acc: Acc,
) {
    // SAFETY (whole body): block `u` of rows `i..i + R` is inside `acts`; `levels` reads a
    // whole unit (64 quads); `acc` has at least `R` rows.
    unsafe {
        let x: [*const i8; R] = acts.unit_rows(i, u);
        let mut t = [S::zero(); R];
        for s in 0..8 {
            let mut p0 = [S::zero(); R];
            let mut p1 = [S::zero(); R];
            for q in (0..8).step_by(2) {
                let (w0, w1) = levels.pair(4 * s + q / 2);
                for r in 0..R {
                    p0[r] = S::dot(p0[r], w0, x[r].add(s * 32 + 4 * q));
                    p1[r] = S::dot(p1[r], w1, x[r].add(s * 32 + 4 * q + 4));
                }
            }
            let sc = S::load(un.iscale[s].as_ptr().cast());
            for r in 0..R {
                t[r] = S::add32(t[r], S::mullo32(S::add32(p0[r], p1[r]), sc));
            }
        }
        finish_k45::<S, R>(&t, un, acts, i, u, acc);
    }
}

/// The scaling step of a Q4_K/Q5_K unit `u` for rows `i..i + R`, whose exact `t` is known:
/// `acc[r] += d·dx·t[r] − dmin·dx·Σ_s m_s·Σ x` (the module's fixed order; the AMX tiles share
/// it).
///
/// # Safety
/// As [`row_k45`].
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always)]
pub(crate) unsafe fn finish_k45<S: Isa, const R: usize>(
    t: &[S::V; R],
    un: &Unpacked,
    acts: &QuantActs,
    i: usize,
    u: usize,
    acc: Acc,
) {
    let k = acts.k;
    // SAFETY: block `u` of rows `i..i + R` is inside `acts`; `acc` has `R` rows (callers').
    unsafe {
        let (d, dmin) = (S::loadf(un.fscale[0].as_ptr()), S::loadf(un.fscale[1].as_ptr()));
        for (r, &tr) in t.iter().enumerate() {
            let mut mn = S::zero();
            let pairs = acts.pairs.as_ptr().add((i + r) * (k / 64) + u * 4);
            for p in 0..4 {
                mn = S::madd16(mn, S::load(un.mins[p].as_ptr().cast()), *pairs.add(p));
            }
            let dx = S::splatf(*acts.d.get_unchecked((i + r) * (k / 256) + u));
            let mut a = acc.get::<S>(r);
            a = S::fmadd(S::cvt(tr), S::mulf(d, dx), a);
            a = S::fnmadd(S::cvt(mn), S::mulf(dmin, dx), a);
            acc.put::<S>(r, a);
        }
    }
}

/// Rows `i..i + R` against one unit of 16 sub-blocks of 16: Q6_K (`OFFSET` 32: levels minus
/// 32), Q3_K (minus 4) and Q2_K (no offset, `MINS`: minus each sub-block's min).
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always)]
unsafe fn row_k16<S: Isa, const R: usize, L: Levels<S>, const OFFSET: i32, const MINS: bool>(
    levels: L,
    un: &Unpacked,
    acts: &QuantActs,
    i: usize,
    u: usize,
    acc: Acc,
) {
    let k = acts.k;
    // SAFETY (whole body): block `u` of rows `i..i + R` is inside `acts`; `levels` reads a
    // whole unit (64 quads); `acc` has at least `R` rows.
    unsafe {
        let x: [*const i8; R] = acts.unit_rows(i, u);
        let s16: [*const i32; R] = acts.unit_sums16(i, u);
        let mut t = [S::zero(); R];
        let mut mn = [S::zero(); R];
        for s in 0..16 {
            let mut p0 = [S::zero(); R];
            let mut p1 = [S::zero(); R];
            for q in (0..4).step_by(2) {
                let (w0, w1) = levels.pair(2 * s + q / 2);
                for r in 0..R {
                    p0[r] = S::dot(p0[r], w0, x[r].add(s * 16 + 4 * q));
                    p1[r] = S::dot(p1[r], w1, x[r].add(s * 16 + 4 * q + 4));
                }
            }
            let sc = S::load(un.iscale[s].as_ptr().cast());
            for r in 0..R {
                let mut p = S::add32(p0[r], p1[r]);
                if OFFSET != 0 {
                    p = S::sub32(p, S::splat32(*s16[r].add(s) * OFFSET));
                }
                t[r] = S::add32(t[r], S::mullo32(p, sc));
            }
            if MINS {
                let m = S::load(un.mins16[s].as_ptr().cast());
                for r in 0..R {
                    mn[r] = S::add32(mn[r], S::mullo32(S::splat32(*s16[r].add(s)), m));
                }
            }
        }
        let (d, dmin) = (S::loadf(un.fscale[0].as_ptr()), S::loadf(un.fscale[1].as_ptr()));
        for r in 0..R {
            let dx = S::splatf(*acts.d.get_unchecked((i + r) * (k / 256) + u));
            let mut a = S::fmadd(S::cvt(t[r]), S::mulf(d, dx), acc.get::<S>(r));
            if MINS {
                a = S::fnmadd(S::cvt(mn[r]), S::mulf(dmin, dx), a);
            }
            acc.put::<S>(r, a);
        }
    }
}
