//! HTTP handlers: `/v1/completions`, `/v1/chat/completions`, `/v1/embeddings` and the small
//! endpoints.

pub mod chat;
pub mod chat_input;
pub mod classify;
pub mod completions;
pub mod embeddings;
pub mod format;
pub mod lora;
pub mod misc;
pub mod render;
pub mod score;

use std::sync::Arc;

use kiln_core::TokenId;
use kiln_engine::AdapterBinding;

use crate::error::ApiError;
use crate::lora::AdapterLease;
use crate::state::{Loaded, ServerState};

/// 404 unless `model` (when given) is one of the served names or LoRA adapters.
pub fn check_model(state: &ServerState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if !state.config.served_model_names.iter().any(|n| n == m) => {
            let known = state.loaded().is_some_and(|loaded| loaded.lora.knows(m));
            if known { Ok(()) } else { Err(unknown_model(m)) }
        }
        _ => Ok(()),
    }
}

fn unknown_model(m: &str) -> ApiError {
    let mut e = ApiError::not_found(format!("The model `{m}` does not exist."));
    e.param = Some("model".into());
    e
}

/// The LoRA binding a request runs with, and its hold on the adapter.
#[derive(Debug, Default)]
pub struct ResolvedAdapter {
    pub binding: AdapterBinding,
    /// Keeps a named adapter from being evicted until the request is done with it.
    pub lease: Option<Arc<AdapterLease>>,
}

/// The LoRA adapter `model` asks for: the base model's binding (the default one unless
/// llama-server's `--lora` gave it adapters) for one of its served names or no `model`, a
/// served adapter's binding for its name (loaded into a slot first when it was parked by
/// `--max-cpu-loras`: [`crate::lora::acquire`]); 404 for any other name.
pub async fn resolve_model(
    state: &ServerState,
    model: Option<&str>,
) -> Result<ResolvedAdapter, ApiError> {
    let loaded = state.loaded();
    let base = || ResolvedAdapter {
        binding: loaded.map(|loaded| loaded.lora.base_binding()).unwrap_or_default(),
        lease: None,
    };
    let Some(m) = model else { return Ok(base()) };
    if state.config.served_model_names.iter().any(|n| n == m) {
        return Ok(base());
    }
    let Some(loaded) = loaded else { return Err(unknown_model(m)) };
    match crate::lora::acquire(loaded, m).await? {
        Some(lease) => Ok(ResolvedAdapter { binding: lease.binding, lease: Some(Arc::new(lease)) }),
        None => Err(unknown_model(m)),
    }
}

/// The name reported in responses.
pub fn model_name(state: &ServerState) -> &str {
    state.config.served_model_names.first().map_or("kiln", String::as_str)
}

/// The name reported in the responses of a request run with LoRA slot `adapter`: the
/// adapter's, or the base model's.
pub fn reported_name(state: &ServerState, adapter: u32) -> String {
    let adapter_name = match adapter {
        0 => None,
        slot => state.loaded().and_then(|loaded| loaded.lora.name_of_slot(slot)),
    };
    adapter_name.unwrap_or_else(|| model_name(state).to_owned())
}

/// Tokenizes on a blocking thread (long prompts must not stall the async workers), after
/// refusing a text too long in bytes to fit the context, and under a permit for large texts
/// ([`crate::tokenize_gate`]).
pub async fn tokenize(
    loaded: &Arc<Loaded>,
    texts: Vec<String>,
    add_special_tokens: bool,
) -> Result<Vec<Vec<TokenId>>, ApiError> {
    for text in &texts {
        loaded.tokenize_gate.check_fits(text.len(), loaded.limits.max_model_len)?;
    }
    let bytes = texts.iter().map(String::len).sum();
    tokenize_admitted(loaded, texts, bytes, "prompt", move |t, text: &String| {
        t.encode(text, add_special_tokens)
    })
    .await
}

/// Runs `encode` over `items` (`bytes` of client text in all) on a blocking thread, under the
/// tokenize gate's permit for that many bytes; a failure is a 400 on `param`. The caller
/// bounds the texts' lengths first, or cuts their tokens after.
pub async fn tokenize_admitted<T: Send + 'static>(
    loaded: &Arc<Loaded>,
    items: Vec<T>,
    bytes: usize,
    param: &'static str,
    encode: impl Fn(&kiln_tokenizer::Tokenizer, &T) -> Result<Vec<u32>, String> + Send + 'static,
) -> Result<Vec<Vec<TokenId>>, ApiError> {
    let _permit = loaded.tokenize_gate.admit(bytes).await?;
    let tokenizer = Arc::clone(&loaded.tokenizer);
    tokio::task::spawn_blocking(move || {
        items
            .iter()
            .map(|item| {
                encode(&tokenizer, item)
                    .map(|ids| ids.into_iter().map(TokenId).collect())
                    .map_err(|e| ApiError::bad_param(param, format!("could not tokenize: {e}")))
            })
            .collect()
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
