//! GGUF/ggml tensor element types and their block geometry: how the bytes of a loaded tensor
//! ([`crate::HostTensor`]) are to be read.
//!
//! A quantized row of `cols` elements is `cols / block_elems()` consecutive blocks of
//! `block_bytes()` bytes (little endian), in ggml's block layouts (the CPU backend's `dequant`
//! module documents each one).

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;
/// Elements per Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL / MXFP4 block.
pub const QK: usize = 32;

/// The GGUF tensor types kiln reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Iq4Nl,
    Iq4Xs,
    Mxfp4,
    Iq1S,
    Iq1M,
    Iq2Xxs,
    Iq2Xs,
    Iq2S,
    Iq3Xxs,
    Iq3S,
    Tq1_0,
    Tq2_0,
}

// `CODEBOOK` is the tail of `ALL`: checked when compiling.
const _: () = assert!(
    matches!(GgmlType::CODEBOOK, [GgmlType::Iq1S, .., GgmlType::Tq2_0])
        && GgmlType::CODEBOOK.len() == 9
);

impl GgmlType {
    /// Every supported type, for tests and tables.
    pub const ALL: [Self; 25] = [
        Self::F32,
        Self::F16,
        Self::Bf16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q2K,
        Self::Q3K,
        Self::Q4K,
        Self::Q5K,
        Self::Q6K,
        Self::Iq4Nl,
        Self::Iq4Xs,
        Self::Mxfp4,
        Self::Iq1S,
        Self::Iq1M,
        Self::Iq2Xxs,
        Self::Iq2Xs,
        Self::Iq2S,
        Self::Iq3Xxs,
        Self::Iq3S,
        Self::Tq1_0,
        Self::Tq2_0,
    ];
    /// The block-quantized types (every type of [`Self::ALL`] after the three float ones).
    pub const QUANTIZED: &'static [Self] = Self::ALL.split_at(3).1;
    /// The codebook and ternary types: decoded at load into levels and scales
    /// (`crate::quant::iq`); the last nine of [`Self::ALL`], from `Iq1S` on.
    pub const CODEBOOK: &'static [Self] = Self::ALL.split_at(Self::ALL.len() - 9).1;
    /// The types kiln also writes (quantize-on-load and the KV cache); the others are read
    /// from files only.
    pub const WRITABLE: [Self; 9] = [
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

    /// The type for a GGUF `ggml_type` id, `None` for types kiln does not support.
    pub fn from_gguf_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            10 => Self::Q2K,
            11 => Self::Q3K,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            20 => Self::Iq4Nl,
            23 => Self::Iq4Xs,
            30 => Self::Bf16,
            39 => Self::Mxfp4,
            19 => Self::Iq1S,
            29 => Self::Iq1M,
            16 => Self::Iq2Xxs,
            17 => Self::Iq2Xs,
            22 => Self::Iq2S,
            18 => Self::Iq3Xxs,
            21 => Self::Iq3S,
            34 => Self::Tq1_0,
            35 => Self::Tq2_0,
            _ => return None,
        })
    }

    /// The GGUF `ggml_type` id.
    pub fn gguf_id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q2K => 10,
            Self::Q3K => 11,
            Self::Q4K => 12,
            Self::Q5K => 13,
            Self::Q6K => 14,
            Self::Iq4Nl => 20,
            Self::Iq4Xs => 23,
            Self::Bf16 => 30,
            Self::Mxfp4 => 39,
            Self::Iq1S => 19,
            Self::Iq1M => 29,
            Self::Iq2Xxs => 16,
            Self::Iq2Xs => 17,
            Self::Iq2S => 22,
            Self::Iq3Xxs => 18,
            Self::Iq3S => 21,
            Self::Tq1_0 => 34,
            Self::Tq2_0 => 35,
        }
    }

    /// llama.cpp's name ("q4_K").
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
            Self::Q4_0 => "q4_0",
            Self::Q4_1 => "q4_1",
            Self::Q5_0 => "q5_0",
            Self::Q5_1 => "q5_1",
            Self::Q8_0 => "q8_0",
            Self::Q2K => "q2_K",
            Self::Q3K => "q3_K",
            Self::Q4K => "q4_K",
            Self::Q5K => "q5_K",
            Self::Q6K => "q6_K",
            Self::Iq4Nl => "iq4_nl",
            Self::Iq4Xs => "iq4_xs",
            Self::Mxfp4 => "mxfp4",
            Self::Iq1S => "iq1_s",
            Self::Iq1M => "iq1_m",
            Self::Iq2Xxs => "iq2_xxs",
            Self::Iq2Xs => "iq2_xs",
            Self::Iq2S => "iq2_s",
            Self::Iq3Xxs => "iq3_xxs",
            Self::Iq3S => "iq3_s",
            Self::Tq1_0 => "tq1_0",
            Self::Tq2_0 => "tq2_0",
        }
    }

    /// Elements per block (1 for float types).
    pub fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::Bf16 => 1,
            Self::Q4_0
            | Self::Q4_1
            | Self::Q5_0
            | Self::Q5_1
            | Self::Q8_0
            | Self::Iq4Nl
            | Self::Mxfp4 => QK,
            Self::Q2K
            | Self::Q3K
            | Self::Q4K
            | Self::Q5K
            | Self::Q6K
            | Self::Iq4Xs
            | Self::Iq1S
            | Self::Iq1M
            | Self::Iq2Xxs
            | Self::Iq2Xs
            | Self::Iq2S
            | Self::Iq3Xxs
            | Self::Iq3S
            | Self::Tq1_0
            | Self::Tq2_0 => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
            Self::Q4_0 | Self::Iq4Nl => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Mxfp4 => 17,
            Self::Q2K => 84,
            Self::Q3K | Self::Iq3S => 110,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
            Self::Iq4Xs => 136,
            Self::Iq1S => 50,
            Self::Iq1M => 56,
            Self::Iq2Xxs | Self::Tq2_0 => 66,
            Self::Iq2Xs => 74,
            Self::Iq2S => 82,
            Self::Iq3Xxs => 98,
            Self::Tq1_0 => 54,
        }
    }

    /// True for the types of [`Self::CODEBOOK`].
    pub fn is_codebook(self) -> bool {
        Self::CODEBOOK.contains(&self)
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
