//! A driver that plans every step ahead of the one in flight, as the asynchronous engine does:
//! `schedule_ahead(N)` while N "computes", N+1 run with N's tokens in place of its
//! placeholders, then `confirm(N)`; after a step planned ahead ran short of blocks, the next
//! is planned after `update`, where preemption can work.

use kiln_sched::{ModelRunnerOutput, RequestOutput, Scheduler, SchedulerOutput};

use super::{FakeRunner, Run};

/// Like [`super::drive_with`], every step planned ahead where the scheduler allows; returns the
/// run and how many steps were planned ahead.
pub fn drive_ahead_with(
    s: &mut Scheduler,
    max_steps: u64,
    mut before_step: impl FnMut(&mut Scheduler, u64) -> bool,
) -> (Run, u64) {
    let kv = s.kv_cache();
    let mut runner = FakeRunner::new(kv.block_size(), kv.num_blocks());
    let cfg = s.config().clone();
    let mut run = Run::default();
    let mut num_ahead = 0;
    // The step in flight and what its forward produced (computed at its launch).
    let mut in_flight: Option<(SchedulerOutput, ModelRunnerOutput)> = None;
    for step in 1..=max_steps {
        let more = before_step(s, step);
        let updates: Vec<RequestOutput>;
        let launched = match in_flight.take() {
            None if !s.has_unfinished() => {
                if more {
                    continue;
                }
                break;
            }
            None => {
                updates = Vec::new();
                let out = s.schedule();
                let res = runner.execute(&out);
                Some((out, res))
            }
            // Nothing ran (no placeholder to fill), or the step ran short of blocks.
            Some((out, res)) if s.ahead_starved() || out.num_scheduled_tokens == 0 => {
                updates = s.update(&out, &res);
                s.check_invariants().unwrap();
                s.has_unfinished().then(|| {
                    let next = s.schedule();
                    let res = runner.execute(&next);
                    (next, res)
                })
            }
            Some((out, res)) => {
                let next = s.schedule_ahead(&out);
                assert!(next.preempted_ids.is_empty(), "a step planned ahead preempted");
                num_ahead += 1;
                let next_res = runner.execute_after(&next, &res);
                updates = s.confirm(&out, &res);
                s.check_invariants().unwrap();
                Some((next, next_res))
            }
        };
        for o in updates {
            assert!(!run.finished.contains_key(&o.id), "{}: a token after the finish", o.id);
            run.outputs.entry(o.id).or_default().push(o.new_token);
            if let Some(reason) = o.finish_reason {
                run.finished.insert(o.id, (reason, step));
                run.finish_order.push(o.id);
            }
        }
        if let Some((out, _)) = &launched {
            assert!(out.num_scheduled_tokens <= cfg.max_num_batched_tokens);
            assert!(s.num_running() <= cfg.max_num_seqs);
            run.outputs_per_step.push(out.clone());
        }
        in_flight = launched;
        run.steps = step;
    }
    assert!(in_flight.is_none(), "a step still in flight after {max_steps} steps");
    (run, num_ahead)
}
