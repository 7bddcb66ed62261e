//! Each policy's admission order, its preemption victim, and starvation freedom through aging.

#![allow(clippy::unwrap_used)]

mod common;

use common::{drive, drive_with, req, scheduler, toks};
use kiln_core::RequestId;
use kiln_sched::{Scheduler, SchedulerConfig, SchedulingPolicy};

fn config(policy: SchedulingPolicy) -> SchedulerConfig {
    SchedulerConfig {
        policy,
        max_num_batched_tokens: 64,
        max_num_seqs: 1,
        max_model_len: 48,
        priority_aging_steps: 1000,
        sjf_aging_tokens_per_step: 1,
        ..SchedulerConfig::default()
    }
}

fn ids(v: &[u64]) -> Vec<RequestId> {
    v.iter().map(|&i| RequestId(i)).collect()
}

#[test]
fn each_policy_admits_in_its_order() {
    // (id, priority, max_tokens), added in id order
    let reqs = [(1, 5, 30), (2, 1, 5), (3, 3, 10)];
    let expected = [
        (SchedulingPolicy::Fcfs, [1, 2, 3]),
        (SchedulingPolicy::Priority, [2, 3, 1]),
        (SchedulingPolicy::Sjf, [2, 3, 1]),
    ];
    for (policy, order) in expected {
        let mut s = scheduler(config(policy), 4, 64);
        for (id, priority, max_tokens) in reqs {
            s.add(req(id, toks(0..8), max_tokens).with_priority(priority)).unwrap();
        }
        let run = drive(&mut s, 500);
        assert_eq!(run.finish_order, ids(&order), "{policy:?}");
    }
}

#[test]
fn priority_ties_go_to_the_earlier_arrival() {
    let mut s = scheduler(config(SchedulingPolicy::Priority), 4, 64);
    s.add(req(7, toks(0..8), 3).with_priority(2).with_arrival(20)).unwrap();
    s.add(req(8, toks(0..8), 3).with_priority(2).with_arrival(10)).unwrap();
    let run = drive(&mut s, 100);
    assert_eq!(run.finish_order, ids(&[8, 7]));
}

/// Two running requests that outgrow 12 blocks: the first preemption's victim.
fn first_victim(policy: SchedulingPolicy, a: (i64, usize), b: (i64, usize)) -> RequestId {
    let cfg = SchedulerConfig { max_num_seqs: 2, ..config(policy) };
    let mut s = scheduler(cfg, 4, 12);
    s.add(req(1, toks(0..16), a.1).with_priority(a.0)).unwrap();
    s.add(req(2, toks(100..116), b.1).with_priority(b.0)).unwrap();
    let run = drive(&mut s, 500);
    assert!(!s.has_unfinished());
    run.outputs_per_step.iter().find_map(|o| o.preempted_ids.first().copied()).unwrap()
}

#[test]
fn each_policy_preempts_its_own_victim() {
    // fcfs: the latest arrival
    assert_eq!(first_victim(SchedulingPolicy::Fcfs, (0, 30), (0, 20)), RequestId(2));
    // priority: the least urgent, even though it arrived first
    assert_eq!(first_victim(SchedulingPolicy::Priority, (5, 30), (0, 30)), RequestId(1));
    // priority ties: the latest arrival
    assert_eq!(first_victim(SchedulingPolicy::Priority, (3, 30), (3, 30)), RequestId(2));
    // sjf: the most remaining work, even though it arrived first
    assert_eq!(first_victim(SchedulingPolicy::Sjf, (0, 30), (0, 20)), RequestId(1));
}

/// A steady stream of one short request per step (more than one slot can serve) plus one
/// request `victim` added first; returns the step it finished in, if it did.
fn finish_step_under_stream(s: &mut Scheduler, victim: (i64, usize), steps: u64) -> Option<u64> {
    s.add(req(1, toks(0..8), victim.1).with_priority(victim.0)).unwrap();
    let mut next = 2;
    let run = drive_with(s, steps, |s, _| {
        s.add(req(next, toks(0..8), 3).with_priority(0)).unwrap();
        next += 1;
        true
    });
    run.finished.get(&RequestId(1)).map(|&(_, step)| step)
}

#[test]
fn aging_bounds_how_long_a_low_priority_request_waits() {
    let aged = SchedulerConfig { priority_aging_steps: 4, ..config(SchedulingPolicy::Priority) };
    let mut s = scheduler(aged.clone(), 4, 64);
    let step = finish_step_under_stream(&mut s, (10, 5), 400).expect("starved despite aging");
    // it outranks every request added after (10 + 1) * 4 steps; those before take 3 steps each
    assert!(step <= 11 * 4 * 3 + 5 + 4, "finished at step {step}");
    // without aging the same stream starves it
    let frozen = SchedulerConfig { priority_aging_steps: u64::MAX, ..aged };
    let mut s = scheduler(frozen, 4, 64);
    assert_eq!(finish_step_under_stream(&mut s, (10, 5), 400), None);
}

#[test]
fn aging_bounds_how_long_a_long_job_waits_under_sjf() {
    let aged = SchedulerConfig { sjf_aging_tokens_per_step: 4, ..config(SchedulingPolicy::Sjf) };
    let mut s = scheduler(aged, 4, 64);
    let step = finish_step_under_stream(&mut s, (0, 40), 600).expect("starved despite aging");
    // work 48 vs 11 for a new short job: it outranks jobs added after ~10 steps
    assert!(step <= 10 * 3 + 40 + 8, "finished at step {step}");
}

#[test]
fn a_preempted_request_is_readmitted_before_later_arrivals_under_fcfs() {
    let cfg = SchedulerConfig { max_num_seqs: 2, ..config(SchedulingPolicy::Fcfs) };
    let mut s = scheduler(cfg, 4, 12);
    s.add(req(1, toks(0..16), 30)).unwrap();
    s.add(req(2, toks(100..116), 30)).unwrap();
    let run = drive_with(&mut s, 500, |s, step| {
        if step == 3 {
            s.add(req(3, toks(200..216), 30)).unwrap();
        }
        false
    });
    assert_eq!(run.finish_order, ids(&[1, 2, 3]));
    // admissions in order: the resumed request 2 (prompt + output) comes before request 3
    let admissions: Vec<(RequestId, usize)> = run
        .outputs_per_step
        .iter()
        .flat_map(|o| o.new_requests.iter().map(|n| (n.id, n.token_ids.len())))
        .collect();
    let resumed_at = admissions.iter().position(|&(id, len)| id == RequestId(2) && len > 16);
    let third_at = admissions.iter().position(|&(id, _)| id == RequestId(3));
    assert!(resumed_at.unwrap() < third_at.unwrap(), "{admissions:?}");
}
