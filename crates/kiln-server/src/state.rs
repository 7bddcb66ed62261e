//! Shared server state: the settings, the loaded model (set once, after start-up loading, so
//! `/health` can answer 503 before it), admission counters and the draining flag.
//!
//! Invariants: `queued` counts sequences submitted whose first token has not arrived (each
//! holds one [`QueueSlot`]); `in_flight` counts live [`crate::sequence::Sequence`]s. Both only
//! change through guards, so they return to 0 whatever way a request ends.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use kiln_engine::EngineHandle;
use kiln_engine::structured::PendingCompiler;
use kiln_tokenizer::{GenerationDefaults, Tokenizer};

use crate::chat_template::ChatTemplate;
use crate::config::ServerConfig;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::metrics::http::HttpMetrics;
use crate::validate::Limits;

/// Everything that exists once the model is loaded.
pub struct Loaded {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub template: ChatTemplate,
    pub metrics: Arc<Metrics>,
    pub defaults: GenerationDefaults,
    pub limits: Limits,
    /// Compiles structured outputs over this model's vocabulary (shared with the engine; built
    /// in the background), or why structured outputs are unavailable.
    pub grammar: PendingCompiler,
    /// Unix seconds when the model became ready (`created` of `/v1/models`).
    pub created: u64,
    /// Tokens per KV block (`kv_block_size` of `/get_server_info`).
    pub block_size: usize,
    /// The KV events publisher (`None`: events off).
    pub kv_events: Option<crate::kv_events::KvEventPublisher>,
    /// Prefill/decode disaggregation (`None`: `kv_transfer_params` refused).
    pub kv_transfer: Option<crate::kv_transfer::KvTransfer>,
    /// Bounds on tokenizing client text (by bytes, and few large texts at once).
    pub tokenize_gate: crate::tokenize_gate::TokenizeGate,
    /// The LoRA adapters served by name.
    pub lora: Arc<crate::lora::LoraRegistry>,
    /// A pooling model's pooler: the server answers /v1/embeddings and /pooling, not
    /// generation (`None`: a generative model).
    pub pooling: Option<kiln_engine::PoolerConfig>,
    /// The model's hidden size (a pooling model's embedding size).
    pub hidden_size: usize,
    /// A cross-encoder: pooling requests give a classifier's score of a text pair (`/score`,
    /// `/rerank`), not an embedding.
    pub cross_encoder: bool,
    /// A sequence classifier's label names, by index (`/classify`); empty for other models.
    pub labels: Vec<String>,
    /// An encoder (BERT, XLM-RoBERTa): `truncate_prompt_tokens` keeps an input's first tokens
    /// and its special tokens, as the tokenizer's right truncation does (an encoder reads its
    /// `[CLS]`); a decoder's keeps the last tokens (vLLM's rule).
    pub encoder: bool,
}

pub struct ServerState {
    pub config: ServerConfig,
    /// `http_requests_total`, counted from the start (before the model is loaded too).
    pub http_metrics: HttpMetrics,
    /// The responses kept by `/v1/responses` (bounded by `config.responses_store`).
    pub responses: crate::responses::store::ResponseStore,
    loaded: OnceLock<Arc<Loaded>>,
    draining: AtomicBool,
    queued: AtomicUsize,
    in_flight: AtomicUsize,
    next_id: AtomicU64,
    id_salt: u64,
    /// Set when the shutdown deadline passes: running responses end at once (streams with a
    /// final `finish_reason: "abort"` chunk and `[DONE]`).
    abort: tokio::sync::watch::Sender<bool>,
}

impl ServerState {
    pub fn new(config: ServerConfig) -> Arc<Self> {
        let salt = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        let responses = crate::responses::store::ResponseStore::new(config.responses_store);
        Arc::new(Self {
            config,
            http_metrics: HttpMetrics::default(),
            responses,
            loaded: OnceLock::new(),
            draining: AtomicBool::new(false),
            queued: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            next_id: AtomicU64::new(0),
            id_salt: salt,
            abort: tokio::sync::watch::Sender::new(false),
        })
    }

    /// Installs the loaded model; `false` if one was installed already.
    pub fn set_loaded(&self, loaded: Loaded) -> bool {
        self.loaded.set(Arc::new(loaded)).is_ok()
    }

    /// [`ServerState::set_loaded`] for a model already shared (warmed up before serving).
    pub fn set_loaded_shared(&self, loaded: Arc<Loaded>) -> bool {
        self.loaded.set(loaded).is_ok()
    }

    pub fn loaded(&self) -> Option<&Arc<Loaded>> {
        self.loaded.get()
    }

    /// Stops the engine thread (after draining) and waits for its shutdown hook, e.g. saving
    /// the prefix cache. Requests submitted later are refused.
    pub fn stop_engine(&self) {
        if let Some(loaded) = self.loaded() {
            loaded.engine.stop();
        }
    }

    /// The loaded model, or 503 while loading and while draining.
    pub fn ready(&self) -> Result<&Arc<Loaded>, ApiError> {
        if self.is_draining() {
            return Err(ApiError::draining());
        }
        self.loaded.get().ok_or_else(|| {
            let mut e = ApiError::new(
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                "The model is still loading.",
            );
            e.retry_after = Some(5);
            e
        })
    }

    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Ends every running response now (the shutdown deadline passed).
    pub fn abort_responses(&self) {
        self.abort.send_replace(true);
    }

    /// Resolves once [`Self::abort_responses`] was called (at once if it was already).
    pub fn aborted(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.abort.subscribe();
        async move {
            let _ = rx.wait_for(|aborted| *aborted).await;
        }
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    pub fn num_in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    pub fn num_queued(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }

    /// A number no other call of this server returns (ids of tool calls).
    pub fn unique(&self) -> u64 {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.id_salt.rotate_left(32) ^ n
    }

    /// A unique response id such as `cmpl-…` or `chatcmpl-…`.
    pub fn response_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:016x}{n:08x}", self.id_salt)
    }

    /// Reserves `count` queue places, or 429 when that would pass `--max-queued-requests`
    /// now; 400 when `count` alone passes it (a request that could never be queued is not
    /// one to retry).
    pub fn reserve(self: &Arc<Self>, count: usize) -> Result<Vec<QueueSlot>, ApiError> {
        let max = self.config.max_queued_requests;
        if count > max {
            return Err(ApiError::bad_param(
                "n",
                format!(
                    "this request needs {count} sequences (prompts × n), more than the server \
                     queues at once ({max}, --max-queued-requests); send fewer prompts or a \
                     smaller n"
                ),
            ));
        }
        self.queued
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |q| {
                (q.saturating_add(count) <= max).then_some(q + count)
            })
            .map_err(|_| ApiError::overloaded(1))?;
        Ok((0..count).map(|_| QueueSlot(Arc::clone(self))).collect())
    }

    pub(crate) fn enter(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(Arc::clone(self))
    }
}

/// One place in the admission queue, released on drop (at the first token, or when the
/// request ends before it).
pub struct QueueSlot(Arc<ServerState>);

impl Drop for QueueSlot {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A live sequence, for draining.
pub struct InFlight(Arc<ServerState>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}
