//! Helpers of the GPU tests: the device (one per test binary), seeded random data, relative
//! errors, and moving buffers between either backend and the host.
//!
//! Every GPU test is `#[ignore]`d: CI machines have no GPU. `scripts/gpu/check.sh` runs them
//! with `--ignored` on a machine that has one.

#![allow(dead_code, clippy::unwrap_used)] // each test binary uses a different subset

use std::sync::{Arc, OnceLock};

use kiln_backend::Backend;
use kiln_cuda::{Cuda, CudaBuffer};
use kiln_kernels::Reference;

/// The GPU of `KILN_CUDA_DEVICE` (an ordinal, default 0), opened once.
pub fn cuda() -> Arc<Cuda> {
    static CUDA: OnceLock<Arc<Cuda>> = OnceLock::new();
    CUDA.get_or_init(|| {
        let ordinal = std::env::var("KILN_CUDA_DEVICE").map_or(0, |s| s.parse().unwrap());
        let cache = kiln_cuda::kernels::kernel_cache_dir(
            std::env::var_os(kiln_cuda::kernels::CACHE_ENV),
            std::env::var_os("XDG_CACHE_HOME"),
            std::env::var_os("HOME"),
        );
        let cuda =
            Cuda::new(ordinal, cache.as_deref()).unwrap_or_else(|e| panic!("no CUDA device: {e}"));
        eprintln!("device: {}", cuda.describe());
        Arc::new(cuda)
    })
    .clone()
}

/// A small deterministic generator (xorshift64*), uniform in [-1, 1).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
        bits as f32 / (1u64 << 23) as f32 - 1.0
    }

    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_f32()).collect()
    }

    pub fn below(&mut self, n: u32) -> u32 {
        ((self.next_f32() + 1.0) * 0.5 * n as f32) as u32 % n
    }
}

/// `‖got − want‖₂ / ‖want‖₂` (NaN anywhere gives infinity).
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(want) {
        if !g.is_finite() {
            return f64::INFINITY;
        }
        num += f64::from(g - w).powi(2);
        den += f64::from(*w).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

pub fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
        .0 as u32
}

/// Host access to a backend's buffers.
pub trait HostIo: Backend {
    fn put(&self, data: &[f32]) -> Self::Buffer;
    fn get(&self, buf: &Self::Buffer, len: usize) -> Vec<f32>;
}

impl HostIo for Reference {
    fn put(&self, data: &[f32]) -> Vec<f32> {
        data.to_vec()
    }

    fn get(&self, buf: &Vec<f32>, len: usize) -> Vec<f32> {
        buf[..len].to_vec()
    }
}

impl HostIo for Cuda {
    fn put(&self, data: &[f32]) -> CudaBuffer {
        self.buffer_from(data)
    }

    fn get(&self, buf: &CudaBuffer, len: usize) -> Vec<f32> {
        self.buffer_to_vec(buf, len)
    }
}
