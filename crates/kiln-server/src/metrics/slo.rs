//! Batch-control and SLO metrics under the metrics prefix (`kiln:` by default), set after every
//! engine step:
//! - gauges `kiln:scheduler_token_budget` and `kiln:scheduler_max_running`: the step token budget
//!   and running cap in force (the configured limits, or what the batch controller set);
//! - gauge `kiln:scheduler_controller_gain`: the fraction of the ITL (or TPOT) target a step is
//!   planned to take (0 without a controller);
//! - gauge `kiln:scheduler_controller_bank_seconds`: step time saved under a TPOT target for
//!   longer steps later (negative: a debt shorter steps pay back);
//! - gauge `kiln:scheduler_controller_ttft_calibration`: what admission control multiplies its
//!   first-token predictions by (the p95 of recent observed-to-predicted ratios; 0 without a
//!   controller);
//! - counter `kiln:slo_target_misses_total{target}`: decode steps slower than the ITL target
//!   (`target="itl"`), first tokens later than their SLO class's TTFT or the TTFT target
//!   (`target="ttft"`), and finished requests whose mean time per output token was over their
//!   class's TPOT or the TPOT target (`target="tpot"`);
//! - counter `kiln:slo_admission_total{action}`: requests refused by admission control
//!   (`action="rejected"`) and requests demoted behind work that can be on time
//!   (`action="demoted"`: at admission, or waiting past their deadline).
//!
//! Counters advance by the delta of the engine's totals, like the others.

use std::sync::atomic::AtomicU64;

use kiln_engine::EngineStats;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

type Label = [(&'static str, String); 1];

/// The totals last seen.
#[derive(Debug, Default)]
pub(super) struct SloTotals {
    itl_misses: u64,
    ttft_misses: u64,
    tpot_misses: u64,
    rejected: u64,
    demoted: u64,
}

#[derive(Debug, Default)]
pub(super) struct SloMetrics {
    token_budget: Gauge,
    max_running: Gauge,
    gain: Gauge<f64, AtomicU64>,
    bank: Gauge<f64, AtomicU64>,
    ttft_calibration: Gauge<f64, AtomicU64>,
    target_misses: Family<Label, Counter>,
    admission: Family<Label, Counter>,
}

impl SloMetrics {
    pub(super) fn register(&self, r: &mut Registry, prefix: &str) {
        let name = |n: &str| format!("{prefix}:{n}");
        r.register(
            name("scheduler_token_budget"),
            "Token budget of an engine step in force",
            self.token_budget.clone(),
        );
        r.register(
            name("scheduler_max_running"),
            "Running requests beyond which none is admitted, in force",
            self.max_running.clone(),
        );
        r.register(
            name("scheduler_controller_gain"),
            "Fraction of the inter-token latency (or TPOT) target a step is planned to take",
            self.gain.clone(),
        );
        r.register(
            name("scheduler_controller_bank_seconds"),
            "Step time saved under a TPOT target for longer steps later (negative: a debt)",
            self.bank.clone(),
        );
        r.register(
            name("scheduler_controller_ttft_calibration"),
            "Factor admission control scales its first-token predictions by (p95 of observed over \
             predicted)",
            self.ttft_calibration.clone(),
        );
        r.register(
            name("slo_target_misses"),
            "Decode steps over the ITL target, first tokens over the TTFT target, requests over \
             the TPOT target",
            self.target_misses.clone(),
        );
        r.register(
            name("slo_admission"),
            "Requests rejected or demoted because their deadline could not be met",
            self.admission.clone(),
        );
        for target in ["itl", "ttft", "tpot"] {
            drop(self.target_misses.get_or_create(&[("target", target.to_owned())]));
        }
        for action in ["rejected", "demoted"] {
            drop(self.admission.get_or_create(&[("action", action.to_owned())]));
        }
    }

    pub(super) fn update(&self, last: &mut SloTotals, stats: &EngineStats) {
        self.token_budget.set(super::saturating_i64(stats.limits.max_num_batched_tokens));
        self.max_running.set(super::saturating_i64(stats.limits.max_num_seqs));
        let controller = stats.controller.unwrap_or_default();
        self.gain.set(if stats.controller.is_some() { controller.gain } else { 0.0 });
        self.bank.set(controller.bank);
        self.ttft_calibration.set(controller.ttft_calibration);
        let miss = |t: &str| self.target_misses.get_or_create(&[("target", t.to_owned())]).clone();
        super::advance(&miss("itl"), &mut last.itl_misses, controller.itl_misses);
        super::advance(&miss("ttft"), &mut last.ttft_misses, controller.ttft_misses);
        super::advance(&miss("tpot"), &mut last.tpot_misses, controller.tpot_misses);
        let act = |a: &str| self.admission.get_or_create(&[("action", a.to_owned())]).clone();
        super::advance(&act("rejected"), &mut last.rejected, stats.num_slo_rejected);
        super::advance(&act("demoted"), &mut last.demoted, stats.num_slo_demoted);
    }
}

/// The log line for a move of the batch controller's plan (cap or gain), `None` when nothing
/// moved between `before` and `now`.
pub fn controller_log_line(before: &EngineStats, now: &EngineStats) -> Option<String> {
    let (b, n) = (before.controller?, now.controller?);
    if n.num_moves == b.num_moves {
        return None;
    }
    Some(format!(
        "Batch controller: max running {} -> {}, gain {:.2} -> {:.2}, token budget now {}, \
         TTFT calibration {:.2}; misses since start: ITL {}, TTFT {}, TPOT {}",
        b.limits.max_num_seqs,
        n.limits.max_num_seqs,
        b.gain,
        n.gain,
        n.limits.max_num_batched_tokens,
        n.ttft_calibration,
        n.itl_misses,
        n.ttft_misses,
        n.tpot_misses
    ))
}
