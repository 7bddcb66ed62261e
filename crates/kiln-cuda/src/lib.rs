//! The CUDA backend of kiln: every operation of [`kiln_backend::Backend`] on an NVIDIA GPU.
//!
//! - Libraries are opened at run time (`cudarc`'s dynamic loading): building needs no CUDA
//!   toolkit, and a machine without a GPU fails only when [`Cuda::new`] is called, with an error
//!   that says which library is missing.
//! - Kernels (`kernels.cu`) are compiled by NVRTC for the device at start-up and cached on disk
//!   ([`kernels`]); GEMMs go to cuBLAS (bf16 operands, f32 accumulation and output).
//! - Weights are kept in bf16: float tensors are rounded to it, quantized GGUF tensors are
//!   dequantized on load (so a Q4_K model takes bf16's memory on the GPU); activations are f32
//!   as the seam requires, rounded to bf16 only as the input of a GEMM; the KV cache is f16 or
//!   f32 (the 8-bit dtypes are refused).
//! - Everything is queued on one stream in call order; [`Backend::logits`] synchronizes when
//!   it copies the logits to the host. Decode and verification steps are replayed from CUDA
//!   graphs captured the second time a step of the same shape is seen ([`graphs`]; off with
//!   [`Cuda::set_graphs`]), bit for bit what the eager step computes. A device error inside
//!   an operation panics with the failed call: a step that failed half-way has left the cache
//!   undefined.
//! - Attention: steps with prompt rows take a tiled kernel (16 query rows of a sequence share
//!   each K/V tile staged in shared memory; head dimensions up to 128), decode-only steps a
//!   FlashDecoding-style split-K kernel (each query row's keys cut into splits of 256 or more,
//!   at most 64, that run as separate blocks, merged by a second kernel; head dimensions up to
//!   256).
//! - Row-wise kernels spread a row over many threads or blocks; how a row is split depends only
//!   on its width or key count, never on the batch.
//!
//! Each output row depends only on its own input row and its sequence's cache, but cuBLAS may
//! pick a different algorithm for a different number of rows, so batched == alone is promised
//! within rounding here, not bit for bit as on the CPU backend (on the tiny fixtures it held
//! bit for bit on an H200).

mod backend;
pub mod device;
mod gemm;
pub mod graphs;
pub mod kernels;
mod memory;
mod scratch;

use std::sync::Mutex;

pub use device::{CudaError, Device};
use graphs::GraphCache;
pub use graphs::GraphStats;
use kernels::Kernels;
pub use memory::{
    CudaBuffer, CudaKvStore, CudaRope, CudaVector, CudaView, CudaViewMut, CudaWeight,
};
use scratch::Scratch;

/// The CUDA backend: one device, its kernels and scratch space (no host threads: the engine's
/// host work runs on a [`kiln_backend::HostParallel`] the program pairs with it).
pub struct Cuda {
    device: Device,
    kernels: Kernels,
    scratch: Mutex<Scratch>,
    graphs: Mutex<GraphCache>,
}

impl Cuda {
    /// Opens GPU `ordinal` and loads the kernels, compiled or from `kernel_cache` (a folder,
    /// [`kernels::kernel_cache_dir`]; `None`: compiled at every start).
    pub fn new(ordinal: usize, kernel_cache: Option<&std::path::Path>) -> Result<Self, CudaError> {
        let device = Device::open(ordinal)?;
        let kernels = Kernels::load(&device, kernel_cache)?;
        Ok(Self {
            device,
            kernels,
            scratch: Mutex::new(Scratch::new()),
            graphs: Mutex::new(GraphCache::new()),
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// "NVIDIA H100 80GB HBM3 (cuda:0, sm_90)".
    pub fn describe(&self) -> String {
        let (major, minor) = self.device.compute_capability;
        format!("{} (cuda:{}, sm_{major}{minor})", self.device.name, self.device.ordinal)
    }

    /// A buffer holding `data` (tests and tools; the model path never copies activations).
    pub fn buffer_from(&self, data: &[f32]) -> CudaBuffer {
        let mut buf = kiln_backend::Backend::new_buffer(self);
        kiln_backend::Backend::reserve(self, &mut buf, data.len());
        self.device.upload(buf.mem.ptr, data);
        buf
    }

    /// The first `len` values of `buf`, once every queued operation is done.
    pub fn buffer_to_vec(&self, buf: &CudaBuffer, len: usize) -> Vec<f32> {
        assert!(len <= buf.len, "{len} values of a buffer of {}", buf.len);
        let mut out = vec![0.0; len];
        self.device.download(&mut out, buf.mem.ptr);
        out
    }

    fn scratch(&self) -> std::sync::MutexGuard<'_, Scratch> {
        self.scratch.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn graph_cache(&self) -> std::sync::MutexGuard<'_, GraphCache> {
        self.graphs.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
