//! The kernels of `kernels.cu`: compiled with NVRTC for the device's compute capability the
//! first time a device is opened, cached on disk as PTX (keyed by a hash of the source, the
//! architecture and the NVRTC version), loaded into the context, and launched with raw device
//! addresses.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, Ptx};

use crate::device::{CudaError, Device, expect_ok};

/// The CUDA C source of every kernel.
pub const SOURCE: &str = include_str!("kernels.cu");

/// Largest head dimension the attention kernel takes (`MAX_HEAD_DIM` in the source).
pub const MAX_HEAD_DIM: usize = 256;
/// Threads of a decode attention block, and the keys it scores at once (`DEC_CHUNK`).
pub const DECODE_THREADS: u32 = 256;
/// Most splits of one decode row's keys (`DEC_MAX_SPLITS`).
const DECODE_MAX_SPLITS: usize = 64;
/// Threads of an `attention_prefill` block.
pub const PREFILL_THREADS: u32 = 128;
/// Query rows per block of `attention_prefill` (`TQ`), and the head dimensions it takes.
pub const PREFILL_ROWS: usize = 16;
pub const PREFILL_MAX_HEAD_DIM: usize = 128;

/// Keys per split of a decode row attending to `len` keys (`decode_split_keys` in the source):
/// whole chunks of [`DECODE_THREADS`], as few as keep the row within 64 splits.
pub fn decode_split_keys(len: usize) -> usize {
    let chunk = DECODE_THREADS as usize;
    len.div_ceil(chunk * DECODE_MAX_SPLITS).max(1) * chunk
}

/// Threads of a norm over rows of `d` (`rms_norm`, `residual_norm`): about four elements a
/// thread, a multiple of 32, at most 1024.
pub fn norm_threads(d: usize) -> u32 {
    d.div_ceil(4).next_multiple_of(32).clamp(32, 1024) as u32
}

/// Compiles [`SOURCE`] to PTX for `compute_{major}{minor}` (no device needed, only NVRTC).
pub fn compile(major: i32, minor: i32) -> Result<String, CudaError> {
    let opts = CompileOptions {
        options: vec![
            format!("--gpu-architecture=compute_{major}{minor}"),
            "-default-device".into(),
        ],
        name: Some("kiln_kernels.cu".into()),
        ..CompileOptions::default()
    };
    let compiled = crate::device::quietly(|| cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts))
        .ok_or_else(|| {
            CudaError("libnvrtc could not be loaded: add CUDA's lib64 to LD_LIBRARY_PATH".into())
        })?
        .map_err(|e| CudaError(format!("compiling the CUDA kernels: {e}")))?;
    Ok(compiled.to_src())
}

/// FNV-1a over the bytes: a cache key, not a security boundary.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in parts.iter().flat_map(|p| p.iter()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The environment variable naming the compiled kernels' cache folder (read by programs, which
/// pass the folder in: [`kernel_cache_dir`]).
pub const CACHE_ENV: &str = "KILN_CUDA_CACHE";

/// Where compiled kernels are cached, from the values a program read of `KILN_CUDA_CACHE`,
/// `XDG_CACHE_HOME` and `HOME`: the first, else `$XDG_CACHE_HOME/kiln/cuda`, else
/// `~/.cache/kiln/cuda` (`None`: no cache, every start compiles).
pub fn kernel_cache_dir(
    kiln_cuda_cache: Option<OsString>,
    xdg_cache_home: Option<OsString>,
    home: Option<OsString>,
) -> Option<PathBuf> {
    let non_empty = |v: Option<OsString>| v.filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = non_empty(kiln_cuda_cache) {
        return Some(dir);
    }
    let base = non_empty(xdg_cache_home).or_else(|| non_empty(home).map(|h| h.join(".cache")))?;
    Some(base.join("kiln").join("cuda"))
}

/// NVRTC's "major.minor" (it decides the PTX it writes).
fn nvrtc_version() -> String {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters of plain ints.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&raw mut major, &raw mut minor) };
    if r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        format!("{major}.{minor}")
    } else {
        String::new()
    }
}

/// The PTX for this device: from the disk cache in `cache_dir`, or compiled and cached (a cache
/// that cannot be written only costs the next start a compile).
fn ptx_for(device: &Device, cache_dir: Option<&Path>) -> Result<String, CudaError> {
    let (major, minor) = device.compute_capability;
    let nvrtc = crate::device::quietly(nvrtc_version).unwrap_or_default();
    let key = fnv1a(&[SOURCE.as_bytes(), format!("{major}{minor}/{nvrtc}").as_bytes()]);
    let path = cache_dir.map(|d| d.join(format!("kernels-sm{major}{minor}-{key:016x}.ptx")));
    if let Some(ptx) = path.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
        return Ok(ptx);
    }
    let ptx = compile(major, minor)?;
    if let Some(path) = path {
        let written = path.parent().map(std::fs::create_dir_all).transpose().is_ok()
            && std::fs::write(&path, &ptx).is_ok();
        if !written {
            eprintln!("kiln-cuda: could not cache kernels at {}", path.display());
        }
    }
    Ok(ptx)
}

/// The name of every kernel in [`SOURCE`].
pub const NAMES: [&str; 15] = [
    "cast_f32_bf16",
    "embed",
    "add_bias",
    "rms_norm",
    "residual_norm",
    "rope_table",
    "rope_apply",
    "gated_act",
    "write_kv_f16",
    "write_kv_f32",
    "gather_rows",
    "softcap",
    "paged_attention",
    "attention_combine",
    "attention_prefill",
];

/// Every kernel of the source, loaded into one context.
pub struct Kernels {
    pub cast_f32_bf16: CudaFunction,
    pub embed: CudaFunction,
    pub add_bias: CudaFunction,
    pub rms_norm: CudaFunction,
    pub residual_norm: CudaFunction,
    pub rope_table: CudaFunction,
    pub rope_apply: CudaFunction,
    pub gated_act: CudaFunction,
    pub write_kv_f16: CudaFunction,
    pub write_kv_f32: CudaFunction,
    pub gather_rows: CudaFunction,
    pub softcap: CudaFunction,
    pub paged_attention: CudaFunction,
    pub attention_combine: CudaFunction,
    pub attention_prefill: CudaFunction,
}

impl Kernels {
    pub fn load(device: &Device, cache_dir: Option<&Path>) -> Result<Self, CudaError> {
        let module = device
            .ctx
            .load_module(Ptx::from_src(ptx_for(device, cache_dir)?))
            .map_err(|e| CudaError::new("loading the kernels", e))?;
        let f = |name: &str| {
            module.load_function(name).map_err(|e| CudaError::new(&format!("kernel {name}"), e))
        };
        Ok(Self {
            cast_f32_bf16: f("cast_f32_bf16")?,
            embed: f("embed")?,
            add_bias: f("add_bias")?,
            rms_norm: f("rms_norm")?,
            residual_norm: f("residual_norm")?,
            rope_table: f("rope_table")?,
            rope_apply: f("rope_apply")?,
            gated_act: f("gated_act")?,
            write_kv_f16: f("write_kv_f16")?,
            write_kv_f32: f("write_kv_f32")?,
            gather_rows: f("gather_rows")?,
            softcap: f("softcap")?,
            paged_attention: f("paged_attention")?,
            attention_combine: f("attention_combine")?,
            attention_prefill: f("attention_prefill")?,
        })
    }
}

/// One kernel argument: an address or a scalar, as the kernel's parameter list types it.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
    U64(u64),
    F32(f32),
}

/// Most arguments of a kernel in [`SOURCE`].
const MAX_ARGS: usize = 24;

/// Launches `func` on the device's stream with `args` in order (or, while a graph's trace is
/// recorded, only writes it down: [`crate::graphs`]).
pub fn launch(
    device: &Device,
    func: &CudaFunction,
    grid: (u32, u32, u32),
    block: u32,
    args: &[Arg],
) {
    if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
        return;
    }
    // What a graph's trace writes down of this launch: the kernel, its shape, every argument.
    let mut words = [0u64; 8 + MAX_ARGS];
    assert!(args.len() <= MAX_ARGS, "{} kernel arguments", args.len());
    let head = [1, func.cu_function() as u64, grid.0.into(), grid.1.into(), grid.2.into()];
    words[..5].copy_from_slice(&head);
    words[5] = block.into();
    for (w, a) in words[6..].iter_mut().zip(args) {
        *w = match *a {
            Arg::Ptr(p) | Arg::U64(p) => p,
            Arg::I32(v) => u64::from(v.cast_unsigned()),
            Arg::F32(v) => u64::from(v.to_bits()),
        };
    }
    if !device.recorder().issue(&words[..6 + args.len()]) {
        return;
    }
    let mut builder = device.stream.launch_builder(func);
    // The builder keeps pointers to the values: they must outlive the launch.
    let values: Vec<Arg> = args.to_vec();
    for a in &values {
        match a {
            Arg::Ptr(p) | Arg::U64(p) => builder.arg(p),
            Arg::I32(v) => builder.arg(v),
            Arg::F32(v) => builder.arg(v),
        };
    }
    let cfg = LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: every address argument is a live allocation covering what the kernel's launch
    // shape (documented in kernels.cu) touches; the callers check the shapes.
    let r = unsafe { builder.launch(cfg) };
    expect_ok(r, "launching a kernel");
}

/// The grid of a row-wise kernel: a block per row, and blocks of 256 along the row.
pub fn row_grid(rows: usize, width: usize) -> (u32, u32, u32) {
    let rows = u32::try_from(rows).unwrap_or_else(|_| panic!("grid of {rows} rows"));
    (rows, blocks_for(width, 256), 1)
}

/// Blocks of `threads` covering `n` elements.
pub fn blocks_for(n: usize, threads: usize) -> u32 {
    u32::try_from(n.div_ceil(threads)).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;
    use std::path::PathBuf;

    use super::kernel_cache_dir;

    #[test]
    fn the_kernel_cache_is_the_variable_then_xdg_then_home_and_empty_values_are_unset() {
        let os = |s: &str| Some(OsString::from(s));
        assert_eq!(kernel_cache_dir(os("/k"), os("/x"), os("/h")), Some(PathBuf::from("/k")));
        assert_eq!(
            kernel_cache_dir(os(""), os("/x"), os("/h")),
            Some(PathBuf::from("/x/kiln/cuda"))
        );
        assert_eq!(
            kernel_cache_dir(None, None, os("/h")),
            Some(PathBuf::from("/h/.cache/kiln/cuda"))
        );
        assert_eq!(kernel_cache_dir(None, os(""), None), None);
    }
}
