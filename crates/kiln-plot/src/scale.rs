//! Axis scales: fitting a data range, "nice" tick values and tick labels.
//!
//! A linear axis pads the finite data range by a few percent (never across zero: data that is
//! all non-negative keeps a lower bound of zero) and then widens it to whole multiples of a tick
//! step of 1, 2 or 5 × 10^k, so the first and last ticks sit on the axis ends. A log10 axis spans
//! whole decades. Invariants of every [`Axis`], whatever the input (empty, one value, all equal,
//! NaN or infinite values, values near `f64::MAX`):
//!
//! - `lo < hi`, both finite (and both positive on a log axis);
//! - `ticks` is non-empty, ascending, within `[lo, hi]`, and has at most [`MAX_TICKS`] entries;
//! - `labels` has one label per tick.
//!
//! Non-finite values are ignored, as are non-positive values on a log axis. Finite values are
//! clamped to ±[`VALUE_LIMIT`] so that spans never overflow.

/// Most ticks an axis ever carries; wider requests fall back to coarser steps.
pub(crate) const MAX_TICKS: usize = 60;
/// Magnitude beyond which data values are clamped before fitting.
pub(crate) const VALUE_LIMIT: f64 = 1e300;
/// Fraction of the data span added on each side before rounding out to ticks.
const PAD_FRACTION: f64 = 0.03;

/// Ticks laid on a closed range: `values` run from `lo` to `hi` in steps of `step`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Ticks {
    pub lo: f64,
    pub hi: f64,
    pub step: f64,
    pub values: Vec<f64>,
}

/// Picks a 1/2/5 × 10^k step giving about `target` intervals over `[lo, hi]`, and widens the
/// range outwards to whole steps. Requires `lo < hi`, both finite; otherwise (or if the step
/// underflows or would give more than [`MAX_TICKS`] ticks) the range is returned unchanged with
/// just its two ends as ticks.
pub(crate) fn nice_ticks(lo: f64, hi: f64, target: usize) -> Ticks {
    let fallback = || Ticks { lo, hi, step: hi - lo, values: vec![lo, hi] };
    let span = hi - lo;
    if !(span.is_finite() && span > 0.0) {
        return fallback();
    }
    let step = nice_step(span / target.max(1) as f64);
    if !(step.is_finite() && step > 0.0) {
        return fallback();
    }
    // A small tolerance keeps values that are whole steps up to rounding from gaining a tick.
    let k_lo = (lo / step + 1e-9).floor();
    let k_hi = (hi / step - 1e-9).ceil();
    let count = k_hi - k_lo + 1.0;
    if !(2.0..=MAX_TICKS as f64).contains(&count) {
        return fallback();
    }
    let values: Vec<f64> = (0..count as usize).map(|i| (k_lo + i as f64) * step).collect();
    // Huge offsets relative to the step (1e16 + 0.5 k) lose precision; refuse such ticks.
    let distinct = values.windows(2).all(|w| w[0] < w[1]);
    if !distinct || !values.iter().all(|v| v.is_finite()) {
        return fallback();
    }
    Ticks { lo: k_lo * step, hi: k_hi * step, step, values }
}

/// The 1, 2, 5 or 10 × 10^k nearest to `raw` (for positive finite `raw`), so the interval
/// count lands near the target rather than always at or below it.
fn nice_step(raw: f64) -> f64 {
    let mag = 10f64.powi(raw.log10().floor() as i32);
    let norm = raw / mag;
    let mult = if norm < 1.5 {
        1.0
    } else if norm < 3.0 {
        2.0
    } else if norm < 7.0 {
        5.0
    } else {
        10.0
    };
    mult * mag
}

/// A fitted axis: its range, tick positions and their labels (see module docs for invariants).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Axis {
    pub lo: f64,
    pub hi: f64,
    pub log: bool,
    pub ticks: Vec<f64>,
    pub labels: Vec<String>,
}

impl Axis {
    /// Fits an axis to `values`, aiming for about `target` tick intervals.
    pub(crate) fn fit(values: impl IntoIterator<Item = f64>, log: bool, target: usize) -> Axis {
        let usable = values
            .into_iter()
            .filter(|v| v.is_finite() && (!log || *v > 0.0))
            .map(|v| v.clamp(-VALUE_LIMIT, VALUE_LIMIT));
        let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
        for v in usable {
            min = min.min(v);
            max = max.max(v);
        }
        let range = (min <= max).then_some((min, max));
        if log { Self::fit_log(range, target) } else { Self::fit_linear(range, target) }
    }

    fn fit_linear(range: Option<(f64, f64)>, target: usize) -> Axis {
        let (lo, hi) = match range {
            None => (0.0, 1.0),
            Some((v, w)) if v == w => around(v),
            Some((min, max)) => {
                let pad = (max - min) * PAD_FRACTION;
                let lo = if min >= 0.0 { (min - pad).max(0.0) } else { min - pad };
                let hi = if max <= 0.0 { (max + pad).min(0.0) } else { max + pad };
                (lo, hi)
            }
        };
        let ticks = nice_ticks(lo, hi, target);
        let labels = ticks.values.iter().map(|&v| format_tick(v, ticks.step)).collect();
        Axis { lo: ticks.lo, hi: ticks.hi, log: false, ticks: ticks.values, labels }
    }

    fn fit_log(range: Option<(f64, f64)>, target: usize) -> Axis {
        let (min, max) = range.unwrap_or((1.0, 10.0));
        let (l_min, l_max) = (min.log10(), max.log10());
        let pad = if l_max > l_min { (l_max - l_min) * PAD_FRACTION } else { 0.5 };
        // Exponents stay within about ±324, so whole-decade arithmetic in f64 is exact.
        let d_lo = (l_min - pad).floor().max(f64::from(f64::MIN_10_EXP));
        let d_hi = (l_max + pad).ceil().min(f64::from(f64::MAX_10_EXP)).max(d_lo + 1.0);
        let decades = d_hi - d_lo;
        let every = (decades / target.max(1) as f64).ceil().max(1.0);
        let mut ticks = Vec::new();
        let mut d = d_lo;
        while d <= d_hi && ticks.len() < MAX_TICKS {
            let base = 10f64.powi(d as i32);
            ticks.push(base);
            // Few decades: also mark 2× and 5× so the axis is not bare.
            if decades <= 2.0 && d < d_hi {
                ticks.extend([2.0 * base, 5.0 * base]);
            }
            d += every;
        }
        let labels = ticks.iter().map(|&v| format_tick(v, v)).collect();
        Axis { lo: 10f64.powi(d_lo as i32), hi: 10f64.powi(d_hi as i32), log: true, ticks, labels }
    }

    /// Position of `v` along the axis as a fraction: 0 at `lo`, 1 at `hi` (values outside the
    /// range give fractions outside `0..=1`). `None` for values the axis cannot show.
    pub(crate) fn frac(&self, v: f64) -> Option<f64> {
        if !v.is_finite() || (self.log && v <= 0.0) {
            return None;
        }
        let v = v.clamp(-VALUE_LIMIT, VALUE_LIMIT);
        let f = if self.log {
            (v.log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10())
        } else {
            // Halved terms keep the span finite even for ranges near ±VALUE_LIMIT.
            (v / 2.0 - self.lo / 2.0) / (self.hi / 2.0 - self.lo / 2.0)
        };
        f.is_finite().then_some(f)
    }

    /// Character count of the longest tick label.
    pub(crate) fn max_label_chars(&self) -> usize {
        self.labels.iter().map(|l| l.chars().count()).max().unwrap_or(0)
    }
}

/// A non-empty range around a single value `v`: ±10% of it, or ±1 around zero.
fn around(v: f64) -> (f64, f64) {
    let half = v.abs() * 0.1;
    if half > f64::MIN_POSITIVE * 1e3 { (v - half, v + half) } else { (v - 1.0, v + 1.0) }
}

/// Formats a tick value `v` on an axis whose tick spacing is `step`, with just enough digits to
/// tell neighbouring ticks apart. Very large or very small magnitudes use `1.5e7` notation.
pub(crate) fn format_tick(v: f64, step: f64) -> String {
    if v == 0.0 || v.abs() < step.abs() * 1e-9 {
        return "0".to_string();
    }
    // The tolerance keeps exact powers of ten (log10 may return -0.999...) in their decade.
    let exp_v = (v.abs().log10() + 1e-9).floor();
    let exp_step =
        if step > 0.0 && step.is_finite() { (step.log10() + 1e-9).floor() } else { exp_v };
    if v.abs() >= 1e6 || v.abs() < 1e-4 {
        let digits = (exp_v - exp_step).clamp(0.0, 6.0) as usize;
        let s = format!("{v:.digits$e}");
        // Drop trailing zeros of the mantissa: "2.50e6" -> "2.5e6", "3.0e-5" -> "3e-5".
        return match s.split_once('e') {
            Some((m, e)) if m.contains('.') => {
                format!("{}e{e}", m.trim_end_matches('0').trim_end_matches('.'))
            }
            _ => s,
        };
    }
    let decimals = (-exp_step).clamp(0.0, 12.0) as usize;
    format!("{v:.decimals$}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-9 * y.abs().max(1.0), "{a:?} vs {b:?}");
        }
    }

    fn check_invariants(axis: &Axis) {
        assert!(axis.lo.is_finite() && axis.hi.is_finite() && axis.lo < axis.hi, "{axis:?}");
        assert!(!axis.ticks.is_empty() && axis.ticks.len() <= MAX_TICKS, "{axis:?}");
        assert_eq!(axis.ticks.len(), axis.labels.len());
        assert!(axis.ticks.windows(2).all(|w| w[0] < w[1]), "{axis:?}");
        let eps = (axis.hi - axis.lo) * 1e-9;
        assert!(axis.ticks.iter().all(|&t| t >= axis.lo - eps && t <= axis.hi + eps));
    }

    #[test]
    fn range_zero_to_97_gives_steps_of_20() {
        let t = nice_ticks(0.0, 97.0, 5);
        assert_eq!(t.step, 20.0);
        assert_close(&t.values, &[0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);
        assert_eq!((t.lo, t.hi), (0.0, 100.0));
    }

    #[test]
    fn steps_are_one_two_or_five_times_a_power_of_ten() {
        assert_eq!(nice_ticks(0.0, 1.0, 5).step, 0.2);
        assert_eq!(nice_ticks(0.0, 10.0, 10).step, 1.0);
        assert_eq!(nice_ticks(0.0, 42.0, 5).step, 10.0);
        assert_eq!(nice_ticks(3.0, 4.0, 4).step, 0.2);
        assert_eq!(nice_ticks(0.0, 100.0, 2).step, 50.0);
        assert_eq!(nice_ticks(0.0, 1000.0, 1).step, 1000.0);
        assert_close(&nice_ticks(-3.2, 7.9, 5).values, &[-4.0, -2.0, 0.0, 2.0, 4.0, 6.0, 8.0]);
        assert_close(&nice_ticks(0.013, 0.087, 4).values, &[0.0, 0.02, 0.04, 0.06, 0.08, 0.1]);
    }

    #[test]
    fn degenerate_ranges_fall_back_to_their_ends() {
        let t = nice_ticks(5.0, 5.0, 5);
        assert_eq!(t.values, vec![5.0, 5.0]);
        let t = nice_ticks(0.0, f64::NAN, 5);
        assert_eq!(t.values.len(), 2);
    }

    #[test]
    fn linear_fit_pads_without_crossing_zero() {
        let axis = Axis::fit([0.0, 97.0], false, 5);
        assert_close(&axis.ticks, &[0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);
        assert_eq!(axis.labels, ["0", "20", "40", "60", "80", "100"]);
        // Data touching a tick gets room beyond it.
        let axis = Axis::fit([10.0, 100.0], false, 5);
        assert!(axis.hi > 100.0 && axis.lo < 10.0, "{axis:?}");
        check_invariants(&axis);
        let axis = Axis::fit([-50.0, -3.0], false, 5);
        assert_eq!(axis.hi, 0.0);
        check_invariants(&axis);
    }

    #[test]
    fn awkward_inputs_keep_the_invariants() {
        let cases: Vec<Vec<f64>> = vec![
            vec![],
            vec![f64::NAN, f64::INFINITY, f64::NEG_INFINITY],
            vec![7.0],
            vec![0.0, 0.0, 0.0],
            vec![-2.5; 4],
            vec![1e-300, 2e-300],
            vec![f64::MAX, f64::MIN],
            vec![1e16, 1e16 + 2.0],
            vec![f64::MIN_POSITIVE],
        ];
        for values in &cases {
            for log in [false, true] {
                for target in [0, 1, 5, 1000] {
                    check_invariants(&Axis::fit(values.iter().copied(), log, target));
                }
            }
        }
    }

    #[test]
    fn log_axis_spans_whole_decades() {
        let axis = Axis::fit([3.0, 4500.0, -1.0, 0.0], true, 6);
        assert_eq!((axis.lo, axis.hi), (1.0, 10_000.0));
        assert_eq!(axis.labels, ["1", "10", "100", "1000", "10000"]);
        assert_eq!(axis.frac(100.0), Some(0.5));
        assert_eq!(axis.frac(0.0), None);
        let narrow = Axis::fit([20.0, 300.0], true, 6);
        assert_eq!(narrow.labels, ["10", "20", "50", "100", "200", "500", "1000"]);
    }

    #[test]
    fn frac_maps_range_ends_to_zero_and_one() {
        let axis = Axis::fit([0.0, 97.0], false, 5);
        assert_eq!(axis.frac(0.0), Some(0.0));
        assert_eq!(axis.frac(100.0), Some(1.0));
        assert_eq!(axis.frac(50.0), Some(0.5));
        assert_eq!(axis.frac(f64::NAN), None);
    }

    #[test]
    fn tick_labels_have_just_enough_digits() {
        assert_eq!(format_tick(0.1 + 0.2, 0.1), "0.3");
        assert_eq!(format_tick(1.0, 0.2), "1.0");
        assert_eq!(format_tick(-0.0, 0.5), "0");
        assert_eq!(format_tick(1e-17, 0.1), "0");
        assert_eq!(format_tick(2_500_000.0, 500_000.0), "2.5e6");
        assert_eq!(format_tick(3e6, 1e6), "3e6");
        assert_eq!(format_tick(0.00003, 0.00001), "3e-5");
        assert_eq!(format_tick(150.0, 50.0), "150");
    }
}
