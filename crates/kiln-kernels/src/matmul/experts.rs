//! Expert-grouped matmuls for mixture-of-experts layers: rows `offsets[e]..offsets[e + 1]` of
//! `x` go through expert `e`'s matrix of every job, with one dispatch that quantizes every
//! expert's rows and one that runs every expert's weight-row tasks (a step's few rows per
//! expert would otherwise pay two dispatches per expert and matrix).
//!
//! Each expert's rows are quantized and multiplied exactly as [`super::linear_multi`] would
//! do for those rows alone (the same per-row quantization, the same kernel, chosen by the same
//! row count), so the result equals one `linear` per expert bit for bit, and a row's output
//! never depends on the rows of other experts.

use std::cell::RefCell;
use std::ops::Range;

use crate::quant::{QuantActs, qgemm_groups};
use crate::thread_pool::SharedMut;
use crate::{CpuIsa, SimdLevel, ThreadPool};

use super::{MAX_JOBS, WeightData, WeightMatrix, bf16_dot, float_rows, rows_per_task};

/// One matrix per expert of a [`linear_experts`] call.
pub struct ExpertJob<'a> {
    /// One `[n, k]` matrix per expert, all of the same shape.
    pub weights: &'a [WeightMatrix],
    /// `[rows, n]`: row `r` is `x[r] · weights[e]ᵀ` for the expert `e` whose rows hold `r`.
    pub out: &'a mut [f32],
}

/// Weight rows `rows` of job `job`'s matrix for the `slot`-th expert that has rows.
struct Task {
    job: usize,
    slot: usize,
    rows: Range<usize>,
}

/// The calling thread's buffers for one call (they only grow, so a step allocates nothing).
#[derive(Default)]
struct Scratch {
    /// Each active expert's quantized rows, blocks of 32 and of 256.
    acts: Vec<[QuantActs; 2]>,
    /// The experts with rows, ascending.
    active: Vec<usize>,
    tasks: Vec<Task>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// For every job, `out[offsets[e]..offsets[e + 1]] = x[the same rows] · weights[e]ᵀ`, where
/// `x` is `[offsets[E], k]` (a longer buffer is fine) and `offsets` ascends from 0 with one
/// entry per expert and one more. At most [`MAX_JOBS`] jobs.
pub fn linear_experts(
    pool: &ThreadPool,
    x: &[f32],
    k: usize,
    offsets: &[usize],
    jobs: &mut [ExpertJob<'_>],
) {
    let num_experts = offsets.len().saturating_sub(1);
    let total = offsets.last().copied().unwrap_or(0);
    assert!(x.len() >= total * k, "linear_experts: x is shorter than [rows, k]");
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "linear_experts: offsets descend");
    assert!(jobs.len() <= MAX_JOBS, "linear_experts: at most {MAX_JOBS} matrices");
    let mut outs = [SharedMut::dangling(); MAX_JOBS];
    for (job, shared) in jobs.iter_mut().zip(&mut outs) {
        assert_eq!(job.weights.len(), num_experts, "linear_experts: one matrix per expert");
        let n = job.weights.first().map_or(0, WeightMatrix::rows);
        assert!(
            job.weights.iter().all(|w| w.rows == n && w.cols == k),
            "linear_experts: the experts' matrices are not all [n, k]"
        );
        assert!(job.out.len() >= total * n, "linear_experts: out is shorter than [rows, n]");
        *shared = SharedMut::new(job.out);
    }
    SCRATCH.with_borrow_mut(|Scratch { acts, active, tasks }| {
        active.clear();
        active.extend((0..num_experts).filter(|&e| offsets[e] < offsets[e + 1]));
        if active.is_empty() {
            return;
        }
        let active: &[usize] = active;
        let seg = |slot: usize| offsets[active[slot]]..offsets[active[slot] + 1];
        // Which activation block sizes (32, 256) the jobs' quantized matrices need.
        let needs = [32, 256].map(|block| {
            jobs.iter().any(|j| {
                active.iter().any(|&e| match &j.weights[e].data {
                    WeightData::Quant(q) => q.act_block() == block,
                    _ => false,
                })
            })
        });
        tasks.clear();
        for (j, job) in jobs.iter().enumerate() {
            for (slot, &e) in active.iter().enumerate() {
                let w = &job.weights[e];
                let step = rows_per_task(w, pool.num_threads());
                for r0 in (0..w.rows).step_by(step) {
                    tasks.push(Task { job: j, slot, rows: r0..(r0 + step).min(w.rows) });
                }
            }
        }
        let tasks: &[Task] = tasks;
        if acts.len() < active.len() {
            acts.resize_with(active.len(), Default::default);
        }
        if needs.contains(&true) {
            let shared = SharedMut::new(&mut acts[..active.len()]);
            pool.run(active.len(), |slot| {
                // SAFETY: task `slot` alone touches element `slot`, inside the slice.
                let a = unsafe { &mut shared.slice(slot, 1)[0] };
                let rows = seg(slot);
                let xs = &x[rows.start * k..rows.end * k];
                for ((q, block), need) in a.iter_mut().zip([32, 256]).zip(needs) {
                    if need {
                        q.quantize_here(xs, rows.len(), k, block);
                    }
                }
            });
        }
        let acts: &[[QuantActs; 2]] = acts;
        let bf16 = jobs.iter().any(|j| active.iter().any(|&e| j.weights[e].bf16_dots));
        let x = &x[..total * k];
        let level = SimdLevel::detect();
        let isa = CpuIsa::selected();
        // `xb` is `x` rounded to bf16 when a matrix takes bf16 dots, else empty.
        let run = |xb: &[u16]| {
            pool.run(tasks.len(), |t| {
                let Task { job, slot, ref rows } = tasks[t];
                let w = &jobs[job].weights[active[slot]];
                let seg = seg(slot);
                // SAFETY: the expert's output rows `seg` start inside `out` (checked above); this
                // task alone writes their columns `rows`.
                let out = unsafe { outs[job].at(seg.start * w.rows) };
                if let WeightData::Quant(q) = &w.data {
                    let a = &acts[slot][usize::from(q.act_block() == 256)];
                    // rows.start is a multiple of 16 (a task's rows are a multiple of 32).
                    qgemm_groups(isa, a, q, rows.start / 16..rows.end.div_ceil(16), out);
                } else {
                    let rows_k = seg.start * k..seg.end * k;
                    let xbs = xb.get(rows_k.clone()).unwrap_or(&[]);
                    float_rows(level, (&x[rows_k], xbs), seg.len(), w, rows.clone(), out);
                }
            });
        };
        if bf16 {
            bf16_dot::with_rounded(x, run);
        } else {
            run(&[]);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::GgmlType;
    use crate::{LinearJob, linear_multi};

    fn matrix(rows: usize, cols: usize, seed: u64) -> WeightMatrix {
        let data = crate::testing::values(rows * cols, seed, 0.5);
        WeightMatrix::new(rows, cols, WeightData::F32(data.into())).unwrap()
    }

    /// Grouped == one `linear_multi` per expert, bit for bit, for float, bf16-dot and
    /// quantized experts, with empty experts, one-row and many-row (AMX-sized) segments.
    #[test]
    fn grouped_equals_one_linear_per_expert() {
        let pool = ThreadPool::new(3);
        let (k, n, experts) = (256, 96, 5);
        let offsets = [0, 1, 1, 19, 21, 40];
        let rows = offsets[experts];
        let x = crate::testing::values(rows * k, 9, 1.0);
        let types = [None, Some(GgmlType::Q8_0), Some(GgmlType::Q4K), Some(GgmlType::Q6K)];
        for ty in types.into_iter().chain([Some(GgmlType::Bf16)]) {
            let make = |seed| {
                let w: Vec<WeightMatrix> =
                    (0..experts).map(|e| matrix(n, k, seed + e as u64)).collect();
                match ty {
                    // bf16 experts multiply as bf16 dot products.
                    Some(GgmlType::Bf16) => w
                        .iter()
                        .map(|w| w.quantize(GgmlType::Bf16).unwrap().with_bf16_dots())
                        .collect(),
                    Some(ty) => w.iter().map(|w| w.quantize(ty).unwrap()).collect(),
                    None => w,
                }
            };
            let (gate, up) = (make(100), make(200));
            let (mut g, mut u) = (vec![0.0; rows * n], vec![0.0; rows * n]);
            linear_experts(
                &pool,
                &x,
                k,
                &offsets,
                &mut [
                    ExpertJob { weights: &gate, out: &mut g },
                    ExpertJob { weights: &up, out: &mut u },
                ],
            );
            for e in 0..experts {
                let seg = offsets[e]..offsets[e + 1];
                let (mut g1, mut u1) = (vec![0.0; seg.len() * n], vec![0.0; seg.len() * n]);
                let xs = &x[seg.start * k..seg.end * k];
                linear_multi(
                    &pool,
                    xs,
                    seg.len(),
                    &mut [
                        LinearJob { weight: &gate[e], bias: None, out: &mut g1 },
                        LinearJob { weight: &up[e], bias: None, out: &mut u1 },
                    ],
                );
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&g[seg.start * n..seg.end * n]), bits(&g1), "{ty:?} expert {e}");
                assert_eq!(bits(&u[seg.start * n..seg.end * n]), bits(&u1), "{ty:?} expert {e}");
            }
        }
    }
}
