//! The step-cost model a batch controller plans with: `seconds ≈ a + b·tokens + c·attention`,
//! refitted online from the steps the engine actually ran.
//!
//! `tokens` is a step's scheduled tokens (weights are read once per step and the matmuls grow
//! with the rows) and `attention` its attention work ([`crate::StepLoad::attention`]: tokens ×
//! context). The fit is least squares over the last [`WINDOW`] steps, with a small ridge term
//! so that a window of identical steps still gives a finite answer, and with every coefficient
//! kept non-negative (a coefficient that comes out negative is fixed at 0 and the rest refitted):
//! a step never gets cheaper by adding work.
//!
//! Features are scaled (`tokens / 1e3`, `attention / 1e6`) so the normal equations stay well
//! conditioned for steps from one token to many thousands.

use std::collections::VecDeque;

use crate::StepLoad;

/// Steps the fit looks back over.
pub const WINDOW: usize = 256;
/// Steps needed before the model predicts anything.
pub const MIN_SAMPLES: usize = 8;

const TOKEN_SCALE: f64 = 1e-3;
const ATTENTION_SCALE: f64 = 1e-6;
const RIDGE: f64 = 1e-9;

fn features(tokens: f64, attention: f64) -> [f64; 3] {
    [1.0, tokens * TOKEN_SCALE, attention * ATTENTION_SCALE]
}

/// `seconds ≈ a + b·tokens + c·attention` over a sliding window of measured steps.
#[derive(Clone, Debug, Default)]
pub struct StepCostModel {
    samples: VecDeque<([f64; 3], f64)>,
    /// `[a, b, c]` in scaled units; `None` until fitted.
    coefficients: Option<[f64; 3]>,
}

impl StepCostModel {
    /// Records one step that took `seconds`; non-finite or negative times are ignored.
    pub fn push(&mut self, load: &StepLoad, seconds: f64) {
        if !seconds.is_finite() || seconds < 0.0 || load.num_tokens == 0 {
            return;
        }
        if self.samples.len() == WINDOW {
            self.samples.pop_front();
        }
        self.samples.push_back((features(load.num_tokens as f64, load.attention), seconds));
    }

    /// Refits the coefficients from the window; `false` with too few steps (or a singular
    /// system), keeping the previous fit if there was one.
    pub fn fit(&mut self) -> bool {
        if self.samples.len() < MIN_SAMPLES {
            return false;
        }
        let mut active = [true; 3];
        loop {
            let Some(solution) = self.solve(active) else { return false };
            match solution.iter().position(|&c| c < 0.0) {
                Some(i) if active.iter().filter(|&&a| a).count() > 1 => active[i] = false,
                _ => {
                    self.coefficients = Some(solution.map(|c| c.max(0.0)));
                    return true;
                }
            }
        }
    }

    /// Least squares over the active features (inactive ones fixed at 0).
    fn solve(&self, active: [bool; 3]) -> Option<[f64; 3]> {
        let idx: Vec<usize> = (0..3).filter(|&i| active[i]).collect();
        let n = idx.len();
        // [n, n + 1]: the normal equations' matrix with the right-hand side as last column.
        let mut m = vec![vec![0.0f64; n + 1]; n];
        for (x, y) in &self.samples {
            for (r, &i) in idx.iter().enumerate() {
                for (c, &j) in idx.iter().enumerate() {
                    m[r][c] += x[i] * x[j];
                }
                m[r][n] += x[i] * y;
            }
        }
        let trace: f64 = (0..n).map(|i| m[i][i]).sum();
        for (r, row) in m.iter_mut().enumerate() {
            row[r] += RIDGE * trace.max(1e-12);
        }
        // Gaussian elimination with partial pivoting.
        for col in 0..n {
            let pivot = (col..n).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))?;
            m.swap(col, pivot);
            let p = m[col][col];
            if p.abs() < 1e-300 {
                return None;
            }
            let pivot_row = m[col].clone();
            for (r, row) in m.iter_mut().enumerate() {
                if r != col {
                    let f = row[col] / p;
                    for (x, y) in row.iter_mut().zip(&pivot_row).skip(col) {
                        *x -= f * y;
                    }
                }
            }
        }
        let mut out = [0.0; 3];
        for (r, &i) in idx.iter().enumerate() {
            out[i] = m[r][n] / m[r][r];
        }
        out.iter().all(|c| c.is_finite()).then_some(out)
    }

    /// Whether the model has been fitted.
    pub fn is_fitted(&self) -> bool {
        self.coefficients.is_some()
    }

    /// Predicted seconds of a step with `tokens` tokens and `attention` work.
    pub fn predict(&self, tokens: f64, attention: f64) -> Option<f64> {
        let c = self.coefficients?;
        let x = features(tokens, attention);
        Some(c[0] * x[0] + c[1] * x[1] + c[2] * x[2])
    }

    /// Seconds of a step with no work (the fixed part `a`).
    pub fn fixed_seconds(&self) -> Option<f64> {
        Some(self.coefficients?[0])
    }

    /// Seconds one more token adds when it attends to `context` positions.
    pub fn seconds_per_token(&self, context: f64) -> Option<f64> {
        let c = self.coefficients?;
        Some(c[1] * TOKEN_SCALE + c[2] * context * ATTENTION_SCALE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(tokens: usize, attention: f64) -> StepLoad {
        StepLoad { num_tokens: tokens, attention, ..StepLoad::default() }
    }

    #[test]
    fn recovers_a_linear_cost() {
        let mut m = StepCostModel::default();
        for i in 1..=64usize {
            let (tokens, attention) = (i * 17 % 500 + 1, (i * 7919 % 100_000) as f64);
            let secs = 0.004 + 2e-5 * tokens as f64 + 3e-9 * attention;
            m.push(&load(tokens, attention), secs);
        }
        assert!(m.fit());
        assert!((m.fixed_seconds().unwrap() - 0.004).abs() < 1e-9);
        assert!((m.seconds_per_token(1000.0).unwrap() - (2e-5 + 3e-6)).abs() < 1e-10);
        assert!((m.predict(300.0, 50_000.0).unwrap() - (0.004 + 0.006 + 1.5e-4)).abs() < 1e-9);
    }

    #[test]
    fn identical_steps_still_fit_and_predict_them() {
        let mut m = StepCostModel::default();
        assert!(!m.fit());
        for _ in 0..MIN_SAMPLES {
            m.push(&load(64, 6400.0), 0.05);
        }
        assert!(m.fit());
        assert!((m.predict(64.0, 6400.0).unwrap() - 0.05).abs() < 1e-6);
        assert!(m.seconds_per_token(0.0).unwrap() >= 0.0);
    }

    #[test]
    fn coefficients_stay_non_negative() {
        let mut m = StepCostModel::default();
        // Time falls as attention grows: a negative attention cost would fit best.
        for i in 1..=32usize {
            m.push(&load(100, i as f64 * 10_000.0), 0.02 - i as f64 * 1e-4);
        }
        assert!(m.fit());
        assert!(m.seconds_per_token(1e6).unwrap() >= 0.0);
        assert!(m.fixed_seconds().unwrap() >= 0.0);
    }
}
