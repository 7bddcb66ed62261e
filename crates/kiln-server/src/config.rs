//! The server's own settings (the engine's are [`kiln_engine::EngineConfig`]).

use std::time::Duration;

#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Names clients may use in `model`; the first is reported by `/v1/models`.
    pub served_model_names: Vec<String>,
    /// Bearer keys accepted on `/v1/*`; none: no key is required.
    pub api_keys: Vec<String>,
    /// Requests admitted but without a first token yet, beyond which new ones get 429.
    pub max_queued_requests: usize,
    /// Most log-probabilities per token (`logprobs`, `top_logprobs`, `prompt_logprobs`).
    pub max_logprobs: usize,
    /// How long SIGTERM / SIGINT waits for in-flight requests before aborting them.
    pub shutdown_timeout: Duration,
    /// No log line per finished request.
    pub disable_log_requests: bool,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// Interval of SSE keep-alive comments while a stream waits for tokens.
    pub keep_alive: Duration,
    /// Prefix of the engine metrics' names (`kiln`; `vllm` gives vLLM's names).
    pub metrics_prefix: String,
    /// Publish the prefix cache's events for routers (`None`: off).
    pub kv_events: Option<crate::kv_events::KvEventsConfig>,
    /// Prefill/decode disaggregation (`--kv-role`; `None`: `kv_transfer_params` refused).
    pub kv_transfer: Option<crate::kv_transfer::KvTransferConfig>,
    /// `max_tokens` of requests that give none (`None`: what is left of the context, vLLM's
    /// default).
    pub max_tokens_default: Option<usize>,
    /// Most tokens one sequence may generate; asking for more is a 400 (`max_tokens`).
    pub max_tokens_cap: Option<usize>,
    /// JSON bodies are parsed whatever their `Content-Type` (otherwise anything but
    /// `application/json` gets 415).
    pub allow_any_content_type: bool,
    /// Origins allowed by CORS (`*` for any); empty: no CORS headers, preflights refused.
    pub allowed_origins: Vec<String>,
    /// Connection limits and timeouts.
    pub connections: ConnectionLimits,
    /// `--tool-call-parser` and `--enable-auto-tool-choice`.
    pub tools: crate::tools::ToolSettings,
    /// `--reasoning-parser`: thinking split from the answer (`None`: it stays in the text).
    pub reasoning_parser: Option<crate::reasoning::ReasoningParser>,
    /// How many responses of `/v1/responses` are kept for `GET` and `previous_response_id`.
    pub responses_store: crate::responses::store::StoreLimits,
    /// `--enable-lora`: the LoRA adapters served beside the base model.
    pub lora: LoraSettings,
}

/// LoRA adapters served by name (`--lora-modules`), each bound to its own slot at load.
#[derive(Clone, Debug)]
pub struct LoraSettings {
    /// In slot order: `modules[i]` runs in slot `i + 1`.
    pub modules: Vec<LoraModule>,
    /// `--max-lora-rank`: adapters of a higher rank are refused at load.
    pub max_rank: usize,
    /// `--max-loras`: most distinct adapters in one step (`None`: no limit).
    pub max_loras: Option<usize>,
    /// `--max-cpu-loras`: most adapters loaded (bound to slots) at once; the others are parked
    /// and loaded again, in place of the least recently used, when a request asks for them
    /// (`None`: every adapter stays loaded).
    pub max_loaded: Option<usize>,
    /// `--lora-dtype`: the precision adapters are kept in (f32 by default).
    pub dtype: kiln_engine::LoraDtype,
    /// `--allow-runtime-lora-updating` (or vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`): serves
    /// `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.
    pub runtime_updates: bool,
    /// llama-server's `--lora` and `--lora-scaled`: adapters applied, summed, to every request
    /// of the base model (bound to the slot after `modules`').
    pub base_adapters: Vec<BaseAdapter>,
}

/// One adapter of llama-server's `--lora FILE` (scale 1) or `--lora-scaled FILE:SCALE`.
#[derive(Clone, Debug, PartialEq)]
pub struct BaseAdapter {
    /// A GGUF LoRA file (or a PEFT adapter directory).
    pub path: std::path::PathBuf,
    pub scale: f32,
}

impl Default for LoraSettings {
    fn default() -> Self {
        // vLLM's default --max-lora-rank.
        Self {
            modules: Vec::new(),
            max_rank: 16,
            max_loras: None,
            max_loaded: None,
            dtype: kiln_engine::LoraDtype::default(),
            runtime_updates: false,
            base_adapters: Vec::new(),
        }
    }
}

/// One adapter of `--lora-modules`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoraModule {
    /// What clients send as `model`.
    pub name: String,
    /// The PEFT adapter directory or GGUF LoRA file.
    pub path: std::path::PathBuf,
    /// The base model it was trained on, as `/v1/models` reports its `parent` (default: the
    /// first served model name).
    pub base_model_name: Option<String>,
}

/// Limits of the HTTP layer against slow, idle or too many clients.
#[derive(Clone, Debug)]
pub struct ConnectionLimits {
    /// Most open client connections; beyond, connections are closed at once (a reserve of
    /// [`Self::reserved_connections`] more may still ask `/health` and `/metrics`).
    pub max_connections: usize,
    /// Extra connections kept for `/health` and `/metrics` once `max_connections` is reached.
    pub reserved_connections: usize,
    /// Time for a request's head: from the connection's start, or from the first byte of a
    /// later request, to the end of its headers.
    pub header_read_timeout: Duration,
    /// Time to receive a whole request body once the headers are in.
    pub body_read_timeout: Duration,
    /// Time a keep-alive connection may stay idle between requests.
    pub idle_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: 512,
            reserved_connections: 16,
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
        }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            served_model_names: vec!["kiln".into()],
            api_keys: Vec::new(),
            max_queued_requests: 1024,
            max_logprobs: 20,
            shutdown_timeout: Duration::from_secs(30),
            disable_log_requests: false,
            max_body_bytes: 4 << 20,
            keep_alive: Duration::from_secs(15),
            max_tokens_default: None,
            max_tokens_cap: None,
            allow_any_content_type: false,
            allowed_origins: Vec::new(),
            connections: ConnectionLimits::default(),
            tools: crate::tools::ToolSettings::default(),
            reasoning_parser: None,
            responses_store: crate::responses::store::StoreLimits::default(),
            metrics_prefix: crate::metrics::DEFAULT_PREFIX.to_owned(),
            kv_events: None,
            kv_transfer: None,
            lora: LoraSettings::default(),
        }
    }
}
