//! Block layouts and their scalar dequantization (the format reference).
//!
//! Layouts (little endian; `d`, `dmin` are f16):
//! - Q8_0 (34 B / 32): `d; i8 qs[32]`; `x = d·q`.
//! - Q4_0 (18 B / 32): `d; u8 qs[16]`; element `j < 16` is the low nibble of `qs[j]`, element
//!   `j + 16` the high nibble; `x = d·(q − 8)`.
//! - Q5_0 (22 B / 32): `d; u8 qh[4]; u8 qs[16]`; nibbles as Q4_0, bit `j` of the u32 `qh` is
//!   bit 4 of element `j`; `x = d·(q − 16)`.
//! - Q4_K (144 B / 256): `d; dmin; u8 scales[12]; u8 qs[128]`; 8 sub-blocks of 32 with 6-bit
//!   scale `sc` and min `m` ([`scale_min_k4`]); chunk `c` (0..4) of 32 bytes holds sub-block
//!   `2c` in its low nibbles and `2c + 1` in its high nibbles; `x = (d·sc)·q − dmin·m`.
//! - Q5_K (176 B / 256): `d; dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]`; as Q4_K plus bit `s`
//!   of `qh[l]` is bit 4 of element `l` of sub-block `s`.
//! - Q6_K (210 B / 256): `u8 ql[128]; u8 qh[64]; i8 scales[16]; d`; two halves of 128; in half
//!   `h` with `l < 32`: elements `l, l+32, l+64, l+96` take the low nibble of `ql[l]`, low
//!   nibble of `ql[l+32]`, high nibble of `ql[l]`, high nibble of `ql[l+32]` with bits
//!   (0,1), (2,3), (4,5), (6,7) of `qh[l]` as bits 4..6; `x = (d·sc[e / 16])·(q − 32)`.
//!
//! - Q4_1 (20 B / 32): `d; m; u8 qs[16]`; nibbles as Q4_0; `x = d·q + m`.
//! - Q5_1 (24 B / 32): `d; m; u8 qh[4]; u8 qs[16]`; bits as Q5_0; `x = d·q + m`.
//! - Q2_K (84 B / 256): `u8 scales[16]; u8 qs[64]; d; dmin`; 16 sub-blocks of 16, scale
//!   `scales[s] & 15`, min `scales[s] >> 4`; two halves of 128: in half `h`, 2-bit field `j`
//!   (bits `2j..2j + 2`) of `qs[32h + l]` is element `128h + 32j + l`;
//!   `x = (d·sc)·q − dmin·m`.
//! - Q3_K (110 B / 256): `u8 hmask[32]; u8 qs[64]; u8 scales[12]; d`; low 2 bits as Q2_K, bit
//!   `4h + j` of `hmask[l]` is bit 2 of the element `128h + 32j + l`; 16 six-bit scales
//!   ([`scales_q3_k`]); `x = (d·(sc − 32))·(q − 4)`.
//! - IQ4_NL (18 B / 32): `d; u8 qs[16]`; nibbles as Q4_0; `x = d·IQ4_LEVELS[q]`.
//! - IQ4_XS (136 B / 256): `d; u16 scales_h; u8 scales_l[4]; u8 qs[128]`; 8 sub-blocks of 32,
//!   sub-block `b` with 6-bit scale `ls` (low nibble `b % 2` of `scales_l[b / 2]`, high bits
//!   `2b..2b + 2` of `scales_h`) and nibbles as Q4_0 in `qs[16b..16b + 16]`;
//!   `x = (d·(ls − 32))·IQ4_LEVELS[q]`.
//! - MXFP4 (17 B / 32): `u8 e; u8 qs[16]`; nibbles as Q4_0; `x = d·MXFP4_LEVELS[q]` with
//!   `d = 2^(e − 128)` ([`e8m0_half`]).
//! - IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0: see [`super::iq`].
//!
//! The arithmetic (f32, unfused, in the order written) matches gguf-py's dequantizers exactly.

use half::{bf16, f16};

use super::formats::{
    GgmlType, IQ4_LEVELS, MXFP4_LEVELS, QK, QK_K, e8m0_half, f16_at, iq4_xs_scale, scale_min_k4,
    scales_q3_k,
};
use super::iq;

/// Dequantizes one row: `src` holds `dst.len() / block_elems` blocks of `ty`.
///
/// Panics when the lengths do not match.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    let be = ty.block_elems();
    assert!(
        dst.len().is_multiple_of(be) && src.len() == dst.len() / be * ty.block_bytes(),
        "dequantize_row: {} bytes are not {} {ty} elements",
        src.len(),
        dst.len()
    );
    let bb = ty.block_bytes();
    let blocks = src.chunks_exact(bb).zip(dst.chunks_exact_mut(be));
    match ty {
        GgmlType::F32 => {
            for (b, o) in blocks {
                o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (b, o) in blocks {
                o[0] = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::Bf16 => {
            for (b, o) in blocks {
                o[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::Q8_0 => blocks.for_each(|(b, o)| dequant_q8_0(b, o)),
        GgmlType::Q4_0 => blocks.for_each(|(b, o)| dequant_q4_0(b, o)),
        GgmlType::Q5_0 => blocks.for_each(|(b, o)| dequant_q5_0(b, o)),
        GgmlType::Q4K => blocks.for_each(|(b, o)| dequant_k45(b, None, o)),
        GgmlType::Q5K => blocks.for_each(|(b, o)| dequant_k45(b, Some(&b[16..48]), o)),
        GgmlType::Q6K => blocks.for_each(|(b, o)| dequant_q6_k(b, o)),
        GgmlType::Q4_1 => blocks.for_each(|(b, o)| dequant_qx_1(b, false, o)),
        GgmlType::Q5_1 => blocks.for_each(|(b, o)| dequant_qx_1(b, true, o)),
        GgmlType::Q2K => blocks.for_each(|(b, o)| dequant_q2_k(b, o)),
        GgmlType::Q3K => blocks.for_each(|(b, o)| dequant_q3_k(b, o)),
        GgmlType::Iq4Nl => {
            blocks.for_each(|(b, o)| dequant_lut(f16_at(b), &b[2..18], &IQ4_LEVELS, o));
        }
        GgmlType::Iq4Xs => blocks.for_each(|(b, o)| dequant_iq4_xs(b, o)),
        GgmlType::Mxfp4 => {
            blocks.for_each(|(b, o)| dequant_lut(e8m0_half(b[0]), &b[1..17], &MXFP4_LEVELS, o));
        }
        _ if ty.is_codebook() => blocks.for_each(|(b, o)| iq::dequant_block(ty, b, o)),
        _ => unreachable!("{ty}: every other type has its arm"),
    }
}

/// Q4_1 (`five_bits == false`) and Q5_1 blocks.
fn dequant_qx_1(b: &[u8], five_bits: bool, o: &mut [f32]) {
    let (d, m) = (f16_at(b), f16_at(&b[2..]));
    let (qh, qs) = if five_bits {
        (u32::from_le_bytes([b[4], b[5], b[6], b[7]]), &b[8..24])
    } else {
        (0, &b[4..20])
    };
    for (j, q) in qs.iter().enumerate() {
        let lo = (q & 0xF) | ((((qh >> j) & 1) as u8) << 4);
        let hi = (q >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
        o[j] = d * f32::from(lo) + m;
        o[j + 16] = d * f32::from(hi) + m;
    }
}

fn dequant_q2_k(b: &[u8], o: &mut [f32]) {
    let (scales, qs) = (&b[..16], &b[16..80]);
    let (d, dmin) = (f16_at(&b[80..]), f16_at(&b[82..]));
    for e in 0..QK_K {
        let sc = scales[e / 16];
        let (dl, ml) = (d * f32::from(sc & 0xF), dmin * f32::from(sc >> 4));
        o[e] = dl * f32::from(q2_at(qs, e)) - ml;
    }
}

fn dequant_q3_k(b: &[u8], o: &mut [f32]) {
    let (hmask, qs) = (&b[..32], &b[32..96]);
    let scales = scales_q3_k(&b[96..108]);
    let d = f16_at(&b[108..]);
    for e in 0..QK_K {
        let dl = d * f32::from(i16::from(scales[e / 16]) - 32);
        let q = i16::from(q2_at(qs, e) | (q3_high_bit(hmask, e) << 2)) - 4;
        o[e] = dl * f32::from(q);
    }
}

/// The low 2 bits of element `e` of a Q2_K / Q3_K block's `qs[64]`.
#[inline]
pub fn q2_at(qs: &[u8], e: usize) -> u8 {
    let (h, j, l) = (e / 128, (e % 128) / 32, e % 32);
    (qs[32 * h + l] >> (2 * j)) & 3
}

/// Bit 2 of element `e` of a Q3_K block (`hmask[32]`), as 0 or 1.
#[inline]
pub fn q3_high_bit(hmask: &[u8], e: usize) -> u8 {
    let (h, j, l) = (e / 128, (e % 128) / 32, e % 32);
    (hmask[l] >> (4 * h + j)) & 1
}

/// One block of 32 nibbles (Q4_0's order) mapped through `levels` and scaled by `d`.
fn dequant_lut(d: f32, qs: &[u8], levels: &[i8; 16], o: &mut [f32]) {
    for (j, q) in qs.iter().enumerate() {
        o[j] = d * f32::from(levels[usize::from(q & 0xF)]);
        o[j + 16] = d * f32::from(levels[usize::from(q >> 4)]);
    }
}

fn dequant_iq4_xs(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b);
    for s in 0..QK_K / QK {
        let dl = d * f32::from(iq4_xs_scale(b, s));
        dequant_lut(dl, &b[8 + 16 * s..24 + 16 * s], &IQ4_LEVELS, &mut o[32 * s..32 * s + 32]);
    }
}

fn dequant_q8_0(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b);
    for (o, q) in o.iter_mut().zip(&b[2..2 + QK]) {
        *o = f32::from(q.cast_signed()) * d;
    }
}

fn dequant_q4_0(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b);
    for (j, q) in b[2..18].iter().enumerate() {
        o[j] = d * f32::from(i16::from(q & 0xF) - 8);
        o[j + 16] = d * f32::from(i16::from(q >> 4) - 8);
    }
}

fn dequant_q5_0(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (j, q) in b[6..22].iter().enumerate() {
        let lo = i16::from(q & 0xF) | (((qh >> j) & 1) << 4) as i16;
        let hi = i16::from(q >> 4) | (((qh >> (j + 16)) & 1) << 4) as i16;
        o[j] = d * f32::from(lo - 16);
        o[j + 16] = d * f32::from(hi - 16);
    }
}

/// Q4_K (`qh == None`) and Q5_K blocks.
fn dequant_k45(b: &[u8], qh: Option<&[u8]>, o: &mut [f32]) {
    let (d, dmin) = (f16_at(b), f16_at(&b[2..]));
    let scales = &b[4..16];
    let qs = if qh.is_some() { &b[48..176] } else { &b[16..144] };
    for s in 0..QK_K / QK {
        let (sc, m) = scale_min_k4(s, scales);
        let (dl, ml) = (d * f32::from(sc), dmin * f32::from(m));
        let chunk = &qs[(s / 2) * 32..(s / 2) * 32 + 32];
        for l in 0..32 {
            let nib = if s % 2 == 0 { chunk[l] & 0xF } else { chunk[l] >> 4 };
            let hi = qh.map_or(0, |h| ((h[l] >> s) & 1) << 4);
            o[s * 32 + l] = dl * f32::from(nib | hi) - ml;
        }
    }
}

fn dequant_q6_k(b: &[u8], o: &mut [f32]) {
    let d = f16_at(&b[208..]);
    for h in 0..2 {
        let ql = &b[64 * h..64 * h + 64];
        let qh = &b[128 + 32 * h..128 + 32 * h + 32];
        let sc = &b[192 + 8 * h..192 + 8 * h + 8];
        let o = &mut o[128 * h..128 * h + 128];
        for l in 0..32 {
            let q = [
                (ql[l] & 0xF) | ((qh[l] & 3) << 4),
                (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4),
                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
            ];
            for (g, q) in q.iter().enumerate() {
                let dl = d * f32::from(sc[l / 16 + 2 * g].cast_signed());
                o[32 * g + l] = dl * f32::from(i16::from(*q) - 32);
            }
        }
    }
}
