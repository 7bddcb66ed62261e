//! Matrix products through cuBLAS: `out[m, n] = x[m, k] · W[n, k]ᵀ` with x rounded to bf16
//! once per call, bf16 weights, f32 accumulation and an f32 result.
//!
//! cuBLAS is column-major: the row-major `out[m, n]` is the column-major `n × m` matrix
//! `Wᵀᵀ · x` = op(A) · B with A = W seen as column-major `k × n` (transposed) and B = x seen as
//! column-major `k × m`.

use std::ffi::c_void;

use cudarc::cublas::result::gemm_ex;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};

use crate::Cuda;
use crate::device::expect_ok;
use crate::kernels::{Arg, blocks_for, launch};
use crate::memory::{CudaView, CudaWeight};
use crate::scratch::{Scratch, grown};

impl Cuda {
    /// Rounds `x[..len]` to bf16 into scratch; returns its address.
    pub(crate) fn to_bf16(&self, scratch: &mut Scratch, x: CudaView<'_>, len: usize) -> u64 {
        assert!(len <= x.len, "GEMM input: {len} elements from a view of {}", x.len);
        let dst = grown(&self.device, &mut scratch.x_bf16, 2 * len);
        let args = [Arg::Ptr(x.ptr), Arg::Ptr(dst), Arg::U64(len as u64)];
        launch(&self.device, &self.kernels.cast_f32_bf16, (blocks_for(len, 256), 1, 1), 256, &args);
        dst
    }

    /// `out[m, w.rows] = x_bf16[m, w.cols] · wᵀ` (f32 out, overwritten).
    pub(crate) fn gemm(&self, x_bf16: u64, m: usize, w: &CudaWeight, out: u64) {
        let (n, k) = (w.rows, w.cols);
        let words = [2, w.mem.ptr, x_bf16, out, m as u64, n as u64, k as u64];
        if m == 0 || n == 0 || !self.device.recorder().issue(&words) {
            return;
        }
        let dim = |v: usize| i32::try_from(v).unwrap_or_else(|_| panic!("GEMM dimension {v}"));
        let (alpha, beta) = (1.0f32, 0.0f32);
        self.device.bind();
        // SAFETY: `w.mem` holds n * k bf16, `x_bf16` m * k bf16 and `out` m * n f32 (the callers
        // check the views); alpha and beta are host f32 (cuBLAS's default pointer mode), and
        // the handle is bound to the backend's one stream.
        let r = unsafe {
            gemm_ex(
                *self.device.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                dim(n),
                dim(m),
                dim(k),
                (&raw const alpha).cast::<c_void>(),
                w.mem.ptr as *const c_void,
                cudaDataType::CUDA_R_16BF,
                dim(k),
                x_bf16 as *const c_void,
                cudaDataType::CUDA_R_16BF,
                dim(k),
                (&raw const beta).cast::<c_void>(),
                out as *mut c_void,
                cudaDataType::CUDA_R_32F,
                dim(n),
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        expect_ok(r, "cuBLAS GEMM");
    }
}
