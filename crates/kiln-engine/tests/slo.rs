//! Latency objectives on a tiny fixture model: the batch controller and the deadline policy
//! change which tokens share a step, never the tokens (kernels are batch-invariant), and leak
//! no block. (Admission control is tested in `src/admission_tests.rs`, on a cost model taught
//! known step times.)

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use kiln_core::{RequestId, SamplingParams, TokenId};
use kiln_engine::{
    EngineConfig, EngineCore, SchedulerConfig, SchedulingPolicy, SloAdmission, SloClass, SloConfig,
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
    // A TPOT target no request can meet: every request misses it once, when it finishes.
    let tight = SloConfig { target_tpot_ms: Some(0.001), ..SloConfig::default() };
    let mut core = engine(tight, SchedulingPolicy::Fcfs);
    let (controlled, _) = run(&mut core);
    assert_eq!(controlled, plain);
    assert_eq!(core.stats().controller.unwrap().tpot_misses, 12);
    // Deadlines by class, earliest first, admission off (nothing refused).
    let classes = BTreeMap::from([
        (0, SloClass { ttft_ms: 60_000, tpot_ms: Some(1) }),
        (1, SloClass { ttft_ms: 5, tpot_ms: None }),
    ]);
    let slo = SloConfig { classes, admission: SloAdmission::Off, ..SloConfig::default() };
    let (deadline, _) = run(&mut engine(slo, SchedulingPolicy::Deadline));
    assert_eq!(deadline, plain);
}
