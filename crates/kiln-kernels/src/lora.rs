//! LoRA updates on rows of a linear layer's output (`Backend::lora_add`): for each row,
//! `rank` dot products of its input with the rows of `a`, then `out += tmp[j] · b_t[j]` for
//! `j` in order. Rows of one adapter go through in blocks of [`ROW_BLOCK`], sharing each load of
//! `a` and `b_t` (prefill chunks run as a small matrix product, not row by row).
//!
//! Invariant: a row's result depends on its own input and adapter alone. Every row's arithmetic
//! is the same whatever block it is in: a dot product is 8 lane sums over the input in index
//! order (multiply, then add; never fused), reduced by one fixed tree, and the update adds
//! `tmp[j] · b_t[j, o]` for `j` in order. So batching, the other adapters of a step, the block a
//! row falls in and the thread count never change a bit of it.

use std::ops::Range;

use kiln_backend::{Backend, LoraJob};

use crate::ThreadPool;
use crate::thread_pool::SharedMut;

/// Rows done together.
const ROW_BLOCK: usize = 4;
/// Ranks done per pass over a block (their dot products kept on the stack).
const RANK_CHUNK: usize = 32;
/// Lanes of a dot product's partial sums.
const LANES: usize = 8;

/// `x · a_row` as 8 lane sums in index order reduced by a fixed tree, for each of `R` rows.
#[allow(clippy::inline_always)] // inlined into the AVX2 copy of `block`, compiled with it
#[inline(always)]
fn dots<const R: usize>(xs: &[&[f32]; R], a_row: &[f32]) -> [f32; R] {
    let k = a_row.len();
    let mut acc = [[0f32; LANES]; R];
    let full = k / LANES * LANES;
    for c in (0..full).step_by(LANES) {
        let a = &a_row[c..c + LANES];
        for (acc, x) in acc.iter_mut().zip(xs) {
            let x = &x[c..c + LANES];
            for l in 0..LANES {
                acc[l] += x[l] * a[l];
            }
        }
    }
    for (acc, x) in acc.iter_mut().zip(xs) {
        for i in full..k {
            acc[i - full] += x[i] * a_row[i];
        }
    }
    acc.map(|v| ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])))
}

/// `out_r += (x_r · aᵀ) · b_t` for `R` rows (`x_r`: `[k]`, `out_r`: `[n]`).
#[allow(clippy::inline_always)] // inlined into `block_avx2`, compiled with AVX2 there
#[inline(always)]
fn block<const R: usize>(
    xs: [&[f32]; R],
    a: &[f32],
    b_t: &[f32],
    rank: usize,
    mut outs: [&mut [f32]; R],
) {
    let k = xs[0].len();
    let n = outs[0].len();
    let mut tmp = [[0f32; RANK_CHUNK]; R];
    for j0 in (0..rank).step_by(RANK_CHUNK) {
        let j1 = (j0 + RANK_CHUNK).min(rank);
        for j in j0..j1 {
            let d = dots(&xs, &a[j * k..(j + 1) * k]);
            for r in 0..R {
                tmp[r][j - j0] = d[r];
            }
        }
        for j in j0..j1 {
            let b = &b_t[j * n..(j + 1) * n];
            for (out, t) in outs.iter_mut().zip(&tmp) {
                let s = t[j - j0];
                for (o, &bv) in out.iter_mut().zip(b) {
                    *o += s * bv;
                }
            }
        }
    }
}

/// [`block`] compiled for AVX2 (the same arithmetic: no fused multiply-adds, so the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn block_avx2<const R: usize>(
    xs: [&[f32]; R],
    a: &[f32],
    b_t: &[f32],
    rank: usize,
    outs: [&mut [f32]; R],
) {
    block(xs, a, b_t, rank, outs);
}

/// Rows `rows` of one adapter: blocks of [`ROW_BLOCK`], then the rest one by one.
fn job_rows<B: Backend<Vector = Vec<f32>>>(
    job: &LoraJob<'_, B>,
    rows: Range<usize>,
    (x, k): (&[f32], usize),
    n: usize,
    out: SharedMut<f32>,
    avx2: bool,
) {
    let x_row = |r: usize| &x[r * k..(r + 1) * k];
    // SAFETY: callers give each task disjoint rows of `out`, which holds `[m, n]`.
    let out_row = |r: usize| unsafe { out.slice(r * n, n) };
    let mut r = rows.start;
    while r + ROW_BLOCK <= rows.end {
        let xs: [&[f32]; ROW_BLOCK] = std::array::from_fn(|i| x_row(r + i));
        let outs: [&mut [f32]; ROW_BLOCK] = std::array::from_fn(|i| out_row(r + i));
        run(xs, job, outs, avx2);
        r += ROW_BLOCK;
    }
    for r in r..rows.end {
        run([x_row(r)], job, [out_row(r)], avx2);
    }
}

fn run<const R: usize, B: Backend<Vector = Vec<f32>>>(
    xs: [&[f32]; R],
    job: &LoraJob<'_, B>,
    outs: [&mut [f32]; R],
    avx2: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: `avx2` is true only when the CPU has AVX2 (checked by the caller).
        unsafe { block_avx2(xs, job.a, job.b_t, job.rank, outs) };
        return;
    }
    let _ = avx2;
    block(xs, job.a, job.b_t, job.rank, outs);
}

fn check<B: Backend<Vector = Vec<f32>>>(
    x: &[f32],
    k: usize,
    n: usize,
    jobs: &[LoraJob<'_, B>],
    out: &[f32],
) {
    assert!(jobs.iter().all(|j| j.rank == 0 || k > 0));
    for job in jobs {
        assert!(job.rows.end * k <= x.len() && job.rows.end * n <= out.len());
        assert!(job.a.len() == job.rank * k && job.b_t.len() == job.rank * n);
    }
}

fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Rows per parallel task (whole blocks).
const ROWS_PER_TASK: usize = 4 * ROW_BLOCK;

/// Every job's rows, in parallel on `pool` (`x`: `[m, k]`, `out`: `[m, n]`, rows disjoint).
pub fn lora_add<B: Backend<Vector = Vec<f32>>>(
    pool: &ThreadPool,
    x: &[f32],
    k: usize,
    n: usize,
    jobs: &[LoraJob<'_, B>],
    out: &mut [f32],
) {
    check(x, k, n, jobs, out);
    let avx2 = has_avx2();
    let tasks_of = |job: &LoraJob<'_, B>| job.rows.len().div_ceil(ROWS_PER_TASK);
    let num_tasks = jobs.iter().map(tasks_of).sum();
    let out_ptr = SharedMut::new(out);
    pool.run(num_tasks, |mut task| {
        // The job holding this task (a step has a few adapters: a scan, no table).
        for job in jobs {
            if task < tasks_of(job) {
                let r0 = job.rows.start + task * ROWS_PER_TASK;
                let rows = r0..(r0 + ROWS_PER_TASK).min(job.rows.end);
                job_rows(job, rows, (x, k), n, out_ptr, avx2);
                return;
            }
            task -= tasks_of(job);
        }
    });
}

/// [`lora_add`] on one thread without SIMD (the reference backend's; the same bits).
pub fn lora_add_scalar<B: Backend<Vector = Vec<f32>>>(
    x: &[f32],
    k: usize,
    n: usize,
    jobs: &[LoraJob<'_, B>],
    out: &mut [f32],
) {
    check(x, k, n, jobs, out);
    let out_ptr = SharedMut::new(out);
    for job in jobs {
        job_rows(job, job.rows.clone(), (x, k), n, out_ptr, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Cpu;

    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 1000)
            .map(|v| v as f32 / 500.0 - 1.0)
            .collect()
    }

    /// f64 `out + (x · aᵀ) · b_t` of one row.
    fn naive(x: &[f32], a: &[f32], b_t: &[f32], rank: usize, out: &[f32]) -> Vec<f64> {
        let (k, n) = (x.len(), out.len());
        let tmp: Vec<f64> = (0..rank)
            .map(|j| (0..k).map(|i| f64::from(x[i]) * f64::from(a[j * k + i])).sum())
            .collect();
        (0..n)
            .map(|o| {
                f64::from(out[o])
                    + (0..rank).map(|j| tmp[j] * f64::from(b_t[j * n + o])).sum::<f64>()
            })
            .collect()
    }

    #[test]
    fn rows_match_f64_and_do_not_depend_on_their_neighbours() {
        let (m, k, n) = (11, 96, 40);
        let x = values(m * k, 1);
        let base = values(m * n, 2);
        let (a1, b1) = (values(8 * k, 3), values(8 * n, 4));
        let (a2, b2) = (values(70 * k, 5), values(70 * n, 6));
        let jobs = [
            LoraJob::<Cpu> { rows: 0..3, rank: 8, a: &a1, b_t: &b1 },
            LoraJob::<Cpu> { rows: 4..11, rank: 70, a: &a2, b_t: &b2 },
        ];
        let pool = ThreadPool::new(3);
        let mut out = base.clone();
        lora_add(&pool, &x, k, n, &jobs, &mut out);
        for (job, (a, b, rank)) in jobs.iter().zip([(&a1, &b1, 8), (&a2, &b2, 70)]) {
            for r in job.rows.clone() {
                let want = naive(&x[r * k..(r + 1) * k], a, b, rank, &base[r * n..(r + 1) * n]);
                for (o, w) in out[r * n..(r + 1) * n].iter().zip(want) {
                    assert!((f64::from(*o) - w).abs() < 1e-3 * (1.0 + w.abs()), "{o} {w}");
                }
            }
        }
        // Row 3 has no adapter: untouched.
        assert_eq!(out[3 * n..4 * n], base[3 * n..4 * n]);
        // The reference (no SIMD, one thread) gives the same bits.
        let mut scalar = base.clone();
        lora_add_scalar(&x, k, n, &jobs, &mut scalar);
        assert_eq!(scalar, out);
        // Each row alone, on one thread, gives the same bits.
        for (job, (a, b, rank)) in jobs.iter().zip([(&a1, &b1, 8), (&a2, &b2, 70)]) {
            for r in job.rows.clone() {
                let mut alone = base[r * n..(r + 1) * n].to_vec();
                let one = [LoraJob::<Cpu> { rows: 0..1, rank, a, b_t: b }];
                lora_add(&ThreadPool::new(1), &x[r * k..(r + 1) * k], k, n, &one, &mut alone);
                assert_eq!(alone, out[r * n..(r + 1) * n]);
            }
        }
    }
}
