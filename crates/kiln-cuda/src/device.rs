//! One GPU: its context, the one stream every operation of the backend is queued on, the
//! cuBLAS handle bound to that stream, and raw device allocations ([`DevMem`]).
//!
//! Invariants:
//! - every kernel, copy and GEMM goes to `stream`, so operations run in call order and a
//!   buffer may be reused as soon as the next operation is queued;
//! - host reads of device memory ([`Device::download`]) synchronize the stream first, so they
//!   see every operation queued before them;
//! - the context is made current on the calling thread before any driver call (the engine
//!   runs steps on its own thread, not the one that loaded the model);
//! - while a step is traced or captured for a graph ([`crate::graphs`]), operations go through
//!   the device's [`Recorder`]; an upload during a capture poisons it instead of running.

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaStream, DriverError, result, sys};

use crate::graphs::{Mode, Recorder};

/// A device failure: the driver, NVRTC or cuBLAS said no.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaError(pub String);

impl std::fmt::Display for CudaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CudaError {}

impl CudaError {
    pub(crate) fn new(what: &str, e: impl std::fmt::Debug) -> Self {
        Self(format!("{what}: {e:?}"))
    }
}

/// Panics with the failed call: operations of the backend cannot return errors (a device that
/// failed mid-step leaves the cache in an unknown state; the process must stop).
pub(crate) fn expect_ok<T, E: std::fmt::Debug>(r: Result<T, E>, what: &str) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("CUDA backend: {what} failed: {e:?}"),
    }
}

/// Runs `f`, turning a panic (cudarc's way of saying a library is missing) into `None`
/// without printing it.
pub(crate) fn quietly<T>(f: impl FnOnce() -> T + std::panic::UnwindSafe) -> Option<T> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = std::panic::catch_unwind(f).ok();
    std::panic::set_hook(hook);
    result
}

/// The GPU the backend runs on.
pub struct Device {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) blas: CudaBlas,
    pub(crate) name: String,
    pub(crate) ordinal: usize,
    /// (major, minor)
    pub(crate) compute_capability: (i32, i32),
    /// cuBLAS's workspace, set once so that no GEMM allocates (a graph capture must not).
    _blas_workspace: DevMem,
    recorder: Mutex<Recorder>,
}

impl Device {
    /// Opens GPU `ordinal`: loads the driver library (a clean error when there is none), makes
    /// a context, a stream and a cuBLAS handle.
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        // cudarc's dynamic loading panics when a library is missing: turn that into an error.
        let ctx = quietly(|| CudaContext::new(ordinal))
            .ok_or_else(|| {
                CudaError(
                    "the CUDA driver library (libcuda.so) could not be loaded: is an NVIDIA \
                     driver installed?"
                        .into(),
                )
            })?
            .map_err(|e| CudaError::new(&format!("opening CUDA device {ordinal}"), e))?;
        let stream = ctx.new_stream().map_err(|e| CudaError::new("creating a stream", e))?;
        let blas = quietly(|| CudaBlas::new(stream.clone()))
            .ok_or_else(|| {
                CudaError(
                    "libcublas could not be loaded: add CUDA's lib64 to LD_LIBRARY_PATH".into(),
                )
            })?
            .map_err(|e| CudaError::new("creating a cuBLAS handle", e))?;
        let name = ctx.name().map_err(|e| CudaError::new("reading the device name", e))?;
        let compute_capability =
            ctx.compute_capability().map_err(|e| CudaError::new("reading the device", e))?;
        ctx.bind_to_thread().map_err(|e| CudaError::new("binding the context", e))?;
        let workspace = alloc_in(&ctx, BLAS_WORKSPACE_BYTES)?;
        // SAFETY: the workspace is a live allocation of that size, kept as long as the handle
        // (both are fields of the device, the workspace dropped after the handle).
        let r = unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                *blas.handle(),
                workspace.ptr as *mut std::ffi::c_void,
                workspace.bytes,
            )
        };
        if r != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(CudaError::new("setting cuBLAS's workspace", r));
        }
        Ok(Self {
            ctx,
            stream,
            blas,
            name,
            ordinal,
            compute_capability,
            _blas_workspace: workspace,
            recorder: Mutex::new(Recorder::new()),
        })
    }

    /// The graph recorder (see [`crate::graphs`]).
    pub(crate) fn recorder(&self) -> MutexGuard<'_, Recorder> {
        self.recorder.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether a graph capture is in progress: then nothing may be allocated, freed or
    /// uploaded, and an operation that would has to [`Recorder::poison`] the capture.
    pub(crate) fn capturing(&self) -> bool {
        self.recorder().mode() == Mode::Capture
    }

    /// Makes the context current on this thread.
    pub(crate) fn bind(&self) {
        expect_ok(self.ctx.bind_to_thread(), "binding the CUDA context");
    }

    pub(crate) fn cu_stream(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }

    /// (free, total) bytes of device memory.
    pub fn mem_info(&self) -> Result<(usize, usize), CudaError> {
        self.bind();
        result::mem_get_info().map_err(|e| CudaError::new("reading free memory", e))
    }

    /// `bytes` of device memory (uninitialized).
    pub(crate) fn alloc(&self, bytes: usize) -> Result<DevMem, CudaError> {
        self.bind();
        alloc_in(&self.ctx, bytes)
    }

    /// [`Device::alloc`] for the operations, which cannot return errors.
    pub(crate) fn alloc_or_panic(&self, bytes: usize) -> DevMem {
        match self.alloc(bytes) {
            Ok(m) => m,
            Err(e) => panic!("CUDA backend: {e}"),
        }
    }

    /// Queues a copy of `src` to device address `dst` (which must hold it).
    pub(crate) fn upload<T: Copy>(&self, dst: u64, src: &[T]) {
        if src.is_empty() {
            return;
        }
        if self.capturing() {
            self.recorder().poison("an upload during a capture");
            return;
        }
        self.bind();
        // SAFETY: the caller's `dst` holds `size_of_val(src)` bytes; the driver stages pageable
        // host memory before returning, so `src` may be dropped after the call.
        let r = unsafe { result::memcpy_htod_async(dst, src, self.cu_stream()) };
        expect_ok(r, "copying to the device");
    }

    /// Copies device address `src` into `dst` once every queued operation is done.
    pub(crate) fn download<T: Copy>(&self, dst: &mut [T], src: u64) {
        if dst.is_empty() {
            return;
        }
        self.bind();
        // SAFETY: `src` holds `size_of_val(dst)` bytes; the stream is synchronized before `dst`
        // is read.
        let r = unsafe { result::memcpy_dtoh_async(dst, src, self.cu_stream()) };
        expect_ok(r, "copying from the device");
        expect_ok(self.stream.synchronize(), "synchronizing the stream");
    }

    /// Queues a device-to-device copy of `bytes`.
    pub(crate) fn copy(&self, dst: u64, src: u64, bytes: usize) {
        if bytes == 0 || !self.recorder().issue(&[3, dst, src, bytes as u64]) {
            return;
        }
        self.bind();
        // SAFETY: both ranges are live allocations of at least `bytes` (the callers' views).
        let r = unsafe { result::memcpy_dtod_async(dst, src, bytes, self.cu_stream()) };
        expect_ok(r, "copying on the device");
    }

    /// Queues zeroing all of `mem`.
    pub(crate) fn zero(&self, mem: &DevMem) {
        if mem.bytes == 0 {
            return;
        }
        self.bind();
        // SAFETY: `mem` is a live allocation of `mem.bytes` bytes.
        let r = unsafe { result::memset_d8_async(mem.ptr, 0, mem.bytes, self.cu_stream()) };
        expect_ok(r, "zeroing device memory");
    }

    /// Waits for every queued operation.
    pub fn synchronize(&self) {
        self.bind();
        expect_ok(self.stream.synchronize(), "synchronizing the stream");
    }
}

/// Bytes of cuBLAS's workspace (NVIDIA's advice for Hopper; older GPUs need less).
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// `bytes` of memory in `ctx`, which is current on this thread.
fn alloc_in(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DevMem, CudaError> {
    if bytes == 0 {
        return Ok(DevMem { ptr: 0, bytes: 0, ctx: ctx.clone() });
    }
    // SAFETY: a plain allocation in the current context; freed once in `DevMem::drop`.
    let ptr = unsafe { result::malloc_sync(bytes) }.map_err(|e| match e {
        DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY) => {
            let free = result::mem_get_info().map_or(0, |(f, _)| f);
            CudaError(format!(
                "out of GPU memory: {} MiB asked, {} MiB free",
                bytes >> 20,
                free >> 20
            ))
        }
        e => CudaError::new("allocating device memory", e),
    })?;
    Ok(DevMem { ptr, bytes, ctx: ctx.clone() })
}

/// A device allocation, freed on drop (after the stream has finished with it).
pub struct DevMem {
    pub(crate) ptr: u64,
    pub(crate) bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: a device address is plain data; every use goes through the one stream of `Device`.
unsafe impl Send for DevMem {}
// SAFETY: as above; shared references only read the address.
unsafe impl Sync for DevMem {}

impl Drop for DevMem {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        if self.ctx.bind_to_thread().is_ok() {
            // Queued kernels may still read this memory: wait for the device first.
            let _ = self.ctx.synchronize();
            // SAFETY: allocated by `malloc_sync` in this context and freed only here.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}
