//! A fake model runner and a driver loop: no model, deterministic tokens, and a simulated KV
//! store that checks every step reads back exactly the tokens it should (prefix hits, resumed
//! requests and rolled-back draft tokens included). An optional proposer drafts tokens after
//! each step; the fake runner verifies them like a greedy target model.

#![allow(dead_code, clippy::missing_panics_doc)]

use std::collections::HashMap;

pub mod ahead;

use kiln_core::{BlockId, FinishReason, RequestId, SamplingParams, TokenId};
use kiln_kv::KvCacheConfig;
use kiln_sched::{
    ModelRunnerOutput, PLACEHOLDER_TOKEN, Request, Scheduler, SchedulerConfig, SchedulerOutput,
};

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

/// The scenarios' scheduler limits: a token budget and a running cap, a 128-token context.
pub fn config(max_num_batched_tokens: usize, max_num_seqs: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_batched_tokens,
        max_num_seqs,
        max_model_len: 128,
        ..SchedulerConfig::default()
    }
}

/// The scheduler [`mixed_workload`] runs on: `policy`, a budget of 64 tokens in chunks of at
/// most 24, 6 running requests (2 partial prefills), 80 blocks of 4 tokens (it preempts).
pub fn mixed_scheduler(policy: kiln_sched::SchedulingPolicy) -> Scheduler {
    let cfg = SchedulerConfig {
        policy,
        long_prefill_token_threshold: 24,
        max_num_partial_prefills: 2,
        ..config(64, 6)
    };
    scheduler(cfg, 4, 80)
}

pub fn scheduler(config: SchedulerConfig, block_size: usize, num_blocks: usize) -> Scheduler {
    Scheduler::new(config, kv(block_size, num_blocks)).unwrap()
}

/// A request with `prompt` and `max_tokens` greedy outputs, ignoring EOS.
pub fn req(id: u64, prompt: Vec<TokenId>, max_tokens: usize) -> Request {
    let sampling = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) };
    Request::new(RequestId(id), prompt, sampling)
}

/// The runner's copy of a request, built only from the scheduler's diffs.
struct RunnerRequest {
    tokens: Vec<TokenId>,
    block_table: Vec<BlockId>,
}

/// Draft tokens for a request holding `num_tokens` tokens: `k` drafts of which exactly the first
/// `num_correct` are what the fake model generates (a wrong one follows them when
/// `num_correct < k`), so verification accepts `num_correct`.
pub fn drafts(id: RequestId, num_tokens: usize, k: usize, num_correct: usize) -> Vec<TokenId> {
    assert!(num_correct <= k);
    (0..k)
        .map(|i| {
            let t = token_for(id, num_tokens + i);
            if i < num_correct { t } else { TokenId(t.0 + 5000) }
        })
        .collect()
}

/// Applies the scheduler's diffs, as a real runner would (no state of its own beyond the tokens
/// and block tables the diffs carry), writes each step's KV into a simulated store and checks
/// every position a step reads. Verifies draft tokens as a greedy target model would: the
/// longest prefix equal to the model's own tokens is accepted, then one model token follows.
pub struct FakeRunner {
    block_size: usize,
    slots: Vec<Option<TokenId>>,
    /// The second tier: a swapped-out block's slots by tier slot; taken by its swap-in, so a
    /// slot read twice, or never written, fails (a released slot is simply overwritten later).
    tier: HashMap<usize, Vec<Option<TokenId>>>,
    requests: HashMap<RequestId, RunnerRequest>,
    /// `(drafts scheduled, drafts accepted)` → how often a step verified that.
    pub acceptance: HashMap<(usize, usize), usize>,
}

impl FakeRunner {
    pub fn new(block_size: usize, num_blocks: usize) -> Self {
        Self {
            block_size,
            slots: vec![None; block_size * num_blocks],
            tier: HashMap::new(),
            requests: HashMap::new(),
            acceptance: HashMap::new(),
        }
    }

    fn slot(&self, table: &[BlockId], pos: usize) -> usize {
        table[pos / self.block_size].index() * self.block_size + pos % self.block_size
    }

    /// Applies the diff; returns per scheduled request `(id, num_computed, num_scheduled,
    /// drafts)`.
    fn apply(&mut self, out: &SchedulerOutput) -> Vec<(RequestId, usize, usize, Vec<TokenId>)> {
        for id in out.preempted_ids.iter().chain(&out.finished_ids) {
            self.requests.remove(id);
        }
        let bs = self.block_size;
        for c in &out.swap_out {
            let block = self.slots[c.block.index() * bs..][..bs].to_vec();
            self.tier.insert(c.slot, block);
        }
        for c in &out.swap_in {
            let block = self.tier.remove(&c.slot).expect("swap-in of an empty tier slot");
            self.slots[c.block.index() * bs..][..bs].copy_from_slice(&block);
        }
        let mut steps = Vec::new();
        for new in &out.new_requests {
            if out.swap_in.is_empty() {
                assert_eq!(new.num_computed_tokens % self.block_size, 0);
            }
            let r = RunnerRequest {
                tokens: new.token_ids.clone(),
                block_table: new.block_table.clone(),
            };
            assert!(self.requests.insert(new.id, r).is_none(), "{} sent as new twice", new.id);
            steps.push((new.id, new.num_computed_tokens, new.num_scheduled_tokens, vec![]));
        }
        for c in &out.cached_requests {
            let r = self.requests.get_mut(&c.id).expect("delta for an unknown request");
            r.tokens.extend_from_slice(out.new_token_ids(c));
            r.block_table.extend_from_slice(&c.new_block_ids);
            let num_known = c.num_scheduled_tokens - c.spec_token_ids.len();
            if !c.spec_token_ids.is_empty() {
                assert_eq!(c.num_computed_tokens + num_known, r.tokens.len(), "{}: drafts", c.id);
            }
            steps.push((
                c.id,
                c.num_computed_tokens,
                c.num_scheduled_tokens,
                c.spec_token_ids.clone(),
            ));
        }
        steps
    }

    /// Writes the step's KV for every request, then "attends": checks that every position up to
    /// the end of each chunk reads back its own token (drafts included), then samples.
    pub fn execute(&mut self, out: &SchedulerOutput) -> ModelRunnerOutput {
        let steps = self.apply(out);
        self.run(out, steps)
    }

    /// [`FakeRunner::execute`] for a step planned ahead of the step that produced `before`:
    /// each placeholder is replaced by its request's token in `before` first (a placeholder
    /// left, or one without a token, fails).
    pub fn execute_after(
        &mut self,
        out: &SchedulerOutput,
        before: &ModelRunnerOutput,
    ) -> ModelRunnerOutput {
        let steps = self.apply(out);
        for (id, r) in &mut self.requests {
            for t in r.tokens.iter_mut().filter(|t| **t == PLACEHOLDER_TOKEN) {
                let sampled = before.iter().find(|(b, _)| b == id).map(|(_, t)| t);
                let Some(&[token]) = sampled else { panic!("{id}: a placeholder, no token") };
                *t = token;
            }
        }
        self.run(out, steps)
    }

    fn run(
        &mut self,
        out: &SchedulerOutput,
        steps: Vec<(RequestId, usize, usize, Vec<TokenId>)>,
    ) -> ModelRunnerOutput {
        let mut total = 0;
        let mut total_spec = 0;
        for (id, num_computed, n, spec) in &steps {
            total += n;
            total_spec += spec.len();
            let r = &self.requests[id];
            let end = num_computed + n;
            assert!(*n > 0 && end <= r.tokens.len() + spec.len(), "{id}: bad chunk {n}");
            assert!(!r.tokens.contains(&PLACEHOLDER_TOKEN), "{id}: a placeholder reached a step");
            assert!(r.block_table.len() * self.block_size >= end, "{id}: too few slots");
            for p in *num_computed..end {
                let s = self.slot(&r.block_table, p);
                self.slots[s] = Some(Self::token_at(&r.tokens, spec, p));
            }
        }
        assert_eq!(total, out.num_scheduled_tokens);
        assert_eq!(total_spec, out.num_scheduled_spec_tokens);
        let mut res = ModelRunnerOutput::default();
        for (id, num_computed, n, spec) in steps {
            let r = &self.requests[&id];
            for p in 0..num_computed + n {
                let s = self.slot(&r.block_table, p);
                let want = Self::token_at(&r.tokens, &spec, p);
                assert_eq!(self.slots[s], Some(want), "{id}: KV of position {p} is wrong");
            }
            if num_computed + n - spec.len() < r.tokens.len() {
                res.push(id, &[]); // a partial prefill chunk
                continue;
            }
            let first = r.tokens.len();
            let num_accepted = spec
                .iter()
                .enumerate()
                .take_while(|&(i, &d)| d == token_for(id, first + i))
                .count();
            *self.acceptance.entry((spec.len(), num_accepted)).or_default() += 1;
            let generated: Vec<TokenId> =
                (first..=first + num_accepted).map(|p| token_for(id, p)).collect();
            res.push(id, &generated);
        }
        res
    }

    /// Token at position `p` of a request whose known tokens are followed by drafts.
    fn token_at(tokens: &[TokenId], spec: &[TokenId], p: usize) -> TokenId {
        tokens.get(p).copied().unwrap_or_else(|| spec[p - tokens.len()])
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
    before_step: impl FnMut(&mut Scheduler, u64) -> bool,
) -> Run {
    drive_spec(s, runner, max_steps, before_step, |_, _| Vec::new())
}

/// Like [`drive_runner`], and after every step `propose(request, step)` drafts tokens for each
/// request of the step that is still decoding (set with `update_draft_token_ids`).
pub fn drive_spec(
    s: &mut Scheduler,
    runner: &mut FakeRunner,
    max_steps: u64,
    mut before_step: impl FnMut(&mut Scheduler, u64) -> bool,
    mut propose: impl FnMut(&Request, u64) -> Vec<TokenId>,
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
        if cfg.long_prefill_token_threshold > 0 && !cfg.whole_prompts {
            for (_, n) in out.scheduled() {
                assert!(n <= cfg.long_prefill_token_threshold.max(1));
            }
        }
        let res = runner.execute(&out);
        for o in s.update(&out, &res) {
            assert!(!run.finished.contains_key(&o.id), "{}: a token after the finish", o.id);
            run.outputs.entry(o.id).or_default().push(o.new_token);
            if let Some(reason) = o.finish_reason {
                run.finished.insert(o.id, (reason, step));
                run.finish_order.push(o.id);
            }
        }
        s.check_invariants().unwrap();
        for (id, _) in out.scheduled() {
            let Some(r) = s.request(id) else { continue };
            let d = propose(r, step);
            let decoding = r.num_uncomputed_tokens() == 1;
            assert_eq!(s.update_draft_token_ids(id, &d), decoding, "{id}");
        }
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

/// A seeded mixed workload: for 300 steps a request arrives with probability 1/3 per step (a
/// prompt of 1 to 81 tokens over a two-token vocabulary, so prefixes collide; 1 to 40 outputs;
/// priority 0 to 4), and one arrival in `abort_one_in` aborts a random earlier request. Drives
/// `s` until nothing is left (20,000 steps at most), asserts that it drained and that every
/// finished request produced exactly its tokens, and returns the run.
pub fn mixed_workload(s: &mut Scheduler, abort_one_in: u64) -> Run {
    mixed_workload_driven(s, abort_one_in, |s, max, f| drive_with(s, max, f))
}

/// [`mixed_workload`] driven by `drive` (`drive_with`, or `ahead::drive_ahead_with`).
pub fn mixed_workload_driven(
    s: &mut Scheduler,
    abort_one_in: u64,
    drive: impl FnOnce(&mut Scheduler, u64, &mut dyn FnMut(&mut Scheduler, u64) -> bool) -> Run,
) -> Run {
    let policy = s.config().policy;
    let mut seed = 0x2545_f491_u64;
    let mut next = move |m: u64| {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % m
    };
    let mut id = 0;
    let mut prompt_lens = HashMap::new();
    let run = drive(s, 20_000, &mut |s, step| {
        if step <= 300 && next(3) == 0 {
            id += 1;
            let prompt: Vec<TokenId> = (0..=next(80)).map(|_| TokenId(next(2) as u32)).collect();
            prompt_lens.insert(RequestId(id), prompt.len());
            s.add(req(id, prompt, 1 + next(40) as usize).with_priority(next(5) as i64)).unwrap();
            if next(abort_one_in) == 0 {
                s.abort(RequestId(next(id) + 1));
            }
        }
        step < 300
    });
    assert!(!s.has_unfinished(), "{policy:?} did not drain in {} steps", run.steps);
    for (id, (reason, _)) in &run.finished {
        assert_eq!(*reason, FinishReason::Length);
        let out = &run.outputs[id];
        assert_eq!(*out, expected_output(id.0, prompt_lens[id], out.len()), "{policy:?} {id}");
    }
    run
}
