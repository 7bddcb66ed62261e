//! The batch controller on a simulated engine: the real scheduler and the fake runner, with a
//! step's duration given by a cost model (`a + b·tokens + c·attention`, with ±10 % noise) on
//! a simulated clock, and Poisson arrivals. No model, no wall clock: every run is deterministic.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;

use common::{FakeRunner, req, scheduler, toks};
use kiln_core::{RequestId, Rng, TokenId};
use kiln_sched::controller::percentile;
use kiln_sched::{
    BatchController, ControllerConfig, QueueAhead, Scheduler, SchedulerConfig, StepLimits, StepLoad,
};

const TARGET_ITL: f64 = 0.050;
const PROMPT: usize = 200;
/// Requests arrive in bursts of this many at once.
const BURST: usize = 4;
const OUTPUT: usize = 100;

/// Seconds a step takes on the simulated engine; `slowdown` scales the per-token costs.
fn step_seconds(load: &StepLoad, slowdown: f64, rng: &mut Rng) -> f64 {
    let base = 0.010 + slowdown * (4e-4 * load.num_tokens as f64 + 1e-8 * load.attention);
    base * (0.9 + 0.2 * rng.next_f64())
}

struct Sim {
    s: Scheduler,
    runner: FakeRunner,
    controller: Option<BatchController>,
    clock: f64,
    /// Step-time noise.
    rng: Rng,
    /// Arrival times, apart from the noise so that every mode sees the same arrivals.
    arrivals: Rng,
    next_arrival: f64,
    next_id: u64,
    arrived: HashMap<RequestId, f64>,
    /// `(time, seconds)` of every step that decoded.
    itl: Vec<(f64, f64)>,
    ttft: Vec<f64>,
    /// `(arrival, TTFT)` of every first token.
    ttft_by_arrival: Vec<(f64, f64)>,
    /// `(first token time, tokens since)` of requests decoding.
    decoding: HashMap<RequestId, (f64, usize)>,
    /// `(first token time, mean seconds per output token after it)` of every finished request.
    tpot: Vec<(f64, f64)>,
    /// The most and least step time the controller held saved.
    max_bank: f64,
    min_bank: f64,
    /// `(time, running cap)` after every step.
    caps: Vec<(f64, usize)>,
    finished: usize,
}

impl Sim {
    fn new(controlled: bool) -> Self {
        Self::with_targets(controlled.then_some((Some(TARGET_ITL), None)))
    }

    /// A simulation controlled to `(ITL, TPOT)` targets (`None`: the fixed ceiling).
    fn with_targets(targets: Option<(Option<f64>, Option<f64>)>) -> Self {
        let config = SchedulerConfig {
            max_num_batched_tokens: 2048,
            max_num_seqs: 128,
            max_model_len: 1024,
            ..SchedulerConfig::default()
        };
        let ceiling = StepLimits { max_num_batched_tokens: 2048, max_num_seqs: 128 };
        let controller = targets.map(|(target_itl, target_tpot)| {
            BatchController::new(ControllerConfig {
                target_itl,
                target_tpot,
                target_ttft: Some(1.0),
                ceiling,
            })
        });
        Self {
            s: scheduler(config, 16, 8192),
            runner: FakeRunner::new(16, 8192),
            controller,
            clock: 0.0,
            rng: Rng::new(7),
            arrivals: Rng::new(11),
            next_arrival: 0.0,
            next_id: 0,
            arrived: HashMap::new(),
            itl: Vec::new(),
            ttft: Vec::new(),
            ttft_by_arrival: Vec::new(),
            decoding: HashMap::new(),
            tpot: Vec::new(),
            max_bank: 0.0,
            min_bank: 0.0,
            caps: Vec::new(),
            finished: 0,
        }
    }

    /// Runs until `until` seconds with `rate` requests per second (in bursts of [`BURST`]);
    /// step costs scaled by `slowdown`.
    fn run(&mut self, until: f64, rate: f64, slowdown: f64) {
        while self.clock < until {
            while self.next_arrival <= self.clock {
                for _ in 0..BURST {
                    let id = self.next_id;
                    self.next_id += 1;
                    let base = (id as u32 % 50) * 1000;
                    self.s.add(req(id, toks(base..base + PROMPT as u32), OUTPUT)).unwrap();
                    self.arrived.insert(RequestId(id), self.next_arrival);
                    if let Some(c) = &mut self.controller {
                        c.observe_arrival(PROMPT, self.next_arrival);
                    }
                }
                self.next_arrival += -(1.0 - self.arrivals.next_f64()).ln() * BURST as f64 / rate;
            }
            if !self.s.has_unfinished() {
                self.clock = self.next_arrival;
                continue;
            }
            let out = self.s.schedule();
            let load = out.load();
            let secs = step_seconds(&load, slowdown, &mut self.rng);
            let model_output = self.runner.execute(&out);
            self.clock += secs;
            for o in self.s.update(&out, &model_output) {
                self.observe_output(o.id, o.finish_reason.is_some());
            }
            self.s.check_invariants().unwrap();
            if load.num_decodes > 0 {
                self.itl.push((self.clock, secs));
            }
            if let Some(c) = &mut self.controller {
                self.max_bank = self.max_bank.max(c.stats().bank);
                self.min_bank = self.min_bank.min(c.stats().bank);
                let limits = c.observe_step(
                    &load,
                    secs,
                    self.s.num_running(),
                    self.s.pending_prefill_tokens(None),
                );
                let set = self.s.set_limits(limits);
                assert_eq!(set, limits, "the controller stays within the ceiling");
            }
            self.caps.push((self.clock, self.s.limits().max_num_seqs));
        }
    }

    /// Records a request's output token at the clock: TTFT for its first, TPOT when it ends.
    fn observe_output(&mut self, id: RequestId, finished: bool) {
        if let Some(arrived) = self.arrived.remove(&id) {
            self.ttft.push(self.clock - arrived);
            self.ttft_by_arrival.push((arrived, self.clock - arrived));
            self.decoding.insert(id, (self.clock, 0));
            if let Some(c) = &mut self.controller {
                c.observe_ttft(self.clock, self.clock - arrived, None, None);
            }
        } else if let Some((_, tokens)) = self.decoding.get_mut(&id) {
            *tokens += 1;
        }
        if finished {
            self.finished += 1;
            let (first, tokens) = self.decoding.remove(&id).unwrap();
            if tokens > 0 {
                let tpot = (self.clock - first) / tokens as f64;
                self.tpot.push((first, tpot));
                if let Some(c) = &mut self.controller {
                    c.observe_tpot(tpot, None);
                }
            }
        }
    }

    /// p95 of the decode step times within `[from, to)` seconds.
    fn itl_p95(&self, from: f64, to: f64) -> f64 {
        self.itl_quantile(from, to, 0.95)
    }

    fn itl_quantile(&self, from: f64, to: f64, q: f64) -> f64 {
        let v: Vec<f64> =
            self.itl.iter().filter(|(t, _)| (from..to).contains(t)).map(|&(_, s)| s).collect();
        assert!(v.len() > 20, "only {} decode steps in [{from}, {to})", v.len());
        percentile(&v, q)
    }

    /// The running caps within `[from, to)`.
    fn caps_in(&self, from: f64, to: f64) -> Vec<usize> {
        self.caps.iter().filter(|(t, _)| (from..to).contains(t)).map(|&(_, c)| c).collect()
    }
}

/// Direction changes of a series (ignoring flat stretches).
fn reversals(series: &[usize]) -> usize {
    let mut last_dir = 0i8;
    let mut count = 0;
    for w in series.windows(2) {
        let dir = (w[1] as i64 - w[0] as i64).signum() as i8;
        if dir != 0 {
            if last_dir != 0 && dir != last_dir {
                count += 1;
            }
            last_dir = dir;
        }
    }
    count
}

#[test]
fn fixed_limits_miss_the_target_the_controller_holds() {
    // The same load without control: a burst's prompts prefilled in one step stall every
    // decode for hundreds of milliseconds.
    let mut fixed = Sim::new(false);
    fixed.run(20.0, 3.0, 1.0);
    let worst = fixed.itl_quantile(2.0, 20.0, 1.0);
    assert!(worst > 4.0 * TARGET_ITL, "worst fixed step {worst:.3} s");

    let mut sim = Sim::new(true);
    sim.run(20.0, 3.0, 1.0);
    for from in [2.0, 6.0, 10.0, 14.0] {
        let p95 = sim.itl_p95(from, from + 6.0);
        assert!(p95 <= TARGET_ITL * 1.02, "p95 {p95:.4} s in [{from}, {}) s", from + 6.0);
    }
    let p99 = sim.itl_quantile(2.0, 20.0, 0.99);
    assert!(p99 <= TARGET_ITL * 1.1, "p99 {p99:.4} s");
    // Converged: it keeps up with the load (nothing piles up) ...
    assert!(sim.s.num_waiting() < 10, "{} waiting", sim.s.num_waiting());
    assert!(sim.finished >= fixed.finished / 2, "{} vs {} finished", sim.finished, fixed.finished);
    let ttft = percentile(&sim.ttft, 0.95);
    assert!(ttft < 1.0, "TTFT p95 {ttft:.3} s");
    // ... and settles: the cap does not swing in the second half.
    let caps = sim.caps_in(10.0, 20.0);
    let (lo, hi) = (caps.iter().min().unwrap(), caps.iter().max().unwrap());
    assert!(hi - lo <= hi / 4 + 2, "cap swings between {lo} and {hi}");
    assert!(reversals(&caps) <= 4, "cap reverses {} times: {caps:?}", reversals(&caps));
    let stats = sim.controller.as_ref().unwrap().stats();
    assert!(stats.gain > 0.3 && stats.gain <= 1.0, "gain {}", stats.gain);
}

#[test]
fn holds_the_target_through_a_four_times_load_step() {
    let mut sim = Sim::new(true);
    sim.run(15.0, 2.5, 1.0);
    let before = *sim.caps.last().map(|(_, c)| c).unwrap();
    // 4x the arrival rate.
    sim.run(45.0, 10.0, 1.0);
    // Within a few seconds (a few hundred steps) the p95 is back under target, and stays.
    for from in [19.0, 25.0, 31.0, 37.0] {
        let p95 = sim.itl_p95(from, from + 6.0);
        assert!(p95 <= TARGET_ITL * 1.02, "p95 {p95:.4} s in [{from}, {}) s", from + 6.0);
    }
    let caps = sim.caps_in(30.0, 45.0);
    assert!(reversals(&caps) <= 6, "cap reverses {} times: {caps:?}", reversals(&caps));
    // Four times the arrivals need a larger prefill reserve: fewer decode seats.
    let after = *caps.last().unwrap();
    assert!(after < before, "cap {before} before the step, {after} after");
}

#[test]
fn a_slower_engine_gets_fewer_seats() {
    // The model is refitted online: when every token costs twice as much (another tenant on the
    // cores), the plan shrinks and the target still holds.
    let mut sim = Sim::new(true);
    sim.run(15.0, 3.0, 1.0);
    let cap_before = sim.controller.as_ref().unwrap().stats().limits.max_num_seqs;
    sim.run(40.0, 3.0, 2.0);
    let cap_after = sim.controller.as_ref().unwrap().stats().limits.max_num_seqs;
    let p95 = sim.itl_p95(25.0, 40.0);
    assert!(p95 <= TARGET_ITL * 1.02, "p95 {p95:.4} s after the slowdown");
    assert!(cap_after < cap_before * 3 / 4, "cap {cap_after} !< 3/4 of {cap_before}");
}

#[test]
fn without_an_itl_target_the_limits_stay_at_the_ceiling() {
    let ceiling = StepLimits { max_num_batched_tokens: 512, max_num_seqs: 16 };
    let mut c = BatchController::new(ControllerConfig {
        target_itl: None,
        target_tpot: None,
        target_ttft: Some(0.5),
        ceiling,
    });
    let load = StepLoad {
        num_tokens: 300,
        num_decodes: 10,
        decode_context: 1000.0,
        num_prefill_tokens: 290,
        attention: 40_000.0,
    };
    for _ in 0..64 {
        assert_eq!(c.observe_step(&load, 0.2, 10, 5000).max_num_seqs, ceiling.max_num_seqs);
    }
    c.observe_ttft(0.0, 0.7, None, None);
    c.observe_ttft(0.0, 0.3, None, None);
    c.observe_ttft(0.0, 0.3, Some(0.2), None);
    c.observe_ttft(0.0, 0.7, Some(1.0), None);
    assert_eq!(c.stats().ttft_misses, 2);
    assert!(c.model().is_fitted());
    assert!(c.predict_prefill_seconds(1000, 10).unwrap() > 0.0);
}

#[test]
fn a_lower_cap_preempts_nothing_and_stops_admissions() {
    let mut s = scheduler(SchedulerConfig::default(), 16, 256);
    for id in 0..4 {
        s.add(req(id, toks(id as u32 * 100..id as u32 * 100 + 8), 50)).unwrap();
    }
    let mut runner = FakeRunner::new(16, 256);
    let out = s.schedule();
    let mo = runner.execute(&out);
    s.update(&out, &mo);
    assert_eq!(s.num_running(), 4);
    let set = s.set_limits(StepLimits { max_num_batched_tokens: 100_000, max_num_seqs: 2 });
    assert_eq!(set, StepLimits { max_num_batched_tokens: 2048, max_num_seqs: 2 });
    s.add(req(9, vec![TokenId(5); 8], 4)).unwrap();
    for _ in 0..10 {
        let out = s.schedule();
        assert!(out.new_requests.is_empty(), "admitted above the cap");
        assert!(out.preempted_ids.is_empty());
        assert_eq!(out.num_scheduled_requests(), 4);
        let mo = runner.execute(&out);
        s.update(&out, &mo);
        s.check_invariants().unwrap();
    }
}

#[test]
fn a_ceiling_below_the_prefill_reserve_is_kept() {
    let ceiling = StepLimits { max_num_batched_tokens: 8, max_num_seqs: 4 };
    let mut c = BatchController::new(ControllerConfig {
        target_itl: Some(0.05),
        target_tpot: None,
        target_ttft: Some(0.5),
        ceiling,
    });
    for i in 0..64usize {
        let load = StepLoad {
            num_tokens: 1 + i % 8,
            num_prefill_tokens: 1 + i % 8,
            ..StepLoad::default()
        };
        let limits = c.observe_step(&load, 0.002 + 1e-3 * (1 + i % 8) as f64, i % 4, 100);
        assert!(limits.max_num_batched_tokens <= 8 && limits.max_num_seqs <= 4, "{limits:?}");
        c.observe_arrival(100, i as f64 * 0.01);
    }
}

/// Values of `(time, value)` pairs from `from` seconds on.
fn after(pairs: &[(f64, f64)], from: f64) -> Vec<f64> {
    pairs.iter().filter(|(t, _)| *t >= from).map(|&(_, v)| v).collect()
}

#[test]
fn a_tpot_target_holds_each_requests_mean_and_drains_bursts_sooner() {
    // The same bursty arrivals under a 50 ms ITL target and under a 50 ms TPOT target: the TPOT
    // controller spends saved step time on the queued prompts of a burst, so first tokens come
    // sooner, while every request's mean time per token stays under the target. Measured from
    // 5 s on, once the cost model is fitted and the start-up queue drained.
    let mut itl = Sim::with_targets(Some((Some(TARGET_ITL), None)));
    itl.run(40.0, 3.0, 1.0);
    let mut tpot = Sim::with_targets(Some((None, Some(TARGET_ITL))));
    tpot.run(40.0, 3.0, 1.0);
    let per_token = after(&tpot.tpot, 5.0);
    let worst = percentile(&per_token, 1.0);
    let (ttft_itl, ttft_tpot) = (
        percentile(&after(&itl.ttft_by_arrival, 5.0), 0.95),
        percentile(&after(&tpot.ttft_by_arrival, 5.0), 0.95),
    );
    assert!(per_token.len() > 50, "{} finished", per_token.len());
    assert!(worst <= TARGET_ITL, "worst TPOT {worst:.4} s");
    // The bank was spent: some steps ran longer than the target; it stayed within its bounds.
    let longest = tpot.itl_quantile(5.0, 40.0, 1.0);
    assert!(longest > 1.5 * TARGET_ITL, "longest step {longest:.4} s");
    let bank_limit = kiln_sched::controller::BANK_STEPS * TARGET_ITL;
    assert!(tpot.max_bank > TARGET_ITL && tpot.max_bank <= bank_limit + 1e-9);
    assert!(tpot.min_bank >= -bank_limit - 1e-9);
    assert!(ttft_tpot < 0.9 * ttft_itl, "TTFT p95 {ttft_tpot:.3} s vs {ttft_itl:.3} s");
    // Throughput is not lost for it.
    assert!(tpot.finished + 8 >= itl.finished, "{} vs {}", tpot.finished, itl.finished);
    assert!(reversals(&tpot.caps_in(20.0, 40.0)) <= 6);
}

#[test]
fn tpot_misses_count_against_the_class_or_the_target() {
    let mut c = BatchController::new(ControllerConfig {
        target_itl: None,
        target_tpot: Some(0.05),
        target_ttft: None,
        ceiling: StepLimits { max_num_batched_tokens: 512, max_num_seqs: 16 },
    });
    c.observe_tpot(0.06, None);
    c.observe_tpot(0.04, None);
    c.observe_tpot(0.03, Some(0.02));
    c.observe_tpot(0.06, Some(0.1));
    assert_eq!(c.stats().tpot_misses, 2);
}

/// A controller with a 1 s TTFT target whose model is fitted to 1 ms per step plus 0.1 ms per
/// token.
fn fitted_controller() -> BatchController {
    let mut c = BatchController::new(ControllerConfig {
        target_itl: Some(0.05),
        target_tpot: None,
        target_ttft: Some(1.0),
        ceiling: StepLimits { max_num_batched_tokens: 512, max_num_seqs: 16 },
    });
    for tokens in (16..=512).step_by(16) {
        let load =
            StepLoad { num_tokens: tokens, num_prefill_tokens: tokens, ..StepLoad::default() };
        c.observe_step(&load, 0.001 + 1e-4 * tokens as f64, 0, 0);
    }
    c
}

#[test]
fn the_admission_calibration_is_the_p95_ratio_of_recent_first_tokens() {
    use kiln_sched::controller::{CALIBRATION_SECONDS, MIN_TTFT_SAMPLES, TTFT_WINDOW};
    let mut c = fitted_controller();
    let queue = QueueAhead { prompt_tokens: 100, tokens_ahead: 300, ..QueueAhead::default() };
    let predicted = c.predict_first_token_seconds(&queue).unwrap();
    assert_eq!(Some(predicted), c.predict_prefill_seconds(400, 0));
    let calibration = |c: &BatchController| c.stats().ttft_calibration;
    // Not before enough ratios are in.
    for _ in 1..MIN_TTFT_SAMPLES {
        c.observe_ttft(1.0, 1.0, None, Some(0.5));
    }
    assert_eq!(calibration(&c), 1.0);
    assert_eq!(c.calibrated_first_token_seconds(&queue, 1.0), Some(predicted));
    // The window's p95 by nearest rank: ratios 1.00, 1.01, ..., 1.63 give 1.60.
    for i in 0..TTFT_WINDOW {
        c.observe_ttft(2.0, 0.5 * (1.0 + i as f64 / 100.0), None, Some(0.5));
    }
    assert!((calibration(&c) - 1.60).abs() < 1e-9, "{}", calibration(&c));
    let scaled = c.calibrated_first_token_seconds(&queue, 2.0).unwrap();
    assert!((scaled - 1.6 * predicted).abs() < 1e-12);
    // Short predictions (under a tenth of the objective) and requests without one teach
    // nothing.
    c.observe_ttft(3.0, 9.0, None, Some(0.09));
    c.observe_ttft(3.0, 9.0, None, None);
    assert!((calibration(&c) - 1.60).abs() < 1e-9);
    // A class's objective counts instead of the target: 0.07 s is under a tenth of the 1 s
    // target, not of a 0.5 s class, so it teaches (the oldest ratio slides out; the 61st of
    // 1.01, ..., 1.63 and 128.6 is 1.61).
    c.observe_ttft(3.0, 9.0, Some(0.5), Some(0.07));
    assert!((calibration(&c) - 1.61).abs() < 1e-9, "{}", calibration(&c));
    // Clamped to [1, 4].
    for _ in 0..TTFT_WINDOW {
        c.observe_ttft(4.0, 9.0, None, Some(0.5));
    }
    assert_eq!(calibration(&c), 4.0);
    // Ratios age out: with nothing recent the factor is 1 again, whatever it was.
    let later = 4.0 + CALIBRATION_SECONDS + 0.1;
    assert_eq!(c.calibrated_first_token_seconds(&queue, later), Some(predicted));
    for _ in 0..TTFT_WINDOW {
        c.observe_ttft(later, 0.01, None, Some(0.5));
    }
    assert_eq!(calibration(&c), 1.0);
}

#[test]
fn a_request_without_a_free_seat_waits_for_departures() {
    let mut c = fitted_controller();
    let queue =
        QueueAhead { prompt_tokens: 100, tokens_ahead: 0, num_running: 16, seats_needed: 0 };
    let alone = c.predict_first_token_seconds(&queue).unwrap();
    assert_eq!(Some(alone), c.predict_prefill_seconds(100, 16));
    // No departure seen yet: the seats' wait is unknown, so there is no prediction.
    let full = QueueAhead { seats_needed: 5, ..queue };
    assert_eq!(c.predict_first_token_seconds(&full), None);
    // One departure so far reads as about one a second (the decaying sum is corrected for the
    // second it has covered), not a tenth.
    c.observe_departure();
    let first = c.predict_first_token_seconds(&full).unwrap();
    assert!((first - alone - 5.0 / 1.05).abs() < 0.1, "{first} s");
    // Steps of half a second (as the fitted model predicts them, so the fit stays), one
    // departure after each, for a minute: five seats take about 2.5 s, then its prefill.
    let half_second =
        StepLoad { num_tokens: 4990, num_prefill_tokens: 4990, ..StepLoad::default() };
    for _ in 0..120 {
        c.observe_step(&half_second, 0.5, 16, 0);
        c.observe_departure();
    }
    let alone = c.predict_prefill_seconds(100, 16).unwrap();
    let waited = c.predict_first_token_seconds(&full).unwrap();
    assert!((waited - alone - 2.5).abs() < 0.2, "{waited} s");
    // The rate decays over busy time in which nobody leaves (idle time, with no steps, does
    // not count).
    for _ in 0..40 {
        c.observe_step(&half_second, 0.5, 16, 0);
    }
    assert!(c.predict_first_token_seconds(&full).unwrap() > waited * 2.0);
    // Behind a long queue of tokens the longer of the two counts.
    let behind = QueueAhead { tokens_ahead: 100_000, ..full };
    let tokens = c.predict_prefill_seconds(100_100, 16).unwrap();
    let seats = c.predict_first_token_seconds(&full).unwrap();
    assert_eq!(c.predict_first_token_seconds(&behind), Some(tokens.max(seats)));
}
