//! API-key check. With `--api-key` (one key or vLLM's list; any of them is accepted), every
//! endpoint that runs model work needs `Authorization: Bearer KEY` (or `x-api-key: KEY`, as
//! Anthropic's clients send it): all of `/v1/` (checked
//! before routing, so an unknown `/v1/` path is a 401 too, not a 404 that reveals what exists),
//! `/tokenize`, `/detokenize`, `/lora-adapters` (it names files) and vLLM's pooling routes
//! outside `/v1/` (`/pooling`, `/score`, `/rerank`, `/v2/rerank`). `/health`, `/metrics` and
//! `/version` stay open for probes and
//! scrapers. Each key is compared in constant time over its bytes, so timing reveals at most
//! the keys' lengths.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::state::ServerState;

/// Whether `a` equals `b`, in time that depends only on their lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// Whether `path` needs the API key (see the module docs).
pub fn is_protected(path: &str) -> bool {
    path.starts_with("/v1/")
        || path == "/v1"
        || path == "/tokenize"
        || path == "/detokenize"
        || path == "/lora-adapters"
        || path.starts_with("/v2/")
        || ["/pooling", "/score", "/rerank"].contains(&path)
}

pub async fn require_api_key(
    State(state): State<Arc<ServerState>>,
    request: Request,
    next: Next,
) -> Response {
    let keys = &state.config.api_keys;
    if keys.is_empty() {
        return next.run(request).await;
    }
    if !is_protected(request.uri().path()) {
        return next.run(request).await;
    }
    let headers = request.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // Anthropic's clients send the key as `x-api-key`.
    let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
    let presented = bearer.or(x_api_key).map(str::trim);
    match presented {
        Some(p)
            if keys
                .iter()
                .fold(false, |ok, k| ok | constant_time_eq(p.as_bytes(), k.as_bytes())) =>
        {
            next.run(request).await
        }
        _ => ApiError::new(StatusCode::UNAUTHORIZED, "Unauthorized: a valid API key is required.")
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::{constant_time_eq, is_protected};

    #[test]
    fn compares_whole_keys() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
    }

    #[test]
    fn model_work_is_protected_probes_are_not() {
        for p in
            ["/v1/completions", "/v1/nope", "/v1", "/tokenize", "/detokenize", "/lora-adapters"]
                .into_iter()
                .chain(["/pooling", "/score", "/rerank", "/v2/rerank"])
        {
            assert!(is_protected(p), "{p}");
        }
        for p in ["/health", "/metrics", "/version", "/v10/x", "/tokenize2"] {
            assert!(!is_protected(p), "{p}");
        }
    }
}
