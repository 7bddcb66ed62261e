//! Engine busy time under the metrics prefix (kiln's own; vLLM has no such series): counters
//! `kiln:engine_busy_seconds_total` (wall time the engine spent in steps: scheduling, the
//! forward passes, sampling and the KV tier's copies) and `kiln:engine_forward_seconds_total`
//! (of that, the model's forward passes), advanced by the delta of the engine's totals like the
//! other counters. `rate(kiln:engine_busy_seconds_total[5m])` is the fraction of time the engine
//! worked, 0..=1: below 1 while requests wait means capacity is left unused (the deployment's
//! alert rules watch it).

use std::time::Duration;

use prometheus_client::registry::Registry;

use super::{SecondsCounter, advance_seconds};

#[derive(Debug, Default)]
pub(super) struct BusyMetrics {
    busy: SecondsCounter,
    forward: SecondsCounter,
}

/// The engine's time totals as of the previous update.
#[derive(Debug, Default)]
pub(super) struct BusyTotals {
    step: Duration,
    forward: Duration,
}

impl BusyMetrics {
    pub(super) fn register(&self, r: &mut Registry, prefix: &str) {
        r.register(
            format!("{prefix}:engine_busy_seconds"),
            "Wall time the engine spent executing steps",
            self.busy.clone(),
        );
        r.register(
            format!("{prefix}:engine_forward_seconds"),
            "Wall time the engine spent in model forward passes",
            self.forward.clone(),
        );
    }

    /// Advances the counters to the totals `step` and `forward`; a total smaller than one
    /// already seen is ignored.
    pub(super) fn update(&self, last: &mut BusyTotals, step: Duration, forward: Duration) {
        advance_seconds(&self.busy, &mut last.step, step);
        advance_seconds(&self.forward, &mut last.forward, forward);
    }
}
