//! The engine core: owns the [`Scheduler`] and the [`ModelRunner`] (with the model bound to its
//! KV cache on its backend), and runs one step at a time: schedule → execute → update →
//! outputs. Synchronous by default; with asynchronous scheduling the forward runs on a second
//! thread while the engine reports the step before (`engine/async_step.rs`).
//! [`crate::EngineHandle`] runs the core on its own thread.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_core::{RequestId, SamplingParams, TokenId};
use kiln_kv::{KvCacheConfig, PrefixCacheStats};
use kiln_models::{Backend, BoundModel, KvCacheDtype, Model, StepModel, check_block_size};
use kiln_sched::{
    AddError, BatchController, ControllerConfig, ControllerStats, Deadline, ModelRunnerOutput,
    PreemptionMode, QueueAhead, Request, RequestStatus, Scheduler, SchedulerConfig, SchedulerStats,
    SchedulingPolicy, SwapConfig, SwapStats,
};

use crate::forward_thread::ForwardThread;
use crate::handle::OutputSink;
use crate::kv_tier::{KvTier, KvTierConfig};
use crate::prefix_store::{self, PrefixStoreError, RestoreSummary};
use crate::requests::{LiveRequest, RequestTable};
use crate::slo::{AdmissionDecision, Admitted, Prediction, SloConfig, decide};
use crate::spec::{
    DraftProposer, SpecDecodeStats, SpeculativeConfig, Speculator, bind_draft_model,
};
use crate::structured::{ConstraintStats, GrammarCompiler, PendingCompiler};
use crate::{EngineOutput, ModelRunner};

mod async_step;
mod deliver;
mod step;

pub(crate) use step::{Arrival, Decoding};

/// Seconds per prefill token the swap-or-recompute rule assumes until a prefill is measured
/// (a small model on a few CPU cores; measured values replace it after the first prefills).
const PRIOR_PREFILL_SECS_PER_TOKEN: f64 = 2e-4;

/// Sizes and limits of an engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Tokens per KV block; see [`kiln_models::check_block_size`].
    pub block_size: usize,
    pub num_kv_blocks: usize,
    /// Prompt plus output tokens of one request; `None` = the model's maximum positions, capped
    /// at the KV cache capacity. Overrides `scheduler.max_model_len`.
    pub max_model_len: Option<usize>,
    pub scheduler: SchedulerConfig,
    /// Requests whose sampling params carry no seed use `seed + request id`.
    pub seed: u64,
    /// The model's end-of-sequence ids (ignored by requests with `ignore_eos`).
    pub eos_token_ids: Vec<TokenId>,
    /// Element type of the KV cache (default f16, as the CLI).
    pub kv_cache_dtype: KvCacheDtype,
    /// Speculative decoding (`None`: off). Method `draft_model` needs the draft model
    /// ([`EngineCore::with_draft_model`]).
    pub speculative: Option<SpeculativeConfig>,
    /// Latency targets, SLO classes and admission control (all off by default).
    pub slo: SloConfig,
    /// A second KV tier for preemption by swap (`None`: preemption recomputes).
    pub kv_tier: Option<KvTierConfig>,
    /// With a tier: when a preempted request's KV goes to it.
    pub preemption_mode: PreemptionMode,
    /// Asynchronous scheduling (vLLM's `--async-scheduling`): each step's forward runs on a
    /// second thread while the engine plans the next step (placeholders for the tokens in
    /// flight) and applies and reports the step before (`engine/async_step.rs`). Not with
    /// speculative decoding; with a second KV tier each step is planned after the update of
    /// the step before.
    pub async_scheduling: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_kv_blocks: 1024,
            max_model_len: None,
            scheduler: SchedulerConfig::default(),
            seed: 0,
            eos_token_ids: Vec::new(),
            kv_cache_dtype: KvCacheDtype::F16,
            speculative: None,
            slo: SloConfig::default(),
            kv_tier: None,
            preemption_mode: PreemptionMode::Auto,
            async_scheduling: false,
        }
    }
}

/// What can go wrong in the engine (cheap to clone: sent to every affected stream).
#[derive(Clone, Debug, thiserror::Error)]
pub enum EngineError {
    #[error("invalid engine configuration: {0}")]
    Config(String),
    /// The request was refused (too long, empty, bad sampling parameters).
    #[error(transparent)]
    Rejected(#[from] AddError),
    #[error("forward step failed: {0}")]
    Forward(String),
    #[error("the engine has shut down")]
    Shutdown,
}

/// Counters after one step (gauges are as of the end of the step; totals since start).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineStats {
    pub num_running: usize,
    pub num_waiting: usize,
    /// Fraction of KV blocks held by requests.
    pub kv_usage: f32,
    /// Prompt tokens looked up in the prefix cache and, of those, found (not recomputed),
    /// summed since start; `prefix_cache.hit_rate()` is their ratio.
    pub prefix_cache: PrefixCacheStats,
    pub num_preemptions: u64,
    /// Tokens scheduled in the last step.
    pub step_scheduled_tokens: usize,
    /// Tokens scheduled since start.
    pub total_scheduled_tokens: u64,
    /// Tokens sampled since start.
    pub total_sampled_tokens: u64,
    pub num_steps: u64,
    /// Steps planned while the step before computed (asynchronous scheduling with
    /// placeholders; the others were planned after its update).
    pub num_steps_planned_ahead: u64,
    /// Wall time of the last step. With asynchronous scheduling: from its planning (a step
    /// planned ahead: from the end of the sampling of the step before) to the end of its
    /// update, less the time the caller held the engine thread after its forward had ended;
    /// the steps then about tile the busy time (a step planned ahead overlaps the one before
    /// by its launch and that step's stop checks).
    pub step_time: Duration,
    /// Wall time since start: of every step, of their model forwards and of their sampling;
    /// the rest of the steps' time is host work (scheduling, building batches, updating
    /// requests, proposing drafts; with asynchronous scheduling also the handoffs to the
    /// forward thread, and the reporting of the step before where it outlasts the forward).
    pub total_step_time: Duration,
    pub total_forward_time: Duration,
    pub total_sample_time: Duration,
    /// Speculative-decoding counters (all 0 with speculation off).
    pub spec_decode: SpecDecodeStats,
    /// The scheduler's limits in force (the batch controller moves them).
    pub limits: kiln_sched::StepLimits,
    /// The batch controller's state (`None`: no latency objective configured).
    pub controller: Option<ControllerStats>,
    /// Requests refused by admission control since start (deadline unmeetable).
    pub num_slo_rejected: u64,
    /// Requests demoted since start: at admission, or waiting past their deadline.
    pub num_slo_demoted: u64,
    /// The second KV tier: slots, blocks swapped out and in, preemptions by mode.
    pub swap: SwapStats,
    /// Structured outputs: tokens constrained, masks computed, single tokens checked.
    pub structured: ConstraintStats,
}

pub struct EngineCore {
    scheduler: Scheduler,
    runner: ModelRunner,
    config: EngineConfig,
    runner_output: ModelRunnerOutput,
    next_id: u64,
    stats: EngineStats,
    /// Everything kept about each request (`requests.rs`); nothing else here is by request.
    requests: RequestTable,
    /// Proposes draft tokens when speculative decoding is on.
    speculator: Option<Speculator>,
    /// The draft model while speculation is switched off ([`EngineCore::set_speculative_config`]).
    idle_draft_model: Option<DraftProposer>,
    /// Compiles requests' structured outputs (`None`: such requests are refused).
    grammar: Option<PendingCompiler>,
    /// Run once when the engine thread stops.
    shutdown_hook: Option<ShutdownHook>,
    /// Where prefix-cache events go (`None`: not logged).
    kv_event_sink: Option<KvEventSink>,
    /// Plans the scheduler's limits from measured steps (`None`: no latency objective).
    controller: Option<BatchController>,
    /// The engine's clock for deadlines (milliseconds since this instant).
    epoch: Instant,
    num_admission_demoted: u64,
    /// The second KV tier's storage (`None`: no tier).
    tier: Option<KvTier>,
    /// Measured seconds per prefill token (moving average; `None` until a prefill step ran).
    prefill_secs_per_token: Option<f64>,
    /// Measured bytes per second of the tier's copies (moving average; `None` until a swap).
    tier_bytes_per_sec: Option<f64>,
    /// Runs the forwards with asynchronous scheduling (`None`: steps are synchronous).
    forward_thread: Option<ForwardThread>,
    /// The step whose forward is running (asynchronous scheduling).
    in_flight: Option<async_step::InFlightStep>,
    /// Why the step after the last one reported could not start (asynchronous scheduling: the
    /// next `step` returns it).
    pending_error: Option<EngineError>,
    /// Requests aborted while a step was in flight: removed from the scheduler once it ends.
    deferred_aborts: Vec<RequestId>,
    /// The forward thread lost the model or panicked: every later step fails with this.
    broken: Option<String>,
    /// When the last asynchronous `step` returned (the caller's time until the next one is
    /// not the engine's).
    returned_at: Option<Instant>,
}

/// Weight of the newest measurement in the engine's moving averages of rates.
const RATE_SMOOTHING: f64 = 0.2;

/// Work for the engine thread's last moment ([`EngineCore::set_shutdown_hook`]).
pub type ShutdownHook = Box<dyn FnOnce(&mut EngineCore) + Send>;

/// Receives the prefix-cache index changes of each step, in order (never an empty batch).
pub type KvEventSink = Box<dyn FnMut(Vec<kiln_kv::KvCacheEvent>) + Send>;

impl EngineCore {
    /// Validates `config` against the model and allocates the KV cache on the model's backend.
    pub fn new<B: Backend>(
        model: Box<dyn Model<B>>,
        config: EngineConfig,
    ) -> Result<Self, EngineError> {
        Self::with_draft_model(model, None, config)
    }

    /// [`EngineCore::new`] with the draft model that `config.speculative`'s method
    /// `draft_model` names, on the same backend: it must have the target's vocabulary size, and
    /// gets a KV cache of the target's blocks (plus scratch blocks for drafts).
    pub fn with_draft_model<B: Backend>(
        model: Box<dyn Model<B>>,
        draft_model: Option<Box<dyn Model<B>>>,
        mut config: EngineConfig,
    ) -> Result<Self, EngineError> {
        let block_size = config.block_size;
        check_block_size(block_size)
            .map_err(|e| EngineError::Config(format!("`block_size` {e}")))?;
        if config.num_kv_blocks == 0 {
            return Err(EngineError::Config("`num_kv_blocks` must be at least 1".into()));
        }
        let model_max = model.config().max_position_embeddings;
        let capacity = block_size * config.num_kv_blocks;
        let max_model_len = match config.max_model_len {
            Some(n) if n > model_max => {
                return Err(EngineError::Config(format!(
                    "`max_model_len` ({n}) exceeds the model's maximum positions ({model_max})"
                )));
            }
            Some(n) => n,
            None => model_max.min(capacity),
        };
        config.max_model_len = Some(max_model_len);
        config.scheduler.max_model_len = max_model_len;
        let kv_config = KvCacheConfig {
            block_size,
            num_blocks: config.num_kv_blocks,
            enable_prefix_caching: config.scheduler.enable_prefix_caching,
            extra_keys: vec![],
        };
        let mut scheduler = Scheduler::new(config.scheduler.clone(), kv_config)
            .map_err(|e| EngineError::Config(e.0))?;
        let bound = BoundModel::new(model, config.kv_cache_dtype, config.num_kv_blocks, block_size)
            .map_err(|e| EngineError::Config(e.to_string()))?;
        let tier = match &config.kv_tier {
            None => None,
            Some(tier_config) => {
                let block_bytes = bound.kv_block_bytes();
                let tier = KvTier::new(tier_config, block_bytes).map_err(EngineError::Config)?;
                scheduler.set_swap_space(SwapConfig {
                    num_slots: tier.num_slots(),
                    block_bytes,
                    mode: config.preemption_mode,
                    tier_bytes_per_sec: tier_config.location.prior_bytes_per_sec(),
                    prefill_secs_per_token: PRIOR_PREFILL_SECS_PER_TOKEN,
                });
                Some(tier)
            }
        };
        let runner = ModelRunner::new(Box::new(bound), config.seed)
            .with_eos_token_ids(&config.eos_token_ids);
        let speculator = speculator_for(&config, &runner, draft_model)?;
        let forward_thread = forward_thread_for(&config, speculator.is_some())?;
        let slo = &config.slo;
        let controller = (slo.is_active() || config.scheduler.policy == SchedulingPolicy::Deadline)
            .then(|| {
                BatchController::new(ControllerConfig {
                    target_itl: slo.target_itl_ms.map(|ms| ms / 1e3),
                    target_tpot: slo.controller_tpot_ms().map(|ms| ms / 1e3),
                    target_ttft: slo.target_ttft_ms.map(|ms| ms / 1e3),
                    ceiling: scheduler.limits(),
                })
            });
        let mut core = Self {
            scheduler,
            runner,
            config,
            runner_output: ModelRunnerOutput::default(),
            next_id: 0,
            stats: EngineStats::default(),
            requests: RequestTable::new(),
            speculator,
            idle_draft_model: None,
            grammar: None,
            shutdown_hook: None,
            kv_event_sink: None,
            controller,
            epoch: Instant::now(),
            num_admission_demoted: 0,
            tier,
            prefill_secs_per_token: None,
            tier_bytes_per_sec: None,
            forward_thread,
            in_flight: None,
            pending_error: None,
            deferred_aborts: Vec::new(),
            broken: None,
            returned_at: None,
        };
        core.refresh_stats();
        Ok(core)
    }

    /// The batch controller, for tests that teach its cost model known step times.
    #[cfg(test)]
    pub(crate) fn controller_mut(&mut self) -> Option<&mut BatchController> {
        self.controller.as_mut()
    }

    /// Milliseconds on the engine's clock.
    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The request's deadline from its SLO class, after admission control: `Err` when it must
    /// be refused, `Ok(None)` when it has no deadline.
    fn admit_deadline(
        &self,
        priority: i64,
        num_prompt_tokens: usize,
    ) -> Result<Option<Admitted>, AddError> {
        let slo = &self.config.slo;
        let now = self.now_ms();
        let is_deadline_policy = self.config.scheduler.policy == SchedulingPolicy::Deadline;
        let shift = self.config.scheduler.slo_demotion_ms;
        let Some(class) = slo.class_for(priority) else {
            // Under the deadline policy every request is due some time, so none starves.
            let best_effort = Deadline { first_token_ms: now.saturating_add(shift), tpot_ms: None };
            let admitted = Admitted { deadline: best_effort, demoted: false, predicted: None };
            return Ok(is_deadline_policy.then_some(admitted));
        };
        let deadline =
            Deadline { first_token_ms: now.saturating_add(class.ttft_ms), tpot_ms: class.tpot_ms };
        let prediction = self.predict_first_token(deadline, num_prompt_tokens);
        match decide(slo.admission, class.ttft_ms, prediction.alone_ms, prediction.queued_ms) {
            AdmissionDecision::Admit => {
                Ok(Some(Admitted { deadline, demoted: false, predicted: prediction.uncalibrated }))
            }
            AdmissionDecision::Reject { predicted_ms } => {
                Err(AddError::DeadlineUnmeetable { predicted_ms, ttft_slo_ms: class.ttft_ms })
            }
            AdmissionDecision::Demote => {
                let first_token_ms = deadline.first_token_ms.saturating_add(shift);
                let deadline = Deadline { first_token_ms, ..deadline };
                Ok(Some(Admitted { deadline, demoted: true, predicted: None }))
            }
        }
    }

    /// The first-token time of a request due at `deadline` with `num_prompt_tokens` tokens:
    /// alone, and behind the work served ahead of it (all `None` until the batch controller's
    /// cost model is fitted).
    fn predict_first_token(&self, deadline: Deadline, num_prompt_tokens: usize) -> Prediction {
        let Some(controller) = &self.controller else { return Prediction::default() };
        let before = (self.config.scheduler.policy == SchedulingPolicy::Deadline)
            .then_some(deadline.first_token_ms);
        let running = self.scheduler.num_running();
        let free_seats = self.scheduler.limits().max_num_seqs.saturating_sub(running);
        let queue = QueueAhead {
            prompt_tokens: num_prompt_tokens,
            tokens_ahead: self.scheduler.pending_prefill_tokens(before),
            num_running: running,
            seats_needed: (self.scheduler.num_waiting_ahead(before) + 1).saturating_sub(free_seats),
        };
        let alone = QueueAhead { prompt_tokens: num_prompt_tokens, ..QueueAhead::default() };
        let now = self.epoch.elapsed().as_secs_f64();
        let ms = |seconds: Option<f64>| seconds.map(|s| (s * 1e3).ceil() as u64);
        Prediction {
            alone_ms: ms(controller.calibrated_first_token_seconds(&alone, now)),
            queued_ms: ms(controller.calibrated_first_token_seconds(&queue, now)),
            uncalibrated: controller.predict_first_token_seconds(&queue),
        }
    }

    /// Enables structured outputs: requests whose params carry one are compiled by `compiler`
    /// (built over this model's vocabulary).
    pub fn set_grammar_compiler(&mut self, compiler: Arc<GrammarCompiler>) {
        self.grammar = Some(PendingCompiler::ready(compiler));
    }

    /// As [`EngineCore::set_grammar_compiler`], with a compiler that may still be being built
    /// (a structured request waits for it; a failed build refuses such requests).
    pub fn set_pending_grammar_compiler(&mut self, compiler: PendingCompiler) {
        self.grammar = Some(compiler);
    }

    /// The structured-output compiler, shared with whoever validates requests before queueing.
    pub fn grammar_compiler(&self) -> Option<&PendingCompiler> {
        self.grammar.as_ref()
    }

    /// The resolved maximum of prompt plus output tokens.
    pub fn max_model_len(&self) -> usize {
        self.scheduler.config().max_model_len
    }

    /// The model, bound to the engine's KV cache on its backend. Panics while an asynchronous
    /// step is in flight (`has_unfinished`; [`EngineCore::finish_in_flight`] ends it).
    pub fn model(&self) -> &dyn StepModel {
        self.runner.model()
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    pub(crate) fn scheduler_mut(&mut self) -> &mut Scheduler {
        &mut self.scheduler
    }

    pub(crate) fn model_mut(&mut self) -> &mut dyn StepModel {
        self.runner.model_mut()
    }

    /// Writes the reachable prefix cache to `path` ([`crate::prefix_store`]); returns the
    /// number of blocks. `model_fingerprint` identifies the model file.
    pub fn save_prefix_cache(&self, path: &Path, model_fingerprint: u64) -> std::io::Result<usize> {
        if self.in_flight.is_some() {
            return Err(std::io::Error::other(
                "a step is in flight: save the prefix cache between steps (finish_in_flight)",
            ));
        }
        prefix_store::save(self, path, model_fingerprint)
    }

    /// Restores a prefix cache saved by [`EngineCore::save_prefix_cache`] into this idle
    /// engine; a file of another model, dtype or geometry, or a damaged one, is refused whole.
    pub fn restore_prefix_cache(
        &mut self,
        path: &Path,
        model_fingerprint: u64,
    ) -> Result<RestoreSummary, PrefixStoreError> {
        prefix_store::restore(self, path, model_fingerprint)
    }

    /// Runs `hook` on the engine thread when the [`crate::EngineHandle`] shuts down (after the
    /// last step; e.g. saving the prefix cache).
    pub fn set_shutdown_hook(&mut self, hook: ShutdownHook) {
        self.shutdown_hook = Some(hook);
    }

    /// Logs every change to the prefix-cache index from now on (blocks stored with their
    /// parent and tokens, removed, all cleared) and hands them to `sink` in order, after each
    /// step on the engine thread ([`Self::flush_kv_events`]).
    pub fn set_kv_event_sink(&mut self, sink: KvEventSink) {
        self.scheduler.kv_cache_mut().set_log_events(true);
        self.kv_event_sink = Some(sink);
    }

    /// Hands the index changes since the last call to the sink, if any.
    pub fn flush_kv_events(&mut self) {
        if let Some(sink) = &mut self.kv_event_sink {
            let events = self.scheduler.kv_cache_mut().take_events();
            if !events.is_empty() {
                sink(events);
            }
        }
    }

    /// Runs and clears the shutdown hook, if any.
    pub(crate) fn run_shutdown_hook(&mut self) {
        // The hook may read the model, which an asynchronous step in flight holds. A failed
        // step has dropped the blocks it never wrote; a model lost with its thread is not read.
        if let Err(e) = self.finish_in_flight() {
            tracing::warn!("the last step failed at shutdown: {e}");
        }
        if !self.runner.has_model() {
            tracing::warn!("the model was lost with the forward thread: shutdown work skipped");
            return;
        }
        if let Some(hook) = self.shutdown_hook.take() {
            hook(self);
        }
    }

    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// Whether a request is unfinished, an asynchronous step still runs, or the error of one
    /// that could not start is still to be returned.
    pub fn has_unfinished(&self) -> bool {
        self.scheduler.has_unfinished() || self.in_flight.is_some() || self.pending_error.is_some()
    }

    /// Requests in the request table: unfinished ones, and finished ones whose outputs await
    /// delivery to a sink (0 when idle: nothing is left behind by a finished or aborted one).
    pub fn num_live_requests(&self) -> usize {
        self.requests.len()
    }

    /// Queues a request; lower `priority` is more urgent (used by the priority policy).
    pub fn add_request(
        &mut self,
        prompt: Vec<TokenId>,
        params: SamplingParams,
        priority: i64,
    ) -> Result<RequestId, EngineError> {
        let id = RequestId(self.next_id);
        self.add_request_with_id(id, prompt, params, priority)?;
        Ok(id)
    }

    /// [`EngineCore::add_request`] with an id chosen by the caller (unique among unfinished
    /// requests; ids from [`EngineCore::add_request`] count up from 0).
    pub fn add_request_with_id(
        &mut self,
        id: RequestId,
        prompt: Vec<TokenId>,
        params: SamplingParams,
        priority: i64,
    ) -> Result<(), EngineError> {
        if self.requests.contains(id) {
            return Err(AddError::DuplicateId(id).into());
        }
        let vocab_size = self.runner.vocab_size();
        let first_bad = |tokens: &mut dyn Iterator<Item = TokenId>| {
            tokens.map(|t| t.0).find(|&t| t as usize >= vocab_size)
        };
        let bad = first_bad(&mut prompt.iter().copied())
            .map(|t| ("prompt", t))
            .or_else(|| {
                first_bad(&mut params.logit_bias.iter().map(|b| b.0)).map(|t| ("logit_bias", t))
            })
            .or_else(|| {
                first_bad(&mut params.stop_token_ids.iter().copied()).map(|t| ("stop_token_ids", t))
            });
        if let Some((what, token)) = bad {
            return Err(AddError::TokenOutOfVocab { what, token, vocab_size }.into());
        }
        let constraint = match (&params.structured, &self.grammar) {
            (None, _) => None,
            (Some(_), None) => {
                return Err(AddError::InvalidSampling(
                    "structured outputs are not available: the engine has no grammar compiler \
                     (no tokenizer vocabulary)"
                        .into(),
                )
                .into());
            }
            (Some(spec), Some(pending)) => {
                let compiler = pending.wait().map_err(|why| {
                    AddError::InvalidSampling(format!(
                        "structured outputs are not available for this model: {why}"
                    ))
                })?;
                Some(compiler.compile(spec).map_err(|e| {
                    AddError::InvalidSampling(format!(
                        "invalid structured output ({}): {e}",
                        spec.kind()
                    ))
                })?)
            }
        };
        let num_prompt_tokens = prompt.len();
        let ttft_ms = self.config.slo.classes.get(&priority).map(|c| c.ttft_ms);
        let tpot_ms = self.config.slo.tpot_ms_for(priority);
        let admitted = self.admit_deadline(priority, num_prompt_tokens);
        if let Err(AddError::DeadlineUnmeetable { .. }) = &admitted {
            self.stats.num_slo_rejected += 1;
        }
        let admitted = admitted?;
        let predicted = admitted.and_then(|a| a.predicted);
        let mut request = Request::new(id, prompt, params)
            .with_priority(priority)
            .with_eos_token_ids(self.config.eos_token_ids.clone());
        request = match admitted {
            Some(Admitted { deadline, demoted: false, .. }) => request.with_deadline(deadline),
            Some(Admitted { deadline, demoted: true, .. }) => {
                request.with_demoted_deadline(deadline)
            }
            None => request,
        };
        let demoted = request.is_demoted();
        self.scheduler.add(request)?;
        self.num_admission_demoted += u64::from(demoted);
        let mut live = LiveRequest { constraint, ..LiveRequest::default() };
        if let Some(c) = &mut self.controller {
            let now = Instant::now();
            live.arrival = Some(Arrival { at: now, ttft_ms, tpot_ms, predicted });
            c.observe_arrival(num_prompt_tokens, now.duration_since(self.epoch).as_secs_f64());
        }
        self.requests.insert(id, live);
        self.next_id = self.next_id.max(id.0 + 1);
        self.refresh_stats();
        Ok(())
    }

    /// Sends `id`'s outputs to `sink` from now on, when delivered (`engine/deliver.rs`); `false`
    /// (the sink dropped) when `id` is not held.
    pub(crate) fn set_sink(&mut self, id: RequestId, sink: OutputSink) -> bool {
        let Some(live) = self.requests.get_mut(id) else { return false };
        live.sink = Some(sink);
        true
    }

    /// Turns speculative decoding on (with `config`) or off between runs: only while no request
    /// is unfinished, so no draft of the old setting is left (benchmarks compare both on the same
    /// weights and threads). The acceptance counters keep counting. A draft model is kept while
    /// speculation is off; a config naming another draft model, or more drafts at once than its
    /// scratch blocks fit, is refused.
    pub fn set_speculative_config(
        &mut self,
        config: Option<SpeculativeConfig>,
    ) -> Result<(), EngineError> {
        if self.has_unfinished() {
            return Err(EngineError::Config(
                "speculative decoding can only be switched while no request runs".into(),
            ));
        }
        if config.is_some() && self.forward_thread.is_some() {
            return Err(EngineError::Config(
                "speculative decoding does not run with asynchronous scheduling".into(),
            ));
        }
        // Checked before anything changes: a refused config leaves the engine as it was.
        let trees = self.runner.model().supports_token_trees();
        if let Some(c) = &config {
            crate::spec::check_token_tree(c, trees).map_err(EngineError::Config)?;
        }
        if let Some(c) = config.as_ref().filter(|c| c.draft_model_name().is_some()) {
            let held = self.speculator.as_ref().and_then(Speculator::draft_model);
            let Some(draft) = held.or(self.idle_draft_model.as_ref()) else {
                return Err(EngineError::Config("this engine has no draft model".into()));
            };
            draft.check_serves(c).map_err(EngineError::Config)?;
        }
        let stats = self.speculator.as_ref().map_or(self.stats.spec_decode, |s| *s.stats());
        if let Some(draft) = self.speculator.take().and_then(Speculator::into_draft_model) {
            self.idle_draft_model = Some(draft);
        }
        let wants_draft = config.as_ref().is_some_and(|c| c.draft_model_name().is_some());
        let draft = if wants_draft { self.idle_draft_model.take() } else { None };
        // No request runs; finished ones awaiting delivery draft no more either.
        self.requests.reset_spec_state();
        self.speculator = match config.clone() {
            Some(c) => Some(
                Speculator::new(c, draft, trees).map_err(EngineError::Config)?.with_stats(stats),
            ),
            None => None,
        };
        self.config.speculative = config;
        Ok(())
    }

    /// Removes a request in any state and frees its blocks; `false` if unknown (finished).
    /// While an asynchronous step is in flight the request gets no more output at once, but
    /// its blocks are freed when that step ends (its KV then written, or dropped with a failed
    /// step), so no block is cached with KV that was never written.
    pub fn abort(&mut self, id: RequestId) -> bool {
        self.requests.remove(id);
        if self.in_flight.is_some() {
            let known = self.scheduler.request(id).is_some();
            if known && !self.deferred_aborts.contains(&id) {
                self.deferred_aborts.push(id);
            }
            return known;
        }
        let known = self.abort_in_scheduler(id);
        self.refresh_stats();
        known
    }

    /// Removes the request from the scheduler; a running one frees its seat, which the batch
    /// controller counts as a departure, like a finished request's.
    pub(crate) fn abort_in_scheduler(&mut self, id: RequestId) -> bool {
        let running =
            self.scheduler.request(id).is_some_and(|r| r.status() == RequestStatus::Running);
        let known = self.scheduler.abort(id);
        if let Some(controller) = self.controller.as_mut().filter(|_| running) {
            controller.observe_departure();
        }
        known
    }

    fn refresh_stats(&mut self) {
        let SchedulerStats {
            num_running,
            num_waiting,
            kv_usage,
            prefix_cache,
            num_preemptions,
            num_scheduled_tokens,
            num_steps,
            num_demoted,
            swap,
        } = self.scheduler.stats();
        self.stats.swap = swap;
        self.stats.structured = self.runner.constraint_stats();
        self.stats.limits = self.scheduler.limits();
        self.stats.controller = self.controller.as_ref().map(BatchController::stats);
        self.stats.num_slo_demoted = num_demoted + self.num_admission_demoted;
        self.stats.num_running = num_running;
        self.stats.num_waiting = num_waiting;
        self.stats.kv_usage = kv_usage;
        self.stats.prefix_cache = prefix_cache;
        self.stats.num_preemptions = num_preemptions;
        self.stats.total_scheduled_tokens = num_scheduled_tokens;
        // With a step in flight, the steps reported so far (its own is counted when reported).
        self.stats.num_steps = num_steps - u64::from(self.in_flight.is_some());
    }
}

/// The speculator `config.speculative` asks for, with its draft model bound to the target's
/// KV geometry (`None`: speculation off; a draft model without a config is refused).
fn speculator_for<B: Backend>(
    config: &EngineConfig,
    runner: &ModelRunner,
    draft_model: Option<Box<dyn Model<B>>>,
) -> Result<Option<Speculator>, EngineError> {
    let draft = match draft_model {
        None => None,
        Some(draft) => Some(
            bind_draft_model(draft, runner.model().config(), config)
                .map_err(EngineError::Config)?,
        ),
    };
    match config.speculative.clone() {
        Some(spec) => {
            let trees = runner.model().supports_token_trees();
            Ok(Some(Speculator::new(spec, draft, trees).map_err(EngineError::Config)?))
        }
        None if draft.is_some() => {
            Err(EngineError::Config("a draft model was given without a speculative config".into()))
        }
        None => Ok(None),
    }
}

/// The forward thread of asynchronous scheduling (`None`: synchronous steps); refused next to
/// speculative decoding.
fn forward_thread_for(
    config: &EngineConfig,
    speculating: bool,
) -> Result<Option<ForwardThread>, EngineError> {
    if !config.async_scheduling {
        return Ok(None);
    }
    if speculating {
        return Err(EngineError::Config(
            "asynchronous scheduling does not run with speculative decoding (the drafts of a step \
             need the tokens of the step before)"
                .into(),
        ));
    }
    ForwardThread::spawn()
        .map(Some)
        .map_err(|e| EngineError::Config(format!("starting the forward thread: {e}")))
}
