//! CORS, off by default: without `--allowed-origins` no response carries
//! `Access-Control-Allow-Origin` and a preflight (`OPTIONS` with
//! `Access-Control-Request-Method`) gets 403, so a web page in a browser cannot read kiln's
//! answers, and (with JSON bodies required, see `request_limits`) cannot send a request that
//! skips the preflight. With `--allowed-origins` (vLLM's flag; `*` allows any origin) a listed
//! `Origin` gets its preflight answered (204) and its responses tagged.
//!
//! Invariants: the answer echoes the request's own origin (never a list), with
//! `Vary: Origin`; credentials are not allowed (the API key travels in a header the preflight
//! lets through).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::state::ServerState;

/// Seconds a browser may cache a preflight answer.
const MAX_AGE_SECS: u32 = 600;

fn allowed(origins: &[String], origin: &str) -> bool {
    origins.iter().any(|o| o == "*" || o == origin)
}

fn tag(headers: &mut HeaderMap, origin: HeaderValue) {
    headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    headers.append(header::VARY, HeaderValue::from_static("Origin"));
}

pub async fn cors(State(state): State<Arc<ServerState>>, request: Request, next: Next) -> Response {
    let origins = &state.config.allowed_origins;
    let origin = request.headers().get(header::ORIGIN).cloned();
    let preflight = request.method() == Method::OPTIONS
        && request.headers().contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let permitted =
        origin.as_ref().and_then(|o| o.to_str().ok()).is_some_and(|o| allowed(origins, o));
    if preflight {
        let Some(origin) = origin.filter(|_| permitted) else {
            return ApiError::new(StatusCode::FORBIDDEN, "Cross-origin requests are not allowed.")
                .into_response();
        };
        let mut response = StatusCode::NO_CONTENT.into_response();
        let headers = response.headers_mut();
        tag(headers, origin);
        headers.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        headers.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("authorization, content-type"),
        );
        headers.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from(MAX_AGE_SECS));
        return response;
    }
    let mut response = next.run(request).await;
    if let (true, Some(origin)) = (permitted, origin) {
        tag(response.headers_mut(), origin);
    }
    response
}
