//! RMSNorm: `out = x / sqrt(mean(x²) + eps) * weight`, row by row; and an encoder's
//! LayerNorm, `(x − mean(x)) / sqrt(var(x) + eps) * weight + bias` (two passes: the mean, then
//! the variance of the centred row, as PyTorch computes it).
//!
//! Gemma-style norms scale by `(1 + w)`; loaders fold the `1 +` into the weight so one kernel
//! serves both. The same kernel normalises per head (q/k norm) with `rows = tokens × heads`.

use crate::thread_pool::SharedMut;
use crate::{ThreadPool, vec_ops};

/// Rows per parallel task; below one task's worth the pool is not used.
const ROWS_PER_TASK: usize = 16;

/// `out[rows, d] = rmsnorm(x[rows, d]) * weight[d]`.
pub fn rms_norm(pool: &ThreadPool, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    assert!(d > 0 && x.len() == out.len() && x.len().is_multiple_of(d));
    let rows = x.len() / d;
    let out_ptr = SharedMut::new(out);
    pool.run(rows.div_ceil(ROWS_PER_TASK), |task| {
        let r0 = task * ROWS_PER_TASK;
        let r1 = (r0 + ROWS_PER_TASK).min(rows);
        for r in r0..r1 {
            // SAFETY: each task writes only its own rows r0..r1.
            let o = unsafe { out_ptr.slice(r * d, d) };
            rms_norm_row(&x[r * d..(r + 1) * d], weight, eps, o);
        }
    });
}

/// In-place variant of [`rms_norm`].
pub fn rms_norm_inplace(pool: &ThreadPool, x: &mut [f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    assert!(d > 0 && x.len().is_multiple_of(d));
    let rows = x.len() / d;
    let x_ptr = SharedMut::new(x);
    pool.run(rows.div_ceil(ROWS_PER_TASK), |task| {
        let r0 = task * ROWS_PER_TASK;
        let r1 = (r0 + ROWS_PER_TASK).min(rows);
        for r in r0..r1 {
            // SAFETY: each task touches only its own rows r0..r1.
            rms_norm_row_inplace(unsafe { x_ptr.slice(r * d, d) }, weight, eps);
        }
    });
}

/// The residual step between two sublayers, in one pass over rows of `d`: `branch` (`[rows,
/// d]`, a sublayer's output) is first normalised in place by `post` when given (Gemma's
/// post-attention / post-FFN norms), then added into the residual stream `x`; with `next`,
/// `out = rmsnorm(x) * next` (the following sublayer's input norm). Bitwise the same as
/// [`rms_norm_inplace`], `x += branch` and [`rms_norm`] one after the other.
pub fn residual_norm(
    pool: &ThreadPool,
    d: usize,
    branch: &mut [f32],
    post: Option<&[f32]>,
    x: &mut [f32],
    next: Option<(&[f32], &mut [f32])>,
    eps: f32,
) {
    assert!(d > 0 && x.len() == branch.len() && x.len().is_multiple_of(d));
    assert!(post.is_none_or(|w| w.len() == d));
    let rows = x.len() / d;
    let (branch_ptr, x_ptr) = (SharedMut::new(branch), SharedMut::new(x));
    let (next_w, out_ptr) = match next {
        Some((w, out)) => {
            assert!(w.len() == d && out.len() == rows * d);
            (Some(w), Some(SharedMut::new(out)))
        }
        None => (None, None),
    };
    pool.run(rows.div_ceil(ROWS_PER_TASK), |task| {
        let r0 = task * ROWS_PER_TASK;
        for r in r0..(r0 + ROWS_PER_TASK).min(rows) {
            // SAFETY: each task touches only its own rows r0..r1 of the three buffers.
            let (b, xr) = unsafe { (branch_ptr.slice(r * d, d), x_ptr.slice(r * d, d)) };
            if let Some(w) = post {
                rms_norm_row_inplace(b, w, eps);
            }
            for (a, v) in xr.iter_mut().zip(b.iter()) {
                *a += v;
            }
            if let (Some(w), Some(out)) = (next_w, out_ptr) {
                // SAFETY: as above.
                rms_norm_row(xr, w, eps, unsafe { out.slice(r * d, d) });
            }
        }
    });
}

/// `x = layernorm(x + branch) * weight + bias` over rows of `d = weight.len()` (without
/// `branch`, of `x` alone).
pub fn layer_norm(
    pool: &ThreadPool,
    x: &mut [f32],
    branch: Option<&[f32]>,
    (weight, bias): (&[f32], &[f32]),
    eps: f32,
) {
    let d = weight.len();
    assert!(d > 0 && bias.len() == d && x.len().is_multiple_of(d));
    assert!(branch.is_none_or(|b| b.len() == x.len()));
    let rows = x.len() / d;
    let x_ptr = SharedMut::new(x);
    pool.run(rows.div_ceil(ROWS_PER_TASK), |task| {
        let r0 = task * ROWS_PER_TASK;
        for r in r0..(r0 + ROWS_PER_TASK).min(rows) {
            // SAFETY: each task touches only its own rows r0..r1.
            let row = unsafe { x_ptr.slice(r * d, d) };
            if let Some(b) = branch {
                for (a, v) in row.iter_mut().zip(&b[r * d..][..d]) {
                    *a += v;
                }
            }
            layer_norm_row_inplace(row, weight, bias, eps);
        }
    });
}

/// One row of [`layer_norm`]; also its scalar reference.
pub fn layer_norm_row_inplace(row: &mut [f32], weight: &[f32], bias: &[f32], eps: f32) {
    let mean = lane_sum(row) / row.len() as f32;
    for v in row.iter_mut() {
        *v -= mean;
    }
    let inv = 1.0 / (vec_ops::dot(row, row) / row.len() as f32 + eps).sqrt();
    for ((v, w), b) in row.iter_mut().zip(weight).zip(bias) {
        *v = (*v * inv).mul_add(*w, *b);
    }
}

/// `Σ x` in 16 lanes summed pairwise at the end (vectorisable; one fixed order for any row).
fn lane_sum(x: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for chunk in &mut chunks {
        for (l, v) in lanes.iter_mut().zip(chunk) {
            *l += v;
        }
    }
    for (l, v) in lanes.iter_mut().zip(chunks.remainder()) {
        *l += v;
    }
    let mut width = 16;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            lanes[i] += lanes[i + width];
        }
    }
    lanes[0]
}

fn rms_norm_row_inplace(row: &mut [f32], weight: &[f32], eps: f32) {
    let inv = inv_rms(row, eps);
    for (v, w) in row.iter_mut().zip(weight) {
        *v = *v * inv * w;
    }
}

fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let mean_sq = vec_ops::dot(x, x) / x.len() as f32;
    1.0 / (mean_sq + eps).sqrt()
}

/// One row; also the scalar reference.
pub fn rms_norm_row(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let inv = inv_rms(x, eps);
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * inv * w;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn residual_norm_equals_the_separate_steps_bitwise() {
        let pool = ThreadPool::new(2);
        let (rows, d) = (37, 24);
        let vals = |seed: usize| -> Vec<f32> {
            (0..rows * d).map(|i| (((i + seed) * 37 % 101) as f32 - 50.0) / 17.0).collect()
        };
        let (post, next): (Vec<f32>, Vec<f32>) = (
            (0..d).map(|i| 0.5 + i as f32 / 9.0).collect(),
            (0..d).map(|i| 1.5 - i as f32 / 30.0).collect(),
        );
        for with_post in [false, true] {
            for with_next in [false, true] {
                let (mut branch, mut x) = (vals(1), vals(2));
                let (mut want_b, mut want_x) = (branch.clone(), x.clone());
                if with_post {
                    rms_norm_inplace(&pool, &mut want_b, &post, 1e-6);
                }
                for (a, b) in want_x.iter_mut().zip(&want_b) {
                    *a += b;
                }
                let mut want_out = vec![0.0; rows * d];
                rms_norm(&pool, &want_x, &next, 1e-6, &mut want_out);
                let mut out = vec![0.0; rows * d];
                let post_w = with_post.then_some(post.as_slice());
                let next_w = with_next.then_some((next.as_slice(), out.as_mut_slice()));
                residual_norm(&pool, d, &mut branch, post_w, &mut x, next_w, 1e-6);
                assert_eq!((&branch, &x), (&want_b, &want_x));
                if with_next {
                    assert_eq!(out, want_out);
                }
            }
        }
    }

    #[test]
    fn layer_norm_matches_its_definition() {
        let pool = ThreadPool::new(2);
        for d in [1usize, 7, 64, 129, 384] {
            let rows = 37;
            let x: Vec<f32> =
                (0..rows * d).map(|i| ((i * 37 % 101) as f32 - 30.0) / 17.0).collect();
            let branch: Vec<f32> = (0..rows * d).map(|i| ((i * 13 % 29) as f32) / 7.0).collect();
            let w: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 / d as f32).collect();
            let b: Vec<f32> = (0..d).map(|i| i as f32 / 50.0 - 0.3).collect();
            let mut y = x.clone();
            layer_norm(&pool, &mut y, Some(&branch), (&w, &b), 1e-12);
            for r in 0..rows {
                let row: Vec<f64> =
                    (0..d).map(|c| f64::from(x[r * d + c] + branch[r * d + c])).collect();
                let mean = row.iter().sum::<f64>() / d as f64;
                let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d as f64;
                for c in 0..d {
                    let want =
                        (row[c] - mean) / (var + 1e-12).sqrt() * f64::from(w[c]) + f64::from(b[c]);
                    let got = f64::from(y[r * d + c]);
                    assert!((got - want).abs() < 1e-5 * (1.0 + want.abs()), "d={d} {got} {want}");
                }
            }
        }
    }

    #[test]
    fn matches_definition_and_inplace_agrees() {
        let pool = ThreadPool::new(2);
        for d in [1usize, 7, 64, 129] {
            let rows = 37;
            let x: Vec<f32> =
                (0..rows * d).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
            let w: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 / d as f32).collect();
            let mut out = vec![0.0; rows * d];
            rms_norm(&pool, &x, &w, 1e-6, &mut out);
            for r in 0..rows {
                let row = &x[r * d..(r + 1) * d];
                let ms: f64 =
                    row.iter().map(|v| f64::from(*v) * f64::from(*v)).sum::<f64>() / d as f64;
                let inv = 1.0 / (ms + 1e-6).sqrt();
                for c in 0..d {
                    let want = f64::from(row[c]) * inv * f64::from(w[c]);
                    assert!((f64::from(out[r * d + c]) - want).abs() < 1e-5 * (1.0 + want.abs()));
                }
            }
            let mut y = x.clone();
            rms_norm_inplace(&pool, &mut y, &w, 1e-6);
            assert_eq!(y, out);
        }
    }
}
