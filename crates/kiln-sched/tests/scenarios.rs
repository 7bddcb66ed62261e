//! Chunked prefill, preemption and resume, prefix hits, aborts, stop conditions and limits,
//! driven by a fake runner (no model).

#![allow(clippy::unwrap_used)]

mod common;

use common::{config, drive, drive_runner, expected_output, req, scheduler, token_for, toks};
use kiln_core::{FinishReason, RequestId, SamplingParams, TokenId};
use kiln_sched::{AddError, Request, RequestStatus, SchedulerConfig, SchedulingPolicy};

#[test]
fn a_long_prompt_is_prefilled_in_chunks_under_a_small_budget() {
    let mut s = scheduler(config(16, 8), 4, 64);
    s.add(req(1, toks(0..100), 3)).unwrap();
    let run = drive(&mut s, 100);
    let chunks: Vec<usize> = run.outputs_per_step.iter().map(|o| o.num_scheduled_tokens).collect();
    assert_eq!(chunks, [16, 16, 16, 16, 16, 16, 4, 1, 1]);
    assert_eq!(run.outputs[&RequestId(1)], expected_output(1, 100, 3));
    assert_eq!(run.finished[&RequestId(1)].0, FinishReason::Length);
    assert_eq!(s.kv_cache().usage(), 0.0);
    let stats = s.stats();
    assert_eq!((stats.num_scheduled_tokens, stats.num_steps), (102, 9));
}

#[test]
fn long_prefill_token_threshold_caps_chunks_and_decodes_share_the_step() {
    let cfg = SchedulerConfig { long_prefill_token_threshold: 8, ..config(64, 8) };
    let mut s = scheduler(cfg, 4, 64);
    s.add(req(1, toks(0..5), 10)).unwrap();
    s.add(req(2, toks(10..40), 2)).unwrap();
    let run = drive(&mut s, 100);
    // step 1: request 1's prompt (5) and an 8-token chunk of request 2; then decode + chunks.
    let first: Vec<(RequestId, usize)> = run.outputs_per_step[0].scheduled().collect();
    assert_eq!(first, [(RequestId(1), 5), (RequestId(2), 8)]);
    let second: Vec<(RequestId, usize)> = run.outputs_per_step[1].scheduled().collect();
    assert_eq!(second, [(RequestId(1), 1), (RequestId(2), 8)]);
    assert_eq!(run.outputs[&RequestId(1)], expected_output(1, 5, 10));
    assert_eq!(run.outputs[&RequestId(2)], expected_output(2, 30, 2));
}

#[test]
fn whole_prompts_are_never_chunked_and_wait_for_a_step_with_room() {
    // An encoder's scheduler: prompts of 20 and 30 under a budget of 40, the chunk cap
    // ignored. The second waits for the next step rather than running 20 of its 30 tokens.
    let cfg = SchedulerConfig {
        whole_prompts: true,
        long_prefill_token_threshold: 8,
        enable_prefix_caching: false,
        ..config(40, 8)
    };
    let mut s = scheduler(cfg, 4, 64);
    s.add(req(1, toks(0..20), 1)).unwrap();
    s.add(req(2, toks(100..130), 1)).unwrap();
    let run = drive(&mut s, 100);
    let steps: Vec<Vec<(RequestId, usize)>> =
        run.outputs_per_step.iter().map(|o| o.scheduled().collect()).collect();
    assert_eq!(steps[0], [(RequestId(1), 20)]);
    assert_eq!(steps[1], [(RequestId(2), 30)]);
    assert_eq!(run.finished.len(), 2);
    // A controller lowering the budget cannot starve a whole prompt: the budget stays at
    // least the longest prompt allowed.
    let cfg =
        SchedulerConfig { whole_prompts: true, enable_prefix_caching: false, ..config(40, 8) };
    let mut s = scheduler(SchedulerConfig { max_model_len: 32, ..cfg }, 4, 64);
    let limits =
        s.set_limits(kiln_sched::StepLimits { max_num_batched_tokens: 1, max_num_seqs: 8 });
    assert_eq!(limits.max_num_batched_tokens, 32);
    s.add(req(3, toks(200..230), 1)).unwrap();
    assert_eq!(s.schedule().num_scheduled_tokens, 30);
}

#[test]
fn max_num_partial_prefills_limits_concurrent_chunked_prompts() {
    let cfg = SchedulerConfig { long_prefill_token_threshold: 8, ..config(64, 8) };
    let mut s = scheduler(cfg, 4, 128);
    for id in 1..=3 {
        s.add(req(
            id,
            toks(0..40).into_iter().map(|t| TokenId(t.0 + id as u32 * 100)).collect(),
            2,
        ))
        .unwrap();
    }
    let out = s.schedule();
    // one partial prefill at a time: request 2 would also stop mid-prompt, so admission stops
    assert_eq!(out.new_requests.len(), 1);
    assert_eq!(out.num_scheduled_tokens, 8);
    s.abort(RequestId(1));
    let cfg = SchedulerConfig {
        max_num_partial_prefills: 2,
        long_prefill_token_threshold: 8,
        ..config(64, 8)
    };
    let mut s = scheduler(cfg, 4, 128);
    for id in 1..=3 {
        s.add(req(id, toks(0..40), 2)).unwrap();
    }
    let run = drive(&mut s, 200);
    let partial_max = run.outputs_per_step.iter().map(|o| o.new_requests.len()).max().unwrap();
    assert_eq!(partial_max, 2);
    assert_eq!(run.finished.len(), 3);
}

/// Many requests over too few blocks: preemptions happen, and every request still produces
/// exactly the tokens of a run with plenty of blocks.
fn preemption_matches_plenty(policy: SchedulingPolicy, enable_prefix_caching: bool) {
    let cfg = |num_seqs| SchedulerConfig {
        policy,
        enable_prefix_caching,
        priority_aging_steps: 4,
        sjf_aging_tokens_per_step: 2,
        max_model_len: 96,
        ..config(48, num_seqs)
    };
    let add_all = |s: &mut kiln_sched::Scheduler| {
        for id in 1..=8u64 {
            let prompt = toks(id as u32 * 50..id as u32 * 50 + 13 + id as u32 * 3);
            s.add(req(id, prompt, 20 + id as usize * 2).with_priority(id as i64 % 3)).unwrap();
        }
    };
    let mut plenty = scheduler(cfg(8), 4, 1024);
    add_all(&mut plenty);
    let reference = drive(&mut plenty, 1000);
    assert_eq!(plenty.stats().num_preemptions, 0);
    let mut tight = scheduler(cfg(8), 4, 24);
    add_all(&mut tight);
    let run = drive(&mut tight, 5000);
    assert!(tight.stats().num_preemptions > 0, "{policy:?}: the run should preempt");
    assert!(!tight.has_unfinished());
    for id in 1..=8u64 {
        let id = RequestId(id);
        assert_eq!(run.outputs[&id], reference.outputs[&id], "{policy:?} {id}");
    }
    assert_eq!(tight.kv_cache().usage(), 0.0);
    // preempted requests come back as new requests carrying prompt + output
    let resumed = run
        .outputs_per_step
        .iter()
        .flat_map(|o| &o.new_requests)
        .filter(|n| n.token_ids.len() > 13 + 3 * n.id.0 as usize)
        .count();
    assert!(resumed > 0);
}

#[test]
fn preempted_requests_resume_with_identical_tokens_fcfs() {
    preemption_matches_plenty(SchedulingPolicy::Fcfs, true);
    preemption_matches_plenty(SchedulingPolicy::Fcfs, false);
}

#[test]
fn preempted_requests_resume_with_identical_tokens_priority() {
    preemption_matches_plenty(SchedulingPolicy::Priority, true);
    preemption_matches_plenty(SchedulingPolicy::Priority, false);
}

#[test]
fn preempted_requests_resume_with_identical_tokens_sjf() {
    preemption_matches_plenty(SchedulingPolicy::Sjf, true);
    preemption_matches_plenty(SchedulingPolicy::Sjf, false);
}

#[test]
fn a_shared_prefix_is_computed_once() {
    let mut s = scheduler(config(256, 8), 4, 128);
    let mut runner = common::FakeRunner::new(4, 128);
    let prefix = toks(1000..1064);
    let with_suffix = |a: u32| [prefix.clone(), toks(a..a + 8)].concat();
    s.add(req(1, with_suffix(1), 4)).unwrap();
    let run = drive_runner(&mut s, &mut runner, 50, |_, _| false);
    assert_eq!(run.outputs_per_step[0].num_scheduled_tokens, 72);
    s.add(req(2, with_suffix(2000), 4)).unwrap();
    let out = s.schedule();
    assert_eq!(out.new_requests[0].num_computed_tokens, 64);
    assert_eq!(out.num_scheduled_tokens, 8);
    let stats = s.stats().prefix_cache;
    assert_eq!((stats.num_requests, stats.num_hit_tokens), (2, 64));
    assert!(stats.hit_rate() > 0.4);
    let res = runner.execute(&out);
    s.abort(RequestId(2));
    assert!(s.update(&out, &res).is_empty());
    s.check_invariants().unwrap();
    // admitted in the same step, the second request hits the blocks the first registers now
    s.add(req(3, with_suffix(3000), 4)).unwrap();
    s.add(req(4, with_suffix(4000), 4)).unwrap();
    let run = drive_runner(&mut s, &mut runner, 50, |_, _| false);
    let first = &run.outputs_per_step[0].new_requests;
    assert_eq!(first.iter().map(|n| n.num_computed_tokens).collect::<Vec<_>>(), [64, 64]);
    assert_eq!(run.outputs[&RequestId(4)], expected_output(4, 72, 4));
}

#[test]
fn requests_sharing_a_prefix_in_one_step_hit_what_the_first_registers() {
    let mut s = scheduler(config(512, 8), 4, 128);
    let prefix = toks(1..41);
    s.add(req(1, [prefix.clone(), toks(500..503)].concat(), 3)).unwrap();
    s.add(req(2, [prefix, toks(600..603)].concat(), 3)).unwrap();
    let run = drive(&mut s, 50);
    let news = &run.outputs_per_step[0].new_requests;
    assert_eq!(news[1].num_computed_tokens, 40);
    assert_eq!(run.outputs[&RequestId(2)], expected_output(2, 43, 3));
}

#[test]
fn aborts_in_every_state_leave_no_blocks_in_use() {
    let cfg = SchedulerConfig {
        long_prefill_token_threshold: 8,
        max_num_partial_prefills: 4,
        ..config(32, 8)
    };
    let mut s = scheduler(cfg, 4, 64);
    assert!(!s.abort(RequestId(99)));
    s.add(req(1, toks(0..40), 50)).unwrap(); // will be mid-prefill
    s.add(req(2, toks(100..103), 50)).unwrap(); // will be decoding
    let mut runner = common::FakeRunner::new(4, 64);
    let mut step = |s: &mut kiln_sched::Scheduler| {
        let out = s.schedule();
        let res = runner.execute(&out);
        s.update(&out, &res);
        s.check_invariants().unwrap();
        out
    };
    step(&mut s);
    step(&mut s);
    s.add(req(3, toks(200..210), 5)).unwrap(); // waiting
    assert_eq!(s.request(RequestId(1)).unwrap().status(), RequestStatus::Running);
    assert!(s.request(RequestId(1)).unwrap().num_computed_tokens() < 40);
    assert!(s.request(RequestId(2)).unwrap().num_output_tokens() > 0);
    assert!(s.abort(RequestId(3)));
    assert!(s.abort(RequestId(1)));
    let out = step(&mut s);
    assert_eq!(out.finished_ids, [RequestId(1)]);
    assert!(s.abort(RequestId(2)));
    s.check_invariants().unwrap();
    assert_eq!(s.kv_cache().usage(), 0.0);
    assert!(!s.has_unfinished());

    // preempted: two requests over few blocks, abort the one that lost its blocks
    let mut s = scheduler(SchedulerConfig { max_model_len: 40, ..config(64, 8) }, 4, 10);
    s.add(req(1, toks(0..16), 20)).unwrap();
    s.add(req(2, toks(100..116), 20)).unwrap();
    let mut runner = common::FakeRunner::new(4, 10);
    let mut preempted = None;
    for _ in 0..40 {
        let out = s.schedule();
        let res = runner.execute(&out);
        s.update(&out, &res);
        s.check_invariants().unwrap();
        if let Some(&id) = out.preempted_ids.first() {
            preempted = Some(id);
            break;
        }
    }
    let id = preempted.expect("the run should preempt");
    assert_eq!(s.request(id).unwrap().status(), RequestStatus::Preempted);
    assert!(s.abort(id));
    // in flight: scheduled but not yet updated
    let out = s.schedule();
    let other = out.scheduled().next().unwrap().0;
    assert!(s.abort(other));
    s.check_invariants().unwrap();
    assert_eq!(s.kv_cache().usage(), 0.0);
    assert!(!s.has_unfinished());
    // the late runner output is ignored
    assert!(s.update(&out, &runner.execute(&out)).is_empty());
}

#[test]
fn stop_conditions_end_requests_with_the_right_reason() {
    let mut s = scheduler(config(64, 8), 4, 64);
    let eos = token_for(RequestId(1), 5 + 2); // the third output of request 1
    s.add(req(1, toks(0..5), 10).with_eos_token_ids(vec![eos])).unwrap(); // ignore_eos
    let strict = SamplingParams::greedy(10);
    s.add(
        Request::new(RequestId(2), toks(0..5), strict.clone())
            .with_eos_token_ids(vec![token_for(RequestId(2), 5 + 3)]),
    )
    .unwrap();
    let stop = SamplingParams { stop_token_ids: vec![token_for(RequestId(3), 6)], ..strict };
    s.add(Request::new(RequestId(3), toks(0..5), stop)).unwrap();
    let run = drive(&mut s, 50);
    assert_eq!(run.finished[&RequestId(1)].0, FinishReason::Length);
    assert_eq!(run.outputs[&RequestId(1)].len(), 10);
    assert_eq!(run.finished[&RequestId(2)].0, FinishReason::Stop);
    assert_eq!(run.outputs[&RequestId(2)].len(), 4);
    assert_eq!(run.finished[&RequestId(3)].0, FinishReason::Stop);
    assert_eq!(run.outputs[&RequestId(3)].len(), 2);
    // the runner hears of request 3's finish in the next step's output
    assert!(run.outputs_per_step.iter().any(|o| o.finished_ids.contains(&RequestId(3))));
}

#[test]
fn add_rejects_what_can_never_run() {
    let mut s = scheduler(SchedulerConfig { max_model_len: 512, ..config(64, 8) }, 4, 200);
    let err = s.add(req(1, toks(0..500), 20)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "This model's maximum context length is 512 tokens. However, you requested 520 tokens \
         (500 in the messages, 20 in the completion). Please reduce the length of the messages \
         or completion."
    );
    assert!(matches!(s.add(req(2, vec![], 4)), Err(AddError::EmptyPrompt(_))));
    s.add(req(3, toks(0..4), 4)).unwrap();
    assert_eq!(s.add(req(3, toks(0..4), 4)), Err(AddError::DuplicateId(RequestId(3))));
    let bad = SamplingParams { top_p: 0.0, ..SamplingParams::default() };
    let err = s.add(Request::new(RequestId(4), toks(0..4), bad)).unwrap_err();
    assert!(err.to_string().contains("top_p"), "{err}");
    assert_eq!(s.num_waiting(), 1);
}

#[test]
fn config_validation_names_the_flag() {
    let ok = config(64, 8);
    assert!(ok.validate(4, 128).is_ok());
    let zero = SchedulerConfig { max_num_partial_prefills: 0, ..ok.clone() };
    assert!(zero.validate(4, 128).unwrap_err().to_string().contains("max_num_partial_prefills"));
    let zero = SchedulerConfig { max_num_seqs: 0, ..ok.clone() };
    assert!(zero.validate(4, 128).unwrap_err().to_string().contains("max_num_seqs"));
    let err = kiln_sched::Scheduler::new(ok, common::kv(4, 20)).unwrap_err();
    assert!(err.to_string().contains("exceeds the KV cache capacity"), "{err}");
}

/// A seeded mixed workload under every policy: the limits hold every step and everything
/// finishes with no blocks left in use.
#[test]
fn limits_hold_under_a_mixed_workload() {
    for policy in [SchedulingPolicy::Fcfs, SchedulingPolicy::Priority, SchedulingPolicy::Sjf] {
        let mut s = common::mixed_scheduler(policy);
        let run = common::mixed_workload(&mut s, 10);
        assert_eq!(s.kv_cache().usage(), 0.0);
        assert!(s.stats().prefix_cache.num_hit_tokens > 0, "{policy:?}: prefixes should collide");
        assert!(s.stats().num_preemptions > 0, "{policy:?}: the workload should preempt");
        for o in &run.outputs_per_step {
            assert!(o.num_scheduled_requests() <= 6);
        }
    }
}

#[test]
fn a_prefill_chunk_ahead_in_the_order_leaves_a_token_for_every_decode() {
    // Priority order puts request 1's long prefill ahead of two decoding requests: its chunks
    // take the budget but one token for each decode, so the decodes never skip a step.
    let cfg = SchedulerConfig { policy: SchedulingPolicy::Priority, ..config(16, 8) };
    let mut s = scheduler(cfg, 4, 128);
    s.add(req(2, toks(200..204), 20).with_priority(5)).unwrap();
    s.add(req(3, toks(300..304), 20).with_priority(5)).unwrap();
    let mut runner = common::FakeRunner::new(4, 128);
    let out = s.schedule();
    s.update(&out, &runner.execute(&out));
    s.add(req(1, toks(0..100), 2).with_priority(0)).unwrap();
    let mut chunks = Vec::new();
    for _ in 0..8 {
        let out = s.schedule();
        let by_id: std::collections::HashMap<RequestId, usize> = out.scheduled().collect();
        assert_eq!((by_id.get(&RequestId(2)), by_id.get(&RequestId(3))), (Some(&1), Some(&1)));
        chunks.push(by_id.get(&RequestId(1)).copied().unwrap_or(0));
        s.update(&out, &runner.execute(&out));
        s.check_invariants().unwrap();
    }
    assert_eq!(chunks, [14, 14, 14, 14, 14, 14, 14, 2]);
}

#[test]
fn a_failed_step_leaves_nothing_it_scheduled_in_the_prefix_cache() {
    let mut s = scheduler(config(64, 8), 4, 64);
    let prompt = toks(0..33);
    s.add(req(1, prompt.clone(), 4)).unwrap();
    let out = s.schedule();
    assert_eq!(out.num_scheduled_tokens, 33);
    // The step failed: its KV was never written, and the request is aborted.
    s.fail_step(&out);
    assert!(s.abort(RequestId(1)));
    s.check_invariants().unwrap();
    assert_eq!(s.kv_cache().lookup_prefix(&prompt).num_cached_tokens, 0);
    // Without the failure, the same blocks would have stayed cached.
    let mut s = scheduler(config(64, 8), 4, 64);
    s.add(req(1, prompt.clone(), 4)).unwrap();
    s.schedule();
    assert!(s.abort(RequestId(1)));
    assert_eq!(s.kv_cache().lookup_prefix(&prompt).num_cached_tokens, 32);
}
