//! An event rate as an exponentially decaying sum: each event adds `amount / τ` and the sum
//! decays by `e^(−Δt/τ)` between events, so under a steady stream it reads `amount` per second
//! averaged over about the last `τ` seconds of whatever clock the caller keeps.

/// A decaying event rate (module docs).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct DecayingRate {
    sum: f64,
    /// Clock readings of the first and the last event.
    first: Option<f64>,
    last: Option<f64>,
}

impl DecayingRate {
    /// Records an event of `amount` at `now` (a clock that never goes back), with time constant
    /// `tau` seconds.
    pub(crate) fn record(&mut self, amount: f64, now: f64, tau: f64) {
        if let Some(last) = self.last {
            self.sum *= (-(now - last).max(0.0) / tau).exp();
        }
        self.sum += amount / tau;
        self.first.get_or_insert(now);
        self.last = Some(now);
    }

    /// The rate as of the last event (0 before any).
    pub(crate) fn as_of_last_event(&self) -> f64 {
        self.sum
    }

    /// The rate at `now` (`None` before any event): decayed since the last event, and divided
    /// by the share of `tau` the events have covered, `1 − e^(−elapsed/tau)` (with `elapsed`
    /// at least a second), so the first events do not read as a rate many times too low.
    pub(crate) fn corrected_at(&self, now: f64, tau: f64) -> Option<f64> {
        let (first, last) = (self.first?, self.last?);
        let decayed = self.sum * (-(now - last).max(0.0) / tau).exp();
        let covered = 1.0 - (-(now - first).max(1.0) / tau).exp();
        Some(decayed / covered)
    }
}
