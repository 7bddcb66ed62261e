//! The small endpoints: `/v1/models`, `/health`, `/version`, `/metrics`, `/tokenize`,
//! `/detokenize`.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kiln_core::TokenId;
use serde_json::{Value, json};

use super::chat_input::{render_tokens, template_kwargs, template_messages};
use super::{check_model, model_name, tokenize};
use crate::chat_template::RenderOptions;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::protocol::{DetokenizeRequest, TokenizeRequest};
use crate::state::{Loaded, ServerState};
use crate::tools::{self, ToolSettings};
use crate::validate;

pub async fn models(State(state): State<Arc<ServerState>>) -> Response {
    let loaded = match state.ready() {
        Ok(loaded) => loaded,
        Err(e) => return e.into_response(),
    };
    let names = state.config.served_model_names.iter();
    let adapters: Vec<String> = loaded.lora.cards().into_iter().map(|card| card.name).collect();
    let data: Vec<_> =
        names.chain(&adapters).map(|name| model_card(&state, loaded, name)).collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// `GET /v1/models/{id}`: one served name's card (the SDK's `models.retrieve`); 404 for a
/// name not served.
pub async fn model(
    State(state): State<Arc<ServerState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    let loaded = match state.ready() {
        Ok(loaded) => loaded,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = check_model(&state, Some(&id)) {
        return e.into_response();
    }
    Json(model_card(&state, loaded, &id)).into_response()
}

/// A served name's card; a LoRA adapter's (vLLM's shape) has its directory as `root` and the
/// base model as `parent`.
fn model_card(state: &ServerState, loaded: &Loaded, name: &str) -> Value {
    let adapter = loaded.lora.cards().into_iter().find(|card| card.name == name);
    let (root, parent) = match adapter {
        Some(card) => {
            let parent = card.base_model_name.as_deref().unwrap_or(model_name(state));
            (json!(card.path.display().to_string()), json!(parent))
        }
        None => (json!(model_name(state)), Value::Null),
    };
    json!({
        "id": name,
        "object": "model",
        "created": loaded.created,
        "owned_by": "kiln",
        "root": root,
        "parent": parent,
        "max_model_len": loaded.limits.max_model_len,
    })
}

/// 200 once the model is loaded; 503 before and while draining.
pub async fn health(State(state): State<Arc<ServerState>>) -> Response {
    match state.ready() {
        Ok(_) => StatusCode::OK.into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /get_server_info`: what a router needs to know of this replica to read its KV events
/// (vllm-router's worker discovery): the served model, this replica's id and the KV block size.
pub async fn server_info(State(state): State<Arc<ServerState>>) -> Response {
    let result = state.ready().map(|loaded| {
        let model = state.config.served_model_names.first().cloned().unwrap_or_default();
        Json(json!({
            "model_id": model,
            "kv_block_size": loaded.block_size,
            "max_model_len": loaded.limits.max_model_len,
            "version": env!("CARGO_PKG_VERSION"),
        }))
    });
    result.map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

/// `GET /kv_event_sources`: where this replica publishes its KV cache events, by data-parallel
/// rank (only rank 0); 404 when events are off.
pub async fn kv_event_sources(State(state): State<Arc<ServerState>>) -> Response {
    let result = state.ready().and_then(|loaded| match &loaded.kv_events {
        Some(publisher) => Ok(Json(publisher.sources_json())),
        None => Err(ApiError::not_found("KV cache events are off (see --kv-events-config).")),
    });
    result.map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

pub async fn version() -> Response {
    Json(json!({"version": env!("CARGO_PKG_VERSION")})).into_response()
}

/// The metrics in OpenMetrics when the scraper asks for it, else the Prometheus text format.
pub async fn render_metrics(State(state): State<Arc<ServerState>>, headers: HeaderMap) -> Response {
    match state.loaded() {
        Some(loaded) => {
            let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
            let (content_type, body) =
                loaded.metrics.render_for(accept, &state.http_metrics.render());
            ([(header::CONTENT_TYPE, content_type)], body).into_response()
        }
        None => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

pub async fn tokenize_endpoint(
    State(state): State<Arc<ServerState>>,
    ApiJson(req): ApiJson<TokenizeRequest>,
) -> Response {
    let result = async {
        let loaded = Arc::clone(state.ready()?);
        check_model(&state, req.model.as_deref())?;
        let ids = request_tokens(&loaded, req).await?;
        let tokens: Vec<u32> = ids.iter().map(|t| t.0).collect();
        Ok::<_, ApiError>(Json(json!({
            "count": tokens.len(),
            "max_model_len": loaded.limits.max_model_len,
            "tokens": tokens,
        })))
    }
    .await;
    result.map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

/// The token ids `/tokenize` gives for `req`: a prompt (special tokens added unless told
/// otherwise), or messages through the chat template (with the generation prompt unless told
/// otherwise). Warm-up prompts go through here too.
pub async fn request_tokens(
    loaded: &Arc<Loaded>,
    req: TokenizeRequest,
) -> Result<Vec<TokenId>, ApiError> {
    match (req.prompt, req.messages) {
        (Some(p), None) => {
            let add_special = req.add_special_tokens.unwrap_or(true);
            Ok(tokenize(loaded, vec![p], add_special).await?.pop().unwrap_or_default())
        }
        (None, Some(m)) => {
            let messages = template_messages(m)?;
            let tool_choice = Some(json!("none"));
            let (plan, _) =
                tools::plan(req.tools, tool_choice, None, ToolSettings::default(), None)?;
            let options = RenderOptions {
                add_generation_prompt: req.add_generation_prompt.unwrap_or(true),
                tools: plan.tools,
                kwargs: template_kwargs(req.chat_template_kwargs)?,
            };
            let add_special = req.add_special_tokens.unwrap_or(false);
            render_tokens(loaded, messages, options, add_special).await
        }
        _ => Err(ApiError::bad_request("give exactly one of `prompt` and `messages`")),
    }
}

pub async fn detokenize_endpoint(
    State(state): State<Arc<ServerState>>,
    ApiJson(req): ApiJson<DetokenizeRequest>,
) -> Response {
    let result = (|| {
        let loaded = state.ready()?;
        check_model(&state, req.model.as_deref())?;
        let ids = req
            .tokens
            .iter()
            .map(|&t| validate::vocab_token_id("tokens", t, &loaded.limits).map(|id| id.0))
            .collect::<Result<Vec<u32>, _>>()?;
        let text = loaded
            .tokenizer
            .decode(&ids, false)
            .map_err(|e| ApiError::bad_param("tokens", format!("could not detokenize: {e}")))?;
        Ok::<_, ApiError>(Json(json!({"prompt": text})))
    })();
    result.map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}
