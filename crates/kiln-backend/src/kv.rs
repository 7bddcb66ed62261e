//! The KV cache contract: what a model needs per token ([`KvLayout`]), the element type
//! ([`KvCacheDtype`]) and the geometry of a whole cache ([`KvCacheSpec`]).
//!
//! Every backend stores, per layer, K and V as `[num_blocks, block_size, num_kv_heads,
//! head_dim]` in the cache's element type; slot `s = block * block_size + offset` is row `s` of
//! `[num_blocks * block_size, num_kv_heads * head_dim]`. A layout whose values are read from the keys
//! ([`KvLayout::values_from_keys`], latent attention) stores K alone: no V buffer, no V scales. Which blocks belong to which sequence
//! is the engine's business. An f16 cache halves the memory and the bytes attention reads;
//! values are rounded to f16 (nearest even) when written and widened exactly when read, so
//! results depend on the dtype but never on batching, chunking or caching.
//!
//! The 8-bit dtypes ([`KvCacheDtype::is_8bit`]) store one byte per element plus f32 scales,
//! K and V each: per layer, codes `[num_blocks, block_size, num_kv_heads, head_dim]` and scales
//! `[num_blocks, block_size, num_kv_heads, head_dim / scale_group]`
//! ([`KvCacheDtype::scale_group`]). A (token, KV head) row is quantized alone when written, so
//! it never depends on other rows: batching, chunking and caching still change nothing.
//! - `int8` first rotates a row whose `head_dim` is a power of two by the (unnormalized)
//!   Walsh-Hadamard transform, which spreads outlier channels over the whole row
//!   ([`KvCacheDtype::rotates`]); attention rotates the queries alike and its output back, exact
//!   in real arithmetic since `H·H = head_dim·I`. Then each group of 64 elements gets
//!   `scale = max|x| / 127` and codes `round(x / scale)`, ties to even.
//! - `fp8_e4m3` / `fp8_e5m2` keep rows as they are, one scale per row (`max|x| / largest
//!   finite value`), each element rounded to the nearest code, ties to even, saturating.
//!
//! The value a kernel reads is `code_value × scale`, one IEEE f32 multiplication of two exact
//! operands, the same on every backend and ISA.

/// The per-token KV shape a model needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Whether attention reads each key row as its value row too, so the cache stores K alone
    /// (multi-head latent attention: a token's compressed latent and RoPE key are one row, and
    /// the latent is also what the values are made of). Attention's output rows are then
    /// `head_dim` wide, and their leading elements are the values' part.
    pub values_from_keys: bool,
}

impl KvLayout {
    /// Keys and values in separate caches: the layout of every attention but latent.
    pub fn new(num_layers: usize, num_kv_heads: usize, head_dim: usize) -> Self {
        Self { num_layers, num_kv_heads, head_dim, values_from_keys: false }
    }

    /// How many caches a layer keeps: 2 (K and V), or 1 when values are read from the keys.
    pub fn caches(&self) -> usize {
        if self.values_from_keys { 1 } else { 2 }
    }

    /// Bytes of K and V for one token across all layers (8-bit dtypes: with their scales).
    pub fn bytes_per_token(&self, dtype: KvCacheDtype) -> usize {
        let row = self.head_dim * dtype.bytes() + 4 * dtype.scales_per_row(self.head_dim);
        self.caches() * self.num_layers * self.num_kv_heads * row
    }
}

/// Elements per `int8` scale (see [`KvCacheDtype::scale_group`]).
pub const INT8_GROUP: usize = 64;

/// Element type of the KV cache. f16 is the default everywhere (library and CLI): half the
/// memory and bandwidth of f32, and the same results as an f32 cache holding rounded values.
/// The 8-bit types halve f16's bytes again, with a scale per (token, KV head) row.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvCacheDtype {
    F32,
    #[default]
    F16,
    /// Signed 8-bit integers, codes -127..=127, after a Hadamard rotation, a scale per 64.
    Int8,
    /// OCP FP8 E4M3 (4 exponent bits, bias 7, 3 mantissa bits; no infinities; largest 448).
    Fp8E4M3,
    /// OCP FP8 E5M2 (5 exponent bits, bias 15, 2 mantissa bits; largest finite 57344).
    Fp8E5M2,
}

impl KvCacheDtype {
    /// Every dtype, in the order the CLI lists them.
    pub const ALL: [Self; 5] = [Self::F32, Self::F16, Self::Int8, Self::Fp8E4M3, Self::Fp8E5M2];

    /// Bytes of one stored element (scales not included).
    pub fn bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 => 2,
            Self::Int8 | Self::Fp8E4M3 | Self::Fp8E5M2 => 1,
        }
    }

    /// Whether elements are 8-bit codes with a scale per (token, KV head) row.
    pub fn is_8bit(self) -> bool {
        self.bytes() == 1
    }

    /// Elements that share one f32 scale in a row of `head_dim` (8-bit types): `int8` groups
    /// of 64 where `head_dim` is a multiple of 64, else the whole row.
    pub fn scale_group(self, head_dim: usize) -> usize {
        match self {
            Self::Int8 if head_dim.is_multiple_of(INT8_GROUP) => INT8_GROUP,
            _ => head_dim,
        }
    }

    /// f32 scales per (token, KV head) row of `head_dim` elements: 0 for f32 and f16.
    pub fn scales_per_row(self, head_dim: usize) -> usize {
        if self.is_8bit() { head_dim / self.scale_group(head_dim).max(1) } else { 0 }
    }

    /// Whether rows are Walsh-Hadamard rotated before quantization: `int8` with a power-of-two
    /// `head_dim`.
    pub fn rotates(self, head_dim: usize) -> bool {
        self == Self::Int8 && head_dim.is_power_of_two() && head_dim > 1
    }

    /// kiln's name (`--kv-cache-dtype`); vLLM's `fp8` is accepted for `fp8_e4m3`.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Int8 => "int8",
            Self::Fp8E4M3 => "fp8_e4m3",
            Self::Fp8E5M2 => "fp8_e5m2",
        }
    }
}

impl std::str::FromStr for KvCacheDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fp8" => return Ok(Self::Fp8E4M3),
            "int8" | "i8" => return Ok(Self::Int8),
            _ => {}
        }
        Self::ALL.into_iter().find(|d| d.name() == s).ok_or_else(|| {
            format!("`{s}` is not a KV cache dtype (f32, f16, int8, fp8 = fp8_e4m3, fp8_e5m2)")
        })
    }
}

/// The geometry of a whole cache: what a backend allocates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheSpec {
    pub layout: KvLayout,
    pub dtype: KvCacheDtype,
    pub num_blocks: usize,
    /// Tokens per block: a power of two up to [`MAX_BLOCK_SIZE`] ([`check_block_size`]).
    pub block_size: usize,
}

impl KvCacheSpec {
    /// Bytes of one block across all layers, K and V.
    pub fn bytes_per_block(&self) -> usize {
        self.layout.bytes_per_token(self.dtype) * self.block_size
    }

    /// Elements of one layer's V buffer: [`KvCacheSpec::layer_elems`], or none when values are
    /// read from the keys.
    pub fn value_elems(&self) -> usize {
        if self.layout.values_from_keys { 0 } else { self.layer_elems() }
    }

    /// Elements of one layer's K (or V) buffer.
    pub fn layer_elems(&self) -> usize {
        self.layer_rows() * self.layout.head_dim
    }

    /// (token, KV head) rows of one layer's K (or V) buffer.
    pub fn layer_rows(&self) -> usize {
        self.num_blocks * self.block_size * self.layout.num_kv_heads
    }

    /// Scales of one layer's K (or V) buffer (8-bit dtypes; 0 otherwise).
    pub fn layer_scales(&self) -> usize {
        self.layer_rows() * self.dtype.scales_per_row(self.layout.head_dim)
    }
}

/// Largest KV block size any backend supports.
pub const MAX_BLOCK_SIZE: usize = 256;

/// The one block-size rule: a power of two from 1 to [`MAX_BLOCK_SIZE`] tokens.
pub fn check_block_size(block_size: usize) -> Result<(), String> {
    if block_size.is_power_of_two() && block_size <= MAX_BLOCK_SIZE {
        Ok(())
    } else {
        Err(format!("must be a power of two up to {MAX_BLOCK_SIZE}, got {block_size}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_8bit_rows_count_their_scales() {
        for dtype in KvCacheDtype::ALL {
            assert_eq!(dtype.name().parse::<KvCacheDtype>(), Ok(dtype));
        }
        assert_eq!("fp8".parse::<KvCacheDtype>(), Ok(KvCacheDtype::Fp8E4M3));
        assert!("fp4".parse::<KvCacheDtype>().is_err());
        let layout = KvLayout::new(2, 3, 256);
        assert_eq!(layout.bytes_per_token(KvCacheDtype::F16), 2 * 2 * 3 * 512);
        let latent = KvLayout { values_from_keys: true, ..layout };
        assert_eq!(latent.bytes_per_token(KvCacheDtype::F16), 2 * 3 * 512);
        assert_eq!(layout.bytes_per_token(KvCacheDtype::Int8), 2 * 2 * 3 * (256 + 4 * 4));
        assert_eq!(layout.bytes_per_token(KvCacheDtype::Fp8E4M3), 2 * 2 * 3 * (256 + 4));
        assert_eq!(KvCacheDtype::Int8.scales_per_row(40), 1);
        assert!(KvCacheDtype::Int8.rotates(128) && !KvCacheDtype::Int8.rotates(40));
        assert!(!KvCacheDtype::Fp8E4M3.rotates(128));
    }
}
