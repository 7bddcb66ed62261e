//! Steps planned ahead of the step in flight (asynchronous scheduling with placeholders),
//! driven by the fake runner: every token is the one scheduling after each update gives, no
//! placeholder reaches a read of the KV or the prefix cache, and a step planned ahead never
//! preempts (the driver checks each step).

#![allow(clippy::unwrap_used)]

mod common;

use common::ahead::drive_ahead_with;
use common::{config, drive, req, scheduler, token_for, toks};
use kiln_core::{FinishReason, RequestId, SamplingParams, TokenId};
use kiln_sched::{Request, SchedulingPolicy};

#[test]
fn planning_ahead_changes_no_token_under_a_mixed_workload() {
    for policy in [SchedulingPolicy::Fcfs, SchedulingPolicy::Priority, SchedulingPolicy::Sjf] {
        let mut s = common::mixed_scheduler(policy);
        let mut num_ahead = 0;
        // Aborts, chunked prefills, prefix hits, preemption; every token checked.
        let run = common::mixed_workload_driven(&mut s, 10, |s, max, before| {
            let (run, n) = drive_ahead_with(s, max, before);
            num_ahead = n;
            run
        });
        assert_eq!(s.kv_cache().usage(), 0.0, "{policy:?}");
        assert!(num_ahead > run.steps / 2, "{policy:?}: {num_ahead} of {}", run.steps);
        let stats = s.stats();
        assert!(stats.prefix_cache.num_hit_tokens > 0, "{policy:?}: prefixes should collide");
        // Preemption happens in the steps planned after an update, once one ahead ran short.
        assert!(stats.num_preemptions > 0, "{policy:?}: the workload should preempt");
    }
}

#[test]
fn a_placeholder_is_never_registered_and_its_block_is_once_its_token_is_known() {
    // Block size 4, a 6-token prompt, 10 outputs: the computed KV covers 15 tokens, so 3 full
    // blocks are registered, whether the steps were planned ahead (each decode's input a
    // placeholder when planned) or not.
    for ahead in [false, true] {
        let mut s = scheduler(config(64, 4), 4, 64);
        s.add(req(1, toks(0..6), 10)).unwrap();
        let run =
            if ahead { drive_ahead_with(&mut s, 100, |_, _| false).0 } else { drive(&mut s, 100) };
        let mut text = toks(0..6);
        text.extend(&run.outputs[&RequestId(1)]);
        assert_eq!(text.len(), 16);
        text.push(TokenId(7));
        assert_eq!(s.kv_cache().lookup_prefix(&text).num_cached_tokens, 12, "ahead: {ahead}");
    }
}

#[test]
fn a_request_that_stops_gives_no_token_from_the_step_planned_ahead_of_its_stop() {
    let stop = token_for(RequestId(1), 8 + 3); // request 1's fourth output
    let params = SamplingParams {
        ignore_eos: true,
        stop_token_ids: vec![stop],
        ..SamplingParams::greedy(12)
    };
    let mut s = scheduler(config(64, 4), 4, 64);
    s.add(Request::new(RequestId(1), toks(0..8), params)).unwrap();
    s.add(req(2, toks(20..25), 12)).unwrap();
    let (run, num_ahead) = drive_ahead_with(&mut s, 100, |_, _| false);
    let expected: Vec<TokenId> = (8..12).map(|p| token_for(RequestId(1), p)).collect();
    assert_eq!(run.outputs[&RequestId(1)], expected);
    assert_eq!(run.finished[&RequestId(1)].0, FinishReason::Stop);
    // Request 1's row in the step planned ahead of its stop was scheduled all the same.
    let scheduled_1 =
        run.outputs_per_step.iter().filter(|o| o.scheduled().any(|(id, _)| id == RequestId(1)));
    assert_eq!(scheduled_1.count(), 5, "a prefill, 3 decodes, 1 planned past the stop");
    assert_eq!(run.outputs[&RequestId(2)].len(), 12);
    assert!(num_ahead > 10);
    assert_eq!(s.kv_cache().usage(), 0.0);
}

#[test]
fn a_request_at_its_last_token_is_not_planned_past_it() {
    // `max_tokens` 3: the third output's placeholder is the last; no step computes past it.
    // (`add` refuses prompt plus `max_tokens` past the context, so `max_model_len` never
    // ends a request before `max_tokens` does.)
    let mut s = scheduler(config(64, 4), 4, 64);
    s.add(req(1, toks(0..5), 3)).unwrap();
    let (run, _) = drive_ahead_with(&mut s, 100, |_, _| false);
    assert_eq!(run.outputs[&RequestId(1)].len(), 3);
    assert_eq!(run.finished[&RequestId(1)].0, FinishReason::Length);
    let tokens: usize = run.outputs_per_step.iter().map(|o| o.num_scheduled_tokens).sum();
    assert_eq!(tokens, 5 + 2, "the prompt, then the first two outputs as inputs");
    assert_eq!(s.kv_cache().usage(), 0.0);
}
