//! `POST /v1/completions/render` and `POST /v1/chat/completions/render`: the prompt token ids
//! a completion or chat request would compute, without generating. The request is the same
//! body `/v1/completions` or `/v1/chat/completions` takes and goes through the same validation,
//! tokenization and chat template, and the same length checks (a prompt that leaves no room
//! in the context, or `max_tokens` past it), so the ids are exactly the engine's prompt (and
//! an invalid request gets the same error). Routers use them to place requests by prefix: vLLM's router
//! (`cache_aware` and `kv_aware` policies) calls render on every worker before choosing one,
//! and falls back to `/tokenize` where it is missing.
//!
//! Replies as vLLM's render routes: chat gives `{"token_ids": [...]}`, completions a list with
//! one `{"token_ids": [...]}` per prompt.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use kiln_core::TokenId;
use serde_json::{Value, json};

use super::{chat, completions};
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::protocol::{ChatRequest, CompletionRequest};
use crate::state::ServerState;

fn ids_json(ids: &[TokenId]) -> Value {
    json!({"token_ids": ids.iter().map(|t| t.0).collect::<Vec<u32>>()})
}

pub async fn render_completion(
    State(state): State<Arc<ServerState>>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Response {
    let result = async {
        let loaded = Arc::clone(state.ready()?);
        let prepared = completions::prepare(&state, &loaded, req).await?;
        for ids in &prepared.prompt_ids {
            prepared.spec.for_prompt(ids.len(), 0, &loaded.limits)?;
        }
        let prompts: Vec<Value> = prepared.prompt_ids.iter().map(|ids| ids_json(ids)).collect();
        Ok::<_, ApiError>(Json(Value::Array(prompts)))
    };
    result.await.map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

pub async fn render_chat(
    State(state): State<Arc<ServerState>>,
    ApiJson(req): ApiJson<ChatRequest>,
) -> Response {
    let result = async {
        let loaded = Arc::clone(state.ready()?);
        let prepared = chat::prepare(&state, &loaded, req).await?;
        prepared.spec.for_prompt(prepared.ids.len(), 0, &loaded.limits)?;
        Ok::<_, ApiError>(Json(ids_json(&prepared.ids)))
    };
    result.await.map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}
