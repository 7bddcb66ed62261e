//! Tick placement and labels: an [`Axis`] is a fitted range (see `range`) plus the ticks that
//! plotters will label on it.
//!
//! plotters chooses ticks itself (the smallest 1/2/5 × 10^k step giving at most a hinted number
//! of them); [`Axis::new`] asks it for that choice, widens a linear range to whole multiples of
//! the step so the first and last ticks sit on the axis ends, and works out the hint under which
//! plotters labels exactly those multiples. Invariants: `lo < hi`; the range still contains the
//! fitted one; `values` are what plotters labels with `hint`; labels come from [`format_tick`]
//! with `step`, so neighbouring labels differ. A log axis keeps its whole decades.

use plotters::coord::types::RangedCoordf64;
use plotters::prelude::{IntoLogRange, LogCoord, Ranged};

/// An axis ready for plotters: its range, the label-count hint to pass to the mesh, and the
/// labels plotters will draw with that hint.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Axis {
    pub(super) lo: f64,
    pub(super) hi: f64,
    /// Passed to plotters as the most labels wanted; it then picks exactly `values`.
    pub(super) hint: usize,
    /// The tick values plotters labels.
    pub(super) values: Vec<f64>,
    /// Spacing of neighbouring ticks, for formatting.
    pub(super) step: f64,
}

impl Axis {
    /// An axis over a fitted `range` with at most about `max` labels. A linear axis is widened
    /// to whole multiples of the tick step so its first and last ticks sit on its ends; a log
    /// axis keeps its whole decades.
    pub(super) fn new((lo, hi): (f64, f64), log: bool, max: usize) -> Axis {
        if log {
            return Axis::with_hint(lo, hi, true, max);
        }
        // Rounding out adds up to two ticks; leave room for them.
        let first = Axis::with_hint(lo, hi, false, max.saturating_sub(2).max(2));
        // One tick or none (a tiny hint): one step spans the whole range.
        let step =
            if first.values.len() >= 2 { snap(first.step, false) } else { snap(hi - lo, true) };
        // The tolerance keeps values that are whole steps up to rounding from gaining a tick.
        let (k_lo, k_hi) = ((lo / step + 1e-9).floor(), (hi / step - 1e-9).ceil());
        let (l, h) = (k_lo * step, k_hi * step);
        let slack = step * 1e-6;
        if !(l.is_finite() && h.is_finite() && l <= lo + slack && h >= hi - slack && k_lo < k_hi) {
            return first;
        }
        // plotters takes the smallest 1/2/5 step giving at most `hint` ticks: with the count
        // of `step` multiples in `l..=h` as the hint, that is `step` again.
        let axis = Axis::with_hint(l, h, false, (k_hi - k_lo) as usize + 1);
        // plotters' tick search loses precision on extreme magnitudes (±1e200): keep the
        // unrounded axis unless the ticks really are the multiples from end to end.
        let on_ends = |v: Option<&f64>, end: f64| v.is_some_and(|v| (v - end).abs() <= slack);
        if on_ends(axis.values.first(), l) && on_ends(axis.values.last(), h) { axis } else { first }
    }

    fn with_hint(lo: f64, hi: f64, log: bool, hint: usize) -> Axis {
        let values = if log {
            LogCoord::from((lo..hi).log_scale()).key_points(hint)
        } else {
            RangedCoordf64::from(lo..hi).key_points(hint)
        };
        let step = values.windows(2).map(|w| (w[1] - w[0]).abs()).fold(f64::INFINITY, f64::min);
        let step = if step.is_finite() && step > 0.0 { step } else { (hi - lo).abs() };
        Axis { lo, hi, hint, values, step }
    }

    /// The tick labels, as drawn.
    pub(super) fn labels(&self) -> impl Iterator<Item = String> + '_ {
        self.values.iter().map(|v| format_tick(*v, self.step))
    }
}

/// `step` rounded to the nearest 1, 2, 5 or 10 × 10^k (undoing the float error of a step read
/// off plotters' tick values: 0.19999999999999996 becomes 0.2), or with `up` to the smallest
/// such value not below it.
fn snap(step: f64, up: bool) -> f64 {
    let magnitude = 10f64.powf((step.log10() + 1e-9).floor());
    let m = step / magnitude;
    let pick = if up {
        [1.0, 2.0, 5.0, 10.0].into_iter().find(|c| *c >= m * (1.0 - 1e-9)).unwrap_or(10.0)
    } else {
        let off = |c: f64| (m / c).ln().abs();
        [1.0, 2.0, 5.0, 10.0]
            .into_iter()
            .fold(1.0, |best, c| if off(c) < off(best) { c } else { best })
    };
    let snapped = pick * magnitude;
    if snapped.is_finite() && snapped > 0.0 { snapped } else { step }
}

/// Formats a tick value `v` on an axis whose tick spacing is `step`, with just enough digits to
/// tell neighbouring ticks apart. Very large or very small magnitudes use `1.5e7` notation.
pub(super) fn format_tick(v: f64, step: f64) -> String {
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

    #[test]
    fn linear_axes_end_on_ticks() {
        let labels = |a: &Axis| a.labels().collect::<Vec<_>>();
        let a = Axis::new((0.0, 103.0), false, 8);
        assert_eq!((a.lo, a.hi, a.step), (0.0, 120.0, 20.0));
        assert_eq!(labels(&a), ["0", "20", "40", "60", "80", "100", "120"]);
        let a = Axis::new((0.45, 2.55), false, 8);
        assert_eq!((a.lo, a.hi), (0.0, 3.0));
        assert_eq!(labels(&a), ["0", "0.5", "1.0", "1.5", "2.0", "2.5", "3.0"]);
        let a = Axis::new((-51.2, -8.8), false, 8);
        assert_eq!((a.lo, a.hi, a.values.len()), (-60.0, 0.0, 7));
        for range in [(0.0, 1.0), (4.5, 5.5), (0.9e16, 1.1e16), (8.2, 71.8), (-1.06e200, 1.06e200)]
        {
            for max in [2, 5, 10] {
                let a = Axis::new(range, false, max);
                assert!(a.lo <= range.0 && a.hi >= range.1 && a.lo < a.hi, "{range:?} {a:?}");
                assert!(a.values.len() <= max.max(3) + 1, "{range:?} {a:?}");
                if range.1 < 1e100 {
                    let ends = [a.values[0], a.values[a.values.len() - 1]];
                    assert!((ends[0] - a.lo).abs() <= 1e-6 * a.step, "{range:?} {a:?}");
                    assert!((ends[1] - a.hi).abs() <= 1e-6 * a.step, "{range:?} {a:?}");
                }
            }
        }
    }

    #[test]
    fn log_axes_are_labelled_at_decades() {
        let a = Axis::new((1.0, 10_000.0), true, 6);
        assert_eq!(a.values, [1.0, 10.0, 100.0, 1000.0, 10_000.0]);
        assert_eq!(a.labels().collect::<Vec<_>>(), ["1", "10", "100", "1000", "10000"]);
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
        assert_eq!(format_tick(1000.0, 1000.0), "1000");
    }

    #[test]
    fn axes_over_awkward_ranges_have_ticks() {
        let ranges = [(0.0, 1.0), (-1.0, 1.0), (4.5, 5.5), (-1.06e200, 1.06e200), (0.9e16, 1.1e16)];
        for range in ranges {
            let axis = Axis::new(range, false, 10);
            assert!(axis.step > 0.0 && !axis.values.is_empty(), "{axis:?}");
        }
        for range in [(1.0, 10.0), (1e-200, 1e-199), (1e199, 1e200), (0.1, 1e6)] {
            // plotters may find no decade inside the extreme 10^-200..10^-199 range.
            assert!(Axis::new(range, true, 10).step > 0.0, "{range:?}");
        }
    }
}
