//! `out = x · Wᵀ (+ bias)` for weights in their stored format.
//!
//! Shapes: `x` is `[m, k]`, `W` is `[n, k]` (the PyTorch `Linear` layout), `out` is `[m, n]`.
//! Work is split over output columns (weight rows), so every weight byte is read once per call
//! whatever `m` is (weight-stationary): that keeps batched decode bandwidth-bound, not
//! batch-bound.
//!
//! One kernel serves decode and prefill ([`gemv`]): register tiles of 4 weight rows × up to 4
//! activation rows, computing each output as a dot product in a fixed order. Because that
//! order never depends on `m`, a row's result is bitwise the same alone, in a batch, or in a
//! prefill chunk: batching and caching never change outputs.
//!
//! Quantized weights ([`WeightData::Quant`]) take the integer-dot kernels of [`crate::quant`]:
//! `x` is quantized to 8 bits once per call (per activation block size the jobs need, into
//! per-thread buffers that only grow), then tasks own 16-row groups of weights. Their outputs
//! obey the same batch invariance.
//!
//! bf16 matrices marked [`WeightMatrix::with_bf16_dots`] take [`bf16_dot`] instead: `x` is
//! rounded to bf16 once per call and multiplied on the CPU's bf16 units in a fixed order, with
//! the same invariance.

mod bf16_dot;
mod experts;
mod gemv;

use std::cell::RefCell;

use half::{bf16, f16};

use crate::quant::{GgmlType, QuantActs, QuantMatrix, qgemm_groups, quantize_row};
use crate::thread_pool::SharedMut;
use crate::{CpuIsa, SimdLevel, ThreadPool};
use kiln_backend::Storage;

pub use bf16_dot::{bf16_dot_supported, round_to_bf16};
pub use experts::{ExpertJob, linear_experts};
pub use gemv::gemv_rows;

/// Weight rows per task (a multiple of the 4-row tile).
const ROWS_PER_TASK: usize = 32;
/// Matrices one [`linear_multi`] call may take.
const MAX_JOBS: usize = 4;

/// Stored weight elements.
pub enum WeightData {
    F32(Storage<f32>),
    F16(Storage<f16>),
    Bf16(Storage<bf16>),
    /// GGUF block-quantized, in the kernel layout.
    Quant(QuantMatrix),
}

impl WeightData {
    pub fn dtype_name(&self) -> &'static str {
        match self {
            Self::F32(_) => "f32",
            Self::F16(_) => "f16",
            Self::Bf16(_) => "bf16",
            Self::Quant(q) => q.ty().name(),
        }
    }

    fn len(&self) -> usize {
        match self {
            Self::F32(s) => s.len(),
            Self::F16(s) => s.len(),
            Self::Bf16(s) => s.len(),
            Self::Quant(q) => q.rows() * q.cols(),
        }
    }

    /// Bytes of weight data (what one full read of the matrix costs in bandwidth).
    pub fn num_bytes(&self) -> usize {
        match self {
            Self::F32(s) => s.len() * 4,
            Self::F16(s) => s.len() * 2,
            Self::Bf16(s) => s.len() * 2,
            Self::Quant(q) => q.num_bytes(),
        }
    }
}

/// A `[rows, cols]` row-major weight matrix.
pub struct WeightMatrix {
    rows: usize,
    cols: usize,
    data: WeightData,
    /// bf16 data multiplied by activations rounded to bf16 ([`bf16_dot`]), not widened to f32.
    bf16_dots: bool,
}

impl WeightMatrix {
    /// `None` when `data` does not hold exactly `rows * cols` elements.
    pub fn new(rows: usize, cols: usize, data: WeightData) -> Option<Self> {
        if let WeightData::Quant(q) = &data
            && (q.rows(), q.cols()) != (rows, cols)
        {
            return None;
        }
        (rows.checked_mul(cols)? == data.len()).then_some(Self {
            rows,
            cols,
            data,
            bf16_dots: false,
        })
    }

    /// This matrix multiplied in bf16 when its data is bf16: activations are rounded to bf16
    /// and the products summed in f32 on the CPU's bf16 units (`--dtype bfloat16`). Other
    /// data is unchanged (it keeps the f32 or integer kernels).
    #[must_use]
    pub fn with_bf16_dots(mut self) -> Self {
        self.bf16_dots = matches!(self.data, WeightData::Bf16(_));
        self
    }

    /// Whether [`WeightMatrix::with_bf16_dots`] applies.
    pub fn bf16_dots(&self) -> bool {
        self.bf16_dots
    }

    /// A matrix from GGUF tensor data: `rows` rows of `ty.row_bytes(cols)` bytes. Float types
    /// map onto the float variants (viewed in place when `bytes` is mapped and aligned, copied
    /// otherwise); block-quantized types are repacked ([`QuantMatrix`]). `None` when the sizes
    /// do not match.
    #[allow(clippy::needless_pass_by_value)] // takes ownership like `WeightData` does
    pub fn from_quantized(
        rows: usize,
        cols: usize,
        ty: GgmlType,
        bytes: Storage<u8>,
    ) -> Option<Self> {
        let expected = rows.checked_mul(ty.row_bytes(cols)?)?;
        if bytes.len() != expected {
            return None;
        }
        let data = match ty {
            GgmlType::F32 => WeightData::F32(float_storage(bytes, f32::from_le_bytes)),
            GgmlType::F16 => WeightData::F16(float_storage(bytes, f16::from_le_bytes)),
            GgmlType::Bf16 => WeightData::Bf16(float_storage(bytes, bf16::from_le_bytes)),
            _ => WeightData::Quant(QuantMatrix::from_bytes(ty, rows, cols, bytes.as_slice())?),
        };
        Self::new(rows, cols, data)
    }

    /// This matrix converted to `ty` (quantize-on-load), rows in parallel.
    pub fn quantize(&self, ty: GgmlType) -> Result<Self, QuantizeError> {
        let row_bytes = ty.row_bytes(self.cols).ok_or(QuantizeError {
            ty,
            cols: self.cols,
            block: ty.block_elems(),
        })?;
        let mut bytes = vec![0u8; self.rows * row_bytes];
        let threads = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        let rows_per_thread = self.rows.div_ceil(threads).max(1);
        std::thread::scope(|scope| {
            for (t, chunk) in bytes.chunks_mut(rows_per_thread * row_bytes.max(1)).enumerate() {
                scope.spawn(move || {
                    let mut row = vec![0.0f32; self.cols];
                    for (i, dst) in chunk.chunks_mut(row_bytes).enumerate() {
                        self.row_to_f32(t * rows_per_thread + i, &mut row);
                        quantize_row(ty, &row, dst);
                    }
                });
            }
        });
        Self::from_quantized(self.rows, self.cols, ty, bytes.into()).ok_or(QuantizeError {
            ty,
            cols: self.cols,
            block: ty.block_elems(),
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn data(&self) -> &WeightData {
        &self.data
    }

    /// Row `r` converted to f32 into `out` (`[cols]`): embedding lookups.
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        if let WeightData::Quant(q) = &self.data {
            q.row_to_f32(r, out);
            return;
        }
        let range = r * self.cols..(r + 1) * self.cols;
        convert_to_f32(&self.data, range, out);
    }
}

/// Why [`WeightMatrix::quantize`] failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantizeError {
    pub ty: GgmlType,
    pub cols: usize,
    pub block: usize,
}

impl std::fmt::Display for QuantizeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cannot quantize {} columns to {}: not a multiple of {}",
            self.cols, self.ty, self.block
        )
    }
}

impl std::error::Error for QuantizeError {}

/// `bytes` (little-endian elements of `T`) as a typed storage: a view when mapped and aligned,
/// else a copy.
#[allow(clippy::needless_pass_by_value)]
fn float_storage<T: kiln_backend::Pod, const N: usize>(
    bytes: Storage<u8>,
    from_le: fn([u8; N]) -> T,
) -> Storage<T> {
    if let Storage::Mapped { file, byte_offset, len } = &bytes
        && let Some(s) = Storage::mapped(file.clone(), *byte_offset, len / N)
    {
        return s;
    }
    let v: Vec<T> =
        bytes.as_slice().chunks_exact(N).map(|c| from_le(std::array::from_fn(|i| c[i]))).collect();
    v.into()
}

/// Converts `data[range]` to f32 into `out` (for quantized data, `range` must cover whole rows).
pub(crate) fn convert_to_f32(data: &WeightData, range: std::ops::Range<usize>, out: &mut [f32]) {
    match data {
        WeightData::Quant(q) => {
            let cols = q.cols();
            assert!(range.start.is_multiple_of(cols) && range.len().is_multiple_of(cols));
            for (i, o) in out.chunks_exact_mut(cols).enumerate() {
                q.row_to_f32(range.start / cols + i, o);
            }
        }
        WeightData::F32(s) => out.copy_from_slice(&s.as_slice()[range]),
        WeightData::F16(s) => {
            for (o, v) in out.iter_mut().zip(&s.as_slice()[range]) {
                *o = v.to_f32();
            }
        }
        WeightData::Bf16(s) => {
            for (o, v) in out.iter_mut().zip(&s.as_slice()[range]) {
                *o = v.to_f32();
            }
        }
    }
}

/// One matrix of a [`linear_multi`] call: `out = x · weightᵀ + bias`.
pub struct LinearJob<'a> {
    pub weight: &'a WeightMatrix,
    /// `[n]`
    pub bias: Option<&'a [f32]>,
    /// `[m, n]`
    pub out: &'a mut [f32],
}

/// `out[m, n] = x[m, k] · Wᵀ + bias`.
pub fn linear(
    pool: &ThreadPool,
    x: &[f32],
    m: usize,
    weight: &WeightMatrix,
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    linear_multi(pool, x, m, &mut [LinearJob { weight, bias, out }]);
}

thread_local! {
    /// Quantized activations of the current call: blocks of 32 and of 256.
    static ACTS: RefCell<[QuantActs; 2]> = RefCell::new(Default::default());
}

/// Weight rows per task for a job of `n` rows: 32, or more for big quantized matrices (fewer
/// tasks, less dispatch overhead per row).
fn rows_per_task(w: &WeightMatrix, threads: usize) -> usize {
    match w.data {
        WeightData::Quant(_) => (w.rows / (threads * 64)).clamp(1, 16) * ROWS_PER_TASK,
        _ => ROWS_PER_TASK,
    }
}

/// Several matrices that share the input `x[m, k]` (q/k/v, gate/up), in one parallel dispatch.
pub fn linear_multi(pool: &ThreadPool, x: &[f32], m: usize, jobs: &mut [LinearJob<'_>]) {
    if m == 0 {
        return;
    }
    for job in jobs.iter() {
        let (n, k) = (job.weight.rows, job.weight.cols);
        assert_eq!(x.len(), m * k, "linear: x is not [m, k]");
        assert_eq!(job.out.len(), m * n, "linear: out is not [m, n]");
        assert!(job.bias.is_none_or(|b| b.len() == n), "linear: bias is not [n]");
    }
    assert!(jobs.len() <= MAX_JOBS, "linear_multi: at most {MAX_JOBS} matrices");
    let bf16 = jobs.iter().any(|j| j.weight.bf16_dots);
    ACTS.with_borrow_mut(|acts| {
        // Quantize x once per activation block size the quantized jobs need.
        for (slot, block) in acts.iter_mut().zip([32, 256]) {
            let needed = jobs.iter().any(|j| match &j.weight.data {
                WeightData::Quant(q) => q.act_block() == block,
                _ => false,
            });
            if needed {
                let k = x.len() / m;
                slot.quantize(pool, x, m, k, block);
            }
        }
        if bf16 {
            bf16_dot::with_rounded(x, |xb| run_jobs(pool, (x, xb), m, jobs, acts));
        } else {
            run_jobs(pool, (x, &[]), m, jobs, acts);
        }
    });
}

/// Columns `rows` of `out[m, n]` for a float matrix `w`: bf16 dot products of `xb` (`x`
/// rounded to bf16) when the matrix takes them, else the f32 kernel on `x`.
fn float_rows(
    level: SimdLevel,
    (x, xb): (&[f32], &[u16]),
    m: usize,
    w: &WeightMatrix,
    rows: std::ops::Range<usize>,
    out: SharedMut<f32>,
) {
    match &w.data {
        WeightData::Bf16(s) if w.bf16_dots => {
            bf16_dot::gemv_rows_bf16(xb, m, s.as_slice(), (w.rows, w.cols), rows, out);
        }
        _ => gemv_rows(level, x, m, w, rows, out),
    }
}

fn run_jobs(
    pool: &ThreadPool,
    (x, xb): (&[f32], &[u16]),
    m: usize,
    jobs: &mut [LinearJob<'_>],
    acts: &[QuantActs; 2],
) {
    // Task t covers rows [c * rows_per_task, ..) of the job where the running count reaches t.
    let mut num_tasks_per_job = [0usize; MAX_JOBS];
    let mut task_rows = [0usize; MAX_JOBS];
    let mut outs = [SharedMut::dangling(); MAX_JOBS];
    for (i, job) in jobs.iter_mut().enumerate() {
        task_rows[i] = rows_per_task(job.weight, pool.num_threads());
        num_tasks_per_job[i] = job.weight.rows.div_ceil(task_rows[i]);
        outs[i] = SharedMut::new(job.out);
    }
    let total: usize = num_tasks_per_job.iter().sum();
    let level = SimdLevel::detect();
    let isa = CpuIsa::selected();
    pool.run(total, |task| {
        let (mut job_idx, mut chunk) = (0, task);
        while chunk >= num_tasks_per_job[job_idx] {
            chunk -= num_tasks_per_job[job_idx];
            job_idx += 1;
        }
        let job = &jobs[job_idx];
        let w = job.weight;
        let r0 = chunk * task_rows[job_idx];
        let r1 = (r0 + task_rows[job_idx]).min(w.rows);
        let out = outs[job_idx];
        if let WeightData::Quant(q) = &w.data {
            let a = &acts[usize::from(q.act_block() == 256)];
            // r0 is a multiple of 16 (task_rows is a multiple of 32).
            qgemm_groups(isa, a, q, r0 / 16..r1.div_ceil(16), out);
        } else {
            float_rows(level, (x, xb), m, w, r0..r1, out);
        }
        if let Some(bias) = job.bias {
            for r in 0..m {
                // SAFETY: this task alone owns columns r0..r1 of every output row.
                let row = unsafe { out.slice(r * w.rows + r0, r1 - r0) };
                for (o, b) in row.iter_mut().zip(&bias[r0..r1]) {
                    *o += b;
                }
            }
        }
    });
}

#[cfg(test)]
mod tests;
