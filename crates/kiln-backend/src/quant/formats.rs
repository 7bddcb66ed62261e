//! Block-format helpers of the quant codecs and the backends' own layouts; the types
//! themselves ([`GgmlType`]) and their block geometry are in [`crate::ggml_type`].

pub use crate::ggml_type::{GgmlType, QK, QK_K};

/// Reads the little-endian f16 at `b[0..2]` as f32.
#[inline]
pub fn f16_at(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Unpacks the 6-bit scale and min of sub-block `j` (0..8) from a K-quant `scales[12]`.
#[inline]
pub fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// IQ4_NL / IQ4_XS: the 16 non-linear levels a nibble selects.
pub const IQ4_LEVELS: [i8; 16] =
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// MXFP4: the E2M1 values a nibble selects, doubled (the block scale is halved to match).
pub const MXFP4_LEVELS: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// An MXFP4 block's E8M0 exponent as the f32 `2^(e − 128)` (half the block scale, for the
/// doubled [`MXFP4_LEVELS`]), built from its bits as ggml does (subnormal for `e < 2`).
#[inline]
pub fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { u32::from(e - 1) << 23 };
    f32::from_bits(bits)
}

/// The signed scale `ls − 32` of sub-block `s` (0..8) of an IQ4_XS block `b`.
#[inline]
pub fn iq4_xs_scale(b: &[u8], s: usize) -> i8 {
    let high = u16::from_le_bytes([b[2], b[3]]);
    let low = (b[4 + s / 2] >> (4 * (s % 2))) & 0xF;
    let ls = low | ((((high >> (2 * s)) & 3) as u8) << 4);
    ls.cast_signed() - 32
}

/// The 16 six-bit scales (0..64, before subtracting 32) of a Q3_K block's `scales[12]`: the
/// low nibbles of bytes 0..8 (scales 0..8) then their high nibbles (8..16), with two high bits
/// each from bytes 8..12 (scale `s` takes bits `2·(s / 4)..` of byte `8 + s % 4`).
pub fn scales_q3_k(s: &[u8]) -> [u8; 16] {
    std::array::from_fn(|i| {
        let low = if i < 8 { s[i] & 0xF } else { s[i - 8] >> 4 };
        let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        low | (high << 4)
    })
}

/// Byte offsets of a block's f16 scale fields (`d`, and `dmin` or Q4_1/Q5_1's `m`); none for
/// the float types and MXFP4 (whose scale is an 8-bit exponent at byte 0).
pub fn f16_scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q4_1 | GgmlType::Q5_1 => &[0, 2],
        GgmlType::Q2K => &[80, 82],
        GgmlType::Q3K => &[108],
        GgmlType::Q6K => &[208],
        GgmlType::Q4_0
        | GgmlType::Q5_0
        | GgmlType::Q8_0
        | GgmlType::Iq4Nl
        | GgmlType::Iq4Xs
        | GgmlType::Iq1S
        | GgmlType::Iq2Xxs
        | GgmlType::Iq2Xs
        | GgmlType::Iq2S
        | GgmlType::Iq3Xxs
        | GgmlType::Iq3S => &[0],
        GgmlType::Tq1_0 => &[52],
        GgmlType::Tq2_0 => &[64],
        // IQ1_M spreads its scale over the top nibbles of `sc[4]` ([`set_f16_scale`]).
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 | GgmlType::Mxfp4 | GgmlType::Iq1M => &[],
    }
}

/// Sets every f16 scale field of `block` to `scale` (little-endian bytes): those of
/// [`f16_scale_offsets`], and IQ1_M's, whose four nibbles are the top nibbles of the u16
/// sub-block scales at bytes 48..56. For tests and measurements on made-up blocks.
pub fn set_f16_scale(ty: GgmlType, block: &mut [u8], scale: [u8; 2]) {
    for &at in f16_scale_offsets(ty) {
        block[at..at + 2].copy_from_slice(&scale);
    }
    if ty == GgmlType::Iq1M {
        let bits = u16::from_le_bytes(scale);
        for i in 0..4 {
            let at = 48 + 2 * i;
            let sc = u16::from_le_bytes([block[at], block[at + 1]]);
            let sc = (sc & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12);
            block[at..at + 2].copy_from_slice(&sc.to_le_bytes());
        }
    }
}
