//! `kiln serve`: the OpenAI-compatible server. The port is bound first (so a busy port fails at
//! once); the model loads on a background thread while `/health` answers 503; SIGINT / SIGTERM
//! drain in-flight requests for up to `--shutdown-timeout` seconds, then exit 0.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use kiln_core::TokenId;
use kiln_engine::{EngineConfig, EngineCore, SchedulerConfig};
use kiln_models::{Architecture, LoadedModel, MoeConfig, load_tokenizer};
use kiln_server::chat_template::{BuiltinTemplate, TemplateOverride};
use kiln_server::kv_events::KvEventsConfig;
use kiln_server::metrics::{CacheConfigInfo, ModelConfigInfo};
use kiln_server::state::Loaded;
use kiln_server::{ConnectionLimits, ServedModel, ServerConfig, ServerState, warmup};

use crate::args::vllm::VllmServeArgs;
use crate::device::{Device, DeviceArgs};
use crate::engine_args::EngineArgs;
use crate::kv_args::{Bytes, HumanCount, KvCacheArgs, available_memory};
use crate::model_arg::{DraftModel, ModelArgs};
use crate::pooling_args::PoolingArgs;

#[cfg(test)]
#[path = "args/command_lines.rs"]
mod command_lines;

/// KV cache cap when no sizing flag is given: half the free RAM, at most this.
const DEFAULT_KV_CACHE_CAP_BYTES: u64 = 4 << 30;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    device: DeviceArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Names clients may send as `model` (one or more); default: the model as given.
    #[arg(long, num_args = 1..)]
    served_model_name: Vec<String>,
    /// A Jinja chat template, used instead of the model's own: a file, or the template text.
    #[arg(long)]
    chat_template: Option<String>,
    /// How tool calls are read out of the model's text (`tool_choice: "auto"`): hermes (Qwen
    /// 2.5 / 3), llama3_json, mistral, pythonic or gemma3 (Gemma 3, Llama 4).
    #[arg(long, value_parser = parse_tool_call_parser)]
    tool_call_parser: Option<kiln_server::tools::ToolCallParser>,
    /// Let the model decide when to call tools (`tool_choice: "auto"`, the default of requests
    /// with `tools`); needs --tool-call-parser.
    #[arg(long)]
    enable_auto_tool_choice: bool,
    /// Split a reasoning model's thinking (`<think>…</think>`) from its answer:
    /// `reasoning_content` on chat, `thinking` blocks on /v1/messages, reasoning items on
    /// /v1/responses; tool calls and
    /// structured outputs apply to the answer. qwen3 (Qwen3, QwQ) or deepseek_r1 (DeepSeek-R1
    /// and its distills).
    #[arg(long, value_parser = parse_reasoning_parser)]
    reasoning_parser: Option<kiln_server::reasoning::ReasoningParser>,
    /// Require `Authorization: Bearer KEY` on /v1/* endpoints (any of the keys given).
    #[arg(long, num_args = 1.., env = "KILN_API_KEY", hide_env_values = true)]
    api_key: Vec<String>,
    /// Requests waiting for their first token beyond which new ones get 429.
    #[arg(long, default_value_t = 1024)]
    max_queued_requests: usize,
    /// Most log-probabilities per token a request may ask for.
    #[arg(long, default_value_t = 20)]
    max_logprobs: usize,
    /// Publish the prefix cache's events (blocks stored and removed) for cache-aware routers
    /// such as `vllm-router --policy kv_aware`, as vLLM's JSON, e.g. `{"enable_kv_cache_events":
    /// true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint":
    /// "tcp://*:5558"}` (docs/DEPLOYMENT.md).
    #[arg(long)]
    kv_events_config: Option<String>,
    /// Seconds SIGTERM / SIGINT wait for in-flight requests before aborting them.
    #[arg(long, default_value_t = 30)]
    shutdown_timeout: u64,
    /// Do not log a line per finished request (the default; see --enable-log-requests).
    #[arg(long)]
    disable_log_requests: bool,
    /// Largest request body (e.g. 4MiB); a larger declared Content-Length gets 413 at once.
    #[arg(long, default_value = "4MiB")]
    max_body_bytes: Bytes,
    /// Responses of /v1/responses kept for `GET /v1/responses/{id}` and
    /// `previous_response_id`, in memory, the oldest dropped first (0: none are kept, and
    /// responses say `store: false`).
    #[arg(long, default_value_t = 1024)]
    max_stored_responses: usize,
    /// Memory the stored responses (and the conversations they continue) may take.
    #[arg(long, default_value = "128MiB")]
    responses_store_bytes: Bytes,
    /// `max_tokens` of requests that give none (default: what is left of the context).
    #[arg(long)]
    max_tokens_default: Option<usize>,
    /// Most tokens one request may ask to generate (more: 400 on `max_tokens`).
    #[arg(long)]
    max_tokens_cap: Option<usize>,
    /// Parse JSON bodies whatever their Content-Type (default: anything but
    /// application/json gets 415, so web pages cannot post without a CORS preflight).
    #[arg(long)]
    allow_any_content_type: bool,
    /// Origins allowed to call the API from a browser (CORS; `*` for any), comma-separated
    /// or as vLLM's JSON list (`'["http://a.example"]'`). Default: none (CORS off).
    #[arg(long)]
    allowed_origins: Option<String>,
    /// Most client connections served at once; more get only /health and /metrics (a reserve
    /// of 16), then are closed at once.
    #[arg(long, default_value_t = 512)]
    max_connections: usize,
    /// Seconds a client may take to send a request's headers.
    #[arg(long, default_value_t = 10.0)]
    header_read_timeout: f64,
    /// Seconds a client may take to send a request's body.
    #[arg(long, default_value_t = 30.0)]
    body_read_timeout: f64,
    /// Seconds an idle keep-alive connection is kept open.
    #[arg(long, default_value_t = 60.0)]
    idle_timeout: f64,
    /// Save the prefix cache in DIR when the server stops and restore it at start, so a
    /// restarted server hits the prefixes it had computed (keyed by the model's files, the KV
    /// dtype and the block size; a foreign or damaged file is refused with a log line).
    #[arg(long, value_name = "DIR")]
    prefix_cache_dir: Option<PathBuf>,
    /// Prompts to prefill before /health turns 200, so the first requests that share their
    /// prefixes (a long system prompt) hit the cache. JSON Lines: per line a prompt string,
    /// or an object as /tokenize takes it ({"prompt": ...} or {"messages": [...]}).
    #[arg(long, value_name = "FILE")]
    warmup_prompts: Option<PathBuf>,
    #[command(flatten)]
    engine: EngineArgs,
    /// Seed of requests that give none.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// KV cache sizing; default: half the free RAM after the weights, at most 4 GiB.
    #[command(flatten)]
    kv: KvCacheArgs,
    #[command(flatten)]
    lora: crate::lora_args::LoraArgs,
    #[command(flatten)]
    pooling: PoolingArgs,
    #[command(flatten)]
    kv_transfer: crate::kv_transfer_args::KvTransferArgs,
    #[command(flatten)]
    vllm: VllmServeArgs,
}

pub fn run(args: &ServeArgs) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let config = server_config(args)?;
    let stats_interval = args.vllm.stats_interval()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let address = format!("{}:{}", args.host, args.port);
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(&address))
        .with_context(|| format!("listening on {address}"))?;
    let chat_template = args
        .chat_template
        .as_deref()
        .map(TemplateOverride::from_arg)
        .transpose()
        .map_err(|e| anyhow::anyhow!("--chat-template: {e}"))?;
    let warmup_prompts = warmup_prompts(args)?;
    let load_args = args_for_loading(args, chat_template)?;
    let state = ServerState::new(config);
    let bound = listener.local_addr().map_or(address, |a| a.to_string());
    tracing::info!("listening on http://{bound} (the model is loading)");
    let (load_tx, load_rx) = tokio::sync::oneshot::channel();
    {
        let state = Arc::clone(&state);
        let args = load_args;
        std::thread::Builder::new()
            .name("kiln-load".into())
            .spawn(move || {
                let result = load(&state, &args);
                let _ = load_tx.send(result);
            })
            .context("starting the loader thread")?;
    }
    runtime.block_on(async move {
        let shutdown_state = Arc::clone(&state);
        let mut server =
            tokio::spawn(kiln_server::serve(listener, Arc::clone(&state), shutdown_signal()));
        // A shutdown signal while the model loads or warms up ends the server (nothing is
        // being served yet, so it drains at once): stop there, without waiting for either.
        let loaded = tokio::select! {
            loaded = load_rx => loaded,
            served = &mut server => {
                tracing::info!("shut down while the model was loading");
                return served.context("server task")?.context("serving");
            }
        };
        match loaded {
            Ok(Ok(ready)) => {
                let ready = Arc::new(ready);
                if let Some(prompts) = warmup_prompts {
                    let warmed = tokio::select! {
                        warmed = warm_up(&ready, prompts) => warmed,
                        served = &mut server => {
                            // The warm-up's streams end when the engine stops.
                            let engine = Arc::clone(&ready);
                            tokio::task::spawn_blocking(move || engine.engine.stop())
                                .await
                                .context("stopping the engine")?;
                            tracing::info!("shut down during the warm-up (warm-up stopped)");
                            return served.context("server task")?.context("serving");
                        }
                    };
                    if let Err(e) = warmed {
                        server.abort();
                        ready.engine.stop();
                        return Err(e);
                    }
                }
                shutdown_state.set_loaded_shared(ready);
                tracing::info!("ready: serving {:?}", shutdown_state.config.served_model_names);
                if let Some(interval) = stats_interval {
                    tokio::spawn(kiln_server::stats_log::run(Arc::clone(&state), interval));
                }
            }
            Ok(Err(e)) => {
                server.abort();
                return Err(e);
            }
            Err(_) => {
                server.abort();
                anyhow::bail!("the loader thread died");
            }
        }
        server.await.context("server task")?.context("serving")?;
        // Drained: the engine stops (and saves the prefix cache when asked to).
        let engine_state = Arc::clone(&shutdown_state);
        tokio::task::spawn_blocking(move || engine_state.stop_engine())
            .await
            .context("stopping the engine")?;
        tracing::info!("shut down");
        Ok(())
    })
}

/// The server's settings from the command line.
fn server_config(args: &ServeArgs) -> anyhow::Result<ServerConfig> {
    let names = if args.served_model_name.is_empty() {
        vec![args.model.spec()?.to_owned()]
    } else {
        args.served_model_name.clone()
    };
    let lora = args.lora.settings(&names)?;
    let api_keys: Vec<String> = args.api_key.iter().filter(|k| !k.is_empty()).cloned().collect();
    Ok(ServerConfig {
        lora,
        served_model_names: names,
        kv_transfer: args.kv_transfer.config(&api_keys)?,
        api_keys,
        max_queued_requests: args.max_queued_requests,
        max_logprobs: args.max_logprobs,
        shutdown_timeout: Duration::from_secs(args.shutdown_timeout),
        disable_log_requests: args.disable_log_requests || !args.vllm.enable_log_requests,
        max_body_bytes: usize::try_from(args.max_body_bytes.0).unwrap_or(usize::MAX),
        keep_alive: Duration::from_secs(15),
        max_tokens_default: args.max_tokens_default,
        max_tokens_cap: args.max_tokens_cap,
        allow_any_content_type: args.allow_any_content_type,
        allowed_origins: parse_origins(args.allowed_origins.as_deref())?,
        connections: ConnectionLimits {
            max_connections: args.max_connections,
            header_read_timeout: seconds("--header-read-timeout", args.header_read_timeout)?,
            body_read_timeout: seconds("--body-read-timeout", args.body_read_timeout)?,
            idle_timeout: seconds("--idle-timeout", args.idle_timeout)?,
            ..ConnectionLimits::default()
        },
        metrics_prefix: args.vllm.metrics_prefix.clone(),
        kv_events: match &args.kv_events_config {
            Some(json) => KvEventsConfig::parse(json).map_err(anyhow::Error::msg)?,
            None => None,
        },
        tools: tool_settings(args)?,
        reasoning_parser: args.reasoning_parser,
        responses_store: kiln_server::responses::store::StoreLimits {
            max_responses: args.max_stored_responses,
            max_bytes: usize::try_from(args.responses_store_bytes.0).unwrap_or(usize::MAX),
        },
    })
}

/// The checked lines of `--warmup-prompts` (read before the model loads, so a bad file stops
/// the start at once), and the flags `--prefix-cache-dir` needs.
fn warmup_prompts(args: &ServeArgs) -> anyhow::Result<Option<Vec<warmup::WarmupPrompt>>> {
    if args.prefix_cache_dir.is_some() && args.kv.no_enable_prefix_caching {
        anyhow::bail!("--prefix-cache-dir needs prefix caching (drop --no-enable-prefix-caching)");
    }
    let Some(path) = args.warmup_prompts.as_deref() else { return Ok(None) };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--warmup-prompts: reading {}", path.display()))?;
    let prompts = warmup::parse(&text)
        .map_err(|e| anyhow::anyhow!("--warmup-prompts {}: {e}", path.display()))?;
    Ok(Some(prompts))
}

/// Prefills the warm-up prompts before the server turns ready.
async fn warm_up(ready: &Arc<Loaded>, prompts: Vec<warmup::WarmupPrompt>) -> anyhow::Result<()> {
    let start = Instant::now();
    tracing::info!("warm-up: prefilling {} prompts", prompts.len());
    let s =
        warmup::run(ready, prompts).await.map_err(|e| anyhow::anyhow!("--warmup-prompts: {e}"))?;
    tracing::info!(
        "warm-up: prefilled {} prompts ({} tokens) in {:.2} s",
        s.prompts,
        s.tokens,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `--allowed-origins`: a JSON list of strings (vLLM's form) or a comma-separated list.
fn parse_origins(value: Option<&str>) -> anyhow::Result<Vec<String>> {
    let Some(value) = value.map(str::trim) else { return Ok(Vec::new()) };
    if value.starts_with('[') {
        return serde_json::from_str(value)
            .with_context(|| format!("--allowed-origins {value}: not a JSON list of strings"));
    }
    Ok(value.split(',').map(str::trim).filter(|o| !o.is_empty()).map(String::from).collect())
}

/// A positive, finite number of seconds given to `flag`.
fn seconds(flag: &str, value: f64) -> anyhow::Result<Duration> {
    anyhow::ensure!(
        value.is_finite() && value > 0.0 && value < 1e9,
        "{flag} must be a positive number of seconds, got {value}"
    );
    Ok(Duration::from_secs_f64(value))
}

/// What the loader thread needs (the args are not `Send`-bound to the runtime).
struct LoadArgs {
    model: ModelArgs,
    device: DeviceArgs,
    /// `--tokenizer`, as a model to take the tokenizer of.
    tokenizer: Option<ModelArgs>,
    vllm: VllmServeArgs,
    chat_template: Option<TemplateOverride>,
    kv: KvCacheArgs,
    scheduler: SchedulerConfig,
    kv_cache_dtype: kiln_engine::KvCacheDtype,
    threads: usize,
    seed: u64,
    speculative: Option<kiln_engine::SpeculativeConfig>,
    slo: kiln_engine::SloConfig,
    async_scheduling: bool,
    prefix_cache_dir: Option<PathBuf>,
    /// `--max-loras`.
    max_loras: Option<usize>,
    /// `--runner` and the pooler flags.
    pooling: PoolingArgs,
}

fn args_for_loading(
    args: &ServeArgs,
    chat_template: Option<TemplateOverride>,
) -> anyhow::Result<LoadArgs> {
    let tokenizer = args.vllm.tokenizer.as_ref().map(|t| ModelArgs {
        download_dir: args.model.download_dir.clone(),
        ..ModelArgs::named(t)
    });
    Ok(LoadArgs {
        model: args.model.clone(),
        device: args.device.clone(),
        tokenizer,
        vllm: args.vllm.clone(),
        chat_template,
        kv: args.kv.clone(),
        scheduler: args.engine.scheduler_config(!args.kv.no_enable_prefix_caching),
        kv_cache_dtype: args.engine.kv_cache_dtype,
        threads: args.engine.threads,
        seed: args.seed,
        speculative: args.engine.speculative_config.clone(),
        slo: args.engine.slo_config()?,
        async_scheduling: args.engine.async_scheduling,
        prefix_cache_dir: args.prefix_cache_dir.clone(),
        max_loras: args.lora.max_loras,
        pooling: args.pooling.clone(),
    })
}

/// Loads the model and starts the engine (restoring a saved prefix cache first); the caller
/// makes the server ready.
fn load(state: &ServerState, args: &LoadArgs) -> anyhow::Result<Loaded> {
    let model_path = args.model.resolve()?;
    let pooler = args.pooling.resolve(&model_path)?;
    let model_args = ModelArgs { pooling: pooler.is_some(), ..args.model.clone() };
    match args.device.device {
        Device::Cpu => {
            args.device.gpu_utilization()?; // a bad value is an error everywhere
            args.device.warn_on_cpu();
            if !args
                .model
                .quantization
                .is_some_and(crate::model_arg::Quantization::converts_weights)
            {
                let needed = crate::memory_fit::weight_file_bytes(&model_path)?;
                crate::memory_fit::check_fits(needed, available_memory(), &model_path)?;
            }
            let backend = crate::model_arg::cpu_backend(args.threads, args.model.dtype);
            let loaded = model_args.load_path_on(&model_path, &backend)?;
            let draft = args.model.load_draft_on(args.speculative.as_ref(), &backend, &loaded)?;
            let weight_bytes = (loaded.model.weight_bytes()
                + draft.as_ref().map_or(0, |d| d.weight_bytes()))
                as u64;
            let free = available_memory().map(|a| a.saturating_sub(weight_bytes));
            let default_bytes = free
                .map_or(DEFAULT_KV_CACHE_CAP_BYTES, |f| (f / 2).min(DEFAULT_KV_CACHE_CAP_BYTES));
            let host_pool = crate::model_arg::cpu_host_pool(&*loaded.model);
            let model = (model_path.as_path(), pooler);
            start(state, args, model, (loaded, draft), host_pool, free, default_bytes)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => {
            if let Some(w) = args.model.dtype.cuda_warning() {
                tracing::warn!("{w}");
            }
            let shape = crate::device::cuda::ProfileShape {
                max_num_batched_tokens: args.scheduler.max_num_batched_tokens,
                max_num_seqs: args.scheduler.max_num_seqs,
                block_size: args.kv.block_size(false),
                kv_cache_dtype: args.kv_cache_dtype,
            };
            if args.speculative.as_ref().is_some_and(|s| s.draft_model_name().is_some()) {
                anyhow::bail!(
                    "--speculative-config: draft models run on the CPU only for now; with \
                     --device cuda use method \"ngram\""
                );
            }
            if pooler.is_some() {
                anyhow::bail!("pooling models (embeddings) run on the CPU only for now");
            }
            let utilization = args.device.gpu_utilization()?;
            let (loaded, kv_bytes) = crate::device::cuda::load(
                &args.model,
                &model_path,
                ordinal,
                utilization,
                args.device.enforce_eager,
                &shape,
            )?;
            let host_pool = crate::device::cuda::host_pool(args.threads);
            let model = (model_path.as_path(), None);
            start(state, args, model, (loaded, None), host_pool, Some(kv_bytes), kv_bytes)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => anyhow::bail!(
            "--device cuda: this kiln was built without CUDA; build it with \
             `cargo build --release --features cuda`"
        ),
    }
}

/// Starts the engine on `loaded` (and its draft model), from `model_path`, with a pooling
/// model's pooler: `free` is the memory the KV cache may take (for `--memory-utilization`),
/// `default_bytes` its size when no flag says. A draft model's cache has as many blocks as
/// the target's, so a block costs both.
fn start<B: kiln_models::Backend>(
    state: &ServerState,
    args: &LoadArgs,
    (model_path, pooler): (&std::path::Path, Option<kiln_engine::PoolerConfig>),
    (loaded, draft): (LoadedModel<B>, Option<DraftModel<B>>),
    host_pool: kiln_engine::HostPool,
    free: Option<u64>,
    default_bytes: u64,
) -> anyhow::Result<Loaded> {
    let model = &loaded.model;
    let encoder = model.config().encoder.is_some();
    let block_size = args.kv.block_size(encoder);
    let draft_bytes_per_token =
        draft.as_ref().map_or(0, |d| d.kv_layout().bytes_per_token(args.kv_cache_dtype));
    let bytes_per_block = (model.kv_layout().bytes_per_token(args.kv_cache_dtype)
        + draft_bytes_per_token)
        * block_size;
    let default_blocks = usize::try_from(default_bytes / bytes_per_block.max(1) as u64)?;
    let model_max = model.config().max_position_embeddings;
    let max_model_len = args
        .kv
        .max_model_len
        .map_or_else(|| model_max.min(default_blocks.max(1) * block_size), HumanCount::as_usize);
    let sizing =
        args.kv.resolve((block_size, bytes_per_block), max_model_len, || free, default_blocks)?;
    tracing::info!(
        "{} ({} elements)",
        sizing.describe(block_size, max_model_len),
        args.kv_cache_dtype.name()
    );
    let builtin_template = builtin_template(model.config().architecture);
    warn_on_raw_harmony(state, model.config().architecture);
    let experts = model.config().moe.as_ref();
    let model_info = ModelConfigInfo {
        architecture: format!("{:?}", model.config().architecture),
        weight_bytes: model.weight_bytes() as u64,
        active_weight_bytes: model.active_weight_bytes() as u64,
        num_experts: experts.map_or(0, |m| m.num_experts),
        num_experts_per_tok: experts.map_or(0, |m| m.experts_per_token),
        num_sparse_layers: experts.map_or(0, MoeConfig::num_sparse_layers),
    };
    let LoadedModel { model, mut tokenizer, generation_defaults, classifier } = loaded;
    let classifier = served_classifier(classifier);
    if let Some(spec) = &args.tokenizer {
        let path = spec.resolve()?;
        tokenizer = load_tokenizer(&path)
            .with_context(|| format!("--tokenizer: loading {}", path.display()))?;
    }
    let generation_defaults = args.vllm.generation_defaults(generation_defaults)?;
    let scheduler = scheduler_for_pooling(args, pooler, (classifier.is_some(), encoder))?;
    let mut engine = EngineConfig {
        block_size,
        num_kv_blocks: sizing.num_blocks,
        max_model_len: Some(max_model_len),
        scheduler: scheduler.clone(),
        seed: args.seed,
        eos_token_ids: tokenizer.eos_token_ids().iter().map(|&t| TokenId(t)).collect(),
        kv_cache_dtype: args.kv_cache_dtype,
        speculative: args.speculative.clone(),
        slo: args.slo.clone(),
        async_scheduling: args.async_scheduling,
        host_pool,
        max_loras: args.max_loras,
        pooling: pooler,
        classifier,
        ..EngineConfig::default()
    };
    args.kv.apply_tier(&mut engine)?;
    let (tier, preemption_mode) = (engine.kv_tier.clone(), engine.preemption_mode);
    let mut core = EngineCore::with_draft_model(model, draft, engine)?;
    log_engine_setup(&core, args.async_scheduling, tier.as_ref(), preemption_mode);
    if let Some(dir) = &args.prefix_cache_dir {
        crate::prefix_persist::restore_and_save_on_stop(&mut core, dir, model_path)?;
    }
    let model_fingerprint = match &state.config.kv_transfer {
        Some(_) => Some(crate::prefix_persist::model_fingerprint(model_path)?),
        None => None,
    };
    let served =
        ServedModel { core, tokenizer, generation_defaults, builtin_template, model_fingerprint };
    let ready = kiln_server::load(&state.config, served, args.chat_template.as_ref())
        .map_err(|e| anyhow::anyhow!(e))?;
    // An encoder embeds text, never chat.
    (!encoder).then(|| tracing::info!("chat template: {}", ready.template.source_name()));
    ready.metrics.set_cache_config(&CacheConfigInfo {
        block_size,
        cache_dtype: args.kv_cache_dtype.name().to_owned(),
        enable_prefix_caching: scheduler.enable_prefix_caching,
        num_blocks: sizing.num_blocks,
    });
    ready.metrics.set_model_config(&model_info);
    Ok(ready)
}

/// Says how steps run: asynchronous scheduling, and the KV tier.
fn log_engine_setup(
    core: &EngineCore,
    async_scheduling: bool,
    tier: Option<&kiln_engine::KvTierConfig>,
    preemption_mode: impl std::fmt::Display,
) {
    if async_scheduling {
        tracing::info!(
            "asynchronous scheduling: each step's forward runs on its own thread while the \
             engine plans the next step and hands out the step before's tokens{}",
            if tier.is_some() {
                " (with the KV tier, each step is planned after the step before is applied)"
            } else {
                ""
            }
        );
    }
    if let Some(tier) = tier {
        let where_ = match &tier.location {
            kiln_engine::KvTierLocation::Memory => "host memory".to_owned(),
            kiln_engine::KvTierLocation::Directory(dir) => format!("a file in {}", dir.display()),
        };
        tracing::info!(
            "KV tier: {} blocks in {where_} ({:.1} MiB); preemption mode {preemption_mode}",
            core.stats().swap.num_slots,
            tier.bytes as f64 / f64::from(1 << 20),
        );
    }
}

/// A sequence classifier's head as served: one label is a cross-encoder's score (`/score`,
/// `/rerank`), any number of labels a classification (`/classify`).
fn served_classifier(
    classifier: Option<kiln_engine::Classifier>,
) -> Option<Arc<kiln_engine::Classifier>> {
    if let Some(c) = &classifier {
        let use_ = if c.num_labels() == 1 { "/score, /rerank and /classify" } else { "/classify" };
        tracing::info!("a sequence classifier of {} labels: {use_}", c.num_labels());
    }
    classifier.map(Arc::new)
}

/// The scheduler's settings for the model (and what it serves, logged): a pooling model with
/// mean or CLS pooling reads every token's hidden state, and an encoder's tokens see their
/// whole sequence, so neither keeps a prefix cache (a hit would skip rows, or reuse K/V that
/// depends on what follows).
fn scheduler_for_pooling(
    args: &LoadArgs,
    pooler: Option<kiln_engine::PoolerConfig>,
    (cross_encoder, encoder): (bool, bool),
) -> anyhow::Result<SchedulerConfig> {
    let mut scheduler = args.scheduler.clone();
    let Some(pooler) = pooler else { return Ok(scheduler) };
    if cross_encoder {
        tracing::info!("cross-encoder: scores of text pairs on /score and /rerank");
    } else {
        let normalized = if pooler.normalize { "normalised" } else { "not normalised" };
        tracing::info!(
            "pooling model: {} pooling, {normalized}; serving /v1/embeddings, /pooling, \
             /score and /rerank (cosine)",
            pooler.pooling.as_str()
        );
    }
    let why = if encoder {
        "an encoder's tokens attend to their whole sequence".to_string()
    } else {
        format!("{} pooling reads every token's hidden state", pooler.pooling.as_str())
    };
    if (encoder || pooler.pooling != kiln_engine::PoolingType::Last)
        && scheduler.enable_prefix_caching
    {
        if args.prefix_cache_dir.is_some() || args.kv.enable_prefix_caching {
            anyhow::bail!(
                "{why}, so the prefix cache cannot serve it: drop --enable-prefix-caching / \
                 --prefix-cache-dir"
            );
        }
        tracing::info!("prefix caching is off: {why}");
        scheduler.enable_prefix_caching = false;
    }
    Ok(scheduler)
}

/// gpt-oss writes its thinking and calls as harmony messages: without the parsers that read
/// them, clients get the raw channels as text.
fn warn_on_raw_harmony(state: &ServerState, architecture: Architecture) {
    if architecture != Architecture::GptOss {
        return;
    }
    if state.config.reasoning_parser.is_none() {
        tracing::warn!(
            "gpt-oss answers in harmony channels: without --reasoning-parser openai_gptoss its \
             thinking and headers stay in the content"
        );
    }
    if state.config.tools.parser.is_none() {
        tracing::warn!(
            "gpt-oss calls tools in harmony messages: `tool_choice: \"auto\"` needs \
             --enable-auto-tool-choice --tool-call-parser openai"
        );
    }
}

/// The chat template kiln ships for a model family, for models that carry none.
fn builtin_template(architecture: Architecture) -> Option<BuiltinTemplate> {
    match architecture {
        Architecture::Gemma3 => Some(BuiltinTemplate::Gemma3),
        _ => None,
    }
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
    tracing::info!("shutdown signal received");
}

fn parse_tool_call_parser(name: &str) -> Result<kiln_server::tools::ToolCallParser, String> {
    kiln_server::tools::ToolCallParser::from_name(name).ok_or_else(|| {
        format!(
            "unknown tool-call parser {name:?} (known: {})",
            kiln_server::tools::ToolCallParser::NAMES
        )
    })
}

fn parse_reasoning_parser(name: &str) -> Result<kiln_server::reasoning::ReasoningParser, String> {
    kiln_server::reasoning::ReasoningParser::from_name(name).ok_or_else(|| {
        format!(
            "unknown reasoning parser {name:?} (known: {})",
            kiln_server::reasoning::ReasoningParser::NAMES
        )
    })
}

/// `--tool-call-parser` and `--enable-auto-tool-choice` (which needs a parser, as in vLLM).
fn tool_settings(args: &ServeArgs) -> anyhow::Result<kiln_server::tools::ToolSettings> {
    if args.enable_auto_tool_choice && args.tool_call_parser.is_none() {
        anyhow::bail!(
            "--enable-auto-tool-choice needs --tool-call-parser ({})",
            kiln_server::tools::ToolCallParser::NAMES
        );
    }
    Ok(kiln_server::tools::ToolSettings {
        parser: args.tool_call_parser,
        auto_tool_choice: args.enable_auto_tool_choice,
    })
}

#[cfg(test)]
mod tests {
    use super::parse_origins;

    #[test]
    fn allowed_origins_as_list_or_json() {
        assert!(parse_origins(None).unwrap().is_empty());
        assert_eq!(parse_origins(Some("http://a, http://b")).unwrap(), ["http://a", "http://b"]);
        assert_eq!(parse_origins(Some(r#"["*"]"#)).unwrap(), ["*"]);
        assert!(parse_origins(Some("[1]")).is_err());
    }
}
