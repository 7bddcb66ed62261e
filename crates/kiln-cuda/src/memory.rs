//! What the CUDA backend keeps on the device: weights (bf16), vectors (f32), rotary
//! frequencies, the paged KV cache (f16 or f32) and activation buffers (f32), plus views of
//! buffer ranges as raw device addresses.
//!
//! Invariants: a view's `ptr .. ptr + 4 * len` lies inside the buffer it was taken from, and
//! the borrow it carries keeps that buffer alive and (for [`CudaViewMut`]) unaliased.

use std::marker::PhantomData;

use kiln_backend::{KvCacheSpec, RopeStyle};

use crate::device::DevMem;

/// A `[rows, cols]` weight matrix in bf16, row-major.
pub struct CudaWeight {
    pub(crate) mem: DevMem,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

/// An f32 vector.
pub struct CudaVector {
    pub(crate) mem: DevMem,
    pub(crate) len: usize,
}

/// Rotary frequencies `[rotary_dim / 2]` and the pairing.
pub struct CudaRope {
    pub(crate) inv_freq: DevMem,
    pub(crate) half: usize,
    pub(crate) style: RopeStyle,
}

/// Per layer, K and V `[num_blocks * block_size, num_kv_heads * head_dim]` of f16 or f32.
pub struct CudaKvStore {
    pub(crate) spec: KvCacheSpec,
    pub(crate) k: Vec<DevMem>,
    pub(crate) v: Vec<DevMem>,
}

impl CudaKvStore {
    /// Bytes of one block of one layer's K (or V).
    pub(crate) fn layer_block_bytes(&self) -> usize {
        let l = self.spec.layout;
        self.spec.block_size * l.num_kv_heads * l.head_dim * self.spec.dtype.bytes()
    }
}

/// A growable f32 activation buffer.
pub struct CudaBuffer {
    pub(crate) mem: DevMem,
    /// Elements it holds.
    pub(crate) len: usize,
}

/// Read access to `len` f32 at device address `ptr`.
#[derive(Clone, Copy, Debug)]
pub struct CudaView<'a> {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    _buf: PhantomData<&'a CudaBuffer>,
}

/// Write access to `len` f32 at device address `ptr`.
#[derive(Debug)]
pub struct CudaViewMut<'a> {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    _buf: PhantomData<&'a mut CudaBuffer>,
}

impl CudaBuffer {
    pub(crate) fn view(&self, range: std::ops::Range<usize>) -> CudaView<'_> {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "view {range:?} of {}",
            self.len
        );
        CudaView { ptr: self.mem.ptr + 4 * range.start as u64, len: range.len(), _buf: PhantomData }
    }

    pub(crate) fn view_mut(&mut self, range: std::ops::Range<usize>) -> CudaViewMut<'_> {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "view {range:?} of {}",
            self.len
        );
        CudaViewMut {
            ptr: self.mem.ptr + 4 * range.start as u64,
            len: range.len(),
            _buf: PhantomData,
        }
    }
}
