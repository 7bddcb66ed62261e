//! KV cache storage: per layer, K and V buffers `[num_blocks, block_size, num_kv_heads,
//! head_dim]` in f32. Slot `s = block * block_size + offset` is row `s` of
//! `[num_blocks * block_size, num_kv_heads * head_dim]`.
//!
//! This is storage only; which blocks belong to which sequence is the engine's business.

/// The per-token KV shape a model needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    /// Bytes of K and V for one token across all layers (f32 elements).
    pub fn bytes_per_token(&self) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * size_of::<f32>()
    }
}

pub struct PagedKvCache {
    layout: KvLayout,
    num_blocks: usize,
    block_size: usize,
    /// Per layer: `[num_blocks, block_size, num_kv_heads, head_dim]`.
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl PagedKvCache {
    pub fn new(layout: KvLayout, num_blocks: usize, block_size: usize) -> Self {
        let per_layer = num_blocks * block_size * layout.num_kv_heads * layout.head_dim;
        Self {
            layout,
            num_blocks,
            block_size,
            k: (0..layout.num_layers).map(|_| vec![0.0; per_layer]).collect(),
            v: (0..layout.num_layers).map(|_| vec![0.0; per_layer]).collect(),
        }
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Bytes of one block across all layers, K and V.
    pub fn bytes_per_block(&self) -> usize {
        self.layout.bytes_per_token() * self.block_size
    }

    /// `(k, v)` of `layer`, mutable.
    pub fn layer_mut(&mut self, layer: usize) -> (&mut [f32], &mut [f32]) {
        (&mut self.k[layer], &mut self.v[layer])
    }
}
