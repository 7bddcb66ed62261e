//! KV cache storage: per layer, K and V buffers `[num_blocks, block_size, num_kv_heads,
//! head_dim]` in the cache's element type, f32 or f16 ([`KvCacheDtype`]). Slot
//! `s = block * block_size + offset` is row `s` of `[num_blocks * block_size, num_kv_heads *
//! head_dim]`.
//!
//! This is storage only; which blocks belong to which sequence is the engine's business.
//! An f16 cache halves the memory and the bytes attention reads; values are rounded to f16
//! when written and widened exactly when read, so results depend on the dtype but never on
//! batching, chunking or caching.

use half::f16;

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

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvCacheDtype {
    #[default]
    F32,
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

/// Per layer K and V buffers of one element type.
enum Store {
    F32 { k: Vec<Vec<f32>>, v: Vec<Vec<f32>> },
    F16 { k: Vec<Vec<f16>>, v: Vec<Vec<f16>> },
}

/// One layer's `(k, v)` buffers, mutable, in the cache's element type.
pub enum KvLayerMut<'a> {
    F32(&'a mut [f32], &'a mut [f32]),
    F16(&'a mut [f16], &'a mut [f16]),
}

pub struct PagedKvCache {
    layout: KvLayout,
    dtype: KvCacheDtype,
    num_blocks: usize,
    block_size: usize,
    /// Per layer: `[num_blocks, block_size, num_kv_heads, head_dim]`.
    store: Store,
}

impl PagedKvCache {
    /// An f32 cache.
    pub fn new(layout: KvLayout, num_blocks: usize, block_size: usize) -> Self {
        Self::with_dtype(layout, KvCacheDtype::F32, num_blocks, block_size)
    }

    pub fn with_dtype(
        layout: KvLayout,
        dtype: KvCacheDtype,
        num_blocks: usize,
        block_size: usize,
    ) -> Self {
        let per_layer = num_blocks * block_size * layout.num_kv_heads * layout.head_dim;
        let layers = layout.num_layers;
        let store = match dtype {
            KvCacheDtype::F32 => Store::F32 {
                k: (0..layers).map(|_| vec![0.0; per_layer]).collect(),
                v: (0..layers).map(|_| vec![0.0; per_layer]).collect(),
            },
            KvCacheDtype::F16 => Store::F16 {
                k: (0..layers).map(|_| vec![f16::ZERO; per_layer]).collect(),
                v: (0..layers).map(|_| vec![f16::ZERO; per_layer]).collect(),
            },
        };
        Self { layout, dtype, num_blocks, block_size, store }
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    pub fn dtype(&self) -> KvCacheDtype {
        self.dtype
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Bytes of one block across all layers, K and V.
    pub fn bytes_per_block(&self) -> usize {
        self.layout.bytes_per_token(self.dtype) * self.block_size
    }

    /// `(k, v)` of `layer`, mutable.
    pub fn layer_mut(&mut self, layer: usize) -> KvLayerMut<'_> {
        match &mut self.store {
            Store::F32 { k, v } => KvLayerMut::F32(&mut k[layer], &mut v[layer]),
            Store::F16 { k, v } => KvLayerMut::F16(&mut k[layer], &mut v[layer]),
        }
    }
}
