//! GGUF/ggml tensor element types and their block geometry: how the bytes of a loaded tensor
//! ([`crate::HostTensor`]) are to be read.
//!
//! A quantized row of `cols` elements is `cols / block_elems()` consecutive blocks of
//! `block_bytes()` bytes (little endian), in ggml's block layouts (the CPU backend's `dequant`
//! module documents each one).

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;
/// Elements per Q4_0 / Q5_0 / Q8_0 block.
pub const QK: usize = 32;

/// The GGUF tensor types kiln reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q5_0,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

impl GgmlType {
    /// Every supported type, for tests and tables.
    pub const ALL: [Self; 9] = [
        Self::F32,
        Self::F16,
        Self::Bf16,
        Self::Q4_0,
        Self::Q5_0,
        Self::Q8_0,
        Self::Q4K,
        Self::Q5K,
        Self::Q6K,
    ];
    /// The block-quantized types.
    pub const QUANTIZED: [Self; 6] =
        [Self::Q4_0, Self::Q5_0, Self::Q8_0, Self::Q4K, Self::Q5K, Self::Q6K];

    /// The type for a GGUF `ggml_type` id, `None` for types kiln does not support.
    pub fn from_gguf_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            6 => Self::Q5_0,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            30 => Self::Bf16,
            _ => return None,
        })
    }

    /// The GGUF `ggml_type` id.
    pub fn gguf_id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q5_0 => 6,
            Self::Q8_0 => 8,
            Self::Q4K => 12,
            Self::Q5K => 13,
            Self::Q6K => 14,
            Self::Bf16 => 30,
        }
    }

    /// llama.cpp's name ("q4_K").
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
            Self::Q4_0 => "q4_0",
            Self::Q5_0 => "q5_0",
            Self::Q8_0 => "q8_0",
            Self::Q4K => "q4_K",
            Self::Q5K => "q5_K",
            Self::Q6K => "q6_K",
        }
    }

    /// Elements per block (1 for float types).
    pub fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::Bf16 => 1,
            Self::Q4_0 | Self::Q5_0 | Self::Q8_0 => QK,
            Self::Q4K | Self::Q5K | Self::Q6K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
            Self::Q4_0 => 18,
            Self::Q5_0 => 22,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }

    /// True for the block-quantized types.
    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Bytes of one row of `cols` elements; `None` unless `cols` is a multiple of
    /// [`Self::block_elems`] (or on overflow).
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        let be = self.block_elems();
        if !cols.is_multiple_of(be) {
            return None;
        }
        (cols / be).checked_mul(self.block_bytes())
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
