//! `kiln serve`: the OpenAI-compatible server. The port is bound first (so a busy port fails at
//! once); the model loads on a background thread while `/health` answers 503; SIGINT / SIGTERM
//! drain in-flight requests for up to `--shutdown-timeout` seconds, then exit 0.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kiln_core::TokenId;
use kiln_engine::{EngineConfig, EngineCore, SchedulerConfig};
use kiln_models::{Architecture, LoadedModel};
use kiln_server::chat_template::BuiltinTemplate;
use kiln_server::{ServedModel, ServerConfig, ServerState};

use crate::engine_args::EngineArgs;
use crate::kv_args::{Bytes, KvCacheArgs, available_memory};
use crate::model_arg::ModelArgs;

/// KV cache cap when no sizing flag is given: half the free RAM, at most this.
const DEFAULT_KV_CACHE_CAP_BYTES: u64 = 4 << 30;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Names clients may send as `model` (repeatable); default: the --model value.
    #[arg(long)]
    served_model_name: Vec<String>,
    /// A Jinja chat template file, used instead of the model's own.
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Require `Authorization: Bearer KEY` on /v1/* endpoints.
    #[arg(long, env = "KILN_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Requests waiting for their first token beyond which new ones get 429.
    #[arg(long, default_value_t = 1024)]
    max_queued_requests: usize,
    /// Most log-probabilities per token a request may ask for.
    #[arg(long, default_value_t = 20)]
    max_logprobs: usize,
    /// Seconds SIGTERM / SIGINT wait for in-flight requests before aborting them.
    #[arg(long, default_value_t = 30)]
    shutdown_timeout: u64,
    /// Do not log a line per finished request.
    #[arg(long)]
    disable_log_requests: bool,
    /// Largest request body (e.g. 4MiB).
    #[arg(long, default_value = "4MiB")]
    max_body_bytes: Bytes,
    #[command(flatten)]
    engine: EngineArgs,
    /// Seed of requests that give none.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// KV cache sizing; default: half the free RAM after the weights, at most 4 GiB.
    #[command(flatten)]
    kv: KvCacheArgs,
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
    let names = if args.served_model_name.is_empty() {
        vec![args.model.model.clone()]
    } else {
        args.served_model_name.clone()
    };
    let config = ServerConfig {
        served_model_names: names,
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        max_queued_requests: args.max_queued_requests,
        max_logprobs: args.max_logprobs,
        shutdown_timeout: Duration::from_secs(args.shutdown_timeout),
        disable_log_requests: args.disable_log_requests,
        max_body_bytes: usize::try_from(args.max_body_bytes.0).unwrap_or(usize::MAX),
        keep_alive: Duration::from_secs(15),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let address = format!("{}:{}", args.host, args.port);
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(&address))
        .with_context(|| format!("listening on {address}"))?;
    let state = ServerState::new(config);
    let bound = listener.local_addr().map_or(address, |a| a.to_string());
    tracing::info!("listening on http://{bound} (the model is loading)");
    let (load_tx, load_rx) = tokio::sync::oneshot::channel();
    {
        let state = Arc::clone(&state);
        let args = args_for_loading(args);
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
        let server =
            tokio::spawn(kiln_server::serve(listener, Arc::clone(&state), shutdown_signal()));
        match load_rx.await {
            Ok(Ok(())) => {
                tracing::info!("ready: serving {:?}", shutdown_state.config.served_model_names);
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
        tracing::info!("shut down");
        Ok(())
    })
}

/// What the loader thread needs (the args are not `Send`-bound to the runtime).
struct LoadArgs {
    model: ModelArgs,
    chat_template: Option<PathBuf>,
    kv: KvCacheArgs,
    scheduler: SchedulerConfig,
    kv_cache_dtype: kiln_engine::KvCacheDtype,
    threads: usize,
    seed: u64,
}

fn args_for_loading(args: &ServeArgs) -> LoadArgs {
    LoadArgs {
        model: args.model.clone(),
        chat_template: args.chat_template.clone(),
        kv: args.kv.clone(),
        scheduler: args.engine.scheduler_config(!args.kv.no_enable_prefix_caching),
        kv_cache_dtype: args.engine.kv_cache_dtype,
        threads: args.engine.threads,
        seed: args.seed,
    }
}

fn load(state: &ServerState, args: &LoadArgs) -> anyhow::Result<()> {
    let loaded = args.model.load(args.threads)?;
    let model = &loaded.model;
    let block_size = args.kv.block_size;
    let bytes_per_block = model.kv_layout().bytes_per_token(args.kv_cache_dtype) * block_size;
    let weight_bytes = model.weight_bytes() as u64;
    let free = available_memory().map(|a| a.saturating_sub(weight_bytes));
    let default_bytes =
        free.map_or(DEFAULT_KV_CACHE_CAP_BYTES, |f| (f / 2).min(DEFAULT_KV_CACHE_CAP_BYTES));
    let default_blocks = usize::try_from(default_bytes / bytes_per_block.max(1) as u64)?;
    let model_max = model.config().max_position_embeddings;
    let max_model_len =
        args.kv.max_model_len.unwrap_or_else(|| model_max.min(default_blocks.max(1) * block_size));
    let sizing = args.kv.resolve(bytes_per_block, max_model_len, || free, default_blocks)?;
    tracing::info!("{}", sizing.describe(block_size, max_model_len));
    let builtin_template = builtin_template(model.config().architecture);
    let LoadedModel { model, tokenizer, generation_defaults } = loaded;
    let engine = EngineConfig {
        block_size,
        num_kv_blocks: sizing.num_blocks,
        max_model_len: Some(max_model_len),
        scheduler: args.scheduler.clone(),
        seed: args.seed,
        eos_token_ids: tokenizer.eos_token_ids().iter().map(|&t| TokenId(t)).collect(),
        kv_cache_dtype: args.kv_cache_dtype,
    };
    let core = EngineCore::new(model, engine)?;
    let served = ServedModel { core, tokenizer, generation_defaults, builtin_template };
    let ready = kiln_server::load(&state.config, served, args.chat_template.as_deref())
        .map_err(|e| anyhow::anyhow!(e))?;
    tracing::info!("chat template: {}", ready.template.source_name());
    state.set_loaded(ready);
    Ok(())
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
