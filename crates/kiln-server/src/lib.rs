//! kiln's OpenAI-compatible HTTP server: `/v1/completions`, `/v1/chat/completions`,
//! `/v1/models`, `/health`, `/metrics`, `/tokenize`, `/detokenize`, `/version`.
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

pub mod auth;
pub mod chat_template;
pub mod config;
pub mod error;
pub mod extract;
pub mod generate;
pub mod metrics;
pub mod protocol;
pub mod routes;
pub mod sequence;
pub mod state;
pub mod stop;
pub mod validate;

use std::future::{Future, IntoFuture};
use std::path::Path;
use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use kiln_engine::{EngineCore, EngineHandle};
use kiln_tokenizer::{GenerationDefaults, Tokenizer};

pub use config::ServerConfig;
pub use error::ApiError;
pub use state::{Loaded, ServerState};

use crate::chat_template::BuiltinTemplate;
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
}

/// Picks the chat template (`chat_template_file` first, see
/// [`chat_template::load_chat_template`]), starts the engine thread, and returns what the
/// server needs.
pub fn load(
    config: &ServerConfig,
    model: ServedModel,
    chat_template_file: Option<&Path>,
) -> Result<Loaded, String> {
    let ServedModel { core, tokenizer, generation_defaults, builtin_template } = model;
    let template =
        chat_template::load_chat_template(&tokenizer, chat_template_file, builtin_template)
            .map_err(|e| format!("chat template: {e}"))?;
    let limits = Limits {
        max_model_len: core.max_model_len(),
        vocab_size: core.model().config().vocab_size,
        max_logprobs: config.max_logprobs,
    };
    let name = config.served_model_names.first().map_or("kiln", String::as_str);
    let metrics = Arc::new(Metrics::new(name, limits.max_model_len));
    let observer_metrics = Arc::clone(&metrics);
    let engine = EngineHandle::spawn_with_observer(
        core,
        Some(Box::new(move |stats| observer_metrics.on_step(stats))),
    )
    .map_err(|e| format!("could not start the engine thread: {e}"))?;
    Ok(Loaded {
        engine,
        tokenizer: Arc::new(tokenizer),
        template,
        metrics,
        defaults: generation_defaults,
        limits,
        created: routes::unix_now(),
    })
}

/// The routes; `/v1/*` require the API key when one is set.
pub fn router(state: Arc<ServerState>) -> Router {
    let v1 = Router::new()
        .route("/v1/completions", post(routes::completions::completions))
        .route("/v1/chat/completions", post(routes::chat::chat_completions))
        .route("/v1/models", get(routes::misc::models))
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&state), auth::require_api_key));
    Router::new()
        .merge(v1)
        .route("/health", get(routes::misc::health))
        .route("/version", get(routes::misc::version))
        .route("/metrics", get(routes::misc::render_metrics))
        .route("/tokenize", post(routes::misc::tokenize_endpoint))
        .route("/detokenize", post(routes::misc::detokenize_endpoint))
        .fallback(|| async { ApiError::not_found("No such endpoint.").into_response() })
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .with_state(state)
}

/// Serves until `shutdown` resolves, then drains (see the module docs).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<ServerState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(Arc::clone(&state));
    let drain_started = Arc::new(tokio::sync::Notify::new());
    let signal = {
        let state = Arc::clone(&state);
        let drain_started = Arc::clone(&drain_started);
        async move {
            shutdown.await;
            state.start_draining();
            drain_started.notify_one();
        }
    };
    // Streamed chunks are small writes: without TCP_NODELAY, Nagle's algorithm holds each
    // one until the client's delayed ACK (up to 40 ms), which would distort every ITL.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let server = axum::serve(listener, app).with_graceful_shutdown(signal).into_future();
    let mut server = std::pin::pin!(server);
    tokio::select! {
        result = &mut server => return result,
        () = drain_started.notified() => {}
    }
    tracing::info!(
        in_flight = state.num_in_flight(),
        "draining for up to {:?}",
        state.config.shutdown_timeout
    );
    if let Ok(result) = tokio::time::timeout(state.config.shutdown_timeout, &mut server).await {
        return result;
    }
    tracing::warn!(in_flight = state.num_in_flight(), "shutdown timeout: aborting what is left");
    Ok(())
}
