//! CPU kernels of kiln.
//!
//! Every kernel has a scalar reference (`*_scalar`) and, where it matters, AVX-512 and AVX2
//! variants chosen once at run time ([`CpuIsa::selected`]: the best the CPU has, or the one
//! `--isa`/`KILN_ISA` forces). Tests compare each SIMD variant
//! with the scalar reference over odd sizes so tails (`n % lanes != 0`) are covered.
//!
//! Activations are `f32` row-major buffers; shapes are stated at every entry point. Weights are
//! [`WeightMatrix`] values in their stored format (f32, f16, bf16, possibly memory-mapped, or
//! GGUF block-quantized types repacked at load time, see [`quant`]).
//! Parallel kernels run on a persistent [`ThreadPool`]; hot paths allocate nothing after their
//! first call (per-thread scratch only grows).

pub mod activation;
pub mod attention;
mod cpu;
mod host_rows;
pub mod huge_pages;
pub mod kv_quant;
mod le_bytes;
pub mod lora;
pub mod matmul;
pub mod norm;
mod prefetch_level;
pub mod probe;
pub mod quant;
mod reference;
pub mod rope;
mod simd;
#[cfg(test)]
mod testing;
mod thread_pool;
pub mod vec_ops;
pub mod vmath;

pub use cpu::{Cpu, CpuKvStore, FloatMatmul, KvLayer, KvLayerMut};
pub use kiln_backend as backend;
pub use kiln_backend::{MappedFile, Storage};
pub use matmul::{
    ExpertJob, LinearJob, QuantizeError, WeightData, WeightMatrix, bf16_dot_supported, linear,
    linear_experts, linear_multi, round_to_bf16,
};
pub use prefetch_level::{PREFETCH_ENV, PrefetchLevel};
pub use quant::{GgmlType, QuantMatrix};
pub use reference::Reference;
pub use simd::{CpuIsa, ISA_ENV, IsaError, SimdLevel};
pub use thread_pool::{SharedMut, ThreadPool};

/// Selects the kernels' path and prefetch level from the values a program without flags read
/// from `KILN_ISA` and `KILN_PREFETCH` (the examples; the CLI has `--isa` and `--prefetch`).
/// `None` or empty leaves a choice to the defaults.
///
/// # Panics
/// On a value that names no path or level, or a path this CPU lacks: a forced setting that
/// silently fell back would make its measurement a lie.
pub fn force_paths(isa: Option<&str>, prefetch: Option<&str>) {
    if let Err(e) = CpuIsa::select_named(isa) {
        panic!("{ISA_ENV}: {e}");
    }
    if let Some(name) = prefetch.map(str::trim).filter(|v| !v.is_empty()) {
        let level = PrefetchLevel::parse(name).unwrap_or_else(|e| panic!("{PREFETCH_ENV}: {e}"));
        level.select().unwrap_or_else(|e| panic!("{PREFETCH_ENV}: {e}"));
    }
}
