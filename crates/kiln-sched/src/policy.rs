//! Ordering keys of the scheduling policies, with aging.
//!
//! Every request gets a key `(primary, arrival, id)`; smaller keys are scheduled first (running
//! requests get the budget in key order, waiting ones are admitted in key order) and the running
//! request with the *largest* key is the preemption victim.
//!
//! - **fcfs**: running `(0, arrival, id)`, so the victim is the latest arrival. Waiting
//!   `(queue_seq, ..)`: new requests join the back, preempted ones the front.
//!   Under priority and sjf a preempted request re-enters the waiting order by its key.
//! - **priority**: `priority - age / priority_aging_steps`. The victim has the lowest effective
//!   priority, ties broken towards the latest arrival.
//! - **sjf**: `remaining_work - age * sjf_aging_tokens_per_step`, where `remaining_work` is the
//!   tokens to compute now plus the outputs still allowed. The victim has the most (aged) work.
//!
//! - **deadline**: the first-token deadline in milliseconds (earliest deadline first; requests
//!   without one come last). The victim has the latest deadline. Deadlines age by themselves: a
//!   request arriving at `t` has a deadline of at least `t + min_ttft`, and a demoted one
//!   (scheduler: a waiting request whose deadline passed, once) `now + slo_demotion_ms`. So a
//!   request with deadline `d` is outranked only by requests that arrived before
//!   `d - min_ttft` or were demoted before `d - slo_demotion_ms`: a finite set, whatever the
//!   load, after which it is admitted (if it is itself demoted, the same holds for its new
//!   deadline). That is the starvation bound the tests check.
//!
//! `age` is the number of `schedule()` calls since the request was added, so it keeps growing
//! while a request waits, runs or is preempted. A request added at step `s` with primary key `k`
//! therefore outranks every request added later with primary key at least `k_min` once
//! `age >= (k - k_min + 1) * priority_aging_steps` (priority) or
//! `age * sjf_aging_tokens_per_step > k - k_min` (sjf): it is then admitted ahead of them,
//! and never again chosen as a victim while they run. That is the starvation bound the tests
//! check.

use crate::config::{SchedulerConfig, SchedulingPolicy};
use crate::request::Request;

/// `(primary, arrival, id)`: smaller is more urgent.
pub type PolicyKey = (i64, u64, u64);

fn aged_primary(config: &SchedulerConfig, req: &Request, step: u64) -> i64 {
    let age = step.saturating_sub(req.added_step);
    match config.policy {
        SchedulingPolicy::Fcfs => 0,
        SchedulingPolicy::Priority => {
            let bonus = i64::try_from(age / config.priority_aging_steps).unwrap_or(i64::MAX);
            req.priority().saturating_sub(bonus)
        }
        SchedulingPolicy::Sjf => {
            let bonus = age.saturating_mul(config.sjf_aging_tokens_per_step);
            let work = i64::try_from(req.remaining_work()).unwrap_or(i64::MAX);
            work.saturating_sub(i64::try_from(bonus).unwrap_or(i64::MAX))
        }
        SchedulingPolicy::Deadline => deadline_key(req),
    }
}

/// Earliest deadline first; no deadline sorts after every deadline.
fn deadline_key(req: &Request) -> i64 {
    req.deadline().map_or(i64::MAX, |d| i64::try_from(d.first_token_ms).unwrap_or(i64::MAX))
}

/// The key of a running request (budget order; the largest is the preemption victim).
pub fn running_key(config: &SchedulerConfig, req: &Request, step: u64) -> PolicyKey {
    (aged_primary(config, req, step), req.arrival(), req.id().0)
}

/// The key of a waiting or preempted request (admission order).
pub fn waiting_key(config: &SchedulerConfig, req: &Request, step: u64) -> PolicyKey {
    let primary = match config.policy {
        SchedulingPolicy::Fcfs => req.queue_seq,
        SchedulingPolicy::Priority | SchedulingPolicy::Sjf | SchedulingPolicy::Deadline => {
            aged_primary(config, req, step)
        }
    };
    (primary, req.arrival(), req.id().0)
}
