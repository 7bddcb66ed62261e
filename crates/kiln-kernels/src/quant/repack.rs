//! The kernel layout of a quantized matrix, built once at load time.
//!
//! Rows are taken in groups of 16 (the last group padded with zero rows); lane `l` of a group is
//! row `16·g + l`. Columns are taken in units of 256 elements (for Q4_0/Q5_0/Q8_0 a unit holds
//! up to 8 blocks of 32; the last unit may hold fewer). Group `g`'s units are consecutive
//! records; each record starts on a 64-byte boundary and holds, for its 16 rows:
//!
//! - the weight levels as unsigned bytes (`q + 128` for Q8_0, the raw 4/5/6-bit `q` otherwise),
//!   organised in "quads" of 64 bytes: quad `i` holds elements `4i..4i + 4` of the unit for each
//!   lane, `[lane][4]`, which is the operand layout of one `vpdpbusd` (16 lanes × 4 bytes).
//!   Q8_0 stores the quads as is; 4-bit types store quads `2v` and `2v + 1` in the low and
//!   high nibbles of 64-byte vector `v`; Q5 types add bit planes, vectors whose byte `i` holds
//!   bit 4 of byte `i` of quads `8v..8v + 8` in bits 0..7 (so each quad's bits come out with
//!   one 16-bit shift and a mask); Q6_K adds vectors whose byte `i` holds bits 4..6 of quads
//!   `4v..4v + 4` in bit pairs (0,1), (2,3), (4,5), (6,7);
//! - the scales: f16 `d` per lane per block (`[nb][16]`); K-quants add `dmin` `[16]` and
//!   sub-block scales `[8][16]` u8 (Q6_K: `[16][16]` i8) and mins as pairs `[4][16][2]` u8.
//!
//! [`unpack`] turns a record back into an [`Unpacked`] (quads as bytes, scales widened), which
//! is what the kernels and [`super::QuantMatrix::row_to_f32`] read (except the AVX2 decode
//! tiles, which build the levels from the record in registers and take only the scales,
//! [`unpack_scales`]); [`pack`] is its inverse.
//!
//! The types read from files only keep the same shape: Q4_1 / Q5_1 are Q4_0 / Q5_0 records plus
//! an f16 min per lane per block (in the mins part); IQ4_NL, IQ4_XS and MXFP4 store their
//! nibbles (the level indices) as Q4_0 does, and [`unpack`] maps them through the format's
//! level table to `level + 128`, so the kernels treat them as Q8_0 (IQ4_XS as 8 blocks of 32
//! with `d·(ls − 32)` per block; MXFP4's scales are stored as f32); Q2_K / Q3_K store 2-bit
//! levels, quads `4v..4v + 4` of vector `v` in bit pairs (0,1)..(6,7), Q3_K's bit 2 in bit
//! planes of 8 quads, their 16 sub-block scales as bytes `[16][16]` (Q2_K: scale and min
//! nibbles as in the file; Q3_K: `sc − 32` as i8) and `d` (Q2_K also `dmin`).
//!
//! The codebook and ternary types (`iq`: IQ1_*, IQ2_*, IQ3_*, TQ*) are decoded at load into
//! level indices, stored as Q2_K's 2-bit vectors (TQ1_0, TQ2_0), plus Q3_K's bit planes for a
//! third bit (IQ1_*, IQ2_*), or as 4-bit nibbles (IQ3_*); [`unpack`] maps them through the
//! type's table to `level + 64`. Their 16 sub-block scales are bytes `[16][16]` and their `d`
//! an f32 per lane, and the kernels run them as Q6_K with offset 64.

use super::formats::{
    GgmlType, IQ4_LEVELS, MXFP4_LEVELS, QK, QK_K, e8m0_half, iq4_xs_scale, scale_min_k4,
    scales_q3_k,
};
use super::iq;
use super::isa::Isa;
use kiln_backend::quant::{q2_at, q3_high_bit};

/// Rows per group: the lanes of one vector.
pub(crate) const LANES: usize = 16;
/// Elements per unit.
pub(crate) const UNIT: usize = QK_K;
/// Quads per unit.
const QUADS: usize = UNIT / 4;

/// One record widened for the kernels.
#[repr(C, align(64))]
pub(crate) struct Unpacked {
    /// `[QUADS][16 lanes][4]`: levels (Q8_0: `q + 128`).
    pub quads: [[u8; 64]; QUADS],
    /// Per-lane f32 scales: Q4_0/Q5_0/Q8_0 `d` of block `b` at `[b]`; K-quants `d` at `[0]`
    /// and (Q2_K/Q4_K/Q5_K) `dmin` at `[1]`; IQ4_XS `d·(ls − 32)` of sub-block `b` at `[b]`.
    pub fscale: [[f32; 16]; 8],
    /// Q4_1/Q5_1: the min `m` of block `b` at `[b]`.
    pub fmin: [[f32; 16]; 8],
    /// Q2_K: the 4-bit min of sub-block `s` at `[s]`.
    pub mins16: [[i32; 16]; 16],
    /// K-quant sub-block scales as i32 lanes `[sub-block][16]` (8 for Q4_K/Q5_K, 16 for
    /// Q2_K/Q3_K/Q6_K).
    pub iscale: [[i32; 16]; 16],
    /// Q4_K/Q5_K mins, `[pair p][16]`: `(m[2p], m[2p + 1])` as two i16 in each i32 lane.
    pub mins: [[i32; 16]; 4],
}

impl Unpacked {
    pub fn new() -> Box<Self> {
        Box::new(Self {
            quads: [[0; 64]; QUADS],
            fscale: [[0.0; 16]; 8],
            fmin: [[0.0; 16]; 8],
            mins16: [[0; 16]; 16],
            iscale: [[0; 16]; 16],
            mins: [[0; 16]; 4],
        })
    }
}

/// Byte offsets of a record's parts: (nibble/level bytes, high bits, sub-block scales, mins,
/// f16 scales), and the padded record size.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RecordLayout {
    pub hi: usize,
    pub sc: usize,
    pub mins: usize,
    pub d: usize,
    pub size: usize,
}

/// Blocks in a unit of `unit_elems` elements.
pub(crate) fn blocks_in(ty: GgmlType, unit_elems: usize) -> usize {
    unit_elems / ty.block_elems()
}

pub(crate) fn record_layout(ty: GgmlType, nb: usize) -> RecordLayout {
    let (lo, hi, sc, mins, d) = match ty {
        GgmlType::Q8_0 => (nb * 8 * 64, 0, 0, 0, nb * 32),
        GgmlType::Q4_0 | GgmlType::Iq4Nl => (nb * 4 * 64, 0, 0, 0, nb * 32),
        GgmlType::Q5_0 => (nb * 4 * 64, nb * 64, 0, 0, nb * 32),
        GgmlType::Q4_1 => (nb * 4 * 64, 0, 0, nb * 32, nb * 32),
        GgmlType::Q5_1 => (nb * 4 * 64, nb * 64, 0, nb * 32, nb * 32),
        GgmlType::Mxfp4 => (nb * 4 * 64, 0, 0, 0, nb * 64),
        GgmlType::Iq4Xs => (2048, 0, 128, 0, 32),
        GgmlType::Q2K | GgmlType::Tq1_0 | GgmlType::Tq2_0 => (1024, 0, 256, 0, 64),
        GgmlType::Q3K => (1024, 512, 256, 0, 32),
        GgmlType::Q4K => (2048, 0, 128, 128, 64),
        GgmlType::Q5K => (2048, 512, 128, 128, 64),
        GgmlType::Q6K => (2048, 1024, 256, 0, 32),
        GgmlType::Iq1S | GgmlType::Iq1M | GgmlType::Iq2Xxs | GgmlType::Iq2Xs | GgmlType::Iq2S => {
            (1024, 512, 256, 0, 64)
        }
        GgmlType::Iq3Xxs | GgmlType::Iq3S => (2048, 0, 256, 0, 64),
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => unreachable!("not a quantized type"),
    };
    let hi_at = lo;
    let sc_at = hi_at + hi;
    let mins_at = sc_at + sc;
    let d_at = mins_at + mins;
    RecordLayout {
        hi: hi_at,
        sc: sc_at,
        mins: mins_at,
        d: d_at,
        size: (d_at + d).next_multiple_of(64),
    }
}

/// Decoded levels and scales of one block of one row.
struct Decoded {
    /// Unsigned levels (Q8_0: `q + 128`), `[block_elems]`.
    levels: [u8; QK_K],
    d: [u8; 2],
    dmin: [u8; 2],
    /// Sub-block scales (Q6_K: i8 bit patterns).
    sc: [u8; 16],
    mins: [u8; 8],
}

fn decode(ty: GgmlType, b: &[u8]) -> Decoded {
    let mut out =
        Decoded { levels: [0; QK_K], d: [b[0], b[1]], dmin: [0; 2], sc: [0; 16], mins: [0; 8] };
    match ty {
        GgmlType::Q8_0 => {
            for (l, q) in out.levels.iter_mut().zip(&b[2..2 + QK]) {
                *l = q ^ 0x80;
            }
        }
        GgmlType::Q4_0
        | GgmlType::Q5_0
        | GgmlType::Q4_1
        | GgmlType::Q5_1
        | GgmlType::Iq4Nl
        | GgmlType::Mxfp4 => {
            let (qs, qh) = match ty {
                GgmlType::Q5_0 => (&b[6..22], u32::from_le_bytes([b[2], b[3], b[4], b[5]])),
                GgmlType::Q5_1 => (&b[8..24], u32::from_le_bytes([b[4], b[5], b[6], b[7]])),
                GgmlType::Q4_1 => (&b[4..20], 0),
                GgmlType::Mxfp4 => (&b[1..17], 0),
                _ => (&b[2..18], 0),
            };
            if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
                out.dmin = [b[2], b[3]];
            }
            for (j, q) in qs.iter().enumerate() {
                out.levels[j] = (q & 0xF) | ((((qh >> j) & 1) as u8) << 4);
                out.levels[j + 16] = (q >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
            }
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            out.dmin = [b[2], b[3]];
            let five = ty == GgmlType::Q5K;
            let qs = if five { &b[48..176] } else { &b[16..144] };
            for s in 0..8 {
                (out.sc[s], out.mins[s]) = scale_min_k4(s, &b[4..16]);
                for l in 0..QK {
                    let c = qs[(s / 2) * 32 + l];
                    let nib = if s % 2 == 0 { c & 0xF } else { c >> 4 };
                    let hi = if five { ((b[16 + l] >> s) & 1) << 4 } else { 0 };
                    out.levels[s * QK + l] = nib | hi;
                }
            }
        }
        GgmlType::Iq4Xs => {
            for sb in 0..8 {
                out.sc[sb] = iq4_xs_scale(b, sb).cast_unsigned();
                for (j, q) in b[8 + 16 * sb..24 + 16 * sb].iter().enumerate() {
                    out.levels[32 * sb + j] = q & 0xF;
                    out.levels[32 * sb + j + 16] = q >> 4;
                }
            }
        }
        GgmlType::Q2K => {
            out.d = [b[80], b[81]];
            out.dmin = [b[82], b[83]];
            out.sc.copy_from_slice(&b[..16]);
            for (e, l) in out.levels.iter_mut().enumerate() {
                *l = q2_at(&b[16..80], e);
            }
        }
        GgmlType::Q3K => {
            out.d = [b[108], b[109]];
            for (sc, s6) in out.sc.iter_mut().zip(scales_q3_k(&b[96..108])) {
                *sc = (s6.cast_signed() - 32).cast_unsigned();
            }
            for (e, l) in out.levels.iter_mut().enumerate() {
                *l = q2_at(&b[32..96], e) | (q3_high_bit(&b[..32], e) << 2);
            }
        }
        GgmlType::Q6K => {
            out.d = [b[208], b[209]];
            out.sc.copy_from_slice(&b[192..208]);
            for h in 0..2 {
                let (ql, qh) = (&b[64 * h..], &b[128 + 32 * h..]);
                let lv = &mut out.levels[128 * h..];
                for l in 0..32 {
                    lv[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                    lv[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                    lv[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    lv[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                }
            }
        }
        _ => unreachable!("{ty} is decoded elsewhere"),
    }
    out
}

/// Writes the record of `rows` (each the unit's `nb` blocks of original bytes; `None` for
/// padding lanes) into `rec` (`record_layout(ty, nb).size` bytes, zeroed).
pub(crate) fn pack(ty: GgmlType, nb: usize, rows: &[Option<&[u8]>; LANES], rec: &mut [u8]) {
    let lay = record_layout(ty, nb);
    let be = ty.block_elems();
    let mut quads = vec![[0u8; 64]; nb * be / 4];
    for (lane, row) in rows.iter().enumerate() {
        let Some(row) = row else { continue };
        for (bi, blk) in row.chunks_exact(ty.block_bytes()).take(nb).enumerate() {
            if ty.is_codebook() {
                pack_codebook_lane(ty, blk, lane, lay, &mut quads, rec);
                continue;
            }
            let dec = decode(ty, blk);
            for e in 0..be {
                let e_unit = bi * be + e;
                quads[e_unit / 4][lane * 4 + e_unit % 4] = dec.levels[e];
            }
            if ty == GgmlType::Mxfp4 {
                let d_at = lay.d + (bi * LANES + lane) * 4;
                rec[d_at..d_at + 4].copy_from_slice(&e8m0_half(blk[0]).to_le_bytes());
            } else {
                let d_at = lay.d + (bi * LANES + lane) * 2;
                rec[d_at..d_at + 2].copy_from_slice(&dec.d);
            }
            match ty {
                GgmlType::Q4_1 | GgmlType::Q5_1 => {
                    let m_at = lay.mins + (bi * LANES + lane) * 2;
                    rec[m_at..m_at + 2].copy_from_slice(&dec.dmin);
                }
                GgmlType::Q2K => {
                    let dmin_at = lay.d + (LANES + lane) * 2;
                    rec[dmin_at..dmin_at + 2].copy_from_slice(&dec.dmin);
                    for s in 0..16 {
                        rec[lay.sc + s * LANES + lane] = dec.sc[s];
                    }
                }
                GgmlType::Iq4Xs => {
                    for s in 0..8 {
                        rec[lay.sc + s * LANES + lane] = dec.sc[s];
                    }
                }
                GgmlType::Q4K | GgmlType::Q5K => {
                    let dmin_at = lay.d + (LANES + lane) * 2;
                    rec[dmin_at..dmin_at + 2].copy_from_slice(&dec.dmin);
                    for s in 0..8 {
                        rec[lay.sc + s * LANES + lane] = dec.sc[s];
                        rec[lay.mins + (s / 2) * 32 + lane * 2 + s % 2] = dec.mins[s];
                    }
                }
                GgmlType::Q6K | GgmlType::Q3K => {
                    for s in 0..16 {
                        rec[lay.sc + s * LANES + lane] = dec.sc[s];
                    }
                }
                _ => {}
            }
        }
    }
    match ty {
        GgmlType::Q8_0 => {
            for (i, q) in quads.iter().enumerate() {
                rec[i * 64..i * 64 + 64].copy_from_slice(q);
            }
        }
        _ if two_bit_levels(ty) => {
            for v in 0..quads.len() / 4 {
                for i in 0..64 {
                    rec[v * 64 + i] =
                        (0..4).fold(0u8, |a, t| a | ((quads[4 * v + t][i] & 3) << (2 * t)));
                }
            }
        }
        _ => {
            for v in 0..quads.len() / 2 {
                for i in 0..64 {
                    rec[v * 64 + i] = (quads[2 * v][i] & 0xF) | ((quads[2 * v + 1][i] & 0xF) << 4);
                }
            }
        }
    }
    match ty {
        _ if matches!(ty, GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5K) || bit_plane_2(ty) => {
            let bit = if bit_plane_2(ty) { 2 } else { 4 };
            for v in 0..quads.len() / 8 {
                for i in 0..64 {
                    rec[lay.hi + v * 64 + i] =
                        (0..8).fold(0u8, |a, t| a | (((quads[8 * v + t][i] >> bit) & 1) << t));
                }
            }
        }
        GgmlType::Q6K => {
            for v in 0..quads.len() / 4 {
                for i in 0..64 {
                    rec[lay.hi + v * 64 + i] =
                        (0..4).fold(0u8, |a, t| a | (((quads[4 * v + t][i] >> 4) & 3) << (2 * t)));
                }
            }
        }
        _ => {}
    }
}

/// One lane of a codebook type's record (a single block): its level indices into `quads`,
/// its scales and `d` into `rec`.
fn pack_codebook_lane(
    ty: GgmlType,
    blk: &[u8],
    lane: usize,
    lay: RecordLayout,
    quads: &mut [[u8; 64]],
    rec: &mut [u8],
) {
    let dec = iq::decode(ty, blk);
    for (e, &i) in dec.idx.iter().enumerate() {
        quads[e / 4][lane * 4 + e % 4] = i;
    }
    for (s, &sc) in dec.sc.iter().enumerate() {
        rec[lay.sc + s * LANES + lane] = sc;
    }
    rec[lay.d + lane * 4..lay.d + lane * 4 + 4].copy_from_slice(&dec.d.to_le_bytes());
}

/// Widens record `rec` (`nb` blocks; `record_layout(ty, nb).size` readable bytes) into `un`.
/// For Q8_0 the quads are not copied (the kernels read them from the record).
///
/// # Safety
/// `S`'s CPU features must be available; `rec` must point at a whole record.
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always)]
pub(crate) unsafe fn unpack<S: Isa>(ty: GgmlType, nb: usize, rec: *const u8, un: &mut Unpacked) {
    let lay = record_layout(ty, nb);
    let q = un.quads.as_mut_ptr().cast::<u8>();
    // SAFETY (whole body): all offsets are within the record layout computed above, and `un`'s
    // arrays are sized for the largest record.
    unsafe {
        let m4 = S::splat8(0x0F);
        let nquads = nb * ty.block_elems() / 4;
        match ty {
            GgmlType::Q8_0 => {}
            _ if two_bit_levels(ty) => {
                unpack_2bit::<S>(bit_plane_2(ty), nquads, rec, lay.hi, q);
                if let Some(table) = level_table(ty) {
                    let table = S::load(table.as_ptr());
                    for v in 0..nquads {
                        S::store(q.add(v * 64), S::lut16(table, S::load(q.add(v * 64))));
                    }
                }
            }
            _ => {
                let five = matches!(ty, GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5K);
                let table = level_table(ty).map(|t| S::load(t.as_ptr()));
                // Every unit holds whole blocks of 8 quads: one bit plane vector, 4 nibble
                // vectors.
                for p in 0..nquads / 8 {
                    let plane = if five { S::load(rec.add(lay.hi + p * 64)) } else { S::zero() };
                    for t in 0..4 {
                        let v = 4 * p + t;
                        let x = S::load(rec.add(v * 64));
                        let mut lo = S::and(x, m4);
                        let mut hi = S::and(S::srli16::<4>(x), m4);
                        if five {
                            lo = S::or(lo, bit4_of::<S>(plane, 2 * t));
                            hi = S::or(hi, bit4_of::<S>(plane, 2 * t + 1));
                        }
                        if let Some(table) = table {
                            lo = S::lut16(table, lo);
                            hi = S::lut16(table, hi);
                        }
                        S::store(q.add(2 * v * 64), lo);
                        S::store(q.add((2 * v + 1) * 64), hi);
                    }
                }
            }
        }
        if ty == GgmlType::Q6K {
            let m3 = S::splat8(0x30);
            for v in 0..nquads / 4 {
                let h = S::load(rec.add(lay.hi + v * 64));
                let parts = [
                    S::and(S::slli16::<4>(h), m3),
                    S::and(S::slli16::<2>(h), m3),
                    S::and(h, m3),
                    S::and(S::srli16::<2>(h), m3),
                ];
                for (t, p) in parts.into_iter().enumerate() {
                    let at = q.add((4 * v + t) * 64);
                    S::store(at, S::or(S::load(at), p));
                }
            }
        }
        unpack_scales::<S>(ty, nb, rec, un);
    }
}

/// The scales part of [`unpack`]: `un.fscale`, and the K-quants' `un.iscale` and `un.mins`
/// (kernels that take the levels straight from the record need only these).
///
/// # Safety
/// As [`unpack`].
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always)]
pub(crate) unsafe fn unpack_scales<S: Isa>(
    ty: GgmlType,
    nb: usize,
    rec: *const u8,
    un: &mut Unpacked,
) {
    let lay = record_layout(ty, nb);
    // SAFETY (whole body): all offsets are within the record layout computed above, and `un`'s
    // arrays are sized for the largest record.
    unsafe {
        let dn = match ty {
            GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q2K => 2,
            GgmlType::Iq4Xs => 1,
            _ => nb,
        };
        for b in 0..dn {
            let d = if ty == GgmlType::Mxfp4 || ty.is_codebook() {
                S::loadf(rec.add(lay.d + b * 64).cast())
            } else {
                S::load_f16(rec.add(lay.d + b * 32))
            };
            S::storef(un.fscale[b].as_mut_ptr(), d);
        }
        match ty {
            GgmlType::Q4K | GgmlType::Q5K => {
                for s in 0..8 {
                    let v = S::widen_u8_i32(rec.add(lay.sc + s * 16));
                    S::store(un.iscale[s].as_mut_ptr().cast(), v);
                }
                for p in 0..4 {
                    let v = S::widen_u8_i16(rec.add(lay.mins + p * 32));
                    S::store(un.mins[p].as_mut_ptr().cast(), v);
                }
            }
            GgmlType::Q6K | GgmlType::Q3K => {
                for s in 0..16 {
                    let v = S::widen_i8_i32(rec.add(lay.sc + s * 16));
                    S::store(un.iscale[s].as_mut_ptr().cast(), v);
                }
            }
            GgmlType::Q2K => {
                for s in 0..16 {
                    let v = S::widen_u8_i32(rec.add(lay.sc + s * 16));
                    S::store(un.iscale[s].as_mut_ptr().cast(), S::and(v, S::splat32(0xF)));
                    // Values below 256 in 32-bit lanes: a 16-bit shift moves only the low half.
                    S::store(un.mins16[s].as_mut_ptr().cast(), S::srli16::<4>(v));
                }
            }
            _ if ty.is_codebook() => {
                for s in 0..16 {
                    let v = S::widen_u8_i32(rec.add(lay.sc + s * 16));
                    S::store(un.iscale[s].as_mut_ptr().cast(), v);
                }
            }
            GgmlType::Q4_1 | GgmlType::Q5_1 => {
                for b in 0..nb {
                    let m = S::load_f16(rec.add(lay.mins + b * 32));
                    S::storef(un.fmin[b].as_mut_ptr(), m);
                }
            }
            GgmlType::Iq4Xs => {
                let d = S::loadf(un.fscale[0].as_ptr());
                for s in 0..8 {
                    let ls = S::cvt(S::widen_i8_i32(rec.add(lay.sc + s * 16)));
                    S::storef(un.fscale[s].as_mut_ptr(), S::mulf(d, ls));
                }
            }
            _ => {}
        }
    }
}

/// Whether `ty`'s record stores 2-bit level vectors (Q2_K, Q3_K, the TQ, IQ1 and IQ2 types).
fn two_bit_levels(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q2K | GgmlType::Q3K) || (ty.is_codebook() && iq::index_bits(ty) < 4)
}

/// Whether `ty`'s record adds bit planes holding bit 2 of each level (Q3_K, IQ1, IQ2).
fn bit_plane_2(ty: GgmlType) -> bool {
    ty == GgmlType::Q3K || (ty.is_codebook() && iq::index_bits(ty) == 3)
}

/// The 2-bit levels of a record (`nquads` quads, with `plane`: bit 2 from the bit planes at
/// `hi`) into `q`.
///
/// # Safety
/// As [`unpack`]; `q` is the scratch's quads.
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always)]
unsafe fn unpack_2bit<S: Isa>(plane: bool, nquads: usize, rec: *const u8, hi: usize, q: *mut u8) {
    // SAFETY (whole body): the record holds `nquads / 4` level vectors and (`plane`)
    // `nquads / 8` bit planes from `hi`; `q` holds `nquads` quads.
    unsafe {
        let m2 = S::splat8(0x03);
        for v in 0..nquads / 4 {
            let x = S::load(rec.add(v * 64));
            let parts = [x, S::srli16::<2>(x), S::srli16::<4>(x), S::srli16::<6>(x)];
            for (t, p) in parts.into_iter().enumerate() {
                S::store(q.add((4 * v + t) * 64), S::and(p, m2));
            }
        }
        if plane {
            for p in 0..nquads / 8 {
                let plane = S::load(rec.add(hi + p * 64));
                for t in 0..8 {
                    let at = q.add((8 * p + t) * 64);
                    // Bit 4 moved down to bit 2 (a 16-bit shift; only bit 4 of each byte is set).
                    let bit2 = S::srli16::<2>(bit4_of::<S>(plane, t));
                    S::store(at, S::or(S::load(at), bit2));
                }
            }
        }
    }
}

/// The format's levels as unsigned bytes, four copies of 16 (one per 128-bit lane of a byte
/// shuffle), for the types whose indices select from a table: `level + 128` for IQ4_NL,
/// IQ4_XS and MXFP4 (run as Q8_0), `level + 64` for the codebook types (run as Q6_K).
fn level_table(ty: GgmlType) -> Option<&'static [u8; 64]> {
    static IQ4: [u8; 64] = biased_table(&IQ4_LEVELS, 128);
    static MXFP4: [u8; 64] = biased_table(&MXFP4_LEVELS, 128);
    static IQ: [[u8; 64]; 5] = [
        biased_table(&iq::IQ1_LEVELS, 64),
        biased_table(&iq::IQ2_LEVELS, 64),
        biased_table(&iq::IQ3XXS_LEVELS, 64),
        biased_table(&iq::IQ3S_LEVELS, 64),
        biased_table(&iq::TERNARY_LEVELS, 64),
    ];
    match ty {
        GgmlType::Iq4Nl | GgmlType::Iq4Xs => Some(&IQ4),
        GgmlType::Mxfp4 => Some(&MXFP4),
        GgmlType::Iq1S | GgmlType::Iq1M => Some(&IQ[0]),
        GgmlType::Iq2Xxs | GgmlType::Iq2Xs | GgmlType::Iq2S => Some(&IQ[1]),
        GgmlType::Iq3Xxs => Some(&IQ[2]),
        GgmlType::Iq3S => Some(&IQ[3]),
        GgmlType::Tq1_0 | GgmlType::Tq2_0 => Some(&IQ[4]),
        _ => None,
    }
}

const fn biased_table(levels: &[i8; 16], bias: i16) -> [u8; 64] {
    let mut out = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        out[i] = (levels[i % 16] as i16 + bias) as u8;
        i += 1;
    }
    out
}

/// Bit `t` of every byte of a Q5 bit plane moved to bit 4, the others cleared: quad `8v + t`'s
/// high bits as levels 16 or 0. A 16-bit shift moves each byte's bit `t` within its byte
/// (`t < 4` left by `4 − t`, `t > 4` right by `t − 4`); the mask drops what crossed over.
///
/// # Safety
/// `S`'s CPU features must be available.
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always)]
pub(crate) unsafe fn bit4_of<S: Isa>(plane: S::V, t: usize) -> S::V {
    // SAFETY: register operations; the features are the caller's.
    unsafe {
        let moved = match t {
            0 => S::slli16::<4>(plane),
            1 => S::slli16::<3>(plane),
            2 => S::slli16::<2>(plane),
            3 => S::slli16::<1>(plane),
            4 => plane,
            5 => S::srli16::<1>(plane),
            6 => S::srli16::<2>(plane),
            _ => S::srli16::<3>(plane),
        };
        S::and(moved, S::splat8(0x10))
    }
}

/// Dequantizes lane `lane` of an unpacked record (`nb` blocks, Q8_0 quads at `quads`) into
/// `out` (`[nb · block_elems]`), with exactly the arithmetic of [`super::dequantize_row`].
pub(crate) fn dequant_lane(
    ty: GgmlType,
    nb: usize,
    un: &Unpacked,
    quads: &[u8],
    lane: usize,
    out: &mut [f32],
) {
    let be = ty.block_elems();
    let level = |e: usize| quads[(e / 4) * 64 + lane * 4 + e % 4];
    for (e, o) in out.iter_mut().enumerate().take(nb * be) {
        let q = level(e);
        *o = match ty {
            GgmlType::Q8_0 => f32::from((q ^ 0x80).cast_signed()) * un.fscale[e / QK][lane],
            GgmlType::Iq4Nl | GgmlType::Iq4Xs | GgmlType::Mxfp4 => {
                un.fscale[e / QK][lane] * f32::from((q ^ 0x80).cast_signed())
            }
            GgmlType::Q4_1 | GgmlType::Q5_1 => {
                un.fscale[e / QK][lane] * f32::from(q) + un.fmin[e / QK][lane]
            }
            GgmlType::Q2K => {
                let s = e / 16;
                let dl = un.fscale[0][lane] * un.iscale[s][lane] as f32;
                dl * f32::from(q) - un.fscale[1][lane] * un.mins16[s][lane] as f32
            }
            GgmlType::Q3K => {
                let dl = un.fscale[0][lane] * un.iscale[e / 16][lane] as f32;
                dl * f32::from(i16::from(q) - 4)
            }
            GgmlType::Q4_0 => un.fscale[e / QK][lane] * f32::from(i16::from(q) - 8),
            GgmlType::Q5_0 => un.fscale[e / QK][lane] * f32::from(i16::from(q) - 16),
            GgmlType::Q4K | GgmlType::Q5K => {
                let s = e / QK;
                let m = un.mins[s / 2][lane] >> (16 * (s % 2)) & 0xFFFF;
                let dl = un.fscale[0][lane] * un.iscale[s][lane] as f32;
                dl * f32::from(q) - un.fscale[1][lane] * m as f32
            }
            GgmlType::Q6K => {
                let dl = un.fscale[0][lane] * un.iscale[e / 16][lane] as f32;
                dl * f32::from(i16::from(q) - 32)
            }
            _ if ty.is_codebook() => {
                // The same products as `iq::dequant_block`.
                let dl = un.fscale[0][lane] * un.iscale[e / 16][lane] as f32;
                dl * f32::from(i16::from(q) - iq::LEVEL_OFFSET as i16)
            }
            _ => unreachable!("{ty} is not a quantized type"),
        };
    }
}

/// Writes the unit's levels minus their offset (as i8) into `out`: `nquads` quads read from
/// `quads` (unsigned levels, Q8_0's `q + 128` included).
///
/// # Safety
/// `S`'s features must be available; `quads` readable for `nquads` quads.
#[inline(always)] // must inline into the `#[target_feature]` entry points
#[allow(clippy::inline_always)]
pub(crate) unsafe fn signed_quads<S: Isa>(
    ty: GgmlType,
    nquads: usize,
    quads: *const u8,
    out: &mut Unpacked,
) {
    let off = match ty {
        GgmlType::Q8_0 => 128,
        GgmlType::Q4_0 => 8,
        GgmlType::Q5_0 => 16,
        GgmlType::Q6K => 32,
        _ => 0,
    };
    let q = out.quads.as_mut_ptr().cast::<u8>();
    // SAFETY: `out.quads` holds a whole unit of quads; reads as guaranteed by the caller.
    unsafe {
        let o = S::splat8(off);
        for v in 0..nquads {
            S::store(q.add(v * 64), S::sub8(S::load(quads.add(v * 64)), o));
        }
    }
}
