//! The codebook and ternary GGUF types: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
//! TQ1_0 and TQ2_0 (all 256-element super-blocks).
//!
//! Each block is decoded at load into the form the Q6_K-style kernel runs (`row_k16`): for
//! every element an index into the type's [`levels`] (a signed level of at most ±62), an
//! integer scale per 16 elements, and one f32 scale `d`, so that element `e` is exactly
//! `(d · sc[e / 16]) · levels[idx[e]]`. The factoring is exact for every block: `d` is the
//! block's f16 scale times a power of two, the integer scale at most 31 and the level at most
//! 62, so every product fits f32's 24-bit mantissa and equals what gguf-py computes (the
//! `dequant.bin` fixture checks it bit for bit).
//!
//! Block layouts (little endian; `d` is f16; a sign byte's bit `j` negates element `j`; the
//! 7-bit sign codes expand to 8 bits with even parity, [`ksigns`]):
//! - IQ2_XXS (66 B): `d; u32 q[16]`; sub-block `b` of 32 takes `q[2b]` (four 8-bit grid
//!   indices into [`IQ2XXS_GRID`]) and `q[2b + 1]` (four 7-bit sign codes, then the 4-bit
//!   scale `ls` in bits 28..32); `x = d·(0.5 + ls)·0.25 · grid · sign`.
//! - IQ2_XS (74 B): `d; u16 q[32]; u8 scales[8]`; `q` is a 9-bit index into [`IQ2XS_GRID`]
//!   and a 7-bit sign code; sub-block of 16 `s` has scale nibble `s % 2` of `scales[s / 2]`.
//! - IQ2_S (82 B): `d; u8 qs[32]; u8 signs[32]; u8 qh[8]; u8 scales[8]`; group `g` of 8 takes
//!   the 10-bit index `qs[g] | ((qh[g / 4] >> 2·(g % 4)) & 3) << 8` into [`IQ2S_GRID`] and the
//!   sign byte `signs[g]`; scales as IQ2_XS.
//! - IQ3_XXS (98 B): `d; u8 qs[64]; u32 ss[8]`; quad `i` of 4 takes grid index `qs[i]`
//!   ([`IQ3XXS_GRID`]); sub-block `b` of 32 takes its sign codes and scale from `ss[b]` as
//!   IQ2_XXS; `x = d·(0.5 + ls)·0.5 · grid · sign`.
//! - IQ3_S (110 B): `d; u8 qs[64]; u8 qh[8]; u8 signs[32]; u8 scales[4]`; quad `i` takes the
//!   9-bit index `qs[i] | ((qh[i / 8] >> (i % 8)) & 1) << 8` ([`IQ3S_GRID`]), group of 8 `g`
//!   the sign byte `signs[g]`; sub-block `b` of 32 the nibble `b % 2` of `scales[b / 2]`;
//!   `x = d·(1 + 2·ls) · grid · sign`.
//! - IQ1_S (50 B): `d; u8 qs[32]; u16 qh[8]`; sub-block `b` of 32: group `g` of 8 takes the
//!   11-bit index `qs[4b + g] | ((qh[b] >> 3g) & 7) << 8` into [`IQ1S_GRID`] (levels −1, 0,
//!   1); `ls = (qh[b] >> 12) & 7`, bit 15 the sign of the shift δ = ±1/8;
//!   `x = d·(2·ls + 1) · (grid + δ)`.
//! - IQ1_M (56 B): `u8 qs[32]; u8 qh[16]; u16 sc[4]`; `d` is the f16 whose four nibbles are the
//!   top nibbles of `sc[0..4]`; group `g` takes `qs[g] | ((qh[g / 2] >> 4·(g % 2)) & 7) << 8`
//!   and the shift sign from bit 3 of that nibble; sub-block of 16 `s` the 3-bit scale at bit
//!   `3·(s % 4)` of `sc[s / 4]`; `x` as IQ1_S.
//! - TQ1_0 (54 B): `u8 qs[48]; u8 qh[4]; d`; five ternary digits per byte of `qs` (bytes 0..32
//!   give elements `32n + m`, bytes 32..48 elements `160 + 16n + m`, `qh` elements
//!   `240 + 4n + m` with four digits), digit `n` of byte `q` being
//!   `((q · 3ⁿ mod 256) · 3) >> 8`; `x = d · (digit − 1)`.
//! - TQ2_0 (66 B): `u8 qs[64]; d`; 2-bit fields as Q2_K's; `x = d · (q − 1)`.

use super::formats::{GgmlType, QK_K, f16_at};
use super::iq_grids::{IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID};

/// Bits a record spends on each level index: 2 (TQ), 3 (IQ1, IQ2) or 4 (IQ3).
pub fn index_bits(ty: GgmlType) -> u32 {
    match ty {
        GgmlType::Tq1_0 | GgmlType::Tq2_0 => 2,
        GgmlType::Iq3Xxs | GgmlType::Iq3S => 4,
        _ => 3,
    }
}

/// What the kernels add to a level to make it an unsigned byte (levels are within ±62, so
/// `level + 64` is below 128 and `vpmaddubsw` cannot saturate).
pub const LEVEL_OFFSET: i32 = 64;

/// IQ2: index = magnitude (8, 25, 43) | sign << 2.
pub const IQ2_LEVELS: [i8; 16] = [8, 25, 43, 0, -8, -25, -43, 0, 0, 0, 0, 0, 0, 0, 0, 0];
/// IQ1: `8·(grid + δ)`, index = grid (−1, 0, 1) | (δ < 0) << 2.
pub const IQ1_LEVELS: [i8; 16] = [-7, 1, 9, 0, -9, -1, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0];
/// IQ3_XXS: index = magnitude | sign << 3.
pub const IQ3XXS_LEVELS: [i8; 16] =
    [4, 12, 20, 28, 36, 44, 52, 62, -4, -12, -20, -28, -36, -44, -52, -62];
/// IQ3_S: index = magnitude | sign << 3.
pub const IQ3S_LEVELS: [i8; 16] = [1, 3, 5, 7, 9, 11, 13, 15, -1, -3, -5, -7, -9, -11, -13, -15];
/// TQ1_0 / TQ2_0: index = digit, level = digit − 1.
pub const TERNARY_LEVELS: [i8; 16] = [-1, 0, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];

/// The signed level each index of `ty` selects (unused indices 0).
pub fn levels(ty: GgmlType) -> &'static [i8; 16] {
    match ty {
        GgmlType::Iq2Xxs | GgmlType::Iq2Xs | GgmlType::Iq2S => &IQ2_LEVELS,
        GgmlType::Iq1S | GgmlType::Iq1M => &IQ1_LEVELS,
        GgmlType::Iq3Xxs => &IQ3XXS_LEVELS,
        GgmlType::Iq3S => &IQ3S_LEVELS,
        GgmlType::Tq1_0 | GgmlType::Tq2_0 => &TERNARY_LEVELS,
        _ => unreachable!("{ty} is not a codebook type"),
    }
}

/// One block in the kernels' terms: element `e` is `(d · sc[e / 16]) · levels[idx[e]]`.
pub struct Decoded {
    pub idx: [u8; QK_K],
    pub sc: [u8; 16],
    pub d: f32,
}

/// The 7-bit sign code `c` as 8 sign bits (bit 7 makes the parity even).
#[inline]
fn ksigns(c: u32) -> u8 {
    let c = (c & 0x7F) as u8;
    c | (((c.count_ones() & 1) as u8) << 7)
}

#[inline]
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

#[inline]
fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// Writes the 8 elements of a 2-bit grid entry with sign byte `signs` (IQ2) at `out`.
fn put_iq2(out: &mut [u8], entry: u16, signs: u8) {
    for (j, o) in out[..8].iter_mut().enumerate() {
        let mag = ((entry >> (2 * j)) & 3) as u8;
        *o = mag | (((signs >> j) & 1) << 2);
    }
}

/// Writes the 4 elements of a 3-bit grid entry with sign bits `signs` (bits 0..4) at `out`.
fn put_iq3(out: &mut [u8], entry: u16, signs: u8) {
    for (j, o) in out[..4].iter_mut().enumerate() {
        let mag = ((entry >> (3 * j)) & 7) as u8;
        *o = mag | (((signs >> j) & 1) << 3);
    }
}

/// Writes the 8 elements of an IQ1 grid entry with shift sign `neg` at `out`.
fn put_iq1(out: &mut [u8], entry: u16, neg: bool) {
    for (j, o) in out[..8].iter_mut().enumerate() {
        *o = ((entry >> (2 * j)) & 3) as u8 | (u8::from(neg) << 2);
    }
}

/// Decodes one block of `ty` (`ty.block_bytes()` bytes).
pub fn decode(ty: GgmlType, b: &[u8]) -> Decoded {
    let mut out = Decoded { idx: [0; QK_K], sc: [1; 16], d: 0.0 };
    match ty {
        GgmlType::Iq2Xxs | GgmlType::Iq2Xs | GgmlType::Iq2S => decode_iq2(ty, b, &mut out),
        GgmlType::Iq3Xxs | GgmlType::Iq3S => decode_iq3(ty, b, &mut out),
        GgmlType::Iq1S | GgmlType::Iq1M => decode_iq1(ty, b, &mut out),
        GgmlType::Tq1_0 | GgmlType::Tq2_0 => decode_ternary(ty, b, &mut out),
        _ => unreachable!("{ty} is not a codebook type"),
    }
    out
}

/// A 4-bit scale `ls` as the integer factor `2·ls + 1`.
#[inline]
fn odd(ls: u32) -> u8 {
    (2 * (ls & 0xF) + 1) as u8
}

fn decode_iq2(ty: GgmlType, b: &[u8], out: &mut Decoded) {
    // d·(0.5 + ls)·0.25 = (d / 8)·(2·ls + 1)
    out.d = f16_at(b) * 0.125;
    match ty {
        GgmlType::Iq2Xxs => {
            for s in 0..8 {
                let (grid, aux) = (u32_at(b, 2 + 8 * s), u32_at(b, 6 + 8 * s));
                out.sc[2 * s] = odd(aux >> 28);
                out.sc[2 * s + 1] = out.sc[2 * s];
                for l in 0..4 {
                    let entry = IQ2XXS_GRID[((grid >> (8 * l)) & 0xFF) as usize];
                    put_iq2(&mut out.idx[32 * s + 8 * l..], entry, ksigns(aux >> (7 * l)));
                }
            }
        }
        GgmlType::Iq2Xs => {
            for g in 0..32 {
                let q = u16_at(b, 2 + 2 * g);
                let entry = IQ2XS_GRID[usize::from(q & 511)];
                put_iq2(&mut out.idx[8 * g..], entry, ksigns(u32::from(q >> 9)));
            }
            for s in 0..16 {
                out.sc[s] = odd(u32::from(b[66 + s / 2] >> (4 * (s % 2))));
            }
        }
        _ => {
            for g in 0..32 {
                let hi = (usize::from(b[66 + g / 4]) >> (2 * (g % 4))) & 3;
                let entry = IQ2S_GRID[usize::from(b[2 + g]) | (hi << 8)];
                put_iq2(&mut out.idx[8 * g..], entry, b[34 + g]);
            }
            for s in 0..16 {
                out.sc[s] = odd(u32::from(b[74 + s / 2] >> (4 * (s % 2))));
            }
        }
    }
}

fn decode_iq3(ty: GgmlType, b: &[u8], out: &mut Decoded) {
    if ty == GgmlType::Iq3Xxs {
        // d·(0.5 + ls)·0.5 = (d / 4)·(2·ls + 1)
        out.d = f16_at(b) * 0.25;
        for s in 0..8 {
            let aux = u32_at(b, 66 + 4 * s);
            out.sc[2 * s] = odd(aux >> 28);
            out.sc[2 * s + 1] = out.sc[2 * s];
            for l in 0..4 {
                let signs = ksigns(aux >> (7 * l));
                for h in 0..2 {
                    let entry = IQ3XXS_GRID[usize::from(b[2 + 8 * s + 2 * l + h])];
                    put_iq3(&mut out.idx[32 * s + 8 * l + 4 * h..], entry, signs >> (4 * h));
                }
            }
        }
    } else {
        out.d = f16_at(b);
        for i in 0..64 {
            let hi = (usize::from(b[66 + i / 8]) >> (i % 8)) & 1;
            let entry = IQ3S_GRID[usize::from(b[2 + i]) | (hi << 8)];
            put_iq3(&mut out.idx[4 * i..], entry, b[74 + i / 2] >> (4 * (i % 2)));
        }
        for s in 0..16 {
            out.sc[s] = odd(u32::from(b[106 + s / 4] >> (4 * ((s / 2) % 2))));
        }
    }
}

fn decode_iq1(ty: GgmlType, b: &[u8], out: &mut Decoded) {
    if ty == GgmlType::Iq1S {
        out.d = f16_at(b) * 0.125;
        for s in 0..8 {
            let qh = u16_at(b, 34 + 2 * s);
            out.sc[2 * s] = odd(u32::from((qh >> 12) & 7));
            out.sc[2 * s + 1] = out.sc[2 * s];
            for g in 0..4 {
                let hi = usize::from((qh >> (3 * g)) & 7);
                let entry = IQ1S_GRID[usize::from(b[2 + 4 * s + g]) | (hi << 8)];
                put_iq1(&mut out.idx[32 * s + 8 * g..], entry, qh & 0x8000 != 0);
            }
        }
    } else {
        let sc: [u16; 4] = std::array::from_fn(|i| u16_at(b, 48 + 2 * i));
        let bits =
            (sc[0] >> 12) | ((sc[1] >> 8) & 0xF0) | ((sc[2] >> 4) & 0xF00) | (sc[3] & 0xF000);
        out.d = half::f16::from_bits(bits).to_f32() * 0.125;
        for g in 0..32 {
            let nib = (usize::from(b[32 + g / 2]) >> (4 * (g % 2))) & 0xF;
            let entry = IQ1S_GRID[usize::from(b[g]) | ((nib & 7) << 8)];
            put_iq1(&mut out.idx[8 * g..], entry, nib & 8 != 0);
        }
        for s in 0..16 {
            out.sc[s] = odd(u32::from((sc[s / 4] >> (3 * (s % 4))) & 7));
        }
    }
}

fn decode_ternary(ty: GgmlType, b: &[u8], out: &mut Decoded) {
    let idx = &mut out.idx;
    if ty == GgmlType::Tq1_0 {
        out.d = f16_at(&b[52..]);
        let digit = |q: u8, n: u32| ((u16::from(q.wrapping_mul(3u8.pow(n))) * 3) >> 8) as u8;
        for n in 0..5 {
            for m in 0..32 {
                idx[32 * n + m] = digit(b[m], n as u32);
            }
            for m in 0..16 {
                idx[160 + 16 * n + m] = digit(b[32 + m], n as u32);
            }
        }
        for n in 0..4 {
            for m in 0..4 {
                idx[240 + 4 * n + m] = digit(b[48 + m], n as u32);
            }
        }
    } else {
        out.d = f16_at(&b[64..]);
        for (e, q) in idx.iter_mut().enumerate() {
            let (h, j, l) = (e / 128, (e % 128) / 32, e % 32);
            *q = (b[32 * h + l] >> (2 * j)) & 3;
        }
    }
}

/// Dequantizes one block: `(d · sc) · level`, every product exact.
pub fn dequant_block(ty: GgmlType, b: &[u8], o: &mut [f32]) {
    let dec = decode(ty, b);
    let lv = levels(ty);
    for (e, o) in o.iter_mut().enumerate().take(QK_K) {
        let dl = dec.d * f32::from(dec.sc[e / 16]);
        *o = dl * f32::from(lv[usize::from(dec.idx[e])]);
    }
}
