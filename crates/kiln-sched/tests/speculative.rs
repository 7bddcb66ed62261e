//! Multi-token steps driven by a fake runner: draft tokens proposed after a step, scheduled in
//! the budget with lookahead slots, verified by the runner (accepting 0..=k of k), rolled back
//! by `update`. Every scenario must produce exactly the tokens of a run without drafts, keep the
//! scheduler's invariants, never serve rejected-token KV (the fake runner checks every position
//! a step reads) and leave no block in use.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;

use common::{
    FakeRunner, config, drafts, drive_spec, expected_output, req, scheduler, token_for, toks,
};
use kiln_core::{FinishReason, RequestId, SamplingParams, TokenId};
use kiln_sched::{
    ModelRunnerOutput, Request, RequestStatus, Scheduler, SchedulerConfig, SchedulingPolicy,
};

/// One schedule → execute → update step.
fn step(s: &mut Scheduler, runner: &mut FakeRunner) -> kiln_sched::SchedulerOutput {
    let out = s.schedule();
    let res = runner.execute(&out);
    s.update(&out, &res);
    s.check_invariants().unwrap();
    out
}

#[test]
fn accepting_0_to_k_of_k_drafts_gives_the_tokens_of_plain_decoding() {
    for k in 1..=4 {
        for a in 0..=k {
            let mut s = scheduler(config(64, 4), 4, 64);
            let mut runner = FakeRunner::new(4, 64);
            s.add(req(1, toks(0..10), 20)).unwrap();
            let run = drive_spec(
                &mut s,
                &mut runner,
                100,
                |_, _| false,
                |r, _| drafts(r.id(), r.num_tokens(), k, a),
            );
            assert_eq!(run.outputs[&RequestId(1)], expected_output(1, 10, 20), "k={k} a={a}");
            assert_eq!(run.finished[&RequestId(1)].0, FinishReason::Length);
            // the prefill step yields 1 token, each later step a + 1 (fewer drafts at the end)
            assert_eq!(run.steps, 1 + 19u64.div_ceil(a as u64 + 1), "k={k} a={a}");
            assert!(runner.acceptance[&(k, a)] > 0, "k={k} a={a}: {:?}", runner.acceptance);
            assert_eq!(s.kv_cache().usage(), 0.0);
            s.check_invariants().unwrap();
        }
    }
}

#[test]
fn the_diff_carries_rolled_back_computed_counts_and_accepted_tokens() {
    let mut s = scheduler(config(64, 4), 4, 64);
    let mut runner = FakeRunner::new(4, 64);
    let id = RequestId(1);
    let t = |p| token_for(id, p);
    s.add(req(1, toks(0..6), 20)).unwrap();
    step(&mut s, &mut runner); // prefill: samples t(6)
    let r = s.request(id).unwrap();
    assert_eq!((r.num_tokens(), r.num_computed_tokens()), (7, 6));
    // three drafts, the first right
    assert!(s.update_draft_token_ids(id, &drafts(id, 7, 3, 1)));
    assert_eq!(s.request(id).unwrap().spec_token_ids().len(), 3);
    let out = step(&mut s, &mut runner);
    let c = &out.cached_requests[0];
    assert_eq!(out.new_token_ids(c), [t(6)]);
    assert_eq!((c.num_computed_tokens, c.num_scheduled_tokens), (6, 4));
    assert_eq!(c.spec_token_ids, drafts(id, 7, 3, 1));
    assert_eq!(out.num_scheduled_spec_tokens, 3);
    assert_eq!(out.num_scheduled_tokens, 4);
    // 10 slots for positions 0..=9: a third block, for lookahead
    assert_eq!(c.new_block_ids.len(), 1);
    let r = s.request(id).unwrap();
    // 6 + 4 computed, 2 drafts rejected: back to 8; t(7) accepted, t(8) sampled after it
    assert_eq!((r.num_tokens(), r.num_computed_tokens()), (9, 8));
    assert_eq!(r.all_token_ids()[r.num_prompt_tokens()..], [t(6), t(7), t(8)]);
    assert!(r.spec_token_ids().is_empty());
    // only known, computed tokens are registered: block 0 (positions 0..4) and block 1 (4..8)
    assert_eq!(s.kv_cache().num_registered_blocks(id), 1);
    assert_eq!(s.kv_cache().block_table(id).len(), 3);
    // no drafts this time: a plain decode from the rolled-back count
    let out = step(&mut s, &mut runner);
    let c = &out.cached_requests[0];
    assert_eq!(out.new_token_ids(c), [t(7), t(8)]);
    assert_eq!((c.num_computed_tokens, c.num_scheduled_tokens), (8, 1));
    assert!(c.spec_token_ids.is_empty() && c.new_block_ids.is_empty());
    assert_eq!(s.kv_cache().num_registered_blocks(id), 2);
    assert!(s.abort(id));
    assert_eq!(s.kv_cache().usage(), 0.0);
}

#[test]
fn drafts_are_refused_unless_the_request_decodes_with_nothing_in_flight() {
    let cfg = SchedulerConfig { long_prefill_token_threshold: 4, ..config(64, 4) };
    let mut s = scheduler(cfg, 4, 64);
    let mut runner = FakeRunner::new(4, 64);
    let d = [TokenId(1), TokenId(2)];
    assert!(!s.update_draft_token_ids(RequestId(9), &d)); // unknown
    s.add(req(1, toks(0..10), 8)).unwrap();
    assert!(!s.update_draft_token_ids(RequestId(1), &d)); // waiting
    step(&mut s, &mut runner);
    assert!(!s.update_draft_token_ids(RequestId(1), &d)); // mid-prefill
    while s.request(RequestId(1)).unwrap().num_uncomputed_tokens() > 1 {
        step(&mut s, &mut runner);
    }
    let out = s.schedule();
    assert!(!s.update_draft_token_ids(RequestId(1), &d)); // in flight
    s.update(&out, &runner.execute(&out));
    assert!(s.update_draft_token_ids(RequestId(1), &d));
    assert!(s.update_draft_token_ids(RequestId(1), &[])); // clears
    assert!(s.request(RequestId(1)).unwrap().spec_token_ids().is_empty());
}

#[test]
fn the_budget_and_the_remaining_outputs_cap_the_drafts_scheduled() {
    // a budget of 3: one known token and two of five drafts; the rest are dropped
    let mut s = scheduler(config(3, 4), 4, 64);
    let mut runner = FakeRunner::new(4, 64);
    s.add(req(1, toks(0..2), 30)).unwrap();
    let run = drive_spec(
        &mut s,
        &mut runner,
        100,
        |_, _| false,
        |r, _| drafts(r.id(), r.num_tokens(), 5, 5),
    );
    assert_eq!(run.outputs[&RequestId(1)], expected_output(1, 2, 30));
    let spec: Vec<usize> =
        run.outputs_per_step.iter().map(|o| o.num_scheduled_spec_tokens).collect();
    // 29 outputs after the prefill: nine steps of 3, then 2 (one draft)
    assert_eq!(spec, [0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1]);
    assert!(runner.acceptance.keys().all(|&(k, a)| k == a && k <= 2));

    // max_tokens: after the first output, 4 more are allowed, so at most 3 drafts are verified
    let mut s = scheduler(config(64, 4), 4, 64);
    s.add(req(1, toks(0..5), 5)).unwrap();
    let mut runner = FakeRunner::new(4, 64);
    let run = drive_spec(
        &mut s,
        &mut runner,
        100,
        |_, _| false,
        |r, _| drafts(r.id(), r.num_tokens(), 10, 10),
    );
    assert_eq!(run.steps, 2);
    assert_eq!(run.outputs_per_step[1].num_scheduled_spec_tokens, 3);
    assert_eq!(run.outputs[&RequestId(1)], expected_output(1, 5, 5));
    assert_eq!(run.finished[&RequestId(1)], (FinishReason::Length, 2));
    assert_eq!(s.kv_cache().usage(), 0.0);

    // max_model_len caps them the same way
    let cfg = SchedulerConfig { max_model_len: 12, ..config(64, 4) };
    let mut s = scheduler(cfg, 4, 64);
    s.add(req(1, toks(0..8), 4)).unwrap();
    let mut runner = FakeRunner::new(4, 64);
    let run = drive_spec(
        &mut s,
        &mut runner,
        100,
        |_, _| false,
        |r, _| drafts(r.id(), r.num_tokens(), 10, 10),
    );
    assert_eq!(run.outputs_per_step[1].num_scheduled_spec_tokens, 2);
    assert_eq!(run.outputs[&RequestId(1)].len(), 4);
}

/// A token tree travels with its parents; a malformed one is refused whole; the budget cuts a
/// tree to its first drafts (parents first, so still a tree); a chain clears the parents.
#[test]
fn token_trees_carry_their_parents_and_are_cut_to_the_budget() {
    let mut s = scheduler(config(4, 4), 4, 64);
    let mut runner = FakeRunner::new(4, 64);
    let id = RequestId(1);
    s.add(req(1, toks(0..6), 20)).unwrap();
    step(&mut s, &mut runner); // a prefill chunk of 4
    step(&mut s, &mut runner); // the last 2 prompt tokens, one output
    let tree = toks(100..105);
    let root = u32::MAX;
    for bad in [&[root, 0, 3, 1, 1][..], &[root, 0][..], &[0, 0, 0, 0, 0][..]] {
        assert!(!s.update_draft_tree(id, &tree, bad), "{bad:?}");
        assert!(s.request(id).unwrap().spec_token_ids().is_empty());
    }
    assert!(s.update_draft_tree(id, &tree, &[root, root, 0, 1, 2]));
    // A budget of 4: the last known token and the first three drafts.
    let out = s.schedule();
    let c = &out.cached_requests[0];
    assert_eq!(
        (c.spec_token_ids.as_slice(), c.spec_parents.as_slice()),
        (&tree[..3], &[root, root, 0][..])
    );
    s.update(&out, &runner.execute(&out));
    s.check_invariants().unwrap();
    assert!(s.update_draft_token_ids(id, &tree[..2]));
    let out = s.schedule();
    assert!(out.cached_requests[0].spec_parents.is_empty(), "a chain has no parents");
}

#[test]
fn a_stop_inside_the_accepted_tokens_drops_the_rest() {
    let strict = SamplingParams::greedy(20);
    let with_stop = |id: u64, output: usize, min_tokens: usize| {
        let stop = token_for(RequestId(id), 5 + output - 1);
        let params = SamplingParams { stop_token_ids: vec![stop], min_tokens, ..strict.clone() };
        Request::new(RequestId(id), toks(0..5), params)
    };
    let mut s = scheduler(config(64, 8), 4, 64);
    s.add(with_stop(1, 3, 0)).unwrap(); // the third output stops
    // EOS as the fourth output
    let eos = token_for(RequestId(2), 5 + 3);
    s.add(Request::new(RequestId(2), toks(0..5), strict.clone()).with_eos_token_ids(vec![eos]))
        .unwrap();
    // a stop token among the first `min_tokens` outputs does not stop
    s.add(with_stop(3, 2, 2)).unwrap();
    s.add(with_stop(4, 2, 1)).unwrap();
    let mut runner = FakeRunner::new(4, 64);
    let run = drive_spec(
        &mut s,
        &mut runner,
        100,
        |_, _| false,
        |r, _| drafts(r.id(), r.num_tokens(), 6, 6),
    );
    // step 2 verifies six drafts for each: request 1 keeps 2 of the 7 tokens
    assert_eq!(run.finished[&RequestId(1)], (FinishReason::Stop, 2));
    assert_eq!(run.outputs[&RequestId(1)], expected_output(1, 5, 3));
    assert_eq!(run.finished[&RequestId(2)], (FinishReason::Stop, 2));
    assert_eq!(run.outputs[&RequestId(2)], expected_output(2, 5, 4));
    assert_eq!(run.finished[&RequestId(3)].0, FinishReason::Length);
    assert_eq!(run.outputs[&RequestId(3)], expected_output(3, 5, 20));
    assert_eq!(run.finished[&RequestId(4)], (FinishReason::Stop, 2));
    assert_eq!(run.outputs[&RequestId(4)], expected_output(4, 5, 2));
    assert_eq!(s.kv_cache().usage(), 0.0);
}

#[test]
fn drafts_share_steps_with_chunked_prefills() {
    let cfg = SchedulerConfig {
        long_prefill_token_threshold: 6,
        max_num_partial_prefills: 2,
        ..config(16, 8)
    };
    let mut s = scheduler(cfg, 4, 128);
    let mut runner = FakeRunner::new(4, 128);
    s.add(req(1, toks(0..3), 30)).unwrap();
    let mut id = 1;
    let run = drive_spec(
        &mut s,
        &mut runner,
        500,
        |s, step| {
            if step % 5 == 0 && id < 6 {
                id += 1;
                s.add(req(id, toks(id as u32 * 100..id as u32 * 100 + 40), 12)).unwrap();
            }
            id < 6
        },
        // k = 5 is capped to 5 by the threshold (6 tokens per request per step)
        |r, step| drafts(r.id(), r.num_tokens(), 5, (step % 6) as usize),
    );
    assert!(!s.has_unfinished());
    assert_eq!(run.outputs[&RequestId(1)], expected_output(1, 3, 30));
    for i in 2..=6 {
        assert_eq!(run.outputs[&RequestId(i)], expected_output(i, 40, 12), "{i}");
    }
    // some step mixed a prefill chunk with verified drafts
    assert!(run.outputs_per_step.iter().any(|o| {
        let prefill = o.new_requests.iter().map(|n| n.num_scheduled_tokens).chain(
            o.cached_requests
                .iter()
                .filter(|c| c.spec_token_ids.is_empty())
                .map(|c| c.num_scheduled_tokens),
        );
        o.num_scheduled_spec_tokens > 0 && prefill.max().unwrap_or(0) > 1
    }));
    assert_eq!(s.kv_cache().usage(), 0.0);
}

#[test]
fn rejected_draft_kv_is_never_a_prefix_hit() {
    let mut s = scheduler(config(64, 8), 4, 64);
    let mut runner = FakeRunner::new(4, 64);
    let a = RequestId(1);
    let prompt = toks(0..8);
    s.add(req(1, prompt.clone(), 12)).unwrap();
    // every draft rejected: each step writes three wrong tokens' KV past the last token
    let run = drive_spec(
        &mut s,
        &mut runner,
        100,
        |_, _| false,
        |r, _| drafts(r.id(), r.num_tokens(), 3, 0),
    );
    assert_eq!(run.outputs[&a], expected_output(1, 8, 12));
    // step 2 wrote [t8, w9, w10, w11] into positions 8..12, a full block: a request whose
    // prompt has exactly those tokens must not hit it
    let rejected = drafts(a, 9, 3, 0);
    let c_prompt = [prompt.clone(), vec![token_for(a, 8)], rejected, toks(900..903)].concat();
    assert_eq!(s.kv_cache().lookup_prefix(&c_prompt).num_cached_tokens, 8);
    // the confirmed tokens are hits up to the last full block whose KV was computed
    let confirmed = [prompt, expected_output(1, 8, 12)].concat();
    let b_prompt = [confirmed, toks(950..953)].concat();
    assert_eq!(s.kv_cache().lookup_prefix(&b_prompt).num_cached_tokens, 16);
    s.add(req(2, b_prompt.clone(), 5)).unwrap();
    s.add(req(3, c_prompt.clone(), 5)).unwrap();
    let run = drive_spec(
        &mut s,
        &mut runner,
        100,
        |_, _| false,
        |r, _| drafts(r.id(), r.num_tokens(), 2, 1),
    );
    let news = &run.outputs_per_step[0].new_requests;
    assert_eq!(news.iter().map(|n| n.num_computed_tokens).collect::<Vec<_>>(), [16, 8]);
    assert_eq!(run.outputs[&RequestId(2)], expected_output(2, b_prompt.len(), 5));
    assert_eq!(run.outputs[&RequestId(3)], expected_output(3, c_prompt.len(), 5));
    assert_eq!(s.kv_cache().usage(), 0.0);
}

#[test]
fn a_request_with_drafts_is_preempted_and_resumes_with_the_same_tokens() {
    // 8 blocks of 4: two requests of 12-token prompts outgrow them
    let cfg = SchedulerConfig { max_model_len: 32, ..config(64, 4) };
    let mut s = scheduler(cfg, 4, 8);
    let mut runner = FakeRunner::new(4, 8);
    s.add(req(1, toks(0..12), 16)).unwrap();
    s.add(req(2, toks(100..112), 16)).unwrap();
    let mut preempted_with_drafts = false;
    let mut outputs = HashMap::new();
    for _ in 0..100 {
        if !s.has_unfinished() {
            break;
        }
        let with_drafts: Vec<RequestId> = [RequestId(1), RequestId(2)]
            .into_iter()
            .filter(|&id| s.request(id).is_some_and(|r| !r.spec_token_ids().is_empty()))
            .collect();
        let out = s.schedule();
        for id in &out.preempted_ids {
            preempted_with_drafts |= with_drafts.contains(id);
            let r = s.request(*id).unwrap();
            assert_eq!(r.status(), RequestStatus::Preempted);
            assert!(r.spec_token_ids().is_empty());
            assert_eq!(r.num_computed_tokens(), 0);
        }
        let res = runner.execute(&out);
        for o in s.update(&out, &res) {
            outputs.entry(o.id).or_insert_with(Vec::new).push(o.new_token);
        }
        s.check_invariants().unwrap();
        for (id, _) in out.scheduled() {
            if let Some(r) = s.request(id).filter(|r| r.num_uncomputed_tokens() == 1) {
                let d = drafts(id, r.num_tokens(), 3, 2);
                assert!(s.update_draft_token_ids(id, &d));
            }
        }
    }
    assert!(preempted_with_drafts);
    assert!(!s.has_unfinished());
    assert_eq!(s.kv_cache().usage(), 0.0);
    assert!(runner.acceptance.contains_key(&(3, 2)));
    assert_eq!(outputs[&RequestId(1)], expected_output(1, 12, 16));
    assert_eq!(outputs[&RequestId(2)], expected_output(2, 12, 16));
}

#[test]
fn aborts_mid_speculation_leave_no_blocks_in_use() {
    let mut s = scheduler(config(64, 8), 4, 64);
    let mut runner = FakeRunner::new(4, 64);
    for id in 1..=3 {
        s.add(req(id, toks(id as u32 * 10..id as u32 * 10 + 7), 20)).unwrap();
    }
    step(&mut s, &mut runner);
    for id in 1..=3 {
        let r = s.request(RequestId(id)).unwrap();
        let d = drafts(RequestId(id), r.num_tokens(), 4, 1);
        assert!(s.update_draft_token_ids(RequestId(id), &d));
    }
    // 1: aborted with drafts pending; 2: aborted between schedule and update
    assert!(s.abort(RequestId(1)));
    let out = s.schedule();
    assert_eq!(out.finished_ids, [RequestId(1)]);
    assert_eq!(out.num_scheduled_spec_tokens, 8);
    let res = runner.execute(&out);
    assert!(s.abort(RequestId(2)));
    let news = s.update(&out, &res);
    assert!(news.iter().all(|o| o.id == RequestId(3)));
    assert_eq!(news.len(), 2);
    s.check_invariants().unwrap();
    // request 2's step counts as run (its 8 known tokens are cached), its drafts do not
    let r2 = [toks(20..27), expected_output(2, 7, 1), drafts(RequestId(2), 8, 4, 1)].concat();
    assert_eq!(s.kv_cache().lookup_prefix(&[r2, toks(0..3)].concat()).num_cached_tokens, 8);
    // 3: aborted after its drafts were verified
    let d = drafts(RequestId(3), s.request(RequestId(3)).unwrap().num_tokens(), 4, 4);
    assert!(s.update_draft_token_ids(RequestId(3), &d));
    step(&mut s, &mut runner);
    assert!(s.abort(RequestId(3)));
    s.check_invariants().unwrap();
    assert_eq!(s.kv_cache().usage(), 0.0);
    assert!(!s.has_unfinished());
}

#[test]
fn a_runner_that_reports_no_tokens_rejects_every_draft() {
    let mut s = scheduler(config(64, 8), 4, 64);
    let mut runner = FakeRunner::new(4, 64);
    s.add(req(1, toks(0..7), 10)).unwrap();
    step(&mut s, &mut runner);
    let id = RequestId(1);
    assert!(s.update_draft_token_ids(id, &drafts(id, 8, 3, 3)));
    let out = s.schedule();
    // the step failed for this request: no tokens, so nothing is confirmed past its last token
    assert!(s.update(&out, &[(id, [])].into_iter().collect::<ModelRunnerOutput>()).is_empty());
    s.check_invariants().unwrap();
    let r = s.request(id).unwrap();
    assert_eq!((r.num_tokens(), r.num_computed_tokens()), (8, 8));
    assert!(s.abort(id));
    assert_eq!(s.kv_cache().usage(), 0.0);
}

/// A seeded generator of values in `0..m`.
fn lcg(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut state = 0x9e37_79b9_7f4a_7c15_u64 ^ seed;
    move |m| {
        state =
            state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) % m
    }
}

/// A seeded random workload: arrivals, aborts, tight blocks (preemption), a small budget
/// (chunked prefill), a tiny vocabulary (prefix hits), and after every step random drafts with
/// a random number right; with even seeds, a second KV tier (preemption by swap, spilled
/// prefixes). Every request produces exactly the tokens of plain decoding.
#[test]
fn random_acceptance_over_a_mixed_workload_changes_no_token_and_leaks_no_block() {
    for (policy, seed) in [
        (SchedulingPolicy::Fcfs, 1u64),
        (SchedulingPolicy::Priority, 2),
        (SchedulingPolicy::Sjf, 3),
        (SchedulingPolicy::Fcfs, 4),
    ] {
        let cfg = SchedulerConfig {
            policy,
            long_prefill_token_threshold: 24,
            max_num_partial_prefills: 2,
            ..config(40, 6)
        };
        let mut s = scheduler(cfg, 4, 60);
        let with_tier = seed % 2 == 0;
        if with_tier {
            s.set_swap_space(kiln_sched::SwapConfig {
                num_slots: 24,
                block_bytes: 1,
                mode: kiln_sched::PreemptionMode::Swap,
                tier_bytes_per_sec: 1.0,
                prefill_secs_per_token: 1.0,
            });
        }
        let mut runner = FakeRunner::new(4, 60);
        let mut next = lcg(seed);
        let mut rng2 = lcg(seed + 100);
        let mut id = 0;
        let mut prompt_lens = HashMap::new();
        let run = drive_spec(
            &mut s,
            &mut runner,
            20_000,
            |s, step| {
                if step <= 400 && next(3) == 0 {
                    id += 1;
                    let prompt: Vec<TokenId> =
                        (0..=next(60)).map(|_| TokenId(next(2) as u32)).collect();
                    prompt_lens.insert(RequestId(id), prompt.len());
                    let r = req(id, prompt, 1 + next(40) as usize).with_priority(next(5) as i64);
                    s.add(r).unwrap();
                    if next(8) == 0 {
                        s.abort(RequestId(next(id) + 1));
                    }
                }
                step < 400
            },
            |r, _| {
                let k = rng2(5) as usize;
                let a = rng2(k as u64 + 1) as usize;
                drafts(r.id(), r.num_tokens(), k, a)
            },
        );
        assert!(!s.has_unfinished(), "{policy:?} did not drain in {} steps", run.steps);
        assert_eq!(s.kv_cache().usage(), 0.0);
        s.check_invariants().unwrap();
        let stats = s.stats();
        assert!(stats.prefix_cache.num_hit_tokens > 0, "{policy:?}: prefixes should collide");
        assert!(stats.num_preemptions > 0, "{policy:?}: the workload should preempt");
        if with_tier {
            assert!(stats.swap.num_swap_preemptions > 0, "{policy:?}: {stats:?}");
            assert!(stats.swap.num_spilled_blocks > 0, "{policy:?}: {stats:?}");
            assert_eq!(stats.swap.num_used_slots, 0);
        }
        for k in 1..=4 {
            for a in 0..=k {
                assert!(
                    runner.acceptance.contains_key(&(k, a)),
                    "{policy:?}: ({k}, {a}) never seen"
                );
            }
        }
        for (id, (reason, _)) in &run.finished {
            assert_eq!(*reason, FinishReason::Length);
            let out = &run.outputs[id];
            assert_eq!(*out, expected_output(id.0, prompt_lens[id], out.len()), "{policy:?} {id}");
        }
        let spec: usize = run.outputs_per_step.iter().map(|o| o.num_scheduled_spec_tokens).sum();
        assert!(spec > 0);
    }
}
