//! The server's own settings (the engine's are [`kiln_engine::EngineConfig`]).

use std::time::Duration;

#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Names clients may use in `model`; the first is reported by `/v1/models`.
    pub served_model_names: Vec<String>,
    /// Bearer key required on `/v1/*` when set.
    pub api_key: Option<String>,
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
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            served_model_names: vec!["kiln".into()],
            api_key: None,
            max_queued_requests: 1024,
            max_logprobs: 20,
            shutdown_timeout: Duration::from_secs(30),
            disable_log_requests: false,
            max_body_bytes: 4 << 20,
            keep_alive: Duration::from_secs(15),
        }
    }
}
