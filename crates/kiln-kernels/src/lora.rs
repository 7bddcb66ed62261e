//! LoRA updates on rows of a linear layer's output (`Backend::lora_add`): for each row,
//! `rank` dot products of its input with the rows of `a` (the SIMD dot the norms use, one
//! level per process), then `out += tmp[j] · b_t[j]` for `j` in order. A row's result depends
//! on its own input and adapter alone, so batching, the other adapters of a step and the
//! thread count never change a bit of it.

use std::ops::Range;

use crate::thread_pool::SharedMut;
use crate::{ThreadPool, vec_ops};

/// Rows per parallel task.
const ROWS_PER_TASK: usize = 4;
/// Ranks done per pass over a row (dot products kept on the stack).
const RANK_CHUNK: usize = 64;

/// One adapter's rows: `a` is `[rank, k]`, `b_t` `[rank, n]`.
pub struct LoraRows<'a> {
    pub rows: Range<usize>,
    pub rank: usize,
    pub a: &'a [f32],
    pub b_t: &'a [f32],
}

/// `out[t] += (x[t] · aᵀ) · b_t` for one row: `x` is `[k]`, `out` `[n]`.
pub fn lora_row(
    x: &[f32],
    a: &[f32],
    b_t: &[f32],
    rank: usize,
    dot: fn(&[f32], &[f32]) -> f32,
    out: &mut [f32],
) {
    let (k, n) = (x.len(), out.len());
    assert!(a.len() == rank * k && b_t.len() == rank * n);
    let mut tmp = [0f32; RANK_CHUNK];
    for j0 in (0..rank).step_by(RANK_CHUNK) {
        let j1 = (j0 + RANK_CHUNK).min(rank);
        for j in j0..j1 {
            tmp[j - j0] = dot(x, &a[j * k..(j + 1) * k]);
        }
        for j in j0..j1 {
            let (s, b) = (tmp[j - j0], &b_t[j * n..(j + 1) * n]);
            for (o, &bv) in out.iter_mut().zip(b) {
                *o += s * bv;
            }
        }
    }
}

fn check(x: &[f32], k: usize, n: usize, jobs: &[LoraRows<'_>], out: &[f32]) {
    for job in jobs {
        assert!(job.rows.end * k <= x.len() && job.rows.end * n <= out.len());
        assert!(job.a.len() == job.rank * k && job.b_t.len() == job.rank * n);
    }
}

/// Every job's rows, in parallel on `pool` (`x`: `[m, k]`, `out`: `[m, n]`, rows disjoint).
pub fn lora_add(
    pool: &ThreadPool,
    x: &[f32],
    k: usize,
    n: usize,
    jobs: &[LoraRows<'_>],
    out: &mut [f32],
) {
    check(x, k, n, jobs, out);
    // (job, first row) of each task.
    let tasks: Vec<(usize, usize)> = jobs
        .iter()
        .enumerate()
        .flat_map(|(j, job)| job.rows.clone().step_by(ROWS_PER_TASK).map(move |r| (j, r)))
        .collect();
    let out_ptr = SharedMut::new(out);
    pool.run(tasks.len(), |task| {
        let (j, r0) = tasks[task];
        let job = &jobs[j];
        for r in r0..(r0 + ROWS_PER_TASK).min(job.rows.end) {
            // SAFETY: the jobs' rows are disjoint and each task writes only its rows r0..r1.
            let o = unsafe { out_ptr.slice(r * n, n) };
            lora_row(&x[r * k..(r + 1) * k], job.a, job.b_t, job.rank, vec_ops::dot, o);
        }
    });
}

/// [`lora_add`] on one thread with the scalar dot (the reference backend's).
pub fn lora_add_scalar(x: &[f32], k: usize, n: usize, jobs: &[LoraRows<'_>], out: &mut [f32]) {
    check(x, k, n, jobs, out);
    for job in jobs {
        for r in job.rows.clone() {
            let o = &mut out[r * n..(r + 1) * n];
            lora_row(&x[r * k..(r + 1) * k], job.a, job.b_t, job.rank, vec_ops::dot_scalar, o);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            LoraRows { rows: 0..3, rank: 8, a: &a1, b_t: &b1 },
            LoraRows { rows: 4..11, rank: 70, a: &a2, b_t: &b2 },
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
        // Each row alone, on one thread, gives the same bits.
        for (job, (a, b, rank)) in jobs.iter().zip([(&a1, &b1, 8), (&a2, &b2, 70)]) {
            for r in job.rows.clone() {
                let mut alone = base[r * n..(r + 1) * n].to_vec();
                let one = [LoraRows { rows: 0..1, rank, a, b_t: b }];
                lora_add(&ThreadPool::new(1), &x[r * k..(r + 1) * k], k, n, &one, &mut alone);
                assert_eq!(alone, out[r * n..(r + 1) * n]);
            }
        }
    }
}
