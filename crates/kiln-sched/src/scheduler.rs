//! The scheduling loop: one token budget per step, running requests first, then admissions.
//!
//! Each `schedule()`:
//! 1. **Running** requests, in policy order, each take `min(uncomputed + drafts, budget)` tokens
//!    (capped by `long_prefill_token_threshold` when set and more than one), where a prefill
//!    chunk or a decode's drafts leave one token of the budget for every decode still to be
//!    served in this pass (decodes are never starved by a chunk ahead of them in the order).
//!    A decoding request with draft tokens ([`Scheduler::update_draft_token_ids`]) gets them
//!    scheduled after its last token, as many as fit, and KV slots for them as lookahead slots
//!    (never registered in the prefix cache). When
//!    `allocate_slots` fails, the running request with the largest policy key (maybe the request
//!    itself) is preempted by recompute: its blocks are freed (those registered for KV that was
//!    never written are first dropped from the prefix cache), `num_computed_tokens` returns to 0,
//!    its output tokens are kept, and it goes back to the waiting queue. If it had been scheduled
//!    earlier in this pass, its tokens return to the budget. Then the allocation is retried.
//!    With a second tier ([`Scheduler::set_swap_space`]) the victim's computed blocks may be
//!    copied out to it instead ([`crate::swap`]: preemption by swap).
//! 2. **Waiting** requests, in policy order, only if nothing was preempted in this pass (so no
//!    admission can hit blocks whose KV is about to be dropped): prefix lookup, then allocation,
//!    while the budget, `max_num_seqs`, `max_num_partial_prefills` and free blocks allow (with
//!    `whole_prompts`, an encoder's, only a prompt whose every token fits the step's budget). The
//!    first request that does not fit stops admission (no bypassing, so aging bounds waiting),
//!    except for a request of a LoRA adapter beyond [`Scheduler::set_max_loras`]: it is
//!    passed over (as in vLLM) until a running adapter's requests leave.
//!    A request preempted by swap gets the blocks past its prefix hit copied back in from the
//!    tier, and computes only what was never computed; any other request's hit continues into
//!    prefix-cache blocks the tier kept when the KV cache evicted them ([`crate::spill`]).
//!
//! `update()` confirms the scheduled tokens as computed, then per request verifies speculation:
//! with `k` drafts scheduled and `g` tokens generated, the first `g - 1` drafts were accepted
//! and `k - (g - 1)` are rolled back out of `num_computed_tokens` (their slots hold KV of
//! rejected tokens and are written again before anything reads them). The generated tokens are
//! appended one by one with the stop conditions checked after each; a stop drops the rest.
//! Finished requests' blocks are freed. Blocks allocated for rejected drafts stay in the table
//! (the next steps fill them) and are freed with the request.
//!
//! `schedule_ahead()` plans a step before the tokens of the one in flight are known
//! (asynchronous scheduling): placeholders stand for them, and `confirm()` puts the tokens in
//! place with `update`'s stop checks (`scheduler/update.rs`). A step planned ahead never
//! preempts, and a placeholder's slot is a lookahead slot, never registered.
//!
//! Prefix-cache safety: the KV manager registers a block only once its tokens are all known
//! tokens scheduled or computed (`num_computed + num_new`), and drafts are never known tokens
//! (they live in `spec_token_ids`, and only tokens the runner returns are appended). Rollback
//! never goes below the registered range, so no registered block can hold rejected-token KV.
//!
//! Limits at run time: [`Scheduler::set_limits`] lowers the token budget and the running cap
//! below the configured ones (a batch controller does, between steps). A lower cap preempts
//! nothing: it only stops admissions until enough running requests finish.
//!
//! Deadlines: under the deadline policy the engine hands in its clock
//! ([`Scheduler::set_now_ms`]) before each step; a waiting request (never scheduled) whose
//! first-token deadline has passed is demoted once: its deadline moves `slo_demotion_ms` past
//! now, so it stops outranking work that can still be on time.
//!
//! Invariants ([`Scheduler::check_invariants`], between `update` and `schedule`, and with a
//! step in flight whose scheduled tokens then count as known): the KV
//! manager's; `running.len() <= max_num_seqs`; at most `max_num_partial_prefills` running
//! requests have more than one token left to compute (only an admission can start a partial
//! prefill, and it checks the count); exactly the running requests hold block tables; waiting
//! and preempted requests have `num_computed_tokens == 0` and no drafts; a running request's
//! blocks registered in the prefix cache lie within its `num_computed_tokens`; each of the
//! tier's slots is free, released in this step, holding a spilled block, or held by one waiting
//! request preempted by swap (running requests hold none); no request holds a placeholder.
//!
//! Cost per step: O(R log R + W log W) for sorting R running and W waiting requests, plus the KV
//! manager's work; outside the KV manager, per-token work only for the tokens a step adds
//! (copied once into the diff, appended once by `update`).

use std::collections::{HashMap, HashSet};
use std::mem;

use kiln_core::{BlockId, RequestId, TokenId};
use kiln_kv::{KvCacheConfig, KvCacheManager, PrefixCacheStats};

use crate::config::{ConfigError, SchedulerConfig, SchedulingPolicy};
use crate::output::{CachedRequestData, NewRequestData, SchedulerOutput};
use crate::policy::{running_key, waiting_key};
use crate::request::{AddError, Request, RequestStatus};
use crate::swap::{BlockCopy, SwapSpace, SwapStats};

mod tier;
mod update;

pub use update::PLACEHOLDER_TOKEN;

/// The limits in force for the next steps: at most the configured ones
/// ([`Scheduler::set_limits`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepLimits {
    /// Token budget of one step.
    pub max_num_batched_tokens: usize,
    /// Running requests beyond which no request is admitted.
    pub max_num_seqs: usize,
}

/// Counters for metrics and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SchedulerStats {
    pub num_running: usize,
    pub num_waiting: usize,
    /// Fraction of KV blocks held by requests.
    pub kv_usage: f32,
    pub prefix_cache: PrefixCacheStats,
    /// Preemptions since start.
    pub num_preemptions: u64,
    /// Tokens scheduled since start.
    pub num_scheduled_tokens: u64,
    /// `schedule()` calls since start.
    pub num_steps: u64,
    /// Requests demoted for a missed first-token deadline since start (deadline policy).
    pub num_demoted: u64,
    /// The second tier (all 0 without one).
    pub swap: SwapStats,
}

/// The continuous-batching scheduler; owns the KV cache manager.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    limits: StepLimits,
    /// The engine's clock in milliseconds, as of the last `set_now_ms`.
    now_ms: u64,
    kv: KvCacheManager,
    requests: HashMap<RequestId, Request>,
    /// Requests holding blocks, in admission order.
    running: Vec<RequestId>,
    /// Waiting and preempted requests (ordered by policy key at each step).
    waiting: Vec<RequestId>,
    step: u64,
    next_arrival: u64,
    next_back_seq: i64,
    next_front_seq: i64,
    finished_since_last: Vec<RequestId>,
    num_preemptions: u64,
    num_scheduled_tokens: u64,
    num_demoted: u64,
    /// The second KV tier (`None`: preemption is by recompute only).
    swap: Option<SwapSpace>,
    /// Most distinct LoRA adapters among running requests (`None`: no limit).
    max_loras: Option<usize>,
    /// A step planned before the one in flight is updated (`update.rs`).
    ahead: update::Ahead,
}

/// A running request scheduled in the current pass.
struct Scheduled {
    id: RequestId,
    /// Known tokens plus drafts.
    num_tokens: usize,
    spec_token_ids: Vec<TokenId>,
    spec_parents: Vec<u32>,
    new_blocks: Vec<BlockId>,
}

impl Scheduler {
    /// A scheduler over a fresh KV cache; `config.enable_prefix_caching` overrides the flag in
    /// `kv_config`.
    pub fn new(config: SchedulerConfig, mut kv_config: KvCacheConfig) -> Result<Self, ConfigError> {
        config.validate(kv_config.block_size, kv_config.num_blocks)?;
        kv_config.enable_prefix_caching = config.enable_prefix_caching;
        let limits = StepLimits {
            max_num_batched_tokens: config.max_num_batched_tokens,
            max_num_seqs: config.max_num_seqs,
        };
        Ok(Self {
            config,
            limits,
            now_ms: 0,
            kv: KvCacheManager::new(kv_config),
            requests: HashMap::new(),
            running: Vec::new(),
            waiting: Vec::new(),
            step: 0,
            next_arrival: 0,
            next_back_seq: 0,
            next_front_seq: -1,
            finished_since_last: Vec::new(),
            num_preemptions: 0,
            num_scheduled_tokens: 0,
            num_demoted: 0,
            swap: None,
            max_loras: None,
            ahead: update::Ahead::default(),
        })
    }

    /// Runs requests of at most `max` distinct LoRA adapters at once (`None`: any number;
    /// vLLM's `--max-loras`). Base-model requests are never held back by it.
    pub fn set_max_loras(&mut self, max: Option<usize>) {
        self.max_loras = max;
    }

    /// The limits in force (the configured ones unless [`Scheduler::set_limits`] lowered them).
    pub fn limits(&self) -> StepLimits {
        self.limits
    }

    /// Sets the token budget and running cap of the next steps, each clamped to `1..=` its
    /// configured value (the budget, with `whole_prompts`, to no less than `max_model_len`, so
    /// a whole prompt always fits); returns the limits now in force. Running requests above a
    /// lowered cap keep running (nothing is preempted); admissions wait until they are below it.
    pub fn set_limits(&mut self, limits: StepLimits) -> StepLimits {
        let configured = self.config.max_num_batched_tokens;
        let floor =
            if self.config.whole_prompts { self.config.max_model_len.min(configured) } else { 1 };
        self.limits = StepLimits {
            max_num_batched_tokens: limits.max_num_batched_tokens.clamp(floor, configured),
            max_num_seqs: limits.max_num_seqs.clamp(1, self.config.max_num_seqs),
        };
        self.limits
    }

    /// Marks the step `output` as not run (its forward pass or its tier copies failed): the
    /// scheduled tokens stay uncomputed, and every block of its requests past the KV really
    /// written leaves the prefix cache at once, even one that a request admitted since hit, so
    /// no later lookup finds it. Call before aborting the step's requests.
    pub fn fail_step(&mut self, output: &SchedulerOutput) {
        for (id, _) in output.scheduled() {
            if let Some(req) = self.requests.get_mut(&id) {
                req.num_in_flight_tokens = 0;
                req.num_in_flight_spec_tokens = 0;
                self.kv.uncache_past(id, req.num_computed_tokens);
            }
        }
    }

    /// Sets the clock that deadlines are read against (milliseconds, never going back).
    pub fn set_now_ms(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
    }

    /// Tokens still to prefill: the rest of every running prefill (running requests are served
    /// before admissions) and every waiting request's prompt (and output, if preempted). With
    /// `before` given (deadline policy), of the waiting requests only those whose first-token
    /// deadline is not later than it: the work served ahead of a request due then.
    pub fn pending_prefill_tokens(&self, before: Option<u64>) -> usize {
        let running = self
            .running
            .iter()
            .map(|id| &self.requests[id])
            .filter(|r| r.num_uncomputed_tokens() > 1);
        self.waiting_ahead(before).chain(running).map(Request::num_tokens_to_prefill).sum()
    }

    /// Waiting requests that take a running seat before a request due at `before` (`None`: all
    /// of them), as [`Scheduler::pending_prefill_tokens`] counts them.
    pub fn num_waiting_ahead(&self, before: Option<u64>) -> usize {
        self.waiting_ahead(before).count()
    }

    fn waiting_ahead(&self, before: Option<u64>) -> impl Iterator<Item = &Request> {
        let ahead = move |req: &&Request| match (before, req.deadline()) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(limit), Some(d)) => d.first_token_ms <= limit,
        };
        self.waiting.iter().map(|id| &self.requests[id]).filter(ahead)
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn kv_cache(&self) -> &KvCacheManager {
        &self.kv
    }

    /// The KV cache manager, mutable: for work between steps on an idle scheduler (restoring a
    /// saved prefix cache); changing the blocks of a running request breaks the scheduler.
    pub fn kv_cache_mut(&mut self) -> &mut KvCacheManager {
        &mut self.kv
    }

    /// A request that is waiting, running or preempted (finished ones are forgotten).
    pub fn request(&self, id: RequestId) -> Option<&Request> {
        self.requests.get(&id)
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// The running requests, in admission order.
    pub fn running_ids(&self) -> &[RequestId] {
        &self.running
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn has_unfinished(&self) -> bool {
        !self.requests.is_empty()
    }

    /// `schedule()` calls so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            num_running: self.running.len(),
            num_waiting: self.waiting.len(),
            kv_usage: self.kv.usage(),
            prefix_cache: self.kv.prefix_cache_stats(),
            num_preemptions: self.num_preemptions,
            num_scheduled_tokens: self.num_scheduled_tokens,
            num_steps: self.step,
            num_demoted: self.num_demoted,
            swap: self.swap.as_ref().map(SwapSpace::stats).unwrap_or_default(),
        }
    }

    /// Queues a request; refuses duplicates, empty prompts, invalid sampling parameters and
    /// prompts that cannot fit `max_tokens` more tokens in `max_model_len`.
    pub fn add(&mut self, mut req: Request) -> Result<(), AddError> {
        let id = req.id();
        if self.requests.contains_key(&id) {
            return Err(AddError::DuplicateId(id));
        }
        if req.num_prompt_tokens() == 0 {
            return Err(AddError::EmptyPrompt(id));
        }
        req.sampling_params().validate().map_err(|e| AddError::InvalidSampling(e.to_string()))?;
        let max_tokens = req.sampling_params().max_tokens;
        if req.num_tokens() + max_tokens > self.config.max_model_len {
            return Err(AddError::TooLong {
                max_model_len: self.config.max_model_len,
                num_prompt_tokens: req.num_tokens(),
                max_tokens,
            });
        }
        req.set_default_arrival(self.next_arrival);
        self.next_arrival += 1;
        req.added_step = self.step;
        req.queue_seq = self.next_back_seq;
        self.next_back_seq += 1;
        req.status = RequestStatus::Waiting;
        req.num_computed_tokens = 0;
        req.num_in_flight_tokens = 0;
        self.requests.insert(id, req);
        self.waiting.push(id);
        Ok(())
    }

    /// Removes a request in any state and frees its blocks at once; `false` if unknown.
    ///
    /// Between `schedule()` and `update()`, the scheduled tokens of the request (not its drafts)
    /// are taken as computed (the engine runs every step it is handed before it aborts
    /// anything).
    pub fn abort(&mut self, id: RequestId) -> bool {
        let Some(mut req) = self.requests.remove(&id) else { return false };
        self.kv.free_with_computed(id, req.num_computed_tokens + req.num_in_flight_tokens);
        if let (Some(space), Some(kv)) = (&mut self.swap, req.swapped.take()) {
            space.release(kv);
        }
        if req.status == RequestStatus::Running {
            self.running.retain(|&r| r != id);
            self.finished_since_last.push(id);
        } else {
            self.waiting.retain(|&r| r != id);
        }
        true
    }

    /// Sets the draft tokens proposed for `id`'s next step, replacing earlier ones (vLLM's
    /// `update_draft_token_ids`); an empty list clears them. Only a running request whose next
    /// step is a decode (one token left to compute, nothing in flight) takes drafts; returns
    /// whether it did. When scheduled, drafts count in the token budget and get lookahead KV
    /// slots; at most `remaining outputs - 1` of them are scheduled (a step yields at most one
    /// token more than it verifies), and those the budget cuts off are dropped.
    pub fn update_draft_token_ids(&mut self, id: RequestId, draft_token_ids: &[TokenId]) -> bool {
        self.update_draft_tree(id, draft_token_ids, &[])
    }

    /// [`Scheduler::update_draft_token_ids`] for a token tree: draft `i` follows draft
    /// `parents[i]` (an earlier one) or, for `u32::MAX`, the request's last known token. Empty
    /// `parents` is a chain. A tree is cut to the budget like a chain, keeping its first drafts
    /// (still a tree: parents come first). Returns false, changing nothing, for a malformed tree.
    pub fn update_draft_tree(
        &mut self,
        id: RequestId,
        draft_token_ids: &[TokenId],
        parents: &[u32],
    ) -> bool {
        let well_formed = parents.is_empty()
            || (parents.len() == draft_token_ids.len()
                && parents.iter().enumerate().all(|(i, &p)| p == u32::MAX || (p as usize) < i));
        let Some(req) = self.requests.get_mut(&id) else { return false };
        let decoding = req.status == RequestStatus::Running
            && req.num_uncomputed_tokens() == 1
            && req.num_in_flight_tokens == 0
            && req.num_in_flight_spec_tokens == 0;
        if decoding && well_formed {
            req.spec_token_ids.clear();
            req.spec_token_ids.extend_from_slice(draft_token_ids);
            req.spec_parents.clear();
            req.spec_parents.extend_from_slice(parents);
        }
        decoding && well_formed
    }

    /// Tokens to give a request with `num_uncomputed` tokens left under `budget`.
    fn chunk_size(&self, num_uncomputed: usize, budget: usize) -> usize {
        let threshold = self.config.long_prefill_token_threshold;
        let n = num_uncomputed.min(budget);
        if threshold > 0 && num_uncomputed > 1 && !self.config.whole_prompts {
            n.min(threshold)
        } else {
            n
        }
    }

    /// Plans the next step.
    pub fn schedule(&mut self) -> SchedulerOutput {
        self.step += 1;
        let mut out = SchedulerOutput {
            step: self.step,
            finished_ids: mem::take(&mut self.finished_since_last),
            ..SchedulerOutput::default()
        };
        if self.config.policy == SchedulingPolicy::Deadline {
            self.demote_late_waiting();
        }
        if let Some(space) = &mut self.swap {
            space.start_step();
        }
        self.ahead.starved = false;
        let mut budget = self.limits.max_num_batched_tokens;
        let scheduled =
            self.schedule_running(&mut budget, &mut out.preempted_ids, &mut out.swap_out);
        self.spill_evicted(&mut out.swap_out);
        let mut num_partial = 0;
        out.cached_new_token_ids.reserve(scheduled.len());
        for s in scheduled {
            let Some(req) = self.requests.get_mut(&s.id) else { continue };
            let num_spec = s.spec_token_ids.len();
            let num_known = s.num_tokens - num_spec;
            num_partial += usize::from(num_known < req.num_uncomputed_tokens());
            req.num_in_flight_tokens = num_known;
            req.num_in_flight_spec_tokens = num_spec;
            let start = out.cached_new_token_ids.len();
            out.cached_new_token_ids.extend_from_slice(&req.all_token_ids()[req.num_sent_tokens..]);
            req.num_sent_tokens = req.num_tokens();
            out.num_scheduled_tokens += s.num_tokens;
            out.num_scheduled_spec_tokens += num_spec;
            out.cached_requests.push(CachedRequestData {
                id: s.id,
                new_token_range: start..out.cached_new_token_ids.len(),
                num_computed_tokens: req.num_computed_tokens,
                num_scheduled_tokens: s.num_tokens,
                spec_token_ids: s.spec_token_ids,
                spec_parents: s.spec_parents,
                new_block_ids: s.new_blocks,
            });
        }
        if out.preempted_ids.is_empty() && !self.ahead.starved {
            self.admit_waiting(budget, num_partial, &mut out);
        }
        self.num_scheduled_tokens += out.num_scheduled_tokens as u64;
        out
    }

    /// Deadline policy: pushes back, once, the deadline of every never-scheduled waiting request
    /// whose first token is already late.
    fn demote_late_waiting(&mut self) {
        let (now, shift) = (self.now_ms, self.config.slo_demotion_ms);
        for id in &self.waiting {
            let Some(req) = self.requests.get_mut(id) else { continue };
            let late = req.deadline().is_some_and(|d| d.first_token_ms < now);
            if late && !req.demoted && req.status == RequestStatus::Waiting {
                req.demoted = true;
                req.set_first_token_deadline(now.saturating_add(shift));
                self.num_demoted += 1;
            }
        }
    }

    /// Phase 1: running requests in policy order; preempts when blocks run out.
    fn schedule_running(
        &mut self,
        budget: &mut usize,
        preempted: &mut Vec<RequestId>,
        swap_out: &mut Vec<BlockCopy>,
    ) -> Vec<Scheduled> {
        let step = self.step;
        let mut order = self.running.clone();
        order.sort_by_cached_key(|id| running_key(&self.config, &self.requests[id], step));
        let mut scheduled: Vec<Scheduled> = Vec::with_capacity(order.len());
        // Decodes not yet served in this pass: a prefill chunk, or a decode's drafts, leaves
        // one token of the budget for each of them.
        let mut decodes_left =
            order.iter().filter(|id| self.requests[*id].num_uncomputed_tokens() == 1).count();
        for id in order {
            if *budget == 0 || self.ahead.starved {
                break;
            }
            let req = &self.requests[&id];
            if req.status != RequestStatus::Running {
                continue; // preempted earlier in this pass
            }
            if req.has_placeholder() && req.num_remaining_tokens(self.config.max_model_len) == 0 {
                decodes_left = decodes_left.saturating_sub(1);
                continue; // its placeholder is its last token: it finishes when confirmed
            }
            let num_uncomputed = req.num_uncomputed_tokens();
            let available = if num_uncomputed == 1 {
                decodes_left = decodes_left.saturating_sub(1);
                budget.saturating_sub(decodes_left).max(1)
            } else {
                budget.saturating_sub(decodes_left)
            };
            let has_drafts = !req.spec_token_ids.is_empty();
            let num_drafts = if num_uncomputed == 1 && has_drafts {
                let max_model_len = self.config.max_model_len;
                req.spec_token_ids
                    .len()
                    .min(req.num_remaining_tokens(max_model_len).saturating_sub(1))
            } else {
                0
            };
            let num_tokens = self.chunk_size(num_uncomputed + num_drafts, available);
            if num_tokens == 0 {
                // A completed chunk the runner sampled nothing for, or a prefill chunk with
                // every token left reserved for decodes: nothing to run this step.
                continue;
            }
            let num_spec = num_tokens.saturating_sub(num_uncomputed);
            loop {
                let req = &self.requests[&id];
                // A placeholder takes a lookahead slot: never registered in the prefix cache.
                let ph = usize::from(req.has_placeholder());
                let tokens = req.all_token_ids();
                let allocated = self.kv.allocate_slots(
                    id,
                    &tokens[..tokens.len() - ph],
                    req.num_computed_tokens,
                    num_tokens - num_spec - ph,
                    num_spec + ph,
                );
                if let Some(new_blocks) = allocated {
                    *budget -= num_tokens;
                    // Drafts are used once: those past the budget are dropped.
                    let (mut spec_token_ids, mut spec_parents) = (Vec::new(), Vec::new());
                    if has_drafts && let Some(req) = self.requests.get_mut(&id) {
                        spec_token_ids = mem::take(&mut req.spec_token_ids);
                        spec_token_ids.truncate(num_spec);
                        spec_parents = mem::take(&mut req.spec_parents);
                        spec_parents.truncate(num_spec);
                    }
                    scheduled.push(Scheduled {
                        id,
                        num_tokens,
                        spec_token_ids,
                        spec_parents,
                        new_blocks,
                    });
                    break;
                }
                if self.ahead.active {
                    self.ahead.starved = true; // planned ahead: no preemption (`update.rs`)
                    break;
                }
                let victim = self.pick_victim();
                // The order and the victim use the same key, so the victim is never a request
                // scheduled earlier in this pass; should keys ever differ, its tokens return.
                if let Some(pos) = scheduled.iter().position(|s| s.id == victim) {
                    *budget += scheduled.remove(pos).num_tokens;
                }
                self.preempt(victim, swap_out);
                preempted.push(victim);
                if victim == id {
                    break;
                }
            }
        }
        scheduled
    }

    /// The running request with the largest policy key.
    fn pick_victim(&self) -> RequestId {
        let step = self.step;
        *self
            .running
            .iter()
            .max_by_key(|id| running_key(&self.config, &self.requests[*id], step))
            .expect("a failed allocation implies a running request")
    }

    /// Frees a running request's blocks and sends it to the front of the waiting queue; with a
    /// second tier, its computed blocks are first copied out when that pays ([`crate::swap`]).
    fn preempt(&mut self, id: RequestId, swap_out: &mut Vec<BlockCopy>) {
        let Some(req) = self.requests.get_mut(&id) else { return };
        let num_computed = req.num_computed_tokens;
        if let Some(space) = &mut self.swap {
            let num_blocks = num_computed.div_ceil(self.kv.block_size());
            let scored = req.sampling_params().prompt_logprobs.is_some();
            if !scored && space.should_swap(num_computed, num_blocks) {
                let blocks = &self.kv.block_table(id)[..num_blocks];
                req.swapped = Some(space.swap_out(blocks, num_computed, swap_out));
            } else {
                space.count_recompute();
            }
        }
        self.kv.free_with_computed(id, num_computed);
        req.num_computed_tokens = 0;
        req.num_in_flight_tokens = 0;
        req.num_in_flight_spec_tokens = 0;
        req.spec_token_ids.clear();
        req.spec_parents.clear();
        req.status = RequestStatus::Preempted;
        req.num_preemptions += 1;
        req.queue_seq = self.next_front_seq;
        self.next_front_seq -= 1;
        self.running.retain(|&r| r != id);
        self.waiting.push(id);
        self.num_preemptions += 1;
    }

    /// Phase 2: admits waiting requests in policy order until one does not fit.
    fn admit_waiting(
        &mut self,
        mut budget: usize,
        mut num_partial: usize,
        out: &mut SchedulerOutput,
    ) {
        if self.waiting.is_empty() {
            return;
        }
        let step = self.step;
        let mut order = self.waiting.clone();
        order.sort_by_cached_key(|id| waiting_key(&self.config, &self.requests[id], step));
        let mut num_admitted = 0;
        let mut adapters: HashSet<u32> =
            self.running.iter().map(|id| self.requests[id].adapter()).filter(|&a| a != 0).collect();
        for id in order {
            if budget == 0 || self.running.len() >= self.limits.max_num_seqs {
                break;
            }
            let req = &self.requests[&id];
            let adapter = req.adapter();
            let new_adapter = adapter != 0 && !adapters.contains(&adapter);
            if new_adapter && self.max_loras.is_some_and(|max| adapters.len() >= max) {
                continue;
            }
            let bs = self.kv.block_size();
            // Prompt logprobs need every prompt position computed: no prefix-cache reads. An
            // adapter's KV is not the base model's: it hits only its own key's blocks, and
            // never the second tier.
            let key = req.cache_key();
            let (num_cached, tier_slots) = if req.sampling_params().prompt_logprobs.is_some() {
                (0, Vec::new())
            } else {
                let hit = self.kv.lookup_prefix_keyed(req.all_token_ids(), key);
                let tier = if req.swapped.is_none() && key == 0 {
                    self.tier_hit(req.all_token_ids(), &hit.blocks)
                } else {
                    Vec::new()
                };
                (hit.num_cached_tokens, tier)
            };
            // A request preempted by swap: the KV past the hit comes back from its slots (all
            // but the last token, whose logits the next sample needs); any other request gets
            // the spilled blocks that continue its hit.
            let num_restored = req.num_swapped_tokens().min(req.num_tokens() - 1);
            let num_computed = (num_cached + tier_slots.len() * bs).max(num_restored);
            let num_uncomputed = req.num_tokens() - num_computed;
            let num_tokens = self.chunk_size(num_uncomputed, budget);
            let is_partial = num_tokens < num_uncomputed;
            if is_partial
                && (self.config.whole_prompts
                    || num_partial >= self.config.max_num_partial_prefills)
            {
                break;
            }
            let tokens = req.all_token_ids();
            let num_new = num_computed - num_cached + num_tokens;
            self.kv.set_cache_key(id, key);
            if self.kv.allocate_slots(id, tokens, num_cached, num_new, 0).is_none() {
                self.kv.set_cache_key(id, 0);
                break;
            }
            num_partial += usize::from(is_partial);
            budget -= num_tokens;
            num_admitted += 1;
            if adapter != 0 {
                adapters.insert(adapter);
            }
            let Some(req) = self.requests.get_mut(&id) else { continue };
            if let (Some(space), false) = (&mut self.swap, tier_slots.is_empty()) {
                let first = num_cached / bs;
                let blocks = &self.kv.block_table(id)[first..first + tier_slots.len()];
                let last = blocks.last().and_then(|&b| self.kv.pool().cached_ref(b));
                space.take_hit(&tier_slots, blocks, last, bs, &mut out.swap_in);
            }
            if let (Some(space), Some(kv)) = (&mut self.swap, req.swapped.take()) {
                let (first, end) = (num_cached / bs, num_computed.div_ceil(bs));
                if num_restored > num_cached {
                    space.swap_in(
                        kv,
                        first,
                        &self.kv.block_table(id)[first..end],
                        &mut out.swap_in,
                    );
                } else {
                    space.release(kv); // the prefix cache holds at least as much
                }
            }
            req.status = RequestStatus::Running;
            req.num_computed_tokens = num_computed;
            req.num_in_flight_tokens = num_tokens;
            req.num_sent_tokens = req.num_tokens();
            self.running.push(id);
            out.num_scheduled_tokens += num_tokens;
            out.new_requests.push(NewRequestData {
                id,
                token_ids: req.all_token_ids().to_vec(),
                num_computed_tokens: num_computed,
                num_scheduled_tokens: num_tokens,
                block_table: self.kv.block_table(id).to_vec(),
                sampling_params: req.sampling_params().clone(),
            });
            // After this admission's hits were taken, so none of their slots is given away.
            self.spill_evicted(&mut out.swap_out);
        }
        if num_admitted > 0 {
            let requests = &self.requests;
            self.waiting.retain(|id| requests[id].status != RequestStatus::Running);
        }
    }

    /// The scheduler's and the KV manager's invariants (module docs).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.kv.check_invariants()?;
        if self.running.len() > self.config.max_num_seqs {
            return Err(format!("{} running > max_num_seqs", self.running.len()));
        }
        if self.running.len() + self.waiting.len() != self.requests.len() {
            return Err("running + waiting != known requests".to_owned());
        }
        let adapters: HashSet<u32> =
            self.running.iter().map(|id| self.requests[id].adapter()).filter(|&a| a != 0).collect();
        if self.max_loras.is_some_and(|max| adapters.len() > max) {
            return Err(format!("{} LoRA adapters running > max_loras", adapters.len()));
        }
        let block_size = self.kv.block_size();
        for id in &self.running {
            let req = &self.requests[id];
            if req.status != RequestStatus::Running || !self.kv.contains(*id) {
                return Err(format!("{id} is in the running list as {:?}", req.status));
            }
            // Scheduled tokens are registered at `schedule` (none are in flight after `update`).
            let num_registered = self.kv.num_registered_blocks(*id) * block_size;
            let num_known = req.num_computed_tokens + req.num_in_flight_tokens;
            if num_registered > num_known {
                return Err(format!(
                    "{id}: {num_registered} tokens registered in the prefix cache, {} computed, \
                     {} in flight",
                    req.num_computed_tokens, req.num_in_flight_tokens
                ));
            }
        }
        let num_partial = (self.running.iter().map(|id| &self.requests[id]))
            .filter(|r| r.num_uncomputed_tokens() - r.num_in_flight_tokens > 1)
            .count();
        if num_partial > self.config.max_num_partial_prefills {
            return Err(format!("{num_partial} partial prefills > max_num_partial_prefills"));
        }
        for id in &self.waiting {
            let req = &self.requests[id];
            let ok = matches!(req.status, RequestStatus::Waiting | RequestStatus::Preempted);
            if !ok || req.num_computed_tokens != 0 || self.kv.contains(*id) {
                return Err(format!("{id} waits as {:?} holding KV", req.status));
            }
            if !req.spec_token_ids.is_empty() || req.num_in_flight_spec_tokens != 0 {
                return Err(format!("{id} waits with draft tokens"));
            }
        }
        if let Some((id, _)) = self.requests.iter().find(|(_, r)| r.has_placeholder()) {
            return Err(format!("{id} holds a placeholder between steps"));
        }
        if let Some(id) = self.running.iter().find(|id| self.requests[*id].swapped.is_some()) {
            return Err(format!("{id} runs holding tier slots"));
        }
        if let Some(space) = &self.swap {
            let held = self.waiting.iter().filter_map(|id| self.requests[id].swapped.as_ref());
            space.check(held.flat_map(|kv| kv.slots.iter().copied()))?;
        }
        Ok(())
    }
}
