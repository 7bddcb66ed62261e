//! Axis ranges fitted to the data, and series split into drawable pieces.
//!
//! plotters needs a finite, non-empty range for each axis, and its tick search does not
//! terminate on infinite or denormal spans. So the data range is fitted here:
//!
//! - a linear axis pads the finite data range by 3% on each side, never across zero (data that
//!   is all non-negative keeps a lower bound of at least zero); a range too narrow to tell apart
//!   from its own magnitude (one value, all equal) becomes ±10% around it, or ±1 around zero;
//! - a log10 axis spans whole decades around the positive data, 10^-200 ..= 10^200 at most.
//!
//! Invariants of every fitted `(lo, hi)`, whatever the input (empty, NaN, infinite, `f64::MAX`):
//! `lo < hi`, both finite, `|lo|, |hi| <= 1.1 * VALUE_LIMIT`; on a linear axis `hi - lo` is at
//! least `1e-100` and at least `1e-9` of the larger magnitude; on a log axis both ends are
//! powers of ten in 10^-200 ..= 10^200, at least one decade apart. Values are clamped to
//! ±[`VALUE_LIMIT`] before fitting, and [`runs`] clamps points the same way, so every point
//! drawn lies within the fitted ranges.

/// Magnitude beyond which data values are clamped before fitting and drawing.
pub(super) const VALUE_LIMIT: f64 = 1e200;
/// Fraction of the data span added on each side of a linear axis.
const PAD_FRACTION: f64 = 0.03;
/// Decade exponents a log axis stays within.
const MAX_DECADE: f64 = 200.0;

/// Whether the point can be shown: both coordinates finite, and x positive on a log x axis.
pub(super) fn drawable((x, y): (f64, f64), x_log: bool) -> bool {
    x.is_finite() && y.is_finite() && (!x_log || x > 0.0)
}

/// The pieces of a series between points that cannot be shown, each non-empty, with
/// coordinates clamped to ±[`VALUE_LIMIT`] (and x to at least 10^-200 on a log axis).
pub(super) fn runs(points: &[(f64, f64)], x_log: bool) -> Vec<Vec<(f64, f64)>> {
    let x_min = if x_log { 10f64.powf(-MAX_DECADE) } else { -VALUE_LIMIT };
    let mut runs = vec![Vec::new()];
    for &p in points {
        if drawable(p, x_log) {
            let clamped = (p.0.clamp(x_min, VALUE_LIMIT), p.1.clamp(-VALUE_LIMIT, VALUE_LIMIT));
            if let Some(run) = runs.last_mut() {
                run.push(clamped);
            }
        } else if runs.last().is_some_and(|r| !r.is_empty()) {
            runs.push(Vec::new());
        }
    }
    runs.retain(|r| !r.is_empty());
    runs
}

/// The smallest and largest finite value (clamped), if any.
fn min_max(values: impl IntoIterator<Item = f64>) -> Option<(f64, f64)> {
    values.into_iter().filter(|v| v.is_finite()).map(|v| v.clamp(-VALUE_LIMIT, VALUE_LIMIT)).fold(
        None,
        |acc, v| match acc {
            None => Some((v, v)),
            Some((lo, hi)) => Some((v.min(lo), v.max(hi))),
        },
    )
}

/// A linear axis range for `values` (see module docs).
pub(super) fn fit_linear(values: impl IntoIterator<Item = f64>) -> (f64, f64) {
    let Some((min, max)) = min_max(values) else { return (0.0, 1.0) };
    let pad = (max - min) * PAD_FRACTION;
    let lo = if min >= 0.0 { (min - pad).max(0.0) } else { min - pad };
    let hi = if max <= 0.0 { (max + pad).min(0.0) } else { max + pad };
    let needed = (1e-9 * lo.abs().max(hi.abs())).max(1e-100);
    if hi - lo >= needed {
        return (lo, hi);
    }
    let mid = min / 2.0 + max / 2.0;
    let half = if mid.abs() > 1e-90 { mid.abs() * 0.1 } else { 1.0 };
    (mid - half, mid + half)
}

/// A log10 axis range of whole decades for the positive `values` (see module docs).
pub(super) fn fit_log(values: impl IntoIterator<Item = f64>) -> (f64, f64) {
    let Some((min, max)) = min_max(values.into_iter().filter(|v| *v > 0.0)) else {
        return (1.0, 10.0);
    };
    let (l_min, l_max) = (min.log10(), max.log10());
    let pad = if l_max > l_min { (l_max - l_min) * PAD_FRACTION } else { 0.5 };
    let lo = (l_min - pad).floor().clamp(-MAX_DECADE, MAX_DECADE - 1.0);
    let hi = (l_max + pad).ceil().clamp(lo + 1.0, MAX_DECADE);
    (10f64.powf(lo), 10f64.powf(hi))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(lo: f64, hi: f64) {
        assert!(lo.is_finite() && hi.is_finite() && lo < hi, "{lo}..{hi}");
        assert!(lo.abs() <= 1.1 * VALUE_LIMIT && hi.abs() <= 1.1 * VALUE_LIMIT, "{lo}..{hi}");
        assert!(hi - lo >= 1e-100 && hi - lo >= 1e-9 * lo.abs().max(hi.abs()), "{lo}..{hi}");
    }

    #[test]
    fn linear_fit_pads_without_crossing_zero() {
        let (lo, hi) = fit_linear([0.0, 100.0]);
        assert_eq!(lo, 0.0);
        assert!((hi - 103.0).abs() < 1e-9);
        let (lo, hi) = fit_linear([-50.0, -10.0]);
        assert!((lo + 51.2).abs() < 1e-9 && (hi + 8.8).abs() < 1e-9, "{lo}..{hi}");
        assert_eq!(fit_linear([5.0, 5.0]), (4.5, 5.5));
        assert_eq!(fit_linear([]), (0.0, 1.0));
        assert_eq!(fit_linear([0.0]), (-1.0, 1.0));
    }

    #[test]
    fn awkward_inputs_keep_the_invariants() {
        let cases: Vec<Vec<f64>> = vec![
            vec![],
            vec![f64::NAN, f64::INFINITY, f64::NEG_INFINITY],
            vec![7.0],
            vec![-2.5; 4],
            vec![1e-300, 2e-300],
            vec![f64::MAX, f64::MIN],
            vec![1e16, 1e16 + 2.0],
            vec![f64::MIN_POSITIVE],
        ];
        for values in &cases {
            let (lo, hi) = fit_linear(values.iter().copied());
            check(lo, hi);
            let (lo, hi) = fit_log(values.iter().copied());
            assert!(lo >= 0.999e-200 && hi <= 1.001e200 && hi / lo >= 9.99, "{lo:e}..{hi:e}");
        }
    }

    #[test]
    fn log_fit_spans_whole_decades() {
        assert_eq!(fit_log([3.0, 4500.0, -1.0, 0.0]), (1.0, 10_000.0));
        assert_eq!(fit_log([]), (1.0, 10.0));
        assert_eq!(fit_log([f64::MAX]), (1e199, 1e200));
    }

    #[test]
    fn runs_break_at_points_that_cannot_be_shown() {
        let nan = f64::NAN;
        let pts = [(nan, 1.0), (1.0, 1.0), (2.0, nan), (3.0, 3.0), (4.0, 4.0), (-1.0, 0.0)];
        assert_eq!(
            runs(&pts, false),
            vec![vec![(1.0, 1.0)], vec![(3.0, 3.0), (4.0, 4.0), (-1.0, 0.0)]]
        );
        assert_eq!(runs(&pts, true), vec![vec![(1.0, 1.0)], vec![(3.0, 3.0), (4.0, 4.0)]]);
        assert_eq!(runs(&[(f64::MAX, 0.0)], false), vec![vec![(VALUE_LIMIT, 0.0)]]);
        assert!(runs(&[], false).is_empty());
    }
}
