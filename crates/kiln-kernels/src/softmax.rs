//! Softmax and log-softmax over one row, numerically stable (max subtracted first).

/// `x = softmax(x)`; an empty row is left alone. Rows of all `-inf` become uniform zeros.
pub fn softmax_inplace(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        x.fill(0.0);
        return;
    }
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `log(sum(exp(x)))`, stable.
pub fn log_sum_exp(x: &[f32]) -> f32 {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return max;
    }
    let sum: f32 = x.iter().map(|v| (v - max).exp()).sum();
    max + sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_to_one_and_survives_large_values() {
        let mut x = vec![1000.0, 1001.0, 999.0, f32::NEG_INFINITY];
        softmax_inplace(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(x[3], 0.0);
        assert!(x[1] > x[0] && x[0] > x[2]);
        let lse = log_sum_exp(&[0.0, 0.0]);
        assert!((lse - 2f32.ln()).abs() < 1e-6);
    }
}
