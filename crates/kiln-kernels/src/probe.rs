//! Quick machine probes for capacity planning and the benchmark examples: read bandwidth over a
//! buffer far larger than the caches, and the arithmetic rate of the quantized matmul kernel
//! (the one the models run). Each returns the best of several passes.

use std::time::Instant;

use crate::quant::quantize_row;
use crate::{GgmlType, ThreadPool, WeightMatrix, linear, vec_ops};

/// Bytes per second the pool's threads read from a `mib` MiB buffer, best of `passes`.
pub fn read_bandwidth(pool: &ThreadPool, mib: usize, passes: usize) -> f64 {
    let len = (mib.max(1) << 20) / 4;
    let data: Vec<f32> = (0..len).map(|i| (i % 7) as f32).collect();
    let ones = vec![1.0f32; 1 << 16];
    let chunk = ones.len();
    let mut best = f64::INFINITY;
    for _ in 0..passes.max(1) {
        let start = Instant::now();
        pool.run(len.div_ceil(chunk), |t| {
            let s = &data[t * chunk..((t + 1) * chunk).min(len)];
            std::hint::black_box(vec_ops::dot(s, &ones[..s.len()]));
        });
        best = best.min(start.elapsed().as_secs_f64());
    }
    (len * 4) as f64 / best
}

/// Operations per second (2 per multiply-add) of `linear` with an `[n, k]` matrix of `ty` and
/// `m` input rows, best of `passes` after one warm-up call; `None` if `k` is not a multiple of
/// the type's block.
pub fn matmul_ops(
    pool: &ThreadPool,
    ty: GgmlType,
    m: usize,
    n: usize,
    k: usize,
    passes: usize,
) -> Option<f64> {
    let w = pseudo_random_matrix(ty, n, k)?;
    let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3).collect();
    let mut out = vec![0.0f32; m * n];
    linear(pool, &x, m, &w, None, &mut out);
    let mut best = f64::INFINITY;
    for _ in 0..passes.max(1) {
        let start = Instant::now();
        linear(pool, &x, m, &w, None, &mut out);
        best = best.min(start.elapsed().as_secs_f64());
    }
    Some(2.0 * (m * n * k) as f64 / best)
}

/// An `[n, k]` matrix of `ty` quantized from 64 pseudo-random rows, cycled; `None` if `k` is
/// not a multiple of the type's block.
pub fn pseudo_random_matrix(ty: GgmlType, n: usize, k: usize) -> Option<WeightMatrix> {
    let rb = ty.row_bytes(k)?;
    let mut src = vec![vec![0u8; rb]; 64];
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    for row in &mut src {
        let vals: Vec<f32> = (0..k)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect();
        if GgmlType::WRITABLE.contains(&ty) {
            quantize_row(ty, &vals, row);
        } else {
            random_blocks(ty, &vals, row);
        }
    }
    let mut bytes = Vec::with_capacity(n * rb);
    for r in 0..n {
        bytes.extend_from_slice(&src[r % 64]);
    }
    WeightMatrix::from_quantized(n, k, ty, bytes.into())
}

/// Blocks of a type kiln does not write, for measuring: the level bytes from `vals`, every
/// scale field `1/64` (MXFP4: the exponent of `2⁻⁶`).
fn random_blocks(ty: GgmlType, vals: &[f32], row: &mut [u8]) {
    for (b, v) in row.iter_mut().zip(vals) {
        *b = ((v + 0.5) * 255.99) as u8;
    }
    let scale = half::f16::from_f32(1.0 / 64.0).to_le_bytes();
    for block in row.chunks_exact_mut(ty.block_bytes()) {
        crate::quant::formats::set_f16_scale(ty, block, scale);
        if ty == GgmlType::Mxfp4 {
            block[0] = 122;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_report_positive_rates() {
        let pool = ThreadPool::new(1);
        assert!(read_bandwidth(&pool, 8, 2) > 1e8);
        assert!(matmul_ops(&pool, GgmlType::Q8_0, 4, 64, 64, 2).unwrap() > 1e6);
        assert!(pseudo_random_matrix(GgmlType::Q8_0, 4, 33).is_none());
    }
}
