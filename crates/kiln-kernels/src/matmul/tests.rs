use half::{bf16, f16};

use super::*;

fn values(n: usize, seed: u64) -> Vec<f32> {
    crate::testing::values(n, seed, 1.0)
}

fn reference(x: &[f32], m: usize, w: &[f32], n: usize, k: usize, bias: Option<&[f32]>) -> Vec<f32> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f64;
            for c in 0..k {
                acc += f64::from(x[i * k + c]) * f64::from(w[j * k + c]);
            }
            out[i * n + j] = acc as f32 + bias.map_or(0.0, |b| b[j]);
        }
    }
    out
}

fn matrices(n: usize, k: usize) -> Vec<(WeightMatrix, Vec<f32>)> {
    let w = values(n * k, 11);
    let w16: Vec<f16> = w.iter().map(|v| f16::from_f32(*v)).collect();
    let wb: Vec<bf16> = w.iter().map(|v| bf16::from_f32(*v)).collect();
    let w16_f32 = w16.iter().map(|v| v.to_f32()).collect();
    let wb_f32 = wb.iter().map(|v| v.to_f32()).collect();
    vec![
        (WeightMatrix::new(n, k, WeightData::F32(w.clone().into())).unwrap(), w),
        (WeightMatrix::new(n, k, WeightData::F16(w16.into())).unwrap(), w16_f32),
        (WeightMatrix::new(n, k, WeightData::Bf16(wb.into())).unwrap(), wb_f32),
    ]
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{what}: [{i}] got {g} want {w}");
    }
}

#[test]
fn every_path_and_dtype_matches_the_reference_over_odd_shapes() {
    let pool = ThreadPool::new(2);
    for (n, k) in [(1, 1), (5, 17), (33, 40), (70, 129), (130, 64)] {
        let bias = values(n, 5);
        for (w, w_f32) in matrices(n, k) {
            for m in [1usize, 2, 3, 4, 5, 9, 16, 17, 40] {
                let x = values(m * k, 3 + m as u64);
                let want = reference(&x, m, &w_f32, n, k, Some(&bias));
                let mut out = vec![f32::NAN; m * n];
                linear(&pool, &x, m, &w, Some(&bias), &mut out);
                assert_close(&out, &want, &format!("{} m={m} n={n} k={k}", w.data.dtype_name()));
            }
        }
    }
}

#[test]
fn gemv_simd_levels_match_scalar() {
    for (n, k) in [(4, 16), (7, 31), (9, 100)] {
        for (w, w_f32) in matrices(n, k) {
            for m in [1usize, 2, 3, 4, 6, 9] {
                let x = values(m * k, 9);
                let want = reference(&x, m, &w_f32, n, k, None);
                for level in SimdLevel::available() {
                    let mut out = vec![f32::NAN; m * n];
                    gemv_rows(level, &x, m, &w, 0..n, SharedMut::new(&mut out));
                    assert_close(&out, &want, &format!("{level:?} m={m} n={n} k={k}"));
                    // Bitwise: each row alone equals the same row inside the batch.
                    for r in 0..m {
                        let mut alone = vec![f32::NAN; n];
                        let xr = &x[r * k..(r + 1) * k];
                        gemv_rows(level, xr, 1, &w, 0..n, SharedMut::new(&mut alone));
                        assert_eq!(alone, out[r * n..(r + 1) * n], "{level:?} row {r} of {m}");
                    }
                    assert_close(&out, &want, &format!("{level:?} m={m} n={n} k={k}"));
                }
            }
        }
    }
}

#[test]
fn linear_multi_fills_every_output() {
    let pool = ThreadPool::new(2);
    let (k, m) = (48, 3);
    let x = values(m * k, 1);
    let mats = [matrices(40, k), matrices(8, k)];
    let (wa, wa_f32) = &mats[0][2];
    let (wb, wb_f32) = &mats[1][0];
    let mut oa = vec![f32::NAN; m * 40];
    let mut ob = vec![f32::NAN; m * 8];
    linear_multi(
        &pool,
        &x,
        m,
        &mut [
            LinearJob { weight: wa, bias: None, out: &mut oa },
            LinearJob { weight: wb, bias: None, out: &mut ob },
        ],
    );
    assert_close(&oa, &reference(&x, m, wa_f32, 40, k, None), "a");
    assert_close(&ob, &reference(&x, m, wb_f32, 8, k, None), "b");
}

#[test]
fn mismatched_data_length_is_rejected() {
    assert!(WeightMatrix::new(3, 4, WeightData::F32(vec![0.0; 11].into())).is_none());
    assert!(WeightMatrix::new(usize::MAX, 2, WeightData::F32(vec![].into())).is_none());
}

/// bf16 weights with bf16 dots: each output is the f64 dot product of the activations rounded
/// to bf16 with the weights, within f32 summation error, with bias; a row's bits do not depend
/// on the batch; and f32 / f16 data ignore the flag.
#[test]
fn bf16_dots_round_the_activations_and_keep_rows_independent() {
    let pool = ThreadPool::new(2);
    for (n, k) in [(5, 17), (70, 129), (130, 640)] {
        let bias = values(n, 5);
        let wb: Vec<bf16> = values(n * k, 11).iter().map(|v| bf16::from_f32(*v)).collect();
        let w_f32: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
        let w = WeightMatrix::new(n, k, WeightData::Bf16(wb.into())).unwrap().with_bf16_dots();
        assert!(w.bf16_dots());
        let x = values(40 * k, 3);
        let xr: Vec<f32> =
            x.iter().map(|v| f32::from_bits(u32::from(round_to_bf16(*v)) << 16)).collect();
        let mut first = Vec::new();
        for m in [1usize, 3, 17, 40] {
            let want = reference(&xr[..m * k], m, &w_f32, n, k, Some(&bias));
            let mut out = vec![f32::NAN; m * n];
            linear(&pool, &x[..m * k], m, &w, Some(&bias), &mut out);
            assert_close(&out, &want, &format!("bf16 dots m={m} n={n} k={k}"));
            if m == 1 {
                first = out[..n].to_vec();
            }
            assert_eq!(
                out[..n].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                first.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "row 0 changed with m={m}"
            );
        }
    }
    let f32_matrix = WeightMatrix::new(2, 2, WeightData::F32(vec![1.0; 4].into())).unwrap();
    assert!(!f32_matrix.with_bf16_dots().bf16_dots());
}
