//! Anthropic's Messages API: `POST /v1/messages` (whole or streamed) and
//! `POST /v1/messages/count_tokens`, served by translating the request into a chat request
//! ([`request`]) and the chat output back into content blocks ([`reply`]): `thinking` (with
//! `--reasoning-parser`), `text` and `tool_use`.
//!
//! Invariants: a streamed message carries the same blocks as the whole one (both read the
//! output through the same [`crate::reasoning::ReasoningSplit`] and [`crate::tools`] code);
//! every error under `/v1/messages`, whichever layer refuses (API key, body limits, JSON,
//! validation), has Anthropic's shape `{"type": "error", "error": {"type", "message"}}`
//! ([`shape_errors`]).

pub mod reply;
pub mod request;

use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::generate::{Usage, collect_all, start_all};
use crate::routes::chat::{Prepared, prepare};
use crate::sequence::SequenceSpec;
use crate::state::ServerState;
use request::MessagesRequest;

/// Anthropic's error type for an HTTP status.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        500.. => "api_error",
        _ => "invalid_request_error",
    }
}

/// An error body in Anthropic's shape.
pub fn error_body(status: StatusCode, message: &str) -> Value {
    json!({"type": "error", "error": {"type": error_type(status), "message": message}})
}

/// Largest error body [`shape_errors`] rewrites (kiln's are far smaller).
const MAX_ERROR_BODY: usize = 64 * 1024;

/// Rewrites the OpenAI-shaped errors of `/v1/messages` paths into Anthropic's shape.
pub async fn shape_errors(request: Request, next: Next) -> Response {
    let anthropic = request.uri().path().starts_with("/v1/messages");
    let response = next.run(request).await;
    if !anthropic || response.status().is_success() {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_ERROR_BODY).await else {
        return error_response(parts.status, "error body unreadable");
    };
    let message = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned));
    let Some(message) = message else {
        return Response::from_parts(parts, Body::from(bytes));
    };
    let shaped = error_body(parts.status, &message).to_string();
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(shaped))
}

fn error_response(status: StatusCode, message: &str) -> Response {
    (status, Json(error_body(status, message))).into_response()
}

pub async fn messages(
    State(state): State<Arc<ServerState>>,
    ApiJson(req): ApiJson<MessagesRequest>,
) -> Response {
    handle(state, req).await.unwrap_or_else(IntoResponse::into_response)
}

pub async fn count_tokens(
    State(state): State<Arc<ServerState>>,
    ApiJson(req): ApiJson<MessagesRequest>,
) -> Response {
    let count = async {
        let loaded = Arc::clone(state.ready()?);
        let translated = req.translate(true)?;
        let prepared = prepare(&state, &loaded, translated.chat).await?;
        Ok::<_, ApiError>(Json(json!({"input_tokens": prepared.ids.len()})).into_response())
    };
    count.await.unwrap_or_else(IntoResponse::into_response)
}

async fn handle(state: Arc<ServerState>, req: MessagesRequest) -> Result<Response, ApiError> {
    let loaded = Arc::clone(state.ready()?);
    let limits = loaded.limits;
    let translated = req.translate(false)?;
    let Prepared { spec, output, ids, max_tokens, reasoning, compiled, .. } =
        prepare(&state, &loaded, translated.chat).await?;
    let seq_spec = SequenceSpec::new(&spec, &ids, 0, &limits, compiled.as_ref())?;
    let max_tokens = max_tokens.and_then(|m| usize::try_from(m).ok());
    let mut seqs = start_all(&state, &loaded, vec![seq_spec], 1, max_tokens)?;
    let id = state.response_id("msg").replace('-', "_");
    let reader = reply::Reader::new(&state, output, reasoning);
    let model = crate::routes::reported_name(&state, spec.adapter.slot);
    let head = reply::Head { id, model };
    if spec.stream {
        let seq = seqs.pop().ok_or_else(|| ApiError::internal("no sequence started"))?;
        return Ok(reply::stream(seq, &state, head, reader, ids.len()));
    }
    let mut usage = Usage::new(&[ids.len()]);
    let mut results = collect_all(seqs, 1, &mut usage, state.aborted()).await?;
    let result = results.pop().unwrap_or_default();
    Ok(Json(reply::whole(&head, &reader, result, &usage)).into_response())
}
