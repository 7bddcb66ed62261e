//! kiln's OpenAI-compatible HTTP server: `/v1/completions`, `/v1/chat/completions`,
//! OpenAI's `/v1/responses` (and `GET` / `DELETE /v1/responses/{id}`,
//! `/v1/responses/{id}/cancel`), Anthropic's `/v1/messages` (and
//! `/v1/messages/count_tokens`), `/v1/models` (and
//! `/v1/models/{id}`), `/health`, `/metrics`, `/tokenize`, `/detokenize`, `/version`.
//!
//! The server runs on tokio and axum; the engine runs on its own thread behind
//! [`kiln_engine::EngineHandle`], which the server reaches with non-blocking submissions whose
//! outputs come back through per-request channels. Nothing below this crate uses tokio, axum or
//! serde_json.
//!
//! Lifecycle: [`ServerState`] exists before the model does, so `/health` answers 503 while the
//! model loads; [`ServerState::set_loaded`] makes it ready. [`serve`] runs until its shutdown
//! future resolves, then drains: it refuses new requests (503), lets in-flight ones finish for
//! up to `shutdown_timeout`, and drops (so aborts) whatever is left.

pub mod anthropic;
pub mod auth;
pub mod chat_template;
pub mod closed_schema;
pub mod config;
pub mod conn;
pub mod cors;
pub mod error;
pub mod extract;
pub mod generate;
pub mod harmony;
pub mod kv_events;
pub mod kv_transfer;
pub mod lora;
pub mod metrics;
pub mod protocol;
pub mod reasoning;
pub mod request_fields;
pub mod request_limits;
pub mod responses;
pub mod routes;
pub mod sequence;
pub mod state;
pub mod stats_log;
pub mod stop;
pub mod structured_fields;
pub mod tokenize_gate;
pub mod tools;
pub mod validate;
pub mod warmup;

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use kiln_engine::structured::{GrammarCompiler, PendingCompiler};
use kiln_engine::{EngineCore, EngineHandle};
use kiln_tokenizer::{GenerationDefaults, Tokenizer};

pub use config::{BaseAdapter, ConnectionLimits, LoraModule, LoraSettings, ServerConfig};
pub use error::ApiError;
pub use state::{Loaded, ServerState};

use crate::chat_template::{BuiltinTemplate, TemplateOverride};
use crate::lora::LoraRegistry;
use crate::metrics::Metrics;
use crate::validate::Limits;

/// A model ready to serve: the engine core that runs it (configured to stop on the
/// tokenizer's end-of-sequence ids), its tokenizer and generation defaults, and the built-in
/// chat template of its family for models that ship none.
pub struct ServedModel {
    pub core: EngineCore,
    pub tokenizer: Tokenizer,
    pub generation_defaults: GenerationDefaults,
    pub builtin_template: Option<BuiltinTemplate>,
    /// A fingerprint of the model's files, which KV transfer peers must share (needed with
    /// `ServerConfig::kv_transfer`).
    pub model_fingerprint: Option<u64>,
}

/// Picks the chat template (`chat_template` first, see
/// [`chat_template::load_chat_template_from`]), starts the engine thread, and returns what the
/// server needs.
pub fn load(
    config: &ServerConfig,
    model: ServedModel,
    chat_template: Option<&TemplateOverride>,
) -> Result<Loaded, String> {
    let ServedModel {
        mut core,
        tokenizer,
        generation_defaults,
        builtin_template,
        model_fingerprint,
    } = model;
    let template =
        chat_template::load_chat_template_from(&tokenizer, chat_template, builtin_template)
            .map_err(|e| format!("chat template: {e}"))?;
    let limits = Limits {
        max_model_len: core.max_model_len(),
        vocab_size: core.model().config().vocab_size,
        max_logprobs: config.max_logprobs,
        max_tokens_default: config.max_tokens_default,
        max_tokens_cap: config.max_tokens_cap,
    };
    // Built in the background: the server answers at once, and the first structured request
    // waits for the vocabulary trie (most of a second for a 262k-token vocabulary).
    // [vocab] what each token decodes to: the tokenize gate's bound and the grammar's trie.
    let token_bytes = tokenizer.token_bytes();
    let tokenize_gate = tokenize_gate::TokenizeGate::new(
        &token_bytes,
        tokenize_gate::TokenizeGate::default_permits(),
    );
    let grammar = if let Some(pending) = core.grammar_compiler() {
        pending.clone()
    } else {
        let (bytes, eos) = (token_bytes, tokenizer.eos_token_ids().to_vec());
        let vocab_size = limits.vocab_size;
        let pending = PendingCompiler::build_in_background(move || {
            GrammarCompiler::new(bytes, vocab_size, &eos).map(Arc::new).map_err(|e| {
                tracing::warn!("structured outputs are unavailable for this model: {e}");
                e.to_string()
            })
        });
        core.set_pending_grammar_compiler(pending.clone());
        pending
    };
    let lora = Arc::new(LoraRegistry::bind_at_load(&config.lora, &mut core)?);
    let block_size = core.scheduler().kv_cache().block_size();
    let (pooling, hidden_size) = (core.pooling(), core.model().config().hidden_size);
    let cross_encoder = core.has_classifier();
    let encoder = core.model().config().encoder.is_some();
    let labels = core.classifier_labels().to_vec();
    let kv_events = start_kv_events(config, &mut core, &lora)?;
    let kv_geometry = prepare_kv_transfer(config, &mut core, model_fingerprint)?;
    let name = config.served_model_names.first().map_or("kiln", String::as_str);
    let metrics =
        Arc::new(Metrics::with_prefix(&config.metrics_prefix, name, limits.max_model_len));
    let observer_metrics = Arc::clone(&metrics);
    let mut last_stats = core.stats();
    let observer_lora = Arc::clone(&lora);
    let max_loras = config.lora.max_loras;
    let mut lora_unreported = !config.lora.modules.is_empty() || config.lora.runtime_updates;
    let engine = EngineHandle::spawn_with_observer(
        core,
        Some(Box::new(move |stats| {
            observer_metrics.on_step(stats);
            if lora_unreported || stats.adapters != last_stats.adapters {
                lora_unreported = false;
                let (running, waiting) = (stats.adapters.running, stats.adapters.waiting);
                let names = |set| observer_lora.names(set);
                observer_metrics.on_lora(&names(running), &names(waiting), max_loras);
            }
            if let Some(line) = metrics::controller_log_line(&last_stats, stats) {
                tracing::info!("{line}");
            }
            last_stats = *stats;
        })),
    )
    .map_err(|e| format!("could not start the engine thread: {e}"))?;
    let kv_transfer = match (&config.kv_transfer, kv_geometry) {
        (Some(transfer), Some(geometry)) => {
            let port = engine.kv_port();
            Some(kv_transfer::KvTransfer::start(transfer, geometry, port, Arc::clone(&metrics))?)
        }
        _ => None,
    };
    Ok(Loaded {
        engine,
        tokenizer: Arc::new(tokenizer),
        template,
        metrics,
        defaults: generation_defaults,
        limits,
        grammar,
        created: routes::unix_now(),
        block_size,
        kv_events,
        kv_transfer,
        tokenize_gate,
        lora,
        pooling,
        hidden_size,
        cross_encoder,
        encoder,
        labels,
    })
}

/// Starts publishing the prefix cache's events, when configured.
fn start_kv_events(
    config: &ServerConfig,
    core: &mut EngineCore,
    lora: &Arc<LoraRegistry>,
) -> Result<Option<kv_events::KvEventPublisher>, String> {
    let Some(events) = &config.kv_events else { return Ok(None) };
    if !core.scheduler().kv_cache().prefix_caching() {
        return Err("KV cache events (--kv-events-config) need the prefix cache; drop \
                    --no-enable-prefix-caching"
            .into());
    }
    let block_size = core.scheduler().kv_cache().block_size();
    let names = Arc::clone(lora);
    let lora_names: kv_events::LoraNames = Arc::new(move |key| names.name_of_key(key));
    let publisher = kv_events::KvEventPublisher::start(events, block_size, lora_names)?;
    tracing::info!("KV cache events published on {}", publisher.endpoint());
    core.set_kv_event_sink(publisher.sink());
    Ok(Some(publisher))
}

/// Readies the engine for `--kv-role`, when given: pins for an exporting role, the prefix
/// cache (which imports land in) for every role; returns the engine's KV geometry.
fn prepare_kv_transfer(
    config: &ServerConfig,
    core: &mut EngineCore,
    model_fingerprint: Option<u64>,
) -> Result<Option<kiln_engine::KvGeometry>, String> {
    let Some(transfer) = &config.kv_transfer else { return Ok(None) };
    let model_fingerprint =
        model_fingerprint.ok_or("--kv-role needs a fingerprint of the model's files")?;
    if !core.scheduler().kv_cache().prefix_caching() {
        return Err("--kv-role needs the prefix cache; drop --no-enable-prefix-caching".into());
    }
    if core.pooling().is_some() {
        return Err("--kv-role is for generative models, not pooling ones".into());
    }
    if matches!(transfer.role, kv_transfer::KvRole::Prefill | kv_transfer::KvRole::Both) {
        core.enable_kv_export(transfer.pin_timeout).map_err(|e| e.to_string())?;
    }
    Ok(Some(core.kv_geometry(model_fingerprint)))
}

/// The routes, behind (outermost first) the HTTP request counts, CORS, the API key (before
/// routing, see [`auth`]) and the checks of a request's head ([`request_limits`]).
pub fn router(state: Arc<ServerState>) -> Router {
    let mut routes = Router::new();
    if state.config.lora.runtime_updates {
        routes = routes
            .route("/v1/load_lora_adapter", post(routes::lora::load_lora_adapter))
            .route("/v1/unload_lora_adapter", post(routes::lora::unload_lora_adapter));
    }
    routes
        .route("/v1/completions", post(routes::completions::completions))
        .route("/v1/chat/completions", post(routes::chat::chat_completions))
        .route("/v1/completions/render", post(routes::render::render_completion))
        .route("/v1/chat/completions/render", post(routes::render::render_chat))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/{id}", get(responses::retrieve).delete(responses::delete))
        .route("/v1/responses/{id}/cancel", post(responses::cancel))
        .route("/v1/embeddings", post(routes::embeddings::embeddings))
        .route("/pooling", post(routes::embeddings::pooling))
        .route("/score", post(routes::score::score))
        .route("/v1/score", post(routes::score::score))
        .route("/rerank", post(routes::score::rerank))
        .route("/v1/rerank", post(routes::score::rerank))
        .route("/v2/rerank", post(routes::score::rerank))
        .route("/classify", post(routes::classify::classify))
        .route("/v1/classify", post(routes::classify::classify))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route(
            "/lora-adapters",
            get(routes::lora::list_base_adapters).post(routes::lora::set_base_adapters),
        )
        .route("/v1/models", get(routes::misc::models))
        .route("/v1/models/{id}", get(routes::misc::model))
        .route("/health", get(routes::misc::health))
        .route("/version", get(routes::misc::version))
        .route("/metrics", get(routes::misc::render_metrics))
        .route("/tokenize", post(routes::misc::tokenize_endpoint))
        .route("/get_server_info", get(routes::misc::server_info))
        .route("/kv_event_sources", get(routes::misc::kv_event_sources))
        .route("/detokenize", post(routes::misc::detokenize_endpoint))
        .fallback(|| async { ApiError::not_found("No such endpoint.").into_response() })
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&state), request_limits::check_head))
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&state), auth::require_api_key))
        .layer(axum::middleware::from_fn(anthropic::shape_errors))
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&state), cors::cors))
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&state), metrics::http::count))
        .with_state(state)
}

/// Serves until `shutdown` resolves, then drains (see the module docs and [`conn`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<ServerState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(Arc::clone(&state));
    conn::serve(listener, app, state, shutdown).await
}
