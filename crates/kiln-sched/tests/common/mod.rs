//! A fake model runner and a driver loop: no model, deterministic tokens, and a simulated KV
//! store that checks every step reads back exactly the tokens it should (prefix hits and
//! resumed requests included).

#![allow(dead_code, clippy::missing_panics_doc)]

use std::collections::HashMap;

use kiln_core::{BlockId, FinishReason, RequestId, SamplingParams, TokenId};
use kiln_kv::KvCacheConfig;
use kiln_sched::{ModelRunnerOutput, Request, Scheduler, SchedulerConfig, SchedulerOutput};

/// The token a fake model samples for request `id` at position `pos`.
pub fn token_for(id: RequestId, pos: usize) -> TokenId {
    TokenId(((id.0 * 7919 + pos as u64 * 104_729) % 1000 + 100) as u32)
}

pub fn toks(range: std::ops::Range<u32>) -> Vec<TokenId> {
    range.map(TokenId).collect()
}

pub fn kv(block_size: usize, num_blocks: usize) -> KvCacheConfig {
    KvCacheConfig { block_size, num_blocks, enable_prefix_caching: true, extra_keys: vec![] }
}

pub fn scheduler(config: SchedulerConfig, block_size: usize, num_blocks: usize) -> Scheduler {
    Scheduler::new(config, kv(block_size, num_blocks)).unwrap()
}

/// A request with `prompt` and `max_tokens` greedy outputs, ignoring EOS.
pub fn req(id: u64, prompt: Vec<TokenId>, max_tokens: usize) -> Request {
    let sampling = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) };
    Request::new(RequestId(id), prompt, sampling)
}

struct RunnerRequest {
    tokens: Vec<TokenId>,
    num_computed: usize,
    block_table: Vec<BlockId>,
}

/// Keeps per-request state from the scheduler's diffs, as a real runner would.
pub struct FakeRunner {
    block_size: usize,
    slots: Vec<Option<TokenId>>,
    requests: HashMap<RequestId, RunnerRequest>,
}

impl FakeRunner {
    pub fn new(block_size: usize, num_blocks: usize) -> Self {
        Self { block_size, slots: vec![None; block_size * num_blocks], requests: HashMap::new() }
    }

    fn slot(&self, table: &[BlockId], pos: usize) -> usize {
        table[pos / self.block_size].index() * self.block_size + pos % self.block_size
    }

    /// Writes the step's KV for every request, then "attends": checks that every position up to
    /// the end of each chunk reads back its own token, then samples.
    pub fn execute(&mut self, out: &SchedulerOutput) -> ModelRunnerOutput {
        for id in out.preempted_ids.iter().chain(&out.finished_ids) {
            self.requests.remove(id);
        }
        for new in &out.new_requests {
            assert_eq!(new.num_computed_tokens % self.block_size, 0);
            let r = RunnerRequest {
                tokens: new.token_ids.clone(),
                num_computed: new.num_computed_tokens,
                block_table: new.block_table.clone(),
            };
            assert!(self.requests.insert(new.id, r).is_none(), "{} sent as new twice", new.id);
        }
        for cached in &out.cached_requests {
            let r = self.requests.get_mut(&cached.id).expect("delta for an unknown request");
            r.block_table.extend_from_slice(&cached.new_block_ids);
        }
        let mut total = 0;
        for (id, n) in out.scheduled() {
            total += n;
            let r = &self.requests[&id];
            assert!(n > 0 && r.num_computed + n <= r.tokens.len(), "{id}: bad chunk {n}");
            assert!(r.block_table.len() * self.block_size >= r.num_computed + n);
            for p in r.num_computed..r.num_computed + n {
                let s = self.slot(&r.block_table, p);
                self.slots[s] = Some(r.tokens[p]);
            }
        }
        assert_eq!(total, out.num_scheduled_tokens);
        let mut sampled = Vec::new();
        for (id, n) in out.scheduled() {
            let r = &self.requests[&id];
            for p in 0..r.num_computed + n {
                let s = self.slot(&r.block_table, p);
                assert_eq!(self.slots[s], Some(r.tokens[p]), "{id}: KV of position {p} is wrong");
            }
            let r = self.requests.get_mut(&id).expect("checked above");
            r.num_computed += n;
            if r.num_computed == r.tokens.len() {
                let t = token_for(id, r.tokens.len());
                r.tokens.push(t);
                sampled.push((id, Some(t)));
            } else {
                sampled.push((id, None));
            }
        }
        ModelRunnerOutput { sampled }
    }
}

/// What a run produced.
#[derive(Default)]
pub struct Run {
    pub outputs: HashMap<RequestId, Vec<TokenId>>,
    /// Finish reason and the step it happened in.
    pub finished: HashMap<RequestId, (FinishReason, u64)>,
    pub finish_order: Vec<RequestId>,
    pub outputs_per_step: Vec<SchedulerOutput>,
    pub steps: u64,
}

/// Runs schedule → execute → update until nothing is left (at most `max_steps`), checking the
/// limits and invariants after every step. `before_step(scheduler, step)` may add requests and
/// returns whether more will come (an idle scheduler then skips the step instead of stopping).
pub fn drive_with(
    s: &mut Scheduler,
    max_steps: u64,
    before_step: impl FnMut(&mut Scheduler, u64) -> bool,
) -> Run {
    let kv = s.kv_cache();
    let mut runner = FakeRunner::new(kv.block_size(), kv.num_blocks());
    drive_runner(s, &mut runner, max_steps, before_step)
}

/// Like [`drive_with`] with a runner that outlives the run (its KV store persists).
pub fn drive_runner(
    s: &mut Scheduler,
    runner: &mut FakeRunner,
    max_steps: u64,
    mut before_step: impl FnMut(&mut Scheduler, u64) -> bool,
) -> Run {
    let cfg = s.config().clone();
    let mut run = Run::default();
    for step in 1..=max_steps {
        let more = before_step(s, step);
        if !s.has_unfinished() {
            if more {
                continue;
            }
            break;
        }
        let out = s.schedule();
        assert!(out.num_scheduled_tokens <= cfg.max_num_batched_tokens);
        assert!(s.num_running() <= cfg.max_num_seqs);
        if cfg.long_prefill_token_threshold > 0 {
            for (_, n) in out.scheduled() {
                assert!(n <= cfg.long_prefill_token_threshold.max(1));
            }
        }
        let res = runner.execute(&out);
        for o in s.update(&out, &res) {
            run.outputs.entry(o.id).or_default().push(o.new_token);
            if let Some(reason) = o.finish_reason {
                run.finished.insert(o.id, (reason, step));
                run.finish_order.push(o.id);
            }
        }
        s.check_invariants().unwrap();
        run.outputs_per_step.push(out);
        run.steps = step;
    }
    run
}

pub fn drive(s: &mut Scheduler, max_steps: u64) -> Run {
    drive_with(s, max_steps, |_, _| false)
}

/// The tokens an unpreempted request `id` with `prompt_len` prompt tokens must produce.
pub fn expected_output(id: u64, prompt_len: usize, max_tokens: usize) -> Vec<TokenId> {
    (0..max_tokens).map(|i| token_for(RequestId(id), prompt_len + i)).collect()
}
