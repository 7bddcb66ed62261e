//! `--device`, `--gpu-memory-utilization` and `--enforce-eager`: which backend runs the model,
//! and on a GPU how much of its memory kiln takes and whether steps replay CUDA graphs.
//!
//! On a GPU, vLLM's semantics: kiln may use `--gpu-memory-utilization` of the device's total
//! memory. The weights are loaded, one engine step of `--max-num-batched-tokens` tokens over
//! `--max-num-seqs` sequences is run to measure the activation peak (buffers, GEMM and
//! attention scratch, the logits), and the KV cache gets what is left of the budget. A model
//! that does not fit is an error naming the three numbers.

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    /// An NVIDIA GPU by ordinal (builds with the `cuda` feature).
    Cuda(usize),
}

/// clap's parser: `cpu`, `cuda`, `cuda:N`.
pub fn parse_device(text: &str) -> Result<Device, String> {
    if text == "cpu" {
        return Ok(Device::Cpu);
    }
    if let Some(ordinal) = cuda_ordinal(text) {
        return Ok(Device::Cuda(ordinal));
    }
    Err(format!("`{text}` is not a device: cpu, cuda or cuda:N"))
}

/// The GPU ordinal of `cuda` / `cuda:N`.
fn cuda_ordinal(text: &str) -> Option<usize> {
    match text.strip_prefix("cuda")? {
        "" => Some(0),
        rest => rest.strip_prefix(':')?.parse().ok(),
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct DeviceArgs {
    /// Where the model runs: cpu, or an NVIDIA GPU as cuda / cuda:N (needs a kiln built with
    /// `--features cuda`; weights in bf16, see docs/CUDA.md).
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: Device,
    /// With --device cuda: the fraction (0, 1] of the GPU's memory kiln may use for weights,
    /// activations and the KV cache, which gets the rest (vLLM's semantics) [default: 0.9].
    /// On the CPU it is accepted with a warning (see --memory-utilization).
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    /// With --device cuda: run every step eagerly, without CUDA graphs (vLLM's flag; by
    /// default decode steps are replayed from graphs). The CPU always runs eagerly.
    #[arg(long)]
    pub enforce_eager: bool,
}

impl Default for DeviceArgs {
    fn default() -> Self {
        Self { device: Device::Cpu, gpu_memory_utilization: None, enforce_eager: false }
    }
}

/// The default of `--gpu-memory-utilization`, as vLLM's.
pub const DEFAULT_GPU_MEMORY_UTILIZATION: f64 = 0.9;

impl DeviceArgs {
    /// The utilization to apply on a GPU, checked.
    pub fn gpu_utilization(&self) -> anyhow::Result<f64> {
        let u = self.gpu_memory_utilization.unwrap_or(DEFAULT_GPU_MEMORY_UTILIZATION);
        anyhow::ensure!(u > 0.0 && u <= 1.0, "--gpu-memory-utilization must be in (0, 1], got {u}");
        Ok(u)
    }

    /// Warns about GPU-only flags on the CPU.
    pub fn warn_on_cpu(&self) {
        if self.device == Device::Cpu && self.gpu_memory_utilization.is_some() {
            tracing::warn!(
                "--gpu-memory-utilization is ignored on the CPU (--device cpu): size the KV cache \
                 with --kv-cache-memory-bytes or --memory-utilization"
            );
        }
        if self.device == Device::Cpu && self.enforce_eager {
            tracing::warn!("--enforce-eager changes nothing on the CPU: it always runs eagerly");
        }
    }
}

#[cfg(feature = "cuda")]
pub mod cuda {
    //! Loading onto the CUDA backend and sizing its KV cache.

    use std::path::Path;
    use std::sync::Arc;

    use anyhow::Context;
    use kiln_cuda::Cuda;
    use kiln_models::{
        Backend, ForwardBatch, KvCacheDtype, KvCacheSpec, LoadedModel, Logits, LogitsWanted,
        Workspace,
    };

    use crate::model_arg::ModelArgs;

    /// Host threads for sampling on a GPU when `--threads` is 0.
    const SAMPLING_THREADS: usize = 4;

    /// The engine's host pool beside a GPU: `threads` scoped workers (`--threads`; 0: a few,
    /// since they only sample and idle ones must not take cores from the server).
    pub fn host_pool(threads: usize) -> kiln_engine::HostPool {
        let threads = if threads == 0 { SAMPLING_THREADS } else { threads };
        kiln_engine::HostPool::new(Arc::new(kiln_models::HostThreads::new(threads)))
    }

    /// What one profiled step needs to know.
    pub struct ProfileShape {
        pub max_num_batched_tokens: usize,
        pub max_num_seqs: usize,
        pub block_size: usize,
        pub kv_cache_dtype: KvCacheDtype,
    }

    /// The model on GPU `ordinal`, and the bytes its KV cache may take.
    pub fn load(
        model: &ModelArgs,
        path: &Path,
        ordinal: usize,
        utilization: f64,
        enforce_eager: bool,
        shape: &ProfileShape,
    ) -> anyhow::Result<(LoadedModel<Cuda>, u64)> {
        // The environment is read here, at the edge; the backend takes the folder.
        let cache = kiln_cuda::kernels::kernel_cache_dir(
            std::env::var_os(kiln_cuda::kernels::CACHE_ENV),
            std::env::var_os("XDG_CACHE_HOME"),
            std::env::var_os("HOME"),
        );
        let cuda = Cuda::new(ordinal, cache.as_deref());
        let cuda = Arc::new(cuda.map_err(|e| anyhow::anyhow!(e))?);
        let (_, total) = cuda.device().mem_info().map_err(|e| anyhow::anyhow!(e))?;
        tracing::info!("CUDA backend: {}, {:.1} GiB", cuda.describe(), gib(total));
        cuda.set_graphs(!enforce_eager);
        if enforce_eager {
            tracing::info!("CUDA graphs: off (--enforce-eager), every step runs eagerly");
        } else {
            tracing::info!(
                "CUDA graphs: decode steps of up to {} tokens are captured the second time \
                 their shape is seen and replayed after (--enforce-eager turns this off)",
                kiln_cuda::graphs::MAX_GRAPH_TOKENS
            );
        }
        let loaded = model.load_path_on(path, &cuda)?;
        let (free, _) = cuda.device().mem_info().map_err(|e| anyhow::anyhow!(e))?;
        let peak = profile_step(&loaded, &cuda, shape).context("profiling one engine step")?;
        let used = total.saturating_sub(free);
        let budget = (total as f64 * utilization) as u64;
        let kv =
            budget.checked_sub(used as u64 + peak).filter(|&kv| kv > 0).with_context(|| {
                format!(
                    "the model does not fit: weights and context take {:.2} GiB and one step's \
                 activations {:.2} GiB, over --gpu-memory-utilization {utilization} of {:.1} GiB; \
                 raise it, or lower --max-num-batched-tokens",
                    gib(used),
                    gib(peak as usize),
                    gib(total)
                )
            })?;
        tracing::info!(
            "GPU memory: {:.2} GiB used after loading, {:.2} GiB activation peak, {:.2} GiB for \
             the KV cache (--gpu-memory-utilization {utilization})",
            gib(used),
            gib(peak as usize),
            gib(kv as usize)
        );
        Ok((loaded, kv))
    }

    fn gib(bytes: usize) -> f64 {
        bytes as f64 / f64::from(1 << 30)
    }

    /// Device bytes one step of the largest shape allocates on top of its KV cache: the step
    /// runs on a throwaway cache and workspace, and the free memory is read while they live.
    fn profile_step(
        loaded: &LoadedModel<Cuda>,
        cuda: &Arc<Cuda>,
        shape: &ProfileShape,
    ) -> anyhow::Result<u64> {
        let model = &loaded.model;
        let tokens = shape.max_num_batched_tokens.max(1);
        let seqs = shape.max_num_seqs.clamp(1, tokens);
        let bs = shape.block_size;
        let per_seq = tokens.div_ceil(seqs);
        let num_blocks = seqs * per_seq.div_ceil(bs);
        let spec = KvCacheSpec {
            layout: model.kv_layout(),
            dtype: shape.kv_cache_dtype,
            num_blocks,
            block_size: bs,
        };
        let mut kv = cuda.alloc_kv(spec)?;
        let (before, _) = cuda.device().mem_info().map_err(|e| anyhow::anyhow!(e))?;
        let mut batch = ForwardBatch::new(bs);
        let vocab = model.config().vocab_size as u32;
        let mut left = tokens;
        for s in 0..seqs {
            let n = per_seq.min(left);
            if n == 0 {
                break;
            }
            left -= n;
            let ids: Vec<u32> = (0..n as u32).map(|i| (i * 31 + s as u32) % vocab).collect();
            let first = (s * per_seq.div_ceil(bs)) as u32;
            let table: Vec<u32> = (first..first + per_seq.div_ceil(bs) as u32).collect();
            batch.push_seq(&ids, 0, &table, LogitsWanted::Last)?;
        }
        let (mut ws, mut logits) = (Workspace::new(), Logits::default());
        model.forward(&batch, &mut kv, &mut ws, &mut logits)?;
        let (after, _) = cuda.device().mem_info().map_err(|e| anyhow::anyhow!(e))?;
        Ok(before.saturating_sub(after) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse() {
        assert_eq!(parse_device("cpu"), Ok(Device::Cpu));
        assert_eq!(parse_device("cuda"), Ok(Device::Cuda(0)));
        assert_eq!(parse_device("cuda:2"), Ok(Device::Cuda(2)));
        for bad in ["gpu", "cuda:", "cuda:x", "CUDA", ""] {
            assert!(parse_device(bad).is_err(), "{bad}");
        }
        let mut args = DeviceArgs::default();
        assert_eq!(args.gpu_utilization().unwrap(), 0.9);
        args.gpu_memory_utilization = Some(1.5);
        assert!(args.gpu_utilization().unwrap_err().to_string().contains("(0, 1]"));
    }
}
