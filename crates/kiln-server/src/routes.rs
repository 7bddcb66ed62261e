//! HTTP handlers: `/v1/completions`, `/v1/chat/completions` and the small endpoints.

pub mod chat;
pub mod chat_input;
pub mod completions;
pub mod format;
pub mod misc;
pub mod render;

use std::sync::Arc;

use kiln_core::TokenId;

use crate::error::ApiError;
use crate::state::{Loaded, ServerState};

/// 404 unless `model` (when given) is one of the served names.
pub fn check_model(state: &ServerState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if !state.config.served_model_names.iter().any(|n| n == m) => {
            let mut e = ApiError::not_found(format!("The model `{m}` does not exist."));
            e.param = Some("model".into());
            Err(e)
        }
        _ => Ok(()),
    }
}

/// The name reported in responses.
pub fn model_name(state: &ServerState) -> &str {
    state.config.served_model_names.first().map_or("kiln", String::as_str)
}

/// Tokenizes on a blocking thread (long prompts must not stall the async workers), after
/// refusing a text too long in bytes to fit the context, and under a permit for large texts
/// ([`crate::tokenize_gate`]).
pub async fn tokenize(
    loaded: &Arc<Loaded>,
    texts: Vec<String>,
    add_special_tokens: bool,
) -> Result<Vec<Vec<TokenId>>, ApiError> {
    let gate = &loaded.tokenize_gate;
    for text in &texts {
        gate.check_fits(text.len(), loaded.limits.max_model_len)?;
    }
    let _permit = gate.admit(texts.iter().map(String::len).sum()).await?;
    let tokenizer = Arc::clone(&loaded.tokenizer);
    tokio::task::spawn_blocking(move || {
        texts
            .iter()
            .map(|t| {
                tokenizer
                    .encode(t, add_special_tokens)
                    .map(|ids| ids.into_iter().map(TokenId).collect())
                    .map_err(|e| ApiError::bad_param("prompt", format!("could not tokenize: {e}")))
            })
            .collect()
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
