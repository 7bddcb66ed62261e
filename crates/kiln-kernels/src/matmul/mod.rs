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

mod gemv;

use half::{bf16, f16};

use crate::storage::Storage;
use crate::thread_pool::SharedMut;
use crate::{SimdLevel, ThreadPool};

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
}

impl WeightData {
    pub fn dtype_name(&self) -> &'static str {
        match self {
            Self::F32(_) => "f32",
            Self::F16(_) => "f16",
            Self::Bf16(_) => "bf16",
        }
    }

    fn len(&self) -> usize {
        match self {
            Self::F32(s) => s.len(),
            Self::F16(s) => s.len(),
            Self::Bf16(s) => s.len(),
        }
    }

    /// Bytes of weight data (what one full read of the matrix costs in bandwidth).
    pub fn num_bytes(&self) -> usize {
        match self {
            Self::F32(s) => s.len() * 4,
            Self::F16(s) => s.len() * 2,
            Self::Bf16(s) => s.len() * 2,
        }
    }
}

/// A `[rows, cols]` row-major weight matrix.
pub struct WeightMatrix {
    rows: usize,
    cols: usize,
    data: WeightData,
}

impl WeightMatrix {
    /// `None` when `data` does not hold exactly `rows * cols` elements.
    pub fn new(rows: usize, cols: usize, data: WeightData) -> Option<Self> {
        (rows.checked_mul(cols)? == data.len()).then_some(Self { rows, cols, data })
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
        let range = r * self.cols..(r + 1) * self.cols;
        convert_to_f32(&self.data, range, out);
    }
}

/// Converts `data[range]` to f32 into `out`.
pub(crate) fn convert_to_f32(data: &WeightData, range: std::ops::Range<usize>, out: &mut [f32]) {
    match data {
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

/// Several matrices that share the input `x[m, k]` (q/k/v, gate/up), in one parallel dispatch.
pub fn linear_multi(pool: &ThreadPool, x: &[f32], m: usize, jobs: &mut [LinearJob<'_>]) {
    if m == 0 {
        return;
    }
    let rows_per_task = ROWS_PER_TASK;
    for job in jobs.iter() {
        let (n, k) = (job.weight.rows, job.weight.cols);
        assert_eq!(x.len(), m * k, "linear: x is not [m, k]");
        assert_eq!(job.out.len(), m * n, "linear: out is not [m, n]");
        assert!(job.bias.is_none_or(|b| b.len() == n), "linear: bias is not [n]");
    }
    assert!(jobs.len() <= MAX_JOBS, "linear_multi: at most {MAX_JOBS} matrices");
    // Task t covers rows [c * rows_per_task, ..) of the job where the running count reaches t.
    let mut num_tasks_per_job = [0usize; MAX_JOBS];
    let mut outs = [SharedMut::dangling(); MAX_JOBS];
    for (i, job) in jobs.iter_mut().enumerate() {
        num_tasks_per_job[i] = job.weight.rows.div_ceil(rows_per_task);
        outs[i] = SharedMut::new(job.out);
    }
    let total: usize = num_tasks_per_job.iter().sum();
    let level = SimdLevel::detect();
    pool.run(total, |task| {
        let (mut job_idx, mut chunk) = (0, task);
        while chunk >= num_tasks_per_job[job_idx] {
            chunk -= num_tasks_per_job[job_idx];
            job_idx += 1;
        }
        let job = &jobs[job_idx];
        let w = job.weight;
        let r0 = chunk * rows_per_task;
        let r1 = (r0 + rows_per_task).min(w.rows);
        let out = outs[job_idx];
        gemv_rows(level, x, m, w, r0..r1, out);
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
