//! Latency objectives on a tiny fixture model: the batch controller and the deadline policy
//! change which tokens share a step, never the tokens (kernels are batch-invariant); admission
//! control refuses or demotes a request whose first-token deadline cannot be met, and leaks no
//! block either way.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use kiln_core::{RequestId, SamplingParams, TokenId};
use kiln_engine::{
    AddError, EngineConfig, EngineCore, EngineError, SchedulerConfig, SchedulingPolicy,
    SloAdmission, SloClass, SloConfig,
};
use kiln_kernels::Cpu;
use kiln_models::load_model;

fn engine(slo: SloConfig, policy: SchedulingPolicy) -> EngineCore {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/llama3");
    let model = load_model(&path, &std::sync::Arc::new(Cpu::new(2))).unwrap().model;
    let config = EngineConfig {
        block_size: 4,
        num_kv_blocks: 512,
        max_model_len: Some(128),
        scheduler: SchedulerConfig {
            max_num_batched_tokens: 256,
            max_num_seqs: 16,
            policy,
            ..SchedulerConfig::default()
        },
        slo,
        ..EngineConfig::default()
    };
    EngineCore::new(model, config).unwrap()
}

fn prompt(seed: u32, len: usize) -> Vec<TokenId> {
    (0..len as u32).map(|i| TokenId((seed * 7919 + i * 131 + i * i * 17) % 500 + 3)).collect()
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) }
}

/// Adds 12 requests (two waves, the second after 6 steps) and runs them to the end; returns
/// each request's tokens and the smallest token budget in force during the run.
fn run(core: &mut EngineCore) -> (Vec<Vec<TokenId>>, usize) {
    let mut ids = Vec::new();
    let mut tokens: HashMap<RequestId, Vec<TokenId>> = HashMap::new();
    let mut min_budget = usize::MAX;
    let mut step = 0;
    for wave in 0..2u32 {
        for i in 0..6u32 {
            let seed = wave * 6 + i;
            let len = 8 + (seed as usize * 13) % 50;
            ids.push(core.add_request(prompt(seed, len), greedy(12), i64::from(i % 2)).unwrap());
        }
        while core.has_unfinished() && (wave == 1 || step < 6) {
            for out in core.step().unwrap() {
                tokens.entry(out.id).or_default().push(out.new_token);
            }
            min_budget = min_budget.min(core.stats().limits.max_num_batched_tokens);
            step += 1;
        }
    }
    assert_eq!(core.stats().kv_usage, 0.0, "blocks leaked");
    (ids.iter().map(|id| tokens.remove(id).unwrap()).collect(), min_budget)
}

#[test]
fn batch_control_and_deadlines_change_no_token() {
    let (plain, plain_budget) = run(&mut engine(SloConfig::default(), SchedulingPolicy::Fcfs));
    assert_eq!(plain_budget, 256);
    // An ITL target far below any step's time: the budget falls to its floor (running + 16).
    let tight = SloConfig { target_itl_ms: Some(0.001), ..SloConfig::default() };
    let (controlled, budget) = run(&mut engine(tight, SchedulingPolicy::Fcfs));
    assert!(budget < 64, "the controller never cut the budget ({budget})");
    assert_eq!(controlled, plain);
    // Deadlines by class, earliest first, admission off (nothing refused).
    let classes = BTreeMap::from([
        (0, SloClass { ttft_ms: 60_000, tpot_ms: Some(1) }),
        (1, SloClass { ttft_ms: 5, tpot_ms: None }),
    ]);
    let slo = SloConfig { classes, admission: SloAdmission::Off, ..SloConfig::default() };
    let (deadline, _) = run(&mut engine(slo, SchedulingPolicy::Deadline));
    assert_eq!(deadline, plain);
}

/// Fits the controller's cost model on plain steps (priority 5 has no class), then queues a
/// long backlog.
fn loaded_engine(admission: SloAdmission) -> EngineCore {
    let classes = BTreeMap::from([(0, SloClass { ttft_ms: 1, tpot_ms: None })]);
    let slo = SloConfig { classes, admission, ..SloConfig::default() };
    let mut core = engine(slo, SchedulingPolicy::Deadline);
    core.add_request(prompt(1, 60), greedy(30), 5).unwrap();
    for _ in 0..20 {
        core.step().unwrap();
    }
    for i in 0..8 {
        core.add_request(prompt(10 + i, 100), greedy(4), 5).unwrap();
    }
    core
}

#[test]
fn an_unmeetable_deadline_is_rejected_and_nothing_leaks() {
    let mut core = loaded_engine(SloAdmission::Reject);
    let Err(EngineError::Rejected(AddError::DeadlineUnmeetable { predicted_ms, ttft_slo_ms })) =
        core.add_request(prompt(99, 100), greedy(4), 0)
    else {
        panic!("a 1 ms first-token deadline behind 800 queued tokens was admitted");
    };
    assert_eq!(ttft_slo_ms, 1);
    assert!(predicted_ms > 1);
    let message = AddError::DeadlineUnmeetable { predicted_ms, ttft_slo_ms }.to_string();
    assert!(message.contains("time-to-first-token objective of 1 ms"), "{message}");
    assert_eq!(core.stats().num_slo_rejected, 1);
    // A request without a class is still admitted.
    core.add_request(prompt(98, 10), greedy(4), 5).unwrap();
    while core.has_unfinished() {
        core.step().unwrap();
    }
    assert_eq!(core.stats().kv_usage, 0.0);
}

#[test]
fn an_unmeetable_deadline_is_demoted_behind_on_time_work() {
    let mut core = loaded_engine(SloAdmission::Demote);
    let demoted = core.add_request(prompt(99, 100), greedy(4), 0).unwrap();
    assert!(core.scheduler().request(demoted).unwrap().is_demoted());
    assert_eq!(core.stats().num_slo_demoted, 1);
    while core.has_unfinished() {
        core.step().unwrap();
    }
    assert_eq!(core.stats().kv_usage, 0.0);
}
