//! The engine core: owns the [`Scheduler`], the [`ModelRunner`] (with the model bound to its
//! KV cache on its backend), the request table (`requests.rs`) and an executor, and runs one
//! step at a time: plan → execute → update → report (`engine/step.rs`) → deliver
//! (`engine/deliver.rs`). The executor (`engine/executor.rs`) orders a step's phases:
//! synchronous by default; with asynchronous scheduling the forward runs on a second thread
//! while the engine reports the step before (`engine/pipelined.rs`).
//! [`crate::EngineHandle`] runs the core on its own thread.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_core::{RequestId, TokenId};
use kiln_kv::{KvCacheConfig, PrefixCacheStats};
use kiln_models::{
    Backend, BoundModel, Classifier, ForwardError, KvCacheDtype, Model, ModelConfig, PoolerConfig,
    PoolingType, StepModel, check_block_size,
};
use kiln_sched::{
    AddError, BatchController, ControllerConfig, ControllerStats, ModelRunnerOutput,
    PreemptionMode, RequestStatus, Scheduler, SchedulerConfig, SchedulerStats, SchedulingPolicy,
    SwapConfig, SwapStats,
};

use crate::handle::OutputSink;
use crate::hooks::{Hooks, KvEvents, SloControl, TierHook};
use crate::kv_handoff::{KvHandoffStats, KvPins};
use crate::kv_tier::{KvTier, KvTierConfig};
use crate::prefix_store::{self, PrefixStoreError, RestoreSummary};
use crate::requests::RequestTable;
use crate::slo::SloConfig;
use crate::spec::{DraftProposer, SpecDecodeStats, SpeculativeConfig};
use crate::structured::{ConstraintStats, GrammarCompiler, PendingCompiler};
use crate::{EngineOutput, HostPool, ModelRunner};

mod adapters;
mod admission;
mod deliver;
mod executor;
mod kv_handoff;
mod pipelined;
mod speculation;
mod step;

use adapters::AdapterBindings;
pub use adapters::{AdapterBinding, AdapterSet, AdapterStats, MAX_ADAPTER_SLOT};
use executor::{Executor, executor_for};
use speculation::speculator_for;

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
    /// Where sampling and a draft model's draws run in parallel (default: serially on the
    /// engine thread; programs pass the CPU backend's pool, or host threads beside a GPU).
    pub host_pool: HostPool,
    /// Asynchronous scheduling (vLLM's `--async-scheduling`): each step's forward runs on a
    /// second thread while the engine plans the next step (placeholders for the tokens in
    /// flight) and applies and reports the step before (`engine/pipelined.rs`). Not with
    /// speculative decoding; with a second KV tier each step is planned after the update of
    /// the step before.
    pub async_scheduling: bool,
    /// Most distinct LoRA adapters in one step (vLLM's `--max-loras`; `None`: no limit): a
    /// request of another adapter waits until a running adapter's requests leave.
    pub max_loras: Option<usize>,
    /// A pooling model's pooler (`None`: a generative engine). With one, every request must
    /// be a pooling request (`PreparedRequest::with_pooling`) and gets its vector instead of
    /// tokens (`pooling.rs`); speculative decoding is refused, and so is the prefix cache
    /// with mean or CLS pooling (they read every row) or an encoder model. An encoder's
    /// prompts run whole, one step each (`SchedulerConfig::whole_prompts`, set here, with the
    /// step's token budget raised to `max_model_len` when below it).
    pub pooling: Option<PoolerConfig>,
    /// A sequence classifier's head on the pooled token (a cross-encoder reranker): each
    /// request's output is its scores, not its hidden state. Needs `pooling` unnormalised,
    /// of the last token (a decoder) or the first (an encoder, BERT's `[CLS]`).
    pub classifier: Option<Arc<Classifier>>,
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
            host_pool: HostPool::serial(),
            max_loras: None,
            pooling: None,
            classifier: None,
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
    /// The step's forward or its batch failed (its requests are to be aborted).
    #[error("forward step failed: {0}")]
    Forward(#[from] ForwardError),
    /// The second KV tier failed a copy: the step fails and the tier is turned off for good.
    #[error("KV tier: {0}; the tier is turned off, preempted requests will be recomputed")]
    KvTier(Arc<std::io::Error>),
    /// An earlier forward panicked or its thread ended with the model: every later step fails
    /// (the model's state is unknown). Holds the first error.
    #[error("the engine can no longer step: {0}")]
    Broken(Box<EngineError>),
    #[error("the engine has shut down")]
    Shutdown,
}

/// Counters after one step (gauges are as of the end of the step; totals since start).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineStats {
    pub num_running: usize,
    pub num_waiting: usize,
    /// LoRA adapters loaded, and named by running and by waiting requests.
    pub adapters: AdapterStats,
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
    /// Prefill/decode disaggregation: KV pinned, exported and imported.
    pub kv_handoff: KvHandoffStats,
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
    /// The draft model while speculation is switched off ([`EngineCore::set_speculative_config`]).
    idle_draft_model: Option<DraftProposer>,
    /// Compiles requests' structured outputs (`None`: such requests are refused).
    grammar: Option<PendingCompiler>,
    /// LoRA slots with an adapter bound ([`EngineCore::set_adapter`], `engine/adapters.rs`).
    adapters: AdapterBindings,
    /// Run once when the engine thread stops.
    shutdown_hook: Option<ShutdownHook>,
    /// What rides on the steps (`hooks.rs`): the speculator, the batch controller, the KV
    /// tier, KV events.
    hooks: Hooks,
    /// The engine's clock for deadlines (milliseconds since this instant).
    epoch: Instant,
    num_admission_demoted: u64,
    /// Runs the steps (`engine/executor.rs`; `None` only while it runs one).
    executor: Option<Box<dyn Executor>>,
    /// Whether the pipelined executor has a step in flight (the counters leave it out, and the
    /// model is away).
    step_in_flight: bool,
    /// KV pinned for decode workers ([`EngineCore::enable_kv_export`]).
    kv_pins: KvPins,
}

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
        if model.config().encoder.is_some() {
            let budget = &mut config.scheduler.max_num_batched_tokens;
            *budget = (*budget).max(max_model_len);
            config.scheduler.whole_prompts = true;
        }
        // A pooling request's one output token is never computed (`pooling.rs`): its prompt
        // may fill the whole context.
        config.scheduler.max_model_len = max_model_len + usize::from(config.pooling.is_some());
        let kv_config = KvCacheConfig {
            block_size,
            num_blocks: config.num_kv_blocks,
            enable_prefix_caching: config.scheduler.enable_prefix_caching,
            extra_keys: vec![],
        };
        let mut scheduler = Scheduler::new(config.scheduler.clone(), kv_config)
            .map_err(|e| EngineError::Config(e.0))?;
        if config.max_loras == Some(0) {
            return Err(EngineError::Config("`max_loras` must be at least 1".into()));
        }
        scheduler.set_max_loras(config.max_loras);
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
                Some(TierHook::new(tier))
            }
        };
        check_pooling(&config, bound.config())?;
        let runner = ModelRunner::new(Box::new(bound), config.seed)
            .with_eos_token_ids(&config.eos_token_ids)
            .with_host_pool(config.host_pool.clone())
            .with_pooling(config.pooling);
        let speculator = speculator_for(&config, &runner, draft_model)?;
        let executor = executor_for(&config, speculator.is_some())?;
        let slo = &config.slo;
        let controller = (slo.is_active() || config.scheduler.policy == SchedulingPolicy::Deadline)
            .then(|| SloControl {
                controller: BatchController::new(ControllerConfig {
                    target_itl: slo.target_itl_ms.map(|ms| ms / 1e3),
                    target_tpot: slo.controller_tpot_ms().map(|ms| ms / 1e3),
                    target_ttft: slo.target_ttft_ms.map(|ms| ms / 1e3),
                    ceiling: scheduler.limits(),
                }),
            });
        let mut core = Self {
            scheduler,
            runner,
            config,
            runner_output: ModelRunnerOutput::default(),
            next_id: 0,
            stats: EngineStats::default(),
            requests: RequestTable::new(),
            hooks: Hooks::for_engine(speculator, controller, tier),
            idle_draft_model: None,
            grammar: None,
            adapters: AdapterBindings::default(),
            shutdown_hook: None,
            epoch: Instant::now(),
            num_admission_demoted: 0,
            executor: Some(executor),
            step_in_flight: false,
            kv_pins: KvPins::default(),
        };
        core.refresh_stats();
        Ok(core)
    }

    /// The batch controller, for tests that teach its cost model known step times.
    #[cfg(test)]
    pub(crate) fn controller_mut(&mut self) -> Option<&mut BatchController> {
        self.hooks.get_mut::<SloControl>().map(|s| &mut s.controller)
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
        self.config.max_model_len.unwrap_or_else(|| self.scheduler.config().max_model_len)
    }

    /// A pooling model's pooler (`None`: a generative engine).
    pub fn pooling(&self) -> Option<PoolerConfig> {
        self.config.pooling
    }

    /// Whether requests get a classifier's scores (a cross-encoder) instead of hidden states.
    pub fn has_classifier(&self) -> bool {
        self.config.classifier.is_some()
    }

    /// A classifier's label names, by index (empty without one).
    pub fn classifier_labels(&self) -> &[String] {
        self.config.classifier.as_deref().map_or(&[], kiln_models::Classifier::labels)
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
        if self.step_in_flight {
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
        drop(self.hooks.take::<KvEvents>());
        self.hooks.push(Some(KvEvents::new(sink)));
    }

    /// Hands the index changes since the last call to the sink, if any (every reported step
    /// does; this is for the changes made between steps, by aborts).
    pub fn flush_kv_events(&mut self) {
        if let Some(events) = self.hooks.get_mut::<KvEvents>() {
            events.flush(&mut self.scheduler);
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

    /// Whether the pipelined executor has a step in flight (the model is away until
    /// [`EngineCore::finish_in_flight`] or the next step reports it).
    pub fn has_step_in_flight(&self) -> bool {
        self.step_in_flight
    }

    /// Whether a request is unfinished, an asynchronous step still runs, or the error of one
    /// that could not start is still to be returned.
    pub fn has_unfinished(&self) -> bool {
        self.scheduler.has_unfinished() || self.executor().has_pending()
    }

    /// Requests in the request table: unfinished ones, and finished ones whose outputs await
    /// delivery to a sink (0 when idle: nothing is left behind by a finished or aborted one).
    pub fn num_live_requests(&self) -> usize {
        self.requests.len()
    }

    /// Sends `id`'s outputs to `sink` from now on, when delivered (`engine/deliver.rs`); `false`
    /// (the sink dropped) when `id` is not held.
    pub(crate) fn set_sink(&mut self, id: RequestId, sink: OutputSink) -> bool {
        let Some(live) = self.requests.get_mut(id) else { return false };
        live.sink = Some(sink);
        true
    }

    /// Removes a request in any state and frees its blocks; `false` if unknown (finished).
    /// While an asynchronous step is in flight the request gets no more output at once, but
    /// its blocks are freed when that step ends (its KV then written, or dropped with a failed
    /// step), so no block is cached with KV that was never written.
    pub fn abort(&mut self, id: RequestId) -> bool {
        self.requests.remove(id);
        if self.step_in_flight {
            let known = self.scheduler.request(id).is_some();
            if known {
                self.executor.as_deref_mut().expect("between steps").defer_abort(id);
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
        if running {
            self.hooks.on_departure();
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
        self.hooks.report(&mut self.stats);
        self.stats.num_slo_demoted = num_demoted + self.num_admission_demoted;
        self.stats.num_running = num_running;
        self.stats.num_waiting = num_waiting;
        self.stats.adapters = self.adapter_stats();
        self.stats.kv_usage = kv_usage;
        self.stats.prefix_cache = prefix_cache;
        self.stats.num_preemptions = num_preemptions;
        self.stats.kv_handoff.pins = self.kv_pins.len();
        self.stats.kv_handoff.pinned_blocks = self.scheduler.kv_cache().num_held();
        self.stats.total_scheduled_tokens = num_scheduled_tokens;
        // With a step in flight, the steps reported so far (its own is counted when reported).
        self.stats.num_steps = num_steps - u64::from(self.step_in_flight);
    }
}

/// A pooling engine's settings that cannot work together (module docs of `pooling.rs`).
fn check_pooling(config: &EngineConfig, model: &ModelConfig) -> Result<(), EngineError> {
    let (hidden_size, encoder) = (model.hidden_size, model.encoder.is_some());
    let Some(pooler) = config.pooling else {
        if config.classifier.is_some() {
            return Err(EngineError::Config("a classifier needs a pooling engine".into()));
        }
        if encoder {
            return Err(EngineError::Config(
                "an encoder model serves pooling only (embeddings, scores): it has no LM head"
                    .into(),
            ));
        }
        return Ok(());
    };
    if encoder && config.scheduler.enable_prefix_caching {
        return Err(EngineError::Config(
            "an encoder's tokens attend to their whole sequence, so no prefix of one can be \
             reused: turn the prefix cache off (--no-enable-prefix-caching)"
                .into(),
        ));
    }
    if let Some(classifier) = &config.classifier {
        let (want, token) =
            if encoder { (PoolingType::Cls, "first") } else { (PoolingType::Last, "last") };
        if pooler.pooling != want || pooler.normalize {
            return Err(EngineError::Config(format!(
                "a sequence classifier reads the {token} token's hidden state, unnormalised"
            )));
        }
        if classifier.width() != hidden_size {
            return Err(EngineError::Config(format!(
                "the classifier's rows have {} values; the model's hidden size is {hidden_size}",
                classifier.width()
            )));
        }
    }
    if config.speculative.is_some() {
        return Err(EngineError::Config("a pooling model runs no speculative decoding".into()));
    }
    if pooler.pooling != PoolingType::Last && config.scheduler.enable_prefix_caching {
        return Err(EngineError::Config(format!(
            "{} pooling reads every token's hidden state, which a prefix-cache hit skips: turn \
             the prefix cache off (--no-enable-prefix-caching)",
            pooler.pooling.as_str()
        )));
    }
    Ok(())
}
