//! The CPU backend's KV store: per layer, K and V buffers `[num_blocks, block_size,
//! num_kv_heads, head_dim]` in host memory, f32, f16 or 8-bit elements ([`KvCacheDtype`]); an
//! 8-bit cache also keeps f32 scales `[num_blocks, block_size, num_kv_heads, scales_per_row]`
//! for K and for V ([`crate::kv_quant`]).
//!
//! Every buffer is allocated zeroed by the allocator (`calloc`: fresh pages from the OS, mapped
//! on first write), never written at start: the cache costs no time to reserve and its resident
//! memory grows with the blocks actually used. All-zero bits are +0.0 in every element type and
//! scale, so an untouched slot reads as zeros.

use half::f16;
use kiln_backend::{KvCacheDtype, KvCacheSpec};

use crate::kv_quant::RowCodec;

/// Per layer K and V buffers of one element type; 8-bit layers as (codes `[slots,
/// num_kv_heads, head_dim]`, scales `[slots, num_kv_heads, scales_per_row]`).
enum Store {
    F32 { k: Vec<Vec<f32>>, v: Vec<Vec<f32>> },
    F16 { k: Vec<Vec<f16>>, v: Vec<Vec<f16>> },
    Q8 { codec: RowCodec, k: Vec<(Vec<u8>, Vec<f32>)>, v: Vec<(Vec<u8>, Vec<f32>)> },
}

/// One layer's `(k, v)` buffers in the cache's element type.
pub enum KvLayer<'a> {
    F32(&'a [f32], &'a [f32]),
    F16(&'a [f16], &'a [f16]),
    /// Codes and scales of K, then of V.
    Q8(RowCodec, (&'a [u8], &'a [f32]), (&'a [u8], &'a [f32])),
}

/// One layer's `(k, v)` buffers, mutable.
pub enum KvLayerMut<'a> {
    F32(&'a mut [f32], &'a mut [f32]),
    F16(&'a mut [f16], &'a mut [f16]),
    Q8(RowCodec, (&'a mut [u8], &'a mut [f32]), (&'a mut [u8], &'a mut [f32])),
}

pub struct CpuKvStore {
    spec: KvCacheSpec,
    store: Store,
}

/// `n` f16 zeros from a zeroed allocation (no element is written).
fn zeroed_f16(n: usize) -> Vec<f16> {
    // `vec![0u16; n]` asks the allocator for zeroed memory; `vec![f16::ZERO; n]` would write
    // every element.
    let mut v = std::mem::ManuallyDrop::new(vec![0u16; n]);
    let (ptr, len, cap) = (v.as_mut_ptr(), v.len(), v.capacity());
    // SAFETY: `f16` is `repr(transparent)` over `u16` (same size and alignment, so the
    // allocation's layout is unchanged), all-zero bits are a valid f16 (+0.0), and ownership of
    // the allocation moves from the forgotten `Vec<u16>` to the new `Vec<f16>`.
    unsafe { Vec::from_raw_parts(ptr.cast::<f16>(), len, cap) }
}

impl CpuKvStore {
    /// A zeroed cache of `spec`'s geometry.
    pub fn new(spec: KvCacheSpec) -> Self {
        let (elems, scales) = (spec.layer_elems(), spec.layer_scales());
        let layers = spec.layout.num_layers;
        let store = match RowCodec::new(spec.dtype, spec.layout.head_dim) {
            Some(codec) => {
                let layer = || (vec![0u8; elems], vec![0.0f32; scales]);
                Store::Q8 {
                    codec,
                    k: (0..layers).map(|_| layer()).collect(),
                    v: (0..layers).map(|_| layer()).collect(),
                }
            }
            None if spec.dtype == KvCacheDtype::F32 => Store::F32 {
                k: (0..layers).map(|_| vec![0.0; elems]).collect(),
                v: (0..layers).map(|_| vec![0.0; elems]).collect(),
            },
            None => Store::F16 {
                k: (0..layers).map(|_| zeroed_f16(elems)).collect(),
                v: (0..layers).map(|_| zeroed_f16(elems)).collect(),
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
            Store::Q8 { codec, k, v } => {
                let (k, v) = (&k[layer], &v[layer]);
                KvLayer::Q8(*codec, (&k.0, &k.1), (&v.0, &v.1))
            }
        }
    }

    /// `(k, v)` of `layer`, mutable.
    pub fn layer_mut(&mut self, layer: usize) -> KvLayerMut<'_> {
        match &mut self.store {
            Store::F32 { k, v } => KvLayerMut::F32(&mut k[layer], &mut v[layer]),
            Store::F16 { k, v } => KvLayerMut::F16(&mut k[layer], &mut v[layer]),
            Store::Q8 { codec, k, v } => {
                let (k, v) = (&mut k[layer], &mut v[layer]);
                KvLayerMut::Q8(*codec, (&mut k.0, &mut k.1), (&mut v.0, &mut v.1))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kiln_backend::KvLayout;

    use super::*;

    #[test]
    fn every_dtype_allocates_zeros_of_the_spec() {
        let layout = KvLayout { num_layers: 2, num_kv_heads: 3, head_dim: 8 };
        // 8 elements a row: one scale per row for every 8-bit type.
        for dtype in KvCacheDtype::ALL {
            let spec = KvCacheSpec { layout, dtype, num_blocks: 5, block_size: 4 };
            let kv = CpuKvStore::new(spec);
            for layer in 0..2 {
                match kv.layer(layer) {
                    KvLayer::F32(k, v) => {
                        assert_eq!((k.len(), v.len()), (480, 480));
                        assert!(k.iter().chain(v).all(|x| x.to_bits() == 0));
                    }
                    KvLayer::F16(k, v) => {
                        assert_eq!((k.len(), v.len()), (480, 480));
                        assert!(k.iter().chain(v).all(|x| x.to_bits() == 0));
                    }
                    KvLayer::Q8(codec, (kc, ks), (vc, vs)) => {
                        assert_eq!(Some(codec), RowCodec::new(dtype, 8));
                        assert_eq!((kc.len(), vc.len(), ks.len(), vs.len()), (480, 480, 60, 60));
                        assert!(kc.iter().chain(vc).all(|&c| c == 0));
                        assert!(ks.iter().chain(vs).all(|x| x.to_bits() == 0));
                    }
                }
            }
        }
    }
}
