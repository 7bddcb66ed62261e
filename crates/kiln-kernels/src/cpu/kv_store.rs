//! The CPU backend's KV store: per layer, K and V buffers `[num_blocks, block_size,
//! num_kv_heads, head_dim]` in host memory, f32 or f16 elements ([`KvCacheDtype`]).

use half::f16;
use kiln_backend::{KvCacheDtype, KvCacheSpec};

/// Per layer K and V buffers of one element type.
enum Store {
    F32 { k: Vec<Vec<f32>>, v: Vec<Vec<f32>> },
    F16 { k: Vec<Vec<f16>>, v: Vec<Vec<f16>> },
}

/// One layer's `(k, v)` buffers in the cache's element type.
pub enum KvLayer<'a> {
    F32(&'a [f32], &'a [f32]),
    F16(&'a [f16], &'a [f16]),
}

/// One layer's `(k, v)` buffers, mutable.
pub enum KvLayerMut<'a> {
    F32(&'a mut [f32], &'a mut [f32]),
    F16(&'a mut [f16], &'a mut [f16]),
}

pub struct CpuKvStore {
    spec: KvCacheSpec,
    store: Store,
}

impl CpuKvStore {
    /// A zeroed cache of `spec`'s geometry.
    pub fn new(spec: KvCacheSpec) -> Self {
        let per_layer = spec.layer_elems();
        let layers = spec.layout.num_layers;
        let store = match spec.dtype {
            KvCacheDtype::F32 => Store::F32 {
                k: (0..layers).map(|_| vec![0.0; per_layer]).collect(),
                v: (0..layers).map(|_| vec![0.0; per_layer]).collect(),
            },
            KvCacheDtype::F16 => Store::F16 {
                k: (0..layers).map(|_| vec![f16::ZERO; per_layer]).collect(),
                v: (0..layers).map(|_| vec![f16::ZERO; per_layer]).collect(),
            },
        };
        Self { spec, store }
    }

    pub fn spec(&self) -> KvCacheSpec {
        self.spec
    }

    /// `(k, v)` of `layer`.
    pub fn layer(&self, layer: usize) -> KvLayer<'_> {
        match &self.store {
            Store::F32 { k, v } => KvLayer::F32(&k[layer], &v[layer]),
            Store::F16 { k, v } => KvLayer::F16(&k[layer], &v[layer]),
        }
    }

    /// `(k, v)` of `layer`, mutable.
    pub fn layer_mut(&mut self, layer: usize) -> KvLayerMut<'_> {
        match &mut self.store {
            Store::F32 { k, v } => KvLayerMut::F32(&mut k[layer], &mut v[layer]),
            Store::F16 { k, v } => KvLayerMut::F16(&mut k[layer], &mut v[layer]),
        }
    }
}
