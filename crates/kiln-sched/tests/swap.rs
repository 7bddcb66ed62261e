//! Preemption by swap to a second KV tier, driven by the fake runner, whose simulated tier takes
//! each swapped-out block and gives it back once: resumed requests read back exactly their own
//! tokens, produce what an unpreempted run produces, recompute less, and leave no slot or block
//! held; the swap-or-recompute rule follows the rates; a full tier falls back to recompute.

#![allow(clippy::unwrap_used)]

mod common;

use common::{FakeRunner, drive, drive_runner, expected_output, req, scheduler, toks};
use kiln_core::{RequestId, SamplingParams, TokenId};
use kiln_sched::{
    PreemptionMode, RequestStatus, Scheduler, SchedulerConfig, SchedulingPolicy, SwapConfig,
    SwapStats,
};

const BLOCK_SIZE: usize = 4;

fn config(policy: SchedulingPolicy, enable_prefix_caching: bool) -> SchedulerConfig {
    SchedulerConfig {
        policy,
        enable_prefix_caching,
        max_num_batched_tokens: 48,
        max_num_seqs: 8,
        max_model_len: 96,
        ..SchedulerConfig::default()
    }
}

/// A tier of `num_slots` blocks; `fast` rates make swapping cheaper than recomputing.
fn swap(num_slots: usize, mode: PreemptionMode, fast: bool) -> SwapConfig {
    SwapConfig {
        num_slots,
        block_bytes: 1 << 20,
        mode,
        tier_bytes_per_sec: if fast { 1e10 } else { 1e6 },
        prefill_secs_per_token: 1e-3,
    }
}

fn add_all(s: &mut Scheduler) {
    for id in 1..=8u64 {
        let prompt = toks(id as u32 * 50..id as u32 * 50 + 13 + id as u32 * 3);
        s.add(req(id, prompt, 20 + id as usize * 2).with_priority(id as i64 % 3)).unwrap();
    }
}

fn expect_all(run: &common::Run) {
    for id in 1..=8u64 {
        let prompt_len = 13 + id as usize * 3;
        assert_eq!(
            run.outputs[&RequestId(id)],
            expected_output(id, prompt_len, 20 + id as usize * 2)
        );
    }
}

/// Prefill tokens scheduled over a run (every scheduled token beyond one per decode).
fn tokens_scheduled(s: &Scheduler) -> u64 {
    s.stats().num_scheduled_tokens
}

#[test]
fn swapped_requests_resume_with_identical_tokens_and_recompute_less() {
    for policy in [SchedulingPolicy::Fcfs, SchedulingPolicy::Priority, SchedulingPolicy::Sjf] {
        for prefix_caching in [false, true] {
            let mut recompute = scheduler(config(policy, prefix_caching), BLOCK_SIZE, 24);
            add_all(&mut recompute);
            let reference = drive(&mut recompute, 5000);
            expect_all(&reference);
            assert!(recompute.stats().num_preemptions > 0);
            assert_eq!(recompute.stats().swap, SwapStats::default());

            let mut swapping = scheduler(config(policy, prefix_caching), BLOCK_SIZE, 24);
            swapping.set_swap_space(swap(64, PreemptionMode::Swap, true));
            add_all(&mut swapping);
            let run = drive(&mut swapping, 5000);
            expect_all(&run);
            let stats = swapping.stats();
            assert!(stats.num_preemptions > 0, "{policy:?}");
            assert_eq!(stats.swap.num_swap_preemptions, stats.num_preemptions, "{policy:?}");
            assert!(stats.swap.num_swapped_in_blocks > 0, "{policy:?}: {stats:?}");
            assert!(stats.swap.num_swapped_in_blocks <= stats.swap.num_swapped_out_blocks);
            assert_eq!((stats.swap.num_used_slots, stats.kv_usage), (0, 0.0), "{policy:?}");
            assert!(
                tokens_scheduled(&swapping) < tokens_scheduled(&recompute),
                "{policy:?} prefix caching {prefix_caching}: swap {} vs recompute {} tokens",
                tokens_scheduled(&swapping),
                tokens_scheduled(&recompute)
            );
            // A resumed request computes only what it never computed: its first chunk starts
            // past block boundaries the swap-in restored.
            let resumed = run
                .outputs_per_step
                .iter()
                .filter(|o| !o.swap_in.is_empty())
                .flat_map(|o| &o.new_requests)
                .filter(|n| n.num_computed_tokens > 0)
                .count();
            assert!(resumed > 0, "{policy:?}");
        }
    }
}

#[test]
fn the_rule_swaps_only_when_moving_is_cheaper_and_only_into_free_slots() {
    let run_with = |tier: SwapConfig| {
        let mut s = scheduler(config(SchedulingPolicy::Fcfs, true), BLOCK_SIZE, 24);
        s.set_swap_space(tier);
        add_all(&mut s);
        let run = drive(&mut s, 5000);
        expect_all(&run);
        assert_eq!(s.stats().swap.num_used_slots, 0);
        s.stats()
    };
    // Fast tier, auto: every preemption swaps.
    let fast = run_with(swap(64, PreemptionMode::Auto, true));
    assert!(fast.num_preemptions > 0);
    assert_eq!(fast.swap.num_swap_preemptions, fast.num_preemptions);
    // Slow tier (2 MiB at 1 MB/s takes seconds; a few tokens take milliseconds): recompute.
    let slow = run_with(swap(64, PreemptionMode::Auto, false));
    assert!(slow.num_preemptions > 0);
    assert_eq!(slow.swap.num_swap_preemptions, 0);
    assert_eq!(slow.swap.num_recompute_preemptions, slow.num_preemptions);
    // Recompute mode never touches the tier, however fast.
    let never = run_with(swap(64, PreemptionMode::Recompute, true));
    assert_eq!((never.swap.num_swap_preemptions, never.swap.num_swapped_out_blocks), (0, 0));
    // Rates measured later change the choice: a slow tier measured fast swaps.
    let mut s = scheduler(config(SchedulingPolicy::Fcfs, true), BLOCK_SIZE, 24);
    s.set_swap_space(swap(64, PreemptionMode::Auto, false));
    s.set_swap_rates(Some(1e10), None);
    s.set_swap_rates(Some(f64::NAN), Some(-1.0)); // ignored
    add_all(&mut s);
    expect_all(&drive(&mut s, 5000));
    assert!(s.stats().swap.num_swap_preemptions > 0);
    // A tier of 3 slots: requests too large for what is free are recomputed.
    let small = run_with(swap(3, PreemptionMode::Swap, true));
    assert!(small.swap.num_recompute_preemptions > 0, "{small:?}");
    assert!(small.swap.num_swapped_out_blocks <= 3 * small.swap.num_swap_preemptions);
}

#[test]
fn prompt_logprob_requests_are_recomputed() {
    let cfg = SchedulerConfig { max_model_len: 40, ..config(SchedulingPolicy::Fcfs, false) };
    let mut s = scheduler(cfg, BLOCK_SIZE, 10);
    s.set_swap_space(swap(64, PreemptionMode::Swap, true));
    for id in 1..=2u64 {
        let sampling = SamplingParams {
            ignore_eos: true,
            prompt_logprobs: Some(1),
            ..SamplingParams::greedy(20)
        };
        s.add(kiln_sched::Request::new(RequestId(id), toks(0..16), sampling)).unwrap();
    }
    let run = drive(&mut s, 1000);
    assert_eq!(run.finished.len(), 2);
    let stats = s.stats();
    assert!(stats.num_preemptions > 0);
    assert_eq!(stats.swap.num_swap_preemptions, 0);
}

#[test]
fn aborting_a_swapped_request_frees_its_slots() {
    let mut s = scheduler(
        SchedulerConfig { max_model_len: 40, ..config(SchedulingPolicy::Fcfs, true) },
        BLOCK_SIZE,
        10,
    );
    s.set_swap_space(swap(16, PreemptionMode::Swap, true));
    s.add(req(1, toks(0..16), 20)).unwrap();
    s.add(req(2, toks(100..116), 20)).unwrap();
    let mut runner = FakeRunner::new(BLOCK_SIZE, 10);
    let mut swapped = None;
    for _ in 0..40 {
        let out = s.schedule();
        let res = runner.execute(&out);
        s.update(&out, &res);
        s.check_invariants().unwrap();
        if let Some(&id) = out.preempted_ids.first() {
            assert!(!out.swap_out.is_empty());
            swapped = Some(id);
            break;
        }
    }
    let id = swapped.expect("the run should preempt");
    let r = s.request(id).unwrap();
    assert_eq!(r.status(), RequestStatus::Preempted);
    assert!(r.num_swapped_tokens() > 0);
    assert!(s.stats().swap.num_used_slots > 0);
    assert!(s.abort(id));
    s.check_invariants().unwrap();
    assert_eq!(s.stats().swap.num_used_slots, 0);
    let run = drive_runner(&mut s, &mut runner, 1000, |_, _| false);
    assert_eq!(run.finished.len(), 1);
    assert_eq!((s.kv_cache().usage(), s.stats().swap.num_used_slots), (0.0, 0));
}

/// A seeded workload with aborts, shared prefixes and a small tier under every policy: the
/// tier's slots and the blocks are all free at the end, and every finished output is exact.
#[test]
fn a_mixed_workload_with_aborts_leaks_no_slot_and_changes_no_token() {
    for policy in [SchedulingPolicy::Fcfs, SchedulingPolicy::Priority, SchedulingPolicy::Sjf] {
        let cfg = SchedulerConfig {
            policy,
            long_prefill_token_threshold: 24,
            max_num_partial_prefills: 2,
            max_num_batched_tokens: 64,
            max_num_seqs: 6,
            max_model_len: 128,
            ..SchedulerConfig::default()
        };
        let mut s = scheduler(cfg, BLOCK_SIZE, 80);
        s.set_swap_space(swap(12, PreemptionMode::Swap, true));
        common::mixed_workload(&mut s, 8);
        let stats = s.stats();
        assert_eq!((stats.kv_usage, stats.swap.num_used_slots), (0.0, 0), "{policy:?}");
        assert!(stats.swap.num_swap_preemptions > 0, "{policy:?}: {stats:?}");
        assert!(stats.swap.num_recompute_preemptions > 0, "{policy:?}: the tier should fill");
        assert!(stats.swap.num_spilled_blocks > 0, "{policy:?}: {stats:?}");
    }
}

/// Runs one request alone to its end on `s` (with `runner`'s KV store and tier kept); returns
/// the step outputs.
fn run_alone(
    s: &mut Scheduler,
    runner: &mut FakeRunner,
    id: u64,
    prompt: Vec<TokenId>,
) -> common::Run {
    let len = prompt.len();
    s.add(req(id, prompt, 2)).unwrap();
    let run = drive_runner(s, runner, 100, |_, _| false);
    assert_eq!(run.outputs[&RequestId(id)], expected_output(id, len, 2));
    run
}

#[test]
fn an_evicted_prefix_comes_back_from_the_tier_and_skips_its_prefill() {
    let mut cached_without_tier = 0;
    for with_tier in [false, true] {
        // 12 blocks of 4: a 33-token prompt plus 2 outputs takes 9, so the next such request
        // evicts most of the first one's 8 cached blocks.
        let cfg = SchedulerConfig { max_model_len: 48, ..config(SchedulingPolicy::Fcfs, true) };
        let mut s = scheduler(cfg, BLOCK_SIZE, 12);
        if with_tier {
            s.set_swap_space(swap(16, PreemptionMode::Auto, true));
        }
        let mut runner = FakeRunner::new(BLOCK_SIZE, 12);
        let shared = toks(1000..1033);
        for round in 0..2u64 {
            run_alone(&mut s, &mut runner, 10 * round + 1, shared.clone());
            run_alone(
                &mut s,
                &mut runner,
                10 * round + 2,
                toks(2000 + round as u32 * 100..2033 + round as u32 * 100),
            );
            // The shared prompt again, with another ending: a few blocks still cached, the rest
            // spilled.
            let mut again = shared[..32].to_vec();
            again.push(TokenId(7));
            let run = run_alone(&mut s, &mut runner, 10 * round + 3, again);
            let first = &run.outputs_per_step[0];
            let computed = first.new_requests[0].num_computed_tokens;
            if with_tier {
                assert_eq!(computed, 32, "round {round}: every full block hit, cache then tier");
                assert_eq!(first.swap_in.len(), (32 - cached_without_tier) / BLOCK_SIZE);
                assert_eq!(first.num_scheduled_tokens, 1);
            } else {
                assert!(computed < 32, "only what the cache still holds");
                cached_without_tier = computed;
            }
            s.check_invariants().unwrap();
        }
        let stats = s.stats();
        if with_tier {
            assert!(stats.swap.num_spilled_blocks >= 12, "{stats:?}");
            let hit = 2 * (32 - cached_without_tier) as u64;
            assert_eq!(stats.swap.num_tier_hit_tokens, hit, "{stats:?}");
            assert!(stats.swap.num_spilled_slots > 0 && stats.swap.num_used_slots == 0);
        } else {
            assert_eq!(stats.swap, SwapStats::default());
        }
    }
}

#[test]
fn preempted_requests_take_the_slots_of_spilled_blocks() {
    let cfg = SchedulerConfig { max_model_len: 48, ..config(SchedulingPolicy::Fcfs, true) };
    let mut s = scheduler(cfg, BLOCK_SIZE, 12);
    // A tier of 8 slots, filled with spilled blocks first.
    s.set_swap_space(swap(8, PreemptionMode::Swap, true));
    let mut runner = FakeRunner::new(BLOCK_SIZE, 12);
    run_alone(&mut s, &mut runner, 1, toks(1000..1033));
    run_alone(&mut s, &mut runner, 2, toks(2000..2033));
    run_alone(&mut s, &mut runner, 3, toks(3000..3033));
    assert_eq!(s.stats().swap.num_spilled_slots, 8, "{:?}", s.stats().swap);
    // Two requests that cannot both fit: the preempted one swaps into spilled blocks' slots.
    s.add(req(4, toks(4000..4020), 20)).unwrap();
    s.add(req(5, toks(5000..5020), 20)).unwrap();
    let run = drive_runner(&mut s, &mut runner, 500, |_, _| false);
    assert_eq!(run.outputs[&RequestId(4)], expected_output(4, 20, 20));
    assert_eq!(run.outputs[&RequestId(5)], expected_output(5, 20, 20));
    let stats = s.stats().swap;
    assert!(stats.num_swap_preemptions > 0, "{stats:?}");
    assert_eq!(stats.num_used_slots, 0);
}

#[test]
fn a_disabled_tier_leaves_swapped_requests_to_recompute() {
    let mut s = scheduler(config(SchedulingPolicy::Fcfs, true), BLOCK_SIZE, 24);
    s.set_swap_space(swap(64, PreemptionMode::Swap, true));
    add_all(&mut s);
    let mut runner = FakeRunner::new(BLOCK_SIZE, 24);
    // Run until some request waits in the tier, then lose the tier.
    let mut steps = 0;
    while s.stats().swap.num_used_slots == 0 {
        let out = s.schedule();
        let res = runner.execute(&out);
        s.update(&out, &res);
        steps += 1;
        assert!(steps < 1000, "nothing was swapped");
    }
    s.disable_swap_space(&[]);
    s.check_invariants().unwrap();
    assert_eq!(s.stats().swap, SwapStats::default());
    let run = drive_runner(&mut s, &mut runner, 5000, |_, _| false);
    assert!(!s.has_unfinished());
    // The runner's KV checks passed: resumed requests recomputed instead of reading the tier.
    assert!(run.outputs_per_step.iter().all(|o| o.swap_in.is_empty() && o.swap_out.is_empty()));
}
