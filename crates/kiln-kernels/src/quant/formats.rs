//! Block-format helpers of the quantized kernels; the types themselves ([`GgmlType`]) and their
//! block geometry are part of the backend contract (`kiln_backend::GgmlType`).

pub use kiln_backend::ggml_type::{GgmlType, QK, QK_K};

/// Reads the little-endian f16 at `b[0..2]` as f32.
#[inline]
pub(crate) fn f16_at(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Unpacks the 6-bit scale and min of sub-block `j` (0..8) from a K-quant `scales[12]`.
#[inline]
pub(crate) fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}
