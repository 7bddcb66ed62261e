//! Admission control on a real engine whose cost model is taught known step times (1 ms per
//! step plus 0.1 ms per token), so predictions do not depend on the machine: a request is
//! refused or demoted only when the work queued ahead of it makes its deadline unmeetable, is
//! admitted when it would be late even alone, and nothing leaks.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use kiln_core::{RequestId, SamplingParams, TokenId};
use kiln_kernels::Cpu;
use kiln_models::load_model;
use kiln_sched::{AddError, SchedulingPolicy, StepLoad};

use crate::slo::{SloAdmission, SloClass, SloConfig};
use crate::{EngineConfig, EngineCore, EngineError, SchedulerConfig};

/// Priority 0 is due 5 ms after arrival; other priorities have no class.
fn engine(admission: SloAdmission, policy: SchedulingPolicy) -> EngineCore {
    engine_with_seats(admission, policy, 16)
}

/// [`engine`] with a running cap of `max_num_seqs`.
fn engine_with_seats(
    admission: SloAdmission,
    policy: SchedulingPolicy,
    max_num_seqs: usize,
) -> EngineCore {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/llama3");
    let model = load_model(&path, &Arc::new(Cpu::new(1))).unwrap().model;
    let classes = BTreeMap::from([(0, SloClass { ttft_ms: 5, tpot_ms: None })]);
    let config = EngineConfig {
        block_size: 4,
        num_kv_blocks: 1024,
        max_model_len: Some(128),
        scheduler: SchedulerConfig {
            max_num_batched_tokens: 256,
            max_num_seqs,
            policy,
            ..SchedulerConfig::default()
        },
        slo: SloConfig { classes, admission, ..SloConfig::default() },
        ..EngineConfig::default()
    };
    let mut core = EngineCore::new(model, config).unwrap();
    let controller = core.controller_mut().unwrap();
    for tokens in (16..=256).step_by(16) {
        let load =
            StepLoad { num_tokens: tokens, num_prefill_tokens: tokens, ..StepLoad::default() };
        controller.observe_step(&load, 0.001 + 1e-4 * tokens as f64, 0, 0);
    }
    core
}

fn prompt(seed: u32, len: usize) -> Vec<TokenId> {
    (0..len as u32).map(|i| TokenId((seed * 7919 + i * 131) % 500 + 3)).collect()
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) }
}

/// Queues 8 prompts of 100 tokens at `priority` (800 tokens: about 4 steps of 26 ms).
fn queue(core: &mut EngineCore, priority: i64) {
    for i in 0..8 {
        core.add_request(prompt(10 + i, 100), greedy(2), priority).unwrap();
    }
}

fn run_to_end(core: &mut EngineCore) -> Vec<RequestId> {
    let mut first_tokens = Vec::new();
    let mut seen = std::collections::HashSet::new();
    while core.has_unfinished() {
        for out in core.step().unwrap() {
            if seen.insert(out.id) {
                first_tokens.push(out.id);
            }
        }
    }
    assert_eq!(core.stats().kv_usage, 0.0, "blocks leaked");
    first_tokens
}

#[test]
fn the_queue_ahead_gets_a_request_refused_not_its_own_length() {
    let mut core = engine(SloAdmission::Reject, SchedulingPolicy::Fcfs);
    // An idle server: a 1-token prompt is due in 5 ms and takes about 1 ms.
    core.add_request(prompt(1, 1), greedy(2), 0).unwrap();
    // A prompt that alone takes longer than its 5 ms is admitted: a retry would be as late.
    core.add_request(prompt(2, 100), greedy(2), 0).unwrap();
    queue(&mut core, 5);
    let Err(EngineError::Rejected(AddError::DeadlineUnmeetable { predicted_ms, ttft_slo_ms })) =
        core.add_request(prompt(3, 1), greedy(2), 0)
    else {
        panic!("a 5 ms deadline behind 900 queued prompt tokens was admitted");
    };
    assert_eq!(ttft_slo_ms, 5);
    assert!(predicted_ms > 30, "{predicted_ms} ms predicted behind 900 tokens");
    assert_eq!(core.stats().num_slo_rejected, 1);
    // Without a class there is no deadline, so no refusal.
    core.add_request(prompt(4, 1), greedy(2), 5).unwrap();
    assert_eq!(run_to_end(&mut core).len(), 11);
}

#[test]
fn a_demoted_request_waits_behind_work_that_can_be_on_time() {
    let mut core = engine(SloAdmission::Demote, SchedulingPolicy::Deadline);
    // Class-0 work, each late alone (so admitted), queued ahead of the probe's deadline.
    queue(&mut core, 0);
    let later = core.add_request(prompt(40, 4), greedy(2), 7).unwrap();
    let probe = core.add_request(prompt(41, 1), greedy(2), 0).unwrap();
    assert!(core.scheduler().request(probe).unwrap().is_demoted());
    assert!(!core.scheduler().request(later).unwrap().is_demoted());
    assert_eq!(core.stats().num_slo_demoted, 1);
    let order = run_to_end(&mut core);
    // Due 60 s after its own deadline, behind the best-effort request (due 60 s after it
    // arrived) that came just before it; not demoted, it would have gone first.
    let pos = |id| order.iter().position(|&x| x == id).unwrap();
    assert!(pos(later) < pos(probe), "{order:?}");
}

#[test]
fn first_tokens_later_than_predicted_make_admission_stricter() {
    // Two classless prompts of 10 tokens ahead (no deadline, never refused), then a 1-token
    // request due in 5 ms: predicted about 3 ms behind them, 1 ms alone.
    let probe = |core: &mut EngineCore| {
        for i in 0..2 {
            core.add_request(prompt(60 + i, 10), greedy(2), 5).unwrap();
        }
        core.add_request(prompt(62, 1), greedy(2), 0)
    };
    let mut core = engine(SloAdmission::Reject, SchedulingPolicy::Fcfs);
    probe(&mut core).unwrap();
    assert_eq!(run_to_end(&mut core).len(), 3);

    // First tokens have been coming four times later than predicted: the same request behind
    // the same queue is now predicted late and refused; alone it still is not (a request is
    // never refused on an idle server).
    let mut core = engine(SloAdmission::Reject, SchedulingPolicy::Fcfs);
    let controller = core.controller_mut().unwrap();
    for _ in 0..64 {
        controller.observe_ttft(0.0, 0.012, Some(0.005), Some(0.003));
    }
    assert_eq!(controller.stats().ttft_calibration, 4.0);
    let Err(EngineError::Rejected(AddError::DeadlineUnmeetable { predicted_ms, .. })) =
        probe(&mut core)
    else {
        panic!("admitted behind a queue that the calibration predicts late");
    };
    assert!((9..=16).contains(&predicted_ms), "{predicted_ms} ms");
    assert_eq!(run_to_end(&mut core).len(), 2);
    // Alone, a 3-token prompt is now predicted past its deadline (about 1.3 ms, four times
    // over): admitted, as a request late even on an idle server is.
    core.add_request(prompt(63, 3), greedy(2), 0).unwrap();
    assert_eq!(run_to_end(&mut core).len(), 1);
}

#[test]
fn a_full_running_cap_makes_a_request_wait_for_seats() {
    let mut core = engine_with_seats(SloAdmission::Reject, SchedulingPolicy::Fcfs, 2);
    // Two classless requests finish: the controller has seen seats free (two departures in
    // well under a second of steps read as about two a second).
    for i in 0..2 {
        core.add_request(prompt(70 + i, 4), greedy(2), 5).unwrap();
    }
    run_to_end(&mut core);
    // Both seats taken by long requests and one more waiting: a request due in 5 ms, whose
    // prompt alone takes about a millisecond, needs two seats to free first.
    for i in 0..3 {
        core.add_request(prompt(80 + i, 4), greedy(40), 5).unwrap();
    }
    core.step().unwrap();
    assert_eq!((core.scheduler().num_running(), core.scheduler().num_waiting()), (2, 1));
    let Err(EngineError::Rejected(AddError::DeadlineUnmeetable { predicted_ms, .. })) =
        core.add_request(prompt(90, 1), greedy(2), 0)
    else {
        panic!("admitted with no seat free and none about to be");
    };
    assert!(predicted_ms > 500, "{predicted_ms} ms for two seats");
    assert_eq!(run_to_end(&mut core).len(), 3);
}
