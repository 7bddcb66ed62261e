//! The CPU backend's KV store: per layer, K and V buffers `[num_blocks, block_size,
//! num_kv_heads, head_dim]` in host memory, f32, f16 or 8-bit elements ([`KvCacheDtype`]); an
//! 8-bit cache also keeps f32 scales `[num_blocks, block_size, num_kv_heads, scales_per_row]`
//! for K and for V ([`crate::kv_quant`]). A layout whose values are read from the keys
//! ([`kiln_backend::KvLayout::values_from_keys`]) has empty V buffers: [`CpuKvStore::layer`]
//! hands its K buffers out as V too, and nothing else ever touches V.
//!
//! Every buffer is allocated zeroed by the allocator (`calloc`: fresh pages from the OS, mapped
//! on first write), never written at start: the cache costs no time to reserve and its resident
//! memory grows with the blocks actually used. All-zero bits are +0.0 in every element type and
//! scale, so an untouched slot reads as zeros.

use half::f16;
use kiln_backend::{KvCacheDtype, KvCacheSpec};

use crate::kv_quant::RowCodec;
use crate::le_bytes::{get_all, put_all};

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
        // V's sizes: none when values are read from the keys.
        let (v_elems, v_scales) =
            if spec.layout.values_from_keys { (0, 0) } else { (elems, scales) };
        let layers = spec.layout.num_layers;
        let store = match RowCodec::new(spec.dtype, spec.layout.head_dim) {
            Some(codec) => {
                let layer = |e, s| (vec![0u8; e], vec![0.0f32; s]);
                Store::Q8 {
                    codec,
                    k: (0..layers).map(|_| layer(elems, scales)).collect(),
                    v: (0..layers).map(|_| layer(v_elems, v_scales)).collect(),
                }
            }
            None if spec.dtype == KvCacheDtype::F32 => Store::F32 {
                k: (0..layers).map(|_| vec![0.0; elems]).collect(),
                v: (0..layers).map(|_| vec![0.0; v_elems]).collect(),
            },
            None => Store::F16 {
                k: (0..layers).map(|_| zeroed_f16(elems)).collect(),
                v: (0..layers).map(|_| zeroed_f16(v_elems)).collect(),
            },
        };
        Self { spec, store }
    }

    pub fn spec(&self) -> KvCacheSpec {
        self.spec
    }

    /// `(k, v)` of `layer`, as attention reads them: `(k, k)` when values are read from the
    /// keys.
    pub fn layer(&self, layer: usize) -> KvLayer<'_> {
        let shared = self.spec.layout.values_from_keys;
        match &self.store {
            Store::F32 { k, v } => {
                KvLayer::F32(&k[layer], if shared { &k[layer] } else { &v[layer] })
            }
            Store::F16 { k, v } => {
                KvLayer::F16(&k[layer], if shared { &k[layer] } else { &v[layer] })
            }
            Store::Q8 { codec, k, v } => {
                let (k, v) = (&k[layer], if shared { &k[layer] } else { &v[layer] });
                KvLayer::Q8(*codec, (&k.0, &k.1), (&v.0, &v.1))
            }
        }
    }

    /// `(k, v)` of `layer`, mutable; `v` is empty when values are read from the keys.
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

impl CpuKvStore {
    /// Bytes of one block over every layer: per layer, K's then V's elements of the block,
    /// then (8-bit) K's then V's scales, little-endian.
    pub fn block_bytes(&self) -> usize {
        // Exactly the spec's bytes per block: elements at their size, scales as f32.
        self.spec.bytes_per_block()
    }

    /// Elements and scales of one block in one layer's K buffers, then in its V buffers
    /// (empty when values are read from the keys).
    fn block_ranges(&self, block: usize) -> [std::ops::Range<usize>; 4] {
        assert!(block < self.spec.num_blocks, "block {block} of {}", self.spec.num_blocks);
        let rows = self.spec.block_size * self.spec.layout.num_kv_heads;
        let elems = rows * self.spec.layout.head_dim;
        let scales = rows * self.spec.dtype.scales_per_row(self.spec.layout.head_dim);
        let (e, s) = (block * elems..(block + 1) * elems, block * scales..(block + 1) * scales);
        if self.spec.layout.values_from_keys {
            [e, s, 0..0, 0..0]
        } else {
            [e.clone(), s.clone(), e, s]
        }
    }

    /// Copies block `block` of every layer into `out` ([`CpuKvStore::block_bytes`] long).
    pub fn read_block(&self, block: usize, out: &mut [u8]) {
        assert_eq!(out.len(), self.block_bytes(), "block buffer size");
        let [e, s, ve, vsr] = self.block_ranges(block);
        let mut out = out;
        for layer in 0..self.spec.layout.num_layers {
            out = match self.layer(layer) {
                KvLayer::F32(k, v) => put_all(&v[ve.clone()], put_all(&k[e.clone()], out)),
                KvLayer::F16(k, v) => put_all(&v[ve.clone()], put_all(&k[e.clone()], out)),
                KvLayer::Q8(_, (kc, ks), (vc, vs)) => {
                    let out = put_all(&vc[ve.clone()], put_all(&kc[e.clone()], out));
                    put_all(&vs[vsr.clone()], put_all(&ks[s.clone()], out))
                }
            };
        }
    }

    /// Overwrites block `block` of every layer with `data`, as [`CpuKvStore::read_block`]
    /// wrote it.
    pub fn write_block(&mut self, block: usize, data: &[u8]) {
        assert_eq!(data.len(), self.block_bytes(), "block buffer size");
        let [e, s, ve, vsr] = self.block_ranges(block);
        let mut data = data;
        for layer in 0..self.spec.layout.num_layers {
            data = match self.layer_mut(layer) {
                KvLayerMut::F32(k, v) => {
                    get_all(&mut v[ve.clone()], get_all(&mut k[e.clone()], data))
                }
                KvLayerMut::F16(k, v) => {
                    get_all(&mut v[ve.clone()], get_all(&mut k[e.clone()], data))
                }
                KvLayerMut::Q8(_, (kc, ks), (vc, vs)) => {
                    let data = get_all(&mut vc[ve.clone()], get_all(&mut kc[e.clone()], data));
                    get_all(&mut vs[vsr.clone()], get_all(&mut ks[s.clone()], data))
                }
            };
        }
    }

    /// Copies the K/V (and scales) of slot `src` to slot `dst` in every layer, for each pair in
    /// order.
    pub fn copy_slots(&mut self, pairs: &[(u32, u32)]) {
        /// Slot `src`'s row to slot `dst`'s (an empty V buffer has none).
        fn copy<T: Copy>(buf: &mut [T], width: usize, src: usize, dst: usize) {
            if !buf.is_empty() {
                buf.copy_within(src * width..(src + 1) * width, dst * width);
            }
        }
        let num_slots = self.spec.num_blocks * self.spec.block_size;
        let row = self.spec.layout.num_kv_heads * self.spec.layout.head_dim;
        let srow = self.spec.layout.num_kv_heads
            * self.spec.dtype.scales_per_row(self.spec.layout.head_dim);
        for &(src, dst) in pairs {
            let (src, dst) = (src as usize, dst as usize);
            assert!(src < num_slots && dst < num_slots, "slot {src} or {dst} of {num_slots}");
            for layer in 0..self.spec.layout.num_layers {
                match self.layer_mut(layer) {
                    KvLayerMut::F32(k, v) => {
                        copy(k, row, src, dst);
                        copy(v, row, src, dst);
                    }
                    KvLayerMut::F16(k, v) => {
                        copy(k, row, src, dst);
                        copy(v, row, src, dst);
                    }
                    KvLayerMut::Q8(_, (kc, ks), (vc, vs)) => {
                        copy(kc, row, src, dst);
                        copy(vc, row, src, dst);
                        copy(ks, srow, src, dst);
                        copy(vs, srow, src, dst);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kiln_backend::KvLayout;

    use super::*;

    #[test]
    fn a_block_read_out_and_written_back_is_the_same_block() {
        let layout = KvLayout::new(2, 2, 64);
        for dtype in KvCacheDtype::ALL {
            let spec = KvCacheSpec { layout, dtype, num_blocks: 3, block_size: 4 };
            let mut kv = CpuKvStore::new(spec);
            assert_eq!(kv.block_bytes(), spec.bytes_per_block(), "{dtype:?}");
            let pattern: Vec<u8> = (0..kv.block_bytes()).map(|i| (i * 7 % 251) as u8).collect();
            // f16 and f32 patterns may hold NaN bits: they are copied, never computed on.
            kv.write_block(1, &pattern);
            let mut out = vec![0u8; kv.block_bytes()];
            kv.read_block(1, &mut out);
            assert_eq!(out, pattern, "{dtype:?}");
            for other in [0, 2] {
                kv.read_block(other, &mut out);
                assert!(out.iter().all(|&b| b == 0), "{dtype:?}: block {other} was touched");
            }
        }
    }

    #[test]
    fn copied_slots_read_back_as_their_sources() {
        let layout = KvLayout::new(2, 2, 32);
        for dtype in KvCacheDtype::ALL {
            let spec = KvCacheSpec { layout, dtype, num_blocks: 2, block_size: 4 };
            let mut kv = CpuKvStore::new(spec);
            let pattern: Vec<u8> = (0..kv.block_bytes()).map(|i| (i * 13 % 251) as u8).collect();
            kv.write_block(0, &pattern);
            // Slots 1 and 2 of block 0 to slots 5 and 4 (block 1), then slot 5 to slot 7.
            kv.copy_slots(&[(1, 5), (2, 4), (5, 7)]);
            let (mut a, mut b) = (vec![0u8; kv.block_bytes()], vec![0u8; kv.block_bytes()]);
            kv.read_block(0, &mut a);
            kv.read_block(1, &mut b);
            assert_eq!(a, pattern, "{dtype:?}: the sources are unchanged");
            // Block bytes hold per layer K's then V's elements, then (8-bit) K's then V's
            // scales, each `[slots, ...]`; block 1's slots take block 0's slots 2, 1, -, 1.
            let sources = [Some(2), Some(1), None, Some(1)];
            let elems = layout.num_kv_heads * layout.head_dim * dtype.bytes();
            let scales = layout.num_kv_heads * dtype.scales_per_row(layout.head_dim) * 4;
            let parts: &[usize] =
                if dtype.is_8bit() { &[elems, elems, scales, scales] } else { &[elems, elems] };
            let mut want = vec![0u8; pattern.len()];
            let mut at = 0;
            for _ in 0..layout.num_layers {
                for &width in parts {
                    for (dst, src) in sources.iter().enumerate() {
                        if let Some(src) = src {
                            let from = &pattern[at + src * width..][..width];
                            want[at + dst * width..][..width].copy_from_slice(from);
                        }
                    }
                    at += spec.block_size * width;
                }
            }
            assert_eq!(b, want, "{dtype:?}");
        }
    }

    #[test]
    fn every_dtype_allocates_zeros_of_the_spec() {
        let layout = KvLayout::new(2, 3, 8);
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
