//! The deadline policy: earliest first-token deadline first, the latest deadline preempted
//! first, late waiting requests demoted once, and the starvation bound of the policy docs.

#![allow(clippy::unwrap_used)]

mod common;

use common::{FakeRunner, drive, req, scheduler, toks};
use kiln_core::RequestId;
use kiln_sched::{Deadline, Request, Scheduler, SchedulerConfig, SchedulingPolicy};

fn config() -> SchedulerConfig {
    SchedulerConfig {
        policy: SchedulingPolicy::Deadline,
        max_num_batched_tokens: 64,
        max_num_seqs: 1,
        max_model_len: 64,
        slo_demotion_ms: 10_000,
        ..SchedulerConfig::default()
    }
}

fn due(id: u64, first_token_ms: u64) -> Request {
    req(id, toks(id as u32 * 10..id as u32 * 10 + 8), 3)
        .with_deadline(Deadline { first_token_ms, tpot_ms: None })
}

fn ids(v: &[u64]) -> Vec<RequestId> {
    v.iter().map(|&i| RequestId(i)).collect()
}

#[test]
fn earliest_deadline_is_admitted_first_and_no_deadline_comes_last() {
    let mut s = scheduler(config(), 4, 64);
    s.add(req(1, toks(0..8), 3)).unwrap();
    s.add(due(2, 900)).unwrap();
    s.add(due(3, 300)).unwrap();
    s.add(due(4, 600)).unwrap();
    let run = drive(&mut s, 200);
    assert_eq!(run.finish_order, ids(&[3, 4, 2, 1]));
}

#[test]
fn the_latest_deadline_is_preempted_first() {
    let cfg = SchedulerConfig { max_num_seqs: 2, max_model_len: 48, ..config() };
    let mut s = scheduler(cfg, 4, 12);
    s.add(req(1, toks(0..16), 20).with_deadline(Deadline { first_token_ms: 50, tpot_ms: None }))
        .unwrap();
    s.add(req(2, toks(100..116), 20).with_deadline(Deadline { first_token_ms: 40, tpot_ms: None }))
        .unwrap();
    let mut runner = FakeRunner::new(4, 12);
    loop {
        let out = s.schedule();
        if let Some(&victim) = out.preempted_ids.first() {
            assert_eq!(victim, RequestId(1));
            break;
        }
        let mo = runner.execute(&out);
        s.update(&out, &mo);
        assert!(s.has_unfinished(), "no preemption happened");
    }
}

#[test]
fn a_late_waiting_request_is_demoted_once_behind_work_still_on_time() {
    let mut s = scheduler(config(), 4, 64);
    // Request 1 runs; 2 waits with a deadline that passes; 3 arrives later, due later than 2
    // was but still on time.
    s.add(due(1, 100)).unwrap();
    s.add(due(2, 200)).unwrap();
    s.add(due(3, 5_000)).unwrap();
    let mut runner = FakeRunner::new(4, 64);
    let out = s.schedule();
    assert_eq!(out.new_requests[0].id, RequestId(1));
    let mo = runner.execute(&out);
    s.update(&out, &mo);
    s.set_now_ms(300);
    let mut order = Vec::new();
    while s.has_unfinished() {
        let out = s.schedule();
        order.extend(out.new_requests.iter().map(|n| n.id));
        let mo = runner.execute(&out);
        s.update(&out, &mo);
    }
    assert_eq!(order, ids(&[3, 2]));
    assert_eq!(s.stats().num_demoted, 1);

    // Demoted once only: its new deadline passing again changes nothing.
    let mut s = scheduler(config(), 4, 64);
    s.add(due(1, 100)).unwrap();
    s.add(due(2, 200)).unwrap();
    s.schedule();
    s.set_now_ms(300);
    s.schedule();
    assert_eq!(s.request(RequestId(2)).unwrap().deadline().unwrap().first_token_ms, 10_300);
    s.set_now_ms(20_000);
    s.schedule();
    let r2 = s.request(RequestId(2)).unwrap();
    assert!(r2.is_demoted());
    assert_eq!(r2.deadline().unwrap().first_token_ms, 10_300);
    assert_eq!(s.stats().num_demoted, 1);
}

/// One request of a batch class (TTFT 30 s) waits under an overload of interactive requests
/// (TTFT 1 s, arriving 1.5× faster than one seat serves them): under a fixed priority it would
/// wait forever. Under the deadline policy the late interactive work is demoted, no arrival
/// outranks the batch request once `now` passes its deadline minus the interactive TTFT, and
/// it is admitted once the finite set of requests due before it has been served (the policy
/// docs' bound).
#[test]
fn a_far_deadline_is_served_once_no_arrival_can_outrank_it() {
    let mut s = scheduler(SchedulerConfig { max_model_len: 200, ..config() }, 4, 256);
    let mut runner = FakeRunner::new(4, 256);
    s.add(req(0, toks(0..8), 3).with_deadline(Deadline { first_token_ms: 30_000, tpot_ms: None }))
        .unwrap();
    let mut now = 0u64;
    let mut next_id = 1;
    let mut admitted_at = None;
    while admitted_at.is_none() {
        // Interactive work arrives faster than it finishes, so the batch request would wait
        // forever under a fixed priority.
        if now.is_multiple_of(200) {
            s.add(
                req(next_id, toks(1000..1008), 3)
                    .with_deadline(Deadline { first_token_ms: now + 1_000, tpot_ms: None }),
            )
            .unwrap();
            next_id += 1;
        }
        now += 100;
        s.set_now_ms(now);
        let out = s.schedule();
        if out.new_requests.iter().any(|n| n.id == RequestId(0)) {
            admitted_at = Some(now);
        }
        let mo = runner.execute(&out);
        s.update(&out, &mo);
        assert!(now <= 120_000, "the batch request starved");
    }
    let at = admitted_at.unwrap();
    assert!(at >= 29_000, "admitted at {at} ms, before anything could stop outranking it");
    assert!(s.stats().num_demoted > 0);
    let _ = Request::is_demoted;
}

#[test]
fn pending_prefill_counts_the_work_ahead_of_a_deadline() {
    let mut s: Scheduler = scheduler(config(), 4, 64);
    s.add(due(1, 100)).unwrap();
    s.add(due(2, 200)).unwrap();
    s.add(req(3, toks(0..5), 2)).unwrap();
    assert_eq!(s.pending_prefill_tokens(None), 21);
    assert_eq!(s.pending_prefill_tokens(Some(150)), 8);
    assert_eq!(s.pending_prefill_tokens(Some(200)), 16);
    // A running prefill is ahead of every waiting request, whatever its deadline.
    let mut runner = FakeRunner::new(4, 64);
    let cfg = SchedulerConfig { max_num_batched_tokens: 4, ..config() };
    let mut s = scheduler(cfg, 4, 64);
    s.add(req(5, toks(0..10), 2)).unwrap();
    let out = s.schedule();
    s.update(&out, &runner.execute(&out));
    assert_eq!(s.pending_prefill_tokens(Some(0)), 6);
}
