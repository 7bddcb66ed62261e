//! The KV cache contract: what a model needs per token ([`KvLayout`]), the element type
//! ([`KvCacheDtype`]) and the geometry of a whole cache ([`KvCacheSpec`]).
//!
//! Every backend stores, per layer, K and V as `[num_blocks, block_size, num_kv_heads,
//! head_dim]` in the cache's element type; slot `s = block * block_size + offset` is row `s` of
//! `[num_blocks * block_size, num_kv_heads * head_dim]`. Which blocks belong to which sequence
//! is the engine's business. An f16 cache halves the memory and the bytes attention reads;
//! values are rounded to f16 (nearest even) when written and widened exactly when read, so
//! results depend on the dtype but never on batching, chunking or caching.

/// The per-token KV shape a model needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    /// Bytes of K and V for one token across all layers.
    pub fn bytes_per_token(&self, dtype: KvCacheDtype) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.bytes()
    }
}

/// Element type of the KV cache. f16 is the default everywhere (library and CLI): half the
/// memory and bandwidth of f32, and the same results as an f32 cache holding rounded values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvCacheDtype {
    F32,
    #[default]
    F16,
}

impl KvCacheDtype {
    pub fn bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
        }
    }
}

impl std::str::FromStr for KvCacheDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Self::F32),
            "f16" => Ok(Self::F16),
            _ => Err(format!("`{s}` is not a KV cache dtype (f32 or f16)")),
        }
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

    /// Elements of one layer's K (or V) buffer.
    pub fn layer_elems(&self) -> usize {
        self.num_blocks * self.block_size * self.layout.num_kv_heads * self.layout.head_dim
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
